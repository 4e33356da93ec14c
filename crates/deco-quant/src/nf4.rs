//! NF4 (Dettmers et al. 2023, "QLoRA", §3 eq. 4 and "Double Quantization"), bitsandbytes
//! `quantize_4bit(quant_type="nf4", blocksize=64, compress_statistics=True)`.
//!
//! Weights are split into blocks of 64 consecutive values; each block stores 4-bit indices into
//! the NormalFloat codebook and its absmax. Double quantization stores the absmax constants as
//! 8-bit codes of bitsandbytes' signed dynamic map in blocks of 256, after subtracting their
//! mean, with one f32 absmax per 256 constants: `4 + 8/64 + 32/(64·256)` bits per weight.

use crate::{Error, Result};

/// The NF4 codebook (bitsandbytes `get_4bit_type("nf4")`).
pub const NF4_CODE: [f32; 16] = [
    -1.0,
    -0.696_192_8,
    -0.525_073_05,
    -0.394_917_5,
    -0.284_441_38,
    -0.184_773_43,
    -0.091_050_036,
    0.0,
    0.079_580_3,
    0.160_930_2,
    0.246_112_3,
    0.337_915_24,
    0.440_709_83,
    0.562_617,
    0.722_956_84,
    1.0,
];

/// bitsandbytes `create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8)`, sorted.
pub fn dynamic_map() -> Vec<f32> {
    let mut data: Vec<f64> = Vec::with_capacity(256);
    let max_exp: i32 = 7;
    for i in 0..max_exp {
        let items = (1usize << i) + 1;
        let bounds: Vec<f64> = (0..items).map(|k| 0.1 + 0.9 * k as f64 / (items - 1) as f64).collect();
        for k in 0..items - 1 {
            let mean = (bounds[k] + bounds[k + 1]) / 2.0;
            let v = 10f64.powi(-(max_exp - 1) + i) * mean;
            data.push(v);
            data.push(-v);
        }
    }
    data.push(0.0);
    data.push(1.0);
    data.sort_by(f64::total_cmp);
    data.iter().map(|&v| v as f32).collect()
}

fn nearest(code: &[f32], x: f32) -> u8 {
    // code is sorted: binary search, then the closer neighbour (ties to the lower index).
    let i = code.partition_point(|&c| c < x);
    if i == 0 {
        return 0;
    }
    if i == code.len() {
        return (code.len() - 1) as u8;
    }
    if (x - code[i - 1]) <= (code[i] - x) { (i - 1) as u8 } else { i as u8 }
}

/// An NF4 tensor with double-quantized absmax constants.
#[derive(Debug, Clone, PartialEq)]
pub struct Nf4Tensor {
    /// Number of values.
    pub len: usize,
    /// Values per block (64).
    pub blocksize: usize,
    /// One 4-bit codebook index per value (unpacked).
    pub codes: Vec<u8>,
    /// 8-bit dynamic-map codes of `absmax - offset`, one per block.
    pub absmax_codes: Vec<u8>,
    /// One f32 scale per 256 absmax constants.
    pub absmax_scales: Vec<f32>,
    /// Mean of the absmax constants.
    pub offset: f32,
}

/// Absmax constants per 256-block in double quantization.
pub const DQ_BLOCKSIZE: usize = 256;

impl Nf4Tensor {
    /// Quantizes `w` (any length; the last block may be short) with `blocksize` values per block.
    ///
    /// # Errors
    /// [`crate::Error::InvalidParameter`] for `blocksize == 0`.
    pub fn quantize(w: &[f32], blocksize: usize) -> Result<Self> {
        if blocksize == 0 {
            return Err(crate::invalid("group_size", "NF4 block size must be positive"));
        }
        let absmax: Vec<f32> = w.chunks(blocksize).map(|b| b.iter().fold(0.0f32, |m, v| m.max(v.abs()))).collect();
        let offset = (absmax.iter().map(|&v| v as f64).sum::<f64>() / absmax.len().max(1) as f64) as f32;
        let dmap = dynamic_map();
        let mut absmax_codes = Vec::with_capacity(absmax.len());
        let mut absmax_scales = Vec::new();
        for chunk in absmax.chunks(DQ_BLOCKSIZE) {
            let m = chunk.iter().fold(0.0f32, |m, &v| m.max((v - offset).abs()));
            let s = if m == 0.0 { 1.0 } else { m };
            absmax_scales.push(s);
            absmax_codes.extend(chunk.iter().map(|&v| nearest(&dmap, (v - offset) / s)));
        }
        let mut t = Self { len: w.len(), blocksize, codes: Vec::with_capacity(w.len()), absmax_codes, absmax_scales, offset };
        // Values are coded against the *dequantized* absmax so that the block's scale is the one
        // the reader uses (bitsandbytes codes against the exact absmax; the difference is below
        // the double-quantization error).
        let deq = t.absmax();
        for (b, block) in w.chunks(blocksize).enumerate() {
            let a = deq[b];
            t.codes.extend(block.iter().map(|&v| if a == 0.0 { 7 } else { nearest(&NF4_CODE, v / a) }));
        }
        Ok(t)
    }

    /// The dequantized absmax constants, one per block.
    pub fn absmax(&self) -> Vec<f32> {
        let dmap = dynamic_map();
        self.absmax_codes
            .iter()
            .enumerate()
            .map(|(i, &c)| dmap[c as usize] * self.absmax_scales[i / DQ_BLOCKSIZE] + self.offset)
            .collect()
    }

    /// Dequantizes to f32.
    pub fn dequantize(&self) -> Vec<f32> {
        let am = self.absmax();
        self.codes.iter().enumerate().map(|(i, &c)| NF4_CODE[c as usize] * am[i / self.blocksize]).collect()
    }

    /// Storage in bits per weight: 4-bit codes, 8-bit absmax codes, f32 absmax scales and offset.
    pub fn bits_per_weight(&self) -> f64 {
        (4 * self.len + 8 * self.absmax_codes.len() + 32 * (self.absmax_scales.len() + 1)) as f64 / self.len.max(1) as f64
    }
}

/// Checks a tensor length for NF4 (non-empty).
///
/// # Errors
/// [`Error::Shape`] for an empty tensor.
pub fn check_len(len: usize) -> Result<()> {
    if len == 0 { Err(Error::Shape("empty tensor".into())) } else { Ok(()) }
}
