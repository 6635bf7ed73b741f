//! The interface every backend implements to run a model graph.

/// Called as `(done, total)` while a backend prepares its weights (for a progress bar).
#[derive(Clone)]
pub struct LoadProgress(pub std::sync::Arc<dyn Fn(usize, usize) + Send + Sync>);

impl std::fmt::Debug for LoadProgress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LoadProgress")
    }
}

impl LoadProgress {
    pub fn report(progress: &Option<LoadProgress>, done: usize, total: usize) {
        if let Some(p) = progress {
            (p.0)(done, total);
        }
    }
}

/// Options shared by all backends when they are instantiated for a model.
#[derive(Clone, Debug)]
pub struct ExecutorOptions {
    /// Tokens per forward call (longer prompts are fed in chunks of this size).
    pub max_batch: usize,
    /// KV-cache capacity in tokens.
    pub context_len: usize,
    /// Keep traced values (per-layer outputs) readable after `forward` (for `compare`).
    pub trace: bool,
    /// Weight preparation progress.
    pub progress: Option<LoadProgress>,
}

impl Default for ExecutorOptions {
    fn default() -> Self {
        Self { max_batch: 256, context_len: 4096, trace: false, progress: None }
    }
}

/// A traced activation: `rows x width` floats named like the graph value (`blk.3.out`, `logits`).
#[derive(Clone, Debug)]
pub struct LayerTrace {
    pub name: String,
    pub width: usize,
    pub data: Vec<f32>,
}

/// Sampling that a backend may run on its device so that only the token id is read back.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeviceSampling {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub seed: u64,
    /// Index of this sampling step (mixed into the RNG stream).
    pub step: u64,
}

impl DeviceSampling {
    /// The most likely token (argmax).
    pub const GREEDY: DeviceSampling = DeviceSampling { temperature: 0.0, top_k: 1, top_p: 1.0, min_p: 0.0, seed: 0, step: 0 };

    /// Whether the draw is the argmax: `temperature <= 0` or `top_k == 1`.
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 || self.top_k == 1
    }
}

/// Index of the largest value (the first one on ties); NaNs never win (all NaN: the last index).
///
/// Two passes that vectorize, the maximum over lanes and then its first place: a loop carrying
/// the best index took ~150 µs on a 49 152-token vocabulary, serially per sequence of a batched
/// step; this takes ~10 µs.
pub fn argmax(logits: &[f32]) -> u32 {
    const LANES: usize = 16;
    let chunks = logits.chunks_exact(LANES);
    let tail = chunks.remainder();
    // `f32::max` ignores NaN operands.
    let mut lanes = [f32::NEG_INFINITY; LANES];
    for chunk in chunks {
        lanes.iter_mut().zip(chunk).for_each(|(m, &v)| *m = m.max(v));
    }
    let max = lanes.iter().chain(tail).fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let first = logits.chunks(LANES).enumerate().find_map(|(c, vs)| vs.iter().position(|&v| v == max).map(|i| c * LANES + i));
    first.unwrap_or(logits.len().saturating_sub(1)) as u32
}

/// The device limits a benchmark is measured against.
#[derive(Clone, Debug)]
pub struct HardwareCeilings {
    /// Memory bandwidth, bytes per second: a device-to-device copy's bytes read plus written
    /// (CUDA), or a read of a buffer as large as the weights (CPU, whose decode only reads:
    /// writes cost it an extra read).
    pub bytes_per_s: f64,
    /// What the bandwidth was measured with.
    pub bandwidth: String,
    /// Measured dense matrix-product rate, FLOP/s.
    pub matmul_flops: f64,
    /// What the matrix rate was measured with.
    pub matmul: String,
}

/// Geometry of a paged KV cache, for serving many sequences in one batch (see
/// [`Executor::forward_paged`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagedKvConfig {
    /// Blocks in the cache.
    pub n_blocks: usize,
    /// Positions per block.
    pub block_size: usize,
    /// Most sequences in one `forward_paged` call.
    pub max_seqs: usize,
    /// Most tokens, over all sequences, in one `forward_paged` call.
    pub max_tokens: usize,
    /// Models with recurrent layers: state slots past the `max_seqs` of the running sequences,
    /// `max_seqs..max_seqs + state_snapshots`, that keep copies of sequences' states for the
    /// prefix cache ([`Executor::copy_state`]). 0 for a model without recurrent layers.
    pub state_snapshots: usize,
}

