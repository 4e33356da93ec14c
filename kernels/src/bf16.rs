//! Matrix products with bf16 inputs and f32 accumulation (AVX-512 BF16 `vdpbf16ps`), for the
//! calibration passes of the compression jobs (GPTQ, AWQ, SparseGPT, Wanda), whose forwards over
//! tens of thousands of tokens and Hessians `XᵀX` are ~10 TFLOP for SmolLM2-135M.
//!
//! `vdpbf16ps` multiplies pairs of bf16 values and adds both products to an f32 lane: twice the
//! multiply-adds per instruction of an f32 FMA at the same throughput (measured on Zen 4: 235
//! against 117 GFLOP/s per core for the same 12 × 32 register tile). The inputs are rounded to
//! bf16 (8 significant bits, round to nearest even: [`to_bf16_bits`]); every product of two
//! bf16 values is exact in f32 and the sums are f32, as the tensor cores' bf16 GEMMs and
//! PyTorch's CPU `autocast(dtype=torch.bfloat16)` compute them. The GPTQ and AWQ reference
//! implementations run their calibration forwards in the checkpoint's fp16 / bf16 on a GPU;
//! this module is deco's CPU counterpart, chosen by `deco quantize --calib-dtype`.
//!
//! The blocking is [`crate::dense`]'s AVX-512 kernel's (GotoBLAS/BLIS, a 12-token × 32-column
//! tile in 24 accumulators), with the inner dimension taken in pairs: a weight is packed once
//! ([`PackedBf16`]: strips of 32 columns, each 32-bit element holding the bf16 values of two
//! consecutive inner rows), the activations are converted once per call. Each output is `Σ`
//! over the inner blocks in order of one `vdpbf16ps` chain per block, so a token's bits depend
//! on neither the other tokens nor the thread count.
//!
//! Only x86-64 CPUs with AVX-512 F and AVX-512 BF16 run it ([`available`]); the callers keep
//! the f32 kernels elsewhere.

#[cfg(target_arch = "x86_64")]
use crate::dense::{GRAM_TILE, MR, NC, lower_blocks, mirror_lower, par_output_tiles, store_tile};
use crate::dense::NR;
use crate::error::{Error, Result};
#[cfg(target_arch = "x86_64")]
use crate::quant::{Isa, SyncPtr};

/// Inner pairs per block: the f32 kernel's [`crate::dense::KC`] values (576) as pairs, so a
/// 12-token panel is 13.5 KiB (L1) and a block of 16 strips 576 KiB (L2).
#[cfg(target_arch = "x86_64")]
const KCP: usize = crate::dense::KC / 2;

/// Whether this CPU runs the bf16 products: x86-64 with AVX-512 F and AVX-512 BF16, and
/// `DECO_KERNELS` not capping the kernels below AVX-512.
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        Isa::detect() == Isa::Avx512 && is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The bf16 bits of `x`, rounded to nearest even, as AVX-512 BF16's `vcvtneps2bf16` gives them:
/// subnormal inputs become zeros of their sign (the instruction treats them as zero), NaN stays
/// a quiet NaN.
#[inline(always)]
pub fn to_bf16_bits(x: f32) -> u16 {
    let u = x.to_bits();
    // Wrapping: only NaN bit patterns can overflow, and they are replaced below.
    let rounded = u.wrapping_add(0x7FFF + ((u >> 16) & 1)) >> 16;
    let r = if x.is_nan() { (u >> 16) | 0x40 } else { rounded };
    let r = if x.abs() < f32::MIN_POSITIVE { (u >> 16) & 0x8000 } else { r };
    r as u16
}

/// The f32 value of bf16 bits.
#[inline(always)]
pub fn from_bf16_bits(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// A pair of bf16 values as one 32-bit element: `lo` in the low half (the even inner index),
/// `hi` in the high half, the layout `vdpbf16ps` multiplies.
#[inline(always)]
fn pair(lo: f32, hi: f32) -> u32 {
    to_bf16_bits(lo) as u32 | (to_bf16_bits(hi) as u32) << 16
}

/// A weight `w[inner, out]` (the transposed `[in, out]` layout of [`crate::dense::matmul`])
/// rounded to bf16 and packed for [`matmul`]: strips of 32 output columns, each strip
/// `[inner / 2][32]` pairs (element `(p, j)` holds `w[2p, j]` low and `w[2p + 1, j]` high), zero
/// past `out` and, for an odd `inner`, past the last row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedBf16 {
    /// Input features.
    pub inner: usize,
    /// Output features.
    pub out: usize,
    /// `[strips][inner.div_ceil(2)][32]`.
    data: Vec<u32>,
}

