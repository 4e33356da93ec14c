//! Speculative decoding (Leviathan et al. 2023, "Fast Inference from Transformers via
//! Speculative Decoding", Algorithm 1; Chen et al. 2023, "Accelerating Large Language Model
//! Decoding with Speculative Sampling", Algorithm 2) with three drafters: a second model or the
//! target's first layers ([`ModelDrafter`]) and prompt lookup ([`PromptLookupDrafter`]).

use deco_decoding::{
    FinishReason, LogitsProcessor, LogitsProcessorList, ProcessContext, Sampler, SamplerOrder, SamplingParams,
    StoppingCriteria, math,
};
use deco_model::LogitsWanted;

use crate::error::{GenerateError, Result, invalid};
use crate::lm::CausalLm;
use crate::sample::{Generation, TokenSink};

/// The processed next-token distribution of a request: its processor chain (in Hugging Face
/// order) followed by softmax, or, for greedy requests, the one-hot distribution on the argmax
/// (lowest id on ties) of the processed logits. Both target `p` and draft `q` use it, so they
/// are "the same temperature / top-k / top-p" distributions.
#[derive(Debug)]
pub struct Processing {
    processors: LogitsProcessorList,
    greedy: bool,
}

impl Processing {
    /// From request parameters.
    ///
    /// # Errors
    /// Invalid `params`.
    pub fn new(params: &SamplingParams) -> Result<Self> {
        Ok(Self { processors: LogitsProcessorList::from_params(params, SamplerOrder::HuggingFace)?, greedy: params.is_greedy() })
    }

    /// True for greedy requests (one-hot distributions).
    pub fn is_greedy(&self) -> bool {
        self.greedy
    }

    /// Probabilities `[vocab]` of the next token after `prompt ++ output` given the model's raw
    /// `logits`.
    ///
    /// # Errors
    /// Processor errors; [`DecodingError::NoValidToken`](deco_decoding::DecodingError) if
    /// every token was filtered out.
    pub fn probs(&self, prompt: &[u32], output: &[u32], eos: &[u32], mut logits: Vec<f32>) -> Result<Vec<f32>> {
        self.processors.process(&ProcessContext::new(prompt, output, eos), &mut logits)?;
        if self.greedy {
            let a = math::argmax(&logits).ok_or(deco_decoding::DecodingError::NoValidToken)?;
            let mut p = vec![0.0; logits.len()];
            p[a] = 1.0;
            return Ok(p);
        }
        if math::max_logit(&logits) == f32::NEG_INFINITY {
            return Err(deco_decoding::DecodingError::NoValidToken.into());
        }
        Ok(math::softmax(&logits))
    }
}

/// One drafted token.
#[derive(Debug, Clone, PartialEq)]
pub struct Draft {
    /// The proposed token.
    pub token: u32,
    /// The drafter's processed distribution `q` `[vocab]` the token was drawn from; `None` for
    /// a deterministic proposal (`q` one-hot on `token`), e.g. prompt lookup.
    pub q: Option<Vec<f32>>,
}

/// Proposes continuation tokens for speculative decoding.
pub trait Drafter {
    /// Proposes up to `gamma` tokens continuing `prompt ++ output` (may return fewer, even
    /// none).
    ///
    /// # Errors
    /// Model or processing errors.
    fn propose(&mut self, prompt: &[u32], output: &[u32], eos: &[u32], gamma: usize, processing: &Processing) -> Result<Vec<Draft>>;

    /// The first `len` tokens of `prompt ++ output` are final and agree with what this drafter
    /// saw; anything it cached beyond them must be dropped.
    ///
    /// # Errors
    /// Model errors.
    fn rollback(&mut self, len: usize) -> Result<()>;
}

/// A draft language model (a second, smaller model sharing the tokenizer, or the target's first
/// `k` layers via [`LlamaSession::truncated`](crate::LlamaSession::truncated)). Samples each
/// draft token from its processed distribution with its own seeded RNG.
#[derive(Debug)]
pub struct ModelDrafter<L: CausalLm> {
    lm: L,
    fed: usize,
    rng: Sampler,
    /// Forward passes run by the draft model.
    pub forward_calls: usize,
}

