//! Synthetic models: GGUF files with the exact tensor shapes of real models and random weights.
//!
//! Used to benchmark real shapes without shipping real weights (and loadable by other GGUF
//! engines for side-by-side numbers). Weights are uniform with a standard deviation of 0.02
//! (embeddings 1.0), norms are 1, so activations stay finite through every layer. The tokenizer
//! is SmolLM2's (vocab 49152, also for shapes whose real vocabulary is larger, like Gemma 3's
//! 262144), embedded in this crate.

use ferrite_gguf::{GgmlType, GgufError, GgufFile, GgufWriter, Value};
use rayon::prelude::*;
use std::path::Path;

/// SmolLM2's tokenizer metadata (a GGUF with only `tokenizer.*` keys).
const TOKENIZER_GGUF: &[u8] = include_bytes!("../../../fixtures/synth/smollm2-tokenizer.gguf");
const VOCAB: usize = 49152;

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SynthShape {
    pub name: &'static str,
    pub arch: &'static str,
    pub n_layers: usize,
    pub n_embd: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub n_ff: usize,
    pub rope_theta: f32,
    pub context_length: usize,
    pub tied_embeddings: bool,
    /// Gated DeltaNet layers (arch `qwen35`, `qwen35moe`): every layer but each 4th is one.
    pub gdn: Option<SynthGdn>,
    /// The MoE FFN of every layer (arch `qwen35moe`, with `gdn`) instead of the dense MLP.
    pub moe: Option<SynthMoe>,
}

/// The MoE FFN of a Qwen3.5-MoE shape: routed experts as 3-D banks, a gated shared expert, an
/// f32 router (as llama.cpp keeps it).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SynthMoe {
    pub n_experts: usize,
    pub top_k: usize,
    pub n_ff_exp: usize,
    pub n_ff_shexp: usize,
    /// One `ffn_gate_up_exps` bank instead of `ffn_gate_exps` + `ffn_up_exps`.
    pub fused_gate_up: bool,
}

/// The Gated DeltaNet dimensions of a hybrid shape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SynthGdn {
    pub n_k_heads: usize,
    pub n_v_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
}

const QWEN35_INTERVAL: usize = 4;

pub const SHAPES: &[SynthShape] = &[
    SynthShape { name: "smollm2-135m", arch: "llama", n_layers: 30, n_embd: 576, n_heads: 9, n_kv_heads: 3, head_dim: 64, n_ff: 1536, rope_theta: 100000.0, context_length: 8192, tied_embeddings: true, gdn: None, moe: None },
    SynthShape { name: "llama-3.2-1b", arch: "llama", n_layers: 16, n_embd: 2048, n_heads: 32, n_kv_heads: 8, head_dim: 64, n_ff: 8192, rope_theta: 500000.0, context_length: 131072, tied_embeddings: true, gdn: None, moe: None },
    SynthShape { name: "llama-3.1-8b", arch: "llama", n_layers: 32, n_embd: 4096, n_heads: 32, n_kv_heads: 8, head_dim: 128, n_ff: 14336, rope_theta: 500000.0, context_length: 131072, tied_embeddings: false, gdn: None, moe: None },
    SynthShape { name: "gemma3-270m", arch: "gemma3", n_layers: 18, n_embd: 640, n_heads: 4, n_kv_heads: 1, head_dim: 256, n_ff: 2048, rope_theta: 1000000.0, context_length: 32768, tied_embeddings: true, gdn: None, moe: None },
    // transformers' Qwen3_5TextConfig defaults ("Qwen3.5-9B style").
    SynthShape { name: "qwen3.5-9b", arch: "qwen35", n_layers: 32, n_embd: 4096, n_heads: 16, n_kv_heads: 4, head_dim: 256, n_ff: 12288, rope_theta: 1e7, context_length: 262144, tied_embeddings: false, gdn: Some(SynthGdn { n_k_heads: 16, n_v_heads: 32, k_dim: 128, v_dim: 128 }), moe: None },
    // Qwen3.5-35B-A3B's layer shape (transformers' Qwen3_5MoeTextConfig defaults: 256 experts of
    // 512, top 8, a shared expert of 512) with 16 of its 40 layers, so that the file stays near
    // 7.7 GB at Q4_0/Q4_K (Q8_0: 14.5 GB): per-layer timings are the real model's; whole-model
    // time scales by 40/16.
    SynthShape { name: "qwen3.5-35b-a3b-16l", arch: "qwen35moe", n_layers: 16, n_embd: 2048, n_heads: 16, n_kv_heads: 2, head_dim: 256, n_ff: 512, rope_theta: 1e7, context_length: 262144, tied_embeddings: false, gdn: Some(SynthGdn { n_k_heads: 16, n_v_heads: 32, k_dim: 128, v_dim: 128 }), moe: Some(SynthMoe { n_experts: 256, top_k: 8, n_ff_exp: 512, n_ff_shexp: 512, fused_gate_up: false }) },
    SynthShape { name: "qwen3-8b", arch: "qwen3", n_layers: 36, n_embd: 4096, n_heads: 32, n_kv_heads: 8, head_dim: 128, n_ff: 12288, rope_theta: 1000000.0, context_length: 40960, tied_embeddings: false, gdn: None, moe: None },
];

