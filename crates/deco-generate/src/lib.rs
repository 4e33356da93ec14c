//! Decoding strategies for deco as step machines ([`step`]): a [`StepMachine`] owns no loop; the
//! serving engine (`deco_serve::engine`), which `deco generate` and `deco serve` share, advances
//! every request's machine one batched forward at a time (the one decode loop of deco).
//!
//! | strategy | type | source |
//! |---|---|---|
//! | greedy / sampling (with AutoDeco heads, early exit) | the engine's per-token path (`deco_serve::engine`) | Hugging Face `_sample` |
//! | beam search | [`BeamSearch`] | Hugging Face `BeamSearchScorer` |
//! | speculative decoding | [`Speculative`], drafting with the engine's second model (another model or the target's first layers) or [`PromptLookupDrafter`] | Leviathan et al. 2023 Alg. 1; Chen et al. 2023 Alg. 2; Saxena 2023 |
//! | contrastive search | [`ContrastiveSearch`] | Su et al. 2022; Hugging Face `_contrastive_search` |
//! | contrastive decoding | [`ContrastiveDecoding`], the engine's second model as the amateur | Li et al. 2023 |
//!
//! Early exit's forward lives in `deco_model::early_exit` (it needs the model's layers).
//!
//! Every strategy takes the request's [`SamplingParams`](deco_decoding::SamplingParams) for its
//! processor chain, `max_new_tokens`, `stop_token_ids` and seed; stop strings are matched by the
//! engine on the text it releases. The [`CausalLm`] trait (implemented for
//! [`deco_model::Llama`] by [`LlamaSession`] and by the closure-driven [`FnLm`]) is what the
//! strategy tests run the machines on.

pub mod beam;
pub mod contrastive;
pub mod error;
pub mod lm;
pub mod medusa;
pub mod sample;
pub mod speculative;
pub mod step;

pub use beam::{BeamHypothesis, BeamSearch, BeamSearchParams, EarlyStopping};
pub use contrastive::{ContrastiveDecoding, ContrastiveDecodingParams, ContrastiveSearch, contrastive_scores, degeneration_penalty};
pub use error::{GenerateError, Result};
pub use medusa::{DraftHeads, Medusa, MedusaStats, MedusaTree, TypicalAcceptance};
pub use lm::{CausalLm, FnLm, LlamaSession, PrefixFn, SeqId, StepRows};
pub use sample::DEFAULT_MAX_NEW_TOKENS;
pub use speculative::{
    Draft, DraftSchedule, DraftSource, MAX_SPECULATIVE_TOKENS, Processing, PromptLookupDrafter, Speculative, SpeculativeStats,
    accept_or_residual,
};
pub use step::{Choice, Local, Op, Role, SeqRows, Step, StepMachine};
