//! Matrix products with 16-bit block-scaled integer inputs (AVX2 `vpmaddwd`), for the
//! calibration passes of the compression jobs on CPUs without AVX-512 BF16: the
//! AVX2 counterpart of [`crate::bf16`].
//!
//! Each operand is cut along the inner dimension into blocks of [`BLOCK`] values; a block of a
//! row (activations: per token; weights: per output column; the Gram matrix's `x`: per feature
//! and block of tokens) is stored as `scale · code` with `scale = max |v| / QMAX` and
//! `code = round(v / scale)` in `[-QMAX, QMAX]` ([`quantize_block`]): 13.5 bits relative to the
//! block's largest value, finer than bf16's 8 significant bits for every value above 1/22 of it.
//! `vpmaddwd` multiplies 16 pairs of 16-bit codes and adds each pair into a 32-bit lane: 16
//! multiply-adds per instruction against 8 for an f32 FMA, at the FMA's instruction rate on the
//! AVX2-only Zen 3 this was measured on (docs/performance.md, twenty-sixth session; the 6 × 16
//! tile reaches 1.1-1.45× the f32 tile there, presumably held back by its loads and broadcasts). A
//! block's sum `Σ code_x · code_w` is exact in i32 (`BLOCK · QMAX² <
//! 2³¹`); it is converted to f32 once per block and added as `sum · (scale_x · scale_w)` with
//! one FMA, so each output is a fixed chain over the blocks, in order: its bits depend on
//! neither the other tokens nor the thread count.
//!
//! The reference GPTQ / AWQ implementations calibrate in fp16 / bf16 on a GPU; this is the
//! same class of approximation (`deco quantize --calib-dtype int16`; docs/quantization.md has
//! the perplexity study). Only x86-64 CPUs with AVX2 + FMA run it ([`available`]).
//!
//! The blocking is [`crate::dense`]'s AVX2 kernel's (a 6-token × 16-column register tile, the
//! inner dimension in cache blocks of [`KC_BLOCKS`] scale blocks), with the inner dimension
//! taken in pairs: a weight is packed once ([`PackedInt16`]), the activations are quantized once
//! per call.

use crate::error::{Error, Result};
#[cfg(target_arch = "x86_64")]
use crate::quant::Isa;
use crate::quant::SyncPtr;

/// Inner values per scale block.
pub const BLOCK: usize = 64;
/// The largest code magnitude: `BLOCK · QMAX² < 2³¹`, so a block's integer sum never overflows.
pub const QMAX: i32 = 5792;
/// Pairs per scale block.
const BP: usize = BLOCK / 2;
/// Output columns per strip (two 8-lane vectors).
const NR: usize = 16;
/// Tokens per register tile.
#[cfg(target_arch = "x86_64")]
const MR: usize = 6;
/// Scale blocks per cache block of the inner dimension (576 values, the f32 kernel's `KC`).
pub const KC_BLOCKS: usize = 9;

const _: () = assert!((BLOCK as i64) * (QMAX as i64) * (QMAX as i64) < (1i64 << 31));

/// Whether this CPU runs the 16-bit integer products: x86-64 with AVX2 and FMA (and
/// `DECO_KERNELS` not forcing the portable kernels).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        Isa::detect() != Isa::Scalar
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Quantizes up to [`BLOCK`] values into `codes` (`BLOCK` long; zero past `v.len()`) and
/// returns the block's scale: `scale = max |v| / QMAX`, `code = round(v · (QMAX / max |v|))`
/// (f32 product, ties to even as `vcvtps2dq` rounds) clamped to `[-QMAX, QMAX]`, so
/// `|v - scale · code| <= scale / 2` up to f32 rounding. An all-zero block has scale 0; a block
/// holding an infinity or NaN gets a NaN scale, so the products it enters are NaN rather than
/// silently finite. The vectorized quantizers of [`matmul`] and [`gram`] give the same codes and
/// scales (`tests/int16.rs`).
pub fn quantize_block(v: &[f32], codes: &mut [i16]) -> f32 {
    debug_assert!(v.len() <= BLOCK && codes.len() == BLOCK);
    let m = v.iter().fold(0.0f32, |m, &x| m.max(x.abs()));
    let bad = v.iter().any(|x| !x.is_finite());
    if bad || m == 0.0 {
        codes.fill(0);
        return if bad { f32::NAN } else { 0.0 };
    }
    let inv = QMAX as f32 / m;
    for (c, &x) in codes.iter_mut().zip(v) {
        *c = (x * inv).round_ties_even().clamp(-(QMAX as f32), QMAX as f32) as i16;
    }
    codes[v.len()..].fill(0);
    m / QMAX as f32
}

