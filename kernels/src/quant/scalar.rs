//! Portable kernels (any CPU; what ARM and x86-64 CPUs without AVX2 run): blocks dequantized
//! as ggml's `dequantize_row_*`, dot products in loops written for LLVM's vectorizer, and the
//! 8-bit-activation row kernel [`q8_row`] (integer block sums from [`BlockDot`]: portable Rust,
//! or NEON on aarch64, `neon.rs`).

use super::{BLOCK, BlockType, QuantizedActivations, f16_at, q4k_scale_min, q6k_scales};

/// The 32 weights of sub-block `k` (0..8) of the Q4_K block `blk` (ggml's
/// `dequantize_row_q4_K`: `d·sc · q − dmin·m`) on the codes of [`q4k_codes`], over whole
/// slices, so that the loop vectorizes.
fn q4k_sub(blk: &[u8], k: usize, out: &mut [f32]) {
    let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
    let (sc, m) = q4k_scale_min(k, &blk[4..16]);
    let (d1, m1) = (d * sc as f32, dmin * m as f32);
    let out: &mut [f32; 32] = out.try_into().expect("32 weights");
    for (o, q) in out.iter_mut().zip(q4k_codes(blk, k)) {
        *o = d1 * q as f32 - m1;
    }
}

/// The 32 weights of sub-block `k` (0..8) of the Q6_K block `blk` (ggml's
/// `dequantize_row_q6_K`: `d·sc · (q − 32)`) on the codes of [`q6k_codes`], over whole slices,
/// so that the loop vectorizes.
fn q6k_sub(blk: &[u8], k: usize, out: &mut [f32]) {
    let (s0, s1) = q6k_scales(blk, k);
    let q = q6k_codes(blk, k);
    let out: &mut [f32; 32] = out.try_into().expect("32 weights");
    for (half, s) in [(0usize, s0), (16, s1)] {
        for l in half..half + 16 {
            out[l] = s * (f32::from(q[l]) - 32.0);
        }
    }
}

/// The 32 weights of sub-block `k` of a 256-weight k-quant block.
fn k_sub(ty: BlockType, blk: &[u8], k: usize, out: &mut [f32]) {
    if ty == BlockType::Q6_K { q6k_sub(blk, k, out) } else { q4k_sub(blk, k, out) }
}

/// Lanes of [`dot_f32`]'s partial sums.
const LANES: usize = 16;

/// `Σ_i w[i] · x[i]` of a dequantized row `w` and one token's activations `x` (equal lengths,
/// a multiple of 32 in the packed matmul): [`LANES`] interleaved partial sums (lane `l` takes
/// `i ≡ l mod LANES`, in `i` order, fused multiply-adds on aarch64), added pairwise at the end.
/// Independent chains, so that LLVM vectorizes the loop for the target's vector unit (NEON,
/// SSE2), where a single running sum stays scalar. The order of operations depends on the
/// length only, not on the other tokens of the call.
pub(super) fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
    #[inline(always)]
    fn madd(a: f32, b: f32, c: f32) -> f32 {
        // `mul_add` is one instruction on aarch64; elsewhere without FMA it is a libm call.
        #[cfg(target_arch = "aarch64")]
        {
            a.mul_add(b, c)
        }
        #[cfg(not(target_arch = "aarch64"))]
        {
            a * b + c
        }
    }
    debug_assert_eq!(w.len(), x.len());
    let mut acc = [0.0f32; LANES];
    let (wc, wr) = w.as_chunks::<LANES>();
    let (xc, xr) = x.as_chunks::<LANES>();
    for (wv, xv) in wc.iter().zip(xc) {
        for l in 0..LANES {
            acc[l] = madd(wv[l], xv[l], acc[l]);
        }
    }
    for (l, (a, b)) in wr.iter().zip(xr).enumerate() {
        acc[l] = madd(*a, *b, acc[l]);
    }
    let mut h = LANES / 2;
    while h > 0 {
        for l in 0..h {
            acc[l] += acc[l + h];
        }
        h /= 2;
    }
    acc[0]
}

