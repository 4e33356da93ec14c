//! AVX-512 kernels (x86-64, AVX-512 F/BW/VL plus AVX2/FMA/F16C). Callers check the features at
//! run time.
//!
//! # Design: a register tile of 4 rows × 4 tokens
//! Each block of 32 weights is unpacked into two 16-lane vectors of f32 *weights* (the scale and,
//! for Q4_1, the minimum folded in: `d·q + m` with one FMA, `d·(q − 8)` for Q4_0, `d·q` for
//! Q8_0). A tile of `R` rows × `T` tokens keeps one accumulator per (row, token): each unpacked
//! block feeds `T` tokens and each activation load feeds `R` rows, so neither the unpacking nor
//! the activation traffic limits the FMA rate. (The AVX2 kernel in `x86.rs` handles one row at a
//! time, so every activation is re-read from L2 for every row: ~8 MAC/cycle at most.)
//!
//! # Batch invariance
//! A (row, token) result is the same sequence of operations whatever the tile shape is, so a
//! token computed alone (`T = 1`) is bit-identical to the same token in a tile of 4.

use std::arch::x86_64::*;

use super::x86::{q4k_sub_codes, q6k_sub_codes};
use super::{BLOCK, BlockType};

/// The f16 at `p` (unaligned) as f32, with the F16C conversion.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn f16_at(p: *const u8) -> f32 {
    // SAFETY: the caller guarantees 2 readable bytes at `p`.
    let bits = unsafe { (p as *const u16).read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// The 32 dequantized weights of the block at `blk`: weights 0..16 and 16..32.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn block_w<const TY: u8>(blk: *const u8) -> (__m512, __m512) {
    // SAFETY (all loads): the caller guarantees a whole block at `blk`.
    unsafe {
        let d = _mm512_set1_ps(f16_at(blk));
        match TY {
            // Q5_0: d · (q − 16), the 5th bits from `qh` as lane masks.
            4 => {
                let qh = (blk.add(2) as *const u32).read_unaligned();
                let v = _mm_loadu_si128(blk.add(6) as *const __m128i);
                let m4 = _mm_set1_epi8(0x0F);
                let lo = _mm512_cvtepu8_epi32(_mm_and_si128(v, m4));
                let hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), m4));
                let sixteen = _mm512_set1_epi32(16);
                let lo = _mm512_mask_add_epi32(lo, qh as u16, lo, sixteen);
                let hi = _mm512_mask_add_epi32(hi, (qh >> 16) as u16, hi, sixteen);
                let off = _mm512_set1_ps(16.0);
                (
                    _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(lo), off), d),
                    _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(hi), off), d),
                )
            }
            // Q8_0: d · qs[i].
            2 => {
                let q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(blk.add(2) as *const __m128i)));
                let q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(blk.add(18) as *const __m128i)));
                (_mm512_mul_ps(q0, d), _mm512_mul_ps(q1, d))
            }
            // Q4_0 (d · (q − 8)) and Q4_1 (d · q + m): low nibbles are weights 0..16, high 16..32.
            _ => {
                let off = if TY == 0 { 2 } else { 4 };
                let qv = _mm_loadu_si128(blk.add(off) as *const __m128i);
                let m4 = _mm_set1_epi8(0x0F);
                let lo = _mm_and_si128(qv, m4);
                let hi = _mm_and_si128(_mm_srli_epi16(qv, 4), m4);
                let q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo));
                let q1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi));
                if TY == 0 {
                    let eight = _mm512_set1_ps(8.0);
                    (_mm512_mul_ps(_mm512_sub_ps(q0, eight), d), _mm512_mul_ps(_mm512_sub_ps(q1, eight), d))
                } else {
                    let m = _mm512_set1_ps(f16_at(blk.add(2)));
                    (_mm512_fmadd_ps(q0, d, m), _mm512_fmadd_ps(q1, d, m))
                }
            }
        }
    }
}

