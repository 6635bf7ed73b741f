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

/// The device limits a benchmark is measured against.
#[derive(Clone, Debug)]
pub struct HardwareCeilings {
    /// Device-to-device copy, bytes read plus bytes written per second.
    pub copy_bytes_per_s: f64,
    /// Measured dense matrix-product rate, FLOP/s.
    pub matmul_flops: f64,
    /// What the matrix rate was measured with.
    pub matmul: String,
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

    /// Traced values of the last `forward` chunk (empty unless created with `trace`).
    fn traces(&mut self) -> anyhow::Result<Vec<LayerTrace>>;

    /// KV-cache capacity in tokens.
    fn context_len(&self) -> usize;

    /// Bytes of one cached position (K and V, all layers): what a decode step reads per token of
    /// context on top of the weights.
    fn kv_bytes_per_position(&self) -> usize;

    /// Measure the device's ceilings (copy bandwidth, matrix rate); `None` where not measured.
    fn hardware_ceilings(&mut self) -> Option<anyhow::Result<HardwareCeilings>> {
        None
    }

    /// Memory in use, one line per category.
    fn memory_report(&self) -> String;
}
