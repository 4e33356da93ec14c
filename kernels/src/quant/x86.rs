//! AVX2 + FMA + F16C kernels (x86-64). Callers check the features at run time.

use std::arch::x86_64::*;

use super::{BLOCK, BlockType, Q6K_D, Q6K_QH, Q6K_SCALES, q4k_scale_min};
use crate::simd::hsum;

/// The f16 at `p` (unaligned) as f32, with the F16C conversion.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_at(p: *const u8) -> f32 {
    // SAFETY: the caller guarantees 2 readable bytes at `p`.
    let bits = unsafe { (p as *const u16).read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
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
            BlockType::Q4_K | BlockType::Q5_0 | BlockType::Q6_K => unreachable!("Q4_K / Q5_0 / Q6_K go through `sub_q`"),
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

/// 32 code bytes as four vectors of 8 f32 (bytes 0..8, 8..16, 16..24, 24..32), signed or not.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn bytes_to_f32<const SIGNED: bool>(v: __m256i) -> [__m256; 4] {
    let lo = _mm256_castsi256_si128(v);
    let hi = _mm256_extracti128_si256(v, 1);
    let cvt = |x: __m128i| -> __m256 {
        if SIGNED { _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x)) } else { _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(x)) }
    };
    [cvt(lo), cvt(_mm_srli_si128(lo, 8)), cvt(hi), cvt(_mm_srli_si128(hi, 8))]
}

/// The 32 bits at `p` as 32 bytes, `0xFF` where the bit is set (byte `j` for bit `j`); ggml's
/// `bytes_from_bits_32`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bytes_from_bits_32(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 4 readable bytes at `p`.
    let x32 = unsafe { (p as *const u32).read_unaligned() };
    let shuf = _mm256_set_epi64x(0x0303_0303_0303_0303, 0x0202_0202_0202_0202, 0x0101_0101_0101_0101, 0);
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x32 as i32), shuf);
    let bit = _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe);
    _mm256_cmpeq_epi8(_mm256_or_si256(bytes, bit), _mm256_set1_epi64x(-1))
}

/// Sub-block `b` (32 weights) of a row of Q4_K, Q5_0 or Q6_K: the codes as four vectors of 8
/// integer-valued f32 (weights 0..8, 8..16, 16..24, 24..32), the scale of weights 0..16 and of
/// weights 16..32, and the minimum, so that weight `l` is `scale · q_l − min` (ggml's
/// `dequantize_row_q4_K` / `_q5_0` / `_q6_K`: `min` is `dmin·m` for Q4_K and 0 otherwise; Q5_0 and
/// Q6_K codes are already centred, `q − 16` and `q − 32`).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `row` must hold sub-block `b` (for the k-quants the
/// whole 256-weight block `b / 8`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn sub_q(ty: BlockType, row: *const u8, b: usize) -> ([__m256; 4], f32, f32, f32) {
    let m4 = _mm256_set1_epi8(0x0F);
    // SAFETY (all loads): the caller guarantees the (super-)block holding sub-block `b`.
    unsafe {
        match ty {
            BlockType::Q4_K => {
                let blk = row.add((b / 8) * 144);
                let k = b % 8;
                let (d, dmin) = (f16_at(blk), f16_at(blk.add(2)));
                let (sc, m) = q4k_scale_min(k, std::slice::from_raw_parts(blk.add(4), 12));
                let mut v = _mm256_loadu_si256(blk.add(16 + 32 * (k / 2)) as *const __m256i);
                if k % 2 == 1 {
                    v = _mm256_srli_epi16(v, 4);
                }
                let s = d * f32::from(sc);
                (bytes_to_f32::<false>(_mm256_and_si256(v, m4)), s, s, dmin * f32::from(m))
            }
            BlockType::Q5_0 => {
                let blk = row.add(b * 22);
                let d = f16_at(blk);
                let qs = _mm_loadu_si128(blk.add(6) as *const __m128i);
                let lo = _mm_and_si128(qs, _mm256_castsi256_si128(m4));
                let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), _mm256_castsi256_si128(m4));
                let nib = _mm256_set_m128i(hi, lo);
                let fifth = _mm256_and_si256(bytes_from_bits_32(blk.add(2)), _mm256_set1_epi8(0x10));
                let q = _mm256_sub_epi8(_mm256_or_si256(nib, fifth), _mm256_set1_epi8(16));
                (bytes_to_f32::<true>(q), d, d, 0.0)
            }
            BlockType::Q6_K => {
                let blk = row.add((b / 8) * 210);
                let k = b % 8;
                let (h, g) = (k / 4, k % 4);
                let mut lo = _mm256_loadu_si256(blk.add(64 * h + 32 * (g % 2)) as *const __m256i);
                if g >= 2 {
                    lo = _mm256_srli_epi16(lo, 4);
                }
                lo = _mm256_and_si256(lo, m4);
                let qh = _mm256_loadu_si256(blk.add(Q6K_QH + 32 * h) as *const __m256i);
                let hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * g as i32)), _mm256_set1_epi8(3));
                let q = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
                let d = f16_at(blk.add(Q6K_D));
                let sc = blk.add(Q6K_SCALES + 8 * h + 2 * g);
                (bytes_to_f32::<true>(q), d * f32::from(*sc as i8), d * f32::from(*sc.add(1) as i8), 0.0)
            }
            _ => unreachable!("sub_q is for Q4_K, Q5_0 and Q6_K"),
        }
    }
}

