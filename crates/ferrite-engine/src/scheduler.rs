//! Continuous batching: one thread owns the executor and runs steps over a changing set of
//! sequences.
//!
//! Every step takes, within a token budget: one token for each sequence that is decoding, the
//! next prompt chunk of each sequence still prefilling (long prompts are prefilled over several
//! steps, so the decodes of others go on), and new requests from the queue as far as the budget,
//! the sequence limit and free KV blocks allow. All of them run as one `forward_paged` call; the
//! logits of every sequence that reached the end of its tokens are sampled and the tokens are
//! streamed back. Finished and cancelled sequences leave the batch at once and free their blocks.
//!
//! KV memory is paged ([`BlockPool`]): a new request first takes the cached blocks of its longest
//! cached prefix (prefix cache), then allocates the rest as it grows. When a sequence needs a
//! block and none is free, the most recently admitted other sequence is preempted: its blocks are
//! released and it goes back to the front of the queue, to be recomputed (prompt and the tokens
//! generated so far) when blocks are free again (if the only holders are already in this step, the
//! sequence itself goes back).
//!
//! Models with recurrent layers (Gated DeltaNet) keep each running sequence's state in the
//! executor: every admitted sequence takes a free state slot (`SeqChunk::state_slot`) and returns
//! it when it leaves; a preempted one starts over at position 0 in a new slot. Their prefix cache
//! needs state snapshots ([`StateSnapshots`]): a sequence's state is kept every
//! `snapshot_stride` tokens (its prefill chunks end there), and a new sequence skips only a
//! cached prefix whose state is kept, starting from a copy of it.
//!
//! Requests are cancelled by dropping their event receiver; the scheduler notices it before the
//! next step (or when a send fails).

use rayon::prelude::*;
use crate::kv_pages::{prefix_hashes, BlockHash, BlockPool};
use crate::metrics::EngineMetrics;
use crate::sampling::{LogProbs, Sampler, SamplerParams};
use crate::state_snapshots::StateSnapshots;
use anyhow::{bail, Context, Result};
use ferrite_model::{AheadSeq, DeviceSampling, Executor, PagedKvConfig, PagedOutput, SeqChunk};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

/// Sizes of the serving engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    /// Positions per KV block.
    pub block_size: usize,
    /// KV blocks (see [`EngineConfig::blocks_for_memory`]).
    pub n_blocks: usize,
    /// Most sequences in the running batch.
    pub max_seqs: usize,
    /// Most tokens per step, over all sequences (the prefill chunk budget).
    pub max_batch_tokens: usize,
    /// Most requests waiting for admission; more are refused.
    pub max_queue: usize,
    /// Most tokens (prompt + generated) of one sequence.
    pub max_context: usize,
    /// Reuse the cached blocks of equal prompt prefixes.
    pub prefix_cache: bool,
    /// Models with recurrent layers: sequence states kept for the prefix cache (each a whole
    /// state; 0: no prefix cache for such models), one every `snapshot_stride` tokens of a
    /// sequence (a multiple of `block_size`). Ignored for other models.
    pub state_snapshots: usize,
    pub snapshot_stride: usize,
}

impl EngineConfig {
    /// Blocks that fit in `bytes` of KV memory for a model with `bytes_per_position`.
    pub fn blocks_for_memory(bytes: usize, bytes_per_position: usize, block_size: usize) -> usize {
        bytes / (bytes_per_position * block_size).max(1)
    }

    pub fn validate(&self) -> Result<()> {
        if self.block_size == 0 || self.max_seqs == 0 || self.max_batch_tokens == 0 || self.max_context == 0 {
            bail!("engine sizes must be positive: {self:?}");
        }
        if self.state_snapshots > 0 && (self.snapshot_stride == 0 || !self.snapshot_stride.is_multiple_of(self.block_size)) {
            bail!("the state snapshot stride ({} tokens) must be a positive multiple of the block size ({})", self.snapshot_stride, self.block_size);
        }
        let need = self.max_context.div_ceil(self.block_size);
        if self.n_blocks < need {
            bail!(
                "the KV cache holds {} blocks of {} positions ({} tokens) but one sequence of the full context ({} tokens) needs {need}: give more KV memory or a smaller context",
                self.n_blocks,
                self.block_size,
                self.n_blocks * self.block_size,
                self.max_context
            );
        }
        Ok(())
    }
}

