//! The 16-bit block-scaled integer products (`deco_kernels::int16`) against an f64 reference of
//! their quantized inputs (the quantization computed here from its definition, `scale = max|v| /
//! QMAX` per block of `BLOCK` values, `code = round(v / scale)`), against the f32 product within
//! the quantization's error bound, and their batch and thread invariance. Without AVX2 the
//! products must refuse with `Error::Unsupported` (checked there instead).

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use deco_kernels::error::Error;
use deco_kernels::int16::{self, BLOCK, PackedInt16, QMAX};
use proptest::prelude::*;

mod common;
use common::values;

/// `v` (blocks of `BLOCK` consecutive values) as the products see it, from the definition
/// (independent of `quantize_block`): per block `s = max|v| / QMAX` (f32),
/// `round(v · (QMAX / max|v|))` (ties to even) clamped, times `s` (the f32 product, as `unpack` gives it).
fn dequantized(v: &[f32]) -> Vec<f64> {
    let mut out = Vec::with_capacity(v.len());
    for b in v.chunks(BLOCK) {
        let m = b.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        if m == 0.0 {
            out.extend(b.iter().map(|_| 0.0));
            continue;
        }
        let (s, inv) = (m / QMAX as f32, QMAX as f32 / m);
        out.extend(b.iter().map(|&x| ((x * inv).round_ties_even().clamp(-(QMAX as f32), QMAX as f32) * s) as f64));
    }
    out
}

/// [`dequantized`] of each row of `[rows, cols]` `m` (blocks along a row).
fn dequantized_rows(m: &[f32], cols: usize) -> Vec<f64> {
    m.chunks(cols).flat_map(dequantized).collect()
}

/// The columns of `[rows, cols]` `m` as rows (`[cols, rows]`).
fn transpose(m: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    (0..cols * rows).map(|i| m[(i % rows) * cols + i / rows]).collect()
}

/// Whether `got` matches `want` up to f32 rounding of the block sums: `2e-6 · mag + 1e-6`.
fn close(got: f32, want: f64, mag: f64) -> bool {
    (got as f64 - want).abs() <= 2e-6 * mag + 1e-6
}

#[test]
fn int16_refuses_without_the_instructions() {
    let w = PackedInt16::new(&[1.0; 4], 2, 2).unwrap();
    let mut y = [0.0f32; 2];
    let r = int16::matmul(&[1.0, 2.0], 1, &w, &mut y);
    if int16::available() {
        assert!(r.is_ok());
    } else {
        assert!(matches!(r, Err(Error::Unsupported(_))), "{r:?}");
        assert!(matches!(int16::gram(&[1.0, 2.0], 1, 2), Err(Error::Unsupported(_))));
    }
    // Mismatched lengths are errors on every CPU.
    assert!(matches!(PackedInt16::new(&[1.0; 3], 2, 2), Err(Error::Length { .. })));
    assert!(matches!(int16::matmul(&[1.0; 3], 1, &w, &mut y), Err(Error::Length { .. })));
    assert!(matches!(int16::gram(&[1.0; 3], 1, 2), Err(Error::Length { .. })));
}

#[test]
fn int16_packing_keeps_the_quantized_weight() {
    let (inner, out) = (150, 37);
    let w = values(3, inner * out);
    let p = PackedInt16::new(&w, inner, out).unwrap();
    let want: Vec<f64> = dequantized_rows(&transpose(&w, inner, out), inner);
    let got = p.unpack();
    for k in 0..inner {
        for j in 0..out {
            assert_eq!(got[k * out + j] as f64, want[j * inner + k], "({k},{j})");
        }
    }
    let rows = transpose(&w, inner, out);
    let q = PackedInt16::from_rows(inner, out, |o, buf| buf.copy_from_slice(&rows[o * inner..(o + 1) * inner]));
    assert_eq!(p, q);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn int16_matmul_matches_f64_reference_of_quantized_inputs(n in 1usize..=40, inner in 1usize..=700, out in 1usize..=300, seed in any::<u64>()) {
        if !int16::available() {
            return Ok(());
        }
        let x = values(seed, n * inner);
        let w = values(seed ^ 0x5555, inner * out);
        let p = PackedInt16::new(&w, inner, out).unwrap();
        let mut y = vec![f32::NAN; n * out];
        int16::matmul(&x, n, &p, &mut y).unwrap();
        let wq = dequantized_rows(&transpose(&w, inner, out), inner);
        for t in 0..n {
            let xq = dequantized(&x[t * inner..(t + 1) * inner]);
            for j in 0..out {
                let (mut want, mut mag, mut bound) = (0.0f64, 0.0f64, 0.0f64);
                for k in 0..inner {
                    let (a, b) = (xq[k], wq[j * inner + k]);
                    want += a * b;
                    mag += (a * b).abs();
                    // |x·w - x̂·ŵ| <= |x̂| e_w + |ŵ| e_x + e_x e_w, e at most half a step.
                    let (ex, ew) = ((x[t * inner + k] as f64 - a).abs(), (w[k * out + j] as f64 - b).abs());
                    bound += a.abs() * ew + b.abs() * ex + ex * ew;
                }
                let got = y[t * out + j];
                prop_assert!(close(got, want, mag), "n={n} inner={inner} out={out} ({t},{j}): {got} vs {want}");
                let exact: f64 = (0..inner).map(|k| x[t * inner + k] as f64 * w[k * out + j] as f64).sum();
                prop_assert!((got as f64 - exact).abs() <= bound * 1.0001 + 2e-6 * mag + 1e-6, "({t},{j}): {got} vs f32 product {exact}, bound {bound}");
            }
        }
    }

    #[test]
    fn int16_gram_matches_f64_reference_of_quantized_inputs(n in 1usize..=700, cols in 1usize..=200, seed in any::<u64>()) {
        if !int16::available() {
            return Ok(());
        }
        let x = values(seed, n * cols);
        let g = int16::gram(&x, n, cols).unwrap();
        // Quantized per feature and block of BLOCK tokens: the columns as rows.
        let xt = transpose(&x, n, cols);
        let q: Vec<Vec<f64>> = (0..cols).map(|j| dequantized(&xt[j * n..(j + 1) * n])).collect();
        for i in 0..cols {
            for j in 0..cols {
                let (want, mag) = (0..n).map(|t| q[i][t] * q[j][t]).fold((0.0, 0.0), |(s, m), p| (s + p, m + p.abs()));
                let got = g[i * cols + j];
                prop_assert!(close(got, want, mag), "n={n} cols={cols} ({i},{j}): {got} vs {want}");
                prop_assert_eq!(got.to_bits(), g[j * cols + i].to_bits());
            }
        }
    }
}

