//! Structured output through the real server (SmolLM2-135M Q4_1, HTTP on loopback): every
//! constrained response is checked with an independent parser and checks written here, not
//! with llguidance:
//! - `response_format: json_object` (chat, streamed and not, `n = 3` sampled): every output
//!   that finished (`stop`) parses as a JSON object (serde_json), and most do; one cut by
//!   `max_tokens` (`length`, a 135M model can ramble inside an object) need not;
//! - `response_format: json_schema` (strict): an object with exactly the schema's keys, a
//!   string name of at most 12 characters and an integer age in [0, 120];
//! - vLLM's `guided_regex` and `guided_grammar` (Lark) on completions: the text matches;
//! - malformed or uncompilable constraints, and two at once, are 400s naming the field;
//! - the engine counts the masks it computed; the mean time per mask is printed (the figure
//!   docs/serving.md quotes).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::SocketAddr;
use std::sync::Arc;

use common::{TestServer, http};

use burn::tensor::Device;
use deco_formats::chat_template::ChatTemplate;
use deco_formats::checkpoint::Checkpoint;
use deco_formats::gguf::GgufFile;
use deco_formats::tokenizer::Tokenizer;
use deco_model::Llama;
use deco_serve::{EngineConfig, Readiness, SchedulerConfig, ServerState};
use serde_json::{Value, json};

fn post(addr: SocketAddr, path: &str, body: &Value) -> (u16, String) {
    http(addr, "POST", path, Some(body))
}

fn ok_json(addr: SocketAddr, path: &str, body: &Value) -> Value {
    let (st, b) = post(addr, path, body);
    assert_eq!(st, 200, "{body}: {b}");
    serde_json::from_str(&b).unwrap_or_else(|e| panic!("not JSON ({e}): {b}"))
}

/// The concatenated `delta.content` of the `data:` events of an SSE body whose chunked
/// framing was left in place (each event is one `data: {...}` line; chunk-size lines are
/// skipped).
fn sse_contents(raw: &str) -> String {
    let mut text = String::new();
    for line in raw.lines() {
        if let Some(d) = line.strip_prefix("data: ")
            && d != "[DONE]"
        {
            let v: Value = serde_json::from_str(d).unwrap_or_else(|e| panic!("SSE event not JSON ({e}): {d}"));
            if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
                text.push_str(c);
            }
        }
    }
    text
}

fn metric(addr: SocketAddr, name: &str) -> f64 {
    let (_, out) = http(addr, "GET", "/metrics", None);
    out.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok()).unwrap_or_else(|| panic!("no {name}"))
}

