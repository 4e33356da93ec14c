//! The host f32 matmul (`deco_kernels::dense::matmul`) against an f64 reference, both paths
//! (streaming at few tokens, `gemm` beyond), and the batch invariance of the streaming path;
//! the lower-block Gram matrix (`dense::gram`) against the same reference (and its thread
//! invariance); the bf16 products (`deco_kernels::bf16`) against the f64 reference of their
//! bf16-rounded inputs, their batch and thread invariance and the rounding itself. On CPUs
//! without AVX-512 BF16 the bf16 products must refuse with `Error::Unsupported` (checked there
//! instead).

use deco_kernels::bf16::{self, PackedBf16, from_bf16_bits, to_bf16_bits};
use deco_kernels::dense::{SMALL_N, gram, gram_with, matmul, matmul_with};
use deco_kernels::quant::Isa;
use deco_kernels::error::Error;
use proptest::prelude::*;

mod common;
use common::values;

/// The input as the f32 products see it.
fn exact(x: f32) -> f64 {
    x as f64
}

/// The input as the bf16 products see it.
fn round(x: f32) -> f64 {
    from_bf16_bits(to_bf16_bits(x)) as f64
}

/// `(Σ_i f(x[t, i])·f(w[i, j]), Σ_i |…|)` in f64: output `(t, j)` of `x[n, inner] · w[inner, out]`
/// with each factor through `f`, and the magnitude its f32 accumulation error scales with.
fn matmul_ref(x: &[f32], w: &[f32], inner: usize, out: usize, t: usize, j: usize, f: fn(f32) -> f64) -> (f64, f64) {
    (0..inner).map(|i| f(x[t * inner + i]) * f(w[i * out + j])).fold((0.0, 0.0), |(s, m), p| (s + p, m + p.abs()))
}

/// [`matmul_ref`] for element `(i, j)` of the Gram matrix `xᵀx` of `x[n, cols]`.
fn gram_ref(x: &[f32], n: usize, cols: usize, i: usize, j: usize, f: fn(f32) -> f64) -> (f64, f64) {
    (0..n).map(|t| f(x[t * cols + i]) * f(x[t * cols + j])).fold((0.0, 0.0), |(s, m), p| (s + p, m + p.abs()))
}

/// Whether `got` is the reference `(want, mag)` up to f32 accumulation: `1e-5 · mag + 1e-6`.
fn close(got: f32, (want, mag): (f64, f64)) -> bool {
    (got as f64 - want).abs() <= 1e-5 * mag + 1e-6
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn matches_f64_reference(n in 1usize..=9, inner in 1usize..=200, out in 1usize..=700, seed in any::<u64>()) {
        let x = values(seed, n * inner);
        let w = values(seed ^ 0x5555, inner * out);
        let mut y = vec![f32::NAN; n * out];
        matmul(&x, n, &w, inner, out, &mut y).expect("matmul");
        for t in 0..n {
            for j in 0..out {
                let (got, want) = (y[t * out + j], matmul_ref(&x, &w, inner, out, t, j, exact));
                prop_assert!(close(got, want), "n={n} inner={inner} out={out} ({t},{j}): {got} vs {want:?}");
            }
        }
        // At few tokens a token's result does not depend on the others of the call.
        if n <= SMALL_N {
            let t = n - 1;
            let mut y1 = vec![f32::NAN; out];
            matmul(&x[t * inner..(t + 1) * inner], 1, &w, inner, out, &mut y1).expect("matmul");
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&y1), bits(&y[t * out..(t + 1) * out]));
        }
    }
}

