//! Decoding strategies as step machines, advanced one engine step at a time.
//!
//! A strategy does not own a decode loop. The engine (`deco_serve::engine`, which both
//! `deco generate` and `deco serve` run on) prefills the request's prompt as the request-local
//! sequence 0 and then alternates, for every request at once:
//!
//! 1. it computes every token the strategies asked for, in one batched forward with the other
//!    requests' prefill chunks and decode tokens (continuous batching);
//! 2. when every sequence a strategy fed has its rows, it calls [`StepMachine::advance`] with
//!    those rows; the strategy answers with cache operations ([`Op`]: fork, feed, truncate,
//!    remove) and the output it can release ([`Choice`]).
//!
//! A strategy with a draft model (speculative decoding with a second model or the target's
//! first layers, contrastive decoding's amateur) feeds it with [`Op::DraftFeed`]: the engine
//! runs the draft feeds of every request in one batched forward of the draft model (its own
//! paged cache) before the target's forward, and advances the strategy with the draft rows, as
//! many times as the strategies keep feeding the draft. One step feeds one model: target feeds
//! and draft feeds are never mixed in one [`Step`].
//!
//! Sequence ids are request-local ([`Local`]), one namespace per model; the engine maps them to
//! its caches' ids, so a strategy's target sequences (a beam group) are ordinary sequences of
//! the paged cache that share blocks through copy-on-write forks, and can be preempted and
//! recomputed like any other.

use deco_decoding::FinishReason;

use crate::error::Result;

/// A request-local sequence id. `0` is the prompt's sequence, prefilled by the engine before the
/// first [`StepMachine::advance`].
pub type Local = u32;

/// A cache operation asked by a strategy, applied by the engine in the order given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// Creates target sequence `to` as a copy of `from`: its tokens and its cached keys and
    /// values (shared blocks, copy-on-write). `to` must be unused.
    Fork {
        /// The source sequence.
        from: Local,
        /// The new sequence.
        to: Local,
    },
    /// Appends `tokens` (at least one) to target sequence `seq` and computes them; the rows of
    /// the last `rows` of them (`1..=tokens.len()`) come back in the next
    /// [`StepMachine::advance`].
    Feed {
        /// The sequence.
        seq: Local,
        /// New tokens.
        tokens: Vec<u32>,
        /// Positions, counted from the end, that return rows.
        rows: usize,
        /// Also return the final hidden states of those positions.
        hidden: bool,
    },
    /// Appends a token tree to target sequence `seq`, every token of which must be computed,
    /// and computes it in one forward with tree attention (Medusa's candidate tree, Cai et al.
    /// 2024 §2.1.2; `deco_model::SeqInput::tree`): `parents[i]` is node `i`'s parent among
    /// `tokens` (`< i`) or `None` for a node that follows the sequence. Every node's row comes
    /// back, with its final hidden state, in node order. The next step must keep one path of
    /// it ([`Op::KeepTreePath`]) before feeding the sequence again.
    FeedTree {
        /// The sequence.
        seq: Local,
        /// The nodes' tokens.
        tokens: Vec<u32>,
        /// Each node's parent.
        parents: Vec<Option<usize>>,
    },
    /// Keeps the nodes `path` (indices into the last [`Op::FeedTree`] of `seq`, a root-to-node
    /// path in increasing order) as the sequence's next tokens, with their keys and values, and
    /// drops the rest of the tree.
    KeepTreePath {
        /// The sequence.
        seq: Local,
        /// Kept nodes.
        path: Vec<usize>,
    },
    /// Keeps the first `len` tokens of target sequence `seq` (prompt included) and drops the
    /// rest from its token list and its cache (rejected speculative tokens).
    Truncate {
        /// The sequence.
        seq: Local,
        /// Tokens kept.
        len: usize,
    },
    /// Drops target sequence `seq` and frees its cache blocks.
    Remove(Local),
    /// Appends `tokens` to the draft model's sequence `seq` (created empty on first use) and
    /// computes them; the row of the last one comes back in the next advance.
    DraftFeed {
        /// The draft sequence.
        seq: Local,
        /// New tokens (at least one).
        tokens: Vec<u32>,
    },
    /// Keeps the first `len` tokens of the draft model's sequence `seq`.
    DraftTruncate {
        /// The draft sequence.
        seq: Local,
        /// Tokens kept.
        len: usize,
    },
    /// Drops the draft model's sequence `seq`.
    DraftRemove(Local),
}

/// Which model computed a [`SeqRows`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The served model.
    Target,
    /// The engine's draft model.
    Draft,
}

/// The model outputs of one fed sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct SeqRows {
    /// The sequence.
    pub seq: Local,
    /// The model that computed the rows.
    pub role: Role,
    /// `rows × [vocab]` raw logits of the fed positions that asked for rows, in order.
    pub logits: Vec<Vec<f32>>,
    /// `rows × [hidden]` final hidden states (after the last RMSNorm) of the same positions when
    /// they were asked for, else empty.
    pub hidden: Vec<Vec<f32>>,
}

impl SeqRows {
    /// The last row of logits (the next-token distribution after everything fed).
    pub fn last(&self) -> Option<&[f32]> {
        self.logits.last().map(Vec::as_slice)
    }
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
    /// Speculative counters of this step: draft tokens proposed and accepted (vLLM's
    /// `spec_decode_num_draft_tokens` / `_accepted_tokens`).
    pub drafted: usize,
    /// See [`Step::drafted`].
    pub accepted: usize,
}

impl Step {
    /// Whether the strategy fed nothing: the request is complete once the ops are applied.
    pub fn is_final(&self) -> bool {
        !self.ops.iter().any(|o| matches!(o, Op::Feed { .. } | Op::FeedTree { .. } | Op::DraftFeed { .. }))
    }
}

/// A decoding strategy advanced by the engine (see the [module docs](self)).
pub trait StepMachine: Send + std::fmt::Debug {
    /// Number of choices the request returns (`num_return_sequences`).
    fn num_choices(&self) -> usize;

    /// Rows the first advance needs from the prompt: the last `rows` positions of sequence 0
    /// (default 1: the next-token distribution) and whether with their hidden states. More
    /// than one row makes the engine compute the whole prompt (no prefix-cache reuse).
    fn prompt_rows(&self) -> (usize, bool) {
        (1, false)
    }

    /// Advances with the rows of every sequence fed by the previous step (the first call: the
    /// prompt's last row, target sequence 0). A [`Step`] that feeds nothing ends the request;
    /// by then every choice has been finished and every sequence removed.
    ///
    /// # Errors
    /// Logits processing errors; the engine fails the request.
    fn advance(&mut self, rows: Vec<SeqRows>) -> Result<Step>;
}
