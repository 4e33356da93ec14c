//! The serving engine with AutoDeco heads on SmolLM2-135M: a seeded request gives the same tokens
//! alone and inside a batch, and they are reproduced by an independent replay (the request's
//! prompt and tokens teacher-forced through one forward of the model with a dense cache, the
//! heads and the seeded sampler applied row by row); heads of another model are refused.

use std::sync::Arc;

use burn::tensor::Device;
use deco_autodeco::decode::combine;
use deco_autodeco::heads::{AutoDecoConfig, AutoDecoHeads, HostHeads};
use deco_decoding::{LogitsProcessorList, ProcessContext, Sampler, SamplerOrder, SamplingParams};
use deco_formats::checkpoint::Checkpoint;
use deco_formats::gguf::GgufFile;
use deco_formats::tokenizer::Tokenizer;
use deco_model::{DenseKvCache, Llama, LogitsWanted, SeqInput};
use deco_serve::{EngineConfig, EngineEvent, GenerateRequest, spawn_engine_with};

fn params(seed: u64) -> SamplingParams {
    SamplingParams { temperature: Some(0.9), top_p: Some(0.95), seed: Some(seed), max_new_tokens: Some(10), ..Default::default() }
}

/// A request's tokens and the heads' `(T, P)` per token.
type Sampled = (Vec<u32>, Vec<(f32, f32)>);

/// Collects one request's events.
fn collect(rx: &mut tokio::sync::mpsc::UnboundedReceiver<EngineEvent>) -> Sampled {
    let (mut toks, mut tp) = (Vec::new(), Vec::new());
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            EngineEvent::Delta { tokens, .. } => {
                toks.extend(tokens.iter().map(|t| t.id));
                tp.extend(tokens.iter().filter_map(|t| t.autodeco));
            }
            EngineEvent::Finished { .. } => break,
            EngineEvent::Failed(e) => panic!("engine failed: {e}"),
        }
    }
    (toks, tp)
}

/// Replays AutoDeco decoding of `prompt` + `tokens` independently of the engine: one forward over
/// the whole sequence (dense cache, every position's logits and hidden state), then per position
/// the heads' prediction and the seeded sampler with the combined parameters. Returns the
/// replayed tokens and predictions.
fn replay(model: &Llama, heads: &HostHeads, prompt: &[u32], tokens: &[u32], params: &SamplingParams, eos: &[u32]) -> Sampled {
    let full: Vec<u32> = prompt.iter().chain(tokens).copied().collect();
    let mut cache = DenseKvCache::new(model.num_layers());
    let out = model.forward(&[SeqInput { seq: 0, tokens: &full[..full.len() - 1], tree: None }], &mut cache, LogitsWanted::All).expect("forward");
    let logits = out.logits_rows().expect("logits");
    let hidden = deco_model::host::to_host_rows(out.hidden).expect("hidden");
    let mut sampler = Sampler::new(params).expect("sampler");
    let (mut ids, mut tp) = (Vec::new(), Vec::new());
    for i in 0..tokens.len() {
        let row = prompt.len() - 1 + i;
        let mut l = logits[row].clone();
        let pred = heads.predict(&hidden[row], &l).expect("predict");
        tp.push((pred.temperature, pred.top_p));
        let processors = LogitsProcessorList::from_params(&combine(params, pred), SamplerOrder::HuggingFace).expect("processors");
        let t = sampler.sample_with(&processors, &ProcessContext::new(prompt, &ids, eos), &mut l).expect("sample").token;
        ids.push(t);
    }
    (ids, tp)
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
    let (engine, join) = spawn_engine_with(model.clone(), tok.clone(), EngineConfig::default(), Some(heads.clone())).expect("engine");
    let (_, mut rx) = engine.submit(GenerateRequest::sample(prompts[0].clone(), params(42), 1)).expect("submit");
    let alone = collect(&mut rx);
    let mut rxs = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let seed = if i == 0 { 42 } else { 100 + i as u64 };
        rxs.push(engine.submit(GenerateRequest::sample(p.clone(), params(seed), 1)).expect("submit").1);
    }
    let batched: Vec<Sampled> = rxs.iter_mut().map(collect).collect();
    assert_eq!(alone.0, batched[0].0, "same seed, alone vs in a batch of 4");
    let (ids, tp) = replay(&model, &heads, &prompts[0], &alone.0, &params(42), tok.eos_token_ids());
    assert_eq!(ids, alone.0, "engine vs independent replay of AutoDeco decoding");
    assert_eq!(tp.len(), alone.1.len());
    for (a, b) in tp.iter().zip(&alone.1) {
        assert!((a.0 - b.0).abs() < 1e-3 && (a.1 - b.1).abs() < 1e-3, "predictions {a:?} vs {b:?}");
    }
    drop(engine);
    join.join().expect("engine thread");
}
