//! The host f32 matmul (`deco_kernels::dense::matmul`) against an f64 reference, both paths
//! (streaming at few tokens, `gemm` beyond), and the batch invariance of the streaming path;
//! the lower-block Gram matrix (`dense::gram`) against the same reference (and its thread
//! invariance).

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

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// The prefill path (`n > SMALL_N`; deco's AVX-512 tile where the CPU has it) across its
    /// blocks: tokens past one 12-token tile, inner sizes past one 384-row block, column tails
    /// of every width modulo 32 and past one 512-column block.
    #[test]
    fn prefill_path_matches_f64_reference(n in (SMALL_N + 1)..=40, inner in 1usize..=900, out in 1usize..=600, seed in any::<u64>()) {
        let x = values(seed, n * inner);
        let w = values(seed ^ 0xAAAA, inner * out);
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
                prop_assert!((got - want).abs() <= 1e-5 * mag + 1e-6, "n={n} inner={inner} out={out} ({t},{j}): {got} vs {want}");
            }
        }
    }
}

/// On AVX-512 the prefill path gives a token the same bits whatever the other tokens of the
/// call and the thread count (one FMA chain per output and inner block, blocks added in order).
#[cfg(target_arch = "x86_64")]
#[test]
fn avx512_prefill_path_is_batch_and_thread_invariant() {
    use deco_kernels::quant::Isa;
    if Isa::detect() != Isa::Avx512 {
        eprintln!("no AVX-512 on this CPU (or DECO_KERNELS caps it): the gemm crate runs, which is not batch-invariant");
        return;
    }
    let (inner, out) = (1000, 777);
    let w = values(7, inner * out);
    let big = values(11, 53 * inner);
    let mut y_big = vec![0.0f32; 53 * out];
    matmul(&big, 53, &w, inner, out, &mut y_big).expect("matmul");
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for t in [0, 11, 12, 40, 52] {
        // Token t of the big call, now the last of SMALL_N + 1 tokens with other companions.
        let mut small = values(100 + t as u64, SMALL_N * inner);
        small.extend_from_slice(&big[t * inner..(t + 1) * inner]);
        let mut y = vec![0.0f32; (SMALL_N + 1) * out];
        matmul(&small, SMALL_N + 1, &w, inner, out, &mut y).expect("matmul");
        assert_eq!(bits(&y[SMALL_N * out..]), bits(&y_big[t * out..(t + 1) * out]), "token {t}");
    }
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().expect("pool");
    let mut y1 = vec![0.0f32; 53 * out];
    one.install(|| matmul(&big, 53, &w, inner, out, &mut y1)).expect("matmul");
    assert_eq!(bits(&y1), bits(&y_big), "one thread against the default pool");
}

/// The Gram matrix across several token blocks (1,300 tokens: the AVX-512 path's blocks of 576
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
            let (mut want, mut mag) = (0.0f64, 0.0f64);
            for t in 0..n {
                let p = x[t * cols + i] as f64 * x[t * cols + j] as f64;
                want += p;
                mag += p.abs();
            }
            let got = g[i * cols + j] as f64;
            assert!((got - want).abs() <= 1e-5 * mag + 1e-6, "({i},{j}): {got} vs {want}");
            assert_eq!(g[i * cols + j].to_bits(), g[j * cols + i].to_bits(), "({i},{j}) not symmetric");
        }
    }
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().expect("pool");
    let g1 = one.install(|| gram(&x, n, cols)).expect("gram");
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&g1), bits(&g), "one thread against the default pool");
}
