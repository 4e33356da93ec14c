//! The fused SwiGLU against an f64 reference, on every instruction set of this CPU.

use deco_kernels::act::swiglu;
use deco_kernels::error::Error;
use proptest::prelude::*;

fn reference(g: f32, u: f32) -> f64 {
    let g = g as f64;
    g / (1.0 + (-g).exp()) * u as f64
}

fn check(gu: &[f32], n: usize, i: usize) -> Result<(), TestCaseError> {
    let mut out = vec![f32::NAN; n * i];
    swiglu(gu, n, i, &mut out).map_err(|e| TestCaseError::fail(e.to_string()))?;
    for t in 0..n {
        for j in 0..i {
            let (g, u) = (gu[2 * i * t + j], gu[2 * i * t + i + j]);
            let (got, want) = (out[t * i + j] as f64, reference(g, u));
            if want.is_nan() {
                prop_assert!(got.is_nan(), "silu({g}) * {u}: {got}, want NaN");
                continue;
            }
            // A few f32 ulps of the result, plus an absolute floor for results that underflow.
            let tol = 1e-6 * want.abs() + 1e-30;
            prop_assert!((got - want).abs() <= tol, "silu({g}) * {u} = {got}, want {want} (row {t}, col {j})");
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn matches_f64_reference(n in 1usize..=40, i in 1usize..=70, scale in prop::sample::select(vec![0.5f32, 8.0, 120.0]), seed in any::<u64>()) {
        let mut s = seed | 1;
        let gu: Vec<f32> = (0..2 * n * i).map(|_| {
            s ^= s << 13; s ^= s >> 7; s ^= s << 17;
            ((s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32 * scale
        }).collect();
        check(&gu, n, i)?;
    }
}

#[test]
fn extreme_inputs() {
    let gates = [0.0f32, -0.0, 1e-30, -1e-30, 88.0, -88.0, 100.0, -100.0, 1e30, -1e30, f32::NAN, 3.5, -3.5, 20.0, -20.0, 0.5];
    let i = gates.len();
    let mut gu = gates.to_vec();
    gu.extend(std::iter::repeat_n(1.5f32, i));
    check(&gu, 1, i).expect("extremes");
}

#[test]
fn wrong_lengths_are_errors() {
    let mut out = vec![0.0f32; 4];
    assert!(matches!(swiglu(&[0.0; 7], 1, 4, &mut out), Err(Error::Length { .. })));
    assert!(matches!(swiglu(&[0.0; 8], 1, 4, &mut out[..3]), Err(Error::Length { .. })));
}
