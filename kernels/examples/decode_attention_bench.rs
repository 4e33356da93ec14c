//! One layer of decode attention for a batch of sequences, SmolLM2-135M shapes (9 query heads,
//! 3 kv heads, head_dim 64), paged storage with block size 16: the fused kernel
//! (`paged_decode_attention`) against the previous path (per sequence: gather the blocks into a
//! contiguous tensor, `causal_gqa_attention`, then one concatenation).
//!
//! ```text
//! cargo run --release -p deco-kernels --example decode_attention_bench -- [CONTEXT] [BATCHES]
//! cargo run --release -p deco-kernels --example decode_attention_bench -- stream [CONTEXT] [LAYERS] [BATCH] [f32|f16]
//! ```
//!
//! `stream` times the fused kernel alone as a decode step meets it: `LAYERS` (default 30)
//! layers of `BATCH` (default 1) sequences, each layer with its own cache, run back to back on
//! the spinning team (`team::with_team`), after a 256 MiB sweep that evicts them from the
//! caches (in a real step the weights pass through L3 between two visits of a layer's keys and
//! values), with an f32 (default) or f16 cache. For scale it also times one thread reading the
//! same arrays (an xor of every byte).

use std::time::Instant;

use burn::tensor::{Device, Tensor, TensorData};
use deco_kernels::attention::{AttnShape, KvElement, SeqKv, paged_decode_attention};
use half::f16;
use deco_kernels::ops::causal_gqa_attention;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Values in `[-0.5, 0.5)` from a 32-bit xorshift seeded with `seed` (non-zero).
fn xorshift(seed: u32) -> impl FnMut() -> f32 {
    let mut x = seed;
    move || {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        (x as f32 / u32::MAX as f32) - 0.5
    }
}

