//! Matrix multiplication on GGUF block-quantized weights kept packed in memory (CPU).
//!
//! A [`PackedMatrix`] holds a weight `W` of shape `[rows, cols]` = `[out_features, in_features]`
//! (transformers' `nn.Linear` layout) as the GGUF / ggml blocks it was stored in: each row is
//! `cols / 32` consecutive blocks of 32 weights (`block_q4_0`, `block_q4_1`, `block_q5_0`,
//! `block_q8_0` of llama.cpp's `ggml-common.h`) or `cols / 256` super-blocks (`block_q4_K`,
//! `block_q6_K`), so a 135M-parameter Q4_1 model needs 0.625 bytes per weight
//! instead of 4. [`PackedMatrix::matmul`] computes `y[n, rows] = x[n, cols] · Wᵀ`.
//!
//! # Accuracy choice: f32 activations
//! The activations stay in f32 and each block is dequantized in registers and multiplied with
//! them: `Σ_b d_b · Σ_i q_{b,i} x_{b,i} (+ m_b · Σ_i x_{b,i})`, with f32 accumulation. This is the
//! product of the *dequantized* weights (exactly the weights the float64 golden reference uses)
//! with the f32 activations, up to f32 rounding of the sums (relative error ~1e-6 of `Σ|w x|`).
//! llama.cpp instead quantizes the activations to 8-bit blocks (`quantize_row_q8_1`) and uses
//! integer dot products (`ggml_vec_dot_q4_1_q8_1`); that adds a relative error of ~1/254 per
//! activation block, which would break deco's 2e-3 logit bound against the reference, so it is
//! not the default here.
//!
//! # Kernels
//! - [`PackedMatrix::matmul`] (what the model uses, for every token count): a fused
//!   dequantize-dot, SIMD with AVX-512 (register tiles of 4 rows × 4 tokens: each unpacked block
//!   feeds 4 tokens, each activation load 4 rows; ~32 KiB sub-chunks of rows stay in cache while
//!   all tokens pass, `x86_512.rs`) or AVX2 + FMA + F16C (one row × 4 tokens, tiles of 64
//!   tokens) when the CPU has them (runtime detection with `is_x86_feature_detected!`), a
//!   portable scalar loop otherwise. A token's result does not depend on the other tokens of the
//!   call (batch invariance).
//! - [`PackedMatrix::matmul_dequant_gemm`]: tiles of `GEMM_TILE_ROWS` rows are dequantized to f32
//!   into a per-task buffer and multiplied with the `gemm` crate (the same f32 micro-kernels
//!   burn-flex uses); not batch-invariant.
//!
//! - [`PackedMatrix::matmul_q8`] (opt-in, [`set_activation_precision`]): the activations are
//!   quantized to 8 bits per block of 32 ([`QuantizedActivations`], llama.cpp's `block_q8_0`
//!   idea) and multiplied with integer dot products (AVX-512 VNNI `vpdpbusd`, or AVX2
//!   `vpmaddubsw` + `vpmaddwd`, with the same bits), as llama.cpp does. Every type goes 8 rows
//!   at a time, one row per 32-bit lane (codes transposed in registers, the next rows
//!   prefetched; Q4_K / Q6_K scales decoded once per super-block for the 8 rows), which makes
//!   single-token decode bound by memory bandwidth. Q4_K / Q6_K matrices that will run with
//!   8-bit activations are interleaved once at load ([`PackedMatrix::interleave8`]: the 8 rows'
//!   4-byte chunks side by side, a byte permutation), so their codes and scales arrive in that
//!   layout with plain loads instead of transposes; same bits. From 8 (AVX2) or 32 (VNNI)
//!   tokens on (prefill), each group of 8 rows is first repacked once per call into a per-task
//!   buffer (`krepack.rs`: codes transposed and unpacked to bytes, scales decoded to f32, llama.cpp's
//!   `REPACK` idea done per call so that the stored matrix stays the GGUF blocks), and every
//!   group of tokens reads that copy in spans of 64 blocks held in L1; the same bits as the
//!   per-token-group kernels. Other CPUs (ARM, x86-64 without AVX2) run a portable row kernel
//!   (`scalar::q8_row`) whose integer block sums are NEON on aarch64 (`sdot` with the
//!   `dotprod` extension, else `smull` + `sadalp`, `neon.rs`) and plain Rust elsewhere, with the
//!   x86 kernels' float operations in their order: the same bits. About 2× faster than the f32 path at one token, but
//!   each activation carries a rounding error of up to `max|x_block| / 254`, so logits move by
//!   ~1e-2 instead of ~1e-6;
//!   the golden-logit bound of deco's tests (2e-3) is for the default f32 path.
//!
//! Both are multithreaded over output rows ([`crate::team::par_for`]: the spinning team of a
//! forward pass, else rayon) and run in the *current* rayon pool (the global one that `deco
//! --threads N` configures, or the one a caller `install`s).

use std::borrow::Cow;

use half::f16;
use rayon::prelude::*;

use crate::error::{Error, Result};

/// Expands `$body` once per literal of the list, with `$v` (a `usize`) bound to it, so that the
/// shift counts, lane indices and array indices derived from it are constants in each copy.
/// Written out because LLVM left the sub-block loops of `kquant_sub_blocks!` rolled: it spilled
/// the code vectors to the stack and emulated Q6_K's 16-bit shifts by a loop-dependent count
/// with seven instructions each (`perf annotate` of Qwen2.5-1.5B's decode, 2026-12-07).
#[cfg(target_arch = "x86_64")]
macro_rules! unroll {
    ($v:ident in [$($i:literal),*] $body:block) => {{
        $({
            let $v: usize = $i;
            $body
        })*
    }};
}

/// Visits the eight 32-weight sub-blocks of one Q4_K (`$ty` 3) or Q6_K (5) super-block of 8
/// rows (row `r` at `$blk + r · $rb`, `$rb` possibly 0; with `$il` true the 8 rows' blocks
/// interleaved at `$blk` instead, `PackedMatrix::interleave8`), one row per 32-bit lane, running
/// the closure-like `|s, w, da, db| body` (written out in place at each of the 8 sub-blocks, so
/// that it is always inlined) with sub-block `s`, its 8 transposed code vectors
/// `w: &[__m256i; 8]` (vector `g`: weights `4g .. 4g + 4`; Q4_K's 4-bit codes, Q6_K's 6-bit
/// codes before the `− 32`) and its scale vectors: Q4_K `d·sc` and `dmin·m` (6-bit scales and
/// minima decoded with ggml's `kmask` shuffle of the 12-byte field on all 8 rows at once,
/// `ggml_vec_dot_q4_K_q8_K`), Q6_K `d·sc` of weights 0..16 and of 16..32. Q4_K in the order
/// 0..8; Q6_K 0, 2, 1, 3, 4, 6, 5, 7 (the two nibbles of a `ql` byte run are sub-blocks `s` and
/// `s + 2`). Shared by the k-quant kernels (`q8_rows8_k_body!`) and the repacking of
/// `krepack.rs`, so both see the same codes and scales. Expanded inside an `unsafe` block of an
/// AVX2 + FMA + F16C function whose caller guarantees the 8 whole blocks.
#[cfg(target_arch = "x86_64")]
macro_rules! kquant_sub_blocks {
    ($ty:expr, $blk:expr, $rb:expr, $il:ident, |$s:ident, $w:ident, $da:ident, $db:ident| $body:block) => {{
        use crate::quant::x86::{byte_f32, q4k_scales8, q6k_d8, q6k_high_bits, rows8x4};
        use crate::quant::{Q6K_QH, Q6K_SCALES};
        let (blk, rb) = ($blk, $rb);
        let m4 = _mm256_set1_epi8(0x0F);
        if $ty == 3 {
            let (d, dmin, sc, mn) = q4k_scales8::<$il>(blk, rb);
            unroll!(j in [0, 1, 2, 3] {
                // Sub-blocks 2j (low nibbles) and 2j + 1 (high) share these 32 bytes.
                let v = rows8x4::<$il>(blk, 16 + 32 * j, rb);
                let u = rows8x4::<$il>(blk, 32 + 32 * j, rb);
                unroll!(h in [0, 1] {
                    let s = 2 * j + h;
                    let nib = |c: __m256i| _mm256_and_si256(if h == 0 { c } else { _mm256_srli_epi16(c, 4) }, m4);
                    let w = [nib(v[0]), nib(v[1]), nib(v[2]), nib(v[3]), nib(u[0]), nib(u[1]), nib(u[2]), nib(u[3])];
                    let dsc = _mm256_mul_ps(d, byte_f32::<false>(sc[s / 4], s % 4));
                    let dmn = _mm256_mul_ps(dmin, byte_f32::<false>(mn[s / 4], s % 4));
                    let ($s, $w, $da, $db): (usize, &[__m256i; 8], __m256, __m256) = (s, &w, dsc, dmn);
                    $body
                });
            });
        } else {
            let d = q6k_d8::<$il>(blk, rb);
            let sv = rows8x4::<$il>(blk, Q6K_SCALES, rb);
            unroll!(h in [0, 1] {
                // The high 2 bits of the half's 4 sub-blocks (weights 0..16, 16..32).
                let qa = rows8x4::<$il>(blk, Q6K_QH + 32 * h, rb);
                let qb = rows8x4::<$il>(blk, Q6K_QH + 32 * h + 16, rb);
                unroll!(p in [0, 1] {
                    // Sub-blocks 4h + p (low nibbles) and 4h + p + 2 (high) share these.
                    let la = rows8x4::<$il>(blk, 64 * h + 32 * p, rb);
                    let lb = rows8x4::<$il>(blk, 64 * h + 32 * p + 16, rb);
                    unroll!(n in [0, 1] {
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
                        let ($s, $w, $da, $db): (usize, &[__m256i; 8], __m256, __m256) = (s, &w, dlo, dhi);
                        $body
                    });
                });
            });
        }
    }};
}

