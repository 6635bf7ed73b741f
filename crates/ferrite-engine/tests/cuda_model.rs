//! The whole model on CUDA against the fp32 CPU reference, in one process, on synthetic models
//! with real shapes (written by `ferrite_model::synth`). Skipped with a message without a GPU.

mod common;

// Skip notes go straight to stderr, past the test harness capture, so CI logs show them.
use std::io::Write as _;
use common::diff;
use ferrite_cpu::{CpuExecutor, CpuPrecision};
use ferrite_engine::sampling::argmax;
use ferrite_gguf::GgmlType;
use ferrite_model::synth::{self, SynthShape};
use ferrite_model::{Executor, ExecutorOptions, FusionOptions, Model};
use std::sync::Arc;

fn gpu_or_skip() -> bool {
    match ferrite_cuda::cuda_available() {
        Ok(()) => true,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "skipped: {e}");
            false
        }
    }
}

fn synthetic(shape: &SynthShape, dtype: GgmlType) -> Arc<Model> {
    let path = synth::write_temp(shape, dtype, 3).unwrap();
    Arc::new(Model::load(&path, FusionOptions::from_env()).unwrap())
}

fn opts(max_batch: usize) -> ExecutorOptions {
    ExecutorOptions { max_batch, context_len: 256, trace: true, progress: None }
}

/// Prompt of the comparisons: 21 tokens (two prefill chunks of `opts(16)`).
const PROMPT: usize = 21;

/// Prefill a prompt (two chunks), then decode `steps` greedy tokens on both executors, feeding
/// the reference's choice to both. Returns (worst relative logit error, steps whose argmax agreed
/// or differed only at a near-tie).
fn compare(model: Arc<Model>, steps: usize) -> (f64, usize) {
    let cpu = CpuExecutor::new(Arc::clone(&model), CpuPrecision::Reference, opts(16)).unwrap();
    let gpu = ferrite_cuda::CudaExecutor::new(Arc::clone(&model), opts(16)).unwrap();
    compare_executors(&model, cpu, gpu, PROMPT, steps)
}

/// `compare` for any pair: `cpu` is the reference whose greedy choices are fed to both.
fn compare_executors(
    model: &Model,
    mut cpu: impl Executor,
    mut gpu: impl Executor,
    prompt_len: usize,
    steps: usize,
) -> (f64, usize) {
    let prompt: Vec<u32> = (0..prompt_len as u32).map(|i| (i * 977 + 5) % model.config.vocab_size as u32).collect();
    let mut worst = 0f64;
    let mut pos = 0;
    let mut tokens = prompt.clone();
    let mut agreed = 0;
    for step in 0..=steps {
        let new = if step == 0 { &tokens[..] } else { &tokens[tokens.len() - 1..] };
        cpu.forward(new, pos).unwrap();
        gpu.forward(new, pos).unwrap();
        pos += new.len();
        if step == 0 {
            for (a, b) in cpu.traces().unwrap().iter().zip(gpu.traces().unwrap()) {
                let (abs, rel) = diff(&a.data, &b.data);
                println!("  {:<12} max|diff| {abs:.2e} rel {rel:.2e}", a.name);
                worst = worst.max(rel);
            }
        }
        let (lc, lg) = (cpu.logits().unwrap(), gpu.logits().unwrap());
        let (_, rel) = diff(&lc, &lg);
        worst = worst.max(rel);
        let (tc, tg) = (argmax(&lc), argmax(&lg));
        if tc == tg || (lc[tc as usize] - lc[tg as usize]).abs() < 1e-3 * lc[tc as usize].abs().max(1.0) {
            agreed += 1;
        }
        tokens.push(tc);
    }
    (worst, agreed)
}

