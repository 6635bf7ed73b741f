//! llama-bench style measurements: prompt processing (pp N) and token generation (tg N).

use crate::sampling::{argmax, Sampler, SamplerParams};
use ferrite_model::graph::{Op, Rows};
use ferrite_model::{AheadSeq, DeviceSampling, Executor, Model, PagedKvConfig, PagedOutput, SeqChunk};
use crate::session::Session;
use anyhow::Result;
use std::time::Instant;

#[derive(Clone, Debug)]
pub struct BenchResult {
    pub test: String,
    pub tokens: usize,
    /// Sequences decoded together (1 but for [`bench_batched`]).
    pub seqs: usize,
    /// Positions each sequence had cached when the timed steps began.
    pub start: usize,
    /// Tokens per second of each timed repetition (warm-up excluded).
    pub samples: Vec<f64>,
}

impl BenchResult {
    pub fn median(&self) -> f64 {
        let mut s = self.samples.clone();
        s.sort_by(f64::total_cmp);
        let n = s.len();
        if n == 0 {
            0.0
        } else if n % 2 == 1 {
            s[n / 2]
        } else {
            (s[n / 2 - 1] + s[n / 2]) / 2.0
        }
    }

    /// Half the distance between the fastest and slowest repetition, relative to the median.
    pub fn spread(&self) -> f64 {
        let max = self.samples.iter().cloned().fold(f64::MIN, f64::max);
        let min = self.samples.iter().cloned().fold(f64::MAX, f64::min);
        (max - min) / 2.0 / self.median().max(1e-12)
    }
}

/// Each batched decode result (`tg N xS`, or `tg N xS sampled`) beside the batch-1 decode of
/// the same length and draws from an empty context (`tg N`, `tg N sampled`), if that ran:
/// (batched test, batch-1 test, aggregate / batch-1 rate).
/// Issue #6's serving target compares these two.
pub fn batch_speedups(results: &[BenchResult]) -> Vec<(&str, &str, f64)> {
    results
        .iter()
        .filter(|r| r.seqs > 1)
        .filter_map(|r| {
            let sampled = if r.test.ends_with(" sampled") { " sampled" } else { "" };
            let base_test = format!("tg{}{sampled}", r.tokens);
            let base = results.iter().find(|b| b.seqs == 1 && b.start == 0 && b.test == base_test)?;
            Some((r.test.as_str(), base.test.as_str(), r.median() / base.median().max(1e-12)))
        })
        .collect()
}

/// Deterministic token ids for benchmarking (content does not change the work done).
fn bench_tokens(n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 7919 + 13) % vocab) as u32).collect()
}

/// A decode test's name: "... sampled" unless its draws are greedy.
fn draws_named(test: String, greedy: bool) -> String {
    if greedy {
        test
    } else {
        format!("{test} sampled")
    }
}

/// The name of a test at `depth` cached positions, as llama-bench writes it ("tg128 @ d2048").
fn at_depth(test: String, depth: usize) -> String {
    if depth == 0 {
        test
    } else {
        format!("{test} @ d{depth}")
    }
}

/// The untimed context of a test at depth: prefilled and finished (the logits read back, so no
/// device work of it runs into the timed part).
fn prefill_depth(session: &mut Session, tokens: &[u32]) -> Result<()> {
    if !tokens.is_empty() {
        session.prefill(tokens)?;
        session.executor().logits()?;
    }
    Ok(())
}

/// Timed repetitions of a test (after one warm-up run), and whether the last one's timed part
/// is bracketed for an external profiler ([`Executor::profiler_range`](ferrite_model::Executor::profiler_range):
/// `ncu --profile-from-start off` then records only those kernels).
#[derive(Clone, Copy, Debug)]
pub struct Reps {
    pub count: usize,
    pub profile_last: bool,
}

impl Reps {
    /// Open (`on`) or close the profiler range around repetition `rep`'s timed part, if it is
    /// the one to profile.
    fn bracket(&self, exec: &mut dyn Executor, rep: usize, on: bool) -> Result<()> {
        if self.profile_last && rep == self.count {
            exec.profiler_range(on)?;
        }
        Ok(())
    }
}

/// Prompt processing: `n` tokens after `depth` cached ones (prefilled untimed), one forward pass.
pub fn bench_pp(session: &mut Session, n: usize, depth: usize, reps: Reps, vocab: usize) -> Result<BenchResult> {
    let tokens = bench_tokens(depth + n, vocab);
    let mut samples = Vec::new();
    for rep in 0..=reps.count {
        session.reset();
        prefill_depth(session, &tokens[..depth])?;
        reps.bracket(session.executor(), rep, true)?;
        let t = Instant::now();
        session.prefill(&tokens)?;
        session.executor().logits()?;
        let tps = n as f64 / t.elapsed().as_secs_f64();
        reps.bracket(session.executor(), rep, false)?;
        if rep > 0 {
            samples.push(tps);
        }
    }
    Ok(BenchResult { test: at_depth(format!("pp{n}"), depth), tokens: n, seqs: 1, start: depth, samples })
}

