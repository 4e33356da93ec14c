//! Sparse fine-tuning after pruning, on the tiny Llama-3 checkpoint:
//!
//! - fixed mask: every pruned weight is still exactly zero after training (the masked gradients
//!   never moved it: `stray == 0` before the final masking), the pattern equals the one-shot
//!   pattern bit for bit, the kept weights did change, and the held-out loss went down;
//! - moving-average masks: the sparsity stays exactly at the target (the same count in every
//!   row for unstructured, N of every M for 2:4), the masks do move, and the loss goes down;
//! - the tuned tensors load into the inference model (`Llama::load_from`), whose logits equal the
//!   trainable student's on the same tensors;
//! - bad parameters and masks that do not fit are errors naming the problem.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::collections::HashMap;
use std::path::PathBuf;

use burn::tensor::Device;
use deco_compress::distill::{cross_entropy_weighted, next_token_labels};
use deco_compress::mask::{Mask, Pattern};
use deco_compress::pipeline::{Method, PrunedModel, prune_model};
use deco_compress::sparse_ft::{MaskUpdate, SparseFtConfig, sparse_finetune};
use deco_compress::student::{HfTensors, StudentModel};
use deco_compress::Error;
use deco_formats::checkpoint::Checkpoint;
use deco_formats::config::ModelConfig;

fn tiny() -> Checkpoint {
    Checkpoint::open(PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/data/tiny/llama3"))).unwrap()
}

/// A learnable token stream: a fixed pseudo-random sequence of period 23 over the vocabulary.
fn stream(vocab: usize, len: usize) -> Vec<u32> {
    (0..len).map(|i| (((i % 23) * 37 + 11) % vocab) as u32).collect()
}

fn prune(ck: &Checkpoint, pattern: Pattern) -> PrunedModel {
    let cfg = &ck.config;
    let src = |n: &str| -> deco_model::Result<(Vec<usize>, Vec<f32>)> { Ok(ck.tensor(n)?) };
    let s = stream(cfg.vocab_size, 400);
    let windows = vec![s[..32].to_vec(), s[50..82].to_vec(), s[100..132].to_vec()];
    prune_model(cfg, &src, &Device::flex(), &windows, &Method::Wanda, pattern, &mut |_| {}).unwrap()
}

/// Held-out mean next-token cross-entropy of a tensor set (plain device).
fn held_out_loss(cfg: &ModelConfig, tensors: &deco_compress::pipeline::TensorFn<'_>) -> f64 {
    let m = StudentModel::from_source(cfg, tensors, &Device::flex()).unwrap();
    let s = stream(cfg.vocab_size, 400);
    let ids = vec![s[200..240].to_vec(), s[300..340].to_vec()];
    let (labels, w) = next_token_labels(&ids);
    let l = cross_entropy_weighted(m.forward(cfg, &ids, false).unwrap(), &labels, &w).unwrap();
    f64::from(l.try_into_vec_as::<f32>().unwrap()[0])
}

fn start_source<'a>(ck: &'a Checkpoint, pruned: &'a PrunedModel, keep_dense_at_pruned: bool) -> impl Fn(&str) -> deco_model::Result<(Vec<usize>, Vec<f32>)> + 'a {
    move |n: &str| {
        let (shape, mut w) = ck.tensor(n)?;
        if let (Some(p), Some(m)) = (pruned.linears.get(n), pruned.masks.get(n)) {
            for ((x, &pv), &k) in w.iter_mut().zip(p).zip(&m.keep) {
                if k || !keep_dense_at_pruned {
                    *x = pv;
                }
            }
        }
        Ok((shape, w))
    }
}

fn config(update: MaskUpdate, pattern: Pattern) -> SparseFtConfig {
    SparseFtConfig { steps: 30, batch_size: 2, seqlen: 24, lr: 3e-3, seed: 7, mask_update: update, pattern, clip_norm: Some(1.0) }
}

fn lookup(t: &HfTensors) -> impl Fn(&str) -> deco_model::Result<(Vec<usize>, Vec<f32>)> + '_ {
    |n: &str| t.get(n).cloned().ok_or_else(|| deco_model::Error::InvalidInput(format!("missing {n}")))
}

