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
    e.init_paged(PagedKvConfig { n_blocks, block_size: BLOCK, max_seqs: 8, max_tokens: 64, state_snapshots: 0 }).unwrap();
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
        let chunk = SeqChunk { tokens: &tokens[pos..pos + c], start_pos: pos, block_table: &table, state_slot: 0 };
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

/// Runs `schedule` (per step: (sequence, tokens) pairs) through one paged executor, sequence `i`
/// in state slot `slots[i]` through `tables[i]`, and checks every sequence's logits after each
/// of its chunks against the contiguous path fed the same chunks alone, bit for bit.
fn batches_equal_single_runs(model: &Arc<Model>, precision: CpuPrecision, prompts: &[Vec<u32>], tables: &[&[u32]], slots: &[usize], schedule: &[&[(usize, usize)]]) {
    let chunks_of = |i: usize| -> Vec<usize> { schedule.iter().flat_map(|step| step.iter().filter(move |&&(s, _)| s == i).map(|&(_, n)| n)).collect() };
    let want: Vec<Vec<Vec<f32>>> = (0..prompts.len()).map(|i| contiguous(&mut executor(model, precision), &prompts[i], &chunks_of(i))).collect();
    let mut e = paged(model, precision, 16);
    let (mut pos, mut chunk_of) = (vec![0usize; prompts.len()], vec![0usize; prompts.len()]);
    for (s, members) in schedule.iter().enumerate() {
        let batch: Vec<SeqChunk> = members
            .iter()
            .map(|&(i, n)| SeqChunk { tokens: &prompts[i][pos[i]..pos[i] + n], start_pos: pos[i], block_table: tables[i], state_slot: slots[i] })
            .collect();
        let got = e.forward_paged(&batch).unwrap();
        for (&(i, n), logits) in members.iter().zip(&got) {
            assert!(same_bits(logits, &want[i][chunk_of[i]]), "batch step {s}: sequence {i} (its chunk {}) differs from its single run", chunk_of[i]);
            pos[i] += n;
            chunk_of[i] += 1;
        }
    }
}

/// Several sequences in one batch (one prefilling, others decoding, different lengths): each one's
/// logits equal what it gets alone on the contiguous path.
#[test]
fn batched_sequences_equal_their_single_runs() {
    let model = smollm2(FusionOptions::ALL);
    let prompts: Vec<Vec<u32>> = [5usize, 23, 40].iter().enumerate().map(|(i, &l)| prompt(i as u32 + 2, l + 3)).collect();
    // Step 0: sequence 0 prefills alone. Step 1: sequence 0 decodes, 1 and 2 prefill.
    // Steps 2-4: 0 decodes on while 1 and 2 decode too.
    let schedule: [&[(usize, usize)]; 5] = [&[(0, 5)], &[(0, 1), (1, 23), (2, 40)], &[(0, 1), (1, 1), (2, 1)], &[(1, 1), (2, 1)], &[(1, 1), (2, 1)]];
    batches_equal_single_runs(&model, CpuPrecision::Quantized, &prompts, &[&[15], &[3, 0], &[7, 12, 1]], &[0, 1, 2], &schedule);
}

fn tiny(file: &str) -> Arc<Model> {
    Arc::new(Model::load(common::workspace_root().join("fixtures/tiny").join(file), FusionOptions::ALL).unwrap())
}

/// Hybrid models (Gated DeltaNet layers beside attention): each sequence's recurrent state
/// stays in its slot between steps (slots not in batch order), a prompt prefilled over two
/// steps continues its state, decodes run beside prefills: every sequence gets what it gets
/// alone, bit for bit.
fn recurrent_batches_equal_single_runs(file: &str, precision: CpuPrecision) {
    let model = tiny(file);
    let vocab = model.config.vocab_size as u32;
    let prompts: Vec<Vec<u32>> = [7usize, 25, 43].iter().enumerate().map(|(i, &l)| prompt(i as u32 + 2, l).iter().map(|t| t % vocab).collect()).collect();
    let schedule: [&[(usize, usize)]; 5] =
        [&[(0, 5), (2, 20)], &[(0, 1), (1, 23), (2, 20)], &[(0, 1), (1, 1), (2, 1)], &[(1, 1), (2, 1)], &[(2, 1)]];
    batches_equal_single_runs(&model, precision, &prompts, &[&[15], &[3, 0], &[7, 12, 1]], &[5, 0, 3], &schedule);
}

#[test]
fn recurrent_batches_equal_single_runs_qwen35() {
    recurrent_batches_equal_single_runs("qwen35.gguf", CpuPrecision::Reference);
    recurrent_batches_equal_single_runs("qwen35.gguf", CpuPrecision::Quantized);
}

#[test]
fn recurrent_batches_equal_single_runs_moe_hybrids() {
    recurrent_batches_equal_single_runs("qwen35moe.gguf", CpuPrecision::Quantized);
    recurrent_batches_equal_single_runs("qwen3next.gguf", CpuPrecision::Quantized);
}

