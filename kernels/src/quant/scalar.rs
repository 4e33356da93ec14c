//! Portable kernels (any CPU; what ARM and x86-64 CPUs without AVX2 run): blocks dequantized
//! as ggml's `dequantize_row_*`, dot products in loops written for LLVM's vectorizer.

use super::{BLOCK, BlockType, f16_at, q4k_scale_min, q6k_scales};

/// The 32 weights of sub-block `k` (0..8) of the Q4_K block `blk` (ggml's
/// `dequantize_row_q4_K`: `d·sc · q − dmin·m`). The shift is fixed per sub-block and the loop
/// runs over whole slices, so that it vectorizes.
fn q4k_sub(blk: &[u8], k: usize, out: &mut [f32]) {
    let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
    let (sc, m) = q4k_scale_min(k, &blk[4..16]);
    let (d1, m1) = (d * sc as f32, dmin * m as f32);
    let qs: &[u8; 32] = blk[16 + 32 * (k / 2)..][..32].try_into().expect("32 bytes");
    let out: &mut [f32; 32] = out.try_into().expect("32 weights");
    let shift = 4 * (k % 2) as u32;
    for (o, q) in out.iter_mut().zip(qs) {
        *o = d1 * ((q >> shift) & 0xF) as f32 - m1;
    }
}

/// The 32 weights of sub-block `k` (0..8) of the Q6_K block `blk` (ggml's
/// `dequantize_row_q6_K`: `d·sc · (q − 32)`, the codes of [`super::q6k_code`]), over whole slices
/// with shifts fixed per sub-block, so that the loop vectorizes.
fn q6k_sub(blk: &[u8], k: usize, out: &mut [f32]) {
    let (s0, s1) = q6k_scales(blk, k);
    let (h, g) = (k / 4, k % 4);
    let ql: &[u8; 32] = blk[64 * h + 32 * (g % 2)..][..32].try_into().expect("32 bytes");
    let qh: &[u8; 32] = blk[super::Q6K_QH + 32 * h..][..32].try_into().expect("32 bytes");
    let (lo_shift, hi_shift) = (4 * (g / 2) as u32, 2 * g as u32);
    let out: &mut [f32; 32] = out.try_into().expect("32 weights");
    for (half, s) in [(0usize, s0), (16, s1)] {
        for l in half..half + 16 {
            let q = ((ql[l] >> lo_shift) & 0xF) | (((qh[l] >> hi_shift) & 3) << 4);
            out[l] = s * (f32::from(q) - 32.0);
        }
    }
}

/// The 32 weights of sub-block `k` of a 256-weight k-quant block.
fn k_sub(ty: BlockType, blk: &[u8], k: usize, out: &mut [f32]) {
    if ty == BlockType::Q6_K { q6k_sub(blk, k, out) } else { q4k_sub(blk, k, out) }
}

/// Lanes of [`dot_f32`]'s partial sums.
const LANES: usize = 16;

/// `Σ_i w[i] · x[i]` of a dequantized row `w` and one token's activations `x` (equal lengths,
/// a multiple of 32 in the packed matmul): [`LANES`] interleaved partial sums (lane `l` takes
/// `i ≡ l mod LANES`, in `i` order, fused multiply-adds on aarch64), added pairwise at the end.
/// Independent chains, so that LLVM vectorizes the loop for the target's vector unit (NEON,
/// SSE2), where a single running sum stays scalar. The order of operations depends on the
/// length only, not on the other tokens of the call.
pub(super) fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
    #[inline(always)]
    fn madd(a: f32, b: f32, c: f32) -> f32 {
        // `mul_add` is one instruction on aarch64; elsewhere without FMA it is a libm call.
        #[cfg(target_arch = "aarch64")]
        {
            a.mul_add(b, c)
        }
        #[cfg(not(target_arch = "aarch64"))]
        {
            a * b + c
        }
    }
    debug_assert_eq!(w.len(), x.len());
    let mut acc = [0.0f32; LANES];
    let (wc, wr) = w.as_chunks::<LANES>();
    let (xc, xr) = x.as_chunks::<LANES>();
    for (wv, xv) in wc.iter().zip(xc) {
        for l in 0..LANES {
            acc[l] = madd(wv[l], xv[l], acc[l]);
        }
    }
    for (l, (a, b)) in wr.iter().zip(xr).enumerate() {
        acc[l] = madd(*a, *b, acc[l]);
    }
    let mut h = LANES / 2;
    while h > 0 {
        for l in 0..h {
            acc[l] += acc[l + h];
        }
        h /= 2;
    }
    acc[0]
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

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::super::{Q6K_D, q6k_code};
    use super::*;

    /// The sliced sub-block decoding gives, for every byte pattern, the weights of the per-weight
    /// definitions (`q6k_code`, and ggml's `d·sc·q − dmin·m` for Q4_K) bit for bit.
    #[test]
    fn sub_blocks_match_the_per_weight_definitions() {
        let mut rng = ChaCha8Rng::seed_from_u64(0x9E37_79B9);
        for _ in 0..64 {
            let mut blk = [0u8; 210];
            rng.fill(&mut blk[..]);
            // Finite scales: d = 0.5 (f16 0x3800) for Q6_K; Q4_K's d and dmin likewise.
            blk[Q6K_D..Q6K_D + 2].copy_from_slice(&0x3800u16.to_le_bytes());
            let mut out = [0.0f32; 32];
            for k in 0..8 {
                q6k_sub(&blk, k, &mut out);
                let (s0, s1) = q6k_scales(&blk, k);
                for (l, o) in out.iter().enumerate() {
                    let want = if l < 16 { s0 } else { s1 } * (f32::from(q6k_code(&blk, k, l)) - 32.0);
                    assert_eq!(o.to_bits(), want.to_bits(), "Q6_K sub-block {k} weight {l}");
                }
            }
            let mut q4 = blk[..144].to_vec();
            q4[0..2].copy_from_slice(&0x3800u16.to_le_bytes());
            q4[2..4].copy_from_slice(&0x3400u16.to_le_bytes());
            for k in 0..8 {
                q4k_sub(&q4, k, &mut out);
                let (sc, m) = q4k_scale_min(k, &q4[4..16]);
                let (d1, m1) = (0.5 * sc as f32, 0.25 * m as f32);
                for (l, o) in out.iter().enumerate() {
                    let b = q4[16 + 32 * (k / 2) + l];
                    let q = if k.is_multiple_of(2) { b & 0xF } else { b >> 4 };
                    assert_eq!(o.to_bits(), (d1 * q as f32 - m1).to_bits(), "Q4_K sub-block {k} weight {l}");
                }
            }
        }
    }
}
