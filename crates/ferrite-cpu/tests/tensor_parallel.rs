//! Tensor parallelism simulated on the CPU: the ranks of a sharded model (`ferrite_model::shard`),
//! one `CpuExecutor` per thread meeting in an in-process all-reduce, against the whole model on
//! one executor. The ranks sum partial products in another order than the whole model, so the
//! logits agree to fp32 rounding, not bit for bit (except over one rank); the greedy tokens agree.

use ferrite_cpu::{CpuExecutor, CpuPrecision};
use ferrite_gguf::GgmlType;
use ferrite_model::collective::{local_group, LocalRank};
use ferrite_model::shard::rank_models;
use ferrite_model::synth::{write_temp, SynthShape};
use ferrite_model::{Collective, Executor, ExecutorOptions, FusionOptions, Model, PagedKvConfig, RankThreads, SeqChunk};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

const PROMPT: [u32; 11] = [1, 17, 200, 33, 5, 250, 99, 7, 64, 128, 3];
const DECODE_STEPS: usize = 6;

fn options() -> ExecutorOptions {
    ExecutorOptions { max_batch: 8, context_len: 64, trace: false, progress: None }
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../fixtures/tiny")).join(name)
}

/// The `n` ranks of `model`, each on its own thread.
fn ranks(model: &Model, n: usize, precision: CpuPrecision) -> RankThreads<CpuExecutor> {
    let builders: Vec<_> = rank_models(model, n)
        .unwrap()
        .into_iter()
        .zip(local_group(n))
        .map(|(m, comm)| move || CpuExecutor::new_rank(Arc::new(m), precision, options(), Box::new(comm)))
        .collect();
    RankThreads::spawn(builders).unwrap()
}

fn argmax(x: &[f32]) -> u32 {
    (0..x.len()).max_by(|&a, &b| x[a].total_cmp(&x[b])).unwrap() as u32
}

/// The prompt's logits, then `DECODE_STEPS` greedy steps: the tokens and the logits of each step.
fn greedy(exec: &mut dyn Executor) -> (Vec<u32>, Vec<Vec<f32>>) {
    exec.forward(&PROMPT, 0).unwrap();
    let mut logits = vec![exec.logits().unwrap()];
    let mut tokens = Vec::new();
    for step in 0..DECODE_STEPS {
        tokens.push(argmax(logits.last().unwrap()));
        exec.forward(&tokens[step..], PROMPT.len() + step).unwrap();
        logits.push(exec.logits().unwrap());
    }
    (tokens, logits)
}

/// Largest difference relative to the largest magnitude.
fn rel_err(want: &[f32], got: &[f32]) -> f32 {
    assert_eq!(want.len(), got.len());
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    want.iter().zip(got).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale
}

/// Run `model` whole and over `n` ranks; the greedy tokens must agree and every step's logits
/// within `tol`; all ranks must hold the same logits. Returns the worst relative error.
fn check(name: &str, model: Model, n: usize, precision: CpuPrecision, tol: f32) -> f32 {
    let model = Arc::new(model);
    let mut whole = CpuExecutor::new(Arc::clone(&model), precision, options()).unwrap();
    let (want_tokens, want) = greedy(&mut whole);
    let mut tp = ranks(&model, n, precision);
    let (tokens, got) = greedy(&mut tp);
    let worst = want.iter().zip(&got).map(|(w, g)| rel_err(w, g)).fold(0f32, f32::max);
    println!("{name}, {n} ranks ({precision:?}): greedy {tokens:?}, worst relative logit error {worst:.2e}");
    assert_eq!(tokens, want_tokens, "{name}: greedy tokens differ at tp={n}");
    assert!(worst <= tol, "{name}: relative logit error {worst:.2e} at tp={n} (tolerance {tol:.0e})");
    let per_rank = tp.each(|e| e.logits().unwrap()).unwrap();
    assert!(per_rank.iter().all(|l| l == &per_rank[0]), "{name}: the ranks' logits differ");
    worst
}

/// fp32 reference: only the order of the sums differs.
const FP32_TOL: f32 = 1e-5;

