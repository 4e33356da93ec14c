//! Contrastive search (Su et al. 2022, "A Contrastive Framework for Neural Text Generation",
//! §5 Eq. 4; Hugging Face `GenerationMixin._contrastive_search` and `_ranking_fast`) and
//! contrastive decoding (Li et al. 2023, "Contrastive Decoding: Open-ended Text Generation as
//! Optimization", §3, Eq. 2-4).

use deco_decoding::{
    LogitsProcessor, LogitsProcessorList, ProcessContext, Sampler, SamplerOrder, SamplingParams,
    StoppingCriteria, math,
};
use deco_model::LogitsWanted;

use crate::error::{GenerateError, Result, invalid};
use crate::lm::{CausalLm, SeqId};
use crate::sample::{Generation, TokenSink};

/// Cosine similarity of two vectors (0 when either is zero).
fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let (mut ab, mut aa, mut bb) = (0.0f64, 0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(b) {
        ab += f64::from(x) * f64::from(y);
        aa += f64::from(x) * f64::from(x);
        bb += f64::from(y) * f64::from(y);
    }
    if aa == 0.0 || bb == 0.0 { 0.0 } else { ab / (aa.sqrt() * bb.sqrt()) }
}

/// Degeneration penalty of a candidate: `max_j cos(h_candidate, h_j)` over the context's hidden
/// states (Su et al. 2022, Eq. 4).
pub fn degeneration_penalty(candidate: &[f32], context: &[Vec<f32>]) -> f64 {
    context.iter().map(|h| cosine(candidate, h)).fold(f64::NEG_INFINITY, f64::max)
}

/// Contrastive search: at each step take the `top_k` tokens of the processed distribution `p`
/// and choose `argmax_v (1 - penalty_alpha) * p(v) - penalty_alpha * max_j cos(h_v, h_j)`, where
/// `h_v` is the last-layer hidden state (after the final norm) of candidate `v` and `h_j` those
/// of every previous token (prompt included). The `top_k` candidates run as one batched
/// forward on forks of the sequence's cache; the winner's cache, logits and hidden state carry
/// on (no extra forward), exactly as Hugging Face's `_contrastive_search`.
///
/// `params.top_k` is the candidate count (Hugging Face requires `top_k > 1`); the history
/// processors of `params` apply, the warpers do not (contrastive search is deterministic).
///
/// # Errors
/// `penalty_alpha` outside `[0, 1]`, `top_k` absent or `< 1`, invalid `params`, an empty / too
/// long prompt, model errors (the model must provide hidden states).
pub fn contrastive_search(
    lm: &mut dyn CausalLm,
    prompt: &[u32],
    params: &SamplingParams,
    penalty_alpha: f32,
    eos_token_ids: &[u32],
    sink: &mut TokenSink<'_>,
) -> Result<Generation> {
    if !(0.0..=1.0).contains(&penalty_alpha) {
        return Err(invalid("penalty_alpha", "must be in [0, 1]", penalty_alpha));
    }
    let top_k = match params.top_k {
        Some(k) if k >= 1 => k as usize,
        other => return Err(invalid("top_k", "must be >= 1 for contrastive search", format!("{other:?}"))),
    };
    let greedy = SamplingParams { do_sample: Some(false), ..params.clone() };
    let processors = LogitsProcessorList::from_params(&greedy, SamplerOrder::HuggingFace)?;
    let stopping = StoppingCriteria::from_params(params, eos_token_ids)?;
    let budget = crate::sample::budget(lm.max_context(), prompt, params)?;
    let alpha = f64::from(penalty_alpha);

    let mut main: SeqId = 0;
    let mut next_id: SeqId = 1;
    lm.remove(main);
    let out = lm.forward(&[(main, prompt)], LogitsWanted::All, true)?;
    let mut context_hidden = out.hidden;
    let mut logits = out.logits.last().cloned().ok_or_else(|| GenerateError::InvalidInput("no logits".into()))?;
    let mut g = Generation::new();
    loop {
        processors.process(&ProcessContext::new(prompt, &g.tokens, eos_token_ids), &mut logits)?;
        let probs = math::softmax(&logits);
        let mut cand: Vec<usize> = (0..probs.len()).filter(|&v| logits[v] > f32::NEG_INFINITY).collect();
        if cand.is_empty() {
            return Err(deco_decoding::DecodingError::NoValidToken.into());
        }
        cand.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
        cand.truncate(top_k);
        let ids: Vec<SeqId> = (0..cand.len() as u64).map(|i| next_id + i).collect();
        next_id += cand.len() as u64;
        for &id in &ids {
            lm.fork(main, id)?;
        }
        let toks: Vec<[u32; 1]> = cand.iter().map(|&v| [v as u32]).collect();
        let inputs: Vec<(SeqId, &[u32])> = ids.iter().zip(&toks).map(|(&id, t)| (id, &t[..])).collect();
        let step = lm.forward(&inputs, LogitsWanted::Last, true)?;
        let mut best = 0;
        let mut best_score = f64::NEG_INFINITY;
        for (i, &v) in cand.iter().enumerate() {
            let pen = degeneration_penalty(&step.hidden[i], &context_hidden);
            let score = (1.0 - alpha) * f64::from(probs[v]) - alpha * pen;
            if score > best_score {
                best_score = score;
                best = i;
            }
        }
        lm.remove(main);
        for (i, &id) in ids.iter().enumerate() {
            if i != best {
                lm.remove(id);
            }
        }
        main = ids[best];
        let token = cand[best] as u32;
        context_hidden.push(step.hidden[best].clone());
        logits = step.logits[best].clone();
        if g.push(token, probs[cand[best]].ln(), None, sink, &stopping) {
            break;
        }
        if g.tokens.len() >= budget || prompt.len() + g.tokens.len() >= lm.max_context() {
            break;
        }
    }
    lm.remove(main);
    Ok(g)
}

