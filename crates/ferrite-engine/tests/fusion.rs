//! Fusion declared at load time must not change results: the fused and unfused graphs of the
//! real model give bit-identical fp32 logits and per-layer values, on both CPU precisions.

mod common;

use common::smollm2;
use ferrite_cpu::{CpuExecutor, CpuPrecision};
use ferrite_model::graph::Op;
use ferrite_model::{Executor, ExecutorOptions, FusionOptions};

fn run(fusion: FusionOptions, precision: CpuPrecision, tokens: &[u32]) -> (Vec<f32>, Vec<Vec<f32>>) {
    let model = smollm2(fusion);
    let opts = ExecutorOptions { max_batch: 8, context_len: 64, trace: true, progress: None };
    let mut exec = CpuExecutor::new(model, precision, opts).unwrap();
    // A prompt split over two chunks, then one decode step.
    exec.forward(&tokens[..tokens.len() - 1], 0).unwrap();
    exec.forward(&tokens[tokens.len() - 1..], tokens.len() - 1).unwrap();
    let traces = exec.traces().unwrap().into_iter().map(|t| t.data).collect();
    (exec.logits().unwrap(), traces)
}

#[test]
fn fused_and_unfused_graphs_are_bit_identical() {
    let tokens: Vec<u32> = vec![1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 2];
    for precision in [CpuPrecision::Reference, CpuPrecision::Quantized] {
        let fused = run(FusionOptions::ALL, precision, &tokens);
        let unfused = run(FusionOptions::NONE, precision, &tokens);
        assert!(fused.0.iter().all(|v| v.is_finite()));
        assert_eq!(fused.0.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), unfused.0.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "{precision:?}: logits differ");
        assert_eq!(fused.1.len(), unfused.1.len());
        for (i, (a, b)) in fused.1.iter().zip(&unfused.1).enumerate() {
            assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()), "{precision:?}: traced value {i} differs");
        }
    }
}

#[test]
fn fusion_options_change_the_graph() {
    let fused = smollm2(FusionOptions::ALL);
    let unfused = smollm2(FusionOptions::NONE);
    let count = |g: &ferrite_model::Graph, f: fn(&Op) -> bool| g.ops.iter().filter(|o| f(o)).count();
    let linear = |o: &Op| matches!(o, Op::Linear { .. } | Op::GatedLinear { .. });
    let gated = |o: &Op| matches!(o, Op::GatedLinear { .. });
    let glu = |o: &Op| matches!(o, Op::SwiGlu { .. });
    let norm = |o: &Op| matches!(o, Op::RmsNorm { .. });
    let layers = fused.config.n_layers;
    // Unfused: q, k, v, o, gate, up, down per layer + head, and SwiGLU; fused: qkv, o,
    // gate_up with SwiGLU in its epilogue, down + head.
    assert_eq!(count(&unfused.graph, linear), 7 * layers + 1);
    assert_eq!(count(&fused.graph, linear), 4 * layers + 1);
    assert_eq!((count(&unfused.graph, gated), count(&unfused.graph, glu)), (0, layers));
    assert_eq!((count(&fused.graph, gated), count(&fused.graph, glu)), (layers, 0));
    assert_eq!(count(&unfused.graph, norm), 2 * layers + 1);
    assert_eq!(count(&fused.graph, norm), 0);
    // RoPE: a separate op per layer, or inside the attention op.
    let rope = |o: &Op| matches!(o, Op::Rope { .. });
    let attention_rope = |o: &Op| matches!(o, Op::Attention { rope: Some(_), .. });
    assert_eq!((count(&unfused.graph, rope), count(&unfused.graph, attention_rope)), (layers, 0));
    assert_eq!((count(&fused.graph, rope), count(&fused.graph, attention_rope)), (0, layers));
}

