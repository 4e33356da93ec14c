//! Fused CPU decode attention over a (paged or contiguous) KV cache in host memory.
//!
//! [`paged_decode_attention`] computes, in one call, the attention of one new query token per
//! sequence for a whole batch of sequences and all heads, reading keys and values straight from
//! the cache's storage through each sequence's block table (no gather copy).
//!
//! # Source
//! - Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with
//!   PagedAttention", §4.1: keys/values of a sequence live in fixed-size blocks addressed through
//!   a block table; the kernel fetches position `p` from block `table[p / block_size]`, row
//!   `p % block_size`.
//! - Dao 2023, "FlashAttention-2", §3.1 (online softmax, Milakov & Gimelshein 2018): the keys are
//!   consumed in tiles of [`TILE`] positions with a running maximum `m` and running sum `l`;
//!   after each tile the output accumulator is rescaled by `exp(m_old − m_new)` and divided by
//!   `l` once at the end. No score buffer larger than one tile is materialized.
//!
//! # Semantics
//! For sequence `s` with `len` cached positions (the new token included, as the last one),
//! query head `h` and key/value head `j = h / (n_heads / kv_heads)` (grouped-query attention,
//! Ainslie et al. 2023; transformers' `repeat_kv`):
//!
//! `out[s, h] = Σ_p softmax_p(q[s, h] · k[p, j] / sqrt(head_dim)) · v[p, j]`, `p = 0 .. len`.
//!
//! The new token is the last cached position, so no causal mask is needed. Sums are f32
//! (FMA with AVX2); relative error against an f64 reference is ~1e-6 of `Σ_p p_p |v_p|`.
//! The cache may hold f16 keys and values ([`KvElement`]): they are widened exactly on load,
//! so the result is the f32 kernel's on the rounded keys and values, and a step streams half
//! the bytes (decode attention at depth is bound by reading the cache).
//!
//! # Parallelism and ISA
//! Split-K over the key positions (FlashDecoding, Dao et al. 2023; llama.cpp's and vLLM's
//! PagedAttention V2 partitions): each sequence's positions are cut into chunks of at most
//! [`CHUNK`] positions ([`split`]: an even number of equal chunks beyond one), and each
//! (sequence, chunk, kv head) gets a partial result: the unnormalized output, running max and
//! sum of the chunk for all query heads of that kv head. With at least
//! twice as many chunks as rayon threads one task computes all kv heads of a chunk (each
//! key/value row is read whole, in order); with fewer, one task per kv head. The partials of a
//! (sequence, head) are then merged in chunk order (`o = Σ_c e^{m_c − m} o_c / Σ_c e^{m_c − m}
//! l_c`). The cut depends only on the sequence's length, so a sequence gets the same bits alone
//! or in any batch, on any number of threads; a single long sequence with few kv heads still
//! keeps every core busy (SmolLM2 has 3 kv heads: without the split two threads run 2 + 1
//! tasks). Small calls run on the calling thread.
//!
//! The AVX2 + FMA task (chosen when [`Isa::detect`] finds it and `head_dim` is a multiple of 8;
//! `DECO_KERNELS=scalar` forces the portable loops) computes the scores of 8 positions at a time
//! with one horizontal reduction for the 8, exponentiates a tile with a vectorized polynomial
//! `exp` (Cephes `expf`), and keeps the output accumulator of 64 dimensions in registers across
//! a tile's positions.

use std::ops::Range;

use half::f16;

use crate::error::{Error, Result};
use crate::quant::Isa;

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
}

/// The element type of a key/value cache the kernel reads: `f32`, or IEEE binary16
/// ([`half::f16`], llama.cpp's default KV type, `-ctk f16 -ctv f16`), which halves the bytes a
/// decode step streams. Keys and values are widened to f32 on load (F16C `vcvtph2ps` in the SIMD
/// task, exact); every sum is f32 as with an f32 cache, so an f16 cache gives the result of the
/// f32 kernel on the f16-rounded keys and values.
pub trait KvElement: Copy + Send + Sync + 'static + sealed::Sealed {
    /// The element's value as f32 (exact for both types).
    fn to_f32(self) -> f32;
    /// Eight consecutive elements at `p` as f32 lanes.
    ///
    /// # Safety
    /// AVX (and F16C for f16) available; `p .. p + 8` readable.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

