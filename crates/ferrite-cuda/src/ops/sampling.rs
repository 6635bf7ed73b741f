//! Token selection ops: the result is one `u32` in device memory.

use super::{addr, addr_mut, as_u32, check_len};
use crate::error::CudaError;
use crate::kernels::sampling::{ArgmaxParams, CandidateParams, RowDraw, SampleParams, SamplingVariant};
use crate::staging::{Mailbox, StagingRing};
use crate::Gpu;
use cudarc::driver::{CudaSlice, CudaView, DevicePtr, DevicePtrMut};

/// Write the index of the largest of `logits[0..n]` to `out[0]` (first one on ties; NaN
/// never wins over a number).
pub fn argmax(gpu: &Gpu, logits: &impl DevicePtr<f32>, n: usize, out: &mut impl DevicePtrMut<u32>) -> Result<(), CudaError> {
    argmax_rows(gpu, logits, n, 1, out)
}

/// [`argmax`] of each of `rows` rows of `n` logits (`logits[r * n..]`) into `out[r]`, in one launch.
pub fn argmax_rows(gpu: &Gpu, logits: &impl DevicePtr<f32>, n: usize, rows: usize, out: &mut impl DevicePtrMut<u32>) -> Result<(), CudaError> {
    const OP: &str = "argmax";
    if n == 0 || rows == 0 {
        return Err(CudaError::invalid(OP, "no logits"));
    }
    check_len(OP, "logits", logits.len(), super::elems(OP, &[n, rows])?)?;
    check_len(OP, "out", out.len(), rows)?;
    let variant = SamplingVariant::DEFAULT;
    let params = ArgmaxParams { logits: addr(gpu, logits), out: addr_mut(gpu, out), n: as_u32(OP, "n", n)?, pad: 0 };
    gpu.launch(&variant, "argmax", variant.rows_launch_config(as_u32(OP, "rows", rows)?), &params)
}

/// Sampling settings, with ferrite-engine's meaning: `temperature <= 0` or `top_k == 1` is
/// greedy (argmax); `top_k == 0`, `top_p >= 1` and `min_p <= 0` disable those filters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingConfig {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub seed: u64,
}

/// Where [`sample_delivering`] sends the token besides `out`, so that a decode loop neither
/// copies it back nor waits for it before the next step.
pub struct TokenDelivery<'a> {
    /// The next one-token step's inputs: the token becomes `ids[0]` and the next position
    /// `positions[0]`, so the step can be enqueued before the host has seen the token.
    pub next_step: Option<(&'a mut CudaSlice<u32>, &'a mut CudaSlice<u32>)>,
    pub mail: Mail<'a>,
}

