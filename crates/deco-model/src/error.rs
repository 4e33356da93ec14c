//! The error type of `deco-model`.

/// Errors of model loading and inference.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A checkpoint could not be read.
    #[error(transparent)]
    Format(#[from] deco_formats::Error),
    /// A sequence would grow past the model's context window.
    #[error("sequence {seq} would reach {needed} tokens, beyond the context length {max} of the model")]
    ContextOverflow {
        /// The sequence.
        seq: u64,
        /// Tokens it would hold.
        needed: usize,
        /// The context length (`max_position_embeddings`).
        max: usize,
    },
    /// A token id outside the vocabulary.
    #[error("token id {id} is outside the vocabulary (size {vocab})")]
    TokenOutOfRange {
        /// The id.
        id: u32,
        /// Vocabulary size.
        vocab: usize,
    },
    /// A request the model cannot serve (empty input, unknown sequence...).
    #[error("{0}")]
    InvalidInput(String),
    /// Reading a tensor back from the device failed.
    #[error("reading tensor data: {0}")]
    TensorRead(String),
}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
