//! Contrastive search (Su et al. 2022, "A Contrastive Framework for Neural Text Generation",
//! §5 Eq. 4; Hugging Face `GenerationMixin._contrastive_search` and `_ranking_fast`) and
//! contrastive decoding (Li et al. 2023, "Contrastive Decoding: Open-ended Text Generation as
//! Optimization", §3, Eq. 2-4).

use deco_decoding::{
    FinishReason, LogitsProcessor, LogitsProcessorList, ProcessContext, Sampler, SamplerOrder, SamplingParams,
    StoppingCriteria, math,
};

use crate::error::{GenerateError, Result, invalid};
use crate::step::{Choice, Local, Op, SeqRows, Step, StepMachine};

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

/// Contrastive search as a [`StepMachine`]: at each step take the `top_k` tokens of the
/// processed distribution `p` and choose `argmax_v (1 - penalty_alpha) * p(v) - penalty_alpha *
/// max_j cos(h_v, h_j)`, where `h_v` is the last-layer hidden state (after the final norm) of
/// candidate `v` and `h_j` those of every previous token (prompt included). The `top_k`
/// candidates are forks of the sequence ([`Op::Fork`]) fed one candidate each, computed in the
/// engine's batched forward with every other request; the winner's sequence, logits and hidden
/// state carry on (no extra forward) and the others are removed, exactly as Hugging Face's
/// `_contrastive_search`. Each chosen token is released at once.
///
/// `params.top_k` is the candidate count (Hugging Face requires `top_k > 1`); the history
/// processors of `params` apply, the warpers do not (contrastive search is deterministic).
#[derive(Debug)]
pub struct ContrastiveSearch {
    prompt: Vec<u32>,
    processors: LogitsProcessorList,
    stopping: StoppingCriteria,
    eos: Vec<u32>,
    alpha: f64,
    top_k: usize,
    budget: usize,
    output: Vec<u32>,
    context_hidden: Vec<Vec<f32>>,
    main: Local,
    /// The candidates being computed: (sequence, token, processed probability).
    candidates: Vec<(Local, u32, f32)>,
    next_seq: Local,
}

impl ContrastiveSearch {
    /// A contrastive search of `prompt` for a model with context `max_context`.
    ///
    /// # Errors
    /// `penalty_alpha` outside `[0, 1]`, `top_k` absent or `< 1`, invalid `params`, an empty
    /// or too long prompt.
    pub fn new(prompt: &[u32], params: &SamplingParams, penalty_alpha: f32, eos_token_ids: &[u32], max_context: usize) -> Result<Self> {
        if !(0.0..=1.0).contains(&penalty_alpha) {
            return Err(invalid("penalty_alpha", "must be in [0, 1]", penalty_alpha));
        }
        let top_k = match params.top_k {
            Some(k) if k >= 1 => k as usize,
            other => return Err(invalid("top_k", "must be >= 1 for contrastive search", format!("{other:?}"))),
        };
        let greedy = SamplingParams { do_sample: Some(false), ..params.clone() };
        Ok(Self {
            prompt: prompt.to_vec(),
            processors: LogitsProcessorList::from_params(&greedy, SamplerOrder::HuggingFace)?,
            stopping: StoppingCriteria::from_params(params, eos_token_ids)?,
            eos: eos_token_ids.to_vec(),
            alpha: f64::from(penalty_alpha),
            top_k,
            budget: crate::sample::budget(max_context, prompt, params)?,
            output: Vec::new(),
            context_hidden: Vec::new(),
            main: 0,
            candidates: Vec::new(),
            next_seq: 1,
        })
    }

    /// Forks the `top_k` candidates of the processed `logits` (the next-token row of `main`).
    fn expand(&mut self, mut logits: Vec<f32>, mut step: Step) -> Result<Step> {
        self.processors.process(&ProcessContext::new(&self.prompt, &self.output, &self.eos), &mut logits)?;
        let probs = math::softmax(&logits);
        let mut cand: Vec<usize> = (0..probs.len()).filter(|&v| logits[v] > f32::NEG_INFINITY).collect();
        if cand.is_empty() {
            return Err(deco_decoding::DecodingError::NoValidToken.into());
        }
        cand.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
        cand.truncate(self.top_k);
        self.candidates.clear();
        for v in cand {
            let seq = self.next_seq;
            self.next_seq += 1;
            step.ops.push(Op::Fork { from: self.main, to: seq });
            step.ops.push(Op::Feed { seq, tokens: vec![v as u32], rows: 1, hidden: true });
            self.candidates.push((seq, v as u32, probs[v]));
        }
        Ok(step)
    }
}

impl StepMachine for ContrastiveSearch {
    fn num_choices(&self) -> usize {
        1
    }

    fn prompt_rows(&self) -> (usize, bool) {
        (self.prompt.len(), true)
    }

