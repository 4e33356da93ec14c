//! The server's lifecycle and its vLLM-named metrics, over real HTTP on loopback with the real
//! SmolLM2 model:
//! - while the model loads, `/health`, `/metrics` and the endpoints answer 503 (OpenAI error
//!   body, code `model_loading`); once ready, `/health` is 200;
//! - `usage.prompt_tokens_details.cached_tokens` is 0 for a new prompt and, for the same prompt
//!   again, the largest multiple of the block size below its length (the prefix cache's rule:
//!   full blocks, at least one token left to compute);
//! - `/metrics` under vLLM's names: the counters and histogram counts equal what the responses
//!   say (prompt and generated tokens, requests, per-token intervals, finish reasons, prefix
//!   cache queries and hits), buckets are cumulative and end with `+Inf` = count;
//! - on the shutdown signal, with a stream in flight: `/health` and a new request get 503, the
//!   stream runs to its end (`[DONE]`), then the server returns.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use common::{TestServer, http};

use burn::tensor::Device;
use deco_formats::checkpoint::Checkpoint;
use deco_formats::gguf::GgufFile;
use deco_formats::tokenizer::Tokenizer;
use deco_model::Llama;
use deco_serve::{EngineConfig, Readiness, SchedulerConfig, ServerState};
use serde_json::{Value, json};

const BLOCK: usize = 16;

fn json_of(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}

/// Prometheus text: series (name with labels, exactly as written) -> value.
fn series(text: &str) -> HashMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (k, v) = l.rsplit_once(' ').unwrap_or_else(|| panic!("bad line {l:?}"));
            (k.to_string(), v.parse::<f64>().unwrap_or_else(|e| panic!("bad value in {l:?}: {e}")))
        })
        .collect()
}

