//! llama-bench style measurements: prompt processing (pp N) and token generation (tg N).

use crate::sampling::{Sampler, SamplerParams};
use ferrite_model::graph::Op;
use ferrite_model::Model;
use crate::session::Session;
use anyhow::Result;
use std::time::Instant;

#[derive(Clone, Debug)]
pub struct BenchResult {
    pub test: String,
    pub tokens: usize,
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

/// Deterministic token ids for benchmarking (content does not change the work done).
fn bench_tokens(n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 7919 + 13) % vocab) as u32).collect()
}

/// Prompt processing: `n` tokens from an empty cache, one forward pass.
pub fn bench_pp(session: &mut Session, n: usize, reps: usize, vocab: usize) -> Result<BenchResult> {
    let tokens = bench_tokens(n, vocab);
    let mut samples = Vec::new();
    for rep in 0..=reps {
        session.reset();
        let t = Instant::now();
        session.prefill(&tokens)?;
        session.executor().logits()?;
        let tps = n as f64 / t.elapsed().as_secs_f64();
        if rep > 0 {
            samples.push(tps);
        }
    }
    Ok(BenchResult { test: format!("pp{n}"), tokens: n, samples })
}

/// Token generation: `n` single-token steps from an empty cache, each followed by greedy
/// sampling (on the device where the backend can), as a generation loop does.
pub fn bench_tg(session: &mut Session, n: usize, reps: usize, vocab: usize) -> Result<BenchResult> {
    let mut samples = Vec::new();
    let mut sampler = Sampler::new(SamplerParams::greedy());
    for rep in 0..=reps {
        session.reset();
        let mut tok = bench_tokens(1, vocab)[0];
        let t = Instant::now();
        for i in 0..n {
            session.step(tok)?;
            tok = session.sample(&mut sampler, &[], i as u64)?;
        }
        let tps = n as f64 / t.elapsed().as_secs_f64();
        if rep > 0 {
            samples.push(tps);
        }
    }
    Ok(BenchResult { test: format!("tg{n}"), tokens: n, samples })
}

/// The least work a token costs, for expressing speed as a fraction of the hardware limit.
#[derive(Clone, Copy, Debug)]
pub struct TokenWork {
    /// Weight bytes a decode step must read: every weight of every linear, once (GGUF sizes).
    pub weight_bytes: usize,
    /// Matrix FLOPs per token of the linears (2 per multiply-add).
    pub linear_flops: f64,
    /// Attention FLOPs per token per position of context (QK and PV, all layers and heads).
    pub attention_flops_per_position: f64,
}

impl TokenWork {
    pub fn of(model: &Model) -> Self {
        let mut weight_bytes = 0;
        let mut linear_flops = 0.0;
        for op in &model.graph.ops {
            if let Op::Linear { w, .. } | Op::GatedLinear { w, .. } = op {
                let spec = model.weights.spec(*w);
                weight_bytes += spec.rows * spec.dtype.row_bytes(spec.cols).unwrap_or(0);
                linear_flops += 2.0 * (spec.rows * spec.cols) as f64;
            }
        }
        let a = model.graph.attention;
        let attention_flops_per_position = 4.0 * (model.graph.n_layers * a.n_heads * a.head_dim) as f64;
        Self { weight_bytes, linear_flops, attention_flops_per_position }
    }

    /// Bytes per token of a decode run of `n` tokens from an empty cache (weights + the KV cache
    /// read at the average context length).
    pub fn decode_bytes(&self, n: usize, kv_bytes_per_position: usize) -> f64 {
        self.weight_bytes as f64 + kv_bytes_per_position as f64 * (n as f64 + 1.0) / 2.0
    }

    /// FLOPs per token of processing an `n`-token prompt (causal: average context n/2).
    pub fn prompt_flops(&self, n: usize) -> f64 {
        self.linear_flops + self.attention_flops_per_position * (n as f64 + 1.0) / 2.0
    }
}
