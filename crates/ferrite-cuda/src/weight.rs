//! Weights on the device, repacked from GGML blocks into "planes".
//!
//! A GGML block interleaves scales and quants (Q4_0: 2-byte `d`, then 16 bytes of nibbles),
//! so its quant bytes are only 2-byte aligned. On upload each block field goes to its own
//! contiguous plane (all `qs` together, all `d` together, ...), each plane 256-byte aligned:
//! the kernels then read quants with 16-byte loads. Float weights (F32/F16/BF16) stay as is.
//! The plane order per type below is the order `kernels::common::QUANT` reads them in.

use crate::error::CudaError;
use crate::kernels::dequant::OutType;
use crate::Gpu;
use cudarc::driver::{CudaSlice, DevicePtr};
use ferrite_gguf::GgmlType;

/// One field of a GGML block: its byte range in the block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Field {
    pub offset: usize,
    pub size: usize,
}

const fn f(offset: usize, size: usize) -> Field {
    Field { offset, size }
}

/// Planes of each quantized type, in the kernels' p0..p3 order (offsets from ggml-common.h).
pub(crate) fn planes(dtype: GgmlType) -> Option<&'static [Field]> {
    use GgmlType::*;
    Some(match dtype {
        Q4_0 => const { &[f(2, 16), f(0, 2)] },                            // qs, d
        Q4_1 => const { &[f(4, 16), f(0, 4)] },                            // qs, (d, m)
        Q5_0 => const { &[f(6, 16), f(2, 4), f(0, 2)] },                   // qs, qh, d
        Q5_1 => const { &[f(8, 16), f(4, 4), f(0, 4)] },                   // qs, qh, (d, m)
        Q8_0 => const { &[f(2, 32), f(0, 2)] },                            // qs, d
        Q2_K => const { &[f(16, 64), f(0, 16), f(80, 4)] },                // qs, scales, (d, dmin)
        Q3_K => const { &[f(32, 64), f(0, 32), f(96, 12), f(108, 2)] },    // qs, hmask, scales, d
        Q4_K => const { &[f(16, 128), f(0, 16)] },                         // qs, (d, dmin, scales)
        Q5_K => const { &[f(48, 128), f(16, 32), f(0, 16)] },              // qs, qh, (d, dmin, scales)
        Q6_K => const { &[f(0, 128), f(128, 64), f(192, 16), f(208, 2)] }, // ql, qh, scales, d
        F32 | F16 | BF16 | Q8_1 | Q8_K => return None,
    })
}

/// Weight types [`Gpu::upload_weight`] accepts.
pub fn supported(dtype: GgmlType) -> bool {
    matches!(dtype, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) || planes(dtype).is_some()
}

const PLANE_ALIGN: usize = 256;

/// Host-side result of the repack: the device image and where each plane starts in it.
#[derive(Debug)]
pub(crate) struct Repacked {
    pub bytes: Vec<u8>,
    pub plane_offsets: [usize; 4],
}

