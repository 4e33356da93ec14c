//! Decoding strategies as step machines, advanced one engine step at a time.
//!
//! A strategy does not own a decode loop. The engine (`deco_serve::engine`, which both
//! `deco generate` and `deco serve` run on) prefills the request's prompt as the request-local
//! sequence 0 and then alternates, for every request at once:
//!
//! 1. it computes every token the strategies asked for, in one batched forward with the other
//!    requests' prefill chunks and decode tokens (continuous batching);
//! 2. when every sequence a strategy fed has its row, it calls [`StepMachine::advance`] with those
//!    rows; the strategy answers with cache operations ([`Op`]: fork, remove, feed tokens) and
//!    the output it can release ([`Choice`]).
//!
//! Sequence ids are request-local ([`Local`]); the engine maps them to its cache's ids, so a
//! strategy's sequences (a beam group) are ordinary sequences of the paged cache that share
//! blocks through copy-on-write forks, can be preempted and recomputed like any other.

use deco_decoding::FinishReason;

use crate::error::Result;

/// A request-local sequence id. `0` is the prompt's sequence, prefilled by the engine before the
/// first [`StepMachine::advance`].
pub type Local = u32;

/// A cache operation asked by a strategy, applied by the engine in the order given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// Creates `to` as a copy of `from`: its tokens and its cached keys and values (shared
    /// blocks, copy-on-write). `to` must be unused.
    Fork {
        /// The source sequence.
        from: Local,
        /// The new sequence.
        to: Local,
    },
    /// Appends `tokens` (at least one) to `seq` and computes them; the row of the last one comes
    /// back in the next [`StepMachine::advance`].
    Feed {
        /// The sequence.
        seq: Local,
        /// New tokens.
        tokens: Vec<u32>,
    },
    /// Drops `seq` and frees its cache blocks.
    Remove(Local),
}

/// The model outputs of one fed sequence: the rows of its last fed token.
#[derive(Debug, Clone, PartialEq)]
pub struct SeqRows {
    /// The sequence.
    pub seq: Local,
    /// `[vocab]` raw logits.
    pub logits: Vec<f32>,
}

/// Output released for one choice of the request.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    /// Choice index, `0..num_choices`.
    pub index: usize,
    /// Tokens appended to the choice's output (the model's end token included when it ended
    /// the choice).
    pub tokens: Vec<u32>,
    /// Set when the choice is complete.
    pub finish: Option<FinishReason>,
    /// The sum of the log-probabilities the strategy scored the choice's tokens with, when it
    /// keeps one (beam search: the processed log-softmax; vLLM's `cumulative_logprob`).
    pub cumulative_logprob: Option<f64>,
}

/// What [`StepMachine::advance`] returns.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Step {
    /// Cache operations, applied in order.
    pub ops: Vec<Op>,
    /// Output to release.
    pub output: Vec<Choice>,
}

impl Step {
    /// Whether the strategy fed nothing: the request is complete once the ops are applied.
    pub fn is_final(&self) -> bool {
        !self.ops.iter().any(|o| matches!(o, Op::Feed { .. }))
    }
}

/// A decoding strategy advanced by the engine (see the [module docs](self)).
pub trait StepMachine: Send + std::fmt::Debug {
    /// Number of choices the request returns (`num_return_sequences`).
    fn num_choices(&self) -> usize;

    /// Advances with the rows of every sequence fed by the previous step (the first call: the
    /// prompt's last row, sequence 0). A [`Step`] that feeds nothing ends the request; by then
    /// every choice has been finished and every sequence removed.
    ///
    /// # Errors
    /// Logits processing errors; the engine fails the request.
    fn advance(&mut self, rows: Vec<SeqRows>) -> Result<Step>;
}
