//! Time of one Medusa round's head evaluation (`MedusaHeads::first_head_logits` for 1..=K
//! heads: the ResBlocks on the host, then the shared LM head over the heads' rows) against one
//! decode token of the base model (`Llama::forward`, one token after a `CONTEXT`-token prompt),
//! interleaved in one process.
//!
//! ```text
//! cargo run --release -p deco-autodeco --example medusa_heads_bench -- MODEL.gguf HEADS_DIR [CONTEXT] [ROUNDS] [q8]
//! ```

use std::path::Path;
use std::time::Instant;

use burn::tensor::Device;
use deco_autodeco::medusa::MedusaHeads;
use deco_formats::checkpoint::Checkpoint;
use deco_model::{DenseKvCache, KvCache, Llama, LogitsWanted, SeqInput};

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: medusa_heads_bench MODEL.gguf HEADS_DIR [CONTEXT] [ROUNDS] [q8]";
    let model_path = args.get(1).expect(usage);
    let heads_dir = args.get(2).expect(usage);
    let context: usize = args.get(3).map_or(200, |s| s.parse().expect("CONTEXT"));
    let rounds: usize = args.get(4).map_or(30, |s| s.parse().expect("ROUNDS"));
    if args.get(5).is_some_and(|s| s == "q8") {
        deco_kernels::quant::set_activation_precision(deco_kernels::quant::ActivationPrecision::Q8).expect("q8 activations");
    }
    let model = Llama::load(&Checkpoint::open(model_path).expect("open model"), &Device::default(), Some(4096)).expect("load");
    let heads = MedusaHeads::load(Path::new(heads_dir), &model).expect("heads");
    let k = heads.config().medusa_num_heads;
    let mut cache = DenseKvCache::new(model.num_layers());
    let prompt: Vec<u32> = (0..context as u32).map(|i| 100 + (i * 37) % 5000).collect();
    let out = model.forward(&[SeqInput { seq: 0, tokens: &prompt, tree: None }], &mut cache, LogitsWanted::Last).expect("prefill");
    let hidden = deco_model::host::to_host(out.hidden).expect("hidden");
    let mut token_ms = Vec::new();
    let mut head_ms: Vec<Vec<f64>> = vec![Vec::new(); k];
    for r in 0..=rounds {
        let t = Instant::now();
        model.forward(&[SeqInput { seq: 0, tokens: &[42], tree: None }], &mut cache, LogitsWanted::Last).expect("decode");
        let ms = t.elapsed().as_secs_f64() * 1e3;
        cache.truncate(0, context).expect("truncate");
        if r > 0 {
            token_ms.push(ms);
        }
        for (n, times) in head_ms.iter_mut().enumerate() {
            let t = Instant::now();
            let rows = heads.first_head_logits(&hidden, n + 1).expect("heads");
            let ms = t.elapsed().as_secs_f64() * 1e3;
            assert_eq!(rows.len(), n + 1);
            if r > 0 {
                times.push(ms);
            }
        }
    }
    let tok = median(&mut token_ms);
    println!("| what | ms | × one token |\n|---|---|---|");
    println!("| one decode token | {tok:.2} | 1.00 |");
    for (n, times) in head_ms.iter_mut().enumerate() {
        let m = median(times);
        println!("| heads 1..={} | {m:.2} | {:.2} |", n + 1, m / tok);
    }
}
