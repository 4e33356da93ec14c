//! Decoding strategies served: `deco serve` answers a strategy request, sent through the official
//! `openai` Python client with `extra_body` while sampled requests share its batches, with the
//! same tokens as `deco generate` with the same settings (both run the one engine; this checks
//! that the served path, its batching and its cache forks change nothing).
//!
//! Needs `python3` with `pip install "openai>=1.40"`; without it the test fails and says so.

mod soak;

use std::process::Command;

/// `deco generate ARGS` on SmolLM2: its stdout without the final newline.
fn generate_text(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_deco")).arg("generate").arg("--model").arg(deco_tests::smollm2_gguf()).args(args).output().expect("run deco generate");
    assert!(out.status.success(), "deco generate failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("utf-8").strip_suffix('\n').expect("a final newline").to_string()
}

/// Starts `deco serve` with `extra` arguments, runs `tests/python/strategy_client_test.py`
/// with `cases` and `script_args`, and asserts it passed.
fn serve_and_check(dir: &std::path::Path, cases: &[serde_json::Value], extra: &[&str], script_args: &[&str]) {
    let expected = dir.join("cases.json");
    std::fs::write(&expected, serde_json::to_string_pretty(cases).expect("json")).expect("write cases");
    let mut c = soak::server_only(env!("CARGO_BIN_EXE_deco").into(), deco_tests::smollm2_gguf(), dir, 256);
    c.extra_args = extra.iter().map(|s| s.to_string()).collect();
    let (mut child, addr) = soak::start_server(&c).expect("start deco serve");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/python/strategy_client_test.py");
    let out = Command::new("python3")
        .arg(script)
        .args(["--base-url", &format!("http://{addr}/v1"), "--model", "soak", "--expected"])
        .arg(&expected)
        .args(script_args)
        .output();
    let _ = child.kill();
    let _ = child.wait();
    let out = out.expect("run python3");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    eprintln!("{stdout}{stderr}");
    assert!(
        out.status.success(),
        "strategy client test failed ({:?}); exit 2 means `pip install openai` is missing\nserver log:\n{}",
        out.status.code(),
        std::fs::read_to_string(&c.log).unwrap_or_default()
    );
}

/// `deco generate --strategy beam` on SmolLM2 for a raw prompt: the choices' texts.
fn generate_beam(prompt: &str, max_new: usize, n: usize, num_beams: usize, length_penalty: f32, early_stopping: &str) -> Vec<String> {
    let model = deco_tests::smollm2_gguf();
    let out = Command::new(env!("CARGO_BIN_EXE_deco"))
        .args(["generate", "--prompt", prompt, "--strategy", "beam"])
        .arg("--model")
        .arg(&model)
        .args(["--max-new-tokens", &max_new.to_string(), "-n", &n.to_string(), "--num-beams", &num_beams.to_string()])
        .args(["--length-penalty", &length_penalty.to_string(), "--early-stopping", early_stopping])
        .output()
        .expect("run deco generate");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "deco generate failed: {stderr}");
    let stdout = String::from_utf8(out.stdout).expect("utf-8 output");
    if n == 1 {
        return vec![stdout.strip_suffix('\n').expect("a final newline").to_string()];
    }
    // `--- beam i score=.. sum_logprobs=..` headers, each followed by the text and a newline.
    let mut texts: Vec<String> = Vec::new();
    for line in stdout.split_inclusive('\n') {
        if line.starts_with("--- beam ") {
            texts.push(String::new());
        } else {
            texts.last_mut().expect("text after a header").push_str(line);
        }
    }
    texts.iter_mut().for_each(|t| {
        t.pop();
    });
    assert_eq!(texts.len(), n, "{stdout}");
    texts
}

