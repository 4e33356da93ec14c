//! Time of one forward of a Medusa candidate tree (`Llama::forward` with `SeqInput::tree`)
//! against one decode token, through the paged cache after a `CONTEXT`-token prompt: the cost
//! model of Medusa's verification step on this machine (docs/decoding.md, "Medusa").
//!
//! ```text
//! cargo run --release -p deco-serve --example tree_forward_bench -- MODEL.gguf [CONTEXT] [ROUNDS] [NODES] [q8]
//! ```
//!
//! `NODES` is a comma-separated list of tree sizes (default `1,2,3,4,6,9,16`; a tree of `n`
//! nodes is the root and `n − 1` children of it, which costs what any shape of `n` nodes
//! costs); `q8` turns on 8-bit activations. Per round, each size runs once, in rotating order,
//! and the cache is truncated back to the prompt after each forward; prints the median ms per
//! forward and its ratio to one token.

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
    let path = args.get(1).expect("usage: tree_forward_bench MODEL.gguf [CONTEXT] [ROUNDS] [NODES] [q8]");
    let context: usize = args.get(2).map_or(200, |s| s.parse().expect("CONTEXT"));
    let rounds: usize = args.get(3).map_or(15, |s| s.parse().expect("ROUNDS"));
    let sizes: Vec<usize> = args
        .get(4)
        .map_or(vec![1, 2, 3, 4, 6, 9, 16], |s| s.split(',').map(|b| b.parse().expect("NODES")).collect());
    if args.get(5).is_some_and(|s| s == "q8") {
        deco_kernels::quant::set_activation_precision(deco_kernels::quant::ActivationPrecision::Q8).expect("q8 activations");
    }
    let device = Device::default();
    let ckpt = Checkpoint::open(path).expect("open model");
    let model = Llama::load(&ckpt, &device, Some(4096)).expect("load");
    let cfg = model.config.clone();
    let max = sizes.iter().copied().max().unwrap_or(1);
    let shape = CacheShape {
        n_layers: model.num_layers(),
        kv_heads: cfg.num_key_value_heads,
        head_dim: cfg.head_dim,
        block_size: 16,
        num_blocks: (context + max).div_ceil(16) + 2,
    };
    let mut cache = PagedKvCache::new(shape, &device).expect("cache");
    let prompt: Vec<u32> = (0..context as u32).map(|i| 100 + (i * 37) % 5000).collect();
    model.forward(&[SeqInput { seq: 0, tokens: &prompt, tree: None }], &mut cache, LogitsWanted::Last).expect("prefill");
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); sizes.len()];
    for r in 0..rounds + 1 {
        for k in 0..sizes.len() {
            let i = (k + r) % sizes.len();
            let n = sizes[i];
            let tokens: Vec<u32> = (0..n as u32).map(|j| 200 + j * 11).collect();
            let parents: Vec<Option<usize>> = (0..n).map(|j| (j > 0).then_some(0)).collect();
            let t = Instant::now();
            let out = model
                .forward(&[SeqInput { seq: 0, tokens: &tokens, tree: Some(&parents) }], &mut cache, LogitsWanted::All)
                .expect("tree forward");
            let rows = out.logits_rows().expect("rows");
            let ms = t.elapsed().as_secs_f64() * 1e3;
            assert_eq!(rows.len(), n);
            cache.truncate(0, context).expect("truncate");
            // The first round warms up.
            if r > 0 {
                times[i].push(ms);
            }
        }
    }
    let one = sizes.iter().position(|&n| n == 1).map(|i| median(&mut times[i].clone()));
    println!("| nodes | ms per forward | × one token |");
    println!("|---|---|---|");
    for (i, &n) in sizes.iter().enumerate() {
        let m = median(&mut times[i]);
        let ratio = one.map_or(String::from("-"), |o| format!("{:.2}", m / o));
        println!("| {n} | {m:.2} | {ratio} |");
    }
}
