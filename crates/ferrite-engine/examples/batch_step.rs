//! Hand-run timing of one batched decode step (`forward_paged_sampled`) on the CPU for 1..N sequences
//! (not part of the test suite):
//!
//!     cargo run --release -p ferrite-engine --example batch_step -- MODEL.gguf [CONTEXT] [SIZES] [STEPS]
//!
//! Every sequence holds CONTEXT cached positions (default 64) and decodes one token per step,
//! drawn greedily by the executor as in serving;
//! prints the median step time over STEPS steps (default 20) and the implied aggregate tokens/s
//! per batch size (SIZES, comma-separated, default 1,2,4,8,16; at most 16). One size and many
//! steps make a profile of that step (`perf record`).

use ferrite_cpu::{CpuExecutor, CpuPrecision};
use ferrite_model::{DeviceSampling, Executor, ExecutorOptions, FusionOptions, Model, PagedKvConfig, SeqChunk};
use std::sync::Arc;
use std::time::Instant;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let path = args.get(1).map(String::as_str).unwrap_or("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let ctx: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(64);
    let model = Arc::new(Model::load(path, FusionOptions::from_env())?);
    let bs = 16;
    let max_seqs = 16;
    let per_seq = (ctx + 64).div_ceil(bs);
    let opts = ExecutorOptions { max_batch: 256, context_len: 1, trace: false, progress: None };
    let mut exec = CpuExecutor::new(model, CpuPrecision::Quantized, opts)?;
    exec.init_paged(PagedKvConfig { n_blocks: per_seq * max_seqs, block_size: bs, max_seqs, max_tokens: 256, state_snapshots: 0 })?;
    let tables: Vec<Vec<u32>> = (0..max_seqs).map(|s| (0..per_seq as u32).map(|b| s as u32 * per_seq as u32 + b).collect()).collect();
    let prompt: Vec<u32> = (0..ctx as u32).map(|i| 100 + i * 31 % 4000).collect();
    for (s, t) in tables.iter().enumerate() {
        exec.forward_paged(&[SeqChunk { tokens: &prompt, start_pos: 0, block_table: t, state_slot: s }])?;
    }
    let sizes: Vec<usize> = match args.get(3) {
        Some(list) => list.split(',').map(|n| n.parse().map_err(|_| anyhow::anyhow!("bad batch size {n:?}"))).collect::<Result<_, _>>()?,
        None => vec![1, 2, 4, 8, 16],
    };
    anyhow::ensure!(sizes.iter().all(|&n| (1..=max_seqs).contains(&n)), "batch sizes are 1..={max_seqs}");
    let steps: usize = args.get(4).and_then(|s| s.parse().ok()).unwrap_or(20).max(1);
    println!("| sequences | step ms (median of {steps}) | tokens/s |");
    println!("|---|---|---|");
    for n in sizes {
        let mut times = Vec::new();
        for step in 0..=steps {
            let tok = [7u32];
            let batch: Vec<SeqChunk> = tables[..n].iter().enumerate().map(|(s, t)| SeqChunk { tokens: &tok, start_pos: ctx + step.min(40), block_table: t, state_slot: s }).collect();
            // Greedy draws, as the server asks for them: the executor takes each argmax in place
            // instead of copying 8 x 49 152 logits out.
            let greedy = vec![Some(DeviceSampling::GREEDY); n];
            let t0 = Instant::now();
            exec.forward_paged_sampled(&batch, &greedy)?;
            if step > 0 {
                times.push(t0.elapsed().as_secs_f64());
            }
        }
        times.sort_by(f64::total_cmp);
        let med = times[times.len() / 2];
        println!("| {n} | {:.2} | {:.0} |", med * 1e3, n as f64 / med);
    }
    Ok(())
}
