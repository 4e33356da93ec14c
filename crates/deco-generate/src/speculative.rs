//! Speculative decoding (Leviathan et al. 2023, "Fast Inference from Transformers via
//! Speculative Decoding", Algorithm 1; Chen et al. 2023, "Accelerating Large Language Model
//! Decoding with Speculative Sampling", Algorithm 2) as a step machine of the serving engine
//! ([`Speculative`]) with three draft sources: a second model or the target's first layers (the
//! engine's draft model, [`DraftSource::Model`]) and prompt lookup ([`PromptLookupDrafter`]).

use deco_decoding::{
    FinishReason, LogitsProcessor, LogitsProcessorList, ProcessContext, Sampler, SamplerOrder, SamplingParams,
    StoppingCriteria, math,
};

use crate::error::{GenerateError, Result, invalid};
use crate::step::{Choice, Op, Role, SeqRows, Step, StepMachine};

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

/// Prompt-lookup decoding (Saxena 2023; Hugging Face `PromptLookupCandidateGenerator`): find the
/// last `n`-gram of the context earlier in the context (`n` from `max_matching_ngram_size`
/// down to 1, earliest match first) and propose the tokens that followed it. Deterministic
/// (`q` one-hot), no model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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

/// Where the draft tokens of [`Speculative`] come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftSource {
    /// The engine's draft model (a second model sharing the tokenizer, or the target's first
    /// layers: self-speculative decoding), each token drawn from its processed distribution `q`
    /// with the strategy's own seeded draft RNG.
    Model,
    /// Prompt lookup: deterministic proposals (`q` one-hot), no model.
    PromptLookup(PromptLookupDrafter),
}

/// How the number of drafts per round evolves (Hugging Face's `num_assistant_tokens_schedule`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DraftSchedule {
    /// `num_speculative_tokens` every round (vLLM).
    #[default]
    Constant,
    /// Hugging Face's `"heuristic"`: +2 after a round whose drafts were all accepted, −1 (not
    /// below 1) after a rejection, so that γ follows how predictable the text is.
    Heuristic,
}

impl std::str::FromStr for DraftSchedule {
    type Err = GenerateError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "constant" => Ok(Self::Constant),
            "heuristic" => Ok(Self::Heuristic),
            _ => Err(invalid("num_assistant_tokens_schedule", "must be constant or heuristic", s)),
        }
    }
}

/// Upper bound of γ under [`DraftSchedule::Heuristic`].
pub const MAX_SPECULATIVE_TOKENS: usize = 32;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for the prompt's row.
    Start,
    /// Waiting for a draft-model row.
    Drafting,
    /// Waiting for the target's verification rows.
    Verifying,
}

/// Speculative decoding of one sequence as a [`StepMachine`] (Leviathan et al. 2023,
/// Algorithm 1; Chen et al. 2023, Algorithm 2).
///
/// The first token is drawn from the prompt's row. Then each round, with `t` the newest token
/// (not yet computed by the target): `γ = min(num_speculative_tokens, tokens left - 1, context
/// left - 1)` draft tokens `d_i` with distributions `q_i` are proposed (from the draft model, one
/// batched draft-model forward of the engine per token, or by prompt lookup), and the target
/// computes `[t, d_1..d_γ]` in one chunk of the engine's batched forward with every row
/// returned: `p_1..p_{γ+1}`, processed with the same chain as `q` ([`Processing`]). Draft `i` is
/// accepted with probability `min(1, p_i(x)/q_i(x))` (one uniform of the request's seeded RNG);
/// at the first rejection a token is drawn from `norm(max(p_i - q_i, 0))` and the round ends;
/// if all are accepted a bonus token is drawn from `p_{γ+1}`. The target's and the draft's
/// sequences are then truncated to the accepted prefix ([`Op::Truncate`],
/// [`Op::DraftTruncate`]). The output follows the target's processed distribution exactly; for
/// a greedy request it equals plain greedy decoding token for token. Accepted tokens are
/// released as soon as a round ends. γ is constant, or follows [`DraftSchedule::Heuristic`].
#[derive(Debug)]
pub struct Speculative {
    prompt: Vec<u32>,
    processing: Processing,
    stopping: StoppingCriteria,
    eos: Vec<u32>,
    rng: Sampler,
    draft_rng: Sampler,
    source: DraftSource,
    /// γ of the next round.
    num_speculative_tokens: usize,
    schedule: DraftSchedule,
    budget: usize,
    max_context: usize,
    /// Generated tokens; the last one is not yet computed by the target after a round.
    output: Vec<u32>,
    /// This round's drafts.
    drafts: Vec<Draft>,
    /// This round's draft length.
    gamma: usize,
    /// Tokens of `prompt ++ output ++ drafts` the draft model has cached.
    draft_fed: usize,
    phase: Phase,
    stats: SpeculativeStats,
}

