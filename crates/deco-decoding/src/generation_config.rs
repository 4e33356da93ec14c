//! Hugging Face `generation_config.json`: reading it and merging request overrides into it.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{DecodingError, Result};
use crate::params::SamplingParams;

/// Hugging Face's default `top_k` (`GenerationConfig.top_k = 50`), used only when sampling.
pub const HF_DEFAULT_TOP_K: i64 = 50;
/// Hugging Face's default `max_length` (prompt + new tokens) when neither it nor
/// `max_new_tokens` is set.
pub const HF_DEFAULT_MAX_LENGTH: usize = 20;

/// One id or a list of ids, as Hugging Face writes `eos_token_id` (`2` or `[151645, 151643]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TokenIds {
    /// A single id.
    One(u32),
    /// Several ids.
    Many(Vec<u32>),
}

impl TokenIds {
    /// The ids as a list.
    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            TokenIds::One(t) => vec![*t],
            TokenIds::Many(v) => v.clone(),
        }
    }
}

/// The decoding defaults a model ships in `generation_config.json` (Hugging Face
/// `transformers.GenerationConfig`).
///
/// Every field is optional; absent (or `null`) fields take Hugging Face's class defaults through
/// the accessor methods: `do_sample = false`, `temperature = 1.0`, `top_k = 50`, `top_p = 1.0`,
/// `typical_p = 1.0`, `epsilon_cutoff = 0`, `eta_cutoff = 0`, `repetition_penalty = 1.0`,
/// `no_repeat_ngram_size = 0`, `max_length = 20`. Unknown keys (`transformers_version`,
/// `_from_model_config`, beam-search settings...) are ignored.
///
/// Note on `top_k`: Hugging Face's default of 50 is a warper setting, so it only takes effect
/// when sampling (`do_sample = true`); greedy decoding ignores it. [`merge`](Self::merge)
/// follows that rule.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct GenerationConfig {
    /// Sample instead of greedy decoding. Default `false`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub do_sample: Option<bool>,
    /// Default 1.0.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    /// Default 50 (sampling only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i64>,
    /// Default 1.0.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    /// Default none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f32>,
    /// Default 1.0.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub typical_p: Option<f32>,
    /// Default 0.0.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub epsilon_cutoff: Option<f32>,
    /// Default 0.0.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eta_cutoff: Option<f32>,
    /// Default 1.0.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub repetition_penalty: Option<f32>,
    /// Default 0.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub no_repeat_ngram_size: Option<usize>,
    /// Default none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bad_words_ids: Option<Vec<Vec<u32>>>,
    /// New tokens to generate at most; takes precedence over `max_length`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_new_tokens: Option<usize>,
    /// Prompt + new tokens at most. Default 20.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_length: Option<usize>,
    /// New tokens to generate at least.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_new_tokens: Option<usize>,
    /// Prompt + new tokens at least (kept for reference, not applied by [`merge`](Self::merge)).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_length: Option<usize>,
    /// End-of-sequence id(s).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eos_token_id: Option<TokenIds>,
    /// Beginning-of-sequence id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bos_token_id: Option<u32>,
    /// Padding id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pad_token_id: Option<u32>,
    /// Beam count (1 = no beam search). Kept for reference.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_beams: Option<usize>,
}

impl GenerationConfig {
    /// Parses the JSON text of a `generation_config.json`.
    ///
    /// # Errors
    /// [`Json`](DecodingError::Json) for malformed JSON or a field of the wrong type.
    pub fn from_json_str(json: &str) -> Result<Self> {
        Ok(serde_json::from_str(json)?)
    }

