//! Penalties and bans that depend on the token history: repetition, frequency and presence
//! penalties, n-gram blocking, bad words, logit bias and the minimum length.

use std::collections::BTreeMap;

use super::{LogitsProcessor, ProcessContext, check_id};
use crate::error::{Result, invalid};

/// One bit per token id, to visit each distinct token once.
struct TokenSet {
    bits: Vec<u64>,
}

impl TokenSet {
    fn new(vocab_size: usize) -> Self {
        Self {
            bits: vec![0; vocab_size.div_ceil(64)],
        }
    }

    /// Inserts `i` (< vocab_size); returns true if it was not there.
    fn insert(&mut self, i: usize) -> bool {
        let (w, b) = (i / 64, 1u64 << (i % 64));
        let fresh = self.bits[w] & b == 0;
        self.bits[w] |= b;
        fresh
    }
}

/// Counts of each distinct token in `ids` (checked against `vocab_size`), sorted by id.
fn counts(what: &'static str, ids: &[u32], vocab_size: usize) -> Result<Vec<(usize, u32)>> {
    let mut sorted = ids.to_vec();
    sorted.sort_unstable();
    let mut out: Vec<(usize, u32)> = Vec::new();
    for t in sorted {
        let i = check_id(what, t, vocab_size)?;
        match out.last_mut() {
            Some((j, c)) if *j == i => *c += 1,
            _ => out.push((i, 1)),
        }
    }
    Ok(out)
}

/// Repetition penalty over the prompt and the generated tokens.
///
/// Source: transformers `RepetitionPenaltyLogitsProcessor` (Keskar et al. 2019, CTRL); the same
/// formula as llama.cpp's `penalty_repeat` (which however only looks at the last
/// `penalty_last_n` tokens; here, like Hugging Face, the whole history counts).
///
/// For every **distinct** token `t` in prompt + output (applied once, however often `t`
/// occurs): `l_t = l_t / penalty` if `l_t > 0`, else `l_t * penalty` (so `0` stays `0` and
/// `-inf` stays `-inf`). `repetition_penalty > 1` discourages repetition, `< 1` encourages it,
/// `1` is the identity. It must be finite and `> 0`.
///
/// # Errors (process)
/// A history token id `>= vocab_size`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RepetitionPenalty {
    penalty: f32,
}

impl RepetitionPenalty {
    /// Validates `repetition_penalty` (finite, `> 0`).
    ///
    /// # Errors
    /// `repetition_penalty <= 0`, NaN or infinite.
    pub fn new(repetition_penalty: f32) -> Result<Self> {
        if !(repetition_penalty.is_finite() && repetition_penalty > 0.0) {
            return Err(invalid(
                "repetition_penalty",
                "must be a finite number > 0",
                repetition_penalty,
            ));
        }
        Ok(Self {
            penalty: repetition_penalty,
        })
    }

    /// The configured penalty.
    pub fn repetition_penalty(&self) -> f32 {
        self.penalty
    }
}

impl LogitsProcessor for RepetitionPenalty {
    fn process(&self, ctx: &ProcessContext<'_>, logits: &mut [f32]) -> Result<()> {
        if self.penalty == 1.0 {
            return Ok(());
        }
        let mut seen = TokenSet::new(logits.len());
        for (what, ids) in [
            ("prompt_ids", ctx.prompt_ids),
            ("output_ids", ctx.output_ids),
        ] {
            for &t in ids {
                let i = check_id(what, t, logits.len())?;
                if seen.insert(i) {
                    let x = logits[i];
                    logits[i] = if x > 0.0 {
                        x / self.penalty
                    } else {
                        x * self.penalty
                    };
                }
            }
        }
        Ok(())
    }

    fn name(&self) -> &'static str {
        "repetition_penalty"
    }
}

/// OpenAI frequency penalty over the generated tokens: `l_t -= count(t) * frequency_penalty`.
///
/// Source: OpenAI API "Frequency and presence penalties" formula
/// `mu[j] -= c[j] * alpha_frequency + (c[j] > 0) * alpha_presence`; llama.cpp
/// `penalty_freq`; vLLM `frequency_penalty`. Not a Hugging Face processor. Only `output_ids`
/// count (not the prompt), as in vLLM.
///
/// Any finite value is accepted here (positive discourages repetition, negative encourages
/// it); [`SamplingParams::validate`](crate::SamplingParams::validate) restricts requests to
/// OpenAI's `[-2, 2]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FrequencyPenalty {
    penalty: f32,
}

impl FrequencyPenalty {
    /// Validates `frequency_penalty` (finite).
    ///
    /// # Errors
    /// NaN or infinite.
    pub fn new(frequency_penalty: f32) -> Result<Self> {
        if !frequency_penalty.is_finite() {
            return Err(invalid(
                "frequency_penalty",
                "must be finite",
                frequency_penalty,
            ));
        }
        Ok(Self {
            penalty: frequency_penalty,
        })
    }
}