#[test]
fn wrong_lengths_are_errors() {
    let mut y = vec![0.0f32; 6];
    assert!(matches!(matmul(&[0.0; 5], 2, &[0.0; 9], 3, 3, &mut y), Err(Error::Length { .. })));
    assert!(matches!(matmul(&[0.0; 6], 2, &[0.0; 8], 3, 3, &mut y), Err(Error::Length { .. })));
    assert!(matches!(matmul(&[0.0; 6], 2, &[0.0; 9], 3, 3, &mut y[..5]), Err(Error::Length { .. })));
    assert!(matmul(&[], 0, &[0.0; 9], 3, 3, &mut []).is_ok());
    // An inner size of 0 is an empty sum on every path (it divided by zero on the streaming
    // path, and the AVX-512 path wrote nothing).
    for n in [1, SMALL_N + 1, 40] {
        let mut y = vec![f32::NAN; n * 5];
        matmul(&[], n, &[], 0, 5, &mut y).expect("inner 0");
        assert!(y.iter().all(|&v| v == 0.0), "n={n}: {y:?}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// `xᵀx` from the lower blocks equals the f64 product within f32 accumulation error, is
    /// exactly symmetric, and covers sizes across the 128- and 192-column blocks, on every
    /// instruction set this CPU has (the `gemm` crate, the AVX2 and the AVX-512 tiles).
    #[test]
    fn gram_matches_f64_reference(n in 1usize..=300, cols in 1usize..=300, seed in any::<u64>()) {
        let x = values(seed, n * cols);
        for isa in [Isa::Scalar, Isa::Avx2, Isa::Avx512].into_iter().filter(|i| i.is_available()) {
            let g = gram_with(&x, n, cols, isa).expect("gram");
            for i in 0..cols {
                for j in 0..cols {
                    let (got, want) = (g[i * cols + j], gram_ref(&x, n, cols, i, j, exact));
                    prop_assert!(close(got, want), "{isa:?} n={n} cols={cols} ({i},{j}): {got} vs {want:?}");
                    prop_assert_eq!(g[i * cols + j].to_bits(), g[j * cols + i].to_bits());
                }
            }
        }
    }
}

#[test]
fn gram_rejects_a_wrong_length() {
    assert!(matches!(gram(&[0.0; 5], 2, 3), Err(Error::Length { .. })));
    assert_eq!(gram(&[], 0, 3).expect("empty"), vec![0.0; 9]);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// The prefill path (`n > SMALL_N`) on every instruction set this CPU has (deco's AVX-512
    /// and AVX2 tiles, the `gemm` crate) across its blocks: tokens past one 12-token tile,
    /// inner sizes past one 576-row block, column tails of every width modulo 32 and past one
    /// 512-column block.
    #[test]
    fn prefill_path_matches_f64_reference(n in (SMALL_N + 1)..=40, inner in 1usize..=900, out in 1usize..=600, seed in any::<u64>()) {
        let x = values(seed, n * inner);
        let w = values(seed ^ 0xAAAA, inner * out);
        for isa in [Isa::Scalar, Isa::Avx2, Isa::Avx512] {
            let mut y = vec![f32::NAN; n * out];
            matmul_with(&x, n, &w, inner, out, &mut y, isa).expect("matmul");
            for t in 0..n {
                for j in 0..out {
                    let (got, want) = (y[t * out + j], matmul_ref(&x, &w, inner, out, t, j, exact));
                    prop_assert!(close(got, want), "{isa:?} n={n} inner={inner} out={out} ({t},{j}): {got} vs {want:?}");
                }
            }
        }
    }
}

/// With AVX-512 or AVX2 the prefill path gives a token the same bits whatever the other tokens
/// of the call and the thread count (one FMA chain per output and inner block, blocks added in
/// order).
#[cfg(target_arch = "x86_64")]
#[test]
fn simd_prefill_paths_are_batch_and_thread_invariant() {
    for isa in [Isa::Avx2, Isa::Avx512] {
        if !isa.is_available() {
            eprintln!("no {isa:?} on this CPU: skipped (the gemm crate runs there, which is not batch-invariant)");
            continue;
        }
        let (inner, out) = (1000, 777);
        let w = values(7, inner * out);
        let big = values(11, 53 * inner);
        let mut y_big = vec![0.0f32; 53 * out];
        matmul_with(&big, 53, &w, inner, out, &mut y_big, isa).expect("matmul");
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for t in [0, 5, 6, 11, 12, 40, 52] {
            // Token t of the big call, now the last of SMALL_N + 1 tokens with other companions.
            let mut small = values(100 + t as u64, SMALL_N * inner);
            small.extend_from_slice(&big[t * inner..(t + 1) * inner]);
            let mut y = vec![0.0f32; (SMALL_N + 1) * out];
            matmul_with(&small, SMALL_N + 1, &w, inner, out, &mut y, isa).expect("matmul");
            assert_eq!(bits(&y[SMALL_N * out..]), bits(&y_big[t * out..(t + 1) * out]), "{isa:?} token {t}");
        }
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().expect("pool");
        let mut y1 = vec![0.0f32; 53 * out];
        one.install(|| matmul_with(&big, 53, &w, inner, out, &mut y1, isa)).expect("matmul");
        assert_eq!(bits(&y1), bits(&y_big), "{isa:?}: one thread against the default pool");
    }
}

/// The Gram matrix across several token blocks (1,300 tokens: the tiled paths' blocks of 576
/// tokens, the last one ragged) and ragged column tiles (430 features: two full 192-wide tiles
/// and a 46-wide one) against the f64 product, exactly symmetric, and the same bits on one
/// thread as on the default pool.
#[test]
fn gram_over_token_blocks_matches_f64_and_is_thread_invariant() {
    let (n, cols) = (1300, 430);
    let x = values(3, n * cols);
    let g = gram(&x, n, cols).expect("gram");
    for i in 0..cols {
        for j in 0..=i {
            let (got, want) = (g[i * cols + j], gram_ref(&x, n, cols, i, j, exact));
            assert!(close(got, want), "({i},{j}): {got} vs {want:?}");
            assert_eq!(g[i * cols + j].to_bits(), g[j * cols + i].to_bits(), "({i},{j}) not symmetric");
        }
    }
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().expect("pool");
    let g1 = one.install(|| gram(&x, n, cols)).expect("gram");
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&g1), bits(&g), "one thread against the default pool");
}