/// The block type of the const parameter `TY` of the kernels below (0 = Q4_0, 1 = Q4_1,
/// 2 = Q8_0, 3 = Q4_K, 4 = Q5_0, 5 = Q6_K).
const fn block_type<const TY: u8>() -> BlockType {
    match TY {
        0 => BlockType::Q4_0,
        1 => BlockType::Q4_1,
        2 => BlockType::Q8_0,
        3 => BlockType::Q4_K,
        4 => BlockType::Q5_0,
        _ => BlockType::Q6_K,
    }
}

/// The 32 dequantized weights of sub-block `k` (0..8) of the Q6_K block at `blk`:
/// `d·sc · (q − 32)` (weights 0..16 and 16..32, each half with its own scale).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn block_w_q6k(blk: *const u8, k: usize) -> (__m512, __m512) {
    // SAFETY: forwarded from the caller.
    let (q, s0, s1) = unsafe { q6k_sub_codes(blk, k) };
    let q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
    let q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
    (_mm512_mul_ps(q0, _mm512_set1_ps(s0)), _mm512_mul_ps(q1, _mm512_set1_ps(s1)))
}

/// The 32 dequantized weights of sub-block `k` (0..8) of the Q4_K block at `blk`:
/// `d·sc_k · q − dmin·m_k` (weights 0..16 and 16..32 of the sub-block).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn block_w_q4k(blk: *const u8, k: usize) -> (__m512, __m512) {
    // SAFETY: forwarded from the caller.
    let (q, d1, m1) = unsafe { q4k_sub_codes(blk, k) };
    let (d1, m1) = (_mm512_set1_ps(d1), _mm512_set1_ps(m1));
    let q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(q)));
    let q1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(q, 1)));
    (_mm512_fmadd_ps(q0, d1, m1), _mm512_fmadd_ps(q1, d1, m1))
}

/// Dot products of `R` consecutive packed rows (`nb` blocks of type `TY` each: 0 = Q4_0,
/// 1 = Q4_1, 2 = Q8_0; row `i` at `rows + i · row_bytes`) with `T` activation rows of `nb · 32`
/// f32 spaced `stride` apart: `out[i][k] = row_i · x_k`.
///
/// Register tile: `R · T` accumulators, `2R` weight vectors and two activation vectors (26 of the
/// 32 registers for `R = T = 4`). Each weight block is unpacked once for `T` tokens and each
/// activation vector loaded once for `R` rows. For every (row, token) the operations are
/// `acc = fma(w_lo, x_lo, acc); acc = fma(w_hi, x_hi, acc)` per block in order, then one
/// `_mm512_reduce_add_ps`, whatever `R` and `T` are (batch invariance).
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL, AVX2, FMA and F16C; the `R` rows must hold `nb`
/// blocks each and the `T` rows of `x` must be readable.
#[inline]
#[allow(clippy::needless_range_loop)] // (row, token) indices name the register tile
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn tile_t<const TY: u8, const R: usize, const T: usize>(
    rows: *const u8,
    row_bytes: usize,
    nb: usize,
    x: *const f32,
    stride: usize,
) -> [[f32; T]; R] {
    let bb = block_type::<TY>().block_bytes();
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    for b in 0..nb {
        // SAFETY: b < nb, so every row's block and each token's 32 values are in bounds.
        unsafe {
            let mut w = [(_mm512_setzero_ps(), _mm512_setzero_ps()); R];
            for (i, wi) in w.iter_mut().enumerate() {
                // `b` counts 32-weight (sub-)blocks; a Q4_K / Q6_K block holds eight.
                *wi = match TY {
                    3 => block_w_q4k(rows.add(i * row_bytes + (b / 8) * bb), b % 8),
                    5 => block_w_q6k(rows.add(i * row_bytes + (b / 8) * bb), b % 8),
                    _ => block_w::<TY>(rows.add(i * row_bytes + b * bb)),
                };
            }
            for k in 0..T {
                let xb = x.add(k * stride + b * BLOCK);
                let x0 = _mm512_loadu_ps(xb);
                let x1 = _mm512_loadu_ps(xb.add(16));
                for i in 0..R {
                    acc[i][k] = _mm512_fmadd_ps(w[i].0, x0, acc[i][k]);
                    acc[i][k] = _mm512_fmadd_ps(w[i].1, x1, acc[i][k]);
                }
            }
        }
    }
    let mut out = [[0.0f32; T]; R];
    for i in 0..R {
        for k in 0..T {
            out[i][k] = hsum512(acc[i][k]);
        }
    }
    out
}

