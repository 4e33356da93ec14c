//! Q4_K / Q6_K rows repacked for many tokens (prefill): the 8-bit-activation k-quant kernels
//! of `q8_rows8_k_body!` transpose the codes of 8 rows and decode their scales for every group
//! of `T` tokens that passes over a row group. With a long prompt each row group meets
//! `n / T` token groups, so [`repack8`] does that work once per call instead: one group of 8
//! rows × one super-block becomes 8 slots of [`SLOT_BYTES`], one per 32-weight sub-block, each
//! holding the sub-block's codes of the 8 rows as unsigned bytes, transposed (vector `g` holds
//! weights `4g .. 4g + 4` of row `r` in 32-bit lane `r`), and its two scale vectors (f32, one
//! row per lane). This is the idea of llama.cpp's `REPACK` (`block_q4_Kx8`, made once at load
//! there, per call here so that the stored matrix stays the GGUF blocks), laid out for the
//! kernels below.
//!
//! The 32-weight block types (Q4_0, Q4_1, Q5_0, Q8_0) get one slot per block ([`repack8_32`]:
//! the codes of `x86::q8_rows8`, and `d`, `m` as f32).
//!
//! [`q8_repacked_avx2`] and [`q8_repacked_vnni`] then load each slot's code vectors once per
//! token group and multiply them with `T` tokens' broadcast activations. Their integer sums are
//! exact and their float operations per (row, token) are those of `q8_rows8_k_body!` /
//! `q8_rows8` in the same order, so a token's result has the same bits through either layout
//! (the batch invariance the tests check).

use std::arch::x86_64::*;

use super::x86::{block32_codes8, halves_to_f32, transpose8x1};
use super::{BLOCK, BlockType};

/// Bytes of one repacked slot: 8 code vectors and 2 scale vectors of 32 bytes.
pub(super) const SLOT_BYTES: usize = 10 * 32;

/// Bytes of one repacked group of 8 rows × one k-quant super-block (8 slots).
pub(super) const GROUP_SB_BYTES: usize = 8 * SLOT_BYTES;

/// The sub-block held by slot `q` of a repacked super-block of type `TY` (3: Q4_K, 5: Q6_K):
/// the order in which `kquant_sub_blocks!` visits them (Q6_K: 0, 2, 1, 3, 4, 6, 5, 7), which the
/// float sums must keep.
#[inline(always)]
const fn slot_sub<const TY: u8>(q: usize) -> usize {
    const Q6K_ORDER: [usize; 8] = [0, 2, 1, 3, 4, 6, 5, 7];
    if TY == 3 { q } else { Q6K_ORDER[q] }
}

/// Stores one slot: 8 code vectors, then the scale vectors `a` and `b`.
///
/// # Safety
/// AVX; `SLOT_BYTES` writable bytes at `p`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn put_slot(p: *mut u8, w: &[__m256i; 8], a: __m256, b: __m256) {
    // SAFETY: the caller's contract.
    unsafe {
        for (g, v) in w.iter().enumerate() {
            _mm256_storeu_si256(p.add(32 * g) as *mut __m256i, *v);
        }
        _mm256_storeu_ps(p.add(256) as *mut f32, a);
        _mm256_storeu_ps(p.add(288) as *mut f32, b);
    }
}

