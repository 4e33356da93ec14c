//! The error type of `deco-decoding`.

use std::path::PathBuf;

/// Everything that can go wrong while validating parameters, processing logits or sampling.
///
/// Every parameter error names the parameter, the rule it breaks and the value that was
/// given, e.g. `top_p must be in [0, 1], got 1.5`.
#[derive(Debug, thiserror::Error)]
pub enum DecodingError {
    /// A parameter is outside its valid range.
    #[error("{name} {requirement}, got {value}")]
    InvalidParameter {
        /// The parameter's name (Hugging Face / OpenAI spelling, e.g. `top_p`).
        name: &'static str,
        /// The rule it breaks, phrased to follow the name (e.g. `must be in [0, 1]`).
        requirement: &'static str,
        /// The offending value, formatted.
        value: String,
    },
    /// The logits row has no entries.
    #[error("logits row is empty (vocabulary size 0)")]
    EmptyLogits,
    /// A token id (in the context, a bias map, a ban list...) does not index the logits row.
    #[error("token id {token} in {what} is out of range for a logits row of size {vocab_size}")]
    TokenOutOfRange {
        /// Where the id came from (e.g. `prompt_ids`, `logit_bias`).
        what: &'static str,
        /// The id.
        token: u32,
        /// Length of the logits row.
        vocab_size: usize,
    },
    /// The model produced a NaN or `+inf` logit; the row cannot be turned into a distribution.
    #[error("logit of token {index} is {value}; logits must be finite or -inf")]
    NonFiniteLogit {
        /// Token id of the bad entry.
        index: usize,
        /// The bad value.
        value: f32,
    },
    /// Every token of the row is `-inf` after processing, so no token can be chosen.
    #[error("every token was filtered out (all processed logits are -inf)")]
    NoValidToken,
    /// A generation config file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A generation config (or request body) is not valid JSON for its schema.
    #[error("invalid generation config JSON: {0}")]
    Json(#[from] serde_json::Error),
}

/// Result type of this crate.
pub type Result<T> = std::result::Result<T, DecodingError>;

/// Builds a [`DecodingError::InvalidParameter`].
pub(crate) fn invalid(
    name: &'static str,
    requirement: &'static str,
    value: impl std::fmt::Display,
) -> DecodingError {
    DecodingError::InvalidParameter {
        name,
        requirement,
        value: value.to_string(),
    }
}