pub fn shape(name: &str) -> Option<&'static SynthShape> {
    SHAPES.iter().find(|s| s.name == name)
}

/// (name, [cols, rows] in GGML order, is_vector) of every tensor of the shape.
fn tensors(s: &SynthShape) -> Vec<(String, Vec<u64>)> {
    let (d, q, kv, ff) = (s.n_embd as u64, (s.n_heads * s.head_dim) as u64, (s.n_kv_heads * s.head_dim) as u64, s.n_ff as u64);
    let mut t = vec![("token_embd.weight".to_string(), vec![d, VOCAB as u64])];
    for l in 0..s.n_layers {
        let b = |n: &str| format!("blk.{l}.{n}");
        t.push((b("attn_norm.weight"), vec![d]));
        if let Some(g) = s.gdn {
            let (kw, vw, hv) = ((g.n_k_heads * g.k_dim) as u64, (g.n_v_heads * g.v_dim) as u64, g.n_v_heads as u64);
            if (l + 1) % QWEN35_INTERVAL != 0 {
                t.push((b("attn_qkv.weight"), vec![d, 2 * kw + vw]));
                t.push((b("attn_gate.weight"), vec![d, vw]));
                t.push((b("ssm_beta.weight"), vec![d, hv]));
                t.push((b("ssm_alpha.weight"), vec![d, hv]));
                t.push((b("ssm_conv1d.weight"), vec![4, 2 * kw + vw]));
                t.push((b("ssm_a"), vec![hv]));
                t.push((b("ssm_dt.bias"), vec![hv]));
                t.push((b("ssm_norm.weight"), vec![g.v_dim as u64]));
                t.push((b("ssm_out.weight"), vec![vw, d]));
            } else {
                t.push((b("attn_q.weight"), vec![d, 2 * q]));
                t.push((b("attn_k.weight"), vec![d, kv]));
                t.push((b("attn_v.weight"), vec![d, kv]));
                t.push((b("attn_q_norm.weight"), vec![s.head_dim as u64]));
                t.push((b("attn_k_norm.weight"), vec![s.head_dim as u64]));
                t.push((b("attn_output.weight"), vec![q, d]));
            }
            t.push((b("post_attention_norm.weight"), vec![d]));
            if let Some(m) = s.moe {
                let (e, fe, fs) = (m.n_experts as u64, m.n_ff_exp as u64, m.n_ff_shexp as u64);
                t.push((b("ffn_gate_inp.weight"), vec![d, e]));
                if m.fused_gate_up {
                    t.push((b("ffn_gate_up_exps.weight"), vec![d, 2 * fe, e]));
                } else {
                    t.push((b("ffn_gate_exps.weight"), vec![d, fe, e]));
                    t.push((b("ffn_up_exps.weight"), vec![d, fe, e]));
                }
                t.push((b("ffn_down_exps.weight"), vec![fe, d, e]));
                t.push((b("ffn_gate_inp_shexp.weight"), vec![d]));
                t.push((b("ffn_gate_shexp.weight"), vec![d, fs]));
                t.push((b("ffn_up_shexp.weight"), vec![d, fs]));
                t.push((b("ffn_down_shexp.weight"), vec![fs, d]));
                continue;
            }
            t.push((b("ffn_gate.weight"), vec![d, ff]));
            t.push((b("ffn_up.weight"), vec![d, ff]));
            t.push((b("ffn_down.weight"), vec![ff, d]));
            continue;
        }
        t.push((b("attn_q.weight"), vec![d, q]));
        t.push((b("attn_k.weight"), vec![d, kv]));
        t.push((b("attn_v.weight"), vec![d, kv]));
        if s.arch == "qwen3" || s.arch == "gemma3" {
            t.push((b("attn_q_norm.weight"), vec![s.head_dim as u64]));
            t.push((b("attn_k_norm.weight"), vec![s.head_dim as u64]));
        }
        if s.arch == "gemma3" {
            t.push((b("post_attention_norm.weight"), vec![d]));
            t.push((b("post_ffw_norm.weight"), vec![d]));
        }
        if s.arch == "qwen2" {
            t.push((b("attn_q.bias"), vec![q]));
            t.push((b("attn_k.bias"), vec![kv]));
            t.push((b("attn_v.bias"), vec![kv]));
        }
        t.push((b("attn_output.weight"), vec![q, d]));
        t.push((b("ffn_norm.weight"), vec![d]));
        t.push((b("ffn_gate.weight"), vec![d, ff]));
        t.push((b("ffn_up.weight"), vec![d, ff]));
        t.push((b("ffn_down.weight"), vec![ff, d]));
    }
    t.push(("output_norm.weight".to_string(), vec![d]));
    if !s.tied_embeddings {
        t.push(("output.weight".to_string(), vec![d, VOCAB as u64]));
    }
    t
}

