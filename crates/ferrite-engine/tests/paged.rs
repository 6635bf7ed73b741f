//! The CPU executor's batched path over a paged KV cache (`forward_paged`) against its
//! single-sequence path over the contiguous cache (`forward`).

mod common;

use common::smollm2;
use ferrite_cpu::{CpuExecutor, CpuPrecision};
use ferrite_gguf::GgmlType;
use ferrite_model::synth::{self, SynthShape};
use ferrite_model::{argmax, DeviceSampling, Executor, ExecutorOptions, FusionOptions, Model, PagedKvConfig, PagedOutput, SeqChunk};
use std::sync::Arc;

const BLOCK: usize = 16;

fn executor(model: &Arc<Model>, precision: CpuPrecision) -> CpuExecutor {
    let opts = ExecutorOptions { max_batch: 64, context_len: 256, trace: false, progress: None };
    CpuExecutor::new(Arc::clone(model), precision, opts).unwrap()
}

fn paged(model: &Arc<Model>, precision: CpuPrecision, n_blocks: usize) -> CpuExecutor {
    let mut e = executor(model, precision);
    e.init_paged(PagedKvConfig { n_blocks, block_size: BLOCK, max_seqs: 8, max_tokens: 64 }).unwrap();
    e
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| (i * 7919 + seed * 104_729) % 40_000 + 100).collect()
}

