//! Q4_0 / Q4_1 / Q8_0 weights repacked at load into groups of rows, for the AVX2 (8 rows) and
//! AVX-512 VNNI (16 rows) matmuls.
//!
//! The GGUF layout keeps each row's blocks together, so a dot-product kernel converts and
//! scales every (row, block, token) on its own: about 9 instructions per 32 multiply-adds. Here,
//! per block, the group's scales sit side by side and their codes interleave by 4 bytes: one
//! register holds 4 codes of each row of the group, so one `vpmaddubsw` with a broadcast of 4
//! activation codes serves every row, and each (group, block, token) needs one conversion and
//! two multiply-adds. AVX2, 8 rows in a 256-bit register: about 30 instructions per 256
//! multiply-adds for the 4-bit types, 43 for Q8_0, whose signed codes take `vpsignb` and whose
//! pair sums need 32-bit adds. The integer sums are those of the row kernels; only the order of
//! the float additions differs.
//!
//! On AVX-512 VNNI CPUs a group is 16 rows in a 512-bit register, and one `vpdpbusd` replaces
//! each `vpmaddubsw` and the adds after it (it accumulates the four products of each row straight
//! into 32 bits): about 13 instructions per 512 multiply-adds for every type (the 512-bit
//! `vpdpbusd` issues nearly twice a cycle on Sapphire Rapids, as the 256-bit one does, so the
//! wider groups double the arithmetic rate of the batched steps). Its unsigned side takes the
//! weight codes, so the Q8_0 codes are stored biased by 128 (`c + 128` as a byte) and the bias
//! comes back out through the activations' block sums, as Q4_0's offset of 8 does.
//!
//! Group layout per block, for `R` rows: `d` of the rows (f16), `m` of the rows (f16, Q4_1
//! only), then the codes. 4-bit: 4 x 4R bytes, register q holds bytes 4q .. 4q + 3 of each row's
//! 16 `qs` bytes (low nibbles: elements 4q ..; high nibbles: elements 16 + 4q ..). Q8_0: 8 x 4R
//! bytes, register j holds elements 4j .. 4j + 3 of each row (biased by 128 for the VNNI kernel).

use super::matmul::for_each_row_chunk;
use super::quant::ActQ8;
use super::simd::{simd_level, SimdLevel};
use super::{KernelError, WeightView};
use ferrite_gguf::GgmlType;
use std::ops::Range;
use std::sync::Arc;

/// Bytes ahead of the block being read that the kernels prefetch.
pub(crate) const PREFETCH_AHEAD: usize = 8192;

/// Rows per group of the layout for `level`'s kernel.
const fn group_rows(level: SimdLevel) -> usize {
    match level {
        SimdLevel::Avx512Vnni => 16,
        _ => 8,
    }
}

/// A Q4_0, Q4_1 or Q8_0 weight in row groups (see the module docs).
pub struct RowGroups {
    /// The kernel the copy is laid out for: [`SimdLevel::Avx2`] or [`SimdLevel::Avx512Vnni`].
    level: SimdLevel,
    dtype: GgmlType,
    rows: usize,
    cols: usize,
    data: Bytes,
}

/// Where a [`RowGroups`] keeps its bytes: a buffer of its own, or a range of one shared by all
/// of a model's copies ([`RowGroups::repack_into_one_buffer`]).
enum Bytes {
    Own(Vec<u8>),
    Shared(Arc<Vec<u8>>, Range<usize>),
}

/// What a repack makes of a `dtype` matrix of `rows x cols`: the kernel level its groups are
/// laid out for, and so its size.
#[derive(Clone, Copy, Debug)]
pub struct Layout {
    level: SimdLevel,
    dtype: GgmlType,
    rows: usize,
    cols: usize,
}

impl Layout {
    /// The layout of the best kernel this CPU runs for such a matrix (see [`RowGroups::repack`]).
    pub fn best(dtype: GgmlType, rows: usize, cols: usize) -> Option<Self> {
        let vnni = (simd_level() == SimdLevel::Avx512Vnni).then(|| Self::for_level(dtype, rows, cols, SimdLevel::Avx512Vnni));
        vnni.flatten().or_else(|| Self::for_level(dtype, rows, cols, SimdLevel::Avx2))
    }

