//! The paged KV cache with its blocks in device memory (wgpu over Mesa lavapipe in CI): the
//! model on wgpu with a `PagedKvCache` (writes by slice assignment, copy-on-write on the
//! device, prefill rows gathered on the device, decode through the CubeCL paged decode
//! kernel) against the model on flex with a `DenseKvCache`, on the tiny Llama 3 and Qwen2
//! checkpoints: a batched prefill, a fork of a sequence whose last block is shared, decode
//! steps of three sequences at once, a speculative rollback (truncate) and a mixed step of one
//! two-token chunk with decode tokens. Run by the wgpu tier of `cargo xtask test`.
#![cfg(feature = "wgpu")]

use burn::tensor::Device;
use deco_formats::checkpoint::Checkpoint;
use deco_model::{DenseKvCache, KvCache, Llama, LogitsWanted, SeqInput};
use deco_serve::paged_cache::{CacheShape, PagedKvCache};

/// The two caches under one interface for the script below.
#[allow(clippy::large_enum_variant)] // two per test run
enum Cache {
    Dense(DenseKvCache),
    Paged(PagedKvCache),
}

impl Cache {
    fn kv(&mut self) -> &mut dyn KvCache {
        match self {
            Cache::Dense(c) => c,
            Cache::Paged(c) => c,
        }
    }

    fn fork(&mut self, from: u64, to: u64) {
        match self {
            Cache::Dense(c) => c.fork(from, to).expect("fork"),
            Cache::Paged(c) => c.fork(from, to).expect("fork"),
        }
    }
}

/// Runs the script on `device` with a paged (else dense) cache; every logits row in order.
fn run(dir: &str, device: &Device, paged: bool) -> Vec<Vec<f32>> {
    let ckpt = Checkpoint::open(dir).expect("tiny checkpoint");
    let model = Llama::load(&ckpt, device, None).expect("load");
    let cfg = &model.config;
    let vocab = cfg.vocab_size as u32;
    let mut cache = if paged {
        let shape = CacheShape { n_layers: cfg.num_hidden_layers, kv_heads: cfg.num_key_value_heads, head_dim: cfg.head_dim, block_size: 4, num_blocks: 64 };
        let c = PagedKvCache::new(shape, device).expect("paged cache");
        assert_eq!(c.on_device(), *device != Device::flex(), "blocks on the device exactly on wgpu");
        Cache::Paged(c)
    } else {
        Cache::Dense(DenseKvCache::new(model.num_layers()))
    };
    let tok = |i: u32, m: u32| (i * m + 3) % vocab;
    let mut rows = Vec::new();
    let mut step = |cache: &mut Cache, inputs: &[(u64, Vec<u32>)]| {
        let seqs: Vec<SeqInput<'_>> = inputs.iter().map(|(s, t)| SeqInput { seq: *s, tokens: t, tree: None }).collect();
        let out = model.forward(&seqs, cache.kv(), LogitsWanted::All).expect("forward").logits_rows().expect("logits");
        rows.extend(out);
    };
    // Prefill: 10 tokens (two full blocks and a half) and 5 tokens.
    step(&mut cache, &[(0, (0..10).map(|i| tok(i, 7)).collect()), (1, (0..5).map(|i| tok(i, 13)).collect())]);
    // Sequence 2 shares sequence 0's blocks, its last one half full: the next writes copy it.
    cache.fork(0, 2);
    for s in 0..3u32 {
        step(&mut cache, &[(0, vec![tok(s, 5)]), (1, vec![tok(s, 11)]), (2, vec![tok(s, 17)])]);
    }
    // A rejected speculative chunk: sequence 1 drops its last two tokens, then continues.
    cache.kv().truncate(1, 6).expect("truncate");
    // A mixed step: a two-token chunk (sequence 1) beside decode tokens (0 and 2).
    step(&mut cache, &[(0, vec![tok(9, 3)]), (1, vec![tok(4, 3), tok(5, 3)]), (2, vec![tok(6, 3)])]);
    step(&mut cache, &[(0, vec![1]), (1, vec![2]), (2, vec![3])]);
    rows
}

#[test]
fn device_paged_cache_matches_flex_dense() {
    let wgpu = deco_kernels::select_device("wgpu").expect("wgpu device");
    for name in ["llama3", "qwen2"] {
        let dir = format!("{}/../../tests/data/tiny/{name}", env!("CARGO_MANIFEST_DIR"));
        let reference = run(&dir, &Device::flex(), false);
        let host_paged = run(&dir, &Device::flex(), true);
        let gpu = run(&dir, &wgpu, true);
        assert_eq!(reference.len(), 10 + 5 + 3 * 3 + 4 + 3);
        let mut worst = (0.0f32, 0.0f32);
        for (r, (h, g)) in reference.iter().zip(host_paged.iter().zip(&gpu)) {
            for (x, (y, z)) in r.iter().zip(h.iter().zip(g)) {
                let (eh, eg) = ((x - y).abs() / (1.0 + x.abs()), (x - z).abs() / (1.0 + x.abs()));
                worst = (worst.0.max(eh), worst.1.max(eg));
                assert!(eh <= 1e-4 && eg <= 1e-4, "{name}: dense {x}, host paged {y}, device paged {z}");
            }
        }
        eprintln!("{name}: worst relative logit difference vs flex dense: host paged {:.2e}, wgpu device paged {:.2e}", worst.0, worst.1);
    }
}
