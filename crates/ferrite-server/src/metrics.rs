//! `/metrics`: the engine's counters, gauges and histograms in the Prometheus text format, plus
//! HTTP responses by route and status.

use ferrite_engine::metrics::{EngineMetrics, HistogramSnapshot};
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;

#[derive(Default)]
pub struct HttpMetrics {
    responses: Mutex<BTreeMap<(String, u16), u64>>,
}

impl HttpMetrics {
    pub fn count(&self, path: &str, status: u16) {
        // Unknown paths are folded into one label so clients cannot grow the map without bound.
        let known = ["/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"];
        let path = if known.contains(&path) { path } else { "other" };
        let mut m = self.responses.lock().unwrap_or_else(|e| e.into_inner());
        *m.entry((path.to_string(), status)).or_default() += 1;
    }
}

fn counter(out: &mut String, name: &str, help: &str, v: &AtomicU64) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}", EngineMetrics::get(v));
}

fn gauge(out: &mut String, name: &str, help: &str, v: f64) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
}

fn histogram(out: &mut String, name: &str, help: &str, h: &HistogramSnapshot) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
    for (le, c) in &h.buckets {
        let _ = writeln!(out, "{name}_bucket{{le=\"{le}\"}} {c}");
    }
    let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}", h.count, h.sum, h.count);
}

pub fn render(m: &EngineMetrics, http: &HttpMetrics) -> String {
    let mut out = String::new();
    let g = |v: &AtomicU64| EngineMetrics::get(v) as f64;
    gauge(&mut out, "ferrite_queue_depth", "Requests waiting to be scheduled (preempted ones included).", g(&m.waiting));
    gauge(&mut out, "ferrite_running_sequences", "Sequences in the running batch.", g(&m.running));
    gauge(&mut out, "ferrite_kv_blocks_total", "Blocks of the paged KV cache.", g(&m.kv_blocks_total));
    gauge(&mut out, "ferrite_kv_blocks_in_use", "KV blocks referenced by a sequence.", g(&m.kv_blocks_in_use));
    gauge(&mut out, "ferrite_kv_blocks_cached", "KV blocks indexed by the prefix cache.", g(&m.kv_blocks_cached));
    gauge(&mut out, "ferrite_generation_tokens_per_second", "Generated tokens per second over the last second of work.", m.tokens_per_second());
    counter(&mut out, "ferrite_requests_admitted_total", "Requests that entered the running batch.", &m.requests_admitted);
    counter(&mut out, "ferrite_requests_finished_total", "Requests that finished (stop token or length).", &m.requests_finished);
    counter(&mut out, "ferrite_requests_cancelled_total", "Requests cancelled (client gone, stop string).", &m.requests_cancelled);
    counter(&mut out, "ferrite_requests_failed_total", "Requests that ended with an engine error.", &m.requests_failed);
    counter(&mut out, "ferrite_prompt_tokens_total", "Prompt tokens of admitted requests.", &m.prompt_tokens);
    counter(&mut out, "ferrite_prefix_cache_hit_tokens_total", "Prompt tokens whose K/V came from the prefix cache.", &m.prefix_cache_hit_tokens);
    counter(&mut out, "ferrite_generation_tokens_total", "Generated tokens.", &m.generation_tokens);
    counter(&mut out, "ferrite_preemptions_total", "Sequences preempted (to be recomputed) for lack of KV blocks.", &m.preemptions);
    counter(&mut out, "ferrite_engine_steps_total", "Batched forward steps.", &m.steps);
    histogram(&mut out, "ferrite_time_to_first_token_seconds", "Time from arrival to the first generated token.", &m.ttft.snapshot());
    histogram(&mut out, "ferrite_time_per_output_token_seconds", "Time between consecutive tokens of a sequence.", &m.tpot.snapshot());
    histogram(&mut out, "ferrite_request_latency_seconds", "Time from arrival to the last token.", &m.e2e.snapshot());
    let _ = writeln!(out, "# HELP ferrite_http_responses_total HTTP responses by route and status.\n# TYPE ferrite_http_responses_total counter");
    for ((path, status), n) in http.responses.lock().unwrap_or_else(|e| e.into_inner()).iter() {
        let _ = writeln!(out, "ferrite_http_responses_total{{path=\"{path}\",code=\"{status}\"}} {n}");
    }
    out
}
