//! Tool calls (`tools`, `tool_choice`, `parallel_tool_calls`) on Qwen2.5-Coder-0.5B-Instruct
//! (Q4_K_M GGUF, fetched by the test tier):
//! - the prompt of a tool conversation (tools, an assistant message with two calls, two tool
//!   results) equals Jinja2's rendering of the model's template, transformers' way
//!   (`tests/python/render_tool_prompt.py` wrote the golden file);
//! - the official `openai` client against the real server (`tests/python/tool_client_test.py`:
//!   auto / required / named / none, parallel calls, streaming, n = 3; arguments validated with
//!   `jsonschema`),
//!   and the mean time of the grammar masks of `required` / named calls is printed;
//! - a model whose template renders no tools (SmolLM2) refuses them, as does `/v1/completions`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use burn::tensor::Device;
use common::TestServer;
use deco_formats::chat_template::ChatTemplate;
use deco_formats::checkpoint::Checkpoint;
use deco_formats::gguf::GgufFile;
use deco_formats::tokenizer::Tokenizer;
use deco_model::Llama;
use deco_serve::{EngineConfig, Readiness, RequestContext, SchedulerConfig, ServerState, prepare_chat, prepare_completion};
use serde_json::{Value, json};

fn data(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name)
}

fn tokenizer_and_template(path: &std::path::Path) -> (Tokenizer, ChatTemplate) {
    let tok = Tokenizer::from_gguf(&GgufFile::open(path).expect("gguf")).expect("tokenizer");
    let template = ChatTemplate::new(tok.chat_template().expect("chat template")).expect("template");
    (tok, template)
}

#[test]
fn tool_conversation_renders_as_jinja2_does() {
    let (tok, template) = tokenizer_and_template(&deco_tests::qwen05b_gguf());
    let ctx = RequestContext { tokenizer: &tok, template: Some(&template), model_name: "qwen", max_sequence_tokens: 4096, grammars: None };
    let body = std::fs::read(data("tool_conversation.json")).expect("request");
    let prep = prepare_chat(&ctx, &body).expect("prepare");
    let text = tok.decode(&prep.prompts[0], false).expect("decode");
    let golden = std::fs::read_to_string(data("qwen2.5-coder_tool_conversation.txt")).expect("golden");
    assert_eq!(text, golden, "deco's rendering differs from Jinja2's");
    assert!(prep.tool_output.is_some() && prep.constraint.is_none(), "auto: parsed, not constrained");

    // tool_choice none: the tools are not rendered (the conversation still is).
    let mut none: Value = serde_json::from_slice(&body).unwrap();
    none["tool_choice"] = json!("none");
    let prep = prepare_chat(&ctx, none.to_string().as_bytes()).expect("prepare none");
    let text = tok.decode(&prep.prompts[0], false).expect("decode");
    assert!(!text.contains("<tools>") && text.contains("<tool_response>\n14:05\n</tool_response>"), "{text}");
    assert!(prep.tool_output.is_none());

    // An assistant call whose arguments are not a JSON object is refused, naming messages.
    let mut bad: Value = serde_json::from_slice(&body).unwrap();
    bad["messages"][2]["tool_calls"][0]["function"]["arguments"] = json!("[1, 2]");
    let e = prepare_chat(&ctx, bad.to_string().as_bytes()).expect_err("bad arguments");
    assert!(e.message().contains("arguments"), "{}", e.message());
}

#[test]
fn tools_are_refused_where_they_cannot_be_honoured() {
    let (tok, template) = tokenizer_and_template(&deco_tests::smollm2_gguf());
    let ctx = RequestContext { tokenizer: &tok, template: Some(&template), model_name: "smollm2", max_sequence_tokens: 2048, grammars: None };
    let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "tools": tools});
    let e = prepare_chat(&ctx, chat.to_string().as_bytes()).expect_err("SmolLM2's template renders no tools");
    assert!(e.message().contains("does not render tools"), "{}", e.message());
    // tool_choice none with tools: nothing to render or parse, accepted.
    let none = json!({"messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": "none"});
    assert!(prepare_chat(&ctx, none.to_string().as_bytes()).is_ok());
    let completion = json!({"prompt": "hi", "tools": tools});
    let e = prepare_completion(&ctx, completion.to_string().as_bytes()).expect_err("no tools on completions");
    assert!(e.message().contains("/v1/chat/completions"), "{}", e.message());
}

#[test]
fn official_client_tool_calls_on_qwen() {
    let path = deco_tests::qwen05b_gguf();
    let ckpt = Checkpoint::open(&path).expect("open model");
    let tokenizer = Arc::new(Tokenizer::from_gguf(&GgufFile::open(&path).expect("gguf")).expect("tokenizer"));
    let model = Llama::load(&ckpt, &Device::default(), Some(2048)).expect("load model");
    let template = tokenizer.chat_template().map(|s| ChatTemplate::new(s).expect("template"));
    let config = EngineConfig { block_size: 16, num_blocks: 256, scheduler: SchedulerConfig { max_num_seqs: 8, max_num_batched_tokens: 512 }, ..EngineConfig::default() };
    let (engine, join) = deco_serve::spawn_engine(model, tokenizer.clone(), config).expect("engine");
    let metrics = engine.metrics.clone();
    let state = Arc::new(ServerState::new(engine, tokenizer, template, "qwen2.5-coder-0.5b".into()));
    assert!(state.grammars.is_some(), "the grammar compiler must build for Qwen2.5");
    let server = TestServer::start(Readiness::ready(state));

    let code = common::run_client_script("tool_client_test.py", server.addr, &[], Duration::from_secs(600));
    server.signal().join();
    join.join().expect("engine thread");
    match code {
        Some(0) => {}
        Some(2) => panic!("a Python package is missing: pip install \"openai>=1.40\" jsonschema"),
        other => panic!("tests/python/tool_client_test.py failed (exit {other:?}); see its output above"),
    }
    assert_eq!(metrics.kv_blocks_used.load(std::sync::atomic::Ordering::Relaxed), 0, "KV blocks leaked");
    // `required` and named choices are constrained: the engine computed their masks.
    let masks = metrics.structured_masks.load(std::sync::atomic::Ordering::Relaxed) as f64;
    let ns = metrics.structured_mask_ns.load(std::sync::atomic::Ordering::Relaxed) as f64;
    assert!(masks > 50.0, "{masks} masks");
    println!("tool-call grammars: {masks} masks, mean {:.1} us per mask (Qwen2.5 vocabulary 151936)", ns / masks / 1e3);
}
