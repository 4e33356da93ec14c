//! AutoDeco (Wang et al. 2025, "The End of Manual Decoding: Towards Truly End-to-End Language
//! Models", arXiv 2510.26697; reference implementation github.com/Zacks917/AutoDeco): small heads
//! on a frozen base model that predict, at every token, the temperature and top-p to sample it with.
//!
//! - [`heads`]: `TempHead` / `TopPHead` (burn modules for training, host copies for inference),
//!   save / load as safetensors + JSON.
//! - [`stats`]: the four statistics of `softmax(logits / T)` the top-p head sees.
//! - [`loss`]: temperature loss, differentiable soft top-p loss, easy-token masking.
//! - [`data`]: GSM-style chat data with the loss on answer tokens; the base model's hidden states.
//! - `train` (feature `train`, default): training on a frozen base with burn autodiff and Adam.
//! - [`medusa`]: Medusa-1 heads (Cai et al. 2024) on the frozen base: storage, inference
//!   (`DraftHeads` of `deco_generate::medusa`), training on self-distilled data.
//! - [`meta`]: the meta-instruction stage (ranking loss on instruction pairs) and its measurement.
//! - [`decode`]: decoding with the heads (per-token `T × temperature`, `clamp(P × top_p)`).
//! - [`eval`]: GSM answer extraction and the unbiased pass@k estimator.
//! - `plot` (feature `train`): SVG charts of loss curves and traces.
//!
//! Without the default feature `train` the crate has what inference needs (heads, statistics,
//! the per-token combination) and no autodiff, optimizer or plotting dependency: the serving
//! engine uses it that way.

pub mod data;
pub mod decode;
pub mod error;
pub mod eval;
pub mod heads;
pub mod loss;
pub mod medusa;
pub mod meta;
#[cfg(feature = "train")]
pub mod plot;
pub mod stats;
#[cfg(feature = "train")]
pub mod train;

pub use error::{Error, Result};
pub use heads::{AutoDecoConfig, AutoDecoHeads, HeadOutput, HostHeads};

/// Writes `bytes` to `path` through a temporary file in the same directory and a rename, so a
/// reader never sees a half-written file.
///
/// # Errors
/// [`Error::Io`].
pub fn write_atomic(path: &std::path::Path, bytes: &[u8]) -> Result<()> {
    deco_formats::atomic::write_file(path, bytes).map_err(error::io_err(path))
}