impl<L: CausalLm> ModelDrafter<L> {
    /// Wraps a draft model; `seed` seeds its RNG (draws are independent of the target's).
    ///
    /// # Errors
    /// None in practice (the empty processor list is always valid).
    pub fn new(mut lm: L, seed: u64) -> Result<Self> {
        lm.remove(0);
        let rng = Sampler::from_processors(LogitsProcessorList::new(), false, Some(seed), None)?;
        Ok(Self { lm, fed: 0, rng, forward_calls: 0 })
    }

    /// The wrapped model.
    pub fn into_inner(self) -> L {
        self.lm
    }
}

impl<L: CausalLm> Drafter for ModelDrafter<L> {
    fn propose(&mut self, prompt: &[u32], output: &[u32], eos: &[u32], gamma: usize, processing: &Processing) -> Result<Vec<Draft>> {
        let ctx: Vec<u32> = prompt.iter().chain(output).copied().collect();
        let gamma = gamma.min(self.lm.max_context().saturating_sub(ctx.len()));
        if gamma == 0 {
            return Ok(Vec::new());
        }
        if self.fed >= ctx.len() {
            // Re-feed the last token to get its logits.
            self.fed = ctx.len() - 1;
            self.lm.truncate(0, self.fed)?;
        }
        let mut feed: Vec<u32> = ctx[self.fed..].to_vec();
        let mut drafted_out = output.to_vec();
        let mut out = Vec::with_capacity(gamma);
        for _ in 0..gamma {
            let logits = self.lm.forward(&[(0, &feed)], LogitsWanted::Last, false)?.logits.remove(0);
            self.forward_calls += 1;
            self.fed += feed.len();
            let q = processing.probs(prompt, &drafted_out, eos, logits)?;
            let token = if processing.is_greedy() {
                q.iter().position(|&x| x == 1.0).unwrap_or(0) as u32
            } else {
                self.rng.sample_weights(&q)?
            };
            drafted_out.push(token);
            out.push(Draft { token, q: Some(q) });
            if eos.contains(&token) {
                break;
            }
            feed = vec![token];
        }
        Ok(out)
    }

    fn rollback(&mut self, len: usize) -> Result<()> {
        if len < self.fed {
            self.fed = len;
            self.lm.truncate(0, len)?;
        }
        Ok(())
    }
}

/// Prompt-lookup decoding (Saxena 2023; Hugging Face `PromptLookupCandidateGenerator`): find the
/// last `n`-gram of the context earlier in the context (`n` from `max_matching_ngram_size`
/// down to 1, earliest match first) and propose the tokens that followed it. Deterministic
/// (`q` one-hot), no model.
#[derive(Debug, Clone, Copy)]
pub struct PromptLookupDrafter {
    /// Longest n-gram matched (Hugging Face `max_matching_ngram_size`, default 2).
    pub max_matching_ngram_size: usize,
}

impl Default for PromptLookupDrafter {
    fn default() -> Self {
        Self { max_matching_ngram_size: 2 }
    }
}

impl PromptLookupDrafter {
    /// The candidate continuation of `ctx` (at most `num_tokens`), as Hugging Face's
    /// `PromptLookupCandidateGenerator.get_candidates`.
    pub fn lookup(&self, ctx: &[u32], num_tokens: usize) -> Vec<u32> {
        let len = ctx.len();
        for n in (1..=self.max_matching_ngram_size.min(len.saturating_sub(1))).rev() {
            let ngram = &ctx[len - n..];
            for start in 0..=len - n {
                if &ctx[start..start + n] == ngram {
                    let s = start + n;
                    let e = (s + num_tokens).min(len);
                    if s < e {
                        return ctx[s..e].to_vec();
                    }
                }
            }
        }
        Vec::new()
    }
}