    /// The layout of `level`'s kernel (see [`RowGroups::repack_for`]).
    pub fn for_level(dtype: GgmlType, rows: usize, cols: usize, level: SimdLevel) -> Option<Self> {
        let kernel_level = matches!(level, SimdLevel::Avx2 | SimdLevel::Avx512Vnni);
        let whole = rows.is_multiple_of(group_rows(level)) && cols > 0 && cols.is_multiple_of(32);
        (kernel_level && level.is_available() && matches!(dtype, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0) && whole).then_some(Layout { level, dtype, rows, cols })
    }

    /// Bytes of the repacked matrix.
    pub fn bytes(&self) -> usize {
        self.rows / group_rows(self.level) * self.cols / 32 * group_bytes(self.dtype, group_rows(self.level))
    }

    fn with(self, data: Bytes) -> RowGroups {
        RowGroups { level: self.level, dtype: self.dtype, rows: self.rows, cols: self.cols, data }
    }

    /// Writes `w` (of this layout's type and shape) repacked into `data` (`self.bytes()` long).
    fn fill(&self, w: &WeightView, data: &mut [u8]) {
        let (level, rows) = (self.level, group_rows(self.level));
        assert!(w.dtype == self.dtype && w.rows == self.rows && w.cols == self.cols && data.len() == self.bytes(), "row_groups: a weight repacked for another layout");
        let row_bytes = self.dtype.row_bytes(self.cols).expect("whole blocks (Layout::for_level)");
        let (nb, block, min, bytes8) = (w.cols / 32, w.dtype.type_size(), w.dtype == GgmlType::Q4_1, w.dtype == GgmlType::Q8_0);
        let group = group_bytes(w.dtype, rows);
        let qs_at = if min { 4 } else { 2 };
        // Registers of 4 code bytes per row: the 16 nibble bytes or the 32 int8 codes.
        let registers = if bytes8 { 8 } else { 4 };
        let bias = if bytes8 && level == SimdLevel::Avx512Vnni { 0x80 } else { 0 };
        for (g, dst) in data.chunks_exact_mut(nb * group).enumerate() {
            for (b, dst) in dst.chunks_exact_mut(group).enumerate() {
                for r in 0..rows {
                    let src = &w.data[(g * rows + r) * row_bytes + b * block..][..block];
                    dst[2 * r..2 * r + 2].copy_from_slice(&src[..2]);
                    if min {
                        dst[2 * rows + 2 * r..2 * rows + 2 * r + 2].copy_from_slice(&src[2..4]);
                    }
                    let codes = &mut dst[if min { 4 * rows } else { 2 * rows }..];
                    for q in 0..registers {
                        for (dst, &src) in codes[(q * rows + r) * 4..][..4].iter_mut().zip(&src[qs_at + 4 * q..qs_at + 4 * q + 4]) {
                            *dst = src ^ bias;
                        }
                    }
                }
            }
        }
    }
}

impl RowGroups {
    /// Whether the executors should repack: on CPUs whose best kernels are AVX2 or AVX-512 VNNI,
    /// unless `FERRITE_CPU_ROW_GROUPS=0` (or `FERRITE_CPU_SCALAR=1`).
    pub fn preferred() -> bool {
        matches!(simd_level(), SimdLevel::Avx2 | SimdLevel::Avx512Vnni) && ferrite_core::env::CPU_ROW_GROUPS.flag()
    }

    /// The repacked copy of `w` for the best kernel this CPU runs (the AVX2 one where the rows
    /// are not whole 16-row VNNI groups), or `None` where no layout serves: other types than
    /// Q4_0/Q4_1/Q8_0, rows not a multiple of 8, or a CPU without AVX2.
    pub fn repack(w: &WeightView) -> Option<Self> {
        w.row_bytes("row_groups").ok()?;
        Layout::best(w.dtype, w.rows, w.cols).map(|l| Self::repack_own(l, w))
    }

    /// The repacked copy of `w` for the kernel of `level` (`Avx2`: 8-row groups, or
    /// `Avx512Vnni`: 16-row groups), or `None` where that kernel cannot serve (other types,
    /// rows not whole groups, or the CPU lacks `level`).
    pub fn repack_for(w: &WeightView, level: SimdLevel) -> Option<Self> {
        w.row_bytes("row_groups").ok()?;
        Layout::for_level(w.dtype, w.rows, w.cols, level).map(|l| Self::repack_own(l, w))
    }

