//! The serving engine with AutoDeco heads on SmolLM2-135M: a seeded request gives the same tokens
//! alone and inside a batch, and the same tokens as offline AutoDeco decoding
//! (`deco_autodeco::decode::generate_batch`); heads of another model are refused.

use std::sync::Arc;

use burn::tensor::Device;
use deco_autodeco::decode::{SeqRequest, generate_batch};
use deco_autodeco::heads::{AutoDecoConfig, AutoDecoHeads};
use deco_decoding::{SamplerOrder, SamplingParams};
use deco_formats::checkpoint::Checkpoint;
use deco_formats::gguf::GgufFile;
use deco_formats::tokenizer::Tokenizer;
use deco_generate::LlamaSession;
use deco_model::Llama;
use deco_serve::{EngineConfig, EngineEvent, GenerateRequest, spawn_engine_with};

fn params(seed: u64) -> SamplingParams {
    SamplingParams { temperature: Some(0.9), top_p: Some(0.95), seed: Some(seed), max_new_tokens: Some(10), ..Default::default() }
}

fn collect(rx: &mut tokio::sync::mpsc::UnboundedReceiver<EngineEvent>) -> Vec<u32> {
    let mut toks = Vec::new();
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            EngineEvent::Delta { tokens, .. } => toks.extend(tokens.iter().map(|t| t.id)),
            EngineEvent::Finished { .. } => break,
            EngineEvent::Failed(e) => panic!("engine failed: {e}"),
        }
    }
    toks
}

#[test]
fn engine_with_heads_is_batch_invariant_and_matches_offline_decoding() {
    let path = deco_tests::smollm2_gguf();
    let load = || Llama::load(&Checkpoint::open(&path).expect("open"), &Device::flex(), Some(512)).expect("load");
    let tok = Arc::new(Tokenizer::from_gguf(&GgufFile::open(&path).expect("gguf")).expect("tok"));
    let device = Device::flex();
    device.seed(2);
    let cfg = AutoDecoConfig::new(576, 49152);
    let heads = AutoDecoHeads::init(&cfg, &device).expect("init").to_host(&cfg).expect("host");

    // Heads of another model are refused.
    let wrong_cfg = AutoDecoConfig::new(64, 49152);
    let wrong = AutoDecoHeads::init(&wrong_cfg, &device).expect("init").to_host(&wrong_cfg).expect("host");
    let err = spawn_engine_with(load(), tok.clone(), EngineConfig::default(), Some(wrong)).map(|_| ()).expect_err("mismatch");
    assert!(err.to_string().contains("hidden size 64"), "{err}");

    let model = load();
    let prompts: Vec<Vec<u32>> = ["The capital of France is", "Once upon a time", "def add(a, b):", "Water boils at"]
        .iter()
        .map(|p| tok.encode(p, true).expect("encode"))
        .collect();
    // Offline reference with the same heads and seed (dense cache).
    let offline = generate_batch(
        &mut LlamaSession::new(&model),
        Some(&heads),
        &[SeqRequest { prompt: prompts[0].clone(), params: params(42) }],
        tok.eos_token_ids(),
        1,
        SamplerOrder::HuggingFace,
        &mut |_, _| false,
    )
    .expect("offline");
    let (engine, join) = spawn_engine_with(model, tok.clone(), EngineConfig::default(), Some(heads)).expect("engine");
    let (_, mut rx) = engine.submit(GenerateRequest::sample(prompts[0].clone(), params(42), 1)).expect("submit");
    let alone = collect(&mut rx);
    let mut rxs = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let seed = if i == 0 { 42 } else { 100 + i as u64 };
        rxs.push(engine.submit(GenerateRequest::sample(p.clone(), params(seed), 1)).expect("submit").1);
    }
    let batched: Vec<Vec<u32>> = rxs.iter_mut().map(collect).collect();
    let mut offline_tokens = offline[0].generation.tokens.clone();
    if tok.eos_token_ids().contains(offline_tokens.last().expect("token")) {
        offline_tokens.pop();
    }
    assert_eq!(alone, batched[0], "same seed, alone vs in a batch of 4");
    assert_eq!(alone, offline_tokens, "engine vs offline AutoDeco decoding");
    drop(engine);
    join.join().expect("engine thread");
}
