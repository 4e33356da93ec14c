//! The host f32 matmul (`deco_kernels::dense::matmul`) against an f64 reference, both paths
//! (streaming at few tokens, `gemm` beyond), and the batch invariance of the streaming path;
//! the lower-block Gram matrix (`dense::gram`) against the same reference.

use deco_kernels::dense::{SMALL_N, gram, matmul};
use deco_kernels::error::Error;
use proptest::prelude::*;

fn values(seed: u64, len: usize) -> Vec<f32> {
    let mut s = seed | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32
        })
        .collect()
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
                let (mut want, mut mag) = (0.0f64, 0.0f64);
                for i in 0..inner {
                    let p = x[t * inner + i] as f64 * w[i * out + j] as f64;
                    want += p;
                    mag += p.abs();
                }
                let got = y[t * out + j] as f64;
                let tol = 1e-5 * mag + 1e-6;
                prop_assert!((got - want).abs() <= tol, "n={n} inner={inner} out={out} ({t},{j}): {got} vs {want}");
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
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// `xᵀx` from the lower blocks equals the f64 product within f32 accumulation error, is
    /// exactly symmetric, and covers sizes across the 128-column blocks.
    #[test]
    fn gram_matches_f64_reference(n in 1usize..=300, cols in 1usize..=300, seed in any::<u64>()) {
        let x = values(seed, n * cols);
        let g = gram(&x, n, cols).expect("gram");
        for i in 0..cols {
            for j in 0..cols {
                let (mut want, mut mag) = (0.0f64, 0.0f64);
                for t in 0..n {
                    let p = x[t * cols + i] as f64 * x[t * cols + j] as f64;
                    want += p;
                    mag += p.abs();
                }
                let got = g[i * cols + j] as f64;
                prop_assert!((got - want).abs() <= 1e-5 * mag + 1e-6, "n={n} cols={cols} ({i},{j}): {got} vs {want}");
                prop_assert_eq!(g[i * cols + j].to_bits(), g[j * cols + i].to_bits());
            }
        }
    }
}

#[test]
fn gram_rejects_a_wrong_length() {
    assert!(matches!(gram(&[0.0; 5], 2, 3), Err(Error::Length { .. })));
    assert_eq!(gram(&[], 0, 3).expect("empty"), vec![0.0; 9]);
}
