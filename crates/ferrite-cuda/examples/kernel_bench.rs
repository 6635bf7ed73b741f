//! Rough kernel timings on the GPU (not a test: nothing is asserted). For each op it prints the
//! mean time per launch over a burst of back-to-back launches, and for the GEMV the weight
//! bandwidth that implies. Launch overhead is included, as in real decoding.
//!
//!   cargo run -p ferrite-cuda --release --example kernel_bench [SECTION ...]
//!   (or the binary from scripts/gpu-build.sh, on the GPU machine: .device/kernel_bench)
//!
//! Sections: gemv, decode, inputs, chain, cluster, layer, prefill, batched, tilings, mma64, attention, gdn, moe, sampling (default: all).

use ferrite_cuda::kernels::gdn::{GdnChunkVariant, GdnDeltaVariant};
use ferrite_cuda::kernels::gemm::GemmMmaVariant;
use ferrite_cuda::kernels::gemv::{GemvQ8Variant, GemvVariant};
use ferrite_cuda::ops::{self, AttentionConfig, GdnPath, GdnState, GdnWeights, KvCache, KvDtype, LinearOptions, LinearPath, MoePath, SamplingConfig};
use ferrite_cuda::{CudaError, DeviceWeight, Gpu, GpuOptions};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use ferrite_gguf::quant::quantize;
use ferrite_gguf::GgmlType;
use ferrite_model::graph::{GdnShape, ValueHeadOrder};
use std::time::Instant;

/// `n` values spread over [-1, 1) in a fixed, unsorted order: weights and activations for the
/// timings.
fn ramp(n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i * 7919) % 2001) as f32 / 1000.0 - 1.0).collect()
}

/// One token's activations of `n` values in [-0.5, 0.5).
fn activation_row(n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i * 31) % 97) as f32 / 97.0 - 0.5).collect()
}

/// Enough copies of one packed weight to fill more than the L2 (150 MB), so that launches
/// rotating over them read DRAM as a model's step does.
fn weight_copies(gpu: &Gpu, dtype: GgmlType, rows: usize, cols: usize, packed: &[u8]) -> Result<Vec<DeviceWeight>, CudaError> {
    (0..(150_000_000 / packed.len()).max(1) + 1).map(|_| gpu.upload_weight(dtype, rows, cols, packed)).collect()
}

/// Mean seconds per call of `f` over `iters` calls, after a warm-up call.
fn time(gpu: &Gpu, iters: usize, mut f: impl FnMut() -> Result<(), CudaError>) -> Result<f64, CudaError> {
    f()?;
    gpu.synchronize()?;
    let start = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    gpu.synchronize()?;
    Ok(start.elapsed().as_secs_f64() / iters as f64)
}

/// A `kernel_bench` section: measures one family of kernels.
type Section = fn(&Gpu) -> Result<(), CudaError>;

fn main() -> Result<(), CudaError> {
    let gpu = Gpu::new(0)?;
    println!(
        "{} (sm_{}{}, {} SMs)",
        gpu.name(),
        gpu.compute_capability().0,
        gpu.compute_capability().1,
        gpu.sm_count()
    );
    // `kernel_bench [SECTION ...]` runs only the named sections.
    let wanted: Vec<String> = std::env::args().skip(1).collect();
    let sections: [(&str, Section); 14] = [
        ("gemv", gemv),
        ("decode", decode),
        ("inputs", inputs),
        ("chain", chain),
        ("layer", layer),
        ("prefill", prefill),
        ("batched", batched),
        ("tilings", tilings),
        ("mma64", mma64),
        ("glu", glu),
        ("attention", attention),
        ("gdn", gdn),
        ("moe", moe),
        ("sampling", sampling),
    ];
    if let Some(unknown) = wanted.iter().find(|w| !sections.iter().any(|(name, _)| name == w)) {
        let names: Vec<&str> = sections.iter().map(|(name, _)| *name).collect();
        eprintln!("error: no section {unknown:?}; sections: {}", names.join(", "));
        std::process::exit(2);
    }
    for (name, run) in sections {
        if wanted.is_empty() || wanted.iter().any(|w| w == name) {
            run(&gpu)?;
        }
    }
    Ok(())
}

fn gemv(gpu: &Gpu) -> Result<(), CudaError> {
    // SmolLM2-135M projections (q/o, k/v, gate/up, down, lm_head) and two large matrices
    // (k-quants need rows of whole 256-value blocks, so they skip SmolLM2's 576 columns).
    let shapes = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576), (8192, 8192), (16384, 4096)];
    let dtypes = [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::F16];
    let gemv = LinearOptions { path: LinearPath::Gemv, ..LinearOptions::default() };
    println!("\n{:<6} {:>13} {:>4} {:>10} {:>9}", "dtype", "rows x cols", "n", "us/launch", "GB/s");
    for dtype in dtypes {
        for n in [1, 4] {
            for info in gpu.kernel_info(&GemvVariant::for_shape(dtype, n))? {
                println!("{dtype} n={n}: {info:?}");
            }
        }
        for (rows, cols) in shapes {
            if cols % dtype.block_size() != 0 {
                continue;
            }
            let values = ramp(rows * cols);
            let bytes = quantize(dtype, &values).expect("quantize");
            let w = gpu.upload_weight(dtype, rows, cols, &bytes)?;
            for n in [1usize, 4] {
                let x = gpu.upload(&vec![0.5f32; n * cols], "x")?;
                let mut out = gpu.alloc_zeros::<f32>(n * rows)?;
                let s = time(gpu, 200, || ops::linear_with(gpu, &w, &x, n, &mut out, &gemv).map(|_| ()))?;
                let gbs = bytes.len() as f64 / s / 1e9;
                println!("{:<6} {:>6}x{:<6} {:>4} {:>10.2} {:>9.1}", dtype.name(), rows, cols, n, s * 1e6, gbs);
            }
        }
    }
    Ok(())
}