/// Repacks one super-block of 8 rows of `ty` (Q4_K or Q6_K; row `r` at `blk + r · row_bytes`,
/// `row_bytes` possibly 0, or with `interleaved` the 8 rows' blocks interleaved at `blk`,
/// `PackedMatrix::interleave8`) into `GROUP_SB_BYTES` at `out`: slot `q` holds what
/// `kquant_sub_blocks!` gives for its `q`-th sub-block (`slot_sub(q)`): the 8 transposed code
/// vectors (Q4_K: the 4-bit codes; Q6_K: the 6-bit codes before the `− 32`), then Q4_K's `d·sc`
/// and `dmin·m`, or Q6_K's `d·sc` of weights 0..16 and of 16..32.
///
/// # Safety
/// AVX2, FMA and F16C; a whole block at `blk + r · row_bytes` for r in 0..8 (with `interleaved`
/// the 8 blocks' interleaved bytes at `blk`); `GROUP_SB_BYTES` writable bytes at `out`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn repack8(ty: BlockType, blk: *const u8, row_bytes: usize, interleaved: bool, out: *mut u8) {
    // SAFETY: the caller's contract; the 8 slots are inside the group.
    unsafe {
        const IL: bool = true;
        const GGUF: bool = false;
        // Sub-block `s` goes to slot `slot_sub(s)`: the visiting order is its own inverse.
        macro_rules! repack {
            ($ty:literal, $il:ident) => {
                kquant_sub_blocks!($ty, blk, row_bytes, $il, |s, w, a, b| { put_slot(out.add(slot_sub::<$ty>(s) * SLOT_BYTES), w, a, b) })
            };
        }
        match (ty == BlockType::Q4_K, interleaved) {
            (true, false) => repack!(3, GGUF),
            (true, true) => repack!(3, IL),
            (false, false) => repack!(5, GGUF),
            (false, true) => repack!(5, IL),
        }
    }
}

/// Repacks one 32-weight block of 8 rows of `ty` (Q4_0, Q4_1, Q5_0 or Q8_0; row `r` at
/// `blk + r · row_bytes`, `row_bytes` possibly 0) into one slot of [`SLOT_BYTES`] at `out`: the
/// 8 transposed code vectors (Q4_0 / Q4_1 nibbles and Q5_0 5-bit codes unsigned, Q8_0 codes
/// signed) and the f32 vectors `d` and (Q4_1) `m`, as `x86::q8_rows8` computes them.
///
/// # Safety
/// AVX2, FMA and F16C; a whole block at `blk + r · row_bytes` for r in 0..8; `SLOT_BYTES`
/// writable bytes at `out`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn repack8_32(ty: BlockType, blk: *const u8, row_bytes: usize, out: *mut u8) {
    // SAFETY: the caller's contract.
    unsafe {
        let dm = transpose8x1(blk, row_bytes);
        let d = halves_to_f32::<false>(dm);
        let m = if ty == BlockType::Q4_1 { halves_to_f32::<true>(dm) } else { _mm256_setzero_ps() };
        let w = match ty {
            BlockType::Q4_0 => block32_codes8::<0>(blk, row_bytes),
            BlockType::Q4_1 => block32_codes8::<1>(blk, row_bytes),
            BlockType::Q5_0 => block32_codes8::<4>(blk, row_bytes),
            _ => block32_codes8::<2>(blk, row_bytes),
        };
        put_slot(out, &w, d, m);
    }
}

/// The operands of one call of the repacked kernels: `units` repacked units (k-quant
/// super-blocks of 8 slots, or 32-weight blocks of one slot) of one group of 8 rows at `pk`,
/// `T` tokens of 8-bit activations from the span's first block (`xq`: codes, rows spaced
/// `stride`; `xd`, `xs`, `xi`, `xl`: per-block scales, scaled sums, integer sums and first-half
/// integer sums, rows spaced `nb`, as `super::QuantizedActivations`), and the running sums in
/// `y`: token `k`'s are `rk` f32 (8, or 1 for a leftover row repacked in all lanes) at
/// `y + k · ys`, read first unless `first` (then they start at 0) and written back.
#[derive(Clone, Copy)]
pub(super) struct Span {
    pub pk: *const u8,
    pub units: usize,
    pub nb: usize,
    pub xq: *const i8,
    pub xd: *const f32,
    pub xs: *const f32,
    pub xi: *const i32,
    pub xl: *const i32,
    pub stride: usize,
    pub y: *mut f32,
    pub ys: usize,
    pub rk: usize,
    pub first: bool,
}

/// The running sums of `T` tokens from `a.y` (zeros if `a.first`).
///
/// # Safety
/// AVX; `a.y` as [`Span`] says.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_sums<const T: usize>(a: &Span) -> [__m256; T] {
    std::array::from_fn(|k| {
        if a.first {
            _mm256_setzero_ps()
        } else if a.rk == 8 {
            // SAFETY: the caller's contract.
            unsafe { _mm256_loadu_ps(a.y.add(k * a.ys)) }
        } else {
            // SAFETY: the caller's contract.
            unsafe { _mm256_set1_ps(*a.y.add(k * a.ys)) }
        }
    })
}

