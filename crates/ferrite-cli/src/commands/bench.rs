use super::common::{load_model, ModelArgs};
use anyhow::Result;
use clap::Args;
use ferrite_engine::bench::{batch_speedups, bench_batched, bench_pp, bench_tg, BenchResult, Reps, TokenWork};
use ferrite_engine::sampling::SamplerParams;

#[derive(Args)]
pub struct BenchArgs {
    /// Prompt lengths to test (pp N), comma separated; 0 skips.
    #[arg(short = 'p', long = "n-prompt", value_delimiter = ',', default_value = "128")]
    pub n_prompt: Vec<usize>,
    /// Generation lengths to test (tg N), comma separated; 0 skips.
    #[arg(short = 'n', long = "n-gen", value_delimiter = ',', default_value = "64")]
    pub n_gen: Vec<usize>,
    /// Cached positions before each pp / tg test (prefilled, not timed), comma separated, as
    /// llama-bench's --n-depth: decode and prefill speed deep into a context.
    #[arg(short = 'd', long = "n-depth", value_delimiter = ',', default_value = "0")]
    pub depth: Vec<usize>,
    /// Timed repetitions per test (one extra warm-up run is not counted).
    #[arg(short = 'r', long = "repetitions", default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    pub reps: u64,
    /// Also decode this many sequences at once on the paged cache (tg N xS: one batched step
    /// per token of all of them, as `serve` runs them), comma separated.
    #[arg(short = 's', long = "seqs", value_delimiter = ',')]
    pub seqs: Vec<usize>,
    /// Prompt tokens of each sequence of a --seqs run (prefilled before the timed steps).
    #[arg(long = "seq-prompt", default_value_t = 32)]
    pub seq_prompt: usize,
    /// Temperature of the tg and --seqs runs' draws (0: greedy), drawn on the device where the
    /// backend can, as `run` and `serve` draw (the CPU backend's --seqs runs return logits,
    /// which the run reduces by argmax). Sampled tests are named "... sampled".
    #[arg(long = "temp", alias = "seq-temp", default_value_t = 0.0)]
    pub temp: f32,
    /// top-k of the sampled draws (0: off, as an OpenAI request without `top_k`).
    #[arg(long = "top-k", alias = "seq-top-k", default_value_t = 0)]
    pub top_k: usize,
    /// top-p of the sampled draws (1: off).
    #[arg(long = "top-p", alias = "seq-top-p", default_value_t = 1.0)]
    pub top_p: f32,
    /// min-p of the sampled draws (0: off).
    #[arg(long = "min-p", default_value_t = 0.0)]
    pub min_p: f32,
    /// Bracket the timed part of each test's last repetition with a profiler range (CUDA:
    /// cuProfilerStart/Stop), so that `ncu --profile-from-start off` records only those kernels
    /// (scripts/gpu-kernel-times.sh --range).
    #[arg(long = "profile-range")]
    pub profile_range: bool,
    #[command(flatten)]
    pub model: ModelArgs,
}