/// The body of the 8-bit-activation k-quant kernels over 8 rows of Q4_K (`TY` 3) or Q6_K (5),
/// one row per 32-bit lane (the layout of `q8_rows8`), written once for `x86_512::q8_rows8_k`
/// (VNNI) and `x86::q8_rows8_k` (AVX2). They differ only in `$dot(w, x)`: the 8 i32 lanes of
/// `Σ_{g<4}` 4-byte sums of unsigned codes `w[g]` times the broadcast signed activation codes
/// `x[g]` (`vpdpbusd`, or `vpmaddubsw` + `vpmaddwd`), exact in both, so both kernels give the
/// same bits.
///
/// Per super-block (256 weights) the 8 rows' codes and scales come from `kquant_sub_blocks!`
/// (scales decoded once into vectors, `d` and `dmin` folded in). Per 32-weight sub-block `s` and
/// token (activation block `i`):
/// - Q4_K: `acc += (d·sc_s · dx_i)·Σ q·qx − (dmin·m_s)·(dx_i·Σ qx)`;
/// - Q6_K (unsigned 6-bit codes `q`, weight `d·sc·(q − 32)`, a scale per 16 weights):
///   `acc += (d·sc_{2s} · dx_i)·(Σ_{0..16} q·qx − 32·Σ_{0..16} qx) + (d·sc_{2s+1} · dx_i)·(Σ_{16..32}
///   q·qx − 32·Σ_{16..32} qx)`, the activation half-sums from `xl` (first 16) and `xi − xl`.
///
/// For every (row, token) the float operations are the same whatever the lane, `T` and the row
/// stride are, and whether the rows are interleaved (`$il`: `PackedMatrix::interleave8`,
/// super-block `sb` of the 8 rows at `rows + sb · 8 · block_bytes`) or not (batch invariance;
/// `row_bytes = 0` computes one row in all lanes). Expanded inside an `unsafe` function whose
/// caller guarantees 8 rows (spaced `row_bytes`, possibly 0, or interleaved) of `nb / 8`
/// super-blocks and `T` tokens of quantized activations (`xq` codes spaced `stride`; `xd`, `xs`,
/// `xi`, `xl` per-block scales, scaled sums, integer sums and first-half integer sums spaced
/// `nb`).
#[cfg(target_arch = "x86_64")]
macro_rules! q8_rows8_k_body {
    ($ty:ident, $t:ident, $il:ident, $rows:ident, $rb:ident, $nb:ident, $xq:ident, $xd:ident, $xs:ident, $xi:ident, $xl:ident, $stride:ident, $dot:expr) => {{
        use crate::quant::{BLOCK, BlockType};
        let bb = if $ty == 3 { BlockType::Q4_K } else { BlockType::Q6_K }.block_bytes();
        let mut acc = [_mm256_setzero_ps(); $t];
        for sb in 0..$nb / 8 {
            // SAFETY: sb < nb / 8: the 8 rows' super-block sb and each token's blocks
            // 8·sb .. 8·sb + 8 are in bounds (the caller's contract).
            unsafe {
                let blk = if $il { $rows.add(sb * 8 * bb) } else { $rows.add(sb * bb) };
                // Prefetch. With one token (decode: DRAM-bound) on interleaved rows, whose bytes
                // are one sequential stream: into L1 (`T0`), `PREFETCH_IL_BYTES` ahead, spread
                // over the 8 sub-blocks below (`bb` bytes each). Otherwise here, at once: the
                // next 8 rows (contiguous after these when `row_bytes` is the row size), one
                // super-block's share of their bytes per super-block of these: with one token
                // into L2 (`T1`), a k-quant row group being 7-60 KB (Qwen2.5-1.5B's Q4_K
                // projections, its Q6_K `ffn_down`), which pulled a whole group ahead into L1
                // evicted the lines in use (on the AMD EPYC (Zen 4) of 2026-12-06, `quant_matmul
                // kquant`, GGUF rows: 51-60 ms with `T0`, 34-40 ms with `T1`); with more tokens
                // (compute-bound, each row group reused by every token tile) into L1 (`T0`),
                // which kept Qwen-1.5B's prefill ~8 % faster there. The smaller-block kernels
                // (`q8_rows8`) keep `T0`, which measured better for SmolLM2's Q4_1 / Q8_0 rows of
                // 0.4-1.6 KB. (`wrapping_add`: past the last rows these addresses may be outside
                // the data, which a prefetch may name.)
                let spread = $t == 1 && $il;
                if !spread {
                    let ahead = $rows.wrapping_add(8 * $rb + sb * 8 * bb);
                    for l in (0..8 * bb).step_by(64) {
                        if $t == 1 {
                            _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(l) as *const i8);
                        } else {
                            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(l) as *const i8);
                        }
                    }
                }
                // One token's contribution of sub-block `s` (codes `w`, lane scales `dlo` for
                // weights 0..16 and `dhi` for 16..32, or for Q4_K `dlo` = d·sc and `dhi` = dmin·m).
                kquant_sub_blocks!($ty, blk, $rb, $il, |s, w, dlo, dhi| {
                    if spread {
                        // The `bb` bytes `PREFETCH_IL_BYTES + s · bb` ahead of this super-block
                        // (a line that straddles two shares is the next share's first). As
                        // `asm!` (not pure): LLVM moves `_mm_prefetch` freely, and sank these
                        // 8 shares into one burst at the end of the super-block.
                        let ahead = blk.wrapping_add(crate::quant::PREFETCH_IL_BYTES + s * bb);
                        for l in 0..bb.div_ceil(64) {
                            std::arch::asm!("prefetcht0 [{p}]", p = in(reg) ahead.wrapping_add(64 * l), options(nostack, preserves_flags));
                        }
                    }
                    for k in 0..$t {
                        let xb = $xq.add(k * $stride + (sb * 8 + s) * BLOCK) as *const i32;
                        let x: [__m256i; 8] = std::array::from_fn(|g| _mm256_set1_epi32(xb.add(g).read_unaligned()));
                        let i = k * $nb + sb * 8 + s;
                        let dx = _mm256_set1_ps(*$xd.add(i));
                        let lo = $dot([w[0], w[1], w[2], w[3]], [x[0], x[1], x[2], x[3]]);
                        let hi = $dot([w[4], w[5], w[6], w[7]], [x[4], x[5], x[6], x[7]]);
                        if $ty == 3 {
                            let si = _mm256_add_epi32(lo, hi);
                            acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si), _mm256_mul_ps(dlo, dx), acc[k]);
                            acc[k] = _mm256_fnmadd_ps(dhi, _mm256_set1_ps(*$xs.add(i)), acc[k]);
                        } else {
                            let il = *$xl.add(i);
                            let ih = *$xi.add(i) - il;
                            let lo = _mm256_sub_epi32(lo, _mm256_set1_epi32(32 * il));
                            let hi = _mm256_sub_epi32(hi, _mm256_set1_epi32(32 * ih));
                            acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(dlo, dx), acc[k]);
                            acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(dhi, dx), acc[k]);
                        }
                    }
                });
            }
        }
        // Token-major: token k's 8 rows are one vector.
        let mut out = [[0.0f32; 8]; $t];
        for k in 0..$t {
            // SAFETY: 8 f32 of stack memory.
            unsafe { _mm256_storeu_ps(out[k].as_mut_ptr(), acc[k]) };
        }
        out
    }};
}

#[cfg(target_arch = "x86_64")]
mod krepack;
#[cfg(target_arch = "aarch64")]
mod neon;
mod scalar;
#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
mod x86_512;

/// Elements per block of every supported type (`QK4_0 = QK4_1 = QK8_0 = 32` in ggml).
pub const BLOCK: usize = 32;

/// Weight rows per dequantized tile of the GEMM path.
pub const GEMM_TILE_ROWS: usize = 64;

/// Rows × tokens of the AVX-512 register tiles.
#[cfg(target_arch = "x86_64")]
const TILE_R: usize = 4;
#[cfg(target_arch = "x86_64")]
const TILE_T: usize = 4;
/// Tokens per pass of the 8-bit-activation VNNI kernels: 8 (each row group's codes, transposed
/// once per block, feed 8 tokens; the 32 vector registers of AVX-512 hold the 8 accumulators,
/// the 8 code vectors and the temporaries). The AVX2 kernels (16 registers) take [`TILE_T`].
#[cfg(target_arch = "x86_64")]
const TILE_T_VNNI: usize = 8;

/// How far ahead of the super-block in use the one-token k-quant kernels prefetch interleaved
/// rows (`PackedMatrix::interleave8`: each task's bytes are one sequential stream), a share of
/// `block_bytes` per 32-weight sub-block. On the AMD EPYC (Zen 3, AVX2) of 2026-12-07,
/// `quant_matmul kquant` (Qwen-1.5B's 28 layers from DRAM, 2 threads, fastest / median of 3
/// runs on a noisy host, probe 17-22 GB/s): this kernel 53.5 / 56.3 ms against 66.0 / 73.7 ms
/// with the same 8 KiB prefetched in one burst per super-block, the Q6_K `ffn_down` matrices
/// alone 22.0 / 23.2 against 38.7 / 42.1 ms (8 → 14 GB/s): the burst had left the memory idle
/// while the core computed. A prototype choosing the pattern at run time put 4-8 KiB spread
/// into L1 ahead of 12-24 KiB, of spreading into L2 (`T1`), and far ahead of the next row
/// group's share (7-60 KB ahead, 70-71 / 80-94 ms) and of no software prefetch (92 ms); the
/// table is in docs/performance.md (twenty-third session).
#[cfg(target_arch = "x86_64")]
const PREFETCH_IL_BYTES: usize = 8 * 1024;

/// Bytes of packed rows per sub-chunk of the tiled kernels: they stay in L1/L2 while every
/// token group passes over them.
#[cfg(target_arch = "x86_64")]
const TILED_SUB_BYTES: usize = 32 * 1024;

/// Tokens from which the 8-bit-activation path repacks its rows first (every block type,
/// `PackedMatrix::matmul_repacked_q8`), with AVX2 and with VNNI; fewer tokens (decode,
/// speculative verification, a batch of decode streams) run the per-token-group kernels on the
/// GGUF blocks. On the AMD EPYC (Zen 4) of 2026-12-07 (`quant_matmul kprefill`,
/// `KPREFILL_N`, one thread), the repacked AVX2 kernels were ahead from 16 tokens on (Q4_K
/// 60 → 84-87 GMAC/s), the VNNI ones behind at 16 (Q4_K 107 → 80-86), about even at 32-64 and
/// ahead at 128 (113 → 135); `cargo xtask bench serve` with 16 streams (VNNI) went from 597
/// to 476-503 tok/s when its batched steps of 16 tokens were repacked. (AVX2 serving at 16
/// streams was not measured.)
#[cfg(target_arch = "x86_64")]
const REPACK_MIN_TOKENS_AVX2: usize = 8;
#[cfg(target_arch = "x86_64")]
const REPACK_MIN_TOKENS_VNNI: usize = 32;

/// Tokens per pass of the repacked kernels: 4 with AVX2 (16 vector registers), and with VNNI
/// (32) 8, but 4 for Q6_K (whose two 16-weight halves keep more sums live). On the AMD EPYC
/// (Zen 4) of 2026-12-07, one thread, `quant_matmul kprefill` (GMAC/s, Q4_K 2048 × 1536 /
/// 17920 × 1536 / Q6_K 1536 × 8960): AVX2 T = 4: 100 / 95 / 65, T = 6: 91 / 85 / 44; VNNI
/// T = 8: 138 / 129 / 67, T = 6: 132 / 123 / 86, T = 4 (Q6_K): 93.
#[cfg(target_arch = "x86_64")]
const REPACK_T_AVX2: usize = 4;
#[cfg(target_arch = "x86_64")]
const REPACK_T_VNNI: usize = 8;
#[cfg(target_arch = "x86_64")]
const REPACK_T_VNNI_Q6K: usize = 4;

