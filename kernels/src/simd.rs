//! AVX2 building blocks shared by the CPU kernels (x86-64). Each is `#[inline]` with the
//! features it needs; callers reach them only from code compiled with those features, after
//! checking the CPU at run time ([`crate::quant::Isa::detect`]).

use std::arch::x86_64::*;

/// Sum of the 8 lanes in a fixed order (halves, then pairs), so a result does not depend on
/// which kernel summed it.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

/// `e^x` lane-wise for `x` in [−87.3, 88.3] (the callers clamp, and decide what lanes outside
/// the range become): `x = n ln 2 + r` with `ln 2` split in two (Cephes C1, C2), Cephes'
/// `expf` polynomial for `e^r` (relative error about 1e-7), `2^n` built in the exponent bits
/// (`n` within [−126, 127]: a normal power of two). NaN stays NaN.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn exp_in_range(x: __m256) -> __m256 {
    let n = _mm256_round_ps(
        _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
    );
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm256_set1_ps(1.987_569_1e-4);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.398_199_9e-3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.333_452e-3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.166_579_6e-2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.666_666_5e-1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5));
    let y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0));
    let e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    _mm256_mul_ps(y, _mm256_castsi256_ps(e))
}

/// `e^x` for `x ≤ 0` lane-wise ([`exp_in_range`]): 0 at or below −87.3 (and for −inf), NaN
/// stays NaN. The softmax weights of the attention kernels.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn exp_neg(x: __m256) -> __m256 {
    let min = _mm256_set1_ps(-87.3);
    // max(min, x) returns x when x is NaN, so NaN propagates.
    let out = exp_in_range(_mm256_max_ps(min, x));
    // Lanes at or below the minimum (including -inf) are exactly 0.
    _mm256_andnot_ps(_mm256_cmp_ps(x, min, _CMP_LE_OQ), out)
}
