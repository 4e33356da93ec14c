//! f32 matrix products with a host weight kept in the transposed `[in, out]` layout (the layout
//! of deco's dense linears, `y = x · w`), for F32 GGUF files and Hugging Face checkpoints on the
//! CPU.
//!
//! - Few tokens (decode, speculative verification; `n ≤` [`SMALL_N`]): a streaming kernel,
//!   split over the inner dimension: each task reads a contiguous run of weight rows once, in
//!   order, and adds `x[t, i] · w[i, ..]` to its own `[n, out]` partial sums (AXPYs with FMA,
//!   eight weight rows per pass over the partial sums with AVX2); the partials are added in task
//!   order. Every
//!   weight is read once per call, at the streaming rate of DRAM; the `gemm` crate instead
//!   packs the weight panel before it multiplies, which reads it twice and writes it once.
//! - More tokens (prefill) with AVX-512: deco's own register-tiled kernel ([`gemm_avx512`]; the
//!   `gemm` crate's AVX-512 kernels need a nightly compiler, so on stable it runs AVX2 code on
//!   these CPUs): GotoBLAS/BLIS blocking (Goto & van de Geijn 2008; BLIS's Skylake-X sgemm
//!   micro-kernel shape, transposed for a row-major `y`), a 12-token × 32-column tile in 24
//!   vector accumulators: 220-250 GFLOP/s on 2 cores of an Intel Xeon with AVX-512, against
//!   140-170 for the `gemm` crate (`dense_bench`).
//! - More tokens with AVX2 + FMA (no AVX-512): the same blocking with a 6-token × 16-column
//!   tile in 12 vector accumulators (`gemm_avx2`, BLIS's Haswell sgemm kernel shape), which
//!   replaced the `gemm` crate there (on the AMD EPYC Zen 4 of 2026-12-07 with
//!   `DECO_KERNELS=avx2`, see `docs/performance.md`).
//! - Otherwise (no AVX2, other architectures): the `gemm` crate (the f32 micro-kernels
//!   burn-flex uses), one call per rayon task on its range of output columns.
//! - The Gram matrix `xᵀx` of the calibration Hessians ([`gram`]): the lower blocks on the same
//!   register tiles (AVX-512 or AVX2), else on the `gemm` crate.
//!
//! A token's result depends on which path ran (the summation orders differ by f32 rounding),
//! not on the other tokens of the call within the streaming, AVX-512 and AVX2 paths, nor on the
//! thread count.

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
    matmul_with(x, n, w, inner, out, y, Isa::detect())
}

