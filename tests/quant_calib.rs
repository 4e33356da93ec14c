//! The layer-by-layer `Calibrator` against the float64 reference on the real SmolLM2 weights, and the
//! (ignored, long) quantization table of `docs/quantization.md`:
//! `cargo test --release -p deco-tests --test quant_calib -- --ignored --nocapture`.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::sync::OnceLock;
use std::time::Instant;

use burn::tensor::Device;
use deco_formats::checkpoint::Checkpoint;
use deco_formats::tokenizer::Tokenizer;
use deco_formats::gguf::GgufFile;
use deco_model::calibrate::{CalibDtype, Calibrator, LayerWeights, Linear};
use deco_model::decoder::NoHook;
use deco_model::host::to_host;
use deco_model::{DenseKvCache, Llama, LogitsWanted, SeqInput};
use deco_tests::{golden, ids, max_abs_diff};
use deco_quant::gptq::GptqConfig;
use deco_quant::pipeline::{Method, calibration_windows, quantize_model};
use deco_quant::scheme::{Granularity, Scheme};

fn ckpt() -> &'static Checkpoint {
    static C: OnceLock<Checkpoint> = OnceLock::new();
    C.get_or_init(|| Checkpoint::open(deco_tests::smollm2_gguf()).expect("open SmolLM2"))
}

fn device() -> Device {
    deco_kernels::select_device("flex").expect("flex device")
}

/// The golden file's first two prompts as two calibration windows: their calibrator, the
/// windows and the embedding matrix.
fn golden_windows() -> (Calibrator, Vec<Vec<u32>>, Vec<f32>) {
    let ck = ckpt();
    let g = golden();
    let windows = vec![ids(&g.prompts[0]["ids"]), ids(&g.prompts[1]["ids"])];
    let lens: Vec<usize> = windows.iter().map(Vec::len).collect();
    let c = Calibrator::new(&ck.config, &device(), &lens).unwrap();
    let (_, embed) = ck.tensor("model.embed_tokens.weight").unwrap();
    (c, windows, embed)
}

/// The whole model's logits through `c` over `windows` (`[tokens, vocab]`, host), the tied
/// embedding as LM head, layers fetched one at a time.
fn model_logits(c: &Calibrator, windows: &[Vec<u32>], embed: &[f32]) -> Vec<f32> {
    let ck = ckpt();
    let (_, norm) = ck.tensor("model.norm.weight").unwrap();
    let src = |n: &str| -> deco_model::Result<(Vec<usize>, Vec<f32>)> { Ok(ck.tensor(n)?) };
    let mut layers = |li: usize| LayerWeights::fetch(&ck.config, li, &src);
    to_host(c.forward_logits(windows, embed, &mut layers, &norm, embed, &NoHook).unwrap()).unwrap()
}

/// The calibrator runs the one decoder layer (`deco_model::decoder::Pass`) over windows without
/// a cache; its logits are checked against the independent float64 reference: every position of
/// prompt 0 and the last position of prompt 1, both windows in one pass.
#[test]
fn calibrator_matches_float64_reference() {
    let ck = ckpt();
    let dev = device();
    let g = golden();
    let cfg = &ck.config;
    let (c, windows, embed) = golden_windows();
    let lens: Vec<usize> = windows.iter().map(Vec::len).collect();
    let got = model_logits(&c, &windows, &embed);
    let v = cfg.vocab_size;
    assert_eq!(got.len(), (lens[0] + lens[1]) * v);
    let (shape, all0) = &g.tensors["prompt0.all_logits"];
    assert_eq!(shape, &vec![lens[0], v]);
    let err0 = max_abs_diff(&got[..lens[0] * v], all0);
    let last1 = &g.tensors["prompt1.last_logits"].1;
    let end = (lens[0] + lens[1]) * v;
    let err1 = max_abs_diff(&got[end - v..end], last1);
    eprintln!("calibrator vs float64 reference: prompt 0 all positions {err0:.3e}, prompt 1 last {err1:.3e}");
    assert!(err0 <= 2e-3 && err1 <= 2e-3, "max logit error {err0} / {err1}");
    assert!(Calibrator::new(cfg, &dev, &[]).is_err());
    assert!(calibration_windows(&[1, 2, 3], 4, 8, 0).is_err());
}

