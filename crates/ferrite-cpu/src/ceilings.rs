//! The two ceilings `ferrite bench` reports CPU results against, measured in the same run on all
//! of the pool's threads: read bandwidth over a buffer as large as the weights a decode step
//! streams (from whichever memory level holds that much, as decode's reads come; a copy would
//! understate it, its writes costing an extra read), and the peak rate of the integer
//! multiply-add the matmul kernels are built on (`vpdpbusd` on AVX-512 VNNI, `vpmaddubsw` on
//! AVX2; 2 operations per multiply-add).

use crate::kernels::simd::{simd_level, SimdLevel};
use ferrite_model::executor::HardwareCeilings;
use rayon::prelude::*;
use std::time::Instant;

/// Best seconds per run of `work` over `reps` runs, after one untimed run.
fn best_secs(reps: usize, mut work: impl FnMut()) -> f64 {
    work();
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            work();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

/// The ceilings, reading `bytes` (at least 32 MiB) per run; `None` on CPUs whose kernels have
/// no SIMD level with an integer multiply-add to time (scalar, NEON).
pub fn measure(bytes: usize) -> Option<HardwareCeilings> {
    let (ops_per_instruction, name) = match simd_level() {
        SimdLevel::Avx512Vnni => (2 * 64, "int8 multiply-adds (512-bit vpdpbusd, AVX-512 VNNI)"),
        SimdLevel::Avx2 => (2 * 32, "int8 multiply-adds (256-bit vpmaddubsw, AVX2)"),
        _ => return None,
    };
    // Read as the matmul kernels do: a sum of 64-bit words (vectorized, little work per byte),
    // prefetching the same distance ahead with the same hint.
    let words = bytes.max(32 << 20) / 8;
    let buf: Vec<u64> = (0..words as u64).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15)).collect();
    let chunk = words.div_ceil(4 * rayon::current_num_threads());
    let read = best_secs(30, || {
        let sum = buf.par_chunks(chunk).map(sum_streamed).reduce(|| 0, u64::wrapping_add);
        std::hint::black_box(sum);
    });
    let bytes_per_s = (words * 8) as f64 / read;
    let bandwidth = format!("read of {} MB", words * 8 / 1_000_000);

    const ROUNDS: u64 = 2_000_000;
    let instructions = ROUNDS * peak::CHAINS as u64 * rayon::current_num_threads() as u64;
    let secs = best_secs(3, || {
        rayon::broadcast(|_| {
            // SAFETY: `simd_level` reports only levels whose features the CPU has.
            std::hint::black_box(unsafe {
                match simd_level() {
                    SimdLevel::Avx512Vnni => peak::vnni(ROUNDS),
                    _ => peak::avx2(ROUNDS),
                }
            });
        });
    });
    Some(HardwareCeilings { bytes_per_s, bandwidth, matmul_flops: (instructions * ops_per_instruction) as f64 / secs, matmul: name.into() })
}

crate::kernels::fvec::multiversion! {
    /// The wrapping sum of `words`, read in pieces of `PREFETCH_AHEAD` bytes, each prefetched
    /// into L2 while the one before it is summed.
    fn sum_streamed(words: &[u64]) -> u64 {
        let piece = crate::kernels::row_groups::PREFETCH_AHEAD / 8;
        let mut sum = 0u64;
        for (i, p) in words.chunks(piece).enumerate() {
            if let Some(next) = words.get((i + 1) * piece..) {
                for line in next.iter().take(piece).step_by(8) {
                    prefetch_l2(line);
                }
            }
            sum = p.iter().fold(sum, |a, &x| a.wrapping_add(x));
        }
        sum
    }
}

#[inline(always)]
fn prefetch_l2<T>(p: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch never faults.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T2 }>(p as *const T as *const i8)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Independent chains of the multiply-add, enough to cover its latency on both issue ports.
#[cfg(target_arch = "x86_64")]
mod peak {
    use std::arch::x86_64::*;

    pub const CHAINS: usize = 12;

    /// `rounds` x `CHAINS` 512-bit `vpdpbusd`s; returns a value made from every chain.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn vnni(rounds: u64) -> i32 {
        let (mut x, y) = (std::hint::black_box(_mm512_set1_epi8(3)), std::hint::black_box(_mm512_set1_epi8(5)));
        let mut acc = [_mm512_setzero_si512(); CHAINS];
        for _ in 0..rounds {
            for a in acc.iter_mut() {
                *a = _mm512_dpbusd_epi32(*a, x, y);
            }
            // Keeps the loop from being folded away.
            std::arch::asm!("/* {0} */", inout(zmm_reg) x, options(nomem, nostack, preserves_flags));
        }
        acc.iter().fold(0, |s, &a| s ^ _mm512_reduce_add_epi32(a))
    }

    /// `rounds` x `CHAINS` 256-bit `vpmaddubsw`s (each with the 16-bit add that follows it in the
    /// kernels).
    #[target_feature(enable = "avx2")]
    pub unsafe fn avx2(rounds: u64) -> i32 {
        let (mut x, y) = (std::hint::black_box(_mm256_set1_epi8(3)), std::hint::black_box(_mm256_set1_epi8(5)));
        let mut acc = [_mm256_setzero_si256(); CHAINS];
        for _ in 0..rounds {
            for a in acc.iter_mut() {
                *a = _mm256_add_epi16(*a, _mm256_maddubs_epi16(x, y));
            }
            std::arch::asm!("/* {0} */", inout(ymm_reg) x, options(nomem, nostack, preserves_flags));
        }
        acc.iter().fold(0, |s, &a| s ^ _mm256_extract_epi32::<0>(a))
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod peak {
    pub const CHAINS: usize = 12;
    pub unsafe fn vnni(_: u64) -> i32 {
        unreachable!("no x86 SIMD level off x86-64")
    }
    pub unsafe fn avx2(_: u64) -> i32 {
        unreachable!("no x86 SIMD level off x86-64")
    }
}
