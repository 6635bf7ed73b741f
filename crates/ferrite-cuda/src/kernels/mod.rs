//! The kernel library: CUDA C++ sources embedded as strings, one file per op family.
//!
//! Each family file holds, side by side, the four things a compile-time variant touches:
//! 1. the kernel source, which declares every macro it needs with `#ifndef NAME / #error`;
//! 2. a typed variant struct (the macro set as one Rust value) whose [`KernelVariant::macros`]
//!    is the macro dictionary turned into `-D` flags;
//! 3. the cache key, derived by [`crate::cache`] from those same flags;
//! 4. the launch geometry, computed by methods of the same variant struct.
//!
//! A test checks that the `#error`-guarded macros of every source equal its variant's
//! dictionary, so a macro added in one place and forgotten in another fails CI.
//!
//! Kernel parameters travel by value in one `#[repr(C)]` struct per kernel, declared with
//! [`device_params!`], which also emits the matching C struct into the source.

pub mod activation;
pub mod attention;
pub mod common;
pub mod dequant;
pub mod embedding;
pub mod flash_attention;
pub mod gdn;
pub mod gemm;
pub mod gemv;
pub mod moe;
pub mod norm;
pub mod quantize;
pub mod rope;
pub mod sampling;

use std::fmt::Debug;
use std::hash::Hash;

/// A compile-time variant of one kernel family: the complete, typed macro set.
pub trait KernelVariant: Copy + Eq + Hash + Debug + Send + Sync + 'static {
    /// Family name: cache file prefix and error messages.
    const FAMILY: &'static str;
    /// Source pieces, concatenated in order (shared headers first).
    const SOURCES: &'static [&'static str];
    /// `extern "C"` kernels of the module.
    const ENTRY_POINTS: &'static [&'static str];
    /// The macro dictionary: every `-D NAME=VALUE` this variant compiles with.
    fn macros(&self) -> Vec<(&'static str, String)>;
    /// Whether the variant uses instructions of the device's arch-specific target (`sm_90a`:
    /// `wgmma`), so it compiles for that target and runs on that arch only.
    fn arch_specific(&self) -> bool {
        false
    }
    /// Blocks per thread-block cluster along z (sm_90, at most 8; 1: no cluster): the launch
    /// gives the cluster shape `(1, 1, n)` as an attribute.
    fn cluster_z(&self) -> u32 {
        1
    }
}

/// C spelling of the scalar field types allowed in kernel parameter structs.
macro_rules! c_type {
    (u32) => {
        "unsigned int"
    };
    (i32) => {
        "int"
    };
    (f32) => {
        "float"
    };
    (u64) => {
        "unsigned long long"
    };
}