/// Beam search (`num_beams`, `length_penalty`, `early_stopping`, `n`), contrastive search
/// (`penalty_alpha`, `top_k`) and early exit (`early_exit`) served through `extra_body` give
/// `deco generate`'s text.
#[test]
fn served_beam_contrastive_search_and_early_exit_equal_deco_generate() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cases = Vec::new();
    for (prompt, max_new, n, beams, lp, es) in [
        ("The capital of France is", 16, 2, 3, 1.0f32, "false"),
        ("def fibonacci(n):", 20, 1, 4, 0.5, "never"),
        ("Once upon a time", 12, 3, 3, 1.0, "true"),
    ] {
        let texts = generate_beam(prompt, max_new, n, beams, lp, es);
        let early = match es {
            "true" => serde_json::json!(true),
            "false" => serde_json::json!(false),
            _ => serde_json::json!("never"),
        };
        cases.push(serde_json::json!({
            "prompt": prompt, "max_tokens": max_new, "n": n,
            "extra_body": {"num_beams": beams, "length_penalty": lp, "early_stopping": early},
            "texts": texts,
        }));
    }
    for (prompt, alpha, k) in [("The best way to learn a language is", "0.6", 4), ("def add(a, b):", "0.4", 3)] {
        let k_s = k.to_string();
        let text = generate_text(&["--prompt", prompt, "--strategy", "contrastive-search", "--penalty-alpha", alpha, "--top-k", &k_s, "--max-new-tokens", "16"]);
        let alpha: f64 = alpha.parse().expect("alpha");
        cases.push(serde_json::json!({"prompt": prompt, "max_tokens": 16, "n": 1, "extra_body": {"penalty_alpha": alpha, "top_k": k}, "texts": [text]}));
    }
    // Early exit (the engine's per-token path with its own forward for decode tokens).
    for (prompt, entropy) in [("The capital of France is", "1.5"), ("1, 2, 3, 4,", "0.5")] {
        let text = generate_text(&["--prompt", prompt, "--strategy", "early-exit", "--exit-entropy", entropy, "--exit-min-layers", "8", "--exit-check-every", "4", "--max-new-tokens", "16"]);
        let entropy: f64 = entropy.parse().expect("entropy");
        let ee = serde_json::json!({"entropy_threshold": entropy, "min_layers": 8, "check_every": 4});
        cases.push(serde_json::json!({"prompt": prompt, "max_tokens": 16, "n": 1, "extra_body": {"early_exit": ee}, "texts": [text]}));
    }
    serve_and_check(dir.path(), &cases, &[], &[]);
}

/// Speculative decoding as a server setting (`--speculative-model [ngram]`, and the model's first
/// 10 layers as the draft): greedy and seeded sampled requests give exactly `deco generate
/// --strategy speculative`'s text with the same settings, and at T = 0 that text is plain greedy
/// decoding's.
#[test]
fn served_speculative_decoding_equals_deco_generate() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (draft_args, serve_args) in [
        (vec!["--prompt-lookup"], vec!["--speculative-model", "[ngram]", "--num-speculative-tokens", "4"]),
        (vec!["--draft-layers", "10"], vec!["--speculative-draft-layers", "10", "--num-speculative-tokens", "4"]),
    ] {
        let mut cases = Vec::new();
        for (prompt, temperature, seed) in [("One, two, three, four, five, six,", 0.0f32, None), ("The capital of France is", 0.8, Some(7u64))] {
            let mut args = vec!["--prompt", prompt, "--strategy", "speculative", "--num-speculative-tokens", "4", "--max-new-tokens", "24"];
            args.extend(&draft_args);
            let (t, s) = (temperature.to_string(), seed.unwrap_or(0).to_string());
            args.extend(["--temperature", &t, "--seed", &s]);
            let text = generate_text(&args);
            if temperature == 0.0 {
                let plain = generate_text(&["--prompt", prompt, "--max-new-tokens", "24"]);
                assert_eq!(text, plain, "speculative {draft_args:?} differs from greedy");
            }
            let mut case = serde_json::json!({"prompt": prompt, "max_tokens": 24, "n": 1, "extra_body": {}, "texts": [text], "temperature": temperature});
            if let Some(s) = seed {
                case["seed"] = serde_json::json!(s);
            }
            cases.push(case);
        }
        serve_and_check(dir.path(), &cases, &serve_args, &["--expect-speculation", "--no-refusals"]);
    }
}

