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
//!
//! # Parallelism and ISA
//! With at least twice as many sequences as rayon threads, one task per sequence (all its kv
//! heads, so each key/value row is read once, whole, while it is in L1); with fewer, one task
//! per (sequence, kv head) so that a single long sequence still uses every core. A task handles
//! all query heads of its kv heads. Small batches run on the calling thread.
//! Dot products and the `acc += p · v` updates use AVX2 + FMA when [`Isa::detect`] finds them
//! (`DECO_KERNELS=scalar` forces the portable loops).

use std::ops::Range;

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::quant::Isa;

/// Key positions per online-softmax tile.
pub const TILE: usize = 32;

/// Below this many multiply-adds in total (`Σ len · n_heads · head_dim · 2`) the tasks run on
/// the calling thread (rayon's fork/join costs more than the work).
const PARALLEL_MIN_WORK: usize = 1 << 18;

/// One sequence's keys and values of one layer, in host memory.
///
/// `k` and `v` are arrays of blocks `[num_blocks, block_size, kv_heads, head_dim]`, row-major.
/// Position `p < len` is row `p % block_size` of block `block_table[p / block_size]`. A
/// contiguous cache `[tokens, kv_heads, head_dim]` is the case `block_table = [0]`,
/// `block_size >= len`.
#[derive(Debug, Clone, Copy)]
pub struct SeqKv<'a> {
    /// Key blocks.
    pub k: &'a [f32],
    /// Value blocks (same layout as `k`).
    pub v: &'a [f32],
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
/// - `seqs[i]`: the cache of sequence `i` (see [`SeqKv`])
/// - `out`: `[seqs.len(), n_heads, head_dim]`, overwritten
///
/// # Errors
/// [`Error::Incompatible`] for a zero dimension, `n_heads` not a multiple of `kv_heads`, a
/// sequence with `len == 0` or `block_size == 0`, a block table too short for `len`, a block
/// outside the storage, or `k` / `v` of different lengths; [`Error::Length`] for `q` or `out` of
/// the wrong length. Nothing is written on error.
pub fn paged_decode_attention(q: &[f32], shape: AttnShape, seqs: &[SeqKv<'_>], out: &mut [f32]) -> Result<()> {
    paged_decode_attention_with(q, shape, seqs, out, Isa::detect())
}

/// [`paged_decode_attention`] with an explicit instruction set (falls back to
/// [`Isa::Scalar`] if `isa` is not available on this CPU).
///
/// # Errors
/// As [`paged_decode_attention`].
pub fn paged_decode_attention_with(
    q: &[f32],
    shape: AttnShape,
    seqs: &[SeqKv<'_>],
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
    let mut work = 0usize;
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
        work = work.saturating_add(s.len * n_heads * head_dim * 2);
    }
    if seqs.is_empty() {
        return Ok(());
    }
    let isa = if isa.is_available() { isa } else { Isa::Scalar };
    let g = n_heads / kv_heads;
    // Many sequences: one task per sequence over all its kv heads (each key/value row is read
    // once, whole); few sequences: one task per (sequence, kv head) so every core gets work.
    let parallel = work >= PARALLEL_MIN_WORK;
    let kv_per_task = if parallel && seqs.len() >= 2 * rayon::current_num_threads() { kv_heads } else { 1 };
    let tasks_per_seq = kv_heads / kv_per_task;
    let task = |(t, o): (usize, &mut [f32])| {
        let (si, kv0) = (t / tasks_per_seq, (t % tasks_per_seq) * kv_per_task);
        let qs = &q[(si * n_heads + kv0 * g) * head_dim..][..kv_per_task * g * head_dim];
        let s = &seqs[si];
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `isa` is Avx2 / Avx512 only if `is_available` confirmed AVX2 and FMA;
            // the bounds of every row read were checked above.
            Isa::Avx2 | Isa::Avx512 => unsafe { x86::task(qs, s, kv0..kv0 + kv_per_task, shape, o) },
            _ => scalar_task(qs, s, kv0..kv0 + kv_per_task, shape, o),
        }
    };
    let chunk = kv_per_task * g * head_dim;
    if parallel {
        out.par_chunks_mut(chunk).enumerate().for_each(task);
    } else {
        out.chunks_mut(chunk).enumerate().for_each(task);
    }
    Ok(())
}

/// Offset of position `p` (kv head 0) in the storage of `s` (`row` = `kv_heads · head_dim`).
#[inline(always)]
fn row_offset(s: &SeqKv<'_>, p: usize, row: usize) -> usize {
    (s.block_table[p / s.block_size] as usize * s.block_size + p % s.block_size) * row
}

