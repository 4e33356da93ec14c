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
//! [`q8_repacked_avx2`] and [`q8_repacked_vnni`] then take each slot's 8 code vectors into
//! registers once per token group and multiply them with `T` tokens' broadcast activations.
//! Their integer sums are exact and their float operations per (row, token) are those of
//! `q8_rows8_k_body!` in the same order, so a token's result has the same bits through either
//! layout (the batch invariance the tests check).

use std::arch::x86_64::*;

use super::x86::{byte_f32, halves_to_f32, q4k_scales8, q5_0_codes8, q6k_d8, q6k_high_bits, transpose8x1, transpose8x4};
use super::{BLOCK, BlockType, Q6K_QH, Q6K_SCALES};

/// Bytes of one repacked sub-block slot: 8 code vectors and 2 scale vectors of 32 bytes.
pub(super) const SLOT_BYTES: usize = 10 * 32;

/// Bytes of one repacked group of 8 rows × one super-block (8 slots).
pub(super) const GROUP_SB_BYTES: usize = 8 * SLOT_BYTES;

/// The sub-block held by slot `q` of a repacked Q6_K super-block: `q8_rows8_k_body!` visits a
/// Q6_K super-block's sub-blocks in the order 0, 2, 1, 3, 4, 6, 5, 7 (the two nibbles of a
/// `ql` byte run are sub-blocks `s` and `s + 2`), and the float sums must keep that order.
const Q6K_ORDER: [usize; 8] = [0, 2, 1, 3, 4, 6, 5, 7];

/// The sub-block in slot `q` of a repacked super-block of type `TY` (3: Q4_K, 5: Q6_K).
#[inline(always)]
const fn slot_sub<const TY: u8>(q: usize) -> usize {
    if TY == 3 { q } else { Q6K_ORDER[q] }
}

/// Repacks one super-block of 8 rows of `ty` (Q4_K or Q6_K; row `r` at `blk + r · row_bytes`,
/// `row_bytes` possibly 0) into `GROUP_SB_BYTES` at `out`. Slot `q` holds sub-block
/// `slot_sub(q)`: its 8 transposed code vectors (Q4_K: the 4-bit code; Q6_K: the 6-bit code
/// before the `− 32`), then Q4_K's `d·sc` and `dmin·m`, or Q6_K's `d·sc` of weights 0..16 and of
/// 16..32 (the vectors `q8_rows8_k_body!` computes).
///
/// # Safety
/// AVX2, FMA and F16C; a whole block at `blk + r · row_bytes` for r in 0..8; `GROUP_SB_BYTES`
/// writable bytes at `out`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn repack8(ty: BlockType, blk: *const u8, row_bytes: usize, out: *mut u8) {
    let m4 = _mm256_set1_epi8(0x0F);
    // SAFETY: the caller's contract; every store is inside the group's 8 slots.
    unsafe {
        let put = |s: usize, w: &[__m256i; 8], a: __m256, b: __m256| {
            let q = if ty == BlockType::Q4_K { s } else { Q6K_ORDER.iter().position(|&x| x == s).unwrap_or(0) };
            let p = out.add(q * SLOT_BYTES);
            for (g, v) in w.iter().enumerate() {
                _mm256_storeu_si256(p.add(32 * g) as *mut __m256i, *v);
            }
            _mm256_storeu_ps(p.add(256) as *mut f32, a);
            _mm256_storeu_ps(p.add(288) as *mut f32, b);
        };
        if ty == BlockType::Q4_K {
            let (d, dmin, sc, mn) = q4k_scales8(blk, row_bytes);
            for j in 0..4 {
                let v = transpose8x4(blk.add(16 + 32 * j), row_bytes);
                let u = transpose8x4(blk.add(32 + 32 * j), row_bytes);
                for h in 0..2 {
                    let s = 2 * j + h;
                    let nib = |c: __m256i| _mm256_and_si256(if h == 0 { c } else { _mm256_srli_epi16(c, 4) }, m4);
                    let w = [nib(v[0]), nib(v[1]), nib(v[2]), nib(v[3]), nib(u[0]), nib(u[1]), nib(u[2]), nib(u[3])];
                    let dsc = _mm256_mul_ps(d, byte_f32::<false>(sc[s / 4], s % 4));
                    let dmn = _mm256_mul_ps(dmin, byte_f32::<false>(mn[s / 4], s % 4));
                    put(s, &w, dsc, dmn);
                }
            }
        } else {
            let d = q6k_d8(blk, row_bytes);
            let sv = transpose8x4(blk.add(Q6K_SCALES), row_bytes);
            for h in 0..2 {
                let qa = transpose8x4(blk.add(Q6K_QH + 32 * h), row_bytes);
                let qb = transpose8x4(blk.add(Q6K_QH + 32 * h + 16), row_bytes);
                for p in 0..2 {
                    let la = transpose8x4(blk.add(64 * h + 32 * p), row_bytes);
                    let lb = transpose8x4(blk.add(64 * h + 32 * p + 16), row_bytes);
                    for n in 0..2 {
                        let g = p + 2 * n;
                        let s = 4 * h + g;
                        let code = |l: __m256i, q: __m256i| _mm256_or_si256(_mm256_and_si256(if n == 0 { l } else { _mm256_srli_epi16(l, 4) }, m4), q6k_high_bits(q, g));
                        let w = [
                            code(la[0], qa[0]),
                            code(la[1], qa[1]),
                            code(la[2], qa[2]),
                            code(la[3], qa[3]),
                            code(lb[0], qb[0]),
                            code(lb[1], qb[1]),
                            code(lb[2], qb[2]),
                            code(lb[3], qb[3]),
                        ];
                        let dlo = _mm256_mul_ps(d, byte_f32::<true>(sv[s / 2], 2 * (s % 2)));
                        let dhi = _mm256_mul_ps(d, byte_f32::<true>(sv[s / 2], 2 * (s % 2) + 1));
                        put(s, &w, dlo, dhi);
                    }
                }
            }
        }
    }
}

