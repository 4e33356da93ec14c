//! Matmul on packed GGUF blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K): `y[n, rows] = x[n, cols] · Wᵀ`.
//!
//! The packed bytes of `W` (ggml-common.h `block_q8_0`, `block_q4_0`, `block_q4_1`,
//! `block_q5_0`, `block_q4_K`, `block_q6_K`; rows of `cols / block_len` blocks) live on the
//! device as little-endian `u32` words, zero-padded to a whole word. The kernel reads bytes at
//! any offset (blocks of 18 / 20 / 22 / 34 / 210 bytes are not word aligned), decodes the f16
//! scales (and mins) with integer operations (no f16 support needed on the device),
//! dequantizes each weight in registers as ggml's `dequantize_row_*` and accumulates `w · x` in
//! f32.
//!
//! # Work split
//! A row is cut into chunks of 32 weights: a block of the 32-weight types, one eighth of a
//! 256-weight super-block of the k-quants (Q4_K: one (scale, min) sub-block; Q6_K: two
//! 16-weight sub-blocks). A cube of `32 × ROWS` units computes `ROWS` output rows for `TOKENS`
//! tokens. The 32 lanes of a row split its chunks (lane `l` takes chunks `l, l + 32, ...`) and
//! keep one f32 partial sum per token; the partials are reduced across lanes as a binary tree
//! in shared memory.

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
const Q5_0: u32 = 3;
const Q4_K: u32 = 4;
const Q6_K: u32 = 5;