impl Drafter for PromptLookupDrafter {
    fn propose(&mut self, prompt: &[u32], output: &[u32], _eos: &[u32], gamma: usize, _p: &Processing) -> Result<Vec<Draft>> {
        let ctx: Vec<u32> = prompt.iter().chain(output).copied().collect();
        Ok(self.lookup(&ctx, gamma).into_iter().map(|token| Draft { token, q: None }).collect())
    }

    fn rollback(&mut self, _len: usize) -> Result<()> {
        Ok(())
    }
}

/// Counters of a speculative run.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SpeculativeStats {
    /// Verification rounds (= target forwards after the prefill).
    pub rounds: usize,
    /// Draft tokens proposed.
    pub drafted: usize,
    /// Draft tokens accepted.
    pub accepted: usize,
    /// Target forward passes, prefill included.
    pub target_forward_calls: usize,
}

impl SpeculativeStats {
    /// `accepted / drafted` (0 when nothing was drafted).
    pub fn acceptance_rate(&self) -> f64 {
        if self.drafted == 0 { 0.0 } else { self.accepted as f64 / self.drafted as f64 }
    }
}

/// Result of [`speculative_generate`].
#[derive(Debug, Clone, PartialEq)]
pub struct SpeculativeOutput {
    /// The generation.
    pub generation: Generation,
    /// Counters (acceptance rate...).
    pub stats: SpeculativeStats,
}

/// Accept/reject step for one draft token `x` with target distribution `p` and draft `q`
/// (`None` = one-hot on `x`), uniform draw `u`: accepted iff `u < p(x) / q(x)` (Leviathan et
/// al. Alg. 1: accept w.p. `min(1, p/q)`). On rejection returns the residual weights
/// `max(p - q, 0)` (unnormalised; [`Sampler::sample_weights`] normalises).
pub fn accept_or_residual(p: &[f32], q: Option<&[f32]>, x: u32, u: f64) -> std::result::Result<(), Vec<f32>> {
    let xi = x as usize;
    let px = f64::from(p.get(xi).copied().unwrap_or(0.0));
    let qx = q.map_or(1.0, |q| f64::from(q.get(xi).copied().unwrap_or(0.0)));
    if qx > 0.0 && u < px / qx {
        return Ok(());
    }
    Err(match q {
        Some(q) => p.iter().zip(q).map(|(&a, &b)| (a - b).max(0.0)).collect(),
        None => {
            let mut r = p.to_vec();
            if let Some(v) = r.get_mut(xi) {
                *v = (*v - 1.0).max(0.0);
            }
            r
        }
    })
}

