//! Tiny random-weight models of each supported architecture, built by HF transformers
//! (fixtures/tiny, made by scripts/fixtures/tiny_models.py): ferrite's CPU paths against
//! transformers' float64 logits at every position, through prefill and through decode.

mod common;

use common::{diff, workspace_root};
use ferrite_cpu::{CpuExecutor, CpuPrecision};
use ferrite_model::{Executor, ExecutorOptions, FusionOptions, Model};
use std::sync::Arc;

/// The model (from `file` in fixtures/tiny: the GGUF or the HF folder), the token ids and
/// transformers' logits for every position.
fn fixture(arch: &str, file: &str) -> (Arc<Model>, Vec<u32>, Vec<Vec<f32>>) {
    let dir = workspace_root().join("fixtures/tiny");
    let model = Arc::new(Model::load(dir.join(file), FusionOptions::from_env()).unwrap());
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join(format!("{arch}.json"))).unwrap()).unwrap();
    let ids = json["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let logits = json["logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| row.as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect())
        .collect();
    (model, ids, logits)
}

fn check(arch: &str, file: &str) {
    let (model, ids, reference) = fixture(arch, file);
    check_model(arch, file, model, &ids, &reference);
}

fn check_model(arch: &str, file: &str, model: Arc<Model>, ids: &[u32], reference: &[Vec<f32>]) {
    let opts = ExecutorOptions { max_batch: 4, context_len: 64, trace: false, progress: None };
    // Prefill in chunks of 4 (the last position's logits), then token by token (every position).
    let mut exec = CpuExecutor::new(Arc::clone(&model), CpuPrecision::Reference, opts.clone()).unwrap();
    exec.forward(ids, 0).unwrap();
    let (max_abs, rel) = diff(reference.last().unwrap(), &exec.logits().unwrap());
    println!("{arch} ({file}) prefill: max |diff| {max_abs:.2e}, relative {rel:.2e}");
    assert!(rel < 1e-5, "{arch}: prefill logits differ from transformers: relative {rel}");
    let mut exec = CpuExecutor::new(model, CpuPrecision::Reference, opts).unwrap();
    let (mut worst_abs, mut worst_rel) = (0f32, 0f64);
    for (pos, (&id, want)) in ids.iter().zip(reference).enumerate() {
        exec.forward(&[id], pos).unwrap();
        let (max_abs, rel) = diff(want, &exec.logits().unwrap());
        assert!(rel < 1e-5, "{arch}: decode logits at position {pos} differ: relative {rel}");
        (worst_abs, worst_rel) = (worst_abs.max(max_abs), worst_rel.max(rel));
    }
    println!("{arch} ({file}) decode, every position: max |diff| {worst_abs:.2e}, relative {worst_rel:.2e}");
}

#[test]
fn qwen3_matches_transformers() {
    check("qwen3", "qwen3.gguf");
    check("qwen3", "qwen3-hf");
}

#[test]
fn llama_matches_transformers() {
    check("llama", "llama.gguf");
    // From safetensors: the loader applies llama.cpp's Q/K permutation itself.
    check("llama", "llama-hf");
}

/// Gemma 3: 7 layers of which layer 5 is global and the others slide over 4 positions (shorter
/// than the 11-token prompt), QK-norm, GeGLU, post-norms, scaled embeddings. The GGUF stores the
/// norms with llama.cpp's folded `1 + w`; from safetensors the loader adds the one itself.
#[test]
fn gemma3_matches_transformers() {
    check("gemma3", "gemma3.gguf");
    check("gemma3", "gemma3-hf");
}

/// The graph declares what makes Gemma 3: a window on every layer but layer 5, two RoPE bases,
/// GeGLU, post-norms, the embedding scale; fused and unfused graphs give bit-identical logits.
#[test]
fn gemma3_graph_and_fusion() {
    use ferrite_model::graph::{GatedActivation, Op};
    let path = workspace_root().join("fixtures/tiny/gemma3.gguf");
    let fused = Model::load(&path, FusionOptions::ALL).unwrap();
    let g = &fused.graph;
    let windows: Vec<Option<usize>> = g.ops.iter().filter_map(|o| if let Op::Attention { window, .. } = o { Some(*window) } else { None }).collect();
    assert_eq!(windows, [Some(4), Some(4), Some(4), Some(4), Some(4), None, Some(4)]);
    let thetas: Vec<f32> =
        g.ops.iter().filter_map(|o| if let Op::Attention { rope: Some(rope), .. } = o { Some(rope.theta) } else { None }).collect();
    assert_eq!(thetas, [1e4, 1e4, 1e4, 1e4, 1e4, 1e6, 1e4]);
    let geglu = |o: &&Op| matches!(o, Op::GatedLinear { act: GatedActivation::GeluTanh, .. });
    assert_eq!(g.ops.iter().filter(geglu).count(), 7);
    assert!(matches!(g.ops[0], Op::Embed { scale, .. } if scale == 8.0));
    assert_eq!(g.attention.scale, 1.0 / 32f32.sqrt());
    // Post-norms (2 per layer) stay separate ops even with every fusion on.
    assert_eq!(g.ops.iter().filter(|o| matches!(o, Op::RmsNorm { .. })).count(), 14);
    let ids = [2u32, 40, 7, 255, 0, 91, 13, 13, 64, 5];
    for precision in [CpuPrecision::Reference, CpuPrecision::Quantized] {
        let logits = |fusion| {
            let model = Arc::new(Model::load(&path, fusion).unwrap());
            let opts = ExecutorOptions { max_batch: 4, context_len: 16, trace: false, progress: None };
            let mut exec = CpuExecutor::new(model, precision, opts).unwrap();
            exec.forward(&ids, 0).unwrap();
            exec.logits().unwrap()
        };
        let (a, b) = (logits(FusionOptions::ALL), logits(FusionOptions::NONE));
        assert!(a.iter().all(|v| v.is_finite()));
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "{precision:?}: fused and unfused Gemma 3 logits differ");
    }
}

/// Gemma 3 GGUF metadata the graph cannot honour, or that is malformed, is refused clearly.
#[test]
fn gemma3_bad_metadata_is_refused() {
    use ferrite_gguf::{GgufFile, GgufWriter, Value};
    let src = GgufFile::open(workspace_root().join("fixtures/tiny/gemma3.gguf")).unwrap();
    let with = |key: &str, value: Option<Value>| -> String {
        let mut w = GgufWriter::new();
        for (k, v) in src.metadata.iter() {
            if k != key {
                w.add_metadata(k, v.clone());
            }
        }
        if let Some(v) = value {
            w.add_metadata(key, v);
        }
        for t in &src.tensors {
            w.add_tensor(&t.name, &t.shape, t.dtype, src.tensor_data(t).to_vec()).unwrap();
        }
        let mut bytes = Vec::new();
        w.write_to(&mut bytes).unwrap();
        match Model::from_file(GgufFile::from_bytes(bytes).unwrap(), FusionOptions::ALL) {
            Ok(_) => "loaded".to_string(),
            Err(e) => e.to_string(),
        }
    };
    assert!(with("gemma3.final_logit_softcapping", Some(Value::F32(30.0))).contains("soft-capping"));
    let pattern = "gemma3.attention.sliding_window_pattern";
    assert!(with(pattern, Some(Value::Array(vec![Value::Bool(true); 3]))).contains("3 entries for 7 layers"));
    assert!(with(pattern, Some(Value::String("x".into()))).contains(pattern));
    assert_eq!(with(pattern, Some(Value::U32(2))), "loaded");
    assert_eq!(with("gemma3.attention.sliding_window", None), "loaded");
    // A missing post-norm tensor is a missing tensor, not a silently plain decoder.
    let mut w = GgufWriter::new();
    for (k, v) in src.metadata.iter() {
        w.add_metadata(k, v.clone());
    }
    for t in src.tensors.iter().filter(|t| t.name != "blk.3.post_ffw_norm.weight") {
        w.add_tensor(&t.name, &t.shape, t.dtype, src.tensor_data(t).to_vec()).unwrap();
    }
    let mut bytes = Vec::new();
    w.write_to(&mut bytes).unwrap();
    let err = Model::from_file(GgufFile::from_bytes(bytes).unwrap(), FusionOptions::ALL).err().expect("loaded without a post-norm");
    assert!(err.to_string().contains("blk.3.post_ffw_norm.weight"), "{err}");
}

