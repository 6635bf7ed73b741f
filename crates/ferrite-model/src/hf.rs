//! Hugging Face checkpoints: `config.json` plus `model.safetensors` (or shards listed in
//! `model.safetensors.index.json`), turned at load time into the GGUF form the rest of ferrite
//! reads — llama.cpp's tensor names and metadata keys — in memory.
//!
//! Llama checkpoints get their Q/K rows permuted as llama.cpp's converter does, because the
//! `llama` graph uses GGML's adjacent-pair RoPE; Qwen and Gemma use NeoX RoPE and need none.
//! Gemma 3 (`gemma3_text`) norms multiply by `1 + w`: as llama.cpp's converter does, the one is
//! added to every `*norm.weight` here (in f32), so the graph's norms are plain RMSNorms.
//! Qwen3-Next (`qwen3_next`) loads like Qwen3.5-MoE but keeps HF's grouped value-head order and
//! its per-key-head interleaved `in_proj_qkvz` / `in_proj_ba`, named as llama.cpp names them
//! (`ssm_in`, its older name for the whole projection, and `ssm_ba`): the `qwen3next` graph
//! de-interleaves them at load, for these and for llama.cpp's GGUFs alike.
//! Qwen3.5-MoE and Qwen3-Next experts become llama.cpp's 3-D expert tensors: per-expert checkpoints
//! (`mlp.experts.{e}.{gate,up,down}_proj.weight`, what transformers' `save_pretrained` writes) are
//! stacked into `ffn_{gate,up,down}_exps`, fused 3-D ones (`mlp.experts.gate_up_proj`,
//! `mlp.experts.down_proj`) become `ffn_gate_up_exps` / `ffn_down_exps`.

use crate::ModelError;
use ferrite_gguf::{GgmlType, GgufFile, GgufWriter, Value};
use safetensors::{Dtype, SafeTensors};
use serde_json::Value as Json;
use std::collections::BTreeMap;
use std::path::Path;

/// True if `path` looks like an HF checkpoint folder (has a `config.json`).
pub fn is_hf_dir(path: &Path) -> bool {
    path.is_dir() && path.join("config.json").is_file()
}

fn config_error(msg: impl Into<String>) -> ModelError {
    ModelError::Config(msg.into())
}

fn read_json(path: &Path) -> Result<Json, ModelError> {
    let text = std::fs::read_to_string(path).map_err(|e| config_error(format!("{}: {e}", path.display())))?;
    serde_json::from_str(&text).map_err(|e| config_error(format!("{}: invalid JSON: {e}", path.display())))
}

/// The safetensors files of the checkpoint, in a stable order.
fn shard_files(dir: &Path) -> Result<Vec<std::path::PathBuf>, ModelError> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if !index.is_file() {
        return Err(config_error(format!("{}: no model.safetensors or model.safetensors.index.json", dir.display())));
    }
    let json = read_json(&index)?;
    let map = json["weight_map"].as_object().ok_or_else(|| config_error(format!("{}: no `weight_map`", index.display())))?;
    let mut files: Vec<String> = map.values().filter_map(|v| v.as_str().map(String::from)).collect();
    files.sort();
    files.dedup();
    files
        .into_iter()
        .map(|f| {
            if f.contains('/') || f.contains("..") {
                return Err(config_error(format!("{}: shard name `{f}` is not a plain file name", index.display())));
            }
            Ok(dir.join(f))
        })
        .collect()
}

/// HF tensor name → GGUF tensor name (`None` for tensors ferrite does not use, e.g. rotary caches).
/// `post_attention_layernorm` is the pre-MLP norm in Llama/Qwen but the attention output's
/// post-norm in Gemma 3, which has its pre-MLP norm as `pre_feedforward_layernorm`.
fn gguf_name(hf: &str, arch: &str) -> Option<String> {
    let fixed = match hf {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_string());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let qwen35 = is_hybrid(arch);
    let moe = is_moe(arch);
    if qwen35 {
        match rest {
            "linear_attn.A_log" => return Some(format!("blk.{layer}.ssm_a")),
            "linear_attn.dt_bias" => return Some(format!("blk.{layer}.ssm_dt.bias")),
            _ => {}
        }
    }
    if moe {
        match rest {
            "mlp.experts.gate_up_proj" => return Some(format!("blk.{layer}.ffn_gate_up_exps.weight")),
            "mlp.experts.down_proj" => return Some(format!("blk.{layer}.ffn_down_exps.weight")),
            _ => {}
        }
    }
    let (module, kind) = rest.rsplit_once('.')?;
    let name = match module {
        "linear_attn.in_proj_qkv" if qwen35 => "attn_qkv",
        "linear_attn.in_proj_z" if qwen35 => "attn_gate",
        "linear_attn.in_proj_b" if qwen35 => "ssm_beta",
        "linear_attn.in_proj_a" if qwen35 => "ssm_alpha",
        "linear_attn.in_proj_qkvz" if arch == "qwen3next" => "ssm_in",
        "linear_attn.in_proj_ba" if arch == "qwen3next" => "ssm_ba",
        "linear_attn.conv1d" if qwen35 => "ssm_conv1d",
        "linear_attn.norm" if qwen35 => "ssm_norm",
        "linear_attn.out_proj" if qwen35 => "ssm_out",
        "post_attention_layernorm" if qwen35 => "post_attention_norm",
        "mlp.gate" if moe => "ffn_gate_inp",
        "mlp.shared_expert_gate" if moe => "ffn_gate_inp_shexp",
        "mlp.shared_expert.gate_proj" if moe => "ffn_gate_shexp",
        "mlp.shared_expert.up_proj" if moe => "ffn_up_shexp",
        "mlp.shared_expert.down_proj" if moe => "ffn_down_shexp",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" if arch == "gemma3" => "post_attention_norm",
        "post_attention_layernorm" => "ffn_norm",
        "pre_feedforward_layernorm" if arch == "gemma3" => "ffn_norm",
        "post_feedforward_layernorm" if arch == "gemma3" => "post_ffw_norm",
        _ => return None,
    };
    Some(format!("blk.{layer}.{name}.{kind}"))
}

