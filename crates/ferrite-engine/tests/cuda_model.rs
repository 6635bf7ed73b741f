//! The whole model on CUDA against the fp32 CPU reference, in one process, on synthetic models
//! with real shapes (written by `ferrite_model::synth`). Skipped with a message without a GPU.

mod common;

// Skip notes go straight to stderr, past the test harness capture, so CI logs show them.
use std::io::Write as _;
use common::diff;
use ferrite_cpu::{CpuExecutor, CpuPrecision};
use ferrite_engine::sampling::argmax;
use ferrite_gguf::GgmlType;
use ferrite_model::synth::{self, SynthGdn, SynthMoe, SynthShape};
use ferrite_model::{AheadSeq, DeviceSampling, Executor, ExecutorOptions, FusionOptions, Model, PagedKvConfig, PagedOutput, SeqChunk};
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

/// A small Qwen3.5 hybrid with real head dimensions (Gated DeltaNet heads of 128, attention heads
/// of 256, partial RoPE on 64): three Gated DeltaNet layers, then one gated attention layer.
const QWEN35_SMALL: SynthShape = SynthShape {
    name: "qwen3.5-small",
    arch: "qwen35",
    n_layers: 4,
    n_embd: 256,
    n_heads: 4,
    n_kv_heads: 2,
    head_dim: 256,
    n_ff: 512,
    rope_theta: 1e7,
    context_length: 256,
    tied_embeddings: false,
    gdn: Some(SynthGdn { n_k_heads: 2, n_v_heads: 4, k_dim: 128, v_dim: 128 }),
    moe: None,
};

/// A small Qwen3.5-MoE: the hybrid above with a MoE FFN in every layer (16 experts of 256, top 4,
/// split gate/up banks, a shared expert of 512).
const QWEN35MOE_SMALL: SynthShape = SynthShape {
    name: "qwen3.5-moe-small",
    arch: "qwen35moe",
    n_ff: 512,
    moe: Some(SynthMoe { n_experts: 16, top_k: 4, n_ff_exp: 256, n_ff_shexp: 512, fused_gate_up: false }),
    ..QWEN35_SMALL
};

/// The same with every expert used by every token (top 4 of 4, a fused gate/up bank): routing
/// is then a weighting without choices, so quantized activations cannot flip an expert in or out
/// (a flip is a legitimate, discontinuous difference between any two numerics; the op tests
/// check choosing subsets on the int8 path).
const QWEN35MOE_ALL_EXPERTS: SynthShape = SynthShape {
    name: "qwen3.5-moe-all-experts",
    moe: Some(SynthMoe { n_experts: 4, top_k: 4, n_ff_exp: 256, n_ff_shexp: 256, fused_gate_up: true }),
    ..QWEN35MOE_SMALL
};

/// A small Llama whose widths are whole 128-column chunks (the warpgroup-MMA GEMM's rows), so
/// that 33-64-token batches take the GLU epilogue and the staged hand-off.
const LLAMA_SMALL: SynthShape = SynthShape {
    name: "llama-small",
    arch: "llama",
    n_layers: 2,
    n_embd: 256,
    n_heads: 4,
    n_kv_heads: 2,
    head_dim: 64,
    n_ff: 512,
    rope_theta: 1e4,
    context_length: 256,
    tied_embeddings: true,
    gdn: None,
    moe: None,
};

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

/// `compare` with an untraced GPU executor: launches that leave values unwritten (fused MLPs,
/// the head's hand-off past the copy of the last row) run only in untraced forwards, so only
/// the logits are compared.
fn compare_untraced(model: Arc<Model>, steps: usize) -> (f64, usize) {
    let cpu = CpuExecutor::new(Arc::clone(&model), CpuPrecision::Reference, opts(16)).unwrap();
    let gpu = ferrite_cuda::CudaExecutor::new(Arc::clone(&model), ExecutorOptions { trace: false, ..opts(16) }).unwrap();
    compare_executors(&model, cpu, gpu, PROMPT, steps)
}