/// The body of the repacked kernels (`TY` 3: Q4_K, 5: Q6_K), written once for AVX2 and VNNI:
/// `$acc(a, w, x)` adds the 4-byte products of unsigned `w` and signed `x` to the partial sums
/// `a` (AVX2: 16-bit lanes, `vpmaddubsw` + `vpaddw`; VNNI: 32-bit lanes, `vpdpbusd`), and
/// `$fin(a)` turns partial sums into the 32-bit sum of each lane (AVX2: `vpmaddwd` with ones);
/// `$pair(a, w0, x0, w1, x1)` adds two groups' products to 32-bit sums `a`. Q4_K sums all 8
/// groups with `$acc` before `$fin` (8 · 2 · 15 · 127 = 30,480 fits 16 bits), Q6_K two groups
/// at a time with `$pair` (2 · 2 · 63 · 127 = 32,004).
macro_rules! repacked_body {
    ($ty:ident, $t:ident, $pk:ident, $nsb:ident, $nb:ident, $xq:ident, $xd:ident, $xs:ident, $xi:ident, $xl:ident, $stride:ident, $y:ident, $ys:ident, $rk:ident, $first:ident, $acc:expr, $fin:expr, $pair:expr) => {{
        let mut acc = [_mm256_setzero_ps(); $t];
        if !$first {
            for k in 0..$t {
                // SAFETY: the caller's `y` holds T rows of `rk` values spaced `ys`.
                acc[k] = unsafe {
                    if $rk == 8 { _mm256_loadu_ps($y.add(k * $ys)) } else { _mm256_set1_ps(*$y.add(k * $ys)) }
                };
            }
        }
        for sb in 0..$nsb {
            for q in 0..8 {
                let s = slot_sub::<$ty>(q);
                let b = sb * 8 + s;
                // SAFETY: slot q of super-block sb is inside the repacked group, block b of every
                // token inside the activations (the caller's contract).
                unsafe {
                    let p = $pk.add((sb * 8 + q) * SLOT_BYTES);
                    let w = |g: usize| _mm256_loadu_si256(p.add(32 * g) as *const __m256i);
                    let x = |k: usize, g: usize| _mm256_set1_epi32(($xq.add(k * $stride + b * BLOCK + 4 * g) as *const i32).read_unaligned());
                    let da = _mm256_loadu_ps(p.add(256) as *const f32);
                    let db = _mm256_loadu_ps(p.add(288) as *const f32);
                    if $ty == 3 {
                        let mut a = [_mm256_setzero_si256(); $t];
                        for g in 0..8 {
                            let wg = w(g);
                            for k in 0..$t {
                                a[k] = $acc(a[k], wg, x(k, g));
                            }
                        }
                        for k in 0..$t {
                            let i = k * $nb + b;
                            let dx = _mm256_set1_ps(*$xd.add(i));
                            acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps($fin(a[k])), _mm256_mul_ps(da, dx), acc[k]);
                            acc[k] = _mm256_fnmadd_ps(db, _mm256_set1_ps(*$xs.add(i)), acc[k]);
                        }
                    } else {
                        for half in 0..2 {
                            let mut a = [_mm256_setzero_si256(); $t];
                            for pair in 0..2 {
                                let g = 4 * half + 2 * pair;
                                let (w0, w1) = (w(g), w(g + 1));
                                for k in 0..$t {
                                    a[k] = $pair(a[k], w0, x(k, g), w1, x(k, g + 1));
                                }
                            }
                            for k in 0..$t {
                                let i = k * $nb + b;
                                let dx = _mm256_set1_ps(*$xd.add(i));
                                let il = *$xl.add(i);
                                let sub = if half == 0 { il } else { *$xi.add(i) - il };
                                let v = _mm256_sub_epi32(a[k], _mm256_set1_epi32(32 * sub));
                                acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_mul_ps(if half == 0 { da } else { db }, dx), acc[k]);
                            }
                        }
                    }
                }
            }
        }
        for k in 0..$t {
            // SAFETY: as the load above.
            unsafe {
                if $rk == 8 {
                    _mm256_storeu_ps($y.add(k * $ys), acc[k]);
                } else {
                    *$y.add(k * $ys) = _mm256_cvtss_f32(acc[k]);
                }
            }
        }
    }};
}