/// A Gated DeltaNet layer reads its input where the batch's memory plan put it, not where the
/// one-sequence plan would (they differ, for one, on a tracing executor, whose plan keeps every
/// value; found by the CUDA-vs-CPU serving test, which panicked here).
#[test]
fn recurrent_batches_use_the_batch_plan() {
    let model = tiny("qwen35.gguf");
    let vocab = model.config.vocab_size as u32;
    let tokens: Vec<u32> = prompt(3, 40).iter().map(|t| t % vocab).collect();
    let want = contiguous(&mut executor(&model, CpuPrecision::Reference), &tokens, &[40]);
    let opts = ExecutorOptions { max_batch: 8, context_len: 256, trace: true, progress: None };
    let mut e = CpuExecutor::new(Arc::clone(&model), CpuPrecision::Reference, opts).unwrap();
    e.init_paged(PagedKvConfig { n_blocks: 8, block_size: BLOCK, max_seqs: 4, max_tokens: 64, state_snapshots: 0 }).unwrap();
    let got = e.forward_paged(&[SeqChunk { tokens: &tokens, start_pos: 0, block_table: &[0, 1, 2], state_slot: 1 }]).unwrap();
    assert!(same_bits(&got[0], &want[0]), "a 40-token batch on a tracing executor of 8-token forwards");
}

/// A recurrent state cannot be rewound: a chunk must start its slot at 0 or continue where the
/// slot's last chunk ended. A batch with one bad chunk fails before it changes any state, so the
/// good sequence beside it continues as if nothing happened.
#[test]
fn recurrent_slots_refuse_gaps_and_survive_a_failed_batch() {
    let model = tiny("qwen35.gguf");
    let vocab = model.config.vocab_size as u32;
    let tokens: Vec<u32> = prompt(9, 12).iter().map(|t| t % vocab).collect();
    let want = contiguous(&mut executor(&model, CpuPrecision::Reference), &tokens, &[8, 1]);
    let mut e = paged(&model, CpuPrecision::Reference, 8);
    let chunk = |from: usize, n: usize, table: &'static [u32], slot: usize| SeqChunk { tokens: &tokens[from..from + n], start_pos: from, block_table: table, state_slot: slot };
    assert!(same_bits(&e.forward_paged(&[chunk(0, 8, &[0], 2)]).unwrap()[0], &want[0]));
    // Slot 4 has consumed nothing: it cannot continue at 8. Slot 2's chunk beside it is fine.
    let err = format!("{:#}", e.forward_paged(&[chunk(8, 1, &[0], 2), chunk(8, 1, &[1], 4)]).unwrap_err());
    assert!(err.contains("state slot 4") && err.contains("cannot be rewound"), "{err}");
    // Slot 2 rewound to 4: refused too.
    assert!(e.forward_paged(&[chunk(4, 1, &[0], 2)]).is_err());
    let got = e.forward_paged(&[chunk(8, 1, &[0], 2)]).unwrap();
    assert!(same_bits(&got[0], &want[1]), "the refused batches changed slot 2's state");
    // A new sequence in slot 2 starts from a clean state.
    assert!(same_bits(&e.forward_paged(&[chunk(0, 8, &[1], 2)]).unwrap()[0], &want[0]), "slot 2 was not reset at position 0");
}

/// The prefix cache's state snapshots (`copy_state`): a state copied into a snapshot slot (past
/// the running sequences' slots) and from there into another sequence's slot continues, bit for
/// bit, as the original does. The copy carries the count of tokens consumed, so it continues only
/// there; slots past the snapshots, and snapshots of a model without recurrent state, are refused.
#[test]
fn copied_states_continue_as_the_original() {
    let model = tiny("qwen35.gguf");
    let vocab = model.config.vocab_size as u32;
    let tokens: Vec<u32> = prompt(9, 12).iter().map(|t| t % vocab).collect();
    let want = contiguous(&mut executor(&model, CpuPrecision::Reference), &tokens, &[8, 4]);
    let mut e = executor(&model, CpuPrecision::Reference);
    e.init_paged(PagedKvConfig { n_blocks: 8, block_size: BLOCK, max_seqs: 8, max_tokens: 64, state_snapshots: 2 }).unwrap();
    let chunk = |from: usize, n: usize, slot: usize| SeqChunk { tokens: &tokens[from..from + n], start_pos: from, block_table: &[0], state_slot: slot };
    assert!(same_bits(&e.forward_paged(&[chunk(0, 8, 1)]).unwrap()[0], &want[0]));
    // Snapshot 1 (slot 9) keeps slot 1's state after 8 tokens; slot 1 moves on.
    e.copy_state(1, 9).unwrap();
    assert!(same_bits(&e.forward_paged(&[chunk(8, 4, 1)]).unwrap()[0], &want[1]));
    // Slot 3 from the snapshot continues at 8 as slot 1 did (rewriting the same K/V rows).
    e.copy_state(9, 3).unwrap();
    assert!(same_bits(&e.forward_paged(&[chunk(8, 4, 3)]).unwrap()[0], &want[1]), "the copied state differs");
    let err = format!("{:#}", e.forward_paged(&[chunk(8, 4, 3)]).unwrap_err());
    assert!(err.contains("state slot 3") && err.contains("continue at 12"), "{err}");
    assert!(e.copy_state(10, 0).unwrap_err().to_string().contains("there are 10"));
    // Running sequences take only the first max_seqs slots.
    assert!(e.forward_paged(&[chunk(0, 8, 8)]).is_err());
    let mut plain = executor(&smollm2(FusionOptions::ALL), CpuPrecision::Quantized);
    let err = plain.init_paged(PagedKvConfig { n_blocks: 8, block_size: BLOCK, max_seqs: 2, max_tokens: 64, state_snapshots: 1 }).unwrap_err();
    assert!(err.to_string().contains("without recurrent layers"), "{err}");
    plain.init_paged(PagedKvConfig { n_blocks: 8, block_size: BLOCK, max_seqs: 2, max_tokens: 64, state_snapshots: 0 }).unwrap();
    assert!(plain.copy_state(0, 1).is_err());
}