/// [`quantize_block`] of a whole block of [`BLOCK`] values with AVX2, the codes written as
/// `BLOCK` consecutive `i16` at `codes` (the pairs layout: token-major codes are their own
/// pairs).
///
/// # Safety
/// AVX2; `v` readable and `codes` writable for [`BLOCK`] elements.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_block_avx2(v: *const f32, codes: *mut i16) -> f32 {
    use std::arch::x86_64::*;
    // SAFETY (whole body): BLOCK values of v, BLOCK codes (the caller's contract).
    unsafe {
        let sign = _mm256_set1_ps(-0.0);
        let inf = _mm256_set1_ps(f32::INFINITY);
        let mut mx = _mm256_setzero_ps();
        let mut bad = _mm256_setzero_ps();
        let xs: [__m256; BLOCK / 8] = std::array::from_fn(|i| _mm256_loadu_ps(v.add(8 * i)));
        for &x in &xs {
            let a = _mm256_andnot_ps(sign, x);
            mx = _mm256_max_ps(mx, a);
            // Not below infinity: an infinity or a NaN (unordered).
            bad = _mm256_or_ps(bad, _mm256_cmp_ps::<_CMP_NLT_UQ>(a, inf));
        }
        let mut lanes = [0.0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), mx);
        let m = lanes.iter().fold(0.0f32, |m, &x| m.max(x));
        if _mm256_movemask_ps(bad) != 0 || m == 0.0 {
            std::ptr::write_bytes(codes, 0, BLOCK);
            return if _mm256_movemask_ps(bad) != 0 { f32::NAN } else { 0.0 };
        }
        let inv = _mm256_set1_ps(QMAX as f32 / m);
        let (lo, hi) = (_mm256_set1_epi32(-QMAX), _mm256_set1_epi32(QMAX));
        for i in 0..BLOCK / 16 {
            let a = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(xs[2 * i], inv)), lo), hi);
            let b = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(xs[2 * i + 1], inv)), lo), hi);
            // packs works per 128-bit lane: [a0-3 b0-3 a4-7 b4-7] → [a0-7 b0-7].
            let p = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(a, b));
            _mm256_storeu_si256(codes.add(16 * i).cast(), p);
        }
        m / QMAX as f32
    }
}

/// Two codes as one 32-bit element, `lo` in the low half (the even inner index): the layout
/// `vpmaddwd` multiplies.
#[inline(always)]
fn pair(lo: i16, hi: i16) -> u32 {
    lo as u16 as u32 | (hi as u16 as u32) << 16
}

/// A weight `w[inner, out]` (the transposed `[in, out]` layout of [`crate::dense::matmul`])
/// quantized per output column and block of [`BLOCK`] inner rows ([`quantize_block`]) and packed
/// for [`matmul`]: strips of 16 output columns, each `[pairs][16]` (element `(p, j)` holds the
/// codes of `w[2p, j]` low and `w[2p + 1, j]` high) with its scales `[blocks][16]`; zero past
/// `out` and past `inner`.
#[derive(Debug, Clone, PartialEq)]
pub struct PackedInt16 {
    /// Input features.
    pub inner: usize,
    /// Output features.
    pub out: usize,
    /// `[strips][blocks · BLOCK / 2][16]`.
    data: Vec<u32>,
    /// `[strips][blocks][16]`.
    scales: Vec<f32>,
}

impl PackedInt16 {
    /// Scale blocks along `inner`.
    fn blocks(&self) -> usize {
        self.inner.div_ceil(BLOCK)
    }