/// How a delivered token reaches the host: `[token, error flag, error detail, tag]` in a slot of
/// a [`Mailbox`].
pub enum Mail<'a> {
    /// In `mailbox`'s `slot`, tagged `tag`; the next step (if delivered) is at `next_pos`.
    Tagged { mailbox: &'a Mailbox, slot: usize, tag: u32, next_pos: u32 },
    /// A draw at the end of a replayed decode step, whose position only the device knows: the
    /// next position is the step's own (`positions[0]`) + 1 and is also the tag; its parity
    /// picks slot `pair + parity`. Needs `next_step`.
    Advancing { mailbox: &'a Mailbox, pair: usize },
}

/// Draw a token from `logits[0..vocab]` and write its id to `out[0]`: keep the top-k, then the
/// smallest top set holding `top_p` of their (temperature-1) probability, then the tokens at
/// least `min_p` times as likely as the best; draw from `softmax(logits / temperature)` over
/// what is left.
/// The random draw is `sampling_uniform(seed, step + counter[0])` where `counter` is an
/// optional device `u32` (e.g. the current position, so a replayed graph draws anew).
pub fn sample(
    gpu: &Gpu,
    logits: &impl DevicePtr<f32>,
    vocab: usize,
    cfg: &SamplingConfig,
    step: u64,
    counter: Option<&CudaView<'_, u32>>,
    out: &mut impl DevicePtrMut<u32>,
) -> Result<(), CudaError> {
    sample_delivering(gpu, logits, vocab, cfg, step, counter, out, None, None)
}

/// Working memory of the two-stage draw (see [`sample_delivering`]) over up to `vocab` logits,
/// for one draw or (`for_draws`) the draws of one [`sample_rows`] launch.
pub struct SampleScratch {
    /// Per draw: the candidates of each chunk of logits and their count.
    cand: CudaSlice<u32>,
    counts: CudaSlice<u32>,
    /// The running best and arrival counter of a greedy draw over many blocks (`argmax_chunks`;
    /// zero between launches).
    best: CudaSlice<u64>,
    arrivals: CudaSlice<u32>,
    /// A draw by chunks' shares (`sample_pass`, `sample_chunks`: maxima, masses, tokens,
    /// top-p's bins, the cut).
    stats: CudaSlice<u32>,
    vocab: usize,
    draws: usize,
}

impl SampleScratch {
    pub fn new(gpu: &Gpu, vocab: usize) -> Result<Self, CudaError> {
        Self::for_draws(gpu, vocab, 1)
    }

    pub fn for_draws(gpu: &Gpu, vocab: usize, draws: usize) -> Result<Self, CudaError> {
        let chunks = vocab.div_ceil(SamplingVariant::DEFAULT.block_size as usize).max(1);
        let draws = draws.max(1);
        Ok(Self {
            cand: gpu.alloc_zeros(draws * chunks * SamplingVariant::DEFAULT.block_size as usize)?,
            counts: gpu.alloc_zeros(draws * chunks)?,
            best: gpu.alloc_zeros(1)?,
            arrivals: gpu.alloc_zeros(1)?,
            // Per chunk a maximum, a mass, a token and two passes' 16 bins of top-p; then the
            // cut's state, twice (a launch reads one while its block 0 writes the other).
            stats: gpu.alloc_zeros((3 + 2 * 16) * chunks + 8)?,
            vocab,
            draws,
        })
    }
}

/// The checks every draw's settings pass before a launch.
fn check_config(op: &'static str, cfg: &SamplingConfig) -> Result<(), CudaError> {
    if cfg.temperature.is_nan() || cfg.top_p.is_nan() || cfg.min_p.is_nan() {
        return Err(CudaError::invalid(op, format!("NaN in {cfg:?}")));
    }
    Ok(())
}

/// Whether a draw takes the two-stage path given a scratch: sampled, with top-k 2 up to one
/// chunk (the device's `draws_candidates` decides the same for a row of [`sample_rows`]).
fn draws_candidates(cfg: &SamplingConfig, block: usize) -> bool {
    cfg.temperature > 0.0 && (2..=block).contains(&cfg.top_k)
}

/// Whether a draw over `vocab` logits runs a block per chunk: sampled with top-k off, over 2 to
/// `block` chunks of `block` logits. (At temperature alone the one-block path, the device's
/// `temperature_only`, draws the same token by chunks too.)
fn draws_by_chunks(cfg: &SamplingConfig, vocab: usize, block: usize) -> bool {
    cfg.temperature > 0.0 && (cfg.top_k == 0 || cfg.top_k >= vocab) && vocab > block && vocab.div_ceil(block) <= block
}

/// The `sample_pass` launches before a draw by chunks: top-p's 8 digits, one (the maxima) for
/// min-p alone, none at temperature alone.
fn cut_passes(cfg: &SamplingConfig) -> u32 {
    if cfg.top_p > 0.0 && cfg.top_p < 1.0 {
        8
    } else {
        u32::from(cfg.min_p > 0.0)
    }
}

/// [`sample`], also delivering the token where `delivery` says. With `scratch`, over more than
/// 1024 logits: a draw with top-k up to 1024 runs in two stages, a block per chunk of 1024
/// logits keeping the chunk's own top-k (`topk_candidates`), then the single sampling block
/// looking at those candidates only (they hold every token the top-k keeps, so the token is the
/// same); a greedy draw is one launch of a block per chunk, each folding its chunk's best into
/// one packed `atomicMax`, the last to arrive delivering it (`argmax_chunks`); a draw with
/// top-k off runs a block per chunk in each launch: top-p's 8 digit passes (or min-p's one) find
/// the cut (`sample_pass`, every block extending it alike), then each block writes its
/// chunk's mass under the cut and the last to arrive draws the chunk and walks it
/// (`sample_chunks`; at temperature alone the one block takes the chunks in turn with the same
/// sums: the same token). Other draws (top-k over 1 024, no scratch) read the whole vocabulary
/// in one block.
#[allow(clippy::too_many_arguments)]
pub fn sample_delivering(
    gpu: &Gpu,
    logits: &impl DevicePtr<f32>,
    vocab: usize,
    cfg: &SamplingConfig,
    step: u64,
    counter: Option<&CudaView<'_, u32>>,
    out: &mut impl DevicePtrMut<u32>,
    delivery: Option<TokenDelivery<'_>>,
    scratch: Option<&mut SampleScratch>,
) -> Result<(), CudaError> {
    const OP: &str = "sample";
    if vocab == 0 {
        return Err(CudaError::invalid(OP, "no logits"));
    }
    check_config(OP, cfg)?;
    check_len(OP, "logits", logits.len(), vocab)?;
    check_len(OP, "out", out.len(), 1)?;
    if let Some(c) = counter {
        check_len(OP, "counter", c.len(), 1)?;
    }
    let variant = SamplingVariant::DEFAULT;
    let DeliveryAddrs { feed_ids, feed_pos, mailbox, next_pos, tag, advance } = delivery_addrs(OP, gpu, delivery)?;
    let block = variant.block_size as usize;
    let (greedy, k) = (cfg.temperature <= 0.0 || cfg.top_k == 1, cfg.top_k);
    let chunks = vocab.div_ceil(block);
    let (mut cand, mut cand_counts, mut best, mut arrivals, mut stats, mut n_chunks) = (0, 0, 0, 0, 0, 0);
    let by_chunks = draws_by_chunks(cfg, vocab, block);
    let staged = scratch.filter(|s| (greedy || by_chunks || draws_candidates(cfg, block)) && vocab > block && chunks <= block && s.vocab >= vocab);
    if let Some(s) = staged {
        (cand, cand_counts, best, arrivals, n_chunks) = (addr_mut(gpu, &mut s.cand), addr_mut(gpu, &mut s.counts), addr_mut(gpu, &mut s.best), addr_mut(gpu, &mut s.arrivals), chunks as u32);
        stats = addr_mut(gpu, &mut s.stats);
        if !greedy && !by_chunks {
            let params = CandidateParams { logits: addr(gpu, logits), cand, cand_counts, rows: 0, n: vocab as u32, top_k: k as u32, cand_cap: SamplingVariant::CANDIDATE_CAP, pad: 0 };
            gpu.launch(&variant, "topk_candidates", variant.rows_launch_config(n_chunks), &params)?;
        }
    }
    let params = SampleParams {
        logits: addr(gpu, logits),
        out: addr_mut(gpu, out),
        step_ptr: counter.map_or(0, |c| addr(gpu, c)),
        seed: cfg.seed,
        step,
        feed_ids,
        feed_pos,
        mailbox,
        error_flag: gpu.error_flag_ptr(),
        cand,
        cand_counts,
        best,
        arrivals,
        stats,
        rows: 0,
        n_chunks,
        n: as_u32(OP, "vocab", vocab)?,
        top_k: u32::try_from(cfg.top_k).unwrap_or(u32::MAX),
        temperature: cfg.temperature,
        top_p: cfg.top_p,
        min_p: cfg.min_p,
        next_pos,
        tag,
        advance,
        cand_cap: SamplingVariant::CANDIDATE_CAP,
        pass: 0,
        passes: 0,
    };
    if greedy && n_chunks > 0 {
        return gpu.launch(&variant, "argmax_chunks", variant.rows_launch_config(n_chunks), &params);
    }
    if by_chunks && n_chunks > 0 {
        let passes = cut_passes(cfg);
        for pass in 0..passes {
            gpu.launch(&variant, "sample_pass", variant.rows_launch_config(n_chunks), &SampleParams { pass, passes, ..params })?;
        }
        return gpu.launch(&variant, "sample_chunks", variant.rows_launch_config(n_chunks), &SampleParams { passes, ..params });
    }
    gpu.launch(&variant, "sample", variant.sample_launch_config(1, cand != 0), &params)
}

/// One draw of [`sample_rows`]: from logits row `row`, with `cfg` at `step`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowSample {
    pub row: usize,
    pub cfg: SamplingConfig,
    pub step: u64,
}

