//! llama-bench style measurements: prompt processing (pp N) and token generation (tg N).

use crate::sampling::{Sampler, SamplerParams};
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
