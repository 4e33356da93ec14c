//! The layer-by-layer `Calibrator` against `Llama::forward` on the real SmolLM2 weights, and the
//! (ignored, long) quantization table of `docs/quantization.md`:
//! `cargo test --release -p deco-tests --test quant_calib -- --ignored --nocapture`.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::sync::OnceLock;
use std::time::Instant;

use burn::tensor::Device;
use deco_formats::checkpoint::Checkpoint;
use deco_formats::tokenizer::Tokenizer;
use deco_formats::gguf::GgufFile;
use deco_model::calibrate::{Calibrator, LayerWeights, to_host};
use deco_model::{DenseKvCache, Llama, LogitsWanted, SeqInput};
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

#[test]
fn calibrator_matches_llama_forward() {
    let ck = ckpt();
    let dev = device();
    let model = Llama::load(ck, &dev, Some(64)).unwrap();
    let windows = vec![vec![1u32, 504, 3458, 282, 4114, 314, 260, 1345, 30, 216, 1000, 42], vec![7u32, 8, 9, 10, 11]];
    let mut want = Vec::new();
    for w in &windows {
        let mut cache = DenseKvCache::new(model.num_layers());
        want.extend(model.forward(&[SeqInput { seq: 0, tokens: w }], &mut cache, LogitsWanted::All).unwrap().logits_rows().unwrap());
    }
    let cfg = &ck.config;
    let c = Calibrator::new(cfg, &dev, &[12, 5]).unwrap();
    let (_, embed) = ck.tensor("model.embed_tokens.weight").unwrap();
    let (_, norm) = ck.tensor("model.norm.weight").unwrap();
    let src = |n: &str| -> deco_model::Result<(Vec<usize>, Vec<f32>)> { Ok(ck.tensor(n)?) };
    let mut layers = |li: usize| LayerWeights::fetch(cfg, li, &src);
    let got = to_host(c.forward_logits(&windows, &embed, &mut layers, &norm, &embed, None).unwrap()).unwrap();
    let v = cfg.vocab_size;
    assert_eq!(got.len(), 17 * v);
    let mut max = 0.0f32;
    for (r, row) in want.iter().enumerate() {
        for (a, b) in row.iter().zip(&got[r * v..(r + 1) * v]) {
            max = max.max((a - b).abs());
        }
    }
    assert!(max < 2e-3, "max logit difference {max}");
    assert!(Calibrator::new(cfg, &dev, &[]).is_err());
    assert!(calibration_windows(&[1, 2, 3], 4, 8, 0).is_err());
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
            let rows = model.forward(&[SeqInput { seq: 0, tokens: win }], &mut cache, LogitsWanted::All).unwrap().logits_rows().unwrap();
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
        let q = quantize_model(cfg, &src, &dev, &windows, &method, &scheme, &mut |_| {}).unwrap();
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