/// The online-softmax loop of one task, generic over the vector primitives (inlined into the
/// scalar and the AVX2 entry points).
///
/// `qs`: the query heads of kv heads `kvs`, `[kvs.len() · g, head_dim]`; `o`: same shape, out.
#[inline(always)]
fn task_body<D, A>(qs: &[f32], s: &SeqKv<'_>, kvs: Range<usize>, shape: AttnShape, o: &mut [f32], dot: D, axpy: A)
where
    D: Fn(&[f32], &[f32]) -> f32,
    A: Fn(&mut [f32], f32, &[f32]),
{
    let AttnShape { n_heads, kv_heads, head_dim: d } = shape;
    let g = n_heads / kv_heads;
    let row = kv_heads * d;
    let scale = 1.0 / (d as f32).sqrt();
    let nh = kvs.len() * g;
    // Running max and sum per query head; `o` is the unnormalized accumulator.
    let mut m = vec![f32::NEG_INFINITY; nh];
    let mut l = vec![0.0f32; nh];
    o.fill(0.0);
    let mut offs = [0usize; TILE];
    let mut sc = [0.0f32; TILE];
    let mut p0 = 0;
    while p0 < s.len {
        let t = TILE.min(s.len - p0);
        for (i, off) in offs[..t].iter_mut().enumerate() {
            *off = row_offset(s, p0 + i, row);
        }
        for (j, kvh) in kvs.clone().enumerate() {
            let kvo = kvh * d;
            for hg in 0..g {
                let h = j * g + hg;
                let qh = &qs[h * d..(h + 1) * d];
                let mut tile_max = f32::NEG_INFINITY;
                for (sv, &off) in sc[..t].iter_mut().zip(&offs[..t]) {
                    *sv = dot(qh, &s.k[off + kvo..off + kvo + d]) * scale;
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
                    axpy(oh, p, &s.v[off + kvo..off + kvo + d]);
                }
                l[h] = l[h] * alpha + sum;
                m[h] = m_new;
            }
        }
        p0 += t;
    }
    for (h, lh) in l.iter().enumerate() {
        let inv = 1.0 / lh;
        o[h * d..(h + 1) * d].iter_mut().for_each(|x| *x *= inv);
    }
}

fn scalar_task(qs: &[f32], s: &SeqKv<'_>, kvs: Range<usize>, shape: AttnShape, o: &mut [f32]) {
    task_body(
        qs,
        s,
        kvs,
        shape,
        o,
        |a, b| a.iter().zip(b).map(|(x, y)| x * y).sum(),
        |acc, p, v| acc.iter_mut().zip(v).for_each(|(a, x)| *a += p * x),
    );
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use std::ops::Range;

    use super::{AttnShape, SeqKv, task_body};

    /// `Σ a_i b_i` over `a.len()` (= `b.len()`) values, two FMA chains.
    ///
    /// # Safety
    /// AVX2 and FMA must be available; `b.len() >= a.len()`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len();
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut i = 0;
        // SAFETY: every load reads 8 values at `i .. i + 8 <= n` of `a` and `b`.
        unsafe {
            let mut s0 = _mm256_setzero_ps();
            let mut s1 = _mm256_setzero_ps();
            while i + 16 <= n {
                s0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), s0);
                s1 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i + 8)), _mm256_loadu_ps(pb.add(i + 8)), s1);
                i += 16;
            }
            if i + 8 <= n {
                s0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), s0);
                i += 8;
            }
            let v = _mm256_add_ps(s0, s1);
            let h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            let h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
            let mut s = _mm_cvtss_f32(h);
            while i < n {
                s += a[i] * b[i];
                i += 1;
            }
            s
        }
    }

    /// `acc += p · v` over `acc.len()` (= `v.len()`) values.
    ///
    /// # Safety
    /// AVX2 and FMA must be available; `v.len() >= acc.len()`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn axpy(acc: &mut [f32], p: f32, v: &[f32]) {
        let n = acc.len();
        let (pa, pv) = (acc.as_mut_ptr(), v.as_ptr());
        let mut i = 0;
        // SAFETY: every load/store touches 8 values at `i .. i + 8 <= n` of `acc` and `v`.
        unsafe {
            let pp = _mm256_set1_ps(p);
            while i + 8 <= n {
                let r = _mm256_fmadd_ps(pp, _mm256_loadu_ps(pv.add(i)), _mm256_loadu_ps(pa.add(i)));
                _mm256_storeu_ps(pa.add(i), r);
                i += 8;
            }
        }
        while i < n {
            acc[i] += p * v[i];
            i += 1;
        }
    }

    /// The AVX2 task.
    ///
    /// # Safety
    /// AVX2 and FMA must be available; the rows of `s` must be in bounds (checked by the caller).
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn task(qs: &[f32], s: &SeqKv<'_>, kvs: Range<usize>, shape: AttnShape, o: &mut [f32]) {
        task_body(
            qs,
            s,
            kvs,
            shape,
            o,
            // SAFETY: AVX2/FMA are available (this function's contract); every key row slice
            // has `head_dim` values, as the query head.
            |a, b| unsafe { dot(a, b) },
            // SAFETY: as above, accumulator and value row both have `head_dim` values.
            |acc, p, v| unsafe { axpy(acc, p, v) },
        );
    }
}