/// Dot products of `nsb` repacked super-blocks of one group of 8 rows ([`repack8`], at `pk`)
/// with `T` tokens of 8-bit activations, AVX2 (`vpmaddubsw`, `vpaddw`, `vpmaddwd`), added to
/// running sums in `y`: token `k`'s sums are `rk` (8, or 1: a leftover row repacked in all
/// lanes) f32 at `y + k · ys`, read first unless `first` (then they start at 0) and written
/// back. Over the spans of a row, the float operations are those of `x86::q8_rows8_k` in the
/// same order: the same bits.
///
/// # Safety
/// AVX2, FMA and F16C; `ty` Q4_K or Q6_K; `nsb · GROUP_SB_BYTES` readable bytes at `pk`; `xq`
/// holds `T` rows of `nsb · 256` codes spaced `stride`, `xd`, `xs`, `xi`, `xl` `T` rows of
/// `nsb · 8` per-block values spaced `nb` (as `x86::q8_rows8_k`, from the span's first block);
/// `y + k · ys` holds `rk` f32 for k in 0..T, written by no one else during the call.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q8_repacked_avx2<const T: usize>(
    ty: BlockType,
    pk: *const u8,
    nsb: usize,
    nb: usize,
    xq: *const i8,
    xd: *const f32,
    xs: *const f32,
    xi: *const i32,
    xl: *const i32,
    stride: usize,
    y: *mut f32,
    ys: usize,
    rk: usize,
    first: bool,
) {
    // SAFETY: forwarded.
    unsafe {
        match ty {
            BlockType::Q4_K => repacked_avx2_t::<3, T>(pk, nsb, nb, xq, xd, xs, xi, xl, stride, y, ys, rk, first),
            _ => repacked_avx2_t::<5, T>(pk, nsb, nb, xq, xd, xs, xi, xl, stride, y, ys, rk, first),
        }
    }
}

