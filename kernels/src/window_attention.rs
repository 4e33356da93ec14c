//! Causal attention over whole windows of tokens (the calibration forwards of the compression
//! jobs: each window attends to itself from position 0, as a prompt's prefill does), computed by
//! blocks of queries against tiles of keys instead of one query token at a time.
//!
//! # Source
//! Dao et al. 2022, "FlashAttention", Algorithm 1, and Dao 2023, "FlashAttention-2", §3.1:
//! the queries of a block and the keys of a tile give a score tile `S = Q Kᵀ / sqrt(d)`; a
//! running maximum `m` and sum `l` per query row (online softmax, Milakov & Gimelshein 2018)
//! rescale the output accumulator by `exp(m_old − m_new)` after each tile, and the output is
//! divided by `l` once at the end. On a CPU the block's queries and the tile's keys stay in L1/L2
//! while every key is multiplied by all the queries of the block (a register tile of 3 query
//! rows × 32 keys for `Q Kᵀ`, 3 rows × 32 output dimensions for `P V`), where a decode kernel
//! reads every key once per query.
//!
//! # Semantics
//! For a window of tokens `s .. s + len` (the `spans`), token `t` and query head `h` with
//! key/value head `j = h / (n_heads / kv_heads)` (grouped-query attention, transformers'
//! `repeat_kv`):
//!
//! `out[t, h] = Σ_{p = s..=t} softmax_p(q[t, h] · k[p, j] / sqrt(head_dim)) · v[p, j]`.
//!
//! Sums are f32 with FMA; the exponentials use the Cephes `expf` polynomial of the decode kernel
//! (relative error about 1e-7). The result is within f32 rounding of the f64 reference (checked
//! in `kernels/tests/window_attention.rs`), not bit-equal to [`crate::attention`]'s decode
//! kernel, whose tiles and sums run in another order. A token's result depends on its window only
//! (not on the other windows, the thread count, or the order of the tasks).
//!
//! # Parallelism and ISA
//! One task per (window, block of [`QB`] query tokens, kv head), claimed dynamically by the
//! threads. AVX2 + FMA (also on AVX-512 CPUs: Zen 4 runs 512-bit FMAs at the 256-bit rate, and
//! the kernel is not the calibration's bottleneck); [`supported`] says where it runs, and the
//! callers keep the decode kernel elsewhere.

use crate::attention::AttnShape;
use crate::error::{Error, Result};
use crate::quant::Isa;

/// Query tokens per task (a block).
pub const QB: usize = 32;
/// Key positions per tile: equal to [`QB`], so every query row of a block has at least one
/// unmasked key in every tile it reads (the tiles start at multiples of `QB`, up to the
/// block's first token).
#[cfg(target_arch = "x86_64")]
const KT: usize = QB;

/// Whether [`causal_window_attention`] runs here: an x86-64 CPU with AVX2 and FMA (and
/// `DECO_KERNELS` not `scalar`), `head_dim` a positive multiple of 8 and whole query groups.
pub fn supported(shape: AttnShape) -> bool {
    let AttnShape { n_heads, kv_heads, head_dim } = shape;
    cfg!(target_arch = "x86_64") && Isa::detect() != Isa::Scalar && head_dim > 0 && head_dim.is_multiple_of(8) && kv_heads > 0 && n_heads.is_multiple_of(kv_heads)
}