/// [`dot_t`] for Q4_K (`TY` 3), Q5_0 (4) and Q6_K (5), per 32-weight sub-block: weights 0..16
/// accumulate under the first scale and 16..32 under the second, and Q4_K's minimum multiplies
/// the sub-block's activation sum from `xsum`. The same operations for each token whatever `T`.
///
/// # Safety
/// As [`dot_t`]; `xsum` holds `T · nb` sums for Q4_K.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_sub_t<const TY: u8, const T: usize>(row: *const u8, nb: usize, x: *const f32, stride: usize, xsum: *const f32) -> [f32; T] {
    let ty = match TY {
        3 => BlockType::Q4_K,
        4 => BlockType::Q5_0,
        _ => BlockType::Q6_K,
    };
    let mut acc0 = [_mm256_setzero_ps(); T];
    let mut acc1 = [_mm256_setzero_ps(); T];
    let mut accm = [0.0f32; T];
    for b in 0..nb {
        // SAFETY: b < nb, so the sub-block and each token's 32 values are in bounds.
        unsafe {
            let (q, s0, s1, m) = sub_q(ty, row, b);
            let (d0, d1) = (_mm256_set1_ps(s0), _mm256_set1_ps(s1));
            for k in 0..T {
                let xb = x.add(k * stride + b * BLOCK);
                let t = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xb.add(8)), _mm256_mul_ps(q[0], _mm256_loadu_ps(xb)));
                let u = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xb.add(24)), _mm256_mul_ps(q[2], _mm256_loadu_ps(xb.add(16))));
                acc0[k] = _mm256_fmadd_ps(t, d0, acc0[k]);
                acc1[k] = _mm256_fmadd_ps(u, d1, acc1[k]);
                if TY == 3 {
                    accm[k] += m * *xsum.add(k * nb + b);
                }
            }
        }
    }
    let mut out = [0.0f32; T];
    for k in 0..T {
        out[k] = hsum(_mm256_add_ps(acc0[k], acc1[k])) - accm[k];
    }
    out
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
    // `nb` counts 32-weight (sub-)blocks; a Q4_K / Q6_K block holds eight.
    debug_assert!(row.len() * ty.block_len() >= nb * BLOCK * ty.block_bytes());
    let rp = row.as_ptr();
    // SAFETY: forwarded from the caller.
    unsafe {
        match ty {
            BlockType::Q4_0 => dot_t::<0, T>(rp, nb, x, stride, xsum),
            BlockType::Q4_1 => dot_t::<1, T>(rp, nb, x, stride, xsum),
            BlockType::Q8_0 => dot_t::<2, T>(rp, nb, x, stride, xsum),
            BlockType::Q4_K => dot_sub_t::<3, T>(rp, nb, x, stride, xsum),
            BlockType::Q5_0 => dot_sub_t::<4, T>(rp, nb, x, stride, xsum),
            BlockType::Q6_K => dot_sub_t::<5, T>(rp, nb, x, stride, xsum),
        }
    }
}

/// Dequantizes one packed row into `out` (`out.len()` values), AVX2. Uses FMA for `d·q + m`
/// (Q4_1), so results may differ from ggml's scalar code in the last bit; Q4_K, Q5_0 and Q6_K
/// round `s·q` and `− min` separately, as ggml does, so they are bit-identical to it.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `row` must hold `out.len() / 32` blocks of `ty`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dequant_row(ty: BlockType, row: &[u8], out: &mut [f32]) {
    let nb = out.len() / BLOCK;
    let rp = row.as_ptr();
    let op = out.as_mut_ptr();
    if matches!(ty, BlockType::Q4_K | BlockType::Q5_0 | BlockType::Q6_K) {
        debug_assert!(row.len() * ty.block_len() >= out.len() * ty.block_bytes());
        for b in 0..nb {
            // SAFETY: b < nb, so the sub-block and its 32 outputs are in bounds.
            unsafe {
                let (q, s0, s1, m) = sub_q(ty, rp, b);
                let ob = op.add(b * BLOCK);
                let mv = _mm256_set1_ps(m);
                for (k, qk) in q.iter().enumerate() {
                    let s = _mm256_set1_ps(if k < 2 { s0 } else { s1 });
                    _mm256_storeu_ps(ob.add(8 * k), _mm256_sub_ps(_mm256_mul_ps(*qk, s), mv));
                }
            }
        }
        return;
    }
    let bb = ty.block_bytes();
    debug_assert!(row.len() >= nb * bb);
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

