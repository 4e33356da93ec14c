//! Portable scalar kernels (reference order of operations; any CPU).

use super::{BLOCK, BlockType, f16_at};

/// Dot product of one packed row with f32 activations `x` (`row` holds `x.len() / 32` blocks);
/// `xsum[b]` is `Σ x[32b .. 32b + 32]` (used by Q4_1 only).
pub(super) fn dot(ty: BlockType, row: &[u8], x: &[f32], xsum: &[f32]) -> f32 {
    let bb = ty.block_bytes();
    let mut acc = 0.0f32;
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
        }
    }
    acc
}

/// Dequantizes one packed row into `out` (`dequantize_row_*` of ggml-quants.c).
pub(super) fn dequant_row(ty: BlockType, row: &[u8], out: &mut [f32]) {
    let bb = ty.block_bytes();
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
        }
    }
}
