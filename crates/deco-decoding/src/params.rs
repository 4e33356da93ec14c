//! Request-level sampling parameters and the processor chain built from them.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize};

use crate::error::{Result, invalid};
use crate::processors::{
    BadWordsIds, EpsilonCutoff, EtaCutoff, FrequencyPenalty, LogitBias, LogitsProcessorList,
    MinNewTokens, MinP, NoRepeatNGram, PresencePenalty, RepetitionPenalty, Temperature, TopK, TopP,
    TypicalP,
};

/// Largest accepted `logprobs` (number of alternatives per token), OpenAI's `top_logprobs`
/// limit.
pub const MAX_LOGPROBS: usize = 20;

/// Sampling parameters of one request; every field optional so that a request body (or a CLI)
/// only states what it changes.
///
/// Names are Hugging Face `GenerationConfig` names where Hugging Face has the parameter, and
/// OpenAI/vLLM names otherwise (`frequency_penalty`, `presence_penalty`, `logit_bias`, `stop`,
/// `stop_token_ids`, `include_stop_str_in_output`, `seed`, `logprobs`). Absent fields mean
/// "off", except `temperature` (1.0); defaults from a model's `generation_config.json` are
/// applied by [`GenerationConfig::merge`](crate::GenerationConfig::merge), not here.
///
/// Deserializes from JSON with unknown fields ignored (so it can be flattened into an
/// OpenAI-style request). `stop` accepts a string or a list of strings; `logit_bias` keys are
/// token ids written as JSON strings (`{"50256": -100}`).
///
/// Call [`validate`](Self::validate) on untrusted input; [`Sampler::new`](crate::Sampler::new)
/// and [`LogitsProcessorList::from_params`] call it too.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Sample (`true`) or decode greedily (`false`). Absent: sample unless `temperature == 0`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub do_sample: Option<bool>,
    /// Softmax temperature, `>= 0`; 0 means greedy. Absent: 1.0.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    /// Keep the `top_k` most likely tokens, `>= 0`; 0 or absent disables.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i64>,
    /// Nucleus mass in `[0, 1]`; 1 or absent disables.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    /// Min-p ratio in `[0, 1]`; 0 or absent disables.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f32>,
    /// Typical mass in `(0, 1]`; 1 or absent disables.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub typical_p: Option<f32>,
    /// Epsilon cutoff in `[0, 1)`; 0 or absent disables.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub epsilon_cutoff: Option<f32>,
    /// Eta cutoff in `[0, 1)`; 0 or absent disables.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eta_cutoff: Option<f32>,
    /// Repetition penalty, `> 0`; 1 or absent disables.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub repetition_penalty: Option<f32>,
    /// OpenAI frequency penalty in `[-2, 2]`; 0 or absent disables.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f32>,
    /// OpenAI presence penalty in `[-2, 2]`; 0 or absent disables.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f32>,
    /// Size of n-grams that may not repeat; 0 or absent disables.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub no_repeat_ngram_size: Option<usize>,
    /// Token id -> additive bias, each in `[-100, 100]` (OpenAI range).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logit_bias: Option<BTreeMap<u32, f32>>,
    /// Banned token sequences (Hugging Face semantics, see [`BadWordsIds`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bad_words_ids: Option<Vec<Vec<u32>>>,
    /// EOS and stop ids are blocked until this many tokens were generated.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_new_tokens: Option<usize>,
    /// Generation ends with [`FinishReason::Length`](crate::FinishReason::Length) after this
    /// many tokens; must be `>= 1`. Absent: no limit from the request.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_new_tokens: Option<usize>,
    /// Stop strings; generation ends when the decoded text contains one (see
    /// [`StopStringMatcher`](crate::StopStringMatcher)). A single string is accepted.
    #[serde(
        skip_serializing_if = "Option::is_none",
        deserialize_with = "string_or_list"
    )]
    pub stop: Option<Vec<String>>,
    /// Extra token ids that end generation (vLLM `stop_token_ids`), besides the model's EOS.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_token_ids: Option<Vec<u32>>,
    /// Keep the matched stop string at the end of the output (vLLM name). Absent: `false`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub include_stop_str_in_output: Option<bool>,
    /// RNG seed; the same seed and parameters give the same tokens. Absent: random seed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Keep generating past the model's end-of-sequence tokens (vLLM's `ignore_eos`;
    /// benchmarks). `stop_token_ids`, stop strings and the length limit still apply. Absent:
    /// `false`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ignore_eos: Option<bool>,
    /// Number of most likely alternatives to report per token, `0..=`[`MAX_LOGPROBS`]
    /// (vLLM/OpenAI-completions `logprobs`; a chat request's `top_logprobs`). `Some(0)` reports
    /// only the chosen token's log-probabilities. Absent: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<usize>,
}