#[cfg(test)]
mod tests {
    use super::super::{BlockType, Q6K_D, scalar};
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// Random blocks of `ty` (every code and scale byte random; the f16 scales set to finite
    /// values, negative ones included).
    fn blocks(ty: BlockType, n: usize, seed: u64) -> Vec<u8> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let bb = ty.block_bytes();
        let mut data: Vec<u8> = (0..n * bb).map(|_| rng.random()).collect();
        for blk in data.chunks_exact_mut(bb) {
            let mut f16 = |at: usize, rng: &mut ChaCha8Rng| {
                let v = half::f16::from_f32(rng.random_range(-0.05f32..0.05));
                blk[at..at + 2].copy_from_slice(&v.to_bits().to_le_bytes());
            };
            match ty {
                BlockType::Q4_K => {
                    f16(0, &mut rng);
                    f16(2, &mut rng);
                }
                BlockType::Q6_K => f16(Q6K_D, &mut rng),
                _ => f16(0, &mut rng),
            }
        }
        data
    }

    /// The AVX2 sub-block unpacking against the scalar (ggml-order) code, on every bit pattern
    /// the random blocks give: dequantization bit-identical, dot products within f32 rounding.
    #[test]
    fn k_quant_and_q5_0_match_scalar() {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")) {
            return;
        }
        for ty in [BlockType::Q4_K, BlockType::Q5_0, BlockType::Q6_K] {
            let cols = 512;
            let row = blocks(ty, cols / ty.block_len(), 7 + ty as u64);
            let mut want = vec![0.0f32; cols];
            scalar::dequant_row(ty, &row, &mut want);
            let mut got = vec![0.0f32; cols];
            // SAFETY: AVX2/FMA/F16C checked above; `row` holds `cols` weights of `ty`.
            unsafe { super::dequant_row(ty, &row, &mut got) };
            assert_eq!(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "{ty:?}");
            let mut rng = ChaCha8Rng::seed_from_u64(3);
            let x: Vec<f32> = (0..cols).map(|_| rng.random_range(-2.0f32..2.0)).collect();
            let xsum: Vec<f32> = x.chunks_exact(32).map(|c| c.iter().sum()).collect();
            let exact: f64 = want.iter().zip(&x).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum();
            let mag: f64 = want.iter().zip(&x).map(|(a, b)| (f64::from(*a) * f64::from(*b)).abs()).sum();
            // SAFETY: as above; x holds one row of `cols`, xsum its `cols / 32` sums.
            let dot = unsafe { super::dot_multi::<1>(ty, &row, cols / 32, x.as_ptr(), cols, xsum.as_ptr()) }[0];
            assert!((f64::from(dot) - exact).abs() <= 1e-5 * mag + 1e-6, "{ty:?}: {dot} vs {exact}");
        }
    }
}

/// [`transpose8x4`] of bytes `off .. off + 16` (`off` a multiple of 4) of one block of 8 rows:
/// with `IL` false the rows are GGUF rows (row `r`'s block at `p + r · row_bytes`); with `IL`
/// true the 8 blocks are stored interleaved (`PackedMatrix::interleave8`: 4-byte chunk `c` of
/// the 8 rows, row `r` at byte `4r`, at `p + 32c`), so the four vectors are plain loads.
///
/// # Safety
/// AVX2; the 8 rows' bytes `off .. off + 16` readable in that layout.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn rows8x4<const IL: bool>(p: *const u8, off: usize, row_bytes: usize) -> [__m256i; 4] {
    // SAFETY: the caller's contract.
    unsafe {
        if IL {
            let q = p.add(8 * off) as *const __m256i;
            [_mm256_loadu_si256(q), _mm256_loadu_si256(q.add(1)), _mm256_loadu_si256(q.add(2)), _mm256_loadu_si256(q.add(3))]
        } else {
            transpose8x4(p.add(off), row_bytes)
        }
    }
}