    fn repack_own(layout: Layout, w: &WeightView) -> Self {
        let mut data = vec![0u8; layout.bytes()];
        layout.fill(w, &mut data);
        layout.with(Bytes::Own(data))
    }

    /// Repacks matrices of the given layouts (`source(i)`: matrix i's GGUF bytes) into one
    /// buffer, in their order, backed by huge pages where the OS offers them: a decode step
    /// streams every weight, and in 4 KiB pages (each copy its own allocation, too small for a
    /// 2 MiB page) the TLB misses cost ~5% of a SmolLM2 step on 2 cores (docs/perf.md, stop 30).
    /// Written in place, so the weights are in memory once.
    pub fn repack_into_one_buffer<B: AsRef<[u8]>>(layouts: &[Layout], mut source: impl FnMut(usize) -> anyhow::Result<B>) -> anyhow::Result<Vec<Self>> {
        let total = layouts.iter().map(Layout::bytes).sum();
        let mut buf = vec![0u8; total];
        crate::memory::advise_huge_pages(&buf);
        let mut ranges = Vec::with_capacity(layouts.len());
        let mut at = 0;
        for (i, l) in layouts.iter().enumerate() {
            let bytes = source(i)?;
            let w = WeightView { dtype: l.dtype, rows: l.rows, cols: l.cols, data: bytes.as_ref() };
            w.row_bytes("row_groups")?;
            l.fill(&w, &mut buf[at..at + l.bytes()]);
            ranges.push(at..at + l.bytes());
            at += l.bytes();
        }
        let buf = Arc::new(buf);
        Ok(layouts.iter().zip(ranges).map(|(l, r)| l.with(Bytes::Shared(Arc::clone(&buf), r))).collect())
    }