impl PackedBf16 {
    /// Packs `w` (`[inner, out]` row-major f32).
    ///
    /// # Errors
    /// [`Error::Length`] when `w.len() != inner · out`.
    pub fn new(w: &[f32], inner: usize, out: usize) -> Result<Self> {
        if w.len() != inner * out {
            return Err(Error::Length { what: "bf16 weight", expected: inner * out, actual: w.len() });
        }
        let kp = inner.div_ceil(2);
        let strips = out.div_ceil(NR);
        let mut data = vec![0u32; strips * kp * NR];
        crate::team::par_chunks_mut(&mut data, (kp * NR).max(1), |s, strip| {
            let c0 = s * NR;
            for (p, row) in strip.chunks_exact_mut(NR).enumerate() {
                if c0 + NR <= out && 2 * p + 1 < inner {
                    // A whole strip row: two weight rows interleaved, vectorized.
                    let lo = &w[2 * p * out + c0..2 * p * out + c0 + NR];
                    let hi = &w[(2 * p + 1) * out + c0..(2 * p + 1) * out + c0 + NR];
                    convert_pairs(lo, Some(hi), row);
                    continue;
                }
                for (j, v) in row.iter_mut().enumerate() {
                    let c = c0 + j;
                    if c < out {
                        let lo = w[2 * p * out + c];
                        let hi = if 2 * p + 1 < inner { w[(2 * p + 1) * out + c] } else { 0.0 };
                        *v = pair(lo, hi);
                    }
                }
            }
        });
        Ok(Self { inner, out, data })
    }

    /// Packs the weight whose output row `o` (`[inner]`, the `[out, inner]` layout of a
    /// checkpoint's linear) `row(o, buf)` writes into `buf`: the same packing as [`Self::new`] of
    /// the transposed matrix, without an f32 copy of the whole weight. The strips are built in
    /// parallel, so `row` is called concurrently, once per output row, in no fixed order. For
    /// weights computed row by row (AWQ's scale candidates).
    pub fn from_rows(inner: usize, out: usize, row: impl Fn(usize, &mut [f32]) + Sync) -> Self {
        let kp = inner.div_ceil(2);
        let strips = out.div_ceil(NR);
        let mut data = vec![0u32; strips * kp * NR];
        crate::team::par_chunks_mut(&mut data, (kp * NR).max(1), |s, strip| {
            let mut buf = vec![0.0f32; inner];
            let mut pairs = vec![0u32; kp];
            for j in 0..NR.min(out - s * NR) {
                row(s * NR + j, &mut buf);
                convert_pairs(&buf, None, &mut pairs);
                for (p, &v) in pairs.iter().enumerate() {
                    strip[p * NR + j] = v;
                }
            }
        });
        Self { inner, out, data }
    }

    /// The weight as the products see it, `[inner, out]` f32 (each value rounded to bf16).
    pub fn unpack(&self) -> Vec<f32> {
        let kp = self.inner.div_ceil(2);
        let mut w = vec![0.0f32; self.inner * self.out];
        for (i, row) in w.chunks_exact_mut(self.out.max(1)).enumerate() {
            for (c, v) in row.iter_mut().enumerate() {
                let e = self.data[(c / NR) * kp * NR + (i / 2) * NR + c % NR];
                *v = from_bf16_bits(if i % 2 == 0 { e as u16 } else { (e >> 16) as u16 });
            }
        }
        w
    }
}

