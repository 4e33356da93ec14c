//! LoRA / QLoRA adapters (`deco_compress::lora`) on the tiny Llama-3 and Qwen2 checkpoints.
//!
//! - the adapted forward (the one decoder on `LoraLayer`) equals the dense model whose weights
//!   are `W + (alpha/r)·B·A` merged here on the host in f64, independently of deco's merge; the
//!   inference path (`Llama::load_from` on `HostAdapters::merged_source`) gives the same logits;
//! - PEFT's initialization (B = 0: the adapted model is the base; A within Kaiming-uniform's
//!   bound), PEFT tensor names and shapes, config keys, save / load round trip;
//! - training changes only the adapters, lowers the answer loss, and resumes;
//! - NF4 base = deco-quant's NF4 (double quantization, block 64) of every decoder linear;
//! - bad input (rank 0, alpha <= 0, dropout outside [0, 1), unknown module, adapters of another
//!   architecture / shape, a non-LoRA PEFT config) is a clear error, never a panic.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use burn::module::Module;
use burn::tensor::{Device, Tensor};
use deco_compress::distill::{CotSequence, TokenKind};
use deco_compress::lora::{
    HostAdapters, LinearKey, LoraAdapters, LoraConfig, LoraTrainConfig, completion_batch, completion_loss, lora_forward, nf4_base, parse_target_modules, peft_tensor_name,
    train_lora,
};
use deco_compress::student::StudentModel;
use deco_formats::checkpoint::{Checkpoint, hf_tensor_names};
use deco_formats::config::ModelConfig;
use deco_model::calibrate::Linear;
use deco_model::{DenseKvCache, Llama, LogitsWanted, SeqInput};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn tiny(name: &str) -> Checkpoint {
    Checkpoint::open(PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/data/tiny")).join(name)).unwrap()
}

fn host(t: Tensor<2>) -> Vec<f32> {
    t.try_into_vec_as::<f32>().unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn ids(vocab: usize, n: usize, len: usize, salt: usize) -> Vec<Vec<u32>> {
    (0..n).map(|w| (0..len).map(|t| ((t * 31 + w * 17 + salt * 7 + 3) % vocab) as u32).collect()).collect()
}

/// Random adapters (A and B both non-zero) for `targets`, in PEFT's layout.
fn random_adapters(cfg: &ModelConfig, lc: &LoraConfig, seed: u64) -> HostAdapters {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut weights = BTreeMap::new();
    for li in 0..cfg.num_hidden_layers {
        for &l in &lc.target_modules {
            let (out, inp) = l.dims(cfg);
            let a: Vec<f32> = (0..lc.r * inp).map(|_| rng.random_range(-0.3..0.3)).collect();
            let b: Vec<f32> = (0..out * lc.r).map(|_| rng.random_range(-0.3..0.3)).collect();
            weights.insert((li, LinearKey::of(l)), (a, b));
        }
    }
    HostAdapters { config: lc.clone(), weights }
}

/// `W + s·B·A` in f64 on the host, written out here (not deco's merge).
fn merged_reference(ck: &Checkpoint, ad: &HostAdapters) -> HashMap<String, (Vec<usize>, Vec<f32>)> {
    let cfg = &ck.config;
    let s = ad.config.lora_alpha / ad.config.r as f64;
    let r = ad.config.r;
    let mut m = HashMap::new();
    for n in hf_tensor_names(cfg) {
        let (shape, mut w) = ck.tensor(&n).unwrap();
        for (&(li, key), (a, b)) in &ad.weights {
            if n == format!("model.layers.{li}.{}.weight", key.linear().hf_suffix()) {
                let (out, inp) = (shape[0], shape[1]);
                for o in 0..out {
                    for i in 0..inp {
                        let mut acc = 0.0f64;
                        for k in 0..r {
                            acc += f64::from(b[o * r + k]) * f64::from(a[k * inp + i]);
                        }
                        w[o * inp + i] = (f64::from(w[o * inp + i]) + s * acc) as f32;
                    }
                }
            }
        }
        m.insert(n, (shape, w));
    }
    m
}

fn llama_logits(m: &Llama, seqs: &[Vec<u32>]) -> Vec<f32> {
    let inputs: Vec<SeqInput<'_>> = seqs.iter().enumerate().map(|(i, t)| SeqInput { seq: i as u64, tokens: t, tree: None }).collect();
    let mut cache = DenseKvCache::new(m.num_layers());
    host(m.forward(&inputs, &mut cache, LogitsWanted::All).unwrap().logits)
}

/// The LoRA forward equals the dense model with independently merged weights, for every target
/// set (attention only, MLP only, all, a single fused part), on Llama-3 (tied head) and Qwen2
/// (QKV bias, untied head); deco's own merge (the `--lora` load path) agrees too.
#[test]
fn lora_forward_equals_merged_dense_weights() {
    let dev = Device::flex();
    for name in ["llama3", "qwen2"] {
        let ck = tiny(name);
        let cfg = &ck.config;
        let src = |n: &str| -> deco_model::Result<(Vec<usize>, Vec<f32>)> { Ok(ck.tensor(n)?) };
        let base = StudentModel::from_source(cfg, &src, &dev).unwrap();
        let batch = ids(cfg.vocab_size, 2, 12, 1);
        for (what, targets) in [
            ("attention", vec!["q_proj", "k_proj", "v_proj", "o_proj"]),
            ("mlp", vec!["gate_proj", "up_proj", "down_proj"]),
            ("all", vec!["all-linear"]),
            ("k and up only", vec!["k_proj", "up_proj"]),
        ] {
            let lc = LoraConfig { r: 3, lora_alpha: 7.0, lora_dropout: 0.1, target_modules: parse_target_modules(&targets).unwrap(), use_rslora: false };
            let ad = random_adapters(cfg, &lc, 5);
            let module = ad.to_module(cfg, &dev);
            // train = false: no dropout.
            let got = host(lora_forward(&base, &module, cfg, &lc, &batch, false).unwrap());
            let reference = merged_reference(&ck, &ad);
            let rsrc = |n: &str| -> deco_model::Result<(Vec<usize>, Vec<f32>)> { Ok(reference[n].clone()) };
            let dense = StudentModel::from_source(cfg, &rsrc, &dev).unwrap();
            let want = host(dense.forward(cfg, &batch, true).unwrap());
            let d = max_diff(&got, &want);
            eprintln!("{name} {what}: max |lora - merged| logit = {d:e}");
            assert!(d < 1e-4, "{name} {what}: {d}");
            // The adapters change the output (the test is not vacuous).
            let plain = host(base.forward(cfg, &batch, true).unwrap());
            assert!(max_diff(&got, &plain) > 1e-2, "{name} {what}: adapters had no effect");
            // deco's merge equals the reference merge, and the inference model on it agrees.
            let merged = ad.merged_source(&src);
            for n in hf_tensor_names(cfg) {
                let (_, w) = merged(&n).unwrap();
                assert!(max_diff(&w, &reference[&n].1) < 1e-5, "{name} {what}: merged {n}");
            }
            let llama = Llama::load_from(cfg, &merged, &dev, None).unwrap();
            let inf = llama_logits(&llama, &batch);
            assert!(max_diff(&inf, &want) < 1e-4, "{name} {what}: Llama on merged weights");
            // The host round trip of the module is exact.
            assert_eq!(HostAdapters::from_module(&module, cfg, &lc).unwrap(), ad);
        }
    }
}

/// PEFT's initialization: B = 0 (the adapted model is the base exactly), A uniform within
/// ±1/√in (Kaiming-uniform, a = √5), only the targeted modules get adapters, seeded.
#[test]
fn init_is_peft_default_and_the_identity() {
    let dev = Device::flex();
    let ck = tiny("qwen2");
    let cfg = &ck.config;
    let src = |n: &str| -> deco_model::Result<(Vec<usize>, Vec<f32>)> { Ok(ck.tensor(n)?) };
    let base = StudentModel::from_source(cfg, &src, &dev).unwrap();
    let lc = LoraConfig { r: 4, lora_alpha: 8.0, lora_dropout: 0.0, target_modules: parse_target_modules(&["q_proj", "down_proj"]).unwrap(), use_rslora: false };
    let ad = LoraAdapters::init(cfg, &lc, 3, &dev).unwrap();
    let h = HostAdapters::from_module(&ad, cfg, &lc).unwrap();
    assert_eq!(h.weights.len(), 2 * cfg.num_hidden_layers);
    assert_eq!(h.num_params(), lc.trainable_params(cfg));
    for (&(_, key), (a, b)) in &h.weights {
        let (_, inp) = key.linear().dims(cfg);
        let bound = 1.0 / (inp as f32).sqrt();
        assert!(a.iter().all(|v| v.abs() <= bound) && a.iter().any(|v| v.abs() > bound / 2.0), "A within ±1/sqrt(in)");
        assert!(b.iter().all(|&v| v == 0.0), "B starts at zero");
    }
    let batch = ids(cfg.vocab_size, 2, 9, 2);
    let got = host(lora_forward(&base, &ad, cfg, &lc, &batch, false).unwrap());
    let want = host(base.forward(cfg, &batch, true).unwrap());
    assert!(max_diff(&got, &want) < 1e-6);
    // Same seed, same adapters; another seed, others.
    assert_eq!(HostAdapters::from_module(&LoraAdapters::init(cfg, &lc, 3, &dev).unwrap(), cfg, &lc).unwrap(), h);
    assert_ne!(HostAdapters::from_module(&LoraAdapters::init(cfg, &lc, 4, &dev).unwrap(), cfg, &lc).unwrap(), h);
}

/// Saved adapters use PEFT's file names, tensor names, shapes and config keys, and load back
/// identically; the output is installed atomically and never overwrites a non-empty directory.
#[test]
fn peft_layout_round_trip() {
    let ck = tiny("llama3");
    let cfg = &ck.config;
    let lc = LoraConfig { r: 2, lora_alpha: 16.0, lora_dropout: 0.05, target_modules: parse_target_modules(&["q_proj", "v_proj", "gate_proj"]).unwrap(), use_rslora: false };
    let ad = random_adapters(cfg, &lc, 9);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("adapter");
    ad.save(&out, "HuggingFaceTB/SmolLM2-135M-Instruct", &serde_json::json!({"base_quant": "nf4"})).unwrap();
    let mut files: Vec<String> = std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    files.sort();
    assert_eq!(files, ["adapter_config.json", "adapter_model.safetensors", "deco_lora.json"]);
    // No temporary directory is left beside it.
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 1);
    let bytes = std::fs::read(out.join("adapter_model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.len(), 2 * 3 * cfg.num_hidden_layers);
    let a = st.tensor("base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight").unwrap();
    assert_eq!(a.shape(), [2, cfg.hidden_size]);
    assert_eq!(a.dtype(), safetensors::Dtype::F32);
    let b = st.tensor("base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight").unwrap();
    assert_eq!(b.shape(), [cfg.intermediate_size, 2]);
    let b = st.tensor("base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight").unwrap();
    assert_eq!(b.shape(), [cfg.num_key_value_heads * cfg.head_dim, 2]);
    assert_eq!(peft_tensor_name(1, Linear::Q, false), "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight");
    let conf: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(conf["peft_type"], "LORA");
    assert_eq!(conf["task_type"], "CAUSAL_LM");
    assert_eq!(conf["r"], 2);
    assert_eq!(conf["lora_alpha"], 16);
    assert_eq!(conf["lora_dropout"], 0.05);
    assert_eq!(conf["target_modules"], serde_json::json!(["q_proj", "v_proj", "gate_proj"]));
    assert_eq!(conf["bias"], "none");
    assert_eq!(conf["fan_in_fan_out"], false);
    assert_eq!(conf["base_model_name_or_path"], "HuggingFaceTB/SmolLM2-135M-Instruct");
    let back = HostAdapters::load(&out, cfg).unwrap();
    assert_eq!(back, ad);
    // A non-empty output is refused and left alone.
    let err = ad.save(&out, "x", &serde_json::json!({})).unwrap_err().to_string();
    assert!(err.contains("not empty"), "{err}");
    assert_eq!(HostAdapters::load(&out, cfg).unwrap(), ad);
}

fn toy_data(vocab: usize) -> Vec<CotSequence> {
    // A prompt of 4 tokens, then an "answer" that is a fixed function of the prompt.
    (0..16)
        .map(|i| {
            let p: Vec<u32> = (0..4).map(|t| ((i * 5 + t * 3 + 1) % vocab) as u32).collect();
            let ans: Vec<u32> = p.iter().rev().map(|&x| (x * 7 + 2) % vocab as u32).collect();
            let mut ids = p.clone();
            ids.extend(&ans);
            let mut kinds = vec![TokenKind::Ignore; 4];
            kinds.extend([TokenKind::Rationale, TokenKind::Rationale, TokenKind::Rationale, TokenKind::Answer]);
            CotSequence { ids, kinds }
        })
        .collect()
}

/// Answer-only loss weights: the question and the padding are not scored.
#[test]
fn completion_batch_scores_answers_only() {
    let data = toy_data(97);
    let short = CotSequence { ids: vec![1, 2, 3], kinds: vec![TokenKind::Ignore, TokenKind::Answer, TokenKind::Answer] };
    let b = completion_batch(&[&data[0], &short], 100, 0);
    assert_eq!(b.ids[1], vec![1, 2, 3, 0, 0, 0, 0, 0]);
    // Sequence 0: rows 3..=6 predict the 4 answer tokens; sequence 1: rows 0, 1.
    assert_eq!(b.scored, 6);
    let scored: Vec<usize> = b.weights.iter().enumerate().filter(|(_, w)| **w > 0.0).map(|(i, _)| i).collect();
    assert_eq!(scored, vec![3, 4, 5, 6, 8, 9]);
    assert!((b.weights.iter().sum::<f32>() - 1.0).abs() < 1e-6);
    assert_eq!(b.labels[3], data[0].ids[4]);
}

/// Training on the frozen (NF4) base changes only the adapters, lowers the held-out answer
/// loss, and a run resumed from a saved checkpoint continues with the same batches.
#[test]
fn qlora_training_updates_only_the_adapters() {
    let ck = tiny("llama3");
    let cfg = &ck.config;
    let src = |n: &str| -> deco_model::Result<(Vec<usize>, Vec<f32>)> { Ok(ck.tensor(n)?) };
    // The NF4 base: deco-quant's NF4 of each decoder linear, nothing else.
    let lin = nf4_base(cfg, &src, &mut |_| {}).unwrap();
    assert_eq!(lin.len(), 7 * cfg.num_hidden_layers);
    for (n, w) in &lin {
        let (_, orig) = ck.tensor(n).unwrap();
        assert_eq!(w, &deco_quant::nf4::Nf4Tensor::quantize(&orig, 64).unwrap().dequantize(), "{n}");
        assert_ne!(w, &orig);
    }
    let q = |n: &str| -> deco_model::Result<(Vec<usize>, Vec<f32>)> {
        match lin.get(n) {
            Some(w) => Ok((ck.tensor(n)?.0, w.clone())),
            None => src(n),
        }
    };
    let dev = Device::flex().autodiff();
    let base = StudentModel::from_source(cfg, &q, &dev).unwrap().no_grad();
    let before = base.to_hf_tensors(cfg).unwrap();
    let lc = LoraConfig { r: 4, lora_alpha: 8.0, lora_dropout: 0.05, target_modules: parse_target_modules(&["all-linear"]).unwrap(), use_rslora: false };
    let data = toy_data(cfg.vocab_size);
    let tc = LoraTrainConfig { steps: 30, batch_size: 4, seqlen: 16, lr: 1e-2, seed: 1, clip_norm: Some(1.0) };
    let eval = |ad: Option<&LoraAdapters>| -> f64 {
        let plain = Device::flex();
        let b = StudentModel::from_source(cfg, &q, &plain).unwrap();
        let m = ad.map(|a| HostAdapters::from_module(a, cfg, &lc).unwrap().to_module(cfg, &plain));
        completion_loss(&b, m.as_ref().map(|m| (m, &lc)), cfg, &data, 16, 0, 5).unwrap().0
    };
    let loss0 = eval(None);
    let mut saved = Vec::new();
    let (ad, log) = train_lora(&base, LoraAdapters::init(cfg, &lc, 0, &dev).unwrap(), cfg, &lc, &data, 0, &tc, 0, 10, &mut |_| {}, &mut |s, a| {
        saved.push((s, HostAdapters::from_module(a, cfg, &lc)?));
        Ok(())
    })
    .unwrap();
    assert_eq!(log.len(), 30);
    assert_eq!(saved.iter().map(|s| s.0).collect::<Vec<_>>(), vec![10, 20, 30]);
    let loss1 = eval(Some(&ad));
    eprintln!("answer loss {loss0:.4} -> {loss1:.4}; train loss {:.4} -> {:.4}", log[0].loss, log[29].loss);
    assert!(loss1 < loss0 * 0.8, "{loss0} -> {loss1}");
    // The base did not move (no gradient reached it).
    let after = base.to_hf_tensors(cfg).unwrap();
    for n in hf_tensor_names(cfg) {
        assert_eq!(before[&n], after[&n], "{n} changed");
    }
    // B left zero.
    assert!(saved[2].1.weights.values().any(|(_, b)| b.iter().any(|&v| v != 0.0)));
    // Resume from step 20 for 10 steps: the same batches and dropout masks, so the same loss
    // at step 21 as the uninterrupted run would have had with fresh Adam moments there.
    let mut log2 = Vec::new();
    let (_, tail) = train_lora(&base, saved[1].1.to_module(cfg, &dev), cfg, &lc, &data, 0, &tc, 20, 0, &mut |r| log2.push(r.step), &mut |_, _| Ok(())).unwrap();
    assert_eq!(log2, (21..=30).collect::<Vec<_>>());
    assert!((tail[0].loss - log[20].loss).abs() < 1e-5, "step 21 loss {} vs {}", tail[0].loss, log[20].loss);
}

/// Dropout is active in training only, and inverted-scaled (its mean is the identity).
#[test]
fn dropout_only_in_training() {
    let dev = Device::flex();
    let ck = tiny("llama3");
    let cfg = &ck.config;
    let src = |n: &str| -> deco_model::Result<(Vec<usize>, Vec<f32>)> { Ok(ck.tensor(n)?) };
    let base = StudentModel::from_source(cfg, &src, &dev).unwrap();
    let lc = LoraConfig { r: 2, lora_alpha: 4.0, lora_dropout: 0.5, target_modules: parse_target_modules(&["o_proj"]).unwrap(), use_rslora: false };
    let module = random_adapters(cfg, &lc, 1).to_module(cfg, &dev);
    let batch = ids(cfg.vocab_size, 1, 8, 0);
    let e1 = host(lora_forward(&base, &module, cfg, &lc, &batch, false).unwrap());
    let e2 = host(lora_forward(&base, &module, cfg, &lc, &batch, false).unwrap());
    assert_eq!(e1, e2);
    dev.seed(7);
    let t1 = host(lora_forward(&base, &module, cfg, &lc, &batch, true).unwrap());
    assert!(max_diff(&t1, &e1) > 1e-4, "dropout had no effect in training");
}

fn err_of<T: std::fmt::Debug>(r: deco_compress::Result<T>) -> String {
    r.unwrap_err().to_string()
}

/// Bad hyper-parameters, module names and adapter files are clear errors naming the problem.
#[test]
fn bad_input_is_a_clear_error() {
    let ck = tiny("llama3");
    let cfg = &ck.config;
    let dev = Device::flex();
    let ok = LoraConfig { r: 2, lora_alpha: 4.0, lora_dropout: 0.0, target_modules: vec![Linear::Q], use_rslora: false };
    for (c, needle) in [
        (LoraConfig { r: 0, ..ok.clone() }, "`r`"),
        (LoraConfig { lora_alpha: 0.0, ..ok.clone() }, "lora_alpha"),
        (LoraConfig { lora_alpha: -1.0, ..ok.clone() }, "lora_alpha"),
        (LoraConfig { lora_alpha: f64::NAN, ..ok.clone() }, "lora_alpha"),
        (LoraConfig { lora_dropout: 1.0, ..ok.clone() }, "lora_dropout"),
        (LoraConfig { lora_dropout: -0.1, ..ok.clone() }, "lora_dropout"),
        (LoraConfig { target_modules: vec![], ..ok.clone() }, "target_modules"),
    ] {
        let e = err_of(c.validate());
        assert!(e.contains(needle), "{e}");
        let e = err_of(LoraAdapters::init(cfg, &c, 0, &dev));
        assert!(e.contains(needle), "{e}");
    }
    let e = err_of(parse_target_modules(&["q_proj", "qkv_proj"]));
    assert!(e.contains("qkv_proj") && e.contains("target_modules"), "{e}");
    assert!(err_of(parse_target_modules::<&str>(&[])).contains("target_modules"));
    let e = err_of(LoraTrainConfig { lr: 0.0, ..LoraTrainConfig::default() }.validate());
    assert!(e.contains("lr"), "{e}");

    let tmp = tempfile::tempdir().unwrap();
    let good = random_adapters(cfg, &LoraConfig { target_modules: vec![Linear::Q, Linear::Down], ..ok.clone() }, 2);
    let dir = tmp.path().join("a");
    good.save(&dir, "m", &serde_json::json!({})).unwrap();
    // Another architecture: wider hidden size, fewer layers.
    let mut wide = cfg.clone();
    wide.hidden_size = 64;
    let e = err_of(HostAdapters::load(&dir, &wide));
    assert!(e.contains("shape") && e.contains("another architecture"), "{e}");
    let mut shallow = cfg.clone();
    shallow.num_hidden_layers = 1;
    let e = err_of(HostAdapters::load(&dir, &shallow));
    assert!(e.contains("layer 1") && e.contains("1 layers"), "{e}");
    // Missing directory / files.
    assert!(err_of(HostAdapters::load(&tmp.path().join("none"), cfg)).contains("adapter_config.json"));
    // Config edits: rank 0, another PEFT method, DoRA, a module not in target_modules, a
    // rank that does not match the tensors.
    let conf_path = dir.join("adapter_config.json");
    let conf: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&conf_path).unwrap()).unwrap();
    for (k, v, needle) in [
        ("r", serde_json::json!(0), "`r`"),
        ("r", serde_json::json!(3), "shape"),
        ("lora_alpha", serde_json::json!(-2), "lora_alpha"),
        ("lora_dropout", serde_json::json!(1.5), "lora_dropout"),
        ("peft_type", serde_json::json!("PREFIX_TUNING"), "not LoRA"),
        ("use_dora", serde_json::json!(true), "DoRA"),
        ("target_modules", serde_json::json!(["q_proj"]), "down_proj"),
        ("target_modules", serde_json::json!(["q_proj", "dense"]), "dense"),
    ] {
        let mut c = conf.clone();
        c[k] = v;
        std::fs::write(&conf_path, serde_json::to_string(&c).unwrap()).unwrap();
        let e = err_of(HostAdapters::load(&dir, cfg));
        assert!(e.contains(needle), "{k}: {e}");
    }
    std::fs::write(&conf_path, serde_json::to_string(&conf).unwrap()).unwrap();
    assert!(HostAdapters::load(&dir, cfg).is_ok());
    // A weights file whose tensors are not Llama decoder LoRA factors.
    let data = vec![0u8; 4 * 4];
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![2, 2], &data).unwrap();
    safetensors::serialize_to_file(vec![("base_model.model.transformer.h.0.attn.c_attn.lora_A.weight".to_string(), view)], None, &dir.join("adapter_model.safetensors")).unwrap();
    let e = err_of(HostAdapters::load(&dir, cfg));
    assert!(e.contains("c_attn") && e.contains("another architecture"), "{e}");
    // Adapters of another layer count given to the forward.
    let base = StudentModel::from_source(cfg, &|n: &str| Ok(ck.tensor(n)?), &dev).unwrap();
    let short = LoraAdapters { layers: Vec::new() };
    let e = err_of(lora_forward(&base, &short, cfg, &ok, &ids(cfg.vocab_size, 1, 4, 0), false));
    assert!(e.contains("layers"), "{e}");
    let _ = base.no_grad();
}