fn type_code(ty: BlockType) -> u32 {
    match ty {
        BlockType::Q4_0 => Q4_0,
        BlockType::Q4_1 => Q4_1,
        BlockType::Q8_0 => Q8_0,
        BlockType::Q5_0 => Q5_0,
        BlockType::Q4_K => Q4_K,
        BlockType::Q6_K => Q6_K,
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

/// The byte at offset `off` of the word buffer `w` (never reads past its word).
#[cube]
fn byte_at(w: &[u32], off: usize) -> u32 {
    (w[off / 4] >> (((off % 4) * 8) as u32)) & 255
}

/// A signed byte as f32.
#[cube]
fn i8_to_f32(b: u32) -> f32 {
    let mut out = f32::cast_from(b);
    if b >= 128 {
        out = f32::cast_from(b) - 256.0f32;
    }
    out
}

/// ggml's `get_scale_min_k4(j, scales)` for the 12 packed 6-bit scales and mins of a Q4_K
/// super-block starting at byte `sc` of `w`: `(scale, min)` of sub-block `j` (0..8).
#[cube]
fn scale_min_k4(w: &[u32], sc: usize, j: usize) -> (u32, u32) {
    let lo = byte_at(w, sc + j) & 63;
    let lo_m = byte_at(w, sc + j + 4) & 63;
    // For j >= 4 (never read out of the 12 bytes for j < 4: sc + j + 4 - 4 = sc + j).
    let jj = if j < 4 { j + 4 } else { j };
    let hi = byte_at(w, sc + jj + 4);
    let hi_s = (hi & 15) | ((byte_at(w, sc + jj - 4) >> 6) << 4);
    let hi_m = (hi >> 4) | ((byte_at(w, sc + jj) >> 6) << 4);
    let s = if j < 4 { lo } else { hi_s };
    let m = if j < 4 { lo_m } else { hi_m };
    (s, m)
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
    // Units past the last row compute on the last row (their results are dropped) so that every
    // unit reaches the barriers.
    let r = if row < rows { row as usize } else { (rows - 1) as usize };
    // Bytes per block and chunks (32 weights) per block.
    let block_bytes = if ty == Q4_0 {
        18usize
    } else if ty == Q4_1 {
        20usize
    } else if ty == Q5_0 {
        22usize
    } else if ty == Q4_K {
        144usize
    } else if ty == Q6_K {
        210usize
    } else {
        34usize
    };
    let chunks_per_block = if ty == Q4_K || ty == Q6_K { 8usize } else { 1usize };
    let nchunks = c / 32;
    let row_off = r * (nchunks / chunks_per_block) * block_bytes;

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

    let mut g = lane;
    while g < nchunks {
        let off = row_off + (g / chunks_per_block) * block_bytes;
        let sub = g % chunks_per_block;
        let xb = g * 32;
        if ty == Q8_0 {
            let d = f16_to_f32(word_at(w, off) & 65535);
            #[unroll]
            for wi in 0..8usize {
                let word = word_at(w, off + 2 + wi * 4);
                #[unroll]
                for bi in 0..4usize {
                    let byte = (word >> (bi as u32 * 8)) & 255;
                    let wv = d * i8_to_f32(byte);
                    let j = xb + wi * 4 + bi;
                    #[unroll]
                    for k in 0..tokens {
                        acc[k] += wv * x[xrow[k] + j];
                    }
                }
            }
        } else if ty == Q4_K {
            // dequantize_row_q4_K: sub-block `sub` is nibble `sub % 2` of qs[(sub / 2) · 32 ..][..32].
            let head = word_at(w, off);
            let (sc, mn) = scale_min_k4(w, off + 4, sub);
            let d1 = f16_to_f32(head & 65535) * f32::cast_from(sc);
            let m1 = f16_to_f32(head >> 16) * f32::cast_from(mn);
            let shift = ((sub % 2) * 4) as u32;
            let qs = off + 16 + (sub / 2) * 32;
            #[unroll]
            for wi in 0..8usize {
                let word = word_at(w, qs + wi * 4);
                #[unroll]
                for bi in 0..4usize {
                    let q = (word >> (bi as u32 * 8 + shift)) & 15;
                    let wv = d1 * f32::cast_from(q) - m1;
                    let j = xb + wi * 4 + bi;
                    #[unroll]
                    for k in 0..tokens {
                        acc[k] += wv * x[xrow[k] + j];
                    }
                }
            }
        } else if ty == Q6_K {
            // dequantize_row_q6_K: chunk `sub` = 32 weights `c · 32 + l` of half `h`; low 4 bits
            // in ql[64h + (c % 2) · 32 + l] (nibble c / 2), high 2 bits in qh[32h + l] (bits
            // 2c..2c+2), int8 scale sc[8h + l / 16 + 2c].
            let h = sub / 4;
            let cc = sub % 4;
            let d = f16_to_f32(byte_at(w, off + 208) | (byte_at(w, off + 209) << 8));
            let ql = off + 64 * h + (cc % 2) * 32;
            let qh = off + 128 + 32 * h;
            let lo_shift = ((cc / 2) * 4) as u32;
            let hi_shift = (cc * 2) as u32;
            let s0 = d * i8_to_f32(byte_at(w, off + 192 + 8 * h + 2 * cc));
            let s1 = d * i8_to_f32(byte_at(w, off + 192 + 8 * h + 2 * cc + 1));
            #[unroll]
            for wi in 0..8usize {
                let lw = word_at(w, ql + wi * 4);
                let hw = word_at(w, qh + wi * 4);
                let scale = if wi < 4 { s0 } else { s1 };
                #[unroll]
                for bi in 0..4usize {
                    let lo = (lw >> (bi as u32 * 8 + lo_shift)) & 15;
                    let hi = (hw >> (bi as u32 * 8 + hi_shift)) & 3;
                    let wv = scale * (f32::cast_from(lo | (hi << 4)) - 32.0f32);
                    let j = xb + wi * 4 + bi;
                    #[unroll]
                    for k in 0..tokens {
                        acc[k] += wv * x[xrow[k] + j];
                    }
                }
            }
        } else {
            // Q4_0, Q4_1, Q5_0: byte j of qs holds weights j (low nibble) and j + 16 (high).
            let head = word_at(w, off);
            let d = f16_to_f32(head & 65535);
            let mut m = 0.0f32;
            let mut qs = off + 2;
            let mut qh = 0u32;
            if ty == Q4_1 {
                m = f16_to_f32(head >> 16);
                qs = off + 4;
            }
            if ty == Q5_0 {
                qh = word_at(w, off + 2);
                qs = off + 6;
            }
            #[unroll]
            for wi in 0..4usize {
                let word = word_at(w, qs + wi * 4);
                #[unroll]
                for bi in 0..4usize {
                    let byte = (word >> (bi as u32 * 8)) & 255;
                    let jj = (wi * 4 + bi) as u32;
                    let mut lo = d * f32::cast_from(byte & 15) + m;
                    let mut hi = d * f32::cast_from(byte >> 4) + m;
                    if ty == Q4_0 {
                        lo = d * (f32::cast_from(byte & 15) - 8.0f32);
                        hi = d * (f32::cast_from(byte >> 4) - 8.0f32);
                    }
                    if ty == Q5_0 {
                        // dequantize_row_q5_0: the fifth bits of weights j and j + 16 are bits
                        // j and j + 16 of qh.
                        let h0 = ((qh >> jj) << 4) & 16;
                        let h1 = (qh >> (jj + 12)) & 16;
                        lo = d * (f32::cast_from((byte & 15) | h0) - 16.0f32);
                        hi = d * (f32::cast_from((byte >> 4) | h1) - 16.0f32);
                    }
                    let j = xb + wi * 4 + bi;
                    #[unroll]
                    for k in 0..tokens {
                        acc[k] += lo * x[xrow[k] + j] + hi * x[xrow[k] + j + 16];
                    }
                }
            }
        }
        g += 32;
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
