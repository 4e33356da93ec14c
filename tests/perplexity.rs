//! Perplexity of SmolLM2 on wiki_test by the golden protocol: first 20000 characters tokenized
//! without BOS, 4 non-overlapping windows of 256 tokens, each scored on its 255 next-token
//! predictions, ppl = exp(total NLL / tokens scored). Reference: 26.502 (float64 numpy forward).

use burn::tensor::Device;
use deco_formats::checkpoint::Checkpoint;
use deco_formats::tokenizer::Tokenizer;
use deco_model::{DenseKvCache, Llama, LogitsWanted, SeqInput};
use deco_tests::{asset, smollm2_gguf};

#[test]
fn wiki_perplexity_matches_golden_within_half_a_percent() {
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(asset("golden/smollm2-135m-instruct.json")).expect("golden"))
            .expect("json");
    let p = &golden["perplexity"];
    let (chars, seqlen, windows) = (
        p["chars_used"].as_u64().expect("chars") as usize,
        p["seqlen"].as_u64().expect("seqlen") as usize,
        p["windows"].as_u64().expect("windows") as usize,
    );
    let want = p["ppl"].as_f64().expect("ppl");

    let ckpt = Checkpoint::open(smollm2_gguf()).expect("open");
    let tok = Tokenizer::from_gguf(ckpt.gguf().expect("gguf")).expect("tokenizer");
    let model = Llama::load(&ckpt, &Device::flex(), Some(seqlen)).expect("load");
    let text: String = std::fs::read_to_string(asset("data/wiki_test.txt")).expect("text").chars().take(chars).collect();
    let ids = tok.encode_with(&text, false, true).expect("encode");
    assert!(ids.len() >= windows * seqlen);

    let (mut nll, mut n) = (0.0f64, 0usize);
    for w in 0..windows {
        let window = &ids[w * seqlen..(w + 1) * seqlen];
        let mut cache = DenseKvCache::new(model.config.num_hidden_layers);
        let rows = model
            .forward(&[SeqInput { seq: 0, tokens: window, tree: None }], &mut cache, LogitsWanted::All)
            .expect("forward")
            .logits_rows()
            .expect("logits");
        for (row, &target) in rows.iter().zip(&window[1..]) {
            // log-sum-exp in f64 (independent of deco's sampler code).
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = row.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln() + max;
            nll += lse - row[target as usize] as f64;
            n += 1;
        }
    }
    assert_eq!(n, p["tokens_scored"].as_u64().expect("tokens") as usize);
    let ppl = (nll / n as f64).exp();
    let rel = (ppl - want).abs() / want;
    eprintln!("perplexity {ppl:.4} vs golden {want:.4} (relative error {rel:.2e})");
    assert!(rel < 0.005, "perplexity {ppl} differs from {want} by {:.3}%", rel * 100.0);
}