/// Gemma 3 safetensors configs the graph cannot honour are refused with the reason.
#[test]
fn gemma3_hf_configs_that_are_not_supported_are_refused() {
    let src = workspace_root().join("fixtures/tiny/gemma3-hf");
    let dir = std::env::temp_dir().join(format!("ferrite-hf-gemma3-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let load_with = |key: &str, value: serde_json::Value| -> String {
        let mut c = config.clone();
        c[key] = value;
        std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
        match Model::load(&dir, FusionOptions::ALL) {
            Ok(_) => "loaded".into(),
            Err(e) => e.to_string(),
        }
    };
    assert_eq!(load_with("unused", serde_json::json!(0)), "loaded");
    assert!(load_with("model_type", serde_json::json!("gemma3")).contains("multimodal"));
    assert!(load_with("final_logit_softcapping", serde_json::json!(30.0)).contains("soft-capping"));
    assert!(load_with("hidden_activation", serde_json::json!("gelu")).contains("activation `gelu`"));
    assert!(load_with("use_bidirectional_attention", serde_json::json!(true)).contains("bidirectional"));
    assert!(load_with("layer_types", serde_json::json!(["full_attention"])).contains("1 layer types for 7 layers"));
    let yarn = serde_json::json!({"full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}, "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}});
    assert!(load_with("rope_parameters", yarn).contains("RoPE type `yarn`"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn broken_hf_folders_give_clear_errors() {
    let src = workspace_root().join("fixtures/tiny/qwen3-hf");
    let dir = std::env::temp_dir().join(format!("ferrite-hf-broken-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let err = |dir: &std::path::Path| match Model::load(dir, FusionOptions::ALL) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    };
    let config = std::fs::read_to_string(src.join("config.json")).unwrap();
    std::fs::write(dir.join("config.json"), config.replace("\"qwen3\"", "\"mamba99\"")).unwrap();
    std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    assert!(err(&dir).contains("mamba99"));
    std::fs::write(dir.join("config.json"), &config).unwrap();
    let weights = std::fs::read(src.join("model.safetensors")).unwrap();
    std::fs::write(dir.join("model.safetensors"), &weights[..weights.len() / 2]).unwrap();
    assert!(err(&dir).contains("safetensors"));
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    assert!(err(&dir).contains("no model.safetensors"));
    std::fs::write(dir.join("config.json"), "{ not json").unwrap();
    assert!(err(&dir).contains("invalid JSON"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Qwen3.5 hybrid: 5 layers (Gated DeltaNet 0-2 and 4, gated attention 3), 2 key / 4 value heads
/// in llama.cpp's tiled order, key dim 16 != value dim 12, partial RoPE. The CPU reference runs
/// the delta rule token by token; transformers uses its chunked torch fallback. `check` prefills
/// in chunks of 4 (the state carries across chunks) and decodes token by token.
#[test]
fn qwen35_matches_transformers() {
    check("qwen35", "qwen35.gguf");
}

fn qwen35_exec(fusion: FusionOptions, precision: CpuPrecision, max_batch: usize) -> CpuExecutor {
    let model = Arc::new(Model::load(workspace_root().join("fixtures/tiny/qwen35.gguf"), fusion).unwrap());
    let opts = ExecutorOptions { max_batch, context_len: 64, trace: false, progress: None };
    CpuExecutor::new(model, precision, opts).unwrap()
}

/// The graph: four Gated DeltaNet ops on layers 0-2 and 4, one attention on layer 3 with the gate
/// ops around it, partial RoPE on 8 of 32 dims; a KV cache only for layer 3.
#[test]
fn qwen35_graph() {
    use ferrite_model::graph::Op;
    let exec = qwen35_exec(FusionOptions::ALL, CpuPrecision::Reference, 4);
    let model = Model::load(workspace_root().join("fixtures/tiny/qwen35.gguf"), FusionOptions::ALL).unwrap();
    let g = &model.graph;
    let gdn: Vec<usize> = g.ops.iter().filter_map(|o| if let Op::GatedDeltaNet { layer, .. } = o { Some(*layer) } else { None }).collect();
    assert_eq!(gdn, [0, 1, 2, 4]);
    assert_eq!(g.attention_layers(), [3]);
    assert!(g.has_recurrent_state());
    assert_eq!(g.ops.iter().filter(|o| matches!(o, Op::SigmoidGate { .. } | Op::SplitGatedQuery { .. })).count(), 2);
    let rot: Vec<usize> =
        g.ops.iter().filter_map(|o| if let Op::Attention { rope: Some(rope), .. } = o { Some(rope.rot_dim) } else { None }).collect();
    assert_eq!(rot, [8]);
    if let Some(Op::GatedDeltaNet { shape, .. }) = g.ops.iter().find(|o| matches!(o, Op::GatedDeltaNet { .. })) {
        assert_eq!((shape.n_k_heads, shape.n_v_heads, shape.k_dim, shape.v_dim, shape.conv_kernel), (2, 4, 16, 12, 4));
    }
    assert!(exec.has_recurrent_state());
    // K and V of one layer, 2 kv heads x 32, f32.
    assert_eq!(exec.kv_bytes_per_position(), 2 * 64 * 4);
}

/// State continuity: one prefill of the whole prompt, prefill in chunks of 3, and token-by-token
/// decode give the same logits at every shared position; fused and unfused graphs are bit-identical.
#[test]
fn qwen35_state_continuity_and_fusion() {
    chunking_and_fusion("qwen35.gguf");
}

/// Recurrent state cannot be rewound: position 0 resets it, the consumed position continues it,
/// anything else is a clear error; after the error a restart at 0 works.
#[test]
fn qwen35_forward_positions() {
    let ids = [5u32, 6, 7, 8, 9, 10];
    let mut exec = qwen35_exec(FusionOptions::ALL, CpuPrecision::Reference, 4);
    exec.forward(&ids, 0).unwrap();
    let fresh = exec.logits().unwrap();
    exec.forward(&[1, 2, 3], 0).unwrap();
    let err = exec.forward(&ids[4..], 4).unwrap_err().to_string();
    assert!(err.contains("cannot be rewound") && err.contains("continue at 3, not at 4"), "{err}");
    // Position 0 resets both the conv window and the delta-rule state.
    exec.forward(&ids[..3], 0).unwrap();
    exec.forward(&ids[3..], 3).unwrap();
    assert_eq!(exec.logits().unwrap(), fresh);
    let err = exec.forward(&[1], 2).unwrap_err().to_string();
    assert!(err.contains("continue at 6, not at 2"), "{err}");
}

/// `ferrite run` / `chat` with a hybrid model: the session reuses the cache only when all of it
/// is a prefix of the new prompt, and otherwise recomputes from 0 — with the same logits as a
/// fresh session either way.
#[test]
fn qwen35_session_prefix_reuse() {
    use ferrite_engine::session::Session;
    let fresh = |prompt: &[u32]| {
        let mut s = Session::new(Box::new(qwen35_exec(FusionOptions::ALL, CpuPrecision::Reference, 4)));
        assert_eq!(s.prefill(prompt).unwrap(), prompt.len());
        s.executor().logits().unwrap()
    };
    let mut s = Session::new(Box::new(qwen35_exec(FusionOptions::ALL, CpuPrecision::Reference, 4)));
    let a = [1u32, 17, 200, 33, 5, 250];
    assert_eq!(s.prefill(&a).unwrap(), 6);
    s.step(99).unwrap();
    // A conversation that goes on: the whole cache is a prefix, only the new tokens run.
    let b = [1u32, 17, 200, 33, 5, 250, 99, 7, 64];
    assert_eq!(s.prefill(&b).unwrap(), 2);
    assert_eq!(s.executor().logits().unwrap(), fresh(&b));
    // A prompt that shares only part of the cache (edited history): recomputed from 0.
    let c = [1u32, 17, 200, 8, 8];
    assert_eq!(s.prefill(&c).unwrap(), 5);
    assert_eq!(s.executor().logits().unwrap(), fresh(&c));
    // The same prompt again (the last token must be recomputed): recomputed from 0.
    assert_eq!(s.prefill(&c).unwrap(), 5);
    assert_eq!(s.executor().logits().unwrap(), fresh(&c));
    assert_eq!(s.cached_tokens(), c);
}

/// The CUDA backend accepts the hybrid graph (its GDN heads fit the delta-rule kernel; checked
/// before any device work). tests/cuda_model.rs runs it against this CPU reference.
#[test]
fn qwen35_is_supported_by_cuda() {
    let model = Model::load(workspace_root().join("fixtures/tiny/qwen35.gguf"), FusionOptions::ALL).unwrap();
    ferrite_cuda::check_supported(&model.graph).unwrap();
}

/// The same model from safetensors: the loader applies llama.cpp's converter transforms itself
/// (norm `1 + w` except the GDN norm, `-exp(A_log)`, conv squeeze, grouped -> tiled value heads).
#[test]
fn qwen35_hf_matches_transformers() {
    check("qwen35", "qwen35-hf");
}

type Tensors = Vec<(String, Vec<u64>, ferrite_gguf::GgmlType, Vec<u8>)>;

/// Rebuild the qwen35 fixture GGUF with `edit` applied to its metadata and tensors.
fn qwen35_variant(edit: impl Fn(&mut Vec<(String, ferrite_gguf::Value)>, &mut Tensors)) -> ferrite_gguf::GgufFile {
    fixture_variant("qwen35.gguf", edit)
}

/// Rebuild a fixture GGUF with `edit` applied to its metadata and tensors.
fn fixture_variant(file: &str, edit: impl Fn(&mut Vec<(String, ferrite_gguf::Value)>, &mut Tensors)) -> ferrite_gguf::GgufFile {
    use ferrite_gguf::{GgufFile, GgufWriter};
    let src = GgufFile::open(workspace_root().join("fixtures/tiny").join(file)).unwrap();
    let mut meta: Vec<_> = src.metadata.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
    let mut tensors: Vec<_> = src.tensors.iter().map(|t| (t.name.clone(), t.shape.clone(), t.dtype, src.tensor_data(t).to_vec())).collect();
    edit(&mut meta, &mut tensors);
    let mut w = GgufWriter::new();
    for (k, v) in meta {
        w.add_metadata(k, v);
    }
    for (name, shape, dtype, data) in tensors {
        w.add_tensor(&name, &shape, dtype, data).unwrap();
    }
    let mut bytes = Vec::new();
    w.write_to(&mut bytes).unwrap();
    GgufFile::from_bytes(bytes).unwrap()
}

/// Missing or inconsistent hybrid metadata and tensors are refused with the reason.
#[test]
fn qwen35_bad_files_are_refused() {
    use ferrite_gguf::Value;
    let load = |f| match Model::from_file(f, FusionOptions::ALL) {
        Ok(_) => "loaded".to_string(),
        Err(e) => e.to_string(),
    };
    let set = |key: &'static str, value: Option<Value>| {
        qwen35_variant(move |m, _| {
            m.retain(|(k, _)| k != key);
            if let Some(v) = value.clone() {
                m.push((key.to_string(), v));
            }
        })
    };
    assert_eq!(load(set("qwen35.full_attention_interval", Some(Value::U32(4)))), "loaded");
    let e = load(set("qwen35.ssm.group_count", None));
    assert!(e.contains("qwen35.ssm.group_count"), "{e}");
    let e = load(set("qwen35.ssm.group_count", Some(Value::U32(3))));
    assert!(e.contains("multiple of 3 key heads"), "{e}");
    let e = load(set("qwen35.ssm.inner_size", Some(Value::U32(50))));
    assert!(e.contains("inner_size 50"), "{e}");
    let e = load(set("qwen35.full_attention_interval", Some(Value::U32(0))));
    assert!(e.contains("full_attention_interval"), "{e}");
    // Interval 2 makes layer 1 an attention layer, whose tensors the file does not have.
    let e = load(set("qwen35.full_attention_interval", Some(Value::U32(2))));
    assert!(e.contains("blk.1.attn_q.weight"), "{e}");
    let e = load(qwen35_variant(|_, t| t.retain(|(n, ..)| n != "blk.2.ssm_a")));
    assert!(e.contains("blk.2.ssm_a"), "{e}");
}

/// The quantized CPU path runs on Q8_0 projections (the small GDN parameters stay f32, as
/// llama.cpp keeps them). This tiny random hybrid is very sensitive to rounding: transformers
/// itself (float64) moves its logits by 11.4% relative when its weights are rounded to Q8_0
/// (ferrite's fp32 reference on the rounded weights: 11.3%; the tiny Qwen3: 1.4%), and the
/// quantized path (8-bit activations too) is 8.4% from that reference — so the bound is loose;
/// the exactness checks are the f32 ones above.
#[test]
fn qwen35_quantized_weights() {
    use ferrite_gguf::GgmlType;
    let file = qwen35_variant(to_q8_0);
    assert_eq!(file.tensor("blk.0.attn_qkv.weight").unwrap().dtype, GgmlType::Q8_0);
    let model = Arc::new(Model::from_file(file, FusionOptions::ALL).unwrap());
    let ids = [1u32, 17, 200, 33, 5, 250, 99, 7];
    let opts = ExecutorOptions { max_batch: 4, context_len: 16, trace: false, progress: None };
    let run = |precision| {
        let mut e = CpuExecutor::new(Arc::clone(&model), precision, opts.clone()).unwrap();
        e.forward(&ids, 0).unwrap();
        e.logits().unwrap()
    };
    let (max_abs, rel) = diff(&run(CpuPrecision::Reference), &run(CpuPrecision::Quantized));
    println!("qwen35 Q8_0: quantized vs reference max |diff| {max_abs:.2e}, relative {rel:.2e}");
    assert!(rel < 0.15, "relative {rel}");
}


/// Matrices (and 3-D expert banks) whose rows are whole Q8_0 blocks to Q8_0; vectors and the
/// small GDN parameters stay f32.
fn to_q8_0(_: &mut Vec<(String, ferrite_gguf::Value)>, tensors: &mut Tensors) {
    use ferrite_gguf::GgmlType;
    for (name, shape, dtype, data) in tensors.iter_mut() {
        let keep = shape.len() == 1 || name.ends_with("ssm_a") || name.contains("ssm_dt");
        if !keep && shape[0] % 32 == 0 {
            let values: Vec<f32> = data.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
            *data = ferrite_gguf::quantize(GgmlType::Q8_0, &values).unwrap();
            *dtype = GgmlType::Q8_0;
        }
    }
}

/// A synthetic Qwen3.5 shape at Q8_0 runs on both CPU paths with finite logits, and token-by-token
/// decode equals one prefill on the quantized path too.
#[test]
fn qwen35_synthetic_shape_runs() {
    use ferrite_model::synth::{self, SynthGdn, SynthShape};
    let gdn = Some(SynthGdn { n_k_heads: 2, n_v_heads: 4, k_dim: 32, v_dim: 32 });
    let s = SynthShape { name: "tiny-qwen35-run", arch: "qwen35", n_layers: 4, n_embd: 128, n_heads: 4, n_kv_heads: 2, head_dim: 64, n_ff: 256, rope_theta: 1e7, context_length: 64, tied_embeddings: false, gdn, moe: None };
    let path = synth::write_temp(&s, ferrite_gguf::GgmlType::Q8_0, 5).unwrap();
    let model = Arc::new(Model::load(&path, FusionOptions::ALL).unwrap());
    let ids = [3u32, 1000, 42, 7, 49000, 12];
    let opts = ExecutorOptions { max_batch: 4, context_len: 16, trace: false, progress: None };
    for precision in [CpuPrecision::Reference, CpuPrecision::Quantized] {
        let mut whole = CpuExecutor::new(Arc::clone(&model), precision, opts.clone()).unwrap();
        whole.forward(&ids, 0).unwrap();
        let want = whole.logits().unwrap();
        assert!(want.iter().all(|v| v.is_finite()) && want.iter().any(|&v| v != 0.0));
        let mut step = CpuExecutor::new(Arc::clone(&model), precision, opts.clone()).unwrap();
        for (p, &id) in ids.iter().enumerate() {
            step.forward(&[id], p).unwrap();
        }
        let (_, rel) = diff(&want, &step.logits().unwrap());
        assert!(rel < 1e-6, "{precision:?}: decode differs from prefill: {rel}");
    }
}

/// Qwen3.5-MoE: the qwen35 hybrid (GDN layers 0-2, gated attention 3) with a MoE FFN in every
/// layer — 4 experts of width 32, top 2, renormalised, plus a gated shared expert of width 48 —
/// against transformers at every position (prefill in chunks of 4, then token by token). The
/// GGUF has separate gate/up expert banks as llama.cpp's converter writes them.
#[test]
fn qwen35moe_matches_transformers() {
    check("qwen35moe", "qwen35moe.gguf");
}

/// The same model from safetensors as `save_pretrained` writes it (one matrix per expert):
/// the loader stacks the experts into llama.cpp's 3-D banks.
#[test]
fn qwen35moe_hf_matches_transformers() {
    check("qwen35moe", "qwen35moe-hf");
}

/// The HF checkpoint with fused 3-D experts (`mlp.experts.gate_up_proj` `[E, 2 ff, n_embd]`,
/// `mlp.experts.down_proj`, transformers' in-memory layout) loads as one `[gate | up]` bank per
/// layer (`ExpertGateUp::Fused`) and gives the same logits.
#[test]
fn qwen35moe_hf_fused_experts_match_transformers() {
    use ferrite_model::graph::{ExpertGateUp, Op};
    use safetensors::{tensor::TensorView, Dtype, SafeTensors};
    let src = workspace_root().join("fixtures/tiny/qwen35moe-hf");
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut owned: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in st.tensors() {
        if !name.contains(".mlp.experts.") {
            owned.push((name, view.shape().to_vec(), view.data().to_vec()));
        }
    }
    for l in 0..4 {
        let get = |e: usize, p: &str| st.tensor(&format!("model.layers.{l}.mlp.experts.{e}.{p}_proj.weight")).unwrap().data().to_vec();
        let gate_up: Vec<u8> = (0..4).flat_map(|e| [get(e, "gate"), get(e, "up")].concat()).collect();
        let down: Vec<u8> = (0..4).flat_map(|e| get(e, "down")).collect();
        owned.push((format!("model.layers.{l}.mlp.experts.gate_up_proj"), vec![4, 64, 64], gate_up));
        owned.push((format!("model.layers.{l}.mlp.experts.down_proj"), vec![4, 64, 32], down));
    }
    let views: Vec<(String, TensorView)> =
        owned.iter().map(|(n, shape, data)| (n.clone(), TensorView::new(Dtype::F32, shape.clone(), data).unwrap())).collect();
    let dir = std::env::temp_dir().join(format!("ferrite-qwen35moe-fused-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("model.safetensors"), safetensors::serialize(views, None).unwrap()).unwrap();
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let model = Arc::new(Model::load(&dir, FusionOptions::from_env()).unwrap());
    std::fs::remove_dir_all(&dir).unwrap();
    let fused = model.graph.ops.iter().filter(|o| matches!(o, Op::MoeFfn { gate_up: ExpertGateUp::Fused(_), .. })).count();
    assert_eq!(fused, 4);
    let (_, ids, reference) = fixture("qwen35moe", "qwen35moe.gguf");
    check_model("qwen35moe", "fused HF experts", model, &ids, &reference);
}

/// The graph: one MoE FFN op per layer with the routing from the metadata, 3-D expert banks,
/// no dense FFN weights; no int8 hand-off starts or ends at a MoE op.
#[test]
fn qwen35moe_graph() {
    use ferrite_model::graph::{ExpertGateUp, MoeShape, Op};
    for fusion in [FusionOptions::ALL, FusionOptions::NONE] {
        let model = Model::load(workspace_root().join("fixtures/tiny/qwen35moe.gguf"), fusion).unwrap();
        let g = &model.graph;
        let moe = model.config.moe.unwrap();
        assert_eq!((moe.n_experts, moe.n_experts_used, moe.n_ff_exp, moe.n_ff_shexp, moe.norm_topk_prob), (4, 2, 32, 48, true));
        let ops: Vec<&Op> = g.ops.iter().filter(|o| matches!(o, Op::MoeFfn { .. })).collect();
        assert_eq!(ops.len(), 4);
        for op in &ops {
            let Op::MoeFfn { norm, gate_up, down, shared, moe, residual, .. } = op else { unreachable!() };
            assert_eq!(*moe, MoeShape { n_experts: 4, top_k: 2, n_ff_exp: 32, norm_topk_prob: true });
            assert_eq!((norm.is_some(), residual.is_some()), (fusion == FusionOptions::ALL, fusion == FusionOptions::ALL));
            let ExpertGateUp::Split { gate, up } = *gate_up else { panic!("GGUF experts are split") };
            for (w, rows, cols) in [(gate, 4 * 32, 64), (up, 4 * 32, 64), (*down, 4 * 64, 32)] {
                let spec = model.weights.spec(w);
                assert_eq!((spec.experts, spec.rows, spec.cols, spec.expert_rows()), (4, rows, cols, rows / 4));
            }
            let sh = shared.unwrap();
            assert_eq!((model.weights.spec(sh.gate).rows, model.weights.spec(sh.down).cols), (48, 48));
            assert!(model.weights.spec(sh.gate_inp).is_vector());
        }
        assert_eq!(op_kinds(g, "gated_delta_net"), 3);
        assert_eq!(g.attention_layers(), [3]);
        for h in &g.handoffs {
            assert!(!matches!(g.ops[h.producer], Op::MoeFfn { .. }) && !matches!(g.ops[h.consumer], Op::MoeFfn { .. }), "{h:?}");
        }
        assert!(model.weights.iter().all(|(_, s)| !s.name.contains("ffn_gate.") && !s.name.contains("ffn_up.")));
        // Validation catches routing and bank shapes that do not fit.
        let rows = |w| model.weights.spec(w).rows;
        g.validate(rows).unwrap();
        for (edit, want) in [
            (MoeShape { n_experts: 4, top_k: 5, n_ff_exp: 32, norm_topk_prob: true }, "bad MoE shape"),
            (MoeShape { n_experts: 4, top_k: 2, n_ff_exp: 16, norm_topk_prob: true }, "do not match"),
            (MoeShape { n_experts: 2, top_k: 2, n_ff_exp: 32, norm_topk_prob: true }, "do not match"),
        ] {
            let mut bad = g.clone();
            if let Some(Op::MoeFfn { moe, .. }) = bad.ops.iter_mut().rev().find(|o| matches!(o, Op::MoeFfn { .. })) {
                *moe = edit;
            }
            let err = bad.validate(rows).unwrap_err();
            assert!(err.contains(want), "{edit:?}: {err}");
        }
    }
}

fn op_kinds(g: &ferrite_model::Graph, kind: &str) -> usize {
    g.ops.iter().filter(|o| o.kind() == kind).count()
}

/// Prefill of the whole prompt, prefill in chunks of 3 and token-by-token decode agree (the
/// experts see different token groups in each), and fused and unfused graphs (norm and
/// residual folded into the MoE op or separate ops) give bit-identical logits, on both CPU paths.
#[test]
fn qwen35moe_chunking_and_fusion() {
    chunking_and_fusion("qwen35moe.gguf");
}

fn chunking_and_fusion(file: &str) {
    let ids = [1u32, 17, 200, 33, 5, 250, 99, 7, 64, 128, 3, 42, 0, 255];
    let path = workspace_root().join("fixtures/tiny").join(file);
    let exec = |fusion, precision, max_batch| {
        let model = Arc::new(Model::load(&path, fusion).unwrap());
        CpuExecutor::new(model, precision, ExecutorOptions { max_batch, context_len: 64, trace: false, progress: None }).unwrap()
    };
    for precision in [CpuPrecision::Reference, CpuPrecision::Quantized] {
        let mut whole = exec(FusionOptions::ALL, precision, 64);
        let mut chunked = exec(FusionOptions::ALL, precision, 3);
        let mut step = exec(FusionOptions::ALL, precision, 64);
        let mut unfused = exec(FusionOptions::NONE, precision, 64);
        let mut worst = 0f64;
        for n in 1..=ids.len() {
            whole.forward(&ids[..n], 0).unwrap();
            chunked.forward(&ids[..n], 0).unwrap();
            step.forward(&ids[n - 1..n], n - 1).unwrap();
            unfused.forward(&ids[..n], 0).unwrap();
            let want = whole.logits().unwrap();
            assert!(want.iter().all(|v| v.is_finite()));
            for (what, got) in [("chunked", chunked.logits().unwrap()), ("token by token", step.logits().unwrap())] {
                let (_, rel) = diff(&want, &got);
                worst = worst.max(rel);
                assert!(rel < 1e-6, "{file} {precision:?} {what}: logits at position {} differ from one prefill: relative {rel}", n - 1);
            }
            let u = unfused.logits().unwrap();
            assert!(want.iter().zip(&u).all(|(a, b)| a.to_bits() == b.to_bits()), "{file} {precision:?}: fused and unfused logits differ at {n}");
        }
        println!("{file} {precision:?}: chunked / token-by-token vs one prefill, worst relative {worst:.2e}");
    }
}

/// Q8_0 weights (the 3-D expert banks quantized row by row) on the quantized path, against the
/// fp32 reference on the same weights. The routing logits are f32 on both paths. The bounds are
/// loose for the reason `qwen35_quantized_weights` gives (a tiny random hybrid amplifies
/// rounding): with only the FFN weights at Q8_0 the first layer's output is 0.8% from the
/// reference and the logits 4.4% — the dense qwen35 fixture, FFN at Q8_0 likewise: 1.0% and
/// 3.3% —, with every matrix at Q8_0 the logits are 12.9% off (qwen35: 8.4%).
#[test]
fn qwen35moe_quantized_weights() {
    use ferrite_gguf::GgmlType;
    let ids = [1u32, 17, 200, 33, 5, 250, 99, 7];
    let opts = ExecutorOptions { max_batch: 4, context_len: 16, trace: false, progress: None };
    let ffn_only = |m: &mut Vec<(String, ferrite_gguf::Value)>, t: &mut Tensors| {
        let mut ffn: Tensors = t.iter().filter(|(n, ..)| n.contains("ffn_")).cloned().collect();
        to_q8_0(m, &mut ffn);
        for (name, _, dtype, data) in t.iter_mut() {
            if let Some((_, _, d, q)) = ffn.iter().find(|(n, ..)| n == name) {
                (*dtype, *data) = (*d, q.clone());
            }
        }
    };
    for (what, file, bound) in [
        ("all matrices", fixture_variant("qwen35moe.gguf", to_q8_0), 0.2),
        ("MoE FFN only", fixture_variant("qwen35moe.gguf", ffn_only), 0.08),
    ] {
        for name in ["blk.0.ffn_up_exps.weight", "blk.0.ffn_down_exps.weight", "blk.3.ffn_gate_shexp.weight"] {
            assert_eq!(file.tensor(name).unwrap().dtype, GgmlType::Q8_0, "{name}");
        }
        let model = Arc::new(Model::from_file(file, FusionOptions::ALL).unwrap());
        let run = |precision| {
            let mut e = CpuExecutor::new(Arc::clone(&model), precision, opts.clone()).unwrap();
            e.forward(&ids, 0).unwrap();
            e.logits().unwrap()
        };
        let (max_abs, rel) = diff(&run(CpuPrecision::Reference), &run(CpuPrecision::Quantized));
        println!("qwen35moe Q8_0 ({what}): quantized vs reference max |diff| {max_abs:.2e}, relative {rel:.2e}");
        assert!(rel < bound, "{what}: relative {rel}");
    }
}

/// The CUDA backend takes MoE graphs (`check_supported` runs before touching any device); MoE
/// shapes its routing kernels cannot run are refused with the reason.
#[test]
fn qwen35moe_is_accepted_by_cuda() {
    use ferrite_model::graph::Op;
    let model = Model::load(workspace_root().join("fixtures/tiny/qwen35moe.gguf"), FusionOptions::ALL).unwrap();
    ferrite_cuda::check_supported(&model.graph).unwrap();
    let mut graph = model.graph.clone();
    for op in &mut graph.ops {
        if let Op::MoeFfn { moe, .. } = op {
            moe.n_experts = 5000;
        }
    }
    let err = format!("{:#}", ferrite_cuda::check_supported(&graph).unwrap_err());
    assert!(err.contains("on CUDA") && err.contains("5000 experts: the routing kernel takes 1 ..= 4096"), "{err}");
}

/// Missing or inconsistent MoE metadata and tensors are refused with the reason.
#[test]
fn qwen35moe_bad_files_are_refused() {
    use ferrite_gguf::Value;
    let load = |f| match Model::from_file(f, FusionOptions::ALL) {
        Ok(_) => "loaded".to_string(),
        Err(e) => e.to_string(),
    };
    let set = |key: &'static str, value: Option<Value>| {
        fixture_variant("qwen35moe.gguf", move |m, _| {
            m.retain(|(k, _)| k != key);
            if let Some(v) = value.clone() {
                m.push((key.to_string(), v));
            }
        })
    };
    assert_eq!(load(set("qwen35moe.expert_weights_norm", Some(Value::Bool(true)))), "loaded");
    let e = load(set("qwen35moe.expert_count", None));
    assert!(e.contains("qwen35moe.expert_count"), "{e}");
    let e = load(set("qwen35moe.expert_used_count", Some(Value::U32(5))));
    assert!(e.contains("5 experts used per token out of 4"), "{e}");
    let e = load(set("qwen35moe.expert_gating_func", Some(Value::U32(2))));
    assert!(e.contains("gating function 2"), "{e}");
    // A wrong expert width is a shape error on the expert banks.
    let e = load(set("qwen35moe.expert_feed_forward_length", Some(Value::U32(16))));
    assert!(e.contains("ffn_gate_exps"), "{e}");
    let e = load(fixture_variant("qwen35moe.gguf", |_, t| t.retain(|(n, ..)| n != "blk.1.ffn_down_shexp.weight")));
    assert!(e.contains("blk.1.ffn_down_shexp.weight"), "{e}");
    // An expert bank stored 2-D (experts flattened into rows) is refused, not misread.
    let e = load(fixture_variant("qwen35moe.gguf", |_, t| {
        for (name, shape, ..) in t.iter_mut() {
            if name == "blk.2.ffn_up_exps.weight" {
                *shape = vec![shape[0], shape[1] * shape[2]];
            }
        }
    }));
    assert!(e.contains("blk.2.ffn_up_exps.weight"), "{e}");
    // norm_topk_prob off is honoured: different logits.
    let logits = |f| {
        let model = Arc::new(Model::from_file(f, FusionOptions::ALL).unwrap());
        let opts = ExecutorOptions { max_batch: 4, context_len: 16, trace: false, progress: None };
        let mut e = CpuExecutor::new(model, CpuPrecision::Reference, opts).unwrap();
        e.forward(&[1, 2, 3], 0).unwrap();
        e.logits().unwrap()
    };
    let (_, rel) = diff(&logits(set("qwen35moe.expert_weights_norm", Some(Value::Bool(true)))), &logits(set("qwen35moe.expert_weights_norm", Some(Value::Bool(false)))));
    assert!(rel > 1e-3, "{rel}");
}


/// Qwen3-Next: the qwen35moe shapes (GDN layers 0-2, gated attention 3, 4 experts top 2 plus a
/// gated shared expert) in Qwen3-Next's layout — value heads in HF's grouped order, `ssm_ba`
/// interleaved per key head, `attn_qkv` / `attn_gate` as llama.cpp's converter splits
/// `in_proj_qkvz` — against transformers at every position.
#[test]
fn qwen3next_matches_transformers() {
    check("qwen3next", "qwen3next.gguf");
}

/// The same model from safetensors: `in_proj_qkvz` and `in_proj_ba` stay interleaved (as
/// `ssm_in` / `ssm_ba`) and the graph de-interleaves both at load.
#[test]
fn qwen3next_hf_matches_transformers() {
    check("qwen3next", "qwen3next-hf");
}

/// The qwen3next fixture with each GDN layer's `attn_qkv` + `attn_gate` put back into llama.cpp's
/// older interleaved `ssm_in` (per key head `[q | k | v (r heads) | z (r heads)]`), optionally at
/// Q8_0 (then `attn_qkv` / `attn_gate` are Q8_0 too, for comparison).
fn qwen3next_variant(legacy: bool, q8: bool) -> ferrite_gguf::GgufFile {
    fixture_variant("qwen3next.gguf", move |m, t| {
        if q8 {
            to_q8_0(m, t);
        }
        if !legacy {
            return;
        }
        let (n_k, dk, d) = (2, 16, 64);
        let (qk, v) = (dk, 2 * 12); // per key head: k_dim rows of q and of k, r * v_dim of v and z
        for l in 0..3 {
            let take = |t: &mut Tensors, name: &str| {
                let i = t.iter().position(|(n, ..)| *n == format!("blk.{l}.{name}.weight")).unwrap();
                t.remove(i)
            };
            let (_, qkv_shape, dtype, qkv) = take(t, "attn_qkv");
            let (_, _, _, z) = take(t, "attn_gate");
            let rows = qkv_shape[1] as usize;
            let row = qkv.len() / rows;
            let (q_at, k_at, v_at) = (0, n_k * qk, 2 * n_k * qk);
            let mut ssm_in = Vec::new();
            for h in 0..n_k {
                ssm_in.extend_from_slice(&qkv[(q_at + h * qk) * row..(q_at + (h + 1) * qk) * row]);
                ssm_in.extend_from_slice(&qkv[(k_at + h * qk) * row..(k_at + (h + 1) * qk) * row]);
                ssm_in.extend_from_slice(&qkv[(v_at + h * v) * row..(v_at + (h + 1) * v) * row]);
                ssm_in.extend_from_slice(&z[h * v * row..(h + 1) * v * row]);
            }
            let n_rows = ssm_in.len() / row;
            t.push((format!("blk.{l}.ssm_in.weight"), vec![d, n_rows as u64], dtype, ssm_in));
        }
    })
}

/// The legacy `ssm_in` layout loads to the same model: the same logits as transformers in f32,
/// and at Q8_0 bit-identical logits to the converter's split layout on the quantized path
/// (quantized rows move whole, so the de-interleaved weight has the same bytes).
#[test]
fn qwen3next_legacy_ssm_in_matches() {
    use ferrite_model::graph::Op;
    let file = qwen3next_variant(true, false);
    assert!(file.tensor("blk.0.attn_qkv.weight").is_none() && file.tensor("blk.2.ssm_in.weight").is_some());
    let model = Arc::new(Model::from_file(file, FusionOptions::from_env()).unwrap());
    let gdn_inputs: Vec<&str> = model.weights.iter().map(|(_, s)| s.name.as_str()).filter(|n| n.starts_with("blk.0.ssm_")).collect();
    assert!(gdn_inputs.iter().any(|n| n.contains("blk.0.ssm_in.weight[q|k|v]")), "{gdn_inputs:?}");
    let (_, ids, reference) = fixture("qwen3next", "qwen3next.gguf");
    check_model("qwen3next", "legacy ssm_in", model, &ids, &reference);
    let ids = [1u32, 17, 200, 33, 5, 250, 99, 7];
    let logits = |legacy| {
        let model = Arc::new(Model::from_file(qwen3next_variant(legacy, true), FusionOptions::ALL).unwrap());
        let gdn = model.graph.ops.iter().filter(|o| matches!(o, Op::GatedDeltaNet { .. })).count();
        assert_eq!(gdn, 3);
        let opts = ExecutorOptions { max_batch: 4, context_len: 16, trace: false, progress: None };
        let mut e = CpuExecutor::new(model, CpuPrecision::Quantized, opts).unwrap();
        e.forward(&ids, 0).unwrap();
        e.logits().unwrap()
    };
    let (split, legacy) = (logits(false), logits(true));
    assert!(split.iter().all(|v| v.is_finite()));
    assert!(split.iter().zip(&legacy).all(|(a, b)| a.to_bits() == b.to_bits()), "Q8_0 ssm_in and attn_qkv/attn_gate logits differ");
}

/// The graph: grouped value heads on the three GDN layers, their `b` / `a` projections gathered
/// from `ssm_ba`, one MoE op per layer with the metadata's routing, the KV cache on layer 3 only.
#[test]
fn qwen3next_graph() {
    use ferrite_model::graph::{MoeShape, Op, ValueHeadOrder};
    for fusion in [FusionOptions::ALL, FusionOptions::NONE] {
        let model = Model::load(workspace_root().join("fixtures/tiny/qwen3next.gguf"), fusion).unwrap();
        let g = &model.graph;
        assert_eq!(model.config.arch, ferrite_model::Arch::Qwen3Next);
        let gdn: Vec<(usize, ValueHeadOrder, usize, usize)> = g
            .ops
            .iter()
            .filter_map(|o| if let Op::GatedDeltaNet { layer, shape, .. } = o { Some((*layer, shape.v_order, shape.k_dim, shape.v_dim)) } else { None })
            .collect();
        assert_eq!(gdn, [(0, ValueHeadOrder::Grouped, 16, 12), (1, ValueHeadOrder::Grouped, 16, 12), (2, ValueHeadOrder::Grouped, 16, 12)]);
        assert_eq!(g.attention_layers(), [3]);
        let rot: Vec<usize> = g
            .ops
            .iter()
            .filter_map(|o| match o {
                Op::Attention { rope: Some(r), .. } | Op::Rope { rope: r, .. } => Some(r.rot_dim),
                _ => None,
            })
            .collect();
        assert_eq!(rot, [8]);
        let moe: Vec<MoeShape> = g.ops.iter().filter_map(|o| if let Op::MoeFfn { moe, .. } = o { Some(*moe) } else { None }).collect();
        assert_eq!(moe, [MoeShape { n_experts: 4, top_k: 2, n_ff_exp: 32, norm_topk_prob: true }; 4]);
        // b and a are row selections of ssm_ba: rows [0, 1, 4, 5] and [2, 3, 6, 7] (r = 2).
        let b = model.weights.iter().find(|(_, s)| s.name == "blk.1.ssm_ba.weight[b]").unwrap().1;
        assert_eq!(b.parts[0].rows.as_deref(), Some([0..2, 4..6].as_slice()));
        let used: Vec<String> = model.weights.used_by(g).into_iter().map(|w| model.weights.spec(w).name.clone()).collect();
        let gdn_proj: Vec<&String> = used.iter().filter(|n| n.starts_with("blk.1.") && (n.contains("attn_qkv") || n.contains("ssm_ba"))).collect();
        match fusion == FusionOptions::ALL {
            true => assert_eq!(gdn_proj, ["blk.1.attn_qkv.weight+blk.1.attn_gate.weight+blk.1.ssm_ba.weight[b]+blk.1.ssm_ba.weight[a]"]),
            false => assert_eq!(gdn_proj, ["blk.1.attn_qkv.weight", "blk.1.ssm_ba.weight[b]", "blk.1.ssm_ba.weight[a]"]),
        }
    }
}

/// Chunked prefill, token-by-token decode and one prefill agree; fused and unfused graphs give
/// bit-identical logits, on both CPU paths.
#[test]
fn qwen3next_chunking_and_fusion() {
    chunking_and_fusion("qwen3next.gguf");
}

/// The CUDA backend accepts Qwen3-Next (`check_supported`, before any device work): the tiny
/// graph, and with Qwen3-Next-80B-A3B's shapes (16 key / 32 value heads of 128 in grouped order,
/// 512 experts top 10). tests/cuda_model.rs runs the tiny model against this CPU reference.
#[test]
fn qwen3next_is_supported_by_cuda() {
    use ferrite_model::graph::{Op, ValueHeadOrder};
    let model = Model::load(workspace_root().join("fixtures/tiny/qwen3next.gguf"), FusionOptions::ALL).unwrap();
    ferrite_cuda::check_supported(&model.graph).unwrap();
    let mut graph = model.graph.clone();
    for op in &mut graph.ops {
        match op {
            Op::GatedDeltaNet { shape, .. } => {
                assert_eq!(shape.v_order, ValueHeadOrder::Grouped);
                (shape.n_k_heads, shape.n_v_heads, shape.k_dim, shape.v_dim) = (16, 32, 128, 128);
            }
            Op::MoeFfn { moe, .. } => (moe.n_experts, moe.top_k) = (512, 10),
            _ => {}
        }
    }
    ferrite_cuda::check_supported(&graph).unwrap();
}

/// A tensor-parallel rank's graph needs an all-reduce the CUDA backend does not have yet: it is
/// refused up front rather than run without one (which would give wrong logits silently).
#[test]
fn tensor_parallel_ranks_are_refused_by_cuda() {
    let model = Model::load(workspace_root().join("fixtures/tiny/llama.gguf"), FusionOptions::ALL).unwrap();
    let ranks = ferrite_model::shard::rank_models(&model, 2).unwrap();
    let err = ferrite_cuda::check_supported(&ranks[1].graph).unwrap_err().to_string();
    assert!(err.contains("rank 1 of a 2-way tensor-parallel split") && err.contains("no all-reduce yet"), "{err}");
}

/// Missing or mis-shaped Qwen3-Next tensors are refused by name.
#[test]
fn qwen3next_bad_layouts_are_refused() {
    use ferrite_gguf::Value;
    let load = |f| match Model::from_file(f, FusionOptions::ALL) {
        Ok(_) => "loaded".to_string(),
        Err(e) => e.to_string(),
    };
    let edit = |f: &'static (dyn Fn(&mut Tensors) + Sync)| fixture_variant("qwen3next.gguf", move |_, t| f(t));
    let drop = |name: &'static str| fixture_variant("qwen3next.gguf", move |_, t| t.retain(|(n, ..)| n != name));
    let e = load(drop("blk.1.ssm_ba.weight"));
    assert!(e.contains("missing tensor `blk.1.ssm_ba.weight`"), "{e}");
    // Qwen3.5's split beta/alpha instead of the interleaved ssm_ba is not this architecture.
    let e = load(edit(&|t| {
        for (name, ..) in t.iter_mut().filter(|(n, ..)| n == "blk.0.ssm_ba.weight") {
            *name = "blk.0.ssm_beta.weight".into();
        }
    }));
    assert!(e.contains("missing tensor `blk.0.ssm_ba.weight`"), "{e}");
    // ssm_ba with the rows of one projection only (n_v instead of 2 n_v).
    let e = load(edit(&|t| {
        for (name, shape, _, data) in t.iter_mut().filter(|(n, ..)| n == "blk.2.ssm_ba.weight") {
            shape[1] /= 2;
            data.truncate(data.len() / 2);
            assert_eq!(name, "blk.2.ssm_ba.weight");
        }
    }));
    assert!(e.contains("tensor `blk.2.ssm_ba.weight`: shape 8x64 expected"), "{e}");
    let e = load(drop("blk.0.attn_gate.weight"));
    assert!(e.contains("missing tensor `blk.0.attn_gate.weight`"), "{e}");
    let e = load(drop("blk.1.attn_qkv.weight"));
    assert!(e.contains("missing tensor `blk.1.attn_qkv.weight (or the interleaved blk.1.ssm_in.weight)`"), "{e}");
    // A legacy ssm_in without its z rows (the converter's q|k|v only).
    let legacy = qwen3next_variant(true, false);
    let mut w = ferrite_gguf::GgufWriter::new();
    for (k, v) in legacy.metadata.iter() {
        w.add_metadata(k, v.clone());
    }
    for t in &legacy.tensors {
        let (mut shape, mut data) = (t.shape.clone(), legacy.tensor_data(t).to_vec());
        if t.name == "blk.0.ssm_in.weight" {
            shape[1] -= 48;
            data.truncate(data.len() - 48 * 64 * 4);
        }
        w.add_tensor(&t.name, &shape, t.dtype, data).unwrap();
    }
    let mut bytes = Vec::new();
    w.write_to(&mut bytes).unwrap();
    let e = load(ferrite_gguf::GgufFile::from_bytes(bytes).unwrap());
    assert!(e.contains("tensor `blk.0.ssm_in.weight`: shape 160x64 expected"), "{e}");
    // Wrong GDN metadata shows up as a shape error on the first GDN tensor it touches: with 2
    // value heads of 24 (same inner size) q|k|v and z keep their heights, ssm_ba does not.
    let e = load(fixture_variant("qwen3next.gguf", |m, _| {
        m.retain(|(k, _)| k != "qwen3next.ssm.time_step_rank");
        m.push(("qwen3next.ssm.time_step_rank".into(), Value::U32(2)));
    }));
    assert!(e.contains("tensor `blk.0.ssm_ba.weight`: shape 4x64 expected"), "{e}");
    let e = load(drop("blk.3.ffn_gate_inp_shexp.weight"));
    assert!(e.contains("blk.3.ffn_gate_inp_shexp.weight"), "{e}");
}

/// HF configs: `norm_topk_prob` is carried over as `expert_weights_norm` (false changes the
/// logits); what the graph does not implement is refused with the reason.
#[test]
fn qwen3next_hf_configs() {
    let src = workspace_root().join("fixtures/tiny/qwen3next-hf");
    let dir = std::env::temp_dir().join(format!("ferrite-hf-qwen3next-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    assert!(config["full_attention_interval"].is_null(), "the fixture has layer_types only");
    let load_with = |key: &str, value: serde_json::Value| -> Result<Model, String> {
        let mut c = config.clone();
        c[key] = value;
        std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
        Model::load(&dir, FusionOptions::ALL).map_err(|e| e.to_string())
    };
    let err = |key: &str, value: serde_json::Value| load_with(key, value).err().unwrap_or_else(|| "loaded".into());
    let logits = |m: Model| {
        let opts = ExecutorOptions { max_batch: 4, context_len: 16, trace: false, progress: None };
        let mut e = CpuExecutor::new(Arc::new(m), CpuPrecision::Reference, opts).unwrap();
        e.forward(&[1, 2, 3, 4, 5], 0).unwrap();
        e.logits().unwrap()
    };
    let on = load_with("norm_topk_prob", serde_json::json!(true)).unwrap();
    assert!(on.config.moe.unwrap().norm_topk_prob);
    let off = load_with("norm_topk_prob", serde_json::json!(false)).unwrap();
    assert!(!off.config.moe.unwrap().norm_topk_prob);
    let (_, rel) = diff(&logits(on), &logits(off));
    assert!(rel > 1e-3, "{rel}");
    assert_eq!(load_with("full_attention_interval", serde_json::json!(4)).map(|_| "loaded").unwrap(), "loaded");
    assert!(err("full_attention_interval", serde_json::json!(2)).contains("`layer_types` does not follow a full-attention layer every 2 layers"));
    assert!(err("decoder_sparse_step", serde_json::json!(2)).contains("`decoder_sparse_step` 2"));
    assert!(err("mlp_only_layers", serde_json::json!([1])).contains("mlp_only_layers"));
    assert!(err("attention_bias", serde_json::json!(true)).contains("attention biases"));
    assert!(err("hidden_act", serde_json::json!("gelu")).contains("qwen3-next activation `gelu`"));
    let yarn = serde_json::json!({"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6, "partial_rotary_factor": 0.25});
    assert!(err("rope_parameters", yarn).contains("RoPE type `\"yarn\"` is not supported for qwen3-next"));
    let yarn = serde_json::json!({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 262144});
    assert!(err("rope_scaling", yarn).contains("RoPE scaling `yarn` (`rope_scaling`) is not supported for qwen3-next"));
    // The pre-transformers-5 form of Qwen3-Next's own config.json: interval, theta and partial
    // rotary factor at the top level, `rope_scaling: null`, no `layer_types`.
    let mut old = config.clone();
    let obj = old.as_object_mut().unwrap();
    obj.remove("layer_types");
    obj.remove("rope_parameters");
    obj.insert("full_attention_interval".into(), serde_json::json!(4));
    obj.insert("rope_theta".into(), serde_json::json!(1e6));
    obj.insert("partial_rotary_factor".into(), serde_json::json!(0.25));
    obj.insert("rope_scaling".into(), serde_json::Value::Null);
    std::fs::write(dir.join("config.json"), old.to_string()).unwrap();
    let (_, ids, reference) = fixture("qwen3next", "qwen3next.gguf");
    check_model("qwen3next", "pre-5 config.json", Arc::new(Model::load(&dir, FusionOptions::ALL).unwrap()), &ids, &reference);
    // Tensors whose height does not match the config are named.
    let e = err("linear_num_value_heads", serde_json::json!(2));
    assert!(e.contains("tensor `model.layers.") || e.contains("tensor `blk."), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
