//! `ferrite serve`: the OpenAI-compatible HTTP server.

use super::common::{load_model, ModelArgs};
use crate::model_path;
use anyhow::{bail, Context, Result};
use clap::Args;
use ferrite_engine::EngineConfig;
use ferrite_server::ServeOptions;
use std::sync::Arc;

#[derive(Args)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 picks a free one).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on /v1/* [default: FERRITE_API_KEY, else no key].
    #[arg(long)]
    pub api_key: Option<String>,
    /// Memory for the paged KV cache (e.g. 512MiB, 2GiB, 1000000000).
    #[arg(long, default_value = "1GiB")]
    pub kv_memory: String,
    /// Positions per KV block.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub block_size: u64,
    /// Most sequences decoding together.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub max_seqs: u64,
    /// Most requests waiting for a place in the batch; more get 429.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// Tokens per engine step over all sequences: long prompts are prefilled in chunks within it,
    /// so it bounds how long a prefill stalls the others' decoding (64 tokens already run the CPU
    /// matmuls at full efficiency).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub max_batch_tokens: u64,
    /// Turn the prefix cache off (every prompt is computed in full).
    #[arg(long)]
    pub no_prefix_cache: bool,
    /// Models with recurrent layers (Qwen3.5, Qwen3-Next): sequence states the prefix cache
    /// keeps, each a whole recurrent state (memory printed at start); 0 turns their prefix
    /// cache off.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(0..=4096))]
    pub state_snapshots: u64,
    /// Models with recurrent layers: tokens between two kept states of a sequence (a multiple of
    /// --block-size): a cached prefix is reused up to the last such point in it, and prefill
    /// chunks end there (the default matches --max-batch-tokens' default, so chunks are not
    /// cut shorter).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    pub snapshot_stride: u64,
    /// Model id reported by /v1/models and expected in requests [default: the model file name].
    #[arg(long)]
    pub model_id: Option<String>,
    #[command(flatten)]
    pub model: ModelArgs,
}

/// `512MiB`, `2GiB`, `1.5G`, `300MB`, `1000000`: binary units for Ki/Mi/Gi and K/M/G.
pub fn parse_size(s: &str) -> Result<usize> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num.parse().with_context(|| format!("`{s}` is not a size (like 512MiB or 2GiB)"))?;
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" | "kib" => 1024.0,
        "m" | "mb" | "mib" => 1024.0 * 1024.0,
        "g" | "gb" | "gib" => 1024.0 * 1024.0 * 1024.0,
        other => bail!("unknown size unit `{other}` in `{s}` (use KiB, MiB or GiB)"),
    };
    let bytes = v * mult;
    if !bytes.is_finite() || bytes < 1.0 || bytes > usize::MAX as f64 {
        bail!("size `{s}` is out of range");
    }
    Ok(bytes as usize)
}

