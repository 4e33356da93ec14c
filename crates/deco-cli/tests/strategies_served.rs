//! Decoding strategies served: `deco serve` answers a strategy request, sent through the official
//! `openai` Python client with `extra_body` while sampled requests share its batches, with the
//! same tokens as `deco generate` with the same settings (both run the one engine; this checks
//! that the served path, its batching and its cache forks change nothing).
//!
//! Needs `python3` with `pip install "openai>=1.40"`; without it the test fails and says so.

mod soak;

use std::process::Command;

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

#[test]
fn served_beam_search_equals_deco_generate() {
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
    let expected = dir.path().join("cases.json");
    std::fs::write(&expected, serde_json::to_string_pretty(&cases).expect("json")).expect("write cases");

    let c = soak::server_only(env!("CARGO_BIN_EXE_deco").into(), deco_tests::smollm2_gguf(), dir.path(), 256);
    let (mut child, addr) = soak::start_server(&c).expect("start deco serve");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/python/strategy_client_test.py");
    let out = Command::new("python3")
        .arg(script)
        .args(["--base-url", &format!("http://{addr}/v1"), "--model", "soak", "--expected"])
        .arg(&expected)
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