/// `y[n, out] = bf16(x)[n, inner] · bf16(w)[inner, out]`, f32 sums.
///
/// # Shapes
/// - `x`: `[n, inner]`
/// - `w`: packed from `[inner, out]`
/// - `y`: `[n, out]`, overwritten
///
/// # Errors
/// [`Error::Length`] for slices that do not match the shapes; [`Error::Unsupported`] on a CPU
/// without AVX-512 BF16 ([`available`]).
pub fn matmul(x: &[f32], n: usize, w: &PackedBf16, y: &mut [f32]) -> Result<()> {
    let (inner, out) = (w.inner, w.out);
    if x.len() != n * inner {
        return Err(Error::Length { what: "bf16 x", expected: n * inner, actual: x.len() });
    }
    if y.len() != n * out {
        return Err(Error::Length { what: "bf16 y", expected: n * out, actual: y.len() });
    }
    if !available() {
        return Err(Error::Unsupported("bf16 products need AVX-512 BF16".into()));
    }
    if n == 0 || out == 0 {
        return Ok(());
    }
    if inner == 0 {
        y.fill(0.0);
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    {
        let kp = inner.div_ceil(2);
        // Zeroed by every thread at once (tens of MB for a calibration pass).
        let mut xb = crate::team::zeroed(n * kp);
        convert_rows(x, n, inner, &mut xb);
        // SAFETY: `available` found AVX-512 F and BF16; the lengths were checked above.
        unsafe { matmul_avx512(&xb, n, kp, w, y) };
    }
    Ok(())
}

/// Rows of `x` (`[n, inner]`) as bf16 pairs (`[n, inner.div_ceil(2)]`), in parallel.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn convert_rows(x: &[f32], n: usize, inner: usize, xb: &mut [u32]) {
    let kp = inner.div_ceil(2);
    let rows = 64usize;
    crate::team::par_chunks_mut(xb, rows * kp, |ci, chunk| {
        for (r, dst) in chunk.chunks_exact_mut(kp).enumerate() {
            let t = ci * rows + r;
            convert_pairs(&x[t * inner..(t + 1) * inner], None, dst);
        }
    });
    debug_assert_eq!(xb.len(), n * kp);
}

/// `dst[p]` = the bf16 pair of `lo` and `hi` at the same index when `hi` is given (two rows
/// interleaved: `lo[p]` low, `hi[p]` high), else of `lo[2p]` and `lo[2p + 1]` (one row in
/// pairs; zero past an odd end). Values as [`to_bf16_bits`].
fn convert_pairs(lo: &[f32], hi: Option<&[f32]>, dst: &mut [u32]) {
    #[cfg(target_arch = "x86_64")]
    if available() {
        // SAFETY: `available` found AVX-512 F and BF16.
        unsafe { convert_pairs_avx512(lo, hi, dst) };
        return;
    }
    convert_pairs_scalar(lo, hi, dst);
}

fn convert_pairs_scalar(lo: &[f32], hi: Option<&[f32]>, dst: &mut [u32]) {
    match hi {
        Some(hi) => {
            for ((d, &l), &h) in dst.iter_mut().zip(lo).zip(hi) {
                *d = pair(l, h);
            }
        }
        None => {
            let mut pairs = lo.chunks_exact(2);
            for (d, p) in dst.iter_mut().zip(&mut pairs) {
                *d = pair(p[0], p[1]);
            }
            if let [last] = pairs.remainder() {
                dst[lo.len() / 2] = pair(*last, 0.0);
            }
        }
    }
}