    /// Packs `w` (`[inner, out]` row-major f32).
    ///
    /// # Errors
    /// [`Error::Length`] when `w.len() != inner · out`.
    pub fn new(w: &[f32], inner: usize, out: usize) -> Result<Self> {
        if w.len() != inner * out {
            return Err(Error::Length { what: "int16 weight", expected: inner * out, actual: w.len() });
        }
        Ok(Self::from_rows(inner, out, |o, buf| {
            for (k, v) in buf.iter_mut().enumerate() {
                *v = w[k * out + o];
            }
        }))
    }

    /// Packs the weight whose output row `o` (`[inner]`, the `[out, inner]` layout of a
    /// checkpoint's linear) `row(o, buf)` writes into `buf`, without an f32 copy of the whole
    /// weight. The strips are built in parallel, so `row` is called concurrently, once per
    /// output row, in no fixed order.
    pub fn from_rows(inner: usize, out: usize, row: impl Fn(usize, &mut [f32]) + Sync) -> Self {
        let nb = inner.div_ceil(BLOCK);
        let kp = nb * BP;
        let strips = out.div_ceil(NR);
        let mut data = vec![0u32; strips * kp * NR];
        let mut scales = vec![0.0f32; strips * nb * NR];
        let sp = SyncPtr(scales.as_mut_ptr());
        crate::team::par_chunks_mut(&mut data, (kp * NR).max(1), |s, strip| {
            let mut buf = vec![0.0f32; inner];
            let mut codes = vec![0i16; nb * BLOCK];
            for j in 0..NR.min(out - s * NR) {
                row(s * NR + j, &mut buf);
                for b in 0..nb {
                    let v = &buf[b * BLOCK..((b + 1) * BLOCK).min(inner)];
                    let sc = quantize_block(v, &mut codes[b * BLOCK..(b + 1) * BLOCK]);
                    // SAFETY: strip s's scales, written by this task only.
                    unsafe { *sp.get().add((s * nb + b) * NR + j) = sc };
                }
                for p in 0..kp {
                    strip[p * NR + j] = pair(codes[2 * p], codes[2 * p + 1]);
                }
            }
        });
        Self { inner, out, data, scales }
    }

    /// The weight as the products see it, `[inner, out]` f32 (`scale · code`).
    pub fn unpack(&self) -> Vec<f32> {
        let (nb, kp) = (self.blocks(), self.blocks() * BP);
        let mut w = vec![0.0f32; self.inner * self.out];
        for (i, row) in w.chunks_exact_mut(self.out.max(1)).enumerate() {
            for (c, v) in row.iter_mut().enumerate() {
                let e = self.data[(c / NR) * kp * NR + (i / 2) * NR + c % NR];
                let code = if i % 2 == 0 { e as u16 as i16 } else { (e >> 16) as u16 as i16 };
                *v = code as f32 * self.scales[((c / NR) * nb + i / BLOCK) * NR + c % NR];
            }
        }
        w
    }
}

/// Quantizes the rows of `x` (`[n, inner]`) per block: codes as pairs `[n, blocks · BLOCK / 2]`,
/// scales `[n, blocks]`, in parallel; whole blocks with AVX2 ([`quantize_block_avx2`]).
#[cfg(target_arch = "x86_64")]
fn quantize_rows(x: &[f32], n: usize, inner: usize) -> (Vec<u32>, Vec<f32>) {
    let nb = inner.div_ceil(BLOCK);
    let kp = nb * BP;
    let mut xq = crate::team::zeroed::<u32>(n * kp);
    let mut xs = vec![0.0f32; n * nb];
    let sp = SyncPtr(xs.as_mut_ptr());
    let rows = 64usize;
    crate::team::par_chunks_mut(&mut xq, rows * kp, |ci, chunk| {
        let mut codes = [0i16; BLOCK];
        for (r, dst) in chunk.chunks_exact_mut(kp).enumerate() {
            let t = ci * rows + r;
            let xr = &x[t * inner..(t + 1) * inner];
            for b in 0..nb {
                if (b + 1) * BLOCK <= inner {
                    // SAFETY: AVX2 (the callers checked `available`); a whole block of the row, and its BP pairs of
                    // dst as BLOCK i16.
                    let sc = unsafe { quantize_block_avx2(xr.as_ptr().add(b * BLOCK), dst.as_mut_ptr().add(b * BP).cast()) };
                    // SAFETY: row t's scales, written by this task only.
                    unsafe { *sp.get().add(t * nb + b) = sc };
                    continue;
                }
                let sc = quantize_block(&xr[b * BLOCK..((b + 1) * BLOCK).min(inner)], &mut codes);
                // SAFETY: row t's scales, written by this task only.
                unsafe { *sp.get().add(t * nb + b) = sc };
                for (p, d) in dst[b * BP..(b + 1) * BP].iter_mut().enumerate() {
                    *d = pair(codes[2 * p], codes[2 * p + 1]);
                }
            }
        }
    });
    (xq, xs)
}