/// Speculative decoding of one sequence (sequence 0 of `target`).
///
/// Each round: the drafter proposes `γ = min(num_speculative_tokens, tokens left - 1)` tokens
/// with distributions `q_i`; the target scores the pending context tokens and the drafts in one
/// forward ([`LogitsWanted::All`]), giving `p_1..p_{γ+1}` (processed with the same chain as
/// `q`, see [`Processing`]). Draft `i` is accepted with probability `min(1, p_i(x)/q_i(x))`
/// (one uniform from the request's seeded RNG); at the first rejection a token is drawn from
/// `norm(max(p_i - q_i, 0))` and the round ends; if all are accepted a bonus token is drawn
/// from `p_{γ+1}`. The target's cache is then truncated to the accepted prefix and the
/// drafter rolls back. The output follows the target's processed distribution exactly; for a
/// greedy request it equals plain greedy decoding token for token.
///
/// # Errors
/// `num_speculative_tokens == 0`, invalid `params`, an empty / too long prompt, model errors.
pub fn speculative_generate(
    target: &mut dyn CausalLm,
    drafter: &mut dyn Drafter,
    prompt: &[u32],
    params: &SamplingParams,
    num_speculative_tokens: usize,
    eos_token_ids: &[u32],
    sink: &mut TokenSink<'_>,
) -> Result<SpeculativeOutput> {
    if num_speculative_tokens == 0 {
        return Err(invalid("num_speculative_tokens", "must be >= 1", 0));
    }
    let processing = Processing::new(params)?;
    let stopping = StoppingCriteria::from_params(params, eos_token_ids)?;
    let mut rng = Sampler::from_processors(LogitsProcessorList::new(), false, params.seed, None)?;
    let budget = crate::sample::budget(target.max_context(), prompt, params)?;
    let seq = 0;
    target.remove(seq);
    let mut stats = SpeculativeStats::default();
    let mut fed = 0;
    if prompt.len() > 1 {
        target.forward(&[(seq, &prompt[..prompt.len() - 1])], LogitsWanted::Last, false)?;
        stats.target_forward_calls += 1;
        fed = prompt.len() - 1;
    }
    let mut g = Generation::new();
    'outer: while g.tokens.len() < budget {
        let ctx_len = prompt.len() + g.tokens.len();
        let room = (budget - g.tokens.len() - 1).min(target.max_context().saturating_sub(ctx_len + 1));
        let gamma = num_speculative_tokens.min(room);
        let drafts = if gamma > 0 { drafter.propose(prompt, &g.tokens, eos_token_ids, gamma, &processing)? } else { Vec::new() };
        let drafts = &drafts[..drafts.len().min(gamma)];
        let mut feed: Vec<u32> = prompt.iter().chain(&g.tokens).skip(fed).copied().collect();
        let pending = feed.len();
        feed.extend(drafts.iter().map(|d| d.token));
        let rows = target.forward(&[(seq, &feed)], LogitsWanted::All, false)?.logits;
        stats.target_forward_calls += 1;
        stats.rounds += 1;
        stats.drafted += drafts.len();
        let mut rows = rows.into_iter().skip(pending - 1);
        let mut new_tokens = Vec::with_capacity(drafts.len() + 1);
        let mut accepted = 0;
        let mut finished = None;
        for d in drafts {
            let row = rows.next().ok_or_else(|| GenerateError::InvalidInput("target returned too few rows".into()))?;
            let p = processing.probs(prompt, &g.tokens, eos_token_ids, row)?;
            let u = rng.uniform();
            let token = match accept_or_residual(&p, d.q.as_deref(), d.token, u) {
                Ok(()) => {
                    accepted += 1;
                    d.token
                }
                Err(residual) => match rng.sample_weights(&residual) {
                    Ok(t) => t,
                    // p == q up to rounding: the residual is empty, draw from p.
                    Err(deco_decoding::DecodingError::NoValidToken) => rng.sample_weights(&p)?,
                    Err(e) => return Err(e.into()),
                },
            };
            g.tokens.push(token);
            g.logprobs.push(p[token as usize].ln());
            new_tokens.push(token);
            if let Some(r) = stopping.check(token, g.tokens.len()) {
                finished = Some(r);
                break;
            }
            if token != d.token {
                break;
            }
        }
        stats.accepted += accepted;
        if finished.is_none() && accepted == drafts.len() {
            let row = rows.next().ok_or_else(|| GenerateError::InvalidInput("target returned too few rows".into()))?;
            let p = processing.probs(prompt, &g.tokens, eos_token_ids, row)?;
            let token = rng.sample_weights(&p)?;
            g.tokens.push(token);
            g.logprobs.push(p[token as usize].ln());
            new_tokens.push(token);
            finished = stopping.check(token, g.tokens.len());
        }
        let user_stop = sink(&new_tokens);
        if let Some(r) = finished {
            g.finish_reason = r;
            break 'outer;
        }
        if user_stop {
            g.finish_reason = FinishReason::Stop;
            break;
        }
        // Keep the cache up to (not including) the newest token.
        fed = ctx_len + accepted;
        target.truncate(seq, fed)?;
        drafter.rollback(fed)?;
    }
    target.remove(seq);
    Ok(SpeculativeOutput { generation: g, stats })
}
