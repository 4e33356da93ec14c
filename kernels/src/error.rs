//! The error type of `deco-kernels`.

use crate::device::DeviceError;

/// Errors of the kernels: bad device names and malformed packed-weight inputs.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Device selection failed.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// A packed matrix whose row length is not a whole number of blocks.
    #[error("{ty:?} rows of {cols} values are not a multiple of the block size {block}")]
    RaggedRow {
        /// The block type.
        ty: crate::quant::BlockType,
        /// Row length given.
        cols: usize,
        /// Elements per block.
        block: usize,
    },
    /// A buffer of the wrong length for the shapes given.
    #[error("{what}: expected {expected} elements/bytes, got {actual}")]
    Length {
        /// Which argument.
        what: &'static str,
        /// Length implied by the shapes.
        expected: usize,
        /// Length given.
        actual: usize,
    },
    /// Matrices that cannot be combined (different block types or row lengths).
    #[error("incompatible matrices: {0}")]
    Incompatible(String),
    /// A kernel variant this CPU cannot run.
    #[error("{0}")]
    Unsupported(String),
}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
