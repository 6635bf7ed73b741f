//! Chat templates: the Jinja template a model ships in `tokenizer.chat_template`, rendered the way
//! transformers' `apply_chat_template` does (trim_blocks + lstrip_blocks, Python string methods,
//! `raise_exception`, `bos_token`/`eos_token`, `add_generation_prompt`).

use crate::TokenizerError;
use minijinja::{context, Environment, Error, ErrorKind};
use serde::Serialize;

const TEMPLATE_NAME: &str = "chat_template";

/// One turn of a conversation (`role` is usually "system", "user" or "assistant").
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

fn template_error(error: Error) -> TokenizerError {
    // minijinja's alternate form adds the template line and source context.
    TokenizerError::Template(format!("{error:#}"))
}

impl ChatTemplate {
    /// Compiles `template`; `bos`/`eos` are the texts templates see as `bos_token`/`eos_token`.
    pub fn new(template: &str, bos: &str, eos: &str) -> Result<Self, TokenizerError> {
        let mut env = Environment::new();
        // Jinja settings transformers uses for chat templates.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<String, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        // Llama 3.1-style templates stamp today's date with Python's strftime.
        env.add_function("strftime_now", |format: String| -> Result<String, Error> {
            use std::fmt::Write;
            let mut out = String::new();
            write!(out, "{}", chrono::Local::now().format(&format))
                .map_err(|_| Error::new(ErrorKind::InvalidOperation, format!("bad strftime format {format:?}")))?;
            Ok(out)
        });
        env.add_template_owned(TEMPLATE_NAME, template.to_string())
            .map_err(template_error)?;
        Ok(Self {
            env,
            bos_token: bos.to_string(),
            eos_token: eos.to_string(),
        })
    }

    /// Renders the conversation; with `add_generation_prompt` the text ends where the assistant's
    /// reply should begin.
    pub fn apply(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(template_error)?;
        template
            .render(context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(template_error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_trimmed_like_transformers() {
        let template = "{% for m in messages %}\n  {% if m.role == 'user' %}\n[{{ m.content }}]\n  {% endif %}\n{% endfor %}";
        let chat = ChatTemplate::new(template, "", "").unwrap();
        let out = chat
            .apply(
                &[Message::new("user", "a"), Message::new("assistant", "b")],
                false,
            )
            .unwrap();
        assert_eq!(out, "[a]\n");
    }

    #[test]
    fn python_string_methods_and_special_token_variables_work() {
        let template = "{{ bos_token }}{% for m in messages %}{{ m.content.strip().upper() }}{% endfor %}{% if add_generation_prompt %}{{ eos_token }}{% endif %}";
        let chat = ChatTemplate::new(template, "<s>", "</s>").unwrap();
        assert_eq!(
            chat.apply(&[Message::new("user", "  hi ")], true).unwrap(),
            "<s>HI</s>"
        );
        assert_eq!(
            chat.apply(&[Message::new("user", "x")], false).unwrap(),
            "<s>X"
        );
    }

    #[test]
    fn tojson_is_available() {
        let chat = ChatTemplate::new("{{ messages[0] | tojson }}", "", "").unwrap();
        let out = chat.apply(&[Message::new("user", "a\"b")], false).unwrap();
        assert_eq!(out, r#"{"role":"user","content":"a\"b"}"#);
    }

    #[test]
    fn strftime_now_renders_the_date_and_rejects_bad_formats() {
        let t = ChatTemplate::new("{{ strftime_now('%Y') }}", "", "").unwrap();
        let year: i32 = t.apply(&[], false).unwrap().parse().unwrap();
        assert!(year >= 2024);
        let bad = ChatTemplate::new("{{ strftime_now('%Q') }}", "", "").unwrap();
        assert!(bad.apply(&[], false).is_err());
    }

    #[test]
    fn raise_exception_becomes_an_error_with_its_message() {
        let template = "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}ok";
        let chat = ChatTemplate::new(template, "", "").unwrap();
        let err = chat
            .apply(&[Message::new("assistant", "x")], false)
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("first message must be from the user"),
            "{err}"
        );
        assert_eq!(
            chat.apply(&[Message::new("user", "x")], false).unwrap(),
            "ok"
        );
    }

    #[test]
    fn a_syntax_error_is_reported_at_construction() {
        let err = ChatTemplate::new("{% for m in messages %}", "", "").unwrap_err();
        assert!(err.to_string().starts_with("chat template:"), "{err}");
    }
}
