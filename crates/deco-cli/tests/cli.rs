//! The `deco` binary end to end: real model, real files, and bad input.
//!
//! Bad input must give a non-zero exit, a message naming the problem and the file, and never a
//! panic.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use deco_tests::{asset, smollm2_gguf};

fn deco(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_deco")).args(args).output().expect("run deco")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Asserts a clean failure: exit code 1, no panic, the message contains every `needle`.
fn assert_clean_error(o: &Output, needles: &[&str]) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(1), "expected exit 1, got {:?}; stderr: {err}", o.status);
    assert!(!err.contains("panicked"), "panic instead of an error: {err}");
    for n in needles {
        assert!(err.contains(n), "stderr does not mention {n:?}: {err}");
    }
}

fn model_bytes() -> Vec<u8> {
    std::fs::read(smollm2_gguf()).expect("read model")
}

fn find(hay: &[u8], needle: &[u8]) -> usize {
    hay.windows(needle.len()).position(|w| w == needle).unwrap_or_else(|| panic!("{needle:?} not in model header"))
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).expect("write test file");
    p
}

/// Offset just past a metadata key string (u64 length + bytes) in the header.
fn after_key(bytes: &[u8], key: &str) -> usize {
    let mut pat = (key.len() as u64).to_le_bytes().to_vec();
    pat.extend_from_slice(key.as_bytes());
    find(bytes, &pat) + pat.len()
}

#[test]
fn tokenize_matches_llama_cpp_ids() {
    // Case from smollm2-cases.json (llama.cpp's tokenizer), special tokens parsed.
    let cases: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(asset("tokenizer-tests/smollm2-cases.json")).expect("cases"))
            .expect("json");
    let case = cases.as_array().and_then(|a| a.iter().find(|c| c["text"].as_str().is_some_and(|t| t.contains("<|im_start|>"))));
    let case = case.expect("a chat case");
    let text = case["text"].as_str().expect("text");
    for (flag, key) in [(None, "ids_parse_special"), (Some("--no-parse-special"), "ids_no_special")] {
        let model = smollm2_gguf();
        let mut args = vec!["tokenize", "--model", model.to_str().expect("path"), "--text", text];
        args.extend(flag);
        let o = deco(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        let got: Vec<u64> = serde_json::from_slice(&o.stdout).expect("JSON list");
        let want: Vec<u64> = case[key].as_array().expect(key).iter().map(|x| x.as_u64().expect("id")).collect();
        assert_eq!(got, want, "{key}");
    }
}