/// Check a GGML tensor's size and turn it into the device layout.
pub(crate) fn repack(dtype: GgmlType, rows: usize, cols: usize, data: &[u8]) -> Result<Repacked, CudaError> {
    let op = "upload_weight";
    if !supported(dtype) {
        return Err(CudaError::invalid(op, format!("weight type {dtype} is not supported on CUDA")));
    }
    if rows == 0 || cols == 0 {
        return Err(CudaError::invalid(op, format!("empty {dtype} weight ({rows} x {cols})")));
    }
    if rows > i32::MAX as usize || cols > i32::MAX as usize {
        return Err(CudaError::invalid(op, format!("{rows} x {cols} is too large")));
    }
    let row_bytes = dtype.row_bytes(cols).ok_or_else(|| {
        CudaError::invalid(
            op,
            format!("{dtype} rows of {cols} values are not whole {}-value blocks", dtype.block_size()),
        )
    })?;
    let expected = row_bytes
        .checked_mul(rows)
        .ok_or_else(|| CudaError::invalid(op, format!("{rows} x {cols} {dtype} overflows")))?;
    if data.len() != expected {
        return Err(CudaError::invalid(
            op,
            format!("{rows} x {cols} {dtype} needs {expected} bytes, got {}", data.len()),
        ));
    }
    let Some(fields) = planes(dtype) else {
        return Ok(Repacked { bytes: data.to_vec(), plane_offsets: [0; 4] });
    };
    let n_blocks = expected / dtype.type_size();
    let mut plane_offsets = [0usize; 4];
    let mut total = 0;
    for (slot, field) in plane_offsets.iter_mut().zip(fields) {
        *slot = total;
        total = (total + field.size * n_blocks).next_multiple_of(PLANE_ALIGN);
    }
    let mut bytes = vec![0u8; total];
    for (field, &start) in fields.iter().zip(&plane_offsets) {
        let plane = &mut bytes[start..start + field.size * n_blocks];
        for (dst, block) in plane.chunks_exact_mut(field.size).zip(data.chunks_exact(dtype.type_size())) {
            dst.copy_from_slice(&block[field.offset..field.offset + field.size]);
        }
    }
    match dtype {
        GgmlType::Q4_K => bytes[..128 * n_blocks].chunks_exact_mut(128).for_each(q4k_units_apart),
        GgmlType::Q6_K => {
            bytes[..128 * n_blocks].chunks_exact_mut(128).for_each(q6k_lows_apart);
            let qh = plane_offsets[1];
            bytes[qh..qh + 64 * n_blocks].chunks_exact_mut(64).for_each(q6k_highs_apart);
        }
        _ => {}
    }
    Ok(Repacked { bytes, plane_offsets })
}

/// A Q4_K block's 128 quant bytes, rearranged so that each 32-weight unit's nibbles are 16
/// bytes of their own, laid out as Q4_0's (unit `s` at `16 s`: element `l` in the low nibble of
/// byte `l` for `l < 16`, in the high nibble of byte `l - 16` after). GGML keeps units `2n` and
/// `2n + 1` in the low and high nibbles of the same 32 bytes, so a unit cost two 16-byte loads
/// and a shift (`kernels::common::QUANT`).
fn q4k_units_apart(qs: &mut [u8]) {
    let ggml: [u8; 128] = qs.try_into().expect("a Q4_K block has 128 quant bytes");
    let code = |s: usize, l: usize| (ggml[32 * (s / 2) + l] >> (4 * (s % 2))) & 15;
    for (s, unit) in qs.chunks_exact_mut(16).enumerate() {
        for (l, byte) in unit.iter_mut().enumerate() {
            *byte = code(s, l) | (code(s, l + 16) << 4);
        }
    }
}

/// A Q6_K block's 128 low-nibble bytes (`ql`), rearranged as [`q4k_units_apart`] does Q4_K's:
/// unit `s` (elements `32 s ..`) at `16 s` in Q4_0's nibble layout. GGML packs element
/// `128 n + 32 r + l` in nibble `r / 2` of byte `64 n + 32 (r % 2) + l`, so a unit took two
/// 16-byte loads of bytes it shares with another unit.
fn q6k_lows_apart(ql: &mut [u8]) {
    let ggml: [u8; 128] = ql.try_into().expect("a Q6_K block has 128 low-nibble bytes");
    let code = |s: usize, l: usize| (ggml[64 * (s / 4) + 32 * (s % 2) + l] >> (4 * (s % 4 / 2))) & 15;
    for (s, unit) in ql.chunks_exact_mut(16).enumerate() {
        for (l, byte) in unit.iter_mut().enumerate() {
            *byte = code(s, l) | (code(s, l + 16) << 4);
        }
    }
}

/// A Q6_K block's 64 high-bit bytes (`qh`, 2 bits per element), rearranged unit-major: unit `s`
/// at `8 s`, element `l`'s bits in byte `4 (l / 16) + l % 4` at bit `2 ((l % 16) / 4)`, so that
/// one shift of a 32-bit word lines up four consecutive elements' bits with their bytes (the
/// kernels' `unit_word`). GGML keeps element `128 n + 32 r + l`'s bits in byte `32 n + l` at bit
/// `2 r`: four units shared 32 bytes.
fn q6k_highs_apart(qh: &mut [u8]) {
    let ggml: [u8; 64] = qh.try_into().expect("a Q6_K block has 64 high-bit bytes");
    qh.fill(0);
    for e in 0..256 {
        let (s, l) = (e / 32, e % 32);
        let bits = (ggml[32 * (s / 4) + l] >> (2 * (s % 4))) & 3;
        qh[8 * s + 4 * (l / 16) + l % 4] |= bits << (2 * (l % 16 / 4));
    }
}