/// `compare` for any pair: `cpu` is the reference whose greedy choices are fed to both (their
/// traces of the prompt compared too when both keep them).
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
            // An untraced executor (compare_untraced) keeps no traces; a traced one must.
            match gpu.traces() {
                Ok(gpu_traces) => {
                    for (a, b) in cpu.traces().unwrap().iter().zip(gpu_traces) {
                        let (abs, rel) = diff(&a.data, &b.data);
                        println!("  {:<12} max|diff| {abs:.2e} rel {rel:.2e}", a.name);
                        worst = worst.max(rel);
                    }
                }
                Err(e) => assert!(e.to_string().contains("without tracing"), "{e:#}"),
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

/// Batched serving: CUDA `forward_paged` against the CPU reference's, three sequences of
/// different prompt lengths (`lens`) prefilling and decoding together on scrambled blocks (in
/// state slots 0, 1, 2: models with Gated DeltaNet layers carry a state per sequence), each fed
/// the reference's greedy choice, after the GPU's serving warm-up. From the third step on,
/// sequence 1 takes its greedy token from the device (`forward_paged_sampled`) instead of its
/// logits. Returns (worst relative logit error, agreeing choices, choices).
fn compare_paged(model: &Arc<Model>, lens: [usize; 3]) -> (f64, usize, usize) {
    const BLOCK: usize = 16;
    // Six steps: at most five tokens past the prompt.
    let per_seq: Vec<usize> = lens.iter().map(|l| (l + 5).div_ceil(BLOCK)).collect();
    // One spare block, and one more where 7 would divide the count (the order below).
    let n_blocks = per_seq.iter().sum::<usize>() + 1;
    let n_blocks = if n_blocks.is_multiple_of(7) { n_blocks + 1 } else { n_blocks };
    let max_tokens = lens.iter().sum::<usize>().max(64);
    let config = PagedKvConfig { n_blocks, block_size: BLOCK, max_seqs: 4, max_tokens, state_snapshots: 0 };
    let mut cpu = CpuExecutor::new(Arc::clone(model), CpuPrecision::Reference, opts(16)).unwrap();
    let mut gpu = ferrite_cuda::CudaExecutor::new(Arc::clone(model), opts(16)).unwrap();
    cpu.init_paged(config).unwrap();
    gpu.init_paged(config).unwrap();
    // The warm-up leaves garbage in the blocks used below: no sequence may see it.
    gpu.warm_up_paged().unwrap();
    let vocab = model.config.vocab_size as u32;
    // Blocks handed out in a scrambled order (a permutation: 7 is coprime to the count).
    let order: Vec<u32> = (0..n_blocks).map(|i| ((i * 7 + 3) % n_blocks) as u32).collect();
    assert!(!n_blocks.is_multiple_of(7), "the block order must be a permutation");
    let tables: Vec<&[u32]> = per_seq.iter().scan(0, |at, &n| {
        *at += n;
        Some(&order[*at - n..*at])
    }).collect();
    let mut tokens: Vec<Vec<u32>> =
        lens.iter().enumerate().map(|(i, &l)| (0..l as u32).map(|t| (t * 977 + 31 * i as u32 + 5) % vocab).collect()).collect();
    let mut pos = [0usize; 3];
    let (mut worst, mut agreed, mut total) = (0f64, 0, 0);
    let greedy = DeviceSampling::GREEDY;
    for (step, members) in [&[0][..], &[0, 1, 2], &[0, 1, 2], &[1, 2], &[0, 2], &[0, 1, 2]].into_iter().enumerate() {
        let (want, got) = {
            let batch: Vec<SeqChunk> =
                members.iter().map(|&i| SeqChunk { tokens: &tokens[i][pos[i]..], start_pos: pos[i], block_table: tables[i], state_slot: i }).collect();
            let sample: Vec<Option<DeviceSampling>> = members.iter().map(|&i| (step >= 2 && i == 1).then_some(greedy)).collect();
            (cpu.forward_paged(&batch).unwrap(), gpu.forward_paged_sampled(&batch, &sample).unwrap())
        };
        for (k, &i) in members.iter().enumerate() {
            let lc = &want[k];
            let tc = argmax(lc);
            let tg = match &got[k] {
                PagedOutput::Logits(lg) => {
                    worst = worst.max(diff(lc, lg).1);
                    argmax(lg)
                }
                PagedOutput::Token(t) => {
                    assert!(step >= 2 && i == 1, "step {step}: sequence {i} was not to be sampled on the device");
                    *t
                }
            };
            if tc == tg || (lc[tc as usize] - lc[tg as usize]).abs() < 1e-3 * lc[tc as usize].abs().max(1.0) {
                agreed += 1;
            }
            total += 1;
            pos[i] = tokens[i].len();
            tokens[i].push(tc);
        }
    }
    (worst, agreed, total)
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
    // Decode attention on caches over 256 positions, split-KV (the default: the fused K/V store
    // in shares of separate blocks) and one block per query: a 530-token prompt, then decode,
    // against the CPU oracle. The third run takes the grouped decode layout from 512 keys on
    // (8 shares of 64 keys of 64 values: FERRITE_CUDA_ATTENTION_GROUP_SHARE_VALUES), so every
    // decode step does.
    for (split, share_values) in [("1", None), ("0", None), ("1", Some("4096"))] {
        std::env::set_var("FERRITE_SPLIT_ATTENTION", split);
        if let Some(values) = share_values {
            std::env::set_var("FERRITE_CUDA_ATTENTION_GROUP_SHARE_VALUES", values);
        }
        let model = synthetic(synth::shape("smollm2-135m").unwrap(), GgmlType::Q8_0);
        let long = ExecutorOptions { context_len: 1024, ..opts(64) };
        let cpu = CpuExecutor::new(Arc::clone(&model), CpuPrecision::Reference, long.clone()).unwrap();
        let gpu = ferrite_cuda::CudaExecutor::new(Arc::clone(&model), long).unwrap();
        let (worst, agreed) = compare_executors(&model, cpu, gpu, 530, 24);
        println!("FERRITE_SPLIT_ATTENTION={split}, group share values {share_values:?}, 530-token prompt: worst relative error {worst:.2e}, {agreed}/25 greedy steps agree");
        assert!(worst < 1e-4 && agreed == 25, "split attention {split}, group share values {share_values:?}: relative error {worst}, {agreed}/25 agree");
    }
    std::env::remove_var("FERRITE_SPLIT_ATTENTION");
    std::env::remove_var("FERRITE_CUDA_ATTENTION_GROUP_SHARE_VALUES");
    // Batched serving on the paged cache: three sequences prefilling and decoding together.
    // Then hybrids (a Gated DeltaNet state per sequence slot), the last with a prompt long
    // enough for the chunked mixer beside the others' recurrent one.
    let fixture = |name: &str| Arc::new(Model::load(common::workspace_root().join("fixtures/tiny").join(name), FusionOptions::from_env()).unwrap());
    let short = [5, 23, 12];
    for (name, model, lens) in [
        ("smollm2-135m Q8_0", synthetic(synth::shape("smollm2-135m").unwrap(), GgmlType::Q8_0), short),
        ("tiny qwen3", fixture("qwen3.gguf"), short),
        ("tiny qwen35", fixture("qwen35.gguf"), short),
        ("qwen3.5-small Q8_0", synthetic(&QWEN35_SMALL, GgmlType::Q8_0), short),
        ("tiny qwen3next", fixture("qwen3next.gguf"), [5, 150, 12]),
    ] {
        let (worst, agreed, total) = compare_paged(&model, lens);
        println!("{name}, batched paged steps, prompts of {lens:?}: worst relative error {worst:.2e}, {agreed}/{total} greedy choices agree");
        assert!(worst < 1e-4 && agreed == total, "{name} paged: relative error {worst}, {agreed}/{total} agree");
    }
    // Qwen3.5 hybrid (Gated DeltaNet state carried across the 16 + 5 prompt chunks and every
    // decode step; gated attention with partial RoPE) on its tiny transformers-checked fixture
    // (key/value heads of 16/12), and with real head dimensions.
    let qwen35 = common::workspace_root().join("fixtures/tiny/qwen35.gguf");
    let (worst, agreed) = compare(Arc::new(Model::load(qwen35, FusionOptions::from_env()).unwrap()), 32);
    println!("tiny qwen35: worst relative error {worst:.2e}, {agreed}/33 greedy steps agree");
    assert!(worst < 1e-4 && agreed == 33, "tiny qwen35: relative error {worst}, {agreed}/33 agree");
    let (worst, agreed) = compare(synthetic(&QWEN35_SMALL, GgmlType::Q8_0), 32);
    println!("qwen3.5-small Q8_0: worst relative error {worst:.2e}, {agreed}/33 greedy steps agree");
    assert!(worst < 1e-4 && agreed == 33, "qwen3.5-small: relative error {worst}, {agreed}/33 agree");
    // Qwen3.5-MoE (routing, the routed experts' GEMVs, the gated shared expert) on its tiny
    // transformers-checked fixture (4 experts, top 2, f32 banks split into gate and up: the f32
    // expert GEMVs), and with quantized banks (the f32-activation GEMVs on them here).
    let qwen35moe = common::workspace_root().join("fixtures/tiny/qwen35moe.gguf");
    let (worst, agreed) = compare(Arc::new(Model::load(qwen35moe, FusionOptions::from_env()).unwrap()), 32);
    println!("tiny qwen35moe: worst relative error {worst:.2e}, {agreed}/33 greedy steps agree");
    assert!(worst < 1e-4 && agreed == 33, "tiny qwen35moe: relative error {worst}, {agreed}/33 agree");
    for (shape, dtype) in [(&QWEN35MOE_SMALL, GgmlType::Q8_0), (&QWEN35MOE_ALL_EXPERTS, GgmlType::Q4_K)] {
        let (worst, agreed) = compare(synthetic(shape, dtype), 32);
        println!("{} {dtype}: worst relative error {worst:.2e}, {agreed}/33 greedy steps agree", shape.name);
        assert!(worst < 1e-4 && agreed == 33, "{} {dtype}: relative error {worst}, {agreed}/33 agree", shape.name);
    }
    // Qwen3-Next (the Qwen3.5-MoE hybrid with GDN value heads in grouped order, projections
    // de-interleaved at load, `norm_topk_prob`) on its tiny transformers-checked fixture; then
    // its grouped heads on the chunked path too: a 300-token prompt in batches of 256 and 44.
    let qwen3next = Arc::new(Model::load(common::workspace_root().join("fixtures/tiny/qwen3next.gguf"), FusionOptions::from_env()).unwrap());
    let (worst, agreed) = compare(Arc::clone(&qwen3next), 32);
    println!("tiny qwen3next: worst relative error {worst:.2e}, {agreed}/33 greedy steps agree");
    assert!(worst < 1e-4 && agreed == 33, "tiny qwen3next: relative error {worst}, {agreed}/33 agree");
    let long = ExecutorOptions { context_len: 512, ..opts(256) };
    let cpu = CpuExecutor::new(Arc::clone(&qwen3next), CpuPrecision::Reference, long.clone()).unwrap();
    let gpu = ferrite_cuda::CudaExecutor::new(Arc::clone(&qwen3next), long).unwrap();
    let (worst, agreed) = compare_executors(&qwen3next, cpu, gpu, 300, 16);
    println!("tiny qwen3next, chunked GDN prefill of 300 tokens: worst relative error {worst:.2e}, {agreed}/17 greedy steps agree");
    assert!(worst < 1e-3 && agreed == 17, "tiny qwen3next chunked GDN prefill: relative error {worst}, {agreed}/17 agree");
    // Chunked Gated DeltaNet prefill: a 300-token prompt in batches of 256 (chunked path) and
    // 44 (recurrent), then decode from the state they left.
    let model = synthetic(&QWEN35_SMALL, GgmlType::Q8_0);
    let long = ExecutorOptions { context_len: 512, ..opts(256) };
    let cpu = CpuExecutor::new(Arc::clone(&model), CpuPrecision::Reference, long.clone()).unwrap();
    let gpu = ferrite_cuda::CudaExecutor::new(Arc::clone(&model), long).unwrap();
    let (worst, agreed) = compare_executors(&model, cpu, gpu, 300, 16);
    println!("qwen3.5-small Q8_0, chunked GDN prefill of 300 tokens: worst relative error {worst:.2e}, {agreed}/17 greedy steps agree");
    assert!(worst < 1e-3 && agreed == 17, "chunked GDN prefill: relative error {worst}, {agreed}/17 agree");
    // The default int8-activation GEMV quantizes activations like the CPU quantized path (int8
    // blocks, d = max/127, round half to even): against the fp32 reference it may drift no more
    // than that CPU path does, and the greedy tokens must agree.
    std::env::set_var("FERRITE_CUDA_GEMV_ACTIVATIONS", "q8");
    // Untraced one-token steps hand the last layer's output to the output head in int8 and
    // skip the copy of the last row: the logits stay as close to the fp32 reference as the CPU's
    // quantized path, and every declared hand-off runs (without the fused MLP, on by default,
    // which drops two per layer: below), but those whose producer spreads its rows instead
    // (the 1B shape's down projections on a GPU of 128+ SMs, unless
    // FERRITE_DISABLE_CUDA_SPREAD_ROWS=1; the next QKV quantizes the f32 row).
    std::env::set_var("FERRITE_CUDA_FUSED_MLP", "0");
    for (shape, dtype) in [("smollm2-135m", GgmlType::Q4_1), ("llama-3.2-1b", GgmlType::Q4_0)] {
        let model = synthetic(synth::shape(shape).unwrap(), dtype);
        let reference = CpuExecutor::new(Arc::clone(&model), CpuPrecision::Reference, opts(16)).unwrap();
        let cpu_q8 = CpuExecutor::new(Arc::clone(&model), CpuPrecision::Quantized, opts(16)).unwrap();
        let (cpu_worst, _) = compare_executors(&model, reference, cpu_q8, PROMPT, 64);
        let (worst, agreed) = compare_untraced(Arc::clone(&model), 64);
        println!("{shape} {dtype} untraced vs fp32 reference: worst relative error {worst:.2e}, {agreed}/65 agree; CPU quantized {cpu_worst:.2e}");
        assert!(worst <= 1.5 * cpu_worst && agreed == 65, "{shape} {dtype} untraced: relative error {worst}, {agreed}/65 agree");
        let mut gpu = ferrite_cuda::CudaExecutor::new(Arc::clone(&model), ExecutorOptions { trace: false, ..opts(16) }).unwrap();
        gpu.forward(&[5, 7, 11], 0).unwrap();
        assert_eq!(gpu.handoffs_run().1, 0, "{shape} {dtype}: a three-token forward skipped the copy of its last row");
        gpu.forward(&[13], 3).unwrap();
        let spread = gpu.f32_rows_in();
        println!("{shape} {dtype}: {spread} hand-offs gave way to spread f32 rows");
        assert_eq!(gpu.handoffs_run(), (model.graph.handoffs.len() - spread, 1), "{shape} {dtype}: hand-offs of a one-token step");
        assert!(spread == 0 || shape == "llama-3.2-1b", "{shape} {dtype}: {spread} spread rows");
    }
    // The MLP as one launch adding into the stream (FERRITE_CUDA_FUSED_MLP=1): every SmolLM2
    // layer but the last (whose output feeds the head through a copy) runs it in untraced
    // one-token steps, whose logits stay as close to the fp32 reference as the CPU's quantized
    // path; its two hand-offs per layer do not run. (Larger shapes are refused for their atomic
    // adds; the op test covers the kernel on them.)
    std::env::set_var("FERRITE_CUDA_FUSED_MLP", "1");
    for (shape, dtype) in [("smollm2-135m", GgmlType::Q4_1), ("smollm2-135m", GgmlType::Q8_0)] {
        let model = synthetic(synth::shape(shape).unwrap(), dtype);
        let layers = model.graph.layers.len();
        let reference = CpuExecutor::new(Arc::clone(&model), CpuPrecision::Reference, opts(16)).unwrap();
        let cpu_q8 = CpuExecutor::new(Arc::clone(&model), CpuPrecision::Quantized, opts(16)).unwrap();
        let (cpu_worst, _) = compare_executors(&model, reference, cpu_q8, PROMPT, 64);
        let (worst, agreed) = compare_untraced(Arc::clone(&model), 64);
        println!("{shape} {dtype} fused MLPs vs fp32 reference: worst relative error {worst:.2e}, {agreed}/65 agree; CPU quantized {cpu_worst:.2e}");
        assert!(worst <= 1.5 * cpu_worst && agreed == 65, "{shape} {dtype} fused MLPs: relative error {worst}, {agreed}/65 agree");
        let mut gpu = ferrite_cuda::CudaExecutor::new(Arc::clone(&model), ExecutorOptions { trace: false, ..opts(16) }).unwrap();
        assert_eq!(gpu.mlps_run(), layers - 1, "{shape} {dtype}: fused MLPs planned at load");
        gpu.forward(&[5, 7, 11], 0).unwrap();
        gpu.forward(&[13], 3).unwrap();
        assert_eq!(gpu.handoffs_run().0, model.graph.handoffs.len() - 2 * (layers - 1), "{shape} {dtype}: hand-offs of a one-token step with fused MLPs");
    }
    std::env::remove_var("FERRITE_CUDA_FUSED_MLP");
    // The default path's drift and greedy tokens against the fp32 reference, beside the CPU's
    // quantized path.
    let named = |name| synth::shape(name).unwrap();
    for (shape, dtype) in
        [(named("smollm2-135m"), GgmlType::Q4_1), (named("llama-3.2-1b"), GgmlType::Q4_0), (named("smollm2-135m"), GgmlType::Q8_0), (&QWEN35_SMALL, GgmlType::Q8_0), (&QWEN35MOE_ALL_EXPERTS, GgmlType::Q4_K)]
    {
        let (model, shape) = (synthetic(shape, dtype), shape.name);
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
    // to launching every op, at every position; with recurrent state too, which the replayed
    // graph updates in place (and a forward at position 0 resets before the replay), and with
    // MoE layers, whose experts come from device memory.
    for model in [
        synthetic(synth::shape("smollm2-135m").unwrap(), GgmlType::Q4_1),
        synthetic(&QWEN35_SMALL, GgmlType::Q8_0),
        synthetic(&QWEN35MOE_SMALL, GgmlType::Q4_K),
    ] {
        let run = |disable_graph: &str| {
            std::env::set_var("FERRITE_DISABLE_CUDA_GRAPH", disable_graph);
            let mut gpu = ferrite_cuda::CudaExecutor::new(Arc::clone(&model), opts(16)).unwrap();
            let mut all = Vec::new();
            gpu.forward(&[11, 22, 33], 0).unwrap();
            for pos in 3..20 {
                gpu.forward(&[(pos * 131 % 49152) as u32], pos).unwrap();
                all.extend(gpu.logits().unwrap().into_iter().map(f32::to_bits));
            }
            gpu.forward(&[44], 0).unwrap();
            all.extend(gpu.logits().unwrap().into_iter().map(f32::to_bits));
            all
        };
        let (replayed, eager) = (run("0"), run("1"));
        std::env::remove_var("FERRITE_DISABLE_CUDA_GRAPH");
        assert!(replayed == eager, "{}: graph replay changes the logits", model.config.arch.name());
    }
    println!("decode graph replay: bit-identical logits over 17 steps and a restart, with and without recurrent state, with MoE layers");
    batch_graph_replay_matches_eager();
    recurrent_state_positions();
    decode_ahead_matches_step_by_step();
    batched_decode_ahead_matches_step_by_step();
    staged_handoff_matches_f32_rows();
    decode_attention_stages_match();
}

/// One-token steps through every decode-attention stage of a 4-head model (`DecodeLayouts`:
/// short up to 128 keys, wide blocks of 16 warps from 129 to 512, short and split again past
/// them), each replayed from its own decode graph: logits bit-identical to launching every op,
/// and the wide stage's those of the split launch (`FERRITE_CUDA_ATTENTION_WARPS=4`) up to the
/// order of the float sums. Untraced, as `ferrite run` steps, but with the MLP as two launches:
/// the fused MLP's atomic adds into the residual stream arrive in any order, so its logits' last
/// bits vary from run to run (`FERRITE_CUDA_FUSED_MLP`). One batch of keys a warp of a wide
/// block (`FERRITE_CUDA_ATTENTION_WIDE_BATCHES=1`: up to 512 keys), so that the steps also cross
/// from the wide stage back to the split one; then the default two batches (up to 1 024 keys:
/// a warp's second batch from 513 keys on) and wide blocks as clusters of two per head
/// (`FERRITE_CUDA_ATTENTION_WIDE_CLUSTER=2`, sm_90) against the split launch too.
fn decode_attention_stages_match() {
    let shape = SynthShape { name: "llama-small-1k", context_length: 1024, ..LLAMA_SMALL };
    let model = synthetic(&shape, GgmlType::Q8_0);
    let (prompt, last) = (120usize, 540usize);
    std::env::set_var("FERRITE_CUDA_FUSED_MLP", "0");
    let run_clustered = |disable_graph: &str, warps: &str, batches: &str, cluster: &str| {
        std::env::set_var("FERRITE_DISABLE_CUDA_GRAPH", disable_graph);
        std::env::set_var("FERRITE_CUDA_ATTENTION_WARPS", warps);
        std::env::set_var("FERRITE_CUDA_ATTENTION_WIDE_BATCHES", batches);
        std::env::set_var("FERRITE_CUDA_ATTENTION_WIDE_CLUSTER", cluster);
        let opts = ExecutorOptions { max_batch: 16, context_len: 1024, trace: false, progress: None };
        let mut gpu = ferrite_cuda::CudaExecutor::new(Arc::clone(&model), opts).unwrap();
        let ids: Vec<u32> = (0..prompt).map(|t| ((t * 389 + 1) % 49152) as u32).collect();
        for (i, chunk) in ids.chunks(16).enumerate() {
            gpu.forward(chunk, 16 * i).unwrap();
        }
        (prompt..last)
            .map(|pos| {
                gpu.forward(&[(pos * 131 % 49152) as u32], pos).unwrap();
                gpu.logits().unwrap()
            })
            .collect::<Vec<Vec<f32>>>()
    };
    let run = |disable_graph: &str, warps: &str, batches: &str| run_clustered(disable_graph, warps, batches, "1");
    let (replayed, eager, split, two_batches) = (run("0", "16", "1"), run("1", "16", "1"), run("0", "4", "1"), run("0", "16", "2"));
    let sm90 = ferrite_cuda::Gpu::new(0).is_ok_and(|g| g.supports_clusters());
    let clustered = if sm90 { run_clustered("0", "16", "1", "2") } else { Vec::new() };
    for name in [
        "FERRITE_DISABLE_CUDA_GRAPH",
        "FERRITE_CUDA_ATTENTION_WARPS",
        "FERRITE_CUDA_FUSED_MLP",
        "FERRITE_CUDA_ATTENTION_WIDE_BATCHES",
        "FERRITE_CUDA_ATTENTION_WIDE_CLUSTER",
    ] {
        std::env::remove_var(name);
    }
    let same_bits = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    if let Some(i) = replayed.iter().zip(&eager).position(|(r, e)| !same_bits(r, e)) {
        panic!("decode stages: graph replay changes the logits at position {}", prompt + i);
    }
    for (wide, what) in [(&replayed, "one batch a warp"), (&two_batches, "two batches a warp"), (&clustered, "clusters of two")] {
        for (i, (wide, split)) in wide.iter().zip(&split).enumerate() {
            let scale = split.iter().fold(1f32, |m, x| m.max(x.abs()));
            let worst = wide.iter().zip(split).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(worst <= 1e-3 * scale, "position {}: wide blocks ({what}) and the split launch differ by {worst} (logits up to {scale})", prompt + i);
        }
    }
    println!(
        "decode attention stages: positions {prompt}-{} replayed bit-identical to eager launches, wide blocks of one and two batches a warp{} as the split launch",
        last - 1,
        if sm90 { " and in clusters" } else { "" }
    );
}

/// Staged 16-bit hand-offs (the default) against f32 rows converted by their consumer
/// (`FERRITE_DISABLE_CUDA_STAGED_HANDOFF=1`): the same logits bit for bit, with the staged paths
/// really taken. Without resident bf16 copies the GLU GEMM writes the down projection's input
/// (the warpgroup-MMA GEMMs); with them attention writes the output projection's (cuBLAS). On
/// prompts of 40 and 64 tokens (once per layer and forward), then two batched steps of 40
/// one-token sequences (the paged attention kernel).
fn staged_handoff_matches_f32_rows() {
    let model = synthetic(&LLAMA_SMALL, GgmlType::Q4_0);
    // The bf16 GEMMs: the checks before this one leave f32 set.
    let precision = std::env::var("FERRITE_CUDA_GEMM_PRECISION").ok();
    std::env::set_var("FERRITE_CUDA_GEMM_PRECISION", "bf16");
    let run = |disable: &str| {
        std::env::set_var("FERRITE_DISABLE_CUDA_STAGED_HANDOFF", disable);
        // Without traces: a traced run keeps every f32 value, so it stages nothing.
        let mut gpu = ferrite_cuda::CudaExecutor::new(Arc::clone(&model), ExecutorOptions { trace: false, ..opts(64) }).unwrap();
        let mut bits = Vec::new();
        for (start, len) in [(0usize, 40usize), (40, 64)] {
            let ids: Vec<u32> = (start..start + len).map(|p| (p * 613 + 7) as u32 % 49152).collect();
            gpu.forward(&ids, start).unwrap();
            let logits = gpu.logits().unwrap();
            assert!(logits.iter().all(|v| v.is_finite()), "non-finite logits");
            bits.extend(logits.into_iter().map(f32::to_bits));
        }
        let prompts = gpu.staged_handoffs_run();
        gpu.init_paged(PagedKvConfig { n_blocks: 48, block_size: 16, max_seqs: 40, max_tokens: 64, state_snapshots: 0 }).unwrap();
        let tables: Vec<[u32; 1]> = (0..40u32).map(|s| [s]).collect();
        for pos in 0..2usize {
            let tokens: Vec<[u32; 1]> = (0..40usize).map(|s| [((s * 389 + pos * 17 + 1) % 49152) as u32]).collect();
            let batch: Vec<SeqChunk> = tokens.iter().zip(&tables).enumerate().map(|(s, (t, b))| SeqChunk { tokens: t, start_pos: pos, block_table: b, state_slot: s }).collect();
            for logits in gpu.forward_paged(&batch).unwrap() {
                bits.extend(logits.into_iter().map(f32::to_bits));
            }
        }
        (bits, prompts, gpu.staged_handoffs_run() - prompts)
    };
    let wgmma = ferrite_cuda::Gpu::new(0).is_ok_and(|g| g.supports_wgmma());
    for expand in ["off", "on"] {
        std::env::set_var("FERRITE_CUDA_EXPAND_WEIGHTS", expand);
        let (staged, rows) = (run("0"), run("1"));
        assert!(staged.0 == rows.0, "resident copies {expand}: the staged hand-off changes the logits");
        assert_eq!((rows.1, rows.2), (0, 0), "resident copies {expand}: staged hand-offs run with the switch off");
        // The GLU hand-off needs the warpgroup-MMA GEMM; attention's serves cuBLAS anywhere.
        if wgmma || expand == "on" {
            assert_eq!(staged.1, 2 * LLAMA_SMALL.n_layers as u64, "resident copies {expand}: staged hand-offs of the prompts");
            assert!(staged.2 >= LLAMA_SMALL.n_layers as u64, "resident copies {expand}: {} staged hand-offs in the batched steps", staged.2);
        }
        println!("staged hand-off, resident copies {expand}: bit-identical logits, {} + {} hand-offs", staged.1, staged.2);
    }
    std::env::remove_var("FERRITE_DISABLE_CUDA_STAGED_HANDOFF");
    std::env::remove_var("FERRITE_CUDA_EXPAND_WEIGHTS");
    match precision {
        Some(p) => std::env::set_var("FERRITE_CUDA_GEMM_PRECISION", p),
        None => std::env::remove_var("FERRITE_CUDA_GEMM_PRECISION"),
    }
}

/// Batched decode steps replayed from their CUDA graphs against launching every op: the same
/// logits bit for bit and the same device-drawn tokens, over steps that see a shape, capture it,
/// replay it, widen the block tables (new shapes) and shrink the batch; a prefill chunk in the
/// middle grows the GEMM scratch, which the graphs captured before must not replay.
fn batch_graph_replay_matches_eager() {
    let model = synthetic(synth::shape("smollm2-135m").unwrap(), GgmlType::Q4_1);
    let run = |disable: &str| {
        std::env::set_var("FERRITE_DISABLE_CUDA_BATCH_GRAPHS", disable);
        let mut gpu = ferrite_cuda::CudaExecutor::new(Arc::clone(&model), opts(64)).unwrap();
        let block = 4;
        gpu.init_paged(PagedKvConfig { n_blocks: 48, block_size: block, max_seqs: 4, max_tokens: 64, state_snapshots: 0 }).unwrap();
        let tables: Vec<Vec<u32>> = (0..4u32).map(|s| (0..12).map(|b| s * 12 + b).collect()).collect();
        let mut pos = [0usize; 4];
        let mut bits = Vec::new();
        let mut tokens = Vec::new();
        let greedy = DeviceSampling::GREEDY;
        // Sequences 0-2 prefill 3 tokens, decode 14 steps together (tables of 1-5 blocks);
        // sequence 3 prefills 40 tokens (a larger GEMM scratch), then 0 and 2 decode 6 more.
        let schedule: Vec<(Vec<usize>, usize)> = std::iter::once((vec![0, 1, 2], 3))
            .chain(std::iter::repeat_n((vec![0, 1, 2], 1), 14))
            .chain(std::iter::once((vec![3], 40)))
            .chain(std::iter::repeat_n((vec![0, 2], 1), 6))
            .collect();
        for (step, (members, len)) in schedule.iter().enumerate() {
            let toks: Vec<Vec<u32>> = members.iter().map(|&i| (0..*len).map(|t| ((pos[i] + t) * 389 + i * 17 + 1) as u32 % 49152).collect()).collect();
            let batch: Vec<SeqChunk> = members
                .iter()
                .zip(&toks)
                .map(|(&i, t)| SeqChunk { tokens: t, start_pos: pos[i], block_table: &tables[i][..(pos[i] + len).div_ceil(block)], state_slot: i })
                .collect();
            if step % 2 == 0 {
                for l in gpu.forward_paged(&batch).unwrap() {
                    bits.extend(l.into_iter().map(f32::to_bits));
                }
            } else {
                let sample = vec![Some(DeviceSampling { step: step as u64, ..greedy }); batch.len()];
                tokens.push(gpu.forward_paged_sampled(&batch, &sample).unwrap());
            }
            for &i in members {
                pos[i] += len;
            }
        }
        (bits, format!("{tokens:?}"), gpu.batch_graph_replays())
    };
    let (replayed, eager) = (run("0"), run("1"));
    std::env::remove_var("FERRITE_DISABLE_CUDA_BATCH_GRAPHS");
    assert_eq!(eager.2, 0, "graphs replayed with FERRITE_DISABLE_CUDA_BATCH_GRAPHS=1");
    assert!(replayed.2 >= 10, "only {} batched steps replayed from graphs", replayed.2);
    assert!(replayed.0 == eager.0, "batched step graph replay changes the logits");
    assert_eq!(replayed.1, eager.1, "batched step graph replay changes the device-drawn tokens");
    println!("batched decode graph replay: bit-identical logits and tokens over {} replayed steps", replayed.2);
}

/// Batched decode steps, each enqueuing the next one on the drawn tokens before reading them
/// back (`forward_paged_ahead`, as the server's scheduler runs them), against reading each
/// step's tokens back first: the same tokens and final logits, bit for bit, greedy and sampled,
/// when the next batch is the step ahead (taken) and when it is not (a sequence leaves, another
/// joins with a prefill chunk, a sequence moves to its next block).
fn batched_decode_ahead_matches_step_by_step() {
    let model = synthetic(synth::shape("smollm2-135m").unwrap(), GgmlType::Q4_1);
    let run = |ahead: bool| {
        let mut gpu = ferrite_cuda::CudaExecutor::new(Arc::clone(&model), opts(64)).unwrap();
        let block = 4;
        gpu.init_paged(PagedKvConfig { n_blocks: 48, block_size: block, max_seqs: 4, max_tokens: 64, state_snapshots: 0 }).unwrap();
        let tables: Vec<Vec<u32>> = (0..4u32).map(|s| (0..12).map(|b| s * 12 + b).collect()).collect();
        let mut seqs: Vec<Vec<u32>> = (0..4).map(|i| (0..3 + 2 * i).map(|t| ((t * 389 + i * 17 + 1) % 49152) as u32).collect()).collect();
        let mut pos = [0usize; 4];
        let sampled = DeviceSampling { temperature: 0.8, top_k: 40, top_p: 0.95, min_p: 0.0, seed: 3, step: 0 };
        // (members, whether the step may run ahead); sequence 1 leaves after step 8, sequence 3
        // joins at step 12 (its whole prompt as a chunk), sequence 2 samples, the others are greedy.
        let schedule: Vec<(Vec<usize>, bool)> = (0..20)
            .map(|step| match step {
                0..=8 => (vec![0, 1, 2], step != 4),
                9..=11 => (vec![0, 2], true),
                _ => (vec![0, 2, 3], step != 12),
            })
            .collect();
        let mut drawn = Vec::new();
        for (step, (members, may_run_ahead)) in schedule.iter().enumerate() {
            let batch: Vec<SeqChunk> =
                members.iter().map(|&i| SeqChunk { tokens: &seqs[i][pos[i]..], start_pos: pos[i], block_table: &tables[i][..seqs[i].len().div_ceil(block)], state_slot: i }).collect();
            let sample: Vec<Option<DeviceSampling>> =
                members.iter().map(|&i| Some(if i == 2 { DeviceSampling { step: step as u64, ..sampled } } else { DeviceSampling::GREEDY })).collect();
            let next: Vec<AheadSeq> = members.iter().map(|&i| AheadSeq { start_pos: seqs[i].len(), block_table: &tables[i][..(seqs[i].len() + 1).div_ceil(block)] }).collect();
            let out = if ahead && *may_run_ahead { gpu.forward_paged_ahead(&batch, &sample, &next) } else { gpu.forward_paged_sampled(&batch, &sample) }.unwrap();
            for (&i, o) in members.iter().zip(out) {
                let PagedOutput::Token(t) = o else { panic!("a token was drawn on the device") };
                pos[i] = seqs[i].len();
                seqs[i].push(t);
                drawn.push((step, i, t));
            }
        }
        let last: Vec<SeqChunk> = [0, 2, 3].iter().map(|&i| SeqChunk { tokens: &seqs[i][pos[i]..], start_pos: pos[i], block_table: &tables[i][..seqs[i].len().div_ceil(block)], state_slot: i }).collect();
        let logits: Vec<u32> = gpu.forward_paged(&last).unwrap().into_iter().flatten().map(f32::to_bits).collect();
        (drawn, logits, gpu.ahead_steps_taken())
    };
    let (ahead, behind) = (run(true), run(false));
    assert_eq!(behind.2, 0, "no step ran ahead");
    // Taken: every step after one run ahead with the same members (1-4, 6-8, 10-11, 14-19),
    // and the final logits' step (after step 19's).
    assert_eq!(ahead.2, 16, "steps taken from the one enqueued ahead");
    assert_eq!(ahead.0, behind.0, "decoding ahead changes the drawn tokens");
    assert!(ahead.1 == behind.1, "decoding ahead changes the logits");
    println!("batched decode ahead: the same tokens and logits over 20 steps, {} taken from the step enqueued ahead", ahead.2);
}

/// `Session::generate` with the next step enqueued before each token is read back (the token
/// handed from the sampler to the step on the device) against reading each token back first:
/// the same tokens, cache and logits, bit for bit, greedy and sampled, with and without
/// recurrent state; stopping at an end token leaves that token in the cache only when run ahead.
/// Also with greedy steps drawing their own next token inside their graphs
/// (the default; `FERRITE_DISABLE_CUDA_STEP_DRAWS=1` turns it off), and after a warm-up.
fn decode_ahead_matches_step_by_step() {
    use ferrite_engine::{SamplerParams, Session, StopReason};
    let sampled = SamplerParams { temperature: 0.8, top_k: 40, top_p: 0.95, min_p: 0.05, seed: 5, ..SamplerParams::DEFAULT };
    let models = [synthetic(synth::shape("smollm2-135m").unwrap(), GgmlType::Q4_1), synthetic(&QWEN35_SMALL, GgmlType::Q8_0)];
    for (model, step_draws) in models.iter().flat_map(|m| [(m, false), (m, true)]) {
        let arch = format!("{} step draws {step_draws}", model.config.arch.name());
        std::env::set_var("FERRITE_DISABLE_CUDA_STEP_DRAWS", if step_draws { "0" } else { "1" });
        let gpu = ferrite_cuda::CudaExecutor::new(Arc::clone(model), opts(16)).unwrap();
        let mut session = Session::new(Box::new(gpu));
        let prompt: Vec<u32> = (0..PROMPT as u32).map(|i| (i * 977 + 5) % model.config.vocab_size as u32).collect();
        let mut run = |ahead: bool, params: &SamplerParams, end: Option<u32>| {
            session.reset();
            session.set_decode_ahead(ahead);
            let mut tokens = Vec::new();
            let stats = session
                .generate(&prompt, 24, params, |t| Some(t) == end, |t| {
                    tokens.push(t);
                    true
                })
                .unwrap();
            let logits: Vec<u32> = session.executor().logits().unwrap().into_iter().map(f32::to_bits).collect();
            (tokens, stats.stop, session.cached_tokens().to_vec(), logits)
        };
        for params in [SamplerParams::greedy(), sampled.clone()] {
            let (ahead, behind) = (run(true, &params, None), run(false, &params, None));
            assert_eq!(ahead.0.len(), 24, "{arch}: 24 tokens");
            assert!(ahead == behind, "{arch} {params:?}: decoding ahead changes tokens, cache or logits");
            assert_eq!(ahead.2.len(), PROMPT + 23, "{arch}: every token but the last appended");
        }
        // A session warmed up first (`Session::warm_up`: steps and draws at positions 0-3)
        // generates the same tokens, cache and logits.
        let mut warm = Session::new(Box::new(ferrite_cuda::CudaExecutor::new(Arc::clone(model), opts(16)).unwrap()));
        warm.warm_up().unwrap();
        for params in [SamplerParams::greedy(), sampled.clone()] {
            let mut tokens = Vec::new();
            warm.reset();
            warm.generate(&prompt, 24, &params, |_| false, |t| {
                tokens.push(t);
                true
            })
            .unwrap();
            let logits: Vec<u32> = warm.executor().logits().unwrap().into_iter().map(f32::to_bits).collect();
            let cold = run(true, &params, None);
            assert!((&tokens, warm.cached_tokens(), &logits) == (&cold.0, &cold.2[..], &cold.3), "{arch} {params:?}: warming up changes tokens, cache or logits");
        }
        let greedy = run(false, &SamplerParams::greedy(), None).0;
        let end = greedy[7];
        let first = greedy.iter().position(|&t| t == end).unwrap();
        let (ahead, behind) = (run(true, &SamplerParams::greedy(), Some(end)), run(false, &SamplerParams::greedy(), Some(end)));
        assert_eq!((ahead.0.len(), ahead.1), (first, StopReason::EndOfGeneration), "{arch}: stops at the end token");
        assert_eq!(ahead.0, behind.0, "{arch}: tokens before the end token");
        assert_eq!(&ahead.2[PROMPT..], &greedy[..first + 1], "{arch}: run ahead, the end token is in the cache");
        assert_eq!(&behind.2[PROMPT..], &greedy[..first], "{arch}: read back first, it is not");
        // The executor's own record: with step draws, every greedy token drawn ahead but the
        // first of a generation (after its prefill) came from the step before.
        let mut gpu = ferrite_cuda::CudaExecutor::new(Arc::clone(model), opts(16)).unwrap();
        gpu.forward(&prompt, 0).unwrap();
        let greedy_draw = DeviceSampling::GREEDY;
        let mut drawn = Vec::new();
        for pos in PROMPT..PROMPT + 10 {
            drawn.push(gpu.sample_and_step(&greedy_draw, Some(pos)).unwrap().unwrap());
        }
        drawn.push(gpu.sample_on_device(&greedy_draw).unwrap().unwrap());
        assert_eq!(drawn, greedy[..11], "{arch}: tokens drawn by the executor");
        assert_eq!(gpu.step_drawn_tokens(), if step_draws { 10 } else { 0 }, "{arch}: tokens the steps drew");
    }
    std::env::remove_var("FERRITE_DISABLE_CUDA_STEP_DRAWS");
    println!("decode ahead: same tokens, cache and logits as reading each token back, greedy and sampled, with recurrent state, with and without steps drawing their next token");
}

/// Recurrent state on the GPU follows the executor rules: position 0 resets it, the consumed
/// position continues it, anything else is refused; only attention layers get a KV cache.
/// (Called from the test above: the env switches it sets are process-wide.)
fn recurrent_state_positions() {
    let model = Arc::new(Model::load(common::workspace_root().join("fixtures/tiny/qwen35.gguf"), FusionOptions::ALL).unwrap());
    let mut gpu = ferrite_cuda::CudaExecutor::new(model, opts(4)).unwrap();
    assert!(gpu.has_recurrent_state());
    let kv_bytes = gpu.kv_bytes_per_position();
    assert!(kv_bytes == 2 * 64 * 2 || kv_bytes == 2 * 64 * 4, "one layer's K and V (2 KV heads x 32), f16 or f32: {kv_bytes}");
    let ids = [5u32, 6, 7, 8, 9, 10];
    gpu.forward(&ids, 0).unwrap();
    let fresh = gpu.logits().unwrap();
    gpu.forward(&[1, 2, 3], 0).unwrap();
    let err = gpu.forward(&ids[4..], 4).unwrap_err().to_string();
    assert!(err.contains("cannot be rewound") && err.contains("continue at 3, not at 4"), "{err}");
    // Position 0 resets both the conv window and the delta-rule state; continuing works.
    gpu.forward(&ids[..3], 0).unwrap();
    gpu.forward(&ids[3..], 3).unwrap();
    let (_, rel) = diff(&fresh, &gpu.logits().unwrap());
    assert!(rel < 1e-5, "restart at 0 then continue differs from one prefill: relative {rel}");
    let err = gpu.forward(&[1], 2).unwrap_err().to_string();
    assert!(err.contains("continue at 6, not at 2"), "{err}");
    println!("recurrent state: reset at 0, continue, refuse other positions");
}

/// The serving engine on CUDA with a hybrid model and its prefix cache: a prompt run cold, then
/// another that shares its first 64 tokens (taking the state kept after them: a copy between
/// state slots on the device), then the first again, warm: it draws, greedily, what it drew
/// cold (the same chunks run either way, on one engine, so the same bits).
#[test]
fn hybrid_prefix_cache_on_cuda_restores_kept_states() {
    if !gpu_or_skip() {
        return;
    }
    use ferrite_engine::{EngineConfig, EngineHandle, GenEvent, GenRequest, SamplerParams};
    let model = Arc::new(Model::load(common::workspace_root().join("fixtures/tiny/qwen35.gguf"), FusionOptions::ALL).unwrap());
    let vocab = model.config.vocab_size as u32;
    let m = Arc::clone(&model);
    let make = move || -> anyhow::Result<Box<dyn Executor>> { Ok(Box::new(ferrite_cuda::CudaExecutor::new(m, opts(64))?)) };
    let config = EngineConfig { block_size: 16, n_blocks: 64, max_seqs: 3, max_batch_tokens: 32, max_queue: 16, max_context: 256, prefix_cache: true, state_snapshots: 2, snapshot_stride: 32 };
    let engine = EngineHandle::start(make, config).unwrap().0;
    let run = |prompt: &[u32]| -> (Vec<u32>, usize) {
        let req = GenRequest { prompt: prompt.to_vec(), max_tokens: 8, sampling: SamplerParams::greedy(), presence_penalty: 0.0, frequency_penalty: 0.0, logit_bias: vec![], logprobs: None, stop_tokens: vec![] };
        let mut rx = engine.submit(req).unwrap();
        let (mut tokens, mut cached) = (vec![], 0);
        loop {
            match rx.blocking_recv().expect("stream ended without Finished") {
                GenEvent::Started { cached_tokens } => cached = cached_tokens,
                GenEvent::Token { id, .. } => tokens.push(id),
                GenEvent::Finished { .. } => return (tokens, cached),
                GenEvent::Error(e) => panic!("engine error: {e}"),
            }
        }
    };
    let q: Vec<u32> = (0..73u32).map(|i| (i * 7919 + 21) % vocab).collect();
    let mut p = q[..70].to_vec();
    p.extend([5, 6, 7, 8, 9]);
    let (cold, cached) = run(&q);
    assert_eq!(cached, 0);
    assert_eq!(run(&p).1, 64, "the state after q's first 64 tokens was kept");
    let (warm, cached) = run(&q);
    assert_eq!(cached, 64);
    assert_eq!(warm, cold, "tokens after the restored state differ from the cold run's");
}