pub fn run(args: BenchArgs) -> Result<()> {
    let deepest = args.depth.iter().copied().max().unwrap_or(0);
    let longest = deepest + args.n_prompt.iter().chain(&args.n_gen).copied().max().unwrap_or(0);
    if args.n_prompt.iter().chain(&args.n_gen).all(|&n| n == 0) {
        anyhow::bail!("nothing to measure: every -p and -n value is 0");
    }
    if args.seqs.contains(&0) {
        anyhow::bail!("--seqs counts sequences: each value must be at least 1");
    }
    let sampling = SamplerParams { temperature: args.temp, top_k: args.top_k, top_p: args.top_p, min_p: args.min_p, seed: 0, ..SamplerParams::greedy() };
    sampling.validate().map_err(|e| anyhow::anyhow!("bad sampling settings: {e}"))?;
    let seq_sampling = sampling.on_device(0).expect("no repetition penalty: drawn on the device");
    let loaded = load_model(&args.model)?;
    let vocab = loaded.model.config.vocab_size;
    let mut margs = args.model.clone();
    if margs.ctx_size != 0 {
        margs.ctx_size = margs.ctx_size.max(longest + 1);
    }
    margs.batch_size = margs.batch_size.max(*args.n_prompt.iter().chain([&deepest]).max().unwrap_or(&1) as u64);
    let mut session = loaded.session(&margs, margs.backend, false)?;
    let reps = Reps { count: args.reps as usize, profile_last: args.profile_range };
    let mut results: Vec<BenchResult> = Vec::new();
    for &depth in &args.depth {
        for &n in args.n_prompt.iter().filter(|&&n| n > 0) {
            results.push(bench_pp(&mut session, n, depth, reps, vocab)?);
        }
        for &n in args.n_gen.iter().filter(|&&n| n > 0) {
            results.push(bench_tg(&mut session, n, depth, reps, vocab, &sampling)?);
        }
    }
    for &n in args.n_gen.iter().filter(|&&n| n > 0) {
        for &seqs in &args.seqs {
            results.push(bench_batched(&mut session, seqs, args.seq_prompt.max(1), n, reps, vocab, seq_sampling)?);
        }
    }
    let m = &loaded.model;
    let size = m.file.file_size() as f64 / 1048576.0;
    println!("| model | size | backend | threads | test | t/s |");
    println!("|---|---|---|---|---|---|");
    for r in &results {
        println!(
            "| {} | {size:.1} MiB | {} | {} | {} | {:.2} ± {:.1}% |",
            m.config.name,
            margs.backend,
            rayon::current_num_threads(),
            r.test,
            r.median(),
            100.0 * r.spread()
        );
    }
    eprintln!("(median of {} repetitions after one warm-up; ± is half the min-max range)", reps.count);
    let speedups = batch_speedups(&results);
    if !speedups.is_empty() {
        println!("\n| batched test | against | aggregate / batch-1 rate |");
        println!("|---|---|---|");
        for (batched, base, ratio) in speedups {
            println!("| {batched} | {base} | {ratio:.2}x |");
        }
    }
    if let Some(ceilings) = session.executor().hardware_ceilings() {
        let c = ceilings?;
        let work = TokenWork::of(m);
        let kv = session.executor().kv_bytes_per_position();
        // TB/s and TFLOP/s on a GPU, GB/s and GOP/s on a CPU's few cores.
        let rate = |per_s: f64, unit: &str| if per_s >= 1e12 { format!("{:.2} T{unit}", per_s / 1e12) } else { format!("{:.1} G{unit}", per_s / 1e9) };
        println!("\nceilings measured in this run: {} {}, {} {}", c.bandwidth, rate(c.bytes_per_s, "B/s"), c.matmul, rate(c.matmul_flops, "FLOP/s"));
        println!("| test | work | achieved | fraction of the limit |");
        println!("|---|---|---|---|");
        for r in &results {
            let tps = r.median();
            if r.test.starts_with("tg") {
                // Per step: the weights once for all of the step's sequences.
                let bytes = work.decode_bytes(r.start, r.tokens, r.seqs, kv);
                let steps = tps / r.seqs as f64;
                println!(
                    "| {} | {:.1} MB per step | {} | {:.1}% of the bandwidth |",
                    r.test,
                    bytes / 1e6,
                    rate(bytes * steps, "B/s"),
                    100.0 * bytes * steps / c.bytes_per_s
                );
            } else {
                let flops = work.prompt_flops(r.tokens, r.start);
                println!("| {} | {:.2} GFLOP | {} | {:.1}% of the matrix rate |", r.test, flops / 1e9, rate(flops * tps, "FLOP/s"), 100.0 * flops * tps / c.matmul_flops);
            }
        }
    }
    Ok(())
}