/// 32-weight blocks per span of the repacked kernels: 8 rows × 64 blocks repacked are 20 KiB,
/// which stay in L1 while all tokens pass.
#[cfg(target_arch = "x86_64")]
const REPACK_SPAN_BLOCKS: usize = 64;

/// A smaller tile's results in the top-left corner of a full tile.
#[cfg(target_arch = "x86_64")]
fn widen<const R: usize, const T: usize, const RO: usize, const TO: usize>(o: [[f32; T]; R]) -> [[f32; TO]; RO] {
    let mut out = [[0.0f32; TO]; RO];
    for (dst, src) in out.iter_mut().zip(o) {
        dst[..T].copy_from_slice(&src);
    }
    out
}

/// A GGUF block type that the packed kernels understand.
///
/// Block layouts (little-endian, from ggml-common.h), for 32 weights each:
/// - `Q4_0`: `d: f16`, `qs: [u8; 16]`; weight `j` is `d · ((qs[j] & 15) − 8)`, weight `j + 16` is
///   `d · ((qs[j] >> 4) − 8)`. 18 bytes.
/// - `Q4_1`: `d: f16`, `m: f16`, `qs: [u8; 16]`; weights `d · q + m` with the same nibble order.
///   20 bytes.
/// - `Q8_0`: `d: f16`, `qs: [i8; 32]`; weight `i` is `d · qs[i]`. 34 bytes.
/// - `Q5_0`: `d: f16`, `qh: u32` (bit `j` is the 5th bit of weight `j`), `qs: [u8; 16]` (low 4
///   bits, nibble order of Q4_0); weight `j` is `d · (q_j − 16)`. 22 bytes.
/// - `Q4_K` (256 weights, 144 bytes): `d: f16`, `dmin: f16`, `scales: [u8; 12]` (eight 6-bit
///   scales and mins, `get_scale_min_k4`), `qs: [u8; 128]`; sub-block `k` (32 weights) is
///   `d·sc_k · q − dmin·m_k`, its codes the low (even `k`) or high (odd `k`) nibbles of
///   `qs[32·(k/2) ..][..32]`. The kernels treat it as eight 32-weight sub-blocks.
/// - `Q6_K` (256 weights, 210 bytes): `ql: [u8; 128]` (low 4 bits), `qh: [u8; 64]` (high 2
///   bits), `scales: [i8; 16]`, `d: f16`; weight `i` is `d · scales[i / 16] · (q_i − 32)` with
///   ggml's interleaving (`dequantize_row_q6_K`, see [`q6k_code`]). The kernels treat it as
///   eight 32-weight sub-blocks with two scales each.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockType {
    /// `block_q4_0`.
    Q4_0,
    /// `block_q4_1`.
    Q4_1,
    /// `block_q8_0`.
    Q8_0,
    /// `block_q4_K` (super-blocks of 256 weights).
    Q4_K,
    /// `block_q5_0`.
    Q5_0,
    /// `block_q6_K` (super-blocks of 256 weights).
    Q6_K,
}

impl BlockType {
    /// Bytes per block (of [`BlockType::block_len`] weights).
    pub const fn block_bytes(self) -> usize {
        match self {
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q8_0 => 34,
            Self::Q4_K => 144,
            Self::Q5_0 => 22,
            Self::Q6_K => 210,
        }
    }

    /// Weights per block: 32, or 256 for the k-quants `Q4_K` and `Q6_K`. A row length must be
    /// a multiple of it.
    pub const fn block_len(self) -> usize {
        match self {
            Self::Q4_K | Self::Q6_K => 256,
            _ => BLOCK,
        }
    }
}

/// Byte offsets of the fields of a `Q6_K` block.
pub(crate) const Q6K_QH: usize = 128;
pub(crate) const Q6K_SCALES: usize = 192;
pub(crate) const Q6K_D: usize = 208;

/// The 6-bit code (0..64, before the `− 32`) of weight `l` (0..32) of 32-weight sub-block `k`
/// (0..8) of a Q6_K block, as ggml's `dequantize_row_q6_K`: in half `h = k / 4`, group
/// `g = k % 4` takes the low (`g < 2`) or high nibble of `ql[64h + 32(g % 2) + l]` and bits
/// `2g, 2g + 1` of `qh[32h + l]`. Its scale is `scales[8h + 2g + l / 16]`. The per-weight
/// definition the kernels' tests check their decoding against.
#[cfg_attr(not(test), allow(dead_code))]
#[inline]
pub(crate) fn q6k_code(blk: &[u8], k: usize, l: usize) -> u8 {
    let (h, g) = (k / 4, k % 4);
    let lo = (blk[64 * h + 32 * (g % 2) + l] >> (4 * (g / 2))) & 0xF;
    let hi = (blk[Q6K_QH + 32 * h + l] >> (2 * g)) & 3;
    lo | (hi << 4)
}

/// The two scales of sub-block `k` of a Q6_K block (weights 0..16 and 16..32), `d` included.
#[inline]
pub(crate) fn q6k_scales(blk: &[u8], k: usize) -> (f32, f32) {
    let d = f16_at(blk, Q6K_D);
    let (h, g) = (k / 4, k % 4);
    let s = &blk[Q6K_SCALES + 8 * h + 2 * g..];
    (d * f32::from(s[0] as i8), d * f32::from(s[1] as i8))
}

/// Scale and min of sub-block `j` (0..8) of a Q4_K block, 6 bits each (ggml's
/// `get_scale_min_k4`; `s` is the 12-byte `scales` field).
#[inline]
pub(crate) fn q4k_scale_min(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

/// The instruction set a kernel call uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Portable Rust loops (any CPU).
    Scalar,
    /// x86-64 AVX2 + FMA + F16C intrinsics.
    Avx2,
    /// x86-64 AVX-512 F/BW/VL/DQ intrinsics (plus AVX2 + FMA + F16C) for the packed matmul; the
    /// other kernels use their AVX2 code under this level.
    Avx512,
}

impl Isa {
    /// The best instruction set this CPU supports, detected once. The environment variable
    /// `DECO_KERNELS` caps it (for benchmarks and debugging): `scalar` forces [`Isa::Scalar`],
    /// `avx2` forbids [`Isa::Avx512`].
    pub fn detect() -> Isa {
        static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *ISA.get_or_init(|| {
            let cap = std::env::var("DECO_KERNELS").unwrap_or_default();
            if cap == "scalar" {
                return Isa::Scalar;
            }
            if cap != "avx2" && Isa::Avx512.is_available() {
                Isa::Avx512
            } else if Isa::Avx2.is_available() {
                Isa::Avx2
            } else {
                Isa::Scalar
            }
        })
    }

    /// Whether this CPU can run kernels of this instruction set.
    pub fn is_available(self) -> bool {
        match self {
            Isa::Scalar => true,
            Isa::Avx2 => {
                #[cfg(target_arch = "x86_64")]
                {
                    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
                }
                #[cfg(not(target_arch = "x86_64"))]
                {
                    false
                }
            }
            Isa::Avx512 => {
                #[cfg(target_arch = "x86_64")]
                {
                    Isa::Avx2.is_available()
                        && is_x86_feature_detected!("avx512f")
                        && is_x86_feature_detected!("avx512bw")
                        && is_x86_feature_detected!("avx512vl")
                        && is_x86_feature_detected!("avx512dq")
                }
                #[cfg(not(target_arch = "x86_64"))]
                {
                    false
                }
            }
        }
    }
}

/// Precision of the activations in [`PackedMatrix::matmul`] (process-wide, default
/// [`ActivationPrecision::F32`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ActivationPrecision {
    /// f32 activations, f32 accumulation: the product of the dequantized weights with the exact
    /// activations up to f32 rounding (the default; what the golden-logit tests check).
    F32,
    /// Activations quantized to 8 bits per block of 32 ([`QuantizedActivations`]) and integer
    /// dot products, as llama.cpp: faster, less accurate. Every CPU ([`q8_isa`]).
    Q8,
}

static ACTIVATION_Q8: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Sets the activation precision of every later [`PackedMatrix::matmul`] in this process.
///
/// # Errors
/// None today: every precision runs on every CPU (the 8-bit-activation kernels have a
/// portable and a NEON path, [`q8_isa`]). The `Result` stays so that a precision a CPU cannot
/// run can be refused.
pub fn set_activation_precision(p: ActivationPrecision) -> Result<()> {
    ACTIVATION_Q8.store(p == ActivationPrecision::Q8, std::sync::atomic::Ordering::Relaxed);
    Ok(())
}

/// The activation precision set by [`set_activation_precision`].
pub fn activation_precision() -> ActivationPrecision {
    if ACTIVATION_Q8.load(std::sync::atomic::Ordering::Relaxed) { ActivationPrecision::Q8 } else { ActivationPrecision::F32 }
}

/// The instruction set [`PackedMatrix::matmul_q8`] runs on: [`Isa::Avx512`] with AVX-512 VNNI,
/// else [`Isa::Avx2`] with AVX2 + FMA + F16C (integer kernels for every block type on both,
/// with the same bits), else [`Isa::Scalar`]: the portable row kernel, whose integer block sums
/// are NEON on aarch64 (`sdot` with the `dotprod` extension) and plain Rust elsewhere, with the
/// same bits as the x86 kernels. `DECO_KERNELS=scalar` selects the portable kernel,
/// `DECO_KERNELS=avx2` the AVX2 kernels.
pub fn q8_isa() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        match Isa::detect() {
            Isa::Avx512 if is_x86_feature_detected!("avx512vnni") => Isa::Avx512,
            Isa::Avx512 | Isa::Avx2 => Isa::Avx2,
            Isa::Scalar => Isa::Scalar,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        Isa::Scalar
    }
}

/// Activations quantized to 8 bits per block of 32 values, per token (the scheme of llama.cpp's
/// `quantize_row_q8_0` / `q8_1`, stored as separate arrays and with f32 rather than f16 scales,
/// so results are not bit-identical to llama.cpp's): for block `b` of a token,
/// `d_b = max|x| / 127`, codes `q_i = round_half_even(x_i / d_b)` in −127..=127, and the
/// scaled code sum `s_b = d_b · Σ q_i` (used for the Q4_1 minimum). A block with a NaN or an
/// infinity gets a NaN scale, so the non-finite value reaches the output as in the f32 path.
///
/// # Shapes
/// `codes`: `[n, cols]`; `scales`, `sums`: `[n, cols / 32]`.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantizedActivations {
    /// Codes, row-major `[n, cols]`.
    pub codes: Vec<i8>,
    /// Per-block scales `d_b`, `[n, cols / 32]`.
    pub scales: Vec<f32>,
    /// Per-block `d_b · Σ q_i`, `[n, cols / 32]`.
    pub sums: Vec<f32>,
    /// Per-block `Σ q_i` (exact integers), `[n, cols / 32]`.
    pub isums: Vec<i32>,
    /// Per-block `Σ q_i` over the block's first 16 codes (exact integers), `[n, cols / 32]`:
    /// Q6_K has a scale per 16 weights.
    pub isums_lo: Vec<i32>,
}