fn string_or_list<'de, D: Deserializer<'de>>(
    d: D,
) -> std::result::Result<Option<Vec<String>>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    Ok(Option::<OneOrMany>::deserialize(d)?.map(|v| match v {
        OneOrMany::One(s) => vec![s],
        OneOrMany::Many(v) => v,
    }))
}

fn check_range(
    name: &'static str,
    value: Option<f32>,
    ok: impl Fn(f32) -> bool,
    requirement: &'static str,
) -> Result<()> {
    match value {
        Some(v) if !ok(v) => Err(invalid(name, requirement, v)),
        _ => Ok(()),
    }
}

impl SamplingParams {
    /// The JSON field names a [`SamplingParams`] reads (its serde names), so that a request
    /// parser can refuse any other field instead of ignoring it.
    pub const FIELDS: &'static [&'static str] = &[
        "do_sample", "temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff",
        "repetition_penalty", "frequency_penalty", "presence_penalty", "no_repeat_ngram_size", "logit_bias",
        "bad_words_ids", "min_new_tokens", "max_new_tokens", "stop", "stop_token_ids", "include_stop_str_in_output",
        "seed", "ignore_eos", "logprobs",
    ];

    /// Parses a JSON object (unknown fields ignored) and validates it.
    ///
    /// # Errors
    /// [`Json`](crate::DecodingError::Json) for malformed JSON or wrong types (e.g. a negative
    /// `max_new_tokens`), then any [`validate`](Self::validate) error.
    pub fn from_json_str(json: &str) -> Result<Self> {
        let p: Self = serde_json::from_str(json)?;
        p.validate()?;
        Ok(p)
    }

    /// Checks every present field against its range.
    ///
    /// | field | valid |
    /// |---|---|
    /// | `temperature` | finite, `>= 0` |
    /// | `top_k` | `>= 0` |
    /// | `top_p`, `min_p` | `[0, 1]` |
    /// | `typical_p` | `(0, 1]` |
    /// | `epsilon_cutoff`, `eta_cutoff` | `[0, 1)` |
    /// | `repetition_penalty` | finite, `> 0` |
    /// | `frequency_penalty`, `presence_penalty` | `[-2, 2]` |
    /// | `logit_bias` values | `[-100, 100]` |
    /// | `bad_words_ids` | non-empty list of non-empty sequences |
    /// | `max_new_tokens` | `>= 1` |
    /// | `min_new_tokens` | `<= max_new_tokens` when both are given |
    /// | `stop` | no empty string |
    /// | `logprobs` | `<= MAX_LOGPROBS` |
    ///
    /// # Errors
    /// The first violation, as [`InvalidParameter`](crate::DecodingError::InvalidParameter)
    /// naming the field, e.g. `top_p must be in [0, 1], got 1.5`.
    pub fn validate(&self) -> Result<()> {
        check_range(
            "temperature",
            self.temperature,
            |v| v.is_finite() && v >= 0.0,
            "must be a finite number >= 0",
        )?;
        if let Some(k) = self.top_k
            && k < 0
        {
            return Err(invalid("top_k", "must be >= 0 (0 disables top-k)", k));
        }
        let unit = |v: f32| (0.0..=1.0).contains(&v);
        check_range("top_p", self.top_p, unit, "must be in [0, 1]")?;
        check_range("min_p", self.min_p, unit, "must be in [0, 1]")?;
        check_range(
            "typical_p",
            self.typical_p,
            |v| v > 0.0 && v <= 1.0,
            "must be in (0, 1]",
        )?;
        let half_open = |v: f32| (0.0..1.0).contains(&v);
        check_range(
            "epsilon_cutoff",
            self.epsilon_cutoff,
            half_open,
            "must be in [0, 1)",
        )?;
        check_range(
            "eta_cutoff",
            self.eta_cutoff,
            half_open,
            "must be in [0, 1)",
        )?;
        check_range(
            "repetition_penalty",
            self.repetition_penalty,
            |v| v.is_finite() && v > 0.0,
            "must be a finite number > 0",
        )?;
        let openai = |v: f32| (-2.0..=2.0).contains(&v);
        check_range(
            "frequency_penalty",
            self.frequency_penalty,
            openai,
            "must be in [-2, 2]",
        )?;
        check_range(
            "presence_penalty",
            self.presence_penalty,
            openai,
            "must be in [-2, 2]",
        )?;
        if let Some(bias) = &self.logit_bias
            && let Some((t, b)) = bias.iter().find(|(_, b)| !(-100.0..=100.0).contains(*b))
        {
            return Err(invalid(
                "logit_bias",
                "values must be in [-100, 100]",
                format!("{b} for token {t}"),
            ));
        }
        if let Some(bw) = &self.bad_words_ids {
            BadWordsIds::new(bw.clone())?;
        }
        if let Some(m) = self.max_new_tokens
            && m == 0
        {
            return Err(invalid("max_new_tokens", "must be >= 1", m));
        }
        if let (Some(min), Some(max)) = (self.min_new_tokens, self.max_new_tokens)
            && min > max
        {
            return Err(invalid(
                "min_new_tokens",
                "must be <= max_new_tokens",
                format!("{min} > {max}"),
            ));
        }
        if let Some(stop) = &self.stop
            && let Some(pos) = stop.iter().position(|s| s.is_empty())
        {
            return Err(invalid(
                "stop",
                "must not contain an empty string",
                format!("\"\" at index {pos}"),
            ));
        }
        if let Some(n) = self.logprobs
            && n > MAX_LOGPROBS
        {
            return Err(invalid("logprobs", "must be <= 20", n));
        }
        Ok(())
    }

    /// True when these parameters decode greedily: `do_sample == Some(false)` or
    /// `temperature == Some(0.0)`.
    pub fn is_greedy(&self) -> bool {
        self.do_sample == Some(false) || self.temperature == Some(0.0)
    }

    /// `other`'s present fields replace this one's (a shallow `Option::or` per field).
    pub fn overridden_by(&self, other: &SamplingParams) -> SamplingParams {
        macro_rules! pick {
            ($($f:ident),*) => { SamplingParams { $($f: other.$f.clone().or_else(|| self.$f.clone()),)* } };
        }
        pick!(
            do_sample,
            temperature,
            top_k,
            top_p,
            min_p,
            typical_p,
            epsilon_cutoff,
            eta_cutoff,
            repetition_penalty,
            frequency_penalty,
            presence_penalty,
            no_repeat_ngram_size,
            logit_bias,
            bad_words_ids,
            min_new_tokens,
            max_new_tokens,
            stop,
            stop_token_ids,
            include_stop_str_in_output,
            seed,
            ignore_eos,
            logprobs
        )
    }
}