/// `y[n, out] ≈ x[n, inner] · w[inner, out]` with both sides quantized per block of [`BLOCK`]
/// inner values ([`quantize_block`]): `y[t, j] = Σ_b (Σ_{k ∈ b} cx[t, k] · cw[k, j]) · sx[t, b] ·
/// sw[b, j]`, each block's sum exact in i32, the blocks added in order in f32.
///
/// # Shapes
/// - `x`: `[n, inner]`
/// - `w`: packed from `[inner, out]`
/// - `y`: `[n, out]`, overwritten
///
/// # Errors
/// [`Error::Length`] for slices that do not match the shapes; [`Error::Unsupported`] on a CPU
/// without AVX2 ([`available`]).
pub fn matmul(x: &[f32], n: usize, w: &PackedInt16, y: &mut [f32]) -> Result<()> {
    let (inner, out) = (w.inner, w.out);
    if x.len() != n * inner {
        return Err(Error::Length { what: "int16 x", expected: n * inner, actual: x.len() });
    }
    if y.len() != n * out {
        return Err(Error::Length { what: "int16 y", expected: n * out, actual: y.len() });
    }
    if !available() {
        return Err(Error::Unsupported("16-bit integer products need AVX2".into()));
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
        let (xq, xs) = quantize_rows(x, n, inner);
        // SAFETY: `available` found AVX2 and FMA; the lengths were checked above.
        unsafe { matmul_avx2(&xq, &xs, n, w, y) };
    }
    Ok(())
}

/// [`matmul`]'s work: tasks over (token range, column range) as in [`crate::dense`]'s AVX2
/// kernel; per block of [`crate::dense::NC`] columns and [`KC_BLOCKS`] scale blocks, each group
/// of [`MR`] tokens is multiplied with every strip of the block, the tokens' codes and scales
/// read in place (the last, partial group copied with zero rows).
///
/// # Safety
/// AVX2 and FMA; `xq` is `[n, blocks · BP]`, `xs` `[n, blocks]`, `y` `[n, w.out]`.
#[cfg(target_arch = "x86_64")]
unsafe fn matmul_avx2(xq: &[u32], xs: &[f32], n: usize, w: &PackedInt16, y: &mut [f32]) {
    let out = w.out;
    let nb = w.blocks();
    let kp = nb * BP;
    let yp = SyncPtr(y.as_mut_ptr());
    crate::dense::par_output_tiles_of(n, out, MR, NR, |t0, t1, c0, c1| {
        let mut panel = vec![0u32; MR * KC_BLOCKS * BP];
        let mut pscale = [0.0f32; MR * KC_BLOCKS];
        for nc0 in (c0..c1).step_by(crate::dense::NC) {
            let nc1 = (nc0 + crate::dense::NC).min(c1);
            for pb in (0..nb).step_by(KC_BLOCKS) {
                let kb = KC_BLOCKS.min(nb - pb);
                for m0 in (t0..t1).step_by(MR) {
                    let mr = MR.min(t1 - m0);
                    let (a, rs, sa, srs) = if mr == MR {
                        (xq[m0 * kp + pb * BP..].as_ptr(), kp, xs[m0 * nb + pb..].as_ptr(), nb)
                    } else {
                        panel.fill(0);
                        pscale.fill(0.0);
                        let (w_, ws) = (KC_BLOCKS * BP, KC_BLOCKS);
                        for i in 0..mr {
                            let t = m0 + i;
                            panel[i * w_..i * w_ + kb * BP].copy_from_slice(&xq[t * kp + pb * BP..t * kp + (pb + kb) * BP]);
                            pscale[i * ws..i * ws + kb].copy_from_slice(&xs[t * nb + pb..t * nb + pb + kb]);
                        }
                        (panel.as_ptr(), w_, pscale.as_ptr(), ws)
                    };
                    for j0 in (nc0..nc1).step_by(NR) {
                        let nv = NR.min(nc1 - j0);
                        let s = j0 / NR;
                        let strip = w.data[(s * kp + pb * BP) * NR..].as_ptr();
                        let sw = w.scales[(s * nb + pb) * NR..].as_ptr();
                        // SAFETY: rows m0 .. m0 + mr, columns j0 .. j0 + nv of y belong to this
                        // task only; `a` reaches MR rows of kb blocks of pairs, `sa` their
                        // scales, the strip kb · BP pairs and kb scale rows.
                        unsafe { tile(kb, a, rs, 1, sa, srs, 1, strip, sw, yp.get().add(m0 * out + j0), out, mr, nv, pb == 0) };
                    }
                }
            }
        }
    });
}

