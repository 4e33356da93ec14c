//! `deco generate --autodeco` and `deco autodeco` end to end on the real model, and bad input.

use std::process::{Command, Output};

use burn::tensor::Device;
use deco_autodeco::heads::{AutoDecoConfig, AutoDecoHeads};
use deco_tests::smollm2_gguf;

fn deco(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_deco")).args(args).output().expect("run deco")
}

fn assert_clean_error(o: &Output, needles: &[&str]) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "expected exit 1, got {:?}; stderr: {err}", o.status);
    assert!(!err.contains("panicked"), "panic instead of an error: {err}");
    for n in needles {
        assert!(err.contains(n), "stderr does not mention {n:?}: {err}");
    }
}

fn save_heads(dir: &std::path::Path, hidden: usize, vocab: usize) {
    let device = Device::flex();
    device.seed(4);
    let cfg = AutoDecoConfig::new(hidden, vocab);
    AutoDecoHeads::init(&cfg, &device).expect("init").to_host(&cfg).expect("host").save(dir).expect("save");
}

#[test]
fn generate_with_heads_writes_a_trace() {
    let model = smollm2_gguf();
    let tmp = tempfile::tempdir().expect("tmp");
    let heads = tmp.path().join("heads");
    save_heads(&heads, 576, 49152);
    let csv = tmp.path().join("trace.csv");
    let svg = tmp.path().join("trace.svg");
    let o = deco(&[
        "generate", "--model", model.to_str().expect("path"), "--prompt", "The capital of France is", "--max-new-tokens", "10",
        "--ignore-eos", "--autodeco", heads.to_str().expect("path"), "--trace-decoding", csv.to_str().expect("path"),
        "--trace-plot", svg.to_str().expect("path"), "--seed", "3",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = std::fs::read_to_string(&csv).expect("csv");
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("step,token,piece,temperature,top_p,final_temperature,final_top_p"));
    let rows: Vec<Vec<String>> = lines.map(|l| l.rsplitn(5, ',').map(str::to_string).collect()).collect();
    assert_eq!(rows.len(), 10, "{text}");
    for r in &rows {
        // rsplitn: [final_top_p, final_temperature, top_p, temperature, rest]
        let v: Vec<f32> = r[..4].iter().map(|x| x.parse().expect("number")).collect();
        let (fp, ft, p, t) = (v[0], v[1], v[2], v[3]);
        assert!(t > 0.0 && t < 2.0 && p > 0.0 && p < 1.0);
        // --autodeco alone samples with user temperature 1 and top_p 1.
        assert!((ft - t.max(1e-2)).abs() < 1e-5 && (fp - p).abs() < 1e-5, "{r:?}");
    }
    assert!(std::fs::read_to_string(&svg).expect("svg").contains("<svg"));
    assert!(String::from_utf8_lossy(&o.stderr).contains("autodeco_mean_T="));
}

#[test]
fn bad_heads_give_clean_errors() {
    let model = smollm2_gguf();
    let m = model.to_str().expect("path");
    let tmp = tempfile::tempdir().expect("tmp");
    let missing = tmp.path().join("nope");
    let o = deco(&["generate", "--model", m, "--prompt", "Hi", "--autodeco", missing.to_str().expect("p")]);
    assert_clean_error(&o, &["autodeco_config.json"]);
    let wrong = tmp.path().join("wrong");
    save_heads(&wrong, 64, 49152);
    let o = deco(&["generate", "--model", m, "--prompt", "Hi", "--autodeco", wrong.to_str().expect("p")]);
    assert_clean_error(&o, &["hidden size 64"]);
    let o = deco(&["generate", "--model", m, "--prompt", "Hi", "--autodeco", wrong.to_str().expect("p"), "--strategy", "beam"]);
    assert_clean_error(&o, &["--autodeco"]);
    let data = tmp.path().join("bad.jsonl");
    std::fs::write(&data, "{\"question\": \"q\"}\n").expect("write");
    let out = tmp.path().join("out");
    let o = deco(&["autodeco", "train", "--model", m, "--data", data.to_str().expect("p"), "--out", out.to_str().expect("p")]);
    assert_clean_error(&o, &["bad.jsonl:1"]);
    let o = deco(&["autodeco", "train", "--model", m, "--data", data.to_str().expect("p"), "--out", out.to_str().expect("p"), "--learning-rate=-1"]);
    assert_clean_error(&o, &["learning_rate"]);
    assert!(!out.exists(), "no output on failure");
    // The meta-instruction stage: heads for another hidden size, a bad margin, too few questions.
    let gsm = deco_tests::asset("data/gsm_train.jsonl");
    let g = gsm.to_str().expect("p");
    let meta_out = tmp.path().join("meta");
    let mo = meta_out.to_str().expect("p");
    let o = deco(&["autodeco", "meta-train", "--model", m, "--heads", wrong.to_str().expect("p"), "--data", g, "--out", mo]);
    assert_clean_error(&o, &["hidden 64"]);
    let good = tmp.path().join("good");
    save_heads(&good, 576, 49152);
    let gd = good.to_str().expect("p");
    let o = deco(&["autodeco", "meta-train", "--model", m, "--heads", gd, "--data", g, "--out", mo, "--margin-t=-0.5"]);
    assert_clean_error(&o, &["margin_t"]);
    let o = deco(&["autodeco", "meta-train", "--model", m, "--heads", gd, "--data", data.to_str().expect("p"), "--out", mo]);
    assert_clean_error(&o, &["bad.jsonl:1"]);
    let o = deco(&["autodeco", "meta-train", "--model", m, "--heads", missing.to_str().expect("p"), "--data", g, "--out", mo]);
    assert_clean_error(&o, &["nope"]);
    assert!(!meta_out.exists(), "no output on failure");
}