impl LogitsProcessor for FrequencyPenalty {
    fn process(&self, ctx: &ProcessContext<'_>, logits: &mut [f32]) -> Result<()> {
        if self.penalty == 0.0 {
            return Ok(());
        }
        for (i, c) in counts("output_ids", ctx.output_ids, logits.len())? {
            logits[i] -= c as f32 * self.penalty;
        }
        Ok(())
    }

    fn name(&self) -> &'static str {
        "frequency_penalty"
    }
}

/// OpenAI presence penalty over the generated tokens: `l_t -= presence_penalty` once for every
/// distinct token `t` that occurs in `output_ids`.
///
/// Source: OpenAI API penalty formula (see [`FrequencyPenalty`]); llama.cpp `penalty_present`;
/// vLLM `presence_penalty`. Any finite value is accepted here; requests are restricted to
/// `[-2, 2]` by [`SamplingParams::validate`](crate::SamplingParams::validate).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PresencePenalty {
    penalty: f32,
}

impl PresencePenalty {
    /// Validates `presence_penalty` (finite).
    ///
    /// # Errors
    /// NaN or infinite.
    pub fn new(presence_penalty: f32) -> Result<Self> {
        if !presence_penalty.is_finite() {
            return Err(invalid(
                "presence_penalty",
                "must be finite",
                presence_penalty,
            ));
        }
        Ok(Self {
            penalty: presence_penalty,
        })
    }
}

impl LogitsProcessor for PresencePenalty {
    fn process(&self, ctx: &ProcessContext<'_>, logits: &mut [f32]) -> Result<()> {
        if self.penalty == 0.0 {
            return Ok(());
        }
        for (i, _) in counts("output_ids", ctx.output_ids, logits.len())? {
            logits[i] -= self.penalty;
        }
        Ok(())
    }

    fn name(&self) -> &'static str {
        "presence_penalty"
    }
}

/// Forbids any n-gram of size `no_repeat_ngram_size` from occurring twice in prompt + output.
///
/// Source: transformers `NoRepeatNGramLogitsProcessor` (Paulus et al. 2017, "A Deep Reinforced
/// Model for Abstractive Summarization").
///
/// Rule, with `n = no_repeat_ngram_size`, `seq` = prompt + output of length `L`: if
/// `L < n` nothing is banned (no complete n-gram yet); otherwise for every window `seq[i..i+n]` whose first `n - 1`
/// tokens equal the last `n - 1` tokens of `seq`, the token `seq[i + n - 1]` is set to `-inf`.
/// `n == 1` bans every token already present; `n == 0` disables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NoRepeatNGram {
    ngram_size: usize,
}

impl NoRepeatNGram {
    /// Any size is valid; 0 disables.
    pub fn new(no_repeat_ngram_size: usize) -> Result<Self> {
        Ok(Self {
            ngram_size: no_repeat_ngram_size,
        })
    }

    /// The tokens banned as next token for this history, in window order (may repeat).
    pub fn banned_tokens(&self, ctx: &ProcessContext<'_>) -> Vec<u32> {
        let n = self.ngram_size;
        let len = ctx.len();
        if n == 0 || len < n {
            return Vec::new();
        }
        let seq: Vec<u32> = ctx.all_ids().collect();
        let prefix = &seq[len - (n - 1)..];
        seq.windows(n)
            .filter(|w| &w[..n - 1] == prefix)
            .map(|w| w[n - 1])
            .collect()
    }
}

impl LogitsProcessor for NoRepeatNGram {
    fn process(&self, ctx: &ProcessContext<'_>, logits: &mut [f32]) -> Result<()> {
        for t in self.banned_tokens(ctx) {
            let i = check_id("no_repeat_ngram_size history", t, logits.len())?;
            logits[i] = f32::NEG_INFINITY;
        }
        Ok(())
    }

    fn name(&self) -> &'static str {
        "no_repeat_ngram_size"
    }
}

/// Bans token sequences ("bad words").
///
/// Source: transformers `NoBadWordsLogitsProcessor` (a `SequenceBiasLogitsProcessor` with
/// bias `-inf`).
///
/// - A one-token sequence `[t]` sets `t` to `-inf` at every step, except when `t` is one of the
///   context's EOS ids (Hugging Face drops `[eos]` entries so that generation can still end).
/// - A longer sequence `[t1, ..., tn]` sets `tn` to `-inf` when prompt + output ends with
///   `[t1, ..., t(n-1)]`, so the full sequence can never be completed.
///
/// `bad_words_ids` must be a non-empty list of non-empty sequences.
///
/// # Errors (process)
/// A banned id `>= vocab_size` (Hugging Face raises the same for out-of-vocabulary ids).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadWordsIds {
    bad_words_ids: Vec<Vec<u32>>,
}

impl BadWordsIds {
    /// Validates the list.
    ///
    /// # Errors
    /// An empty outer list, or an empty sequence inside it.
    pub fn new(bad_words_ids: Vec<Vec<u32>>) -> Result<Self> {
        if bad_words_ids.is_empty() {
            return Err(invalid(
                "bad_words_ids",
                "must be a non-empty list of token-id sequences",
                "[]",
            ));
        }
        if let Some(pos) = bad_words_ids.iter().position(|s| s.is_empty()) {
            return Err(invalid(
                "bad_words_ids",
                "must not contain an empty sequence",
                format!("an empty sequence at index {pos}"),
            ));
        }
        Ok(Self { bad_words_ids })
    }