#[inline]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn repacked_avx2_t<const TY: u8, const T: usize>(
    pk: *const u8,
    nsb: usize,
    nb: usize,
    xq: *const i8,
    xd: *const f32,
    xs: *const f32,
    xi: *const i32,
    xl: *const i32,
    stride: usize,
    y: *mut f32,
    ys: usize,
    rk: usize,
    first: bool,
) {
    let ones = _mm256_set1_epi16(1);
    repacked_body!(
        TY,
        T,
        pk,
        nsb,
        nb,
        xq,
        xd,
        xs,
        xi,
        xl,
        stride,
        y,
        ys,
        rk,
        first,
        |a: __m256i, w: __m256i, x: __m256i| _mm256_add_epi16(a, _mm256_maddubs_epi16(w, x)),
        |a: __m256i| _mm256_madd_epi16(a, ones),
        |a: __m256i, w0: __m256i, x0: __m256i, w1: __m256i, x1: __m256i| _mm256_add_epi32(
            a,
            _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(w0, x0), _mm256_maddubs_epi16(w1, x1)), ones)
        )
    )
}

/// [`q8_repacked_avx2`] with AVX-512 VNNI (`vpdpbusd` on 256-bit vectors): the same bits.
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C; otherwise as [`q8_repacked_avx2`].
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn q8_repacked_vnni<const T: usize>(
    ty: BlockType,
    pk: *const u8,
    nsb: usize,
    nb: usize,
    xq: *const i8,
    xd: *const f32,
    xs: *const f32,
    xi: *const i32,
    xl: *const i32,
    stride: usize,
    y: *mut f32,
    ys: usize,
    rk: usize,
    first: bool,
) {
    // SAFETY: forwarded.
    unsafe {
        match ty {
            BlockType::Q4_K => repacked_vnni_t::<3, T>(pk, nsb, nb, xq, xd, xs, xi, xl, stride, y, ys, rk, first),
            _ => repacked_vnni_t::<5, T>(pk, nsb, nb, xq, xd, xs, xi, xl, stride, y, ys, rk, first),
        }
    }
}

#[inline]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn repacked_vnni_t<const TY: u8, const T: usize>(
    pk: *const u8,
    nsb: usize,
    nb: usize,
    xq: *const i8,
    xd: *const f32,
    xs: *const f32,
    xi: *const i32,
    xl: *const i32,
    stride: usize,
    y: *mut f32,
    ys: usize,
    rk: usize,
    first: bool,
) {
    repacked_body!(
        TY,
        T,
        pk,
        nsb,
        nb,
        xq,
        xd,
        xs,
        xi,
        xl,
        stride,
        y,
        ys,
        rk,
        first,
        |a: __m256i, w: __m256i, x: __m256i| _mm256_dpbusd_epi32(a, w, x),
        |a: __m256i| a,
        |a: __m256i, w0: __m256i, x0: __m256i, w1: __m256i, x1: __m256i| _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(a, w0, x0), w1, x1)
    )
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
    let m4 = _mm256_set1_epi8(0x0F);
    // SAFETY: the caller's contract.
    unsafe {
        let dm = transpose8x1(blk, row_bytes);
        let d = halves_to_f32::<false>(dm);
        let m = if ty == BlockType::Q4_1 { halves_to_f32::<true>(dm) } else { _mm256_setzero_ps() };
        let mut w = [_mm256_setzero_si256(); 8];
        match ty {
            BlockType::Q8_0 => {
                let lo = transpose8x4(blk.add(2), row_bytes);
                let hi = transpose8x4(blk.add(18), row_bytes);
                w[..4].copy_from_slice(&lo);
                w[4..].copy_from_slice(&hi);
            }
            BlockType::Q5_0 => w = q5_0_codes8(blk, row_bytes),
            _ => {
                let v = transpose8x4(blk.add(if ty == BlockType::Q4_0 { 2 } else { 4 }), row_bytes);
                for c in 0..4 {
                    w[c] = _mm256_and_si256(v[c], m4);
                    w[4 + c] = _mm256_and_si256(_mm256_srli_epi16(v[c], 4), m4);
                }
            }
        }
        for (g, v) in w.iter().enumerate() {
            _mm256_storeu_si256(out.add(32 * g) as *mut __m256i, *v);
        }
        _mm256_storeu_ps(out.add(256) as *mut f32, d);
        _mm256_storeu_ps(out.add(288) as *mut f32, m);
    }
}

