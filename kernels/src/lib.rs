//! Tensor operations and kernels of deco.
//!
//! Model code calls the functions of [`ops`] on burn tensors; each is written once as a
//! composition of burn operations, which runs on every burn device (flex on CPU, wgpu, CUDA).
//! Fused CubeCL and CPU-SIMD implementations will replace individual functions behind the same
//! signatures, checked against these compositions as the reference.
//!
//! [`quant`] holds CPU matmul kernels on packed GGUF blocks (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K), used by the
//! model for quantized checkpoints without an f32 copy of the weights.
//!
//! [`attention`] holds the fused CPU decode-attention kernel over a paged or contiguous KV
//! cache in host memory (one call per layer for a whole decode batch).
//!
//! `cube` (features `wgpu` / `cuda` only) holds the CubeCL GPU kernels (fused RMSNorm, RoPE,
//! quantized matmul on packed GGUF blocks, tiled causal attention), exposed as a burn backend
//! extension with the compositions above as the Flex reference path.
//!
//! [`device`] turns a user-facing name (`flex`, `wgpu`, `cuda`) into a burn [`burn::tensor::Device`].

pub mod act;
pub mod attention;
pub mod bf16;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub mod cube;
pub mod dense;
pub mod device;
pub mod error;
pub mod int16;
pub mod ops;
pub mod quant;
#[cfg(target_arch = "x86_64")]
mod simd;
pub mod team;
pub mod window_attention;

pub use device::{DeviceError, select_device};
pub use error::{Error, Result};
