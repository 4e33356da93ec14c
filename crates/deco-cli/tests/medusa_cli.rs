//! `deco medusa train` / `deco medusa eval` end to end on the real model (a few prompts, a few
//! tokens, a few steps), and bad input.

use std::path::Path;
use std::process::{Command, Output};

use deco_autodeco::medusa::{MedusaConfig, ResBlockWeights, save_blocks};
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

/// The tensor table of a safetensors file (name -> (dtype, shape)), read from its JSON header
/// independently of the writer.
fn safetensors_table(path: &Path) -> serde_json::Map<String, serde_json::Value> {
    let bytes = std::fs::read(path).expect("read");
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).expect("header JSON");
    let mut m = header.as_object().expect("object").clone();
    m.remove("__metadata__");
    m
}

fn prompts(dir: &Path) -> std::path::PathBuf {
    let p = dir.join("prompts.txt");
    std::fs::write(&p, "What is 2 + 3?\nName a colour.\n\nCount from one to five.\nWhat is the capital of France?\n").expect("write");
    p
}

#[test]
fn train_writes_heads_that_eval_reads() {
    let model = smollm2_gguf();
    let m = model.to_str().expect("path");
    let tmp = tempfile::tempdir().expect("tmp");
    let data = prompts(tmp.path());
    let out = tmp.path().join("medusa");
    let o = deco(&[
        "medusa", "train", "--model", m, "--data", data.to_str().expect("p"), "--out", out.to_str().expect("p"), "--num-heads", "2",
        "--max-new-tokens", "12", "--steps", "3", "--batch-size", "8", "--heldout-fraction", "0.25", "--eval-every", "0",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // config.json: the reference's field names plus deco's.
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).expect("config")).expect("json");
    assert_eq!(cfg["medusa_num_heads"], 2);
    assert_eq!(cfg["medusa_num_layers"], 1);
    assert_eq!(cfg["hidden_size"], 576);
    assert_eq!(cfg["vocab_size"], 49152);
    assert_eq!(cfg["shared_lm_head"], true);
    // medusa_lm_head.safetensors: the reference's names, PyTorch shapes, f32.
    let table = safetensors_table(&out.join("medusa_lm_head.safetensors"));
    let mut names: Vec<&String> = table.keys().collect();
    names.sort();
    assert_eq!(names, ["medusa_head.0.0.linear.bias", "medusa_head.0.0.linear.weight", "medusa_head.1.0.linear.bias", "medusa_head.1.0.linear.weight"]);
    for (name, info) in &table {
        assert_eq!(info["dtype"], "F32", "{name}");
        let want = if name.ends_with("weight") { serde_json::json!([576, 576]) } else { serde_json::json!([576]) };
        assert_eq!(info["shape"], want, "{name}");
    }
    // The loss log (step 0 + 3 steps), the accuracy report, the plot.
    let csv = std::fs::read_to_string(out.join("loss.csv")).expect("loss.csv");
    assert!(csv.starts_with("step,loss,loss_head1,loss_head2,"), "{csv}");
    assert_eq!(csv.lines().count(), 5, "{csv}");
    let acc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("accuracy.json")).expect("accuracy")).expect("json");
    assert_eq!(acc["heldout"].as_array().expect("list").len(), 2, "{acc}");
    assert_eq!(acc["train_sequences"], 3);
    assert_eq!(acc["heldout_sequences"], 1);
    assert!(std::fs::read_to_string(out.join("loss.svg")).expect("svg").contains("<svg"));
    // eval reads them back.
    let o = deco(&["medusa", "eval", "--model", m, "--medusa", out.to_str().expect("p"), "--data", data.to_str().expect("p"), "--max-new-tokens", "8", "--max-examples", "2"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8_lossy(&o.stdout);
    let last: serde_json::Value = serde_json::from_str(stdout.lines().last().expect("a line")).expect("json");
    let heads = last["heldout"].as_array().expect("list");
    assert_eq!(heads.len(), 2);
    for h in heads {
        let (t1, t5) = (h["top1"].as_f64().expect("top1"), h["top5"].as_f64().expect("top5"));
        assert!((0.0..=1.0).contains(&t1) && t1 <= t5 && t5 <= 1.0, "{h}");
    }
}

#[test]
fn bad_input_gives_clean_errors() {
    let model = smollm2_gguf();
    let m = model.to_str().expect("path");
    let tmp = tempfile::tempdir().expect("tmp");
    let data = prompts(tmp.path());
    let d = data.to_str().expect("p");
    let out = tmp.path().join("out");
    let o_ = out.to_str().expect("p");
    let o = deco(&["medusa", "train", "--model", m, "--data", d, "--out", o_, "--num-heads", "0"]);
    assert_clean_error(&o, &["--num-heads", "0"]);
    let o = deco(&["medusa", "train", "--model", m, "--data", d, "--out", o_, "--steps", "0"]);
    assert_clean_error(&o, &["steps"]);
    let o = deco(&["medusa", "train", "--model", m, "--data", d, "--out", o_, "--lr=-1"]);
    assert_clean_error(&o, &["learning_rate"]);
    let o = deco(&["medusa", "train", "--model", m, "--data", tmp.path().join("missing.txt").to_str().expect("p"), "--out", o_]);
    assert_clean_error(&o, &["missing.txt"]);
    let bad = tmp.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"question\": \"q\"}\n").expect("write");
    let o = deco(&["medusa", "train", "--model", m, "--data", bad.to_str().expect("p"), "--out", o_]);
    assert_clean_error(&o, &["bad.jsonl:1"]);
    assert!(!out.exists(), "no output on failure");
    // Heads trained for another model (hidden size 32).
    let other = tmp.path().join("other");
    save_blocks(&other, &MedusaConfig::new(2, 32, 49152), &vec![ResBlockWeights::zeros(32); 2], &[]).expect("save");
    let o = deco(&["medusa", "eval", "--model", m, "--medusa", other.to_str().expect("p"), "--data", d]);
    assert_clean_error(&o, &["hidden size 32", "hidden size 576"]);
    // Heads with no head, or a missing directory.
    let zero = tmp.path().join("zero");
    std::fs::create_dir_all(&zero).expect("mkdir");
    std::fs::write(zero.join("config.json"), r#"{"medusa_num_heads": 0, "medusa_num_layers": 1, "hidden_size": 576, "vocab_size": 49152}"#).expect("write");
    let o = deco(&["medusa", "eval", "--model", m, "--medusa", zero.to_str().expect("p"), "--data", d]);
    assert_clean_error(&o, &["medusa_num_heads"]);
    let o = deco(&["medusa", "eval", "--model", m, "--medusa", tmp.path().join("nope").to_str().expect("p"), "--data", d]);
    assert_clean_error(&o, &["nope", "config.json"]);
}