#[test]
fn generate_greedy_streams_golden_continuation() {
    // Golden prompt 0 greedy continuation: " Paris.\n\nThe answer is: ..." (first 8 tokens have
    // reference margins > 0.05, so f32 must reproduce them).
    let model = smollm2_gguf();
    let o = deco(&[
        "generate", "--model", model.to_str().expect("path"), "--prompt", "The capital of France is",
        "--max-new-tokens", "8", "--threads", "2",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8(o.stdout.clone()).expect("utf-8 output");
    assert!(out.starts_with(" Paris.\n\nThe answer is:"), "{out:?}");
    let err = stderr(&o);
    let last = err.lines().last().expect("stats line");
    assert!(last.starts_with("[stats] prompt_tokens=5 "), "{last}");
    assert!(last.contains("decode_tokens=8"), "{last}");
}

#[test]
fn inspect_prints_metadata_and_tensors() {
    let model = smollm2_gguf();
    let o = deco(&["inspect", model.to_str().expect("path")]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("general.architecture") && out.contains("\"llama\""), "{out}");
    assert!(out.contains("blk.0.attn_q.weight") && out.contains("Q4_1"), "{out}");
    assert!(out.contains("token_embd.weight") && out.contains("Q8_0"), "{out}");
    // 30 layers x 9 tensors + token_embd + output_norm.
    assert_eq!(out.lines().filter(|l| l.trim_start().starts_with("blk.")).count(), 270);
}

#[test]
fn missing_file_is_a_clear_error() {
    let o = deco(&["inspect", "/nonexistent/model.gguf"]);
    assert_clean_error(&o, &["/nonexistent/model.gguf", "No such file"]);
    let o = deco(&["generate", "--model", "/nonexistent/model.gguf", "--prompt", "hi"]);
    assert_clean_error(&o, &["/nonexistent/model.gguf"]);
}

#[test]
fn not_a_gguf_is_a_clear_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let p = write(dir.path(), "notes.gguf", b"this is a text file, not a model\n");
    let o = deco(&["inspect", p.to_str().expect("path")]);
    assert_clean_error(&o, &["notes.gguf", "not a GGUF file"]);
}

#[test]
fn truncated_header_and_data_are_clear_errors() {
    let bytes = model_bytes();
    let dir = tempfile::tempdir().expect("tempdir");
    let p = write(dir.path(), "head.gguf", &bytes[..200]);
    let o = deco(&["inspect", p.to_str().expect("path")]);
    assert_clean_error(&o, &["head.gguf", "truncated"]);
    let p = write(dir.path(), "half.gguf", &bytes[..bytes.len() / 2]);
    let o = deco(&["inspect", p.to_str().expect("path")]);
    assert_clean_error(&o, &["half.gguf", "truncated", "data of tensor"]);
}

#[test]
fn unknown_architecture_is_a_clear_error() {
    let mut bytes = model_bytes();
    // general.architecture: type 8 (string), length 5, "llama" -> "gpt_x".
    let at = after_key(&bytes, "general.architecture");
    assert_eq!(&bytes[at..at + 4], &8u32.to_le_bytes());
    assert_eq!(&bytes[at + 12..at + 17], b"llama");
    bytes[at + 12..at + 17].copy_from_slice(b"gpt_x");
    let dir = tempfile::tempdir().expect("tempdir");
    let p = write(dir.path(), "arch.gguf", &bytes);
    let o = deco(&["generate", "--model", p.to_str().expect("path"), "--prompt", "hi"]);
    assert_clean_error(&o, &["arch.gguf", "unsupported architecture `gpt_x`"]);
}

#[test]
fn unknown_quant_type_is_a_clear_error() {
    let mut bytes = model_bytes();
    // Tensor info of output_norm.weight: name, n_dims=1, dim 576, type (F32 = 0) -> 99.
    let at = after_key(&bytes, "output_norm.weight");
    assert_eq!(&bytes[at..at + 4], &1u32.to_le_bytes());
    let ty = at + 4 + 8;
    assert_eq!(&bytes[ty..ty + 4], &0u32.to_le_bytes());
    bytes[ty..ty + 4].copy_from_slice(&99u32.to_le_bytes());
    let dir = tempfile::tempdir().expect("tempdir");
    let p = write(dir.path(), "qtype.gguf", &bytes);
    let o = deco(&["inspect", p.to_str().expect("path")]);
    assert_clean_error(&o, &["qtype.gguf", "output_norm.weight", "unknown GGML tensor type id 99"]);
}

#[test]
fn shape_mismatch_is_a_clear_error() {
    let mut bytes = model_bytes();
    // llama.feed_forward_length: u32 1536 -> 1024; the FFN tensors no longer fit the config.
    let at = after_key(&bytes, "llama.feed_forward_length");
    assert_eq!(&bytes[at..at + 4], &4u32.to_le_bytes());
    assert_eq!(&bytes[at + 4..at + 8], &1536u32.to_le_bytes());
    bytes[at + 4..at + 8].copy_from_slice(&1024u32.to_le_bytes());
    let dir = tempfile::tempdir().expect("tempdir");
    let p = write(dir.path(), "shape.gguf", &bytes);
    let o = deco(&["generate", "--model", p.to_str().expect("path"), "--prompt", "hi"]);
    // Whichever FFN weight is read first is the one reported; all of them involve 1536 vs 1024.
    assert_clean_error(&o, &["shape.gguf", ".mlp.", "has shape", "1536", "expected", "1024"]);
}

#[test]
fn prompt_longer_than_context_is_a_clear_error() {
    let model = smollm2_gguf();
    let text = asset("data/wiki_test.txt"); // ~150k tokens, context is 8192
    let o = deco(&["generate", "--model", model.to_str().expect("path"), "--prompt-file", text.to_str().expect("path")]);
    assert_clean_error(&o, &["prompt has", "context is 8192"]);
}

#[test]
fn invalid_utf8_prompt_file_is_a_clear_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let p = write(dir.path(), "prompt.txt", b"caf\xe9 au lait\n");
    let model = smollm2_gguf();
    let o = deco(&["generate", "--model", model.to_str().expect("path"), "--prompt-file", p.to_str().expect("path")]);
    assert_clean_error(&o, &["prompt.txt", "not valid UTF-8"]);
}