/// What to generate for one request.
#[derive(Clone, Debug)]
pub struct GenRequest {
    pub prompt: Vec<u32>,
    /// Most tokens to generate (the context limit may end generation earlier).
    pub max_tokens: usize,
    pub sampling: SamplerParams,
    /// OpenAI penalties over the generated tokens: `logit -= presence * [count > 0] + frequency * count`.
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// Added to the logits of these tokens before sampling.
    pub logit_bias: Vec<(u32, f32)>,
    /// Report the chosen token's log-probability and this many alternatives.
    pub logprobs: Option<usize>,
    /// Tokens that end generation (not reported as output).
    pub stop_tokens: Vec<u32>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub logprob: f32,
    /// The most likely tokens with their log-probabilities, best first.
    pub top: Vec<(u32, f32)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token was generated.
    Stop,
    /// `max_tokens` or the context limit was reached.
    Length,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens taken from the prefix cache.
    pub cached_tokens: usize,
}

#[derive(Clone, Debug, PartialEq)]
pub enum GenEvent {
    /// The request entered the running batch for the first time; this many prompt tokens came
    /// from the prefix cache.
    Started { cached_tokens: usize },
    Token { id: u32, logprob: Option<TokenLogprob> },
    Finished { reason: FinishReason, usage: Usage },
    Error(String),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SubmitError {
    QueueFull,
    /// The prompt is empty or leaves no room to generate.
    BadPrompt(String),
    Stopped,
}

impl std::fmt::Display for SubmitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SubmitError::QueueFull => f.write_str("the request queue is full; try again later"),
            SubmitError::BadPrompt(m) => f.write_str(m),
            SubmitError::Stopped => f.write_str("the engine has stopped"),
        }
    }
}

impl std::error::Error for SubmitError {}

struct Submission {
    req: GenRequest,
    events: UnboundedSender<GenEvent>,
    arrived: Instant,
}

/// The thread-safe front of a running engine. Cloning it is cheap; the engine thread stops once
/// every handle is dropped and its work is done.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Submission>,
    /// Cleared when the engine thread ends (normally or by a panic).
    alive: Arc<std::sync::atomic::AtomicBool>,
    queued: Arc<AtomicU64>,
    metrics: Arc<EngineMetrics>,
    config: EngineConfig,
    describe: String,
}

impl EngineHandle {
    /// Start the engine thread; `make_executor` runs on it (executors need not be `Send`).
    pub fn start(
        make_executor: impl FnOnce() -> Result<Box<dyn Executor>> + Send + 'static,
        config: EngineConfig,
    ) -> Result<(EngineHandle, std::thread::JoinHandle<()>)> {
        config.validate()?;
        let (tx, rx) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::channel();
        let metrics = Arc::new(EngineMetrics::default());
        let queued = Arc::new(AtomicU64::new(0));
        let alive = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let (m, q, c, a) = (Arc::clone(&metrics), Arc::clone(&queued), config.clone(), Arc::clone(&alive));
        let thread = std::thread::Builder::new()
            .name("ferrite-engine".into())
            .spawn(move || {
                struct Alive(Arc<std::sync::atomic::AtomicBool>);
                impl Drop for Alive {
                    fn drop(&mut self) {
                        self.0.store(false, Relaxed);
                    }
                }
                let _alive = Alive(a);
                let setup = make_executor().and_then(|mut exec| {
                    let recurrent = exec.has_recurrent_state();
                    if c.prefix_cache && recurrent && c.state_snapshots == 0 {
                        bail!("the prefix cache of a model with recurrent (Gated DeltaNet) layers needs state snapshots: cached KV blocks cannot restore the state after a prefix (give some, or turn the prefix cache off)");
                    }
                    let snapshots = if recurrent && c.prefix_cache { c.state_snapshots } else { 0 };
                    exec.init_paged(PagedKvConfig {
                        n_blocks: c.n_blocks,
                        block_size: c.block_size,
                        max_seqs: c.max_seqs,
                        max_tokens: c.max_batch_tokens,
                        state_snapshots: snapshots,
                    })?;
                    exec.warm_up_paged().context("warming up the batched kernels")?;
                    Ok((exec, StateSnapshots::new(c.max_seqs, snapshots, c.snapshot_stride.max(1))))
                });
                match setup {
                    Ok((exec, snapshots)) => {
                        let _ = ready_tx.send(Ok(exec.describe()));
                        Scheduler::new(exec, c, snapshots, rx, m, q).run();
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                    }
                }
            })
            .context("starting the engine thread")?;
        let describe = ready_rx.recv().context("the engine thread ended during startup")??;
        Ok((EngineHandle { tx, alive, queued, metrics, config, describe }, thread))
    }

