//! When to stop: stop strings over streamed text ([`StopStringMatcher`]) and stop tokens /
//! length ([`StoppingCriteria`]), with the resulting [`FinishReason`].

use serde::{Deserialize, Serialize};

use crate::error::{Result, invalid};
use crate::params::SamplingParams;

/// Why a sequence finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// A stop string or a `stop_token_ids` token was produced.
    Stop,
    /// `max_new_tokens` tokens were generated.
    Length,
    /// The model produced one of its EOS tokens.
    EosToken,
}

impl FinishReason {
    /// The OpenAI API `finish_reason`: `"stop"` for [`Stop`](Self::Stop) and
    /// [`EosToken`](Self::EosToken), `"length"` for [`Length`](Self::Length).
    pub fn as_openai_str(&self) -> &'static str {
        match self {
            FinishReason::Stop | FinishReason::EosToken => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// Token-level stopping rules of one sequence (Hugging Face `StoppingCriteria`:
/// `EosTokenCriteria`, `MaxNewTokensCriteria`; vLLM `stop_token_ids`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoppingCriteria {
    eos_token_ids: Vec<u32>,
    stop_token_ids: Vec<u32>,
    max_new_tokens: Option<usize>,
}

impl StoppingCriteria {
    /// Stop on any of `eos_token_ids` ([`FinishReason::EosToken`]), any of `stop_token_ids`
    /// ([`FinishReason::Stop`]), or after `max_new_tokens` tokens ([`FinishReason::Length`];
    /// `None` = no limit).
    ///
    /// # Errors
    /// `max_new_tokens == Some(0)`.
    pub fn new(
        eos_token_ids: Vec<u32>,
        stop_token_ids: Vec<u32>,
        max_new_tokens: Option<usize>,
    ) -> Result<Self> {
        if max_new_tokens == Some(0) {
            return Err(invalid("max_new_tokens", "must be >= 1", 0));
        }
        Ok(Self {
            eos_token_ids,
            stop_token_ids,
            max_new_tokens,
        })
    }

    /// From request parameters (`stop_token_ids`, `max_new_tokens`) and the model's EOS ids.
    ///
    /// # Errors
    /// `max_new_tokens == Some(0)`.
    pub fn from_params(params: &SamplingParams, eos_token_ids: &[u32]) -> Result<Self> {
        let eos = if params.ignore_eos == Some(true) { Vec::new() } else { eos_token_ids.to_vec() };
        Self::new(
            eos,
            params.stop_token_ids.clone().unwrap_or_default(),
            params.max_new_tokens,
        )
    }

    /// Checks the token just generated; `num_generated` counts it (1 after the first token).
    ///
    /// Precedence when several apply: EOS, then stop token, then length. Whether the stopping
    /// token is shown to the user is the caller's choice (Hugging Face keeps EOS in the ids,
    /// OpenAI servers do not print it).
    pub fn check(&self, token: u32, num_generated: usize) -> Option<FinishReason> {
        if self.eos_token_ids.contains(&token) {
            Some(FinishReason::EosToken)
        } else if self.stop_token_ids.contains(&token) {
            Some(FinishReason::Stop)
        } else if self.max_new_tokens.is_some_and(|m| num_generated >= m) {
            Some(FinishReason::Length)
        } else {
            None
        }
    }
}

/// What [`StopStringMatcher::push`] lets through.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StopStep {
    /// Text that is safe to stream now: it can never become part of a stop string.
    pub text: String,
    /// The stop string that matched, if generation must end now.
    pub stop: Option<String>,
}

/// Incremental stop-string matching over streamed, decoded text.
///
/// Text arrives in pieces (one per token, split anywhere, even inside a stop string). The
/// matcher emits only text that cannot be the start of a stop string, holds back the rest, and
/// reports a match as soon as the text contains a full stop string. So the streamed output
/// never contains a stop string nor a piece of one (unless `include_stop_str_in_output`).
///
/// Semantics (vLLM / OpenAI `stop`):
/// - The match that **ends first** in the text wins (the one a character-by-character reader
///   sees first); among matches ending at the same place, the one starting first (longest).
///   So the result does not depend on how the text was split into pieces.
/// - The output is the text before the match; with `include_stop_str_in_output` it also
///   contains the stop string. Anything after the match is dropped.
/// - At the end of generation without a match, call [`flush`](Self::flush) to release the
///   held-back text.
#[derive(Debug, Clone)]
pub struct StopStringMatcher {
    stops: Vec<String>,
    include_stop_str_in_output: bool,
    pending: String,
    stopped: bool,
}

impl StopStringMatcher {
    /// A matcher for `stop` (may be empty: then text passes straight through).
    ///
    /// # Errors
    /// An empty stop string (it would match everywhere).
    pub fn new(stop: Vec<String>, include_stop_str_in_output: bool) -> Result<Self> {
        if let Some(pos) = stop.iter().position(|s| s.is_empty()) {
            return Err(invalid(
                "stop",
                "must not contain an empty string",
                format!("\"\" at index {pos}"),
            ));
        }
        Ok(Self {
            stops: stop,
            include_stop_str_in_output,
            pending: String::new(),
            stopped: false,
        })
    }

    /// From request parameters (`stop`, `include_stop_str_in_output`).
    ///
    /// # Errors
    /// An empty stop string.
    pub fn from_params(params: &SamplingParams) -> Result<Self> {
        Self::new(
            params.stop.clone().unwrap_or_default(),
            params.include_stop_str_in_output.unwrap_or(false),
        )
    }

    /// Feeds the next piece of decoded text.
    ///
    /// Returns the text that may be streamed now and, when a stop string completed, which
    /// one. After a match every later call returns nothing.
    pub fn push(&mut self, delta: &str) -> StopStep {
        if self.stopped {
            return StopStep::default();
        }
        self.pending.push_str(delta);
        // Earliest-ending match, then earliest start.
        let mut best: Option<(usize, usize, usize)> = None; // (end, start, stop index)
        for (k, s) in self.stops.iter().enumerate() {
            if let Some(start) = self.pending.find(s.as_str()) {
                let cand = (start + s.len(), start, k);
                if best.is_none_or(|b| (cand.0, cand.1) < (b.0, b.1)) {
                    best = Some(cand);
                }
            }
        }
        if let Some((end, start, k)) = best {
            self.stopped = true;
            let cut = if self.include_stop_str_in_output {
                end
            } else {
                start
            };
            let text = self.pending[..cut].to_string();
            self.pending.clear();
            return StopStep {
                text,
                stop: Some(self.stops[k].clone()),
            };
        }
        // Hold back the longest suffix that is a proper prefix of some stop string.
        let hold_from = self
            .pending
            .char_indices()
            .map(|(j, _)| j)
            .find(|&j| {
                let suffix = &self.pending[j..];
                self.stops
                    .iter()
                    .any(|s| s.len() > suffix.len() && s.starts_with(suffix))
            })
            .unwrap_or(self.pending.len());
        let rest = self.pending.split_off(hold_from);
        let text = std::mem::replace(&mut self.pending, rest);
        StopStep { text, stop: None }
    }

    /// Ends the stream without a match: returns the held-back text (empty after a match).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }

    /// True once a stop string has matched.
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// Text currently held back because it may start a stop string.
    pub fn held_back(&self) -> &str {
        &self.pending
    }
}