impl QuantizedActivations {
    /// Quantizes `x` (`[n, cols]` row-major, `cols` a multiple of 32).
    ///
    /// # Errors
    /// [`Error::RaggedRow`] if `cols` is not a multiple of 32; [`Error::Length`] if
    /// `x.len() != n · cols`.
    pub fn quantize(x: &[f32], n: usize, cols: usize) -> Result<Self> {
        if !cols.is_multiple_of(BLOCK) {
            return Err(Error::RaggedRow { ty: BlockType::Q8_0, cols, block: BLOCK });
        }
        if x.len() != n * cols {
            return Err(Error::Length { what: "x", expected: n * cols, actual: x.len() });
        }
        let nblocks = x.len() / BLOCK;
        let mut q = Self { codes: vec![0i8; x.len()], scales: vec![0.0f32; nblocks], sums: vec![0.0f32; nblocks], isums: vec![0i32; nblocks], isums_lo: vec![0i32; nblocks] };
        // Blocks are independent: a long prompt is quantized in parallel pieces of whole
        // blocks (the same values as in one piece).
        const PIECE: usize = 64 * 1024;
        let run = |xp: &[f32], c: &mut [i8], sc: &mut [f32], su: &mut [f32], is: &mut [i32], il: &mut [i32]| {
            #[cfg(target_arch = "x86_64")]
            if Isa::detect() != Isa::Scalar {
                // SAFETY: AVX2 and FMA were detected (`Isa::detect` is not Scalar).
                unsafe { quantize_blocks_avx2(xp, c, sc, su, is, il) };
                return;
            }
            quantize_blocks(xp, c, sc, su, is, il);
        };
        if x.len() > PIECE {
            // On the forward pass's spinning team (`team::par_for`): a rayon `par_chunks` here
            // ran serially, the team's other threads being busy polling it.
            let (cp, scp, sup, isp, ilp) = (
                SyncPtr(q.codes.as_mut_ptr()),
                SyncPtr(q.scales.as_mut_ptr()),
                SyncPtr(q.sums.as_mut_ptr()),
                SyncPtr(q.isums.as_mut_ptr()),
                SyncPtr(q.isums_lo.as_mut_ptr()),
            );
            crate::team::par_for(x.len().div_ceil(PIECE), |p| {
                let (v0, v1) = (p * PIECE, ((p + 1) * PIECE).min(x.len()));
                let (b0, b1) = (v0 / BLOCK, v1 / BLOCK);
                // SAFETY: piece p owns values v0 .. v1 of `codes` and blocks b0 .. b1 of the
                // per-block vectors, disjoint from every other piece's; `q` outlives the call.
                unsafe {
                    run(
                        &x[v0..v1],
                        std::slice::from_raw_parts_mut(cp.get().add(v0), v1 - v0),
                        std::slice::from_raw_parts_mut(scp.get().add(b0), b1 - b0),
                        std::slice::from_raw_parts_mut(sup.get().add(b0), b1 - b0),
                        std::slice::from_raw_parts_mut(isp.get().add(b0), b1 - b0),
                        std::slice::from_raw_parts_mut(ilp.get().add(b0), b1 - b0),
                    )
                };
            });
        } else {
            let Self { codes, scales, sums, isums, isums_lo } = &mut q;
            run(x, codes, scales, sums, isums, isums_lo);
        }
        Ok(q)
    }
}

/// [`quantize_blocks`] with AVX2, written out with intrinsics (the compiler did not vectorize
/// the scalar loop's max and finiteness scans: ~1 ns per value, 6 % of a Q8_0 prefill): per block
/// the `|x|` maximum (exact in any order for finite values), the non-finite test on the exponent
/// bits, `x · (1/d)` rounded to nearest-even (`vroundps`), clamped, converted and packed to
/// bytes, and the exact integer sums; a block with a non-finite value gets NaN scale and sum.
/// The same IEEE operations as [`quantize_blocks`], so the same codes and scales (unit test
/// `avx2_quantizer_equals_scalar`).
///
/// # Safety
/// AVX2 and FMA must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_blocks_avx2(x: &[f32], codes: &mut [i8], scales: &mut [f32], sums: &mut [f32], isums: &mut [i32], isums_lo: &mut [i32]) {
    use std::arch::x86_64::*;
    debug_assert!(x.len() == codes.len() && x.len() == scales.len() * BLOCK);
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let exp_mask = _mm256_set1_epi32(0x7f80_0000);
    let hi = _mm256_set1_ps(127.0);
    let lo = _mm256_set1_ps(-127.0);
    // vpackssdw / vpacksswb interleave the 128-bit lanes; this puts the 8 dwords back in order.
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    let hsum = |v: __m256i| -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
        _mm_cvtsi128_si32(s)
    };
    for b in 0..scales.len() {
        // SAFETY: block b's 32 values and codes are in bounds (the lengths above).
        unsafe {
            let xp = x.as_ptr().add(b * BLOCK);
            let v: [__m256; 4] = std::array::from_fn(|k| _mm256_loadu_ps(xp.add(8 * k)));
            let a = v.map(|v| _mm256_and_ps(v, abs_mask));
            let m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
            let e = v.map(|v| _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(v), exp_mask), exp_mask));
            let bad = _mm256_or_si256(_mm256_or_si256(e[0], e[1]), _mm256_or_si256(e[2], e[3]));
            if _mm256_movemask_epi8(bad) != 0 {
                scales[b] = f32::NAN;
                sums[b] = f32::NAN;
                continue;
            }
            let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1)));
            let d = amax / 127.0;
            let id = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
            let q = v.map(|v| {
                let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(v, id));
                _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi))
            });
            let p16a = _mm256_packs_epi32(q[0], q[1]);
            let p16b = _mm256_packs_epi32(q[2], q[3]);
            let p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b), order);
            _mm256_storeu_si256(codes.as_mut_ptr().add(b * BLOCK).cast(), p8);
            let first = hsum(_mm256_add_epi32(q[0], q[1]));
            let sum = first + hsum(_mm256_add_epi32(q[2], q[3]));
            scales[b] = d;
            sums[b] = d * sum as f32;
            isums[b] = sum;
            isums_lo[b] = first;
        }
    }
}

/// Quantizes `x` block by block into `codes` (as long as `x`) and the per-block `scales`,
/// `sums`, `isums`, `isums_lo` (`x.len() / 32` each) of a [`QuantizedActivations`].
#[inline(always)]
fn quantize_blocks(x: &[f32], codes: &mut [i8], scales: &mut [f32], sums: &mut [f32], isums: &mut [i32], isums_lo: &mut [i32]) {
    for (b, (xb, qb)) in x.chunks_exact(BLOCK).zip(codes.chunks_exact_mut(BLOCK)).enumerate() {
        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        if xb.iter().any(|v| !v.is_finite()) {
            scales[b] = f32::NAN;
            sums[b] = f32::NAN;
            continue;
        }
        let d = amax / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for (q, v) in qb.iter_mut().zip(xb) {
            let c = (v * id).round_ties_even().clamp(-127.0, 127.0) as i8;
            *q = c;
            sum += i32::from(c);
        }
        scales[b] = d;
        sums[b] = d * sum as f32;
        isums[b] = sum;
        isums_lo[b] = qb[..BLOCK / 2].iter().map(|&q| i32::from(q)).sum();
    }
}

/// A `[rows, cols]` weight matrix stored as packed GGUF blocks, row-major (row `r` is the
/// `cols / 32` blocks at bytes `r · row_bytes .. (r + 1) · row_bytes`), or, after
/// [`PackedMatrix::interleave8`], with the blocks of each group of 8 rows interleaved.
/// Equality compares the stored bytes, so the two layouts of one matrix are not equal.
#[derive(Clone, PartialEq, Eq)]
pub struct PackedMatrix {
    ty: BlockType,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
    /// Whether the whole groups of 8 rows are in [`PackedMatrix::interleave8`]'s layout.
    interleaved: bool,
}

impl std::fmt::Debug for PackedMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedMatrix")
            .field("ty", &self.ty)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .field("bytes", &self.data.len())
            .field("interleaved", &self.interleaved)
            .finish()
    }
}

// Always inlined: a call per block was ~7 % of the portable kernels' time.
#[inline(always)]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// A raw pointer that parallel tasks (rayon, [`crate::team`]) may share to write disjoint
/// elements: the packed and dense kernels here, [`crate::team::par_chunks_mut`], and the
/// blocked factorizations of `deco-quant`. Whoever dereferences it must make sure the tasks'
/// elements are disjoint and in bounds.
#[derive(Debug)]
pub struct SyncPtr<T = f32>(pub *mut T);

// Copy for every `T` (a derive would ask `T: Copy`): it is a pointer.
impl<T> Clone for SyncPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SyncPtr<T> {}
// SAFETY: every task writes a disjoint set of elements (distinct output columns / rows).
unsafe impl<T: Send> Send for SyncPtr<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for SyncPtr<T> {}

impl<T> SyncPtr<T> {
    /// The pointer (a method, so closures capture the whole `Send` wrapper).
    pub fn get(self) -> *mut T {
        self.0
    }
}

/// Where [`PackedMatrix::interleave8`] puts the bytes of row `r` (0..8) of one super-block of 8
/// rows of `bb`-byte blocks: `(bytes of the row's block, bytes of the 8 interleaved blocks)`
/// pairs, in the order of the row's bytes: 4-byte chunk `c` at `32c + 4r`, then the `bb mod 4`
/// bytes after the last whole chunk at `32 · ⌊bb/4⌋ + r · (bb mod 4)`. The one definition of the
/// layout on the host side; the kernels' loads (`x86::rows8x4`, `x86::rows8x1`, `x86::q6k_d8`)
/// read the same offsets.
fn interleaved_spans(bb: usize, r: usize) -> impl Iterator<Item = (std::ops::Range<usize>, std::ops::Range<usize>)> {
    let (chunks, tail) = (bb / 4, bb % 4);
    (0..chunks)
        .map(move |c| (4 * c..4 * c + 4, 32 * c + 4 * r..32 * c + 4 * r + 4))
        .chain(std::iter::once((4 * chunks..bb, 32 * chunks + tail * r..32 * chunks + tail * (r + 1))))
}

