//! Helpers shared by the kernel test binaries: the GGUF type of each packed block type,
//! ggml's reference quantizers (from deco-formats), and seeded test values.
#![allow(dead_code)] // each test binary uses a part

use deco_formats::ggml::{self, GgmlType};
use deco_kernels::quant::BlockType;

/// The GGUF / ggml type whose blocks a [`BlockType`] holds.
pub fn ggml_type(ty: BlockType) -> GgmlType {
    match ty {
        BlockType::Q4_0 => GgmlType::Q4_0,
        BlockType::Q4_1 => GgmlType::Q4_1,
        BlockType::Q8_0 => GgmlType::Q8_0,
        BlockType::Q4_K => GgmlType::Q4_K,
        BlockType::Q5_0 => GgmlType::Q5_0,
        BlockType::Q6_K => GgmlType::Q6_K,
    }
}

/// `w` quantized by ggml's reference quantizer of `ty`, or `None` for the types deco-formats
/// has no quantizer for (Q4_K, Q5_0, Q6_K).
pub fn ggml_quantize(ty: BlockType, w: &[f32]) -> Option<Vec<u8>> {
    let q = match ty {
        BlockType::Q4_0 => ggml::quantize_q4_0(w),
        BlockType::Q4_1 => ggml::quantize_q4_1(w),
        BlockType::Q8_0 => ggml::quantize_q8_0(w),
        BlockType::Q4_K | BlockType::Q5_0 | BlockType::Q6_K => return None,
    };
    Some(q.expect("ggml quantizer"))
}

/// `len` values uniform in (−1, 1) from an xorshift stream seeded by `seed`.
pub fn values(seed: u64, len: usize) -> Vec<f32> {
    let mut s = seed | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32
        })
        .collect()
}
