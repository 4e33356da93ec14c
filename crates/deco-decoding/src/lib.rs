//! Decoding for deco: logits processors, per-sequence seeded sampling, generation config and
//! stopping rules. Works on plain `&mut [f32]` logits rows (one row = one sequence's next-token
//! logits, length `vocab_size`); no tensor framework.
//!
//! # Pieces
//! - [`LogitsProcessor`] (object safe) with [`ProcessContext`] (prompt ids, generated ids, EOS
//!   ids), and the processors: [`Temperature`], [`TopK`], [`TopP`], [`MinP`], [`TypicalP`],
//!   [`EpsilonCutoff`], [`EtaCutoff`], [`RepetitionPenalty`], [`FrequencyPenalty`],
//!   [`PresencePenalty`], [`NoRepeatNGram`], [`LogitBias`], [`BadWordsIds`], [`MinNewTokens`].
//!   Semantics follow Hugging Face transformers' `generation/logits_process.py`; each type
//!   names its source class or paper and any deviation.
//! - [`SamplingParams`]: a request's optional parameters (serde), [`SamplingParams::validate`].
//! - [`LogitsProcessorList::from_params`]: the chain in a [`SamplerOrder`].
//! - [`Sampler`]: one per sequence; own ChaCha8 RNG, greedy or categorical choice, logprobs.
//! - [`GenerationConfig`]: a model's `generation_config.json`, [`GenerationConfig::merge`].
//! - [`StopStringMatcher`], [`StoppingCriteria`], [`FinishReason`].
//!
//! # Processor order
//! [`LogitsProcessorList::from_params`] mirrors transformers' `GenerationMixin._get_logits_processor`
//! (which builds: `sequence_bias`, ..., `repetition_penalty`, `no_repeat_ngram_size`,
//! `bad_words_ids`, `min_length`, `min_new_tokens`, ..., then, only when `do_sample`, the
//! warpers `temperature`, `top_k`, `top_p`, `min_p`, `typical_p`, `epsilon_cutoff`,
//! `eta_cutoff`). Processors whose parameter is absent or at its identity value are skipped.
//!
//! History processors (both orders):
//! 1. `logit_bias` ([`LogitBias`]; in the slot of Hugging Face's `sequence_bias`, which comes first)
//! 2. `repetition_penalty` ([`RepetitionPenalty`])
//! 3. `frequency_penalty` ([`FrequencyPenalty`]) and 4. `presence_penalty`
//!    ([`PresencePenalty`]) — not in Hugging Face; placed next to the repetition penalty, as
//!    llama.cpp's `penalties` sampler applies repeat, then frequency and presence together
//! 5. `no_repeat_ngram_size` ([`NoRepeatNGram`])
//! 6. `bad_words_ids` ([`BadWordsIds`])
//! 7. `min_new_tokens` ([`MinNewTokens`])
//!
//! Warpers, only when sampling ([`SamplingParams::is_greedy`] is false):
//! - [`SamplerOrder::HuggingFace`] (default): `temperature -> top_k -> top_p -> min_p ->
//!   typical_p -> epsilon_cutoff -> eta_cutoff`.
//! - [`SamplerOrder::LlamaCpp`]: llama.cpp's default chain is `logit_bias`, then
//!   `penalties; dry; top_n_sigma; top_k; typ_p; top_p; min_p; xtc; temperature`, then `dist`.
//!   Here: `top_k -> typical_p -> top_p -> min_p -> epsilon_cutoff -> eta_cutoff ->
//!   temperature` (DRY, top-n-sigma and XTC are not implemented; epsilon/eta are not in
//!   llama.cpp and sit just before temperature). Temperature last means the filters act on
//!   the untempered distribution. llama.cpp's `penalty_last_n` window is not modelled: the
//!   penalties see the whole history.
//!
//! # Greedy versus sampling
//! A request decodes greedily when `do_sample == Some(false)` or `temperature == Some(0.0)`:
//! the history processors run, the warpers do not, and the argmax (lowest id on ties) is
//! taken. Otherwise the processed row is sampled with the sequence's own RNG; see [`Sampler`].
//!
//! # Determinism
//! Each [`Sampler`] owns a `rand_chacha::ChaCha8Rng` seeded by `seed_from_u64(seed)` and uses
//! exactly one `u64` per sampled token, so a seeded request yields the same tokens for the
//! same logits regardless of the other sequences in its batch.
//!
//! # Example
//! ```
//! use deco_decoding::{ProcessContext, Sampler, SamplingParams};
//!
//! let params = SamplingParams::from_json_str(r#"{"temperature": 0.7, "top_p": 0.9, "seed": 42}"#)?;
//! let mut sampler = Sampler::new(&params)?;
//! let mut logits = vec![1.0f32, 3.0, 2.5, -1.0];
//! let ctx = ProcessContext::new(&[5, 6], &[], &[3]);
//! let out = sampler.sample(&ctx, &mut logits)?;
//! assert!(out.token == 1 || out.token == 2);
//! # Ok::<(), deco_decoding::DecodingError>(())
//! ```

pub mod error;
pub mod generation_config;
pub mod math;
pub mod params;
pub mod processors;
pub mod sampler;
pub mod stop;

pub use error::{DecodingError, Result};
pub use generation_config::{GenerationConfig, HF_DEFAULT_MAX_LENGTH, HF_DEFAULT_TOP_K, TokenIds};
pub use params::{MAX_LOGPROBS, SamplerOrder, SamplingParams};
pub use processors::{
    BadWordsIds, EpsilonCutoff, EtaCutoff, FrequencyPenalty, LogitBias, LogitsProcessor,
    LogitsProcessorList, MinNewTokens, MinP, NoRepeatNGram, PresencePenalty, ProcessContext,
    RepetitionPenalty, Temperature, TopK, TopP, TypicalP,
};
pub use sampler::{Logprobs, SampleOutput, Sampler, TokenLogprob};
pub use stop::{FinishReason, StopStep, StopStringMatcher, StoppingCriteria};
