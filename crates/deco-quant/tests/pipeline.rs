//! Whole-model methods of `pipeline::quantize_model` on a tiny random Llama whose residual stream
//! has planted outlier channels (large embedding values and RMSNorm weights in a few channels,
//! the pattern of real LLM activations): AWQ beats RTN at W3, SmoothQuant W8A8 and LLM.int8()
//! beat naive W8A8 (per-channel int8 weights + per-token int8 activations), each measured as the
//! logit error of the full model against the f32 model on held-out windows. Also: the
//! `deco_act_quant.json` round trip, `export::quantize_linears` = the pipeline's integer forms,
//! and parameter errors.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::collections::{BTreeMap, HashMap};

use burn::tensor::Device;
use deco_formats::config::ModelConfig;
use deco_model::calibrate::{CalibDtype, Calibrator, LayerWeights, Linear};
use deco_model::decoder::{LayerHook, NoHook};
use deco_model::host::to_host;
use deco_quant::Error;
use deco_quant::awq::AwqConfig;
use deco_quant::export::quantize_linears;
use deco_quant::pipeline::{Method, QuantizedModel, quantize_model};
use deco_quant::scheme::{Granularity, Scheme};
use deco_quant::smooth::{ActMode, ActQuant};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const HIDDEN: usize = 64;
const INTER: usize = 128;
const VOCAB: usize = 96;
const LAYERS: usize = 2;
const OUTLIERS: [usize; 3] = [5, 21, 40];

fn randn(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let u1: f64 = rng.random_range(1e-12..1.0);
            let u2: f64 = rng.random_range(0.0..1.0);
            ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
        })
        .collect()
}

fn config() -> ModelConfig {
    // One directory per call: the tests of this file run in parallel in one process.
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("config.json");
    let v = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
        "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": LAYERS,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 128, "tie_word_embeddings": true, "rms_norm_eps": 1e-5,
    });
    std::fs::write(&p, v.to_string()).unwrap();
    ModelConfig::from_hf_json(&p).unwrap()
}

/// Random weights; the embedding and both RMSNorms of every layer are 8-20x larger in the
/// `OUTLIERS` channels, so every linear reading a norm output sees outlier input channels.
fn weights(cfg: &ModelConfig) -> HashMap<String, (Vec<usize>, Vec<f32>)> {
    let mut rng = ChaCha8Rng::seed_from_u64(42);
    let mut m = HashMap::new();
    let mut emb = randn(&mut rng, VOCAB * HIDDEN);
    for t in 0..VOCAB {
        for (k, &c) in OUTLIERS.iter().enumerate() {
            emb[t * HIDDEN + c] *= 8.0 + 4.0 * k as f32;
        }
    }
    m.insert("model.embed_tokens.weight".to_string(), (vec![VOCAB, HIDDEN], emb));
    let norm = |rng: &mut ChaCha8Rng| -> Vec<f32> {
        let mut n: Vec<f32> = randn(rng, HIDDEN).iter().map(|v| 1.0 + 0.1 * v).collect();
        for (k, &c) in OUTLIERS.iter().enumerate() {
            n[c] *= 10.0 + 5.0 * k as f32;
        }
        n
    };
    for li in 0..LAYERS {
        for l in Linear::ALL {
            let (o, i) = l.dims(cfg);
            let w: Vec<f32> = randn(&mut rng, o * i).iter().map(|v| v / (i as f32).sqrt()).collect();
            m.insert(format!("model.layers.{li}.{}.weight", l.hf_suffix()), (vec![o, i], w));
        }
        m.insert(format!("model.layers.{li}.input_layernorm.weight"), (vec![HIDDEN], norm(&mut rng)));
        m.insert(format!("model.layers.{li}.post_attention_layernorm.weight"), (vec![HIDDEN], norm(&mut rng)));
    }
    m.insert("model.norm.weight".to_string(), (vec![HIDDEN], vec![1.0; HIDDEN]));
    m
}

fn windows(seed: u64, n: usize, len: usize) -> Vec<Vec<u32>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| (0..len).map(|_| rng.random_range(0..VOCAB as u32)).collect()).collect()
}