fn decode(gpu: &Gpu) -> Result<(), CudaError> {
    // The 8B decode step's int8 GEMVs with their epilogues (QKV plain; output and down add the
    // residual and leave the next GEMV's int8 input with its norm; gate/up applies SwiGLU and
    // emits), each at the dispatcher's tiling and at others. 60 dependent launches replayed from
    // a graph (so the host's launch rate does not floor the small ones), rotating over copies of
    // the weight that together exceed the 50 MB L2 three times: every launch streams from DRAM.
    println!("\ndecode int8 GEMV tilings, Q4_0, 8B and 1B shapes, one token: us per launch, GB/s of weights (nwarps rows unroll k_split: registers, spilled bytes)");
    // (name, weight rows, cols, gated, residual, emits)
    let shapes = [
        ("qkv", 6144usize, 4096usize, false, false, false),
        ("output", 4096, 4096, false, true, true),
        ("gate_up", 28672, 4096, true, false, true),
        ("down", 4096, 14336, false, true, true),
        ("1b qkv", 3072, 2048, false, false, false),
        ("1b out", 2048, 2048, false, true, true),
        ("1b g/u", 16384, 2048, true, false, true),
        ("1b down", 2048, 8192, false, true, true),
        // Without the hand-off (the next GEMV would quantize the f32 row itself), a block may own
        // fewer than 32 rows: up to 256 blocks instead of the emitting tiling's 64.
        ("down f32", 4096, 14336, false, true, false),
        ("1b out f32", 2048, 2048, false, true, false),
        ("1b dn f32", 2048, 8192, false, true, false),
    ];
    // (nwarps, rows, unroll, k_split); the first entry is the dispatcher's own.
    let tilings: [(u32, u32, u32, u32); 15] = [
        (0, 0, 0, 0),
        (4, 1, 4, 1),
        (4, 2, 2, 1),
        (4, 4, 2, 1),
        (8, 4, 2, 1),
        (8, 4, 1, 2),
        (8, 4, 1, 4),
        (16, 2, 2, 1),
        (16, 2, 4, 1),
        (16, 2, 2, 2),
        (16, 2, 1, 2),
        (32, 1, 4, 1),
        (8, 2, 1, 4),
        (8, 1, 1, 4),
        (4, 1, 2, 4),
    ];
    for (name, rows, cols, gated, adds, emits) in shapes {
        let values = ramp(rows * cols);
        let packed = quantize(GgmlType::Q4_0, &values).expect("quantize");
        let weights = weight_copies(gpu, GgmlType::Q4_0, rows, cols, &packed)?;
        let out_rows = if gated { rows / 2 } else { rows };
        let x = activation_row(cols);
        let mut q8 = ops::Q8Activations::new(gpu, cols)?;
        ops::quantize_q8(gpu, &gpu.upload(&x, "x")?, 1, cols, None, &mut q8)?;
        let residual = gpu.upload(&vec![0.25f32; out_rows], "residual")?;
        let norm = gpu.upload(&vec![1.0f32; out_rows], "norm")?;
        let mut emitted = ops::Q8Activations::new(gpu, out_rows)?;
        let mut out = gpu.alloc_zeros::<f32>(out_rows)?;
        let epilogue = ops::Epilogue { residual: adds.then_some(&residual), glu: gated.then_some(ops::Glu::SwiGlu), ..Default::default() };
        let mut line = format!("  {name:<8} {rows}x{cols}");
        for (nwarps, r, unroll, k_split) in tilings {
            let chosen = std::cell::Cell::new(None);
            let retile = |v: GemvQ8Variant| {
                let v = if nwarps == 0 { v } else { GemvQ8Variant { nwarps, rows: r, unroll, k_split, ..v } };
                chosen.set(Some(v));
                v
            };
            let result = time_graph(gpu, 60, &mut || {
                (0..60).try_for_each(|i| {
                    let emit = emits.then_some(ops::Q8Emit { dst: &mut emitted, norm: Some(ops::NormPrologue { weight: &norm, eps: 1e-5, add_one: false }) });
                    ops::linear_q8_retiled(gpu, &weights[i % weights.len()], &q8, 1, &mut out, out_rows, 0, &epilogue, emit, Some(&retile))
                })
            });
            let Some(v) = chosen.get() else { continue };
            // The launched variant: the tiling plus the epilogue's macros (bias and norm-in off).
            let info = gpu.kernel_info(&GemvQ8Variant { residual: adds, ..v }).ok().and_then(|i| i.into_iter().next()).map_or((0, 0), |i| (i.registers, i.local_bytes));
            match result {
                Ok(s) => line += &format!(" | {}{}{}{}: {:.1} us {:.0} GB/s ({}r {}B)", v.nwarps, v.rows, v.unroll, v.k_split, s * 1e6, packed.len() as f64 / s / 1e9, info.0, info.1),
                Err(_) => line += &format!(" | {}{}{}{}: -", v.nwarps, v.rows, v.unroll, v.k_split),
            }
        }
        println!("{line}");
    }
    Ok(())
}

fn inputs(gpu: &Gpu) -> Result<(), CudaError> {
    // How a one-token int8 GEMV gets its input: the producer's int8 hand-off (plain, or with
    // the norm pending), or the f32 row it quantizes itself (every block, a prologue after the
    // dependency wait, with or without a folded norm). 60 dependent launches replayed from a
    // graph, rotating over weight copies beyond the L2.
    println!("\none-token int8 GEMV inputs, graph replay: us per launch (QKV shape)");
    for (name, dtype, d, qkv) in [("SmolLM2", GgmlType::Q4_1, 576usize, 960usize), ("1B", GgmlType::Q4_0, 2048, 3072)] {
        let copies_of = |rows: usize, cols: usize| weight_copies(gpu, dtype, rows, cols, &quantize(dtype, &ramp(rows * cols)).expect("quantize"));
        let (wq, wo) = (copies_of(qkv, d)?, copies_of(d, d)?);
        let x = activation_row(d);
        let x = gpu.upload(&x, "x")?;
        let (res, g) = (gpu.upload(&vec![0.25f32; d], "residual")?, gpu.upload(&vec![1.0f32; d], "norm")?);
        let mut q8 = ops::Q8Activations::new(gpu, d)?;
        ops::quantize_q8(gpu, &x, 1, d, None, &mut q8)?;
        let mut emitted = ops::Q8Activations::new(gpu, d)?;
        let (mut y, mut h) = (gpu.alloc_zeros::<f32>(qkv)?, gpu.alloc_zeros::<f32>(d)?);
        let norm = Some(ops::NormPrologue { weight: &g, eps: 1e-5, add_one: false });
        let plain = ops::Epilogue::default();
        let with_res = ops::Epilogue { residual: Some(&res), ..Default::default() };
        let mut line = format!("  {name:<8} {dtype}");
        let mut cell = |what: &str, s: Result<f64, CudaError>| match s {
            Ok(s) => line += &format!(" | {what} {:.2}", s * 1e6),
            Err(e) => line += &format!(" | {what} error: {e}"),
        };
        cell("qkv q8 in", time_graph(gpu, 60, &mut || (0..60).try_for_each(|i| ops::linear_q8(gpu, &wq[i % wq.len()], &q8, 1, &mut y, qkv, 0, &plain, None))));
        // The hand-off with its norm pending (as from an emitting down projection).
        ops::linear_q8(gpu, &wo[0], &q8, 1, &mut h, d, 0, &with_res, Some(ops::Q8Emit { dst: &mut emitted, norm }))?;
        cell("q8+norm in", time_graph(gpu, 60, &mut || (0..60).try_for_each(|i| ops::linear_q8(gpu, &wq[i % wq.len()], &emitted, 1, &mut y, qkv, 0, &plain, None))));
        cell("f32 in", time_graph(gpu, 60, &mut || (0..60).try_for_each(|i| ops::linear_q8_f32_row(gpu, &wq[i % wq.len()], &x, None, &mut y, qkv, 0, &plain, None))));
        cell("f32+norm in", time_graph(gpu, 60, &mut || (0..60).try_for_each(|i| ops::linear_q8_f32_row(gpu, &wq[i % wq.len()], &x, norm, &mut y, qkv, 0, &plain, None))));
        println!("{line}");
    }
    Ok(())
}