/// Writes the running sums of `T` tokens back to `a.y` (lane 0 only for a leftover row).
///
/// # Safety
/// AVX; `a.y` as [`Span`] says.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn store_sums<const T: usize>(a: &Span, acc: &[__m256; T]) {
    for (k, v) in acc.iter().enumerate() {
        // SAFETY: the caller's contract.
        unsafe {
            if a.rk == 8 {
                _mm256_storeu_ps(a.y.add(k * a.ys), *v);
            } else {
                *a.y.add(k * a.ys) = _mm256_cvtss_f32(*v);
            }
        }
    }
}

/// The body of the repacked k-quant kernels (`TY` 3: Q4_K, 5: Q6_K), written once for AVX2 and
/// VNNI: `$acc(a, w, x)` adds the 4-byte products of unsigned `w` and signed `x` to the partial
/// sums `a` (AVX2: 16-bit lanes, `vpmaddubsw` + `vpaddw`; VNNI: 32-bit lanes, `vpdpbusd`), and
/// `$fin(a)` turns partial sums into the 32-bit sum of each lane (AVX2: `vpmaddwd` with ones);
/// `$pair(a, w0, x0, w1, x1)` adds two groups' products to 32-bit sums `a`. Q4_K sums all 8
/// groups with `$acc` before `$fin` (8 · 2 · 15 · 127 = 30,480 fits 16 bits), Q6_K two groups
/// at a time with `$pair` (2 · 2 · 63 · 127 = 32,004). Each slot's code vectors are loaded once
/// and used by all `T` tokens.
macro_rules! kquant_body {
    ($ty:ident, $t:ident, $a:ident, $acc:expr, $fin:expr, $pair:expr) => {{
        let a = $a;
        let Span { pk, units, nb, xq, xd, xs, xi, xl, stride, .. } = *a;
        // SAFETY: the caller's contract (see `Span`).
        let mut acc: [__m256; $t] = unsafe { load_sums::<$t>(a) };
        for sb in 0..units {
            for q in 0..8 {
                let b = sb * 8 + slot_sub::<$ty>(q);
                // SAFETY: slot q of super-block sb is inside the span, block b of every token
                // inside the activations (the caller's contract).
                unsafe {
                    let p = pk.add((sb * 8 + q) * SLOT_BYTES);
                    let w = |g: usize| _mm256_loadu_si256(p.add(32 * g) as *const __m256i);
                    let x = |k: usize, g: usize| _mm256_set1_epi32((xq.add(k * stride + b * BLOCK + 4 * g) as *const i32).read_unaligned());
                    let da = _mm256_loadu_ps(p.add(256) as *const f32);
                    let db = _mm256_loadu_ps(p.add(288) as *const f32);
                    if $ty == 3 {
                        let mut s = [_mm256_setzero_si256(); $t];
                        for g in 0..8 {
                            let wg = w(g);
                            for k in 0..$t {
                                s[k] = $acc(s[k], wg, x(k, g));
                            }
                        }
                        for k in 0..$t {
                            let i = k * nb + b;
                            let dx = _mm256_set1_ps(*xd.add(i));
                            acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps($fin(s[k])), _mm256_mul_ps(da, dx), acc[k]);
                            acc[k] = _mm256_fnmadd_ps(db, _mm256_set1_ps(*xs.add(i)), acc[k]);
                        }
                    } else {
                        for half in 0..2 {
                            let mut s = [_mm256_setzero_si256(); $t];
                            for pair in 0..2 {
                                let g = 4 * half + 2 * pair;
                                let (w0, w1) = (w(g), w(g + 1));
                                for k in 0..$t {
                                    s[k] = $pair(s[k], w0, x(k, g), w1, x(k, g + 1));
                                }
                            }
                            for k in 0..$t {
                                let i = k * nb + b;
                                let dx = _mm256_set1_ps(*xd.add(i));
                                let il = *xl.add(i);
                                let sum = if half == 0 { il } else { *xi.add(i) - il };
                                let v = _mm256_sub_epi32(s[k], _mm256_set1_epi32(32 * sum));
                                acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_mul_ps(if half == 0 { da } else { db }, dx), acc[k]);
                            }
                        }
                    }
                }
            }
        }
        // SAFETY: as `load_sums`.
        unsafe { store_sums::<$t>(a, &acc) };
    }};
}