#[test]
fn out_of_range_sampling_parameter_is_a_clear_error() {
    let model = smollm2_gguf();
    let o = deco(&["generate", "--model", model.to_str().expect("path"), "--prompt", "hi", "--top-p", "1.5"]);
    assert_clean_error(&o, &["top_p", "1.5"]);
}

#[test]
fn quantize_refuses_gptq_options_it_cannot_honour() {
    let model = smollm2_gguf();
    let m = model.to_str().expect("path");
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("q");
    let o = out.to_str().expect("path");
    let base = ["quantize", "--model", m, "--format", "fake", "--out", o];
    // --mse is GPTQ's scale search: refused for RTN, and a norm must be finite and >= 0.
    let r = deco(&[&base[..], &["--method", "rtn", "--mse", "2.4"]].concat());
    assert_clean_error(&r, &["--mse", "gptq"]);
    let r = deco(&[&base[..], &["--method", "gptq", "--mse", "-1"]].concat());
    assert_clean_error(&r, &["--mse", "-1"]);
    // --calib-dtype is the calibration products' precision: refused where nothing calibrates.
    let r = deco(&[&base[..], &["--method", "rtn", "--calib-dtype", "bf16"]].concat());
    assert_clean_error(&r, &["--calib-dtype", "calibrate"]);
    // The default calibration mix has two files: one window cannot cover both.
    let r = deco(&[&base[..], &["--method", "gptq", "--nsamples", "1"]].concat());
    assert_clean_error(&r, &["--nsamples 1", "2 calibration files"]);
    assert!(!out.exists(), "no output may be written on a refused command");
}

/// The packed formats' defaults work on SmolLM2 (input widths 576 and 1536): the group size
/// becomes 64 (128 does not divide 576) and AWQ is asymmetric; a group size their loaders cannot
/// read is refused naming the valid ones; act-order without static groups is refused for
/// compressed-tensors (its current layout has no g_idx).
#[test]
fn quantize_packed_formats_defaults_and_group_sizes() {
    let model = smollm2_gguf();
    let m = model.to_str().expect("path");
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("q");
    let o = out.to_str().expect("path");
    let r = deco(&["quantize", "--model", m, "--format", "gptq", "--group-size", "128", "--out", o]);
    assert_clean_error(&r, &["--group-size 128", "576", "valid here: 64, 32, -1"]);
    let r = deco(&["quantize", "--model", m, "--format", "compressed-tensors", "--method", "gptq", "--desc-act", "--out", o]);
    assert_clean_error(&r, &["actorder", "--static-groups"]);
    let r = deco(&["quantize", "--model", m, "--format", "awq", "--sym", "--out", o]);
    assert_clean_error(&r, &["zero points", "--sym"]);
    assert!(!out.exists(), "no output may be written on a refused command");
    // Round to nearest in each format (the defaults being checked are the format's, not the
    // method's; RTN keeps the test quick).
    for (format, sym) in [("awq", false), ("gptq", true)] {
        let out = dir.path().join(format);
        let r = deco(&["quantize", "--model", m, "--format", format, "--method", "rtn", "--out", out.to_str().expect("path")]);
        assert!(r.status.success(), "--format {format} with default options failed: {}", stderr(&r));
        let cfg: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("config.json")).expect("config.json")).expect("json");
        let q = &cfg["quantization_config"];
        assert_eq!(q["group_size"], 64, "{format}: {q}");
        match format {
            "awq" => assert_eq!(q["zero_point"], !sym, "{q}"),
            _ => assert_eq!(q["sym"], sym, "{q}"),
        }
    }
}

#[test]
fn layer_error_bad_input_is_a_clear_error() {
    let model = smollm2_gguf();
    let m = model.to_str().expect("path");
    let dir = tempfile::tempdir().expect("tempdir");
    let text = write(dir.path(), "t.txt", b"Hello world.");
    let t = text.to_str().expect("path");
    let missing = dir.path().join("no-such-model");
    let r = deco(&["eval", "layer-error", "--model", m, "--quantized", missing.to_str().expect("path"), "--text", t]);
    assert_clean_error(&r, &["no-such-model"]);
    // A text shorter than one window is named.
    let r = deco(&["eval", "layer-error", "--model", m, "--quantized", m, "--text", t, "--seqlen", "256"]);
    assert_clean_error(&r, &["t.txt", "less than one window"]);
}