    /// The banned sequences.
    pub fn bad_words_ids(&self) -> &[Vec<u32>] {
        &self.bad_words_ids
    }
}

impl LogitsProcessor for BadWordsIds {
    fn process(&self, ctx: &ProcessContext<'_>, logits: &mut [f32]) -> Result<()> {
        let len = ctx.len();
        for seq in &self.bad_words_ids {
            let (&last, prefix) = match seq.split_last() {
                Some(x) => x,
                None => continue,
            };
            let i = check_id("bad_words_ids", last, logits.len())?;
            let ban = if prefix.is_empty() {
                !ctx.eos_token_ids.contains(&last)
            } else {
                prefix.len() <= len
                    && prefix
                        .iter()
                        .enumerate()
                        .all(|(k, &t)| ctx.token(len - prefix.len() + k) == Some(t))
            };
            if ban {
                logits[i] = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    fn name(&self) -> &'static str {
        "bad_words_ids"
    }
}

/// Adds a fixed bias to chosen tokens: `l_t += logit_bias[t]`.
///
/// Source: OpenAI API `logit_bias`; llama.cpp `llama_sampler_init_logit_bias`; equivalent to
/// transformers `SequenceBiasLogitsProcessor` with one-token sequences.
///
/// A bias may be any finite value or `-inf` (ban); NaN and `+inf` are rejected (they would
/// make the softmax NaN). [`SamplingParams::validate`](crate::SamplingParams::validate)
/// restricts requests to OpenAI's `[-100, 100]`.
///
/// # Errors (process)
/// A biased id `>= vocab_size` (OpenAI rejects unknown token ids as well).
#[derive(Debug, Clone, PartialEq)]
pub struct LogitBias {
    bias: BTreeMap<u32, f32>,
}

impl LogitBias {
    /// Validates the map token id -> bias.
    ///
    /// # Errors
    /// A NaN or `+inf` bias.
    pub fn new(logit_bias: BTreeMap<u32, f32>) -> Result<Self> {
        if let Some((t, b)) = logit_bias
            .iter()
            .find(|(_, b)| b.is_nan() || **b == f32::INFINITY)
        {
            return Err(invalid(
                "logit_bias",
                "values must be finite or -inf",
                format!("{b} for token {t}"),
            ));
        }
        Ok(Self { bias: logit_bias })
    }

    /// The bias map.
    pub fn logit_bias(&self) -> &BTreeMap<u32, f32> {
        &self.bias
    }
}

impl LogitsProcessor for LogitBias {
    fn process(&self, _ctx: &ProcessContext<'_>, logits: &mut [f32]) -> Result<()> {
        for (&t, &b) in &self.bias {
            let i = check_id("logit_bias", t, logits.len())?;
            logits[i] += b;
        }
        Ok(())
    }

    fn name(&self) -> &'static str {
        "logit_bias"
    }
}

/// Blocks end-of-sequence tokens until `min_new_tokens` tokens have been generated.
///
/// Source: transformers `MinNewTokensLengthLogitsProcessor` (which blocks the EOS ids); here the
/// extra `stop_token_ids` (vLLM's name) are blocked as well, so a request cannot end before
/// its minimum length through either. While `output_ids.len() < min_new_tokens`, every id in
/// `ctx.eos_token_ids` and in `stop_token_ids` is set to `-inf`.
///
/// # Errors (process)
/// A blocked id `>= vocab_size`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MinNewTokens {
    min_new_tokens: usize,
    stop_token_ids: Vec<u32>,
}

impl MinNewTokens {
    /// Any `min_new_tokens` is valid (0 disables). `stop_token_ids` are blocked in addition to
    /// the context's EOS ids.
    pub fn new(min_new_tokens: usize, stop_token_ids: Vec<u32>) -> Result<Self> {
        Ok(Self {
            min_new_tokens,
            stop_token_ids,
        })
    }

    /// The configured minimum.
    pub fn min_new_tokens(&self) -> usize {
        self.min_new_tokens
    }
}

impl LogitsProcessor for MinNewTokens {
    fn process(&self, ctx: &ProcessContext<'_>, logits: &mut [f32]) -> Result<()> {
        if ctx.output_ids.len() >= self.min_new_tokens {
            return Ok(());
        }
        for &t in ctx.eos_token_ids {
            let i = check_id("eos_token_ids", t, logits.len())?;
            logits[i] = f32::NEG_INFINITY;
        }
        for &t in &self.stop_token_ids {
            let i = check_id("stop_token_ids", t, logits.len())?;
            logits[i] = f32::NEG_INFINITY;
        }
        Ok(())
    }

    fn name(&self) -> &'static str {
        "min_new_tokens"
    }
}