/// [`transpose8x1`] of bytes `off .. off + 4` of one block of 8 rows, in the layouts of
/// [`rows8x4`].
///
/// # Safety
/// AVX2; with `IL` false 16 readable bytes at `p + off + r · row_bytes` for r in 0..8, with
/// `IL` 32 at `p + 8 · off`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn rows8x1<const IL: bool>(p: *const u8, off: usize, row_bytes: usize) -> __m256i {
    // SAFETY: the caller's contract.
    unsafe { if IL { _mm256_loadu_si256(p.add(8 * off) as *const __m256i) } else { transpose8x1(p.add(off), row_bytes) } }
}

/// Rows 0..8 of the 16 bytes at `p + r · row_bytes` as four vectors of 32-bit groups: vector
/// `c` holds bytes `4c .. 4c + 4` of row `r` in lane `r` (an 8 × 4 transpose of 32-bit words).
///
/// # Safety
/// AVX2; 16 readable bytes at `p + r · row_bytes` for r in 0..8.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn transpose8x4(p: *const u8, row_bytes: usize) -> [__m256i; 4] {
    // SAFETY: the caller guarantees the 8 × 16 bytes.
    unsafe {
        let ld = |r: usize| _mm_loadu_si128(p.add(r * row_bytes) as *const __m128i);
        let a0 = _mm256_set_m128i(ld(4), ld(0));
        let a1 = _mm256_set_m128i(ld(5), ld(1));
        let a2 = _mm256_set_m128i(ld(6), ld(2));
        let a3 = _mm256_set_m128i(ld(7), ld(3));
        let t0 = _mm256_unpacklo_epi32(a0, a1);
        let t1 = _mm256_unpackhi_epi32(a0, a1);
        let t2 = _mm256_unpacklo_epi32(a2, a3);
        let t3 = _mm256_unpackhi_epi32(a2, a3);
        [
            _mm256_unpacklo_epi64(t0, t2),
            _mm256_unpackhi_epi64(t0, t2),
            _mm256_unpacklo_epi64(t1, t3),
            _mm256_unpackhi_epi64(t1, t3),
        ]
    }
}

/// The first 4 bytes at `p + r · row_bytes` in lane `r`, r in 0..8.
///
/// # Safety
/// AVX2; 16 readable bytes at `p + r · row_bytes` for r in 0..8.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn transpose8x1(p: *const u8, row_bytes: usize) -> __m256i {
    // SAFETY: the caller guarantees the 8 × 16 bytes.
    unsafe {
        let ld = |r: usize| _mm_loadu_si128(p.add(r * row_bytes) as *const __m128i);
        let t0 = _mm256_unpacklo_epi32(_mm256_set_m128i(ld(4), ld(0)), _mm256_set_m128i(ld(5), ld(1)));
        let t2 = _mm256_unpacklo_epi32(_mm256_set_m128i(ld(6), ld(2)), _mm256_set_m128i(ld(7), ld(3)));
        _mm256_unpacklo_epi64(t0, t2)
    }
}

/// The AVX2 twin of `x86_512::q8_rows8` (same arguments, same contract minus VNNI) for CPUs
/// without AVX-512 VNNI: `vpmaddubsw` + `vpmaddwd` instead of `vpdpbusd`, as ggml's AVX2
/// `mul_sum_us8_pairs_float`. Q4 codes (0..15) times activation codes (|qx| ≤ 127) summed over
/// the 8 groups stay within i16 (8 · 2 · 15 · 127 = 30,480), so they are added in 16 bits
/// before one widening; Q5_0 codes (0..31) in two halves of 4 groups (31,496 each); Q8_0 uses
/// ggml's sign trick (`|q|` times `sign(q)·qx`, each pair ≤ 32,512) and widens per group. The integer block sums are the exact values the VNNI kernel
/// computes and the float operations after them are the same, so both kernels give the same
/// bits.
///
/// # Safety
/// AVX2, FMA and F16C; otherwise as `x86_512::q8_rows8`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q8_rows8<const T: usize>(
    ty: BlockType,
    rows: *const u8,
    row_bytes: usize,
    nb: usize,
    xq: *const i8,
    xd: *const f32,
    xs: *const f32,
    xi: *const i32,
    stride: usize,
) -> [[f32; 8]; T] {
    // SAFETY: forwarded from the caller.
    unsafe {
        match ty {
            BlockType::Q4_0 => q8_rows8_t::<0, T>(rows, row_bytes, nb, xq, xd, xs, xi, stride),
            BlockType::Q4_1 => q8_rows8_t::<1, T>(rows, row_bytes, nb, xq, xd, xs, xi, stride),
            BlockType::Q5_0 => q8_rows8_t::<4, T>(rows, row_bytes, nb, xq, xd, xs, xi, stride),
            _ => q8_rows8_t::<2, T>(rows, row_bytes, nb, xq, xd, xs, xi, stride),
        }
    }
}