/// The calibrator's logits in `dtype` against the float64 reference over every position of
/// prompt 0: `(max abs error, mean abs error, positions whose argmax is the reference's,
/// positions)`; `None` where `available` is false, after checking that the dtype is refused.
fn low_precision_logits(dtype: CalibDtype, available: bool) -> Option<(f32, f64, usize, usize)> {
    let ck = ckpt();
    let g = golden();
    let cfg = &ck.config;
    let (c, windows, embed) = golden_windows();
    if !available {
        assert!(c.with_dtype(dtype).is_err());
        return None;
    }
    let c = c.with_dtype(dtype).unwrap();
    assert_eq!(c.dtype(), dtype);
    let lens: Vec<usize> = windows.iter().map(Vec::len).collect();
    let got = model_logits(&c, &windows, &embed);
    let v = cfg.vocab_size;
    let all0 = &g.tensors["prompt0.all_logits"].1;
    let argmax = |r: &[f32]| r.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i);
    let (mut worst, mut sum, mut same) = (0.0f32, 0.0f64, 0usize);
    for t in 0..lens[0] {
        let (a, b) = (&got[t * v..(t + 1) * v], &all0[t * v..(t + 1) * v]);
        worst = worst.max(max_abs_diff(a, b));
        sum += a.iter().zip(b).map(|(x, y)| (x - y).abs() as f64).sum::<f64>() / v as f64;
        same += usize::from(argmax(a) == argmax(b));
    }
    let mean = sum / lens[0] as f64;
    eprintln!("{dtype:?} calibrator vs float64 reference: max logit error {worst:.3e}, mean {mean:.3e}, argmax equal at {same}/{}", lens[0]);
    Some((worst, mean, same, lens[0]))
}

/// The bf16 calibration products (`CalibDtype::Bf16`) against the same float64 reference: the
/// whole model's logits stay within the error that rounding every linear's inputs to 8
/// significant bits explains, and the argmax token is the reference's nearly everywhere. Where
/// the CPU lacks AVX-512 BF16 the dtype is refused instead.
#[test]
fn bf16_calibrator_stays_near_float64_reference() {
    let Some((worst, mean, same, n)) = low_precision_logits(CalibDtype::Bf16, deco_kernels::bf16::available()) else {
        return;
    };
    assert!(worst <= 0.5 && mean <= 0.05, "bf16 logits error max {worst} mean {mean}");
    assert!(same * 20 >= n * 19, "argmax equal at only {same} of {n} positions");
}

/// The 16-bit block-scaled integer products (`CalibDtype::Int16`) against the same reference:
/// 13.5 bits relative to each block of 64 values (a block holding one of SmolLM2's outlier
/// activations leaves its other values fewer), within bf16's bounds with room (measured on
/// 2026-12-07, AVX2 Zen 3: max 6.8e-2, mean 1.15e-2, argmax equal everywhere). Where the CPU
/// lacks AVX2 the dtype is refused instead.
#[test]
fn int16_calibrator_stays_near_float64_reference() {
    let Some((worst, mean, same, n)) = low_precision_logits(CalibDtype::Int16, deco_kernels::int16::available()) else {
        return;
    };
    assert!(worst <= 0.2 && mean <= 0.03, "int16 logits error max {worst} mean {mean}");
    assert!(same * 20 >= n * 19, "argmax equal at only {same} of {n} positions");
}

