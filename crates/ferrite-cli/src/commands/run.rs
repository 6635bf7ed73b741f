use super::common::{load_model, ModelArgs, SamplingArgs};
use anyhow::{bail, Context, Result};
use clap::Args;
use ferrite_tokenizer::{Message, StreamDecoder};
use std::io::Write;

#[derive(Args)]
pub struct RunArgs {
    /// The prompt.
    pub prompt: String,
    /// Maximum number of tokens to generate.
    #[arg(short = 'n', long = "n-predict", default_value_t = 128)]
    pub n_predict: usize,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// Do not echo the prompt before the continuation.
    #[arg(long)]
    pub no_echo: bool,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

pub fn run(args: RunArgs) -> Result<()> {
    let params = args.sampling.params()?;
    let loaded = load_model(&args.model)?;
    let tok = loaded.tokenizer()?;
    let ids = if args.chat {
        let tmpl = tok.chat_template()?.ok_or_else(|| anyhow::anyhow!("--chat: this model has no chat template"))?;
        tok.encode_chat(&tmpl.apply(&[Message { role: "user".into(), content: args.prompt.clone() }], true)?)?
    } else {
        tok.encode(&args.prompt, true)?
    };
    if ids.is_empty() {
        bail!("the prompt is empty after tokenization");
    }
    let mut session = loaded.session(&args.model, args.model.backend, false)?;
    if ids.len() >= session.context_len() {
        bail!("the prompt has {} tokens but the context holds {} (raise --ctx-size)", ids.len(), session.context_len());
    }
    session.warm_up().context("warming up the decode path")?;
    let mut out = std::io::stdout().lock();
    if !args.no_echo {
        write!(out, "{}", args.prompt)?;
        out.flush()?;
    }
    let mut dec = StreamDecoder::new(tok);
    let stats = session.generate(&ids, args.n_predict, &params, |t| tok.is_end_of_generation(t), |t| {
        let piece = dec.push(t);
        write!(out, "{piece}").and_then(|_| out.flush()).is_ok()
    })?;
    writeln!(out, "{}", dec.finish())?;
    eprintln!(
        "\nprompt: {} tokens, {:.1} tok/s | generated: {} tokens, {:.1} tok/s | stop: {:?}",
        stats.prompt_tokens,
        stats.prompt_tps(),
        stats.generated,
        stats.gen_tps(),
        stats.stop
    );
    Ok(())
}