/// The 5th bits of weight group `g` (weights `4g .. 4g + 4`) of 8 Q5_0 rows, one row per 32-bit
/// lane: byte `i` of lane `r` is `0x10` if bit `4g + i` of lane `r` of `qh` (row `r`'s `qh`
/// field) is set, else 0. Byte `g / 2` of each lane is broadcast to its 4 bytes, then each
/// byte tests its own bit (ggml's `bytes_from_bits_32` idea, per lane).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q5_high_bits(qh: __m256i, g: usize) -> __m256i {
    let byte = _mm256_set1_epi8((g / 2) as i8);
    let lanes = _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12, 0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12);
    let spread = _mm256_shuffle_epi8(qh, _mm256_add_epi8(lanes, byte));
    let s = 4 * (g % 2) as u32;
    let bit = _mm256_set1_epi32(i32::from_le_bytes([(1u32 << s) as u8, (2u32 << s) as u8, (4u32 << s) as u8, (8u32 << s) as u8]));
    _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10))
}

/// The unsigned 5-bit codes (0..31, before the `− 16`) of one Q5_0 block of 8 rows (at `blk +
/// r · row_bytes`), one row per 32-bit lane: vector `g` holds weights `4g .. 4g + 4` (the
/// layout of `q8_rows8`). A block is `d: f16`, `qh: u32` (bit `j`: the 5th bit of weight `j`),
/// then the nibbles as Q4_0 (byte `j`: weight `j` low, `j + 16` high).
///
/// # Safety
/// AVX2; a whole 22-byte block at `blk + r · row_bytes` for r in 0..8.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q5_0_codes8(blk: *const u8, row_bytes: usize) -> [__m256i; 8] {
    let m4 = _mm256_set1_epi8(0x0F);
    // SAFETY: bytes 2..18 and 6..22 of each row's block.
    let (qh, v) = unsafe { (transpose8x1(blk.add(2), row_bytes), transpose8x4(blk.add(6), row_bytes)) };
    let mut w = [_mm256_setzero_si256(); 8];
    for c in 0..4 {
        w[c] = _mm256_or_si256(_mm256_and_si256(v[c], m4), q5_high_bits(qh, c));
        w[4 + c] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v[c], 4), m4), q5_high_bits(qh, 4 + c));
    }
    w
}

/// The 8 f16 in the low (`HI = false`) or high halves of the 32-bit lanes of `v`, as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn halves_to_f32<const HI: bool>(v: __m256i) -> __m256 {
    let pick = if HI {
        _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1, 2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1)
    } else {
        _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1, 0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1)
    };
    // 64-bit words 0 and 2 hold the 4 + 4 halves.
    let packed = _mm256_permute4x64_epi64::<0b1000>(_mm256_shuffle_epi8(v, pick));
    _mm256_cvtph_ps(_mm256_castsi256_si128(packed))
}

/// The codes of one 32-weight block of 8 rows (`TY` 0: Q4_0, 1: Q4_1, 4: Q5_0, 2: Q8_0; row `r`
/// at `blk + r · row_bytes`, `row_bytes` possibly 0), one row per 32-bit lane: vector `g` holds
/// weights `4g .. 4g + 4`. Q4_0 / Q4_1 nibbles and Q5_0 5-bit codes unsigned (byte `j` of a Q4
/// block holds weight `j` in its low and `j + 16` in its high nibble), Q8_0 codes signed. Shared
/// by the per-token-group kernels (`q8_rows8`, both ISAs) and the repacking of `krepack.rs`.
///
/// # Safety
/// AVX2; a whole block at `blk + r · row_bytes` for r in 0..8.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn block32_codes8<const TY: u8>(blk: *const u8, row_bytes: usize) -> [__m256i; 8] {
    let m4 = _mm256_set1_epi8(0x0F);
    let mut w = [_mm256_setzero_si256(); 8];
    // SAFETY: the caller's contract.
    unsafe {
        if TY == 2 {
            let lo = transpose8x4(blk.add(2), row_bytes);
            let hi = transpose8x4(blk.add(18), row_bytes);
            w[..4].copy_from_slice(&lo);
            w[4..].copy_from_slice(&hi);
        } else if TY == 4 {
            w = q5_0_codes8(blk, row_bytes);
        } else {
            let v = transpose8x4(blk.add(if TY == 0 { 2 } else { 4 }), row_bytes);
            for c in 0..4 {
                w[c] = _mm256_and_si256(v[c], m4);
                w[4 + c] = _mm256_and_si256(_mm256_srli_epi16(v[c], 4), m4);
            }
        }
    }
    w
}