#[test]
fn lifecycle_cached_tokens_and_vllm_metrics() {
    let gate = Readiness::loading();
    let server = TestServer::start(gate.clone());
    let addr = server.addr;

    // Loading: everything 503.
    assert_eq!(http(addr, "GET", "/health", None).0, 503);
    assert_eq!(http(addr, "GET", "/metrics", None).0, 503);
    let (st, body) = http(addr, "POST", "/v1/completions", Some(&json!({"prompt": "Hi", "max_tokens": 2})));
    assert_eq!(st, 503, "{body}");
    assert_eq!(json_of(&body)["error"]["code"], "model_loading", "{body}");

    let path = deco_tests::smollm2_gguf();
    let ckpt = Checkpoint::open(&path).expect("open model");
    let tokenizer = Arc::new(Tokenizer::from_gguf(&GgufFile::open(&path).expect("gguf")).expect("tokenizer"));
    let model = Llama::load(&ckpt, &Device::default(), Some(2048)).expect("load model");
    let config = EngineConfig {
        block_size: BLOCK,
        num_blocks: 256,
        scheduler: SchedulerConfig { max_num_seqs: 16, max_num_batched_tokens: 256 },
        ..EngineConfig::default()
    };
    let (engine, join) = deco_serve::spawn_engine(model, tokenizer.clone(), config).expect("engine");
    gate.set_ready(Arc::new(ServerState::new(engine, tokenizer, None, "smol \"test\"".into()))).expect("ready");
    assert_eq!(http(addr, "GET", "/health", None).0, 200);

    // Requests with token-id prompts (exact lengths): A (40 tokens) twice, then B (20 tokens, n = 2).
    let a: Vec<u32> = (1000..1040).collect();
    let b: Vec<u32> = (2000..2020).collect();
    let mut prompt_total = 0;
    let mut generated = 0;
    let mut intervals = 0;
    let mut choices = 0;
    let mut cached = Vec::new();
    // min_new_tokens = max_tokens: every choice generates exactly max_tokens tokens.
    for (prompt, n, max_tokens) in [(&a, 1usize, 5usize), (&a, 1, 5), (&b, 2, 4)] {
        let req = json!({"prompt": prompt, "max_tokens": max_tokens, "min_new_tokens": max_tokens, "n": n, "temperature": 0.7, "seed": 1});
        let (st, body) = http(addr, "POST", "/v1/completions", Some(&req));
        assert_eq!(st, 200, "{body}");
        let v = json_of(&body);
        let usage = &v["usage"];
        assert_eq!(usage["prompt_tokens"], prompt.len(), "{body}");
        cached.push(usage["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached_tokens"));
        assert_eq!(usage["completion_tokens"], n * max_tokens, "{body}");
        for c in v["choices"].as_array().expect("choices") {
            assert_eq!(c["finish_reason"], "length", "{body}");
        }
        prompt_total += prompt.len();
        generated += n * max_tokens;
        choices += n;
        // A sequence of k tokens has k - 1 intervals between them.
        intervals += n * (max_tokens - 1);
    }
    assert_eq!(cached, vec![0, ((a.len() - 1) / BLOCK * BLOCK) as u64, 0], "cached_tokens per request");

    let l = r#"model_name="smol \"test\"",engine="0""#;
    // The gauges are published after the engine step that sent the last response: poll.
    let wait = std::time::Instant::now();
    let (text, m) = loop {
        let (st, text) = http(addr, "GET", "/metrics", None);
        assert_eq!(st, 200);
        let m = series(&text);
        if m.get(&format!("vllm:num_requests_running{{{l}}}")) == Some(&0.0) || wait.elapsed() > Duration::from_secs(10) {
            break (text, m);
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let get = |k: &str| -> f64 { *m.get(k).unwrap_or_else(|| panic!("missing series {k} in\n{text}")) };
    assert_eq!(get(&format!("vllm:prompt_tokens_total{{{l}}}")), prompt_total as f64);
    assert_eq!(get(&format!("vllm:generation_tokens_total{{{l}}}")), generated as f64);
    assert_eq!(get(&format!("vllm:prefix_cache_queries_total{{{l}}}")), prompt_total as f64);
    assert_eq!(get(&format!("vllm:prefix_cache_hits_total{{{l}}}")), cached.iter().sum::<u64>() as f64);
    assert_eq!(get(&format!("vllm:num_requests_running{{{l}}}")), 0.0);
    assert_eq!(get(&format!("vllm:num_requests_waiting{{{l}}}")), 0.0);
    let usage = get(&format!("vllm:kv_cache_usage_perc{{{l}}}"));
    assert!((0.0..=1.0).contains(&usage), "usage {usage}");
    assert_eq!(get(&format!("vllm:gpu_cache_usage_perc{{{l}}}")), usage);
    assert_eq!(get(&format!("vllm:request_success_total{{{l},finished_reason=\"length\"}}")), choices as f64);
    assert_eq!(get(&format!("vllm:request_success_total{{{l},finished_reason=\"stop\"}}")), 0.0);
    assert_eq!(get(&format!("vllm:request_success_total{{{l},finished_reason=\"abort\"}}")), 0.0);
    assert_eq!(get(&format!("vllm:cache_config_info{{{l},block_size=\"16\",num_gpu_blocks=\"256\",cache_dtype=\"float32\",enable_prefix_caching=\"True\"}}")), 1.0);
    for (name, count) in [("time_to_first_token_seconds", 3), ("e2e_request_latency_seconds", 3), ("time_per_output_token_seconds", intervals)] {
        let mut buckets: Vec<(f64, f64)> = m
            .iter()
            .filter_map(|(k, &v)| {
                let le = k.strip_prefix(&format!("vllm:{name}_bucket{{{l},le=\""))?.strip_suffix("\"}")?;
                Some((if le == "+Inf" { f64::INFINITY } else { le.parse().expect("le") }, v))
            })
            .collect();
        buckets.sort_by(|x, y| x.0.total_cmp(&y.0));
        assert!(buckets.len() > 10, "{name}: {buckets:?}");
        assert!(buckets.windows(2).all(|w| w[0].1 <= w[1].1), "{name} buckets not cumulative: {buckets:?}");
        let last = buckets.last().expect("buckets");
        assert!(last.0.is_infinite() && last.1 == count as f64, "{name}: +Inf bucket {last:?}, expected count {count}");
        assert_eq!(get(&format!("vllm:{name}_count{{{l}}}")), count as f64, "{name}_count");
        let sum = get(&format!("vllm:{name}_sum{{{l}}}"));
        assert!(sum > 0.0 && sum < 600.0 * count as f64, "{name}_sum {sum}");
    }

    // Drain: a long stream in flight, then the shutdown signal.
    let long = std::thread::spawn(move || {
        let body = json!({"prompt": "Once upon a time", "max_tokens": 160, "min_new_tokens": 160, "stream": true, "temperature": 0});
        let (st, out) = http(addr, "POST", "/v1/completions", Some(&body));
        assert_eq!(st, 200, "{out}");
        out
    });
    // Wait until the stream has produced tokens.
    let wait = std::time::Instant::now();
    while gate.pending_requests() == 0 || series(&http(addr, "GET", "/metrics", None).1).get(&format!("vllm:generation_tokens_total{{{l}}}")).copied().unwrap_or(0.0) <= generated as f64 {
        assert!(wait.elapsed() < Duration::from_secs(120), "the stream did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let stopping = server.signal();
    std::thread::sleep(Duration::from_millis(200));
    assert!(gate.pending_requests() > 0, "the stream finished too early for the drain checks");
    assert_eq!(http(addr, "GET", "/health", None).0, 503, "/health while draining");
    let (st, body) = http(addr, "POST", "/v1/completions", Some(&json!({"prompt": "Hi", "max_tokens": 2})));
    assert_eq!(st, 503, "new request while draining: {body}");
    let out = long.join().expect("stream thread");
    assert!(out.contains("data: [DONE]") && out.contains("\"finish_reason\":\"length\""), "the drained stream did not finish: {out}");
    stopping.join();
    drop(gate);
    join.join().expect("engine thread");
}