    /// Rows per group of this copy's layout.
    pub fn group_rows(&self) -> usize {
        group_rows(self.level)
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes of the repacked copy.
    pub fn bytes(&self) -> usize {
        self.data().len()
    }

    fn data(&self) -> &[u8] {
        match &self.data {
            Bytes::Own(v) => v,
            Bytes::Shared(buf, range) => &buf[range.clone()],
        }
    }

    /// `out[t * m + i] = x[t] · W[rows.start + i]` (`m = rows.len()`) for `n_tokens` tokens; the
    /// range must be whole groups.
    pub fn matmul(&self, rows: std::ops::Range<usize>, x: &[f32], n_tokens: usize, out: &mut [f32]) -> Result<(), KernelError> {
        self.matmul_add(rows, x, n_tokens, out, None)
    }

    /// [`Self::matmul`], then `out += residual` (as long as `out`), each task adding to its own
    /// rows while they are in cache: the same sums as a separate pass, which a decode step of 8
    /// sequences ran on one thread (~1.3 us a layer's projection, the other threads waiting).
    pub fn matmul_add(&self, rows: std::ops::Range<usize>, x: &[f32], n_tokens: usize, out: &mut [f32], residual: Option<&[f32]>) -> Result<(), KernelError> {
        let (m, cols, group) = (rows.len(), self.cols, self.group_rows());
        let shape = |detail: String| KernelError::Shape { op: "row_groups", detail };
        if !rows.start.is_multiple_of(group) || !m.is_multiple_of(group) || rows.end > self.rows {
            return Err(shape(format!("rows {rows:?} are not whole {group}-row groups of 0..{}", self.rows)));
        }
        if x.len() != n_tokens * cols || out.len() != n_tokens * m || residual.is_some_and(|r| r.len() != out.len()) {
            let res = residual.map_or(String::new(), |r| format!(", residual {}", r.len()));
            return Err(shape(format!("{n_tokens} tokens: input {} and output {}{res} values for {m} x {cols}", x.len(), out.len())));
        }
        if out.is_empty() {
            return Ok(());
        }
        let acts = ActQ8::quantize(x, cols, n_tokens);
        let per_group = cols / 32 * group_bytes(self.dtype, group);
        let weights = &self.data()[rows.start / group * per_group..rows.end / group * per_group];
        // Widest token tiles first: the AVX2 kernel's 16 registers hold 4 tokens' sums beside
        // the 8 code registers, the AVX-512 kernel's 32 hold 8.
        macro_rules! tiles {
            ($dot:ident, $kind:expr, [$($nt:literal),*]) => {
                &[$(($nt, $dot::<{ $kind }, $nt> as GroupDot)),*]
            };
        }
        let tiles: &[(usize, GroupDot)] = match (self.level, self.dtype) {
            (SimdLevel::Avx512Vnni, GgmlType::Q4_0) => tiles!(group_dot_vnni, Q4_0, [8, 4, 2, 1]),
            (SimdLevel::Avx512Vnni, GgmlType::Q4_1) => tiles!(group_dot_vnni, Q4_1, [8, 4, 2, 1]),
            (SimdLevel::Avx512Vnni, _) => tiles!(group_dot_vnni, Q8_0, [8, 4, 2, 1]),
            (_, GgmlType::Q4_0) => tiles!(group_dot_avx2, Q4_0, [4, 2, 1]),
            (_, GgmlType::Q4_1) => tiles!(group_dot_avx2, Q4_1, [4, 2, 1]),
            _ => tiles!(group_dot_avx2, Q8_0, [4, 2, 1]),
        };
        let chunk = balanced_chunk(m / group, rayon::current_num_threads()) * group;
        for_each_row_chunk(out, m, n_tokens, chunk, |c, outs| {
            let n_rows = outs[0].len();
            for g in 0..n_rows / group {
                let w = &weights[(c * chunk / group + g) * per_group..][..per_group];
                let mut t = 0;
                for &(nt, dot) in tiles {
                    while t + nt <= n_tokens {
                        // SAFETY: `repack_for` makes a copy only for a level the CPU has.
                        unsafe { dot(w, &acts, t, &mut outs[t..t + nt], g * group) };
                        t += nt;
                    }
                }
            }
            if let Some(residual) = residual {
                for (t, out) in outs.iter_mut().enumerate() {
                    out.iter_mut().zip(&residual[t * m + c * chunk..]).for_each(|(o, r)| *o += r);
                }
            }
        });
        Ok(())
    }
}

/// Groups per task when `n_groups` are shared by `threads`: 4 to 8 tasks per thread (some
/// slack for the stealing), sized so that the busiest thread's share is as small as whole
/// chunks allow (a 576-row matrix in 16-row groups: 12 tasks of 3, not 8 of 5 where one
/// thread gets 20 groups and the other 16).
fn balanced_chunk(n_groups: usize, threads: usize) -> usize {
    let threads = threads.max(1);
    let busiest = |c: usize| n_groups.div_ceil(c).div_ceil(threads) * c;
    let (lo, hi) = (n_groups.div_ceil(8 * threads).max(1), n_groups.div_ceil(4 * threads).max(1));
    (lo..=hi).min_by_key(|&c| busiest(c)).unwrap_or(1)
}

// The kernels' weight formats.
const Q4_0: u8 = 0;
const Q4_1: u8 = 1;
const Q8_0: u8 = 2;

/// Bytes of one block of a group of `rows` rows: the scales, then the code registers.
const fn block_bytes(kind: u8, rows: usize) -> usize {
    rows * match kind {
        Q4_0 => 2 + 16,
        Q4_1 => 4 + 16,
        _ => 2 + 32,
    }
}

fn group_bytes(dtype: GgmlType, rows: usize) -> usize {
    let kind = match dtype {
        GgmlType::Q4_0 => Q4_0,
        GgmlType::Q4_1 => Q4_1,
        _ => Q8_0,
    };
    block_bytes(kind, rows)
}

/// One group's dot products with tokens `t0 ..` (as many as the kernel's tile): token `t0 + t`'s
/// into `outs[t][at ..]` (the group's rows).
type GroupDot = unsafe fn(group: &[u8], acts: &ActQ8, t0: usize, outs: &mut [&mut [f32]], at: usize);

/// The vector width of a kernel: its intrinsics under one set of names (plain re-exports, so
/// they inline into the kernels' `target_feature` functions), and its rows per group.
#[cfg(target_arch = "x86_64")]
mod ymm {
    pub use std::arch::x86_64::{
        __m128i as Half, __m256i as Ints, _mm256_abs_epi8 as abs_epi8, _mm256_add_epi32 as add_epi32, _mm256_and_si256 as and_si,
        _mm256_cvtepi32_ps as cvtepi32_ps, _mm256_cvtph_ps as cvtph_ps, _mm256_fmadd_ps as fmadd_ps,
        _mm256_loadu_si256 as loadu_si, _mm256_mul_ps as mul_ps, _mm256_set1_epi32 as set1_epi32, _mm256_set1_epi8 as set1_epi8,
        _mm256_set1_ps as set1_ps, _mm256_setzero_ps as setzero_ps, _mm256_setzero_si256 as setzero_si, _mm256_srli_epi16 as srli_epi16,
        _mm256_storeu_ps as storeu_ps, _mm_loadu_si128 as loadu_half,
    };
    pub const ROWS: usize = 8;
}

#[cfg(target_arch = "x86_64")]
mod zmm {
    pub use std::arch::x86_64::{
        __m256i as Half, __m512i as Ints, _mm256_loadu_si256 as loadu_half, _mm512_abs_epi8 as abs_epi8, _mm512_add_epi32 as add_epi32,
        _mm512_and_si512 as and_si, _mm512_cvtepi32_ps as cvtepi32_ps, _mm512_cvtph_ps as cvtph_ps, _mm512_dpbusd_epi32 as dpbusd_epi32,
        _mm512_fmadd_ps as fmadd_ps, _mm512_loadu_si512 as loadu_si, _mm512_mul_ps as mul_ps, _mm512_set1_epi32 as set1_epi32,
        _mm512_set1_epi8 as set1_epi8, _mm512_set1_ps as set1_ps, _mm512_setzero_ps as setzero_ps, _mm512_setzero_si512 as setzero_si,
        _mm512_srli_epi16 as srli_epi16, _mm512_storeu_ps as storeu_ps,
    };
    pub const ROWS: usize = 16;
}

/// `sum_b (d_r * da) * (codes_r · y) + c_r * sa * F`, with c = m and F = 1 for Q4_1, c = d and
/// F = -8 for Q4_0 (its codes are offset by 8), for Q8_0 F = -128 where its codes are stored
/// biased (VNNI) and no such term otherwise. The kernels differ in their vector width (`$width`:
/// a module above) and in the integer dot of a block (`$isum`, from the unsigned codes, the
/// signed ones and the broadcast activations).
macro_rules! group_dot_kernel {
    ($name:ident, $features:literal, $width:ident, q8_biased: $biased:literal, |$ucodes:ident, $codes:ident, $y4:ident| $isum:expr) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        unsafe fn $name<const KIND: u8, const NT: usize>(group: &[u8], acts: &ActQ8, t0: usize, outs: &mut [&mut [f32]], at: usize) {
            #[allow(unused_imports)]
            use std::arch::x86_64::*;
            use $width::*;
            let nb = acts.blocks();
            let block = block_bytes(KIND, ROWS);
            assert!(
                group.len() == nb * block && t0 + NT <= acts.n_tokens() && outs.len() == NT && outs.iter().all(|o| at + ROWS <= o.len()),
                "row_groups: kernel arguments"
            );
            let low = set1_epi8(0x0F);
            let min_factor = set1_ps(match KIND {
                Q4_1 => 1.0,
                Q4_0 => -8.0,
                _ => -128.0,
            });
            let min_term = KIND != Q8_0 || $biased;
            let tokens: [(&[i8], &[[f32; 2]]); NT] = std::array::from_fn(|t| acts.token(t0 + t));
            let mut acc = [setzero_ps(); NT];
            for b in 0..nb {
                let p = group.as_ptr().add(b * block);
                // Streaming from memory, the hardware prefetcher alone leaves this one sequential
                // read latency-bound; ask for the bytes a few blocks ahead (a prefetch never faults),
                // with the T2 hint: on Sapphire Rapids 8 KiB ahead into L2 streamed ~15% faster than
                // 4 KiB into L1 (perf.md, stop 26).
                for l in (0..block).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T2>(p.wrapping_add(PREFETCH_AHEAD + l) as *const i8);
                }
                let d = cvtph_ps(loadu_half(p as *const Half));
                let c = if KIND == Q4_1 { cvtph_ps(loadu_half(p.add(2 * ROWS) as *const Half)) } else { d };
                let c = mul_ps(c, min_factor);
                let q = p.add(if KIND == Q4_1 { 4 * ROWS } else { 2 * ROWS });
                // Register j: codes of elements 4j .. 4j + 3 of the rows (4-bit: j < 4 low
                // nibbles, else high ones; Q8_0: as stored, and unbiased their magnitudes).
                let mut $codes = [setzero_si(); 8];
                let mut $ucodes = [setzero_si(); 8];
                if KIND == Q8_0 {
                    for j in 0..8 {
                        $codes[j] = loadu_si(q.add(4 * ROWS * j) as *const Ints);
                        $ucodes[j] = if $biased { $codes[j] } else { abs_epi8($codes[j]) };
                    }
                } else {
                    for i in 0..4 {
                        let v = loadu_si(q.add(4 * ROWS * i) as *const Ints);
                        $ucodes[i] = and_si(v, low);
                        $ucodes[i + 4] = and_si(srli_epi16::<4>(v), low);
                    }
                }
                for (t, (qs, ds)) in tokens.iter().enumerate() {
                    let y = qs.as_ptr().add(b * 32) as *const i32;
                    let $y4 = |j: usize| set1_epi32(y.add(j).read_unaligned());
                    let isum: Ints = $isum;
                    let [da, sa] = ds[b];
                    acc[t] = fmadd_ps(cvtepi32_ps(isum), mul_ps(d, set1_ps(da)), acc[t]);
                    if min_term {
                        acc[t] = fmadd_ps(c, set1_ps(sa), acc[t]);
                    }
                }
            }
            for (o, a) in outs.iter_mut().zip(acc) {
                storeu_ps(o.as_mut_ptr().add(at), a);
            }
        }
    };
}

