//! The per-sequence [`Sampler`]: processors + seeded RNG + greedy/categorical choice + logprobs.

use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{RngCore, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::error::{DecodingError, Result};
use crate::math::{log_sum_exp, max_logit, sum_exp_shifted, top_n};
use crate::params::{MAX_LOGPROBS, SamplerOrder, SamplingParams};
use crate::processors::{LogitsProcessor, LogitsProcessorList, ProcessContext};

/// A token id with its log-probability (natural log).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    /// Token id.
    pub token: u32,
    /// `ln p(token)`.
    pub logprob: f32,
}

/// Log-probabilities reported for one sampled token when `logprobs` was requested.
///
/// Two distributions are reported:
/// - **processed**: `log_softmax` of the logits after every processor of the chain (penalties,
///   bias, temperature, truncation; removed tokens are `-inf`). This is the distribution the
///   token was actually drawn from (for greedy decoding: the penalized logits at temperature 1,
///   the warpers are not applied). It matches Hugging Face's `output_scores` after
///   `log_softmax`, and vLLM's `logprobs_mode="processed_logprobs"`.
/// - **raw**: `log_softmax` of the model's logits before any processing. This is what the
///   OpenAI API and vLLM (by default, `raw_logprobs`) return.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Logprobs {
    /// Chosen token's log-probability under the raw model distribution.
    pub raw_logprob: f32,
    /// The `n` most likely tokens of the processed distribution, most likely first (ties: lower
    /// id first). Tokens with processed probability 0 (`-inf`) are never listed, so this may
    /// hold fewer than `n` entries.
    pub top_logprobs: Vec<TokenLogprob>,
    /// The `n` most likely tokens of the raw distribution, most likely first.
    pub raw_top_logprobs: Vec<TokenLogprob>,
}

/// The result of one [`Sampler::sample`] step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SampleOutput {
    /// The chosen token id.
    pub token: u32,
    /// Chosen token's log-probability under the processed distribution (see [`Logprobs`] for
    /// which distribution that is); NaN for a greedy sampler told not to compute it
    /// ([`Sampler::set_chosen_logprob`]).
    pub logprob: f32,
    /// Alternatives and raw log-probabilities, when `logprobs` was requested.
    pub logprobs: Option<Logprobs>,
}

/// Sampling state of one sequence: its processor chain, its own seeded RNG and its logprobs
/// setting.
///
/// A batch engine holds one `Sampler` per sequence. The RNG is `ChaCha8` (from `rand_chacha`),
/// seeded with `seed_from_u64(seed)`; each sampling step that is not greedy consumes exactly
/// one `u64` from it. So a seeded request produces the same tokens for the same logits,
/// whatever other sequences share its batch and in whatever order their samplers run.
///
/// Choice rule:
/// - **greedy** (`do_sample == false` or `temperature == 0`): argmax of the processed logits,
///   ties to the lowest token id; the RNG is not used.
/// - **sampling**: draw `u` uniform in `[0, 1)` from the top 53 bits of one `u64`, then take the
///   first token (in id order) whose cumulative weight `sum_{j <= i} exp(l_j - max)` exceeds
///   `u * total` (inverse-CDF categorical sampling in `f64`). Tokens at `-inf` have weight 0
///   and are never drawn.
#[derive(Debug)]
pub struct Sampler {
    processors: LogitsProcessorList,
    greedy: bool,
    seed: u64,
    rng: ChaCha8Rng,
    logprobs: Option<usize>,
    chosen_logprob: bool,
}

impl Sampler {
    /// A sampler for `params` with the Hugging Face processor order.
    ///
    /// # Errors
    /// Any [`SamplingParams::validate`] error.
    pub fn new(params: &SamplingParams) -> Result<Self> {
        Self::with_order(params, SamplerOrder::HuggingFace)
    }

    /// A sampler for `params` with the given processor order.
    ///
    /// Without `params.seed`, a seed is drawn from the operating system (see [`seed`](Self::seed)
    /// to report it).
    ///
    /// # Errors
    /// Any [`SamplingParams::validate`] error.
    pub fn with_order(params: &SamplingParams, order: SamplerOrder) -> Result<Self> {
        let processors = LogitsProcessorList::from_params(params, order)?;
        Self::from_processors(processors, params.is_greedy(), params.seed, params.logprobs)
    }

    /// A sampler over a hand-built processor list.
    ///
    /// # Errors
    /// `logprobs > MAX_LOGPROBS`.
    pub fn from_processors(
        processors: LogitsProcessorList,
        greedy: bool,
        seed: Option<u64>,
        logprobs: Option<usize>,
    ) -> Result<Self> {
        if let Some(n) = logprobs
            && n > MAX_LOGPROBS
        {
            return Err(crate::error::invalid("logprobs", "must be <= 20", n));
        }
        let seed = seed.unwrap_or_else(rand::random);
        Ok(Self {
            processors,
            greedy,
            seed,
            rng: ChaCha8Rng::seed_from_u64(seed),
            logprobs,
            chosen_logprob: true,
        })
    }

