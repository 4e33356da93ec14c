//! Beam search with Hugging Face `BeamSearchScorer` / `BeamHypotheses` semantics.
//!
//! Reference: transformers `generation/beam_search.py` (`BeamHypotheses.add`, `is_done`,
//! `BeamSearchScorer.process`, `finalize`) and `GenerationMixin._beam_search`.

use deco_decoding::{FinishReason, LogitsProcessor, LogitsProcessorList, ProcessContext, SamplerOrder, SamplingParams, math};

use crate::error::{GenerateError, Result, invalid};
use crate::step::{Choice, Local, Op, SeqRows, Step, StepMachine};

/// Hugging Face's `early_stopping` (`True`, `False` or `"never"`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum EarlyStopping {
    /// Stop as soon as `num_beams` finished hypotheses exist (`early_stopping=True`).
    True,
    /// Stop when no running beam can, by the heuristic `best_running_sum / cur_len^α`, beat the
    /// worst finished hypothesis (`early_stopping=False`, Hugging Face's default).
    #[default]
    False,
    /// Stop only when no running beam can beat the worst finished hypothesis, using the
    /// maximal reachable length for `α > 0` (`early_stopping="never"`, the canonical beam
    /// search bound).
    Never,
}

impl std::str::FromStr for EarlyStopping {
    type Err = crate::GenerateError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "true" | "True" => Ok(Self::True),
            "false" | "False" => Ok(Self::False),
            "never" => Ok(Self::Never),
            _ => Err(invalid("early_stopping", "must be true, false or never", s)),
        }
    }
}

/// Beam search parameters (Hugging Face `GenerationConfig` names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BeamSearchParams {
    /// Number of beams, `>= 1`.
    pub num_beams: usize,
    /// Exponent α of the length normalisation `score = sum_logprobs / generated_len^α`
    /// (default 1.0; > 0 favours longer sequences, < 0 shorter).
    pub length_penalty: f32,
    /// When to stop (default [`EarlyStopping::False`]).
    pub early_stopping: EarlyStopping,
    /// Hypotheses returned, `1..=num_beams`.
    pub num_return_sequences: usize,
}

impl Default for BeamSearchParams {
    fn default() -> Self {
        Self { num_beams: 1, length_penalty: 1.0, early_stopping: EarlyStopping::False, num_return_sequences: 1 }
    }
}

/// One finished beam hypothesis.
#[derive(Debug, Clone, PartialEq)]
pub struct BeamHypothesis {
    /// Generated tokens (the EOS that ended it included).
    pub tokens: Vec<u32>,
    /// Sum of the processed log-probabilities of the generated tokens.
    pub sum_logprobs: f64,
    /// `sum_logprobs / tokens.len()^length_penalty`, the ranking score.
    pub score: f64,
}

/// Hugging Face `BeamHypotheses`: the `num_beams` best finished hypotheses.
#[derive(Debug)]
struct Hypotheses {
    num_beams: usize,
    length_penalty: f64,
    beams: Vec<BeamHypothesis>,
    worst_score: f64,
}

impl Hypotheses {
    fn add(&mut self, tokens: Vec<u32>, sum_logprobs: f64) {
        let score = sum_logprobs / (tokens.len() as f64).powf(self.length_penalty);
        if self.beams.len() < self.num_beams || score > self.worst_score {
            self.beams.push(BeamHypothesis { tokens, sum_logprobs, score });
            if self.beams.len() > self.num_beams {
                let mut order: Vec<usize> = (0..self.beams.len()).collect();
                order.sort_by(|&a, &b| self.beams[a].score.total_cmp(&self.beams[b].score));
                self.worst_score = self.beams[order[1]].score;
                self.beams.remove(order[0]);
            } else {
                self.worst_score = self.worst_score.min(score);
            }
        }
    }

    /// `BeamHypotheses.is_done(best_sum_logprobs, cur_len)`; `cur_len` counts generated tokens.
    fn is_done(&self, best_sum_logprobs: f64, cur_len: usize, max_len: usize, early: EarlyStopping) -> bool {
        if self.beams.len() < self.num_beams {
            return false;
        }
        let bound_len = match early {
            EarlyStopping::True => return true,
            EarlyStopping::False => cur_len,
            EarlyStopping::Never if self.length_penalty > 0.0 => max_len,
            EarlyStopping::Never => cur_len,
        };
        let highest = best_sum_logprobs / (bound_len as f64).powf(self.length_penalty);
        self.worst_score >= highest
    }
}