/// Logits of all positions of `eval` windows through `src` with an optional activation hook.
fn logits(cfg: &ModelConfig, dev: &Device, src: &deco_quant::pipeline::TensorFn<'_>, eval: &[Vec<u32>], hook: Option<&dyn LayerHook>) -> Vec<f32> {
    let lens: Vec<usize> = eval.iter().map(Vec::len).collect();
    let c = Calibrator::new(cfg, dev, &lens).unwrap();
    let (_, embed) = src("model.embed_tokens.weight").unwrap();
    let (_, norm) = src("model.norm.weight").unwrap();
    let mut layers = |li: usize| LayerWeights::fetch(cfg, li, src);
    to_host(c.forward_logits(eval, &embed, &mut layers, &norm, &embed, hook.unwrap_or(&NoHook)).unwrap()).unwrap()
}

fn err(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum::<f64>() / a.len() as f64
}

struct Fixture {
    cfg: ModelConfig,
    dev: Device,
    w: HashMap<String, (Vec<usize>, Vec<f32>)>,
    calib: Vec<Vec<u32>>,
    eval: Vec<Vec<u32>>,
}

impl Fixture {
    fn new() -> Self {
        let cfg = config();
        let w = weights(&cfg);
        Self { cfg, dev: Device::flex(), w, calib: windows(1, 8, 32), eval: windows(2, 4, 32) }
    }

    fn src(&self) -> impl Fn(&str) -> deco_model::Result<(Vec<usize>, Vec<f32>)> + '_ {
        move |n: &str| self.w.get(n).cloned().ok_or_else(|| deco_model::Error::InvalidInput(format!("no tensor {n}")))
    }

    fn quantize(&self, method: &Method, scheme: &Scheme) -> deco_quant::Result<QuantizedModel> {
        let src = self.src();
        quantize_model(&self.cfg, &src, &self.dev, &self.calib, method, scheme, CalibDtype::F32, &mut |_| {})
    }

    /// Logit MSE of a quantized model (with its activation hook, or `hook` if given).
    fn error(&self, q: &QuantizedModel, hook: Option<&dyn LayerHook>) -> f64 {
        let src = self.src();
        let base = logits(&self.cfg, &self.dev, &src, &self.eval, None);
        let qs = q.source(&src);
        let hook = hook.or(q.act_quant.as_ref().map(|a| a as &dyn LayerHook));
        err(&logits(&self.cfg, &self.dev, &qs, &self.eval, hook), &base)
    }
}