    /// Queue a request; its events arrive on the returned receiver. Dropping the receiver cancels
    /// the request.
    pub fn submit(&self, req: GenRequest) -> Result<UnboundedReceiver<GenEvent>, SubmitError> {
        if req.prompt.is_empty() {
            return Err(SubmitError::BadPrompt("the prompt is empty".into()));
        }
        if req.max_tokens == 0 {
            return Err(SubmitError::BadPrompt("max_tokens must be at least 1".into()));
        }
        if req.prompt.len() >= self.config.max_context {
            return Err(SubmitError::BadPrompt(format!(
                "the prompt has {} tokens but the context holds {} (prompt plus at least one generated token)",
                req.prompt.len(),
                self.config.max_context
            )));
        }
        let max = self.config.max_queue as u64;
        if self.queued.fetch_update(Relaxed, Relaxed, |q| (q < max).then_some(q + 1)).is_err() {
            return Err(SubmitError::QueueFull);
        }
        let (events, rx) = unbounded_channel();
        if self.tx.send(Submission { req, events, arrived: Instant::now() }).is_err() {
            self.queued.fetch_sub(1, Relaxed);
            return Err(SubmitError::Stopped);
        }
        Ok(rx)
    }

    pub fn metrics(&self) -> &EngineMetrics {
        &self.metrics
    }

    /// Whether the engine thread is still running (false after a panic).
    pub fn is_alive(&self) -> bool {
        self.alive.load(Relaxed)
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The executor's description.
    pub fn describe(&self) -> &str {
        &self.describe
    }
}

struct Seq {
    req: GenRequest,
    events: UnboundedSender<GenEvent>,
    /// Prompt, then the generated tokens.
    tokens: Vec<u32>,
    /// Tokens whose K/V are in the cache.
    computed: usize,
    table: Vec<u32>,
    /// The executor's recurrent-state slot of this sequence while it runs (see [`SeqChunk`]).
    slot: usize,
    /// Hashes of the full computed blocks (those registered in the prefix cache).
    hashes: Vec<BlockHash>,
    sampler: Sampler,
    /// Generated tokens and how often each occurred (for the OpenAI penalties).
    counts: HashMap<u32, u32>,
    generated: usize,
    cached_tokens: usize,
    arrived: Instant,
    last_token: Option<Instant>,
    /// Admitted once already (a preempted sequence is not counted again).
    admitted: bool,
}

impl Seq {
    fn prompt_len(&self) -> usize {
        self.req.prompt.len()
    }
}

struct Scheduler {
    exec: Box<dyn Executor>,
    config: EngineConfig,
    rx: mpsc::Receiver<Submission>,
    /// Whether every handle is gone (no more submissions can come).
    closed: bool,
    pool: BlockPool,
    /// Recurrent-state slots no running sequence holds.
    free_slots: Vec<usize>,
    /// The prefix cache's recurrent states (none for models without recurrent layers).
    snapshots: StateSnapshots,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    metrics: Arc<EngineMetrics>,
    queued: Arc<AtomicU64>,
    rate_window: (Instant, u64),
    /// `FERRITE_DECODE_AHEAD`: a step of decodes may enqueue the next one before its tokens are
    /// read back ([`Scheduler::plan_ahead`]).
    decode_ahead: bool,
}

impl Scheduler {
    fn new(exec: Box<dyn Executor>, config: EngineConfig, snapshots: StateSnapshots, rx: mpsc::Receiver<Submission>, metrics: Arc<EngineMetrics>, queued: Arc<AtomicU64>) -> Self {
        let pool = BlockPool::new(config.n_blocks, config.block_size);
        let free_slots = (0..config.max_seqs).rev().collect();
        metrics.kv_blocks_total.store(config.n_blocks as u64, Relaxed);
        Self {
            exec,
            config,
            rx,
            closed: false,
            pool,
            free_slots,
            snapshots,
            waiting: VecDeque::new(),
            running: Vec::new(),
            metrics,
            queued,
            rate_window: (Instant::now(), 0),
            decode_ahead: ferrite_core::env::DECODE_AHEAD.flag(),
        }
    }