/// The body of the repacked 32-block kernels (`TY` 0: Q4_0, 1: Q4_1, 4: Q5_0, 2: Q8_0), written
/// once for AVX2 and VNNI. `$acc(a, w, x)` adds the products of unsigned codes `w` and signed
/// `x` to partial sums (AVX2: 16-bit, VNNI: 32-bit), `$fin` widens them to 32 bits; Q4 codes sum
/// all 8 groups before `$fin` (30,480 fits 16 bits), Q5_0 4 at a time (31,496). `$q8(a, w, x)`
/// adds Q8_0's signed products to 32-bit sums (AVX2: ggml's sign trick; VNNI: `w ^ 0x80`, then
/// `− $q8off · Σ qx` once per block). Per (row, token) the float operations are those of
/// `x86::q8_rows8` / `x86_512::q8_rows8` in the same order: the same bits.
macro_rules! repacked32_body {
    ($ty:ident, $t:ident, $pk:ident, $nblk:ident, $nb:ident, $xq:ident, $xd:ident, $xs:ident, $xi:ident, $stride:ident, $y:ident, $ys:ident, $rk:ident, $first:ident, $acc:expr, $fin:expr, $q8:expr, $q8off:expr) => {{
        let mut acc = [_mm256_setzero_ps(); $t];
        if !$first {
            for k in 0..$t {
                // SAFETY: the caller's `y` holds T rows of `rk` values spaced `ys`.
                acc[k] = unsafe {
                    if $rk == 8 { _mm256_loadu_ps($y.add(k * $ys)) } else { _mm256_set1_ps(*$y.add(k * $ys)) }
                };
            }
        }
        for b in 0..$nblk {
            // SAFETY: slot b is inside the repacked span, block b of every token inside the
            // activations (the caller's contract).
            unsafe {
                let p = $pk.add(b * SLOT_BYTES);
                let w = |g: usize| _mm256_loadu_si256(p.add(32 * g) as *const __m256i);
                let x = |k: usize, g: usize| _mm256_set1_epi32(($xq.add(k * $stride + b * BLOCK + 4 * g) as *const i32).read_unaligned());
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
                        let mut a = [_mm256_setzero_si256(); $t];
                        for g in 4 * half..4 * half + 4 {
                            let wg = w(g);
                            for k in 0..$t {
                                a[k] = $acc(a[k], wg, x(k, g));
                            }
                        }
                        for k in 0..$t {
                            s[k] = _mm256_add_epi32(s[k], $fin(a[k]));
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
                    let i = k * $nb + b;
                    let off = match $ty {
                        0 => 8,
                        4 => 16,
                        2 => $q8off,
                        _ => 0,
                    };
                    let v = if off != 0 { _mm256_sub_epi32(s[k], _mm256_set1_epi32(off * *$xi.add(i))) } else { s[k] };
                    let scale = _mm256_mul_ps(d, _mm256_set1_ps(*$xd.add(i)));
                    acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), scale, acc[k]);
                    if $ty == 1 {
                        acc[k] = _mm256_fmadd_ps(_mm256_loadu_ps(p.add(288) as *const f32), _mm256_set1_ps(*$xs.add(i)), acc[k]);
                    }
                }
            }
        }
        for k in 0..$t {
            // SAFETY: as the load above.
            unsafe {
                if $rk == 8 {
                    _mm256_storeu_ps($y.add(k * $ys), acc[k]);
                } else {
                    *$y.add(k * $ys) = _mm256_cvtss_f32(acc[k]);
                }
            }
        }
    }};
}