    /// Whether a greedy draw without `logprobs` computes [`SampleOutput::logprob`] (default
    /// true). Off, the greedy token costs one pass over the row for its maximum and a search for
    /// its first position instead of also an `exp` per vocabulary entry (~180 µs of a
    /// 49,152-entry row on a 2026 server core), and `logprob` is NaN. The serving engine turns
    /// it off for requests without `logprobs`, which never return it (as vLLM). Sampling, and
    /// any sampler with `logprobs`, always compute it.
    pub fn set_chosen_logprob(&mut self, on: bool) {
        self.chosen_logprob = on;
    }

    /// The seed in use (the request's, or the random one drawn when it had none).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// True when this sampler takes the argmax instead of drawing.
    pub fn is_greedy(&self) -> bool {
        self.greedy
    }

    /// The processor chain, in application order.
    pub fn processors(&self) -> &LogitsProcessorList {
        &self.processors
    }

    /// Runs the processors on `logits` (in place) and chooses the next token.
    ///
    /// `logits` is the model's row for the next position, length `vocab_size`; afterwards it
    /// holds the processed logits.
    ///
    /// # Errors
    /// - [`EmptyLogits`](DecodingError::EmptyLogits) for an empty row;
    /// - [`NonFiniteLogit`](DecodingError::NonFiniteLogit) if the model's row holds NaN or
    ///   `+inf` (`-inf` is allowed);
    /// - any processor error (e.g. a history token `>= vocab_size`), or a processor that left
    ///   NaN / `+inf` in the row ([`NonFiniteLogit`](DecodingError::NonFiniteLogit));
    /// - [`NoValidToken`](DecodingError::NoValidToken) if processing removed every token.
    pub fn sample(&mut self, ctx: &ProcessContext<'_>, logits: &mut [f32]) -> Result<SampleOutput> {
        let processors = std::mem::take(&mut self.processors);
        let out = self.sample_with(&processors, ctx, logits);
        self.processors = processors;
        out
    }

    /// Like [`sample`](Self::sample), but runs `processors` instead of the sampler's own chain
    /// for this one token; the greedy / sampling choice, the RNG and the logprobs setting stay
    /// the sampler's. For parameters that change per token, e.g. AutoDeco's predicted
    /// temperature and top-p (build the chain with [`LogitsProcessorList::from_params`]).
    ///
    /// # Errors
    /// As [`sample`](Self::sample).
    pub fn sample_with(&mut self, processors: &LogitsProcessorList, ctx: &ProcessContext<'_>, logits: &mut [f32]) -> Result<SampleOutput> {
        check_row(logits)?;
        let raw = self.logprobs.map(|_| logits.to_vec());
        processors.process(ctx, logits)?;
        // A custom processor could have produced NaN or +inf; refuse rather than guess.
        check_row(logits)?;
        if self.greedy && !self.chosen_logprob && self.logprobs.is_none() {
            // The first position of the maximum (`argmax`), without the log-sum-exp.
            let m = max_logit(logits);
            let token = if m == f32::NEG_INFINITY { None } else { logits.iter().position(|&x| x == m) };
            let token = token.ok_or(DecodingError::NoValidToken)?;
            return Ok(SampleOutput { token: token as u32, logprob: f32::NAN, logprobs: None });
        }
        // `log_sum_exp` spelled out, so that the draw reuses its sum of `exp(l - max)` (one pass
        // over the vocabulary fewer; the same bits as `log_sum_exp` and `categorical`).
        let m = max_logit(logits);
        let (total, lse) = if m == f32::NEG_INFINITY {
            (0.0, f64::NEG_INFINITY)
        } else {
            let total = sum_exp_shifted(logits, m);
            (total, f64::from(m) + total.ln())
        };
        if lse == f64::NEG_INFINITY || lse.is_nan() {
            return Err(DecodingError::NoValidToken);
        }
        let token = if self.greedy {
            // The first position of the maximum (`argmax`, with `m` already known and finite).
            logits.iter().position(|&x| x == m).ok_or(DecodingError::NoValidToken)?
        } else {
            let u = self.uniform();
            categorical_with(logits, u, m, total).ok_or(DecodingError::NoValidToken)?
        };
        let logprob = (f64::from(logits[token]) - lse) as f32;
        let logprobs = match (self.logprobs, raw) {
            (Some(n), Some(raw)) => {
                let raw_lse = log_sum_exp(&raw);
                let list = |row: &[f32], lse: f64| -> Vec<TokenLogprob> {
                    top_n(row, n)
                        .into_iter()
                        .map(|i| TokenLogprob {
                            token: i as u32,
                            logprob: (f64::from(row[i]) - lse) as f32,
                        })
                        .collect()
                };
                Some(Logprobs {
                    raw_logprob: (f64::from(raw[token]) - raw_lse) as f32,
                    top_logprobs: list(logits, lse),
                    raw_top_logprobs: list(&raw, raw_lse),
                })
            }
            _ => None,
        };
        Ok(SampleOutput {
            token: token as u32,
            logprob,
            logprobs,
        })
    }