#[test]
fn model_methods_beat_rtn_on_planted_outliers() {
    let f = Fixture::new();
    // AWQ vs RTN, W3 g32 asym: the scale search protects the salient (outlier) input channels.
    let w3 = Scheme { bits: 3, sym: false, granularity: Granularity::PerGroup(32) };
    let rtn = f.quantize(&Method::Rtn, &w3).unwrap();
    let awq = f.quantize(&Method::Awq(AwqConfig { search_windows: 8, ..AwqConfig::default() }), &w3).unwrap();
    let (e_rtn, e_awq) = (f.error(&rtn, None), f.error(&awq, None));
    assert!(e_awq < 0.8 * e_rtn, "awq {e_awq} rtn {e_rtn}");
    // AWQ changed the norms (scales folded in) and kept integer forms of all linears.
    assert_eq!(awq.other.len(), 2 * LAYERS);
    assert_eq!(awq.quantized.len(), 7 * LAYERS);
    assert!((awq.bits_per_weight() - rtn.bits_per_weight()).abs() < 1e-12);

    // W8A8: naive = per-channel int8 weights (LLM.int8()'s) + per-token int8 activations.
    let any = Scheme { bits: 8, sym: true, granularity: Granularity::PerChannel };
    let int8 = f.quantize(&Method::LlmInt8 { threshold: 6.0, auto: false }, &any).unwrap();
    let naive_hook = ActQuant { mode: ActMode::PerToken, columns: BTreeMap::new() };
    let e_naive = f.error(&int8, Some(&naive_hook));
    let e_int8 = f.error(&int8, None);
    assert!(e_int8 < 0.5 * e_naive, "llm.int8 {e_int8} naive w8a8 {e_naive}");
    let sq = f.quantize(&Method::SmoothQuant { alpha: 0.5 }, &any).unwrap();
    let e_sq = f.error(&sq, None);
    assert!(e_sq < e_naive, "smoothquant {e_sq} naive w8a8 {e_naive}");
    // The automatic LLM.int8() variant flags only planted channels at the norm-output sites,
    // at least the largest one (mean + 3σ is inflated by the outliers themselves, so the
    // smallest planted channel can stay below the cut).
    let auto = f.quantize(&Method::LlmInt8 { threshold: 6.0, auto: true }, &any).unwrap();
    let aq = auto.act_quant.as_ref().unwrap();
    for li in 0..LAYERS {
        for site in [0usize, 2] {
            let cols = &aq.columns[&(li, site)];
            assert!(cols.contains(&40) && cols.iter().all(|c| OUTLIERS.contains(&(*c as usize))), "layer {li} site {site}: {cols:?}");
        }
    }
    let e_auto = f.error(&auto, None);
    assert!(e_auto < e_naive, "llm.int8 auto {e_auto} naive w8a8 {e_naive}");
    // JSON round trip of every activation scheme.
    for q in [&int8, &sq, &auto] {
        let a = q.act_quant.as_ref().unwrap();
        assert_eq!(&ActQuant::from_json(&a.to_json()).unwrap(), a);
    }
}

#[test]
fn quantize_linears_is_the_pipeline_loop() {
    let f = Fixture::new();
    let src = f.src();
    let s = Scheme { bits: 4, sym: true, granularity: Granularity::PerGroup(48) }; // ragged on 64
    let q = quantize_linears(&f.cfg, &src, &f.dev, &[], &Method::Rtn, &s, CalibDtype::F32, &mut |_| {}).unwrap();
    let m = f.quantize(&Method::Rtn, &s).unwrap();
    assert_eq!(q, m.quantized);
    assert_eq!(q["model.layers.0.self_attn.q_proj.weight"].groups(), 2);
    assert!(matches!(
        quantize_linears(&f.cfg, &src, &f.dev, &f.calib, &Method::Awq(AwqConfig::default()), &s, CalibDtype::F32, &mut |_| {}),
        Err(Error::InvalidParameter { name: "method", .. })
    ));
}

#[test]
fn bad_parameters_are_named() {
    let f = Fixture::new();
    let src = f.src();
    let s = Scheme { bits: 4, sym: false, granularity: Granularity::PerChannel };
    let name = |r: deco_quant::Result<QuantizedModel>| match r {
        Err(Error::InvalidParameter { name, .. }) => name,
        other => panic!("expected an invalid parameter, got {:?}", other.map(|_| ())),
    };
    assert_eq!(name(f.quantize(&Method::SmoothQuant { alpha: 1.5 }, &s)), "alpha");
    assert_eq!(name(f.quantize(&Method::SmoothQuant { alpha: -0.1 }, &s)), "alpha");
    assert_eq!(name(f.quantize(&Method::LlmInt8 { threshold: 0.0, auto: false }, &s)), "threshold");
    assert_eq!(name(f.quantize(&Method::Rtn, &Scheme { bits: 5, ..s })), "bits");
    assert_eq!(name(f.quantize(&Method::Awq(AwqConfig::default()), &Scheme { granularity: Granularity::PerGroup(0), ..s })), "group_size");
    let empty = quantize_model(&f.cfg, &src, &f.dev, &[], &Method::Awq(AwqConfig::default()), &s, CalibDtype::F32, &mut |_| {});
    assert!(matches!(empty, Err(Error::Calibration(_))));
    let empty = quantize_model(&f.cfg, &src, &f.dev, &[], &Method::SmoothQuant { alpha: 0.5 }, &s, CalibDtype::F32, &mut |_| {});
    assert!(matches!(empty, Err(Error::Calibration(_))));
    assert!(ActQuant::from_json(&serde_json::json!({"activations": "per_token_int8", "outliers": "threshold"})).is_err());
}

