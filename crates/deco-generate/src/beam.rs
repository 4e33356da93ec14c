//! Beam search with Hugging Face `BeamSearchScorer` / `BeamHypotheses` semantics.
//!
//! Reference: transformers `generation/beam_search.py` (`BeamHypotheses.add`, `is_done`,
//! `BeamSearchScorer.process`, `finalize`) and `GenerationMixin._beam_search`.

use deco_decoding::{LogitsProcessor, LogitsProcessorList, ProcessContext, SamplerOrder, SamplingParams, math};
use deco_model::LogitsWanted;

use crate::error::{Result, invalid};
use crate::lm::{CausalLm, SeqId};

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

/// Result of [`beam_search`].
#[derive(Debug, Clone, PartialEq)]
pub struct BeamSearchOutput {
    /// The best `num_return_sequences` hypotheses, best first.
    pub sequences: Vec<BeamHypothesis>,
    /// Forward passes run (prefill included).
    pub forward_calls: usize,
}

/// Hugging Face `BeamHypotheses`: the `num_beams` best finished hypotheses.
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

struct Beam {
    seq: SeqId,
    tokens: Vec<u32>,
    score: f64,
}

/// Beam search (Hugging Face `num_beams > 1, do_sample=False`).
///
/// Each step: for every running beam, `log_softmax` of its logits, then the history processors
/// of `params` (repetition penalty, `no_repeat_ngram_size` per beam, bad words,
/// `min_new_tokens`...) on those log-probabilities (as Hugging Face applies its
/// `logits_processor` to the log-softmax scores; warpers are not used), plus the beam's running
/// sum. The best `max(2, 1 + #eos) * num_beams` candidates are scanned in order: an EOS
/// candidate of rank `< num_beams` becomes a finished hypothesis scored
/// `sum_logprobs / generated_len^length_penalty` (the EOS counts in the length and its log-prob
/// in the sum); other candidates become the next beams until `num_beams` are chosen. The new
/// beams run as one batched forward, each on a fork of its parent's KV cache. Stops per
/// `early_stopping`, or at `max_new_tokens` / the context limit, after which running beams are
/// added as hypotheses (`finalize`).
///
/// Deviation from Hugging Face: the first step expands only the prompt's beam and a step may
/// keep fewer than `num_beams` beams when fewer finite candidates exist (Hugging Face pads with
/// copies scored -1e9); results only differ when the vocabulary is smaller than `2 * num_beams`.
///
/// # Errors
/// `num_beams == 0`, `num_return_sequences` outside `1..=num_beams`, a non-finite
/// `length_penalty`, invalid `params`, an empty or too long prompt, model errors.
pub fn beam_search(
    lm: &mut dyn CausalLm,
    prompt: &[u32],
    params: &SamplingParams,
    beam: &BeamSearchParams,
    eos_token_ids: &[u32],
) -> Result<BeamSearchOutput> {
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
    let budget = crate::sample::budget(lm.max_context(), prompt, params)?;
    let n_keep = 2usize.max(1 + eos_token_ids.len()) * b;
    let mut hyps = Hypotheses { num_beams: b, length_penalty: f64::from(beam.length_penalty), beams: Vec::new(), worst_score: 1e9 };

    // Sequence ids alternate between two banks: [0, b) and [b, 2b).
    let mut bank = 0u64;
    for s in 0..2 * b as u64 {
        lm.remove(s);
    }
    let mut forward_calls = 1;
    let mut rows = lm.forward(&[(0, prompt)], LogitsWanted::Last, false)?.logits;
    let mut beams = vec![Beam { seq: 0, tokens: Vec::new(), score: 0.0 }];
    let mut done = false;
    for cur_len in 1..=budget {
        // Candidates (score, beam index, token), best first.
        let mut cands: Vec<(f64, usize, u32)> = Vec::new();
        for (bi, (bm, row)) in beams.iter().zip(rows.iter()).enumerate() {
            let mut lp = math::log_softmax(row);
            processors.process(&ProcessContext::new(prompt, &bm.tokens, eos_token_ids), &mut lp)?;
            // Keep only this beam's best n_keep (no other can enter the global top n_keep).
            let mut idx: Vec<usize> = (0..lp.len()).filter(|&v| lp[v] > f32::NEG_INFINITY && !lp[v].is_nan()).collect();
            let cmp = |a: &usize, c: &usize| lp[*c].total_cmp(&lp[*a]).then(a.cmp(c));
            if idx.len() > n_keep {
                idx.select_nth_unstable_by(n_keep - 1, cmp);
                idx.truncate(n_keep);
            }
            cands.extend(idx.into_iter().map(|v| (bm.score + f64::from(lp[v]), bi, v as u32)));
        }
        cands.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)).then(x.2.cmp(&y.2)));
        cands.truncate(n_keep);
        if cands.is_empty() {
            break;
        }
        let mut next: Vec<(usize, u32, f64)> = Vec::with_capacity(b);
        for (rank, &(score, bi, tok)) in cands.iter().enumerate() {
            if eos_token_ids.contains(&tok) {
                if rank >= b {
                    continue;
                }
                let mut t = beams[bi].tokens.clone();
                t.push(tok);
                hyps.add(t, score);
            } else {
                next.push((bi, tok, score));
            }
            if next.len() == b {
                break;
            }
        }
        done = hyps.is_done(cands[0].0, cur_len, budget, beam.early_stopping);
        if done || next.is_empty() {
            done = true;
            break;
        }
        // Fork caches into the other bank and run the new beams in one batched forward.
        bank ^= 1;
        let base = bank * b as u64;
        let mut new_beams = Vec::with_capacity(next.len());
        for (j, &(bi, tok, score)) in next.iter().enumerate() {
            let seq = base + j as u64;
            lm.fork(beams[bi].seq, seq)?;
            let mut t = beams[bi].tokens.clone();
            t.push(tok);
            new_beams.push(Beam { seq, tokens: t, score });
        }
        for old in &beams {
            lm.remove(old.seq);
        }
        beams = new_beams;
        if cur_len == budget {
            break;
        }
        let inputs: Vec<(SeqId, &[u32])> = beams.iter().map(|bm| (bm.seq, &bm.tokens[bm.tokens.len() - 1..])).collect();
        rows = lm.forward(&inputs, LogitsWanted::Last, false)?.logits;
        forward_calls += 1;
    }
    if !done {
        for bm in &beams {
            hyps.add(bm.tokens.clone(), bm.score);
        }
    }
    for bm in &beams {
        lm.remove(bm.seq);
    }
    let mut sequences = hyps.beams;
    sequences.sort_by(|x, y| y.score.total_cmp(&x.score));
    sequences.truncate(beam.num_return_sequences);
    Ok(BeamSearchOutput { sequences, forward_calls })
}