    /// One uniform draw in `[0, 1)` from this sequence's RNG (53 random bits); consumes one
    /// `u64`. For accept/reject steps such as speculative decoding.
    pub fn uniform(&mut self) -> f64 {
        (self.rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Draws a token id with probability proportional to `weights[i]` (non-negative, need not
    /// sum to 1), using this sequence's RNG (one `u64`). For sampling from a residual
    /// distribution, e.g. `max(0, p_target - p_draft)` in speculative decoding.
    ///
    /// # Errors
    /// [`EmptyLogits`](DecodingError::EmptyLogits) for an empty slice;
    /// [`InvalidParameter`](DecodingError::InvalidParameter) for a negative, NaN or infinite
    /// weight; [`NoValidToken`](DecodingError::NoValidToken) if all weights are 0.
    pub fn sample_weights(&mut self, weights: &[f32]) -> Result<u32> {
        if weights.is_empty() {
            return Err(DecodingError::EmptyLogits);
        }
        if let Some((i, w)) = weights
            .iter()
            .enumerate()
            .find(|(_, w)| !(w.is_finite() && **w >= 0.0))
        {
            return Err(crate::error::invalid(
                "weights",
                "must be finite and >= 0",
                format!("{w} at index {i}"),
            ));
        }
        let total: f64 = weights.iter().map(|&w| f64::from(w)).sum();
        if total <= 0.0 {
            return Err(DecodingError::NoValidToken);
        }
        let target = self.uniform() * total;
        let mut cum = 0.0f64;
        let mut last = 0;
        for (i, &w) in weights.iter().enumerate() {
            if w > 0.0 {
                cum += f64::from(w);
                last = i;
                if cum > target {
                    return Ok(i as u32);
                }
            }
        }
        Ok(last as u32)
    }
}

/// Rejects empty rows and NaN / `+inf` entries.
fn check_row(logits: &[f32]) -> Result<()> {
    if logits.is_empty() {
        return Err(DecodingError::EmptyLogits);
    }
    // NaN or +inf. Pieces scanned without an early exit (vectorized); the first bad piece is
    // searched for the first bad index.
    let bad = |x: f32| x.is_nan() | (x == f32::INFINITY);
    const PIECE: usize = 1024;
    for (p, c) in logits.chunks(PIECE).enumerate() {
        if c.iter().fold(false, |a, &x| a | bad(x))
            && let Some((i, &value)) = c.iter().enumerate().find(|&(_, &x)| bad(x))
        {
            return Err(DecodingError::NonFiniteLogit { index: p * PIECE + i, value });
        }
    }
    Ok(())
}

/// [`categorical_with`] computing the row's maximum and sum itself; `None` if every entry is
/// `-inf`.
#[cfg(test)]
fn categorical(logits: &[f32], u: f64) -> Option<usize> {
    let m = max_logit(logits);
    if m == f32::NEG_INFINITY {
        return None;
    }
    categorical_with(logits, u, m, sum_exp_shifted(logits, m))
}

/// Inverse-CDF draw from `softmax(logits)` with uniform `u` in `[0, 1)`, given the row's
/// maximum `m` (finite) and `total = sum_exp_shifted(logits, m)`. Weights are `exp(l - max)` as
/// `f32` terms, summed in `f64`; `-inf` entries are skipped.
fn categorical_with(logits: &[f32], u: f64, m: f32, total: f64) -> Option<usize> {
    let target = u * total;
    let mut cum = 0.0f64;
    let mut last = None;
    for (i, &x) in logits.iter().enumerate() {
        if x > f32::NEG_INFINITY {
            cum += f64::from((x - m).exp());
            last = Some(i);
            if cum > target {
                return Some(i);
            }
        }
    }
    last
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn categorical_inverts_the_cdf() {
        // p = [0.25, 0.5, 0.25] (logits ln 1, ln 2, ln 1); CDF = 0.25, 0.75, 1.0
        let l = [0.0f32, 2f32.ln(), 0.0];
        assert_eq!(categorical(&l, 0.0), Some(0));
        assert_eq!(categorical(&l, 0.2499), Some(0));
        assert_eq!(categorical(&l, 0.2501), Some(1));
        assert_eq!(categorical(&l, 0.7499), Some(1));
        assert_eq!(categorical(&l, 0.7501), Some(2));
        assert_eq!(categorical(&l, 0.999_999), Some(2));
        // -inf entries are skipped even at u = 0
        assert_eq!(categorical(&[f32::NEG_INFINITY, 1.0], 0.0), Some(1));
        assert_eq!(categorical(&[f32::NEG_INFINITY], 0.5), None);
    }
}