impl KvElement for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        // SAFETY: the caller's contract.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }
}

impl KvElement for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract (16 readable bytes, F16C).
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }
}

/// Key positions per online-softmax tile.
pub const TILE: usize = 32;

/// Most key positions per split-K chunk; see the [module docs](self) and [`split`].
pub const CHUNK: usize = 256;

/// The split-K cut of a sequence of `len` positions: `(chunks, positions per chunk)`, chunk `c`
/// covering positions `c·size .. min(len, (c + 1)·size)`. Up to [`CHUNK`] positions one chunk;
/// beyond, an even number of chunks, `2·⌈len / (2·CHUNK)⌉`, of `⌈len / chunks⌉` positions (at
/// most `CHUNK`, the last one shorter; beyond ~65,000 positions trailing chunks may be empty,
/// which add nothing). An even count splits the (chunk, kv head) tasks of one sequence evenly
/// over two threads whatever the kv-head count: with chunks of exactly `CHUNK` positions,
/// SmolLM2's 3 kv heads at 513-768 positions made 9 tasks (5 + 4) of unequal lengths. The cut
/// depends on `len` only.
pub fn split(len: usize) -> (usize, usize) {
    if len <= CHUNK {
        return (1, len.max(1));
    }
    let chunks = 2 * len.div_ceil(2 * CHUNK);
    (chunks, len.div_ceil(chunks))
}

/// Most partial results (one per sequence, chunk and kv head, `g · (head_dim + 2)` floats each)
/// held at once: 16,384 × 198 floats = 13 MB for SmolLM2.
const MAX_PARTIALS: usize = 1 << 14;

/// Below this many multiply-adds in total (`Σ len · n_heads · head_dim · 2`) the tasks run on
/// the calling thread (rayon's fork/join costs more than the work).
const PARALLEL_MIN_WORK: usize = 1 << 18;

/// One sequence's keys and values of one layer, in host memory.
///
/// `k` and `v` are arrays of blocks `[num_blocks, block_size, kv_heads, head_dim]`, row-major,
/// of f32 or f16 elements ([`KvElement`]). Position `p < len` is row `p % block_size` of block
/// `block_table[p / block_size]`. A contiguous cache `[tokens, kv_heads, head_dim]` is the case
/// `block_table = [0]`, `block_size >= len`.
#[derive(Debug, Clone, Copy)]
pub struct SeqKv<'a, E: KvElement = f32> {
    /// Key blocks.
    pub k: &'a [E],
    /// Value blocks (same layout as `k`).
    pub v: &'a [E],
    /// Block of each run of `block_size` positions; at least `len.div_ceil(block_size)` entries.
    pub block_table: &'a [u32],
    /// Positions per block (≥ 1).
    pub block_size: usize,
    /// Positions to attend to, the new token included (≥ 1).
    pub len: usize,
}

/// Head geometry of a [`paged_decode_attention`] call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnShape {
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (divides `n_heads`).
    pub kv_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
}