/// [`convert_pairs`] with `vcvtneps2bf16`: 32 values of a row, or 16 of each of two rows, per
/// step; the tails as [`convert_pairs_scalar`].
///
/// # Safety
/// AVX-512 F and BF16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn convert_pairs_avx512(lo: &[f32], hi: Option<&[f32]>, dst: &mut [u32]) {
    use std::arch::x86_64::*;
    match hi {
        Some(hi) => {
            let n = lo.len().min(hi.len()).min(dst.len());
            let mut j = 0;
            while j + 16 <= n {
                // SAFETY: j + 16 <= the three lengths.
                unsafe {
                    let l: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(_mm512_loadu_ps(lo.as_ptr().add(j))));
                    let h: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(_mm512_loadu_ps(hi.as_ptr().add(j))));
                    let v = _mm512_or_si512(_mm512_cvtepu16_epi32(l), _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)));
                    _mm512_storeu_si512(dst.as_mut_ptr().add(j).cast(), v);
                }
                j += 16;
            }
            convert_pairs_scalar(&lo[j..n], Some(&hi[j..n]), &mut dst[j..n]);
        }
        None => {
            let mut j = 0;
            while j + 32 <= lo.len() {
                // SAFETY: values j .. j + 32 of `lo`, pairs j/2 .. j/2 + 16 of `dst` (the caller
                // gives `lo.len().div_ceil(2)` pairs). The low 16 bf16 come from the second
                // operand.
                unsafe {
                    let a = _mm512_loadu_ps(lo.as_ptr().add(j));
                    let b = _mm512_loadu_ps(lo.as_ptr().add(j + 16));
                    let v: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(b, a));
                    _mm512_storeu_si512(dst.as_mut_ptr().add(j / 2).cast(), v);
                }
                j += 32;
            }
            convert_pairs_scalar(&lo[j..], None, &mut dst[j / 2..]);
        }
    }
}

/// [`matmul`]'s work for AVX-512 BF16: tasks over (token range, column range) as in
/// [`crate::dense`]'s AVX-512 kernel ([`par_output_tiles`]); per block of [`NC`] columns and
/// [`KCP`] pairs, each group of [`MR`] tokens is multiplied with every strip of the block, the
/// tokens' pairs read in place (the last, partial group copied with zero rows).
///
/// # Safety
/// AVX-512 F and BF16; `xb` is `[n, kp]`, `y` `[n, w.out]`, `kp == w.inner.div_ceil(2)`.
#[cfg(target_arch = "x86_64")]
unsafe fn matmul_avx512(xb: &[u32], n: usize, kp: usize, w: &PackedBf16, y: &mut [f32]) {
    let out = w.out;
    let yp = SyncPtr(y.as_mut_ptr());
    par_output_tiles(n, out, |t0, t1, c0, c1| {
        let mut panel = [0u32; MR * KCP];
        for nc0 in (c0..c1).step_by(NC) {
            let nc1 = (nc0 + NC).min(c1);
            for pc in (0..kp).step_by(KCP) {
                let kc = KCP.min(kp - pc);
                for m0 in (t0..t1).step_by(MR) {
                    let mr = MR.min(t1 - m0);
                    let (a, rs) = if mr == MR {
                        (xb[m0 * kp + pc..].as_ptr(), kp)
                    } else {
                        panel.fill(0);
                        for i in 0..mr {
                            panel[i * KCP..i * KCP + kc].copy_from_slice(&xb[(m0 + i) * kp + pc..(m0 + i) * kp + pc + kc]);
                        }
                        (panel.as_ptr(), KCP)
                    };
                    for j0 in (nc0..nc1).step_by(NR) {
                        let nv = NR.min(nc1 - j0);
                        let strip = w.data[(j0 / NR) * kp * NR + pc * NR..].as_ptr();
                        // SAFETY: rows m0 .. m0 + mr, columns j0 .. j0 + nv of y belong to this
                        // task only; `a` reaches MR rows of kc pairs, the strip kc · NR pairs.
                        unsafe { tile(kc, a, rs, 1, strip, yp.get().add(m0 * out + j0), out, mr, nv, pc == 0) };
                    }
                }
            }
        }
    });
}