group_dot_kernel!(group_dot_avx2, "avx2,fma,f16c", ymm, q8_biased: false, |ucodes, codes, y4| {
    let ones = _mm256_set1_epi16(1);
    if KIND == Q8_0 {
        // A pair sum reaches 2 * 128 * 127: each goes to 32 bits before adding.
        let dot = |j: usize| _mm256_madd_epi16(_mm256_maddubs_epi16(ucodes[j], _mm256_sign_epi8(y4(j), codes[j])), ones);
        (1..8).fold(dot(0), |s, j| add_epi32(s, dot(j)))
    } else {
        // |sum of 8 pairs| <= 8 * 2 * 15 * 127 fits vpmaddubsw's 16-bit lanes.
        let s = (1..8).fold(_mm256_maddubs_epi16(ucodes[0], y4(0)), |s, j| _mm256_add_epi16(s, _mm256_maddubs_epi16(ucodes[j], y4(j))));
        _mm256_madd_epi16(s, ones)
    }
});

// Two accumulation chains, so that each `vpdpbusd` waits for the one two before it (one chain
// per token was slower, even with 8 tokens' chains to overlap: perf.md, stop 27).
group_dot_kernel!(group_dot_vnni, "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni", zmm, q8_biased: true, |ucodes, codes, y4| {
    let _ = &codes;
    let (mut s0, mut s1) = (setzero_si(), setzero_si());
    for j in (0..8).step_by(2) {
        s0 = dpbusd_epi32(s0, ucodes[j], y4(j));
        s1 = dpbusd_epi32(s1, ucodes[j + 1], y4(j + 1));
    }
    add_epi32(s0, s1)
});

