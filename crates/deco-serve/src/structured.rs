//! Structured output: token masks that make a generation follow a JSON schema, a Lark grammar
//! or a regular expression (OpenAI's `response_format`, vLLM's `guided_json` / `guided_grammar`
//! / `guided_regex`), through llguidance (the engine llama.cpp and mistral.rs use; Moskal et
//! al., "llguidance", guidance-ai/llguidance).
//!
//! [`Grammars`] holds the tokenizer's token trie (built once per model, about 50k tokens for
//! SmolLM2); [`Grammars::compile`] turns an [`OutputConstraint`] into a [`Constraint`], one per
//! sequence. At each step the engine calls [`Constraint::apply`] on the sequence's logits row
//! before the logits processors and the sampler (disallowed tokens become `-inf`, so every
//! later stage of the chain keeps them out), then [`Constraint::commit`] with the sampled
//! token. When the grammar is complete the mask allows only EOS (or the constraint reports
//! [`Constraint::is_finished`]), so a finished output always parses; an output cut by
//! `max_tokens` (`finish_reason: "length"`) may not, as with OpenAI.

use std::sync::Arc;

use deco_formats::tokenizer::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

use crate::{Error, Result};

/// What a request constrains its output to.
#[derive(Debug, Clone, PartialEq)]
pub enum OutputConstraint {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON valid under this schema (`response_format: {"type": "json_schema", "json_schema":
    /// {"schema": ...}}`, or vLLM's `guided_json`).
    JsonSchema(Value),
    /// A grammar in llguidance's Lark syntax (vLLM's `guided_grammar`).
    Lark(String),
    /// A regular expression the whole output must match (vLLM's `guided_regex`).
    Regex(String),
}

impl OutputConstraint {
    fn grammar(&self) -> TopLevelGrammar {
        match self {
            Self::JsonObject => TopLevelGrammar::from_json_schema(serde_json::json!({"type": "object"})),
            Self::JsonSchema(s) => TopLevelGrammar::from_json_schema(s.clone()),
            Self::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
            Self::Regex(r) => TopLevelGrammar::from_regex(r),
        }
    }
}

/// The tokenizer as llguidance sees it: every token's bytes (special tokens as `0xFF` + their
/// text, llguidance's convention) and a tokenize function.
struct DecoTokEnv {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for DecoTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.tokenizer.encode_with(&String::from_utf8_lossy(s), false, false).unwrap_or_default()
    }
}

/// A model's grammar compiler: its token trie and llguidance's parser factory. Build once per
/// model ([`Grammars::new`]) and share.
pub struct Grammars {
    factory: ParserFactory,
    vocab_size: usize,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Grammars {{ vocab_size: {} }}", self.vocab_size)
    }
}

impl Grammars {
    /// The token trie of `tokenizer` (one byte string per id; added special tokens marked) and
    /// the parser factory over it.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] if the tokenizer has no EOS token, or llguidance refuses the
    /// vocabulary.
    pub fn new(tokenizer: Arc<Tokenizer>) -> Result<Self> {
        let n = tokenizer.vocab_size();
        let eos = tokenizer.eos_token_id().ok_or_else(|| Error::InvalidRequest("structured output needs a tokenizer with an EOS token".into()))?;
        let added = tokenizer.inner().get_added_tokens_decoder();
        let words: Vec<Vec<u8>> = (0..n as u32)
            .map(|id| match added.get(&id) {
                Some(t) if t.special => {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(t.content.as_bytes());
                    w
                }
                _ => tokenizer.token_to_piece(id).unwrap_or_default(),
            })
            .collect();
        let info = TokRxInfo {
            vocab_size: n as u32,
            tok_eos: eos,
            tok_bos: tokenizer.bos_token_id(),
            tok_pad: tokenizer.pad_token_id(),
            tok_unk: None,
            tok_end_of_turn: None,
        };
        let env: TokEnv = Arc::new(DecoTokEnv { trie: TokTrie::from(&info, &words), tokenizer });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| Error::InvalidRequest(format!("structured output: {e}")))?;
        factory.quiet();
        Ok(Self { factory, vocab_size: n })
    }

    /// Compiles `c` into a fresh per-sequence constraint.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] naming the problem for a schema, grammar or regex llguidance
    /// cannot compile (unsupported schema keywords included).
    pub fn compile(&self, c: &OutputConstraint) -> Result<Constraint> {
        let m = Matcher::new(self.factory.create_parser(c.grammar()));
        if let Some(e) = m.get_error() {
            return Err(Error::InvalidRequest(format!("invalid structured output constraint: {e}")));
        }
        Ok(Constraint { matcher: Box::new(m), vocab_size: self.vocab_size })
    }
}

/// One sequence's grammar state.
pub struct Constraint {
    matcher: Box<Matcher>,
    vocab_size: usize,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Constraint {{ stopped: {} }}", self.matcher.is_stopped())
    }
}

impl Clone for Constraint {
    /// An independent copy of the state (for the `n > 1` forks of a request).
    fn clone(&self) -> Self {
        Self { matcher: Box::new(self.matcher.deep_clone()), vocab_size: self.vocab_size }
    }
}

impl Constraint {
    /// Sets every token the grammar does not allow next to `-inf` in `row` (`[vocab]` logits of
    /// the model, which may be longer than the tokenizer's vocabulary: ids past it are masked).
    ///
    /// # Errors
    /// [`Error::Structured`] if the matcher is in an error state or allows no token at all.
    pub fn apply(&mut self, row: &mut [f32]) -> Result<()> {
        let mask = self.matcher.compute_mask_or_eos().map_err(|e| Error::Structured(e.to_string()))?;
        let mut any = false;
        for (id, x) in row.iter_mut().enumerate() {
            if id < self.vocab_size && mask.is_allowed(id as TokenId) {
                any |= x.is_finite() || *x == f32::INFINITY;
            } else {
                *x = f32::NEG_INFINITY;
            }
        }
        if !any {
            return Err(Error::Structured("the grammar allows no token here".into()));
        }
        Ok(())
    }

    /// Advances the grammar past `token` (the token the sampler drew from the masked row).
    ///
    /// # Errors
    /// [`Error::Structured`] if the grammar does not accept it.
    pub fn commit(&mut self, token: u32) -> Result<()> {
        self.matcher.consume_token(token).map_err(|e| Error::Structured(format!("token {token} rejected: {e}")))
    }

    /// The grammar is complete and accepts nothing more: the sequence should stop.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}