/// A token's outputs are the same bits alone, in any batch and on any number of threads.
#[test]
fn int16_matmul_is_batch_and_thread_invariant() {
    if !int16::available() {
        return;
    }
    let (n, inner, out) = (53, 1536, 200);
    let x = values(11, n * inner);
    let w = PackedInt16::new(&values(12, inner * out), inner, out).unwrap();
    let mut y = vec![0.0f32; n * out];
    int16::matmul(&x, n, &w, &mut y).unwrap();
    for t in [0, 7, 52] {
        let mut one = vec![0.0f32; out];
        int16::matmul(&x[t * inner..(t + 1) * inner], 1, &w, &mut one).unwrap();
        assert_eq!(one, y[t * out..(t + 1) * out], "token {t}");
    }
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    let mut y1 = vec![0.0f32; n * out];
    pool.install(|| int16::matmul(&x, n, &w, &mut y1)).unwrap();
    assert_eq!(y, y1);
    let g = int16::gram(&x[..40 * inner], 40, inner).unwrap();
    let g1 = pool.install(|| int16::gram(&x[..40 * inner], 40, inner)).unwrap();
    assert_eq!(g, g1);
}

/// Values at the top of the range do not overflow the 32-bit block sums: a block of `QMAX`
/// codes on both sides.
#[test]
fn int16_extreme_blocks_do_not_overflow() {
    if !int16::available() {
        return;
    }
    let inner = 3 * BLOCK;
    let x = vec![-1.0e6f32; inner];
    let w = PackedInt16::new(&vec![-2.5e-3; inner], inner, 1).unwrap();
    let mut y = [0.0f32];
    int16::matmul(&x, 1, &w, &mut y).unwrap();
    let want = inner as f64 * 1.0e6 * 2.5e-3;
    assert!((y[0] as f64 - want).abs() <= 1e-5 * want, "{} vs {want}", y[0]);
}

/// All-zero blocks give zeros, a non-finite input poisons exactly the outputs it enters (NaN),
/// in the products and in the Gram matrix, on the vector and the scalar quantizers alike.
#[test]
fn int16_zero_and_non_finite_blocks() {
    if !int16::available() {
        return;
    }
    let (n, inner, out) = (3, 2 * BLOCK + 5, 4);
    let mut x = values(5, n * inner);
    x[..BLOCK].fill(0.0); // token 0: first block zero
    x[inner + 3] = f32::INFINITY; // token 1: first block non-finite
    x[2 * inner + 2 * BLOCK + 1] = f32::NAN; // token 2: the scalar tail block
    let w = PackedInt16::new(&values(6, inner * out), inner, out).unwrap();
    let mut y = vec![0.0f32; n * out];
    int16::matmul(&x, n, &w, &mut y).unwrap();
    assert!(y[..out].iter().all(|v| v.is_finite()), "{:?}", &y[..out]);
    assert!(y[out..].iter().all(|v| v.is_nan()), "{:?}", &y[out..]);
    // Gram: 9 features (8 vectorized, 1 scalar), 70 tokens; feature 2 holds an infinity,
    // feature 8 a NaN, feature 5 is zero.
    let (n, cols) = (70, 9);
    let mut x = values(7, n * cols);
    for t in 0..n {
        x[t * cols + 5] = 0.0;
    }
    x[3 * cols + 2] = f32::INFINITY;
    x[66 * cols + 8] = f32::NAN;
    let g = int16::gram(&x, n, cols).unwrap();
    for i in 0..cols {
        for j in 0..cols {
            let v = g[i * cols + j];
            let poisoned = [2, 8].contains(&i) || [2, 8].contains(&j);
            assert_eq!(v.is_nan(), poisoned, "({i},{j}) = {v}");
            if !poisoned && (i == 5 || j == 5) {
                assert_eq!(v, 0.0, "({i},{j})");
            }
        }
    }
}
