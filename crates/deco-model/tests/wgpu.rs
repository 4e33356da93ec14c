//! The model on the wgpu device (CubeCL RMSNorm and FlashAttention-2 prefill kernels, see
//! `dispatch` in llama.rs) against the same model on flex: prefill logits of two sequences of
//! different lengths, then three batched decode steps, for the tiny Llama 3 and Qwen2 checkpoints
//! of `tests/data/tiny` (GQA, RoPE, Qwen2's QKV biases). Run by the wgpu tier of `cargo xtask
//! test` (Mesa lavapipe in CI).
#![cfg(feature = "wgpu")]

use burn::tensor::Device;
use deco_formats::checkpoint::Checkpoint;
use deco_model::{DenseKvCache, Llama, LogitsWanted, SeqInput};

/// Prefill + decode on `device`; every position's logits of the prefill, then each decode step's.
fn run(dir: &str, device: &Device) -> Vec<Vec<f32>> {
    let ckpt = Checkpoint::open(dir).expect("tiny checkpoint");
    let model = Llama::load(&ckpt, device, None).expect("load");
    let vocab = model.config.vocab_size as u32;
    let a: Vec<u32> = (0..11).map(|i| (i * 7 + 3) % vocab).collect();
    let b: Vec<u32> = (0..5).map(|i| (i * 13 + 1) % vocab).collect();
    let mut cache = DenseKvCache::new(model.num_layers());
    let mut rows = model
        .forward(&[SeqInput { seq: 0, tokens: &a }, SeqInput { seq: 1, tokens: &b }], &mut cache, LogitsWanted::All)
        .expect("prefill")
        .logits_rows()
        .expect("logits");
    for step in 0..3u32 {
        let (ta, tb) = ([(step * 5 + 2) % vocab], [(step * 11 + 4) % vocab]);
        let out = model
            .forward(&[SeqInput { seq: 0, tokens: &ta }, SeqInput { seq: 1, tokens: &tb }], &mut cache, LogitsWanted::All)
            .expect("decode")
            .logits_rows()
            .expect("logits");
        rows.extend(out);
    }
    rows
}

#[test]
fn wgpu_forward_matches_flex() {
    for name in ["llama3", "qwen2"] {
        let dir = format!("{}/../../tests/data/tiny/{name}", env!("CARGO_MANIFEST_DIR"));
        let flex = run(&dir, &Device::flex());
        let gpu = run(&dir, &deco_kernels::select_device("wgpu").expect("wgpu device"));
        assert_eq!(flex.len(), gpu.len());
        assert_eq!(flex.len(), 11 + 5 + 2 * 3);
        let mut worst = 0.0f32;
        for (f, g) in flex.iter().zip(&gpu) {
            assert_eq!(f.len(), g.len());
            for (x, y) in f.iter().zip(g) {
                let err = (x - y).abs() / (1.0 + x.abs());
                worst = worst.max(err);
                assert!(err <= 1e-4, "{name}: flex {x} vs wgpu {y}");
            }
        }
        eprintln!("{name}: worst relative logit difference wgpu vs flex {worst:.2e}");
    }
}
