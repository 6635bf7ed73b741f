//! Counters, gauges and histograms the serving engine updates as it runs (read by the server's
//! `/metrics` endpoint and by tests).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

/// A cumulative histogram with fixed upper bounds (Prometheus style).
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    inner: Mutex<HistState>,
}

#[derive(Clone, Debug, Default)]
struct HistState {
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

/// A snapshot: cumulative counts per bound (`le`), then the total count and sum.
#[derive(Clone, Debug, PartialEq)]
pub struct HistogramSnapshot {
    pub buckets: Vec<(f64, u64)>,
    pub count: u64,
    pub sum: f64,
}

impl HistogramSnapshot {
    /// Upper bound of the bucket holding quantile `q` (`inf` if past the last bound).
    pub fn quantile_bound(&self, q: f64) -> f64 {
        let want = (q * self.count as f64).ceil() as u64;
        self.buckets.iter().find(|(_, c)| *c >= want).map_or(f64::INFINITY, |(b, _)| *b)
    }
}

impl Histogram {
    pub const fn new(bounds: &'static [f64]) -> Self {
        Self { bounds, inner: Mutex::new(HistState { counts: Vec::new(), sum: 0.0, count: 0 }) }
    }

    pub fn observe(&self, v: f64) {
        let mut s = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if s.counts.is_empty() {
            s.counts = vec![0; self.bounds.len()];
        }
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            s.counts[i] += 1;
        }
        s.sum += v;
        s.count += 1;
    }

    pub fn snapshot(&self) -> HistogramSnapshot {
        let s = self.inner.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let mut acc = 0;
        let buckets = self
            .bounds
            .iter()
            .enumerate()
            .map(|(i, &b)| {
                acc += s.counts.get(i).copied().unwrap_or(0);
                (b, acc)
            })
            .collect();
        HistogramSnapshot { buckets, count: s.count, sum: s.sum }
    }
}

/// Seconds, from 1 ms to 60 s.
pub const LATENCY_BOUNDS: &[f64] =
    &[0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0];

/// Everything the engine reports. Gauges are set by the scheduler after every step.
#[derive(Debug)]
pub struct EngineMetrics {
    /// Requests waiting to be scheduled (including preempted ones).
    pub waiting: AtomicU64,
    /// Sequences in the running batch.
    pub running: AtomicU64,
    pub kv_blocks_total: AtomicU64,
    /// Blocks referenced by a sequence.
    pub kv_blocks_in_use: AtomicU64,
    /// Unreferenced blocks kept for the prefix cache.
    pub kv_blocks_cached: AtomicU64,
    pub requests_admitted: AtomicU64,
    pub requests_finished: AtomicU64,
    pub requests_cancelled: AtomicU64,
    pub requests_failed: AtomicU64,
    pub prompt_tokens: AtomicU64,
    /// Prompt tokens whose K/V came from the prefix cache.
    pub prefix_cache_hit_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    pub preemptions: AtomicU64,
    pub steps: AtomicU64,
    /// Generated tokens per second over the last second or so (f64 bits).
    tokens_per_second: AtomicU64,
    /// Time from a request's arrival to its first token.
    pub ttft: Histogram,
    /// Time between consecutive tokens of a sequence.
    pub tpot: Histogram,
    /// Time from arrival to the last token.
    pub e2e: Histogram,
}

impl Default for EngineMetrics {
    fn default() -> Self {
        Self {
            waiting: AtomicU64::new(0),
            running: AtomicU64::new(0),
            kv_blocks_total: AtomicU64::new(0),
            kv_blocks_in_use: AtomicU64::new(0),
            kv_blocks_cached: AtomicU64::new(0),
            requests_admitted: AtomicU64::new(0),
            requests_finished: AtomicU64::new(0),
            requests_cancelled: AtomicU64::new(0),
            requests_failed: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            prefix_cache_hit_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            preemptions: AtomicU64::new(0),
            steps: AtomicU64::new(0),
            tokens_per_second: AtomicU64::new(0f64.to_bits()),
            ttft: Histogram::new(LATENCY_BOUNDS),
            tpot: Histogram::new(LATENCY_BOUNDS),
            e2e: Histogram::new(LATENCY_BOUNDS),
        }
    }
}

impl EngineMetrics {
    pub fn tokens_per_second(&self) -> f64 {
        f64::from_bits(self.tokens_per_second.load(Relaxed))
    }

    pub(crate) fn set_tokens_per_second(&self, v: f64) {
        self.tokens_per_second.store(v.to_bits(), Relaxed);
    }

    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative() {
        let h = Histogram::new(&[1.0, 2.0, 4.0]);
        for v in [0.5, 1.5, 1.7, 3.0, 10.0] {
            h.observe(v);
        }
        let s = h.snapshot();
        assert_eq!(s.buckets, vec![(1.0, 1), (2.0, 3), (4.0, 4)]);
        assert_eq!(s.count, 5);
        assert!((s.sum - 16.7).abs() < 1e-9);
        assert_eq!(s.quantile_bound(0.5), 2.0);
        assert_eq!(s.quantile_bound(1.0), f64::INFINITY);
    }
}
