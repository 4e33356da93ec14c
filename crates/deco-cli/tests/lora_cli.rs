//! `deco lora train` end to end on the real model (SmolLM2-135M-Instruct, NF4 base): a PEFT
//! adapter directory that `deco generate --lora` and `deco lora eval --lora` load, `--resume`
//! continuing from the last checkpoint; bad input gives clean errors and no output.

use std::path::Path;
use std::process::{Command, Output};

use deco_tests::smollm2_gguf;

fn deco(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_deco")).args(args).output().expect("run deco")
}

fn assert_ok(o: &Output) {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

fn assert_clean_error(o: &Output, needles: &[&str]) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "expected exit 1, got {:?}; stderr: {err}", o.status);
    assert!(!err.contains("panicked"), "panic instead of an error: {err}");
    for n in needles {
        assert!(err.contains(n), "stderr does not mention {n:?}: {err}");
    }
}

/// Four short GSM8K-style records.
fn write_data(dir: &Path) -> String {
    let p = dir.join("gsm.jsonl");
    let lines: Vec<String> = (1..=4)
        .map(|i| serde_json::json!({"question": format!("Tom has {i} apples and buys 2 more. How many?"), "answer": format!("{i} + 2 = {}\n#### {}", i + 2, i + 2)}).to_string())
        .collect();
    std::fs::write(&p, lines.join("\n")).expect("write data");
    p.to_str().expect("p").to_string()
}

#[test]
fn lora_train_writes_a_peft_adapter_that_generate_and_eval_load() {
    let m = smollm2_gguf();
    let m = m.to_str().expect("path");
    let tmp = tempfile::tempdir().expect("tmp");
    let data = write_data(tmp.path());
    let out = tmp.path().join("adapter");
    let o = out.to_str().expect("p");
    let train = |steps: &str, extra: &[&str]| {
        let mut a = vec![
            "lora", "train", "--model", m, "--target-modules", "q_proj,down_proj", "--r", "2", "--alpha", "4", "--steps", steps, "--batch-size", "1", "--seqlen", "48",
            "--lr", "1e-3", "--checkpoint-every", "1", "--data", &data, "--out", o,
        ];
        a.extend_from_slice(extra);
        deco(&a)
    };
    assert_ok(&train("2", &[]));
    for f in ["adapter_config.json", "adapter_model.safetensors", "deco_lora.json", "lora_log.csv", "checkpoint-000001", "checkpoint-000002"] {
        assert!(out.join(f).exists(), "{f} missing");
    }
    let conf: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("adapter_config.json")).expect("config")).expect("json");
    assert_eq!((conf["r"].as_u64(), conf["lora_alpha"].as_f64(), conf["peft_type"].as_str()), (Some(2), Some(4.0), Some("LORA")));
    assert_eq!(conf["target_modules"], serde_json::json!(["q_proj", "down_proj"]));
    let meta: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("deco_lora.json")).expect("meta")).expect("json");
    assert_eq!(meta["base_quant"], "nf4");
    // The top-level adapter is the last checkpoint.
    assert_eq!(std::fs::read(out.join("adapter_model.safetensors")).expect("w"), std::fs::read(out.join("checkpoint-000002/adapter_model.safetensors")).expect("w"));

    // Resume to step 3 (f32 base, to keep the test short): the log continues.
    let r = train("3", &["--resume", "--quant", "none"]);
    assert_ok(&r);
    let log = std::fs::read_to_string(out.join("lora_log.csv")).expect("log");
    assert_eq!(log.lines().map(|l| l.split(',').next().unwrap_or("")).collect::<Vec<_>>(), ["step", "1", "2", "3"]);
    assert!(!out.join("checkpoint-000001").exists(), "only the last two checkpoints are kept");

    let g = deco(&["generate", "--model", m, "--lora", o, "--prompt", "Tom has", "--max-new-tokens", "3"]);
    assert_ok(&g);
    assert!(String::from_utf8_lossy(&g.stderr).contains("lora: merging"), "{}", String::from_utf8_lossy(&g.stderr));
    let e = deco(&["lora", "eval", "--model", m, "--lora", o, "--data", &data, "--limit", "2"]);
    assert_ok(&e);
    assert!(String::from_utf8_lossy(&e.stdout).contains("answer_loss="));

    // An adapter whose config does not match its tensors (or the model): a clean error.
    let bad = tmp.path().join("bad");
    std::fs::create_dir_all(&bad).expect("mkdir");
    std::fs::copy(out.join("adapter_model.safetensors"), bad.join("adapter_model.safetensors")).expect("copy");
    std::fs::write(bad.join("adapter_config.json"), serde_json::to_string(&serde_json::json!({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "down_proj"]})).expect("j"))
        .expect("write");
    let g = deco(&["generate", "--model", m, "--lora", bad.to_str().expect("p"), "--prompt", "Hi", "--max-new-tokens", "1"]);
    assert_clean_error(&g, &["--lora", "shape", "r = 4"]);
}

#[test]
fn bad_lora_input_gives_clean_errors_and_no_output() {
    let m = smollm2_gguf();
    let m = m.to_str().expect("path");
    let tmp = tempfile::tempdir().expect("tmp");
    let data = write_data(tmp.path());
    let out = tmp.path().join("out");
    let o = out.to_str().expect("p");
    for (args, needles) in [
        (vec!["--r", "0"], vec!["`r`"]),
        (vec!["--alpha", "0"], vec!["lora_alpha"]),
        (vec!["--alpha=-1"], vec!["lora_alpha"]),
        (vec!["--dropout", "1"], vec!["lora_dropout"]),
        (vec!["--dropout=-0.5"], vec!["lora_dropout"]),
        (vec!["--target-modules", "q_proj,attn"], vec!["target_modules", "attn"]),
        (vec!["--steps", "0"], vec!["steps"]),
    ] {
        let mut a = vec!["lora", "train", "--model", m, "--data", &data, "--out", o];
        a.extend_from_slice(&args);
        assert_clean_error(&deco(&a), &needles);
        assert!(!out.exists(), "{args:?} left output");
    }
    let o2 = deco(&["lora", "train", "--model", m, "--data", &data, "--out", o, "--resume"]);
    assert_clean_error(&o2, &["--resume", "checkpoint"]);
    let g = deco(&["generate", "--model", m, "--lora", tmp.path().join("none").to_str().expect("p"), "--prompt", "Hi", "--max-new-tokens", "1"]);
    assert_clean_error(&g, &["--lora", "adapter_config.json"]);
}