#[inline]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_rows8_t<const TY: u8, const T: usize>(
    rows: *const u8,
    row_bytes: usize,
    nb: usize,
    xq: *const i8,
    xd: *const f32,
    xs: *const f32,
    xi: *const i32,
    stride: usize,
) -> [[f32; 8]; T] {
    let bb = match TY {
        0 => BlockType::Q4_0,
        1 => BlockType::Q4_1,
        4 => BlockType::Q5_0,
        _ => BlockType::Q8_0,
    }
    .block_bytes();
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); T];
    for b in 0..nb {
        // SAFETY: b < nb: the 8 rows' block b and each token's block b are in bounds.
        unsafe {
            let blk = rows.add(b * bb);
            let ahead = rows.add(8 * row_bytes + b * 8 * bb);
            for l in (0..8 * bb).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(ahead.add(l) as *const i8);
            }
            let dm = transpose8x1(blk, row_bytes);
            let d = halves_to_f32::<false>(dm);
            let w = block32_codes8::<TY>(blk, row_bytes);
            let m = if TY == 1 { halves_to_f32::<true>(dm) } else { d };
            for k in 0..T {
                let xb = xq.add(k * stride + b * BLOCK) as *const i32;
                let bcast = |g: usize| _mm256_set1_epi32(xb.add(g).read_unaligned());
                let mut s = if TY == 2 {
                    let pair = |g: usize| {
                        _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w[g]), _mm256_sign_epi8(bcast(g), w[g])), ones)
                    };
                    let s01 = _mm256_add_epi32(pair(0), pair(1));
                    let s23 = _mm256_add_epi32(pair(2), pair(3));
                    let s45 = _mm256_add_epi32(pair(4), pair(5));
                    let s67 = _mm256_add_epi32(pair(6), pair(7));
                    _mm256_add_epi32(_mm256_add_epi32(s01, s23), _mm256_add_epi32(s45, s67))
                } else if TY == 4 {
                    // Q5_0 codes reach 31: four groups fit 16 bits (4 · 2 · 31 · 127 = 31,496),
                    // eight would not.
                    let p = |g: usize| _mm256_maddubs_epi16(w[g], bcast(g));
                    let lo = _mm256_add_epi16(_mm256_add_epi16(p(0), p(1)), _mm256_add_epi16(p(2), p(3)));
                    let hi = _mm256_add_epi16(_mm256_add_epi16(p(4), p(5)), _mm256_add_epi16(p(6), p(7)));
                    _mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones))
                } else {
                    let p = |g: usize| _mm256_maddubs_epi16(w[g], bcast(g));
                    let s01 = _mm256_add_epi16(p(0), p(1));
                    let s23 = _mm256_add_epi16(p(2), p(3));
                    let s45 = _mm256_add_epi16(p(4), p(5));
                    let s67 = _mm256_add_epi16(p(6), p(7));
                    let s16 = _mm256_add_epi16(_mm256_add_epi16(s01, s23), _mm256_add_epi16(s45, s67));
                    _mm256_madd_epi16(s16, ones)
                };
                let i = k * nb + b;
                if TY == 0 || TY == 4 {
                    let off = if TY == 0 { 8 } else { 16 };
                    s = _mm256_sub_epi32(s, _mm256_set1_epi32(off * *xi.add(i)));
                }
                let scale = _mm256_mul_ps(d, _mm256_set1_ps(*xd.add(i)));
                acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[k]);
                if TY == 1 {
                    acc[k] = _mm256_fmadd_ps(m, _mm256_set1_ps(*xs.add(i)), acc[k]);
                }
            }
        }
    }
    // Token-major: token k's 8 rows are one vector.
    let mut out = [[0.0f32; 8]; T];
    for k in 0..T {
        // SAFETY: 8 f32 of stack memory.
        unsafe { _mm256_storeu_ps(out[k].as_mut_ptr(), acc[k]) };
    }
    out
}

/// Sub-block `k` (0..8) of the Q6_K block at `blk`: its 32 signed codes `q − 32` (one per byte,
/// in weight order) and the scales `d·sc` of its weights 0..16 and 16..32 (see
/// [`super::q6k_code`] for the bit layout).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q6k_sub_codes(blk: *const u8, k: usize) -> (__m256i, f32, f32) {
    // SAFETY (all loads): the caller guarantees a whole 210-byte block at `blk` and k < 8.
    unsafe {
        let (h, g) = (k / 4, k % 4);
        let ql = _mm256_loadu_si256(blk.add(64 * h + 32 * (g % 2)) as *const __m256i);
        let ql = if g < 2 { ql } else { _mm256_srli_epi16(ql, 4) };
        let lo = _mm256_and_si256(ql, _mm256_set1_epi8(0x0F));
        let hi = q6k_high_bits(_mm256_loadu_si256(blk.add(Q6K_QH + 32 * h) as *const __m256i), g);
        let q = _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
        let d = f16_at(blk.add(Q6K_D));
        let s = blk.add(Q6K_SCALES + 8 * h + 2 * g) as *const i8;
        (q, d * f32::from(*s), d * f32::from(*s.add(1)))
    }
}

