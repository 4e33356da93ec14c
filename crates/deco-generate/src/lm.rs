//! The model-facing trait of every strategy, [`CausalLm`], its implementation for
//! [`deco_model::Llama`] ([`LlamaSession`]) and a closure-driven fake ([`FnLm`]) for tests.

use std::collections::HashMap;
use std::ops::Range;

use deco_model::{DenseKvCache, KvCache, Llama, LogitsWanted, SeqInput};

pub use deco_model::SeqId;

use crate::error::{GenerateError, Result};

/// Host copies of one batched forward's outputs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepRows {
    /// `[rows][vocab]` raw logits (f32, before any processor).
    pub logits: Vec<Vec<f32>>,
    /// `[rows][hidden]` last-layer hidden states after the final norm (Hugging Face's
    /// `hidden_states[-1]` for Llama); empty unless requested.
    pub hidden: Vec<Vec<f32>>,
    /// Row range of each input sequence, in input order.
    pub rows: Vec<Range<usize>>,
}

/// A causal language model with a per-sequence KV cache, as the decoding strategies see it.
///
/// Each sequence (`SeqId`) has a cached prefix; [`forward`](Self::forward) appends new tokens
/// of several sequences in one batched pass and returns logits (and optionally hidden states)
/// for the last new token of each sequence or for every new token.
pub trait CausalLm {
    /// Vocabulary size (length of each logits row).
    fn vocab_size(&self) -> usize;

    /// Longest sequence (prompt + output) the model accepts.
    fn max_context(&self) -> usize;

    /// Appends `tokens` to each sequence's cache and returns their logits rows: one per
    /// sequence with [`LogitsWanted::Last`], one per new token with [`LogitsWanted::All`].
    /// With `hidden`, also the final hidden state of the same rows.
    ///
    /// # Errors
    /// The model's: empty batch or empty token list, token out of range, context overflow.
    fn forward(&mut self, inputs: &[(SeqId, &[u32])], wanted: LogitsWanted, hidden: bool) -> Result<StepRows>;

    /// Tokens cached for `seq` (0 for an unknown sequence).
    fn seq_len(&self, seq: SeqId) -> usize;

    /// Copies the cache of `from` into `to` (replacing what `to` held).
    ///
    /// # Errors
    /// [`GenerateError::InvalidInput`] / model error if `from` is unknown.
    fn fork(&mut self, from: SeqId, to: SeqId) -> Result<()>;

    /// Keeps the first `len` cached tokens of `seq` (rollback).
    ///
    /// # Errors
    /// If `len` exceeds the cached length or `seq` is unknown.
    fn truncate(&mut self, seq: SeqId, len: usize) -> Result<()>;

    /// Frees the cache of `seq`.
    fn remove(&mut self, seq: SeqId);
}

/// A [`Llama`] with its own [`DenseKvCache`], optionally cut to its first `num_layers` layers
/// (followed by the final norm and the LM head: the self-speculative draft of Zhang et al. 2024,
/// "Draft & Verify", and the truncated amateur of contrastive decoding).
#[derive(Debug)]
pub struct LlamaSession<'m> {
    model: &'m Llama,
    cache: DenseKvCache,
    num_layers: usize,
}

impl<'m> LlamaSession<'m> {
    /// The full model with an empty cache.
    pub fn new(model: &'m Llama) -> Self {
        Self { model, cache: DenseKvCache::new(model.num_layers()), num_layers: model.num_layers() }
    }

    /// The model's first `num_layers` layers + final norm + LM head, with an empty cache.
    ///
    /// # Errors
    /// [`GenerateError::InvalidParameter`] unless `1 <= num_layers <= model.num_layers()`.
    pub fn truncated(model: &'m Llama, num_layers: usize) -> Result<Self> {
        if num_layers == 0 || num_layers > model.num_layers() {
            return Err(crate::error::invalid(
                "num_layers",
                "must be between 1 and the model's number of layers",
                format!("{num_layers} (model has {})", model.num_layers()),
            ));
        }
        Ok(Self { model, cache: DenseKvCache::new(num_layers), num_layers })
    }

    /// Number of layers this session runs.
    pub fn num_layers(&self) -> usize {
        self.num_layers
    }

    /// The underlying model.
    pub fn model(&self) -> &'m Llama {
        self.model
    }
}


impl CausalLm for LlamaSession<'_> {
    fn vocab_size(&self) -> usize {
        self.model.config.vocab_size
    }

    fn max_context(&self) -> usize {
        self.model.max_context()
    }

    fn forward(&mut self, inputs: &[(SeqId, &[u32])], wanted: LogitsWanted, hidden: bool) -> Result<StepRows> {
        let seqs: Vec<SeqInput<'_>> = inputs.iter().map(|&(seq, tokens)| SeqInput { seq, tokens, tree: None }).collect();
        let out = self.model.forward_partial(&seqs, &mut self.cache, wanted, self.num_layers)?;
        let logits = deco_model::host::to_host_rows(out.logits)?;
        let hidden = if hidden { deco_model::host::to_host_rows(out.hidden)? } else { Vec::new() };
        Ok(StepRows { logits, hidden, rows: out.rows })
    }

    fn seq_len(&self, seq: SeqId) -> usize {
        self.cache.seq_len(seq)
    }

    fn fork(&mut self, from: SeqId, to: SeqId) -> Result<()> {
        Ok(self.cache.fork(from, to)?)
    }

    fn truncate(&mut self, seq: SeqId, len: usize) -> Result<()> {
        Ok(self.cache.truncate(seq, len)?)
    }

    fn remove(&mut self, seq: SeqId) {
        self.cache.remove(seq);
    }
}