/// Token generation: `n` single-token steps after `depth` cached positions (prefilled untimed),
/// each followed by a draw with `sampling` (on the device where the backend can; a sampled test
/// is named "tgN sampled"), as a generation loop does (`Session::generate`: without a host round
/// trip between steps where the backend samples on the device).
pub fn bench_tg(session: &mut Session, n: usize, depth: usize, reps: Reps, vocab: usize, sampling: &SamplerParams) -> Result<BenchResult> {
    let mut samples = Vec::new();
    let mut sampler = Sampler::new(sampling.clone());
    for rep in 0..=reps.count {
        session.reset();
        prefill_depth(session, &bench_tokens(depth, vocab))?;
        reps.bracket(session.executor(), rep, true)?;
        let t = Instant::now();
        session.step(bench_tokens(1, vocab)[0])?;
        for i in 0..n {
            // As `Session::generate` runs: the next step enqueued before the token is read back
            // where the backend can.
            let (tok, appended) = session.sample_ahead(&mut sampler, &[], i as u64, i + 1 < n)?;
            if !appended && i + 1 < n {
                session.step(tok)?;
            }
        }
        let tps = n as f64 / t.elapsed().as_secs_f64();
        reps.bracket(session.executor(), rep, false)?;
        if rep > 0 {
            samples.push(tps);
        }
    }
    // Named by the device's greedy rule (top-k 1 is the argmax too), as `bench_batched` names.
    let greedy = sampling.on_device(0).is_some_and(|d| d.is_greedy());
    Ok(BenchResult { test: at_depth(draws_named(format!("tg{n}"), greedy), depth), tokens: n, seqs: 1, start: depth, samples })
}

/// Batched decode, as a server's continuous batching runs it without the HTTP side: `seqs`
/// sequences on the executor's paged cache, each prefilled with `prompt` tokens (one batched
/// step per sequence), then `n` steps that each decode one token of every sequence in one
/// [`Executor::forward_paged_sampled`](ferrite_model::Executor::forward_paged_sampled) call with
/// `sampling` (greedy, or sampled as a server's requests are, each sequence its own seed;
/// sampled runs are named "... sampled"), drawn on the device where the backend can (else the
/// logits come back and are reduced by argmax), each step enqueued before the last one's tokens
/// are read back where the backend can ([`Executor::forward_paged_ahead`]). Samples are
/// aggregate tokens per second over the `n` steps.
#[allow(clippy::too_many_arguments)]
pub fn bench_batched(session: &mut Session, seqs: usize, prompt: usize, n: usize, reps: Reps, vocab: usize, sampling: DeviceSampling) -> Result<BenchResult> {
    const BLOCK: usize = 16;
    let blocks_per_seq = (prompt + n).div_ceil(BLOCK);
    let exec = session.executor();
    exec.init_paged(PagedKvConfig { n_blocks: seqs * blocks_per_seq, block_size: BLOCK, max_seqs: seqs, max_tokens: seqs.max(prompt), state_snapshots: 0 })?;
    let tables: Vec<Vec<u32>> = (0..seqs).map(|s| (0..blocks_per_seq).map(|b| (s * blocks_per_seq + b) as u32).collect()).collect();
    let ahead_on = ferrite_core::env::DECODE_AHEAD.flag();
    let mut samples = Vec::new();
    for rep in 0..=reps.count {
        // Distinct prompts, so no two sequences compute the same rows.
        let mut next: Vec<u32> = Vec::with_capacity(seqs);
        for (s, table) in tables.iter().enumerate() {
            let tokens: Vec<u32> = bench_tokens(prompt + s, vocab).split_off(s);
            let logits = exec.forward_paged(&[SeqChunk { tokens: &tokens, start_pos: 0, block_table: table, state_slot: s }])?;
            next.push(argmax(&logits[0]));
        }
        reps.bracket(exec, rep, true)?;
        let t = Instant::now();
        for step in 0..n {
            let ids = next.clone();
            let batch: Vec<SeqChunk> =
                tables.iter().zip(&ids).enumerate().map(|(s, (table, tok))| SeqChunk { tokens: std::slice::from_ref(tok), start_pos: prompt + step, block_table: table, state_slot: s }).collect();
            let sample: Vec<_> = (0..seqs).map(|s| Some(DeviceSampling { step: step as u64, seed: s as u64, ..sampling })).collect();
            // As the server's scheduler runs it: the next step enqueued before the tokens are
            // read back (where the backend can), but for the last step.
            let outputs = if step + 1 < n && ahead_on {
                let ahead: Vec<AheadSeq> = tables.iter().map(|table| AheadSeq { start_pos: prompt + step + 1, block_table: table }).collect();
                exec.forward_paged_ahead(&batch, &sample, &ahead)?
            } else {
                exec.forward_paged_sampled(&batch, &sample)?
            };
            next = outputs
                .iter()
                .map(|o| match o {
                    PagedOutput::Token(t) => *t,
                    PagedOutput::Logits(l) => argmax(l),
                })
                .collect();
        }
        let tps = (seqs * n) as f64 / t.elapsed().as_secs_f64();
        reps.bracket(exec, rep, false)?;
        if rep > 0 {
            samples.push(tps);
        }
    }
    let test = draws_named(format!("tg{n} x{seqs}"), sampling.is_greedy());
    Ok(BenchResult { test, tokens: n, seqs, start: prompt, samples })
}