#[test]
fn fixed_mask_keeps_the_one_shot_pattern_exactly_and_recovers() {
    let ck = tiny();
    let cfg = ck.config.clone();
    let pattern = Pattern::Unstructured(0.5);
    let pruned = prune(&ck, pattern);
    assert_eq!(pruned.masks.len(), 7 * cfg.num_hidden_layers);
    let src = start_source(&ck, &pruned, false);
    let before = held_out_loss(&cfg, &src);
    let model = StudentModel::from_source(&cfg, &src, &Device::flex().autodiff()).unwrap();
    let tokens = stream(cfg.vocab_size, 400);
    let mut steps = 0;
    let out = sparse_finetune(model, &cfg, &pruned.masks, &tokens, &config(MaskUpdate::Fixed, pattern), &mut |_| steps += 1).unwrap();
    assert_eq!(steps, 30);
    assert_eq!(out.stray, 0, "a pruned weight moved under masked gradients");
    assert!(out.mask_log.is_empty());
    let mut moved = 0usize;
    for (name, m) in &pruned.masks {
        assert_eq!(&out.masks[name], m, "{name}: the fixed mask changed");
        let w = &out.tensors[name].1;
        for ((&v, &k), &p) in w.iter().zip(&m.keep).zip(&pruned.linears[name]) {
            if !k {
                assert_eq!(v.to_bits(), 0.0f32.to_bits(), "{name}: pruned weight is {v}");
            } else if v != p {
                moved += 1;
            }
        }
    }
    let kept: usize = pruned.masks.values().map(|m| m.keep.len() - m.pruned()).sum();
    assert!(moved > kept / 2, "only {moved} of {kept} kept weights changed");
    let after = held_out_loss(&cfg, &lookup(&out.tensors));
    assert!(after < before - 0.05, "held-out loss {before:.4} -> {after:.4}");
    // The tuned tensors in the inference model give the student's logits.
    let llama = deco_model::Llama::load_from(&cfg, &lookup(&out.tensors), &Device::flex(), None).unwrap();
    let ids = tokens[10..30].to_vec();
    let mut cache = deco_model::DenseKvCache::new(llama.num_layers());
    let inf = llama.forward(&[deco_model::SeqInput { seq: 0, tokens: &ids, tree: None }], &mut cache, deco_model::LogitsWanted::All).unwrap();
    let inf = inf.logits.try_into_vec_as::<f32>().unwrap();
    let st = StudentModel::from_source(&cfg, &lookup(&out.tensors), &Device::flex()).unwrap();
    let st = st.forward(&cfg, &[ids], false).unwrap().try_into_vec_as::<f32>().unwrap();
    let diff = inf.iter().zip(&st).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(diff < 1e-4, "inference vs student logits differ by {diff}");
}

fn check_exact(masks: &HashMap<String, Mask>, pattern: Pattern) {
    for (name, m) in masks {
        match pattern {
            Pattern::NM { n, m: g } => assert!(m.satisfies_nm(n, g) && m.pruned() * g == m.keep.len() * (g - n), "{name}: not exactly {n}:{g}"),
            Pattern::Unstructured(s) => {
                let per_row = ((s * m.cols as f64).round()) as usize;
                for row in m.keep.chunks(m.cols) {
                    assert_eq!(row.iter().filter(|&&k| !k).count(), per_row, "{name}: a row is not at the target sparsity");
                }
            }
        }
    }
}