    fn run(mut self) {
        loop {
            self.intake();
            if self.running.is_empty() && self.waiting.is_empty() {
                if self.closed {
                    break;
                }
                self.metrics.set_tokens_per_second(0.0);
                self.rate_window = (Instant::now(), 0);
                // Idle: wait for work.
                match self.rx.recv() {
                    Ok(s) => self.enqueue(s),
                    Err(_) => self.closed = true,
                }
                continue;
            }
            self.drop_cancelled();
            self.step();
            self.publish();
        }
    }

    fn intake(&mut self) {
        loop {
            match self.rx.try_recv() {
                Ok(s) => self.enqueue(s),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => {
                    self.closed = true;
                    break;
                }
            }
        }
    }

    fn enqueue(&mut self, s: Submission) {
        let Submission { req, events, arrived } = s;
        let sampler = Sampler::new(req.sampling.clone());
        self.waiting.push_back(Seq {
            tokens: req.prompt.clone(),
            req,
            events,
            computed: 0,
            table: Vec::new(),
            slot: usize::MAX,
            hashes: Vec::new(),
            sampler,
            counts: HashMap::new(),
            generated: 0,
            cached_tokens: 0,
            arrived,
            last_token: None,
            admitted: false,
        });
        self.publish();
    }

    fn unqueue(&mut self, seq: &Seq) {
        if !seq.admitted {
            self.queued.fetch_sub(1, Relaxed);
        }
    }