impl Speculative {
    /// A speculative decoding of `prompt` (prefilled as target sequence 0 when the engine first
    /// calls [`StepMachine::advance`]) for a target with context `max_context`.
    ///
    /// # Errors
    /// `num_speculative_tokens == 0`, invalid `params`, an empty or too long prompt.
    pub fn new(prompt: &[u32], params: &SamplingParams, source: DraftSource, num_speculative_tokens: usize, eos_token_ids: &[u32], max_context: usize) -> Result<Self> {
        if num_speculative_tokens == 0 {
            return Err(invalid("num_speculative_tokens", "must be >= 1", 0));
        }
        let seed = params.seed;
        Ok(Self {
            prompt: prompt.to_vec(),
            processing: Processing::new(params)?,
            stopping: StoppingCriteria::from_params(params, eos_token_ids)?,
            eos: eos_token_ids.to_vec(),
            rng: Sampler::from_processors(LogitsProcessorList::new(), false, seed, None)?,
            draft_rng: Sampler::from_processors(LogitsProcessorList::new(), false, seed.map(|s| s ^ 0x5eed_d4af), None)?,
            source,
            num_speculative_tokens,
            schedule: DraftSchedule::Constant,
            budget: crate::sample::budget(max_context, prompt, params)?,
            max_context,
            output: Vec::new(),
            drafts: Vec::new(),
            gamma: 0,
            draft_fed: 0,
            phase: Phase::Start,
            stats: SpeculativeStats::default(),
        })
    }

    /// The same decoding with γ following `schedule` from its initial value.
    pub fn with_schedule(mut self, schedule: DraftSchedule) -> Self {
        self.schedule = schedule;
        self
    }

    /// Counters so far (rounds, drafted, accepted, target forwards including the prefill).
    pub fn stats(&self) -> SpeculativeStats {
        self.stats
    }

    fn ctx(&self) -> Vec<u32> {
        self.prompt.iter().chain(&self.output).chain(self.drafts.iter().map(|d| &d.token)).copied().collect()
    }

    /// Appends a committed token; `Some(reason)` when it ends the sequence.
    fn commit(&mut self, token: u32) -> Option<FinishReason> {
        self.output.push(token);
        let n = self.output.len();
        self.stopping.check(token, n).or((n >= self.budget).then_some(FinishReason::Length))
    }

    /// Ends the request: removes the sequences and releases the last tokens.
    fn finish(&mut self, tokens: Vec<u32>, reason: FinishReason, mut step: Step) -> Step {
        step.ops.push(Op::Remove(0));
        if self.source == DraftSource::Model && self.draft_fed > 0 {
            step.ops.push(Op::DraftRemove(0));
        }
        step.output.push(Choice { index: 0, tokens, finish: Some(reason), cumulative_logprob: None });
        step
    }

    /// Starts a round after the newest token: drafts (or feeds the target directly).
    fn round(&mut self, mut step: Step) -> Result<Step> {
        let ctx_len = self.prompt.len() + self.output.len();
        let room = (self.budget - self.output.len()).saturating_sub(1).min(self.max_context.saturating_sub(ctx_len + 1));
        self.gamma = self.num_speculative_tokens.min(room);
        self.drafts.clear();
        match self.source {
            DraftSource::PromptLookup(d) if self.gamma > 0 => {
                self.drafts = d.lookup(&self.ctx(), self.gamma).into_iter().map(|token| Draft { token, q: None }).collect();
            }
            DraftSource::Model if self.gamma > 0 => {
                let ctx = self.ctx();
                step.ops.push(Op::DraftFeed { seq: 0, tokens: ctx[self.draft_fed..].to_vec() });
                self.draft_fed = ctx.len();
                self.phase = Phase::Drafting;
                return Ok(step);
            }
            _ => {}
        }
        Ok(self.verify(step))
    }

    /// Feeds the target the newest token and the drafts, every row wanted.
    fn verify(&mut self, mut step: Step) -> Step {
        let t = self.output[self.output.len() - 1];
        let mut tokens = vec![t];
        tokens.extend(self.drafts.iter().map(|d| d.token));
        let rows = tokens.len();
        step.ops.push(Op::Feed { seq: 0, tokens, rows, hidden: false });
        self.phase = Phase::Verifying;
        step
    }
}

fn row_of(rows: &[SeqRows], role: Role) -> Result<&SeqRows> {
    rows.iter().find(|r| r.seq == 0 && r.role == role).ok_or_else(|| GenerateError::InvalidInput(format!("speculative decoding: no {role:?} rows")))
}

impl StepMachine for Speculative {
    fn num_choices(&self) -> usize {
        1
    }

