//! The plain autoregressive loop: greedy decoding or sampling with the processor chain.

use deco_decoding::{FinishReason, ProcessContext, SampleOutput, Sampler, SamplingParams, StoppingCriteria};
use deco_model::LogitsWanted;

use crate::error::{GenerateError, Result};
use crate::lm::CausalLm;

/// Receives newly decided tokens in order (one or more per call, e.g. several per speculative
/// step); returns `true` to end generation now (e.g. a stop string matched in the text).
pub type TokenSink<'a> = dyn FnMut(&[u32]) -> bool + 'a;

/// A finished generation of one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// Generated token ids; the EOS / stop token that ended generation is included (as Hugging
    /// Face's `generate` keeps it).
    pub tokens: Vec<u32>,
    /// Per token, `ln p(token)` under the distribution it was chosen from (processed logits; for
    /// speculative decoding, the target's processed distribution).
    pub logprobs: Vec<f32>,
    /// Per-token sampler output (chosen and top-N logprobs) when the strategy samples from
    /// processed logits token by token (greedy / sample / early exit); empty otherwise.
    pub samples: Vec<SampleOutput>,
    /// Why generation ended.
    pub finish_reason: FinishReason,
}

impl Generation {
    /// An empty generation; its finish reason stays `Length` unless something stops it.
    pub(crate) fn new() -> Self {
        Self { tokens: Vec::new(), logprobs: Vec::new(), samples: Vec::new(), finish_reason: FinishReason::Length }
    }

    /// Records one chosen token (with its log-probability and, when the strategy sampled it token
    /// by token, the sampler's output), streams it to `sink`, and says whether generation must
    /// stop: a stopping criterion fired (EOS, stop id, `max_new_tokens`) or the sink asked to stop.
    /// Sets `finish_reason` accordingly.
    pub(crate) fn push(
        &mut self,
        token: u32,
        logprob: f32,
        sample: Option<SampleOutput>,
        sink: &mut TokenSink<'_>,
        stopping: &StoppingCriteria,
    ) -> bool {
        self.tokens.push(token);
        self.logprobs.push(logprob);
        self.samples.extend(sample);
        let user_stop = sink(&[token]);
        if let Some(r) = stopping.check(token, self.tokens.len()) {
            self.finish_reason = r;
            return true;
        }
        if user_stop {
            self.finish_reason = FinishReason::Stop;
            return true;
        }
        false
    }
}

/// Default `max_new_tokens` when the request gives none (Hugging Face's default `max_length`).
pub const DEFAULT_MAX_NEW_TOKENS: usize = deco_decoding::HF_DEFAULT_MAX_LENGTH;

/// Checks the prompt against the model and returns how many tokens may be generated:
/// `min(max_new_tokens, max_context - prompt_len)`.
pub(crate) fn budget(max_context: usize, prompt: &[u32], params: &SamplingParams) -> Result<usize> {
    if prompt.is_empty() {
        return Err(GenerateError::InvalidInput("the prompt is empty".into()));
    }
    if prompt.len() >= max_context {
        return Err(GenerateError::InvalidInput(format!(
            "the prompt has {} tokens; the model's context is {max_context}",
            prompt.len()
        )));
    }
    let max_new = params.max_new_tokens.unwrap_or(DEFAULT_MAX_NEW_TOKENS);
    Ok(max_new.min(max_context - prompt.len()))
}

/// Greedy decoding or sampling, one forward per token (Hugging Face `_sample`): the prompt is
/// prefilled as sequence 0, then each step runs the processor chain of `params` and the
/// sequence's seeded [`Sampler`], and feeds the chosen token back.
///
/// Stops on an `eos_token_ids` / `stop_token_ids` token, after `max_new_tokens`
/// ([`DEFAULT_MAX_NEW_TOKENS`] if absent) or at the context limit, or when `sink` returns true
/// ([`FinishReason::Stop`]). Stop strings are the caller's job (they need the text).
///
/// # Errors
/// Invalid `params`, an empty / too long prompt, model errors.
pub fn generate(
    lm: &mut dyn CausalLm,
    prompt: &[u32],
    params: &SamplingParams,
    eos_token_ids: &[u32],
    sink: &mut TokenSink<'_>,
) -> Result<Generation> {
    let mut sampler = Sampler::new(params)?;
    let stopping = StoppingCriteria::from_params(params, eos_token_ids)?;
    let budget = budget(lm.max_context(), prompt, params)?;
    let seq = 0;
    lm.remove(seq);
    let mut logits = lm.forward(&[(seq, prompt)], LogitsWanted::Last, false)?.logits.remove(0);
    let mut g = Generation::new();
    loop {
        let ctx = ProcessContext::new(prompt, &g.tokens, eos_token_ids);
        let out = sampler.sample(&ctx, &mut logits)?;
        let token = out.token;
        if g.push(token, out.logprob, Some(out), sink, &stopping) || g.tokens.len() >= budget {
            break;
        }
        logits = lm.forward(&[(seq, &[token])], LogitsWanted::Last, false)?.logits.remove(0);
    }
    lm.remove(seq);
    Ok(g)
}