/// [`matmul`] with an explicit instruction set (for tests and benchmarks: the AVX2 kernels on an
/// AVX-512 CPU); one this CPU lacks falls back to [`Isa::Scalar`] (the portable loop and the
/// `gemm` crate).
///
/// # Errors
/// As [`matmul`].
pub fn matmul_with(x: &[f32], n: usize, w: &[f32], inner: usize, out: usize, y: &mut [f32], isa: Isa) -> Result<()> {
    let isa = if isa.is_available() { isa } else { Isa::Scalar };
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
    if inner == 0 {
        // An empty sum.
        y.fill(0.0);
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
        // The partial sums live in a buffer of the calling thread, reused across calls (no
        // allocation, page faults or zeroing per call: each task's first rows overwrite it).
        // (A call nested in another one on this thread, a task the pool ran while the caller
        // waited, gets a buffer of its own.)
        PARTIALS.with(|cell| {
            let mut own = Vec::new();
            let mut kept = cell.try_borrow_mut().ok();
            let part = match kept.as_deref_mut() {
                Some(v) => v,
                None => &mut own,
            };
            if part.len() < tasks * n * out {
                part.resize(tasks * n * out, 0.0);
            }
            let part = &mut part[..tasks * n * out];
            crate::team::par_chunks_mut(part, n * out, |k, acc| {
                let rows = k * kc..((k + 1) * kc).min(inner);
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: AVX2 and FMA are available (`isa` was checked above).
                    Isa::Avx2 | Isa::Avx512 => unsafe { stream_avx2(x, n, w, inner, out, rows, acc) },
                    _ => {
                        acc.fill(0.0);
                        stream(x, n, w, inner, out, rows, acc)
                    }
                }
            });
            let part = &*part;
            crate::team::par_chunks_mut(y, cols, |ci, yc| {
                // `y` is [n, out]; chunk ci covers flat indices ci·cols ..; add the partials there,
                // one partial at a time over the chunk (vectorized), per element in task order
                // from 0.0 as a running sum would.
                let start = ci * cols;
                let len = yc.len();
                for (v, &p) in yc.iter_mut().zip(&part[start..start + len]) {
                    *v = 0.0 + p;
                }
                for k in 1..tasks {
                    for (v, &p) in yc.iter_mut().zip(&part[k * n * out + start..k * n * out + start + len]) {
                        *v += p;
                    }
                }
            });
        });
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    match isa {
        // SAFETY: AVX-512 F is available (checked above); the lengths were checked above.
        Isa::Avx512 => {
            unsafe { gemm_avx512(x, n, w, inner, out, y) };
            return Ok(());
        }
        // SAFETY: AVX2 and FMA are available (checked above); the lengths were checked above.
        Isa::Avx2 => {
            unsafe { gemm_avx2(x, n, w, inner, out, y) };
            return Ok(());
        }
        Isa::Scalar => {}
    }
    crate::team::par_for(out.div_ceil(cols), |ci| {
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

/// Side of the square blocks of [`gram`] on the `gemm` crate's path.
const GRAM_BLOCK: usize = 128;

/// The Gram matrix `xᵀ x` of `n` rows of `cols` features, f32 products accumulated in f32.
///
/// Symmetric rank-k update (BLAS `ssyrk`): only the blocks on and below the diagonal are
/// multiplied (about half the `n · cols²` multiply-adds of a full product), in parallel over the
/// blocks, then mirrored. With AVX-512 or AVX2 the blocks are `192 × 192` and run on deco's
/// register tiles ([`gemm_avx512`]'s 12 × 32 or [`gemm_avx2`]'s 6 × 16, with `x`'s columns
/// packed as the broadcast side; strips wholly above the diagonal skipped); otherwise
/// `128 × 128` blocks on the `gemm` crate. Used for the calibration Hessians of GPTQ and
/// SparseGPT (`H = 2 XᵀX / n`).
///
/// # Shapes
/// - `x`: `[n, cols]`
/// - returns `[cols, cols]`, symmetric
///
/// # Errors
/// [`Error::Length`] when `x.len() != n · cols`.
pub fn gram(x: &[f32], n: usize, cols: usize) -> Result<Vec<f32>> {
    gram_with(x, n, cols, Isa::detect())
}

/// [`gram`] with an explicit instruction set (for tests and benchmarks); one this CPU lacks
/// falls back to [`Isa::Scalar`] (the `gemm` crate).
///
/// # Errors
/// As [`gram`].
pub fn gram_with(x: &[f32], n: usize, cols: usize, isa: Isa) -> Result<Vec<f32>> {
    let isa = if isa.is_available() { isa } else { Isa::Scalar };
    if x.len() != n * cols {
        return Err(Error::Length { what: "gram x", expected: n * cols, actual: x.len() });
    }
    let mut g = vec![0.0f32; cols * cols];
    if n == 0 || cols == 0 {
        return Ok(g);
    }
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Scalar {
        // SAFETY: `isa` is available: AVX-512 F, or AVX2 and FMA; `x` is `n · cols`, `g` is
        // `cols · cols`.
        unsafe {
            if isa == Isa::Avx512 {
                gram_tiled::<MR, NR>(x, n, cols, &mut g, tile_avx512);
            } else {
                gram_tiled::<MR_AVX2, NR_AVX2>(x, n, cols, &mut g, tile_avx2);
            }
        }
        mirror_lower(&mut g, cols);
        return Ok(g);
    }
    // Elsewhere every instruction set runs the `gemm` crate.
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
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
    mirror_lower(&mut g, cols);
    Ok(g)
}

/// Copies the strict lower triangle of the `[cols, cols]` matrix `g` onto its upper triangle.
pub(crate) fn mirror_lower(g: &mut [f32], cols: usize) {
    for i in 0..cols {
        for j in i + 1..cols {
            g[i * cols + j] = g[j * cols + i];
        }
    }
}

/// Copies columns `j0 .. j1` (at most `L`) of the row-major `x` (row stride `cols`) into the
/// rows of `L` floats of `dst`, zero past `j1`; a full width is a fixed-size copy.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn pack_columns<const L: usize>(x: &[f32], cols: usize, j0: usize, j1: usize, dst: &mut [f32]) {
    let w = j1 - j0;
    for (row, d) in x.chunks_exact(cols).zip(dst.chunks_exact_mut(L)) {
        if w == L {
            let src: &[f32; L] = row[j0..j1].try_into().expect("L columns");
            d.copy_from_slice(src);
        } else {
            d[..w].copy_from_slice(&row[j0..j1]);
            d[w..].fill(0.0);
        }
    }
}

/// Rows and columns of `xᵀx` per task of [`gram_tiled`]: 16 register tiles tall, 6 strips wide
/// with AVX-512 (32 and 12 with AVX2); SmolLM2's 576 and 1,536 features are 3 and 8 blocks.
#[cfg(target_arch = "x86_64")]
pub(crate) const GRAM_TILE: usize = 192;

/// The `(row block, column block)` pairs of [`GRAM_TILE`] blocks on and below the diagonal of a
/// `[cols, cols]` Gram matrix: the tasks of [`gram_tiled`] and of [`crate::bf16::gram`].
#[cfg(target_arch = "x86_64")]
pub(crate) fn lower_blocks(cols: usize) -> Vec<(usize, usize)> {
    let nb = cols.div_ceil(GRAM_TILE);
    (0..nb).flat_map(|i| (0..=i).map(move |j| (i, j))).collect()
}

/// The blocks on and below the diagonal of `g = xᵀ x` (`x` is `[n, cols]`, `g` is
/// `[cols, cols]`, zero on entry) on a register tile of `M` rows × `N` columns of `g`
/// ([`tile_avx512`]: 12 × 32, [`tile_avx2`]: 6 × 16): [`gemm_tiled`]'s blocking with the
/// features as both sides. Per [`KC`] tokens: first all of `x[pc .. pc + kc, ..]` is packed,
/// once, into `[KC][M]` panels (columns `m0 .. m0 + M`, zero past `cols`) and `N`-wide strips
/// (`[KC][N]`), in parallel over column ranges; then, one task per `GRAM_TILE` block of `g`,
/// `tile` multiplies each of the block's panels with every strip of the block not wholly above
/// the diagonal. Each output is `Σ` over the token blocks in order of one FMA chain per block,
/// independent of the thread count. The AVX2 tile replaced the `gemm` crate here on 2026-12-07
/// (GPTQ's Hessians on an AVX2-only Zen 3, `docs/performance.md`, twenty-fifth session); until
/// the twenty-sixth session every task packed its block's panels itself, gathering `M` floats
/// from each of `kc` rows `cols` floats apart once per block, 7 % of a GPTQ run there.
///
/// # Safety
/// The CPU runs `tile`, a tile of `M × N` (`M <= MR`, `N <= NR`, both dividing
/// [`GRAM_TILE`]); `x.len() == n · cols`, `g.len() == cols · cols`.
#[cfg(target_arch = "x86_64")]
unsafe fn gram_tiled<const M: usize, const N: usize>(x: &[f32], n: usize, cols: usize, g: &mut [f32], tile: TileFn) {
    debug_assert!(GRAM_TILE.is_multiple_of(M) && GRAM_TILE.is_multiple_of(N));
    let blocks = lower_blocks(cols);
    let gp = SyncPtr(g.as_mut_ptr());
    let (groups, strips) = (cols.div_ceil(M), cols.div_ceil(N));
    let mut panels = vec![0.0f32; groups * KC * M];
    let mut stripv = vec![0.0f32; strips * KC * N];
    for pc in (0..n).step_by(KC) {
        let kc = KC.min(n - pc);
        let xs = &x[pc * cols..(pc + kc) * cols];
        // Pack x[pc .. pc + kc, ..]: panel p holds columns p·M .., strip s columns s·N ..; a
        // task packs the panels and strips of GRAM_TILE columns (a few hundred KiB of x).
        let per_block_p = GRAM_TILE / M;
        let per_block_s = GRAM_TILE / N;
        panels
            .par_chunks_mut(per_block_p * KC * M)
            .zip(stripv.par_chunks_mut(per_block_s * KC * N))
            .enumerate()
            .for_each(|(b, (pp, ss))| {
                for (i, d) in pp.chunks_mut(KC * M).enumerate() {
                    let j0 = (b * per_block_p + i) * M;
                    pack_columns::<M>(xs, cols, j0, (j0 + M).min(cols), &mut d[..kc * M]);
                }
                for (i, d) in ss.chunks_mut(KC * N).enumerate() {
                    let j0 = (b * per_block_s + i) * N;
                    pack_columns::<N>(xs, cols, j0, (j0 + N).min(cols), &mut d[..kc * N]);
                }
            });
        let (panels, stripv) = (&panels, &stripv);
        blocks.par_iter().for_each(|&(bi, bj)| {
            let (r0, r1) = (bi * GRAM_TILE, ((bi + 1) * GRAM_TILE).min(cols));
            let (c0, c1) = (bj * GRAM_TILE, ((bj + 1) * GRAM_TILE).min(cols));
            for m0 in (r0..r1).step_by(M) {
                let mr = M.min(r1 - m0);
                let panel = &panels[(m0 / M) * KC * M..][..kc * M];
                for j0 in (c0..c1).step_by(N) {
                    if j0 >= m0 + mr {
                        // Wholly above the diagonal: mirrored from below afterwards.
                        break;
                    }
                    let nv = N.min(c1 - j0);
                    let strip = &stripv[(j0 / N) * KC * N..][..kc * N];
                    // SAFETY: rows m0 .. m0 + mr, columns j0 .. j0 + nv of g belong to this
                    // task's block only; the panel holds kc · M floats, the strip kc · N;
                    // the caller guarantees the CPU runs `tile`.
                    unsafe { tile(kc, panel.as_ptr(), 1, M, strip.as_ptr(), gp.get().add(m0 * cols + j0), cols, mr, nv, pc == 0) };
                }
            }
        });
    }
}

/// The streaming loop over weight rows `rows`: `acc[t, ..] = Σ_{i ∈ rows} x[t, i] · w[i, ..]`
/// (`acc` is `[n, out]`, zero on entry), the rows in order, each product added with one
/// rounding (`mul_add`), so the SIMD kernel below gives the same bits.
#[inline(always)]
fn stream(x: &[f32], n: usize, w: &[f32], inner: usize, out: usize, rows: std::ops::Range<usize>, acc: &mut [f32]) {
    for i in rows {
        let wr = &w[i * out..(i + 1) * out];
        for t in 0..n {
            let xv = x[t * inner + i];
            for (a, &wv) in acc[t * out..(t + 1) * out].iter_mut().zip(wr) {
                *a = xv.mul_add(wv, *a);
            }
        }
    }
}

/// [`stream`] with AVX2 + FMA, `acc` overwritten (its contents on entry are not read): eight
/// weight rows per pass over `acc` (then four, then [`stream`] for the last few), one load and
/// one store of `acc` per eight rows instead of per row, the first pass starting from zero
/// registers, 32 columns per step; per element the same FMAs in the same row order as
/// [`stream`] from a zero `acc`, so the same bits. Eight rows per pass streamed SmolLM2's 120
/// layer products 5-15 % faster than four on the AMD EPYC Zen 4 of 2026-12-07 (same task cut;
/// sixteen spill on AVX2 and were slower on AVX-512 too; `dense_bench 1`).
///
/// # Safety
/// AVX2 and FMA must be available; `x` is `[n, inner]`, `w` `[inner, out]`, `acc` `[n, out]`,
/// `rows` within `0..inner`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn stream_avx2(x: &[f32], n: usize, w: &[f32], inner: usize, out: usize, rows: std::ops::Range<usize>, acc: &mut [f32]) {
    debug_assert!(rows.end <= inner && w.len() >= inner * out && x.len() >= n * inner && acc.len() >= n * out);
    let mut i = rows.start;
    // SAFETY: AVX2 and FMA (the caller's contract); rows within `0..inner`, shapes as above.
    unsafe {
        i = stream_pass_avx2::<8>(x, n, w, inner, out, i..rows.end, i == rows.start, acc);
        i = stream_pass_avx2::<4>(x, n, w, inner, out, i..rows.end, i == rows.start, acc);
    }
    if i == rows.start {
        acc[..n * out].fill(0.0);
    }
    stream(x, n, w, inner, out, i..rows.end, acc);
}

/// The passes of [`stream_avx2`] over `R` weight rows at a time, from `rows.start` while `R`
/// rows are left; `first`: the first pass overwrites `acc`. Returns the first row not summed.
///
/// # Safety
/// As [`stream_avx2`].
#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop, clippy::too_many_arguments)] // `r` is the weight row: it indexes `xv` and offsets `wp`
#[target_feature(enable = "avx2,fma")]
unsafe fn stream_pass_avx2<const R: usize>(x: &[f32], n: usize, w: &[f32], inner: usize, out: usize, rows: std::ops::Range<usize>, first: bool, acc: &mut [f32]) -> usize {
    use std::arch::x86_64::*;
    let mut i = rows.start;
    while i + R <= rows.end {
        let first = first && i == rows.start;
        let wp = w[i * out..].as_ptr();
        for t in 0..n {
            let xs: [f32; R] = std::array::from_fn(|r| x[t * inner + i + r]);
            let xv = xs.map(|v| _mm256_set1_ps(v));
            let ap = acc[t * out..].as_mut_ptr();
            let mut j = 0;
            // SAFETY: columns j .. j + 32 (or + 8) < out of rows i .. i + R < inner and of
            // token t's accumulator are in bounds (the caller's shapes).
            unsafe {
                while j + 32 <= out {
                    for u in 0..4 {
                        let c = j + 8 * u;
                        let mut a = if first { _mm256_setzero_ps() } else { _mm256_loadu_ps(ap.add(c)) };
                        for r in 0..R {
                            a = _mm256_fmadd_ps(xv[r], _mm256_loadu_ps(wp.add(r * out + c)), a);
                        }
                        _mm256_storeu_ps(ap.add(c), a);
                    }
                    j += 32;
                }
                while j + 8 <= out {
                    let mut a = if first { _mm256_setzero_ps() } else { _mm256_loadu_ps(ap.add(j)) };
                    for r in 0..R {
                        a = _mm256_fmadd_ps(xv[r], _mm256_loadu_ps(wp.add(r * out + j)), a);
                    }
                    _mm256_storeu_ps(ap.add(j), a);
                    j += 8;
                }
                for c in j..out {
                    let mut a = if first { 0.0 } else { *ap.add(c) };
                    for r in 0..R {
                        a = xs[r].mul_add(*wp.add(r * out + c), a);
                    }
                    *ap.add(c) = a;
                }
            }
        }
        i += R;
    }
    i
}

/// Tokens per register tile of [`gemm_avx512`] and of [`crate::bf16`] (the broadcast side).
#[cfg(target_arch = "x86_64")]
pub(crate) const MR: usize = 12;
/// Output columns per register tile of [`gemm_avx512`] and of [`crate::bf16`] (two 16-lane
/// vectors; also the width of [`crate::bf16::PackedBf16`]'s strips on every architecture).
pub(crate) const NR: usize = 32;
/// Inner-dimension block: the `MR × KC` token rows (27 KiB) stay in L1 while the weight strips
/// stream past them from L2; SmolLM2's 576-wide projections take one block (measured against
/// 256, 384 and 768 with `dense_bench`, Intel Xeon with AVX-512, 2 threads: 384 gave 222-236
/// GFLOP/s, 576 gave 235-250).
#[cfg(target_arch = "x86_64")]
pub(crate) const KC: usize = 576;
/// Output columns per packed weight block: `KC × NC` floats (1.1 MiB) stay in L2.
#[cfg(target_arch = "x86_64")]
pub(crate) const NC: usize = 512;

/// Runs `f(t0, t1, c0, c1)` in parallel for the tasks that cut a `[n, out]` output of the
/// register-tiled kernels (this module's and [`crate::bf16`]'s) into token ranges (multiples of
/// [`MR`]) × column ranges (multiples of [`NR`], at least 128): at least 4 tasks per thread.
/// The cut depends on the shape and the thread count; the kernels' sums do not depend on it.
#[cfg(target_arch = "x86_64")]
pub(crate) fn par_output_tiles(n: usize, out: usize, f: impl Fn(usize, usize, usize, usize) + Sync) {
    par_output_tiles_of(n, out, MR, NR, f);
}

/// [`par_output_tiles`] for register tiles of `mr` tokens × `nr` columns.
#[cfg(target_arch = "x86_64")]
pub(crate) fn par_output_tiles_of(n: usize, out: usize, mr: usize, nr: usize, f: impl Fn(usize, usize, usize, usize) + Sync) {
    let threads = rayon::current_num_threads().max(1);
    let target = 4 * threads;
    let col_chunk = out.div_ceil(target).next_multiple_of(nr).max(128).min(out.next_multiple_of(nr));
    let col_tasks = out.div_ceil(col_chunk);
    let tok_tasks = target.div_ceil(col_tasks).min(n.div_ceil(mr)).max(1);
    let tok_chunk = n.div_ceil(tok_tasks).next_multiple_of(mr);
    let tok_tasks = n.div_ceil(tok_chunk);
    crate::team::par_for(tok_tasks * col_tasks, |task| {
        let (ti, ci) = (task / col_tasks, task % col_tasks);
        f(ti * tok_chunk, ((ti + 1) * tok_chunk).min(n), ci * col_chunk, ((ci + 1) * col_chunk).min(out));
    });
}

/// The signature of a register tile of [`gemm_tiled`]: `tile(kc, a, rs, cs, wp, y, ldy, mr, nv,
/// first)`, see [`tile_avx512`].
#[cfg(target_arch = "x86_64")]
type TileFn = unsafe fn(usize, *const f32, usize, usize, *const f32, *mut f32, usize, usize, usize, bool);

/// `y = x · w` for `n > SMALL_N` with AVX-512 F (see [`matmul`] for the shapes): [`gemm_tiled`]
/// with [`tile_avx512`] (12 tokens × 32 columns).
///
/// # Safety
/// AVX-512 F must be available; `x`, `w`, `y` must have the lengths `matmul` checks.
#[cfg(target_arch = "x86_64")]
unsafe fn gemm_avx512(x: &[f32], n: usize, w: &[f32], inner: usize, out: usize, y: &mut [f32]) {
    // SAFETY: forwarded; `tile_avx512` is a tile of MR × NR.
    unsafe { gemm_tiled::<MR, NR>(x, n, w, inner, out, y, tile_avx512) }
}

/// `y = x · w` for `n > SMALL_N` with AVX2 + FMA: [`gemm_tiled`] with [`tile_avx2`] (6 tokens ×
/// 16 columns in 12 of the 16 vector registers, the shape of BLIS's Haswell sgemm kernel).
///
/// # Safety
/// AVX2 and FMA must be available; `x`, `w`, `y` must have the lengths `matmul` checks.
#[cfg(target_arch = "x86_64")]
unsafe fn gemm_avx2(x: &[f32], n: usize, w: &[f32], inner: usize, out: usize, y: &mut [f32]) {
    // SAFETY: forwarded; `tile_avx2` is a tile of MR_AVX2 × NR_AVX2.
    unsafe { gemm_tiled::<MR_AVX2, NR_AVX2>(x, n, w, inner, out, y, tile_avx2) }
}

/// Tokens × columns of [`tile_avx2`].
#[cfg(target_arch = "x86_64")]
const MR_AVX2: usize = 6;
#[cfg(target_arch = "x86_64")]
const NR_AVX2: usize = 16;

/// The blocked product of [`gemm_avx512`] and [`gemm_avx2`], for register tiles of `M` tokens ×
/// `N` columns (`M <= MR`).
///
/// Work is cut into tasks over (token range, column range), at least 4 per thread. In a task,
/// for each block of [`NC`] columns and [`KC`] inner rows: the weight block is packed into
/// strips of `N` columns (`[KC][N]`, zero-padded), then each group of `M` tokens is multiplied
/// with every strip by `tile`, reading the tokens' rows in place (the last, partial group
/// packed with zero rows). Every output is `Σ` over the inner blocks in order of one FMA chain
/// per block, so its bits depend on neither the tiling, the other tokens nor the thread count.
///
/// # Safety
/// The CPU runs `tile`, a tile of `M × N`; `x`, `w`, `y` must have the lengths `matmul` checks.
#[cfg(target_arch = "x86_64")]
unsafe fn gemm_tiled<const M: usize, const N: usize>(x: &[f32], n: usize, w: &[f32], inner: usize, out: usize, y: &mut [f32], tile: TileFn) {
    let yp = SyncPtr(y.as_mut_ptr());
    par_output_tiles_of(n, out, M, N, |t0, t1, c0, c1| {
        PANELS.with(|panels| {
            let mut panels = panels.borrow_mut();
            let (wp, xp) = &mut *panels;
            wp.resize(KC * NC, 0.0);
            xp.resize(KC * M, 0.0);
            for nc0 in (c0..c1).step_by(NC) {
                let nc1 = (nc0 + NC).min(c1);
                let strips = (nc1 - nc0).div_ceil(N);
                for pc in (0..inner).step_by(KC) {
                    let kc = KC.min(inner - pc);
                    // Pack w[pc .. pc + kc, nc0 .. nc1] into strips [s][k][N], zero past nc1.
                    for s in 0..strips {
                        let (j0, j1) = (nc0 + s * N, (nc0 + (s + 1) * N).min(nc1));
                        let strip = &mut wp[s * KC * N..s * KC * N + kc * N];
                        pack_columns::<N>(&w[pc * out..(pc + kc) * out], out, j0, j1, strip);
                    }
                    for m0 in (t0..t1).step_by(M) {
                        let mr = M.min(t1 - m0);
                        // A full group of tokens is read in place (row stride `inner`); the last,
                        // partial group is packed transposed into [k][M] with zero rows past mr.
                        let (a, rs, cs) = if mr == M {
                            (x[m0 * inner + pc..].as_ptr(), inner, 1)
                        } else {
                            for i in 0..M {
                                for k in 0..kc {
                                    xp[k * M + i] = if i < mr { x[(m0 + i) * inner + pc + k] } else { 0.0 };
                                }
                            }
                            (xp.as_ptr(), 1, M)
                        };
                        for s in 0..strips {
                            let j0 = nc0 + s * N;
                            let nv = N.min(nc1 - j0);
                            // SAFETY: rows m0 .. m0 + mr, columns j0 .. j0 + nv of y belong to this
                            // task only; `a` reaches M rows of kc values (x's rows m0 .. m0 + M,
                            // or the packed panel), the weight strip kc · N floats; the caller
                            // guarantees the CPU runs `tile`.
                            unsafe { tile(kc, a, rs, cs, wp.as_ptr().add(s * KC * N), yp.get().add(m0 * out + j0), out, mr, nv, pc == 0) };
                        }
                    }
                }
            }
        });
    });
}

thread_local! {
    /// The split-K partial sums of [`matmul`]'s streaming path (every architecture),
    /// `[tasks, n, out]`, kept by the calling thread between calls.
    static PARTIALS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// The packed weight block (`KC × NC`) and token panel (`KC × MR`) of [`gemm_avx512`], one
    /// pair per worker thread, reused across calls (a fresh 1.1 MiB block per task cost page
    /// faults and zeroing comparable to a small projection's arithmetic). Every element a tile
    /// reads is written first in the same task, padding included.
    static PANELS: std::cell::RefCell<(Vec<f32>, Vec<f32>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// One register tile: `acc[i, j] = Σ_k a[i·rs + k·cs] · wp[k, j]` for `MR × NR` outputs (one
/// FMA chain each, in `k` order), then `y[i, j] = acc` (`first`) or `y[i, j] += acc` for the
/// first `mr` rows and `nv` columns (masked stores).
///
/// # Safety
/// AVX-512 F; `a[i·rs + k·cs]` is readable for `i < MR`, `k < kc`; `wp` holds `kc · NR` floats;
/// `y` (row stride `ldy`) is writable for `mr` rows of `nv` columns.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_avx512(kc: usize, a: *const f32, rs: usize, cs: usize, wp: *const f32, y: *mut f32, ldy: usize, mr: usize, nv: usize, first: bool) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    // SAFETY: i < MR rows of `a`.
    let rows: [*const f32; MR] = std::array::from_fn(|i| unsafe { a.add(i * rs) });
    for k in 0..kc {
        // SAFETY (whole block): k < kc, so the reads stay inside `a` and the packed strip.
        unsafe {
            let b0 = _mm512_loadu_ps(wp.add(k * NR));
            let b1 = _mm512_loadu_ps(wp.add(k * NR + 16));
            for (row, p) in acc.iter_mut().zip(rows) {
                let ai = _mm512_set1_ps(*p.add(k * cs));
                row[0] = _mm512_fmadd_ps(ai, b0, row[0]);
                row[1] = _mm512_fmadd_ps(ai, b1, row[1]);
            }
        }
    }
    // SAFETY: forwarded from the caller.
    unsafe { store_tile(&acc, y, ldy, mr, nv, first) };
}

/// [`tile_avx512`] with AVX2 + FMA for a tile of [`MR_AVX2`] tokens × [`NR_AVX2`] columns:
/// `acc[i, j] = Σ_k a[i·rs + k·cs] · wp[k, j]` (one FMA chain each, in `k` order), then
/// `y[i, j] = acc` (`first`) or `y[i, j] += acc` for the first `mr` rows and `nv` columns.
///
/// # Safety
/// AVX2 and FMA; `a[i·rs + k·cs]` is readable for `i < MR_AVX2`, `k < kc`; `wp` holds
/// `kc · NR_AVX2` floats; `y` (row stride `ldy`) is writable for `mr` rows of `nv` columns.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_avx2(kc: usize, a: *const f32, rs: usize, cs: usize, wp: *const f32, y: *mut f32, ldy: usize, mr: usize, nv: usize, first: bool) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm256_setzero_ps(); 2]; MR_AVX2];
    // SAFETY: i < MR_AVX2 rows of `a`.
    let rows: [*const f32; MR_AVX2] = std::array::from_fn(|i| unsafe { a.add(i * rs) });
    for k in 0..kc {
        // SAFETY (whole block): k < kc, so the reads stay inside `a` and the packed strip.
        unsafe {
            let b0 = _mm256_loadu_ps(wp.add(k * NR_AVX2));
            let b1 = _mm256_loadu_ps(wp.add(k * NR_AVX2 + 8));
            for (row, p) in acc.iter_mut().zip(rows) {
                let ai = _mm256_set1_ps(*p.add(k * cs));
                row[0] = _mm256_fmadd_ps(ai, b0, row[0]);
                row[1] = _mm256_fmadd_ps(ai, b1, row[1]);
            }
        }
    }
    // SAFETY: forwarded from the caller.
    unsafe { store_tile_avx2(&acc, y, ldy, mr, nv, first) };
}

/// The end of an AVX2 register tile of `M` rows × 16 columns ([`tile_avx2`],
/// [`crate::int16`]'s): `y[i, j] = acc[i, j]` (`first`) or `y[i, j] += acc[i, j]` for the first
/// `mr` rows and `nv` columns (a full row with two vector stores, a partial one through a local
/// copy).
///
/// # Safety
/// AVX2; `y` (row stride `ldy`) writable for `mr <= M` rows of `nv <= 16` columns.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(crate) unsafe fn store_tile_avx2<const M: usize>(acc: &[[std::arch::x86_64::__m256; 2]; M], y: *mut f32, ldy: usize, mr: usize, nv: usize, first: bool) {
    use std::arch::x86_64::*;
    let mut tmp = [0.0f32; 16];
    for (i, row) in acc.iter().enumerate().take(mr) {
        // SAFETY: row i < mr of y, columns below nv (the caller's contract); `tmp` is local.
        unsafe {
            let p = y.add(i * ldy);
            if nv == 16 {
                let (mut v0, mut v1) = (row[0], row[1]);
                if !first {
                    v0 = _mm256_add_ps(_mm256_loadu_ps(p), v0);
                    v1 = _mm256_add_ps(_mm256_loadu_ps(p.add(8)), v1);
                }
                _mm256_storeu_ps(p, v0);
                _mm256_storeu_ps(p.add(8), v1);
            } else {
                _mm256_storeu_ps(tmp.as_mut_ptr(), row[0]);
                _mm256_storeu_ps(tmp.as_mut_ptr().add(8), row[1]);
                for (j, &v) in tmp.iter().enumerate().take(nv) {
                    *p.add(j) = if first { v } else { *p.add(j) + v };
                }
            }
        }
    }
}