impl PackedMatrix {
    /// Wraps packed blocks. `data` must hold exactly `rows · cols / ty.block_len()` blocks of
    /// `ty`.
    ///
    /// # Errors
    /// [`Error::RaggedRow`] if `cols` is not a multiple of the block length (32, or 256 for
    /// Q4_K and Q6_K), [`Error::Length`] for a wrong byte count.
    pub fn new(ty: BlockType, rows: usize, cols: usize, data: Vec<u8>) -> Result<Self> {
        if !cols.is_multiple_of(ty.block_len()) {
            return Err(Error::RaggedRow { ty, cols, block: ty.block_len() });
        }
        let expected = rows
            .checked_mul(cols / ty.block_len())
            .and_then(|b| b.checked_mul(ty.block_bytes()))
            .ok_or(Error::Length { what: "packed matrix bytes", expected: usize::MAX, actual: data.len() })?;
        if data.len() != expected {
            return Err(Error::Length { what: "packed matrix bytes", expected, actual: data.len() });
        }
        Ok(Self { ty, rows, cols, data, interleaved: false })
    }

    /// Block type.
    pub fn ty(&self) -> BlockType {
        self.ty
    }

    /// Number of rows (output features).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Row length (input features).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The packed bytes as stored: GGUF rows, or after [`PackedMatrix::interleave8`] its layout
    /// ([`PackedMatrix::gguf_bytes`] gives the GGUF rows either way).
    pub fn as_bytes(&self) -> &[u8] {
        &self.data
    }