/// Qwen2 layout (q/k/v biases, NeoX RoPE) on a tiny synthetic model: fused (with a fused bias)
/// and unfused graphs agree bit for bit.
#[test]
fn qwen2_biases_fuse_bit_identically() {
    use ferrite_gguf::GgmlType;
    use ferrite_model::synth::{self, SynthShape};
    use ferrite_model::Model;
    use std::sync::Arc;
    let shape = SynthShape { name: "tiny-qwen2", arch: "qwen2", n_layers: 2, n_embd: 64, n_heads: 4, n_kv_heads: 2, head_dim: 16, n_ff: 96, rope_theta: 1e6, context_length: 128, tied_embeddings: true, gdn: None, moe: None };
    let path = synth::write_temp(&shape, GgmlType::Q8_0, 5).unwrap();
    let tokens = [3u32, 77, 1000, 42, 9];
    let logits = |fusion| {
        let model = Arc::new(Model::load(&path, fusion).unwrap());
        let mut exec = CpuExecutor::new(model, CpuPrecision::Reference, ExecutorOptions { max_batch: 4, context_len: 16, trace: false, progress: None }).unwrap();
        exec.forward(&tokens, 0).unwrap();
        exec.logits().unwrap()
    };
    let (a, b) = (logits(FusionOptions::ALL), logits(FusionOptions::NONE));
    assert!(a.iter().all(|v| v.is_finite()));
    assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "fused and unfused Qwen2 logits differ");
}

/// QK-norm inside the attention op (`head_norm_into_attention`): Qwen3, Gemma 3 and Qwen3.5's
/// gated attention, each on its tiny fixture, give bit-identical logits with and without it
/// (a prompt in one chunk, then two decode steps), and the graph trades two `HeadNorm` ops per
/// attention layer for the op's own norm.
#[test]
fn qk_norm_inside_attention_is_bit_identical() {
    use ferrite_model::Model;
    use std::sync::Arc;
    let without = FusionOptions { head_norm_into_attention: false, ..FusionOptions::ALL };
    for name in ["qwen3.gguf", "gemma3.gguf", "qwen35.gguf"] {
        let path = common::workspace_root().join("fixtures/tiny").join(name);
        let load = |fusion| Arc::new(Model::load(&path, fusion).unwrap());
        let (fused, unfused) = (load(FusionOptions::ALL), load(without));
        // Without the RoPE fusion the norms cannot stay inside (they come before the rotation):
        // the two HeadNorm ops, then the Rope op, then the attention.
        let no_rope = load(FusionOptions { rope_into_attention: false, ..FusionOptions::ALL });
        let kinds: Vec<&str> = no_rope.graph.ops.iter().map(|o| o.kind()).collect();
        let at = kinds.iter().position(|k| *k == "attention").expect("an attention op");
        assert_eq!(kinds[at - 3..=at], ["head_norm", "head_norm", "rope", "attention"], "{name}: ops before the first attention");
        let count = |m: &Model, f: fn(&Op) -> bool| m.graph.ops.iter().filter(|o| f(o)).count();
        let head_norm = |o: &Op| matches!(o, Op::HeadNorm { .. });
        let normed_attention = |o: &Op| matches!(o, Op::Attention { qk_norm: Some(_), .. });
        let layers = fused.graph.attention_layers().len();
        assert!(layers > 0, "{name}: no attention layer");
        assert_eq!((count(&fused, head_norm), count(&fused, normed_attention)), (0, layers), "{name}: fused graph");
        assert_eq!((count(&unfused, head_norm), count(&unfused, normed_attention)), (2 * layers, 0), "{name}: unfused graph");
        for precision in [CpuPrecision::Reference, CpuPrecision::Quantized] {
            let logits = |model: Arc<Model>| {
                let mut exec = CpuExecutor::new(model, precision, ExecutorOptions { max_batch: 8, context_len: 32, trace: false, progress: None }).unwrap();
                let mut all = Vec::new();
                exec.forward(&[3, 77, 100, 42, 9, 12], 0).unwrap();
                all.extend(exec.logits().unwrap());
                for (i, t) in [5u32, 61].into_iter().enumerate() {
                    exec.forward(&[t], 6 + i).unwrap();
                    all.extend(exec.logits().unwrap());
                }
                all
            };
            let (a, b, c) = (logits(Arc::clone(&fused)), logits(Arc::clone(&unfused)), logits(Arc::clone(&no_rope)));
            assert!(a.iter().all(|v| v.is_finite()), "{name} {precision:?}: non-finite logits");
            assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "{name} {precision:?}: QK-norm inside attention changed the logits");
            assert!(a.iter().zip(&c).all(|(x, y)| x.to_bits() == y.to_bits()), "{name} {precision:?}: separate QK-norm and RoPE ops changed the logits");
        }
    }
}

