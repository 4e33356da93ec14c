//! Time of one batched decode step (`Llama::forward`, one new token for each of `B` sequences)
//! through the paged cache, with the fused CPU decode attention on and off, interleaved in one
//! process so both see the same machine load.
//!
//! ```text
//! cargo run --release -p deco-serve --example decode_step_bench -- MODEL.gguf [CONTEXT] [ROUNDS] [BATCHES]
//! ```
//!
//! `BATCHES` is a comma-separated list (default `1,4,16,64`). Each sequence gets a
//! `CONTEXT`-token prompt (default 64), then per round and per batch size
//! 8 decode steps with the fused path and 8 with the reference path (order alternating between
//! rounds); prints the median ms per step and the decode tok/s.

use std::time::Instant;

use burn::tensor::Device;
use deco_formats::checkpoint::Checkpoint;
use deco_model::{KvCache, Llama, LogitsWanted, SeqInput};
use deco_serve::{CacheShape, PagedKvCache};

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = args.get(1).expect("usage: decode_step_bench MODEL.gguf [CONTEXT] [ROUNDS] [BATCHES]");
    let context: usize = args.get(2).map_or(64, |s| s.parse().expect("CONTEXT"));
    let rounds: usize = args.get(3).map_or(3, |s| s.parse().expect("ROUNDS"));
    let batches: Vec<usize> = args
        .get(4)
        .map_or(vec![1, 4, 16, 64], |s| s.split(',').map(|b| b.parse().expect("BATCHES")).collect());
    let device = Device::default();
    let ckpt = Checkpoint::open(path).expect("open model");
    let fused = Llama::load(&ckpt, &device, Some(4096)).expect("load");
    let mut reference = fused.clone();
    reference.set_fused_decode_attention(false);
    let cfg = fused.config.clone();
    println!("| batch | context | fused ms/step | reference ms/step | fused tok/s | reference tok/s | speed-up |");
    println!("|---|---|---|---|---|---|---|");
    for batch in batches {
        let shape = CacheShape {
            n_layers: fused.num_layers(),
            kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
            block_size: 16,
            num_blocks: batch * (context + 8 * 2 * rounds + 32).div_ceil(16) + 8,
        };
        let mut cache = PagedKvCache::new(shape, &device).expect("cache");
        let prompt: Vec<u32> = (0..context as u32).map(|i| 100 + (i * 37) % 5000).collect();
        for s in 0..batch as u64 {
            fused.forward(&[SeqInput { seq: s, tokens: &prompt, tree: None }], &mut cache, LogitsWanted::Last).expect("prefill");
        }
        let (mut tf, mut tr) = (Vec::new(), Vec::new());
        for r in 0..rounds {
            let order: [bool; 2] = if r % 2 == 0 { [true, false] } else { [false, true] };
            for use_fused in order {
                let model = if use_fused { &fused } else { &reference };
                for step in 0..8u32 {
                    let toks: Vec<u32> = (0..batch as u32).map(|s| 200 + (s * 13 + step) % 4000).collect();
                    let inputs: Vec<SeqInput<'_>> = (0..batch)
                        .map(|s| SeqInput { seq: s as u64, tokens: std::slice::from_ref(&toks[s]), tree: None })
                        .collect();
                    let t0 = Instant::now();
                    let out = model.forward(&inputs, &mut cache, LogitsWanted::Last).expect("decode");
                    let _ = out.logits_rows().expect("rows");
                    let ms = t0.elapsed().as_secs_f64() * 1e3;
                    if use_fused { tf.push(ms) } else { tr.push(ms) }
                }
            }
        }
        let (mf, mr) = (median(&mut tf), median(&mut tr));
        println!(
            "| {batch} | {context}+ | {mf:.1} | {mr:.1} | {:.1} | {:.1} | {:.2}x |",
            batch as f64 / mf * 1e3,
            batch as f64 / mr * 1e3,
            mr / mf
        );
        for s in 0..batch as u64 {
            cache.remove(s);
        }
    }
}