/// Dequantizes one packed row into `out` (`dequantize_row_*` of ggml-quants.c).
pub(super) fn dequant_row(ty: BlockType, row: &[u8], out: &mut [f32]) {
    let bb = ty.block_bytes();
    if ty.block_len() == 256 {
        for (blk, o) in row.chunks_exact(bb).zip(out.chunks_exact_mut(256)) {
            for (k, ok) in o.chunks_exact_mut(32).enumerate() {
                k_sub(ty, blk, k, ok);
            }
        }
        return;
    }
    // ggml's weights from the stored codes of `block32_codes`: Q8_0 `q·d`, Q4_0 `(q − 8)·d`,
    // Q5_0 `(q − 16)·d`, Q4_1 `q·d + m`.
    let off = code_offset(ty);
    for (blk, o) in row.chunks_exact(bb).zip(out.chunks_exact_mut(BLOCK)) {
        let d = f16_at(blk, 0);
        let w = block32_codes(ty, blk);
        if ty == BlockType::Q4_1 {
            let m = f16_at(blk, 2);
            for (ov, &q) in o.iter_mut().zip(&w) {
                *ov = q as f32 * d + m;
            }
        } else {
            for (ov, &q) in o.iter_mut().zip(&w) {
                *ov = (i32::from(q) - off) as f32 * d;
            }
        }
    }
}

/// The integer dot products of one 32-weight block: weight codes `w` (unsigned 0..63 for the
/// 4-, 5- and 6-bit types, signed for Q8_0) times one token's 8-bit activation codes `x`.
/// Exact integer sums, so every implementation gives the same values.
pub(super) trait BlockDot {
    /// `(Σ_{i<16} w_i x_i, Σ_{16≤i<32} w_i x_i)` (Q6_K has a scale per 16 weights).
    fn halves(w: &[i8; 32], x: &[i8; 32]) -> (i32, i32);
    /// `Σ_{i<32} w_i x_i`.
    #[inline(always)]
    fn sum(w: &[i8; 32], x: &[i8; 32]) -> i32 {
        let (a, b) = Self::halves(w, x);
        a + b
    }
}

/// [`BlockDot`] in plain Rust (i32 products, 16 independent sums: LLVM vectorizes it for SSE2).
/// On aarch64 the NEON variants run instead, and this is their test reference.
#[cfg(any(not(target_arch = "aarch64"), test))]
pub(super) struct PortableDot;

#[cfg(any(not(target_arch = "aarch64"), test))]
impl BlockDot for PortableDot {
    // Not inlined: inside `q8_row`'s loops LLVM left the products scalar (`movsbl` / `imul`,
    // `perf annotate` of SmolLM2's decode with `DECO_KERNELS=scalar`); alone they become SSE2
    // `pmaddwd`s.
    #[inline(never)]
    fn halves(w: &[i8; 32], x: &[i8; 32]) -> (i32, i32) {
        let half = |r: std::ops::Range<usize>| w[r.clone()].iter().zip(&x[r]).map(|(&a, &b)| i32::from(a) * i32::from(b)).sum::<i32>();
        (half(0..16), half(16..32))
    }
}