/// Contrastive decoding parameters (Li et al. 2023).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ContrastiveDecodingParams {
    /// Plausibility cutoff α in `[0, 1]`: only tokens with `p_expert >= α * max p_expert` are
    /// scored (paper §3.2, Eq. 3; default 0.1).
    pub alpha: f32,
    /// Temperature applied to the amateur's logits before its log-softmax, `> 0` (paper §4:
    /// τ = 0.5 for the amateur in some settings; default 1.0).
    pub amateur_temperature: f32,
}

impl Default for ContrastiveDecodingParams {
    fn default() -> Self {
        Self { alpha: 0.1, amateur_temperature: 1.0 }
    }
}

/// The contrastive decoding score row: `log p_e(v) - log p_a(v)` for tokens with
/// `p_e(v) >= alpha * max p_e`, `-inf` otherwise (Li et al. 2023, Eq. 2-4).
/// `expert` and `amateur` are raw logits rows of the same length; the amateur's are divided by
/// `amateur_temperature` first.
pub fn contrastive_scores(expert: &[f32], amateur: &[f32], alpha: f32, amateur_temperature: f32) -> Vec<f32> {
    let le = math::log_softmax(expert);
    let scaled: Vec<f32> = amateur.iter().map(|&x| x / amateur_temperature).collect();
    let la = math::log_softmax(&scaled);
    let cut = alpha.ln() + math::max_logit(&le);
    le.iter()
        .zip(&la)
        .map(|(&e, &a)| if e >= cut && e > f32::NEG_INFINITY { e - a } else { f32::NEG_INFINITY })
        .collect()
}

/// Contrastive decoding: each step both models score the context; the token is chosen from
/// [`contrastive_scores`] by the request's [`Sampler`] (history processors, then argmax for a
/// greedy request, as the paper's greedy search; or sampling with the warpers). The amateur is a
/// second model with the same tokenizer, or the expert cut to its first layers
/// ([`LlamaSession::truncated`](crate::LlamaSession::truncated)).
///
/// # Errors
/// `alpha` outside `[0, 1]`, `amateur_temperature <= 0`, mismatched vocabularies, invalid
/// `params`, prompt or model errors.
pub fn contrastive_decoding(
    expert: &mut dyn CausalLm,
    amateur: &mut dyn CausalLm,
    prompt: &[u32],
    params: &SamplingParams,
    cd: &ContrastiveDecodingParams,
    eos_token_ids: &[u32],
    sink: &mut TokenSink<'_>,
) -> Result<Generation> {
    if !(0.0..=1.0).contains(&cd.alpha) {
        return Err(invalid("alpha", "must be in [0, 1]", cd.alpha));
    }
    if !(cd.amateur_temperature.is_finite() && cd.amateur_temperature > 0.0) {
        return Err(invalid("amateur_temperature", "must be a finite number > 0", cd.amateur_temperature));
    }
    if expert.vocab_size() != amateur.vocab_size() {
        return Err(GenerateError::InvalidInput(format!(
            "expert and amateur vocabularies differ ({} vs {})",
            expert.vocab_size(),
            amateur.vocab_size()
        )));
    }
    let mut sampler = Sampler::new(params)?;
    let stopping = StoppingCriteria::from_params(params, eos_token_ids)?;
    let budget = crate::sample::budget(expert.max_context().min(amateur.max_context()), prompt, params)?;
    expert.remove(0);
    amateur.remove(0);
    let mut feed: Vec<u32> = prompt.to_vec();
    let mut g = Generation::new();
    loop {
        let e = expert.forward(&[(0, &feed)], LogitsWanted::Last, false)?.logits.remove(0);
        let a = amateur.forward(&[(0, &feed)], LogitsWanted::Last, false)?.logits.remove(0);
        let mut scores = contrastive_scores(&e, &a, cd.alpha, cd.amateur_temperature);
        let out = sampler.sample(&ProcessContext::new(prompt, &g.tokens, eos_token_ids), &mut scores)?;
        let token = out.token;
        if g.push(token, out.logprob, Some(out), sink, &stopping) || g.tokens.len() >= budget {
            break;
        }
        feed = vec![token];
    }
    expert.remove(0);
    amateur.remove(0);
    Ok(g)
}