/// Sum of the 16 lanes in a fixed order (halves, then the AVX tree), so the result does not
/// depend on how a library implements `_mm512_reduce_add_ps`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn hsum512(v: __m512) -> f32 {
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    crate::simd::hsum(_mm256_add_ps(_mm512_castps512_ps256(v), hi))
}

/// `R × T` dot products of packed rows with activation rows (see `tile_t`).
///
/// # Safety
/// As `tile_t`: AVX-512 F/BW/VL + AVX2 + FMA + F16C available; `R` rows of `nb` blocks of `ty`
/// at `rows` spaced `row_bytes` apart; `x` holds `T` readable rows of `nb · 32` values spaced
/// `stride` apart.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn tile<const R: usize, const T: usize>(
    ty: BlockType,
    rows: *const u8,
    row_bytes: usize,
    nb: usize,
    x: *const f32,
    stride: usize,
) -> [[f32; T]; R] {
    // SAFETY: forwarded from the caller.
    unsafe {
        match ty {
            BlockType::Q4_0 => tile_t::<0, R, T>(rows, row_bytes, nb, x, stride),
            BlockType::Q4_1 => tile_t::<1, R, T>(rows, row_bytes, nb, x, stride),
            BlockType::Q8_0 => tile_t::<2, R, T>(rows, row_bytes, nb, x, stride),
            BlockType::Q4_K => tile_t::<3, R, T>(rows, row_bytes, nb, x, stride),
            BlockType::Q5_0 => tile_t::<4, R, T>(rows, row_bytes, nb, x, stride),
            BlockType::Q6_K => tile_t::<5, R, T>(rows, row_bytes, nb, x, stride),
        }
    }
}

/// `Σ_{g<4}` of the 4-byte sums of unsigned `w[g]` times signed `x[g]`, per 32-bit lane: one
/// `vpdpbusd` chain (32 products per instruction), exact.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn dot16_vnni(w: [__m256i; 4], x: [__m256i; 4]) -> __m256i {
    let s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w[0], x[0]);
    let s = _mm256_dpbusd_epi32(s, w[1], x[1]);
    let s = _mm256_dpbusd_epi32(s, w[2], x[2]);
    _mm256_dpbusd_epi32(s, w[3], x[3])
}

/// Dot products of 8 packed Q4_K or Q6_K rows with `T` tokens of 8-bit activations
/// ([`super::QuantizedActivations`]), one row per 32-bit lane, with AVX-512 VNNI: `q8_rows8`'s
/// layout (codes of the 8 rows transposed in registers, the next 8 rows prefetched) with the
/// super-block scales of the 8 rows decoded once per super-block into vectors (the per-row,
/// per-sub-block arithmetic of llama.cpp's `ggml_vec_dot_q4_K_q8_K` / `q6_K_q8_K`, on 32-weight
/// activation blocks). The body is `q8_rows8_k_body!`, shared with the AVX2 twin
/// `x86::q8_rows8_k` (same bits).
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C; `ty` is Q4_K or Q6_K; 8 rows (spaced `row_bytes`,
/// possibly 0, or with `interleaved` one interleaved group of 8, `PackedMatrix::interleave8`)
/// of `nb / 8` super-blocks at `rows`; `xq` holds `T` rows of `nb · 32` codes spaced
/// `stride`; `xd`, `xs`, `xi`, `xl` hold `T · nb` per-block scales, scaled sums, integer sums and
/// integer sums of the first 16 codes, spaced `nb`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
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
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
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
    q8_rows8_k_body!(TY, T, IL, rows, row_bytes, nb, xq, xd, xs, xi, xl, stride, dot16_vnni)
}