/// The Gram matrix of `x` quantized per feature and block of [`BLOCK`] tokens: `g[i, j] =
/// Σ_b (Σ_{t ∈ b} c[t, i] · c[t, j]) · s[b, i] · s[b, j]` (f32 over the blocks, in order),
/// computed on and below the diagonal and mirrored.
///
/// # Shapes
/// - `x`: `[n, cols]`
/// - returns `[cols, cols]`, symmetric
///
/// # Errors
/// [`Error::Length`] when `x.len() != n · cols`; [`Error::Unsupported`] without AVX2.
pub fn gram(x: &[f32], n: usize, cols: usize) -> Result<Vec<f32>> {
    if x.len() != n * cols {
        return Err(Error::Length { what: "int16 gram x", expected: n * cols, actual: x.len() });
    }
    if !available() {
        return Err(Error::Unsupported("16-bit integer products need AVX2".into()));
    }
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
    let mut g = vec![0.0f32; cols * cols];
    if n == 0 || cols == 0 {
        return Ok(g);
    }
    #[cfg(target_arch = "x86_64")]
    {
        let (xp, xs) = quantize_columns(x, n, cols);
        // SAFETY: `available` found AVX2 and FMA; `xp`, `xs` as `quantize_columns` returns them.
        unsafe { gram_avx2(&xp, &xs, n.div_ceil(BLOCK), cols, &mut g) };
        crate::dense::mirror_lower(&mut g, cols);
    }
    Ok(g)
}

