//! End-to-end test of the OpenAI-compatible server with the official `openai` Python client.
//!
//! Starts the server in this process on a free loopback port (`tests/common`'s `TestServer`:
//! the same `deco_serve::serve_with` that `deco serve` runs), then runs `python3
//! tests/python/client_test.py` against it and asserts its exit status. Needs `python3` with
//! `pip install "openai>=1.40" prometheus_client`; without them the test fails and says so. The
//! script bounds itself (every request has a small `max_tokens`, the client has timeouts); this
//! test kills it after 5 minutes.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::TestServer;

use burn::tensor::Device;
use deco_formats::chat_template::ChatTemplate;
use deco_formats::checkpoint::Checkpoint;
use deco_formats::gguf::GgufFile;
use deco_formats::tokenizer::Tokenizer;
use deco_model::Llama;
use deco_serve::{EngineConfig, Readiness, SchedulerConfig, ServerState};

#[test]
fn openai_python_client_against_server() {
    let path = deco_tests::smollm2_gguf();
    let device = Device::default();
    let ckpt = Checkpoint::open(&path).expect("open model");
    let tokenizer = Arc::new(Tokenizer::from_gguf(&GgufFile::open(&path).expect("gguf")).expect("tokenizer"));
    let model = Llama::load(&ckpt, &device, Some(2048)).expect("load model");
    let template = tokenizer.chat_template().map(|s| ChatTemplate::new(s).expect("template"));
    let config = EngineConfig {
        block_size: 16,
        num_blocks: 256,
        scheduler: SchedulerConfig { max_num_seqs: 32, max_num_batched_tokens: 256 },
        ..EngineConfig::default()
    };
    let (engine, join) = deco_serve::spawn_engine(model, tokenizer.clone(), config).expect("engine");
    let metrics = engine.metrics.clone();
    let state = Arc::new(ServerState::new(engine, tokenizer, template, "smollm2".into()));

    let server = TestServer::start(Readiness::ready(state));
    let golden = deco_tests::asset("golden/smollm2-135m-instruct.json");
    let code = common::run_client_script("client_test.py", server.addr, &["--golden".as_ref(), golden.as_os_str()], Duration::from_secs(300));
    server.signal().join();
    join.join().expect("engine thread");
    match code {
        Some(0) => {}
        Some(2) => panic!("a Python package is missing: pip install \"openai>=1.40\" prometheus_client"),
        other => panic!("tests/python/client_test.py failed (exit {other:?}); see its output above"),
    }
    assert_eq!(metrics.kv_blocks_used.load(std::sync::atomic::Ordering::Relaxed), 0, "KV blocks leaked");
}