/// Mean seconds per launch of `launches` dependent launches enqueued by `f`, captured once as a
/// CUDA graph and replayed (as a decode step runs).
fn time_graph(gpu: &Gpu, launches: usize, f: &mut dyn FnMut() -> Result<(), CudaError>) -> Result<f64, CudaError> {
    let stream = gpu.stream();
    f()?; // load the modules outside the capture
    stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
    let recorded = f();
    let graph = stream.end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY)?;
    recorded?;
    let graph = graph.expect("captured launches");
    let s = time(gpu, 20, || Ok(graph.launch()?))?;
    Ok(s / launches as f64)
}

fn chain(_: &Gpu) -> Result<(), CudaError> {
    // The floor of a decode step's kernel chain: 150 launches, each reading what the previous one
    // wrote, replayed from a graph, with and without programmatic dependent launch. The GEMV
    // chains hand int8 activations from one to the next as the decode GEMVs do.
    println!("
dependent launch chains (150 launches, graph replay): us per launch");
    for pdl in [true, false] {
        let gpu = Gpu::with_options(0, GpuOptions { dependent_launch: pdl, ..GpuOptions::from_env() })?;
        let gpu = &gpu;
        let mut line = format!("  pdl {}", if pdl { "on " } else { "off" });
        for n in [576usize, 132 * 1024] {
            let x = gpu.upload(&vec![0.5f32; n], "x")?;
            let mut acc = gpu.alloc_zeros::<f32>(n)?;
            let s = time_graph(gpu, 150, &mut || (0..150).try_for_each(|_| ops::add(gpu, &mut acc, &x, n)))?;
            line += &format!(" | add {n}: {:.2}", s * 1e6);
        }
        for (dtype, rows, cols) in [(GgmlType::Q4_1, 576usize, 576usize), (GgmlType::Q4_0, 2048, 2048), (GgmlType::Q4_0, 4096, 4096)] {
            let values = ramp(rows * cols);
            let w = gpu.upload_weight(dtype, rows, cols, &quantize(dtype, &values).expect("quantize"))?;
            let mut q8 = [ops::Q8Activations::new(gpu, cols)?, ops::Q8Activations::new(gpu, cols)?];
            let x = activation_row(cols);
            for q in &mut q8 {
                ops::quantize_q8(gpu, &gpu.upload(&x, "x")?, 1, cols, None, q)?;
            }
            let mut out = gpu.alloc_zeros::<f32>(rows)?;
            // The dispatcher's tiling, then blocks of 32 rows from 256 to 1 024 threads: whether
            // a kernel that fills an SM's register file (so the next one's blocks land only as
            // its own leave) raises the floor; last, the dispatcher's tiling with every other
            // launch releasing the next one before its wait (`EARLY_RELEASE`, as the decode
            // plan's projections around attention do).
            for (nwarps, r, k_split, early) in [(0, 0, 0, false), (8, 4, 1, false), (8, 4, 2, false), (8, 4, 4, false), (16, 2, 1, false), (32, 1, 1, false), (0, 0, 0, true)] {
                let s = time_graph(gpu, 150, &mut || {
                    (0..150).try_for_each(|i| {
                        let [a, b] = &mut q8;
                        let (src, dst) = if i % 2 == 0 { (&*a, b) } else { (&*b, a) };
                        let retile = |v: GemvQ8Variant| {
                            let v = GemvQ8Variant { early_release: early && i % 2 == 0, ..v };
                            if nwarps == 0 { v } else { GemvQ8Variant { nwarps, rows: r, unroll: 1, k_split, ..v } }
                        };
                        ops::linear_q8_retiled(gpu, &w, src, 1, &mut out, rows, 0, &ops::Epilogue::default(), Some(ops::Q8Emit { dst, norm: None }), Some(&retile))
                    })
                });
                let tiling = match (nwarps, early) {
                    (0, false) => "dispatched".to_string(),
                    (0, true) => "dispatched, every other early".to_string(),
                    _ => format!("{nwarps}x{r}x{k_split}"),
                };
                match s {
                    Ok(s) => line += &format!(" | gemv {dtype} {rows}x{cols} {tiling}: {:.2}", s * 1e6),
                    Err(_) => line += &format!(" | gemv {dtype} {rows}x{cols} {tiling}: -"),
                }
            }
        }
        println!("{line}");
    }
    Ok(())
}

fn layer(gpu: &Gpu) -> Result<(), CudaError> {
    // A decode layer's four linears (output projection with the residual, gate/up with SwiGLU
    // after the MLP norm, down with the residual, the next QKV after its norm) over several
    // layers' distinct weights, as separate int8 GEMVs with hand-offs (the model's unfused-MLP
    // path), replayed from a graph.
    println!("\ndecode layer linears, one token, graph replay: us per layer (GB/s of weights)");
    for (name, dtype, d, ff, qkv, layers) in
        [("SmolLM2", GgmlType::Q4_1, 576usize, 1536usize, 960usize, 30usize), ("1B", GgmlType::Q4_0, 2048, 8192, 3072, 8), ("8B", GgmlType::Q4_0, 4096, 14336, 6144, 4)]
    {
        let weight = |rows: usize, cols: usize| gpu.upload_weight(dtype, rows, cols, &quantize(dtype, &ramp(rows * cols)).expect("quantize"));
        let mut ws = Vec::new();
        for _ in 0..layers {
            ws.push([weight(d, d)?, weight(2 * ff, d)?, weight(d, ff)?, weight(qkv, d)?]);
        }
        let bytes: usize = [d * d, 2 * ff * d, d * ff, qkv * d].iter().sum::<usize>() * dtype.type_size() / dtype.block_size();
        let x = activation_row(d);
        let (x, res, g) = (gpu.upload(&x, "x")?, gpu.upload(&vec![0.25f32; d], "residual")?, gpu.upload(&vec![1.0f32; d], "norm")?);
        let (mut h1, mut m, mut h2, mut y) = (gpu.alloc_zeros::<f32>(d)?, gpu.alloc_zeros::<f32>(ff)?, gpu.alloc_zeros::<f32>(d)?, gpu.alloc_zeros::<f32>(qkv)?);
        let mut q_x = ops::Q8Activations::new(gpu, ff)?;
        ops::quantize_q8(gpu, &x, 1, d, None, &mut q_x)?;
        let (mut q_a, mut q_b) = (ops::Q8Activations::new(gpu, ff)?, ops::Q8Activations::new(gpu, ff)?);
        let norm = || Some(ops::NormPrologue { weight: &g, eps: 1e-5, add_one: false });
        let separate = time_graph(gpu, layers, &mut || {
            for w in &ws {
                ops::linear_q8(gpu, &w[0], &q_x, 1, &mut h1, d, 0, &ops::Epilogue { residual: Some(&res), ..Default::default() }, Some(ops::Q8Emit { dst: &mut q_a, norm: norm() }))?;
                ops::linear_q8(gpu, &w[1], &q_a, 1, &mut m, ff, 0, &ops::Epilogue { glu: Some(ops::Glu::SwiGlu), ..Default::default() }, Some(ops::Q8Emit { dst: &mut q_b, norm: None }))?;
                ops::linear_q8(gpu, &w[2], &q_b, 1, &mut h2, d, 0, &ops::Epilogue { residual: Some(&h1), ..Default::default() }, Some(ops::Q8Emit { dst: &mut q_a, norm: norm() }))?;
                ops::linear_q8(gpu, &w[3], &q_a, 1, &mut y, qkv, 0, &ops::Epilogue::default(), None)?;
            }
            Ok(())
        })?;
        let gbs = |s: f64| bytes as f64 / s / 1e9;
        println!("  {name:<8} {dtype} {:.1} MB/layer: {:.2} us ({:.0} GB/s)", bytes as f64 / 1e6, separate * 1e6, gbs(separate));
    }
    Ok(())
}

fn prefill(gpu: &Gpu) -> Result<(), CudaError> {
    println!("\nprefill GEMM (dequantize + cuBLAS SGEMM), Q4_1 1536x576");
    let values: Vec<f32> = (0..1536 * 576).map(|i| (i % 17) as f32 / 17.0 - 0.5).collect();
    let w = gpu.upload_weight(GgmlType::Q4_1, 1536, 576, &quantize(GgmlType::Q4_1, &values).expect("quantize"))?;
    for n in [16usize, 128, 512] {
        let x = gpu.upload(&vec![0.5f32; n * 576], "x")?;
        let mut out = gpu.alloc_zeros::<f32>(n * 1536)?;
        let s = time(gpu, 50, || ops::linear(gpu, &w, &x, n, &mut out))?;
        println!("  n={n:<4} {:>9.2} us  {:>8.1} GFLOP/s", s * 1e6, 2.0 * 1536.0 * 576.0 * n as f64 / s / 1e9);
    }
    Ok(())
}

fn batched(gpu: &Gpu) -> Result<(), CudaError> {
    // Serving-sized batches (issue #6): each shape at the batch sizes of the paths: the
    // small-batch tensor-core GEMM on the packed weights (auto, up to 64 tokens), and dequantize +
    // cuBLAS with the per-call dequantization and with a resident bf16 copy.
    println!("\nbatched linear, Q4_0 (8B QKV, output, gate/up, down and LM head): us per call, packed-weight GB/s");
    let cublas = LinearOptions { mma_max_tokens: 0, ..LinearOptions::default() };
    for dtype in [GgmlType::Q4_0, GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q6_K] {
        for info in gpu.kernel_info(&GemmMmaVariant::for_shape(dtype, 64, true))? {
            println!("  {dtype} n=64: {info:?}");
        }
    }
    for (rows, cols) in [(6144usize, 4096usize), (4096, 4096), (28672, 4096), (4096, 14336), (49152, 4096)] {
        let values = ramp(rows * cols);
        let packed = quantize(GgmlType::Q4_0, &values).expect("quantize");
        let mut w = gpu.upload_weight(GgmlType::Q4_0, rows, cols, &packed)?;
        for (path, opts) in [("auto", LinearOptions::default()), ("cublas", cublas), ("cublas resident", cublas)] {
            if path == "cublas resident" {
                ops::expand_weight(gpu, &mut w, ops::Precision::BF16)?;
            }
            for n in [8usize, 9, 16, 32, 48, 64, 512] {
                let x = gpu.upload(&vec![0.5f32; n * cols], "x")?;
                let mut out = gpu.alloc_zeros::<f32>(n * rows)?;
                let mut plan = None;
                let s = time(gpu, 20, || ops::linear_with(gpu, &w, &x, n, &mut out, &opts).map(|p| plan = Some(p)))?;
                let gbs = packed.len() as f64 / s / 1e9;
                println!("  {rows}x{cols} n={n:<4} {path:<15} {:>9.2} us {gbs:>8.1} GB/s  {plan:?}", s * 1e6);
            }
        }
    }
    Ok(())
}

fn tilings(gpu: &Gpu) -> Result<(), CudaError> {
    // Tilings of the small-batch GEMM (m-tiles per warp, weight chunks in flight, activation
    // stages) on the 8B QKV, gate/up and down shapes; the first line of each shape is the default.
    println!("\nsmall-batch GEMM tilings, Q4_0: us per call ([wg: wgmma k-steps per group, s: weight stages] nt mt warpgroups depth stages o blocks per SM: registers, spilled bytes)");
    for (rows, cols) in [(6144usize, 4096usize), (28672, 4096), (4096, 14336)] {
        let values = ramp(rows * cols);
        let w = gpu.upload_weight(GgmlType::Q4_0, rows, cols, &quantize(GgmlType::Q4_0, &values).expect("quantize"))?;
        for n in [16usize, 32, 64] {
            let x = gpu.upload(&vec![0.5f32; n * cols], "x")?;
            let mut out = gpu.alloc_zeros::<f32>(n * rows)?;
            let base = GemmMmaVariant::for_shape(GgmlType::Q4_0, n, true);
            let mut line = format!("  {rows}x{cols} n={n:<3}");
            // (n-tiles, m-tiles, warpgroups, depth, stages, blocks per SM); narrower n-tiles than
            // the batch mean several token blocks per row block.
            // (.., wgmma k-steps per group, 0: mma.sync): warpgroup MMAs need 3 stages and an
            // sm_90 device.
            let wgmma = gpu.supports_wgmma();
            let wg = GemmMmaVariant::for_wgmma(GgmlType::Q4_0, n, true);
            // (.., weight stages in shared memory, 0: weights through registers)
            let tilings = [
                (base.nt, base.mt, base.warpgroups, base.depth, base.stages, base.occupancy, base.wgmma, base.weight_stages),
                (wg.nt, wg.mt, wg.warpgroups, wg.depth, wg.stages, wg.occupancy, wg.wgmma, wg.weight_stages),
                (2, 2, 1, 2, 2, 4, 0, 0),
                (4, 1, 1, 2, 2, 4, 0, 0),
                (8, 2, 1, 2, 2, 2, 0, 0),
                (4, 1, 1, 2, 4, 4, 4, 0),
                (8, 2, 1, 2, 3, 2, 4, 0),
                (8, 2, 1, 1, 3, 2, 4, 4),
                (8, 2, 1, 1, 3, 2, 2, 4),
                (8, 1, 1, 1, 3, 3, 4, 4),
                (8, 1, 2, 1, 3, 2, 4, 4),
                (8, 1, 2, 1, 3, 2, 2, 4),
                (8, 1, 2, 1, 4, 2, 4, 4),
                (8, 1, 2, 1, 3, 2, 4, 2),
                (8, 1, 2, 2, 3, 2, 4, 0),
                (4, 1, 2, 1, 3, 3, 4, 4),
            ];
            for (nt, mt, warpgroups, depth, stages, occupancy, wg, ws) in tilings {
                if nt as usize * 8 > n.next_power_of_two().max(16) || (wg > 0 && !wgmma) {
                    continue;
                }
                let v = GemmMmaVariant { nt, mt, warpgroups, depth, stages, occupancy, wgmma: wg, weight_stages: ws, ..base };
                let info = gpu.kernel_info(&v)?.into_iter().find(|i| i.name == "gemm_mma");
                let s = time(gpu, 20, || ops::linear_mma(gpu, &w, &x, n, &mut out, v))?;
                let (regs, local) = info.map_or((0, 0), |i| (i.registers, i.local_bytes));
                let kind = match (wg, ws) {
                    (0, _) => String::new(),
                    (_, 0) => format!("wg{wg}:"),
                    _ => format!("wg{wg}s{ws}:"),
                };
                line += &format!(" | {kind}{nt}{mt}{warpgroups}{depth}{stages}o{occupancy}: {:.1} ({regs}r {local}B)", s * 1e6);
            }
            println!("{line}");
        }
    }
    Ok(())
}

fn mma64(gpu: &Gpu) -> Result<(), CudaError> {
    // Two launches (warm-up, then one to profile) of each small-batch GEMM kernel kind on the 8B
    // gate/up shape at 64 tokens: mma.sync and the dispatcher's warpgroup-MMA tiling. For Nsight
    // Compute: `ncu -k regex:gemm_mma --launch-skip 1 --launch-count 3 kernel_bench mma64`
    // profiles the second launch of each.
    let (rows, cols, n) = (28672usize, 4096usize, 64usize);
    let values = ramp(rows * cols);
    let w = gpu.upload_weight(GgmlType::Q4_0, rows, cols, &quantize(GgmlType::Q4_0, &values).expect("quantize"))?;
    let x = gpu.upload(&vec![0.5f32; n * cols], "x")?;
    let mut out = gpu.alloc_zeros::<f32>(n * rows)?;
    let base = GemmMmaVariant::for_shape(GgmlType::Q4_0, n, true);
    for v in [base, GemmMmaVariant::for_wgmma(GgmlType::Q4_0, n, true)] {
        for _ in 0..2 {
            ops::linear_mma(gpu, &w, &x, n, &mut out, v)?;
        }
        gpu.synchronize()?;
        println!("{v:?}: launched twice");
    }
    Ok(())
}

fn glu(gpu: &Gpu) -> Result<(), CudaError> {
    // A fused gate/up weight of the 8B shape (2 x 14336 rows) at 33-64 tokens, RMSNorm folded:
    // the warpgroup-MMA GEMM writing both halves, then the SwiGLU kernel, against the GEMM with
    // the SwiGLU in its epilogue.
    println!("\ngate/up + SwiGLU, 8B shape (28672 x 4096, Q4_0), norm folded, us per call");
    let (rows, cols) = (28672usize, 4096usize);
    let w = gpu.upload_weight(GgmlType::Q4_0, rows, cols, &quantize(GgmlType::Q4_0, &ramp(rows * cols)).expect("quantize"))?;
    let g = gpu.upload(&vec![1f32; cols], "norm")?;
    let opts = ops::LinearOptions::default();
    for n in [33usize, 48, 64] {
        let x = gpu.upload(&vec![0.5f32; n * cols], "x")?;
        let mut both = gpu.alloc_zeros::<f32>(n * rows)?;
        let mut out = gpu.alloc_zeros::<f32>(n * rows / 2)?;
        let mut normed = gpu.alloc_zeros::<f32>(n * cols)?;
        let norm = Some(ops::NormPrologue { weight: &g, eps: 1e-5, add_one: false });
        let plain = ops::LinearFusion { norm, residual: None, glu: None };
        let fused = ops::LinearFusion { glu: Some(ops::Glu::SwiGlu), ..plain };
        let apart = time_graph(gpu, 1, &mut || {
            ops::linear_fused(gpu, &w, &x, &plain, n, &mut both, &mut normed, &opts)?;
            ops::glu_rows(gpu, &both, n, rows / 2, ops::Glu::SwiGlu, &mut out)
        })?;
        let one = time_graph(gpu, 1, &mut || ops::linear_fused(gpu, &w, &x, &fused, n, &mut out, &mut normed, &opts).map(|_| ()))?;
        println!("  n={n:<3} GEMM + swiglu {:>7.1} | GLU epilogue {:>7.1}", apart * 1e6, one * 1e6);
    }
    Ok(())
}

fn attention(gpu: &Gpu) -> Result<(), CudaError> {
    println!("\ndecode attention, 9 heads / 3 KV heads, head_dim 64, f16 cache");
    let mut cache = KvCache::new(gpu, KvDtype::F16, 8192, 3, 64)?;
    let qkv = gpu.upload(&vec![0.1f32; 8192 * 960], "qkv")?;
    let all: Vec<u32> = (0..8192).collect();
    let mut q_all = gpu.alloc_zeros::<f32>(8192 * 576)?;
    ops::store_qkv(gpu, &mut cache, &qkv, 960, 8192, 9, &gpu.upload(&all, "positions")?, None, None, &mut q_all)?;
    let q = gpu.upload(&vec![0.1f32; 576], "q")?;
    let mut out = gpu.alloc_zeros::<f32>(576)?;
    let cfg = AttentionConfig { n_heads: 9, scale: 0.125, window: None, softcap: None };
    for pos in [127u32, 1023, 8191] {
        let p = gpu.upload(&[pos], "pos")?;
        let s = time(gpu, 200, || ops::attention(gpu, &q, &cache, &p, 1, &cfg, &mut out, None))?;
        let splits = ops::attention_splits(gpu.sm_count() as usize, 9, 1, 8192);
        let mut scratch = ops::SplitScratch::new(gpu, 9, splits, 64)?;
        let split = time(gpu, 200, || ops::attention_split(gpu, &q, &cache, &p, 1, &cfg, splits, &mut scratch, &mut out, None))?;
        println!("  kv_len={:<5} {:>9.2} us, split in {splits}: {:>9.2} us", pos + 1, s * 1e6, split * 1e6);
    }
    // The decode step's kernel: K/V store, RoPE and attention in one launch, at the positions
    // of a short generation (SmolLM2 / 1B heads of 64, 8B heads of 128).
    let max_seq = 4096;
    for (n_heads, n_kv, head_dim) in [(9usize, 3usize, 64usize), (32, 8, 128)] {
        let layouts = ops::DecodeLayouts::new(gpu, n_heads, n_kv, head_dim, max_seq, true);
        println!("\nfused decode attention (store + RoPE + attend), {n_heads} heads / {n_kv} KV heads of {head_dim}, f16 cache, {layouts:?}");
        let mut cache = KvCache::new(gpu, KvDtype::F16, max_seq, n_kv, head_dim)?;
        let row = (n_heads + 2 * n_kv) * head_dim;
        let qkv = gpu.upload(&vec![0.1f32; row], "qkv")?;
        let mut out = gpu.alloc_zeros::<f32>(n_heads * head_dim)?;
        let cfg = AttentionConfig { n_heads, scale: 1.0 / (head_dim as f32).sqrt(), window: None, softcap: None };
        let rope = ops::RopeConfig { n_heads, head_dim, rot_dim: head_dim, theta: 500_000.0, freq_scale: 1.0, neox: true };
        let mut scratch = ops::SplitScratch::new(gpu, n_heads, layouts.short.splits.max(layouts.long.splits), head_dim)?;
        for pos in [0u32, 31, 127, 511, 1023, 2047, max_seq as u32 - 1] {
            let p = gpu.upload(&[pos], "pos")?;
            // The layout the executor would take at this position, and (one head per block) the
            // launch with other warps per block (FERRITE_CUDA_ATTENTION_WARPS), no more shares
            // than hold a batch of 32 keys per warp.
            let layout = layouts.layout(layouts.stage(pos as usize + 1));
            let one = ops::DecodeLayout::one_block(layout.group);
            let s = time(gpu, 200, || ops::store_and_attend(gpu, &mut cache, &qkv, &p, &cfg, Some(&rope), None, one, None, &mut out, None))?;
            let mut line = format!("  kv_len={:<5} {} heads per block {:>8.2} us", pos + 1, layout.group, s * 1e6);
            for warps in [4, 8, 16].into_iter().filter(|&w| layout.group == 1 || w == 4) {
                let l = ops::DecodeLayout { warps, splits: layout.splits.min((max_seq / (32 * warps)).max(1)), ..layout };
                let split = time(gpu, 200, || ops::store_and_attend(gpu, &mut cache, &qkv, &p, &cfg, Some(&rope), None, l, Some(&mut scratch), &mut out, None))?;
                line += &format!(" | {warps} warps, up to {} shares: {:.2} us", l.splits, split * 1e6);
            }
            // Wide blocks as a cluster of shares per head (FERRITE_CUDA_ATTENTION_WIDE_CLUSTER).
            for blocks in [2, 4, 8].into_iter().filter(|_| layout.group == 1 && gpu.supports_clusters()) {
                let l = ops::DecodeLayout { splits: blocks, cluster: true, ..layouts.wide };
                let t = time(gpu, 200, || ops::store_and_attend(gpu, &mut cache, &qkv, &p, &cfg, Some(&rope), None, l, None, &mut out, None))?;
                line += &format!(" | cluster of {blocks} x {} warps: {:.2} us", l.warps, t * 1e6);
            }
            println!("{line}");
        }
    }
    // A batched decode step on the paged cache (serve, `bench --seqs`): one query per sequence,
    // 8B heads, blocks of 16 positions, each sequence's blocks scattered over the cache.
    println!("\npaged decode attention (store_qkv_paged + attention_paged), 32 heads / 8 KV heads of 128, f16 cache, blocks of 16");
    let (n_heads, n_kv, head_dim, block) = (32usize, 8usize, 128usize, 16usize);
    for (seqs, len) in [(16usize, 64usize), (64, 64), (64, 512)] {
        let max_blocks = len.div_ceil(block);
        let mut cache = KvCache::new(gpu, KvDtype::F16, seqs * max_blocks * block, n_kv, head_dim)?;
        // Sequence s owns blocks s, s + seqs, s + 2 seqs, ...: neighbours in a table are far apart.
        let tables: Vec<u32> = (0..seqs).flat_map(|s| (0..max_blocks).map(move |b| (b * seqs + s) as u32)).collect();
        let row = (n_heads + 2 * n_kv) * head_dim;
        let qkv = gpu.upload(&vec![0.1f32; seqs * row], "qkv")?;
        let (tables, row_seq) = (gpu.upload(&tables, "tables")?, gpu.upload(&(0..seqs as u32).collect::<Vec<_>>(), "row_seq")?);
        let paging = ops::Paging { tables: &tables, row_seq: &row_seq, n_seqs: seqs, max_blocks, block_size: block };
        let positions = gpu.upload(&vec![len as u32 - 1; seqs], "positions")?;
        let mut q = gpu.alloc_zeros::<f32>(seqs * n_heads * head_dim)?;
        let mut out = gpu.alloc_zeros::<f32>(seqs * n_heads * head_dim)?;
        let cfg = AttentionConfig { n_heads, scale: 1.0 / (head_dim as f32).sqrt(), window: None, softcap: None };
        let rope = ops::RopeConfig { n_heads, head_dim, rot_dim: head_dim, theta: 500_000.0, freq_scale: 1.0, neox: true };
        let store = time(gpu, 200, || ops::store_qkv_paged(gpu, &mut cache, &qkv, row, seqs, n_heads, &positions, Some(&rope), None, &paging, &mut q))?;
        let attend = time(gpu, 200, || ops::attention_paged(gpu, &q, &cache, &positions, seqs, &cfg, &paging, &mut out, None))?;
        // K and V rows as each query head's block reads them (a group's heads share them via L2).
        let gbs = (seqs * n_heads * len * head_dim * 2 * 2) as f64 / attend / 1e9;
        println!("  {seqs:>3} seqs x {len:<4} keys: store {:>7.2} us, attention {:>7.2} us ({gbs:.0} GB/s of K/V rows per query head)", store * 1e6, attend * 1e6);
    }
    Ok(())
}

fn gdn(gpu: &Gpu) -> Result<(), CudaError> {
    println!("\nGated DeltaNet (conv + delta rule, recurrent / chunked), Qwen3.5-9B layer: 16 key / 32 value heads of 128");
    let shape = GdnShape { n_k_heads: 16, n_v_heads: 32, k_dim: 128, v_dim: 128, conv_kernel: 4, v_order: ValueHeadOrder::Tiled };
    for info in gpu.kernel_info(&GdnDeltaVariant::for_shape(128, 128).expect("Qwen3.5 heads"))? {
        println!("  {info:?}");
    }
    for info in gpu.kernel_info(&GdnChunkVariant::for_shape(128, 128).expect("Qwen3.5 heads"))? {
        println!("  {info:?}");
    }
    let vector = |n: usize, v: f32| gpu.upload(&vec![v; n], "gdn weights");
    let (conv, a_coef, dt_bias, norm) = (vector(shape.conv_width() * 4, 0.3)?, vector(32, -2.0)?, vector(32, 0.5)?, vector(128, 1.0)?);
    let w = GdnWeights { conv: &conv, a_coef: &a_coef, dt_bias: &dt_bias, norm: &norm, eps: 1e-6 };
    let mut state = GdnState::new(gpu, shape)?;
    for (path, lengths) in [(GdnPath::Recurrent, &[1usize, 16, 128, 512][..]), (GdnPath::Chunked, &[16, 64, 128, 512, 2048][..])] {
        for &n in lengths {
            let x = gpu.upload(&ramp(n * shape.proj_width()), "x")?;
            let mut scratch = gpu.alloc_zeros::<f32>(ops::gdn_scratch_len(&shape, n, path))?;
            let mut out = gpu.alloc_zeros::<f32>(n * shape.value_width())?;
            let s = time(gpu, 50, || ops::gated_delta_net_with(gpu, path, &x, n, &w, &mut state, &mut scratch, &mut out))?;
            // The delta-rule state is read and written once per launch.
            let state_gbs = 2.0 * shape.ssm_state_len() as f64 * 4.0 / s / 1e9;
            println!("  {path:?} n={n:<4} {:>9.2} us  {:>7.2} us/token  state {state_gbs:>6.1} GB/s", s * 1e6, s * 1e6 / n as f64);
        }
    }
    Ok(())
}

fn moe(gpu: &Gpu) -> Result<(), CudaError> {
    println!("\nMoE FFN (router, routing, experts, shared expert, combine), Qwen3.5-35B-A3B layer: 256 experts of 512, top 8, width 2048, Q4_0");
    let (d, e, k, ff) = (2048usize, 256usize, 8usize, 512usize);
    // Q4_0 blocks made directly (scale 2^-7, varied nibbles): the values do not matter here.
    let q4_0 = |rows: usize, cols: usize| -> Result<ferrite_cuda::DeviceWeight, CudaError> {
        let blocks = rows * cols / 32;
        let mut bytes = vec![0u8; blocks * 18];
        for (i, b) in bytes.chunks_exact_mut(18).enumerate() {
            b[..2].copy_from_slice(&0x2000u16.to_le_bytes());
            for (j, q) in b[2..].iter_mut().enumerate() {
                *q = ((i * 31 + j * 17) % 251) as u8;
            }
        }
        gpu.upload_weight(GgmlType::Q4_0, rows, cols, &bytes)
    };
    let router_values: Vec<f32> = (0..e * d).map(|i| ((i * 7919) % 2001) as f32 / 20000.0 - 0.05).collect();
    let router = gpu.upload_weight(GgmlType::F32, e, d, &router_values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>())?;
    let (gate, up, down) = (q4_0(e * ff, d)?, q4_0(e * ff, d)?, q4_0(e * d, ff)?);
    let (sgate, sup, sdown) = (q4_0(ff, d)?, q4_0(ff, d)?, q4_0(d, ff)?);
    let gate_inp = gpu.upload(&vec![0.01f32; d], "gate_inp")?;
    let weights = ops::MoeWeights {
        router: &router,
        gate_up: ops::ExpertGateUp::Split { gate: &gate, up: &up },
        down: &down,
        shared: Some(ops::SharedExpert { gate: &sgate, up: &sup, down: &sdown, gate_inp: &gate_inp }),
        top_k: k,
        norm_topk_prob: true,
    };
    let dims = weights.check()?;
    let mut scratch = ops::MoeScratch::new(gpu, dims, 256)?;
    // Bytes one token reads: its k experts' gate, up and down rows, the shared expert, the router.
    let per_token = (3 * k * ff * d + 3 * ff * d) as f64 * 18.0 / 32.0 + (e * d * 4) as f64;
    // The routed experts pair by pair (auto's path) and grouped by expert (opt-in while it is
    // slower), at decode and prefill sizes.
    let opts = gpu.linear_options();
    for n in [1usize, 8, 16, 64, 256] {
        let x = gpu.upload(&ramp(n * d), "x")?;
        let mut out = gpu.alloc_zeros::<f32>(n * d)?;
        for path in [MoePath::Pairs, MoePath::Grouped] {
            let s = time(gpu, 50, || ops::moe_ffn_with(gpu, Some(path), &weights, &x, n, None, &mut scratch, &mut out, &opts).map(|_| ()))?;
            println!(
                "  n={n:<4} {:<8} {:>9.2} us  {:>7.2} us/token  {:>7.1} GB/s of routed + shared weights per token",
                format!("{path:?}"),
                s * 1e6,
                s * 1e6 / n as f64,
                per_token * n as f64 / s / 1e9
            );
        }
        // The grouping launch alone, on this batch's routing.
        let pairs = n * k;
        let mut groups = ops::MoeGroups::new(gpu, pairs, e)?;
        let ids = scratch.routing().0;
        let s = time(gpu, 50, || ops::moe_group(gpu, ids, pairs, e, &mut groups).map(|_| ()))?;
        let distinct = {
            let mut seen = gpu.download(ids)?[..pairs].to_vec();
            seen.sort_unstable();
            seen.dedup();
            seen.len()
        };
        println!("  n={n:<4} moe_group {:>9.2} us  ({pairs} pairs on {distinct} experts)", s * 1e6);
    }
    Ok(())
}

fn sampling(gpu: &Gpu) -> Result<(), CudaError> {
    let spread = |n: u64| -> Vec<f32> { (0..n).map(|i| ((i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) % 16001) as f32 / 1000.0 - 8.0).collect() };
    let greedy = SamplingConfig { temperature: 0.0, top_k: 40, top_p: 0.95, min_p: 0.05, seed: 1 };
    let cfg = SamplingConfig { temperature: 0.8, ..greedy };
    let mut token = gpu.alloc_zeros::<u32>(1)?;
    // SmolLM2's vocabulary, Llama 3's (whose 126 chunks keep more top-k candidates), Gemma 3's
    // (256 chunks: more blocks than SMs).
    for vocab in [49152usize, 128256, 262144] {
        println!("\nsampling over {vocab} logits (spread like a model's: a hash of the index, -8..8)");
        let logits = gpu.upload(&spread(vocab as u64), "logits")?;
        let mut scratch = ops::SampleScratch::new(gpu, vocab)?;
        let s = time(gpu, 200, || ops::argmax(gpu, &logits, vocab, &mut token))?;
        println!("  argmax (one block) {:>9.2} us", s * 1e6);
        for (name, cfg) in [("greedy", greedy), ("top-k 40/top-p/min-p", cfg), ("top-k off, top-p 0.95", SamplingConfig { top_k: 0, ..cfg }), ("top-k off, top-p 0.95 alone", SamplingConfig { top_k: 0, min_p: 0.0, ..cfg }), ("top-k off, min-p alone", SamplingConfig { top_k: 0, top_p: 1.0, ..cfg }), ("top-k off, top-p off", SamplingConfig { top_k: 0, top_p: 1.0, min_p: 0.0, ..cfg })] {
            let one = time(gpu, 200, || ops::sample(gpu, &logits, vocab, &cfg, 0, None, &mut token))?;
            let two = time(gpu, 200, || ops::sample_delivering(gpu, &logits, vocab, &cfg, 0, None, &mut token, None, Some(&mut scratch)))?;
            println!("  {name:<27} one block {:>8.2} us | by chunks (candidates, or a block each) {:>8.2} us", one * 1e6, two * 1e6);
        }
    }
    let host_logits = spread(49152);
    let logits = gpu.upload(&host_logits, "logits")?;
    let mut scratch = ops::SampleScratch::new(gpu, 49152)?;
    // A batched step's sampled sequences (64 rows of these logits): a launch per row, or one
    // launch drawing them all side by side (`sample_rows`).
    let rows = 64;
    let many = gpu.upload(&(0..rows).flat_map(|_| host_logits.iter().copied()).collect::<Vec<_>>(), "logits rows")?;
    let mut outs = gpu.alloc_zeros::<u32>(rows)?;
    let mut row_scratch = ops::SampleScratch::for_draws(gpu, 49152, rows)?;
    let mut words = gpu.alloc_zeros::<u32>(rows * ops::ROW_DRAW_WORDS)?;
    let mut ring = ferrite_cuda::StagingRing::new(gpu, 4, rows * ops::ROW_DRAW_WORDS)?;
    for (name, cfg) in [("top-k 40/top-p/min-p", cfg), ("top-k off, top-p 0.95", SamplingConfig { top_k: 0, ..cfg }), ("top-k off, top-p off", SamplingConfig { top_k: 0, top_p: 1.0, min_p: 0.0, ..cfg })] {
        let each = time(gpu, 20, || {
            for r in 0..rows {
                let row = many.slice(r * 49152..(r + 1) * 49152);
                ops::sample_delivering(gpu, &row, 49152, &cfg, 0, None, &mut outs.slice_mut(r..r + 1), None, Some(&mut scratch))?;
            }
            Ok(())
        })?;
        let draws: Vec<ops::RowSample> = (0..rows).map(|row| ops::RowSample { row, cfg, step: row as u64 }).collect();
        let one = time(gpu, 20, || ops::sample_rows(gpu, &mut ring, &mut words, &many, 49152, rows, &draws, &mut outs, Some(&mut row_scratch)))?;
        println!("  {rows} rows, {name:<24} a launch each {:>8.1} us | one launch {:>8.1} us", each * 1e6, one * 1e6);
    }
    // What a decode loop's draw adds: the next step's inputs and the host's mailbox (a
    // device-mapped page-locked slot written through the system, tag last).
    let mailbox = ferrite_cuda::Mailbox::new(gpu, 3)?;
    let (mut ids, mut positions) = (gpu.alloc_zeros::<u32>(1)?, gpu.alloc_zeros::<u32>(1)?);
    let mut tag = 0;
    let tagged = time(gpu, 200, || {
        tag += 1;
        let mail = ops::Mail::Tagged { mailbox: &mailbox, slot: 0, tag, next_pos: 7 };
        let delivery = ops::TokenDelivery { next_step: Some((&mut ids, &mut positions)), mail };
        ops::sample_delivering(gpu, &logits, 49152, &greedy, 0, None, &mut token, Some(delivery), Some(&mut scratch))
    })?;
    let advancing = time(gpu, 200, || {
        let delivery = ops::TokenDelivery { next_step: Some((&mut ids, &mut positions)), mail: ops::Mail::Advancing { mailbox: &mailbox, pair: 1 } };
        ops::sample_delivering(gpu, &logits, 49152, &greedy, 0, None, &mut token, Some(delivery), Some(&mut scratch))
    })?;
    println!("  greedy delivered to the next step and the mailbox: tagged {:>8.2} us | advancing {:>8.2} us", tagged * 1e6, advancing * 1e6);
    Ok(())
}
