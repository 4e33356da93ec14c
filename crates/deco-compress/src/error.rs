//! The error type of `deco-compress`.

use std::path::PathBuf;

/// Errors of pruning and sparse storage.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A parameter outside what the method supports (`sparsity`, `n:m`, `blocksize`, ...).
    #[error("invalid parameter `{name}`: {msg}")]
    InvalidParameter {
        /// The parameter (e.g. `sparsity`).
        name: &'static str,
        /// What is wrong with it.
        msg: String,
    },
    /// A matrix or vector whose length does not match its declared shape.
    #[error("shape mismatch: {0}")]
    Shape(String),
    /// Calibration data that cannot be used (no windows, too few tokens).
    #[error("calibration: {0}")]
    Calibration(String),
    /// A sparse checkpoint that cannot be read.
    #[error("{path}: invalid sparse checkpoint: {msg}")]
    SparseFormat {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// A LoRA adapter directory that cannot be read or written (`deco_compress::lora`).
    #[error("{path}: invalid LoRA adapter: {msg}")]
    Adapter {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// A file system operation failed.
    #[error("{path}: {source}")]
    Io {
        /// The path involved.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The Hessian machinery of `deco-quant` failed (e.g. not positive definite).
    #[error(transparent)]
    Quant(#[from] deco_quant::Error),
    /// The model failed.
    #[error(transparent)]
    Model(#[from] deco_model::Error),
    /// A checkpoint could not be read or written.
    #[error(transparent)]
    Format(#[from] deco_formats::Error),
}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

pub(crate) fn invalid(name: &'static str, msg: impl Into<String>) -> Error {
    Error::InvalidParameter { name, msg: msg.into() }
}

pub(crate) fn io_err(path: &std::path::Path) -> impl Fn(std::io::Error) -> Error + '_ {
    move |source| Error::Io { path: path.to_path_buf(), source }
}