/// Causal attention of every window in `spans` over itself (see the [module docs](self)).
///
/// # Shapes
/// - `q`, `out`: `[tokens, n_heads, head_dim]`
/// - `k`, `v`: `[tokens, kv_heads, head_dim]`
/// - `spans`: `(start, len)` windows, disjoint, within `tokens`; rows outside every window are
///   left as they are in `out`.
///
/// # Errors
/// [`Error::Length`] for slices that do not match the shapes; [`Error::Incompatible`] for a
/// window outside the tokens; [`Error::Unsupported`] where [`supported`] is false.
pub fn causal_window_attention(q: &[f32], k: &[f32], v: &[f32], shape: AttnShape, spans: &[(usize, usize)], out: &mut [f32]) -> Result<()> {
    let AttnShape { n_heads, kv_heads, head_dim: d } = shape;
    if !supported(shape) {
        return Err(Error::Unsupported(format!("window attention needs AVX2 + FMA and head_dim a multiple of 8 (got {shape:?})")));
    }
    let qrow = n_heads * d;
    let kvrow = kv_heads * d;
    let tokens = q.len() / qrow;
    if q.len() != tokens * qrow {
        return Err(Error::Length { what: "window attention q", expected: tokens * qrow, actual: q.len() });
    }
    for (what, x) in [("window attention k", k), ("window attention v", v)] {
        if x.len() != tokens * kvrow {
            return Err(Error::Length { what, expected: tokens * kvrow, actual: x.len() });
        }
    }
    if out.len() != q.len() {
        return Err(Error::Length { what: "window attention out", expected: q.len(), actual: out.len() });
    }
    if let Some(&(s, len)) = spans.iter().find(|&&(s, len)| s.checked_add(len).is_none_or(|e| e > tokens)) {
        return Err(Error::Incompatible(format!("window {s}..{s}+{len} outside {tokens} tokens")));
    }
    // Tasks (window start, block's first token within the window, tokens in the block, kv
    // head), the longest (last) blocks first so that the short ones even out the end.
    let mut tasks: Vec<(usize, usize, usize, usize)> = Vec::new();
    for &(s, len) in spans {
        for b in 0..len.div_ceil(QB) {
            for j in 0..kv_heads {
                tasks.push((s, b * QB, QB.min(len - b * QB), j));
            }
        }
    }
    tasks.sort_by_key(|t| std::cmp::Reverse(t.1));
    #[cfg(target_arch = "x86_64")]
    {
        let o = crate::quant::SyncPtr(out.as_mut_ptr());
        crate::team::par_for(tasks.len(), |i| {
            let (s, t0, nt, j) = tasks[i];
            // SAFETY: `supported` found AVX2 and FMA; the lengths were checked above and the
            // window lies within the tokens, so every row read is in bounds; the task writes
            // only the rows of its tokens and the query heads of kv head `j`, which no other task
            // writes (windows are disjoint).
            unsafe { x86::task(q, k, v, o.get(), shape, s, t0, nt, j) };
        });
    }
    Ok(())
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{KT, QB};
    use crate::attention::AttnShape;
    use crate::simd::exp_neg;

    /// The 8 × 8 transpose of eight row vectors (unpack, shuffle, then 128-bit lane swaps).
    #[inline(always)]
    unsafe fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
        // SAFETY: register-only AVX instructions.
        unsafe {
            let t0 = _mm256_unpacklo_ps(r[0], r[1]);
            let t1 = _mm256_unpackhi_ps(r[0], r[1]);
            let t2 = _mm256_unpacklo_ps(r[2], r[3]);
            let t3 = _mm256_unpackhi_ps(r[2], r[3]);
            let t4 = _mm256_unpacklo_ps(r[4], r[5]);
            let t5 = _mm256_unpackhi_ps(r[4], r[5]);
            let t6 = _mm256_unpacklo_ps(r[6], r[7]);
            let t7 = _mm256_unpackhi_ps(r[6], r[7]);
            let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
            let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
            let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
            let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
            let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
            let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
            let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
            let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
            [
                _mm256_permute2f128_ps::<0x20>(u0, u4),
                _mm256_permute2f128_ps::<0x20>(u1, u5),
                _mm256_permute2f128_ps::<0x20>(u2, u6),
                _mm256_permute2f128_ps::<0x20>(u3, u7),
                _mm256_permute2f128_ps::<0x31>(u0, u4),
                _mm256_permute2f128_ps::<0x31>(u1, u5),
                _mm256_permute2f128_ps::<0x31>(u2, u6),
                _mm256_permute2f128_ps::<0x31>(u3, u7),
            ]
        }
    }

    /// Scores of `K` keys against `8W` query rows: `st[kk][0..8W] = Σ_c k_kk[c] · qt[c][0..8W]`
    /// (`kr[kk]` points at key kk's `d` values; `qt` rows `rp` apart, already scaled by
    /// `1/sqrt(d)`; `st` rows `rp` apart). `K · W` accumulators, `K` broadcasts and one load.
    ///
    /// # Safety
    /// AVX2 + FMA; the pointers cover what is read and written.
    #[inline(always)]
    unsafe fn scores<const K: usize, const W: usize>(kr: [*const f32; K], qt: *const f32, rp: usize, d: usize, st: *mut f32) {
        // SAFETY: the caller's contract covers every load and store.
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); W]; K];
            for c in 0..d {
                let mut kb = [_mm256_setzero_ps(); K];
                for (x, p) in kb.iter_mut().zip(&kr) {
                    *x = _mm256_broadcast_ss(&*p.add(c));
                }
                for i in 0..W {
                    let qv = _mm256_loadu_ps(qt.add(c * rp + 8 * i));
                    for (a, &b) in acc.iter_mut().zip(&kb) {
                        a[i] = _mm256_fmadd_ps(b, qv, a[i]);
                    }
                }
            }
            for (kk, a) in acc.iter().enumerate() {
                for (i, x) in a.iter().enumerate() {
                    _mm256_storeu_ps(st.add(kk * rp + 8 * i), *x);
                }
            }
        }
    }

    /// `o_r[0..8W] = alpha_r · o_r + Σ_kk p[kk][r] · v_kk[0..8W]` for `R` rows over `n` keys
    /// (`p` the probabilities `[kk][rows]`, rows `rp` apart; `vr` the first key's values,
    /// `vstride` floats between keys). `R · W` accumulators, `R` broadcasts and one load.
    ///
    /// # Safety
    /// AVX2 + FMA; `o` rows (`ostride` apart) hold `8W` values; the pointers cover what is read.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)] // the tile's pointers and strides
    unsafe fn pv<const R: usize, const W: usize>(o: *mut f32, ostride: usize, alpha: *const f32, p: *const f32, rp: usize, vr: *const f32, vstride: usize, n: usize) {
        // SAFETY: the caller's contract covers every load and store.
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); W]; R];
            for (r, a) in acc.iter_mut().enumerate() {
                let al = _mm256_broadcast_ss(&*alpha.add(r));
                for (i, x) in a.iter_mut().enumerate() {
                    *x = _mm256_mul_ps(_mm256_loadu_ps(o.add(r * ostride + 8 * i)), al);
                }
            }
            for kk in 0..n {
                let mut pb = [_mm256_setzero_ps(); R];
                for (r, x) in pb.iter_mut().enumerate() {
                    *x = _mm256_broadcast_ss(&*p.add(kk * rp + r));
                }
                for i in 0..W {
                    let vi = _mm256_loadu_ps(vr.add(kk * vstride + 8 * i));
                    for (a, &b) in acc.iter_mut().zip(&pb) {
                        a[i] = _mm256_fmadd_ps(b, vi, a[i]);
                    }
                }
            }
            for (r, a) in acc.iter().enumerate() {
                for (i, x) in a.iter().enumerate() {
                    _mm256_storeu_ps(o.add(r * ostride + 8 * i), *x);
                }
            }
        }
    }

    /// One task: the `nt` tokens `t0 ..` of the window starting at `s`, the query heads of kv
    /// head `j`. Rows are (token, head in the group) pairs, token-major, padded to a multiple
    /// of 8 with zero queries. The queries are transposed once (`qt[c][row]`, scaled by
    /// `1/sqrt(d)`), so the scores of a key tile come out as `st[key][row]`: the keys are read in
    /// place as broadcasts, and the online softmax runs down the columns, 8 rows per vector.
    ///
    /// # Safety
    /// AVX2 + FMA; `head_dim % 8 == 0`; the window `s .. s + t0 + nt` lies within the tokens
    /// of `q`, `k`, `v` (shapes as [`super::causal_window_attention`]); `out` has `q`'s length
    /// and no other thread writes rows `s + t0 .. s + t0 + nt`, heads of kv head `j`.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)] // the inputs, the shape and the task's coordinates
    pub(super) unsafe fn task(q: &[f32], k: &[f32], v: &[f32], out: *mut f32, shape: AttnShape, s: usize, t0: usize, nt: usize, j: usize) {
        let AttnShape { n_heads, kv_heads, head_dim: d } = shape;
        let g = n_heads / kv_heads;
        let rows = nt * g;
        let rp = rows.div_ceil(8) * 8;
        let scale = 1.0 / (d as f32).sqrt();
        let q_row = |r: usize| -> usize { ((s + t0 + r / g) * n_heads + j * g + r % g) * d };
        let kv_row = |p: usize| -> usize { ((s + p) * kv_heads + j) * d };
        debug_assert!(rows <= QB * g);
        let mut qt = vec![0.0f32; d * rp];
        // SAFETY: rows `r0 .. r0 + 8` below `rows` are the task's query rows (`d` values each),
        // the rest stay zero; `qt` holds `d · rp` values.
        unsafe {
            let sc = _mm256_set1_ps(scale);
            for r0 in (0..rp).step_by(8) {
                let real = rows.saturating_sub(r0).min(8);
                for c0 in (0..d).step_by(8) {
                    let mut x = [_mm256_setzero_ps(); 8];
                    for (i, xi) in x.iter_mut().enumerate().take(real) {
                        *xi = _mm256_mul_ps(_mm256_loadu_ps(q.as_ptr().add(q_row(r0 + i) + c0)), sc);
                    }
                    let t = transpose8(x);
                    for (i, ti) in t.iter().enumerate() {
                        _mm256_storeu_ps(qt.as_mut_ptr().add((c0 + i) * rp + r0), *ti);
                    }
                }
            }
        }
        let mut st = vec![0.0f32; KT * rp];
        let mut o = vec![0.0f32; rp * d];
        let mut m = vec![f32::NEG_INFINITY; rp];
        let mut l = vec![0.0f32; rp];
        let mut alpha = vec![0.0f32; rp];
        let mut kt0 = 0;
        // SAFETY (loop body): key rows `s + kt0 + kk` with `kt0 + kk < t0 + nt` lie within the
        // window; `qt`, `st`, `o`, `m`, `l`, `alpha` are sized above (rows padded to `rp`).
        unsafe {
            while kt0 < t0 + nt {
                let kn = KT.min(t0 + nt - kt0);
                // Scores `st[kk][row]`: keys 3 at a time (then one by one) against 32 rows
                // (then 8).
                let kp = |kk: usize| k.as_ptr().add(kv_row(kt0 + kk));
                let mut kk = 0;
                while kk < kn {
                    let nk = if kn - kk >= 3 { 3 } else { 1 };
                    let mut r = 0;
                    while r < rp {
                        let (qtr, str) = (qt.as_ptr().add(r), st.as_mut_ptr().add(kk * rp + r));
                        match (nk, rp - r >= 32) {
                            (3, true) => scores::<3, 4>([kp(kk), kp(kk + 1), kp(kk + 2)], qtr, rp, d, str),
                            (3, false) => scores::<3, 1>([kp(kk), kp(kk + 1), kp(kk + 2)], qtr, rp, d, str),
                            (_, true) => scores::<1, 4>([kp(kk)], qtr, rp, d, str),
                            (_, false) => scores::<1, 1>([kp(kk)], qtr, rp, d, str),
                        }
                        r += if rp - r >= 32 { 32 } else { 8 };
                    }
                    kk += nk;
                }
                // Causal mask on the tile that reaches the block: key `kt0 + kk` is after the
                // tokens of rows `0 .. (kt0 + kk − t0) · g` (token-major rows). Padded keys
                // (`kk ≥ kn`) are never read below.
                if kt0 + KT > t0 {
                    for kk in 0..kn {
                        let masked = ((kt0 + kk).saturating_sub(t0) * g).min(rows);
                        st[kk * rp..kk * rp + masked].fill(f32::NEG_INFINITY);
                    }
                }
                // Online softmax down the columns, 8 rows at a time: every real row has an
                // unmasked key in this tile (kt0 ≤ t0 ≤ its token), padded rows score 0.
                for r in (0..rp).step_by(8) {
                    let mut mx = _mm256_loadu_ps(st.as_ptr().add(r));
                    for kk in 1..kn {
                        mx = _mm256_max_ps(mx, _mm256_loadu_ps(st.as_ptr().add(kk * rp + r)));
                    }
                    let m_old = _mm256_loadu_ps(m.as_ptr().add(r));
                    let m_new = _mm256_max_ps(m_old, mx);
                    // exp(-inf - m_new) = 0 on the first tile.
                    _mm256_storeu_ps(alpha.as_mut_ptr().add(r), exp_neg(_mm256_sub_ps(m_old, m_new)));
                    let mut sum = _mm256_setzero_ps();
                    for kk in 0..kn {
                        let pp = st.as_mut_ptr().add(kk * rp + r);
                        let p = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(pp), m_new));
                        _mm256_storeu_ps(pp, p);
                        sum = _mm256_add_ps(sum, p);
                    }
                    let lv = _mm256_loadu_ps(l.as_ptr().add(r));
                    _mm256_storeu_ps(l.as_mut_ptr().add(r), _mm256_fmadd_ps(lv, _mm256_loadu_ps(alpha.as_ptr().add(r)), sum));
                    _mm256_storeu_ps(m.as_mut_ptr().add(r), m_new);
                }
                // `O = diag(alpha) O + Pᵀ V`: rows 3 at a time (then one by one), 32 dimensions
                // at a time (then 8).
                let vr = v.as_ptr().add(kv_row(kt0));
                let vstride = kv_heads * d;
                let mut r = 0;
                while r < rows {
                    let nr = if rows - r >= 3 { 3 } else { 1 };
                    let mut c = 0;
                    while c < d {
                        let (or, al, pr, vc) = (o.as_mut_ptr().add(r * d + c), alpha.as_ptr().add(r), st.as_ptr().add(r), vr.add(c));
                        match (nr, d - c >= 32) {
                            (3, true) => pv::<3, 4>(or, d, al, pr, rp, vc, vstride, kn),
                            (3, false) => pv::<3, 1>(or, d, al, pr, rp, vc, vstride, kn),
                            (_, true) => pv::<1, 4>(or, d, al, pr, rp, vc, vstride, kn),
                            (_, false) => pv::<1, 1>(or, d, al, pr, rp, vc, vstride, kn),
                        }
                        c += if d - c >= 32 { 32 } else { 8 };
                    }
                    r += nr;
                }
                kt0 += KT;
            }
            for (r, orow) in o.chunks_exact(d).take(rows).enumerate() {
                let inv = 1.0 / l[r];
                let dst = out.add(q_row(r));
                for (c, &x) in orow.iter().enumerate() {
                    *dst.add(c) = x * inv;
                }
            }
        }
    }
}