/// `x` (`[n, cols]`) quantized per feature and block of [`BLOCK`] tokens, strip-major: codes
/// `[strips][blocks · BP][16]` (element `(s, p, j)` holds feature `16s + j` of tokens `2p` low and
/// `2p + 1` high) and scales `[strips][blocks][16]`; zero past `cols` and `n`. In parallel over
/// token blocks; eight features at a time with AVX2 ([`quantize_features_avx2`]), the last few
/// with [`quantize_block`].
#[cfg(target_arch = "x86_64")]
fn quantize_columns(x: &[f32], n: usize, cols: usize) -> (Vec<u32>, Vec<f32>) {
    let nb = n.div_ceil(BLOCK);
    let kp = nb * BP;
    let strips = cols.div_ceil(NR);
    let mut xp = crate::team::zeroed::<u32>(strips * kp * NR);
    let mut xs = vec![0.0f32; strips * nb * NR];
    let (pp, sp) = (SyncPtr(xp.as_mut_ptr()), SyncPtr(xs.as_mut_ptr()));
    let vec_cols = cols / 8 * 8;
    crate::team::par_for(nb, |b| {
        let (t0, t1) = (b * BLOCK, ((b + 1) * BLOCK).min(n));
        for j0 in (0..vec_cols).step_by(8) {
            let (s, jj) = (j0 / NR, j0 % NR);
            // SAFETY: AVX2 (the caller checked `available`); rows t0 .. t1 of x hold features
            // j0 .. j0 + 8; token block b of those features (BP pairs and a scale each, 8
            // consecutive elements of their strip rows) is written by this task only.
            unsafe {
                quantize_features_avx2(x[t0 * cols + j0..].as_ptr(), cols, t1 - t0, pp.get().add((s * kp + b * BP) * NR + jj), sp.get().add((s * nb + b) * NR + jj));
            }
        }
        let mut col = [0.0f32; BLOCK];
        let mut codes = [0i16; BLOCK];
        for j in vec_cols..cols {
            for (t, v) in (t0..t1).zip(col.iter_mut()) {
                *v = x[t * cols + j];
            }
            let sc = quantize_block(&col[..t1 - t0], &mut codes);
            let (s, jj) = (j / NR, j % NR);
            // SAFETY: token block b of feature j (its BP pairs and its scale), written by this
            // task only; in bounds by the shapes above.
            unsafe {
                *sp.get().add((s * nb + b) * NR + jj) = sc;
                for p in 0..BP {
                    *pp.get().add((s * kp + b * BP + p) * NR + jj) = pair(codes[2 * p], codes[2 * p + 1]);
                }
            }
        }
    });
    (xp, xs)
}

/// [`quantize_block`] of eight features at once over `rows` (≤ [`BLOCK`]) tokens: `x` points at
/// the first token's first feature (row stride `cols`); the codes go to `dst` as [`BP`] rows of
/// eight pairs (row stride 16, tokens `2p` low and `2p + 1` high, zero past `rows`), the eight
/// scales to `scales`. Same codes and scales as [`quantize_block`] of each feature's values.
///
/// # Safety
/// AVX2; `x[t · cols + j]` readable for `t < rows`, `j < 8`; `dst[p · 16 + j]` writable for
/// `p < BP`, `j < 8`; `scales` writable for 8.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_features_avx2(x: *const f32, cols: usize, rows: usize, dst: *mut u32, scales: *mut f32) {
    use std::arch::x86_64::*;
    // SAFETY (whole body): the caller's contract.
    unsafe {
        let sign = _mm256_set1_ps(-0.0);
        let inf = _mm256_set1_ps(f32::INFINITY);
        let mut mx = _mm256_setzero_ps();
        let mut bad = _mm256_setzero_ps();
        for t in 0..rows {
            let a = _mm256_andnot_ps(sign, _mm256_loadu_ps(x.add(t * cols)));
            mx = _mm256_max_ps(mx, a);
            bad = _mm256_or_ps(bad, _mm256_cmp_ps::<_CMP_NLT_UQ>(a, inf));
        }
        let q = _mm256_set1_ps(QMAX as f32);
        let zero = _mm256_cmp_ps::<_CMP_EQ_OQ>(mx, _mm256_setzero_ps());
        let skip = _mm256_or_ps(bad, zero);
        // Lanes of an all-zero or non-finite block: inverse 0, codes 0; scale 0 or NaN.
        let inv = _mm256_andnot_ps(skip, _mm256_div_ps(q, mx));
        let sc = _mm256_blendv_ps(_mm256_div_ps(mx, q), _mm256_set1_ps(f32::NAN), bad);
        _mm256_storeu_ps(scales, sc);
        let keep = _mm256_castps_si256(_mm256_xor_ps(skip, _mm256_castsi256_ps(_mm256_set1_epi32(-1))));
        let (lo, hi) = (_mm256_set1_epi32(-QMAX), _mm256_set1_epi32(QMAX));
        let mask16 = _mm256_set1_epi32(0xFFFF);
        for p in 0..BP {
            let mut c = [_mm256_setzero_si256(); 2];
            for (h, ch) in c.iter_mut().enumerate() {
                let t = 2 * p + h;
                if t < rows {
                    let v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x.add(t * cols)), inv));
                    *ch = _mm256_and_si256(_mm256_min_epi32(_mm256_max_epi32(v, lo), hi), keep);
                }
            }
            let v = _mm256_or_si256(_mm256_and_si256(c[0], mask16), _mm256_slli_epi32::<16>(c[1]));
            _mm256_storeu_si256(dst.add(p * NR).cast(), v);
        }
    }
}

