//! AVX2 + FMA + F16C kernels (x86-64). Callers check the features at run time.

use std::arch::x86_64::*;

use super::{BLOCK, BlockType};

/// The f16 at `p` (unaligned) as f32, with the F16C conversion.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_at(p: *const u8) -> f32 {
    // SAFETY: the caller guarantees 2 readable bytes at `p`.
    let bits = unsafe { (p as *const u16).read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// Sum of the 8 lanes in a fixed order (halves, then pairs); shared by the AVX-512 kernels.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

/// The 32 weights of a block as four vectors of 8 integer-valued f32 (before the scale):
/// `q − 8` for Q4_0, `q` for Q4_1, `q` for Q8_0.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block_q(ty: BlockType, blk: *const u8) -> [__m256; 4] {
    // SAFETY (all loads): the caller guarantees a whole block at `blk`.
    unsafe {
        match ty {
            BlockType::Q8_0 => {
                let p = blk.add(2);
                [
                    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i))),
                    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(8) as *const __m128i))),
                    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(16) as *const __m128i))),
                    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(24) as *const __m128i))),
                ]
            }
            BlockType::Q4_K | BlockType::Q5_0 | BlockType::Q6_K => unreachable!("Q4_K / Q5_0 / Q6_K run the scalar or AVX-512 kernels"),
            BlockType::Q4_0 | BlockType::Q4_1 => {
                let off = if ty == BlockType::Q4_0 { 2 } else { 4 };
                let qv = _mm_loadu_si128(blk.add(off) as *const __m128i);
                let m4 = _mm_set1_epi8(0x0F);
                let mut lo = _mm_and_si128(qv, m4);
                let mut hi = _mm_and_si128(_mm_srli_epi16(qv, 4), m4);
                if ty == BlockType::Q4_0 {
                    let eight = _mm_set1_epi8(8);
                    lo = _mm_sub_epi8(lo, eight);
                    hi = _mm_sub_epi8(hi, eight);
                }
                // Values are in -8..=15, so sign extension is right for both types.
                [
                    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)),
                    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))),
                    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)),
                    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))),
                ]
            }
        }
    }
}

/// Dot products of one packed row with `T` consecutive activation rows, AVX2.
///
/// `x` points at `T` rows of `nb · 32` f32 spaced `stride` apart; `xsum` at their per-block sums
/// (`nb` per row, Q4_1 only). The operations for each token are the same whatever `T` is, so the
/// result for a token does not depend on how many tokens share the call (batch invariance).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `row` must hold `nb` blocks of type `TY`
/// (0 = Q4_0, 1 = Q4_1, 2 = Q8_0), and the `x` / `xsum` rows must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_t<const TY: u8, const T: usize>(
    row: *const u8,
    nb: usize,
    x: *const f32,
    stride: usize,
    xsum: *const f32,
) -> [f32; T] {
    let ty = match TY {
        0 => BlockType::Q4_0,
        1 => BlockType::Q4_1,
        _ => BlockType::Q8_0,
    };
    let bb = ty.block_bytes();
    let mut acc0 = [_mm256_setzero_ps(); T];
    let mut acc1 = [_mm256_setzero_ps(); T];
    let mut accm = [0.0f32; T];
    for b in 0..nb {
        // SAFETY: b < nb, so the block and each token's 32 values are in bounds.
        unsafe {
            let blk = row.add(b * bb);
            let q = block_q(ty, blk);
            let d = _mm256_set1_ps(f16_at(blk));
            let m = if TY == 1 { f16_at(blk.add(2)) } else { 0.0 };
            for k in 0..T {
                let xb = x.add(k * stride + b * BLOCK);
                let mut t = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb));
                let mut u = _mm256_mul_ps(q[1], _mm256_loadu_ps(xb.add(8)));
                t = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xb.add(16)), t);
                u = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xb.add(24)), u);
                acc0[k] = _mm256_fmadd_ps(t, d, acc0[k]);
                acc1[k] = _mm256_fmadd_ps(u, d, acc1[k]);
                if TY == 1 {
                    accm[k] += m * *xsum.add(k * nb + b);
                }
            }
        }
    }
    let mut out = [0.0f32; T];
    for k in 0..T {
        out[k] = hsum(_mm256_add_ps(acc0[k], acc1[k])) + accm[k];
    }
    out
}

/// Dot products of a packed row with `T` activation rows (see `dot_t`), for `T` in 1 and 4.
///
/// # Safety
/// As `dot_t`, with `nb = x.len()` / (32 · stride-rows) implied by the caller: `x` holds `T`
/// rows of `nb · 32` values at `stride`, `xsum` `T · nb` sums for Q4_1.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_multi<const T: usize>(
    ty: BlockType,
    row: &[u8],
    nb: usize,
    x: *const f32,
    stride: usize,
    xsum: *const f32,
) -> [f32; T] {
    debug_assert!(row.len() >= nb * ty.block_bytes());
    let rp = row.as_ptr();
    // SAFETY: forwarded from the caller.
    unsafe {
        match ty {
            BlockType::Q4_0 => dot_t::<0, T>(rp, nb, x, stride, xsum),
            BlockType::Q4_1 => dot_t::<1, T>(rp, nb, x, stride, xsum),
            BlockType::Q8_0 => dot_t::<2, T>(rp, nb, x, stride, xsum),
            BlockType::Q4_K | BlockType::Q5_0 | BlockType::Q6_K => unreachable!("Q4_K / Q5_0 / Q6_K run the scalar or AVX-512 kernels"),
        }
    }
}

/// Dequantizes one packed row into `out` (`out.len()` values), AVX2. Uses FMA for `d·q + m`
/// (Q4_1), so results may differ from ggml's scalar code in the last bit.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `row` must hold `out.len() / 32` blocks of `ty`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dequant_row(ty: BlockType, row: &[u8], out: &mut [f32]) {
    let nb = out.len() / BLOCK;
    let bb = ty.block_bytes();
    debug_assert!(row.len() >= nb * bb);
    let rp = row.as_ptr();
    let op = out.as_mut_ptr();
    for b in 0..nb {
        // SAFETY: b < nb, so the block and the 32 outputs are in bounds.
        unsafe {
            let blk = rp.add(b * bb);
            let ob = op.add(b * BLOCK);
            let q = block_q(ty, blk);
            let d = _mm256_set1_ps(f16_at(blk));
            let m = if ty == BlockType::Q4_1 { _mm256_set1_ps(f16_at(blk.add(2))) } else { _mm256_setzero_ps() };
            for (k, qk) in q.iter().enumerate() {
                _mm256_storeu_ps(ob.add(8 * k), _mm256_fmadd_ps(*qk, d, m));
            }
        }
    }
}