/// Logits (or hidden state) of the next position as a function of the whole token prefix.
pub type PrefixFn = Box<dyn Fn(&[u32]) -> Vec<f32> + Send + Sync>;

/// A fake [`CausalLm`] whose "cache" is each sequence's token list and whose logits (and hidden
/// states) are closures of the prefix. For hand-computable tests of the strategies.
pub struct FnLm {
    vocab: usize,
    max_context: usize,
    logits: PrefixFn,
    hidden: Option<PrefixFn>,
    seqs: HashMap<SeqId, Vec<u32>>,
    /// Number of [`CausalLm::forward`] calls so far.
    pub forward_calls: usize,
    /// Number of tokens run through [`CausalLm::forward`] so far.
    pub tokens_processed: usize,
}

impl std::fmt::Debug for FnLm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FnLm").field("vocab", &self.vocab).field("seqs", &self.seqs.len()).finish()
    }
}

impl FnLm {
    /// A fake model over `vocab` tokens: `logits(prefix)` gives the `[vocab]` logits of the
    /// token after `prefix` (which includes the token at the current position).
    pub fn new(vocab: usize, logits: impl Fn(&[u32]) -> Vec<f32> + Send + Sync + 'static) -> Self {
        Self {
            vocab,
            max_context: usize::MAX,
            logits: Box::new(logits),
            hidden: None,
            seqs: HashMap::new(),
            forward_calls: 0,
            tokens_processed: 0,
        }
    }

    /// Adds hidden states: `hidden(prefix)` is the hidden vector at the last token of `prefix`.
    pub fn with_hidden(mut self, hidden: impl Fn(&[u32]) -> Vec<f32> + Send + Sync + 'static) -> Self {
        self.hidden = Some(Box::new(hidden));
        self
    }

    /// Limits the context length.
    pub fn with_max_context(mut self, max_context: usize) -> Self {
        self.max_context = max_context;
        self
    }

    /// The tokens held for `seq`.
    pub fn tokens(&self, seq: SeqId) -> &[u32] {
        self.seqs.get(&seq).map_or(&[], |v| v.as_slice())
    }
}

impl CausalLm for FnLm {
    fn vocab_size(&self) -> usize {
        self.vocab
    }

    fn max_context(&self) -> usize {
        self.max_context
    }

    fn forward(&mut self, inputs: &[(SeqId, &[u32])], wanted: LogitsWanted, hidden: bool) -> Result<StepRows> {
        if inputs.is_empty() {
            return Err(GenerateError::InvalidInput("empty batch".into()));
        }
        self.forward_calls += 1;
        let mut out = StepRows::default();
        for &(seq, tokens) in inputs {
            if tokens.is_empty() {
                return Err(GenerateError::InvalidInput(format!("sequence {seq} has no new tokens")));
            }
            if let Some(&t) = tokens.iter().find(|&&t| t as usize >= self.vocab) {
                return Err(GenerateError::Model(deco_model::Error::TokenOutOfRange { id: t, vocab: self.vocab }));
            }
            let s = self.seqs.entry(seq).or_default();
            if s.len() + tokens.len() > self.max_context {
                return Err(GenerateError::Model(deco_model::Error::ContextOverflow {
                    seq,
                    needed: s.len() + tokens.len(),
                    max: self.max_context,
                }));
            }
            self.tokens_processed += tokens.len();
            let start = out.logits.len();
            for (i, &t) in tokens.iter().enumerate() {
                s.push(t);
                if wanted == LogitsWanted::All || i + 1 == tokens.len() {
                    out.logits.push((self.logits)(s));
                    if hidden {
                        let h = self.hidden.as_ref().ok_or_else(|| {
                            GenerateError::InvalidInput("this FnLm has no hidden states".into())
                        })?;
                        out.hidden.push(h(s));
                    }
                }
            }
            out.rows.push(start..out.logits.len());
        }
        Ok(out)
    }

    fn seq_len(&self, seq: SeqId) -> usize {
        self.seqs.get(&seq).map_or(0, Vec::len)
    }

    fn fork(&mut self, from: SeqId, to: SeqId) -> Result<()> {
        let s = self.seqs.get(&from).ok_or_else(|| GenerateError::InvalidInput(format!("unknown sequence {from}")))?;
        let copy = s.clone();
        self.seqs.insert(to, copy);
        Ok(())
    }

    fn truncate(&mut self, seq: SeqId, len: usize) -> Result<()> {
        let s = self.seqs.get_mut(&seq).ok_or_else(|| GenerateError::InvalidInput(format!("unknown sequence {seq}")))?;
        if len > s.len() {
            return Err(GenerateError::InvalidInput(format!("cannot truncate sequence {seq} of {} tokens to {len}", s.len())));
        }
        s.truncate(len);
        Ok(())
    }

    fn remove(&mut self, seq: SeqId) {
        self.seqs.remove(&seq);
    }
}