/// splitmix64: a fast, well-mixed hash for reproducible per-element random numbers.
fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Uniform values with standard deviation `std`, reproducible from (seed, tensor index, element).
fn random_row(seed: u64, std: f32, out: &mut [f32]) {
    let a = std * 3f32.sqrt();
    for (i, v) in out.iter_mut().enumerate() {
        let r = splitmix(seed ^ (i as u64).wrapping_mul(0x2545_F491_4F6C_DD1D));
        *v = ((r >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * a;
    }
}

/// Write a synthetic model of `shape` with matrices in `dtype` to `path`.
pub fn write(path: &Path, shape: &SynthShape, dtype: GgmlType, seed: u64, mut progress: impl FnMut(usize, usize)) -> Result<(), GgufError> {
    let tokenizer = GgufFile::from_bytes(TOKENIZER_GGUF.to_vec())?;
    let mut w = GgufWriter::new();
    let a = shape.arch;
    w.add_metadata("general.architecture", Value::String(a.into()));
    w.add_metadata("general.name", Value::String(format!("synthetic {} {}", shape.name, dtype.name())));
    w.add_metadata("general.file_type", Value::U32(file_type(dtype)));
    let u = |v: usize| Value::U32(v as u32);
    w.add_metadata(format!("{a}.block_count"), u(shape.n_layers));
    w.add_metadata(format!("{a}.context_length"), u(shape.context_length));
    w.add_metadata(format!("{a}.embedding_length"), u(shape.n_embd));
    w.add_metadata(format!("{a}.feed_forward_length"), u(shape.n_ff));
    w.add_metadata(format!("{a}.attention.head_count"), u(shape.n_heads));
    w.add_metadata(format!("{a}.attention.head_count_kv"), u(shape.n_kv_heads));
    w.add_metadata(format!("{a}.attention.key_length"), u(shape.head_dim));
    w.add_metadata(format!("{a}.attention.value_length"), u(shape.head_dim));
    if shape.gdn.is_none() {
        w.add_metadata(format!("{a}.rope.dimension_count"), u(shape.head_dim));
    }
    w.add_metadata(format!("{a}.rope.freq_base"), Value::F32(shape.rope_theta));
    w.add_metadata(format!("{a}.attention.layer_norm_rms_epsilon"), Value::F32(1e-5));
    w.add_metadata(format!("{a}.vocab_size"), u(VOCAB));
    if let Some(g) = shape.gdn {
        // Partial RoPE over a quarter of the head, as Qwen3.5.
        w.add_metadata(format!("{a}.rope.dimension_count"), u(shape.head_dim / 4));
        w.add_metadata(format!("{a}.ssm.conv_kernel"), u(4));
        w.add_metadata(format!("{a}.ssm.state_size"), u(g.k_dim));
        w.add_metadata(format!("{a}.ssm.group_count"), u(g.n_k_heads));
        w.add_metadata(format!("{a}.ssm.time_step_rank"), u(g.n_v_heads));
        w.add_metadata(format!("{a}.ssm.inner_size"), u(g.n_v_heads * g.v_dim));
        w.add_metadata(format!("{a}.full_attention_interval"), u(QWEN35_INTERVAL));
    }
    if let Some(m) = shape.moe {
        w.add_metadata(format!("{a}.expert_count"), u(m.n_experts));
        w.add_metadata(format!("{a}.expert_used_count"), u(m.top_k));
        w.add_metadata(format!("{a}.expert_feed_forward_length"), u(m.n_ff_exp));
        w.add_metadata(format!("{a}.expert_shared_feed_forward_length"), u(m.n_ff_shexp));
    }
    if a == "gemma3" {
        // Gemma 3's window; every 6th layer global, local RoPE base 10 000 (llama.cpp's defaults).
        w.add_metadata("gemma3.attention.sliding_window", u(512));
    }
    for (k, v) in tokenizer.metadata.iter() {
        if k.starts_with("tokenizer.") {
            w.add_metadata(k, v.clone());
        }
    }
    let list = tensors(shape);
    for (name, dims) in &list {
        // Like llama.cpp's quantizer: rows that are not whole blocks of `dtype` (Gemma 3 270M's
        // 640-wide rows under a 256-value k-quant) fall back to Q8_0.
        let matrix_type = if name.ends_with("ffn_gate_inp.weight") {
            GgmlType::F32 // MoE routers (llama.cpp keeps them in f32 too)
        } else if dims[0] % dtype.block_size() as u64 == 0 {
            dtype
        } else if dims[0] % GgmlType::Q8_0.block_size() as u64 == 0 {
            GgmlType::Q8_0
        } else {
            GgmlType::F32 // the 4-tap conv of Gated DeltaNet (llama.cpp keeps it in f32 too)
        };
        w.add_tensor_info(name, dims, if dims.len() == 1 { GgmlType::F32 } else { matrix_type })?;
    }
    let total = list.len();
    let mut done = 0;
    w.write_file_with(path, |info| {
        let index = list.iter().position(|(n, _)| *n == info.name).unwrap_or(0) as u64;
        let cols = info.shape[0] as usize;
        let rows = info.n_rows();
        let row_bytes = info.dtype.row_bytes(cols).ok_or_else(|| GgufError::InvalidWrite(format!("{}: bad row", info.name)))?;
        let mut data = vec![0u8; rows * row_bytes];
        let std = if info.name == "token_embd.weight" { 1.0 } else { 0.02 };
        data.par_chunks_mut(row_bytes).enumerate().try_for_each(|(r, dst)| -> Result<(), GgufError> {
            let mut row = vec![0f32; cols];
            if info.name.ends_with(".bias") {
                random_row(splitmix(seed ^ (index << 32)), 0.1, &mut row);
            } else if info.name.ends_with("ssm_a") {
                row.fill(-1.0); // -exp(A_log): a decay, negative
            } else if rows == 1 {
                row.fill(1.0); // norm weights
            } else {
                random_row(splitmix(seed ^ (index << 32) ^ r as u64), std, &mut row);
            }
            dst.copy_from_slice(&ferrite_gguf::quantize(info.dtype, &row)?);
            Ok(())
        })?;
        done += 1;
        progress(done, total);
        Ok(data)
    })
}

/// Write (once per process) a synthetic model into the system temp folder and return its path;
/// for tests and benchmarks that need a model file of a given shape.
pub fn write_temp(shape: &SynthShape, dtype: GgmlType, seed: u64) -> Result<std::path::PathBuf, GgufError> {
    let dir = std::env::temp_dir().join(format!("ferrite-synth-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join(format!("{}-{}-{seed}.gguf", shape.name, dtype.name()));
    if !path.is_file() {
        write(&path, shape, dtype, seed, |_, _| {})?;
    }
    Ok(path)
}

/// `general.file_type` (llama_ftype) for an all-`dtype` model.
fn file_type(dtype: GgmlType) -> u32 {
    match dtype {
        GgmlType::F32 => 0,
        GgmlType::F16 => 1,
        GgmlType::Q4_0 => 2,
        GgmlType::Q4_1 => 3,
        GgmlType::Q8_0 => 7,
        GgmlType::Q5_0 => 8,
        GgmlType::Q5_1 => 9,
        GgmlType::Q4_K => 15,
        GgmlType::Q5_K => 17,
        GgmlType::Q6_K => 18,
        GgmlType::BF16 => 32,
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{Handoff, Op};
    use crate::{Arch, FusionOptions, Model};

    #[test]
    fn qwen2_shape_loads_with_biases_fused() {
        let s = SynthShape { name: "tiny-qwen2", arch: "qwen2", n_layers: 1, n_embd: 64, n_heads: 4, n_kv_heads: 2, head_dim: 16, n_ff: 96, rope_theta: 1e6, context_length: 128, tied_embeddings: true, gdn: None, moe: None };
        let path = write_temp(&s, GgmlType::Q4_0, 1).unwrap();
        let fused = Model::load(&path, FusionOptions::ALL).unwrap();
        assert_eq!(fused.config.arch, Arch::Qwen2);
        assert_eq!(fused.config.rope.style, crate::RopeStyle::Neox);
        let qkv = fused.graph.ops.iter().find_map(|o| match o {
            Op::Linear { bias: Some(b), w, .. } => Some((*w, *b)),
            _ => None,
        });
        let (w, b) = qkv.expect("fused QKV linear with a fused bias");
        assert_eq!(fused.weights.spec(w).rows, 64 + 2 * 32);
        assert_eq!(fused.weights.spec(b).cols, 64 + 2 * 32);
        let unfused = Model::load(&path, FusionOptions::NONE).unwrap();
        let biased = unfused.graph.ops.iter().filter(|o| matches!(o, Op::Linear { bias: Some(_), .. })).count();
        assert_eq!(biased, 3);
    }

    /// A Gemma 3 shape: post-norms and QK-norm tensors, a 512-token window on all but every 6th layer.
    #[test]
    fn gemma3_shape_loads_with_sliding_layers() {
        let s = SynthShape { name: "tiny-gemma3", arch: "gemma3", n_layers: 7, n_embd: 64, n_heads: 4, n_kv_heads: 1, head_dim: 32, n_ff: 96, rope_theta: 1e6, context_length: 128, tied_embeddings: true, gdn: None, moe: None };
        let path = write_temp(&s, GgmlType::Q8_0, 2).unwrap();
        let m = Model::load(&path, FusionOptions::ALL).unwrap();
        assert_eq!(m.config.arch, Arch::Gemma3);
        let windows: Vec<Option<usize>> = m.graph.ops.iter().filter_map(|o| if let Op::Attention { window, .. } = o { Some(*window) } else { None }).collect();
        assert_eq!(windows, [Some(512), Some(512), Some(512), Some(512), Some(512), None, Some(512)]);
        assert!(m.file.tensor("blk.6.post_ffw_norm.weight").is_some());
    }

    /// A Qwen3.5 hybrid shape: GDN layers 0-2 and 4, gated attention on layer 3, the conv in f32.
    #[test]
    fn qwen35_shape_loads_as_a_hybrid() {
        let gdn = Some(SynthGdn { n_k_heads: 2, n_v_heads: 4, k_dim: 16, v_dim: 32 });
        let s = SynthShape { name: "tiny-qwen35", arch: "qwen35", n_layers: 5, n_embd: 64, n_heads: 4, n_kv_heads: 2, head_dim: 32, n_ff: 96, rope_theta: 1e7, context_length: 128, tied_embeddings: false, gdn, moe: None };
        let path = write_temp(&s, GgmlType::Q8_0, 4).unwrap();
        let m = Model::load(&path, FusionOptions::ALL).unwrap();
        assert_eq!(m.config.arch, Arch::Qwen35);
        assert_eq!(m.config.rope.rot_dim, 8);
        assert_eq!(m.graph.attention_layers(), [3]);
        let gdn_layers: Vec<usize> = m.graph.ops.iter().filter_map(|o| if let Op::GatedDeltaNet { layer, .. } = o { Some(*layer) } else { None }).collect();
        assert_eq!(gdn_layers, [0, 1, 2, 4]);
        assert_eq!(m.file.tensor("blk.0.ssm_conv1d.weight").unwrap().dtype, GgmlType::F32);
        assert_eq!(m.file.tensor("blk.0.attn_qkv.weight").unwrap().dtype, GgmlType::Q8_0);
        let a = ferrite_gguf::dequantize_tensor(&m.file, m.file.tensor("blk.4.ssm_a").unwrap()).unwrap();
        assert!(a.iter().all(|&v| v == -1.0));
        assert!(shape("qwen3.5-9b").is_some_and(|s| s.gdn.is_some()));
    }

    /// A Qwen3.5-MoE shape: the hybrid with a MoE FFN in every layer, banks as 3-D tensors
    /// (fused or split gate/up), the router in f32 whatever the matrix type.
    #[test]
    fn qwen35moe_shape_loads_with_expert_banks() {
        use crate::graph::ExpertGateUp;
        let gdn = Some(SynthGdn { n_k_heads: 2, n_v_heads: 4, k_dim: 16, v_dim: 32 });
        for fused_gate_up in [false, true] {
            let moe = Some(SynthMoe { n_experts: 8, top_k: 2, n_ff_exp: 32, n_ff_shexp: 64, fused_gate_up });
            let s = SynthShape { name: "tiny-qwen35moe", arch: "qwen35moe", n_layers: 4, n_embd: 64, n_heads: 4, n_kv_heads: 2, head_dim: 32, n_ff: 64, rope_theta: 1e7, context_length: 128, tied_embeddings: false, gdn, moe };
            let path = write_temp(&s, GgmlType::Q8_0, 8 + fused_gate_up as u64).unwrap();
            let m = Model::load(&path, FusionOptions::ALL).unwrap();
            assert_eq!(m.config.arch, Arch::Qwen35Moe);
            let moe_ops: Vec<_> = m.graph.ops.iter().filter_map(|o| if let Op::MoeFfn { router, gate_up, down, moe, .. } = o { Some((*router, *gate_up, *down, *moe)) } else { None }).collect();
            assert_eq!(moe_ops.len(), 4);
            let (router, gate_up, down, shape) = moe_ops[0];
            assert_eq!((shape.n_experts, shape.top_k, shape.n_ff_exp, shape.norm_topk_prob), (8, 2, 32, true));
            assert_eq!(m.weights.spec(router).dtype, GgmlType::F32);
            assert_eq!((m.weights.spec(down).rows, m.weights.spec(down).cols, m.weights.spec(down).experts), (8 * 64, 32, 8));
            assert_eq!(matches!(gate_up, ExpertGateUp::Fused(_)), fused_gate_up);
        }
        let real = shape("qwen3.5-35b-a3b-16l").unwrap();
        assert_eq!(real.moe.map(|m| (m.n_experts, m.top_k)), Some((256, 8)));
    }

    /// The decoder layers declared at load: every Llama layer's five ops after the fusions; none
    /// without the fusion or the fusions it rests on, none for Qwen3 (its QK-norm runs between
    /// QKV and attention) or Gemma 3 (GeGLU, post-norms).
    #[test]
    fn decoder_layers_cover_each_llama_layer() {
        let llama = SynthShape { name: "tiny-llama", arch: "llama", n_layers: 3, n_embd: 64, n_heads: 4, n_kv_heads: 2, head_dim: 16, n_ff: 96, rope_theta: 1e4, context_length: 64, tied_embeddings: false, gdn: None, moe: None };
        let path = write_temp(&llama, GgmlType::Q8_0, 9).unwrap();
        let m = Model::load(&path, FusionOptions::ALL).unwrap();
        let kinds: Vec<Vec<&str>> = m.graph.layers.iter().map(|l| l.ops().map(|i| m.graph.ops[i].kind()).collect()).collect();
        let layer = vec!["norm+linear", "attention", "linear", "norm+gated_linear", "linear"];
        assert_eq!(kinds, [layer.clone(), layer.clone(), layer]);
        // Each layer's output is the next one's input.
        for w in m.graph.layers.windows(2) {
            assert_eq!(m.graph.ops[w[0].first + 4].writes(), m.graph.ops[w[1].first].reads()[0]);
        }
        assert!(Model::load(&path, FusionOptions { decoder_layer: false, ..FusionOptions::ALL }).unwrap().graph.layers.is_empty());
        assert!(Model::load(&path, FusionOptions { rope_into_attention: false, ..FusionOptions::ALL }).unwrap().graph.layers.is_empty());
        assert!(Model::load(&path, FusionOptions { decoder_layer: true, ..FusionOptions::NONE }).unwrap().graph.layers.is_empty());
        for arch in ["qwen3", "gemma3"] {
            let other = SynthShape { name: "tiny-other", arch, ..llama };
            let path = write_temp(&other, GgmlType::Q8_0, 9).unwrap();
            assert!(Model::load(&path, FusionOptions::ALL).unwrap().graph.layers.is_empty(), "{arch}");
        }
    }

    /// The int8 hand-offs declared at load: per Llama layer attention -> output projection ->
    /// gate/up -> down -> the next layer's QKV, and the last down projection -> the output head
    /// through the copy of the last row (for one-row batches); Gemma's
    /// post-norms and Qwen3.5's gated/GDN outputs leave only the producers that feed a linear
    /// directly. None without the fusion.
    #[test]
    fn int8_handoffs_follow_the_producers_of_linears() {
        let kinds = |m: &Model| -> Vec<(&'static str, &'static str)> {
            m.graph.handoffs.iter().map(|h| (m.graph.ops[h.producer].kind(), m.graph.ops[h.consumer].kind())).collect()
        };
        let llama = SynthShape { name: "tiny-llama", arch: "llama", n_layers: 2, n_embd: 64, n_heads: 4, n_kv_heads: 2, head_dim: 16, n_ff: 96, rope_theta: 1e4, context_length: 64, tied_embeddings: false, gdn: None, moe: None };
        let path = write_temp(&llama, GgmlType::Q8_0, 5).unwrap();
        let m = Model::load(&path, FusionOptions::ALL).unwrap();
        let layer = [("attention", "linear"), ("linear", "norm+gated_linear"), ("norm+gated_linear", "linear")];
        assert_eq!(kinds(&m), [&layer[..], &[("linear", "norm+linear")], &layer[..], &[("linear", "norm+linear")]].concat());
        let through: Vec<_> = m.graph.handoffs.iter().map(|h| h.last_row.map(|l| m.graph.ops[l].kind())).collect();
        assert!(through[..through.len() - 1].iter().all(Option::is_none) && through.last() == Some(&Some("last_row")), "{through:?}");
        // Validation follows the hand-off through the copy, and refuses one that skips it or
        // names another op.
        let rows = |w| m.weights.spec(w).rows;
        m.graph.validate(rows).unwrap();
        let last = m.graph.handoffs.len() - 1;
        let head = m.graph.handoffs[last];
        for bad in [Handoff { last_row: None, ..head }, Handoff { last_row: Some(head.producer), ..head }] {
            let mut g = m.graph.clone();
            g.handoffs[last] = bad;
            assert!(g.validate(rows).unwrap_err().contains("hand-off"), "{bad:?}");
        }
        assert!(Model::load(&path, FusionOptions { int8_handoff: false, ..FusionOptions::ALL }).unwrap().graph.handoffs.is_empty());
        // Unfused: the separate Q/K/V linears read the normed value, written by an RmsNorm op.
        let unfused = Model::load(&path, FusionOptions { int8_handoff: true, ..FusionOptions::NONE }).unwrap();
        assert!(kinds(&unfused).iter().all(|&(p, _)| p != "rms_norm"));
        let gemma = SynthShape { name: "tiny-gemma3", arch: "gemma3", n_layers: 1, n_embd: 64, n_heads: 4, n_kv_heads: 1, head_dim: 32, n_ff: 96, rope_theta: 1e6, context_length: 64, tied_embeddings: true, gdn: None, moe: None };
        let m = Model::load(write_temp(&gemma, GgmlType::Q8_0, 6).unwrap(), FusionOptions::ALL).unwrap();
        assert_eq!(kinds(&m), [("attention", "linear"), ("norm+gated_linear", "linear")]);
        let gdn = Some(SynthGdn { n_k_heads: 2, n_v_heads: 4, k_dim: 16, v_dim: 32 });
        let qwen35 = SynthShape { name: "tiny-qwen35", arch: "qwen35", n_layers: 4, n_embd: 64, n_heads: 4, n_kv_heads: 2, head_dim: 32, n_ff: 96, rope_theta: 1e7, context_length: 64, tied_embeddings: false, gdn, moe: None };
        let m = Model::load(write_temp(&qwen35, GgmlType::Q8_0, 7).unwrap(), FusionOptions::ALL).unwrap();
        assert!(kinds(&m).iter().all(|&(p, _)| p != "attention" && p != "gated_delta_net"));
    }

    /// A k-quant whose blocks do not divide the rows: those tensors are written as Q8_0.
    #[test]
    fn ragged_rows_fall_back_to_q8_0() {
        let s = SynthShape { name: "ragged", arch: "llama", n_layers: 1, n_embd: 96, n_heads: 2, n_kv_heads: 1, head_dim: 48, n_ff: 256, rope_theta: 1e4, context_length: 64, tied_embeddings: false, gdn: None, moe: None };
        let path = write_temp(&s, GgmlType::Q4_K, 3).unwrap();
        let m = Model::load(&path, FusionOptions::ALL).unwrap();
        assert_eq!(m.file.tensor("blk.0.ffn_up.weight").unwrap().dtype, GgmlType::Q8_0); // 96-wide rows
        assert_eq!(m.file.tensor("blk.0.ffn_down.weight").unwrap().dtype, GgmlType::Q4_K); // 256-wide rows
    }

    /// A small custom shape written, reloaded and turned into a graph.
    #[test]
    fn synthetic_model_loads_with_expected_shapes() {
        let s = SynthShape { name: "tiny", arch: "llama", n_layers: 2, n_embd: 64, n_heads: 4, n_kv_heads: 2, head_dim: 16, n_ff: 128, rope_theta: 1e4, context_length: 256, tied_embeddings: false, gdn: None, moe: None };
        let path = write_temp(&s, GgmlType::Q8_0, 7).unwrap();
        let m = Model::load(&path, FusionOptions::ALL).unwrap();
        assert_eq!((m.config.n_layers, m.config.n_embd, m.config.n_kv_heads, m.config.vocab_size), (2, 64, 2, VOCAB));
        assert_eq!(m.file.tensor("output.weight").unwrap().dtype, GgmlType::Q8_0);
        let w = ferrite_gguf::dequantize_tensor(&m.file, m.file.tensor("blk.1.ffn_up.weight").unwrap()).unwrap();
        let std = (w.iter().map(|v| v * v).sum::<f32>() / w.len() as f32).sqrt();
        assert!((std - 0.02).abs() < 0.002, "weight std {std}");
    }
}