#[test]
fn bf16_rounding_is_nearest_even() {
    // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1); just above rounds up.
    assert_eq!(from_bf16_bits(to_bf16_bits(1.0 + 2f32.powi(-8))), 1.0);
    assert_eq!(from_bf16_bits(to_bf16_bits(1.0 + 2f32.powi(-8) + 2f32.powi(-20))), 1.0 + 2f32.powi(-7));
    // 1 + 3·2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6: up to even.
    assert_eq!(from_bf16_bits(to_bf16_bits(1.0 + 3.0 * 2f32.powi(-8))), 1.0 + 2f32.powi(-6));
    assert_eq!(from_bf16_bits(to_bf16_bits(-2.5)), -2.5);
    assert!(from_bf16_bits(to_bf16_bits(f32::NAN)).is_nan());
    assert_eq!(from_bf16_bits(to_bf16_bits(f32::INFINITY)), f32::INFINITY);
    // Subnormals become zeros of their sign, as `vcvtneps2bf16` makes them.
    assert_eq!(to_bf16_bits(1e-39), 0);
    assert_eq!(to_bf16_bits(-3e-39), 0x8000);
    assert_eq!(to_bf16_bits(1.2e-38), 0x0083);
    for x in values(9, 10_000) {
        let r = from_bf16_bits(to_bf16_bits(x * 100.0)) as f64;
        let e = (r - (x * 100.0) as f64).abs();
        // Unit roundoff 2^-8 (8 significant bits).
        assert!(e <= (x * 100.0).abs() as f64 * 2f64.powi(-8), "{x}: {r}");
    }
}

#[test]
fn bf16_refuses_without_the_instructions() {
    if bf16::available() {
        return;
    }
    let w = PackedBf16::new(&[1.0; 6], 2, 3).expect("pack");
    let mut y = [0.0f32; 3];
    assert!(matches!(bf16::matmul(&[1.0, 2.0], 1, &w, &mut y), Err(Error::Unsupported(_))));
    assert!(matches!(bf16::gram(&[1.0, 2.0], 1, 2), Err(Error::Unsupported(_))));
}

