//! Matmul on packed GGUF blocks (Q8_0, Q4_0, Q4_1): `y[n, rows] = x[n, cols] · Wᵀ`.
//!
//! The packed bytes of `W` (ggml-common.h `block_q8_0`, `block_q4_0`, `block_q4_1`, rows of
//! `cols / 32` blocks) live on the device as little-endian `u32` words, zero-padded to a whole
//! word. The kernel reads bytes at any offset (blocks of 18 / 20 / 34 bytes are not word
//! aligned), decodes the f16 scale (and min) with integer operations (no f16 support needed
//! on the device), dequantizes each weight in registers and accumulates `w · x` in f32.
//!
//! # Work split
//! A cube of `32 × ROWS` units computes `ROWS` output rows for `TOKENS` tokens. The 32 lanes of
//! a row split its blocks (lane `l` takes blocks `l, l + 32, ...`) and keep one f32 partial sum
//! per token; the partials are reduced across lanes as a binary tree in shared memory.

use burn::tensor::DType;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn::backend::Shape;
use cubecl::prelude::*;

use crate::quant::BlockType;

/// Lanes per output row (the split of the blocks of a row).
const LANES: u32 = 32;
/// Output rows per cube.
pub(crate) const ROWS: u32 = 4;
/// Tokens per cube (partial sums per lane kept in registers).
pub(crate) const TOKENS: u32 = 4;

/// Shared partial sums per cube: `ROWS · TOKENS · LANES`.
const SHARED_LEN: usize = (ROWS * TOKENS * LANES) as usize;

/// Block type codes of the comptime parameter `ty`.
const Q4_0: u32 = 0;
const Q4_1: u32 = 1;
const Q8_0: u32 = 2;

fn type_code(ty: BlockType) -> u32 {
    match ty {
        BlockType::Q4_0 => Q4_0,
        BlockType::Q4_1 => Q4_1,
        BlockType::Q8_0 => Q8_0,
        // Refused by `CubePackedMatrix::matmul` before any launch.
        BlockType::Q4_K | BlockType::Q5_0 | BlockType::Q6_K => u32::MAX,
    }
}

/// The 4 bytes at byte offset `off` of the word buffer `w`, little-endian (the buffer holds at
/// least `off + 4` bytes).
#[cube]
fn word_at(w: &[u32], off: usize) -> u32 {
    let i = off / 4;
    let s = ((off % 4) * 8) as u32;
    let lo = w[i];
    let mut out = lo;
    if s != 0 {
        out = (lo >> s) | (w[i + 1] << (32 - s));
    }
    out
}

/// IEEE binary16 bits (low 16 bits of `h`) to f32, exactly (normals, subnormals, ±0, ±inf, NaN).
#[cube]
fn f16_to_f32(h: u32) -> f32 {
    let sign = (h >> 15) & 1;
    let exp = (h >> 10) & 31;
    let mant = h & 1023;
    // Normal: rebias the exponent (15 → 127) and widen the mantissa.
    let mut out = f32::reinterpret((sign << 31) | ((exp + 112) << 23) | (mant << 13));
    if exp == 0 {
        // Zero or subnormal: mant · 2⁻²⁴, exact in f32.
        out = f32::cast_from(mant) * 5.960_464_5e-8f32;
        if sign == 1 {
            out = -out;
        }
    } else if exp == 31 {
        out = f32::reinterpret((sign << 31) | 2_139_095_040u32 | (mant << 13));
    }
    out
}

