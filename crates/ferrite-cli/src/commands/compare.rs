use super::common::{load_model, ModelArgs};
use anyhow::{bail, Result};
use clap::Args;
use ferrite_engine::{BackendKind, SamplerParams};

#[derive(Args)]
pub struct CompareArgs {
    /// Prompt to run on both backends.
    #[arg(default_value = "The capital of France is")]
    pub prompt: String,
    /// Token ids to run instead of the prompt (comma separated; for models without a tokenizer).
    #[arg(long, value_delimiter = ',')]
    pub ids: Vec<u32>,
    /// The reference backend.
    #[arg(long = "ref", default_value = "cpu-ref")]
    pub reference: BackendKind,
    /// Greedy tokens to generate on both and compare.
    #[arg(long, default_value_t = 32)]
    pub steps: usize,
    /// GPU compute precision: f32 (f32 KV cache, GEMM and GEMV activations: the paths that match
    /// the fp32 CPU oracle) or f16 (f16 KV cache and GEMM, int8 GEMV activations). Shorthand for
    /// FERRITE_CUDA_KV_DTYPE, FERRITE_CUDA_GEMM_PRECISION and FERRITE_CUDA_GEMV_ACTIVATIONS.
    #[arg(long, value_parser = ["f32", "f16"])]
    pub gpu_precision: Option<String>,
    /// The backend under test is --backend.
    #[command(flatten)]
    pub model: ModelArgs,
}

fn max_abs_and_rel(a: &[f32], b: &[f32]) -> (f32, f64) {
    let mut max_abs = 0f32;
    let (mut num, mut den) = (0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        max_abs = max_abs.max((x - y).abs());
        num += ((x - y) as f64).powi(2);
        den += (x as f64).powi(2);
    }
    if a.iter().chain(b).any(|v| v.is_nan()) {
        return (f32::NAN, f64::NAN);
    }
    (max_abs, (num / den.max(1e-30)).sqrt())
}

pub fn run(args: CompareArgs) -> Result<()> {
    if let Some(p) = &args.gpu_precision {
        // Set before any backend exists; both switches are read when the GPU executor is created.
        std::env::set_var(ferrite_core::env::CUDA_KV_DTYPE.name, p);
        std::env::set_var(ferrite_core::env::CUDA_GEMM_PRECISION.name, p);
        let activations = if p == "f32" { "f32" } else { "q8" };
        std::env::set_var(ferrite_core::env::CUDA_GEMV_ACTIVATIONS.name, activations);
    }
    let loaded = load_model(&args.model)?;
    let ids = if args.ids.is_empty() { loaded.tokenizer()?.encode(&args.prompt, true)? } else { args.ids.clone() };
    if ids.is_empty() {
        bail!("empty prompt");
    }
    let mut sessions = Vec::new();
    for kind in [args.reference, args.model.backend] {
        sessions.push(loaded.session(&args.model, kind, true)?);
    }
    let mut traces = Vec::new();
    for s in &mut sessions {
        s.prefill(&ids)?;
        traces.push(s.executor().traces()?);
    }
    println!("prompt: {} tokens; {} vs {} (reference)", ids.len(), args.model.backend, args.reference);
    println!("{:<16} {:>12} {:>12}", "value", "max |diff|", "rel error");
    let mut worst = 0f64;
    for (a, b) in traces[0].iter().zip(&traces[1]) {
        let (abs, rel) = max_abs_and_rel(&a.data, &b.data);
        worst = if rel.is_nan() { f64::NAN } else { worst.max(rel) };
        println!("{:<16} {:>12.3e} {:>12.3e}", a.name, abs, rel);
    }
    let mut gen = Vec::new();
    for s in &mut sessions {
        let mut toks = Vec::new();
        s.generate(&ids, args.steps, &SamplerParams::greedy(), |_| false, |t| {
            toks.push(t);
            true
        })?;
        gen.push(toks);
    }
    let agree = gen[0].iter().zip(&gen[1]).take_while(|(a, b)| a == b).count();
    println!("\ngreedy tokens ({}): {:?}", args.reference, gen[0]);
    println!("greedy tokens ({}): {:?}", args.model.backend, gen[1]);
    println!("first {agree} of {} greedy tokens agree; worst relative error {worst:.3e}", args.steps);
    Ok(())
}