/// The least work a token costs, for expressing speed as a fraction of the hardware limit.
#[derive(Clone, Copy, Debug)]
pub struct TokenWork {
    /// Weight bytes a decode step must read: every weight of every linear, once (GGUF sizes).
    pub weight_bytes: usize,
    /// Matrix FLOPs per token of the linears (2 per multiply-add).
    pub linear_flops: f64,
    /// The part of `linear_flops` computed on a batch's last row only (the output head): a
    /// prompt pays it once, not per token.
    pub last_row_flops: f64,
    /// Attention FLOPs per token per position of context (QK and PV, all layers and heads).
    pub attention_flops_per_position: f64,
}

impl TokenWork {
    pub fn of(model: &Model) -> Self {
        let weight_bytes = model.linear_weight_bytes();
        let (mut linear_flops, mut last_row_flops) = (0.0, 0.0);
        for op in &model.graph.ops {
            if let Op::Linear { w, out, .. } | Op::GatedLinear { w, out, .. } = op {
                let spec = model.weights.spec(*w);
                let flops = 2.0 * (spec.rows * spec.cols) as f64;
                linear_flops += flops;
                if model.graph.value(*out).rows == Rows::Last {
                    last_row_flops += flops;
                }
            }
        }
        let a = model.graph.attention;
        let attention_flops_per_position = 4.0 * (model.graph.n_layers * a.n_heads * a.head_dim) as f64;
        Self { weight_bytes, linear_flops, last_row_flops, attention_flops_per_position }
    }

    /// Bytes per step of a decode run of `n` tokens from `start` cached positions, `seqs`
    /// sequences at a time: the weights once, and each sequence's KV cache at the average
    /// context length.
    pub fn decode_bytes(&self, start: usize, n: usize, seqs: usize, kv_bytes_per_position: usize) -> f64 {
        let context = start as f64 + (n as f64 + 1.0) / 2.0;
        self.weight_bytes as f64 + (seqs * kv_bytes_per_position) as f64 * context
    }

    /// FLOPs per token of processing an `n`-token prompt after `start` cached positions
    /// (causal: average context start + (n + 1) / 2; the output head on the last token only).
    pub fn prompt_flops(&self, n: usize, start: usize) -> f64 {
        let per_token = self.linear_flops - self.last_row_flops;
        per_token + self.last_row_flops / n.max(1) as f64 + self.attention_flops_per_position * (start as f64 + (n as f64 + 1.0) / 2.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(test: &str, tokens: usize, seqs: usize, start: usize, tps: f64) -> BenchResult {
        BenchResult { test: test.to_string(), tokens, seqs, start, samples: vec![tps] }
    }

    /// Each batched run pairs with the batch-1 decode of its length from an empty context, not
    /// with prefill, other lengths or deeper decodes; without one it is left out.
    #[test]
    fn batched_runs_pair_with_batch_one_decode_of_their_length() {
        let results = [
            result("pp512", 512, 1, 0, 9000.0),
            result("tg32 @ d4096", 32, 1, 4096, 400.0),
            result("tg32", 32, 1, 0, 700.0),
            result("tg64", 64, 1, 0, 650.0),
            result("tg32 x64", 32, 64, 32, 15_400.0),
            result("tg64 x8", 64, 8, 32, 3_250.0),
            result("tg16 x8", 16, 8, 32, 3_000.0),
        ];
        let got = batch_speedups(&results);
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!((got[0].0, got[0].1), ("tg32 x64", "tg32"));
        assert!((got[0].2 - 22.0).abs() < 1e-9, "{got:?}");
        assert_eq!((got[1].0, got[1].1), ("tg64 x8", "tg64"));
        assert!((got[1].2 - 5.0).abs() < 1e-9, "{got:?}");
    }
}