    fn drop_cancelled(&mut self) {
        let mut i = 0;
        while i < self.waiting.len() {
            if self.waiting[i].events.is_closed() {
                let mut s = self.waiting.remove(i).expect("index in range");
                self.unqueue(&s);
                self.pool.release_all(&mut s.table);
                self.metrics.requests_cancelled.fetch_add(1, Relaxed);
            } else {
                i += 1;
            }
        }
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].events.is_closed() {
                self.leave(i);
                self.metrics.requests_cancelled.fetch_add(1, Relaxed);
            } else {
                i += 1;
            }
        }
    }

    /// Give the running sequence `i` blocks for `upto` positions, preempting other sequences
    /// from the back of `running` (never one of the first `protected`, already in this step's
    /// batch). Returns the sequence's index afterwards: `Ok` with the blocks, `Err` if the
    /// others that hold blocks are all protected.
    fn reserve(&mut self, mut i: usize, upto: usize, protected: usize) -> Result<usize, usize> {
        let need = upto.div_ceil(self.config.block_size);
        while self.running[i].table.len() < need {
            match self.pool.allocate() {
                Some(b) => self.running[i].table.push(b),
                None => {
                    let Some(victim) = (protected..self.running.len()).rev().find(|&v| v != i) else { return Err(i) };
                    self.preempt(victim);
                    if victim < i {
                        i -= 1;
                    }
                }
            }
        }
        Ok(i)
    }

    /// Most tokens one step may compute of a sequence at `computed`: up to its next snapshot
    /// point where states are kept (they are copied between steps).
    fn chunk_limit(&self, computed: usize) -> usize {
        if self.snapshots.enabled() {
            self.snapshots.stride() - computed % self.snapshots.stride()
        } else {
            usize::MAX
        }
    }

    /// The cached blocks of the longest prefix of `hashes` (whole blocks of a new prompt) whose
    /// recurrent state is kept too, taken from the pool, and the state's snapshot slot: a longer
    /// cached prefix without its state cannot be skipped. Nothing if none is kept.
    fn cached_state_prefix(&mut self, hashes: &[BlockHash]) -> (Vec<u32>, Option<usize>) {
        let per = self.snapshots.stride() / self.config.block_size;
        let mut limit = hashes.len();
        while let Some((k, slot)) = self.snapshots.longest(&hashes[..limit], (per..=limit).step_by(per)) {
            let mut table = self.pool.lookup(&hashes[..k]);
            if table.len() == k {
                return (table, Some(slot));
            }
            // Some of its blocks were evicted: a shorter one may still be whole.
            self.pool.release_all(&mut table);
            limit = k - 1;
        }
        (Vec::new(), None)
    }

    /// Take running sequence `k` out of the batch, its blocks and state slot freed.
    fn leave(&mut self, k: usize) -> Seq {
        let mut s = self.running.remove(k);
        self.pool.release_all(&mut s.table);
        self.free_slots.push(std::mem::replace(&mut s.slot, usize::MAX));
        s
    }

    fn preempt(&mut self, v: usize) {
        let mut s = self.leave(v);
        s.computed = 0;
        s.hashes.clear();
        self.metrics.preemptions.fetch_add(1, Relaxed);
        self.waiting.push_front(s);
    }

    /// Choose this step's work and run it.
    fn step(&mut self) {
        let bs = self.config.block_size;
        let mut budget = self.config.max_batch_tokens;
        // (index in `running`, tokens this step). Batched sequences are moved to the front of
        // `running` in batch order so that preemption never picks one of them.
        let mut batch: Vec<usize> = Vec::new();
        let mut counts: Vec<usize> = Vec::new();
        // Decodes first (one token each), then prefill chunks of sequences already running.
        for pass in 0..2 {
            let mut i = batch.len();
            while i < self.running.len() && budget > 0 {
                let s = &self.running[i];
                let remaining = s.tokens.len() - s.computed;
                let decoding = remaining == 1;
                if (pass == 0) != decoding {
                    i += 1;
                    continue;
                }
                let n = remaining.min(budget).min(self.chunk_limit(s.computed));
                let upto = s.computed + n;
                let pos = batch.len();
                let at = match self.reserve(i, upto, pos) {
                    Ok(at) => at,
                    // The blocks are held by sequences already in this step: wait for them.
                    Err(at) if pos > 0 => {
                        self.preempt(at);
                        i = at;
                        continue;
                    }
                    // Alone and still no room: only possible if the cache is smaller than the
                    // config promised.
                    Err(at) => {
                        let s = self.leave(at);
                        self.fail(s, "the KV cache cannot hold this sequence");
                        i = at;
                        continue;
                    }
                };
                i = at;
                self.running.swap(pos, i);
                batch.push(pos);
                counts.push(n);
                budget -= n;
                i += 1;
            }
        }
        // Admit new requests while there is budget, room in the batch and free blocks (keeping
        // one block per running sequence in reserve so that decodes rarely preempt).
        while budget > 0 && self.running.len() < self.config.max_seqs {
            let Some(mut s) = self.waiting.pop_front() else { break };
            let hashes = prefix_hashes(&s.tokens, bs);
            // At least the last token is computed, so its logits exist.
            let reusable = (s.tokens.len() - 1) / bs;
            let reusable = if self.config.prefix_cache { reusable.min(hashes.len()) } else { 0 };
            let mut restore = None;
            if self.snapshots.enabled() {
                (s.table, restore) = self.cached_state_prefix(&hashes[..reusable]);
            } else {
                s.table = self.pool.lookup(&hashes[..reusable]);
            }
            s.hashes = hashes[..s.table.len()].to_vec();
            s.computed = s.table.len() * bs;
            let n = (s.tokens.len() - s.computed).min(budget).min(self.chunk_limit(s.computed));
            let need = (s.computed + n).div_ceil(bs) - s.table.len();
            if self.pool.available() < need + self.running.len() {
                self.pool.release_all(&mut s.table);
                s.hashes.clear();
                s.computed = 0;
                self.waiting.push_front(s);
                break;
            }
            for _ in 0..need {
                let b = self.pool.allocate().expect("checked available");
                s.table.push(b);
            }
            if !s.admitted {
                s.admitted = true;
                s.cached_tokens = s.computed;
                let _ = s.events.send(GenEvent::Started { cached_tokens: s.computed });
                self.unqueue_admitted();
                self.metrics.requests_admitted.fetch_add(1, Relaxed);
                self.metrics.prompt_tokens.fetch_add(s.prompt_len() as u64, Relaxed);
                self.metrics.prefix_cache_hit_tokens.fetch_add(s.computed as u64, Relaxed);
            }
            s.slot = self.free_slots.pop().expect("fewer sequences running than state slots");
            if let Some(from) = restore {
                if let Err(e) = self.exec.copy_state(from, s.slot) {
                    self.free_slots.push(s.slot);
                    self.pool.release_all(&mut s.table);
                    self.fail(s, &format!("restoring a cached prefix's state: {e:#}"));
                    continue;
                }
            }
            self.running.push(s);
            let pos = batch.len();
            let last = self.running.len() - 1;
            self.running.swap(pos, last);
            batch.push(pos);
            counts.push(n);
            budget -= n;
        }
        if batch.is_empty() {
            // Nothing could be scheduled (only possible if every sequence failed above); do not
            // spin while waiting for the next submission.
            std::thread::sleep(Duration::from_millis(1));
            return;
        }
        debug_assert!(batch.iter().enumerate().all(|(k, &p)| k == p));
        let n_batch = batch.len();
        let ahead = self.plan_ahead(&counts);
        let result = {
            let chunks: Vec<SeqChunk> = self.running[..n_batch]
                .iter()
                .zip(&counts)
                // Only the blocks the step reaches: a table may hold one taken early for the step
                // ahead, and the step ahead is recognised by its tables.
                .map(|(s, &n)| SeqChunk {
                    tokens: &s.tokens[s.computed..s.computed + n],
                    start_pos: s.computed,
                    block_table: &s.table[..(s.computed + n).div_ceil(bs)],
                    state_slot: s.slot,
                })
                .collect();
            // The sequences that reach their last token this step sample from its logits.
            let sample: Vec<Option<DeviceSampling>> = self.running[..n_batch]
                .iter()
                .zip(&counts)
                .map(|(s, &n)| if s.computed + n == s.tokens.len() { Self::device_sampling(s) } else { None })
                .collect();
            if ahead {
                // Each sequence's drawn token goes in at the position after this step's.
                let next: Vec<AheadSeq> = self.running[..n_batch].iter().map(|s| AheadSeq { start_pos: s.tokens.len(), block_table: &s.table[..(s.tokens.len() + 1).div_ceil(bs)] }).collect();
                self.exec.forward_paged_ahead(&chunks, &sample, &next)
            } else {
                self.exec.forward_paged_sampled(&chunks, &sample)
            }
        };
        self.metrics.steps.fetch_add(1, Relaxed);
        let outputs = match result {
            Ok(l) => l,
            Err(e) => {
                let msg = format!("{e:#}");
                for _ in 0..n_batch {
                    let s = self.leave(0);
                    self.fail(s, &msg);
                }
                return;
            }
        };
        // Register the blocks that became full; sequences still in their prompt sample nothing.
        let mut outputs: Vec<Option<PagedOutput>> = outputs.into_iter().map(Some).collect();
        for (k, output) in outputs.iter_mut().enumerate() {
            let s = &mut self.running[k];
            s.computed += counts[k];
            while s.hashes.len() < s.computed / bs {
                let j = s.hashes.len();
                let h = crate::kv_pages::block_hash(s.hashes.last(), &s.tokens[j * bs..(j + 1) * bs]);
                self.pool.register(s.table[j], h);
                s.hashes.push(h);
            }
            // At a snapshot point: keep the state after this prefix (in order after the step).
            if self.snapshots.enabled() && s.computed.is_multiple_of(self.snapshots.stride()) {
                if let Some(h) = s.hashes.last().copied() {
                    if let Some(to) = self.snapshots.slot_for(h) {
                        if self.exec.copy_state(s.slot, to).is_err() {
                            self.snapshots.forget(&h);
                        }
                    }
                }
            }
            if s.computed < s.tokens.len() {
                *output = None; // prefill continues next step
            }
        }
        // Draw the tokens, the sequences side by side: a host draw over the vocabulary (with
        // penalties or log-probabilities) takes tens of microseconds per sequence.
        let drawn: Vec<Option<(u32, Option<TokenLogprob>)>> =
            self.running[..n_batch].par_iter_mut().zip(outputs).map(|(s, output)| output.map(|o| Self::draw(s, o))).collect();
        // Stream, and retire finished sequences (walking backwards keeps indices valid).
        let mut finished: Vec<(usize, Option<FinishReason>)> = Vec::new();
        for (k, drawn) in drawn.into_iter().enumerate().rev() {
            if let Some((tok, logprob)) = drawn {
                finished.push((k, Self::deliver(&mut self.running[k], tok, logprob, &self.metrics, self.config.max_context)));
            }
        }
        for (k, outcome) in finished {
            match outcome {
                None => {}
                Some(reason) => {
                    let s = self.leave(k);
                    self.publish();
                    let usage = Usage { prompt_tokens: s.prompt_len(), completion_tokens: s.generated, cached_tokens: s.cached_tokens };
                    self.metrics.e2e.observe(s.arrived.elapsed().as_secs_f64());
                    self.metrics.requests_finished.fetch_add(1, Relaxed);
                    let _ = s.events.send(GenEvent::Finished { reason, usage });
                }
            }
        }
        // Cancelled during sampling (send failed): dropped at the next `drop_cancelled`.
    }

    /// Whether this step (the first `counts.len()` running sequences) may enqueue the next
    /// decode step before its tokens are read back ([`Executor::forward_paged_ahead`]): when it
    /// is likely to be the next step exactly. That is, every running sequence draws its next
    /// token in it (a decode, or its prompt's last chunk) on the device, nobody waiting could
    /// join, and no sequence is sure to finish (by length). A sequence whose next position needs
    /// a new block takes a free one now (never by preemption, unlike [`Scheduler::reserve`]; none
    /// free: no step ahead). A stop token or a cancellation still changes the next batch: then
    /// the step ahead is wasted work, nothing more.
    fn plan_ahead(&mut self, counts: &[usize]) -> bool {
        if !self.decode_ahead || counts.len() != self.running.len() || (!self.waiting.is_empty() && self.running.len() < self.config.max_seqs) {
            return false;
        }
        let max_context = self.config.max_context;
        let decodes = self.running.iter().zip(counts).all(|(s, &n)| {
            s.computed + n == s.tokens.len() && s.generated + 1 < s.req.max_tokens && s.tokens.len() + 1 < max_context && Self::device_sampling(s).is_some()
        });
        if !decodes {
            return false;
        }
        let bs = self.config.block_size;
        for s in &mut self.running {
            if s.table.len() * bs < s.tokens.len() + 1 {
                match self.pool.allocate() {
                    Some(b) => s.table.push(b),
                    None => return false,
                }
            }
        }
        true
    }

    fn unqueue_admitted(&mut self) {
        self.queued.fetch_sub(1, Relaxed);
    }

    /// How `s`'s next token may be drawn on the device ([`Executor::forward_paged_sampled`]):
    /// when nothing in its request needs the logits on the host (log-probabilities, logit bias,
    /// penalties). The draw is the device sampler's, keyed by (seed, index of the token).
    fn device_sampling(s: &Seq) -> Option<DeviceSampling> {
        let r = &s.req;
        let host_only = r.logprobs.is_some() || !r.logit_bias.is_empty() || r.presence_penalty != 0.0 || r.frequency_penalty != 0.0;
        if host_only {
            return None;
        }
        s.sampler.params().on_device(s.generated as u64)
    }

    /// The next token of `s`: drawn on the device, or sampled here from its logits (with the
    /// request's bias, penalties and log-probabilities).
    fn draw(s: &mut Seq, output: PagedOutput) -> (u32, Option<TokenLogprob>) {
        match output {
            PagedOutput::Token(tok) => (tok, None),
            PagedOutput::Logits(mut logits) => {
                let logprob_of = s.req.logprobs.map(|k| (LogProbs::new(&logits), k));
                for &(t, b) in &s.req.logit_bias {
                    if let Some(l) = logits.get_mut(t as usize) {
                        *l += b;
                    }
                }
                if s.req.presence_penalty != 0.0 || s.req.frequency_penalty != 0.0 {
                    for (&t, &c) in &s.counts {
                        if let Some(l) = logits.get_mut(t as usize) {
                            *l -= s.req.presence_penalty + s.req.frequency_penalty * c as f32;
                        }
                    }
                }
                let tok = s.sampler.sample(&mut logits, &s.tokens);
                (tok, logprob_of.map(|(lp, k)| TokenLogprob { logprob: lp.of(tok), top: lp.top(k) }))
            }
        }
    }

    /// Send `s`'s next token and account for it. `Some(reason)` when it is done.
    fn deliver(s: &mut Seq, tok: u32, logprob: Option<TokenLogprob>, metrics: &EngineMetrics, max_context: usize) -> Option<FinishReason> {
        // TTFT counts the first sampled token even when it ends generation at once.
        let now = Instant::now();
        match s.last_token {
            None => metrics.ttft.observe(now.duration_since(s.arrived).as_secs_f64()),
            Some(t) => metrics.tpot.observe(now.duration_since(t).as_secs_f64()),
        }
        s.last_token = Some(now);
        if s.req.stop_tokens.contains(&tok) {
            return Some(FinishReason::Stop);
        }
        s.tokens.push(tok);
        *s.counts.entry(tok).or_default() += 1;
        s.generated += 1;
        metrics.generation_tokens.fetch_add(1, Relaxed);
        if s.events.send(GenEvent::Token { id: tok, logprob }).is_err() {
            return None; // cancelled; dropped before the next step
        }
        if s.generated >= s.req.max_tokens || s.tokens.len() >= max_context {
            return Some(FinishReason::Length);
        }
        None
    }

    fn fail(&self, s: Seq, msg: &str) {
        self.metrics.requests_failed.fetch_add(1, Relaxed);
        if !s.admitted {
            self.queued.fetch_sub(1, Relaxed);
        }
        let _ = s.events.send(GenEvent::Error(msg.to_string()));
    }

    /// Update the gauges.
    fn publish(&mut self) {
        let m = &self.metrics;
        m.waiting.store(self.waiting.len() as u64, Relaxed);
        m.running.store(self.running.len() as u64, Relaxed);
        m.kv_blocks_in_use.store(self.pool.in_use() as u64, Relaxed);
        m.kv_blocks_cached.store(self.pool.cached() as u64, Relaxed);
        let generated = m.generation_tokens.load(Relaxed);
        let (t0, g0) = self.rate_window;
        let dt = t0.elapsed();
        if dt >= Duration::from_secs(1) {
            m.set_tokens_per_second((generated - g0) as f64 / dt.as_secs_f64());
            self.rate_window = (Instant::now(), generated);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_must_hold_one_full_sequence() {
        let c = EngineConfig { block_size: 16, n_blocks: 3, max_seqs: 4, max_batch_tokens: 64, max_queue: 8, max_context: 64, prefix_cache: true, state_snapshots: 0, snapshot_stride: 0 };
        assert!(c.validate().unwrap_err().to_string().contains("needs 4"));
        assert!(EngineConfig { n_blocks: 4, ..c }.validate().is_ok());
    }
}