/// The Gram matrix `bf16(x)ᵀ bf16(x)` of `n` rows of `cols` features, f32 sums: the
/// [`crate::dense::gram`] of the bf16-rounded `x` (blocks on and below the diagonal, mirrored),
/// with the tokens taken in pairs.
///
/// # Shapes
/// - `x`: `[n, cols]`
/// - returns `[cols, cols]`, symmetric
///
/// # Errors
/// [`Error::Length`] when `x.len() != n · cols`; [`Error::Unsupported`] without AVX-512 BF16.
pub fn gram(x: &[f32], n: usize, cols: usize) -> Result<Vec<f32>> {
    if x.len() != n * cols {
        return Err(Error::Length { what: "bf16 gram x", expected: n * cols, actual: x.len() });
    }
    if !available() {
        return Err(Error::Unsupported("bf16 products need AVX-512 BF16".into()));
    }
    // (Written by the AVX-512 code below; elsewhere `available` returned the error above.)
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
    let mut g = vec![0.0f32; cols * cols];
    if n == 0 || cols == 0 {
        return Ok(g);
    }
    #[cfg(target_arch = "x86_64")]
    {
        // Token pairs in strips of NR features, each strip contiguous over all pairs:
        // element (s, p, j) holds x[2p, s·NR + j] low and x[2p + 1, s·NR + j] high, zero past
        // `cols` and past `n`. The tile then reads a strip's run of pairs in place.
        let np = n.div_ceil(2);
        let strips = cols.div_ceil(NR);
        let mut xp: Vec<u32> = crate::team::zeroed(strips * np * NR);
        let xpp = SyncPtr(xp.as_mut_ptr());
        let per = 64usize;
        crate::team::par_for(np.div_ceil(per), |task| {
            let mut lo_row = [0.0f32; NR];
            let mut hi_row = [0.0f32; NR];
            for p in task * per..((task + 1) * per).min(np) {
                for st in 0..strips {
                    let (j0, j1) = (st * NR, ((st + 1) * NR).min(cols));
                    let w = j1 - j0;
                    lo_row[..w].copy_from_slice(&x[2 * p * cols + j0..2 * p * cols + j1]);
                    lo_row[w..].fill(0.0);
                    if 2 * p + 1 < n {
                        hi_row[..w].copy_from_slice(&x[(2 * p + 1) * cols + j0..(2 * p + 1) * cols + j1]);
                    } else {
                        hi_row[..w].fill(0.0);
                    }
                    hi_row[w..].fill(0.0);
                    // SAFETY: element (st, p, ..NR) of xp, written by this task only (its pairs).
                    let dst = unsafe { std::slice::from_raw_parts_mut(xpp.get().add((st * np + p) * NR), NR) };
                    convert_pairs(&lo_row, Some(&hi_row), dst);
                }
            }
        });
        // SAFETY: `available` found AVX-512 F and BF16; `xp` holds `strips · np · NR` pairs,
        // `g` is `[cols, cols]`.
        unsafe { gram_avx512(&xp, np, cols, &mut g) };
        mirror_lower(&mut g, cols);
    }
    Ok(g)
}

/// The blocks on and below the diagonal of `g` from the strip-major token pairs `xp` (see
/// [`gram`]): per task (a [`GRAM_TILE`] block, [`lower_blocks`]) and per [`KCP`] pairs, each
/// group of [`MR`] rows of `g` is copied into a `[KCP][MR]` panel and multiplied by [`tile`]
/// with every strip of the block's columns not wholly above the diagonal, the strips read in
/// place.
///
/// # Safety
/// AVX-512 F and BF16; `xp.len() == cols.div_ceil(NR) · np · NR`, `g.len() == cols · cols`.
#[cfg(target_arch = "x86_64")]
unsafe fn gram_avx512(xp: &[u32], np: usize, cols: usize, g: &mut [f32]) {
    // The blocks are GRAM_TILE (192) wide, a multiple of NR: a block's columns are whole strips.
    let blocks = lower_blocks(cols);
    let gp = SyncPtr(g.as_mut_ptr());
    crate::team::par_for(blocks.len(), |b| {
        let (bi, bj) = blocks[b];
        let (r0, r1) = (bi * GRAM_TILE, ((bi + 1) * GRAM_TILE).min(cols));
        let (c0, c1) = (bj * GRAM_TILE, ((bj + 1) * GRAM_TILE).min(cols));
        let mut ap = [0u32; KCP * MR];
        for pc in (0..np).step_by(KCP) {
            let kc = KCP.min(np - pc);
            for m0 in (r0..r1).step_by(MR) {
                let mr = MR.min(r1 - m0);
                // Rows m0 .. m0 + mr of g are features m0 ..: gather them from their strips.
                for (p, dst) in ap[..kc * MR].chunks_exact_mut(MR).enumerate() {
                    for (i, d) in dst.iter_mut().enumerate() {
                        let f = m0 + i;
                        *d = if i < mr { xp[((f / NR) * np + pc + p) * NR + f % NR] } else { 0 };
                    }
                }
                for j0 in (c0..c1).step_by(NR) {
                    if j0 >= m0 + mr {
                        // Wholly above the diagonal: mirrored from below afterwards.
                        break;
                    }
                    let nv = NR.min(c1 - j0);
                    // SAFETY: rows m0 .. m0 + mr, columns j0 .. j0 + nv of g belong to this
                    // task's block only; the panel holds kc · MR pairs, the strip from pair pc
                    // on kc · NR.
                    unsafe { tile(kc, ap.as_ptr(), 1, MR, xp.as_ptr().add(((j0 / NR) * np + pc) * NR), gp.get().add(m0 * cols + j0), cols, mr, nv, pc == 0) };
                }
            }
        }
    });
}

