// TEMPORARY (to be deleted)
use ferrite_cpu::kernels::attention::{attention, AttentionParams};
fn main() {
    let a: Vec<String> = std::env::args().collect();
    let start: usize = a[1].parse().unwrap();
    let n: usize = a[2].parse().unwrap();
    let iters: usize = a[3].parse().unwrap();
    let p = AttentionParams::new(9, 3, 64);
    let kv = start + n;
    let q: Vec<f32> = (0..n * 576).map(|i| (i % 17) as f32 * 0.01).collect();
    let k: Vec<f32> = (0..kv * 192).map(|i| (i % 13) as f32 * 0.01).collect();
    let v = k.clone();
    let mut out = vec![0f32; n * 576];
    rayon::scope(|_| {
        let t = std::time::Instant::now();
        for _ in 0..iters { attention(&p, &q, &k, &v, start, n, &mut out); }
        eprintln!("{:.1} us per call", t.elapsed().as_secs_f64() * 1e6 / iters as f64);
    });
}