/// The blocks on and below the diagonal of `g` from the strip-major codes `xp` and scales `xs`
/// (see [`quantize_columns`]): per [`KC_BLOCKS`] token blocks, the rows' `[pairs][MR]` panels
/// and `[blocks][MR]` scales are gathered once from the strips, in parallel; then one task per
/// `GRAM_TILE` block of `g` multiplies each of its panels with every strip of the block not
/// wholly above the diagonal, the strips read in place.
///
/// # Safety
/// AVX2 and FMA; `xp.len() == cols.div_ceil(16) · nb · BP · 16`, `xs.len() ==
/// cols.div_ceil(16) · nb · 16`, `g.len() == cols · cols`.
#[cfg(target_arch = "x86_64")]
unsafe fn gram_avx2(xp: &[u32], xs: &[f32], nb: usize, cols: usize, g: &mut [f32]) {
    use crate::dense::{GRAM_TILE, lower_blocks};
    use rayon::prelude::*;
    let kp = nb * BP;
    let blocks = lower_blocks(cols);
    let gp = SyncPtr(g.as_mut_ptr());
    let groups = cols.div_ceil(MR);
    let mut panels = vec![0u32; groups * KC_BLOCKS * BP * MR];
    let mut pscales = vec![0.0f32; groups * KC_BLOCKS * MR];
    for pb in (0..nb).step_by(KC_BLOCKS) {
        let kb = KC_BLOCKS.min(nb - pb);
        panels.par_chunks_mut(KC_BLOCKS * BP * MR).zip(pscales.par_chunks_mut(KC_BLOCKS * MR)).enumerate().for_each(|(gi, (pan, psc))| {
            for i in 0..MR {
                let f = gi * MR + i;
                let (s, j) = (f / NR, f % NR);
                for p in 0..kb * BP {
                    pan[p * MR + i] = if f < cols { xp[(s * kp + pb * BP + p) * NR + j] } else { 0 };
                }
                for b in 0..kb {
                    psc[b * MR + i] = if f < cols { xs[(s * nb + pb + b) * NR + j] } else { 0.0 };
                }
            }
        });
        let (panels, pscales) = (&panels, &pscales);
        blocks.par_iter().for_each(|&(bi, bj)| {
            let (r0, r1) = (bi * GRAM_TILE, ((bi + 1) * GRAM_TILE).min(cols));
            let (c0, c1) = (bj * GRAM_TILE, ((bj + 1) * GRAM_TILE).min(cols));
            for m0 in (r0..r1).step_by(MR) {
                let mr = MR.min(r1 - m0);
                let gi = m0 / MR;
                let a = panels[gi * KC_BLOCKS * BP * MR..].as_ptr();
                let sa = pscales[gi * KC_BLOCKS * MR..].as_ptr();
                for j0 in (c0..c1).step_by(NR) {
                    if j0 >= m0 + mr {
                        // Wholly above the diagonal: mirrored from below afterwards.
                        break;
                    }
                    let nv = NR.min(c1 - j0);
                    let s = j0 / NR;
                    let strip = xp[(s * kp + pb * BP) * NR..].as_ptr();
                    let sw = xs[(s * nb + pb) * NR..].as_ptr();
                    // SAFETY: rows m0 .. m0 + mr, columns j0 .. j0 + nv of g belong to this
                    // task's block only; the panel holds kb · BP pairs of MR rows and kb
                    // scales each, the strip kb · BP pairs and kb scale rows.
                    unsafe { tile(kb, a, 1, MR, sa, 1, MR, strip, sw, gp.get().add(m0 * cols + j0), cols, mr, nv, pb == 0) };
                }
            }
        });
    }
}

