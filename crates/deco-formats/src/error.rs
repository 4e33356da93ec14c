//! The error type of `deco-formats`.

use std::path::PathBuf;

/// Everything that can go wrong while reading or writing model files.
///
/// Every variant that concerns a file carries its path, so that a user sees which file is bad.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An I/O error on a file.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The file does not start with the GGUF magic.
    #[error("{path}: not a GGUF file (magic {found:?}, expected \"GGUF\")")]
    NotGguf {
        /// The file.
        path: PathBuf,
        /// The first bytes found.
        found: String,
    },
    /// A GGUF version this reader does not support.
    #[error("{path}: unsupported GGUF version {version} (supported: 2, 3)")]
    UnsupportedGgufVersion {
        /// The file.
        path: PathBuf,
        /// The version found.
        version: u32,
    },
    /// The file ended before a structure it declares.
    #[error("{path}: truncated file: {what} needs bytes up to offset {needed}, file has {len}")]
    Truncated {
        /// The file.
        path: PathBuf,
        /// What was being read.
        what: String,
        /// Offset one past the last byte needed.
        needed: u64,
        /// File length in bytes.
        len: u64,
    },
    /// A structurally invalid file (bad value type, impossible count, misaligned offset...).
    #[error("{path}: invalid {format}: {msg}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// The format ("GGUF", "safetensors", "config.json", ...).
        format: &'static str,
        /// What is wrong.
        msg: String,
    },
    /// A required metadata key is missing or has the wrong type.
    #[error("{path}: metadata key `{key}`: {msg}")]
    Metadata {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
        /// What is wrong.
        msg: String,
    },
    /// A tensor the model needs is not in the checkpoint.
    #[error("{path}: tensor `{name}` not found")]
    TensorNotFound {
        /// The file or directory.
        path: PathBuf,
        /// The tensor name.
        name: String,
    },
    /// A tensor has a shape other than the one expected.
    #[error("{path}: tensor `{name}` has shape {found:?}, expected {expected:?}")]
    ShapeMismatch {
        /// The file or directory.
        path: PathBuf,
        /// The tensor name.
        name: String,
        /// Shape found.
        found: Vec<usize>,
        /// Shape expected.
        expected: Vec<usize>,
    },
    /// An architecture deco does not implement.
    #[error("{path}: unknown or unsupported architecture `{arch}` (supported: llama, qwen2)")]
    UnsupportedArchitecture {
        /// The file or directory.
        path: PathBuf,
        /// The architecture name found.
        arch: String,
    },
    /// A GGML tensor type or block problem.
    #[error("{path}: tensor `{name}`: {source}")]
    Ggml {
        /// The file.
        path: PathBuf,
        /// The tensor name.
        name: String,
        /// The underlying error.
        #[source]
        source: crate::ggml::GgmlError,
    },
    /// A tokenizer could not be built or used.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A chat template failed to parse or render.
    #[error("chat template: {0}")]
    ChatTemplate(String),
}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// Wraps an I/O error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io { path: path.into(), source }
    }
}