/// One sequence's part of a batched step: `tokens` at positions `start_pos..`, its cache rows
/// found through `block_table` (position `p` is row `p % block_size` of block
/// `block_table[p / block_size]`). The table covers at least `start_pos + tokens.len()` positions.
/// `state_slot` (below `max_seqs`, one per sequence of a batch) names the sequence's recurrent
/// state for models with Gated DeltaNet layers: it lives in the executor between steps, a chunk
/// at position 0 resets it and any other chunk must continue exactly where the slot's last one
/// ended (the state cannot be rewound).
#[derive(Clone, Copy, Debug)]
pub struct SeqChunk<'a> {
    pub tokens: &'a [u32],
    pub start_pos: usize,
    pub block_table: &'a [u32],
    pub state_slot: usize,
}

/// A sequence's row of a decode step enqueued ahead ([`Executor::forward_paged_ahead`]): its
/// token is the one drawn for it by the step before, at `start_pos`, through `block_table`.
#[derive(Clone, Copy, Debug)]
pub struct AheadSeq<'a> {
    pub start_pos: usize,
    pub block_table: &'a [u32],
}

/// A batched step laid out in token rows, checked against the paged cache's geometry (the
/// rules every executor's [`Executor::forward_paged`] applies).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BatchRows {
    pub ids: Vec<u32>,
    pub positions: Vec<u32>,
    /// The batch index of every row's sequence.
    pub row_seq: Vec<u32>,
    /// The first row of every sequence (and, last, the row count).
    pub seq_start: Vec<usize>,
}

impl BatchRows {
    pub fn new(batch: &[SeqChunk<'_>], config: &PagedKvConfig) -> anyhow::Result<Self> {
        let n: usize = batch.iter().map(|s| s.tokens.len()).sum();
        if batch.is_empty() || batch.len() > config.max_seqs {
            anyhow::bail!("a batch holds 1 to {} sequences, got {}", config.max_seqs, batch.len());
        }
        if n > config.max_tokens {
            anyhow::bail!("a batch holds at most {} tokens, got {n}", config.max_tokens);
        }
        let mut rows = BatchRows { ids: Vec::with_capacity(n), positions: Vec::with_capacity(n), row_seq: Vec::with_capacity(n), seq_start: Vec::new() };
        let mut slots_taken = vec![false; config.max_seqs];
        for (i, s) in batch.iter().enumerate() {
            if s.tokens.is_empty() {
                anyhow::bail!("sequence {i} of the batch has no tokens");
            }
            match slots_taken.get_mut(s.state_slot) {
                None => anyhow::bail!("sequence {i}: state slot {} is outside the {} slots", s.state_slot, config.max_seqs),
                Some(true) => anyhow::bail!("sequence {i}: state slot {} belongs to another sequence of the batch", s.state_slot),
                Some(taken) => *taken = true,
            }
            let end = s.start_pos + s.tokens.len();
            if s.block_table.len() * config.block_size < end {
                anyhow::bail!("sequence {i}: {} blocks cannot hold {end} positions", s.block_table.len());
            }
            if let Some(&b) = s.block_table.iter().find(|&&b| b as usize >= config.n_blocks) {
                anyhow::bail!("sequence {i}: block {b} is outside the cache ({} blocks)", config.n_blocks);
            }
            rows.seq_start.push(rows.ids.len());
            rows.ids.extend_from_slice(s.tokens);
            rows.positions.extend((s.start_pos..end).map(|p| p as u32));
            rows.row_seq.extend(std::iter::repeat_n(i as u32, s.tokens.len()));
        }
        rows.seq_start.push(n);
        Ok(rows)
    }

    /// The row of each sequence's last token.
    pub fn last_rows(&self) -> impl Iterator<Item = usize> + '_ {
        self.seq_start.windows(2).map(|w| w[1] - 1)
    }
}

/// The tokens a backend's recurrent state (Gated DeltaNet) has consumed, and the rule of
/// [`Executor::forward`] for it: a forward starts at 0 (reset) or exactly there (continue).
#[derive(Clone, Copy, Debug)]
pub struct RecurrentCursor {
    /// `None`: unusable after a failed forward; only position 0 resets it.
    consumed: Option<usize>,
}

impl Default for RecurrentCursor {
    fn default() -> Self {
        Self { consumed: Some(0) }
    }
}