/// The tiny HF-made fixtures (4 query heads, 2 kv heads each): Llama, Qwen3 (QK-norm), Gemma 3
/// (post-norms in the way of the residual fusion, GeGLU, sliding windows), fused and unfused.
#[test]
fn tiny_fixtures_at_two_ranks_match_the_whole_model() {
    for arch in ["llama", "qwen3", "gemma3"] {
        for (fusion, label) in [(FusionOptions::ALL, "fused"), (FusionOptions::NONE, "unfused")] {
            let model = Model::load(fixture(&format!("{arch}.gguf")), fusion).unwrap();
            check(&format!("{arch} {label}"), model, 2, CpuPrecision::Reference, FP32_TOL);
        }
    }
}

/// Over one rank the sharded graph does the same arithmetic (the residual add after the
/// all-reduce is the same sum as in the linear's epilogue): bit-identical.
#[test]
fn one_rank_is_bit_identical() {
    for fusion in [FusionOptions::ALL, FusionOptions::NONE] {
        let model = Model::load(fixture("gemma3.gguf"), fusion).unwrap();
        assert_eq!(check("gemma3 over one rank", model, 1, CpuPrecision::Reference, 0.0), 0.0);
    }
}

fn synth_llama(name: &'static str, arch: &'static str) -> SynthShape {
    SynthShape { name, arch, n_layers: 2, n_embd: 128, n_heads: 8, n_kv_heads: 4, head_dim: 16, n_ff: 256, rope_theta: 1e4, context_length: 64, tied_embeddings: false, gdn: None, moe: None }
}

/// Synthetic Llama shapes over 2 and 4 ranks, in f32 and sliced Q8_0 / Q4_0 blocks (each rank's
/// 32 attention-output and 64 down-projection columns are whole blocks).
#[test]
fn synthetic_llama_at_two_and_four_ranks() {
    let shape = synth_llama("tp-cpu-llama", "llama");
    for dtype in [GgmlType::F32, GgmlType::Q8_0, GgmlType::Q4_0] {
        let path = write_temp(&shape, dtype, 21).unwrap();
        for n in [2, 4] {
            let model = Model::load(&path, FusionOptions::ALL).unwrap();
            check(&format!("synthetic llama {}", dtype.name()), model, n, CpuPrecision::Reference, FP32_TOL);
        }
    }
}

/// Qwen2's Q/K/V biases are split with their heads (fused into one bias, or three).
#[test]
fn qwen2_biases_follow_their_heads() {
    let path = write_temp(&synth_llama("tp-cpu-qwen2", "qwen2"), GgmlType::Q8_0, 22).unwrap();
    for fusion in [FusionOptions::ALL, FusionOptions::NONE] {
        check("synthetic qwen2", Model::load(&path, fusion).unwrap(), 4, CpuPrecision::Reference, FP32_TOL);
    }
}

/// The quantized path multiplies the sliced packed blocks directly, with the same kernels. Its
/// tolerance is wider: a hidden state that differs in the last bits can move an 8-bit
/// activation across a rounding step.
#[test]
fn quantized_kernels_on_sliced_blocks() {
    let path = write_temp(&synth_llama("tp-cpu-llama-q", "llama"), GgmlType::Q8_0, 23).unwrap();
    check("synthetic llama Q8_0", Model::load(&path, FusionOptions::ALL).unwrap(), 2, CpuPrecision::Quantized, 1e-4);
}

/// Batched serving steps (paged cache, several sequences, one last row each) over the ranks.
#[test]
fn paged_batches_match() {
    let model = Arc::new(Model::load(fixture("llama.gguf"), FusionOptions::ALL).unwrap());
    let config = PagedKvConfig { n_blocks: 8, block_size: 4, max_seqs: 2, max_tokens: 16, state_snapshots: 0 };
    let batch = [SeqChunk { tokens: &PROMPT[..7], start_pos: 0, block_table: &[0, 1], state_slot: 0 }, SeqChunk { tokens: &PROMPT[3..], start_pos: 0, block_table: &[2, 3], state_slot: 1 }];
    let mut whole = CpuExecutor::new(Arc::clone(&model), CpuPrecision::Reference, options()).unwrap();
    let mut tp = ranks(&model, 2, CpuPrecision::Reference);
    let mut worst = 0f32;
    for exec in [&mut whole as &mut dyn Executor, &mut tp] {
        exec.init_paged(config).unwrap();
    }
    for step in [&batch[..], &[SeqChunk { tokens: &[42], start_pos: 7, block_table: &[0, 1], state_slot: 0 }]] {
        let (want, got) = (whole.forward_paged(step).unwrap(), tp.forward_paged(step).unwrap());
        assert_eq!(want.len(), got.len());
        for (w, g) in want.iter().zip(&got) {
            assert_eq!(argmax(w), argmax(g));
            worst = worst.max(rel_err(w, g));
        }
    }
    println!("llama paged, 2 ranks: worst relative logit error {worst:.2e}");
    assert!(worst <= FP32_TOL, "{worst:.2e}");
}