    fn advance(&mut self, rows: Vec<SeqRows>) -> Result<Step> {
        let step = Step::default();
        if self.candidates.is_empty() {
            // The prompt: every position's hidden state, the last position's logits.
            let r = rows.into_iter().find(|r| r.seq == 0).ok_or_else(|| GenerateError::InvalidInput("contrastive search: no prompt rows".into()))?;
            let logits = r.logits.last().cloned().ok_or_else(|| GenerateError::InvalidInput("contrastive search: no logits".into()))?;
            if r.hidden.len() != self.prompt.len() {
                return Err(GenerateError::InvalidInput(format!("contrastive search: {} prompt hidden states for {} tokens", r.hidden.len(), self.prompt.len())));
            }
            self.context_hidden = r.hidden;
            return self.expand(logits, step);
        }
        let mut best: Option<(f64, usize)> = None;
        let mut found = Vec::with_capacity(self.candidates.len());
        for (i, &(seq, _, p)) in self.candidates.iter().enumerate() {
            let r = rows.iter().find(|r| r.seq == seq).ok_or_else(|| GenerateError::InvalidInput(format!("contrastive search: no row for candidate {seq}")))?;
            let h = r.hidden.last().ok_or_else(|| GenerateError::InvalidInput("contrastive search: no hidden state".into()))?;
            let score = (1.0 - self.alpha) * f64::from(p) - self.alpha * degeneration_penalty(h, &self.context_hidden);
            if best.is_none_or(|b| score > b.0) {
                best = Some((score, i));
            }
            found.push(r);
        }
        let (_, bi) = best.ok_or_else(|| GenerateError::InvalidInput("contrastive search: no candidates".into()))?;
        let (seq, token, _) = self.candidates[bi];
        let winner = found[bi];
        let mut step = step;
        step.ops.push(Op::Remove(self.main));
        for &(s, _, _) in &self.candidates {
            if s != seq {
                step.ops.push(Op::Remove(s));
            }
        }
        self.main = seq;
        self.context_hidden.push(winner.hidden.last().cloned().unwrap_or_default());
        let logits = winner.logits.last().cloned().unwrap_or_default();
        self.output.push(token);
        let n = self.output.len();
        let finish = self.stopping.check(token, n).or((n >= self.budget).then_some(FinishReason::Length));
        step.output.push(Choice { index: 0, tokens: vec![token], finish, cumulative_logprob: None });
        if finish.is_some() {
            step.ops.push(Op::Remove(self.main));
            self.candidates.clear();
            return Ok(step);
        }
        self.expand(logits, step)
    }
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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CdPhase {
    /// Waiting for the expert's row.
    Expert,
    /// Waiting for the amateur's row of the same context.
    Amateur,
}

/// Contrastive decoding as a [`StepMachine`] (Li et al. 2023): for each token the expert (the
/// served model) and the amateur (the engine's second model: another model with the same
/// tokenizer, or the expert's first layers) score the same context; the token is chosen from
/// [`contrastive_scores`] by the request's [`Sampler`] (history processors, then argmax for a
/// greedy request, as the paper's greedy search; or sampling with the warpers). The amateur is
/// fed through [`Op::DraftFeed`], so both models run in the engine's batched forwards, and each
/// token is released at once.
#[derive(Debug)]
pub struct ContrastiveDecoding {
    prompt: Vec<u32>,
    sampler: Sampler,
    stopping: StoppingCriteria,
    eos: Vec<u32>,
    cd: ContrastiveDecodingParams,
    budget: usize,
    output: Vec<u32>,
    expert_row: Vec<f32>,
    phase: CdPhase,
}

impl ContrastiveDecoding {
    /// Contrastive decoding of `prompt` for an expert and an amateur of context `max_context`
    /// (the smaller of the two).
    ///
    /// # Errors
    /// `alpha` outside `[0, 1]`, `amateur_temperature <= 0`, invalid `params`, an empty or too
    /// long prompt.
    pub fn new(prompt: &[u32], params: &SamplingParams, cd: &ContrastiveDecodingParams, eos_token_ids: &[u32], max_context: usize) -> Result<Self> {
        if !(0.0..=1.0).contains(&cd.alpha) {
            return Err(invalid("alpha", "must be in [0, 1]", cd.alpha));
        }
        if !(cd.amateur_temperature.is_finite() && cd.amateur_temperature > 0.0) {
            return Err(invalid("amateur_temperature", "must be a finite number > 0", cd.amateur_temperature));
        }
        Ok(Self {
            prompt: prompt.to_vec(),
            sampler: Sampler::new(params)?,
            stopping: StoppingCriteria::from_params(params, eos_token_ids)?,
            eos: eos_token_ids.to_vec(),
            cd: *cd,
            budget: crate::sample::budget(max_context, prompt, params)?,
            output: Vec::new(),
            expert_row: Vec::new(),
            phase: CdPhase::Expert,
        })
    }
}

impl StepMachine for ContrastiveDecoding {
    fn num_choices(&self) -> usize {
        1
    }

    fn advance(&mut self, rows: Vec<SeqRows>) -> Result<Step> {
        let mut step = Step::default();
        let row = rows.into_iter().find(|r| r.seq == 0).and_then(|r| r.logits.last().cloned());
        let row = row.ok_or_else(|| GenerateError::InvalidInput("contrastive decoding: no row".into()))?;
        match self.phase {
            CdPhase::Expert => {
                self.expert_row = row;
                let feed = if self.output.is_empty() { self.prompt.clone() } else { vec![self.output[self.output.len() - 1]] };
                step.ops.push(Op::DraftFeed { seq: 0, tokens: feed });
                self.phase = CdPhase::Amateur;
            }
            CdPhase::Amateur => {
                let mut scores = contrastive_scores(&self.expert_row, &row, self.cd.alpha, self.cd.amateur_temperature);
                let out = self.sampler.sample(&ProcessContext::new(&self.prompt, &self.output, &self.eos), &mut scores)?;
                self.output.push(out.token);
                let n = self.output.len();
                let finish = self.stopping.check(out.token, n).or((n >= self.budget).then_some(FinishReason::Length));
                step.output.push(Choice { index: 0, tokens: vec![out.token], finish, cumulative_logprob: None });
                if finish.is_some() {
                    step.ops.push(Op::Remove(0));
                    step.ops.push(Op::DraftRemove(0));
                } else {
                    step.ops.push(Op::Feed { seq: 0, tokens: vec![out.token], rows: 1, hidden: false });
                    self.phase = CdPhase::Expert;
                }
            }
        }
        Ok(step)
    }
}
