//! Llama-family decoder models on burn.
//!
//! [`Llama`] implements transformers' `LlamaForCausalLM` and `Qwen2ForCausalLM` (Q/K/V biases)
//! for weights from any [`deco_formats::checkpoint::Checkpoint`]: RMSNorm, rotate-half RoPE,
//! grouped-query attention, SwiGLU MLP, tied or separate LM head.
//!
//! The decoder layer exists once, in [`decoder`]: [`Llama`] runs it against a KV cache, the
//! quantizers' [`calibrate::Calibrator`] over calibration windows with observer hooks, and the
//! trainers of `deco-compress` on autodiff parameters with structural masks.
//!
//! The forward pass takes a *batch of sequences at different positions* ([`SeqInput`]): all
//! tokens of the batch go through the dense layers together as one `[tokens, hidden]` matrix, and
//! attention runs per sequence against that sequence's cached keys and values. The cache is the
//! [`KvCache`] trait; [`DenseKvCache`] is the contiguous implementation, and a paged cache for
//! continuous batching implements the same trait.

pub mod calibrate;
pub mod decoder;
pub mod early_exit;
pub mod error;
pub mod host;
pub mod kv_cache;
pub mod llama;

pub use error::{Error, Result};
pub use kv_cache::{DenseKvCache, DeviceKv, HostKv, KvCache, SeqId};
pub use decoder::TensorSource;
pub use llama::{ForwardOutput, Llama, LogitsWanted, SeqInput, WeightStorage};