/// [`sample`] from several of `rows` rows of `vocab` logits (`logits[row * vocab..]`) in one
/// launch, a block per draw, each writing `out[row]`: the token a launch of its own would draw
/// (the blocks run side by side instead of one after another). The draws' settings reach the
/// device through `staging`, into `draw_words` ([`ROW_DRAW_WORDS`] a draw). With `scratch`
/// (for at least `draws.len()` draws) the draws with top-k up to 1 024 take the two-stage
/// path, all of their first stages in one `topk_candidates` launch.
#[allow(clippy::too_many_arguments)]
pub fn sample_rows(
    gpu: &Gpu,
    staging: &mut StagingRing,
    draw_words: &mut CudaSlice<u32>,
    logits: &impl DevicePtr<f32>,
    vocab: usize,
    rows: usize,
    draws: &[RowSample],
    out: &mut impl DevicePtrMut<u32>,
    scratch: Option<&mut SampleScratch>,
) -> Result<(), CudaError> {
    const OP: &str = "sample_rows";
    if vocab == 0 || rows == 0 {
        return Err(CudaError::invalid(OP, "no logits"));
    }
    check_len(OP, "logits", logits.len(), super::elems(OP, &[vocab, rows])?)?;
    check_len(OP, "out", out.len(), rows)?;
    if draws.is_empty() {
        return Ok(());
    }
    check_len(OP, "draw words", draw_words.len(), super::elems(OP, &[draws.len(), ROW_DRAW_WORDS])?)?;
    let mut drawn = vec![false; rows];
    let mut words = Vec::with_capacity(draws.len() * ROW_DRAW_WORDS);
    for d in draws {
        check_config(OP, &d.cfg)?;
        if d.row >= rows || std::mem::replace(&mut drawn[d.row], true) {
            return Err(CudaError::invalid(OP, format!("row {} is outside the {rows} rows or drawn twice", d.row)));
        }
        let draw = RowDraw {
            seed: d.cfg.seed,
            step: d.step,
            temperature: d.cfg.temperature,
            top_p: d.cfg.top_p,
            min_p: d.cfg.min_p,
            top_k: u32::try_from(d.cfg.top_k).unwrap_or(u32::MAX),
            row: d.row as u32,
            pad: 0,
        };
        words.extend_from_slice(&draw.words());
    }
    staging.copy(gpu, &words, &mut draw_words.slice_mut(0..words.len()))?;
    let variant = SamplingVariant::DEFAULT;
    let block = variant.block_size as usize;
    let (n, n_draws, chunks) = (as_u32(OP, "vocab", vocab)?, as_u32(OP, "draws", draws.len())?, vocab.div_ceil(block));
    let rows_addr = addr(gpu, draw_words);
    let (mut cand, mut cand_counts, mut n_chunks) = (0, 0, 0);
    let staged = scratch.filter(|s| vocab > block && chunks <= block && s.vocab >= vocab && s.draws >= draws.len());
    if let Some(s) = staged.filter(|_| draws.iter().any(|d| draws_candidates(&d.cfg, block))) {
        (cand, cand_counts, n_chunks) = (addr_mut(gpu, &mut s.cand), addr_mut(gpu, &mut s.counts), chunks as u32);
        let params = CandidateParams { logits: addr(gpu, logits), cand, cand_counts, rows: rows_addr, n, top_k: 0, cand_cap: SamplingVariant::CANDIDATE_CAP, pad: 0 };
        gpu.launch(&variant, "topk_candidates", variant.grid_launch_config(n_chunks, n_draws), &params)?;
    }
    let params = SampleParams {
        logits: addr(gpu, logits),
        out: addr_mut(gpu, out),
        error_flag: gpu.error_flag_ptr(),
        cand,
        cand_counts,
        rows: rows_addr,
        n_chunks,
        n,
        cand_cap: SamplingVariant::CANDIDATE_CAP,
        ..Default::default()
    };
    gpu.launch(&variant, "sample", variant.sample_launch_config(n_draws, cand != 0), &params)
}

