//! Run-time choice of the SIMD instruction set used by the dot-product kernels.

use std::sync::OnceLock;

/// The instruction-set level the CPU kernels run at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SimdLevel {
    /// Portable Rust; the reference the SIMD kernels are tested against.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C (256-bit, `vpmaddubsw` integer dots).
    Avx2,
    /// x86-64 AVX-512 F/BW/VL + VNNI (512-bit, `vpdpbusd` integer dots); implies [`SimdLevel::Avx2`].
    Avx512Vnni,
    /// AArch64 NEON. No NEON kernels are written yet: this level runs the scalar kernels.
    Neon,
}

impl SimdLevel {
    pub const ALL: [SimdLevel; 4] = [
        SimdLevel::Scalar,
        SimdLevel::Avx2,
        SimdLevel::Avx512Vnni,
        SimdLevel::Neon,
    ];

    /// Every level this CPU can run, scalar first, best last.
    pub fn available() -> Vec<SimdLevel> {
        Self::ALL.into_iter().filter(|l| l.is_available()).collect()
    }

    /// Whether this CPU can run kernels of this level (feature detection is cached by std).
    pub fn is_available(self) -> bool {
        match self {
            SimdLevel::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2 => x86_avx2(),
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512Vnni => x86_avx512_vnni(),
            #[cfg(target_arch = "aarch64")]
            SimdLevel::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn x86_avx2() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

#[cfg(target_arch = "x86_64")]
fn x86_avx512_vnni() -> bool {
    x86_avx2()
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
}

/// The level the kernels use: the best one the CPU supports, or [`SimdLevel::Scalar`] when
/// `FERRITE_CPU_SCALAR=1`. Detected once per process.
pub fn simd_level() -> SimdLevel {
    static LEVEL: OnceLock<SimdLevel> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        if ferrite_core::env::CPU_SCALAR.flag() {
            SimdLevel::Scalar
        } else {
            *SimdLevel::available()
                .last()
                .expect("scalar is always available")
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detected_level_is_available() {
        let levels = SimdLevel::available();
        assert_eq!(levels[0], SimdLevel::Scalar);
        assert!(simd_level().is_available());
        // AVX-512 VNNI kernels also use AVX2 instructions (tails), so it must imply AVX2.
        if levels.contains(&SimdLevel::Avx512Vnni) {
            assert!(levels.contains(&SimdLevel::Avx2));
        }
    }
}