#[cfg(not(target_arch = "x86_64"))]
unsafe fn group_dot_avx2<const KIND: u8, const NT: usize>(_: &[u8], _: &ActQ8, _: usize, _: &mut [&mut [f32]], _: usize) {
    unreachable!("row groups are made only where the AVX2 kernel runs")
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn group_dot_vnni<const KIND: u8, const NT: usize>(_: &[u8], _: &ActQ8, _: usize, _: &mut [&mut [f32]], _: usize) {
    unreachable!("row groups are made only where the AVX-512 VNNI kernel runs")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::matmul;

    #[test]
    fn chunks_balance_the_threads() {
        assert_eq!(balanced_chunk(36, 2), 3);
        assert_eq!(balanced_chunk(60, 2), 5);
        assert_eq!(balanced_chunk(72, 2), 6);
        assert_eq!(balanced_chunk(1, 2), 1);
        assert_eq!(balanced_chunk(0, 4), 1);
        assert_eq!(balanced_chunk(3072, 2), 192);
    }

    /// The repacked matmul gives the row kernels' results (same integer sums, float order aside)
    /// with both kernels, on Q4_0, Q4_1 and Q8_0 (codes of both signs, -128 too), every token
    /// tiling, whole and partial row ranges.
    #[test]
    fn row_groups_match_the_row_kernels() {
        for level in [SimdLevel::Avx2, SimdLevel::Avx512Vnni] {
            if level.is_available() {
                check_level(level);
            } else {
                eprintln!("skipped: no {level:?} row-group kernel on this CPU");
            }
        }
    }

    fn check_level(level: SimdLevel) {
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        let mut rnd = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for dtype in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            let (rows, cols) = (48, 96);
            let block = dtype.type_size();
            let mut data = vec![0u8; rows * cols / 32 * block];
            for b in data.chunks_exact_mut(block) {
                b[..2].copy_from_slice(&half::f16::from_f32(0.01 + (rnd() % 64) as f32 * 1e-3).to_bits().to_le_bytes());
                if dtype == GgmlType::Q4_1 {
                    b[2..4].copy_from_slice(&half::f16::from_f32((rnd() % 64) as f32 * -2e-3).to_bits().to_le_bytes());
                }
                for v in &mut b[if dtype == GgmlType::Q4_1 { 4 } else { 2 }..] {
                    *v = rnd() as u8;
                }
            }
            let view = WeightView { dtype, rows, cols, data: &data };
            let groups = RowGroups::repack_for(&view, level).expect("a level the CPU has");
            let g = groups.group_rows();
            for n in [1usize, 2, 3, 4, 7, 9] {
                let x: Vec<f32> = (0..n * cols).map(|_| (rnd() % 2001) as f32 / 1000.0 - 1.0).collect();
                for range in [0..rows, g..2 * g] {
                    let m = range.len();
                    let sub = WeightView { rows: m, data: &data[range.start * cols / 32 * block..range.end * cols / 32 * block], ..view };
                    let (mut want, mut got) = (vec![0f32; n * m], vec![f32::NAN; n * m]);
                    matmul::matmul(&sub, &x, n, &mut want).unwrap();
                    groups.matmul(range.clone(), &x, n, &mut got).unwrap();
                    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                        assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{level:?} {dtype} n={n} {range:?} [{i}]: {a} vs {b}");
                    }
                }
            }
            let err = groups.matmul(4..4 + g, &[0.0; 96], 1, &mut vec![0.0; g]).unwrap_err().to_string();
            assert!(err.contains(&format!("not whole {g}-row groups")), "{err}");
            // 40 rows: whole 8-row groups only.
            let ragged = WeightView { rows: 40, data: &data[..40 * cols / 32 * block], ..view };
            assert_eq!(RowGroups::repack_for(&ragged, level).is_some(), g == 8, "{level:?}: 40 rows");
            // Several weights in one buffer: each the same bits as its copy alone.
            let parts = [0..rows, g..2 * g, 0..g];
            let views: Vec<WeightView> = parts.iter().map(|r| WeightView { rows: r.len(), data: &data[r.start * cols / 32 * block..r.end * cols / 32 * block], ..view }).collect();
            let layouts: Vec<Layout> = views.iter().map(|v| Layout::for_level(dtype, v.rows, cols, level).expect("whole groups")).collect();
            let shared = RowGroups::repack_into_one_buffer(&layouts, |i| Ok(views[i].data)).unwrap();
            let short = RowGroups::repack_into_one_buffer(&layouts[..1], |_| Ok(&data[1..])).err().expect("a weight's bytes cut short");
            assert!(short.to_string().contains("row_groups"), "{short}");
            let x: Vec<f32> = (0..3 * cols).map(|_| (rnd() % 2001) as f32 / 1000.0 - 1.0).collect();
            for (v, one) in views.iter().zip(&shared) {
                let alone = RowGroups::repack_for(v, level).unwrap();
                assert_eq!(one.bytes(), alone.bytes());
                let (mut a, mut b) = (vec![0f32; 3 * v.rows], vec![1f32; 3 * v.rows]);
                one.matmul(0..v.rows, &x, 3, &mut a).unwrap();
                alone.matmul(0..v.rows, &x, 3, &mut b).unwrap();
                assert_eq!(a, b, "{level:?} {dtype}: {} rows in the shared buffer", v.rows);
                // With a residual: the products plus it, value by value.
                let residual: Vec<f32> = (0..a.len()).map(|i| i as f32 * 0.37 - 5.0).collect();
                one.matmul_add(0..v.rows, &x, 3, &mut b, Some(&residual)).unwrap();
                a.iter_mut().zip(&residual).for_each(|(a, r)| *a += r);
                assert_eq!(a, b, "{level:?} {dtype}: {} rows plus a residual", v.rows);
                assert!(one.matmul_add(0..v.rows, &x, 3, &mut b, Some(&residual[1..])).is_err(), "a residual of another length");
            }
        }
    }
}
