//! The engine draws the plain sampled tokens of a step in parallel over its sequences
//! (`Engine::presample`). On SmolLM2-135M: seeded requests (temperature, top-p, top-k,
//! repetition penalty) give the same tokens alone as in a batch of six drawn in parallel (n = 2
//! included), and an independent replay (prompt and tokens teacher-forced through one forward
//! with a dense cache, then the seeded sampler row by row) reproduces them.

use std::sync::Arc;

use burn::tensor::Device;
use deco_decoding::{ProcessContext, Sampler, SamplingParams};
use deco_formats::checkpoint::Checkpoint;
use deco_formats::gguf::GgufFile;
use deco_formats::tokenizer::Tokenizer;
use deco_model::{DenseKvCache, Llama, LogitsWanted, SeqInput};
use deco_serve::{EngineConfig, EngineEvent, GenerateRequest, spawn_engine};

fn params(seed: u64, i: usize) -> SamplingParams {
    let mut p = SamplingParams { temperature: Some(0.8), seed: Some(seed), min_new_tokens: Some(12), max_new_tokens: Some(12), ..Default::default() };
    match i % 3 {
        0 => p.top_p = Some(0.9),
        1 => p.top_k = Some(40),
        _ => p.repetition_penalty = Some(1.3),
    }
    p
}

/// Every choice's tokens, in choice order.
fn collect(rx: &mut tokio::sync::mpsc::UnboundedReceiver<EngineEvent>, n: usize) -> Vec<Vec<u32>> {
    let mut out = vec![Vec::new(); n];
    let mut finished = 0;
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            EngineEvent::Delta { index, tokens, .. } => out[index].extend(tokens.iter().map(|t| t.id)),
            EngineEvent::Finished { .. } => {
                finished += 1;
                if finished == n {
                    break;
                }
            }
            EngineEvent::Failed(e) => panic!("engine failed: {e}"),
        }
    }
    out
}

/// Seeded sampling of `prompt` + `tokens` replayed outside the engine.
fn replay(model: &Llama, prompt: &[u32], tokens: &[u32], params: &SamplingParams, eos: &[u32]) -> Vec<u32> {
    let full: Vec<u32> = prompt.iter().chain(tokens).copied().collect();
    let mut cache = DenseKvCache::new(model.num_layers());
    let out = model.forward(&[SeqInput { seq: 0, tokens: &full[..full.len() - 1], tree: None }], &mut cache, LogitsWanted::All).expect("forward");
    let logits = out.logits_rows().expect("logits");
    let mut sampler = Sampler::new(params).expect("sampler");
    let mut ids = Vec::new();
    for i in 0..tokens.len() {
        let mut l = logits[prompt.len() - 1 + i].clone();
        ids.push(sampler.sample(&ProcessContext::new(prompt, &ids, eos), &mut l).expect("sample").token);
    }
    ids
}

#[test]
fn parallel_draws_equal_alone_and_offline_sampling() {
    let path = deco_tests::smollm2_gguf();
    let model = Llama::load(&Checkpoint::open(&path).expect("open"), &Device::flex(), Some(512)).expect("load");
    let tok = Arc::new(Tokenizer::from_gguf(&GgufFile::open(&path).expect("gguf")).expect("tok"));
    let prompts: Vec<Vec<u32>> = ["The capital of France is", "Once upon a time", "def add(a, b):", "Water boils at", "My favourite colour"]
        .iter()
        .map(|p| tok.encode(p, true).expect("encode"))
        .collect();
    let (engine, join) = spawn_engine(model.clone(), tok.clone(), EngineConfig::default()).expect("engine");
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let (_, mut rx) = engine.submit(GenerateRequest::sample(p.clone(), params(7 + i as u64, i), 1)).expect("submit");
            collect(&mut rx, 1).remove(0)
        })
        .collect();
    // All five at once, plus the first prompt again with n = 2 (its choices use seeds 7 and 8).
    let mut rxs: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| engine.submit(GenerateRequest::sample(p.clone(), params(7 + i as u64, i), 1)).expect("submit").1)
        .collect();
    let (_, mut rx2) = engine.submit(GenerateRequest::sample(prompts[0].clone(), params(7, 0), 2)).expect("submit n = 2");
    let batched: Vec<Vec<u32>> = rxs.iter_mut().map(|rx| collect(rx, 1).remove(0)).collect();
    let two = collect(&mut rx2, 2);
    for (i, (a, b)) in alone.iter().zip(&batched).enumerate() {
        assert_eq!(a.len(), 12, "request {i}: 12 tokens");
        assert_eq!(a, b, "request {i}: alone vs in a batch drawn in parallel");
    }
    assert_eq!(two[0], alone[0], "choice 0 of n = 2 uses the request's seed");
    assert_eq!(two[1], replay(&model, &prompts[0], &two[1], &params(8, 0), tok.eos_token_ids()), "choice 1 of n = 2 (seed + 1), replayed");
    for (i, (p, a)) in prompts.iter().zip(&alone).enumerate() {
        assert_eq!(&replay(&model, p, a, &params(7 + i as u64, i), tok.eos_token_ids()), a, "request {i}: engine vs offline replay");
    }
    drop(engine);
    join.join().expect("engine thread");
}