/// One register tile: `acc[i, j] = Σ_p a[i·rs + p·cs] · wp[p, j]` over `kc` pairs (one
/// `vdpbf16ps` chain each, in `p` order), then `y[i, j] = acc` (`first`) or `y[i, j] += acc` for
/// the first `mr` rows and `nv` columns.
///
/// # Safety
/// AVX-512 F and BF16; `a[i·rs + p·cs]` readable for `i < MR`, `p < kc`; `wp` holds `kc · NR`
/// pairs; `y` (row stride `ldy`) writable for `mr` rows of `nv` columns.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile(kc: usize, a: *const u32, rs: usize, cs: usize, wp: *const u32, y: *mut f32, ldy: usize, mr: usize, nv: usize, first: bool) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    // SAFETY: i < MR rows of `a`.
    let rows: [*const u32; MR] = std::array::from_fn(|i| unsafe { a.add(i * rs) });
    for p in 0..kc {
        // SAFETY (whole block): p < kc, so the reads stay inside `a` and the strip; the
        // transmutes reinterpret 512-bit integer vectors as 32 bf16 values.
        unsafe {
            let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(wp.add(p * NR).cast()));
            let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(wp.add(p * NR + 16).cast()));
            for (row, r) in acc.iter_mut().zip(rows) {
                let ai: __m512bh = std::mem::transmute(_mm512_set1_epi32(*r.add(p * cs) as i32));
                row[0] = _mm512_dpbf16_ps(row[0], ai, b0);
                row[1] = _mm512_dpbf16_ps(row[1], ai, b1);
            }
        }
    }
    // SAFETY: forwarded from the caller.
    unsafe { store_tile(&acc, y, ldy, mr, nv, first) };
}

// The AVX-512 conversion against the scalar one (x86-64 only).
#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// The vector conversion gives the scalar one's bits: ties, subnormals, infinities, NaN, and
    /// the tails past the last full vector.
    #[test]
    fn vector_conversion_equals_scalar() {
        if !available() {
            return;
        }
        let mut v: Vec<f32> = vec![1.0 + 2f32.powi(-8), 1.0 + 3.0 * 2f32.powi(-8), -2.5, 1e-39, -3e-39, 1.2e-38, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, 65504.0, 3.4e38];
        let mut s = 7u64;
        v.extend((0..200).map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            f32::from_bits((s >> 32) as u32 & 0xBFFF_FFFF)
        }));
        for len in [v.len(), 77, 33, 31, 16, 1] {
            let lo = &v[..len];
            let (mut a, mut b) = (vec![0u32; len.div_ceil(2)], vec![0u32; len.div_ceil(2)]);
            convert_pairs_scalar(lo, None, &mut a);
            // SAFETY: `available` checked above.
            unsafe { convert_pairs_avx512(lo, None, &mut b) };
            assert_eq!(a, b, "one row of {len}");
            let hi: Vec<f32> = lo.iter().rev().copied().collect();
            let (mut a, mut b) = (vec![0u32; len], vec![0u32; len]);
            convert_pairs_scalar(lo, Some(&hi), &mut a);
            // SAFETY: as above.
            unsafe { convert_pairs_avx512(lo, Some(&hi), &mut b) };
            assert_eq!(a, b, "two rows of {len}");
        }
    }
}