/// The body of the repacked 32-block kernels (`TY` 0: Q4_0, 1: Q4_1, 4: Q5_0, 2: Q8_0), written
/// once for AVX2 and VNNI. `$acc` and `$fin` as in `kquant_body!`: Q4 codes sum all 8 groups
/// before `$fin` (30,480 fits 16 bits), Q5_0 4 at a time (31,496). `$q8(a, w, x)` adds Q8_0's
/// signed products to 32-bit sums (AVX2: ggml's sign trick; VNNI: `w ^ 0x80`, then
/// `− $q8off · Σ qx` once per block). Per (row, token) the float operations are those of
/// `x86::q8_rows8` / `x86_512::q8_rows8` in the same order: the same bits.
macro_rules! block32_body {
    ($ty:ident, $t:ident, $a:ident, $acc:expr, $fin:expr, $q8:expr, $q8off:expr) => {{
        let a = $a;
        let Span { pk, units, nb, xq, xd, xs, xi, stride, .. } = *a;
        // SAFETY: the caller's contract (see `Span`).
        let mut acc: [__m256; $t] = unsafe { load_sums::<$t>(a) };
        for b in 0..units {
            // SAFETY: slot b is inside the span, block b of every token inside the activations
            // (the caller's contract).
            unsafe {
                let p = pk.add(b * SLOT_BYTES);
                let w = |g: usize| _mm256_loadu_si256(p.add(32 * g) as *const __m256i);
                let x = |k: usize, g: usize| _mm256_set1_epi32((xq.add(k * stride + b * BLOCK + 4 * g) as *const i32).read_unaligned());
                let d = _mm256_loadu_ps(p.add(256) as *const f32);
                let mut s = [_mm256_setzero_si256(); $t];
                if $ty == 2 {
                    for g in 0..8 {
                        let wg = w(g);
                        for k in 0..$t {
                            s[k] = $q8(s[k], wg, x(k, g));
                        }
                    }
                } else if $ty == 4 {
                    for half in 0..2 {
                        let mut h = [_mm256_setzero_si256(); $t];
                        for g in 4 * half..4 * half + 4 {
                            let wg = w(g);
                            for k in 0..$t {
                                h[k] = $acc(h[k], wg, x(k, g));
                            }
                        }
                        for k in 0..$t {
                            s[k] = _mm256_add_epi32(s[k], $fin(h[k]));
                        }
                    }
                } else {
                    for g in 0..8 {
                        let wg = w(g);
                        for k in 0..$t {
                            s[k] = $acc(s[k], wg, x(k, g));
                        }
                    }
                    for k in 0..$t {
                        s[k] = $fin(s[k]);
                    }
                }
                for k in 0..$t {
                    let i = k * nb + b;
                    let off = match $ty {
                        0 => 8,
                        4 => 16,
                        2 => $q8off,
                        _ => 0,
                    };
                    let v = if off != 0 { _mm256_sub_epi32(s[k], _mm256_set1_epi32(off * *xi.add(i))) } else { s[k] };
                    let scale = _mm256_mul_ps(d, _mm256_set1_ps(*xd.add(i)));
                    acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), scale, acc[k]);
                    if $ty == 1 {
                        acc[k] = _mm256_fmadd_ps(_mm256_loadu_ps(p.add(288) as *const f32), _mm256_set1_ps(*xs.add(i)), acc[k]);
                    }
                }
            }
        }
        // SAFETY: as `load_sums`.
        unsafe { store_sums::<$t>(a, &acc) };
    }};
}

