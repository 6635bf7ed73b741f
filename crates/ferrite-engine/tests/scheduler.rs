//! The continuous-batching engine on the real SmolLM2 model: greedy outputs equal
//! `Session::generate`'s whatever the batching (chunked prefill, queueing, preemption, prefix
//! cache), cancellation frees everything, and no KV block leaks.

mod common;

use common::smollm2;
use ferrite_cpu::{CpuExecutor, CpuPrecision};
use ferrite_engine::metrics::EngineMetrics;
use ferrite_engine::{EngineConfig, EngineHandle, FinishReason, GenEvent, GenRequest, SamplerParams, Session, SubmitError};
use ferrite_model::{Executor, ExecutorOptions, FusionOptions, Model};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn options() -> ExecutorOptions {
    ExecutorOptions { max_batch: 64, context_len: 256, trace: false, progress: None }
}

fn start(model: &Arc<Model>, config: EngineConfig) -> EngineHandle {
    let m = Arc::clone(model);
    let make = move || -> anyhow::Result<Box<dyn Executor>> { Ok(Box::new(CpuExecutor::new(m, CpuPrecision::Quantized, options())?)) };
    EngineHandle::start(make, config).unwrap().0
}

fn config() -> EngineConfig {
    EngineConfig { block_size: 16, n_blocks: 64, max_seqs: 3, max_batch_tokens: 32, max_queue: 16, max_context: 256, prefix_cache: true, state_snapshots: 0, snapshot_stride: 0 }
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| (i * 7919 + seed * 104_729) % 40_000 + 100).collect()
}

fn greedy(prompt: Vec<u32>, max_tokens: usize) -> GenRequest {
    GenRequest {
        prompt,
        max_tokens,
        sampling: SamplerParams::greedy(),
        presence_penalty: 0.0,
        frequency_penalty: 0.0,
        logit_bias: vec![],
        logprobs: None,
        stop_tokens: vec![],
    }
}

/// What `Session::generate` produces alone.
fn reference(model: &Arc<Model>, prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    let mut s = Session::new(Box::new(CpuExecutor::new(Arc::clone(model), CpuPrecision::Quantized, options()).unwrap()));
    let mut out = vec![];
    s.generate(prompt, max_tokens, &SamplerParams::greedy(), |_| false, |t| {
        out.push(t);
        true
    })
    .unwrap();
    out
}

struct Outcome {
    tokens: Vec<u32>,
    reason: FinishReason,
    cached: usize,
    completion_tokens: usize,
}

fn collect(mut rx: tokio::sync::mpsc::UnboundedReceiver<GenEvent>) -> Outcome {
    let mut tokens = vec![];
    let mut cached = 0;
    loop {
        match rx.blocking_recv().expect("the engine ended a stream without Finished") {
            GenEvent::Started { cached_tokens } => cached = cached_tokens,
            GenEvent::Token { id, .. } => tokens.push(id),
            GenEvent::Finished { reason, usage } => return Outcome { completion_tokens: usage.completion_tokens, tokens, reason, cached },
            GenEvent::Error(e) => panic!("engine error: {e}"),
        }
    }
}

fn wait_idle(m: &EngineMetrics) {
    let t = Instant::now();
    while (EngineMetrics::get(&m.running) > 0 || EngineMetrics::get(&m.kv_blocks_in_use) > 0 || EngineMetrics::get(&m.waiting) > 0) && t.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(EngineMetrics::get(&m.running), 0, "sequences still running");
    assert_eq!(EngineMetrics::get(&m.kv_blocks_in_use), 0, "KV blocks leaked");
}

