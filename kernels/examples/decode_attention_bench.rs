//! One layer of decode attention for a batch of sequences, SmolLM2-135M shapes (9 query heads,
//! 3 kv heads, head_dim 64), paged storage with block size 16: the fused kernel
//! (`paged_decode_attention`) against the previous path (per sequence: gather the blocks into a
//! contiguous tensor, `causal_gqa_attention`, then one concatenation).
//!
//! ```text
//! cargo run --release -p deco-kernels --example decode_attention_bench -- [CONTEXT] [BATCHES]
//! ```

use std::time::Instant;

use burn::tensor::{Device, Tensor, TensorData};
use deco_kernels::attention::{AttnShape, SeqKv, paged_decode_attention};
use deco_kernels::ops::causal_gqa_attention;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
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
        let mut x = 1u32;
        let mut rnd = || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x as f32 / u32::MAX as f32) - 0.5
        };
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
