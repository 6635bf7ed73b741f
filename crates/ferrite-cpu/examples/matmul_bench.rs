//! Hand-run matmul benchmark for the SmolLM2-135M shapes (not part of the test suite).
//!
//!     cargo run --release -p ferrite-cpu --example matmul_bench [-- THREADS [groups|sweep]]
//!
//! Part 1 times each shape alone (its weights stay in L2/L3 between runs) at every available SIMD
//! level; part 2 times the row-group kernels (`RowGroups`, what the executors run on AVX2
//! and AVX-512 VNNI CPUs) of every level on the same shapes at the token counts of batched decode
//! steps; part 3 times the matmuls of one decode step / one 128-token prefill over 30 distinct
//! layers plus the output head (~98 MB, as large as the real model), so weights stream from L3 or
//! memory exactly as in inference.
//! THREADS defaults to 2; `groups` runs part 2 only, `sweep` part 3's row groups only.

use ferrite_cpu::kernels::simd::SimdLevel;
use ferrite_cpu::kernels::{matmul_with, RowGroups, WeightView};
use ferrite_gguf::GgmlType;
use std::time::{Duration, Instant};

const D: usize = 576;
const FF: usize = 1536;
const KV: usize = 192;
const VOCAB: usize = 49152;
const LAYERS: usize = 30;

struct Weight {
    dtype: GgmlType,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
}

impl Weight {
    fn random(dtype: GgmlType, rows: usize, cols: usize, seed: u64) -> Self {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let floats: Vec<f32> = (0..rows * cols)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
            })
            .collect();
        Weight {
            dtype,
            rows,
            cols,
            data: ferrite_gguf::quantize(dtype, &floats).expect("whole blocks"),
        }
    }

    fn view(&self) -> WeightView<'_> {
        WeightView {
            dtype: self.dtype,
            rows: self.rows,
            cols: self.cols,
            data: &self.data,
        }
    }
}

/// Mean time of `f` over enough repetitions to fill ~0.3 s, best of three such batches.
fn time(mut f: impl FnMut()) -> Duration {
    f();
    let start = Instant::now();
    let mut reps = 0u32;
    while start.elapsed() < Duration::from_millis(100) {
        f();
        reps += 1;
    }
    let reps = reps.max(1);
    (0..3)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..reps {
                f();
            }
            t.elapsed() / reps
        })
        .min()
        .expect("three batches")
}

fn run(level: SimdLevel, w: &Weight, x: &[f32], n_tokens: usize, out: &mut Vec<f32>) {
    out.resize(n_tokens * w.rows, 0.0);
    matmul_with(level, &w.view(), &x[..n_tokens * w.cols], n_tokens, out).expect("valid shapes");
}

fn main() {
    let threads: usize = std::env::args()
        .nth(1)
        .map_or(2, |a| a.parse().expect("THREADS must be a number"));
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
        .expect("first pool");
    // Run on a pool thread, as an executor should: parallel calls made from outside the pool pay
    // a cross-thread wake-up (~10 us) each time.
    let part = std::env::args().nth(2);
    rayon::scope(|_| bench(threads, part.as_deref()));
}