/// Dot products of 8 packed Q4_0 / Q4_1 / Q5_0 / Q8_0 rows with `T` tokens of 8-bit
/// activations, one row per 32-bit lane (the idea of llama.cpp's repacked `Q4_0_8x8` GEMV, done on the original
/// block layout with an 8 × 4 transpose instead of a repacked copy): per block, the codes of
/// the 8 rows are transposed so that each `vpdpbusd` multiplies 4 consecutive codes of every
/// row with the same 4 activation codes (broadcast); the block's `f16` scales (and Q4_1 minima)
/// of the 8 rows come in one transposed load and one conversion. Per row and block:
///
/// - Q4_1: `acc += (d·dx)·Σ q·qx`, then `acc += m·(dx·Σ qx)`;
/// - Q4_0: `acc += (d·dx)·(Σ q·qx − 8·Σ qx)`;
/// - Q5_0: `acc += (d·dx)·(Σ q·qx − 16·Σ qx)`, the 5-bit codes `q` from `x86::q5_0_codes8`;
/// - Q8_0: `acc += (d·dx)·(Σ (q + 128)·qx − 128·Σ qx)` (`q + 128` is the unsigned byte `q ^ 0x80`).
///
/// The integer sums are exact, so the result is `Σ_b` of the same two roundings per block for
/// every lane: a row gives the same bits in any lane, with any `T` and with any row stride
/// (`row_bytes = 0` computes one row in all lanes: the leftover-row case).
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C; 8 rows (spaced `row_bytes`, possibly 0) of `nb`
/// blocks of `ty` at `rows`; `xq` holds `T` rows of `nb · 32` codes spaced `stride`; `xd`, `xs`,
/// `xi` hold `T · nb` per-block scales, scaled sums and integer sums spaced `nb`; `ty` is Q4_0,
/// Q4_1, Q5_0 or Q8_0.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
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

#[inline]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
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
    let bb = block_type::<TY>().block_bytes();
    let mut acc = [_mm256_setzero_ps(); T];
    for b in 0..nb {
        // SAFETY: b < nb: the 8 rows' block b and each token's block b are in bounds.
        unsafe {
            let blk = rows.add(b * bb);
            // The next 8 rows (contiguous after these when `row_bytes` is the row size): one
            // block's share of their bytes per block of these, ahead of the streamer.
            let ahead = rows.add(8 * row_bytes + b * 8 * bb);
            for l in (0..8 * bb).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(ahead.add(l) as *const i8);
            }
            // The first 4 bytes of each row's block: f16 d (and, for Q4_1, f16 m). (A
            // `vpgatherdd` here was the kernel's bottleneck on Zen 4.)
            let dm = super::x86::transpose8x1(blk, row_bytes);
            let d = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(dm));
            // Weight groups g = 0..8 (weights 4g .. 4g + 4) of the 8 rows, unsigned codes
            // (Q8_0's signed codes + 128: `q ^ 0x80`).
            let mut w = super::x86::block32_codes8::<TY>(blk, row_bytes);
            if TY == 2 {
                let sign = _mm256_set1_epi8(-128);
                for v in &mut w {
                    *v = _mm256_xor_si256(*v, sign);
                }
            }
            let m = if TY == 1 { _mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_srli_epi32(dm, 16))) } else { d };
            for k in 0..T {
                let xb = xq.add(k * stride + b * BLOCK) as *const i32;
                let bcast = |g: usize| _mm256_set1_epi32(xb.add(g).read_unaligned());
                // Four independent chains (integer sums: the split does not change them).
                let mut s0 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w[0], bcast(0));
                let mut s1 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w[1], bcast(1));
                let mut s2 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w[2], bcast(2));
                let mut s3 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w[3], bcast(3));
                s0 = _mm256_dpbusd_epi32(s0, w[4], bcast(4));
                s1 = _mm256_dpbusd_epi32(s1, w[5], bcast(5));
                s2 = _mm256_dpbusd_epi32(s2, w[6], bcast(6));
                s3 = _mm256_dpbusd_epi32(s3, w[7], bcast(7));
                let mut s = _mm256_add_epi32(_mm256_add_epi32(s0, s1), _mm256_add_epi32(s2, s3));
                let i = k * nb + b;
                if TY != 1 {
                    let off = match TY {
                        0 => 8,
                        4 => 16,
                        _ => 128,
                    };
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
