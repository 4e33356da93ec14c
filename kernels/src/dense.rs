//! f32 matrix products with a host weight kept in the transposed `[in, out]` layout (the layout
//! of deco's dense linears, `y = x · w`), for F32 GGUF files and Hugging Face checkpoints on the
//! CPU.
//!
//! - Few tokens (decode, speculative verification; `n ≤` [`SMALL_N`]): a streaming kernel,
//!   split over the inner dimension: each rayon task reads a contiguous run of weight rows once,
//!   in order, and adds `x[t, i] · w[i, ..]` to its own `[n, out]` partial sums (an AXPY per
//!   row and token, vectorized for AVX2 + FMA); the partials are added in task order. Every
//!   weight is read once per call, at the streaming rate of DRAM; the `gemm` crate instead
//!   packs the weight panel before it multiplies, which reads it twice and writes it once.
//! - More tokens (prefill): the `gemm` crate (the f32 micro-kernels burn-flex uses), one call
//!   per rayon task on its range of output columns.
//!
//! A token's result depends on which path ran (the summation orders differ by f32 rounding),
//! not on the other tokens of the call within a path.

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::quant::{Isa, SyncPtr};

/// Most tokens for the streaming kernel.
pub const SMALL_N: usize = 4;

/// Output columns per task of the `gemm` path and of the partial-sum reduction, at least.
const MIN_COLS: usize = 256;