/// `Calibrator::upload_replacing` (AWQ's candidates) gives the same layer as uploading the
/// modified weights from scratch: same attention and MLP outputs, bit for bit.
#[test]
fn upload_replacing_equals_a_fresh_upload() {
    let ck = ckpt();
    let cfg = &ck.config;
    let (c, windows, embed) = golden_windows();
    let src = |n: &str| -> deco_model::Result<(Vec<usize>, Vec<f32>)> { Ok(ck.tensor(n)?) };
    let lw = LayerWeights::fetch(cfg, 0, &src).unwrap();
    let x = c.embed(&embed, &windows).unwrap();
    let base = c.upload(&lw);
    let k2: Vec<f32> = lw.linear(Linear::K).iter().map(|v| v * 1.5).collect();
    let up2: Vec<f32> = lw.linear(Linear::Up).iter().map(|v| v * 0.5).collect();
    let mut changed = lw.clone();
    changed.linear_mut(Linear::K).clone_from(&k2);
    changed.linear_mut(Linear::Up).clone_from(&up2);
    let fresh = c.upload(&changed);
    let replaced = c.upload_replacing(&base, &lw, &[(Linear::K, &k2), (Linear::Up, &up2)]);
    let run = |d: &deco_model::decoder::DecoderLayer| -> Vec<f32> {
        let xn = c.attn_in(d, x.clone());
        let a = c.attention(d, xn).unwrap();
        let x2 = c.attn_residual(d, x.clone(), a).unwrap();
        let h = c.swiglu_out(d, c.mlp_in(d, x2.clone())).unwrap();
        to_host(c.mlp_residual(d, x2, h).unwrap()).unwrap()
    };
    let (want, got, old) = (run(&fresh), run(&replaced), run(&base));
    assert!(want.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()), "upload_replacing differs from a fresh upload");
    assert!(want != old, "the replaced linears changed nothing");
}

fn log_softmax(row: &[f32]) -> Vec<f32> {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln() + m;
    row.iter().map(|&x| (x as f64 - lse) as f32).collect()
}

struct Eval {
    ppl: Vec<f64>,
    kld: f64,
    top1: f64,
}

/// Perplexity on each text (4 windows of 256, no BOS; `deco eval ppl`'s protocol) and mean KL /
/// top-1 agreement against `base` log-probabilities (None: this is the base; returns them).
fn evaluate(model: &Llama, texts: &[Vec<u32>], base: Option<&[Vec<Vec<f32>>]>) -> (Eval, Vec<Vec<Vec<f32>>>) {
    let seqlen = 256;
    let (mut kl, mut agree, mut rows_n) = (0.0f64, 0usize, 0usize);
    let mut ppl = Vec::new();
    let mut all = Vec::new();
    for (ti, ids) in texts.iter().enumerate() {
        let mut lp_text = Vec::new();
        let (mut nll, mut count) = (0.0f64, 0usize);
        for w in 0..4 {
            let win = &ids[w * seqlen..(w + 1) * seqlen];
            let mut cache = DenseKvCache::new(model.num_layers());
            let rows = model.forward(&[SeqInput { seq: 0, tokens: win, tree: None }], &mut cache, LogitsWanted::All).unwrap().logits_rows().unwrap();
            for (r, row) in rows.iter().enumerate().take(seqlen - 1) {
                let lp = log_softmax(row);
                nll -= lp[win[r + 1] as usize] as f64;
                count += 1;
                if let Some(b) = base {
                    let bl = &b[ti][w * (seqlen - 1) + r];
                    kl += bl.iter().zip(&lp).map(|(&p, &q)| (p as f64).exp() * (p as f64 - q as f64)).sum::<f64>();
                    let am = |v: &[f32]| v.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0;
                    agree += usize::from(am(bl) == am(&lp));
                    rows_n += 1;
                } else {
                    lp_text.push(lp);
                }
            }
        }
        ppl.push((nll / count as f64).exp());
        all.push(lp_text);
    }
    let n = rows_n.max(1) as f64;
    (Eval { ppl, kld: kl / n, top1: if base.is_some() { agree as f64 / n } else { 1.0 } }, all)
}

fn tokens_of(tok: &Tokenizer, rel: &str, chars: usize) -> Vec<u32> {
    let text = std::fs::read_to_string(deco_tests::asset(rel)).unwrap();
    let text: String = text.chars().take(chars).collect();
    tok.encode_with(&text, false, true).unwrap()
}

