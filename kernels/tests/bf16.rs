//! The bf16 products (`deco_kernels::bf16`) against an f64 reference over the bf16-rounded
//! inputs, the batch and thread invariance of `matmul`, and the rounding itself. On CPUs without
//! AVX-512 BF16 the products must refuse with `Error::Unsupported` (checked there instead).

use deco_kernels::bf16::{PackedBf16, available, from_bf16_bits, gram, matmul, to_bf16_bits};
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

fn round(x: f32) -> f64 {
    from_bf16_bits(to_bf16_bits(x)) as f64
}

#[test]
fn rounding_is_nearest_even() {
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
fn refuses_without_the_instructions() {
    if available() {
        return;
    }
    let w = PackedBf16::new(&[1.0; 6], 2, 3).expect("pack");
    let mut y = [0.0f32; 3];
    assert!(matches!(matmul(&[1.0, 2.0], 1, &w, &mut y), Err(Error::Unsupported(_))));
    assert!(matches!(gram(&[1.0, 2.0], 1, 2), Err(Error::Unsupported(_))));
}

#[test]
fn packing_keeps_the_rounded_weight() {
    let (inner, out) = (7, 45);
    let w = values(3, inner * out);
    let p = PackedBf16::new(&w, inner, out).expect("pack");
    let u = p.unpack();
    for (a, b) in u.iter().zip(&w) {
        assert_eq!(*a as f64, round(*b));
    }
    assert!(matches!(PackedBf16::new(&w, inner, out + 1), Err(Error::Length { .. })));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]

    /// Each output is the f64 dot product of the bf16-rounded inputs up to f32 summation:
    /// within `1e-5 · Σ|x·w|` (the products are exact; only the f32 sums round).
    #[test]
    fn matmul_matches_f64_reference_of_rounded_inputs(n in 1usize..=40, inner in 1usize..=700, out in 1usize..=600, seed in any::<u64>()) {
        if !available() {
            return Ok(());
        }
        let x = values(seed, n * inner);
        let w = values(seed ^ 0x5555, inner * out);
        let p = PackedBf16::new(&w, inner, out).expect("pack");
        let mut y = vec![f32::NAN; n * out];
        matmul(&x, n, &p, &mut y).expect("matmul");
        for t in 0..n {
            for j in 0..out {
                let (mut want, mut mag) = (0.0f64, 0.0f64);
                for i in 0..inner {
                    let q = round(x[t * inner + i]) * round(w[i * out + j]);
                    want += q;
                    mag += q.abs();
                }
                let got = y[t * out + j] as f64;
                prop_assert!((got - want).abs() <= 1e-5 * mag + 1e-6, "t {t} j {j}: {got} vs {want}");
            }
        }
    }

    #[test]
    fn gram_matches_f64_reference_of_rounded_inputs(n in 1usize..=1300, cols in 1usize..=260, seed in any::<u64>()) {
        if !available() {
            return Ok(());
        }
        let x = values(seed, n * cols);
        let g = gram(&x, n, cols).expect("gram");
        for i in 0..cols {
            for j in 0..cols {
                let (mut want, mut mag) = (0.0f64, 0.0f64);
                for t in 0..n {
                    let q = round(x[t * cols + i]) * round(x[t * cols + j]);
                    want += q;
                    mag += q.abs();
                }
                let got = g[i * cols + j] as f64;
                prop_assert!((got - want).abs() <= 1e-5 * mag + 1e-6, "({i}, {j}) of {cols}, n {n}: {got} vs {want}");
                prop_assert_eq!(got, g[j * cols + i] as f64);
            }
        }
    }
}

/// A token's outputs are the same bits alone, in a batch, and on one thread or two.
#[test]
fn matmul_is_batch_and_thread_invariant() {
    if !available() {
        return;
    }
    let (n, inner, out) = (53, 576, 960);
    let x = values(1, n * inner);
    let w = PackedBf16::new(&values(2, inner * out), inner, out).expect("pack");
    let mut all = vec![0.0f32; n * out];
    matmul(&x, n, &w, &mut all).expect("matmul");
    for t0 in [0usize, 17, 48] {
        let k = 5.min(n - t0);
        let mut part = vec![0.0f32; k * out];
        matmul(&x[t0 * inner..(t0 + k) * inner], k, &w, &mut part).expect("matmul");
        assert_eq!(part, all[t0 * out..(t0 + k) * out]);
    }
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().expect("pool");
    let mut single = vec![0.0f32; n * out];
    one.install(|| matmul(&x, n, &w, &mut single)).expect("matmul");
    assert_eq!(single, all);
}
