//! The error type of `deco-generate`.

/// Errors of the decoding strategies.
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    /// The model failed (context overflow, token out of range, device read...).
    #[error(transparent)]
    Model(#[from] deco_model::Error),
    /// Logits processing or sampling failed (invalid sampling parameter, all tokens filtered...).
    #[error(transparent)]
    Decoding(#[from] deco_decoding::DecodingError),
    /// A strategy parameter is outside its valid range.
    #[error("{name} {requirement}, got {value}")]
    InvalidParameter {
        /// Parameter name (Hugging Face spelling, e.g. `num_beams`).
        name: &'static str,
        /// The rule it breaks (e.g. `must be >= 1`).
        requirement: &'static str,
        /// The value given.
        value: String,
    },
    /// A request the strategy cannot run (empty prompt, prompt longer than the context, ...).
    #[error("{0}")]
    InvalidInput(String),
}

/// `Result` with [`GenerateError`].
pub type Result<T> = std::result::Result<T, GenerateError>;

/// Builds a [`GenerateError::InvalidParameter`].
pub(crate) fn invalid(name: &'static str, requirement: &'static str, value: impl std::fmt::Display) -> GenerateError {
    GenerateError::InvalidParameter { name, requirement, value: value.to_string() }
}
