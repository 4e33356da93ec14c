//! NEON integer block sums for the portable 8-bit-activation kernel ([`super::scalar::q8_row`])
//! on aarch64, where NEON is part of the base instruction set.
//!
//! Two variants, chosen at run time per call ([`super::PackedMatrix::matmul_q8_with`]):
//! - [`NeonDot`] (CPUs with the `dotprod` extension, Armv8.2-A and later: Graviton 2+, Apple
//!   M1+, Cortex-A76+): `sdot`, four 4-byte dot products into i32 lanes per instruction, as
//!   ggml's `vdotq_s32` path of `ggml_vec_dot_q4_0_q8_0`. Written as inline assembly because
//!   Rust's `vdotq_s32` intrinsic is not stable (`stdarch_neon_dotprod`).
//! - [`Neon`] (any aarch64 CPU): `smull` + `smlal2` into i16 lanes, then `sadalp` / `saddlp`
//!   into i32, ggml's fallback `ggml_vdotq_s32` for CPUs without `dotprod`. Two products
//!   share an i16 lane: `2 · 128 · 127 = 32,512 < 2^15`, so nothing overflows for any code.
//!
//! Both compute the exact integer sums, the values of [`super::scalar::PortableDot`].

use std::arch::aarch64::*;

use super::scalar::BlockDot;

/// [`BlockDot`] with `smull` / `smlal2` / `sadalp` (any aarch64 CPU).
pub(super) struct Neon;

/// [`BlockDot`] with `sdot` (needs the `dotprod` extension:
/// `is_aarch64_feature_detected!("dotprod")`).
pub(super) struct NeonDot;

/// The 8 i16 sums of two products each of one 16-byte half.
#[inline(always)]
fn mul16(w: int8x16_t, x: int8x16_t) -> int16x8_t {
    // SAFETY: NEON is part of aarch64's base instruction set; register-only operations.
    unsafe { vmlal_high_s8(vmull_s8(vget_low_s8(w), vget_low_s8(x)), w, x) }
}

/// Both 16-byte halves of a block, loaded.
#[inline(always)]
fn load(w: &[i8; 32], x: &[i8; 32]) -> [int8x16_t; 4] {
    // SAFETY: NEON is baseline; each load reads 16 of the 32 bytes of an array.
    unsafe { [vld1q_s8(w.as_ptr()), vld1q_s8(w.as_ptr().add(16)), vld1q_s8(x.as_ptr()), vld1q_s8(x.as_ptr().add(16))] }
}

impl BlockDot for Neon {
    #[inline(always)]
    fn halves(w: &[i8; 32], x: &[i8; 32]) -> (i32, i32) {
        let [w0, w1, x0, x1] = load(w, x);
        // SAFETY: NEON is baseline; register-only operations.
        unsafe { (vaddlvq_s16(mul16(w0, x0)), vaddlvq_s16(mul16(w1, x1))) }
    }

    #[inline(always)]
    fn sum(w: &[i8; 32], x: &[i8; 32]) -> i32 {
        let [w0, w1, x0, x1] = load(w, x);
        // SAFETY: NEON is baseline; register-only operations.
        unsafe { vaddvq_s32(vpadalq_s16(vpaddlq_s16(mul16(w0, x0)), mul16(w1, x1))) }
    }
}

/// `acc + sdot(w, x)`: lane `j` adds `Σ_{i<4} w_{4j+i} x_{4j+i}`.
///
/// # Safety
/// The CPU must have the `dotprod` extension.
#[inline(always)]
unsafe fn sdot(acc: int32x4_t, w: int8x16_t, x: int8x16_t) -> int32x4_t {
    let mut acc = acc;
    // SAFETY: the caller guarantees `dotprod`; register-only instruction.
    unsafe {
        std::arch::asm!(
            ".arch_extension dotprod",
            "sdot {acc:v}.4s, {w:v}.16b, {x:v}.16b",
            acc = inout(vreg) acc,
            w = in(vreg) w,
            x = in(vreg) x,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    acc
}

impl BlockDot for NeonDot {
    #[inline(always)]
    fn halves(w: &[i8; 32], x: &[i8; 32]) -> (i32, i32) {
        let [w0, w1, x0, x1] = load(w, x);
        // SAFETY: `NeonDot` is only chosen after `dotprod` was detected (module docs).
        unsafe {
            let z = vdupq_n_s32(0);
            (vaddvq_s32(sdot(z, w0, x0)), vaddvq_s32(sdot(z, w1, x1)))
        }
    }

    #[inline(always)]
    fn sum(w: &[i8; 32], x: &[i8; 32]) -> i32 {
        let [w0, w1, x0, x1] = load(w, x);
        // SAFETY: as in `halves`.
        unsafe { vaddvq_s32(sdot(sdot(vdupq_n_s32(0), w0, x0), w1, x1)) }
    }
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::super::scalar::PortableDot;
    use super::*;

    /// Both NEON variants give the portable sums for random codes, and for the extremes
    /// (−128 weights, which Q8_0 blocks may hold, against ±127 activations).
    #[test]
    fn neon_sums_equal_portable_sums() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let mut cases: Vec<([i8; 32], [i8; 32])> = (0..500)
            .map(|_| {
                let mut w = [0i8; 32];
                let mut x = [0i8; 32];
                rng.fill(&mut w[..]);
                rng.fill(&mut x[..]);
                (w, x.map(|v| v.max(-127)))
            })
            .collect();
        cases.push(([-128; 32], [127; 32]));
        cases.push(([-128; 32], [-127; 32]));
        cases.push(([63; 32], [-127; 32]));
        let dotprod = std::arch::is_aarch64_feature_detected!("dotprod");
        for (w, x) in &cases {
            let want = PortableDot::halves(w, x);
            assert_eq!(Neon::halves(w, x), want);
            assert_eq!(Neon::sum(w, x), want.0 + want.1);
            if dotprod {
                assert_eq!(NeonDot::halves(w, x), want);
                assert_eq!(NeonDot::sum(w, x), want.0 + want.1);
            }
        }
    }
}