/// Greedy draws come back as the argmax of the logits, other draws as the logits themselves:
/// the same step through `forward_paged` and `forward_paged_sampled` on two executors.
#[test]
fn sampled_steps_draw_greedy_tokens_and_return_other_logits() {
    let model = smollm2(FusionOptions::ALL);
    let prompts = [prompt(3, 9), prompt(4, 17)];
    let tables: [&[u32]; 2] = [&[2], &[5, 9]];
    let (mut plain, mut sampled) = (paged(&model, CpuPrecision::Quantized, 16), paged(&model, CpuPrecision::Quantized, 16));
    let batch: Vec<SeqChunk> = prompts.iter().zip(tables).enumerate().map(|(i, (p, t))| SeqChunk { tokens: p, start_pos: 0, block_table: t, state_slot: i }).collect();
    let want = plain.forward_paged(&batch).unwrap();
    let hot = DeviceSampling { temperature: 0.8, top_k: 40, ..DeviceSampling::GREEDY };
    let got = sampled.forward_paged_sampled(&batch, &[Some(DeviceSampling::GREEDY), Some(hot)]).unwrap();
    assert_eq!(got[0], PagedOutput::Token(argmax(&want[0])));
    assert_eq!(got[1], PagedOutput::Logits(want[1].clone()));
    // Without sampling settings (a prompt chunk that does not end its prompt): logits.
    let next: Vec<SeqChunk> = prompts.iter().zip(tables).enumerate().map(|(i, (p, t))| SeqChunk { tokens: &p[..1], start_pos: p.len(), block_table: t, state_slot: i }).collect();
    let (want, got) = (plain.forward_paged(&next).unwrap(), sampled.forward_paged_sampled(&next, &[None, None]).unwrap());
    assert_eq!(got, want.into_iter().map(PagedOutput::Logits).collect::<Vec<_>>());
    assert!(sampled.forward_paged_sampled(&next, &[None]).is_err(), "one sampling setting per sequence");
}

#[test]
fn bad_batches_are_errors_not_panics() {
    let model = smollm2(FusionOptions::ALL);
    let mut plain = executor(&model, CpuPrecision::Quantized);
    let t = [1u32, 2, 3];
    let err = plain.forward_paged(&[SeqChunk { tokens: &t, start_pos: 0, block_table: &[0], state_slot: 0 }]).unwrap_err().to_string();
    assert!(err.contains("before init_paged"), "{err}");
    let mut e = paged(&model, CpuPrecision::Quantized, 4);
    let long = vec![1u32; 65];
    let chunk = |tokens, start_pos, block_table, state_slot| SeqChunk { tokens, start_pos, block_table, state_slot };
    let cases: [(&[SeqChunk], &str); 8] = [
        (&[], "1 to 8 sequences"),
        (&[chunk(&t, 15, &[0], 0)], "cannot hold"),
        (&[chunk(&t, 0, &[9], 0)], "outside the cache"),
        (&[chunk(&[], 0, &[0], 0)], "no tokens"),
        (&[chunk(&long, 0, &[0, 1, 2, 3, 3], 0)], "at most 64 tokens"),
        (&[chunk(&[1_000_000], 0, &[0], 0)], "outside the table"),
        (&[chunk(&t, 0, &[0], 8)], "state slot 8 is outside the 8 slots"),
        (&[chunk(&t, 0, &[0], 3), chunk(&t, 0, &[1], 3)], "state slot 3 belongs to another sequence"),
    ];
    for (batch, want) in cases {
        let err = format!("{:#}", e.forward_paged(batch).unwrap_err());
        assert!(err.contains(want), "expected `{want}` in: {err}");
    }
    // Still usable afterwards.
    assert_eq!(e.forward_paged(&[chunk(&t, 0, &[2], 0)]).unwrap().len(), 1);
}
