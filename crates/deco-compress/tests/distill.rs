//! The trainable student and the distillation losses.
//!
//! - the student's forward (the one decoder layer on trainable parameters) matches the float64
//!   reference of the tiny Llama-3 and Qwen2 checkpoints, and its weights round-trip to
//!   transformers tensors exactly;
//! - forward KL with τ, reverse KL, weighted CE and the CoT weighting equal hand computations;
//! - gradients reach the student and not the teacher;
//! - a short distillation run lowers the student's KL to the teacher (tiny model, structurally
//!   pruned student), and every objective runs.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::path::PathBuf;

use burn::module::Module;
use burn::tensor::{Device, Tensor, TensorData};
use deco_compress::distill::{
    CotExample, DistillConfig, batch_loss, DistillData, Objective, TokenKind, cot_loss, cot_sequence, cot_weights, cross_entropy_weighted, distill, forward_kl_loss, mean_kl,
    parse_gsm_jsonl, reverse_kl_loss,
};
use deco_compress::structured::{StructuredPlan, StructuredSpec, importance};
use deco_compress::student::StudentModel;
use deco_formats::checkpoint::{Checkpoint, hf_tensor_names};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use deco_model::Llama;

fn tiny(name: &str) -> Checkpoint {
    Checkpoint::open(PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/data/tiny")).join(name)).unwrap()
}

fn host(t: Tensor<2>) -> Vec<f32> {
    t.try_into_vec_as::<f32>().unwrap()
}

fn scalar(t: Tensor<1>) -> f64 {
    f64::from(t.try_into_vec_as::<f32>().unwrap()[0])
}

fn t2(v: &[f32], rows: usize, cols: usize, dev: &Device) -> Tensor<2> {
    Tensor::from_data(TensorData::new(v.to_vec(), [rows, cols]), dev)
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn seqs(vocab: usize, n: usize, len: usize, salt: usize) -> Vec<Vec<u32>> {
    (0..n).map(|w| (0..len).map(|t| ((t * 31 + w * 17 + salt * 7 + 3) % vocab) as u32).collect()).collect()
}

/// `ids` and `[tokens, vocab]` float64 logits of `tests/data/tiny/NAME/reference.safetensors`
/// (`tests/data/tiny/gen.py`: a numpy forward with transformers semantics, no deco code).
fn reference(name: &str) -> (Vec<u32>, Vec<f64>) {
    let path = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/data/tiny")).join(name).join("reference.safetensors");
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ids = st.tensor("ids").unwrap().data().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32).collect();
    let logits = st.tensor("logits").unwrap().data().chunks_exact(8).map(|b| f64::from_le_bytes(b.try_into().unwrap())).collect();
    (ids, logits)
}

/// The student runs the one decoder layer on trainable parameters; its logits (plain and
/// autodiff device, one sequence and a batch of windows) are checked against the float64
/// reference of the tiny Llama-3 and Qwen2 checkpoints.
#[test]
fn student_forward_matches_float64_reference_on_tiny_models() {
    let dev = Device::flex();
    for name in ["llama3", "qwen2"] {
        let ck = tiny(name);
        let cfg = &ck.config;
        let src = |n: &str| -> deco_model::Result<(Vec<usize>, Vec<f32>)> { Ok(ck.tensor(n)?) };
        let student = StudentModel::from_source(cfg, &src, &dev).unwrap();
        let (ids, want) = reference(name);
        let worst = |got: &[f32]| -> f64 {
            got.iter().zip(want.iter().cycle()).map(|(&g, &w)| (g as f64 - w).abs()).fold(0.0, f64::max)
        };
        let one = host(student.forward(cfg, std::slice::from_ref(&ids), false).unwrap());
        assert_eq!(one.len(), want.len());
        let d = worst(&one);
        eprintln!("{name}: max |student - float64 reference| logit = {d:e}");
        assert!(d <= 1e-4, "{name}: {d}");
        // Three windows in one pass, and the autodiff device: the same numbers.
        let batch = vec![ids.clone(), ids.clone(), ids.clone()];
        let ad = StudentModel::from_source(cfg, &src, &dev.clone().autodiff()).unwrap();
        for (what, m) in [("batch", &student), ("autodiff batch", &ad)] {
            let d = worst(&host(m.forward(cfg, &batch, false).unwrap()));
            assert!(d <= 1e-4, "{name} {what}: {d}");
        }
        // Weights round-trip exactly to transformers names and layout.
        let m = student.to_hf_tensors(cfg).unwrap();
        assert_eq!(m.len(), hf_tensor_names(cfg).len());
        for n in hf_tensor_names(cfg) {
            assert_eq!(m[&n], ck.tensor(&n).unwrap(), "{name}: {n}");
        }
        // Bad input is refused.
        assert!(student.forward(cfg, &[], false).is_err());
        assert!(student.forward(cfg, &[vec![1, 2], vec![1]], false).is_err());
        assert!(student.forward(cfg, &[vec![cfg.vocab_size as u32]], false).is_err());
    }
}

/// Softmax of `x / tau` in f64.
fn softmax(x: &[f32], tau: f64) -> Vec<f64> {
    let m = x.iter().map(|&v| f64::from(v) / tau).fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = x.iter().map(|&v| (f64::from(v) / tau - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|v| v / s).collect()
}

fn kl(p: &[f64], q: &[f64]) -> f64 {
    p.iter().zip(q).map(|(a, b)| a * (a / b).ln()).sum()
}

#[test]
fn losses_equal_hand_computation() {
    let dev = Device::flex();
    let s = [1.0f32, -0.5, 2.0, 0.3, 0.0, -1.0, 0.7, 0.2];
    let t = [0.5f32, 0.5, 1.0, -0.2, 2.0, -1.0, 0.1, 0.4];
    let (rows, v) = (2, 4);
    for tau in [1.0, 2.0, 0.5] {
        let mut fwd = 0.0;
        let mut rev = 0.0;
        for r in 0..rows {
            let ps = softmax(&s[r * v..(r + 1) * v], tau);
            let pt = softmax(&t[r * v..(r + 1) * v], tau);
            fwd += kl(&pt, &ps);
            rev += kl(&ps, &pt);
        }
        let want_fwd = tau * tau * fwd / rows as f64;
        let want_rev = rev / rows as f64;
        let got_fwd = scalar(forward_kl_loss(t2(&s, rows, v, &dev), t2(&t, rows, v, &dev), tau));
        let got_rev = scalar(reverse_kl_loss(t2(&s, rows, v, &dev), t2(&t, rows, v, &dev), tau));
        assert!((got_fwd - want_fwd).abs() < 1e-6, "tau {tau}: forward KL {got_fwd} vs {want_fwd}");
        assert!((got_rev - want_rev).abs() < 1e-6, "tau {tau}: reverse KL {got_rev} vs {want_rev}");
    }
    // KL of identical logits is 0.
    assert!(scalar(forward_kl_loss(t2(&s, rows, v, &dev), t2(&s, rows, v, &dev), 2.0)).abs() < 1e-6);

    // Weighted CE: -Σ w_i log p_i[label_i].
    let labels = [2u32, 0];
    let w = [0.25f32, 0.75];
    let want: f64 = (0..rows).map(|r| -f64::from(w[r]) * softmax(&s[r * v..(r + 1) * v], 1.0)[labels[r] as usize].ln()).sum();
    let got = scalar(cross_entropy_weighted(t2(&s, rows, v, &dev), &labels, &w).unwrap());
    assert!((got - want).abs() < 1e-6, "CE {got} vs {want}");
    assert!(cross_entropy_weighted(t2(&s, rows, v, &dev), &[2], &w).is_err());
    assert!(cross_entropy_weighted(t2(&s, rows, v, &dev), &[9, 0], &w).is_err());

    // CoT: L = mean CE(answer) + λ · mean CE(rationale); ignored rows do not count.
    let s6: Vec<f32> = (0..24).map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.3).collect();
    let labels6 = [1u32, 3, 0, 2, 2, 1];
    let kinds = [TokenKind::Ignore, TokenKind::Rationale, TokenKind::Rationale, TokenKind::Rationale, TokenKind::Answer, TokenKind::Answer];
    let ce = |r: usize| -softmax(&s6[r * 4..(r + 1) * 4], 1.0)[labels6[r] as usize].ln();
    for lambda in [0.0, 0.5, 2.0] {
        let want = (ce(4) + ce(5)) / 2.0 + lambda * (ce(1) + ce(2) + ce(3)) / 3.0;
        let got = scalar(cot_loss(t2(&s6, 6, 4, &dev), &labels6, &kinds, lambda).unwrap());
        assert!((got - want).abs() < 1e-5, "λ {lambda}: {got} vs {want}");
    }
    let w = cot_weights(&kinds, 0.5);
    assert_eq!(w[0], 0.0);
    assert!((w[1] - 0.5 / 3.0).abs() < 1e-7 && (w[4] - 0.5).abs() < 1e-7);
}

#[test]
fn gradients_reach_the_student_and_not_the_teacher() {
    let ad = Device::flex().autodiff();
    let ck = tiny("llama3");
    let cfg = &ck.config;
    let src = |n: &str| -> deco_model::Result<(Vec<usize>, Vec<f32>)> { Ok(ck.tensor(n)?) };
    let student = StudentModel::from_source(cfg, &src, &ad).unwrap();
    let batch = seqs(cfg.vocab_size, 2, 8, 2);
    let [rows, vocab] = student.forward(cfg, &batch, false).unwrap().dims();
    let tvals: Vec<f32> = (0..rows * vocab).map(|i| ((i * 13 % 17) as f32 - 8.0) * 0.2).collect();
    for objective in ["forward", "reverse"] {
        let s = student.forward(cfg, &batch, false).unwrap();
        let teacher = t2(&tvals, rows, vocab, &ad).require_grad();
        let loss = if objective == "forward" { forward_kl_loss(s.clone(), teacher.clone(), 2.0) } else { reverse_kl_loss(s.clone(), teacher.clone(), 1.0) };
        let grads = loss.backward();
        assert!(teacher.grad(&grads).is_none(), "{objective}: the teacher logits got a gradient");
        let g = student.layers[0].wqkv.val().grad(&grads).expect("student q/k/v gradient");
        let norm: f32 = g.abs().sum().into_scalar();
        assert!(norm > 0.0, "{objective}: zero student gradient");
        assert!(student.embed.val().grad(&grads).is_some());
    }
    // Frozen embeddings get no gradient, the decoder still does.
    let teacher = t2(&tvals, rows, vocab, &ad);
    let grads = forward_kl_loss(student.forward(cfg, &batch, true).unwrap(), teacher, 1.0).backward();
    assert!(student.embed.val().grad(&grads).is_none());
    assert!(student.layers[1].w_down.val().grad(&grads).is_some());
}

/// A structurally pruned tiny Llama-3 (half the heads per group, half the neurons) distilled from
/// the dense one: the KL to the teacher on held-out sequences drops.
#[test]
fn short_distillation_lowers_kl_to_teacher() {
    let dev = Device::flex();
    let ck = tiny("llama3");
    let cfg = &ck.config;
    let src = |n: &str| -> deco_model::Result<(Vec<usize>, Vec<f32>)> { Ok(ck.tensor(n)?) };
    let teacher = Llama::load_from(cfg, &src, &dev, None).unwrap();
    let wins = seqs(cfg.vocab_size, 4, 16, 5);
    let imp = importance(cfg, &src, &dev, &wins, &mut |_| {}).unwrap();
    let plan = StructuredPlan::from_importance(cfg, &imp, &StructuredSpec { heads: 0.5, neurons: 0.5, ..Default::default() }).unwrap();
    let pcfg = plan.config(cfg);
    let psrc = |n: &str| plan.pruned_tensor(cfg, &src, n);
    let student = StudentModel::from_source(&pcfg, &psrc, &dev.clone().autodiff()).unwrap();
    let tokens: Vec<u32> = (0..4000u32).map(|i| (i.wrapping_mul(2654435761) >> 7) % cfg.vocab_size as u32).collect();
    let held = seqs(cfg.vocab_size, 4, 24, 9);
    let before = mean_kl(&student.valid(), &pcfg, &teacher, &held).unwrap();
    let dc = DistillConfig { steps: 40, batch_size: 4, seqlen: 24, lr: 5e-3, temperature: 1.0, ..Default::default() };
    let mut checkpoints = Vec::new();
    let (trained, log) = distill(student, &pcfg, &teacher, &DistillData::Tokens(tokens.clone()), &dc, 0, 20, &mut |_| {}, &mut |s, _| {
        checkpoints.push(s);
        Ok(())
    })
    .unwrap();
    let after = mean_kl(&trained.valid(), &pcfg, &teacher, &held).unwrap();
    eprintln!("tiny pruned student: held-out KL {before:.4} -> {after:.4}; train loss {:.4} -> {:.4}", log[0].loss, log[log.len() - 1].loss);
    assert_eq!(log.len(), 40);
    assert_eq!(checkpoints, vec![20, 40]);
    assert!(after < 0.7 * before, "KL {before} -> {after}");

    // Resuming from step 30 runs only the remaining steps.
    let (_, log2) = distill(trained, &pcfg, &teacher, &DistillData::Tokens(tokens.clone()), &DistillConfig { steps: 45, ..dc.clone() }, 40, 0, &mut |_| {}, &mut |_, _| Ok(())).unwrap();
    assert_eq!(log2.iter().map(|r| r.step).collect::<Vec<_>>(), vec![41, 42, 43, 44, 45]);

    // Reverse KL on student samples also lowers the reverse KL.
    let student = StudentModel::from_source(&pcfg, &psrc, &dev.clone().autodiff()).unwrap();
    // Measured as the objective itself: reverse KL on fresh student samples (16 sequences, fixed
    // prompts and sampling seed).
    let rdc = DistillConfig { objective: Objective::ReverseKl, steps: 80, seqlen: 16, lr: 3e-3, ..dc.clone() };
    let data = DistillData::Tokens(tokens.clone());
    let rev = |m: &StudentModel| -> f64 {
        let eval = DistillConfig { batch_size: 16, ..rdc.clone() };
        scalar(batch_loss(m, &pcfg, &teacher, &data, &eval, &mut ChaCha8Rng::seed_from_u64(77)).unwrap().0)
    };
    let first = rev(&student.valid());
    let (rs, rlog) = distill(student, &pcfg, &teacher, &data, &rdc, 0, 0, &mut |_| {}, &mut |_, _| Ok(())).unwrap();
    let last = rev(&rs.valid());
    eprintln!("reverse KL on student samples: {first:.4} -> {last:.4} (train {:.4} -> {:.4})", rlog[0].loss, rlog[79].loss);
    assert!(last < 0.85 * first, "reverse KL {first} -> {last}");

    // Bad input: vocabulary mismatch, wrong data kind, out-of-range parameters.
    let student = StudentModel::from_source(&pcfg, &psrc, &dev.clone().autodiff()).unwrap();
    let mut other = pcfg.clone();
    other.vocab_size += 1;
    assert!(distill(student.clone(), &other, &teacher, &DistillData::Tokens(tokens.clone()), &dc, 0, 0, &mut |_| {}, &mut |_, _| Ok(())).is_err());
    let cot = DistillConfig { objective: Objective::Cot, ..dc.clone() };
    assert!(distill(student.clone(), &pcfg, &teacher, &DistillData::Tokens(tokens.clone()), &cot, 0, 0, &mut |_| {}, &mut |_, _| Ok(())).is_err());
    for bad in [DistillConfig { lr: 0.0, ..dc.clone() }, DistillConfig { lr: 2.0, ..dc.clone() }, DistillConfig { temperature: 0.0, ..dc.clone() }, DistillConfig { temperature: f64::NAN, ..dc.clone() }] {
        assert!(bad.validate().is_err());
    }
    assert!(distill(student, &pcfg, &teacher, &DistillData::Tokens(vec![1, 2, 3]), &dc, 0, 0, &mut |_| {}, &mut |_, _| Ok(())).is_err());
}

#[test]
fn cot_data_and_objective() {
    let text = "{\"question\": \"2+3?\", \"answer\": \"2+3=5\\n#### 5\"}\n{\"question\": \"no\", \"answer\": \"none\"}\n";
    let ex = parse_gsm_jsonl(text).unwrap();
    assert_eq!(ex, vec![CotExample { question: "2+3?".into(), rationale: "2+3=5\n".into(), answer: "#### 5".into() }]);
    assert!(parse_gsm_jsonl("{\"question\": \"x\", \"answer\": \"y\"}").is_err());
    assert!(parse_gsm_jsonl("not json").is_err());
    // A byte-level toy tokenizer within the tiny vocabulary.
    let encode = |s: &str| -> deco_compress::Result<Vec<u32>> { Ok(s.bytes().map(|b| u32::from(b) % 90).collect()) };
    let seq = cot_sequence(&ex[0], &encode, Some(96)).unwrap();
    let prompt = "Question: 2+3?\nAnswer: ".len();
    assert_eq!(seq.ids.len(), prompt + 6 + 7);
    assert!(seq.kinds[..prompt].iter().all(|&k| k == TokenKind::Ignore));
    assert!(seq.kinds[prompt..prompt + 6].iter().all(|&k| k == TokenKind::Rationale));
    assert!(seq.kinds[prompt + 6..].iter().all(|&k| k == TokenKind::Answer));
    // The CoT objective trains: the loss on the (single) example drops.
    let ck = tiny("llama3");
    let cfg = &ck.config;
    let src = |n: &str| -> deco_model::Result<(Vec<usize>, Vec<f32>)> { Ok(ck.tensor(n)?) };
    let teacher = Llama::load_from(cfg, &src, &Device::flex(), None).unwrap();
    let student = StudentModel::from_source(cfg, &src, &Device::flex().autodiff()).unwrap();
    let dc = DistillConfig { objective: Objective::Cot, steps: 15, batch_size: 2, seqlen: 48, lr: 3e-3, rationale_weight: 0.5, ..Default::default() };
    let (_, log) = distill(student, cfg, &teacher, &DistillData::Cot { seqs: vec![seq], pad: 0 }, &dc, 0, 0, &mut |_| {}, &mut |_, _| Ok(())).unwrap();
    eprintln!("CoT loss {:.4} -> {:.4}", log[0].loss, log[14].loss);
    assert!(log[14].loss < 0.5 * log[0].loss);
}

/// The strong check on the real model: student logits on SmolLM2's weights against the float64
/// golden reference (every position of prompt 0; the same prompt twice as a batch of windows).
#[test]
fn smollm2_student_matches_float64_reference() {
    let ck = Checkpoint::open(deco_tests::smollm2_gguf()).unwrap();
    let cfg = &ck.config;
    let dev = Device::flex();
    let src = |n: &str| -> deco_model::Result<(Vec<usize>, Vec<f32>)> { Ok(ck.tensor(n)?) };
    let student = StudentModel::from_source(cfg, &src, &dev).unwrap();
    let g = deco_tests::golden();
    let ids = deco_tests::ids(&g.prompts[0]["ids"]);
    let (_, want) = &g.tensors["prompt0.all_logits"];
    let got = host(student.forward(cfg, &[ids.clone(), ids], false).unwrap());
    let n = want.len();
    let d = max_diff(&got[..n], want).max(max_diff(&got[n..], want));
    eprintln!("SmolLM2: max |student - float64 reference| logit = {d:e}");
    assert!(d <= 2e-3, "{d}");
}
