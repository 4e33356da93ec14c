//! Pruned models load and run; structured pruning equals the masked dense model; pruned models
//! survive writing to disk (dense HF directory and sparse form).
//!
//! The tiny checkpoints (`tests/data/tiny`) make the checks fast; the `smollm2_*` tests repeat the
//! strong check (structured-pruned logits = masked dense logits within 1e-4) on the real model.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::path::PathBuf;

use burn::tensor::Device;
use deco_compress::export::{write_dense_dir, write_sparse_dir};
use deco_compress::mask::Pattern;
use deco_compress::pipeline::{Method, prune_model};
use deco_compress::sparse::SparseCheckpoint;
use deco_compress::sparsegpt::SparseGptConfig;
use deco_compress::structured::{HeadMode, StructuredPlan, StructuredSpec, decoder_params, importance};
use deco_compress::unstructured::Scope;
use deco_formats::checkpoint::Checkpoint;
use deco_formats::config::ModelConfig;
use deco_formats::gguf::GgufFile;
use deco_formats::hf_export::ExportDtype;
use deco_formats::tokenizer::Tokenizer;
use deco_model::calibrate::Linear;
use deco_model::{DenseKvCache, Llama, LogitsWanted, SeqInput};

fn tiny(name: &str) -> Checkpoint {
    Checkpoint::open(PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/data/tiny")).join(name)).unwrap()
}

fn device() -> Device {
    deco_kernels::select_device("flex").unwrap()
}

fn logits(model: &Llama, tokens: &[u32]) -> Vec<f32> {
    let mut cache = DenseKvCache::new(model.num_layers());
    let rows = model.forward(&[SeqInput { seq: 0, tokens, tree: None }], &mut cache, LogitsWanted::All).unwrap().logits_rows().unwrap();
    assert_eq!(rows.len(), tokens.len());
    for r in &rows {
        assert_eq!(r.len(), model.config.vocab_size);
        assert!(r.iter().all(|v| v.is_finite()));
    }
    rows.concat()
}

fn windows(vocab: usize, n: usize, len: usize) -> Vec<Vec<u32>> {
    (0..n).map(|w| (0..len).map(|t| ((t * 37 + w * 11 + 5) % vocab) as u32).collect()).collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn unstructured_pruned_tiny_models_load_and_run() {
    let dev = device();
    for name in ["llama3", "qwen2"] {
        let ck = tiny(name);
        let cfg = &ck.config;
        let src = |n: &str| -> deco_model::Result<(Vec<usize>, Vec<f32>)> { Ok(ck.tensor(n)?) };
        let wins = windows(cfg.vocab_size, 3, 16);
        let methods = [Method::Magnitude(Scope::Layer), Method::Magnitude(Scope::Row), Method::Wanda, Method::SparseGpt(SparseGptConfig::default())];
        for method in methods {
            for pattern in [Pattern::Unstructured(0.5), Pattern::NM { n: 2, m: 4 }] {
                let p = prune_model(cfg, &src, &dev, &wins, &method, pattern, &mut |_| {}).unwrap();
                assert_eq!(p.linears.len(), 7 * cfg.num_hidden_layers);
                // Exactly 50% of every linear layer is zero (the tiny weights have no zeros).
                for (n, w) in &p.linears {
                    let z = w.iter().filter(|&&v| v == 0.0).count();
                    assert_eq!(z * 2, w.len(), "{name} {method:?} {pattern:?} {n}");
                }
                let source = p.source(&src);
                let model = Llama::load_from(cfg, &source, &dev, Some(64)).unwrap();
                let _ = logits(&model, &wins[0]);
            }
        }
        // Wanda needs calibration; a bad pattern is an error.
        assert!(prune_model(cfg, &src, &dev, &[], &Method::Wanda, Pattern::Unstructured(0.5), &mut |_| {}).is_err());
        assert!(prune_model(cfg, &src, &dev, &wins, &Method::Wanda, Pattern::NM { n: 2, m: 5 }, &mut |_| {}).is_err());
    }
}

/// Structured plan on `ck`, then: the pruned model's config and weights agree (it loads), its
/// logits equal the masked dense model's, and the parameter count shrinks.
///
/// Bound: `max |Δlogit| < tol`, with `tol` 1e-4 on the tiny models. On the 30-layer SmolLM2 the
/// two f32 computations differ only in summation order (the masked matmuls add zeros inside
/// longer dot products) and that noise accumulates over the layers to ~1-2e-4 at logits of
/// magnitude ~40, so there the bound is relative: `1e-5 · max |logit|`, with the mean difference
/// below 1e-4 absolute. An indexing error gives differences of order 1.
fn structured_equals_masked(ck: &Checkpoint, spec: &StructuredSpec, wins: &[Vec<u32>], tokens: &[u32], max_pos: usize, relative: bool) -> (StructuredPlan, ModelConfig, f32) {
    let dev = device();
    let cfg = &ck.config;
    let src = |n: &str| -> deco_model::Result<(Vec<usize>, Vec<f32>)> { Ok(ck.tensor(n)?) };
    let imp = importance(cfg, &src, &dev, wins, &mut |_| {}).unwrap();
    let plan = StructuredPlan::from_importance(cfg, &imp, spec).unwrap();
    plan.validate(cfg).unwrap();
    let pcfg = plan.config(cfg);
    pcfg.validate(std::path::Path::new("pruned")).unwrap();
    let pruned_src = |n: &str| plan.pruned_tensor(cfg, &src, n);
    let masked_src = |n: &str| plan.masked_tensor(cfg, &src, n);
    let pruned = Llama::load_from(&pcfg, &pruned_src, &dev, Some(max_pos)).unwrap();
    let masked = Llama::load_from(cfg, &masked_src, &dev, Some(max_pos)).unwrap();
    let a = logits(&pruned, tokens);
    let b = logits(&masked, tokens);
    let d = max_diff(&a, &b);
    let mean = a.iter().zip(&b).map(|(x, y)| (x - y).abs() as f64).sum::<f64>() / a.len() as f64;
    let amax = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    eprintln!("{spec:?}: max |pruned - masked| {d:e}, mean {mean:e}, max |logit| {amax}");
    let tol = if relative { 1e-5 * amax } else { 1e-4 };
    assert!(d < tol && mean < 1e-4, "{spec:?}: pruned vs masked logits differ by {d} (mean {mean}, bound {tol})");
    assert!(decoder_params(&pcfg) < decoder_params(cfg));
    (plan, pcfg, d)
}

#[test]
fn structured_tiny_equals_masked_dense() {
    for name in ["llama3", "qwen2"] {
        let ck = tiny(name);
        let cfg = &ck.config;
        let wins = windows(cfg.vocab_size, 2, 12);
        let tokens: Vec<u32> = (0..20).map(|t| (t * 13 % cfg.vocab_size) as u32).collect();
        let specs = [
            StructuredSpec { heads: 0.5, ..Default::default() },
            StructuredSpec { heads: 0.5, head_mode: HeadMode::KvGroups, ..Default::default() },
            StructuredSpec { neurons: 0.4, ..Default::default() },
            StructuredSpec { layers: 0.5, ..Default::default() },
            StructuredSpec { heads: 0.5, neurons: 0.5, layers: 0.5, ..Default::default() },
        ];
        for spec in specs {
            let (_, pcfg, _) = structured_equals_masked(&ck, &spec, &wins, &tokens, 64, false);
            if spec.heads > 0.0 {
                match spec.head_mode {
                    HeadMode::QueryPerGroup => assert_eq!((pcfg.num_attention_heads, pcfg.num_key_value_heads), (2, 2)),
                    HeadMode::KvGroups => assert_eq!((pcfg.num_attention_heads, pcfg.num_key_value_heads), (2, 1)),
                }
            }
            if spec.neurons > 0.0 {
                assert_eq!(pcfg.intermediate_size, cfg.intermediate_size - (spec.neurons * cfg.intermediate_size as f64).round() as usize);
            }
            if spec.layers > 0.0 {
                assert_eq!(pcfg.num_hidden_layers, 1);
            }
        }
        assert!(StructuredPlan::from_importance(cfg, &importance(cfg, &|n| Ok(ck.tensor(n)?), &device(), &wins, &mut |_| {}).unwrap(), &StructuredSpec { heads: 1.0, ..Default::default() }).is_err());
    }
}

fn smollm2() -> Checkpoint {
    Checkpoint::open(deco_tests::smollm2_gguf()).unwrap()
}

fn smollm2_tokenizer() -> Tokenizer {
    Tokenizer::from_gguf(&GgufFile::open(deco_tests::smollm2_gguf()).unwrap()).unwrap()
}

fn text_tokens(tok: &Tokenizer, rel: &str, chars: usize) -> Vec<u32> {
    let text: String = std::fs::read_to_string(deco_tests::asset(rel)).unwrap().chars().take(chars).collect();
    tok.encode_with(&text, false, true).unwrap()
}

#[test]
fn smollm2_structured_equals_masked_and_round_trips_through_disk() {
    let ck = smollm2();
    let tok = smollm2_tokenizer();
    let calib = text_tokens(&tok, "data/wiki_train.txt", 4000);
    let wins = vec![calib[..64].to_vec(), calib[64..128].to_vec()];
    let tokens = text_tokens(&tok, "data/wiki_test.txt", 400)[..48].to_vec();
    let spec = StructuredSpec { heads: 0.34, neurons: 0.5, layers: 0.1, ..Default::default() };
    let (plan, pcfg, d) = structured_equals_masked(&ck, &spec, &wins, &tokens, 128, true);
    eprintln!("SmolLM2 heads+neurons+layers: max |pruned - masked| logit = {d:e}");
    assert_eq!((pcfg.num_attention_heads, pcfg.num_key_value_heads, pcfg.intermediate_size, pcfg.num_hidden_layers), (6, 3, 768, 27));
    // Written atomically as a HF directory, loads back with the generic loader, same logits.
    let dev = device();
    let cfg = &ck.config;
    let src = |n: &str| -> deco_model::Result<(Vec<usize>, Vec<f32>)> { Ok(ck.tensor(n)?) };
    let pruned_src = |n: &str| plan.pruned_tensor(cfg, &src, n);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("pruned");
    write_dense_dir(&ck, &tok, &pcfg, &pruned_src, &out, ExportDtype::F32).unwrap();
    let names: Vec<String> = std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().to_string()).collect();
    assert_eq!(names, vec!["pruned".to_string()], "no temporary directory left behind");
    let back = Checkpoint::open(&out).unwrap();
    assert_eq!(back.config, pcfg);
    let reloaded = Llama::load(&back, &dev, Some(128)).unwrap();
    let direct = Llama::load_from(&pcfg, &pruned_src, &dev, Some(128)).unwrap();
    assert_eq!(logits(&reloaded, &tokens), logits(&direct, &tokens));
    assert!(Tokenizer::from_hf_dir(&out).is_ok());
    // A non-empty output directory is refused.
    assert!(write_dense_dir(&ck, &tok, &pcfg, &pruned_src, &out, ExportDtype::F32).is_err());
}

#[test]
fn smollm2_sparse_storage_round_trip_and_size() {
    let ck = smollm2();
    let tok = smollm2_tokenizer();
    let dev = device();
    let cfg = &ck.config;
    let src = |n: &str| -> deco_model::Result<(Vec<usize>, Vec<f32>)> { Ok(ck.tensor(n)?) };
    let p = prune_model(cfg, &src, &dev, &[], &Method::Magnitude(Scope::Row), Pattern::NM { n: 2, m: 4 }, &mut |_| {}).unwrap();
    let source = p.source(&src);
    let tmp = tempfile::tempdir().unwrap();
    let (dense_dir, sparse_dir) = (tmp.path().join("dense"), tmp.path().join("sparse"));
    write_sparse_dir(&ck, &tok, cfg, &source, &sparse_dir, ExportDtype::F32).unwrap();
    write_dense_dir(&ck, &tok, cfg, &source, &dense_dir, ExportDtype::F32).unwrap();
    let sp = SparseCheckpoint::open(&sparse_dir).unwrap();
    assert_eq!(&sp.config, cfg);
    for li in [0, 29] {
        for l in Linear::ALL {
            let n = format!("model.layers.{li}.{}.weight", l.hf_suffix());
            let (_, want) = source(&n).unwrap();
            let (shape, got) = sp.tensor(&n).unwrap();
            assert_eq!(shape, vec![l.dims(cfg).0, l.dims(cfg).1]);
            assert!(want.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits() || (*a == 0.0 && *b == 0.0)), "{n}");
        }
    }
    let size = |d: &std::path::Path, f: &str| std::fs::metadata(d.join(f)).unwrap().len();
    let (s, d) = (size(&sparse_dir, deco_compress::sparse::SPARSE_FILE), size(&dense_dir, "model.safetensors"));
    eprintln!("2:4 SmolLM2: sparse {s} bytes, dense {d} bytes");
    assert!((s as f64) < 0.7 * d as f64, "sparse file {s} not smaller than dense {d}");
    let model = Llama::load_from(&sp.config, &|n| sp.model_tensor(n), &dev, Some(64)).unwrap();
    let want = Llama::load_from(cfg, &source, &dev, Some(64)).unwrap();
    let toks = [504u32, 3458, 282, 4114, 314, 260];
    assert_eq!(logits(&model, &toks), logits(&want, &toks));
    assert!(SparseCheckpoint::open(&dense_dir).is_err());
}