/// The Qwen3.5 hybrids (dense and MoE) and Qwen3-Next, which share the GDN and gated-attention
/// tensors.
fn is_hybrid(arch: &str) -> bool {
    matches!(arch, "qwen35" | "qwen35moe" | "qwen3next")
}

/// The hybrids with a MoE FFN in every layer.
fn is_moe(arch: &str) -> bool {
    matches!(arch, "qwen35moe" | "qwen3next")
}

/// `model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight` → (layer, expert, the GGUF
/// bank `ffn_{gate,up,down}_exps.weight` it is stacked into).
fn expert_part(hf: &str) -> Option<(usize, usize, &'static str)> {
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (expert, proj) = rest.strip_prefix("mlp.experts.")?.split_once('.')?;
    let bank = match proj {
        "gate_proj.weight" => "ffn_gate_exps.weight",
        "up_proj.weight" => "ffn_up_exps.weight",
        "down_proj.weight" => "ffn_down_exps.weight",
        _ => return None,
    };
    Some((layer.parse().ok()?, expert.parse().ok()?, bank))
}

/// One expert's matrix: its safetensors name, GGML shape, dtype and bytes.
type ExpertMatrix = (String, Vec<u64>, GgmlType, Vec<u8>);

/// Stack per-expert matrices (all `n_experts` of them, alike in shape and dtype) into one 3-D
/// tensor, GGML shape `[cols, rows, n_experts]`.
fn stack_experts(name: &str, parts: Vec<Option<ExpertMatrix>>) -> Result<(Vec<u64>, GgmlType, Vec<u8>), ModelError> {
    let n = parts.len() as u64;
    let mut parts = parts.into_iter().enumerate().map(|(e, p)| p.ok_or_else(|| ModelError::tensor(name, format!("expert {e} is missing"))));
    let (first, shape, dtype, mut data) = parts.next().ok_or_else(|| ModelError::tensor(name, "no experts"))??;
    if shape.len() != 2 {
        return Err(ModelError::tensor(&first, "an expert matrix must have 2 dimensions"));
    }
    for p in parts {
        let (hf, s, d, bytes) = p?;
        if s != shape || d != dtype {
            return Err(ModelError::tensor(&hf, format!("shape {s:?} / {d:?} differs from `{first}` ({shape:?} / {dtype:?})")));
        }
        data.extend_from_slice(&bytes);
    }
    Ok((vec![shape[0], shape[1], n], dtype, data))
}

/// llama.cpp's Q/K permutation: within each head, row `i` and row `i + d/2` become rows `2i`, `2i+1`.
fn permute_rows(data: &[u8], rows: usize, n_heads: usize) -> Vec<u8> {
    let row_bytes = data.len() / rows;
    let hd = rows / n_heads;
    let mut out = vec![0u8; data.len()];
    for h in 0..n_heads {
        for i in 0..hd / 2 {
            for (dst, src) in [(2 * i, i), (2 * i + 1, hd / 2 + i)] {
                let (d, s) = ((h * hd + dst) * row_bytes, (h * hd + src) * row_bytes);
                out[d..d + row_bytes].copy_from_slice(&data[s..s + row_bytes]);
            }
        }
    }
    out
}

/// `1 + w` for Gemma's norm weights, as f32 bytes.
fn plus_one_f32(name: &str, dtype: GgmlType, data: &[u8]) -> Result<Vec<u8>, ModelError> {
    let n = data.len() / dtype.row_bytes(1).ok_or_else(|| ModelError::tensor(name, "unsupported dtype"))?;
    let mut values = vec![0f32; n];
    ferrite_gguf::dequantize(dtype, data, &mut values)?;
    Ok(values.iter().flat_map(|v| (v + 1.0).to_le_bytes()).collect())
}

/// Qwen3.5's (or Qwen3-Next's) Gated DeltaNet geometry from config.json.
#[derive(Clone, Copy, Debug)]
struct Gdn {
    n_k: usize,
    n_v: usize,
    dk: usize,
    dv: usize,
    /// Reorder the value heads to llama.cpp's tiled order (Qwen3.5; Qwen3-Next keeps HF's grouped
    /// order, as llama.cpp's qwen3next converter does).
    tiled: bool,
}

impl Gdn {
    /// Grouped value head order (HF: the value heads of key head `j` are `j*r .. j*r + r`) to
    /// llama.cpp's tiled order (`[K0v0, K1v0, .., K0v1, ..]`): tiled head `n` is grouped head
    /// `(n % n_k) * r + n / n_k`.
    fn source_head(&self, n: usize) -> usize {
        (n % self.n_k) * (self.n_v / self.n_k) + n / self.n_k
    }