impl RecurrentCursor {
    /// Before a forward at `start_pos`: `true` if the state must be reset first (position 0), or
    /// why the state cannot serve that position. The state counts as unusable until
    /// [`RecurrentCursor::finish`].
    pub fn begin(&mut self, start_pos: usize) -> anyhow::Result<bool> {
        if start_pos != 0 && self.consumed != Some(start_pos) {
            anyhow::bail!(
                "this model has recurrent (Gated DeltaNet) layers whose state cannot be rewound: a forward must start at position 0 or continue at {}, not at {start_pos}",
                match self.consumed {
                    Some(p) => p.to_string(),
                    None => "(nothing: a failed forward left the state unusable)".into(),
                }
            );
        }
        self.consumed = None;
        Ok(start_pos == 0)
    }

    /// After a forward that succeeded up to position `end`.
    pub fn finish(&mut self, end: usize) {
        self.consumed = Some(end);
    }

    /// [`Executor::copy_state`]'s bookkeeping: slot `to` of `cursors` takes slot `from`'s count,
    /// or the error if `graph` has no recurrent state or either is not a slot.
    pub fn copy_slot(graph: &crate::graph::Graph, cursors: &mut [RecurrentCursor], from: usize, to: usize) -> anyhow::Result<()> {
        if !graph.has_recurrent_state() {
            anyhow::bail!("this model has no recurrent state to copy");
        }
        let slots = cursors.len();
        if from >= slots || to >= slots {
            anyhow::bail!("state slots {from} -> {to}: there are {slots}");
        }
        cursors[to] = cursors[from];
        Ok(())
    }
}

fn no_batched_serving(backend: String) -> anyhow::Error {
    anyhow::anyhow!("backend {backend} does not support batched serving yet")
}

pub trait Executor {
    /// Human-readable backend description (`cpu (fp32 reference)`, `cuda: NVIDIA H200`...).
    fn describe(&self) -> String;

    /// Run `tokens` at positions `start_pos..start_pos + tokens.len()`, writing their K/V into the
    /// cache (overwriting anything already stored at those positions). Afterwards the logits of
    /// the last token are available. `tokens.len()` may exceed `max_batch`: it is chunked.
    ///
    /// Models with recurrent layers (Gated DeltaNet, see [`Executor::has_recurrent_state`]) also
    /// carry a state that cannot be rewound: `start_pos == 0` resets it, `start_pos` equal to the
    /// number of tokens consumed so far continues it, anything else is an error (as is any
    /// `start_pos > 0` after a failed forward).
    fn forward(&mut self, tokens: &[u32], start_pos: usize) -> anyhow::Result<()>;

    /// True if the model keeps recurrent state besides the KV cache: a forward must then start
    /// at 0 or exactly where the previous one ended (no rewinding for prefix reuse).
    fn has_recurrent_state(&self) -> bool {
        false
    }

    /// Logits of the last token of the last `forward`.
    fn logits(&mut self) -> anyhow::Result<Vec<f32>>;

    /// Sample the next token on the device, if this backend can; `None` means "sample on the host".
    fn sample_on_device(&mut self, _params: &DeviceSampling) -> Option<anyhow::Result<u32>> {
        None
    }

    /// [`Self::sample_on_device`], and with `next_pos` the one-token forward of the drawn token
    /// at that position, enqueued before the token is read back: the token goes from the sampler
    /// to the step on the device, so the device does not wait for the host between tokens. The
    /// step runs whatever the caller then does with the token (stopping at an end token leaves
    /// it in the cache, computed). `None`: this backend has no such path (sample, then forward).
    fn sample_and_step(&mut self, _params: &DeviceSampling, _next_pos: Option<usize>) -> Option<anyhow::Result<u32>> {
        None
    }

    /// Traced values of the last `forward` chunk (empty unless created with `trace`).
    fn traces(&mut self) -> anyhow::Result<Vec<LayerTrace>>;

    /// KV-cache capacity in tokens.
    fn context_len(&self) -> usize;

    /// Bytes of one cached position (K and V, all layers): what a decode step reads per token of
    /// context on top of the weights.
    fn kv_bytes_per_position(&self) -> usize;

    /// Open (`true`) or close the range of work an external profiler records (CUDA:
    /// `cuProfilerStart` / `cuProfilerStop`, for `ncu --profile-from-start off`). By default
    /// nothing.
    fn profiler_range(&mut self, _on: bool) -> anyhow::Result<()> {
        Ok(())
    }

