//! Logits processors: the [`LogitsProcessor`] trait, its per-step [`ProcessContext`], the
//! ordered [`LogitsProcessorList`], and every processor.
//!
//! A processor rewrites one row of `vocab_size` logits in place. Filtering processors
//! ("warpers" in Hugging Face: top-k, top-p, min-p, typical, epsilon, eta) set removed tokens
//! to `-inf`; penalties shift or scale logits. Processors never produce NaN from a row whose
//! entries are finite or `-inf`, and a row that is already all `-inf` is left unchanged
//! (the sampler then reports [`DecodingError::NoValidToken`]).
//!
//! Every processor is named after, and follows the formula of, the class of Hugging Face
//! transformers' `generation/logits_process.py` cited in its documentation; deviations are
//! listed there.

mod penalties;
mod warpers;

pub use penalties::{
    BadWordsIds, FrequencyPenalty, LogitBias, MinNewTokens, NoRepeatNGram, PresencePenalty,
    RepetitionPenalty,
};
pub use warpers::{EpsilonCutoff, EtaCutoff, MinP, Temperature, TopK, TopP, TypicalP};

use crate::error::{DecodingError, Result};

/// What a processor may look at besides the logits: the token history of one sequence.
///
/// Hugging Face passes `input_ids` = prompt followed by the generated tokens (decoder-only
/// models); here the two halves are kept apart because some rules (frequency/presence
/// penalties, `min_new_tokens`) only look at the generated part.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcessContext<'a> {
    /// Token ids of the prompt.
    pub prompt_ids: &'a [u32],
    /// Token ids generated so far (not counting the one being chosen now).
    pub output_ids: &'a [u32],
    /// End-of-sequence token ids of the model (a model may have several, e.g. Qwen2's
    /// `<|im_end|>` and `<|endoftext|>`).
    pub eos_token_ids: &'a [u32],
}

impl<'a> ProcessContext<'a> {
    /// A context from its three parts.
    pub fn new(prompt_ids: &'a [u32], output_ids: &'a [u32], eos_token_ids: &'a [u32]) -> Self {
        Self {
            prompt_ids,
            output_ids,
            eos_token_ids,
        }
    }

    /// Length of prompt + output (Hugging Face's `input_ids.shape[-1]`, `cur_len`).
    pub fn len(&self) -> usize {
        self.prompt_ids.len() + self.output_ids.len()
    }

    /// True when both prompt and output are empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Token `i` of prompt + output, `None` past the end.
    pub fn token(&self, i: usize) -> Option<u32> {
        if i < self.prompt_ids.len() {
            Some(self.prompt_ids[i])
        } else {
            self.output_ids.get(i - self.prompt_ids.len()).copied()
        }
    }

    /// Prompt then output ids, in order.
    pub fn all_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.prompt_ids
            .iter()
            .chain(self.output_ids.iter())
            .copied()
    }
}

/// One step of logits processing for one sequence.
///
/// `logits` is one row of length `vocab_size` (unnormalized log-probabilities); it is rewritten
/// in place. Implementations must be deterministic (randomness belongs to the
/// [`Sampler`](crate::Sampler)), must not panic on any input, and return
/// [`DecodingError::TokenOutOfRange`] when a token id they need does not index the row.
///
/// The trait is object safe; lists hold `Box<dyn LogitsProcessor>`.
pub trait LogitsProcessor: Send + Sync + std::fmt::Debug {
    /// Rewrites `logits` (length `vocab_size`) for the next token of the sequence in `ctx`.
    fn process(&self, ctx: &ProcessContext<'_>, logits: &mut [f32]) -> Result<()>;

    /// Short name (the Hugging Face parameter it implements, e.g. `"top_p"`), used in
    /// [`LogitsProcessorList::names`] and debugging output.
    fn name(&self) -> &'static str;
}

/// Where a token id came from, for error messages.
pub(crate) fn check_id(what: &'static str, token: u32, vocab_size: usize) -> Result<usize> {
    let i = token as usize;
    if i < vocab_size {
        Ok(i)
    } else {
        Err(DecodingError::TokenOutOfRange {
            what,
            token,
            vocab_size,
        })
    }
}

/// Validates Hugging Face's `min_tokens_to_keep` (must be >= 1).
pub(crate) fn check_min_keep(min_tokens_to_keep: usize) -> Result<usize> {
    if min_tokens_to_keep == 0 {
        Err(crate::error::invalid(
            "min_tokens_to_keep",
            "must be >= 1",
            min_tokens_to_keep,
        ))
    } else {
        Ok(min_tokens_to_keep)
    }
}

/// An ordered list of processors applied one after another (Hugging Face `LogitsProcessorList`).
///
/// Build it by hand with [`push`](Self::push), or from request parameters with
/// [`LogitsProcessorList::from_params`](crate::LogitsProcessorList::from_params), which uses the
/// documented default order (see the [crate docs](crate)).
#[derive(Debug, Default)]
pub struct LogitsProcessorList {
    processors: Vec<Box<dyn LogitsProcessor>>,
}

impl LogitsProcessorList {
    /// An empty list (processing is the identity).
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a processor; it runs after those already in the list.
    pub fn push(&mut self, processor: impl LogitsProcessor + 'static) {
        self.processors.push(Box::new(processor));
    }

    /// Appends an already boxed processor.
    pub fn push_boxed(&mut self, processor: Box<dyn LogitsProcessor>) {
        self.processors.push(processor);
    }

    /// Number of processors.
    pub fn len(&self) -> usize {
        self.processors.len()
    }

    /// True when the list holds no processor.
    pub fn is_empty(&self) -> bool {
        self.processors.is_empty()
    }

    /// The [`LogitsProcessor::name`]s in application order.
    pub fn names(&self) -> Vec<&'static str> {
        self.processors.iter().map(|p| p.name()).collect()
    }

    /// The processors in application order.
    pub fn iter(&self) -> impl Iterator<Item = &dyn LogitsProcessor> {
        self.processors.iter().map(|p| p.as_ref())
    }
}

impl LogitsProcessor for LogitsProcessorList {
    /// Applies every processor in order; stops at the first error.
    fn process(&self, ctx: &ProcessContext<'_>, logits: &mut [f32]) -> Result<()> {
        for p in &self.processors {
            p.process(ctx, logits)?;
        }
        Ok(())
    }

    fn name(&self) -> &'static str {
        "processor_list"
    }
}