    /// The packed bytes as GGUF rows (row `r` at `r · row_bytes`): [`PackedMatrix::as_bytes`],
    /// or a copy with the interleaving undone.
    pub fn gguf_bytes(&self) -> Cow<'_, [u8]> {
        if !self.interleaved {
            return Cow::Borrowed(&self.data);
        }
        let mut out = Vec::with_capacity(self.data.len());
        for r in 0..self.rows {
            out.extend_from_slice(&self.row(r));
        }
        Cow::Owned(out)
    }

    /// Whether the matrix is in [`PackedMatrix::interleave8`]'s layout.
    pub fn is_interleaved(&self) -> bool {
        self.interleaved
    }

    /// This matrix with the blocks of each whole group of 8 rows interleaved, the layout the
    /// 8-bit-activation Q4_K / Q6_K kernels read without transposing (llama.cpp's `REPACK`
    /// idea, `block_q4_Kx8`, here a pure permutation of the bytes, so the matrix keeps its size):
    /// for group `g` (rows `8g .. 8g + 8`, bytes `8g · row_bytes ..` as before) and super-block
    /// `sb`, the 8 rows' blocks (`B` = 144 or 210 bytes each) take bytes
    /// `sb · 8B .. (sb + 1) · 8B` of the group, 4-byte chunk `c` of row `r` at `32c + 4r`, and the
    /// `B mod 4` bytes after the last whole chunk (Q6_K's `d`) of row `r` at `32 · ⌊B/4⌋ + r · (B
    /// mod 4)`. The `rows mod 8` last rows stay GGUF rows. Other block types, and CPUs whose
    /// 8-bit-activation kernel is the portable one ([`q8_isa`] is [`Isa::Scalar`]: it reads GGUF
    /// rows), are returned unchanged.
    ///
    /// The 8-bit-activation kernels ([`PackedMatrix::matmul_q8`]) give the same bits on either
    /// layout. Everything else reads GGUF rows: [`PackedMatrix::dequantize_rows`] and the row
    /// operations gather them (one row at a time), while the f32-activation products
    /// ([`PackedMatrix::matmul_with`], [`PackedMatrix::matmul_dequant_gemm`]) first copy the
    /// whole matrix back to GGUF rows, a copy per call: interleave only matrices that will run
    /// with 8-bit activations ([`PackedMatrix::for_activation_precision`]).
    pub fn interleave8(mut self) -> Self {
        if self.interleaved || !matches!(self.ty, BlockType::Q4_K | BlockType::Q6_K) || q8_isa() == Isa::Scalar {
            return self;
        }
        let (rb, bb) = (self.row_bytes(), self.ty.block_bytes());
        let mut group = vec![0u8; 8 * rb];
        for g in 0..self.rows / 8 {
            let dst = &mut self.data[g * 8 * rb..(g + 1) * 8 * rb];
            group.copy_from_slice(dst);
            for sb in 0..rb / bb {
                let out = &mut dst[sb * 8 * bb..(sb + 1) * 8 * bb];
                for r in 0..8 {
                    let src = &group[r * rb + sb * bb..r * rb + (sb + 1) * bb];
                    for (from, to) in interleaved_spans(bb, r) {
                        out[to].copy_from_slice(&src[from]);
                    }
                }
            }
        }
        self.interleaved = true;
        self
    }

    /// [`PackedMatrix::interleave8`] when the process computes with 8-bit activations
    /// ([`set_activation_precision`] with [`ActivationPrecision::Q8`]), else `self`: what a model
    /// loader calls on each host weight after setting the precision.
    pub fn for_activation_precision(self) -> Self {
        if activation_precision() == ActivationPrecision::Q8 { self.interleave8() } else { self }
    }

    /// Bytes per row.
    pub fn row_bytes(&self) -> usize {
        self.cols / self.ty.block_len() * self.ty.block_bytes()
    }

    /// Row `r`'s GGUF blocks: a slice of the data, or gathered from an interleaved group.
    fn row(&self, r: usize) -> Cow<'_, [u8]> {
        let rb = self.row_bytes();
        if !self.interleaved || r >= self.rows / 8 * 8 {
            return Cow::Borrowed(&self.data[r * rb..(r + 1) * rb]);
        }
        let bb = self.ty.block_bytes();
        let group = &self.data[r / 8 * 8 * rb..(r / 8 + 1) * 8 * rb];
        let mut out = Vec::with_capacity(rb);
        for blk in group.chunks_exact(8 * bb) {
            // The spans come in the order of the row's bytes.
            for (_, at) in interleaved_spans(bb, r % 8) {
                out.extend_from_slice(&blk[at]);
            }
        }
        Cow::Owned(out)
    }

    /// This matrix in GGUF rows (a copy when interleaved).
    fn gguf(&self) -> Cow<'_, PackedMatrix> {
        if !self.interleaved {
            return Cow::Borrowed(self);
        }
        Cow::Owned(Self { ty: self.ty, rows: self.rows, cols: self.cols, data: self.gguf_bytes().into_owned(), interleaved: false })
    }

    /// A new matrix whose row `i` is row `perm[i]` of this one (e.g. undoing llama.cpp's Q/K
    /// row permutation without dequantizing), in GGUF rows.
    ///
    /// # Errors
    /// [`Error::Length`] if an index is out of range.
    pub fn permute_rows(&self, perm: &[usize]) -> Result<Self> {
        let rb = self.row_bytes();
        let mut data = Vec::with_capacity(perm.len() * rb);
        for &p in perm {
            if p >= self.rows {
                return Err(Error::Length { what: "row index", expected: self.rows, actual: p });
            }
            data.extend_from_slice(&self.row(p));
        }
        Ok(Self { ty: self.ty, rows: perm.len(), cols: self.cols, data, interleaved: false })
    }

    /// Stacks matrices of the same type and row length along the rows (fusing Q/K/V or gate/up
    /// projections into one matmul), in GGUF rows.
    ///
    /// # Errors
    /// [`Error::Incompatible`] for an empty list or different types / row lengths.
    pub fn concat_rows(parts: &[&PackedMatrix]) -> Result<Self> {
        let first = parts.first().ok_or_else(|| Error::Incompatible("no matrices to concatenate".into()))?;
        let mut data = Vec::with_capacity(parts.iter().map(|p| p.data.len()).sum());
        let mut rows = 0;
        for p in parts {
            if p.ty != first.ty || p.cols != first.cols {
                return Err(Error::Incompatible(format!(
                    "{:?} [{}, {}] vs {:?} [{}, {}]",
                    first.ty, first.rows, first.cols, p.ty, p.rows, p.cols
                )));
            }
            data.extend_from_slice(&p.gguf_bytes());
            rows += p.rows;
        }
        Ok(Self { ty: first.ty, rows, cols: first.cols, data, interleaved: false })
    }

    /// Dequantizes rows `start .. start + out.len() / cols` into `out` (row-major f32), with
    /// ggml's arithmetic (`dequantize_row_*` of ggml-quants.c).
    ///
    /// # Errors
    /// [`Error::Length`] if `out` is not a whole number of rows or runs past the last row.
    pub fn dequantize_rows(&self, start: usize, out: &mut [f32]) -> Result<()> {
        if !out.len().is_multiple_of(self.cols.max(1)) || start + out.len() / self.cols.max(1) > self.rows {
            return Err(Error::Length { what: "dequantized rows", expected: (self.rows - start.min(self.rows)) * self.cols, actual: out.len() });
        }
        for (i, o) in out.chunks_exact_mut(self.cols.max(1)).enumerate() {
            scalar::dequant_row(self.ty, &self.row(start + i), o);
        }
        Ok(())
    }

    /// The whole matrix as row-major f32 `[rows, cols]`.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.rows * self.cols];
        if self.cols > 0 {
            out.par_chunks_mut(self.cols).enumerate().for_each(|(r, o)| scalar::dequant_row(self.ty, &self.row(r), o));
        }
        out
    }

    /// `y[n, rows] = x[n, cols] · Wᵀ` (row-major f32), with the best detected [`Isa`].
    ///
    /// # Errors
    /// [`Error::Length`] if `x.len() != n · cols` or `y.len() != n · rows`.
    ///
    /// With [`ActivationPrecision::Q8`] set ([`set_activation_precision`]) this is
    /// [`PackedMatrix::matmul_q8`].
    pub fn matmul(&self, x: &[f32], n: usize, y: &mut [f32]) -> Result<()> {
        if activation_precision() == ActivationPrecision::Q8 {
            return self.matmul_q8(x, n, y);
        }
        self.matmul_with(x, n, y, Isa::detect())
    }

    /// `y[n, rows] = q8(x)[n, cols] · Wᵀ`: the activations quantized per token and block of 32
    /// ([`QuantizedActivations`]), integer dot products, f32 block scaling and accumulation
    /// (llama.cpp's `ggml_vec_dot_q4_1_q8_1` and siblings). Batch-invariant, multithreaded and
    /// tiled as the f32 path. Runs on the best of [`PackedMatrix::matmul_q8_with`]'s
    /// instruction sets this CPU has ([`q8_isa`]).
    ///
    /// Error bound per output: `Σ_b (d_b / 2) · Σ_{i∈b} |w_i|` from the activation rounding
    /// (`d_b` the block's activation scale) plus f32 rounding.
    ///
    /// # Errors
    /// [`Error::Length`] as [`PackedMatrix::matmul`].
    pub fn matmul_q8(&self, x: &[f32], n: usize, y: &mut [f32]) -> Result<()> {
        self.matmul_q8_with(x, n, y, q8_isa())
    }

    /// [`PackedMatrix::matmul_q8`] on an explicit instruction set:
    /// - [`Isa::Avx512`] (needs AVX-512 VNNI): `vpdpbusd`, every block type 8 rows at a time
    ///   (one row per 32-bit lane) and up to 8 tokens per pass over the rows;
    /// - [`Isa::Avx2`]: `vpmaddubsw` + `vpmaddwd` (ggml's AVX2 `mul_sum_us8_pairs_float`), the
    ///   same row groups; the same integer block sums and float operations as the VNNI kernels,
    ///   so the same bits (4 tokens per pass: 16 vector registers);
    /// - [`Isa::Scalar`] (any CPU): one row and up to 4 tokens at a time, integer block sums in
    ///   NEON on aarch64 (`sdot` where the CPU has `dotprod`, else `smull` / `sadalp`) or plain
    ///   Rust, the same float operations in the same order with `f32::mul_add`: the same bits
    ///   as the x86 kernels (`scalar::q8_row`).
    ///
    /// # Errors
    /// [`Error::Length`] as [`PackedMatrix::matmul`]; [`Error::Unsupported`] for an instruction
    /// set this CPU lacks.
    pub fn matmul_q8_with(&self, x: &[f32], n: usize, y: &mut [f32], isa: Isa) -> Result<()> {
        if x.len() != n * self.cols {
            return Err(Error::Length { what: "x", expected: n * self.cols, actual: x.len() });
        }
        if y.len() != n * self.rows {
            return Err(Error::Length { what: "y", expected: n * self.rows, actual: y.len() });
        }
        let ok = match isa {
            Isa::Avx512 => q8_isa() == Isa::Avx512,
            Isa::Avx2 => q8_isa() != Isa::Scalar,
            Isa::Scalar => true,
        };
        if !ok {
            return Err(Error::Unsupported(format!("matmul_q8 on {isa:?}: this CPU lacks it (see q8_isa)")));
        }
        if n == 0 || self.rows == 0 {
            return Ok(());
        }
        if self.cols == 0 {
            y.fill(0.0);
            return Ok(());
        }
        let qa = QuantizedActivations::quantize(x, n, self.cols)?;
        #[cfg(target_arch = "x86_64")]
        if isa != Isa::Scalar {
            self.matmul_tiled_q8(&qa, n, y, isa == Isa::Avx512);
            return Ok(());
        }
        self.matmul_portable_q8(&qa, n, y);
        Ok(())
    }

    /// The [`Isa::Scalar`] path of [`PackedMatrix::matmul_q8_with`]: row chunks on the team as
    /// [`PackedMatrix::matmul_fused`]; per row, the tokens in tiles of 64 and groups of 4
    /// (`scalar::q8_row`: each block's codes decoded once per group). The integer block sums
    /// run in NEON on aarch64 (with `sdot` when the CPU has `dotprod`, detected once per call).
    /// An interleaved matrix (`interleave8`, which only happens when the x86 kernels exist) is
    /// first copied back to GGUF rows.
    fn matmul_portable_q8(&self, qa: &QuantizedActivations, n: usize, y: &mut [f32]) {
        let m = self.gguf();
        #[cfg(target_arch = "aarch64")]
        if std::arch::is_aarch64_feature_detected!("dotprod") {
            m.portable_q8_with::<neon::NeonDot>(qa, n, y)
        } else {
            m.portable_q8_with::<neon::Neon>(qa, n, y)
        }
        #[cfg(not(target_arch = "aarch64"))]
        m.portable_q8_with::<scalar::PortableDot>(qa, n, y)
    }

    fn portable_q8_with<D: scalar::BlockDot>(&self, qa: &QuantizedActivations, n: usize, y: &mut [f32]) {
        // Tokens per pass over a row chunk (their codes stay in L2 while the rows go by), and
        // per group sharing one decoding of a row's blocks.
        const TOKEN_TILE: usize = 64;
        const GROUP: usize = 4;
        let (rows, cols) = (self.rows, self.cols);
        let chunk = self.chunk_rows(cols * n / 4);
        let yp = SyncPtr(y.as_mut_ptr());
        crate::team::par_for(rows.div_ceil(chunk), |ci| {
            let rows_here = ci * chunk..((ci + 1) * chunk).min(rows);
            for t0 in (0..n).step_by(TOKEN_TILE) {
                let t1 = (t0 + TOKEN_TILE).min(n);
                for r in rows_here.clone() {
                    let row = self.row(r);
                    let mut t = t0;
                    while t < t1 {
                        let take = (t1 - t).min(GROUP);
                        let mut out = [0.0f32; GROUP];
                        scalar::q8_row::<D>(self.ty, &row, qa, cols, t, &mut out[..take]);
                        for (k, o) in out.iter().enumerate().take(take) {
                            // SAFETY: (t + k, r) is inside y and row r belongs to this task only.
                            unsafe { *yp.get().add((t + k) * rows + r) = *o };
                        }
                        t += take;
                    }
                }
            }
        });
    }

    /// [`PackedMatrix::matmul`] with an explicit instruction set (falls back to
    /// [`Isa::Scalar`] if `isa` is not available on this CPU).
    ///
    /// # Errors
    /// As [`PackedMatrix::matmul`].
    pub fn matmul_with(&self, x: &[f32], n: usize, y: &mut [f32], isa: Isa) -> Result<()> {
        if x.len() != n * self.cols {
            return Err(Error::Length { what: "x", expected: n * self.cols, actual: x.len() });
        }
        if y.len() != n * self.rows {
            return Err(Error::Length { what: "y", expected: n * self.rows, actual: y.len() });
        }
        let isa = if isa.is_available() { isa } else { Isa::Scalar };
        if n == 0 || self.rows == 0 {
            return Ok(());
        }
        if self.cols == 0 {
            y.fill(0.0);
            return Ok(());
        }
        // The f32-activation kernels read GGUF rows (see `interleave8`).
        self.gguf().matmul_fused(x, n, y, isa);
        Ok(())
    }

    /// `y[n, rows] = x[n, cols] · Wᵀ` by dequantizing tiles of `GEMM_TILE_ROWS` rows to f32
    /// and multiplying them with the `gemm` crate's f32 kernels.
    ///
    /// Faster than [`PackedMatrix::matmul`] for long prompts on some CPUs, but its results
    /// depend on the summation order of `gemm`, so they differ (by f32 rounding) from the
    /// one-token results; [`PackedMatrix::matmul`] is batch-invariant and is what the model uses.
    ///
    /// # Errors
    /// As [`PackedMatrix::matmul`].
    pub fn matmul_dequant_gemm(&self, x: &[f32], n: usize, y: &mut [f32]) -> Result<()> {
        if x.len() != n * self.cols {
            return Err(Error::Length { what: "x", expected: n * self.cols, actual: x.len() });
        }
        if y.len() != n * self.rows {
            return Err(Error::Length { what: "y", expected: n * self.rows, actual: y.len() });
        }
        if n == 0 || self.rows == 0 {
            return Ok(());
        }
        if self.cols == 0 {
            y.fill(0.0);
            return Ok(());
        }
        self.gguf().matmul_gemm(x, n, y, Isa::detect());
        Ok(())
    }

    /// Row chunk per rayon task: enough tasks to balance the pool, but each at least a few
    /// tens of microseconds of work.
    ///
    /// Up to 4 tasks per thread, each of at least `16384 / per_row_cost` rows, or 8 per thread
    /// when each of those still costs `2^18` (a large matrix: the team's threads claim tasks as
    /// they finish, so smaller last tasks shorten the wait for the slowest thread). On the AVX2
    /// AMD EPYC (Zen 3) of 2026-12-07, Qwen2.5-1.5B Q4_K_M with 8-bit activations (`gate_up`
    /// and the LM head above the bar in decode, every matrix in prefill): 8 per thread on every
    /// matrix was faster in 9 of 12 alternated decode runs (medians 16.8 → 18.1 tok/s) but
    /// mixed on SmolLM2-135M's small matrices; with the bar, 4 alternated pairs each: Qwen decode
    /// 3 of 4 faster (medians 15.6 → 16.5 tok/s), prefill 4 of 4 (+3-23 %), SmolLM2 Q4_1 decode
    /// and prefill 3 of 4.
    /// When fewer fit, a multiple of the thread count where possible, so that the threads get
    /// equal shares (a 960-row matrix cut into 456 + 456 + 48 rows kept one of two threads idle
    /// for half the call).
    fn chunk_rows(&self, per_row_cost: usize) -> usize {
        let threads = rayon::current_num_threads().max(1);
        let min_rows = (16_384 / per_row_cost.max(1)).max(1);
        let fit = (self.rows / min_rows).max(1);
        let work = self.rows.saturating_mul(per_row_cost.max(1));
        let tasks = if work / (8 * threads) >= 1 << 18 && fit >= 8 * threads {
            8 * threads
        } else if fit >= 4 * threads {
            4 * threads
        } else if fit >= threads {
            fit / threads * threads
        } else {
            fit
        };
        self.rows.div_ceil(tasks).max(1)
    }

    fn matmul_fused(&self, x: &[f32], n: usize, y: &mut [f32], isa: Isa) {
        let cols = self.cols;
        #[cfg(target_arch = "x86_64")]
        let nb = cols / BLOCK;
        // Per-block sums of x (the `m · Σx` term of Q4_1 and of Q4_K's sub-blocks in the AVX2
        // kernels; the AVX-512 kernel folds `m` into the dequantized weights instead, and the
        // portable path dequantizes whole rows).
        #[cfg(target_arch = "x86_64")]
        let xsum: Vec<f32> = if (self.ty == BlockType::Q4_1 || self.ty == BlockType::Q4_K) && isa == Isa::Avx2 {
            x.chunks_exact(BLOCK).map(|c| c.iter().sum()).collect()
        } else {
            Vec::new()
        };
        let rows = self.rows;
        let chunk = self.chunk_rows(cols * n);
        let yp = SyncPtr(y.as_mut_ptr());
        let ty = self.ty;
        // Tokens per pass over a row chunk: their activations stay in L2 while the chunk's rows
        // go by.
        const TOKEN_TILE: usize = 64;
        #[cfg(target_arch = "x86_64")]
        if isa == Isa::Avx512 {
            self.matmul_tiled_512(x, n, y);
            return;
        }
        let group = 4;
        // The portable path (no AVX2: other architectures, `DECO_KERNELS=scalar`): each row
        // dequantized once per token tile, then a vectorizable dot product per token.
        let portable = isa == Isa::Scalar;
        crate::team::par_for(rows.div_ceil(chunk), |ci| {
            let rows_here = ci * chunk..((ci + 1) * chunk).min(rows);
            let mut wrow = if portable { vec![0.0f32; cols] } else { Vec::new() };
            for t0 in (0..n).step_by(TOKEN_TILE) {
                let t1 = (t0 + TOKEN_TILE).min(n);
                for r in rows_here.clone() {
                    let row = self.row(r);
                    let row = &*row;
                    if portable {
                        scalar::dequant_row(ty, row, &mut wrow);
                    }
                    let mut t = t0;
                    while t < t1 {
                        let take = (t1 - t).min(group);
                        let mut out = [0.0f32; 4];
                        match isa {
                            #[cfg(target_arch = "x86_64")]
                            Isa::Avx2 => {
                                let xp = x[t * cols..].as_ptr();
                                let xs = if xsum.is_empty() { std::ptr::null() } else { xsum[t * nb..].as_ptr() };
                                // SAFETY: AVX2/FMA/F16C were detected (`isa` is available); `row`
                                // holds `nb` blocks; tokens t .. t + take exist in x and xsum.
                                unsafe {
                                    match take {
                                        4 => out = x86::dot_multi::<4>(ty, row, nb, xp, cols, xs),
                                        3 => out[..3].copy_from_slice(&x86::dot_multi::<3>(ty, row, nb, xp, cols, xs)),
                                        2 => out[..2].copy_from_slice(&x86::dot_multi::<2>(ty, row, nb, xp, cols, xs)),
                                        _ => out[0] = x86::dot_multi::<1>(ty, row, nb, xp, cols, xs)[0],
                                    }
                                }
                            }
                            _ => {
                                for (k, o) in out.iter_mut().enumerate().take(take) {
                                    let tt = t + k;
                                    *o = scalar::dot_f32(&wrow, &x[tt * cols..(tt + 1) * cols]);
                                }
                            }
                        }
                        for (k, o) in out.iter().enumerate().take(take) {
                            // SAFETY: (t + k, r) is inside y and row r belongs to this task only.
                            unsafe { *yp.get().add((t + k) * rows + r) = *o };
                        }
                        t += take;
                    }
                }
            }
        });
    }

    /// The AVX-512 path of [`PackedMatrix::matmul`]: f32 activations, `x86_512::tile`.
    #[cfg(target_arch = "x86_64")]
    fn matmul_tiled_512(&self, x: &[f32], n: usize, y: &mut [f32]) {
        let (cols, ty) = (self.cols, self.ty);
        let nb = cols / BLOCK;
        self.tiled::<TILE_R, TILE_T, _>(n, cols * n, y, |t, wp, rk, tk| {
            let xp = x[t * cols..].as_ptr();
            // SAFETY: AVX-512 F/BW/VL, AVX2, FMA and F16C were detected (the caller checked
            // `Isa::Avx512.is_available()`); `tiled` passes rows that exist (each `row_bytes` of
            // `nb` 32-weight (sub-)blocks) and tokens t .. t + tk that exist in x.
            let rows_major: [[f32; TILE_T]; TILE_R] = unsafe {
                match (rk, tk) {
                    (TILE_R, TILE_T) => x86_512::tile::<TILE_R, TILE_T>(ty, wp, self.row_bytes(), nb, xp, cols),
                    (TILE_R, 3) => widen(x86_512::tile::<TILE_R, 3>(ty, wp, self.row_bytes(), nb, xp, cols)),
                    (TILE_R, 2) => widen(x86_512::tile::<TILE_R, 2>(ty, wp, self.row_bytes(), nb, xp, cols)),
                    (TILE_R, _) => widen(x86_512::tile::<TILE_R, 1>(ty, wp, self.row_bytes(), nb, xp, cols)),
                    (_, TILE_T) => widen(x86_512::tile::<1, TILE_T>(ty, wp, self.row_bytes(), nb, xp, cols)),
                    (_, 3) => widen(x86_512::tile::<1, 3>(ty, wp, self.row_bytes(), nb, xp, cols)),
                    (_, 2) => widen(x86_512::tile::<1, 2>(ty, wp, self.row_bytes(), nb, xp, cols)),
                    _ => widen(x86_512::tile::<1, 1>(ty, wp, self.row_bytes(), nb, xp, cols)),
                }
            };
            std::array::from_fn(|k| std::array::from_fn(|r| rows_major[r][k]))
        });
    }

    /// The integer paths of [`PackedMatrix::matmul_q8_with`], 8 rows at a time (one row per
    /// vector lane, codes transposed in registers): Q4_0, Q4_1, Q5_0 and Q8_0 through
    /// `x86_512::q8_rows8` (`vnni`) or `x86::q8_rows8`, Q4_K and Q6_K through
    /// `x86_512::q8_rows8_k` or `x86::q8_rows8_k`.
    #[cfg(target_arch = "x86_64")]
    fn matmul_tiled_q8(&self, qa: &QuantizedActivations, n: usize, y: &mut [f32], vnni: bool) {
        let (cols, ty) = (self.cols, self.ty);
        let nb = cols / BLOCK;
        let rb = self.row_bytes();
        let kquant = matches!(ty, BlockType::Q4_K | BlockType::Q6_K);
        // Integer products over 8 rows at once are ~4× cheaper than the f32 tile.
        let cost = cols * n / 4;
        // Row group `wp` (`rk` rows: 8, or 1 computed in all lanes with row stride 0, so that
        // its result has the same bits as inside a group of 8) with `T` tokens from `t`.
        macro_rules! call {
            ($t:expr, $tok:expr, $wp:expr, $rk:expr) => {{
                let t = $tok;
                let (xq, xd, xs, xi, xl) = (
                    qa.codes[t * cols..].as_ptr(),
                    qa.scales[t * nb..].as_ptr(),
                    qa.sums[t * nb..].as_ptr(),
                    qa.isums[t * nb..].as_ptr(),
                    qa.isums_lo[t * nb..].as_ptr(),
                );
                let stride_rows = if $rk == 8 { rb } else { 0 };
                // A whole group of 8 rows of an interleaved matrix (the leftover rows are GGUF rows).
                let il = self.interleaved && $rk == 8;
                match (vnni, kquant) {
                    (true, false) => x86_512::q8_rows8::<{ $t }>(ty, $wp, stride_rows, nb, xq, xd, xs, xi, cols),
                    (true, true) => x86_512::q8_rows8_k::<{ $t }>(ty, $wp, stride_rows, il, nb, xq, xd, xs, xi, xl, cols),
                    (false, false) => x86::q8_rows8::<{ $t }>(ty, $wp, stride_rows, nb, xq, xd, xs, xi, cols),
                    (false, true) => x86::q8_rows8_k::<{ $t }>(ty, $wp, stride_rows, il, nb, xq, xd, xs, xi, xl, cols),
                }
            }};
        }
        if n >= if vnni { REPACK_MIN_TOKENS_VNNI } else { REPACK_MIN_TOKENS_AVX2 } {
            self.matmul_repacked_q8(qa, n, y, vnni);
            return;
        }
        // SAFETY (both closures): AVX2, FMA and F16C, and with `vnni` AVX-512 F/BW/VL/VNNI, were
        // detected (`matmul_q8_with` checked `q8_isa()`); `tiled` passes `rk` rows that exist
        // (`nb` blocks, or `nb / 8` super-blocks, each, `rb` apart) and tokens t .. t + tk that
        // exist in `qa`. Per (row, token) the kernels' float operations do not depend on `T`,
        // so splitting a tile's tokens does not change any result.
        if vnni {
            self.tiled::<8, TILE_T_VNNI, _>(n, cost, y, |t, wp, rk, tk| unsafe {
                match tk {
                    TILE_T_VNNI => call!(TILE_T_VNNI, t, wp, rk),
                    4 => widen(call!(4, t, wp, rk)),
                    3 => widen(call!(3, t, wp, rk)),
                    2 => widen(call!(2, t, wp, rk)),
                    1 => widen(call!(1, t, wp, rk)),
                    _ => {
                        // 5-7 leftover tokens: 4, then the rest (token-major results).
                        let mut out: [[f32; 8]; TILE_T_VNNI] = widen(call!(4, t, wp, rk));
                        let rest: [[f32; 8]; TILE_T] = match tk - 4 {
                            3 => widen(call!(3, t + 4, wp, rk)),
                            2 => widen(call!(2, t + 4, wp, rk)),
                            _ => widen(call!(1, t + 4, wp, rk)),
                        };
                        out[4..tk].copy_from_slice(&rest[..tk - 4]);
                        out
                    }
                }
            });
        } else {
            self.tiled::<8, TILE_T, _>(n, cost, y, |t, wp, rk, tk| unsafe {
                match tk {
                    TILE_T => call!(TILE_T, t, wp, rk),
                    3 => widen(call!(3, t, wp, rk)),
                    2 => widen(call!(2, t, wp, rk)),
                    _ => widen(call!(1, t, wp, rk)),
                }
            });
        }
    }

    /// The path of [`PackedMatrix::matmul_tiled_q8`] from `REPACK_MIN_TOKENS_AVX2` (AVX2) or
    /// `REPACK_MIN_TOKENS_VNNI` tokens on (prefill). Row chunks go to the team as in
    /// [`PackedMatrix::tiled`]; inside a chunk, each group of 8 rows (a leftover row alone, in
    /// all 8 lanes) is repacked once into a per-task buffer (`krepack::repack8` for Q4_K / Q6_K
    /// super-blocks, `krepack::repack8_32` for 32-weight blocks: codes transposed and unpacked
    /// to bytes, scales decoded); then, for each
    /// span of [`REPACK_SPAN_BLOCKS`] blocks (~20 KiB repacked, held in L1), every group of
    /// tokens passes over it, its running sums kept in `y` between spans (loaded and stored in
    /// the same order, so the float operations and the bits are those of one pass, and those of
    /// the per-token-group kernels that fewer tokens use).
    #[cfg(target_arch = "x86_64")]
    fn matmul_repacked_q8(&self, qa: &QuantizedActivations, n: usize, y: &mut [f32], vnni: bool) {
        /// 64-byte aligned storage, so that no 32-byte load of the buffer splits a cache line.
        #[derive(Clone, Copy)]
        #[repr(align(64))]
        struct Line(#[allow(dead_code)] [u8; 64]);
        let (cols, rows, ty) = (self.cols, self.rows, self.ty);
        let nb = cols / BLOCK;
        let rb = self.row_bytes();
        let bb = ty.block_bytes();
        // Repacking units: a super-block of 8 slots (k-quants) or one 32-weight block.
        let kquant = matches!(ty, BlockType::Q4_K | BlockType::Q6_K);
        let (unit_blocks, unit_bytes) = if kquant { (8, krepack::GROUP_SB_BYTES) } else { (1, krepack::SLOT_BYTES) };
        let units = nb / unit_blocks;
        let group_bytes = units * unit_bytes;
        let chunk = self.chunk_rows(cols * n / 4).next_multiple_of(8);
        let yp = SyncPtr(y.as_mut_ptr());
        // Units k0 .. k0 + ks of the group at `pk` (rows r .. r + rk) with `$t` tokens from
        // `t`, accumulated into y.
        macro_rules! call {
            ($kernel:ident, $t:expr, $tok:expr, $pk:expr, $k0:expr, $ks:expr, $r:expr, $rk:expr) => {{
                let (t, k0) = ($tok, $k0);
                let (b0, i0) = (t * cols + k0 * unit_blocks * BLOCK, t * nb + k0 * unit_blocks);
                let span = krepack::Span {
                    pk: $pk.wrapping_add(k0 * unit_bytes),
                    units: $ks,
                    nb,
                    xq: qa.codes[b0..].as_ptr(),
                    xd: qa.scales[i0..].as_ptr(),
                    xs: qa.sums[i0..].as_ptr(),
                    xi: qa.isums[i0..].as_ptr(),
                    xl: qa.isums_lo[i0..].as_ptr(),
                    stride: cols,
                    y: yp.get().wrapping_add(t * rows + $r),
                    ys: rows,
                    rk: $rk,
                    first: k0 == 0,
                };
                // SAFETY: the ISA was detected (`q8_isa()`, the VNNI kernel only with VNNI);
                // `$pk` holds the group's units k0 .. k0 + ks repacked from `ty`; tokens
                // t .. t + $t exist in `qa` and in y, whose rows r .. r + rk belong to this task
                // only.
                unsafe { krepack::$kernel::<{ $t }>(ty, &span) }
            }};
        }
        // All tokens over one span of a group, `$tmax` at a time, then the leftover tokens as
        // 4 + 2 + 1 (per (row, token) the kernels do the same operations whatever `T` is).
        macro_rules! tokens {
            ($kernel:ident, $tmax:expr, $pk:expr, $k0:expr, $ks:expr, $r:expr, $rk:expr) => {{
                let mut t = 0;
                while t < n {
                    let tk = n - t;
                    let take = if tk >= $tmax { $tmax } else if tk >= 4 { 4 } else if tk >= 2 { 2 } else { 1 };
                    if take == $tmax {
                        call!($kernel, $tmax, t, $pk, $k0, $ks, $r, $rk)
                    } else if take == 4 {
                        call!($kernel, 4, t, $pk, $k0, $ks, $r, $rk)
                    } else if take == 2 {
                        call!($kernel, 2, t, $pk, $k0, $ks, $r, $rk)
                    } else {
                        call!($kernel, 1, t, $pk, $k0, $ks, $r, $rk)
                    }
                    t += take;
                }
            }};
        }
        crate::team::par_for(rows.div_ceil(chunk), |ci| {
            let end = ((ci + 1) * chunk).min(rows);
            let mut buf = vec![Line([0; 64]); group_bytes.div_ceil(64)];
            let pk = buf.as_mut_ptr() as *mut u8;
            let mut r = ci * chunk;
            while r < end {
                // A group of 8 rows, or a leftover row in all lanes (row stride 0).
                let (rk, stride) = if end - r >= 8 { (8, rb) } else { (1, 0) };
                // Unit u of the group: 8 rows' super-blocks interleaved, or row r's u-th block.
                let il = self.interleaved && rk == 8;
                for u in 0..units {
                    let at = r * rb + if il { u * 8 * bb } else { u * bb };
                    let (src, dst) = (self.data[at..].as_ptr(), pk.wrapping_add(u * unit_bytes));
                    // SAFETY: AVX2/FMA/F16C were detected (`q8_isa()`); rows r .. r + rk hold
                    // unit u (a super-block, or a block); the slot range is inside `buf`.
                    unsafe {
                        if kquant {
                            krepack::repack8(ty, src, stride, il, dst);
                        } else {
                            krepack::repack8_32(ty, src, stride, dst);
                        }
                    }
                }
                let pk = pk as *const u8;
                let span = REPACK_SPAN_BLOCKS / unit_blocks;
                for k0 in (0..units).step_by(span) {
                    let ks = span.min(units - k0);
                    if !vnni {
                        tokens!(q8_repacked_avx2, REPACK_T_AVX2, pk, k0, ks, r, rk);
                    } else if ty == BlockType::Q6_K {
                        tokens!(q8_repacked_vnni, REPACK_T_VNNI_Q6K, pk, k0, ks, r, rk);
                    } else {
                        tokens!(q8_repacked_vnni, REPACK_T_VNNI, pk, k0, ks, r, rk);
                    }
                }
                r += rk;
            }
        });
    }

    /// The loop structure shared by the AVX-512 kernels: rayon over row chunks (sized from
    /// `cost` as [`PackedMatrix::chunk_rows`]); inside a chunk, sub-chunks of ~32 KiB of packed
    /// rows stay in L1/L2 while every group of `T` tokens passes over them in register tiles
    /// of `R` rows (leftover rows one at a time, and leftover tokens in narrower tiles, with the
    /// same per-element arithmetic). `tile(t, rows_ptr, rk, tk)` returns the dot products of
    /// rows starting at `rows_ptr` with tokens `t ..` (`rk` is `R` or 1), token-major
    /// (`out[k][i]`: token `t + k`, row `i`), so that each token's `rk` results go to
    /// `y[n, rows]` as one contiguous run.
    #[cfg(target_arch = "x86_64")]
    fn tiled<const R: usize, const T: usize, F>(&self, n: usize, cost: usize, y: &mut [f32], tile: F)
    where
        F: Fn(usize, *const u8, usize, usize) -> [[f32; R]; T] + Sync,
    {
        let rows = self.rows;
        let row_bytes = self.row_bytes();
        let chunk = self.chunk_rows(cost).next_multiple_of(R);
        let sub = (TILED_SUB_BYTES / row_bytes.max(1)).max(R).next_multiple_of(R);
        let yp = SyncPtr(y.as_mut_ptr());
        crate::team::par_for(rows.div_ceil(chunk), |ci| {
            let end = ((ci + 1) * chunk).min(rows);
            let mut s0 = ci * chunk;
            while s0 < end {
                let s1 = (s0 + sub).min(end);
                let mut t = 0;
                while t < n {
                    // Leftover tokens (2 or 3: a speculative or tree verification) share one
                    // tile too, so that each row is unpacked once for them.
                    let tk = (n - t).min(T);
                    let mut r = s0;
                    while r < s1 {
                        let rk = if s1 - r >= R { R } else { 1 };
                        let out = tile(t, self.data[r * row_bytes..].as_ptr(), rk, tk);
                        for (k, o) in out.iter().enumerate().take(tk) {
                            // SAFETY: (t + k, r .. r + rk) is inside y and rows s0 .. s1 belong
                            // to this task only.
                            unsafe {
                                let dst = yp.get().add((t + k) * rows + r);
                                // A full tile copies `R` values, a compile-time length (vector
                                // moves, not a `memcpy` call).
                                if rk == R {
                                    std::ptr::copy_nonoverlapping(o.as_ptr(), dst, R);
                                } else {
                                    *dst = o[0];
                                }
                            }
                        }
                        r += rk;
                    }
                    t += tk;
                }
                s0 = s1;
            }
        });
    }

    fn matmul_gemm(&self, x: &[f32], n: usize, y: &mut [f32], isa: Isa) {
        let cols = self.cols;
        let rows = self.rows;
        let tile = GEMM_TILE_ROWS;
        let yp = SyncPtr(y.as_mut_ptr());
        (0..rows.div_ceil(tile)).into_par_iter().for_each_init(
            || vec![0.0f32; tile * cols],
            |buf, ti| {
                    let r0 = ti * tile;
                let tr = tile.min(rows - r0);
                for i in 0..tr {
                    let o = &mut buf[i * cols..(i + 1) * cols];
                    match isa {
                        #[cfg(target_arch = "x86_64")]
                        // SAFETY: AVX2/FMA/F16C checked; row and o have matching sizes.
                        Isa::Avx2 | Isa::Avx512 => unsafe { x86::dequant_row(self.ty, &self.row(r0 + i), o) },
                        _ => scalar::dequant_row(self.ty, &self.row(r0 + i), o),
                    }
                }
                // dst[n, tr] (row stride `rows`) = x[n, cols] · buf[tr, cols]ᵀ.
                // SAFETY: pointers and strides describe in-bounds views of x, buf and y; this
                // task writes only columns r0 .. r0 + tr of y.
                unsafe {
                    gemm::gemm(
                        n,
                        tr,
                        cols,
                        yp.get().add(r0),
                        1,
                        rows as isize,
                        false,
                        x.as_ptr(),
                        1,
                        cols as isize,
                        buf.as_ptr(),
                        cols as isize,
                        1,
                        0.0f32,
                        1.0f32,
                        false,
                        false,
                        false,
                        gemm::Parallelism::None,
                    );
                }
            },
        );
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// The AVX2 activation quantizer gives the scalar one's codes, scales and sums, bit for
    /// bit: random blocks of several magnitudes, an all-zero block, exact ties (`x · (1/d)` at
    /// `k + 0.5`), a block with a NaN and one with an infinity, and negative zeros.
    #[test]
    fn avx2_quantizer_equals_scalar() {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            return;
        }
        let mut x = Vec::new();
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        for blk in 0..200 {
            let mag = [1e-6f32, 0.01, 1.0, 37.0, 1e4][blk % 5];
            for _ in 0..BLOCK {
                state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                x.push(((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * mag);
            }
        }
        x.extend([0.0f32; BLOCK]);
        // amax 127 (d = 1): every x·(1/d) below is a tie or an integer.
        x.extend((0..BLOCK).map(|i| if i == 0 { 127.0 } else { i as f32 - 16.5 }));
        x.extend((0..BLOCK).map(|i| if i == 3 { f32::NAN } else { i as f32 }));
        x.extend((0..BLOCK).map(|i| if i == 31 { f32::NEG_INFINITY } else { 1.0 }));
        x.extend((0..BLOCK).map(|i| if i % 2 == 0 { -0.0 } else { 1e-3 }));
        let nb = x.len() / BLOCK;
        let run = |avx2: bool| {
            let (mut c, mut sc, mut su, mut is, mut il) = (vec![0i8; x.len()], vec![0.0f32; nb], vec![0.0f32; nb], vec![0i32; nb], vec![0i32; nb]);
            if avx2 {
                // SAFETY: AVX2 and FMA were detected above.
                unsafe { quantize_blocks_avx2(&x, &mut c, &mut sc, &mut su, &mut is, &mut il) };
            } else {
                quantize_blocks(&x, &mut c, &mut sc, &mut su, &mut is, &mut il);
            }
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            (c, bits(&sc), bits(&su), is, il)
        };
        let (a, s) = (run(true), run(false));
        for b in 0..nb {
            let r = b * BLOCK..(b + 1) * BLOCK;
            if s.1[b] != f32::NAN.to_bits() {
                assert_eq!(a.0[r.clone()], s.0[r], "block {b} codes");
                assert_eq!((a.3[b], a.4[b]), (s.3[b], s.4[b]), "block {b} integer sums");
            }
            assert_eq!((a.1[b], a.2[b]), (s.1[b], s.2[b]), "block {b} scale and sum");
        }
        assert!(f32::from_bits(a.1[nb - 3]).is_nan() && f32::from_bits(a.1[nb - 2]).is_nan());
    }
}