/// An error on the ranks (here before any all-reduce, on all of them) reaches the caller, and the
/// ranks still serve the next call.
#[test]
fn errors_reach_the_caller() {
    let model = Model::load(fixture("llama.gguf"), FusionOptions::ALL).unwrap();
    let mut tp = ranks(&model, 2, CpuPrecision::Reference);
    let e = format!("{:#}", tp.forward(&[1; 65], 0).unwrap_err());
    assert!(e.contains("rank 0") && e.contains("prompt too long"), "{e}");
    let e = format!("{:#}", tp.forward(&[1, 256], 0).unwrap_err());
    assert!(e.contains("token id 256 is outside the vocabulary"), "{e}");
    tp.forward(&PROMPT, 0).unwrap();
    assert!(tp.describe().starts_with("2 ranks, each cpu (fp32 reference") && tp.describe().ends_with("rank 0 of 2)"), "{}", tp.describe());
    let whole = CpuExecutor::new(Arc::new(Model::load(fixture("llama.gguf"), FusionOptions::ALL).unwrap()), CpuPrecision::Reference, options()).unwrap();
    assert_eq!(tp.kv_bytes_per_position(), whole.kv_bytes_per_position());
    let rank = rank_models(&model, 2).unwrap().remove(1);
    let e = CpuExecutor::new(Arc::new(rank), CpuPrecision::Reference, options()).err().unwrap().to_string();
    assert!(e.contains("rank 1 of 2 (tensor parallel): run it with `CpuExecutor::new_rank`"), "{e}");
}

/// A rank whose third all-reduce fails, as a device or network error would.
struct Flaky(LocalRank, AtomicUsize);

impl Collective for Flaky {
    fn rank(&self) -> usize {
        self.0.rank()
    }

    fn n_ranks(&self) -> usize {
        self.0.n_ranks()
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> anyhow::Result<()> {
        if self.1.fetch_add(1, Ordering::Relaxed) == 2 {
            anyhow::bail!("injected failure");
        }
        self.0.all_reduce_sum(buf)
    }

    fn abort(&self) {
        self.0.abort()
    }
}

/// A rank failing mid-step aborts the group: the rank waiting for it fails instead of hanging,
/// and so does every later step.
#[test]
fn a_rank_failing_mid_step_aborts_the_others() {
    let model = Model::load(fixture("llama.gguf"), FusionOptions::ALL).unwrap();
    let builders: Vec<_> = rank_models(&model, 2)
        .unwrap()
        .into_iter()
        .zip(local_group(2))
        .map(|(m, comm)| {
            let comm: Box<dyn Collective> = if comm.rank() == 1 { Box::new(Flaky(comm, AtomicUsize::new(0))) } else { Box::new(comm) };
            move || CpuExecutor::new_rank(Arc::new(m), CpuPrecision::Reference, options(), comm)
        })
        .collect();
    let mut tp = RankThreads::spawn(builders).unwrap();
    let errors = tp.each(|e| format!("{:#}", e.forward(&PROMPT, 0).unwrap_err())).unwrap();
    // Rank 0 either waits in the all-reduce when rank 1 aborts ("rank 1 aborted ... while the
    // others waited") or arrives after it ("rank 1 has aborted"): a race, both are right.
    let rank0_failed = errors[0].contains("rank 1 aborted") || errors[0].contains("rank 1 has aborted");
    assert!(rank0_failed && errors[1].contains("injected failure"), "{errors:?}");
    let later = format!("{:#}", tp.forward(&PROMPT, 0).unwrap_err());
    assert!(later.contains("rank 0") && later.contains("rank 1 has aborted"), "{later}");
}