#[test]
fn batched_greedy_equals_session_generate() {
    let model = smollm2(FusionOptions::ALL);
    let engine = start(&model, config());
    // Five requests, three running at most; the 70-token prompt is prefilled over several steps.
    let cases = [(1, 5, 10), (2, 70, 12), (3, 17, 6), (4, 33, 9), (5, 2, 14)];
    let rxs: Vec<_> = cases.iter().map(|&(s, l, n)| engine.submit(greedy(prompt(s, l), n)).unwrap()).collect();
    for ((s, l, n), rx) in cases.into_iter().zip(rxs) {
        let got = collect(rx);
        assert_eq!(got.tokens, reference(&model, &prompt(s, l), n), "request {s}");
        assert_eq!((got.reason, got.completion_tokens), (FinishReason::Length, n));
    }
    wait_idle(engine.metrics());
    assert_eq!(EngineMetrics::get(&engine.metrics().requests_finished), 5);
}

#[test]
fn preemption_by_recompute_keeps_outputs_exact() {
    let model = smollm2(FusionOptions::ALL);
    // 64-token context: 4 blocks per sequence, 6 blocks for three growing sequences.
    let cfg = EngineConfig { n_blocks: 6, max_context: 64, max_seqs: 3, ..config() };
    let engine = start(&model, cfg);
    let cases = [(7, 14, 30), (8, 20, 30), (9, 9, 30)];
    let rxs: Vec<_> = cases.iter().map(|&(s, l, n)| engine.submit(greedy(prompt(s, l), n)).unwrap()).collect();
    for ((s, l, n), rx) in cases.into_iter().zip(rxs) {
        assert_eq!(collect(rx).tokens, reference(&model, &prompt(s, l), n), "request {s}");
    }
    let m = engine.metrics();
    assert!(EngineMetrics::get(&m.preemptions) > 0, "the cache was large enough: nothing was preempted");
    wait_idle(m);
}

/// A hybrid model (Gated DeltaNet layers beside attention) served: every running sequence keeps
/// its recurrent state in a slot of its own; the outputs equal `Session::generate`'s through
/// chunked prefills, queueing and preemption by recompute (a preempted sequence gets a fresh slot
/// and starts over). The prefix cache, which would skip a prompt's recurrence, is refused without
/// state snapshots.
#[test]
fn hybrid_models_are_served_with_a_state_slot_per_sequence() {
    let model = Arc::new(Model::load(common::workspace_root().join("fixtures/tiny/qwen35.gguf"), FusionOptions::ALL).unwrap());
    let vocab = model.config.vocab_size as u32;
    let m = Arc::clone(&model);
    let make = move || -> anyhow::Result<Box<dyn Executor>> { Ok(Box::new(CpuExecutor::new(m, CpuPrecision::Quantized, options())?)) };
    let err = EngineHandle::start(make, config()).err().expect("the prefix cache must be refused");
    assert!(err.to_string().contains("needs state snapshots"), "{err}");
    let cfg = EngineConfig { n_blocks: 6, max_context: 64, max_seqs: 3, prefix_cache: false, ..config() };
    let engine = start(&model, cfg);
    let cases = [(7, 14, 30), (8, 40, 20), (9, 9, 30), (10, 3, 12)];
    let prompt_of = |s: u32, l: usize| -> Vec<u32> { prompt(s, l).iter().map(|t| t % vocab).collect() };
    let rxs: Vec<_> = cases.iter().map(|&(s, l, n)| engine.submit(greedy(prompt_of(s, l), n)).unwrap()).collect();
    for ((s, l, n), rx) in cases.into_iter().zip(rxs) {
        assert_eq!(collect(rx).tokens, reference(&model, &prompt_of(s, l), n), "request {s}");
    }
    let m = engine.metrics();
    assert!(EngineMetrics::get(&m.preemptions) > 0, "the cache was large enough: nothing was preempted");
    wait_idle(m);
}

