//! The error type of `deco-autodeco`.

/// Errors of AutoDeco heads, training and decoding.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A parameter outside its range (`lr`, `steps`, `batch_size`, `drop_prob`, ...).
    #[error("invalid parameter `{name}`: {msg}")]
    InvalidParameter {
        /// The parameter.
        name: &'static str,
        /// What is wrong with it.
        msg: String,
    },
    /// Input of the wrong shape (hidden size, vocabulary, row count).
    #[error("shape mismatch: {0}")]
    Shape(String),
    /// A heads directory that cannot be read (missing file, bad JSON, missing or misshapen tensor).
    #[error("{path}: {msg}")]
    Heads {
        /// The file.
        path: String,
        /// What is wrong.
        msg: String,
    },
    /// Training data that cannot be used (unreadable file, bad JSON line, no answer tokens).
    #[error("data: {0}")]
    Data(String),
    /// I/O.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// A tensor could not be read back from the device.
    #[error("tensor read failed: {0}")]
    TensorRead(String),
    /// The model failed.
    #[error(transparent)]
    Model(#[from] deco_model::Error),
    /// A checkpoint / tokenizer / template error.
    #[error(transparent)]
    Format(#[from] deco_formats::Error),
    /// A decoding error (invalid sampling parameters, ...).
    #[error(transparent)]
    Decoding(#[from] deco_decoding::DecodingError),
}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

pub(crate) fn invalid(name: &'static str, msg: impl Into<String>) -> Error {
    Error::InvalidParameter { name, msg: msg.into() }
}

pub(crate) fn io_err(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io { path: path.display().to_string(), source }
}