    fn advance(&mut self, rows: Vec<SeqRows>) -> Result<Step> {
        let step = Step::default();
        match self.phase {
            Phase::Start => {
                self.stats.target_forward_calls += 1;
                let r = row_of(&rows, Role::Target)?;
                let logits = r.last().ok_or_else(|| GenerateError::InvalidInput("speculative decoding: empty prompt row".into()))?.to_vec();
                let p = self.processing.probs(&self.prompt, &self.output, &self.eos, logits)?;
                let token = self.rng.sample_weights(&p)?;
                if let Some(reason) = self.commit(token) {
                    return Ok(self.finish(vec![token], reason, step));
                }
                let mut step = step;
                step.output.push(Choice { index: 0, tokens: vec![token], finish: None, cumulative_logprob: None });
                self.round(step)
            }
            Phase::Drafting => {
                let r = row_of(&rows, Role::Draft)?;
                let logits = r.last().ok_or_else(|| GenerateError::InvalidInput("speculative decoding: empty draft row".into()))?.to_vec();
                let drafted: Vec<u32> = self.output.iter().copied().chain(self.drafts.iter().map(|d| d.token)).collect();
                let q = self.processing.probs(&self.prompt, &drafted, &self.eos, logits)?;
                let token = if self.processing.is_greedy() { q.iter().position(|&x| x == 1.0).unwrap_or(0) as u32 } else { self.draft_rng.sample_weights(&q)? };
                self.drafts.push(Draft { token, q: Some(q) });
                if self.drafts.len() < self.gamma && !self.eos.contains(&token) {
                    let mut step = step;
                    step.ops.push(Op::DraftFeed { seq: 0, tokens: vec![token] });
                    self.draft_fed += 1;
                    return Ok(step);
                }
                Ok(self.verify(step))
            }
            Phase::Verifying => {
                self.stats.target_forward_calls += 1;
                self.stats.rounds += 1;
                let r = row_of(&rows, Role::Target)?;
                let drafts = std::mem::take(&mut self.drafts);
                if r.logits.len() != drafts.len() + 1 {
                    return Err(GenerateError::InvalidInput(format!("speculative decoding: {} rows for {} drafts", r.logits.len(), drafts.len())));
                }
                let mut step = step;
                step.drafted = drafts.len();
                let mut new_tokens = Vec::with_capacity(drafts.len() + 1);
                let mut accepted = 0;
                let mut finished = None;
                for (d, row) in drafts.iter().zip(&r.logits) {
                    let p = self.processing.probs(&self.prompt, &self.output, &self.eos, row.clone())?;
                    let u = self.rng.uniform();
                    let token = match accept_or_residual(&p, d.q.as_deref(), d.token, u) {
                        Ok(()) => {
                            accepted += 1;
                            d.token
                        }
                        Err(residual) => match self.rng.sample_weights(&residual) {
                            Ok(t) => t,
                            // p == q up to rounding: the residual is empty, draw from p.
                            Err(deco_decoding::DecodingError::NoValidToken) => self.rng.sample_weights(&p)?,
                            Err(e) => return Err(e.into()),
                        },
                    };
                    new_tokens.push(token);
                    finished = self.commit(token);
                    if finished.is_some() || token != d.token {
                        break;
                    }
                }
                if finished.is_none() && accepted == drafts.len() {
                    let row = &r.logits[drafts.len()];
                    let p = self.processing.probs(&self.prompt, &self.output, &self.eos, row.clone())?;
                    let token = self.rng.sample_weights(&p)?;
                    new_tokens.push(token);
                    finished = self.commit(token);
                }
                self.stats.drafted += drafts.len();
                self.stats.accepted += accepted;
                if self.schedule == DraftSchedule::Heuristic && !drafts.is_empty() {
                    self.num_speculative_tokens = if accepted == drafts.len() {
                        (self.num_speculative_tokens + 2).min(MAX_SPECULATIVE_TOKENS)
                    } else {
                        self.num_speculative_tokens.saturating_sub(1).max(1)
                    };
                }
                step.accepted = accepted;
                if let Some(reason) = finished {
                    return Ok(self.finish(new_tokens, reason, step));
                }
                // Keep everything computed up to (not including) the newest token.
                let keep = self.prompt.len() + self.output.len() - 1;
                if accepted < drafts.len() {
                    step.ops.push(Op::Truncate { seq: 0, len: keep });
                }
                if self.draft_fed > keep {
                    step.ops.push(Op::DraftTruncate { seq: 0, len: keep });
                    self.draft_fed = keep;
                }
                step.output.push(Choice { index: 0, tokens: new_tokens, finish: None, cumulative_logprob: None });
                self.round(step)
            }
        }
    }
}