#[test]
fn repeated_prefix_is_served_from_the_cache() {
    let model = smollm2(FusionOptions::ALL);
    let engine = start(&model, config());
    let p = prompt(11, 40);
    let first = collect(engine.submit(greedy(p.clone(), 5)).unwrap());
    let second = collect(engine.submit(greedy(p.clone(), 5)).unwrap());
    assert_eq!(first.cached, 0);
    assert_eq!(second.cached, 32, "two full blocks of 16 reused");
    assert_eq!(first.tokens, second.tokens);
    // A different continuation of the same prefix shares its first two blocks too.
    let mut q = p[..36].to_vec();
    q.extend([5, 6, 7, 8, 9]);
    let third = collect(engine.submit(greedy(q.clone(), 5)).unwrap());
    assert_eq!(third.cached, 32);
    assert_eq!(third.tokens, reference(&model, &q, 5));
    assert_eq!(EngineMetrics::get(&engine.metrics().prefix_cache_hit_tokens), 64);
    wait_idle(engine.metrics());
    // With the prefix cache off nothing is reused.
    let engine = start(&model, EngineConfig { prefix_cache: false, ..config() });
    collect(engine.submit(greedy(p.clone(), 5)).unwrap());
    assert_eq!(collect(engine.submit(greedy(p, 5)).unwrap()).cached, 0);
}

/// The prefix cache of a hybrid model: a sequence's recurrent state is kept every
/// `snapshot_stride` tokens, and a later prompt with the same start skips its cached prefix up to
/// the last kept state, not further (a longer cached KV prefix without its state is computed
/// again); the tokens equal `Session::generate`'s.
#[test]
fn hybrid_prefix_cache_restores_kept_states() {
    let model = Arc::new(Model::load(common::workspace_root().join("fixtures/tiny/qwen35.gguf"), FusionOptions::ALL).unwrap());
    let vocab = model.config.vocab_size as u32;
    let prompt_of = |s: u32, l: usize| -> Vec<u32> { prompt(s, l).iter().map(|t| t % vocab).collect() };
    let engine = start(&model, EngineConfig { state_snapshots: 2, snapshot_stride: 32, ..config() });
    let p = prompt_of(21, 75);
    let first = collect(engine.submit(greedy(p.clone(), 6)).unwrap());
    assert_eq!(first.cached, 0);
    assert_eq!(first.tokens, reference(&model, &p, 6));
    // 4 whole blocks of its first 64 tokens are cached, with the state after them.
    let mut q = p[..70].to_vec();
    q.extend([5, 6, 7]);
    let second = collect(engine.submit(greedy(q.clone(), 6)).unwrap());
    assert_eq!(second.cached, 64);
    assert_eq!(second.tokens, reference(&model, &q, 6));
    // 3 whole blocks match, but the state is kept after 2 (32 tokens) and 4.
    let mut r = p[..48].to_vec();
    r.extend([9, 8, 7]);
    let third = collect(engine.submit(greedy(r.clone(), 6)).unwrap());
    assert_eq!(third.cached, 32);
    assert_eq!(third.tokens, reference(&model, &r, 6));
    assert_eq!(EngineMetrics::get(&engine.metrics().prefix_cache_hit_tokens), 96);
    wait_idle(engine.metrics());
    // A stride that is not a multiple of the block size is refused.
    let m = Arc::clone(&model);
    let make = move || -> anyhow::Result<Box<dyn Executor>> { Ok(Box::new(CpuExecutor::new(m, CpuPrecision::Quantized, options())?)) };
    let err = EngineHandle::start(make, EngineConfig { state_snapshots: 2, snapshot_stride: 24, ..config() }).err().expect("a stride of 24");
    assert!(err.to_string().contains("multiple of the block size"), "{err}");
}

#[test]
fn dropping_the_receiver_cancels_and_frees_blocks() {
    let model = smollm2(FusionOptions::ALL);
    let engine = start(&model, config());
    let mut rx = engine.submit(greedy(prompt(12, 30), 200)).unwrap();
    let mut seen = 0;
    while seen < 2 {
        if let Some(GenEvent::Token { .. }) = rx.blocking_recv() {
            seen += 1;
        }
    }
    drop(rx);
    wait_idle(engine.metrics());
    assert_eq!(EngineMetrics::get(&engine.metrics().requests_cancelled), 1);
    // The engine keeps serving.
    assert_eq!(collect(engine.submit(greedy(prompt(13, 4), 3)).unwrap()).tokens.len(), 3);
}