pub fn run(args: ServeArgs) -> Result<()> {
    let kv_bytes = parse_size(&args.kv_memory).context("--kv-memory")?;
    let api_key = args.api_key.clone().or_else(|| ferrite_core::env::API_KEY.get());
    let path = model_path::resolve(args.model.model.as_deref())?;
    let model_id = args.model_id.clone().unwrap_or_else(|| {
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into());
        name.strip_suffix(".gguf").map(str::to_string).unwrap_or(name)
    });
    let mut margs = args.model.clone();
    margs.model = Some(path);
    let loaded = load_model(&margs)?;
    let executor = loaded.executor_options(&margs, false);
    let block_size = args.block_size as usize;
    let graph = &loaded.model.graph;
    // f32 K and V of the attention layers (a backend with an f16 cache gets twice the blocks'
    // worth of memory to spare); Gated DeltaNet layers keep a recurrent state per sequence instead.
    let per_position = graph.attention_layers().len() * 2 * loaded.model.config.kv_width() * 4;
    // A cached prefix holds K/V blocks but not the recurrent state after it: that takes snapshots.
    let recurrent = graph.has_recurrent_state();
    let snapshots = if recurrent { args.state_snapshots as usize } else { 0 };
    if recurrent && !args.no_prefix_cache && snapshots == 0 {
        eprintln!("note: prefix cache off: this model's Gated DeltaNet layers carry a recurrent state that cached KV blocks cannot restore, and --state-snapshots is 0");
    }
    if snapshots > 0 && !(args.snapshot_stride as usize).is_multiple_of(block_size) {
        bail!("--snapshot-stride ({}) must be a multiple of --block-size ({block_size})", args.snapshot_stride);
    }
    let engine = EngineConfig {
        block_size,
        n_blocks: EngineConfig::blocks_for_memory(kv_bytes, per_position, block_size),
        max_seqs: args.max_seqs as usize,
        max_batch_tokens: args.max_batch_tokens as usize,
        max_queue: args.max_queue,
        max_context: executor.context_len,
        prefix_cache: !args.no_prefix_cache && (!recurrent || snapshots > 0),
        state_snapshots: snapshots,
        snapshot_stride: args.snapshot_stride as usize,
    };
    let opts = ServeOptions { backend: margs.backend, executor, engine: engine.clone(), api_key, model_id: model_id.clone() };
    let (state, engine_thread) = ferrite_server::start_engine(Arc::clone(&loaded.model), &opts).with_context(|| format!("starting the {} backend for serving", margs.backend))?;
    eprintln!("backend: {}", state.engine.describe());
    eprintln!(
        "kv cache: {} blocks of {} positions ({:.0} MiB, {} tokens); up to {} sequences, {} tokens per step, context {}{}",
        engine.n_blocks,
        engine.block_size,
        (engine.n_blocks * engine.block_size * per_position) as f64 / 1048576.0,
        engine.n_blocks * engine.block_size,
        engine.max_seqs,
        engine.max_batch_tokens,
        engine.max_context,
        if engine.prefix_cache { ", prefix cache on" } else { "" }
    );
    if recurrent {
        let per_seq = graph.recurrent_state_floats() as f64 * 4.0 / 1048576.0;
        eprintln!("recurrent state: {:.1} MiB ({} sequences x {per_seq:.2} MiB, besides --kv-memory)", per_seq * engine.max_seqs as f64, engine.max_seqs);
        if engine.prefix_cache {
            eprintln!(
                "prefix cache state snapshots: {:.1} MiB ({} x {per_seq:.2} MiB, one every {} tokens of a sequence)",
                per_seq * snapshots as f64,
                snapshots,
                engine.snapshot_stride
            );
        }
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().context("starting the async runtime")?;
    let served: Result<()> = runtime.block_on(async move {
        let addr = format!("{}:{}", args.host, args.port);
        let listener = tokio::net::TcpListener::bind(&addr).await.with_context(|| format!("cannot listen on {addr}"))?;
        let local = listener.local_addr()?;
        eprintln!("serving `{model_id}` on http://{local} (OpenAI API under /v1; /health, /metrics){}", if state.api_key.is_some() { "; API key required" } else { "" });
        ferrite_server::serve(listener, Arc::new(state), shutdown_signal()).await.context("server error")?;
        Ok(())
    });
    // Dropping the runtime drops the last engine handles; the engine thread then ends.
    drop(runtime);
    if engine_thread.join().is_err() {
        bail!("the engine thread panicked");
    }
    served?;
    eprintln!("all requests finished; bye");
    Ok(())
}

/// Resolves on Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                eprintln!("warning: cannot watch SIGTERM ({e}); stop with Ctrl-C");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    eprintln!("shutting down: no new connections; finishing the requests in flight");
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("2G").unwrap(), 2 << 30);
        assert_eq!(parse_size("1.5 GiB").unwrap(), 3 << 29);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        for bad in ["", "abc", "12XB", "-1G", "0"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }
}