#[test]
fn structured_output_always_parses_and_validates() {
    let path = deco_tests::smollm2_gguf();
    let ckpt = Checkpoint::open(&path).expect("open model");
    let tokenizer = Arc::new(Tokenizer::from_gguf(&GgufFile::open(&path).expect("gguf")).expect("tokenizer"));
    let model = Llama::load(&ckpt, &Device::default(), Some(2048)).expect("load model");
    let template = tokenizer.chat_template().map(|s| ChatTemplate::new(s).expect("template"));
    let config = EngineConfig { block_size: 16, num_blocks: 256, scheduler: SchedulerConfig { max_num_seqs: 16, max_num_batched_tokens: 256 }, ..EngineConfig::default() };
    let (engine, join) = deco_serve::spawn_engine(model, tokenizer.clone(), config).expect("engine");
    let state = Arc::new(ServerState::new(engine, tokenizer, template, "smollm2".into()));
    assert!(state.grammars.is_some(), "the structured-output compiler must build for SmolLM2");
    let server = TestServer::start(Readiness::ready(state));
    let addr = server.addr;
    let user = |text: &str| json!([{"role": "user", "content": text}]);

    // json_object: greedy, sampled with n = 4, streamed.
    let is_object = |s: &str| serde_json::from_str::<Value>(s).map(|p| p.is_object()).unwrap_or(false);
    let (mut finished, mut total) = (0, 0);
    let prompt = "Reply with a small JSON object with the keys \"animal\" and \"legs\" for a cat.";
    let req = json!({"messages": user(prompt), "max_tokens": 120, "temperature": 0, "response_format": {"type": "json_object"}});
    let v = ok_json(addr, "/v1/chat/completions", &req);
    let req = json!({"messages": user(prompt), "max_tokens": 120, "temperature": 0.8, "seed": 7, "n": 4, "response_format": {"type": "json_object"}});
    let sampled = ok_json(addr, "/v1/chat/completions", &req);
    for c in v["choices"].as_array().into_iter().chain(sampled["choices"].as_array()).flatten() {
        let content = c["message"]["content"].as_str().expect("content");
        total += 1;
        if c["finish_reason"] == "stop" {
            finished += 1;
            assert!(is_object(content), "a finished json_object output does not parse: {content:?}");
        }
    }
    let req = json!({"messages": user(prompt), "max_tokens": 120, "temperature": 0, "stream": true, "response_format": {"type": "json_object"}});
    let (st, raw) = post(addr, "/v1/chat/completions", &req);
    assert_eq!(st, 200);
    let streamed = sse_contents(&raw);
    assert_eq!(streamed, v["choices"][0]["message"]["content"].as_str().expect("content"), "streamed greedy output differs from the non-streamed one");
    total += 1;
    if raw.contains("\"finish_reason\":\"stop\"") {
        finished += 1;
        assert!(is_object(&streamed), "streamed output does not parse: {streamed:?}");
    }
    assert!(finished * 2 > total, "only {finished} of {total} json_object outputs finished within 120 tokens");

    // json_schema, strict.
    let schema = json!({
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": false
    });
    for temperature in [0.0, 1.0] {
        let req = json!({"messages": user("Invent a person."), "max_tokens": 100, "temperature": temperature, "seed": 3,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "strict": true, "schema": schema}}});
        let v = ok_json(addr, "/v1/chat/completions", &req);
        let content = v["choices"][0]["message"]["content"].as_str().expect("content");
        let p: Value = serde_json::from_str(content).unwrap_or_else(|e| panic!("json_schema output does not parse ({e}): {content:?}"));
        let obj = p.as_object().unwrap_or_else(|| panic!("not an object: {content}"));
        let mut keys: Vec<&str> = obj.keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(keys, ["age", "name"], "{content}");
        let name = obj["name"].as_str().unwrap_or_else(|| panic!("name not a string: {content}"));
        assert!(name.chars().count() <= 12, "{content}");
        let age = obj["age"].as_i64().unwrap_or_else(|| panic!("age not an integer: {content}"));
        assert!((0..=120).contains(&age), "{content}");
    }

    // vLLM's guided_regex and guided_grammar (Lark).
    let v = ok_json(addr, "/v1/completions", &json!({"prompt": "My phone number is", "max_tokens": 20, "temperature": 0.7, "seed": 1, "guided_regex": " [0-9]{3}-[0-9]{4}"}));
    let text = v["choices"][0]["text"].as_str().expect("text");
    let b = text.as_bytes();
    assert!(b.len() == 9 && b[0] == b' ' && b[4] == b'-' && b[1..4].iter().chain(&b[5..]).all(u8::is_ascii_digit), "regex output {text:?}");
    let v = ok_json(addr, "/v1/completions", &json!({"prompt": "Is the sky blue? Answer:", "max_tokens": 10, "temperature": 0, "guided_grammar": "start: \" yes\" | \" no\""}));
    let text = v["choices"][0]["text"].as_str().expect("text");
    assert!(text == " yes" || text == " no", "grammar output {text:?}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");

    // Refusals.
    for (body, param) in [
        (json!({"prompt": "x", "max_tokens": 2, "response_format": {"type": "json_schema"}}), "response_format"),
        (json!({"prompt": "x", "max_tokens": 2, "response_format": {"type": "yaml"}}), "response_format"),
        (json!({"prompt": "x", "max_tokens": 2, "guided_grammar": "start: ("}), "guided_grammar"),
        (json!({"prompt": "x", "max_tokens": 2, "guided_regex": "[0-9"}), "guided_regex"),
        (json!({"prompt": "x", "max_tokens": 2, "guided_json": "{not json"}), "guided_json"),
    ] {
        let (st, b) = post(addr, "/v1/completions", &body);
        assert_eq!(st, 400, "{body}: {b}");
        let e: Value = serde_json::from_str(&b).expect("error body");
        assert_eq!(e["error"]["param"], param, "{body}: {b}");
    }
    let (st, b) = post(addr, "/v1/completions", &json!({"prompt": "x", "max_tokens": 2, "guided_regex": "a", "guided_grammar": "start: \"a\""}));
    assert!(st == 400 && b.contains("at most one"), "{b}");

    let masks = metric(addr, "deco_structured_masks_total");
    let ns = metric(addr, "deco_structured_mask_nanoseconds_total");
    assert!(masks > 50.0, "{masks} masks");
    println!("structured output: {masks} masks, mean {:.1} us per mask (SmolLM2 vocabulary 49152)", ns / masks / 1e3);

    server.signal().join();
    join.join().expect("engine thread");
}