/// A weight matrix (`rows` outputs x `cols` inputs, row-major like GGUF) in device memory.
pub struct DeviceWeight {
    pub dtype: GgmlType,
    pub rows: usize,
    pub cols: usize,
    data: CudaSlice<u8>,
    plane_offsets: [usize; 4],
    /// A resident copy in a GEMM input type ([`crate::ops::expand_weight`]): the GEMM path reads
    /// it instead of dequantizing into scratch on every call.
    pub(crate) expanded: Option<(OutType, CudaSlice<u8>)>,
}

impl DeviceWeight {
    /// Device addresses of the planes (p0..p3); unused planes repeat the base address.
    pub(crate) fn plane_ptrs(&self, gpu: &Gpu) -> [u64; 4] {
        let (base, _sync) = self.data.device_ptr(gpu.stream());
        self.plane_offsets.map(|off| base + off as u64)
    }

    /// Bytes the weight occupies on the device (with its expanded copy, if any).
    pub fn device_bytes(&self) -> usize {
        self.data.len() + self.expanded.as_ref().map_or(0, |(_, e)| e.len())
    }
}

impl Gpu {
    /// Copy a GGML tensor's bytes (as stored in GGUF) to the device, repacked for the kernels.
    pub fn upload_weight(
        &self,
        dtype: GgmlType,
        rows: usize,
        cols: usize,
        data: &[u8],
    ) -> Result<DeviceWeight, CudaError> {
        let packed = repack(dtype, rows, cols, data)?;
        let data = self.upload(&packed.bytes, "upload_weight")?;
        Ok(DeviceWeight { dtype, rows, cols, data, plane_offsets: packed.plane_offsets, expanded: None })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn planes_cover_each_block_exactly_once() {
        for dtype in GgmlType::ALL {
            let Some(fields) = planes(dtype) else { continue };
            assert!(fields.len() <= 4, "{dtype}: at most 4 planes");
            let mut covered = vec![0u8; dtype.type_size()];
            for field in fields {
                for b in &mut covered[field.offset..field.offset + field.size] {
                    *b += 1;
                }
            }
            assert!(covered.iter().all(|&c| c == 1), "{dtype}: planes {fields:?} do not tile the block");
            // The first plane holds the quants and must allow 16-byte loads per block.
            assert_eq!(fields[0].size % 16, 0, "{dtype}: quant plane not a multiple of 16 bytes");
        }
    }

    #[test]
    fn repack_moves_each_field_to_its_plane() {
        // Two Q4_0 blocks: d = [0xd0, 0xd1], qs = 16 bytes of the block index.
        let mut data = Vec::new();
        for b in 0..2u8 {
            data.extend_from_slice(&[0xd0 + b, 0xe0]);
            data.extend_from_slice(&[b; 16]);
        }
        let r = repack(GgmlType::Q4_0, 1, 64, &data).unwrap();
        assert_eq!(&r.bytes[..16], &[0u8; 16]);
        assert_eq!(&r.bytes[16..32], &[1u8; 16]);
        let d = r.plane_offsets[1];
        assert_eq!(d % PLANE_ALIGN, 0);
        assert_eq!(&r.bytes[d..d + 4], &[0xd0, 0xe0, 0xd1, 0xe0]);
    }

    #[test]
    fn q4k_units_decode_as_ggml_dequantizes() {
        // Two Q4_K blocks of arbitrary bytes, with d and dmin set to finite f16 values.
        let mut data: Vec<u8> = (0..2 * 144).map(|i| (i * 37 + 11) as u8).collect();
        for block in data.chunks_exact_mut(144) {
            block[..4].copy_from_slice(&[0x00, 0x3c, 0x00, 0x38]); // d = 1.0, dmin = 0.5
        }
        let mut want = vec![0f32; 512];
        ferrite_gguf::quant::dequantize(GgmlType::Q4_K, &data, &mut want).unwrap();
        let r = repack(GgmlType::Q4_K, 1, 512, &data).unwrap();
        let meta = &r.bytes[r.plane_offsets[1]..];
        for (i, &w) in want.iter().enumerate() {
            let (blk, s, l) = (i / 256, i % 256 / 32, i % 32);
            // The kernel's decode: the code from the unit's own 16 bytes, the 6-bit scale and
            // minimum of sub-block s picked from the meta words by shifts (`kquant_scales`).
            let code = (r.bytes[blk * 128 + 16 * s + l % 16] >> (4 * (l / 16))) & 15;
            let m = &meta[blk * 16..blk * 16 + 16];
            let (d, dmin) = (half::f16::from_le_bytes([m[0], m[1]]).to_f32(), half::f16::from_le_bytes([m[2], m[3]]).to_f32());
            let word = |k: usize| u32::from_le_bytes(m[4 * k..4 * k + 4].try_into().unwrap()) >> (8 * (s % 4));
            let (y, z, x) = (word(1), word(2), word(3));
            let (sc, mn) = if s < 4 { (y & 63, z & 63) } else { ((x & 15) | ((y >> 2) & 48), ((x >> 4) & 15) | ((z >> 2) & 48)) };
            let got = d * sc as f32 * code as f32 - dmin * mn as f32;
            assert_eq!(got, w, "weight {i} (block {blk}, unit {s}, element {l})");
        }
    }

    #[test]
    fn q6k_units_decode_as_ggml_dequantizes() {
        // Two Q6_K blocks of arbitrary bytes, with d set to a finite f16 value.
        let mut data: Vec<u8> = (0..2 * 210).map(|i| (i * 53 + 7) as u8).collect();
        for block in data.chunks_exact_mut(210) {
            block[208..].copy_from_slice(&[0x00, 0x3c]); // d = 1.0
        }
        let mut want = vec![0f32; 512];
        ferrite_gguf::quant::dequantize(GgmlType::Q6_K, &data, &mut want).unwrap();
        let r = repack(GgmlType::Q6_K, 1, 512, &data).unwrap();
        let (qh, scales) = (&r.bytes[r.plane_offsets[1]..], &r.bytes[r.plane_offsets[2]..]);
        for (i, &w) in want.iter().enumerate() {
            let (blk, s, l) = (i / 256, i % 256 / 32, i % 32);
            // The kernel's decode (`unit_q`): the low nibble from the unit's 16 bytes, the high
            // bits from its 8, scale 2 s + l / 16.
            let low = (r.bytes[blk * 128 + 16 * s + l % 16] >> (4 * (l / 16))) & 15;
            let high = (qh[blk * 64 + 8 * s + 4 * (l / 16) + l % 4] >> (2 * (l % 16 / 4))) & 3;
            let scale = scales[blk * 16 + 2 * s + l / 16] as i8;
            let got = scale as f32 * ((low | (high << 4)) as f32 - 32.0);
            assert_eq!(got, w, "weight {i} (block {blk}, unit {s}, element {l})");
            // The int8 path's decode (`unit_word`): word l / 4 holds this code in byte l % 4.
            let word = |bytes: &[u8], k: usize| u32::from_le_bytes(bytes[4 * k..4 * k + 4].try_into().unwrap());
            let (unit_ql, unit_qh) = (&r.bytes[blk * 128 + 16 * s..], &qh[blk * 64 + 8 * s..]);
            let j = l / 4;
            let packed = ((word(unit_ql, j % 4) >> (if j < 4 { 0 } else { 4 })) & 0x0F0F_0F0F) | (((word(unit_qh, j / 4) >> (2 * (j % 4))) & 0x0303_0303) << 4);
            assert_eq!((packed >> (8 * (l % 4))) & 0xff, (low | (high << 4)) as u32, "word of weight {i}");
        }
    }

    #[test]
    fn bad_weights_are_rejected_with_a_reason() {
        let err = |t, r, c, n| repack(t, r, c, &vec![0u8; n]).unwrap_err().to_string();
        assert!(err(GgmlType::Q4_0, 2, 64, 71).contains("needs 72 bytes, got 71"));
        assert!(err(GgmlType::Q4_K, 1, 100, 144).contains("not whole 256-value blocks"));
        assert!(err(GgmlType::Q8_K, 1, 256, 292).contains("not supported"));
        assert!(err(GgmlType::F32, 0, 4, 0).contains("empty"));
        assert_eq!(repack(GgmlType::F16, 3, 5, &[7u8; 30]).unwrap().bytes, vec![7u8; 30]);
    }
}
