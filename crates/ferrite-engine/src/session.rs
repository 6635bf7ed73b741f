//! A session: one conversation's KV cache on an executor, and the generation loop.

use crate::sampling::{Sampler, SamplerParams};
use anyhow::{bail, Result};
use ferrite_model::Executor;
use std::time::{Duration, Instant};

pub struct Session {
    exec: Box<dyn Executor>,
    /// Tokens whose K/V are in the cache, in position order.
    cached: Vec<u32>,
    /// `FERRITE_DECODE_AHEAD`: `sample_ahead` may enqueue the next step before the token is back.
    decode_ahead: bool,
}

/// Timings of one `generate` call.
#[derive(Clone, Debug, Default)]
pub struct GenStats {
    pub prompt_tokens: usize,
    /// Prompt tokens actually computed (the rest were reused from the cache).
    pub prompt_computed: usize,
    pub prompt_time: Duration,
    pub generated: usize,
    pub gen_time: Duration,
    pub stop: StopReason,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StopReason {
    #[default]
    MaxTokens,
    EndOfGeneration,
    ContextFull,
    Callback,
}

impl GenStats {
    pub fn prompt_tps(&self) -> f64 {
        self.prompt_computed as f64 / self.prompt_time.as_secs_f64().max(1e-9)
    }

    /// Decode speed: the first generated token comes from the prompt's logits, so it is not counted.
    pub fn gen_tps(&self) -> f64 {
        self.generated.saturating_sub(1) as f64 / self.gen_time.as_secs_f64().max(1e-9)
    }
}

impl Session {
    pub fn new(exec: Box<dyn Executor>) -> Self {
        Self { exec, cached: Vec::new(), decode_ahead: ferrite_core::env::DECODE_AHEAD.flag() }
    }

    /// Override `FERRITE_DECODE_AHEAD` for this session (A/B comparisons, tests).
    pub fn set_decode_ahead(&mut self, on: bool) {
        self.decode_ahead = on;
    }

    pub fn executor(&mut self) -> &mut dyn Executor {
        &mut *self.exec
    }

    pub fn context_len(&self) -> usize {
        self.exec.context_len()
    }

    /// Tokens currently held in the KV cache.
    pub fn cached_tokens(&self) -> &[u32] {
        &self.cached
    }

    pub fn reset(&mut self) {
        self.cached.clear();
    }

    /// Warm the backend's decode path up before the first prompt ([`Executor::warm_up`]); the
    /// cache then holds nothing reusable.
    pub fn warm_up(&mut self) -> Result<()> {
        self.cached.clear();
        self.exec.warm_up()
    }

    /// Make the cache hold exactly `tokens` and the logits be those of the last one. The longest
    /// common prefix with what is cached is reused (at least the last token is recomputed). With
    /// recurrent layers (Gated DeltaNet) only the whole cache can be reused, when it is a strict
    /// prefix of `tokens`; otherwise everything is recomputed from position 0.
    /// Returns how many tokens were computed.
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<usize> {
        if tokens.is_empty() {
            bail!("empty prompt: nothing to process");
        }
        if tokens.len() > self.context_len() {
            bail!("prompt of {} tokens does not fit in the context of {} tokens", tokens.len(), self.context_len());
        }
        let mut common = self.cached.iter().zip(tokens).take_while(|(a, b)| a == b).count().min(tokens.len() - 1);
        let recurrent = self.exec.has_recurrent_state();
        if recurrent && common != self.cached.len() {
            // A recurrent state cannot be rewound: reuse the cache only when all of it is a
            // prefix of the new prompt (a conversation that goes on), else start over.
            common = 0;
        }
        self.cached.truncate(common);
        let result = self.exec.forward(&tokens[common..], common);
        if result.is_err() {
            // The cache beyond `common` may be partially written: forget it (all of it when a
            // recurrent state may be half-updated).
            if recurrent {
                self.cached.clear();
            }
            return result.map(|_| 0);
        }
        self.cached.extend_from_slice(&tokens[common..]);
        Ok(tokens.len() - common)
    }

    /// Append one token to the cache.
    pub fn step(&mut self, token: u32) -> Result<()> {
        if self.cached.len() >= self.context_len() {
            bail!("context full ({} tokens)", self.context_len());
        }
        if let Err(e) = self.exec.forward(&[token], self.cached.len()) {
            if self.exec.has_recurrent_state() {
                self.cached.clear();
            }
            return Err(e);
        }
        self.cached.push(token);
        Ok(())
    }

    /// Choose the next token from the current logits.
    pub fn sample(&mut self, sampler: &mut Sampler, history: &[u32], step: u64) -> Result<u32> {
        Ok(self.sample_ahead(sampler, history, step, false)?.0)
    }

    /// Choose the next token from the current logits; with `ahead`, where the backend samples on
    /// the device, also append it to the cache, enqueued before the token is read back, so the
    /// device goes from one step to the next without waiting for the host (the token is then
    /// appended even if the caller stops at it). Returns the token and whether it was appended.
    pub fn sample_ahead(&mut self, sampler: &mut Sampler, history: &[u32], step: u64, ahead: bool) -> Result<(u32, bool)> {
        let ahead = ahead && self.decode_ahead && self.cached.len() < self.context_len();
        let p = sampler.params();
        // The device sampler covers temperature/top-k/top-p/min-p; a repetition penalty needs the
        // host path.
        if let Some(d) = p.on_device(step) {
            let next_pos = ahead.then_some(self.cached.len());
            if let Some(drawn) = self.exec.sample_and_step(&d, next_pos) {
                if drawn.is_err() && ahead && self.exec.has_recurrent_state() {
                    self.cached.clear();
                }
                let tok = drawn?;
                if ahead {
                    self.cached.push(tok);
                }
                return Ok((tok, ahead));
            }
            if let Some(tok) = self.exec.sample_on_device(&d) {
                return Ok((tok?, false));
            }
        }
        let mut logits = self.exec.logits()?;
        Ok((sampler.sample(&mut logits, history), false))
    }

    /// Process `prompt`, then sample up to `max_new` tokens. `on_token` gets each new token and
    /// returns false to stop; `is_end` marks end-of-generation tokens (not passed to `on_token`).
    pub fn generate(
        &mut self,
        prompt: &[u32],
        max_new: usize,
        params: &SamplerParams,
        is_end: impl Fn(u32) -> bool,
        mut on_token: impl FnMut(u32) -> bool,
    ) -> Result<GenStats> {
        let mut sampler = Sampler::new(params.clone());
        let mut stats = GenStats { prompt_tokens: prompt.len(), ..GenStats::default() };
        let t0 = Instant::now();
        stats.prompt_computed = self.prefill(prompt)?;
        stats.prompt_time = t0.elapsed();
        let t1 = Instant::now();
        let mut history = prompt.to_vec();
        for i in 0..max_new {
            // Each token but the last one asked for is appended as it is drawn where the device
            // can run ahead (`sample_ahead`), else after the checks below.
            let (tok, appended) = self.sample_ahead(&mut sampler, &history, i as u64, i + 1 < max_new)?;
            if is_end(tok) {
                stats.stop = StopReason::EndOfGeneration;
                break;
            }
            stats.generated += 1;
            history.push(tok);
            if !on_token(tok) {
                stats.stop = StopReason::Callback;
                break;
            }
            if i + 1 == max_new {
                break;
            }
            if !appended {
                if self.cached.len() >= self.context_len() {
                    stats.stop = StopReason::ContextFull;
                    break;
                }
                self.step(tok)?;
            }
        }
        stats.gen_time = t1.elapsed();
        Ok(stats)
    }
}