/// The 32 weight codes of one 32-weight block (`Q4_0`, `Q4_1`, `Q5_0`, `Q8_0`) as [`BlockDot`]
/// takes them: the 4- and 5-bit codes unsigned, before ggml's `− 8` / `− 16` (byte `j` of the
/// nibbles holds weight `j` low and `j + 16` high; Q5_0's `qh` bit `j` is weight `j`'s 5th bit),
/// Q8_0's signed codes as stored.
#[inline(always)]
fn block32_codes(ty: BlockType, blk: &[u8]) -> [i8; 32] {
    let mut w = [0i8; 32];
    match ty {
        BlockType::Q8_0 => {
            for (o, &q) in w.iter_mut().zip(&blk[2..34]) {
                *o = q as i8;
            }
        }
        BlockType::Q5_0 => {
            let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
            let qs: &[u8; 16] = blk[6..22].try_into().expect("16 bytes");
            for j in 0..16 {
                w[j] = ((qs[j] & 0xF) | ((((qh >> j) & 1) as u8) << 4)) as i8;
                w[j + 16] = ((qs[j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4)) as i8;
            }
        }
        _ => {
            let at = if ty == BlockType::Q4_1 { 4 } else { 2 };
            let qs: &[u8; 16] = blk[at..at + 16].try_into().expect("16 bytes");
            for j in 0..16 {
                w[j] = (qs[j] & 0xF) as i8;
                w[j + 16] = (qs[j] >> 4) as i8;
            }
        }
    }
    w
}

/// What ggml subtracts from the unsigned codes of [`block32_codes`]: 8 for Q4_0, 16 for Q5_0,
/// 0 otherwise (Q8_0's codes are signed, Q4_1 adds its minimum instead).
fn code_offset(ty: BlockType) -> i32 {
    match ty {
        BlockType::Q4_0 => 8,
        BlockType::Q5_0 => 16,
        _ => 0,
    }
}

/// The 32 unsigned 4-bit codes of sub-block `k` (0..8) of the Q4_K block `blk`.
#[inline(always)]
fn q4k_codes(blk: &[u8], k: usize) -> [i8; 32] {
    let qs: &[u8; 32] = blk[16 + 32 * (k / 2)..][..32].try_into().expect("32 bytes");
    let shift = 4 * (k % 2) as u32;
    qs.map(|q| ((q >> shift) & 0xF) as i8)
}

/// The 32 unsigned 6-bit codes (before the `− 32`) of sub-block `k` (0..8) of the Q6_K block
/// `blk` ([`super::q6k_code`]).
#[inline(always)]
fn q6k_codes(blk: &[u8], k: usize) -> [i8; 32] {
    let (h, g) = (k / 4, k % 4);
    let ql: &[u8; 32] = blk[64 * h + 32 * (g % 2)..][..32].try_into().expect("32 bytes");
    let qh: &[u8; 32] = blk[super::Q6K_QH + 32 * h..][..32].try_into().expect("32 bytes");
    let (lo_shift, hi_shift) = (4 * (g / 2) as u32, 2 * g as u32);
    std::array::from_fn(|l| (((ql[l] >> lo_shift) & 0xF) | (((qh[l] >> hi_shift) & 3) << 4)) as i8)
}

/// The order in which the x86 k-quant kernels visit the 8 sub-blocks of a Q6_K super-block
/// (`kquant_sub_blocks!`: the two nibbles of a `ql` byte run are sub-blocks `s` and `s + 2`);
/// [`q8_row`] follows it so that its float sums are added in the same order.
const Q6K_ORDER: [usize; 8] = [0, 2, 1, 3, 4, 6, 5, 7];

/// One packed row (GGUF blocks, `cols / 32` blocks of `ty`) times tokens `t .. t + out.len()`
/// (at most 4) of the 8-bit activations `qa` (`[n, cols]`): `out[k]` = row · token `t + k`.
///
/// The float operations per (row, token) are those of the x86 8-bit-activation kernels
/// (`x86::q8_rows8`, `q8_rows8_k_body!`), in the same order, with `f32::mul_add` where they
/// use FMA, on the same exact integer block sums, so the results have the same bits as theirs
/// (unit-tested against the AVX2 kernels): per block (Q4_K / Q6_K: per 32-weight sub-block)
/// `b` of activation scale `dx`, scaled sum `xs`, integer sums `xi` / first-half `xl`:
/// - Q4_0 / Q5_0: `acc = fma(Σwx − 8·xi (16·xi), d·dx, acc)`; Q8_0 without the offset;
/// - Q4_1: then `acc = fma(m, xs, acc)`;
/// - Q4_K: `acc = fma(Σwx, (d·sc)·dx, acc)`, `acc = fma(−(dmin·m), xs, acc)`;
/// - Q6_K (sub-blocks in [`Q6K_ORDER`]): `acc = fma(Σ_{<16}wx − 32·xl, (d·sc_lo)·dx, acc)`, then
///   the same for the second half with `xi − xl`.
///
/// The weight codes of a block are decoded once for all the tokens. A token's result does not
/// depend on the other tokens (batch invariance). `f32::mul_add` is one instruction on aarch64
/// (and on x86-64 with FMA); on an x86-64 CPU without FMA it is a libm call per block and
/// token, the price of matching the AVX2 kernels' bits.
pub(super) fn q8_row<D: BlockDot>(ty: BlockType, row: &[u8], qa: &QuantizedActivations, cols: usize, t: usize, out: &mut [f32]) {
    let nb = cols / BLOCK;
    let bb = ty.block_bytes();
    let take = out.len();
    debug_assert!(take <= 4 && row.len() == nb / (ty.block_len() / BLOCK) * bb);
    let mut acc = [0.0f32; 4];
    let x = |k: usize, b: usize| -> &[i8; 32] { qa.codes[(t + k) * cols + b * BLOCK..][..BLOCK].try_into().expect("32 codes") };
    match ty {
        BlockType::Q4_K => {
            for (sb, blk) in row.chunks_exact(bb).enumerate() {
                let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
                for s in 0..8 {
                    let (sc, m) = q4k_scale_min(s, &blk[4..16]);
                    let (dsc, dmn) = (d * f32::from(sc), dmin * f32::from(m));
                    let w = q4k_codes(blk, s);
                    for (k, a) in acc.iter_mut().enumerate().take(take) {
                        let i = (t + k) * nb + sb * 8 + s;
                        let si = D::sum(&w, x(k, sb * 8 + s));
                        *a = (si as f32).mul_add(dsc * qa.scales[i], *a);
                        *a = (-dmn).mul_add(qa.sums[i], *a);
                    }
                }
            }
        }
        BlockType::Q6_K => {
            for (sb, blk) in row.chunks_exact(bb).enumerate() {
                for s in Q6K_ORDER {
                    let (slo, shi) = q6k_scales(blk, s);
                    let w = q6k_codes(blk, s);
                    for (k, a) in acc.iter_mut().enumerate().take(take) {
                        let i = (t + k) * nb + sb * 8 + s;
                        let (lo, hi) = D::halves(&w, x(k, sb * 8 + s));
                        let (il, dx) = (qa.isums_lo[i], qa.scales[i]);
                        let ih = qa.isums[i] - il;
                        *a = ((lo - 32 * il) as f32).mul_add(slo * dx, *a);
                        *a = ((hi - 32 * ih) as f32).mul_add(shi * dx, *a);
                    }
                }
            }
        }
        _ => {
            let off = code_offset(ty);
            for (b, blk) in row.chunks_exact(bb).enumerate() {
                let d = f16_at(blk, 0);
                let m = if ty == BlockType::Q4_1 { f16_at(blk, 2) } else { 0.0 };
                let w = block32_codes(ty, blk);
                for (k, a) in acc.iter_mut().enumerate().take(take) {
                    let i = (t + k) * nb + b;
                    let s = D::sum(&w, x(k, b)) - off * qa.isums[i];
                    *a = (s as f32).mul_add(d * qa.scales[i], *a);
                    if ty == BlockType::Q4_1 {
                        *a = m.mul_add(qa.sums[i], *a);
                    }
                }
            }
        }
    }
    out.copy_from_slice(&acc[..take]);
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::super::{Q6K_D, q6k_code};
    use super::*;

    /// The sliced sub-block decoding gives, for every byte pattern, the weights of the per-weight
    /// definitions (`q6k_code`, and ggml's `d·sc·q − dmin·m` for Q4_K) bit for bit.
    #[test]
    fn sub_blocks_match_the_per_weight_definitions() {
        let mut rng = ChaCha8Rng::seed_from_u64(0x9E37_79B9);
        for _ in 0..64 {
            let mut blk = [0u8; 210];
            rng.fill(&mut blk[..]);
            // Finite scales: d = 0.5 (f16 0x3800) for Q6_K; Q4_K's d and dmin likewise.
            blk[Q6K_D..Q6K_D + 2].copy_from_slice(&0x3800u16.to_le_bytes());
            let mut out = [0.0f32; 32];
            for k in 0..8 {
                q6k_sub(&blk, k, &mut out);
                let (s0, s1) = q6k_scales(&blk, k);
                for (l, o) in out.iter().enumerate() {
                    let want = if l < 16 { s0 } else { s1 } * (f32::from(q6k_code(&blk, k, l)) - 32.0);
                    assert_eq!(o.to_bits(), want.to_bits(), "Q6_K sub-block {k} weight {l}");
                }
            }
            let mut q4 = blk[..144].to_vec();
            q4[0..2].copy_from_slice(&0x3800u16.to_le_bytes());
            q4[2..4].copy_from_slice(&0x3400u16.to_le_bytes());
            for k in 0..8 {
                q4k_sub(&q4, k, &mut out);
                let (sc, m) = q4k_scale_min(k, &q4[4..16]);
                let (d1, m1) = (0.5 * sc as f32, 0.25 * m as f32);
                for (l, o) in out.iter().enumerate() {
                    let b = q4[16 + 32 * (k / 2) + l];
                    let q = if k.is_multiple_of(2) { b & 0xF } else { b >> 4 };
                    assert_eq!(o.to_bits(), (d1 * q as f32 - m1).to_bits(), "Q4_K sub-block {k} weight {l}");
                }
            }
        }
    }
}