/// The `stream` mode (see the module docs): µs per layer, median of 15 steps.
fn stream<E: KvElement>(context: usize, layers: usize, batch: usize, from_f32: fn(f32) -> E) {
    let shape = AttnShape { n_heads: 9, kv_heads: 3, head_dim: 64 };
    let (bs, row) = (16usize, 3 * 64);
    let per_seq = context.div_ceil(bs);
    let nb = batch * per_seq;
    let mut rnd = xorshift(7);
    let kv: Vec<(Vec<E>, Vec<E>)> = (0..layers)
        .map(|_| ((0..nb * bs * row).map(|_| from_f32(rnd())).collect(), (0..nb * bs * row).map(|_| from_f32(rnd())).collect()))
        .collect();
    // SAFETY: f32 and f16 are plain bytes.
    let bytes_of = |x: &[E]| unsafe { std::slice::from_raw_parts(x.as_ptr() as *const u8, std::mem::size_of_val(x)) };
    // Interleaved block tables (sequence s owns blocks s, s + batch, ...).
    let tables: Vec<Vec<u32>> = (0..batch).map(|s| (0..per_seq).map(|i| (i * batch + s) as u32).collect()).collect();
    let q: Vec<f32> = (0..batch * 9 * 64).map(|_| rnd()).collect();
    let mut out = vec![0.0f32; q.len()];
    let sweep: Vec<u64> = (0..32u64 << 20).collect();
    let half = sweep.len() / 2;
    let sink = std::sync::atomic::AtomicU64::new(0);
    let add = |x: u64| {
        sink.fetch_add(x, std::sync::atomic::Ordering::Relaxed);
    };
    let (mut times, mut reads) = (Vec::new(), Vec::new());
    // One team for the whole run, as for a decode step: the sweeps run on it too (both threads
    // read, as the weights' stream does), so the helper is awake when the attention starts.
    rayon::scope(|_| {
        deco_kernels::team::with_team(|| {
            let sweep_all = || {
                deco_kernels::team::par_for(2, |i| add(sweep[i * half..(i + 1) * half].iter().fold(0u64, |a, &w| a ^ w)))
            };
            for step in 0..16 {
                // Read-only sweeps (clean lines, as the weights' stream leaves them).
                sweep_all();
                let t0 = Instant::now();
                let sum = kv.iter().fold(0u8, |a, (k, v)| bytes_of(k).iter().chain(bytes_of(v)).fold(a, |b, x| b ^ x));
                let r = t0.elapsed().as_secs_f64() * 1e6 / layers as f64;
                add(u64::from(sum));
                sweep_all();
                let t0 = Instant::now();
                for (k, v) in &kv {
                    let seqs: Vec<SeqKv<'_, E>> =
                        tables.iter().map(|t| SeqKv { k, v, block_table: t, block_size: bs, len: context }).collect();
                    paged_decode_attention(&q, shape, &seqs, &mut out).expect("kernel");
                }
                let t = t0.elapsed().as_secs_f64() * 1e6 / layers as f64;
                if step > 0 {
                    times.push(t);
                    reads.push(r);
                }
            }
        })
    });
    let sink = sink.into_inner();
    let bytes = (batch * context * row * 2 * std::mem::size_of::<E>()) as f64;
    let t = median(&mut times);
    let r = median(&mut reads);
    println!(
        "stream: {}, batch {batch}, context {context}, {layers} layers: {t:.1} µs/layer, {:.1} GB/s of keys and values; a 1-thread xor of the same arrays {r:.1} µs/layer ({:.1} GB/s) [{}]",
        std::any::type_name::<E>(),
        bytes / t / 1e3,
        bytes / r / 1e3,
        sink % 2
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("stream") {
        let context = args.get(2).map_or(576, |s| s.parse().expect("CONTEXT"));
        let layers = args.get(3).map_or(30, |s| s.parse().expect("LAYERS"));
        let batch = args.get(4).map_or(1, |s| s.parse().expect("BATCH"));
        return match args.get(5).map_or("f32", String::as_str) {
            "f32" => stream(context, layers, batch, |x| x),
            "f16" => stream(context, layers, batch, f16::from_f32),
            other => panic!("cache type {other}: f32 or f16"),
        };
    }
    let context: usize = args.get(1).map_or(512, |s| s.parse().expect("CONTEXT"));
    let batches: Vec<usize> =
        args.get(2).map_or(vec![1, 16, 64], |s| s.split(',').map(|b| b.parse().expect("BATCHES")).collect());
    let shape = AttnShape { n_heads: 9, kv_heads: 3, head_dim: 64 };
    let (bs, row) = (16usize, 3 * 64);
    let dev = Device::flex();
    println!("| batch | context | fused µs/layer | previous µs/layer | speed-up |");
    println!("|---|---|---|---|---|");
    for batch in batches {
        let per_seq = context.div_ceil(bs);
        let nb = batch * per_seq;
        let mut rnd = xorshift(1);
        let k: Vec<f32> = (0..nb * bs * row).map(|_| rnd()).collect();
        let v: Vec<f32> = (0..nb * bs * row).map(|_| rnd()).collect();
        // Interleaved block tables (sequence s owns blocks s, s + batch, ...).
        let tables: Vec<Vec<u32>> = (0..batch).map(|s| (0..per_seq).map(|i| (i * batch + s) as u32).collect()).collect();
        let q: Vec<f32> = (0..batch * 9 * 64).map(|_| rnd()).collect();
        let seqs: Vec<SeqKv<'_>> =
            tables.iter().map(|t| SeqKv { k: &k, v: &v, block_table: t, block_size: bs, len: context }).collect();
        let mut out = vec![0.0f32; q.len()];
        let (mut tf, mut tp) = (Vec::new(), Vec::new());
        // Back to back, as in a decode step (the pool's threads stay awake between calls).
        for _ in 0..60 {
            let t0 = Instant::now();
            paged_decode_attention(&q, shape, &seqs, &mut out).expect("kernel");
            tf.push(t0.elapsed().as_secs_f64() * 1e6);
        }
        for _ in 0..30 {
            let t0 = Instant::now();
            let mut outs = Vec::with_capacity(batch);
            for (s, t) in tables.iter().enumerate() {
                let (mut kg, mut vg) = (Vec::with_capacity(context * row), Vec::with_capacity(context * row));
                for (i, &b) in t.iter().enumerate() {
                    let rows = bs.min(context - i * bs);
                    let off = b as usize * bs * row;
                    kg.extend_from_slice(&k[off..off + rows * row]);
                    vg.extend_from_slice(&v[off..off + rows * row]);
                }
                let kt = Tensor::from_data(TensorData::new(kg, [context, 3, 64]), &dev);
                let vt = Tensor::from_data(TensorData::new(vg, [context, 3, 64]), &dev);
                let qt = Tensor::from_data(TensorData::new(q[s * 576..(s + 1) * 576].to_vec(), [1, 9, 64]), &dev);
                outs.push(causal_gqa_attention(qt, kt, vt, context - 1));
            }
            let _ = Tensor::cat(outs, 0).try_into_vec_as::<f32>().expect("read");
            tp.push(t0.elapsed().as_secs_f64() * 1e6);
        }
        let (f, p) = (median(&mut tf), median(&mut tp));
        println!("| {batch} | {context} | {f:.0} | {p:.0} | {:.1}x |", p / f);
    }
}