#[test]
fn cuda_fp32_matches_cpu_reference_on_real_shapes() {
    if !gpu_or_skip() {
        return;
    }
    // fp32 KV, fp32 GEMM and f32-activation GEMV: the GPU must match the CPU oracle to 1e-4
    // relative.
    std::env::set_var("FERRITE_CUDA_KV_DTYPE", "f32");
    std::env::set_var("FERRITE_CUDA_GEMM_PRECISION", "f32");
    std::env::set_var("FERRITE_CUDA_GEMV_ACTIVATIONS", "f32");
    for (shape, dtype) in [("smollm2-135m", GgmlType::Q4_1), ("smollm2-135m", GgmlType::Q8_0), ("llama-3.2-1b", GgmlType::Q4_0)] {
        println!("{shape} {dtype}:");
        let (worst, agreed) = compare(synthetic(synth::shape(shape).unwrap(), dtype), 64);
        println!("{shape} {dtype}: worst relative error {worst:.2e}, {agreed}/65 greedy steps agree");
        assert!(worst < 1e-4, "{shape} {dtype}: relative error {worst}");
        assert_eq!(agreed, 65, "{shape} {dtype}: greedy tokens differ");
    }
    // Qwen3 (QK-norm) on the tiny transformers-checked fixture.
    let qwen3 = common::workspace_root().join("fixtures/tiny/qwen3.gguf");
    let (worst, agreed) = compare(Arc::new(Model::load(qwen3, FusionOptions::from_env()).unwrap()), 32);
    println!("tiny qwen3: worst relative error {worst:.2e}, {agreed}/33 greedy steps agree");
    assert!(worst < 1e-4 && agreed == 33, "tiny qwen3: relative error {worst}, {agreed}/33 agree");
    // Gemma 3 (sliding window 4 over a 53-token run, two RoPE bases, GeGLU, post-norms, scaled
    // embeddings) on its tiny fixture, and on its real shape.
    let gemma3 = common::workspace_root().join("fixtures/tiny/gemma3.gguf");
    let (worst, agreed) = compare(Arc::new(Model::load(gemma3, FusionOptions::from_env()).unwrap()), 32);
    println!("tiny gemma3: worst relative error {worst:.2e}, {agreed}/33 greedy steps agree");
    assert!(worst < 1e-4 && agreed == 33, "tiny gemma3: relative error {worst}, {agreed}/33 agree");
    let (worst, agreed) = compare(synthetic(synth::shape("gemma3-270m").unwrap(), GgmlType::Q8_0), 16);
    println!("gemma3-270m Q8_0: worst relative error {worst:.2e}, {agreed}/17 greedy steps agree");
    assert!(worst < 1e-4 && agreed == 17, "gemma3-270m: relative error {worst}, {agreed}/17 agree");
    // Long caches take split-KV decode attention (more than 256 positions): a 530-token prompt,
    // then decode, against the CPU oracle.
    let model = synthetic(synth::shape("smollm2-135m").unwrap(), GgmlType::Q8_0);
    let long = ExecutorOptions { context_len: 1024, ..opts(64) };
    let cpu = CpuExecutor::new(Arc::clone(&model), CpuPrecision::Reference, long.clone()).unwrap();
    let gpu = ferrite_cuda::CudaExecutor::new(Arc::clone(&model), long).unwrap();
    let (worst, agreed) = compare_executors(&model, cpu, gpu, 530, 24);
    println!("split-KV attention, 530-token prompt: worst relative error {worst:.2e}, {agreed}/25 greedy steps agree");
    assert!(worst < 1e-4 && agreed == 25, "split attention: relative error {worst}, {agreed}/25 agree");
    // The default int8-activation GEMV quantizes activations like the CPU quantized path (int8
    // blocks, d = max/127, round half to even): against the fp32 reference it may drift no more
    // than that CPU path does, and the greedy tokens must agree.
    std::env::set_var("FERRITE_CUDA_GEMV_ACTIVATIONS", "q8");
    for (shape, dtype) in [("smollm2-135m", GgmlType::Q4_1), ("llama-3.2-1b", GgmlType::Q4_0), ("smollm2-135m", GgmlType::Q8_0)] {
        let model = synthetic(synth::shape(shape).unwrap(), dtype);
        let reference = || CpuExecutor::new(Arc::clone(&model), CpuPrecision::Reference, opts(16)).unwrap();
        let cpu_q8 = CpuExecutor::new(Arc::clone(&model), CpuPrecision::Quantized, opts(16)).unwrap();
        let (cpu_worst, cpu_agreed) = compare_executors(&model, reference(), cpu_q8, PROMPT, 64);
        let (worst, agreed) = compare(Arc::clone(&model), 64);
        println!(
            "{shape} {dtype} vs fp32 reference: CUDA q8 GEMV worst relative error {worst:.2e}, {agreed}/65 agree; \
             CPU quantized {cpu_worst:.2e}, {cpu_agreed}/65 agree"
        );
        assert!(worst <= 1.5 * cpu_worst, "{shape} {dtype}: relative error {worst}, the CPU quantized path has {cpu_worst}");
        assert_eq!(agreed, 65, "{shape} {dtype}: greedy tokens differ from the fp32 reference");
    }
    // The default f16 KV cache: small drift, same greedy tokens. (One test, because the
    // switches are process-wide.)
    std::env::set_var("FERRITE_CUDA_KV_DTYPE", "f16");
    std::env::set_var("FERRITE_CUDA_GEMV_ACTIVATIONS", "f32");
    let (worst, agreed) = compare(synthetic(synth::shape("smollm2-135m").unwrap(), GgmlType::Q4_1), 64);
    println!("f16 KV: worst relative error {worst:.2e}, {agreed}/65 greedy steps agree");
    assert!(worst < 1e-2, "relative error {worst}");
    assert!(agreed >= 60, "only {agreed}/65 greedy steps agree");

    std::env::remove_var("FERRITE_CUDA_GEMV_ACTIVATIONS");

    // Decode-step graph replay runs the same kernels on the same buffers: bit-identical logits
    // to launching every op, at every position.
    let model = synthetic(synth::shape("smollm2-135m").unwrap(), GgmlType::Q4_1);
    let run = |disable_graph: &str| {
        std::env::set_var("FERRITE_DISABLE_CUDA_GRAPH", disable_graph);
        let mut gpu = ferrite_cuda::CudaExecutor::new(Arc::clone(&model), opts(16)).unwrap();
        let mut all = Vec::new();
        gpu.forward(&[11, 22, 33], 0).unwrap();
        for pos in 3..20 {
            gpu.forward(&[(pos * 131 % 49152) as u32], pos).unwrap();
            all.extend(gpu.logits().unwrap().into_iter().map(f32::to_bits));
        }
        all
    };
    let (replayed, eager) = (run("0"), run("1"));
    std::env::remove_var("FERRITE_DISABLE_CUDA_GRAPH");
    assert!(replayed == eager, "graph replay changes the logits");
    println!("decode graph replay: bit-identical logits over 17 steps");
}