#[cube(launch)]
fn quant_matmul_kernel(
    x: &[f32],
    w: &[u32],
    y: &mut [f32],
    n: u32,
    rows: u32,
    cols: u32,
    #[comptime] ty: u32,
    #[comptime] tokens: usize,
) {
    let lane = UNIT_POS_X as usize;
    let local_row = UNIT_POS_Y as usize;
    let row = CUBE_POS_X * CUBE_DIM_Y + UNIT_POS_Y;
    let t0 = (CUBE_POS_Y as usize) * tokens;
    let nn = n as usize;
    let c = cols as usize;
    let nb = c / 32;
    // Units past the last row compute on the last row (their results are dropped) so that every
    // unit reaches the barriers.
    let r = if row < rows { row as usize } else { (rows - 1) as usize };
    let block_bytes = if ty == Q4_0 {
        18usize
    } else if ty == Q4_1 {
        20usize
    } else {
        34usize
    };
    let row_off = r * nb * block_bytes;

    let mut acc = Array::<f32>::new(tokens);
    #[unroll]
    for k in 0..tokens {
        acc[k] = 0.0f32;
    }
    // Token rows read by this cube; tokens past `n` read the last token (results dropped).
    let mut xrow = Array::<usize>::new(tokens);
    #[unroll]
    for k in 0..tokens {
        let t = t0 + k;
        xrow[k] = if t < nn { t * c } else { (nn - 1) * c };
    }

    let mut b = lane;
    while b < nb {
        let off = row_off + b * block_bytes;
        let head = word_at(w, off);
        let d = f16_to_f32(head & 65535);
        let xb = b * 32;
        if ty == Q8_0 {
            #[unroll]
            for wi in 0..8usize {
                let word = word_at(w, off + 2 + wi * 4);
                #[unroll]
                for bi in 0..4usize {
                    let byte = (word >> (bi as u32 * 8)) & 255;
                    let q = if byte >= 128 { f32::cast_from(byte) - 256.0f32 } else { f32::cast_from(byte) };
                    let wv = d * q;
                    let j = xb + wi * 4 + bi;
                    #[unroll]
                    for k in 0..tokens {
                        acc[k] = acc[k] + wv * x[xrow[k] + j];
                    }
                }
            }
        } else {
            let mut m = 0.0f32;
            let mut qs = off + 2;
            if ty == Q4_1 {
                m = f16_to_f32(head >> 16);
                qs = off + 4;
            }
            #[unroll]
            for wi in 0..4usize {
                let word = word_at(w, qs + wi * 4);
                #[unroll]
                for bi in 0..4usize {
                    let byte = (word >> (bi as u32 * 8)) & 255;
                    let mut lo = d * f32::cast_from(byte & 15);
                    let mut hi = d * f32::cast_from(byte >> 4);
                    if ty == Q4_0 {
                        lo = d * (f32::cast_from(byte & 15) - 8.0f32);
                        hi = d * (f32::cast_from(byte >> 4) - 8.0f32);
                    } else {
                        lo += m;
                        hi += m;
                    }
                    let j = xb + wi * 4 + bi;
                    #[unroll]
                    for k in 0..tokens {
                        acc[k] = acc[k] + lo * x[xrow[k] + j] + hi * x[xrow[k] + j + 16];
                    }
                }
            }
        }
        b += 32;
    }

    // Tree reduction of the 32 lane partials of each (row, token).
    let mut partial = Shared::<[f32]>::new_slice(SHARED_LEN);
    #[unroll]
    for k in 0..tokens {
        partial[(local_row * tokens + k) * 32 + lane] = acc[k];
    }
    sync_cube();
    let mut stride = CUBE_DIM_X as usize / 2;
    while stride > 0 {
        if lane < stride {
            #[unroll]
            for k in 0..tokens {
                let at = (local_row * tokens + k) * 32 + lane;
                let sum = partial[at] + partial[at + stride];
                partial[at] = sum;
            }
        }
        sync_cube();
        stride /= 2;
    }
    if lane < tokens && row < rows && t0 + lane < nn {
        y[(t0 + lane) * rows as usize + row as usize] = partial[(local_row * tokens + lane) * 32];
    }
}

/// Launches [`quant_matmul_kernel`]: `x: [n, cols]` f32, `w`: the packed words of a
/// `[rows, cols]` matrix of type `ty` (all checked by the caller). Returns `[n, rows]`.
pub(crate) fn launch(x: CubeTensor, w: CubeTensor, ty: BlockType, rows: usize, cols: usize) -> CubeTensor {
    let x = into_contiguous(x);
    let w = into_contiguous(w);
    let n = x.meta.shape()[0];
    let out = empty_device_dtype(x.client.clone(), x.device.clone(), Shape::new([n, rows]), DType::F32);
    if n == 0 || rows == 0 {
        return out;
    }
    if cols == 0 {
        // An empty sum: zeros (the kernel needs at least one block per row).
        return burn_cubecl::ops::numeric::full_client::<f32>(x.client.clone(), Shape::new([n, rows]), x.device.clone(), 0.0);
    }
    let cubes = CubeCount::Static(rows.div_ceil(ROWS as usize) as u32, n.div_ceil(TOKENS as usize) as u32, 1);
    quant_matmul_kernel::launch(
        &x.client,
        cubes,
        CubeDim::new_2d(LANES, ROWS),
        x.clone().into_buffer_arg(),
        w.into_buffer_arg(),
        out.clone().into_buffer_arg(),
        n as u32,
        rows as u32,
        cols as u32,
        type_code(ty),
        TOKENS as usize,
    );
    out
}
