//! Decoding strategies for deco, over a model-agnostic [`CausalLm`] trait (implemented for
//! [`deco_model::Llama`] by [`LlamaSession`], and by the closure-driven [`FnLm`] for tests).
//!
//! | strategy | function | source |
//! |---|---|---|
//! | greedy / sampling | [`generate`] | Hugging Face `_sample` |
//! | beam search | [`BeamSearch`], a [`StepMachine`] the engine advances | Hugging Face `BeamSearchScorer` |
//! | speculative decoding | [`speculative_generate`] with [`ModelDrafter`] (second model or the target's first layers) or [`PromptLookupDrafter`] | Leviathan et al. 2023 Alg. 1; Chen et al. 2023 Alg. 2; Saxena 2023 |
//! | contrastive search | [`contrastive_search`] | Su et al. 2022; Hugging Face `_contrastive_search` |
//! | contrastive decoding | [`contrastive_decoding`] | Li et al. 2023 |
//!
//! Early exit lives in `deco_model::early_exit` (it needs the model's layers).
//!
//! The strategies are moving to step machines ([`step`]): a [`StepMachine`] owns no loop; the
//! serving engine (`deco_serve::engine`), which `deco generate` and `deco serve` share, advances
//! it one batched forward at a time. Beam search is one; the others still run their own loop
//! over [`CausalLm`].
//!
//! Every strategy takes the request's [`SamplingParams`](deco_decoding::SamplingParams) for its
//! processor chain, `max_new_tokens`, `stop_token_ids` and seed; stop strings are matched by the
//! caller on the text it receives through the [`TokenSink`].

pub mod beam;
pub mod contrastive;
pub mod error;
pub mod lm;
pub mod sample;
pub mod speculative;
pub mod step;

pub use beam::{BeamHypothesis, BeamSearch, BeamSearchParams, EarlyStopping};
pub use contrastive::{
    ContrastiveDecodingParams, contrastive_decoding, contrastive_scores, contrastive_search, degeneration_penalty,
};
pub use error::{GenerateError, Result};
pub use lm::{CausalLm, FnLm, LlamaSession, PrefixFn, SeqId, StepRows};
pub use sample::{DEFAULT_MAX_NEW_TOKENS, Generation, TokenSink, generate};
pub use step::{Choice, Local, Op, SeqRows, Step, StepMachine};
pub use speculative::{
    Draft, Drafter, ModelDrafter, Processing, PromptLookupDrafter, SpeculativeOutput, SpeculativeStats,
    accept_or_residual, speculative_generate,
};
