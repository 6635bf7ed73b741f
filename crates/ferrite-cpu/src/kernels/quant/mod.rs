//! Dot products of weight rows with activations, one kernel family per weight dtype.
//!
//! Quantized weights are multiplied with activations quantized to 8 bits once per token
//! (per matmul call): integer dot products per block, then one float multiply-add per block.
//! Each family has a scalar kernel and x86 SIMD kernels computing the same integers.

pub(crate) mod float;
pub(crate) mod kquant;
pub(crate) mod legacy;
#[cfg(target_arch = "x86_64")]
mod x86;

use super::fvec;
use super::simd::SimdLevel;
use ferrite_gguf::GgmlType;
use rayon::prelude::*;

/// Dot products of one weight row with the activations of tokens `t0 .. t0 + NT`.
///
/// Safety: the kernel may use CPU features of the [`SimdLevel`] it was selected for; call it only
/// if that level is available. (Argument sizes are checked inside: wrong sizes panic, never read
/// out of bounds.)
pub(crate) type RowDot<A, const NT: usize> =
    unsafe fn(row: &[u8], acts: &A, t0: usize) -> [f32; NT];

/// A weight dtype's dot-product kernels.
pub(crate) trait DotKernel {
    /// The activations of all tokens, in the form the dot products read.
    type Acts: Sync;

    /// Converts `n_tokens` rows of `cols` activations (`x.len() == n_tokens * cols`).
    fn prepare(x: &[f32], cols: usize, n_tokens: usize) -> Self::Acts;

    /// The row kernel for `level` (scalar when the family has no kernel for that level).
    fn row_dot<const NT: usize>(level: SimdLevel) -> RowDot<Self::Acts, NT>;
}

/// The kernels' bounds guard: `row` must be one row and tokens `t0 .. t0 + nt` must exist.
#[inline(always)]
fn check_row(dtype: GgmlType, row: &[u8], row_bytes: usize, t0: usize, nt: usize, n_tokens: usize) {
    assert!(
        row.len() == row_bytes && t0 + nt <= n_tokens,
        "{dtype} dot: row of {} bytes (expected {row_bytes}) or tokens {t0}..{} of {n_tokens}",
        row.len(),
        t0 + nt
    );
}

/// Symmetric 8-bit quantization of one block: `q = round(x / d)` with `d = max|x| / 127`.
/// Returns `d` and the sum of the codes. A NaN in the block makes `d` NaN, so that it reaches
/// the outputs instead of turning into arbitrary codes.
#[inline(always)]
fn quantize_block<const N: usize>(x: &[f32; N], q: &mut [i8; N]) -> (f32, i32) {
    // max |x| on the bit patterns: with the sign cleared, integer order is float order and NaNs
    // sort above infinity. Unlike `f32::max`, an integer max reduction vectorizes.
    let max_bits = x.iter().fold(0u32, |m, v| m.max(v.to_bits() & 0x7FFF_FFFF));
    if max_bits > f32::INFINITY.to_bits() {
        q.fill(0);
        return (f32::NAN, 0);
    }
    let amax = f32::from_bits(max_bits);
    let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
    let mut sum = 0i32;
    for (q, &v) in q.iter_mut().zip(x) {
        let c = fvec::round_i32(v * inv);
        *q = c as i8;
        sum += c;
    }
    (amax / 127.0, sum)
}

fvec::multiversion! {
    /// [`quantize_block`] over the `N`-element blocks of one row, handing each block's index,
    /// `d` and code sum to `store`. Compiled for the CPU's widest vectors (the baseline x86-64
    /// build has only SSE2): the activations of every matmul pass through here.
    fn quantize_blocks<const N: usize>(x: &[f32], qs: &mut [i8], store: impl FnMut(usize, f32, i32)) {
        let mut store = store;
        let (x, qs) = (x.as_chunks::<N>().0, qs.as_chunks_mut::<N>().0);
        for (b, (x, q)) in x.iter().zip(qs).enumerate() {
            let (d, sum) = quantize_block(x, q);
            store(b, d, sum);
        }
    }
}

/// Activations in 32-element blocks with Q8_0/Q8_1 numerics, stored struct-of-arrays so that
/// SIMD kernels load the codes of consecutive blocks with one instruction.
pub(crate) struct ActQ8 {
    cols: usize,
    n_tokens: usize,
    /// `n_tokens * cols` codes.
    qs: Vec<i8>,
    /// Per block: `[d, d * sum(q)]` (the second term serves the weight offsets and minimums).
    ds: Vec<[f32; 2]>,
}

impl ActQ8 {
    pub(crate) const BLOCK: usize = 32;

