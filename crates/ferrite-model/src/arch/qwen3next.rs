//! Qwen3-Next (llama.cpp arch `qwen3next`, HF `qwen3_next`, e.g. Qwen3-Next-80B-A3B): the
//! Qwen3.5-MoE hybrid (built by [`super::qwen35::build_hybrid`]) with two differences in its Gated
//! DeltaNet layers, both read from the files as they are:
//!
//! * The input projections are interleaved per key head. HF's `in_proj_qkvz` holds, for each of
//!   the `n_k` key heads, `[q (k_dim) | k (k_dim) | v (r * v_dim) | z (r * v_dim)]` rows
//!   (`r = n_v / n_k`), and `in_proj_ba` holds `[b (r) | a (r)]` per key head. llama.cpp's
//!   converter splits the first into flat `attn_qkv` + `attn_gate` but keeps the second as
//!   `ssm_ba`; older GGUFs (and HF folders, see `hf.rs`) carry the first whole as `ssm_in`.
//!   The graph reads `q | k | v | z | b | a`, so the interleaved tensors are declared here as row
//!   selections ([`WeightSet::add_rows`]) that gather each field of every key head in order: the
//!   de-interleave happens once at load (any dtype: whole rows move), never in a backend.
//! * The value heads stay in HF's grouped order (value head `h` reads key head `h / r`,
//!   [`ValueHeadOrder::Grouped`]); llama.cpp's qwen3next graph repeats q/k interleaved to match.
//!
//! The rest is as in Qwen3.5-MoE, checked against transformers' `modeling_qwen3_next.py`: `1 + w`
//! RMSNorms (stored as `1 + w` by the converter) but a plain-`w` gated GDN norm, gated attention
//! with per-head `[query | gate]`, QK-norm and partial NeoX RoPE, and in every layer a softmax
//! top-k MoE (`expert_weights_norm` = HF's `norm_topk_prob`) plus a shared expert gated by
//! `sigmoid(ffn_gate_inp_shexp · x)`.

use super::qwen35::{self, GdnInputs};
use crate::graph::{GdnShape, ValueHeadOrder};
use crate::{FusionOptions, Graph, ModelConfig, ModelError, WeightSet};
use ferrite_gguf::GgufFile;
use std::ops::Range;

pub fn build(cfg: &ModelConfig, file: &GgufFile, fusion: FusionOptions) -> Result<(WeightSet, Graph), ModelError> {
    if cfg.moe.is_none() {
        return Err(ModelError::Config("qwen3next: no MoE configuration".into()));
    }
    qwen35::build_hybrid(cfg, file, fusion, ValueHeadOrder::Grouped, |ws, l, s| gdn_inputs(ws, file, cfg.n_embd, l, s))
}

/// For a tensor whose rows are `n_groups` groups of consecutive fields `widths[0], widths[1], ..`
/// rows tall, the row ranges that gather each field of every group, in group order: entry `f`
/// lists field `f` of group 0, of group 1, ... (adjacent ranges merged).
pub(crate) fn deinterleave(n_groups: usize, widths: &[usize]) -> Vec<Vec<Range<usize>>> {
    let group: usize = widths.iter().sum();
    let mut offset = 0;
    widths
        .iter()
        .map(|&w| {
            let mut ranges: Vec<Range<usize>> = Vec::new();
            for g in 0..n_groups {
                let r = g * group + offset..g * group + offset + w;
                match ranges.last_mut() {
                    Some(last) if last.end == r.start => last.end = r.end,
                    _ => ranges.push(r),
                }
            }
            offset += w;
            ranges
        })
        .collect()
}

