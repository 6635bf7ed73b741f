//! Options shared by the subcommands that load a model, and the loading itself.

use crate::model_path;
use anyhow::{Context, Result};
use clap::Args;
use ferrite_engine::{open_executor, BackendKind, SamplerParams, Session};
use ferrite_model::{ExecutorOptions, FusionOptions, LoadProgress, Model};
use ferrite_tokenizer::Tokenizer;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// GGUF model file [default: the SmolLM2-135M-Instruct model, fetched on first use]
    #[arg(short, long)]
    pub model: Option<PathBuf>,
    /// Backend: cpu (quantized SIMD), cpu-ref (fp32 reference) or cuda.
    #[arg(short, long, default_value = "cpu")]
    pub backend: BackendKind,
    /// CPU threads [default: all cores, or FERRITE_THREADS].
    #[arg(short, long)]
    pub threads: Option<usize>,
    /// Context size in tokens, capped at the model's trained context; 0 takes that context.
    #[arg(short = 'c', long = "ctx-size", default_value_t = 4096)]
    pub ctx_size: usize,
    /// Tokens per forward pass when processing a prompt.
    #[arg(long = "batch-size", default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub batch_size: u64,
}

#[derive(Args, Clone, Debug)]
pub struct SamplingArgs {
    /// Sampling temperature; 0 means greedy.
    #[arg(long = "temp", default_value_t = SamplerParams::DEFAULT.temperature)]
    pub temperature: f32,
    /// Top-k sampling (0 = off).
    #[arg(long, default_value_t = SamplerParams::DEFAULT.top_k)]
    pub top_k: usize,
    /// Top-p (nucleus) sampling (1.0 = off).
    #[arg(long, default_value_t = SamplerParams::DEFAULT.top_p)]
    pub top_p: f32,
    /// Min-p sampling (0 = off).
    #[arg(long, default_value_t = SamplerParams::DEFAULT.min_p)]
    pub min_p: f32,
    /// Repetition penalty (1.0 = off).
    #[arg(long, default_value_t = SamplerParams::DEFAULT.repeat_penalty)]
    pub repeat_penalty: f32,
    /// Tokens the repetition penalty looks back over.
    #[arg(long, default_value_t = SamplerParams::DEFAULT.repeat_last_n)]
    pub repeat_last_n: usize,
    /// RNG seed [default: random].
    #[arg(long)]
    pub seed: Option<u64>,
}

impl SamplingArgs {
    pub fn params(&self) -> Result<SamplerParams> {
        let seed = self.seed.unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
        });
        let p = SamplerParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            seed,
        };
        p.validate().map_err(anyhow::Error::msg)?;
        Ok(p)
    }
}

/// Size the global rayon pool once: --threads, else FERRITE_THREADS, else all cores.
pub fn init_threads(threads: Option<usize>) {
    let n = threads.or_else(|| ferrite_core::env::THREADS.get().and_then(|v| v.parse().ok())).unwrap_or(0);
    // Fails only if the pool already exists, which is harmless.
    let _ = rayon::ThreadPoolBuilder::new().num_threads(n).build_global();
}

pub struct Loaded {
    pub model: Arc<Model>,
    /// The tokenizer, or why the model has none (e.g. a safetensors folder without
    /// tokenizer.json: `info` and `bench` work without one).
    tokenizer: Result<Tokenizer, String>,
}

pub fn load_model(args: &ModelArgs) -> Result<Loaded> {
    init_threads(args.threads);
    let path = model_path::resolve(args.model.as_deref())?;
    let model = Model::load(&path, FusionOptions::from_env()).context("loading the model")?;
    // HF folders carry their tokenizer in tokenizer.json (+ tokenizer_config.json), GGUF files in metadata.
    let tokenizer = if ferrite_model::hf::is_hf_dir(&path) { Tokenizer::from_hf_dir(&path) } else { Tokenizer::from_gguf(&model.file.metadata) }
        .map_err(|e| format!("this model has no usable tokenizer: {e}"));
    for w in tokenizer.iter().flat_map(|t| t.warnings()) {
        eprintln!("warning: {w}");
    }
    Ok(Loaded { model: Arc::new(model), tokenizer })
}

impl Loaded {
    pub fn tokenizer(&self) -> Result<&Tokenizer> {
        self.tokenizer.as_ref().map_err(|e| anyhow::anyhow!("{e}"))
    }

    pub fn executor_options(&self, args: &ModelArgs, trace: bool) -> ExecutorOptions {
        ExecutorOptions {
            max_batch: args.batch_size as usize,
            context_len: match args.ctx_size {
                0 => self.model.config.context_length,
                n => n.min(self.model.config.context_length),
            }
            .max(1),
            trace,
            progress: None,
        }
    }

    /// Instantiate the backend (weight preparation/upload happens here) with a progress bar.
    pub fn session(&self, args: &ModelArgs, backend: BackendKind, trace: bool) -> Result<Session> {
        let bar = indicatif::ProgressBar::new(0);
        bar.set_style(indicatif::ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} weights").expect("valid template"));
        bar.set_message(format!("preparing {} for {backend}", self.model.config.name));
        let mut options = self.executor_options(args, trace);
        let b = bar.clone();
        options.progress = Some(LoadProgress(Arc::new(move |done, total| {
            b.set_length(total as u64);
            b.set_position(done as u64 + 1);
        })));
        let t = Instant::now();
        let exec = open_executor(Arc::clone(&self.model), backend, options);
        bar.finish_and_clear();
        let exec = exec.with_context(|| format!("starting the {backend} backend"))?;
        eprintln!("backend: {} (ready in {:.2} s)", exec.describe(), t.elapsed().as_secs_f64());
        Ok(Session::new(exec))
    }
}
