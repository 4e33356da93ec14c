//! Compression of Llama-family models by pruning.
//!
//! - [`mask`]: sparsity patterns (unstructured fraction, N:M) and exact mask selection;
//! - [`unstructured`]: magnitude (per layer / per row) and Wanda (Sun et al. 2024) on one layer;
//! - [`sparsegpt`]: SparseGPT (Frantar & Alistarh 2023) on one layer, on `deco-quant`'s Hessian;
//! - [`pipeline`]: whole-model, layer-by-layer unstructured / N:M pruning;
//! - [`structured`]: attention heads (GQA-aware), MLP neurons and layers by importance, giving a
//!   smaller dense model with a valid config;
//! - [`sparse`]: bitmask + nonzero values storage;
//! - [`student`]: a trainable (burn `Module`) Llama-family model, loaded from and exported to
//!   transformers tensors;
//! - [`distill`]: knowledge distillation (forward KL, MiniLLM reverse KL, chain-of-thought) of a
//!   frozen teacher into a student, for post-pruning recovery;
//! - [`sparse_ft`]: sparse fine-tuning after pruning, fixed mask (masked gradients) or masks
//!   re-selected from a moving average of the Wanda score;
//! - [`sheared`]: Sheared-LLaMA targeted structured pruning (hard-concrete masks, Lagrangian);
//! - [`lora`]: LoRA / QLoRA adapters (NF4 base) on the student's decoder, PEFT's file layout;
//! - [`export`]: atomic writing of pruned models (dense HF directory or sparse form).
//!
//! Weights are `[out, in]` row-major f32 under transformers names throughout.

pub mod error;
pub mod distill;
pub mod export;
pub mod lora;
pub mod mask;
pub mod pipeline;
pub mod sparse;
pub mod sparse_ft;
pub mod sheared;
pub mod sparsegpt;
pub mod structured;
pub mod student;
pub mod unstructured;

pub use error::{Error, Result};
/// The progress-bar crate used by `deco prune` (feature `progress`).
#[cfg(feature = "progress")]
pub use indicatif;
pub(crate) use error::{invalid, io_err};