    pub(crate) fn quantize(x: &[f32], cols: usize, n_tokens: usize) -> Self {
        assert!(
            cols.is_multiple_of(Self::BLOCK) && x.len() == cols * n_tokens,
            "activation shape"
        );
        let nb = cols / Self::BLOCK;
        let mut qs = vec![0i8; x.len()];
        let mut ds = vec![[0f32; 2]; nb * n_tokens];
        // A token's codes and scales; on the calling thread for the few tokens of a decode step
        // (at ~1 ns per 32 values, waking another thread costs more than it saves), on the pool
        // for a prompt's.
        #[cfg(target_arch = "x86_64")]
        let avx512 = super::simd::simd_level() == SimdLevel::Avx512Vnni;
        let row = |t: usize, qs: &mut [i8], ds: &mut [[f32; 2]]| {
            let (x, store) = (&x[t * cols..(t + 1) * cols], |b: usize, d: f32, sum: i32| ds[b] = [d, d * sum as f32]);
            #[cfg(target_arch = "x86_64")]
            if avx512 {
                // SAFETY: the level is reported only where AVX-512 F and BW are available.
                return unsafe { x86::quantize_blocks32_avx512(x, qs, store) };
            }
            quantize_blocks::<{ Self::BLOCK }>(x, qs, store);
        };
        super::for_each_row_pair(&mut qs, cols, &mut ds, nb, row);
        ActQ8 {
            cols,
            n_tokens,
            qs,
            ds,
        }
    }

    /// Codes and block scales of token `t`.
    #[inline(always)]
    pub(crate) fn token(&self, t: usize) -> (&[i8], &[[f32; 2]]) {
        let nb = self.cols / Self::BLOCK;
        (
            &self.qs[t * self.cols..(t + 1) * self.cols],
            &self.ds[t * nb..(t + 1) * nb],
        )
    }

    pub(crate) fn blocks(&self) -> usize {
        self.cols / Self::BLOCK
    }

    pub(crate) fn n_tokens(&self) -> usize {
        self.n_tokens
    }
}

/// Activations in 256-element super-blocks with Q8_K numerics (one scale per super-block, sums
/// of each 16 codes), struct-of-arrays.
pub(crate) struct ActQ8K {
    cols: usize,
    n_tokens: usize,
    qs: Vec<i8>,
    d: Vec<f32>,
    /// Sum of the codes of each group of 16.
    bsums: Vec<i16>,
}

impl ActQ8K {
    pub(crate) const BLOCK: usize = ferrite_gguf::dtype::QK_K;
    pub(crate) const GROUP: usize = 16;

    pub(crate) fn quantize(x: &[f32], cols: usize, n_tokens: usize) -> Self {
        assert!(
            cols.is_multiple_of(Self::BLOCK) && x.len() == cols * n_tokens,
            "activation shape"
        );
        let nb = cols / Self::BLOCK;
        let mut qs = vec![0i8; x.len()];
        let mut d = vec![0f32; nb * n_tokens];
        let mut bsums = vec![0i16; cols / Self::GROUP * n_tokens];
        let ng = cols / Self::GROUP;
        x.par_chunks(cols)
            .zip(qs.par_chunks_mut(cols))
            .zip(d.par_chunks_mut(nb))
            .zip(bsums.par_chunks_mut(ng))
            .for_each(|(((x, qs), d), bsums)| {
                quantize_blocks::<{ Self::BLOCK }>(x, qs, |b, db, _| d[b] = db);
                for (q, s) in qs.chunks_exact(Self::GROUP).zip(bsums.iter_mut()) {
                    *s = q.iter().map(|&c| c as i16).sum();
                }
            });
        ActQ8K {
            cols,
            n_tokens,
            qs,
            d,
            bsums,
        }
    }

    /// Codes, super-block scales and group sums of token `t`.
    #[inline(always)]
    pub(crate) fn token(&self, t: usize) -> (&[i8], &[f32], &[i16]) {
        let (nb, ng) = (self.cols / Self::BLOCK, self.cols / Self::GROUP);
        (
            &self.qs[t * self.cols..(t + 1) * self.cols],
            &self.d[t * nb..(t + 1) * nb],
            &self.bsums[t * ng..(t + 1) * ng],
        )
    }

    pub(crate) fn blocks(&self) -> usize {
        self.cols / Self::BLOCK
    }