/// The end of a register tile ([`tile_avx512`], [`crate::bf16`]'s): `y[i, j] = acc[i, j]`
/// (`first`) or `y[i, j] += acc[i, j]` for the first `mr` rows and `nv` columns (masked loads
/// and stores).
///
/// # Safety
/// AVX-512 F; `y` (row stride `ldy`) writable for `mr <= MR` rows of `nv <= NR` columns.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) unsafe fn store_tile(acc: &[[std::arch::x86_64::__m512; 2]; MR], y: *mut f32, ldy: usize, mr: usize, nv: usize, first: bool) {
    use std::arch::x86_64::*;
    let m0: __mmask16 = if nv >= 16 { 0xFFFF } else { (1u16 << nv) - 1 };
    let m1: __mmask16 = if nv >= 32 { 0xFFFF } else if nv > 16 { (1u16 << (nv - 16)) - 1 } else { 0 };
    for (i, row) in acc.iter().enumerate().take(mr) {
        // SAFETY: row i < mr of y, columns masked to nv.
        unsafe {
            let p = y.add(i * ldy);
            let (mut v0, mut v1) = (row[0], row[1]);
            if !first {
                v0 = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, p), v0);
                v1 = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, p.wrapping_add(16)), v1);
            }
            _mm512_mask_storeu_ps(p, m0, v0);
            // With nv ≤ 16 the mask is empty and nothing is accessed there.
            _mm512_mask_storeu_ps(p.wrapping_add(16), m1, v1);
        }
    }
}
