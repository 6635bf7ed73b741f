use super::common::{load_model, ModelArgs, SamplingArgs};
use anyhow::{Context, Result};
use clap::Args;
use ferrite_tokenizer::{Message, StreamDecoder};
use std::io::{BufRead, Write};

#[derive(Args)]
pub struct ChatArgs {
    /// System prompt.
    #[arg(short, long)]
    pub system: Option<String>,
    /// Maximum tokens per reply.
    #[arg(short = 'n', long = "n-predict", default_value_t = 512)]
    pub n_predict: usize,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

pub fn run(args: ChatArgs) -> Result<()> {
    let params = args.sampling.params()?;
    let loaded = load_model(&args.model)?;
    let tok = loaded.tokenizer()?;
    let template = tok.chat_template()?;
    if template.is_none() {
        eprintln!("note: the model has no chat template; using a plain `role: text` layout");
    }
    let mut session = loaded.session(&args.model, args.model.backend, false)?;
    session.warm_up().context("warming up the decode path")?;
    let mut messages: Vec<Message> = args.system.iter().map(|s| Message { role: "system".into(), content: s.clone() }).collect();
    eprintln!("chat with {} — /reset clears the conversation, /exit or Ctrl-D quits", loaded.model.config.name);
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    loop {
        eprint!("> ");
        let Some(line) = lines.next().transpose()? else { break };
        let line = line.trim();
        match line {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                messages.truncate(args.system.is_some() as usize);
                session.reset();
                continue;
            }
            _ => {}
        }
        messages.push(Message { role: "user".into(), content: line.to_string() });
        let render = |messages: &[Message]| -> Result<Vec<u32>> {
            let prompt = match &template {
                Some(t) => t.apply(messages, true)?,
                None => messages.iter().map(|m| format!("{}: {}\n", m.role, m.content)).collect::<String>() + "assistant:",
            };
            Ok(if template.is_some() { tok.encode_chat(&prompt)? } else { tok.encode(&prompt, true)? })
        };
        // Room for a reply of up to a quarter of the context: past that, the oldest exchanges
        // (after the system prompt) are dropped, as llama.cpp's context shift drops old tokens.
        let ctx = session.context_len();
        let reserve = args.n_predict.min(ctx / 4).max(1);
        let first = args.system.is_some() as usize;
        let mut ids = render(&messages)?;
        let mut dropped = 0;
        // Whole exchanges (a user message and its reply), so that the turns still alternate
        // from a user's (some templates insist).
        while ids.len() + reserve > ctx && messages.len() - first > 2 {
            messages.drain(first..first + 2);
            dropped += 1;
            ids = render(&messages)?;
        }
        if dropped > 0 {
            eprintln!("(the {dropped} oldest exchange(s) were dropped to fit the context of {ctx} tokens)");
        }
        if ids.len() + 1 >= ctx {
            eprintln!("this message ({} tokens with the template) does not fit the context of {ctx} tokens; raise --ctx-size", ids.len());
            messages.pop();
            continue;
        }
        let budget = args.n_predict.min(session.context_len() - ids.len());
        let mut reply = String::new();
        let mut dec = StreamDecoder::new(tok);
        let mut out = std::io::stdout().lock();
        let stats = session.generate(&ids, budget, &params, |t| tok.is_end_of_generation(t), |t| {
            let piece = dec.push(t);
            reply.push_str(&piece);
            write!(out, "{piece}").and_then(|_| out.flush()).is_ok()
        })?;
        let rest = dec.finish();
        reply.push_str(&rest);
        writeln!(out, "{rest}")?;
        eprintln!("[{} tokens, {:.1} tok/s]", stats.generated, stats.gen_tps());
        messages.push(Message { role: "assistant".into(), content: reply.trim().to_string() });
    }
    Ok(())
}