#[test]
#[ignore = "long: quantizes SmolLM2 several times (tens of minutes on 2 cores)"]
fn quant_table() {
    let ck = ckpt();
    let dev = device();
    let cfg = &ck.config;
    let tok = Tokenizer::from_gguf(&GgufFile::open(deco_tests::smollm2_gguf()).unwrap()).unwrap();
    let texts = vec![tokens_of(&tok, "data/wiki_test.txt", 20000), tokens_of(&tok, "data/shakespeare/test.txt", 20000)];
    for t in &texts {
        assert!(t.len() >= 1024);
    }
    let calib_tokens = tokens_of(&tok, "data/wiki_train.txt", 400_000);
    let nsamples: usize = std::env::var("DECO_QUANT_NSAMPLES").ok().and_then(|v| v.parse().ok()).unwrap_or(16);
    let windows = calibration_windows(&calib_tokens, nsamples, 256, 0).unwrap();
    let src = |n: &str| -> deco_model::Result<(Vec<usize>, Vec<f32>)> { Ok(ck.tensor(n)?) };
    let base_model = Llama::load(ck, &dev, Some(512)).unwrap();
    let (e, base) = evaluate(&base_model, &texts, None);
    drop(base_model);
    println!("| method | scheme | bits/weight | wiki ppl | shakespeare ppl | KLD | top-1 | time (s) |");
    println!("|---|---|---|---|---|---|---|---|");
    println!("| f32 | - | 32 | {:.3} | {:.3} | 0 | 1 | - |", e.ppl[0], e.ppl[1]);
    let only = std::env::var("DECO_QUANT_ONLY").ok();
    let g = |bits, group_size| GptqConfig { bits, group_size, sym: false, damp_percent: 0.01, desc_act: false, static_groups: false, blocksize: 128, mse: 0.0 };
    let runs: Vec<(&str, &str, Method, Scheme)> = vec![
        ("rtn", "W8 per-channel", Method::Rtn, Scheme { bits: 8, sym: false, granularity: Granularity::PerChannel }),
        ("gptq", "W8 per-channel", Method::Gptq(g(8, None)), Scheme { bits: 8, sym: false, granularity: Granularity::PerChannel }),
        ("rtn", "W4 g192", Method::Rtn, Scheme { bits: 4, sym: false, granularity: Granularity::PerGroup(192) }),
        ("gptq", "W4 g192", Method::Gptq(g(4, Some(192))), Scheme { bits: 4, sym: false, granularity: Granularity::PerGroup(192) }),
        ("rtn", "W4 per-channel", Method::Rtn, Scheme { bits: 4, sym: false, granularity: Granularity::PerChannel }),
        ("gptq", "W4 per-channel", Method::Gptq(g(4, None)), Scheme { bits: 4, sym: false, granularity: Granularity::PerChannel }),
        ("rtn", "W3 g192", Method::Rtn, Scheme { bits: 3, sym: false, granularity: Granularity::PerGroup(192) }),
        ("gptq", "W3 g192", Method::Gptq(g(3, Some(192))), Scheme { bits: 3, sym: false, granularity: Granularity::PerGroup(192) }),
        ("nf4", "NF4 b64 DQ", Method::Nf4, Scheme { bits: 4, sym: true, granularity: Granularity::PerGroup(64) }),
    ];
    for (m, s, method, scheme) in runs {
        if let Some(o) = &only
            && !o.split(',').any(|x| format!("{m} {s}").contains(x))
        {
            continue;
        }
        let t0 = Instant::now();
        let q = quantize_model(cfg, &src, &dev, &windows, &method, &scheme, deco_model::calibrate::CalibDtype::F32, &mut |_| {}).unwrap();
        let secs = t0.elapsed().as_secs_f64();
        let qsrc = q.source(&src);
        let model = Llama::load_from(cfg, &qsrc, &dev, Some(512)).unwrap();
        let (e, _) = evaluate(&model, &texts, Some(&base));
        println!(
            "| {m} | {s} | {:.3} | {:.3} | {:.3} | {:.4} | {:.3} | {secs:.1} |",
            q.bits_per_weight(),
            e.ppl[0],
            e.ppl[1],
            e.kld,
            e.top1
        );
    }
}