/// The repacked kernels with AVX2 (`vpmaddubsw`, `vpaddw`, `vpmaddwd`): the span `a` of `ty`
/// (units: super-blocks for Q4_K / Q6_K, blocks otherwise) with `T` tokens, added to the running
/// sums in `a.y`. Over the spans of a row the float operations are those of `x86::q8_rows8_k` /
/// `x86::q8_rows8` in the same order: the same bits.
///
/// # Safety
/// AVX2, FMA and F16C; `a` as [`Span`] says, its units repacked from `ty` ([`repack8`] /
/// [`repack8_32`]).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q8_repacked_avx2<const T: usize>(ty: BlockType, a: &Span) {
    // SAFETY: forwarded.
    unsafe {
        match ty {
            BlockType::Q4_K => kquant_avx2::<3, T>(a),
            BlockType::Q6_K => kquant_avx2::<5, T>(a),
            BlockType::Q4_0 => block32_avx2::<0, T>(a),
            BlockType::Q4_1 => block32_avx2::<1, T>(a),
            BlockType::Q5_0 => block32_avx2::<4, T>(a),
            BlockType::Q8_0 => block32_avx2::<2, T>(a),
        }
    }
}

/// [`q8_repacked_avx2`] with AVX-512 VNNI (`vpdpbusd` on 256-bit vectors): the same bits.
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C; otherwise as [`q8_repacked_avx2`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn q8_repacked_vnni<const T: usize>(ty: BlockType, a: &Span) {
    // SAFETY: forwarded.
    unsafe {
        match ty {
            BlockType::Q4_K => kquant_vnni::<3, T>(a),
            BlockType::Q6_K => kquant_vnni::<5, T>(a),
            BlockType::Q4_0 => block32_vnni::<0, T>(a),
            BlockType::Q4_1 => block32_vnni::<1, T>(a),
            BlockType::Q5_0 => block32_vnni::<4, T>(a),
            BlockType::Q8_0 => block32_vnni::<2, T>(a),
        }
    }
}

#[inline]
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn kquant_avx2<const TY: u8, const T: usize>(a: &Span) {
    let ones = _mm256_set1_epi16(1);
    kquant_body!(
        TY,
        T,
        a,
        |s: __m256i, w: __m256i, x: __m256i| _mm256_add_epi16(s, _mm256_maddubs_epi16(w, x)),
        |s: __m256i| _mm256_madd_epi16(s, ones),
        |s: __m256i, w0: __m256i, x0: __m256i, w1: __m256i, x1: __m256i| _mm256_add_epi32(
            s,
            _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(w0, x0), _mm256_maddubs_epi16(w1, x1)), ones)
        )
    )
}

#[inline]
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn kquant_vnni<const TY: u8, const T: usize>(a: &Span) {
    kquant_body!(
        TY,
        T,
        a,
        |s: __m256i, w: __m256i, x: __m256i| _mm256_dpbusd_epi32(s, w, x),
        |s: __m256i| s,
        |s: __m256i, w0: __m256i, x0: __m256i, w1: __m256i, x1: __m256i| _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(s, w0, x0), w1, x1)
    )
}

#[inline]
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block32_avx2<const TY: u8, const T: usize>(a: &Span) {
    let ones = _mm256_set1_epi16(1);
    block32_body!(
        TY,
        T,
        a,
        |s: __m256i, w: __m256i, x: __m256i| _mm256_add_epi16(s, _mm256_maddubs_epi16(w, x)),
        |s: __m256i| _mm256_madd_epi16(s, ones),
        |s: __m256i, w: __m256i, x: __m256i| _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w)), ones)),
        0
    )
}

#[inline]
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn block32_vnni<const TY: u8, const T: usize>(a: &Span) {
    let sign = _mm256_set1_epi8(-128);
    block32_body!(
        TY,
        T,
        a,
        |s: __m256i, w: __m256i, x: __m256i| _mm256_dpbusd_epi32(s, w, x),
        |s: __m256i| s,
        |s: __m256i, w: __m256i, x: __m256i| _mm256_dpbusd_epi32(s, _mm256_xor_si256(w, sign), x),
        128
    )
}
