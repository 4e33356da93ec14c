//! Architectures beyond SmolLM2, against an independent float64 numpy forward
//! (`tests/data/tiny/gen.py`, transformers semantics) on tiny random checkpoints:
//! Qwen2 (Q/K/V biases, untied LM head, sharded safetensors with an index) and Llama with
//! Llama 3.1 RoPE scaling and tied embeddings.

use std::path::PathBuf;

use burn::tensor::Device;
use deco_formats::checkpoint::Checkpoint;
use deco_formats::config::{Architecture, RopeScaling};
use deco_model::{DenseKvCache, Llama, LogitsWanted, SeqInput};

/// f32 forward vs float64 reference, logits of magnitude ~10.
const TOL: f64 = 1e-4;

fn dir(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/data/tiny")).join(name)
}

fn reference(name: &str) -> (Vec<u32>, Vec<f64>, usize) {
    let bytes = std::fs::read(dir(name).join("reference.safetensors")).expect("reference");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    let ids = st.tensor("ids").expect("ids");
    assert_eq!(ids.dtype(), safetensors::Dtype::I64);
    let ids: Vec<u32> = ids.data().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().expect("8")) as u32).collect();
    let logits = st.tensor("logits").expect("logits");
    assert_eq!(logits.dtype(), safetensors::Dtype::F64);
    let vocab = logits.shape()[1];
    let values = logits.data().chunks_exact(8).map(|b| f64::from_le_bytes(b.try_into().expect("8"))).collect();
    (ids, values, vocab)
}

fn check(name: &str) -> Checkpoint {
    let ckpt = Checkpoint::open(dir(name)).expect("open tiny checkpoint");
    let model = Llama::load(&ckpt, &Device::flex(), None).expect("load");
    let (ids, want, vocab) = reference(name);
    assert_eq!(vocab, model.config.vocab_size);

    let mut cache = DenseKvCache::new(model.config.num_hidden_layers);
    let rows = model
        .forward(&[SeqInput { seq: 0, tokens: &ids, tree: None }], &mut cache, LogitsWanted::All)
        .expect("forward")
        .logits_rows()
        .expect("logits");
    let mut worst = 0.0f64;
    for (t, row) in rows.iter().enumerate() {
        for (j, &x) in row.iter().enumerate() {
            worst = worst.max((x as f64 - want[t * vocab + j]).abs());
        }
    }
    eprintln!("{name}: max |logit - float64 reference| = {worst:.2e}");
    assert!(worst <= TOL, "{name}: max abs logit error {worst} > {TOL}");

    // Token-by-token decoding through the cache reproduces the reference at every position.
    let mut cache = DenseKvCache::new(model.config.num_hidden_layers);
    for (t, tok) in ids.iter().enumerate() {
        let row = model
            .forward(&[SeqInput { seq: 3, tokens: &[*tok], tree: None }], &mut cache, LogitsWanted::Last)
            .expect("step")
            .logits_rows()
            .expect("logits")
            .remove(0);
        for (j, &x) in row.iter().enumerate() {
            assert!((x as f64 - want[t * vocab + j]).abs() <= TOL, "{name}: step {t} token {j}");
        }
    }
    ckpt
}

#[test]
fn qwen2_with_biases_and_sharded_weights_matches_reference() {
    let ckpt = check("qwen2");
    assert_eq!(ckpt.config.model_type, Architecture::Qwen2);
    assert!(ckpt.config.attention_bias && !ckpt.config.tie_word_embeddings);
}

#[test]
fn llama3_rope_scaling_with_tied_embeddings_matches_reference() {
    let ckpt = check("llama3");
    assert!(matches!(ckpt.config.rope_scaling, Some(RopeScaling::Llama3 { .. })));
    assert!(ckpt.config.tie_word_embeddings);
}