    /// Reorder `n_v` blocks of `unit` consecutive rows (rows of `row_bytes`) of `data[start..]`.
    fn reorder_rows(&self, data: &mut [u8], start_row: usize, unit: usize, row_bytes: usize) {
        let block = unit * row_bytes;
        let base = start_row * row_bytes;
        let src = data[base..base + self.n_v * block].to_vec();
        for n in 0..self.n_v {
            let o = self.source_head(n);
            data[base + n * block..base + (n + 1) * block].copy_from_slice(&src[o * block..(o + 1) * block]);
        }
    }

    /// Reorder the columns (`n_v` blocks of `dv` elements of `elem` bytes) of every row.
    fn reorder_cols(&self, data: &mut [u8], elem: usize) {
        let block = self.dv * elem;
        let row = self.n_v * block;
        for r in data.chunks_exact_mut(row) {
            let src = r.to_vec();
            for n in 0..self.n_v {
                let o = self.source_head(n);
                r[n * block..(n + 1) * block].copy_from_slice(&src[o * block..(o + 1) * block]);
            }
        }
    }
}

/// Qwen3.5 / Qwen3-Next tensors as llama.cpp's converter writes them: `1 + w` for every norm but
/// the GDN output norm, `ssm_a = -exp(A_log)`, and (Qwen3.5 only) the GDN value heads in tiled
/// order (see [`Gdn`]). Qwen3-Next's interleaved `ssm_in` / `ssm_ba` pass unchanged.
/// Returns the new dtype and bytes. The conv weight's `[C, 1, K]` shape is squeezed by the caller.
fn qwen35_tensor(gname: &str, hf: &str, gdn: &Gdn, dtype: GgmlType, mut data: Vec<u8>) -> Result<(GgmlType, Vec<u8>), ModelError> {
    let f32s = |data: &[u8]| -> Result<Vec<f32>, ModelError> {
        let n = data.len() / dtype.row_bytes(1).ok_or_else(|| ModelError::tensor(hf, "unsupported dtype"))?;
        let mut v = vec![0f32; n];
        ferrite_gguf::dequantize(dtype, data, &mut v)?;
        Ok(v)
    };
    let bytes = |v: Vec<f32>| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let elem = dtype.row_bytes(1).ok_or_else(|| ModelError::tensor(hf, "unsupported dtype"))?;
    let kd = gdn.n_k * gdn.dk;
    // `blk.N.attn_qkv.weight` -> `attn_qkv.weight`; non-layer names stay whole.
    let suffix = match gname.strip_prefix("blk.") {
        Some(rest) => rest.split_once('.').map_or(rest, |(_, r)| r),
        None => gname,
    };
    let check = |want: usize| -> Result<(), ModelError> {
        if data.len() != want * elem {
            return Err(ModelError::tensor(hf, format!("{} elements, expected {want} from config.json", data.len() / elem)));
        }
        Ok(())
    };
    let qkv_rows = 2 * kd + gdn.n_v * gdn.dv;
    let reorder = gdn.tiled && gdn.n_k != gdn.n_v;
    match suffix {
        "ssm_norm.weight" => Ok((dtype, data)),
        s if s.ends_with("norm.weight") => Ok((GgmlType::F32, bytes(f32s(&data)?.into_iter().map(|w| w + 1.0).collect()))),
        "ssm_a" => {
            check(gdn.n_v)?;
            let mut a = bytes(f32s(&data)?.into_iter().map(|v| -v.exp()).collect());
            if reorder {
                gdn.reorder_rows(&mut a, 0, 1, 4);
            }
            Ok((GgmlType::F32, a))
        }
        "ssm_dt.bias" | "ssm_beta.weight" | "ssm_alpha.weight" => {
            let row = data.len() / gdn.n_v;
            if reorder {
                gdn.reorder_rows(&mut data, 0, 1, row);
            }
            Ok((dtype, data))
        }
        "attn_qkv.weight" | "ssm_conv1d.weight" => {
            let rows = qkv_rows;
            if !data.len().is_multiple_of(rows) {
                return Err(ModelError::tensor(hf, format!("not {rows} rows (2 * key heads * key dim + value heads * value dim)")));
            }
            let row = data.len() / rows;
            if reorder {
                gdn.reorder_rows(&mut data, 2 * kd, gdn.dv, row);
            }
            Ok((dtype, data))
        }
        "attn_gate.weight" => {
            let row = data.len() / (gdn.n_v * gdn.dv);
            if reorder {
                gdn.reorder_rows(&mut data, 0, gdn.dv, row);
            }
            Ok((dtype, data))
        }
        "ssm_out.weight" => {
            if !data.len().is_multiple_of(gdn.n_v * gdn.dv * elem) {
                return Err(ModelError::tensor(hf, "rows are not value heads * value dim wide"));
            }
            if reorder {
                gdn.reorder_cols(&mut data, elem);
            }
            Ok((dtype, data))
        }
        _ => Ok((dtype, data)),
    }
}