/// Contrastive decoding (`contrastive_decoding`, with `deco serve --amateur-layers 8`) and AutoDeco
/// heads (`autodeco`, with `deco serve --autodeco`, the committed SmolLM2 heads) give `deco
/// generate`'s text for the same settings, greedy and seeded sampling.
#[test]
fn served_contrastive_decoding_and_autodeco_equal_deco_generate() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cases = Vec::new();
    for (prompt, temperature, seed) in [("The capital of France is", 0.0f32, 0u64), ("Once upon a time", 0.9, 5)] {
        let (t, s) = (temperature.to_string(), seed.to_string());
        let text = generate_text(&["--prompt", prompt, "--strategy", "contrastive", "--amateur-layers", "8", "--contrastive-alpha", "0.1", "--max-new-tokens", "16", "--temperature", &t, "--seed", &s]);
        let cd = serde_json::json!({"alpha": 0.1, "amateur_temperature": 1.0});
        cases.push(serde_json::json!({"prompt": prompt, "max_tokens": 16, "n": 1, "extra_body": {"contrastive_decoding": cd}, "texts": [text], "temperature": temperature, "seed": seed}));
    }
    serve_and_check(dir.path(), &cases, &["--amateur-layers", "8"], &["--no-refusals"]);

    let heads = deco_tests::workspace_root().join("assets/autodeco/smollm2-135m-instruct-gsm");
    let heads = heads.to_str().expect("utf-8 path");
    let mut cases = Vec::new();
    for (prompt, temperature, seed) in [("Natalia sold 48 clips in April. How many clips did she sell in May if she sold half as many?", 1.0f32, 3u64), ("Once upon a time", 0.7, 9)] {
        let (t, s) = (temperature.to_string(), seed.to_string());
        let text = generate_text(&["--prompt", prompt, "--autodeco", heads, "--max-new-tokens", "20", "--temperature", &t, "--seed", &s]);
        cases.push(serde_json::json!({"prompt": prompt, "max_tokens": 20, "n": 1, "extra_body": {"autodeco": true}, "texts": [text], "temperature": temperature, "seed": seed}));
    }
    serve_and_check(dir.path(), &cases, &["--autodeco", heads], &["--no-refusals"]);
}

/// Medusa heads as a server setting (`deco serve --medusa DIR`, heads trained here on a few
/// self-distilled prompts): greedy and seeded sampled requests give exactly `deco generate
/// --medusa DIR`'s text, and at T = 0 that text is plain greedy decoding's.
#[test]
fn served_medusa_equals_deco_generate() {
    let dir = tempfile::tempdir().expect("tempdir");
    let prompts = dir.path().join("prompts.txt");
    std::fs::write(&prompts, "Count from one to twenty.\nName the planets of the solar system.\nList the days of the week.\nWhat are the primary colors?\n").expect("write prompts");
    let heads = dir.path().join("heads");
    let out = Command::new(env!("CARGO_BIN_EXE_deco"))
        .args(["medusa", "train", "--model"])
        .arg(deco_tests::smollm2_gguf())
        .arg("--data")
        .arg(&prompts)
        .arg("--out")
        .arg(&heads)
        .args(["--steps", "20", "--max-new-tokens", "32", "--num-heads", "3", "--heldout-fraction", "0.25", "--eval-every", "0"])
        .output()
        .expect("run deco medusa train");
    assert!(out.status.success(), "deco medusa train failed: {}", String::from_utf8_lossy(&out.stderr));
    let heads_arg = heads.display().to_string();
    let mut cases = Vec::new();
    for (prompt, temperature, seed) in [("One, two, three, four, five, six,", 0.0f32, 0u64), ("The capital of France is", 0.8, 7)] {
        let (t, s) = (temperature.to_string(), seed.to_string());
        let text = generate_text(&["--prompt", prompt, "--medusa", &heads_arg, "--max-new-tokens", "24", "--temperature", &t, "--seed", &s]);
        if temperature == 0.0 {
            let plain = generate_text(&["--prompt", prompt, "--max-new-tokens", "24"]);
            assert_eq!(text, plain, "Medusa differs from greedy");
        }
        cases.push(serde_json::json!({"prompt": prompt, "max_tokens": 24, "n": 1, "extra_body": {}, "texts": [text], "temperature": temperature, "seed": seed}));
    }
    serve_and_check(dir.path(), &cases, &["--medusa", &heads_arg], &["--expect-speculation", "--no-refusals"]);
}
