//! Post-training quantization of Llama-family weights (and activations).
//!
//! - [`scheme`]: uniform integer schemes (bits 2/3/4/8, symmetric or with zero point,
//!   per-tensor / per-channel / per-group), round-to-nearest (RTN) and fake quantization;
//! - [`gptq`]: GPTQ (Frantar et al. 2023) with lazy batch updates, `desc_act`, `static_groups`;
//! - [`awq`]: AWQ scale and clip searches (Lin et al. 2024);
//! - [`smooth`]: SmoothQuant scales (Xiao et al. 2023), per-token activation quantization and
//!   LLM.int8() outlier decomposition (Dettmers et al. 2022);
//! - [`nf4`]: NormalFloat-4 with double quantization (Dettmers et al. 2023);
//! - [`linalg`]: the Cholesky factorizations GPTQ needs;
//! - [`pipeline`]: whole-model, layer-by-layer quantization (RTN, GPTQ, NF4);
//! - [`export`]: integer forms of a whole model and their export (GPTQ, AWQ GEMM,
//!   compressed-tensors, GGUF Q8_0/Q4_0/Q4_1, fake-quantized f32).

pub mod awq;
pub mod error;
pub mod export;
pub mod gptq;
pub mod linalg;
pub mod nf4;
pub mod pipeline;
pub mod scheme;
pub mod smooth;

pub use error::{Error, Result};
pub(crate) use error::invalid;