/// Sub-block `k` (0..8) of the Q4_K block at `blk`: its 32 unsigned 4-bit codes (one per byte,
/// in weight order), its scale `d·sc_k` and its negated minimum `−dmin·m_k`, so that weight
/// `i` is `d·sc_k · q_i − dmin·m_k`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q4k_sub_codes(blk: *const u8, k: usize) -> (__m256i, f32, f32) {
    // SAFETY (all loads): the caller guarantees a whole 144-byte block at `blk` and k < 8.
    unsafe {
        let (sc, m) = q4k_scale_min(k, std::slice::from_raw_parts(blk.add(4), 12));
        let v = _mm256_loadu_si256(blk.add(16 + 32 * (k / 2)) as *const __m256i);
        let v = if k.is_multiple_of(2) { v } else { _mm256_srli_epi16(v, 4) };
        (_mm256_and_si256(v, _mm256_set1_epi8(0x0F)), f16_at(blk) * sc as f32, -(f16_at(blk.add(2)) * m as f32))
    }
}

/// Byte `j` (0..4) of every 32-bit lane of `v` as f32: unsigned (`SIGNED = false`) or
/// sign-extended.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn byte_f32<const SIGNED: bool>(v: __m256i, j: usize) -> __m256 {
    let i = if SIGNED {
        _mm256_srai_epi32::<24>(_mm256_sll_epi32(v, _mm_cvtsi32_si128((24 - 8 * j) as i32)))
    } else {
        _mm256_and_si256(_mm256_srl_epi32(v, _mm_cvtsi32_si128((8 * j) as i32)), _mm256_set1_epi32(0xFF))
    };
    _mm256_cvtepi32_ps(i)
}

/// The scales of one Q4_K super-block of 8 rows (at `blk + r · row_bytes`), one row per lane:
/// `(d, dmin, sc, mn)` with `d`, `dmin` as f32 and the eight 6-bit scales (`sc[0]` bytes 0..4:
/// sub-blocks 0..4, `sc[1]`: 4..8) and minima (`mn`) as bytes, decoded from the 12-byte field
/// with ggml's `kmask1/2/3` shuffle (`ggml_vec_dot_q4_K_q8_K`), which is `get_scale_min_k4`
/// for all eight sub-blocks at once. With `IL` the 8 blocks are interleaved (see [`rows8x4`]).
///
/// # Safety
/// AVX2; a whole 144-byte block at `blk + r · row_bytes` for r in 0..8 (with `IL` the 8 blocks'
/// 1152 interleaved bytes at `blk`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q4k_scales8<const IL: bool>(blk: *const u8, row_bytes: usize) -> (__m256, __m256, [__m256i; 2], [__m256i; 2]) {
    // SAFETY: bytes 0..28 of each row's block (the 4-byte chunks 0..4 interleaved).
    let (dm, u0, u1, u2) = unsafe {
        (rows8x1::<IL>(blk, 0, row_bytes), rows8x1::<IL>(blk, 4, row_bytes), rows8x1::<IL>(blk, 8, row_bytes), rows8x1::<IL>(blk, 12, row_bytes))
    };
    let (k1, k2, k3) = (_mm256_set1_epi32(0x3f3f_3f3f), _mm256_set1_epi32(0x0f0f_0f0f), _mm256_set1_epi32(0x0303_0303));
    let top2 = |u: __m256i| _mm256_slli_epi32::<4>(_mm256_and_si256(_mm256_srli_epi32::<6>(u), k3));
    let sc = [_mm256_and_si256(u0, k1), _mm256_or_si256(_mm256_and_si256(u2, k2), top2(u0))];
    let mn = [_mm256_and_si256(u1, k1), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32::<4>(u2), k2), top2(u1))];
    (halves_to_f32::<false>(dm), halves_to_f32::<true>(dm), sc, mn)
}