/// `layer_output_errors` against two independent references: a candidate that scales one
/// linear by `1 + ε` has relative error exactly `ε²` there and 0 elsewhere; and for an RTN model
/// the error equals `‖X (W − Q)ᵀ‖² / ‖X Wᵀ‖²` with `X` captured from the base model's layers and
/// the products written out in f64.
#[test]
fn layer_output_errors_match_direct_products() {
    use deco_quant::pipeline::layer_output_errors;
    let f = Fixture::new();
    let src = f.src();
    let eps = 0.01f32;
    let target = "model.layers.1.mlp.down_proj.weight";
    let scaled = |n: &str| -> deco_model::Result<(Vec<usize>, Vec<f32>)> {
        let (s, mut d) = src(n)?;
        if n == target {
            d.iter_mut().for_each(|v| *v *= 1.0 + eps);
        }
        Ok((s, d))
    };
    let s4 = Scheme { bits: 4, sym: false, granularity: Granularity::PerGroup(32) };
    let rtn = f.quantize(&Method::Rtn, &s4).unwrap();
    let rtn_src = rtn.source(&src);
    let rows = layer_output_errors(&f.cfg, &src, &[&scaled, &rtn_src], &f.dev, &f.eval, &mut |_| {}).unwrap();
    assert_eq!(rows.len(), 7 * LAYERS);
    // Direct: capture each layer's site inputs from the base model, then the products.
    let lens: Vec<usize> = f.eval.iter().map(Vec::len).collect();
    let c = Calibrator::new(&f.cfg, &f.dev, &lens).unwrap();
    let (_, embed) = src("model.embed_tokens.weight").unwrap();
    let mut x = c.embed(&embed, &f.eval).unwrap();
    let n = c.tokens();
    for li in 0..LAYERS {
        let lw = LayerWeights::fetch(&f.cfg, li, &src).unwrap();
        let dl = c.upload(&lw);
        // The output-less capture (Wanda's and SparseGPT's) gives the same inputs, bit for bit.
        let sites = c.site_inputs(&dl, x.clone()).unwrap();
        let (inputs, y) = c.layer_capture(&dl, x).unwrap();
        for (a, b) in sites.iter().zip(&inputs) {
            assert_eq!(to_host(a.clone()).unwrap(), to_host(b.clone()).unwrap(), "layer {li}: site_inputs differs from layer_capture");
        }
        for l in Linear::ALL {
            let (o, i) = l.dims(&f.cfg);
            let xin = to_host(inputs[l.site() as usize].clone()).unwrap();
            let w = lw.linear(l);
            let q = &rtn.linears[&format!("model.layers.{li}.{}.weight", l.hf_suffix())];
            let (mut num, mut den) = (0.0f64, 0.0f64);
            for t in 0..n {
                for r in 0..o {
                    let (mut a, mut b) = (0.0f64, 0.0f64);
                    for k in 0..i {
                        let xv = xin[t * i + k] as f64;
                        a += xv * w[r * i + k] as f64;
                        b += xv * q[r * i + k] as f64;
                    }
                    den += a * a;
                    num += (a - b) * (a - b);
                }
            }
            let row = rows.iter().find(|e| e.layer == li && e.linear == l).unwrap();
            let want_scaled = if li == 1 && l == Linear::Down { (eps as f64).powi(2) } else { 0.0 };
            assert!((row.rel[0] - want_scaled).abs() <= 1e-4 * want_scaled + 1e-12, "layer {li} {l:?}: {} vs {want_scaled}", row.rel[0]);
            let want = num / den;
            assert!(want > 0.0 && (row.rel[1] - want).abs() <= 1e-3 * want, "layer {li} {l:?}: {} vs direct {want}", row.rel[1]);
        }
        x = y;
    }
    assert!(matches!(layer_output_errors(&f.cfg, &src, &[&scaled], &f.dev, &[], &mut |_| {}), Err(Error::Calibration(_))));
}
