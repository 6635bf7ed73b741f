//! Hand-run benchmark of the paged decode attention (not part of the test suite): one batched
//! decode step's attention over SmolLM2-135M's 30 layers (9 query heads, 3 KV heads of 64, an f16
//! cache in blocks of 16 rows, the blocks of the sequences interleaved), so that the K/V rows
//! come from L3 or memory as in serving.
//!
//!     cargo run --release -p ferrite-cpu --example attention_bench [-- POSITIONS [SEQS [THREADS]]]
//!
//! Defaults: 84 cached positions (the middle of `batch_step … 64 8 40`), 8 sequences, 2 threads.
//! Prints the best of 30 passes over the layers.

use ferrite_cpu::kernels::attention::{attention_paged, AttentionParams, PagedKv, PagedSeq};
use half::f16;
use std::time::Instant;

const LAYERS: usize = 30;
const BLOCK: usize = 16;

fn main() {
    let arg = |i: usize, default: usize| std::env::args().nth(i).map_or(default, |a| a.parse().expect("a number"));
    let (positions, seqs, threads) = (arg(1, 84), arg(2, 8), arg(3, 2));
    let p = AttentionParams::new(9, 3, 64);
    let kvw = p.n_kv_heads * p.head_dim;
    let per_seq = (positions + 1).div_ceil(BLOCK);
    let n_blocks = seqs * per_seq;
    // Block b of sequence s is physical block (b * seqs + s) * 7919 mod n (a permutation when n
    // and 7919 are coprime, as every n below 7919 is).
    let tables: Vec<Vec<u32>> = (0..seqs).map(|s| (0..per_seq).map(|b| ((b * seqs + s) * 7919 % n_blocks) as u32).collect()).collect();
    let caches: Vec<(Vec<f16>, Vec<f16>)> = (0..LAYERS)
        .map(|l| {
            let k: Vec<f16> = (0..n_blocks * BLOCK * kvw).map(|i| f16::from_f32(((i * 7 + l) % 13) as f32 * 0.05 - 0.3)).collect();
            let v = k.iter().rev().copied().collect();
            (k, v)
        })
        .collect();
    let q: Vec<f32> = (0..seqs * p.n_heads * p.head_dim).map(|i| (i % 11) as f32 * 0.1 - 0.5).collect();
    let rows: Vec<PagedSeq> = tables.iter().map(|t| PagedSeq { blocks: t, start_pos: positions, n_tokens: 1 }).collect();
    let mut out = vec![0f32; q.len()];
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("thread pool");
    let mut best = f64::MAX;
    for _ in 0..30 {
        let t = Instant::now();
        pool.install(|| {
            for (k, v) in &caches {
                attention_paged(&p, &q, &PagedKv { k, v, block_size: BLOCK }, &rows, &mut out);
            }
        });
        best = best.min(t.elapsed().as_secs_f64());
    }
    let bytes = 2 * LAYERS * seqs * (positions + 1) * kvw * 2;
    println!(
        "{LAYERS} layers x {seqs} sequences at {positions} positions, {threads} threads: {:.3} ms ({:.1} GB/s of K/V rows), checksum {:.6}",
        best * 1e3,
        bytes as f64 / best / 1e9,
        out.iter().sum::<f32>()
    );
}