/// Gemma's post-norms with their residual adds folded in (`residual_into_linear`): the Gemma 3
/// fixture's logits are the same bits, and the graph has no `Add` op left.
#[test]
fn gemma_post_norm_adds_fold_bit_identically() {
    use ferrite_model::Model;
    use std::sync::Arc;
    let path = common::workspace_root().join("fixtures/tiny/gemma3.gguf");
    let load = |fusion| Arc::new(Model::load(&path, fusion).unwrap());
    let (fused, unfused) = (load(FusionOptions::ALL), load(FusionOptions { residual_into_linear: false, ..FusionOptions::ALL }));
    let count = |m: &Model, f: fn(&Op) -> bool| m.graph.ops.iter().filter(|o| f(o)).count();
    let (add, norm_add) = (|o: &Op| matches!(o, Op::Add { .. }), |o: &Op| matches!(o, Op::RmsNorm { residual: Some(_), .. }));
    let layers = fused.config.n_layers;
    assert_eq!((count(&fused, add), count(&fused, norm_add)), (0, 2 * layers));
    assert_eq!((count(&unfused, add), count(&unfused, norm_add)), (2 * layers, 0));
    for precision in [CpuPrecision::Reference, CpuPrecision::Quantized] {
        let logits = |model: Arc<Model>| {
            let mut exec = CpuExecutor::new(model, precision, ExecutorOptions { max_batch: 8, context_len: 32, trace: false, progress: None }).unwrap();
            exec.forward(&[3, 77, 100, 42, 9, 12], 0).unwrap();
            let mut all = exec.logits().unwrap();
            exec.forward(&[5], 6).unwrap();
            all.extend(exec.logits().unwrap());
            all
        };
        let (a, b) = (logits(Arc::clone(&fused)), logits(Arc::clone(&unfused)));
        assert!(a.iter().all(|v| v.is_finite()));
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "{precision:?}: folded post-norm adds changed the logits");
    }
}

/// The bench's per-token work on SmolLM2: every quantized matrix read once (the tied embedding
/// table serves as the output head), FLOPs = 2 per weight; a prompt pays the output head once.
#[test]
fn token_work_counts_every_matrix_once() {
    use ferrite_engine::bench::TokenWork;
    for fusion in [FusionOptions::ALL, FusionOptions::NONE] {
        let model = smollm2(fusion);
        let work = TokenWork::of(&model);
        let matrices: Vec<_> = model.file.tensors.iter().filter(|t| t.shape.len() == 2).collect();
        assert_eq!(work.weight_bytes, matrices.iter().map(|t| t.n_bytes).sum::<usize>());
        let weights: u64 = matrices.iter().map(|t| t.n_elements()).sum();
        assert_eq!(work.linear_flops, 2.0 * weights as f64);
        assert_eq!(work.attention_flops_per_position, 4.0 * (30 * 9 * 64) as f64);
        let head = 2.0 * (model.config.vocab_size * 576) as f64;
        assert_eq!(work.last_row_flops, head);
        let attention = work.attention_flops_per_position * 64.5;
        assert_eq!(work.prompt_flops(128, 0), work.linear_flops - head + head / 128.0 + attention);
        // 1000 cached positions before the prompt: every token attends to them too.
        let deep = work.attention_flops_per_position * 1064.5;
        assert_eq!(work.prompt_flops(128, 1000), work.linear_flops - head + head / 128.0 + deep);
    }
}
