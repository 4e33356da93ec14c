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

/// Defines `fn $name($args) -> $ret` running `$body($args)` compiled for the widest vectors this
/// CPU has ([`deco_kernels::quant::Isa::detect`]): an AVX-512 copy, an AVX2 + FMA copy and the
/// baseline, `$body` (`#[inline(always)]`) inlined into each. Rust never contracts `a * b + c`
/// into an FMA, so every copy runs the same IEEE operations in the same order: the same bits.
/// Used for the quantizers' hot loops (RTN, the MSE range search, GPTQ's row updates), which
/// the baseline x86-64 build would compile for SSE2.
macro_rules! wide_dispatch {
    ($name:ident($($arg:ident: $ty:ty),*) -> $ret:ty, $body:ident) => {
        fn $name($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            {
                use deco_kernels::quant::Isa;
                #[target_feature(enable = "avx512f,avx512vl,avx512dq,avx512bw,avx2,fma")]
                unsafe fn avx512($($arg: $ty),*) -> $ret {
                    $body($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) -> $ret {
                    $body($($arg),*)
                }
                match Isa::detect() {
                    // SAFETY: the CPU has the features (Isa::detect checks them).
                    Isa::Avx512 => return unsafe { avx512($($arg),*) },
                    // SAFETY: as above.
                    Isa::Avx2 => return unsafe { avx2($($arg),*) },
                    Isa::Scalar => {}
                }
            }
            $body($($arg),*)
        }
    };
}

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