#[derive(Debug)]
struct Beam {
    seq: Local,
    tokens: Vec<u32>,
    score: f64,
}

/// Beam search (Hugging Face `num_beams > 1, do_sample=False`) as a [`StepMachine`].
///
/// Each step: for every running beam, `log_softmax` of its logits, then the history processors
/// of `params` (repetition penalty, `no_repeat_ngram_size` per beam, bad words,
/// `min_new_tokens`...) on those log-probabilities (as Hugging Face applies its
/// `logits_processor` to the log-softmax scores; warpers are not used), plus the beam's running
/// sum. The best `max(2, 1 + #eos) * num_beams` candidates are scanned in order: an EOS
/// candidate of rank `< num_beams` becomes a finished hypothesis scored
/// `sum_logprobs / generated_len^length_penalty` (the EOS counts in the length and its log-prob
/// in the sum); other candidates become the next beams until `num_beams` are chosen. Each new
/// beam is a fork of its parent's sequence ([`Op::Fork`], copy-on-write KV blocks) fed its new
/// token; the engine runs them in one batched forward with everything else it serves. Stops per
/// `early_stopping`, or at `max_new_tokens` / the context limit, after which running beams are
/// added as hypotheses (`finalize`); the best `num_return_sequences` hypotheses are released
/// then, best first (beam search cannot stream: a beam's tokens are final only at the end).
///
/// Deviation from Hugging Face: the first step expands only the prompt's beam and a step may
/// keep fewer than `num_beams` beams when fewer finite candidates exist (Hugging Face pads with
/// copies scored -1e9); results only differ when the vocabulary is smaller than `2 * num_beams`.
#[derive(Debug)]
pub struct BeamSearch {
    prompt: Vec<u32>,
    processors: LogitsProcessorList,
    eos: Vec<u32>,
    beam: BeamSearchParams,
    budget: usize,
    n_keep: usize,
    hyps: Hypotheses,
    beams: Vec<Beam>,
    cur_len: usize,
    next_seq: Local,
    /// Forward passes over the beams (prefill included).
    forward_steps: usize,
    /// The released hypotheses, best first (after the last step).
    result: Vec<BeamHypothesis>,
}

impl BeamSearch {
    /// A beam search over `prompt` (already prefilled as sequence 0 when the engine first calls
    /// [`StepMachine::advance`]) for a model with context `max_context`.
    ///
    /// # Errors
    /// `num_beams == 0`, `num_return_sequences` outside `1..=num_beams`, a non-finite
    /// `length_penalty`, invalid `params`, an empty or too long prompt.
    pub fn new(prompt: &[u32], params: &SamplingParams, beam: &BeamSearchParams, eos_token_ids: &[u32], max_context: usize) -> Result<Self> {
        let b = beam.num_beams;
        if b == 0 {
            return Err(invalid("num_beams", "must be >= 1", b));
        }
        if beam.num_return_sequences == 0 || beam.num_return_sequences > b {
            return Err(invalid("num_return_sequences", "must be in 1..=num_beams", beam.num_return_sequences));
        }
        if !beam.length_penalty.is_finite() {
            return Err(invalid("length_penalty", "must be finite", beam.length_penalty));
        }
        let greedy = SamplingParams { do_sample: Some(false), ..params.clone() };
        let processors = LogitsProcessorList::from_params(&greedy, SamplerOrder::HuggingFace)?;
        let budget = crate::sample::budget(max_context, prompt, params)?;
        Ok(Self {
            prompt: prompt.to_vec(),
            processors,
            eos: eos_token_ids.to_vec(),
            beam: *beam,
            budget,
            n_keep: 2usize.max(1 + eos_token_ids.len()) * b,
            hyps: Hypotheses { num_beams: b, length_penalty: f64::from(beam.length_penalty), beams: Vec::new(), worst_score: 1e9 },
            beams: vec![Beam { seq: 0, tokens: Vec::new(), score: 0.0 }],
            cur_len: 0,
            next_seq: 1,
            forward_steps: 0,
            result: Vec::new(),
        })
    }

    /// Forward passes the search has consumed so far (the prompt's included).
    pub fn forward_steps(&self) -> usize {
        self.forward_steps
    }

    /// The hypotheses released by the last step (the best `num_return_sequences`, best first,
    /// with their sums of log-probabilities and scores); empty before.
    pub fn hypotheses(&self) -> &[BeamHypothesis] {
        &self.result
    }

