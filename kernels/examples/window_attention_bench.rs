//! Times `causal_window_attention` against the decode kernel over the same windows (one query
//! per token), as the calibration forwards call them: `cargo run --release -p deco-kernels
//! --example window_attention_bench -- [windows] [len] [heads] [kv_heads] [head_dim]`.

use deco_kernels::attention::{AttnShape, SeqKv, paged_decode_attention};
use deco_kernels::window_attention::causal_window_attention;
use std::time::Instant;

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).map(|a| a.parse().expect("a number")).collect();
    let get = |i: usize, d: usize| args.get(i).copied().unwrap_or(d);
    let (windows, len, heads, kvh, d) = (get(0, 128), get(1, 256), get(2, 9), get(3, 3), get(4, 64));
    let shape = AttnShape { n_heads: heads, kv_heads: kvh, head_dim: d };
    let n = windows * len;
    let fill = |len: usize, seed: u32| -> Vec<f32> { (0..len).map(|i| ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) as f32 / (1u32 << 24) as f32 - 0.5).collect() };
    let (q, k, v) = (fill(n * heads * d, 1), fill(n * kvh * d, 2), fill(n * kvh * d, 3));
    let spans: Vec<(usize, usize)> = (0..windows).map(|w| (w * len, len)).collect();
    let mut out = vec![0.0f32; n * heads * d];
    // Causal FLOPs: Q·K and P·V, 2 · 2 · d per (query head, key) pair.
    let flop = (windows * len * (len + 1) / 2 * heads * d * 4) as f64;
    let pool = rayon::ThreadPoolBuilder::new().build().expect("pool");
    pool.install(|| {
        for _ in 0..3 {
            let t = Instant::now();
            causal_window_attention(&q, &k, &v, shape, &spans, &mut out).expect("window");
            let tw = t.elapsed().as_secs_f64();
            let table = [0u32];
            let kvrow = kvh * d;
            let mut views = Vec::with_capacity(n);
            for &(s, l) in &spans {
                let (kw, vw) = (&k[s * kvrow..(s + l) * kvrow], &v[s * kvrow..(s + l) * kvrow]);
                views.extend((1..=l).map(|p| SeqKv { k: kw, v: vw, block_table: &table, block_size: l, len: p }));
            }
            let t = Instant::now();
            paged_decode_attention(&q, shape, &views, &mut out).expect("decode");
            let td = t.elapsed().as_secs_f64();
            println!("window {:.1} ms ({:.1} GFLOP/s)   decode kernel {:.1} ms ({:.1} GFLOP/s)   ratio {:.2}x", tw * 1e3, flop / tw / 1e9, td * 1e3, flop / td / 1e9, td / tw);
        }
    });
}