/// Layer `l`'s GDN input projections as the graph reads them: `q | k | v`, `z`, `b`, `a`.
fn gdn_inputs(ws: &mut WeightSet, file: &GgufFile, d: usize, l: usize, s: &GdnShape) -> Result<GdnInputs, ModelError> {
    let t = |n: &str| format!("blk.{l}.{n}.weight");
    let (n_k, r) = (s.n_k_heads, s.n_v_heads / s.n_k_heads);
    let (qkv, z) = if file.tensor(&t("attn_qkv")).is_some() {
        // llama.cpp's converter: already flat (value heads grouped, as everywhere here).
        (ws.add(file, &t("attn_qkv"), s.conv_width(), d)?, ws.add(file, &t("attn_gate"), s.value_width(), d)?)
    } else if file.tensor(&t("ssm_in")).is_some() {
        let name = t("ssm_in");
        let rows = s.conv_width() + s.value_width();
        let fields = deinterleave(n_k, &[s.k_dim, s.k_dim, r * s.v_dim, r * s.v_dim]);
        let qkv = ws.add_rows(file, &name, "q|k|v", fields[..3].concat(), rows, d)?;
        (qkv, ws.add_rows(file, &name, "z", fields[3].clone(), rows, d)?)
    } else {
        return Err(ModelError::MissingTensor(format!("{} (or the interleaved {})", t("attn_qkv"), t("ssm_in"))));
    };
    let name = t("ssm_ba");
    let fields = deinterleave(n_k, &[r, r]);
    let b = ws.add_rows(file, &name, "b", fields[0].clone(), 2 * s.n_v_heads, d)?;
    let a = ws.add_rows(file, &name, "a", fields[1].clone(), 2 * s.n_v_heads, d)?;
    Ok([qkv, z, b, a])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The row ranges follow HF's `fix_query_key_value_ordering`: per key head
    /// `[q | k | v (r heads) | z (r heads)]` and `[b (r) | a (r)]`.
    #[test]
    fn deinterleave_gathers_each_field_of_every_key_head() {
        // 2 key heads, k_dim 3, 2 value heads of 2 per key head: groups of 3+3+4+4 = 14 rows.
        let f = deinterleave(2, &[3, 3, 4, 4]);
        assert_eq!(f, vec![vec![0..3, 14..17], vec![3..6, 17..20], vec![6..10, 20..24], vec![10..14, 24..28]]);
        // ba with r = 2: [b0 b1 a0 a1 | b2 b3 a2 a3].
        assert_eq!(deinterleave(2, &[2, 2]), vec![vec![0..2, 4..6], vec![2..4, 6..8]]);
        // One key head: nothing is interleaved, each field is one range.
        assert_eq!(deinterleave(1, &[3, 3, 8, 8]), vec![vec![0..3], vec![3..6], vec![6..14], vec![14..22]]);
        // r = 1 (as many value heads as key heads): b and a alternate row by row.
        assert_eq!(deinterleave(3, &[1, 1]), vec![vec![0..1, 2..3, 4..5], vec![1..2, 3..4, 5..6]]);
    }

    /// Applying the ranges to HF's interleaved row order gives the flat order HF itself builds
    /// (`torch.cat([q, k, v])` of the reshaped splits), checked on row labels.
    #[test]
    fn deinterleave_matches_hf_reordering() {
        let (n_k, r, dk, dv) = (2, 3, 2, 2);
        // Label each interleaved row by (field, key head, index within the field of that head).
        let mut rows = Vec::new();
        for h in 0..n_k {
            for (f, w) in [(0, dk), (1, dk), (2, r * dv), (3, r * dv)] {
                rows.extend((0..w).map(|i| (f, h, i)));
            }
        }
        let fields = deinterleave(n_k, &[dk, dk, r * dv, r * dv]);
        let gathered: Vec<(usize, usize, usize)> = fields[..3].concat().into_iter().flat_map(|rg| rows[rg].to_vec()).collect();
        // HF: q = all heads' q in head order, then k, then v (value head j of key head h = h*r + j).
        let want: Vec<_> = (0..3).flat_map(|f| (0..n_k).flat_map(move |h| (0..if f < 2 { dk } else { r * dv }).map(move |i| (f, h, i)))).collect();
        assert_eq!(gathered, want);
        let z: Vec<_> = fields[3].iter().flat_map(|rg| rows[rg.clone()].to_vec()).collect();
        assert_eq!(z, (0..n_k).flat_map(|h| (0..r * dv).map(move |i| (3, h, i))).collect::<Vec<_>>());
    }
}