/// `u32` words of one [`RowDraw`] on the device.
pub const ROW_DRAW_WORDS: usize = std::mem::size_of::<RowDraw>() / 4;

impl RowDraw {
    /// The draw as the device reads it (little-endian `repr(C)`: the `u64`s low word first).
    fn words(&self) -> [u32; ROW_DRAW_WORDS] {
        let [seed_lo, seed_hi, step_lo, step_hi] = [self.seed as u32, (self.seed >> 32) as u32, self.step as u32, (self.step >> 32) as u32];
        [seed_lo, seed_hi, step_lo, step_hi, self.temperature.to_bits(), self.top_p.to_bits(), self.min_p.to_bits(), self.top_k, self.row, self.pad]
    }
}

/// A token delivery's device addresses and words, as the kernels take them (all zero without
/// one).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct DeliveryAddrs {
    pub feed_ids: u64,
    pub feed_pos: u64,
    pub mailbox: u64,
    pub next_pos: u32,
    pub tag: u32,
    pub advance: u32,
}

/// [`DeliveryAddrs`] of `delivery`, checked (for op `op`'s errors).
fn delivery_addrs(op: &'static str, gpu: &Gpu, delivery: Option<TokenDelivery<'_>>) -> Result<DeliveryAddrs, CudaError> {
    let mut a = DeliveryAddrs::default();
    let Some(d) = delivery else { return Ok(a) };
    if let Some((ids, positions)) = d.next_step {
        check_len(op, "next step ids", ids.len(), 1)?;
        check_len(op, "next step positions", positions.len(), 1)?;
        (a.feed_ids, a.feed_pos) = (addr_mut(gpu, ids), addr_mut(gpu, positions));
    }
    match d.mail {
        Mail::Tagged { mailbox, slot, tag, next_pos } => (a.mailbox, a.tag, a.next_pos) = (mailbox.slot_addr(op, slot)?, tag, next_pos),
        Mail::Advancing { mailbox, pair } => {
            if a.feed_pos == 0 {
                return Err(CudaError::invalid(op, "an advancing delivery needs the next step's inputs"));
            }
            mailbox.slot_addr(op, pair + 1)?;
            (a.mailbox, a.advance) = (mailbox.slot_addr(op, pair)?, 1);
        }
    }
    Ok(a)
}