fn bench(threads: usize, part: Option<&str>) {
    let (groups_only, sweep_only) = (part == Some("groups"), part == Some("sweep"));
    let levels = SimdLevel::available();
    let x: Vec<f32> = (0..128 * FF)
        .map(|i| (i * 7919 % 1000) as f32 / 500.0 - 1.0)
        .collect();
    let mut out = Vec::new();
    println!("{threads} threads, levels {levels:?}\n");

    println!("== one shape, weights warm ==");
    println!(
        "{:<24} {:>7} {:>12} {:>11} {:>10} {:>10}",
        "shape", "tokens", "level", "time", "weight GB/s", "GMAC/s"
    );
    let shapes = [
        ("attn_q/o 576x576", GgmlType::Q4_1, D, D),
        ("attn_k/v 192x576", GgmlType::Q4_1, KV, D),
        ("qkv fused 960x576", GgmlType::Q4_1, D + 2 * KV, D),
        ("gate/up 1536x576", GgmlType::Q4_1, FF, D),
        ("gate+up fused 3072x576", GgmlType::Q4_1, 2 * FF, D),
        ("down 576x1536", GgmlType::Q4_1, D, FF),
        ("head 49152x576 Q8_0", GgmlType::Q8_0, VOCAB, D),
        ("1536x768 Q4_K", GgmlType::Q4_K, FF, 768),
    ];
    for (name, dtype, rows, cols) in shapes.into_iter().filter(|_| part.is_none()) {
        let w = Weight::random(dtype, rows, cols, rows as u64);
        for n_tokens in [1, 128] {
            for &level in &levels {
                if level == SimdLevel::Scalar && (n_tokens > 1 || rows > 4096) {
                    continue; // minutes of scalar work tell nothing new
                }
                let t = time(|| run(level, &w, &x, n_tokens, &mut out));
                let secs = t.as_secs_f64();
                let gbs = w.data.len() as f64 / secs / 1e9;
                let gmacs = (rows * cols * n_tokens) as f64 / secs / 1e9;
                println!(
                    "{name:<24} {n_tokens:>7} {:>12} {:>9.1}us {gbs:>11.1} {gmacs:>10.1}",
                    format!("{level:?}"),
                    secs * 1e6
                );
            }
        }
    }

    println!("\n== row groups, weights warm ==");
    println!("{:<24} {:>7} {:>12} {:>11} {:>10}", "shape", "tokens", "kernel", "time", "GMAC/s");
    let grouped = |s: &(&str, GgmlType, usize, usize)| !sweep_only && matches!(s.1, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0);
    for (name, dtype, rows, cols) in shapes.into_iter().filter(grouped) {
        for level in [SimdLevel::Avx2, SimdLevel::Avx512Vnni] {
            let Some(groups) = RowGroups::repack_for(&Weight::random(dtype, rows, cols, rows as u64).view(), level) else {
                println!("(no {level:?} row groups on this CPU)");
                continue;
            };
            for n_tokens in [1, 4, 8] {
                out.resize(n_tokens * rows, 0.0);
                let t = time(|| groups.matmul(0..rows, &x[..n_tokens * cols], n_tokens, &mut out).expect("valid shapes"));
                let secs = t.as_secs_f64();
                println!("{name:<24} {n_tokens:>7} {:>12} {:>9.1}us {:>10.1}", format!("{level:?}"), secs * 1e6, (rows * cols * n_tokens) as f64 / secs / 1e9);
            }
        }
    }
    if groups_only {
        return;
    }

    println!(
        "\n== model-sized sweep: 30 layers (fused qkv, o, fused gate+up, down) + Q8_0 head =="
    );
    let layers: Vec<[Weight; 4]> = (0..LAYERS)
        .map(|l| {
            let s = 1000 * l as u64;
            [
                Weight::random(GgmlType::Q4_1, D + 2 * KV, D, s + 1),
                Weight::random(GgmlType::Q4_1, D, D, s + 2),
                Weight::random(GgmlType::Q4_1, 2 * FF, D, s + 3),
                Weight::random(GgmlType::Q4_1, D, FF, s + 4),
            ]
        })
        .collect();
    let head = Weight::random(GgmlType::Q8_0, VOCAB, D, 7);
    let bytes: usize =
        layers.iter().flatten().map(|w| w.data.len()).sum::<usize>() + head.data.len();
    println!("{:.1} MB of weights", bytes as f64 / 1e6);
    for &level in levels.iter().filter(|&&l| l != SimdLevel::Scalar && !sweep_only) {
        for n_tokens in [1, 128] {
            let t = time(|| {
                for layer in &layers {
                    for w in layer {
                        run(level, w, &x, n_tokens, &mut out);
                    }
                }
                // The head runs for the last token only, as in prefill.
                run(level, &head, &x, 1, &mut out);
            });
            let secs = t.as_secs_f64();
            println!(
                "{level:?} n_tokens={n_tokens}: {:.2} ms per step, {:.1} GB/s of weights, {:.0} tokens/s (matmuls only)",
                secs * 1e3,
                bytes as f64 / secs / 1e9,
                n_tokens as f64 / secs
            );
        }
    }
    // The same sweep on row groups: one decode step, and a batched step of 8 sequences (the head
    // runs for every sequence there).
    for level in [SimdLevel::Avx2, SimdLevel::Avx512Vnni] {
        let repack = |w: &Weight| RowGroups::repack_for(&w.view(), level);
        let Some(head_g) = repack(&head) else { continue };
        let layers_g: Vec<Vec<RowGroups>> = layers.iter().map(|l| l.iter().filter_map(repack).collect()).collect();
        for n_tokens in [1, 8] {
            let t = time(|| {
                for g in layers_g.iter().flatten().chain([&head_g]) {
                    out.resize(n_tokens * g.rows(), 0.0);
                    g.matmul(0..g.rows(), &x[..n_tokens * g.cols()], n_tokens, &mut out).expect("valid shapes");
                }
            });
            let secs = t.as_secs_f64();
            println!("row groups {level:?} n_tokens={n_tokens}: {:.2} ms per step, {:.1} GB/s of weights", secs * 1e3, bytes as f64 / secs / 1e9);
        }
    }
}