/// The f16 `d` of one Q6_K super-block of 8 rows (at `blk + r · row_bytes`, or interleaved with
/// `IL`, see [`rows8x4`]), one row per lane.
///
/// # Safety
/// AVX2; a whole 210-byte block at `blk + r · row_bytes` for r in 0..8 (with `IL` the 8 blocks'
/// 1680 interleaved bytes at `blk`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q6k_d8<const IL: bool>(blk: *const u8, row_bytes: usize) -> __m256 {
    if IL {
        // SAFETY: interleaved, the 8 rows' `d` (the 2 bytes after the 52 whole 4-byte chunks)
        // are 16 bytes at `8 · Q6K_D`.
        return unsafe { _mm256_cvtph_ps(_mm_loadu_si128(blk.add(8 * Q6K_D) as *const __m128i)) };
    }
    // SAFETY: bytes 208..210 of each row's block.
    let ld = |r: usize| unsafe { (blk.add(r * row_bytes + Q6K_D) as *const i16).read_unaligned() };
    _mm256_cvtph_ps(_mm_setr_epi16(ld(0), ld(1), ld(2), ld(3), ld(4), ld(5), ld(6), ld(7)))
}

/// Bits `2g, 2g + 1` of every byte of `qh` (Q6_K's high bits of sub-block `g` of a half) moved
/// to bits 4, 5 (16-bit shifts, then a byte mask).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn q6k_high_bits(qh: __m256i, g: usize) -> __m256i {
    let hi = match g {
        0 => _mm256_slli_epi16::<4>(qh),
        1 => _mm256_slli_epi16::<2>(qh),
        2 => qh,
        _ => _mm256_srli_epi16::<2>(qh),
    };
    _mm256_and_si256(hi, _mm256_set1_epi8(0x30))
}

/// `Σ_{g<4}` of the 4-byte sums of unsigned `w[g]` times signed `x[g]`, per 32-bit lane, with
/// `vpmaddubsw` + `vpmaddwd`; exact: Q4_K codes ≤ 15 (`TY` 3) let four groups add in 16 bits
/// (4 · 2 · 15 · 127 = 15,240), Q6_K codes ≤ 63 two (2 · 2 · 63 · 127 = 32,004).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot16_avx2<const TY: u8>(w: [__m256i; 4], x: [__m256i; 4]) -> __m256i {
    let ones = _mm256_set1_epi16(1);
    let p = |g: usize| _mm256_maddubs_epi16(w[g], x[g]);
    if TY == 3 {
        _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(p(0), p(1)), _mm256_add_epi16(p(2), p(3))), ones)
    } else {
        _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(p(0), p(1)), ones), _mm256_madd_epi16(_mm256_add_epi16(p(2), p(3)), ones))
    }
}

/// The AVX2 twin of `x86_512::q8_rows8_k` (Q4_K, Q6_K, 8 rows per vector): the same body
/// (`q8_rows8_k_body!`) with `vpmaddubsw` + `vpmaddwd` ([`dot16_avx2`]) where the VNNI kernel
/// has `vpdpbusd`; both leave the same exact integer sums in the same lanes, so this kernel
/// gives the VNNI kernel's bits.
///
/// # Safety
/// AVX2, FMA and F16C; otherwise as `x86_512::q8_rows8_k`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q8_rows8_k<const T: usize>(
    ty: BlockType,
    rows: *const u8,
    row_bytes: usize,
    interleaved: bool,
    nb: usize,
    xq: *const i8,
    xd: *const f32,
    xs: *const f32,
    xi: *const i32,
    xl: *const i32,
    stride: usize,
) -> [[f32; 8]; T] {
    // SAFETY: forwarded from the caller.
    unsafe {
        match (ty, interleaved) {
            (BlockType::Q4_K, false) => q8_rows8_k_t::<3, T, false>(rows, row_bytes, nb, xq, xd, xs, xi, xl, stride),
            (BlockType::Q4_K, true) => q8_rows8_k_t::<3, T, true>(rows, row_bytes, nb, xq, xd, xs, xi, xl, stride),
            (_, false) => q8_rows8_k_t::<5, T, false>(rows, row_bytes, nb, xq, xd, xs, xi, xl, stride),
            (_, true) => q8_rows8_k_t::<5, T, true>(rows, row_bytes, nb, xq, xd, xs, xi, xl, stride),
        }
    }
}

#[inline]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_rows8_k_t<const TY: u8, const T: usize, const IL: bool>(
    rows: *const u8,
    row_bytes: usize,
    nb: usize,
    xq: *const i8,
    xd: *const f32,
    xs: *const f32,
    xi: *const i32,
    xl: *const i32,
    stride: usize,
) -> [[f32; 8]; T] {
    q8_rows8_k_body!(TY, T, IL, rows, row_bytes, nb, xq, xd, xs, xi, xl, stride, dot16_avx2::<TY>)
}