/// Order in which the warpers (temperature and truncation filters) are applied.
///
/// The history-dependent processors always come first, in the same order for both (see the
/// [crate docs](crate)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SamplerOrder {
    /// Hugging Face transformers' `_get_logits_processor`: temperature first, then
    /// top_k -> top_p -> min_p -> typical_p -> epsilon_cutoff -> eta_cutoff. The filters see
    /// the tempered distribution.
    #[default]
    HuggingFace,
    /// llama.cpp's default `common_sampler` chain (`--samplers
    /// penalties;dry;top_n_sigma;top_k;typ_p;top_p;min_p;xtc;temperature`, then `dist`):
    /// top_k -> typical_p -> top_p -> min_p -> (epsilon_cutoff -> eta_cutoff, not in
    /// llama.cpp) -> temperature. The filters see the untempered distribution, and temperature
    /// only reshapes the survivors. DRY, top-n-sigma and XTC are not implemented.
    LlamaCpp,
}

impl LogitsProcessorList {
    /// Builds the processor chain for `params` (validated first) in `order`.
    ///
    /// A processor is only added when its parameter is present and not its identity value
    /// (`repetition_penalty != 1`, `top_k != 0`, `top_p < 1`, `min_p > 0`, `typical_p < 1`,
    /// `0 < epsilon_cutoff`, `0 < eta_cutoff`, `temperature != 1`...), like Hugging Face's
    /// `_get_logits_processor`. When [`SamplingParams::is_greedy`] the warpers are left out
    /// entirely (Hugging Face only adds them when `do_sample`); the history processors still
    /// apply, and the sampler takes the argmax.
    ///
    /// # Errors
    /// Any [`SamplingParams::validate`] error.
    pub fn from_params(params: &SamplingParams, order: SamplerOrder) -> Result<Self> {
        params.validate()?;
        let mut list = LogitsProcessorList::new();
        if let Some(bias) = &params.logit_bias
            && !bias.is_empty()
        {
            list.push(LogitBias::new(bias.clone())?);
        }
        if let Some(r) = params.repetition_penalty
            && r != 1.0
        {
            list.push(RepetitionPenalty::new(r)?);
        }
        if let Some(f) = params.frequency_penalty
            && f != 0.0
        {
            list.push(FrequencyPenalty::new(f)?);
        }
        if let Some(p) = params.presence_penalty
            && p != 0.0
        {
            list.push(PresencePenalty::new(p)?);
        }
        if let Some(n) = params.no_repeat_ngram_size
            && n > 0
        {
            list.push(NoRepeatNGram::new(n)?);
        }
        if let Some(bw) = &params.bad_words_ids {
            list.push(BadWordsIds::new(bw.clone())?);
        }
        if let Some(m) = params.min_new_tokens
            && m > 0
        {
            list.push(MinNewTokens::new(
                m,
                params.stop_token_ids.clone().unwrap_or_default(),
            )?);
        }
        if params.is_greedy() {
            return Ok(list);
        }
        let temperature = match params.temperature {
            Some(t) if t != 1.0 => Some(Temperature::new(t)?),
            _ => None,
        };
        if order == SamplerOrder::HuggingFace
            && let Some(t) = temperature
        {
            list.push(t);
        }
        let top_k = match params.top_k {
            Some(k) if k > 0 => Some(TopK::new(usize::try_from(k).unwrap_or(usize::MAX))?),
            _ => None,
        };
        let top_p = match params.top_p {
            Some(p) if p < 1.0 => Some(TopP::new(p)?),
            _ => None,
        };
        let typical = match params.typical_p {
            Some(p) if p < 1.0 => Some(TypicalP::new(p)?),
            _ => None,
        };
        match order {
            SamplerOrder::HuggingFace => {
                if let Some(k) = top_k {
                    list.push(k);
                }
                if let Some(p) = top_p {
                    list.push(p);
                }
                if let Some(m) = params.min_p
                    && m > 0.0
                {
                    list.push(MinP::new(m)?);
                }
                if let Some(t) = typical {
                    list.push(t);
                }
            }
            SamplerOrder::LlamaCpp => {
                if let Some(k) = top_k {
                    list.push(k);
                }
                if let Some(t) = typical {
                    list.push(t);
                }
                if let Some(p) = top_p {
                    list.push(p);
                }
                if let Some(m) = params.min_p
                    && m > 0.0
                {
                    list.push(MinP::new(m)?);
                }
            }
        }
        if let Some(e) = params.epsilon_cutoff
            && e > 0.0
        {
            list.push(EpsilonCutoff::new(e)?);
        }
        if let Some(e) = params.eta_cutoff
            && e > 0.0
        {
            list.push(EtaCutoff::new(e)?);
        }
        if order == SamplerOrder::LlamaCpp
            && let Some(t) = temperature
        {
            list.push(t);
        }
        Ok(list)
    }
}