    pub(crate) fn n_tokens(&self) -> usize {
        self.n_tokens
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vectorized quantizer gives the plain formula's codes and scales bit for bit, NaN
    /// blocks and all-zero blocks included.
    #[test]
    fn q8_blocks_match_the_plain_formula() {
        let mut x: Vec<f32> = (0..96 * 4).map(|i| ((i * 7919 % 1013) as f32 - 506.0) * 3.1e-3).collect();
        x[5] = f32::NAN;
        x[96 + 40..96 + 64].fill(0.0);
        x[96 + 32..96 + 40].fill(-0.0);
        x[200] = 2.5e-3;
        let a = ActQ8::quantize(&x, 96, 4);
        for (b, block) in x.chunks_exact(32).enumerate() {
            let (t, tb) = (b / 3, b % 3);
            let (qs, ds) = a.token(t);
            let (q, [d, s]) = (&qs[tb * 32..][..32], ds[tb]);
            if block.iter().any(|v| v.is_nan()) {
                assert!(d.is_nan() && q.iter().all(|&c| c == 0), "block {b}");
                continue;
            }
            let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
            let want: Vec<i8> = block.iter().map(|&v| fvec::round_i32(v * inv) as i8).collect();
            assert_eq!(q, &want[..], "block {b}");
            assert_eq!(d.to_bits(), (amax / 127.0).to_bits(), "block {b}");
            assert_eq!(s, d * want.iter().map(|&c| c as i32).sum::<i32>() as f32, "block {b}");
        }
    }

    /// Rows of many blocks (the AVX-512 quantizer's groups of 16 blocks, a group with a NaN, one
    /// with an infinity, zero and negative-zero blocks, a partial group at the end) give the
    /// codes, scales and sums of the block-by-block formula, bit for bit.
    #[test]
    fn long_rows_match_the_block_formula() {
        let cols = 32 * 53;
        let mut x: Vec<f32> = (0..cols * 3).map(|i| ((i * 7919 % 2027) as f32 - 1013.0) * 1.7e-3 * (1 + i % 5) as f32).collect();
        x[40 * 32 + 7] = f32::NAN; // group 2 of row 0
        x[cols + 20 * 32 + 3] = f32::INFINITY; // group 1 of row 1
        x[2 * cols..2 * cols + 64].fill(0.0);
        x[2 * cols + 64..2 * cols + 96].fill(-0.0);
        x[2 * cols + 100] = 126.999; // a large value beside small ones
        let a = ActQ8::quantize(&x, cols, 3);
        for (t, row) in x.chunks(cols).enumerate() {
            let (qs, ds) = a.token(t);
            for (b, block) in row.chunks_exact(32).enumerate() {
                let mut want = [0i8; 32];
                let (d, sum) = quantize_block::<32>(block.try_into().unwrap(), &mut want);
                assert_eq!(&qs[b * 32..][..32], &want[..], "row {t} block {b}");
                assert_eq!(ds[b][0].to_bits(), d.to_bits(), "row {t} block {b}");
                assert_eq!(ds[b][1].to_bits(), (d * sum as f32).to_bits(), "row {t} block {b}");
            }
        }
    }

    /// A prompt's tokens (quantized on the pool) get the codes and scales each token gets alone.
    #[test]
    fn many_tokens_quantize_as_each_alone() {
        let n = 3 * crate::kernels::PAR_MIN_ROWS;
        let x: Vec<f32> = (0..64 * n).map(|i| ((i * 7919 % 1013) as f32 - 506.0) * 3.1e-3).collect();
        let all = ActQ8::quantize(&x, 64, n);
        for t in 0..n {
            let one = ActQ8::quantize(&x[t * 64..(t + 1) * 64], 64, 1);
            assert_eq!(all.token(t).0, one.token(0).0, "token {t}");
            assert_eq!(all.token(t).1, one.token(0).1, "token {t}");
        }
    }

    #[test]
    fn q8_blocks_bound_the_error_by_half_a_step() {
        let x: Vec<f32> = (0..64 * 3)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
            .collect();
        let a = ActQ8::quantize(&x, 64, 3);
        for t in 0..3 {
            let (qs, ds) = a.token(t);
            for (i, &q) in qs.iter().enumerate() {
                let [d, s] = ds[i / 32];
                assert!((q as f32 * d - x[t * 64 + i]).abs() <= d * 0.5 * (1.0 + 1e-6));
                let sum: i32 = qs[i / 32 * 32..i / 32 * 32 + 32]
                    .iter()
                    .map(|&c| c as i32)
                    .sum();
                assert_eq!(s, d * sum as f32);
            }
        }
        let k = ActQ8K::quantize(&vec![0.25; 512], 256, 2);
        let (qs, d, bsums) = k.token(1);
        assert!(qs.iter().all(|&q| q == 127) && d[0] == 0.25 / 127.0);
        assert!(bsums.iter().all(|&s| s == 16 * 127));
    }
}