#[test]
fn stop_tokens_end_generation_and_bad_submissions_are_refused() {
    let model = smollm2(FusionOptions::ALL);
    let engine = start(&model, EngineConfig { max_queue: 0, ..config() });
    assert_eq!(engine.submit(greedy(prompt(1, 3), 3)).unwrap_err(), SubmitError::QueueFull);
    let engine = start(&model, config());
    assert!(matches!(engine.submit(greedy(vec![], 3)), Err(SubmitError::BadPrompt(_))));
    assert!(matches!(engine.submit(greedy(prompt(1, 256), 3)), Err(SubmitError::BadPrompt(_))));
    // Stop at the third greedy token.
    let want = reference(&model, &prompt(14, 8), 5);
    let req = GenRequest { stop_tokens: vec![want[2]], ..greedy(prompt(14, 8), 5) };
    let got = collect(engine.submit(req).unwrap());
    assert_eq!(got.reason, FinishReason::Stop);
    assert_eq!(got.tokens, want[..want.iter().position(|&t| t == want[2]).unwrap()].to_vec());
    wait_idle(engine.metrics());
}

/// A backend double: no batched serving at all, or one whose batched step panics.
struct FakeBackend {
    paged: bool,
}

impl Executor for FakeBackend {
    fn describe(&self) -> String {
        "fake".into()
    }
    fn forward(&mut self, _: &[u32], _: usize) -> anyhow::Result<()> {
        Ok(())
    }
    fn logits(&mut self) -> anyhow::Result<Vec<f32>> {
        Ok(vec![0.0; 4])
    }
    fn traces(&mut self) -> anyhow::Result<Vec<ferrite_model::LayerTrace>> {
        Ok(vec![])
    }
    fn context_len(&self) -> usize {
        256
    }
    fn kv_bytes_per_position(&self) -> usize {
        8
    }
    fn memory_report(&self) -> String {
        String::new()
    }
    fn init_paged(&mut self, _: ferrite_model::PagedKvConfig) -> anyhow::Result<()> {
        if self.paged {
            Ok(())
        } else {
            anyhow::bail!("backend fake does not support batched serving yet")
        }
    }
    fn forward_paged(&mut self, _: &[ferrite_model::SeqChunk<'_>]) -> anyhow::Result<Vec<Vec<f32>>> {
        panic!("simulated backend crash");
    }
}

#[test]
fn a_backend_without_batching_is_refused_and_a_dead_engine_is_reported() {
    let err = EngineHandle::start(|| Ok(Box::new(FakeBackend { paged: false }) as Box<dyn Executor>), config()).err().expect("start must fail");
    assert!(err.to_string().contains("does not support batched serving yet"), "{err}");
    let (engine, thread) = EngineHandle::start(|| Ok(Box::new(FakeBackend { paged: true }) as Box<dyn Executor>), config()).unwrap();
    assert!(engine.is_alive());
    let mut rx = engine.submit(greedy(prompt(1, 4), 3)).unwrap();
    // The request in flight ends (its sender is dropped by the unwinding thread) instead of hanging.
    while let Some(e) = rx.blocking_recv() {
        assert!(matches!(e, GenEvent::Started { .. }), "{e:?}");
    }
    assert!(thread.join().is_err(), "the engine thread should have panicked");
    assert!(!engine.is_alive());
    assert_eq!(engine.submit(greedy(prompt(1, 4), 3)).unwrap_err(), SubmitError::Stopped);
}

/// The CPU executor with a stand-in for a device sampler: a sequence the engine asks to sample
/// gets its greedy token instead of its logits (as the CUDA executor returns it), and every
/// request is counted. Steps asked to run ahead (`forward_paged_ahead`) are checked (the next
/// position of every sequence, a table that extends the step's and covers it), counted, and
/// counted again as taken when the next batch is exactly that step.
struct SamplesOnDevice {
    inner: CpuExecutor,
    requests: Arc<std::sync::atomic::AtomicUsize>,
    block_size: usize,
    /// The step asked for ahead: each sequence's (position, table).
    pending: Option<Vec<(usize, Vec<u32>)>>,
    /// (steps asked to run ahead, of those taken by the next batch, of those whose next batch
    /// had the same rows but other tables)
    ahead: Arc<[std::sync::atomic::AtomicUsize; 3]>,
}

impl SamplesOnDevice {
    fn new(inner: CpuExecutor, requests: Arc<std::sync::atomic::AtomicUsize>) -> Self {
        Self { inner, requests, block_size: 0, pending: None, ahead: Arc::default() }
    }
}

impl Executor for SamplesOnDevice {
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn forward(&mut self, tokens: &[u32], start_pos: usize) -> anyhow::Result<()> {
        self.inner.forward(tokens, start_pos)
    }
    fn logits(&mut self) -> anyhow::Result<Vec<f32>> {
        self.inner.logits()
    }
    fn traces(&mut self) -> anyhow::Result<Vec<ferrite_model::LayerTrace>> {
        self.inner.traces()
    }
    fn context_len(&self) -> usize {
        self.inner.context_len()
    }
    fn kv_bytes_per_position(&self) -> usize {
        self.inner.kv_bytes_per_position()
    }
    fn memory_report(&self) -> String {
        self.inner.memory_report()
    }
    fn init_paged(&mut self, config: ferrite_model::PagedKvConfig) -> anyhow::Result<()> {
        self.block_size = config.block_size;
        self.inner.init_paged(config)
    }
    fn forward_paged(&mut self, batch: &[ferrite_model::SeqChunk<'_>]) -> anyhow::Result<Vec<Vec<f32>>> {
        self.inner.forward_paged(batch)
    }
    fn forward_paged_ahead(&mut self, batch: &[ferrite_model::SeqChunk<'_>], sample: &[Option<ferrite_model::DeviceSampling>], ahead: &[ferrite_model::AheadSeq<'_>]) -> anyhow::Result<Vec<ferrite_model::PagedOutput>> {
        assert!(sample.iter().all(Option::is_some), "a step runs ahead only when every sequence samples on the device");
        for (s, a) in batch.iter().zip(ahead) {
            assert_eq!(a.start_pos, s.start_pos + s.tokens.len(), "the step ahead is at each sequence's next position");
            assert!(a.block_table.starts_with(s.block_table) && a.block_table.len() * self.block_size > a.start_pos, "the step ahead's table extends the step's and covers its position");
        }
        let out = self.forward_paged_sampled(batch, sample)?;
        self.ahead[0].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.pending = Some(ahead.iter().map(|a| (a.start_pos, a.block_table.to_vec())).collect());
        Ok(out)
    }
    fn forward_paged_sampled(&mut self, batch: &[ferrite_model::SeqChunk<'_>], sample: &[Option<ferrite_model::DeviceSampling>]) -> anyhow::Result<Vec<ferrite_model::PagedOutput>> {
        if let Some(p) = self.pending.take() {
            let same_rows = p.len() == batch.len() && p.iter().zip(batch).all(|((pos, _), s)| s.tokens.len() == 1 && s.start_pos == *pos);
            if same_rows {
                let same_tables = p.iter().zip(batch).all(|((_, table), s)| s.block_table == &table[..]);
                self.ahead[if same_tables { 1 } else { 2 }].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
        let logits = self.inner.forward_paged(batch)?;
        Ok(logits
            .into_iter()
            .zip(sample)
            .map(|(l, p)| match p {
                Some(p) => {
                    assert!(p.temperature <= 0.0, "only greedy requests in this test");
                    self.requests.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    ferrite_model::PagedOutput::Token(ferrite_engine::sampling::argmax(&l))
                }
                None => ferrite_model::PagedOutput::Logits(l),
            })
            .collect())
    }
}

/// Device sampling in batched steps: asked once per generated token of each request whose
/// sampling needs no logits on the host (never for a prefill chunk that does not end the prompt,
/// never for a request with log-probabilities), and the outputs stay those of `Session::generate`.
#[test]
fn batched_steps_sample_on_the_device_when_the_request_allows() {
    let model = smollm2(FusionOptions::ALL);
    let requests = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (m, r) = (Arc::clone(&model), Arc::clone(&requests));
    let make = move || -> anyhow::Result<Box<dyn Executor>> {
        Ok(Box::new(SamplesOnDevice::new(CpuExecutor::new(m, CpuPrecision::Quantized, options())?, r)))
    };
    let engine = EngineHandle::start(make, config()).unwrap().0;
    // 40- and 50-token prompts take two chunks each at 32 tokens per step.
    let plain = [engine.submit(greedy(prompt(31, 40), 5)).unwrap(), engine.submit(greedy(prompt(32, 50), 4)).unwrap()];
    let with_logprobs = engine.submit(GenRequest { logprobs: Some(2), ..greedy(prompt(33, 12), 3) }).unwrap();
    let outs: Vec<Outcome> = plain.into_iter().map(collect).collect();
    assert_eq!(outs[0].tokens, reference(&model, &prompt(31, 40), 5));
    assert_eq!(outs[1].tokens, reference(&model, &prompt(32, 50), 4));
    assert_eq!(collect(with_logprobs).tokens, reference(&model, &prompt(33, 12), 3));
    assert_eq!(requests.load(std::sync::atomic::Ordering::Relaxed), 5 + 4);
    wait_idle(engine.metrics());
}

/// Batched decode ahead: while the same sequences keep decoding (nobody waiting, nobody at its
/// length limit) each step asks for the next one ahead, at every sequence's next position with a
/// table that covers it (blocks taken early, including at a block boundary), the next batch is
/// that step, and the outputs and the block accounting are unchanged.
#[test]
fn steady_decode_steps_run_ahead() {
    let model = smollm2(FusionOptions::ALL);
    let requests = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let ahead = Arc::new(Default::default());
    let (m, r, a) = (Arc::clone(&model), Arc::clone(&requests), Arc::clone(&ahead));
    let make = move || -> anyhow::Result<Box<dyn Executor>> {
        let mut exec = SamplesOnDevice::new(CpuExecutor::new(m, CpuPrecision::Quantized, options())?, r);
        exec.ahead = a;
        Ok(Box::new(exec))
    };
    let engine = EngineHandle::start(make, config()).unwrap().0;
    // 12-token prompts and 10 tokens each: positions 12..21 cross the first 16-position block.
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| prompt(40 + i, 12)).collect();
    let rxs: Vec<_> = prompts.iter().map(|p| engine.submit(greedy(p.clone(), 10)).unwrap()).collect();
    for (rx, p) in rxs.into_iter().zip(&prompts) {
        assert_eq!(collect(rx).tokens, reference(&model, p, 10));
    }
    wait_idle(engine.metrics());
    let [asked, taken, other_tables] = [0, 1, 2].map(|i| ahead[i].load(std::sync::atomic::Ordering::Relaxed));
    // Once all three decode together, every step runs ahead until the first sequence is sure to
    // finish, and the next step is the one ahead, tables included (a request arriving during the
    // first step may make that step's ahead useless: timing, not an error).
    assert_eq!(other_tables, 0, "a next batch with the same rows but other tables than the step ahead");
    assert!(asked >= 7 && taken + 1 >= asked, "{asked} steps asked to run ahead, {taken} taken");
    assert_eq!(requests.load(std::sync::atomic::Ordering::Relaxed), 30);
}
