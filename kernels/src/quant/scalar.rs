//! Portable scalar kernels (reference order of operations; any CPU).

use super::{BLOCK, BlockType, f16_at, q4k_scale_min, q6k_code, q6k_scales};

/// The 32 weights of sub-block `k` (0..8) of the Q4_K block `blk` (ggml's
/// `dequantize_row_q4_K`: `d·sc · q − dmin·m`).
fn q4k_sub(blk: &[u8], k: usize, out: &mut [f32]) {
    let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
    let (sc, m) = q4k_scale_min(k, &blk[4..16]);
    let (d1, m1) = (d * sc as f32, dmin * m as f32);
    let qs = &blk[16 + 32 * (k / 2)..][..32];
    for (o, q) in out.iter_mut().zip(qs) {
        let q = if k.is_multiple_of(2) { q & 0xF } else { q >> 4 };
        *o = d1 * q as f32 - m1;
    }
}

/// The 32 weights of sub-block `k` (0..8) of the Q6_K block `blk` (ggml's
/// `dequantize_row_q6_K`: `d·sc · (q − 32)`).
fn q6k_sub(blk: &[u8], k: usize, out: &mut [f32]) {
    let (s0, s1) = q6k_scales(blk, k);
    for (l, o) in out.iter_mut().enumerate() {
        let q = f32::from(q6k_code(blk, k, l)) - 32.0;
        *o = if l < 16 { s0 } else { s1 } * q;
    }
}

/// The 32 weights of sub-block `k` of a 256-weight k-quant block.
fn k_sub(ty: BlockType, blk: &[u8], k: usize, out: &mut [f32]) {
    if ty == BlockType::Q6_K { q6k_sub(blk, k, out) } else { q4k_sub(blk, k, out) }
}

/// Dot product of one packed row with f32 activations `x` (`row` holds `x.len() / 32` blocks);
/// `xsum[b]` is `Σ x[32b .. 32b + 32]` (used by Q4_1 only).
pub(super) fn dot(ty: BlockType, row: &[u8], x: &[f32], xsum: &[f32]) -> f32 {
    let bb = ty.block_bytes();
    let mut acc = 0.0f32;
    if ty.block_len() == 256 {
        let mut w = [0.0f32; 32];
        for (blk, xb) in row.chunks_exact(bb).zip(x.chunks_exact(256)) {
            for (k, xs) in xb.chunks_exact(32).enumerate() {
                k_sub(ty, blk, k, &mut w);
                acc += w.iter().zip(xs).map(|(a, b)| a * b).sum::<f32>();
            }
        }
        return acc;
    }
    for (b, (blk, xb)) in row.chunks_exact(bb).zip(x.chunks_exact(BLOCK)).enumerate() {
        let d = f16_at(blk, 0);
        match ty {
            BlockType::Q8_0 => {
                let mut s = 0.0f32;
                for (q, xv) in blk[2..].iter().zip(xb) {
                    s += (*q as i8) as f32 * xv;
                }
                acc += d * s;
            }
            BlockType::Q4_0 => {
                let mut s = 0.0f32;
                for (j, q) in blk[2..18].iter().enumerate() {
                    s += ((q & 15) as i32 - 8) as f32 * xb[j] + ((q >> 4) as i32 - 8) as f32 * xb[j + 16];
                }
                acc += d * s;
            }
            BlockType::Q4_1 => {
                let m = f16_at(blk, 2);
                let mut s = 0.0f32;
                for (j, q) in blk[4..20].iter().enumerate() {
                    s += (q & 15) as f32 * xb[j] + (q >> 4) as f32 * xb[j + 16];
                }
                acc += d * s + m * xsum[b];
            }
            BlockType::Q5_0 => {
                let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
                let mut s = 0.0f32;
                for (j, q) in blk[6..22].iter().enumerate() {
                    let lo = ((q & 15) | ((((qh >> j) & 1) as u8) << 4)) as i32 - 16;
                    let hi = ((q >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4)) as i32 - 16;
                    s += lo as f32 * xb[j] + hi as f32 * xb[j + 16];
                }
                acc += d * s;
            }
            BlockType::Q4_K | BlockType::Q6_K => unreachable!("handled above"),
        }
    }
    acc
}

/// Dequantizes one packed row into `out` (`dequantize_row_*` of ggml-quants.c).
pub(super) fn dequant_row(ty: BlockType, row: &[u8], out: &mut [f32]) {
    let bb = ty.block_bytes();
    if ty.block_len() == 256 {
        for (blk, o) in row.chunks_exact(bb).zip(out.chunks_exact_mut(256)) {
            for (k, ok) in o.chunks_exact_mut(32).enumerate() {
                k_sub(ty, blk, k, ok);
            }
        }
        return;
    }
    for (blk, o) in row.chunks_exact(bb).zip(out.chunks_exact_mut(BLOCK)) {
        let d = f16_at(blk, 0);
        match ty {
            BlockType::Q8_0 => {
                for (q, ov) in blk[2..].iter().zip(o.iter_mut()) {
                    *ov = (*q as i8) as f32 * d;
                }
            }
            BlockType::Q4_0 => {
                for (j, q) in blk[2..18].iter().enumerate() {
                    o[j] = ((q & 15) as i32 - 8) as f32 * d;
                    o[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
                }
            }
            BlockType::Q4_1 => {
                let m = f16_at(blk, 2);
                for (j, q) in blk[4..20].iter().enumerate() {
                    o[j] = (q & 15) as f32 * d + m;
                    o[j + 16] = (q >> 4) as f32 * d + m;
                }
            }
            BlockType::Q5_0 => {
                let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
                for (j, q) in blk[6..22].iter().enumerate() {
                    let lo = ((q & 15) | ((((qh >> j) & 1) as u8) << 4)) as i32 - 16;
                    let hi = ((q >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4)) as i32 - 16;
                    o[j] = lo as f32 * d;
                    o[j + 16] = hi as f32 * d;
                }
            }
            BlockType::Q4_K | BlockType::Q6_K => unreachable!("handled above"),
        }
    }
}
