//! `causal_window_attention` against a naive f64 causal softmax attention written here: windows
//! of 1 to 300 tokens (partial query blocks and key tiles), several windows per call with gaps
//! between them, GQA ratios 1 to 6, head_dim 8 to 128; a window's result does not depend on the
//! other windows of the call; the error cases. Where the CPU has no AVX2 + FMA the kernel must
//! refuse with `Error::Unsupported` (checked there instead).

use deco_kernels::Error;
use deco_kernels::attention::AttnShape;
use deco_kernels::window_attention::{causal_window_attention, supported};
use proptest::prelude::*;

mod common;

/// `len` values uniform in (−amp, amp).
fn values(seed: u64, len: usize, amp: f32) -> Vec<f32> {
    common::values(seed, len).into_iter().map(|v| v * amp).collect()
}

/// Naive f64 attention of token `t` (window starting at `start`), head `h`: the output and
/// `Σ_p p_p |v_p|` per dimension (the scale of the f32 rounding).
fn reference(q: &[f32], k: &[f32], v: &[f32], shape: AttnShape, start: usize, t: usize, h: usize) -> (Vec<f64>, Vec<f64>) {
    let AttnShape { n_heads, kv_heads, head_dim: d } = shape;
    let j = h / (n_heads / kv_heads);
    let qh = &q[(t * n_heads + h) * d..][..d];
    let scores: Vec<f64> = (start..=t)
        .map(|p| {
            let kp = &k[(p * kv_heads + j) * d..][..d];
            qh.iter().zip(kp).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() / (d as f64).sqrt()
        })
        .collect();
    let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
    let z: f64 = e.iter().sum();
    let mut out = vec![0.0f64; d];
    let mut mag = vec![0.0f64; d];
    for (i, p) in (start..=t).enumerate() {
        let vp = &v[(p * kv_heads + j) * d..][..d];
        for c in 0..d {
            out[c] += e[i] / z * vp[c] as f64;
            mag[c] += e[i] / z * (vp[c] as f64).abs();
        }
    }
    (out, mag)
}

/// q, k, v, the output and the windows of one [`run`].
type Run = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<(usize, usize)>);

/// Runs the kernel on windows laid out with `gap` untouched rows before each, returns the
/// inputs, the output and the windows.
fn run(shape: AttnShape, lens: &[usize], gap: usize, seed: u64, amp: f32) -> Run {
    let AttnShape { n_heads, kv_heads, head_dim: d } = shape;
    let mut spans = Vec::new();
    let mut tokens = 0;
    for &len in lens {
        tokens += gap;
        spans.push((tokens, len));
        tokens += len;
    }
    let q = values(seed, tokens * n_heads * d, amp);
    let k = values(seed ^ 0x55, tokens * kv_heads * d, amp);
    let v = values(seed ^ 0xAA, tokens * kv_heads * d, 1.0);
    let mut out = vec![7.0f32; q.len()];
    causal_window_attention(&q, &k, &v, shape, &spans, &mut out).expect("attention");
    (q, k, v, out, spans)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Every output within `2e-5 · Σ_p p_p |v_p|` (+1e-6) of the f64 reference; rows outside the
    /// windows untouched.
    #[test]
    fn matches_f64_reference(
        lens in proptest::collection::vec(1usize..=300, 1..=3),
        gap in 0usize..=3,
        (kv_heads, group) in (1usize..=3, 1usize..=6),
        d8 in 1usize..=16,
        seed in any::<u64>(),
        amp in prop_oneof![Just(0.5f32), Just(3.0f32)],
    ) {
        let shape = AttnShape { n_heads: kv_heads * group, kv_heads, head_dim: 8 * d8 };
        if !supported(shape) {
            return Ok(());
        }
        let (q, k, v, out, spans) = run(shape, &lens, gap, seed, amp);
        let (h, d) = (shape.n_heads, shape.head_dim);
        let mut inside = vec![false; q.len() / (h * d)];
        for &(s, len) in &spans {
            for t in s..s + len {
                inside[t] = true;
                for hh in 0..h {
                    let (want, mag) = reference(&q, &k, &v, shape, s, t, hh);
                    let got = &out[(t * h + hh) * d..][..d];
                    for c in 0..d {
                        let tol = 2e-5 * mag[c] + 1e-6;
                        prop_assert!((got[c] as f64 - want[c]).abs() <= tol, "t {t} head {hh} dim {c}: {} vs {} (tol {tol})", got[c], want[c]);
                    }
                }
            }
        }
        for (t, &ins) in inside.iter().enumerate() {
            if !ins {
                prop_assert!(out[t * h * d..(t + 1) * h * d].iter().all(|&x| x == 7.0), "row {t} outside the windows was written");
            }
        }
    }
}

/// A window gives the same bits alone and among other windows (the tasks of one window do not
/// see the others, whatever thread runs them).
#[test]
fn a_window_alone_equals_the_same_window_in_a_batch() {
    let shape = AttnShape { n_heads: 9, kv_heads: 3, head_dim: 64 };
    if !supported(shape) {
        return;
    }
    let lens = [77usize, 256, 31, 130];
    let (q, k, v, out, spans) = run(shape, &lens, 0, 5, 2.0);
    let (h, d, kvh) = (shape.n_heads, shape.head_dim, shape.kv_heads);
    for &(s, len) in &spans {
        let mut alone = vec![0.0f32; len * h * d];
        causal_window_attention(&q[s * h * d..(s + len) * h * d], &k[s * kvh * d..(s + len) * kvh * d], &v[s * kvh * d..(s + len) * kvh * d], shape, &[(0, len)], &mut alone).expect("attention");
        let batch = &out[s * h * d..(s + len) * h * d];
        assert!(alone.iter().zip(batch).all(|(a, b)| a.to_bits() == b.to_bits()), "window at {s}");
    }
}

#[test]
fn refuses_bad_shapes_and_windows() {
    let shape = AttnShape { n_heads: 2, kv_heads: 1, head_dim: 8 };
    if !supported(shape) {
        let e = causal_window_attention(&[0.0; 16], &[0.0; 8], &[0.0; 8], shape, &[(0, 1)], &mut [0.0; 16]);
        assert!(matches!(e, Err(Error::Unsupported(_))));
        return;
    }
    let (q, kv) = (vec![0.1f32; 3 * 16], vec![0.2f32; 3 * 8]);
    let mut out = vec![0.0f32; 3 * 16];
    assert!(matches!(causal_window_attention(&q, &kv[..16], &kv, shape, &[(0, 3)], &mut out), Err(Error::Length { .. })));
    assert!(matches!(causal_window_attention(&q, &kv, &kv, shape, &[(0, 3)], &mut out[..16]), Err(Error::Length { .. })));
    assert!(matches!(causal_window_attention(&q, &kv, &kv, shape, &[(2, 2)], &mut out), Err(Error::Incompatible(_))));
    assert!(matches!(causal_window_attention(&q, &kv, &kv, shape, &[(usize::MAX, 2)], &mut out), Err(Error::Incompatible(_))));
    let odd = AttnShape { n_heads: 2, kv_heads: 1, head_dim: 12 };
    assert!(!supported(odd));
    assert!(matches!(causal_window_attention(&[0.0; 24], &[0.0; 12], &[0.0; 12], odd, &[(0, 1)], &mut [0.0; 24]), Err(Error::Unsupported(_))));
}
