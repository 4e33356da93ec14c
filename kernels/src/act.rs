//! Fused CPU activation of the feed-forward block: SwiGLU over the host output of the fused
//! gate/up projection, in one pass (burn's `silu(gate) * up` makes a pass and an allocation per
//! operation and calls libm's `expf` per element).
//!
//! # Source
//! Shazeer 2020, "GLU Variants Improve Transformer", eq. 6 (SwiGLU with β = 1):
//! `silu(g) · u`, `silu(g) = g / (1 + e^{−g})` (transformers' `LlamaMLP`, `ACT2FN["silu"]`).


use crate::error::{Error, Result};
use crate::quant::Isa;

/// Rows per rayon task (a row of SmolLM2 is 1,536 values).
const ROWS_PER_TASK: usize = 16;

/// `out[t, j] = silu(gu[t, j]) · gu[t, i + j]`.
///
/// # Shapes
/// - `gu`: `[n, 2 · i]` row-major, the gate then the up projection of each token (the fused
///   `gate_up` linear's output);
/// - `out`: `[n, i]`, overwritten.
///
/// Relative error against the exact value: a few f32 ulps (AVX2: Cephes' `expf` polynomial,
/// about 1e-7 relative; portable: `f32::exp`). Elementwise, so a row's result does not depend
/// on the other rows.
///
/// # Errors
/// [`Error::Length`] if `gu.len() != 2 · n · i` or `out.len() != n · i`.
pub fn swiglu(gu: &[f32], n: usize, i: usize, out: &mut [f32]) -> Result<()> {
    if gu.len() != 2 * n * i {
        return Err(Error::Length { what: "swiglu gate_up", expected: 2 * n * i, actual: gu.len() });
    }
    if out.len() != n * i {
        return Err(Error::Length { what: "swiglu out", expected: n * i, actual: out.len() });
    }
    if i == 0 {
        return Ok(());
    }
    let isa = Isa::detect();
    let row = |(r, o): (usize, &mut [f32])| {
        let (g, u) = gu[2 * i * r..2 * i * (r + 1)].split_at(i);
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Isa::detect` found AVX2 and FMA; `g`, `u` and `o` all hold `i` values.
            Isa::Avx2 | Isa::Avx512 => unsafe { x86::swiglu_row(g, u, o) },
            _ => scalar_row(g, u, o),
        }
    };
    let per_task = ROWS_PER_TASK * i;
    if n > ROWS_PER_TASK {
        crate::team::par_chunks_mut(out, per_task, |c, o| {
            for (k, orow) in o.chunks_mut(i).enumerate() {
                row((c * ROWS_PER_TASK + k, orow));
            }
        });
    } else {
        out.chunks_mut(i).enumerate().for_each(row);
    }
    Ok(())
}

fn scalar_row(g: &[f32], u: &[f32], o: &mut [f32]) {
    for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
        *o = g / (1.0 + (-g).exp()) * u;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// `e^x` lane-wise for any `x` ([`crate::simd::exp_in_range`]): below −87.3 the result is
    /// `e^−87.3` (the caller only uses `1 + e^x`, where that is 1), above 88.3 it is +inf;
    /// NaN stays NaN.
    #[inline(always)]
    unsafe fn exp(x: __m256) -> __m256 {
        // SAFETY (whole body): register-only AVX2/FMA instructions (the caller's target features).
        unsafe {
            let big = _mm256_cmp_ps(x, _mm256_set1_ps(88.3), _CMP_GT_OQ);
            // max(lo, x) / min(hi, x) return x when x is NaN.
            let x = _mm256_min_ps(_mm256_set1_ps(88.3), _mm256_max_ps(_mm256_set1_ps(-87.3), x));
            // Above the clamp e^x overflows f32: +inf, as `f32::exp`.
            _mm256_blendv_ps(crate::simd::exp_in_range(x), _mm256_set1_ps(f32::INFINITY), big)
        }
    }

    /// One row of [`super::swiglu`].
    ///
    /// # Safety
    /// AVX2 and FMA must be available; `g`, `u`, `o` have the same length.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn swiglu_row(g: &[f32], u: &[f32], o: &mut [f32]) {
        let n = o.len();
        let mut j = 0;
        // SAFETY: every access is at `j .. j + 8 <= n` of the three equal-length slices.
        unsafe {
            let one = _mm256_set1_ps(1.0);
            let sign = _mm256_set1_ps(-0.0);
            while j + 8 <= n {
                let gv = _mm256_loadu_ps(g.as_ptr().add(j));
                let uv = _mm256_loadu_ps(u.as_ptr().add(j));
                let den = _mm256_add_ps(one, exp(_mm256_xor_ps(gv, sign)));
                _mm256_storeu_ps(o.as_mut_ptr().add(j), _mm256_mul_ps(_mm256_div_ps(gv, den), uv));
                j += 8;
            }
        }
        super::scalar_row(&g[j..], &u[j..], &mut o[j..]);
    }
}