/// `y[n, out] = x[n, inner] · w[inner, out]`, all row-major f32.
///
/// # Shapes
/// - `x`: `[n, inner]`
/// - `w`: `[inner, out]` (the transposed weight of `nn.Linear`'s `[out, inner]`)
/// - `y`: `[n, out]`, overwritten
///
/// # Errors
/// [`Error::Length`] when a slice does not have the length its shape implies.
pub fn matmul(x: &[f32], n: usize, w: &[f32], inner: usize, out: usize, y: &mut [f32]) -> Result<()> {
    if x.len() != n * inner {
        return Err(Error::Length { what: "dense x", expected: n * inner, actual: x.len() });
    }
    if w.len() != inner * out {
        return Err(Error::Length { what: "dense w", expected: inner * out, actual: w.len() });
    }
    if y.len() != n * out {
        return Err(Error::Length { what: "dense y", expected: n * out, actual: y.len() });
    }
    if n == 0 || out == 0 {
        return Ok(());
    }
    let threads = rayon::current_num_threads().max(1);
    let cols = out.div_ceil(4 * threads).next_multiple_of(8).max(MIN_COLS).min(out);
    let yp = SyncPtr(y.as_mut_ptr());
    if n <= SMALL_N {
        // Split-K: task k sums weight rows k·kc .. (k+1)·kc, a contiguous stretch of memory
        // that the hardware prefetcher streams; the partial sums are then added in task order.
        // The cut depends on the shape and the thread count only, not on `n`.
        let kc = inner.div_ceil(4 * threads).max(16).min(inner);
        let tasks = inner.div_ceil(kc);
        let isa = Isa::detect();
        let mut part = vec![0.0f32; tasks * n * out];
        part.par_chunks_mut(n * out).enumerate().for_each(|(k, acc)| {
            let rows = k * kc..((k + 1) * kc).min(inner);
            match isa {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `Isa::detect` found AVX2 and FMA.
                Isa::Avx2 | Isa::Avx512 => unsafe { stream_avx2(x, n, w, inner, out, rows, acc) },
                _ => stream(x, n, w, inner, out, rows, acc),
            }
        });
        y.par_chunks_mut(cols).enumerate().for_each(|(ci, yc)| {
            // `y` is [n, out]; chunk ci covers flat indices ci·cols ..; add the partials there.
            let start = ci * cols;
            for (j, v) in yc.iter_mut().enumerate() {
                let mut sum = 0.0f32;
                for k in 0..tasks {
                    sum += part[k * n * out + start + j];
                }
                *v = sum;
            }
        });
        return Ok(());
    }
    (0..out.div_ceil(cols)).into_par_iter().for_each(|ci| {
        let c0 = ci * cols;
        let c1 = (c0 + cols).min(out);
        // SAFETY: dst is columns c0 .. c1 of y (row stride `out`), which only this task
        // writes; lhs is x (row stride `inner`), rhs columns c0 .. c1 of w (row stride `out`).
        unsafe {
            gemm::gemm(
                n,
                c1 - c0,
                inner,
                yp.get().add(c0),
                1,
                out as isize,
                false,
                x.as_ptr(),
                1,
                inner as isize,
                w.as_ptr().add(c0),
                1,
                out as isize,
                0.0f32,
                1.0f32,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
    });
    Ok(())
}

/// Side of the square blocks of [`gram`].
const GRAM_BLOCK: usize = 128;

/// The Gram matrix `xᵀ x` of `n` rows of `cols` features, f32 products accumulated in f32 by
/// the `gemm` crate (what a device `xᵀ · x` matmul computes).
///
/// Symmetric rank-k update (BLAS `ssyrk`): only the `128 × 128` blocks on and below the
/// diagonal are multiplied (about half the `n · cols²` multiply-adds of a full product), in
/// parallel over the blocks, then mirrored. Used for the calibration Hessians of GPTQ and
/// SparseGPT (`H = 2 XᵀX / n`).
///
/// # Shapes
/// - `x`: `[n, cols]`
/// - returns `[cols, cols]`, symmetric
///
/// # Errors
/// [`Error::Length`] when `x.len() != n · cols`.
pub fn gram(x: &[f32], n: usize, cols: usize) -> Result<Vec<f32>> {
    if x.len() != n * cols {
        return Err(Error::Length { what: "gram x", expected: n * cols, actual: x.len() });
    }
    let mut g = vec![0.0f32; cols * cols];
    if n == 0 || cols == 0 {
        return Ok(g);
    }
    let nb = cols.div_ceil(GRAM_BLOCK);
    let blocks: Vec<(usize, usize)> = (0..nb).flat_map(|i| (0..=i).map(move |j| (i, j))).collect();
    let gp = SyncPtr(g.as_mut_ptr());
    blocks.into_par_iter().for_each(|(bi, bj)| {
        let (i0, j0) = (bi * GRAM_BLOCK, bj * GRAM_BLOCK);
        let (mi, mj) = (GRAM_BLOCK.min(cols - i0), GRAM_BLOCK.min(cols - j0));
        // SAFETY: dst is the block rows i0..i0+mi × cols j0..j0+mj of g (row stride cols),
        // written by this task only; lhs is columns i0.. of x read transposed (element (i, t)
        // at x[t·cols + i0 + i]), rhs columns j0.. of x (element (t, j) at x[t·cols + j0 + j]).
        unsafe {
            gemm::gemm(
                mi,
                mj,
                n,
                gp.get().add(i0 * cols + j0),
                1,
                cols as isize,
                false,
                x.as_ptr().add(i0),
                cols as isize,
                1,
                x.as_ptr().add(j0),
                1,
                cols as isize,
                0.0f32,
                1.0f32,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
    });
    for i in 0..cols {
        for j in i + 1..cols {
            g[i * cols + j] = g[j * cols + i];
        }
    }
    Ok(g)
}

/// The streaming loop over weight rows `rows`: `acc[t, ..] = Σ_{i ∈ rows} x[t, i] · w[i, ..]`
/// (`acc` is `[n, out]`, zero on entry).
#[inline(always)]
fn stream(x: &[f32], n: usize, w: &[f32], inner: usize, out: usize, rows: std::ops::Range<usize>, acc: &mut [f32]) {
    for i in rows {
        let wr = &w[i * out..(i + 1) * out];
        for t in 0..n {
            let xv = x[t * inner + i];
            for (a, &wv) in acc[t * out..(t + 1) * out].iter_mut().zip(wr) {
                *a += xv * wv;
            }
        }
    }
}

/// [`stream`] compiled for AVX2 + FMA (the AXPY loops vectorize).
///
/// # Safety
/// AVX2 and FMA must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn stream_avx2(x: &[f32], n: usize, w: &[f32], inner: usize, out: usize, rows: std::ops::Range<usize>, acc: &mut [f32]) {
    stream(x, n, w, inner, out, rows, acc);
}
