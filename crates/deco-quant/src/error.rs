//! The error type of `deco-quant`.

/// Errors of quantization.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A parameter outside what the method supports (`bits`, `group_size`, `alpha`, ...).
    #[error("invalid parameter `{name}`: {msg}")]
    InvalidParameter {
        /// The parameter (anchor name, e.g. `group_size`).
        name: &'static str,
        /// What is wrong with it.
        msg: String,
    },
    /// A matrix or vector whose length does not match its declared shape.
    #[error("shape mismatch: {0}")]
    Shape(String),
    /// The damped Hessian was not positive definite (GPTQ); raise `damp_percent`.
    #[error("Hessian is not positive definite at pivot {pivot} (raise damp_percent)")]
    NotPositiveDefinite {
        /// The failing diagonal index.
        pivot: usize,
    },
    /// Calibration data that cannot be used (empty text, too few tokens).
    #[error("calibration: {0}")]
    Calibration(String),
    /// The model failed.
    #[error(transparent)]
    Model(#[from] deco_model::Error),
    /// A checkpoint could not be read.
    #[error(transparent)]
    Format(#[from] deco_formats::Error),
}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

pub(crate) fn invalid(name: &'static str, msg: impl Into<String>) -> Error {
    Error::InvalidParameter { name, msg: msg.into() }
}
