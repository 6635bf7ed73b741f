use ferrite_cpu::kernels::attention::{attention_paged, AttentionParams, PagedKv, PagedSeq};
use std::time::Instant;
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let keys: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(256);
    let pool_blocks: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(4096);
    let (nh, nkv, hd, bs, nseq) = (9, 3, 64, 16, 8);
    let kvw = nkv * hd;
    let k: Vec<f32> = (0..pool_blocks * bs * kvw).map(|i| (i % 97) as f32 * 0.01).collect();
    let v = k.clone();
    let per = keys.div_ceil(bs);
    // sequences' blocks spread over the pool
    let tables: Vec<Vec<u32>> = (0..nseq).map(|s| (0..per).map(|b| ((s * per + b) * 37 % pool_blocks) as u32).collect()).collect();
    let seqs: Vec<PagedSeq> = tables.iter().map(|t| PagedSeq { blocks: t, start_pos: keys - 1, n_tokens: 1 }).collect();
    let q = vec![0.1f32; nseq * nh * hd];
    let mut out = vec![0f32; nseq * nh * hd];
    let p = AttentionParams::new(nh, nkv, hd);
    let kv = PagedKv { k: &k, v: &v, block_size: bs };
    // 30 layers: rotate over 30 disjoint pools would be better; use the same (cache-warm) and a "cold" variant
    for _ in 0..10 { attention_paged(&p, &q, &kv, &seqs, &mut out); }
    let t = Instant::now();
    let n = 300;
    for _ in 0..n { attention_paged(&p, &q, &kv, &seqs, &mut out); }
    let per_call = t.elapsed().as_secs_f64() / n as f64;
    println!("keys {keys} pool {} MB: {:.1} us per call (8 seqs x 9 heads), x30 layers = {:.2} ms", k.len() * 8 >> 20, per_call * 1e6, per_call * 30e3);
}