/// [`q8_repacked_avx2`] for the 32-block types: `nblk` repacked blocks ([`repack8_32`], one
/// slot each) of one group of 8 rows, the same bits as `x86::q8_rows8`.
///
/// # Safety
/// AVX2, FMA and F16C; `ty` Q4_0, Q4_1, Q5_0 or Q8_0; `nblk · SLOT_BYTES` readable bytes at
/// `pk`; activations and `y` as [`q8_repacked_avx2`] (`nblk` blocks per token).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q8_repacked32_avx2<const T: usize>(
    ty: BlockType,
    pk: *const u8,
    nblk: usize,
    nb: usize,
    xq: *const i8,
    xd: *const f32,
    xs: *const f32,
    xi: *const i32,
    _xl: *const i32,
    stride: usize,
    y: *mut f32,
    ys: usize,
    rk: usize,
    first: bool,
) {
    // SAFETY: forwarded.
    unsafe {
        match ty {
            BlockType::Q4_0 => repacked32_avx2_t::<0, T>(pk, nblk, nb, xq, xd, xs, xi, stride, y, ys, rk, first),
            BlockType::Q4_1 => repacked32_avx2_t::<1, T>(pk, nblk, nb, xq, xd, xs, xi, stride, y, ys, rk, first),
            BlockType::Q5_0 => repacked32_avx2_t::<4, T>(pk, nblk, nb, xq, xd, xs, xi, stride, y, ys, rk, first),
            _ => repacked32_avx2_t::<2, T>(pk, nblk, nb, xq, xd, xs, xi, stride, y, ys, rk, first),
        }
    }
}

#[inline]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn repacked32_avx2_t<const TY: u8, const T: usize>(
    pk: *const u8,
    nblk: usize,
    nb: usize,
    xq: *const i8,
    xd: *const f32,
    xs: *const f32,
    xi: *const i32,
    stride: usize,
    y: *mut f32,
    ys: usize,
    rk: usize,
    first: bool,
) {
    let ones = _mm256_set1_epi16(1);
    repacked32_body!(
        TY,
        T,
        pk,
        nblk,
        nb,
        xq,
        xd,
        xs,
        xi,
        stride,
        y,
        ys,
        rk,
        first,
        |a: __m256i, w: __m256i, x: __m256i| _mm256_add_epi16(a, _mm256_maddubs_epi16(w, x)),
        |a: __m256i| _mm256_madd_epi16(a, ones),
        |a: __m256i, w: __m256i, x: __m256i| _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w)), ones)),
        0
    )
}

/// [`q8_repacked32_avx2`] with AVX-512 VNNI: the same bits.
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C; otherwise as [`q8_repacked32_avx2`].
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn q8_repacked32_vnni<const T: usize>(
    ty: BlockType,
    pk: *const u8,
    nblk: usize,
    nb: usize,
    xq: *const i8,
    xd: *const f32,
    xs: *const f32,
    xi: *const i32,
    _xl: *const i32,
    stride: usize,
    y: *mut f32,
    ys: usize,
    rk: usize,
    first: bool,
) {
    // SAFETY: forwarded.
    unsafe {
        match ty {
            BlockType::Q4_0 => repacked32_vnni_t::<0, T>(pk, nblk, nb, xq, xd, xs, xi, stride, y, ys, rk, first),
            BlockType::Q4_1 => repacked32_vnni_t::<1, T>(pk, nblk, nb, xq, xd, xs, xi, stride, y, ys, rk, first),
            BlockType::Q5_0 => repacked32_vnni_t::<4, T>(pk, nblk, nb, xq, xd, xs, xi, stride, y, ys, rk, first),
            _ => repacked32_vnni_t::<2, T>(pk, nblk, nb, xq, xd, xs, xi, stride, y, ys, rk, first),
        }
    }
}

#[inline]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn repacked32_vnni_t<const TY: u8, const T: usize>(
    pk: *const u8,
    nblk: usize,
    nb: usize,
    xq: *const i8,
    xd: *const f32,
    xs: *const f32,
    xi: *const i32,
    stride: usize,
    y: *mut f32,
    ys: usize,
    rk: usize,
    first: bool,
) {
    let sign = _mm256_set1_epi8(-128);
    repacked32_body!(
        TY,
        T,
        pk,
        nblk,
        nb,
        xq,
        xd,
        xs,
        xi,
        stride,
        y,
        ys,
        rk,
        first,
        |a: __m256i, w: __m256i, x: __m256i| _mm256_dpbusd_epi32(a, w, x),
        |a: __m256i| a,
        |a: __m256i, w: __m256i, x: __m256i| _mm256_dpbusd_epi32(a, _mm256_xor_si256(w, sign), x),
        128
    )
}