/// One register tile of `MR` rows × 16 columns over `kb` scale blocks: per block, `acc[i, j] =
/// Σ_p a[i·rs + p·cs] ⊙ wp[p, j]` over the block's [`BP`] pairs (`vpmaddwd` + `vpaddd`, exact in
/// i32), then `f[i, j] += f32(acc) · (sa[i·srs + b·scs] · sw[b, j])` (one FMA); at the end
/// `y[i, j] = f` (`first`) or `y[i, j] += f` for the first `mr` rows and `nv` columns.
///
/// # Safety
/// AVX2 and FMA; `a[i·rs + p·cs]` readable for `i < MR`, `p < kb · BP`, `sa[i·srs + b·scs]` for
/// `b < kb`; `wp` holds `kb · BP · 16` pairs, `sw` `kb · 16` scales; `y` (row stride `ldy`)
/// writable for `mr` rows of `nv` columns.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile(kb: usize, a: *const u32, rs: usize, cs: usize, sa: *const f32, srs: usize, scs: usize, wp: *const u32, sw: *const f32, y: *mut f32, ldy: usize, mr: usize, nv: usize, first: bool) {
    use std::arch::x86_64::*;
    let mut f = [[_mm256_setzero_ps(); 2]; MR];
    // SAFETY: i < MR rows of `a`.
    let rows: [*const u32; MR] = std::array::from_fn(|i| unsafe { a.add(i * rs) });
    for b in 0..kb {
        let mut acc = [[_mm256_setzero_si256(); 2]; MR];
        for p in b * BP..(b + 1) * BP {
            // SAFETY (whole block): p < kb · BP, so the reads stay inside `a` and the strip.
            unsafe {
                let b0 = _mm256_loadu_si256(wp.add(p * NR).cast());
                let b1 = _mm256_loadu_si256(wp.add(p * NR + 8).cast());
                for (row, r) in acc.iter_mut().zip(rows) {
                    let ai = _mm256_set1_epi32(*r.add(p * cs) as i32);
                    row[0] = _mm256_add_epi32(row[0], _mm256_madd_epi16(ai, b0));
                    row[1] = _mm256_add_epi32(row[1], _mm256_madd_epi16(ai, b1));
                }
            }
        }
        // SAFETY: block b < kb of the scales.
        unsafe {
            let s0 = _mm256_loadu_ps(sw.add(b * NR));
            let s1 = _mm256_loadu_ps(sw.add(b * NR + 8));
            for (i, (fr, ar)) in f.iter_mut().zip(&acc).enumerate() {
                let si = _mm256_set1_ps(*sa.add(i * srs + b * scs));
                fr[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ar[0]), _mm256_mul_ps(si, s0), fr[0]);
                fr[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ar[1]), _mm256_mul_ps(si, s1), fr[1]);
            }
        }
    }
    // SAFETY: forwarded from the caller.
    unsafe { crate::dense::store_tile_avx2(&f, y, ldy, mr, nv, first) };
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test
mod tests {
    use super::*;

    /// The round trip of a block is within half a step of every value, the codes within range.
    #[test]
    fn block_round_trip_within_half_a_step() {
        let v: Vec<f32> = (0..50).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.173).collect();
        let mut codes = [0i16; BLOCK];
        let s = quantize_block(&v, &mut codes);
        assert!(s > 0.0);
        for (&x, &c) in v.iter().zip(&codes) {
            assert!(c.unsigned_abs() as i32 <= QMAX);
            assert!((x - s * c as f32).abs() <= s / 2.0 * 1.0001, "{x} vs {}", s * c as f32);
        }
        assert!(codes[50..].iter().all(|&c| c == 0));
        assert_eq!(quantize_block(&[0.0; 3], &mut codes), 0.0);
        assert!(quantize_block(&[1.0, f32::NAN], &mut codes).is_nan());
        assert!(quantize_block(&[1.0, f32::INFINITY], &mut codes).is_nan());
    }
}
