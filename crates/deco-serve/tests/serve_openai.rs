//! End-to-end test of the OpenAI-compatible server with the official `openai` Python client.
//!
//! Starts the server in this process on a free loopback port (the same `deco_serve::serve` that
//! `deco serve` runs), then runs `python3 tests/python/client_test.py` against it and asserts
//! its exit status. Needs `python3` with `pip install "openai>=1.40" prometheus_client`; without them the test fails
//! and says so. The script bounds itself (every request has a small `max_tokens`, the client has
//! timeouts); this test kills it after 5 minutes.

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::tensor::Device;
use deco_formats::chat_template::ChatTemplate;
use deco_formats::checkpoint::Checkpoint;
use deco_formats::gguf::GgufFile;
use deco_formats::tokenizer::Tokenizer;
use deco_model::Llama;
use deco_serve::{EngineConfig, SchedulerConfig, ServerState};

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

    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = rt.spawn(deco_serve::serve(listener, state, async {
        let _ = stop_rx.await;
    }));

    let script = deco_tests::workspace_root().join("tests/python/client_test.py");
    let golden = deco_tests::asset("golden/smollm2-135m-instruct.json");
    let mut child = Command::new("python3")
        .arg(&script)
        .arg("--base-url")
        .arg(format!("http://{addr}/v1"))
        .arg("--golden")
        .arg(&golden)
        .spawn()
        .expect("python3 must be installed to run the OpenAI client test");
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if start.elapsed() > Duration::from_secs(300) {
            let _ = child.kill();
            panic!("client test did not finish in 5 minutes");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let _ = stop_tx.send(());
    rt.block_on(server).expect("server task").expect("server");
    drop(rt);
    join.join().expect("engine thread");
    match status.code() {
        Some(0) => {}
        Some(2) => panic!("a Python package is missing: pip install \"openai>=1.40\" prometheus_client"),
        other => panic!("tests/python/client_test.py failed (exit {other:?}); see its output above"),
    }
    assert_eq!(metrics.kv_blocks_used.load(std::sync::atomic::Ordering::Relaxed), 0, "KV blocks leaked");
}