#[test]
fn moving_average_masks_hold_the_target_sparsity_and_move() {
    let ck = tiny();
    let cfg = ck.config.clone();
    for pattern in [Pattern::NM { n: 2, m: 4 }, Pattern::Unstructured(0.5)] {
        let pruned = prune(&ck, pattern);
        check_exact(&pruned.masks, pattern);
        let src = start_source(&ck, &pruned, true);
        let before = held_out_loss(&cfg, &start_source(&ck, &pruned, false));
        let model = StudentModel::from_source(&cfg, &src, &Device::flex().autodiff()).unwrap();
        let tokens = stream(cfg.vocab_size, 400);
        let sc = config(MaskUpdate::Ema { beta: 0.5, every: 5 }, pattern);
        let out = sparse_finetune(model, &cfg, &pruned.masks, &tokens, &sc, &mut |_| {}).unwrap();
        assert_eq!(out.mask_log.len(), 6);
        check_exact(&out.masks, pattern);
        let target = pattern.sparsity();
        for l in &out.mask_log {
            assert!((l.sparsity - target).abs() < 1e-12, "step {}: sparsity {} vs {target}", l.step, l.sparsity);
        }
        assert!(out.mask_log.iter().any(|l| l.changed > 0.0), "{pattern:?}: the masks never moved");
        for (name, m) in &out.masks {
            for (&v, &k) in out.tensors[name].1.iter().zip(&m.keep) {
                assert!(k || v == 0.0, "{name}: pruned weight {v} in the output");
            }
        }
        let after = held_out_loss(&cfg, &lookup(&out.tensors));
        assert!(after < before - 0.05, "{pattern:?}: held-out loss {before:.4} -> {after:.4}");
    }
}

#[test]
fn bad_parameters_and_masks_are_errors() {
    let ck = tiny();
    let cfg = ck.config.clone();
    let pattern = Pattern::NM { n: 2, m: 4 };
    let pruned = prune(&ck, pattern);
    let tokens = stream(cfg.vocab_size, 400);
    let src = |n: &str| -> deco_model::Result<(Vec<usize>, Vec<f32>)> { Ok(ck.tensor(n)?) };
    let run = |sc: SparseFtConfig, masks: &HashMap<String, Mask>, toks: &[u32]| {
        let model = StudentModel::from_source(&cfg, &src, &Device::flex().autodiff()).unwrap();
        sparse_finetune(model, &cfg, masks, toks, &sc, &mut |_| {}).map(|_| ()).unwrap_err().to_string()
    };
    let base = config(MaskUpdate::Fixed, pattern);
    let e = run(SparseFtConfig { steps: 0, ..base.clone() }, &pruned.masks, &tokens);
    assert!(e.contains("finetune_steps"), "{e}");
    let e = run(SparseFtConfig { lr: f64::NAN, ..base.clone() }, &pruned.masks, &tokens);
    assert!(e.contains("lr"), "{e}");
    let e = run(SparseFtConfig { mask_update: MaskUpdate::Ema { beta: 1.0, every: 5 }, ..base.clone() }, &pruned.masks, &tokens);
    assert!(e.contains("mask_ema"), "{e}");
    let e = run(SparseFtConfig { mask_update: MaskUpdate::Ema { beta: 0.9, every: 0 }, ..base.clone() }, &pruned.masks, &tokens);
    assert!(e.contains("mask_update_every"), "{e}");
    let e = run(base.clone(), &pruned.masks, &tokens[..10]);
    assert!(e.contains("seqlen") || e.contains("tokens"), "{e}");
    let mut missing = pruned.masks.clone();
    missing.remove("model.layers.1.mlp.down_proj.weight");
    let e = run(base.clone(), &missing, &tokens);
    assert!(e.contains("model.layers.1.mlp.down_proj.weight"), "{e}");
    let mut wrong = pruned.masks.clone();
    wrong.insert("model.layers.0.self_attn.o_proj.weight".into(), Mask::dense(3, 5));
    let model = StudentModel::from_source(&cfg, &src, &Device::flex().autodiff()).unwrap();
    let r = sparse_finetune(model, &cfg, &wrong, &tokens, &base, &mut |_| {});
    assert!(matches!(r, Err(Error::Shape(ref m)) if m.contains("o_proj")), "{r:?}");
}