#[test]
fn bf16_packing_keeps_the_rounded_weight() {
    let (inner, out) = (7, 45);
    let w = values(3, inner * out);
    let p = PackedBf16::new(&w, inner, out).expect("pack");
    let u = p.unpack();
    for (a, b) in u.iter().zip(&w) {
        assert_eq!(*a as f64, round(*b));
    }
    assert!(matches!(PackedBf16::new(&w, inner, out + 1), Err(Error::Length { .. })));
}

/// Packing from `[out, inner]` rows gives the same packed weight (padding included) as packing
/// the transposed matrix, for odd and even inner sizes and partial strips.
#[test]
fn bf16_packing_from_rows_equals_packing_the_transpose() {
    for (inner, out) in [(1, 1), (2, 31), (7, 45), (64, 32), (129, 70), (576, 97)] {
        let rows = values(inner as u64 * 31 + out as u64, inner * out);
        let mut t = vec![0.0f32; inner * out];
        for o in 0..out {
            for i in 0..inner {
                t[i * out + o] = rows[o * inner + i];
            }
        }
        let want = PackedBf16::new(&t, inner, out).expect("pack");
        let got = PackedBf16::from_rows(inner, out, |o, buf| buf.copy_from_slice(&rows[o * inner..(o + 1) * inner]));
        assert_eq!(got, want, "inner {inner}, out {out}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]

    /// Each output is the f64 dot product of the bf16-rounded inputs up to f32 summation:
    /// within `1e-5 · Σ|x·w|` (the products are exact; only the f32 sums round).
    #[test]
    fn bf16_matmul_matches_f64_reference_of_rounded_inputs(n in 1usize..=40, inner in 1usize..=700, out in 1usize..=600, seed in any::<u64>()) {
        if !bf16::available() {
            return Ok(());
        }
        let x = values(seed, n * inner);
        let w = values(seed ^ 0x5555, inner * out);
        let p = PackedBf16::new(&w, inner, out).expect("pack");
        let mut y = vec![f32::NAN; n * out];
        bf16::matmul(&x, n, &p, &mut y).expect("matmul");
        for t in 0..n {
            for j in 0..out {
                let (got, want) = (y[t * out + j], matmul_ref(&x, &w, inner, out, t, j, round));
                prop_assert!(close(got, want), "t {t} j {j}: {got} vs {want:?}");
            }
        }
    }

    #[test]
    fn bf16_gram_matches_f64_reference_of_rounded_inputs(n in 1usize..=1300, cols in 1usize..=260, seed in any::<u64>()) {
        if !bf16::available() {
            return Ok(());
        }
        let x = values(seed, n * cols);
        let g = bf16::gram(&x, n, cols).expect("gram");
        for i in 0..cols {
            for j in 0..cols {
                let (got, want) = (g[i * cols + j], gram_ref(&x, n, cols, i, j, round));
                prop_assert!(close(got, want), "({i}, {j}) of {cols}, n {n}: {got} vs {want:?}");
                prop_assert_eq!(got, g[j * cols + i]);
            }
        }
    }
}

/// A token's outputs are the same bits alone, in a batch, and on one thread or two.
#[test]
fn bf16_matmul_is_batch_and_thread_invariant() {
    if !bf16::available() {
        return;
    }
    let (n, inner, out) = (53, 576, 960);
    let x = values(1, n * inner);
    let w = PackedBf16::new(&values(2, inner * out), inner, out).expect("pack");
    let mut all = vec![0.0f32; n * out];
    bf16::matmul(&x, n, &w, &mut all).expect("matmul");
    for t0 in [0usize, 17, 48] {
        let k = 5.min(n - t0);
        let mut part = vec![0.0f32; k * out];
        bf16::matmul(&x[t0 * inner..(t0 + k) * inner], k, &w, &mut part).expect("matmul");
        assert_eq!(part, all[t0 * out..(t0 + k) * out]);
    }
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().expect("pool");
    let mut single = vec![0.0f32; n * out];
    one.install(|| bf16::matmul(&x, n, &w, &mut single)).expect("matmul");
    assert_eq!(single, all);
}