    /// Measure the device's ceilings (copy bandwidth, matrix rate); `None` where not measured.
    fn hardware_ceilings(&mut self) -> Option<anyhow::Result<HardwareCeilings>> {
        None
    }

    /// Memory in use, one line per category.
    fn memory_report(&self) -> String;

    /// Allocate the paged KV cache used by [`Executor::forward_paged`] (replacing any earlier one).
    /// It is separate from the contiguous cache of `forward`.
    fn init_paged(&mut self, _config: PagedKvConfig) -> anyhow::Result<()> {
        Err(no_batched_serving(self.describe()))
    }

    /// Run one step for a batch of sequences: each chunk's K/V are written into the paged cache at
    /// its positions and its queries attend over its own blocks. Returns the logits of the last
    /// token of every chunk, in order. The weights are applied to all chunks' rows at once.
    fn forward_paged(&mut self, _batch: &[SeqChunk<'_>]) -> anyhow::Result<Vec<Vec<f32>>> {
        Err(no_batched_serving(self.describe()))
    }

    /// Copy the recurrent state of slot `from` into slot `to` (slots below `max_seqs +
    /// state_snapshots` of [`PagedKvConfig`]), with the count of tokens it has consumed, in order
    /// with the batched steps: the prefix cache of a model with Gated DeltaNet layers keeps the
    /// state after a cached prefix in a snapshot slot and starts a later sequence with that
    /// prefix from a copy. An error for models without recurrent state.
    fn copy_state(&mut self, _from: usize, _to: usize) -> anyhow::Result<()> {
        anyhow::bail!("{} keeps no recurrent state to copy", self.describe())
    }

    /// Run throw-away one-token decode steps at the first positions, as a generation runs them
    /// (greedy and sampled draws on the device), so that kernels loaded on first use and decode
    /// graphs captured at a step's second run are ready before the first prompt instead of
    /// delaying its first tokens. It writes garbage into the cache there, which the first
    /// forward from position 0 overwrites (and resets any recurrent state). By default nothing.
    fn warm_up(&mut self) -> anyhow::Result<()> {
        Ok(())
    }

    /// Run throw-away batched steps of the shapes serving will meet (after
    /// [`Executor::init_paged`]), so that kernels compiled or loaded on first use are ready
    /// before the first request instead of stalling it. It writes garbage into cache blocks,
    /// which is harmless: a sequence reads only the positions it wrote. By default nothing.
    fn warm_up_paged(&mut self) -> anyhow::Result<()> {
        Ok(())
    }

    /// [`Executor::forward_paged`], where the sequences with `sample[i]` set may have their next
    /// token drawn on the device, as [`Executor::sample_on_device`] draws it (only the ids are
    /// read back, not 4 bytes per vocabulary entry per sequence): each output is the token for
    /// those, the logits for the rest. By default nothing is sampled on the device.
    fn forward_paged_sampled(&mut self, batch: &[SeqChunk<'_>], sample: &[Option<DeviceSampling>]) -> anyhow::Result<Vec<PagedOutput>> {
        debug_assert_eq!(batch.len(), sample.len());
        Ok(self.forward_paged(batch)?.into_iter().map(PagedOutput::Logits).collect())
    }

    /// [`Executor::forward_paged_sampled`] where every sequence draws its token on the device,
    /// and then, before the tokens are read back, the next decode step of the same sequences is
    /// enqueued: sequence `i`'s drawn token at `ahead[i]`, fed from the sampler on the device
    /// (batched "decode ahead": the device does not wait for the host between steps). The next
    /// call whose batch is exactly that step (the same sequences in the same order, each with
    /// its drawn token, position and table) takes its results instead of running it again; any
    /// other batch runs as usual, and the step ahead has only written cache rows at positions
    /// past what its sequences had computed. Backends without the path ignore `ahead`.
    fn forward_paged_ahead(&mut self, batch: &[SeqChunk<'_>], sample: &[Option<DeviceSampling>], ahead: &[AheadSeq<'_>]) -> anyhow::Result<Vec<PagedOutput>> {
        debug_assert_eq!(batch.len(), ahead.len());
        self.forward_paged_sampled(batch, sample)
    }
}

/// One sequence's result of [`Executor::forward_paged_sampled`].
#[derive(Clone, Debug, PartialEq)]
pub enum PagedOutput {
    Logits(Vec<f32>),
    Token(u32),
}