/// Decode attention for a batch of sequences, one query token each. See the [module
/// docs](self).
///
/// # Shapes
/// - `q`: `[seqs.len(), n_heads, head_dim]` (RoPE already applied)
/// - `seqs[i]`: the cache of sequence `i` (see [`SeqKv`]; f32 or f16 elements)
/// - `out`: `[seqs.len(), n_heads, head_dim]`, overwritten
///
/// # Errors
/// [`Error::Incompatible`] for a zero dimension, `n_heads` not a multiple of `kv_heads`, a
/// sequence with `len == 0` or `block_size == 0`, a block table too short for `len`, a block
/// outside the storage, or `k` / `v` of different lengths; [`Error::Length`] for `q` or `out` of
/// the wrong length. Nothing is written on error.
pub fn paged_decode_attention<E: KvElement>(q: &[f32], shape: AttnShape, seqs: &[SeqKv<'_, E>], out: &mut [f32]) -> Result<()> {
    paged_decode_attention_with(q, shape, seqs, out, Isa::detect())
}

/// [`paged_decode_attention`] with an explicit instruction set (falls back to
/// [`Isa::Scalar`] if `isa` is not available on this CPU).
///
/// # Errors
/// As [`paged_decode_attention`].
pub fn paged_decode_attention_with<E: KvElement>(
    q: &[f32],
    shape: AttnShape,
    seqs: &[SeqKv<'_, E>],
    out: &mut [f32],
    isa: Isa,
) -> Result<()> {
    let AttnShape { n_heads, kv_heads, head_dim } = shape;
    if n_heads == 0 || kv_heads == 0 || head_dim == 0 || !n_heads.is_multiple_of(kv_heads) {
        return Err(Error::Incompatible(format!(
            "attention heads: n_heads {n_heads}, kv_heads {kv_heads}, head_dim {head_dim} (need non-zero, kv_heads | n_heads)"
        )));
    }
    let n = seqs.len() * n_heads * head_dim;
    if q.len() != n {
        return Err(Error::Length { what: "attention q", expected: n, actual: q.len() });
    }
    if out.len() != n {
        return Err(Error::Length { what: "attention out", expected: n, actual: out.len() });
    }
    let row = kv_heads * head_dim;
    for (i, s) in seqs.iter().enumerate() {
        if s.len == 0 || s.block_size == 0 {
            return Err(Error::Incompatible(format!(
                "sequence {i}: len {} and block_size {} must be non-zero",
                s.len, s.block_size
            )));
        }
        if s.k.len() != s.v.len() {
            return Err(Error::Incompatible(format!("sequence {i}: k has {} values, v {}", s.k.len(), s.v.len())));
        }
        let blocks = s.len.div_ceil(s.block_size);
        if s.block_table.len() < blocks {
            return Err(Error::Incompatible(format!(
                "sequence {i}: block table of {} entries for {} positions of block size {}",
                s.block_table.len(),
                s.len,
                s.block_size
            )));
        }
        let block_floats = s.block_size * row;
        // The last block is read only up to row `(len - 1) % block_size`.
        for (bi, &b) in s.block_table[..blocks].iter().enumerate() {
            let rows = if bi + 1 == blocks { s.len - bi * s.block_size } else { s.block_size };
            let end = (b as usize) * block_floats + rows * row;
            if end > s.k.len() {
                return Err(Error::Incompatible(format!(
                    "sequence {i}: block {b} outside the storage of {} values",
                    s.k.len()
                )));
            }
        }
    }
    if seqs.is_empty() {
        return Ok(());
    }
    let isa = if isa.is_available() { isa } else { Isa::Scalar };
    // A long prefill is many queries over long prefixes: the sequences go through in groups of
    // at most MAX_PARTIALS partial results, which bounds the buffer; a group computes each of
    // its sequences exactly as a call of its own would.
    let per_seq = n_heads * head_dim;
    let mut s0 = 0;
    while s0 < seqs.len() {
        let (mut s1, mut count) = (s0, 0usize);
        while s1 < seqs.len() {
            let c = kv_heads * split(seqs[s1].len).0;
            if s1 > s0 && count + c > MAX_PARTIALS {
                break;
            }
            count += c;
            s1 += 1;
        }
        attend_group(&q[s0 * per_seq..s1 * per_seq], shape, &seqs[s0..s1], &mut out[s0 * per_seq..s1 * per_seq], isa);
        s0 = s1;
    }
    Ok(())
}

/// [`paged_decode_attention_with`] on validated inputs (`isa` available).
fn attend_group<E: KvElement>(q: &[f32], shape: AttnShape, seqs: &[SeqKv<'_, E>], out: &mut [f32], isa: Isa) {
    let AttnShape { n_heads, kv_heads, head_dim } = shape;
    let work = seqs.iter().fold(0usize, |w, s| w.saturating_add(s.len * n_heads * head_dim * 2));
    let g = n_heads / kv_heads;
    // Partials are (sequence, chunk, kv head), sequence-major; `first[i]` is sequence i's first.
    let mut first = Vec::with_capacity(seqs.len() + 1);
    let mut partials = 0usize;
    for s in seqs {
        first.push(partials);
        partials += kv_heads * split(s.len).0;
    }
    first.push(partials);
    // Per partial: the unnormalized output of its g query heads, then g maxima, then g sums.
    let stride = g * (head_dim + 2);
    let mut part = vec![0.0f32; partials * stride];
    let parallel = work >= PARALLEL_MIN_WORK;
    // Many chunks: a task takes all kv heads of a chunk (each key/value row is read whole, in
    // order, which the hardware prefetcher follows); few: one kv head, so that a short batch
    // still feeds every core. Which task computes a partial does not change its bits.
    let chunks = partials / kv_heads;
    let kv_per_task = if parallel && chunks >= 2 * rayon::current_num_threads() { kv_heads } else { 1 };
    let simd = isa != Isa::Scalar && head_dim.is_multiple_of(8);
    let run = |(t, ps): (usize, &mut [f32])| {
        let i0 = t * kv_per_task;
        let si = first.partition_point(|&x| x <= i0) - 1;
        let s = &seqs[si];
        // A task holds `kv_per_task` (1 or all) kv heads of one chunk: partials are sequence-,
        // then chunk-major.
        let (c, j0) = ((i0 - first[si]) / kv_heads, (i0 - first[si]) % kv_heads);
        let kvs = j0..j0 + ps.len() / stride;
        let size = split(s.len).1;
        let pos = s.len.min(c * size)..s.len.min((c + 1) * size);
        let qseq = &q[si * n_heads * head_dim..][..n_heads * head_dim];
        match simd {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `simd` holds only if `isa` (AVX2 / AVX-512, both with AVX2 + FMA + F16C) was
            // confirmed by `is_available` and `head_dim` is a multiple of 8; the bounds of
            // every row read were checked above.
            true => unsafe { x86::task(qseq, s, kvs, pos, shape, ps) },
            _ => {
                for (j, p) in kvs.zip(ps.chunks_mut(stride)) {
                    let qs = &qseq[j * g * head_dim..][..g * head_dim];
                    let (o, ml) = p.split_at_mut(g * head_dim);
                    let (m, l) = ml.split_at_mut(g);
                    scalar_task(qs, s, j, pos.clone(), shape, o, m, l);
                }
            }
        }
    };
    if parallel {
        crate::team::par_chunks_mut(&mut part, kv_per_task * stride, |i, c| run((i, c)));
    } else {
        part.chunks_mut(kv_per_task * stride).enumerate().for_each(run);
    }
    let merge = |(si, out_s): (usize, &mut [f32])| {
        let nc = split(seqs[si].len).0;
        for (h, oh) in out_s.chunks_mut(head_dim).enumerate() {
            let (j, hg) = (h / g, h % g);
            let at = |c: usize| (first[si] + c * kv_heads + j) * stride;
            let ml = |c: usize| (part[at(c) + g * head_dim + hg], part[at(c) + g * head_dim + g + hg]);
            let mx = (0..nc).map(|c| ml(c).0).fold(f32::NEG_INFINITY, f32::max);
            oh.fill(0.0);
            let mut sum = 0.0f32;
            for c in 0..nc {
                let (mc, lc) = ml(c);
                // One chunk: alpha = e^0 = 1 exactly, so `oh` is the chunk's accumulator.
                let alpha = (mc - mx).exp();
                sum += alpha * lc;
                let oc = &part[at(c) + hg * head_dim..][..head_dim];
                oh.iter_mut().zip(oc).for_each(|(x, y)| *x += alpha * y);
            }
            let inv = 1.0 / sum;
            oh.iter_mut().for_each(|x| *x *= inv);
        }
    };
    let per_seq = n_heads * head_dim;
    if parallel && seqs.len() > 1 {
        crate::team::par_chunks_mut(out, per_seq, |i, c| merge((i, c)));
    } else {
        out.chunks_mut(per_seq).enumerate().for_each(merge);
    }
}

impl<E: KvElement> SeqKv<'_, E> {
    /// The storage row (`[kv_heads, head_dim]` values) of position `p < len`:
    /// `block_table[p / block_size] · block_size + p % block_size`.
    #[inline(always)]
    pub fn physical_row(&self, p: usize) -> usize {
        self.block_table[p / self.block_size] as usize * self.block_size + p % self.block_size
    }
}

/// Offset of position `p` (kv head 0) in the storage of `s` (`row` = `kv_heads · head_dim`).
#[inline(always)]
fn row_offset<E: KvElement>(s: &SeqKv<'_, E>, p: usize, row: usize) -> usize {
    s.physical_row(p) * row
}

/// The portable task: the online softmax of the `g` query heads `qs` (`[g, head_dim]`) of kv
/// head `kvh` over positions `pos` of `s`. Writes the unnormalized output `o` (`[g, head_dim]`),
/// the running maxima `m` and sums `l` (`[g]`).
#[allow(clippy::too_many_arguments)]
fn scalar_task<E: KvElement>(
    qs: &[f32],
    s: &SeqKv<'_, E>,
    kvh: usize,
    pos: Range<usize>,
    shape: AttnShape,
    o: &mut [f32],
    m: &mut [f32],
    l: &mut [f32],
) {
    let AttnShape { kv_heads, head_dim: d, .. } = shape;
    let row = kv_heads * d;
    let kvo = kvh * d;
    let scale = 1.0 / (d as f32).sqrt();
    m.fill(f32::NEG_INFINITY);
    l.fill(0.0);
    o.fill(0.0);
    let mut offs = [0usize; TILE];
    let mut sc = [0.0f32; TILE];
    let mut p0 = pos.start;
    while p0 < pos.end {
        let t = TILE.min(pos.end - p0);
        for (i, off) in offs[..t].iter_mut().enumerate() {
            *off = row_offset(s, p0 + i, row) + kvo;
        }
        for (h, qh) in qs.chunks(d).enumerate() {
            let mut tile_max = f32::NEG_INFINITY;
            for (sv, &off) in sc[..t].iter_mut().zip(&offs[..t]) {
                *sv = qh.iter().zip(&s.k[off..off + d]).map(|(x, y)| x * y.to_f32()).sum::<f32>() * scale;
                tile_max = tile_max.max(*sv);
            }
            let m_new = m[h].max(tile_max);
            let oh = &mut o[h * d..(h + 1) * d];
            // exp(-inf) = 0 on the first tile: nothing to rescale.
            let alpha = (m[h] - m_new).exp();
            if alpha != 1.0 {
                oh.iter_mut().for_each(|x| *x *= alpha);
            }
            let mut sum = 0.0f32;
            for (&sv, &off) in sc[..t].iter().zip(&offs[..t]) {
                let p = (sv - m_new).exp();
                sum += p;
                oh.iter_mut().zip(&s.v[off..off + d]).for_each(|(a, x)| *a += p * x.to_f32());
            }
            l[h] = l[h] * alpha + sum;
            m[h] = m_new;
        }
        p0 += t;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use std::ops::Range;

    use super::{AttnShape, KvElement, SeqKv, TILE, row_offset};
    use crate::simd::{exp_neg, hsum};

    /// `[Σ a_0, …, Σ a_7]`: the horizontal sums of eight vectors in one vector.
    #[inline(always)]
    unsafe fn hsum8(a: &[__m256; 8]) -> __m256 {
        // SAFETY (whole body): register-only AVX instructions.
        unsafe {
            let t0 = _mm256_hadd_ps(a[0], a[1]);
            let t1 = _mm256_hadd_ps(a[2], a[3]);
            let t2 = _mm256_hadd_ps(a[4], a[5]);
            let t3 = _mm256_hadd_ps(a[6], a[7]);
            // u0 = [a0 a1 a2 a3 (low halves) | a0 a1 a2 a3 (high halves)], u1 the same for a4..a7.
            let u0 = _mm256_hadd_ps(t0, t1);
            let u1 = _mm256_hadd_ps(t2, t3);
            let lo = _mm256_permute2f128_ps(u0, u1, 0x20);
            let hi = _mm256_permute2f128_ps(u0, u1, 0x31);
            _mm256_add_ps(lo, hi)
        }
    }

    #[inline(always)]
    unsafe fn hmax(v: __m256) -> f32 {
        // SAFETY: register-only AVX instructions.
        unsafe {
            let h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)))
        }
    }

    /// `acc[0..W·8] = alpha · o + Σ_i p_i · v(offs_i)` with the accumulator in registers.
    ///
    /// # Safety
    /// AVX2 + FMA (+ F16C for f16); `o` holds `W · 8` values; every `v + off_i` holds `W · 8`
    /// values.
    #[inline(always)]
    unsafe fn pv_block<E: KvElement, const W: usize>(o: *mut f32, alpha: f32, p: &[f32], offs: &[usize], v: *const E) {
        // SAFETY: the caller's contract covers every load and store.
        unsafe {
            let a = _mm256_set1_ps(alpha);
            let mut acc = [_mm256_setzero_ps(); W];
            for (k, x) in acc.iter_mut().enumerate() {
                *x = _mm256_mul_ps(_mm256_loadu_ps(o.add(8 * k)), a);
            }
            for (&pi, &off) in p.iter().zip(offs) {
                let pb = _mm256_set1_ps(pi);
                let vp = v.add(off);
                for (k, x) in acc.iter_mut().enumerate() {
                    *x = _mm256_fmadd_ps(pb, E::load8(vp.add(8 * k)), *x);
                }
            }
            for (k, x) in acc.iter().enumerate() {
                _mm256_storeu_ps(o.add(8 * k), *x);
            }
        }
    }

    /// The AVX2 task: for each kv head `j` of `kvs`, the partial of `super::scalar_task` (the
    /// unnormalized output `[g, head_dim]`, the maxima `[g]`, the sums `[g]`, in
    /// `parts[(j − kvs.start) · g · (head_dim + 2)..]`) over positions `pos`, for `head_dim` a
    /// multiple of 8. The tiles are the outer loop: a tile's key and value rows (the columns of
    /// all of the task's kv heads) are prefetched together one tile ahead, and each head's
    /// arithmetic is the same, in the same order, as in a task of that head alone (so which
    /// task computes a partial does not change its bits).
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available; `head_dim % 8 == 0`; `kvs.end <= kv_heads`; the
    /// rows of `s` at `pos` must be in bounds (checked by the caller); `q` holds
    /// `n_heads · head_dim` values (this sequence's query), `parts`
    /// `kvs.len() · g · (head_dim + 2)`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn task<E: KvElement>(q: &[f32], s: &SeqKv<'_, E>, kvs: Range<usize>, pos: Range<usize>, shape: AttnShape, parts: &mut [f32]) {
        let AttnShape { n_heads, kv_heads, head_dim: d } = shape;
        let g = n_heads / kv_heads;
        let stride = g * (d + 2);
        let row = kv_heads * d;
        let scale = _mm256_set1_ps(1.0 / (d as f32).sqrt());
        for p in parts.chunks_mut(stride) {
            let (o, ml) = p.split_at_mut(g * d);
            o.fill(0.0);
            ml[..g].fill(f32::NEG_INFINITY);
            ml[g..].fill(0.0);
        }
        let (kp, vp) = (s.k.as_ptr(), s.v.as_ptr());
        // The task's columns of a row: kv heads `kvs`, `span` floats from `lo`.
        let (lo, span) = (kvs.start * d, kvs.len() * d);
        let mut offs = [0usize; TILE];
        let mut sc = [0.0f32; TILE];
        let mut p0 = pos.start;
        // SAFETY (loop body): every key/value row read is `offs[i] + j · d .. + d` with
        // `offs[i]` a checked row of this sequence (padding lanes repeat the last real row) and
        // `j < kv_heads`; `q` is read at `(j · g + h) · d .. + d`, and `parts` written within
        // partial `j − kvs.start`, h < g.
        unsafe {
            while p0 < pos.end {
                let t = TILE.min(pos.end - p0);
                let t8 = t.div_ceil(8) * 8;
                for (i, off) in offs[..t].iter_mut().enumerate() {
                    *off = row_offset(s, p0 + i, row);
                }
                let last = offs[t - 1];
                offs[t..t8].fill(last);
                // The next tile's key and value rows (the task's kv heads), ahead of use, into
                // L2: a sequence's blocks are scattered, so the hardware prefetcher loses the
                // stream at every block edge, and a long cache does not fit in L3 (30 layers ×
                // 1,000 positions of SmolLM2 are 46 MB of f32 keys and values). Into L1 (`T0`)
                // the next tile evicted the current one: `decode_attention_bench stream` (30
                // layers from DRAM, 576 positions) went from 78-81 to 61-62 µs per layer with
                // `T1` on the AMD EPYC (Zen 4) machine.
                let pn = p0 + t;
                for p in pn..pos.end.min(pn + TILE) {
                    let off = row_offset(s, p, row) + lo;
                    for l in (0..span).step_by(64 / size_of::<E>()) {
                        _mm_prefetch::<_MM_HINT_T1>(kp.add(off + l) as *const i8);
                        _mm_prefetch::<_MM_HINT_T1>(vp.add(off + l) as *const i8);
                    }
                }
                for (j, part) in kvs.clone().zip(parts.chunks_mut(stride)) {
                    let (kj, vj) = (kp.add(j * d), vp.add(j * d));
                    let (o, ml) = part.split_at_mut(g * d);
                    let (m, l) = ml.split_at_mut(g);
                    for (h, mh) in m.iter_mut().enumerate() {
                        let qh = q.as_ptr().add((j * g + h) * d);
                        // Scores of 8 positions at a time, one reduction for the 8.
                        for i0 in (0..t8).step_by(8) {
                            let mut a = [_mm256_setzero_ps(); 8];
                            for c in (0..d).step_by(8) {
                                let qv = _mm256_loadu_ps(qh.add(c));
                                for (i, x) in a.iter_mut().enumerate() {
                                    *x = _mm256_fmadd_ps(qv, E::load8(kj.add(offs[i0 + i] + c)), *x);
                                }
                            }
                            _mm256_storeu_ps(sc.as_mut_ptr().add(i0), _mm256_mul_ps(hsum8(&a), scale));
                        }
                        sc[t..t8].fill(f32::NEG_INFINITY);
                        let mut mv = _mm256_loadu_ps(sc.as_ptr());
                        for i0 in (8..t8).step_by(8) {
                            mv = _mm256_max_ps(mv, _mm256_loadu_ps(sc.as_ptr().add(i0)));
                        }
                        let m_new = mh.max(hmax(mv));
                        // exp(-inf) = 0 on the first tile.
                        let alpha = (*mh - m_new).exp();
                        let mn = _mm256_set1_ps(m_new);
                        let mut sv = _mm256_setzero_ps();
                        for i0 in (0..t8).step_by(8) {
                            let p = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(sc.as_ptr().add(i0)), mn));
                            _mm256_storeu_ps(sc.as_mut_ptr().add(i0), p);
                            sv = _mm256_add_ps(sv, p);
                        }
                        l[h] = l[h] * alpha + hsum(sv);
                        *mh = m_new;
                        let oh = o.as_mut_ptr().add(h * d);
                        let mut c0 = 0;
                        while c0 + 64 <= d {
                            pv_block::<E, 8>(oh.add(c0), alpha, &sc[..t], &offs[..t], vj.add(c0));
                            c0 += 64;
                        }
                        while c0 + 16 <= d {
                            pv_block::<E, 2>(oh.add(c0), alpha, &sc[..t], &offs[..t], vj.add(c0));
                            c0 += 16;
                        }
                        if c0 < d {
                            pv_block::<E, 1>(oh.add(c0), alpha, &sc[..t], &offs[..t], vj.add(c0));
                        }
                    }
                }
                p0 += t;
            }
        }
    }
}
