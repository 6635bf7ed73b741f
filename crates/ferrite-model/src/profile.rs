//! Per-op timing for `FERRITE_PROFILE=1`, shared by the backends' executors.
//!
//! Profiling changes what it measures (the GPU backend brackets every op with events and waits
//! for them), so its numbers explain where time goes but are never optimisation targets: those
//! come from `ferrite bench` without profiling.

use std::collections::BTreeMap;

#[derive(Default, Debug)]
pub struct OpProfile {
    /// Op label (its kind, and for the CUDA backend the value it writes) → (total ms, calls).
    by_kind: BTreeMap<String, (f64, usize)>,
    forwards: usize,
}

impl OpProfile {
    /// A profile if `FERRITE_PROFILE=1`, else `None`.
    pub fn from_env() -> Option<Self> {
        ferrite_core::env::PROFILE.flag().then(Self::default)
    }

    pub fn add(&mut self, kind: &str, ms: f64) {
        let e = self.by_kind.entry(kind.to_string()).or_default();
        e.0 += ms;
        e.1 += 1;
    }

    pub fn end_forward(&mut self) {
        self.forwards += 1;
    }

    pub fn report(&self, backend: &str) -> String {
        let total: f64 = self.by_kind.values().map(|v| v.0).sum();
        let mut rows: Vec<_> = self.by_kind.iter().collect();
        rows.sort_by(|a, b| b.1 .0.total_cmp(&a.1 .0));
        let mut s = format!(
            "per-op profile ({backend}, {} forward calls) — WARNING: profiled timings are not optimisation targets; measure with `ferrite bench`\n{:<40} {:>10} {:>8} {:>10} {:>7}\n",
            self.forwards, "op", "total ms", "calls", "µs/call", "share"
        );
        for (kind, (ms, n)) in rows {
            s += &format!("{kind:<40} {ms:>10.2} {n:>8} {:>10.1} {:>6.1}%\n", 1000.0 * ms / *n as f64, 100.0 * ms / total.max(1e-12));
        }
        s
    }
}
