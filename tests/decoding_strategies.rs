//! Decoding strategies on the real SmolLM2-135M-Instruct model.

use std::sync::OnceLock;

use burn::tensor::Device;
use deco_decoding::SamplingParams;
use deco_formats::checkpoint::Checkpoint;
use deco_formats::tokenizer::Tokenizer;
use deco_generate::*;
use deco_model::Llama;
use deco_tests::smollm2_gguf;

fn model() -> &'static Llama {
    static M: OnceLock<Llama> = OnceLock::new();
    M.get_or_init(|| {
        let ckpt = Checkpoint::open(smollm2_gguf()).expect("open SmolLM2 GGUF");
        Llama::load(&ckpt, &Device::flex(), Some(1024)).expect("load SmolLM2")
    })
}

fn tokens(text: &str) -> Vec<u32> {
    let g = deco_formats::gguf::GgufFile::open(smollm2_gguf()).expect("gguf");
    Tokenizer::from_gguf(&g).expect("tokenizer").encode(text, true).expect("encode")
}

fn greedy(max_new: usize) -> SamplingParams {
    SamplingParams { temperature: Some(0.0), max_new_tokens: Some(max_new), seed: Some(0), ..Default::default() }
}

fn no_sink() -> impl FnMut(&[u32]) -> bool {
    |_: &[u32]| false
}

#[test]
fn beam_search_sequence_logprob_is_at_least_greedys() {
    let m = model();
    let prompt = tokens("The capital of France is");
    let params = greedy(8);
    let g = generate(&mut LlamaSession::new(m), &prompt, &params, &[], &mut no_sink()).expect("greedy");
    let greedy_lp: f64 = g.logprobs.iter().map(|&x| f64::from(x)).sum();
    let beam = BeamSearchParams { num_beams: 4, length_penalty: 0.0, early_stopping: EarlyStopping::Never, num_return_sequences: 2 };
    let out = beam_search(&mut LlamaSession::new(m), &prompt, &params, &beam, &[]).expect("beam");
    let best = &out.sequences[0];
    assert_eq!(best.tokens.len(), 8);
    assert!(best.sum_logprobs >= greedy_lp - 1e-4, "beam {} < greedy {greedy_lp}", best.sum_logprobs);
    assert!(out.sequences[1].score <= best.score);
    // The reported sum is the model's: re-score the beam's tokens with one forward.
    let mut s = LlamaSession::new(m);
    let full: Vec<u32> = prompt.iter().chain(&best.tokens).copied().collect();
    let rows = s.forward(&[(0, &full)], deco_model::LogitsWanted::All, false).expect("fwd").logits;
    let rescored: f64 = best
        .tokens
        .iter()
        .enumerate()
        .map(|(i, &t)| f64::from(deco_decoding::math::log_softmax(&rows[prompt.len() - 1 + i])[t as usize]))
        .sum();
    assert!((rescored - best.sum_logprobs).abs() < 1e-2, "{rescored} vs {}", best.sum_logprobs);
}

#[test]
fn speculative_at_temperature_zero_equals_greedy() {
    let m = model();
    let prompt = tokens("<|im_start|>user\nList the days of the week.<|im_end|>\n<|im_start|>assistant\n");
    let params = greedy(24);
    let g = generate(&mut LlamaSession::new(m), &prompt, &params, &[2], &mut no_sink()).expect("greedy");
    let draft = ModelDrafter::new(LlamaSession::truncated(m, 10).expect("draft"), 1).expect("drafter");
    let mut draft = draft;
    let spec = speculative_generate(&mut LlamaSession::new(m), &mut draft, &prompt, &params, 4, &[2], &mut no_sink())
        .expect("self-speculative");
    assert_eq!(spec.generation.tokens, g.tokens);
    assert!(spec.stats.drafted > 0);
    let spec = speculative_generate(&mut LlamaSession::new(m), &mut PromptLookupDrafter::default(), &prompt, &params, 4, &[2], &mut no_sink())
        .expect("prompt lookup");
    assert_eq!(spec.generation.tokens, g.tokens);
}

#[test]
fn contrastive_search_with_zero_alpha_is_greedy() {
    let m = model();
    let prompt = tokens("Once upon a time");
    let params = SamplingParams { top_k: Some(3), ..greedy(6) };
    let g = generate(&mut LlamaSession::new(m), &prompt, &params, &[], &mut no_sink()).expect("greedy");
    let cs = contrastive_search(&mut LlamaSession::new(m), &prompt, &params, 0.0, &[], &mut no_sink()).expect("cs");
    assert_eq!(cs.tokens, g.tokens);
    let cs = contrastive_search(&mut LlamaSession::new(m), &prompt, &params, 0.6, &[], &mut no_sink()).expect("cs");
    assert_eq!(cs.tokens.len(), 6);
}