/// Logits after every chunk of the contiguous path: prefill in `chunks`, then one token at a time.
fn contiguous(e: &mut CpuExecutor, tokens: &[u32], chunks: &[usize]) -> Vec<Vec<f32>> {
    let mut out = Vec::new();
    let mut pos = 0;
    for &c in chunks {
        e.forward(&tokens[pos..pos + c], pos).unwrap();
        out.push(e.logits().unwrap());
        pos += c;
    }
    out
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// One sequence, prefilled in two chunks then decoded token by token through a shuffled block
/// table: every step's logits equal the contiguous path's bit for bit.
fn single_sequence_matches(model: &Arc<Model>, precision: CpuPrecision) {
    let tokens = prompt(1, 45);
    let chunks: Vec<usize> = [20, 17].into_iter().chain(std::iter::repeat_n(1, 8)).collect();
    let want = contiguous(&mut executor(model, precision), &tokens, &chunks);
    let mut e = paged(model, precision, 12);
    let table = [9u32, 2, 11, 5];
    let mut pos = 0;
    for (i, &c) in chunks.iter().enumerate() {
        let chunk = SeqChunk { tokens: &tokens[pos..pos + c], start_pos: pos, block_table: &table };
        let got = e.forward_paged(&[chunk]).unwrap();
        assert_eq!(got.len(), 1);
        assert!(same_bits(&got[0], &want[i]), "step {i} (position {pos}): paged logits differ from the contiguous path");
        pos += c;
    }
}

#[test]
fn single_sequence_paged_equals_contiguous_smollm2_quantized() {
    single_sequence_matches(&smollm2(FusionOptions::ALL), CpuPrecision::Quantized);
}

#[test]
fn single_sequence_paged_equals_contiguous_synth_reference() {
    let shape = SynthShape { name: "tiny-llama-paged", arch: "llama", n_layers: 2, n_embd: 128, n_heads: 4, n_kv_heads: 2, head_dim: 32, n_ff: 192, rope_theta: 1e4, context_length: 256, tied_embeddings: true, gdn: None, moe: None };
    let path = synth::write_temp(&shape, GgmlType::Q8_0, 11).unwrap();
    let model = Arc::new(Model::load(&path, FusionOptions::ALL).unwrap());
    single_sequence_matches(&model, CpuPrecision::Reference);
}

/// Several sequences in one batch (one prefilling, others decoding, different lengths): each one's
/// logits equal what it gets alone on the contiguous path.
#[test]
fn batched_sequences_equal_their_single_runs() {
    let model = smollm2(FusionOptions::ALL);
    let lens = [5usize, 23, 40];
    let prompts: Vec<Vec<u32>> = lens.iter().enumerate().map(|(i, &l)| prompt(i as u32 + 2, l + 3)).collect();
    // Reference: each sequence alone; prefill `l`, then 3 single-token steps.
    let want: Vec<Vec<Vec<f32>>> = prompts
        .iter()
        .zip(lens)
        .map(|(p, l)| contiguous(&mut executor(&model, CpuPrecision::Quantized), p, &[l, 1, 1, 1]))
        .collect();
    let mut e = paged(&model, CpuPrecision::Quantized, 16);
    let tables: [&[u32]; 3] = [&[15], &[3, 0], &[7, 12, 1]];
    // Step 0: sequence 0 prefills alone. Step 1: sequence 0 decodes, 1 and 2 prefill.
    // Steps 2-4: 0 decodes on while 1 and 2 decode too.
    let mut pos = [0usize; 3];
    let mut step_of = [0usize; 3];
    let schedule: [&[usize]; 5] = [&[0], &[0, 1, 2], &[0, 1, 2], &[1, 2], &[1, 2]];
    for (s, members) in schedule.iter().enumerate() {
        let batch: Vec<SeqChunk> = members
            .iter()
            .map(|&i| {
                let n = if pos[i] == 0 { lens[i] } else { 1 };
                SeqChunk { tokens: &prompts[i][pos[i]..pos[i] + n], start_pos: pos[i], block_table: tables[i] }
            })
            .collect();
        let got = e.forward_paged(&batch).unwrap();
        for (&i, logits) in members.iter().zip(&got) {
            assert!(same_bits(logits, &want[i][step_of[i]]), "batch step {s}: sequence {i} (its step {}) differs from its single run", step_of[i]);
            pos[i] += batch[members.iter().position(|&m| m == i).unwrap()].tokens.len();
            step_of[i] += 1;
        }
    }
}

/// Greedy draws come back as the argmax of the logits, other draws as the logits themselves:
/// the same step through `forward_paged` and `forward_paged_sampled` on two executors.
#[test]
fn sampled_steps_draw_greedy_tokens_and_return_other_logits() {
    let model = smollm2(FusionOptions::ALL);
    let prompts = [prompt(3, 9), prompt(4, 17)];
    let tables: [&[u32]; 2] = [&[2], &[5, 9]];
    let (mut plain, mut sampled) = (paged(&model, CpuPrecision::Quantized, 16), paged(&model, CpuPrecision::Quantized, 16));
    let batch: Vec<SeqChunk> = prompts.iter().zip(tables).map(|(p, t)| SeqChunk { tokens: p, start_pos: 0, block_table: t }).collect();
    let want = plain.forward_paged(&batch).unwrap();
    let hot = DeviceSampling { temperature: 0.8, top_k: 40, ..DeviceSampling::GREEDY };
    let got = sampled.forward_paged_sampled(&batch, &[Some(DeviceSampling::GREEDY), Some(hot)]).unwrap();
    assert_eq!(got[0], PagedOutput::Token(argmax(&want[0])));
    assert_eq!(got[1], PagedOutput::Logits(want[1].clone()));
    // Without sampling settings (a prompt chunk that does not end its prompt): logits.
    let next: Vec<SeqChunk> = prompts.iter().zip(tables).map(|(p, t)| SeqChunk { tokens: &p[..1], start_pos: p.len(), block_table: t }).collect();
    let (want, got) = (plain.forward_paged(&next).unwrap(), sampled.forward_paged_sampled(&next, &[None, None]).unwrap());
    assert_eq!(got, want.into_iter().map(PagedOutput::Logits).collect::<Vec<_>>());
    assert!(sampled.forward_paged_sampled(&next, &[None]).is_err(), "one sampling setting per sequence");
}

#[test]
fn bad_batches_are_errors_not_panics() {
    let model = smollm2(FusionOptions::ALL);
    let mut plain = executor(&model, CpuPrecision::Quantized);
    let t = [1u32, 2, 3];
    let err = plain.forward_paged(&[SeqChunk { tokens: &t, start_pos: 0, block_table: &[0] }]).unwrap_err().to_string();
    assert!(err.contains("before init_paged"), "{err}");
    let mut e = paged(&model, CpuPrecision::Quantized, 4);
    let long = vec![1u32; 65];
    let cases: [(&[SeqChunk], &str); 6] = [
        (&[], "1 to 8 sequences"),
        (&[SeqChunk { tokens: &t, start_pos: 15, block_table: &[0] }], "cannot hold"),
        (&[SeqChunk { tokens: &t, start_pos: 0, block_table: &[9] }], "outside the cache"),
        (&[SeqChunk { tokens: &[], start_pos: 0, block_table: &[0] }], "no tokens"),
        (&[SeqChunk { tokens: &long, start_pos: 0, block_table: &[0, 1, 2, 3, 3] }], "at most 64 tokens"),
        (&[SeqChunk { tokens: &[1_000_000], start_pos: 0, block_table: &[0] }], "outside the table"),
    ];
    for (batch, want) in cases {
        let err = format!("{:#}", e.forward_paged(batch).unwrap_err());
        assert!(err.contains(want), "expected `{want}` in: {err}");
    }
    // Still usable afterwards.
    assert_eq!(e.forward_paged(&[SeqChunk { tokens: &t, start_pos: 0, block_table: &[2] }]).unwrap().len(), 1);
}