    /// Reads and parses `path` (usually `<model dir>/generation_config.json`).
    ///
    /// # Errors
    /// [`Io`](DecodingError::Io) naming the file, or [`Json`](DecodingError::Json).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| DecodingError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_json_str(&text)
    }

    /// EOS ids as a list (empty when absent).
    pub fn eos_token_ids(&self) -> Vec<u32> {
        self.eos_token_id
            .as_ref()
            .map(TokenIds::to_vec)
            .unwrap_or_default()
    }

    /// `do_sample`, default `false`.
    pub fn do_sample(&self) -> bool {
        self.do_sample.unwrap_or(false)
    }

    /// `temperature`, default 1.0.
    pub fn temperature(&self) -> f32 {
        self.temperature.unwrap_or(1.0)
    }

    /// `top_k`, default 50.
    pub fn top_k(&self) -> i64 {
        self.top_k.unwrap_or(HF_DEFAULT_TOP_K)
    }

    /// `top_p`, default 1.0.
    pub fn top_p(&self) -> f32 {
        self.top_p.unwrap_or(1.0)
    }

    /// `typical_p`, default 1.0.
    pub fn typical_p(&self) -> f32 {
        self.typical_p.unwrap_or(1.0)
    }

    /// `repetition_penalty`, default 1.0.
    pub fn repetition_penalty(&self) -> f32 {
        self.repetition_penalty.unwrap_or(1.0)
    }

    /// `max_length`, default 20.
    pub fn max_length(&self) -> usize {
        self.max_length.unwrap_or(HF_DEFAULT_MAX_LENGTH)
    }

    /// How many new tokens Hugging Face would generate at most for a prompt of `prompt_len`
    /// tokens: `max_new_tokens` if set, else `max_length - prompt_len` (saturating at 0).
    pub fn max_new_tokens_for(&self, prompt_len: usize) -> usize {
        self.max_new_tokens
            .unwrap_or_else(|| self.max_length().saturating_sub(prompt_len))
    }

    /// Final request parameters: the request's `overrides` on top of this config.
    ///
    /// Rules:
    /// - `do_sample`: the request's `do_sample` if given; else, if the request gives a
    ///   `temperature`, `temperature > 0` (an OpenAI-style request that sets a temperature wants
    ///   sampling even when the model's config says `do_sample = false`); else the config's
    ///   `do_sample` (default `false`). The result is always `Some`.
    /// - Warpers (`temperature`, `top_k`, `top_p`, `min_p`, `typical_p`, `epsilon_cutoff`,
    ///   `eta_cutoff`) and `repetition_penalty`, `no_repeat_ngram_size`, `bad_words_ids`,
    ///   `min_new_tokens`, `max_new_tokens`: the request's value, else the config's.
    /// - `top_k`: when the result samples and neither sets `top_k`, Hugging Face's default 50.
    /// - Request-only fields (`frequency_penalty`, `presence_penalty`, `logit_bias`, `stop`,
    ///   `stop_token_ids`, `include_stop_str_in_output`, `seed`, `logprobs`): the request's.
    /// - `max_length` / `min_length` (which count the prompt) are not converted; see
    ///   [`max_new_tokens_for`](Self::max_new_tokens_for).
    ///
    /// The result is not validated; [`Sampler::new`](crate::Sampler::new) validates it.
    pub fn merge(&self, overrides: &SamplingParams) -> SamplingParams {
        let do_sample = overrides
            .do_sample
            .or(overrides.temperature.map(|t| t > 0.0))
            .unwrap_or(self.do_sample());
        let base = SamplingParams {
            do_sample: Some(do_sample),
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            typical_p: self.typical_p,
            epsilon_cutoff: self.epsilon_cutoff,
            eta_cutoff: self.eta_cutoff,
            repetition_penalty: self.repetition_penalty,
            no_repeat_ngram_size: self.no_repeat_ngram_size,
            bad_words_ids: self.bad_words_ids.clone(),
            min_new_tokens: self.min_new_tokens,
            max_new_tokens: self.max_new_tokens,
            ..SamplingParams::default()
        };
        let mut merged = base.overridden_by(overrides);
        merged.do_sample = Some(do_sample);
        if do_sample && merged.top_k.is_none() {
            merged.top_k = Some(HF_DEFAULT_TOP_K);
        }
        merged
    }
}