/// Declare a kernel parameter struct once: the `#[repr(C)]` Rust struct passed by value at
/// launch and, as `NAME::C_DECL`, the identical C struct for the kernel source. Fields are
/// scalars only (device pointers as `u64`); put `u64` fields first so no padding differs.
macro_rules! device_params {
    ($(#[$meta:meta])* pub struct $name:ident { $( $(#[$fmeta:meta])* pub $field:ident : $ty:tt ),* $(,)? }) => {
        $(#[$meta])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug, Default)]
        pub struct $name { $( $(#[$fmeta])* pub $field: $ty ),* }

        // SAFETY: a repr(C) struct of plain scalars, mirrored field for field by C_DECL.
        unsafe impl cudarc::driver::DeviceRepr for $name {}

        impl $name {
            /// The C declaration of this struct, prepended to the kernel source.
            pub const C_DECL: &'static str = concat!(
                "struct ", stringify!($name), " {\n",
                $( "  ", $crate::kernels::c_type!($ty), " ", stringify!($field), ";\n", )*
                "};\n"
            );
        }
    };
}
pub(crate) use {c_type, device_params};

/// Macros a source declares as required (`#ifndef NAME` directly followed by `#error`).
pub fn required_macros(source: &str) -> std::collections::BTreeSet<String> {
    let lines: Vec<&str> = source.lines().map(str::trim).collect();
    lines
        .windows(2)
        .filter(|w| w[1].starts_with("#error"))
        .filter_map(|w| w[0].strip_prefix("#ifndef").map(|name| name.trim().to_string()))
        .collect()
}

/// Ceiling division for launch-grid sizes.
pub(crate) fn blocks_for(items: usize, per_block: usize) -> u32 {
    u32::try_from(items.div_ceil(per_block)).expect("grid size checked against u32 by the op layer")
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// Every macro the source requires is in the dictionary and vice versa.
    pub(crate) fn assert_macros_match<V: KernelVariant>(variant: V) {
        let source = V::SOURCES.concat();
        let required = required_macros(&source);
        let given: BTreeSet<String> = variant.macros().iter().map(|(n, _)| n.to_string()).collect();
        assert_eq!(required, given, "family {}: source #ifndef/#error set vs macro dictionary", V::FAMILY);
        for entry in V::ENTRY_POINTS {
            assert!(
                source.contains(&format!("void {entry}(")) || source.contains(&format!(") {entry}(")),
                "family {}: entry point {entry} not found in the source",
                V::FAMILY
            );
        }
    }

    /// Every kernel waits for its predecessor (programmatic dependent launch, see `pdl_wait` in
    /// the common header): its body calls `KERNEL_ENTRY()` or `pdl_wait()` (after the loads it
    /// may issue early).
    #[test]
    fn every_kernel_waits_for_the_previous_one() {
        let families: [(&str, &[&str]); 20] = [
            (activation::ActivationVariant::FAMILY, activation::ActivationVariant::SOURCES),
            (attention::AttentionVariant::FAMILY, attention::AttentionVariant::SOURCES),
            (attention::StoreQkvVariant::FAMILY, attention::StoreQkvVariant::SOURCES),
            (dequant::DequantVariant::FAMILY, dequant::DequantVariant::SOURCES),
            (dequant::ConvertVariant::FAMILY, dequant::ConvertVariant::SOURCES),
            (embedding::EmbedVariant::FAMILY, embedding::EmbedVariant::SOURCES),
            (flash_attention::FlashAttentionVariant::FAMILY, flash_attention::FlashAttentionVariant::SOURCES),
            (gdn::GdnConvVariant::FAMILY, gdn::GdnConvVariant::SOURCES),
            (gdn::GdnDeltaVariant::FAMILY, gdn::GdnDeltaVariant::SOURCES),
            (gdn::GdnChunkVariant::FAMILY, gdn::GdnChunkVariant::SOURCES),
            (gemm::GemmMmaVariant::FAMILY, gemm::GemmMmaVariant::SOURCES),
            (gemv::GemvVariant::FAMILY, gemv::GemvVariant::SOURCES),
            (gemv::GemvQ8Variant::FAMILY, gemv::GemvQ8Variant::SOURCES),
            (moe::MoeRouteVariant::FAMILY, moe::MoeRouteVariant::SOURCES),
            (moe::MoeGroupVariant::FAMILY, moe::MoeGroupVariant::SOURCES),
            (moe::MoeCombineVariant::FAMILY, moe::MoeCombineVariant::SOURCES),
            (norm::NormVariant::FAMILY, norm::NormVariant::SOURCES),
            (quantize::QuantizeVariant::FAMILY, quantize::QuantizeVariant::SOURCES),
            (rope::RopeVariant::FAMILY, rope::RopeVariant::SOURCES),
            (sampling::SamplingVariant::FAMILY, sampling::SamplingVariant::SOURCES),
        ];
        let mut kernels = 0;
        for (family, sources) in families {
            let source = sources.concat();
            for (start, _) in source.match_indices("__global__") {
                let body = &source[start..];
                let open = body.find('{').expect("kernel body");
                let kernel = &body[..body.find("\n}\n").unwrap_or(body.len())];
                let waits = kernel.contains("KERNEL_ENTRY();") || kernel.contains("pdl_wait();");
                assert!(waits, "family {family}: kernel at {:?} does not wait for its predecessor", &body[..open]);
                kernels += 1;
            }
        }
        assert!(kernels >= 25, "found only {kernels} kernels");
    }

    device_params! {
        pub struct Probe { pub ptr: u64, pub n: u32, pub scale: f32 }
    }

    #[test]
    fn params_struct_has_matching_c_declaration() {
        assert_eq!(Probe::C_DECL, "struct Probe {\n  unsigned long long ptr;\n  unsigned int n;\n  float scale;\n};\n");
        assert_eq!(std::mem::size_of::<Probe>(), 16);
    }

    #[test]
    fn required_macros_are_parsed() {
        let src = "#ifndef A\n#error \"A\"\n#endif\n#ifndef B_OPTIONAL\n#define B_OPTIONAL 1\n#endif\n  #ifndef C\n  #error x\n#endif";
        let got: Vec<String> = required_macros(src).into_iter().collect();
        assert_eq!(got, vec!["A".to_string(), "C".to_string()]);
    }
}
