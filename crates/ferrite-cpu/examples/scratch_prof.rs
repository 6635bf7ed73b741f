// TEMPORARY profiling harness (to be deleted).
use ferrite_cpu::kernels::simd::SimdLevel;
use ferrite_cpu::kernels::{matmul_with, WeightView};
use ferrite_gguf::GgmlType;
fn main() {
    let a: Vec<String> = std::env::args().collect();
    let dtype = GgmlType::from_name(&a[1]).unwrap();
    let rows: usize = a[2].parse().unwrap();
    let cols: usize = a[3].parse().unwrap();
    let nt: usize = a[4].parse().unwrap();
    let level = match a[5].as_str() { "s" => SimdLevel::Scalar, "2" => SimdLevel::Avx2, _ => SimdLevel::Avx512Vnni };
    let iters: usize = a[6].parse().unwrap();
    let threads: usize = a[7].parse().unwrap();
    let copies: usize = a.get(8).map_or(1, |s| s.parse().unwrap());
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
    let floats: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.05).collect();
    let one = ferrite_gguf::quantize(dtype, &floats).unwrap();
    let datas: Vec<Vec<u8>> = (0..copies).map(|_| one.clone()).collect();
    let x: Vec<f32> = (0..nt * cols).map(|i| ((i * 31 % 1000) as f32 / 500.0 - 1.0)).collect();
    let mut out = vec![0f32; nt * rows];
    let oncpu = || std::fs::read_to_string("/proc/thread-self/schedstat").unwrap().split_whitespace().next().unwrap().parse::<u64>().unwrap();
    let (el, cpu) = pool.install(|| {
    let c0 = oncpu();
    let t = std::time::Instant::now();
    for i in 0..iters {
        let data = &datas[i % copies];
        matmul_with(level, &WeightView { dtype, rows, cols, data }, &x, nt, &mut out).unwrap();
    }
    (t.elapsed(), oncpu() - c0) });
    eprintln!("on-cpu (this thread): {:.2} us/iter", cpu as f64 / 1e3 / iters as f64);
    eprintln!("{:.2} us/iter, {:.2} GB/s", el.as_secs_f64() * 1e6 / iters as f64, (one.len() * iters) as f64 / el.as_secs_f64() / 1e9);
}