/// The Qwen3.5 / Qwen3-Next keys beyond the common ones: the GDN shape, the layer schedule (as
/// llama.cpp's `full_attention_interval`), partial RoPE, the MoE widths and routing. Refuses what
/// the graph does not implement.
type ArchMetadata = Vec<(&'static str, Value)>;

fn qwen35_metadata(cfg: &Json, n_layers: usize, head_dim: u64) -> Result<(ArchMetadata, Gdn), ModelError> {
    let num = |key: &str| -> Result<usize, ModelError> {
        cfg[key].as_u64().map(|v| v as usize).ok_or_else(|| config_error(format!("config.json: `{key}` is missing or not an integer")))
    };
    let next = cfg["model_type"].as_str() == Some("qwen3_next");
    let family = if next { "qwen3-next" } else { "qwen3.5" };
    let gdn = Gdn {
        n_k: num("linear_num_key_heads")?,
        n_v: num("linear_num_value_heads")?,
        dk: num("linear_key_head_dim")?,
        dv: num("linear_value_head_dim")?,
        tiled: !next,
    };
    if gdn.n_k == 0 || !gdn.n_v.is_multiple_of(gdn.n_k) || gdn.dk == 0 || gdn.dv == 0 {
        return Err(config_error(format!("config.json: unsupported linear attention heads {gdn:?}")));
    }
    let act = cfg["hidden_act"].as_str().unwrap_or("silu");
    if act != "silu" {
        return Err(config_error(format!("config.json: {family} activation `{act}` is not supported (silu is)")));
    }
    let moe = next || cfg["model_type"].as_str().is_some_and(|t| t.starts_with("qwen3_5_moe"));
    if !moe && cfg["num_experts"].as_u64().is_some_and(|e| e > 0) {
        return Err(config_error("config.json: `num_experts` in a dense Qwen3.5 config (MoE checkpoints are `qwen3_5_moe`)"));
    }
    if cfg["attention_bias"].as_bool() == Some(true) {
        return Err(config_error(format!("config.json: attention biases (`attention_bias`) are not supported for {family}")));
    }
    // transformers saves `layer_types` without `full_attention_interval` (it derives one from
    // the other): without the interval, the first full-attention layer gives it.
    let first_full = cfg["layer_types"].as_array().and_then(|t| t.iter().position(|t| t.as_str() == Some("full_attention")));
    let interval = match cfg["full_attention_interval"].as_u64() {
        Some(i) => i as usize,
        None if cfg["layer_types"].is_array() => first_full.map_or(n_layers + 1, |l| l + 1),
        None => 4,
    };
    if interval == 0 {
        return Err(config_error("config.json: `full_attention_interval` must be positive"));
    }
    if let Some(types) = cfg["layer_types"].as_array() {
        let full: Vec<bool> = types
            .iter()
            .map(|t| match t.as_str() {
                Some("full_attention") => Ok(true),
                Some("linear_attention") => Ok(false),
                _ => Err(config_error(format!("config.json: unknown layer type {t}"))),
            })
            .collect::<Result<_, _>>()?;
        if full.len() != n_layers {
            return Err(config_error(format!("config.json: {} layer types for {n_layers} layers", full.len())));
        }
        if full.iter().enumerate().any(|(l, &f)| f != ((l + 1) % interval == 0)) {
            return Err(config_error(format!(
                "config.json: `layer_types` does not follow a full-attention layer every {interval} layers, which is the only schedule supported"
            )));
        }
    }
    let rope = &cfg["rope_parameters"];
    if rope["rope_type"].as_str().is_some_and(|t| t != "default") {
        return Err(config_error(format!("config.json: RoPE type `{}` is not supported for {family}", rope["rope_type"])));
    }
    // Configs written before transformers 5 (Qwen3-Next's own) carry scaling as `rope_scaling`.
    let scaling = &cfg["rope_scaling"];
    if let Some(t) = scaling["rope_type"].as_str().or(scaling["type"].as_str()).filter(|&t| t != "default") {
        return Err(config_error(format!("config.json: RoPE scaling `{t}` (`rope_scaling`) is not supported for {family}")));
    }
    let factor = rope["partial_rotary_factor"].as_f64().or(cfg["partial_rotary_factor"].as_f64()).unwrap_or(0.25);
    let rot = (head_dim as f64 * factor) as u64;
    let u = |v: usize| Value::U32(v as u32);
    let mut experts = Vec::new();
    if moe {
        // transformers' Qwen3.5-MoE router always renormalises the top-k weights (llama.cpp's
        // `expert_weights_norm` default): there is no `norm_topk_prob` switch to carry over.
        // Qwen3-Next's router has one (default true).
        if next {
            let norm = cfg["norm_topk_prob"].as_bool().unwrap_or(true);
            experts.push(("expert_weights_norm", Value::Bool(norm)));
            // transformers: layer l is MoE iff (l + 1) % decoder_sparse_step == 0 (and not in
            // mlp_only_layers), else a dense MLP.
            let step = cfg["decoder_sparse_step"].as_u64().unwrap_or(1);
            if step != 1 {
                return Err(config_error(format!("config.json: `decoder_sparse_step` {step} (dense layers in a MoE model) is not supported (1 is)")));
            }
        }
        for (key, hf) in [
            ("expert_count", "num_experts"),
            ("expert_used_count", "num_experts_per_tok"),
            ("expert_feed_forward_length", "moe_intermediate_size"),
            ("expert_shared_feed_forward_length", "shared_expert_intermediate_size"),
        ] {
            experts.push((key, u(num(hf)?)));
        }
        if cfg["mlp_only_layers"].as_array().is_some_and(|a| !a.is_empty()) {
            return Err(config_error("config.json: `mlp_only_layers` (dense layers in a MoE model) is not supported"));
        }
    }
    Ok((
        vec![
            ("ssm.conv_kernel", u(cfg["linear_conv_kernel_dim"].as_u64().unwrap_or(4) as usize)),
            ("ssm.state_size", u(gdn.dk)),
            ("ssm.group_count", u(gdn.n_k)),
            ("ssm.time_step_rank", u(gdn.n_v)),
            ("ssm.inner_size", u(gdn.n_v * gdn.dv)),
            ("full_attention_interval", u(interval)),
            ("rope.dimension_count", Value::U32(rot as u32)),
        ]
        .into_iter()
        .chain(experts)
        .collect(),
        gdn,
    ))
}

/// The Gemma 3 keys beyond the common ones: sliding window and which layers use it, the local
/// RoPE base, RoPE scaling of the global layers, the attention scale; refuses what the graph
/// does not implement.
fn gemma3_metadata(cfg: &Json, n_layers: usize) -> Result<Vec<(&'static str, Value)>, ModelError> {
    let act = cfg["hidden_activation"].as_str().or(cfg["hidden_act"].as_str()).unwrap_or("gelu_pytorch_tanh");
    if act != "gelu_pytorch_tanh" {
        return Err(config_error(format!("config.json: gemma3 activation `{act}` is not supported (gelu_pytorch_tanh is)")));
    }
    if cfg["use_bidirectional_attention"].as_bool() == Some(true) {
        return Err(config_error("config.json: bidirectional attention (EmbeddingGemma) is not supported"));
    }
    let mut out = Vec::new();
    for cap in ["final_logit_softcapping", "attn_logit_softcapping"] {
        if let Some(v) = cfg[cap].as_f64() {
            out.push((cap, Value::F32(v as f32))); // the graph builder refuses it with a clear error
        }
    }
    let pattern = cfg["sliding_window_pattern"].as_u64().or(cfg["_sliding_window_pattern"].as_u64()).unwrap_or(6) as usize;
    let sliding: Vec<bool> = match cfg["layer_types"].as_array() {
        Some(types) => types
            .iter()
            .map(|t| match t.as_str() {
                Some("sliding_attention") => Ok(true),
                Some("full_attention") => Ok(false),
                _ => Err(config_error(format!("config.json: unknown layer type {t}"))),
            })
            .collect::<Result<_, _>>()?,
        None => (0..n_layers).map(|l| pattern == 0 || l % pattern < pattern - 1).collect(),
    };
    if sliding.len() != n_layers {
        return Err(config_error(format!("config.json: {} layer types for {n_layers} layers", sliding.len())));
    }
    if sliding.iter().any(|&s| s) {
        let window = cfg["sliding_window"].as_u64().filter(|&w| w > 0);
        let window = window.ok_or_else(|| config_error("config.json: sliding layers but no positive `sliding_window`"))?;
        out.push(("attention.sliding_window", Value::U32(window as u32)));
        out.push(("attention.sliding_window_pattern", Value::Array(sliding.into_iter().map(Value::Bool).collect())));
    }
    let rope = &cfg["rope_parameters"];
    let local = rope["sliding_attention"]["rope_theta"].as_f64().or(cfg["rope_local_base_freq"].as_f64()).unwrap_or(10_000.0);
    out.push(("rope.freq_base_swa", Value::F32(local as f32)));
    // Scaling of the global layers: transformers 5 `rope_parameters.full_attention`, else the
    // older `rope_scaling`.
    let scaling = if rope["full_attention"].is_object() { &rope["full_attention"] } else { &cfg["rope_scaling"] };
    match scaling["rope_type"].as_str().or(scaling["type"].as_str()) {
        None | Some("default") => {}
        Some("linear") => {
            let factor = scaling["factor"].as_f64().filter(|&f| f > 0.0);
            let factor = factor.ok_or_else(|| config_error("config.json: linear RoPE scaling without a positive factor"))?;
            out.push(("rope.scaling.factor", Value::F32(factor as f32)));
        }
        Some(other) => return Err(config_error(format!("config.json: RoPE type `{other}` is not supported for gemma3"))),
    }
    if rope["sliding_attention"]["rope_type"].as_str().is_some_and(|t| t != "default") {
        return Err(config_error("config.json: RoPE scaling on sliding-window layers is not supported"));
    }
    let scalar = cfg["query_pre_attn_scalar"].as_f64().unwrap_or(256.0);
    if scalar <= 0.0 {
        return Err(config_error("config.json: `query_pre_attn_scalar` must be positive"));
    }
    out.push(("attention.scale", Value::F32((1.0 / scalar.sqrt()) as f32)));
    Ok(out)
}

/// Load an HF checkpoint folder as an in-memory GGUF file.
pub fn load_hf_dir(dir: &Path) -> Result<GgufFile, ModelError> {
    let top = read_json(&dir.join("config.json"))?;
    let model_type = top["model_type"].as_str().ok_or_else(|| config_error("config.json has no `model_type`"))?;
    // Multimodal Qwen3.5 checkpoints: the text model's config is `text_config`, its weights are
    // `model.language_model.*` (the vision tower `model.visual.*` and `mtp.*` are skipped).
    let multimodal = matches!(model_type, "qwen3_5" | "qwen3_5_moe");
    let cfg = if multimodal {
        let mut c = top["text_config"].clone();
        if !c.is_object() {
            return Err(config_error(format!("config.json: `{model_type}` without a `text_config`")));
        }
        if c["model_type"].is_null() {
            c["model_type"] = Json::String(format!("{model_type}_text"));
        }
        if c["tie_word_embeddings"].is_null() {
            c["tie_word_embeddings"] = top["tie_word_embeddings"].clone();
        }
        c
    } else {
        top.clone()
    };
    let arch = match model_type {
        "llama" | "qwen2" | "qwen3" => model_type,
        "qwen3_5_text" | "qwen3_5" => "qwen35",
        "qwen3_5_moe_text" | "qwen3_5_moe" => "qwen35moe",
        "qwen3_next" => "qwen3next",
        "gemma3_text" => "gemma3",
        "gemma3" => {
            return Err(config_error(
                "config.json: `gemma3` is the multimodal Gemma 3 checkpoint; only text-only ones (`gemma3_text`, Gemma3ForCausalLM) are supported",
            ))
        }
        other => {
            return Err(ModelError::UnsupportedArch(other.to_string(), "llama, qwen2, qwen3, gemma3_text, qwen3_5(_text), qwen3_5_moe(_text), qwen3_next (safetensors)"))
        }
    };
    let num = |key: &str| -> Result<u64, ModelError> {
        cfg[key].as_u64().ok_or_else(|| config_error(format!("config.json: `{key}` is missing or not an integer")))
    };
    let n_heads = num("num_attention_heads")?;
    let n_kv = cfg["num_key_value_heads"].as_u64().unwrap_or(n_heads);
    let hidden = num("hidden_size")?;
    if n_heads == 0 || n_kv == 0 || (hidden % n_heads != 0 && cfg["head_dim"].is_null()) {
        return Err(config_error("config.json: head counts do not divide the hidden size"));
    }
    let head_dim = cfg["head_dim"].as_u64().unwrap_or(hidden / n_heads);
    // transformers 5 moved rope_theta into `rope_parameters` (per layer type for Gemma 3).
    let theta = cfg["rope_theta"]
        .as_f64()
        .or_else(|| cfg["rope_parameters"]["rope_theta"].as_f64())
        .or_else(|| cfg["rope_parameters"]["full_attention"]["rope_theta"].as_f64())
        .unwrap_or(if arch == "gemma3" { 1_000_000.0 } else { 10_000.0 });
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", Value::String(arch.into()));
    w.add_metadata("general.name", Value::String(dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()));
    let u = |v: u64| Value::U32(v as u32);
    for (key, value) in [
        ("block_count", u(num("num_hidden_layers")?)),
        ("context_length", u(num("max_position_embeddings")?)),
        ("embedding_length", u(hidden)),
        ("attention.head_count", u(n_heads)),
        ("attention.head_count_kv", u(n_kv)),
        ("attention.key_length", u(head_dim)),
        ("attention.value_length", u(head_dim)),
        ("vocab_size", u(num("vocab_size")?)),
        ("rope.freq_base", Value::F32(theta as f32)),
        ("attention.layer_norm_rms_epsilon", Value::F32(cfg["rms_norm_eps"].as_f64().unwrap_or(1e-6) as f32)),
    ] {
        w.add_metadata(format!("{arch}.{key}"), value);
    }
    // MoE checkpoints have no dense FFN width (the config reads the expert widths instead).
    if !is_moe(arch) || !cfg["intermediate_size"].is_null() {
        w.add_metadata(format!("{arch}.feed_forward_length"), u(num("intermediate_size")?));
    }
    if arch == "gemma3" {
        for (key, value) in gemma3_metadata(&cfg, num("num_hidden_layers")? as usize)? {
            w.add_metadata(format!("gemma3.{key}"), value);
        }
    }
    let gdn = if is_hybrid(arch) {
        let (meta, gdn) = qwen35_metadata(&cfg, num("num_hidden_layers")? as usize, head_dim)?;
        for (key, value) in meta {
            w.add_metadata(format!("{arch}.{key}"), value);
        }
        Some(gdn)
    } else {
        None
    };
    let mut tensors: BTreeMap<String, (Vec<u64>, GgmlType, Vec<u8>)> = BTreeMap::new();
    let n_experts = if is_moe(arch) { num("num_experts")? as usize } else { 0 };
    let mut expert_parts: BTreeMap<String, Vec<Option<ExpertMatrix>>> = BTreeMap::new();
    for file in shard_files(dir)? {
        let bytes = std::fs::read(&file).map_err(|e| config_error(format!("{}: {e}", file.display())))?;
        let st = SafeTensors::deserialize(&bytes).map_err(|e| config_error(format!("{}: not a valid safetensors file: {e}", file.display())))?;
        for (name, view) in st.tensors() {
            let hf_name = match name.strip_prefix("model.language_model.") {
                Some(rest) if multimodal => format!("model.{rest}"),
                _ => name.clone(),
            };
            let dtype = || match view.dtype() {
                Dtype::F32 => Ok(GgmlType::F32),
                Dtype::F16 => Ok(GgmlType::F16),
                Dtype::BF16 => Ok(GgmlType::BF16),
                other => Err(ModelError::tensor(&name, format!("safetensors dtype {other:?} is not supported"))),
            };
            // GGML order: the contiguous dimension first.
            let mut shape: Vec<u64> = view.shape().iter().rev().map(|&d| d as u64).collect();
            if let Some((layer, e, bank)) = expert_part(&hf_name).filter(|_| is_moe(arch)) {
                let slots = expert_parts.entry(format!("blk.{layer}.{bank}")).or_insert_with(|| vec![None; n_experts]);
                let slot = slots.get_mut(e).ok_or_else(|| ModelError::tensor(&name, format!("expert {e} of {n_experts} (num_experts)")))?;
                if slot.replace((name.clone(), shape, dtype()?, view.data().to_vec())).is_some() {
                    return Err(ModelError::tensor(&name, "appears twice"));
                }
                continue;
            }
            let Some(gname) = gguf_name(&hf_name, arch) else { continue };
            let dtype = dtype()?;
            let (mut dtype, mut data) = (dtype, view.data().to_vec());
            if let Some(gdn) = &gdn {
                (dtype, data) = qwen35_tensor(&gname, &name, gdn, dtype, data)?;
                // The conv [C, 1, K] -> [C, K] (GGML order [K, 1, C] -> [K, C]); the shared
                // expert's gate [1, n_embd] -> [n_embd], as llama.cpp stores them.
                let conv = gname.ends_with("ssm_conv1d.weight") && shape.len() == 3;
                let shexp_gate = gname.ends_with("ffn_gate_inp_shexp.weight") && shape.len() == 2;
                if (conv || shexp_gate) && shape[1] == 1 {
                    shape.remove(1);
                }
            }
            if arch == "gemma3" && gname.ends_with("norm.weight") {
                (dtype, data) = (GgmlType::F32, plus_one_f32(&name, dtype, &data)?);
            }
            if arch == "llama" && (gname.ends_with("attn_q.weight") || gname.ends_with("attn_k.weight")) {
                let heads = if gname.ends_with("attn_q.weight") { n_heads } else { n_kv } as usize;
                data = permute_rows(&data, view.shape()[0], heads);
            }
            if tensors.insert(gname.clone(), (shape, dtype, data)).is_some() {
                return Err(ModelError::tensor(&name, format!("appears twice (as `{gname}`)")));
            }
        }
    }
    for (gname, parts) in expert_parts {
        let stacked = stack_experts(&gname, parts)?;
        if tensors.insert(gname.clone(), stacked).is_some() {
            return Err(ModelError::tensor(&gname, "given both per expert and as a 3-D tensor"));
        }
    }
    // Gemma 3 ties them unless the config says otherwise (transformers' default).
    if cfg["tie_word_embeddings"].as_bool().unwrap_or(arch == "gemma3") {
        tensors.remove("output.weight");
    }
    for (name, (shape, dtype, data)) in tensors {
        w.add_tensor(name, &shape, dtype, data)?;
    }
    let mut bytes = Vec::new();
    w.write_to(&mut bytes)?;
    Ok(GgufFile::from_bytes(bytes)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture_dir() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny/qwen35-hf")
    }

    /// A copy of the text checkpoint `src` in the multimodal layout (`model_type` with the text
    /// config as `text_config`, text weights under `model.language_model.*`, a vision tower and
    /// MTP weights to skip), in a fresh temporary folder. Returns the folder and its config.
    fn multimodal_copy(src: &Path, model_type: &str, text_cfg: Json) -> (std::path::PathBuf, Json) {
        let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let extra = vec![0u8; 4 * 8];
        let mut views: Vec<(String, safetensors::tensor::TensorView)> = st
            .tensors()
            .into_iter()
            .map(|(n, v)| (n.strip_prefix("model.").map_or(n.clone(), |r| format!("model.language_model.{r}")), v))
            .collect();
        for name in ["model.visual.blocks.0.attn.qkv.weight", "mtp.fc.weight"] {
            views.push((name.into(), safetensors::tensor::TensorView::new(Dtype::F32, vec![2, 4], &extra).unwrap()));
        }
        let dir = std::env::temp_dir().join(format!("ferrite-{model_type}-mm-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("model.safetensors"), safetensors::serialize(views, None).unwrap()).unwrap();
        let cfg = serde_json::json!({"model_type": model_type, "text_config": text_cfg, "vision_config": {"depth": 1}});
        std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
        (dir, cfg)
    }

    fn assert_same_file(a: &GgufFile, b: &GgufFile) {
        let names = |f: &GgufFile| f.tensors.iter().map(|t| t.name.clone()).collect::<Vec<_>>();
        assert_eq!(names(a), names(b));
        for t in &b.tensors {
            let o = a.tensor(&t.name).unwrap();
            assert_eq!((&o.shape, o.dtype), (&t.shape, t.dtype), "{}", t.name);
            assert_eq!(a.tensor_data(o), b.tensor_data(t), "{}", t.name);
        }
        let keys = |f: &GgufFile| {
            let mut k: Vec<String> = f.metadata.iter().filter(|(k, _)| *k != "general.name").map(|(k, v)| format!("{k}={v:?}")).collect();
            k.sort();
            k
        };
        assert_eq!(keys(a), keys(b));
    }

    /// The multimodal Qwen3.5 layout (`qwen3_5` with `text_config`, text weights under
    /// `model.language_model.*`, a vision tower and MTP weights to skip) loads to exactly the
    /// same tensors and keys as the text-only checkpoint.
    #[test]
    fn qwen3_5_multimodal_layout_loads_its_text_model() {
        let src = fixture_dir();
        let text = load_hf_dir(&src).unwrap();
        let text_cfg = read_json(&src.join("config.json")).unwrap();
        let (dir, cfg) = multimodal_copy(&src, "qwen3_5", text_cfg);
        let mm = load_hf_dir(&dir).unwrap();
        assert_same_file(&mm, &text);
        for key in ["qwen35.ssm.time_step_rank", "qwen35.rope.dimension_count", "qwen35.full_attention_interval"] {
            assert_eq!(mm.metadata.u64(key).unwrap(), text.metadata.u64(key).unwrap(), "{key}");
        }
        assert_eq!(text.metadata.u64("qwen35.rope.dimension_count").unwrap(), 8);
        assert_eq!(text.tensor("blk.0.ssm_conv1d.weight").unwrap().shape, [4, 2 * 32 + 48]);
        // A schedule other than "every n-th layer is full attention" is refused.
        let mut bad = cfg.clone();
        bad["text_config"]["layer_types"][0] = serde_json::json!("full_attention");
        std::fs::write(dir.join("config.json"), bad.to_string()).unwrap();
        let err = load_hf_dir(&dir).unwrap_err().to_string();
        assert!(err.contains("layer_types"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The same for Qwen3.5-MoE (`qwen3_5_moe`, whose text config may leave out its own
    /// `model_type`): per-expert weights are stacked into llama.cpp's 3-D banks either way, and
    /// the expert keys come through.
    #[test]
    fn qwen3_5_moe_multimodal_layout_loads_its_text_model() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny/qwen35moe-hf");
        let text = load_hf_dir(&src).unwrap();
        assert_eq!(text.metadata.str("general.architecture").unwrap(), "qwen35moe");
        for (key, want) in [("expert_count", 4), ("expert_used_count", 2), ("expert_feed_forward_length", 32), ("expert_shared_feed_forward_length", 48)] {
            assert_eq!(text.metadata.u64(&format!("qwen35moe.{key}")).unwrap(), want, "{key}");
        }
        assert!(text.metadata.get("qwen35moe.feed_forward_length").is_none());
        assert_eq!(text.tensor("blk.1.ffn_gate_exps.weight").unwrap().shape, [64, 32, 4]);
        assert_eq!(text.tensor("blk.1.ffn_down_exps.weight").unwrap().shape, [32, 64, 4]);
        assert_eq!(text.tensor("blk.1.ffn_gate_inp.weight").unwrap().shape, [64, 4]);
        assert_eq!(text.tensor("blk.1.ffn_gate_inp_shexp.weight").unwrap().shape, [64]);
        assert!(text.tensors.iter().all(|t| !t.name.contains("experts")));
        let mut text_cfg = read_json(&src.join("config.json")).unwrap();
        text_cfg.as_object_mut().unwrap().remove("model_type");
        let (dir, _) = multimodal_copy(&src, "qwen3_5_moe", text_cfg);
        assert_same_file(&load_hf_dir(&dir).unwrap(), &text);
        // A missing expert is named.
        let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let views: Vec<_> = st.tensors().into_iter().filter(|(n, _)| n != "model.layers.2.mlp.experts.3.up_proj.weight").collect();
        std::fs::write(dir.join("model.safetensors"), safetensors::serialize(views, None).unwrap()).unwrap();
        let err = load_hf_dir(&dir).unwrap_err().to_string();
        assert!(err.contains("blk.2.ffn_up_exps.weight") && err.contains("expert 3 is missing"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Qwen3-Next (`qwen3_next`): the interleaved projections pass unchanged as `ssm_in` /
    /// `ssm_ba`, the value heads keep HF's grouped order (no tiled reorder), the schedule comes
    /// from `layer_types` (transformers saves no `full_attention_interval`), `norm_topk_prob`
    /// becomes `expert_weights_norm`; the norms and `ssm_a` are converted as for Qwen3.5.
    #[test]
    fn qwen3_next_checkpoint_keeps_its_layout() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny/qwen3next-hf");
        let f = load_hf_dir(&src).unwrap();
        assert_eq!(f.metadata.str("general.architecture").unwrap(), "qwen3next");
        for (key, want) in [("full_attention_interval", 4), ("ssm.group_count", 2), ("ssm.time_step_rank", 4), ("expert_count", 4), ("rope.dimension_count", 8)] {
            assert_eq!(f.metadata.u64(&format!("qwen3next.{key}")).unwrap(), want, "{key}");
        }
        assert!(f.metadata.bool_or("qwen3next.expert_weights_norm", false).unwrap());
        let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let same = |gguf: &str, hf: &str| {
            let t = f.tensor(gguf).unwrap_or_else(|| panic!("{gguf} missing"));
            assert_eq!(f.tensor_data(t), st.tensor(hf).unwrap().data(), "{gguf} != {hf}");
        };
        same("blk.0.ssm_in.weight", "model.layers.0.linear_attn.in_proj_qkvz.weight");
        same("blk.2.ssm_ba.weight", "model.layers.2.linear_attn.in_proj_ba.weight");
        same("blk.1.ssm_out.weight", "model.layers.1.linear_attn.out_proj.weight");
        same("blk.1.ssm_dt.bias", "model.layers.1.linear_attn.dt_bias");
        same("blk.1.ssm_norm.weight", "model.layers.1.linear_attn.norm.weight");
        assert_eq!(f.tensor("blk.0.ssm_in.weight").unwrap().shape, [64, 2 * 32 + 2 * 48]);
        assert_eq!(f.tensor("blk.0.ssm_conv1d.weight").unwrap().shape, [4, 2 * 32 + 48]);
        assert_eq!(f.tensor("blk.3.ffn_gate_exps.weight").unwrap().shape, [64, 32, 4]);
        let f32s = |name: &str| -> Vec<f32> { f.tensor_data(f.tensor(name).unwrap()).chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect() };
        let hf32 = |name: &str| -> Vec<f32> { st.tensor(name).unwrap().data().chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect() };
        let a_log = hf32("model.layers.0.linear_attn.A_log");
        assert_eq!(f32s("blk.0.ssm_a"), a_log.iter().map(|v| -v.exp()).collect::<Vec<_>>());
        let norm = hf32("model.layers.3.self_attn.q_norm.weight");
        assert_eq!(f32s("blk.3.attn_q_norm.weight"), norm.iter().map(|v| v + 1.0).collect::<Vec<_>>());
        assert!(f.tensors.iter().all(|t| !t.name.contains("attn_qkv") && !t.name.contains("ssm_beta")));
    }
}