    /// Ends the search: running beams become hypotheses unless `done`, every sequence is
    /// removed, the best hypotheses are released.
    fn finish(&mut self, done: bool, mut ops: Vec<Op>) -> Step {
        if !done {
            for bm in &self.beams {
                self.hyps.add(bm.tokens.clone(), bm.score);
            }
        }
        ops.extend(self.beams.drain(..).map(|bm| Op::Remove(bm.seq)));
        let mut sequences = std::mem::take(&mut self.hyps.beams);
        sequences.sort_by(|x, y| y.score.total_cmp(&x.score));
        sequences.truncate(self.beam.num_return_sequences);
        let output = sequences
            .iter()
            .enumerate()
            .map(|(index, h)| {
                let ended = h.tokens.last().is_some_and(|t| self.eos.contains(t));
                let finish = if ended { FinishReason::EosToken } else { FinishReason::Length };
                Choice { index, tokens: h.tokens.clone(), finish: Some(finish), cumulative_logprob: Some(h.sum_logprobs) }
            })
            .collect();
        self.result = sequences;
        Step { ops, output, ..Step::default() }
    }
}

impl StepMachine for BeamSearch {
    fn num_choices(&self) -> usize {
        self.beam.num_return_sequences
    }

    fn advance(&mut self, rows: Vec<SeqRows>) -> Result<Step> {
        self.forward_steps += 1;
        self.cur_len += 1;
        let b = self.beam.num_beams;
        // Candidates (score, beam index, token), best first.
        let mut cands: Vec<(f64, usize, u32)> = Vec::new();
        for (bi, bm) in self.beams.iter().enumerate() {
            let row = rows
                .iter()
                .find(|r| r.seq == bm.seq)
                .ok_or_else(|| GenerateError::InvalidInput(format!("beam search: no row for sequence {}", bm.seq)))?;
            let logits = row.last().ok_or_else(|| GenerateError::InvalidInput(format!("beam search: empty rows for sequence {}", bm.seq)))?;
            let mut lp = math::log_softmax(logits);
            self.processors.process(&ProcessContext::new(&self.prompt, &bm.tokens, &self.eos), &mut lp)?;
            // Keep only this beam's best n_keep (no other can enter the global top n_keep).
            let mut idx: Vec<usize> = (0..lp.len()).filter(|&v| lp[v] > f32::NEG_INFINITY && !lp[v].is_nan()).collect();
            let cmp = |a: &usize, c: &usize| lp[*c].total_cmp(&lp[*a]).then(a.cmp(c));
            if idx.len() > self.n_keep {
                idx.select_nth_unstable_by(self.n_keep - 1, cmp);
                idx.truncate(self.n_keep);
            }
            cands.extend(idx.into_iter().map(|v| (bm.score + f64::from(lp[v]), bi, v as u32)));
        }
        cands.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)).then(x.2.cmp(&y.2)));
        cands.truncate(self.n_keep);
        if cands.is_empty() {
            return Ok(self.finish(false, Vec::new()));
        }
        let mut next: Vec<(usize, u32, f64)> = Vec::with_capacity(b);
        for (rank, &(score, bi, tok)) in cands.iter().enumerate() {
            if self.eos.contains(&tok) {
                if rank >= b {
                    continue;
                }
                let mut t = self.beams[bi].tokens.clone();
                t.push(tok);
                self.hyps.add(t, score);
            } else {
                next.push((bi, tok, score));
            }
            if next.len() == b {
                break;
            }
        }
        if next.is_empty() || self.hyps.is_done(cands[0].0, self.cur_len, self.budget, self.beam.early_stopping) {
            return Ok(self.finish(true, Vec::new()));
        }
        // Each new beam forks its parent's sequence; the old beams are then dropped.
        let mut ops = Vec::with_capacity(3 * next.len());
        let mut new_beams = Vec::with_capacity(next.len());
        for &(bi, tok, score) in &next {
            let seq = self.next_seq;
            self.next_seq += 1;
            ops.push(Op::Fork { from: self.beams[bi].seq, to: seq });
            let mut t = self.beams[bi].tokens.clone();
            t.push(tok);
            new_beams.push(Beam { seq, tokens: t, score });
        }
        ops.extend(self.beams.iter().map(|bm| Op::Remove(bm.seq)));
        self.beams = new_beams;
        if self.cur_len == self.budget {
            return Ok(self.finish(false, ops));
        }
        ops.extend(self.beams.iter().map(|bm| Op::Feed { seq: bm.seq, tokens: vec![bm.tokens[bm.tokens.len() - 1]], rows: 1, hidden: false }));
        Ok(Step { ops, ..Step::default() })
    }
}
