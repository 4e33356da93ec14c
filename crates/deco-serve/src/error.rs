//! The error type of `deco-serve`.

/// Errors of the block pool, the paged cache, the engine and the server.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The block pool has no free block left (the scheduler preempts on this).
    #[error("KV cache out of blocks: {needed} needed, {free} free")]
    OutOfBlocks {
        /// Blocks requested.
        needed: usize,
        /// Blocks free (including evictable cached blocks).
        free: usize,
    },
    /// A sequence id the cache or engine does not know.
    #[error("unknown sequence {0}")]
    UnknownSequence(u64),
    /// A request that cannot be served as given (maps to HTTP 400).
    #[error("{0}")]
    InvalidRequest(String),
    /// Too many requests in flight (maps to HTTP 429).
    #[error("the server is overloaded: {0} requests are already pending; retry later")]
    Overloaded(usize),
    /// The engine thread has stopped.
    #[error("the engine has shut down")]
    EngineStopped,
    /// The model failed.
    #[error(transparent)]
    Model(#[from] deco_model::Error),
    /// Tokenizer or chat template failure.
    #[error(transparent)]
    Format(#[from] deco_formats::Error),
    /// A sampling parameter or sampling failure.
    #[error(transparent)]
    Decoding(#[from] deco_decoding::DecodingError),
    /// Socket errors of the HTTP server.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// A structured-output constraint failed during generation (its grammar allows no token,
    /// or rejected the sampled one).
    #[error("structured output: {0}")]
    Structured(String),
    /// AutoDeco heads failed (shape mismatch with the model).
    #[error(transparent)]
    AutoDeco(#[from] deco_autodeco::Error),
}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
