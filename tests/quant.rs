//! Quantization algorithms against independent references: RTN error bounds (proptest), GPTQ
//! against a straightforward implementation of the paper's Algorithm 1 (explicit inverse,
//! one column at a time), and every method against RTN on a layer with planted outlier input
//! channels.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use deco_quant::awq::{ScaleCandidate, act_mean_abs, apply_clip, scaled_fake_quant, search_clip, search_scale};
use deco_quant::gptq::{GptqConfig, Hessian, gptq_quantize};
use deco_quant::nf4::{NF4_CODE, Nf4Tensor, dynamic_map};
use deco_quant::scheme::{Granularity, Scheme, absmax_int8_rows, dequantize_value, find_params, find_params_mse, quantize_rtn, quantize_value};
use deco_quant::smooth::{act_max_abs, outlier_columns, outlier_columns_auto, quant_act_per_token, smooth_scales};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn randn(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    // Box-Muller
    (0..n)
        .map(|_| {
            let u1: f64 = rng.random_range(1e-12..1.0);
            let u2: f64 = rng.random_range(0.0..1.0);
            ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
        })
        .collect()
}

/// `[tokens, cols]` inputs with correlated channels: x = z · M for a random mixing M.
fn correlated_x(rng: &mut ChaCha8Rng, tokens: usize, cols: usize) -> Vec<f32> {
    let z = randn(rng, tokens * cols);
    let m = randn(rng, cols * cols);
    let mut x = vec![0.0f32; tokens * cols];
    for t in 0..tokens {
        for j in 0..cols {
            let mut s = 0.0;
            for k in 0..cols {
                s += z[t * cols + k] * m[k * cols + j] / (cols as f32).sqrt();
            }
            x[t * cols + j] = s + 0.3 * z[t * cols + j];
        }
    }
    x
}

fn matmul_abt(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut out = vec![0.0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..k).map(|l| a[i * k + l] as f64 * b[j * k + l] as f64).sum();
        }
    }
    out
}

/// ||X Wᵀ − X Ŵᵀ||² / ||X Wᵀ||²
fn out_err(x: &[f32], w: &[f32], wq: &[f32], tokens: usize, rows: usize, cols: usize) -> f64 {
    let a = matmul_abt(x, w, tokens, cols, rows);
    let b = matmul_abt(x, wq, tokens, cols, rows);
    let num: f64 = a.iter().zip(&b).map(|(p, q)| (p - q).powi(2)).sum();
    let den: f64 = a.iter().map(|p| p * p).sum();
    num / den
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    #[test]
    fn rtn_round_trip_within_half_step(
        rows in 1usize..5, groups in 1usize..4, gsel in 0usize..3, bits_i in 0usize..4, sym: bool,
        seed: u64, scale in 0.01f32..100.0, nzero in 0usize..4,
    ) {
        let bits = [2u32, 3, 4, 8][bits_i];
        let gs = 8;
        let cols = groups * gs;
        let granularity = [Granularity::PerTensor, Granularity::PerChannel, Granularity::PerGroup(gs)][gsel];
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut w: Vec<f32> = randn(&mut rng, rows * cols).iter().map(|v| v * scale).collect();
        for i in 0..nzero.min(w.len()) { w[(i * 7) % (rows * cols)] = 0.0; }
        let scheme = Scheme { bits, sym, granularity };
        let q = quantize_rtn(&w, rows, cols, &scheme).unwrap();
        let d = q.dequantize();
        let g = q.groups();
        for r in 0..rows {
            for c in 0..cols {
                let p = (if q.param_rows == 1 { 0 } else { r }) * g + q.g_idx[c] as usize;
                let step = q.scales[p];
                prop_assert!(step > 0.0 && step.is_finite());
                prop_assert!(q.codes[r * cols + c] as u32 <= scheme.maxq());
                let (x, y) = (w[r * cols + c], d[r * cols + c]);
                // AutoGPTQ's representable range; a symmetric group without negative values
                // clips above step * (maxq - zero) (see the `scheme` module docs).
                let lo = step * -q.zeros[p];
                let hi = step * (scheme.maxq() as f32 - q.zeros[p]);
                let tol = 1e-5 * step + 1e-6 * x.abs();
                if x > hi + 0.5 * step {
                    prop_assert!((y - hi).abs() <= tol, "r{r} c{c}: {x} above the range should clip to {hi}, got {y}");
                } else if x < lo - 0.5 * step {
                    prop_assert!((y - lo).abs() <= tol, "r{r} c{c}: {x} below the range should clip to {lo}, got {y}");
                } else {
                    let e = (y - x).abs();
                    prop_assert!(e <= 0.5 * step + tol,
                        "r{r} c{c}: |{y} - {x}| = {e} > step/2 = {}", step / 2.0);
                }
                // Only that documented symmetric case may leave the range at all.
                if !(sym && (0..cols).all(|cc| q.g_idx[cc] != q.g_idx[c] || w[r * cols + cc] >= 0.0)) && q.param_rows != 1 {
                    prop_assert!(x <= hi + 0.5 * step + tol && x >= lo - 0.5 * step - tol, "r{r} c{c}: {x} outside [{lo}, {hi}]");
                }
                if !sym && w[r * cols + c] == 0.0 {
                    prop_assert_eq!(d[r * cols + c], 0.0);
                    prop_assert_eq!(q.codes[r * cols + c] as f32, q.zeros[p]);
                }
            }
        }
    }

    #[test]
    fn nf4_round_trip_bound(seed: u64, n in 1usize..600, scale in 0.001f32..10.0) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let w: Vec<f32> = randn(&mut rng, n).iter().map(|v| v * scale).collect();
        let t = Nf4Tensor::quantize(&w, 64).unwrap();
        let d = t.dequantize();
        let am = t.absmax();
        // Largest half-gap of the codebook is (1 - 0.6961928) / 2; the absmax itself carries the
        // double-quantization error (checked separately below).
        for (b, chunk) in w.chunks(64).enumerate() {
            let exact = chunk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            // Double quantization: 8-bit dynamic-map code of (absmax - offset) / s, whose largest
            // half-gap is (1 - 0.99297) / 2 ≈ 0.0036 of the per-256 scale s (bound with margin).
            let s = t.absmax_scales[b / 256];
            prop_assert!((am[b] - exact).abs() <= 0.0071 * s + 1e-7 * exact, "absmax {} vs {}", am[b], exact);
            for (i, &v) in chunk.iter().enumerate() {
                let e = (d[b * 64 + i] - v).abs();
                prop_assert!(e <= 0.1520 * am[b] + (am[b] - exact).abs() + 1e-6);
            }
        }
    }
}

/// `Σ |q(x) − x|^norm` of one group under `(scale, zero)`.
fn group_err(v: &[f32], s: f32, z: f32, bits: u32, norm: f64) -> f64 {
    let maxq = (1u32 << bits) - 1;
    v.iter().map(|&x| (dequantize_value(quantize_value(x, s, z, maxq), s, z) as f64 - x as f64).abs().powf(norm)).sum()
}

/// The reference shrink search (IST-DASLab/gptq `quant.py`, `find_params` with `mse=True`),
/// written out over the same grid in f64 from the group's own min/max.
fn reference_mse_params(v: &[f32], bits: u32, sym: bool, norm: f64) -> (f32, f32) {
    let maxq = ((1u32 << bits) - 1) as f64;
    let xmin = v.iter().fold(0.0f64, |m, &x| m.min(x as f64));
    let xmax = v.iter().fold(0.0f64, |m, &x| m.max(x as f64));
    let (xmin, xmax) = if sym {
        let a = xmax.max(-xmin);
        (if xmin < 0.0 { -a } else { xmin }, a)
    } else {
        (xmin, xmax)
    };
    let (mut best, mut bs, mut bz) = (f64::INFINITY, 0.0f32, 0.0f32);
    for i in 0..80 {
        let p = 1.0 - i as f64 / 100.0;
        let s = ((p * xmax - p * xmin) / maxq) as f32;
        let z = if sym { ((maxq + 1.0) / 2.0) as f32 } else { (-(p * xmin) / s as f64).round_ties_even().clamp(0.0, maxq) as f32 };
        let e = group_err(v, s, z, bits, norm);
        if e < best {
            (best, bs, bz) = (e, s, z);
        }
    }
    (bs, bz)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    /// The shrink search never does worse than min-max on its own objective (p = 1 is
    /// min-max), picks what the reference loop picks up to the f32 rounding of the errors it
    /// compares (the search sums f32 terms, as the reference's torch code does; this reference
    /// sums in f64), and returns a valid scale / zero.
    #[test]
    fn mse_params_never_worse_than_minmax_and_match_reference(
        seed: u64, n in 2usize..160, bits_i in 0usize..3, sym: bool, outlier in 0.0f32..20.0,
    ) {
        let bits = [2u32, 3, 4][bits_i];
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut v = randn(&mut rng, n);
        v[0] *= 1.0 + outlier;
        let (s0, z0) = find_params(v.iter().copied(), bits, sym);
        let (s, z) = find_params_mse(&v, bits, sym, 2.4, 100, 0.8);
        prop_assert!(s > 0.0 && s.is_finite() && z >= 0.0 && z <= ((1u32 << bits) - 1) as f32 && z.fract() == 0.0);
        let (e0, e) = (group_err(&v, s0, z0, bits, 2.4), group_err(&v, s, z, bits, 2.4));
        prop_assert!(e <= e0 * (1.0 + 2e-5), "mse search {e} worse than min-max {e0}");
        let (rs, rz) = reference_mse_params(&v, bits, sym, 2.4);
        let er = group_err(&v, rs, rz, bits, 2.4);
        prop_assert!((s, z) == (rs, rz) || e <= er * (1.0 + 2e-5), "picked ({s}, {z}) error {e}, the reference ({rs}, {rz}) {er}");
    }
}

#[test]
fn mse_params_shrink_an_outlier_group() {
    // 127 values evenly in [-1, 1) and one at 1.6: the search (norm 2.4) shrinks the range to
    // p = 0.93 and clips the outlier, lowering the total error (worked out by hand over the
    // grid: Σ|e|^2.4 0.1116 -> 0.0963; squared error -13%).
    let mut v: Vec<f32> = (0..127).map(|i| (i as f32 / 63.5) - 1.0).collect();
    v.push(1.6);
    let (s0, z0) = find_params(v.iter().copied(), 4, false);
    let (s, z) = find_params_mse(&v, 4, false, 2.4, 100, 0.8);
    assert!((s / s0 - 0.93).abs() < 1e-4, "scale {s} vs min-max {s0}: want the p = 0.93 step");
    assert!((group_err(&v, s, z, 4, 2.4) - 0.0963).abs() < 1e-3 && (group_err(&v, s0, z0, 4, 2.4) - 0.1116).abs() < 1e-3);
    assert!(group_err(&v, s, z, 4, 2.0) < 0.9 * group_err(&v, s0, z0, 4, 2.0));
    // A group of zeros keeps find_params' (-1, 1) range.
    assert_eq!(find_params_mse(&[0.0; 8], 4, false, 2.4, 100, 0.8), find_params([0.0f32; 8], 4, false));
}

#[test]
fn rtn_hand_computed_4bit() {
    // Row [-1, 0, 0.5, 2]: asym: xmin=-1, xmax=2, scale=3/15=0.2, zero=round(5)=5.
    let w = [-1.0f32, 0.0, 0.5, 2.0];
    let q = quantize_rtn(&w, 1, 4, &Scheme { bits: 4, sym: false, granularity: Granularity::PerChannel }).unwrap();
    assert_eq!(q.scales, vec![0.2]);
    assert_eq!(q.zeros, vec![5.0]);
    // 0.5/0.2 = 2.5 -> round half to even = 2 (+5 = 7) -> 0.4
    assert_eq!(q.codes, vec![0, 5, 7, 15]);
    let d = q.dequantize();
    assert!((d[2] - 0.4).abs() < 1e-6 && d[1] == 0.0);
    // sym: xmax = 2, scale = 4/15, zero = 8
    let (s, z) = find_params(w, 4, true);
    assert!((s - 4.0 / 15.0).abs() < 1e-7 && z == 8.0);
    // Invalid parameters are errors, not panics.
    assert!(quantize_rtn(&w, 1, 4, &Scheme { bits: 5, sym: true, granularity: Granularity::PerChannel }).is_err());
    assert!(quantize_rtn(&w, 1, 4, &Scheme { bits: 4, sym: true, granularity: Granularity::PerGroup(3) }).is_err());
    assert!(quantize_rtn(&w, 2, 4, &Scheme { bits: 4, sym: true, granularity: Granularity::PerGroup(2) }).is_err());
}

/// Inverse of a symmetric matrix by Gauss-Jordan elimination (independent of deco's Cholesky).
fn gauss_jordan_inverse(a: &[f64], n: usize) -> Vec<f64> {
    let mut m = a.to_vec();
    let mut inv: Vec<f64> = (0..n * n).map(|i| if i / n == i % n { 1.0 } else { 0.0 }).collect();
    for c in 0..n {
        let p = (c..n).max_by(|&x, &y| m[x * n + c].abs().total_cmp(&m[y * n + c].abs())).unwrap();
        for k in 0..n {
            m.swap(c * n + k, p * n + k);
            inv.swap(c * n + k, p * n + k);
        }
        let d = m[c * n + c];
        for k in 0..n {
            m[c * n + k] /= d;
            inv[c * n + k] /= d;
        }
        for r in 0..n {
            if r != c {
                let f = m[r * n + c];
                for k in 0..n {
                    m[r * n + k] -= f * m[c * n + k];
                    inv[r * n + k] -= f * inv[c * n + k];
                }
            }
        }
    }
    inv
}

/// The paper's Algorithm 1 without lazy batching or Cholesky: quantize column `j` (in `order`),
/// spread its error with the inverse Hessian of the not-yet-quantized columns (OBS update,
/// eq. 2–3), remove `j` from that inverse. Returns dequantized weights.
/// `mse`: group parameters from the reference shrink search ([`reference_mse_params`], norm
/// 2.4) instead of min-max.
#[allow(clippy::too_many_arguments)] // the weight, its shape, the Hessian and four options
fn reference_gptq(w: &[f32], rows: usize, cols: usize, h: &[f64], bits: u32, group: Option<usize>, desc_act: bool, mse: bool) -> Vec<f32> {
    let n = cols;
    let mut h = h.to_vec();
    let mut wm: Vec<f64> = w.iter().map(|&v| v as f64).collect();
    for i in 0..n {
        if h[i * n + i] == 0.0 {
            h[i * n + i] = 1.0;
            for r in 0..rows {
                wm[r * n + i] = 0.0;
            }
        }
    }
    let mut order: Vec<usize> = (0..n).collect();
    if desc_act {
        order.sort_by(|&a, &b| h[b * n + b].total_cmp(&h[a * n + a]));
    }
    let damp = 0.01 * (0..n).map(|i| h[i * n + i]).sum::<f64>() / n as f64;
    for i in 0..n {
        h[i * n + i] += damp;
    }
    let mut hinv = gauss_jordan_inverse(&h, n);
    let maxq = ((1u32 << bits) - 1) as f64;
    let params = |vals: Vec<f64>| -> (f64, f64) {
        let v32: Vec<f32> = vals.iter().map(|&v| v as f32).collect();
        let (s, z) = if mse { reference_mse_params(&v32, bits, true, 2.4) } else { find_params(v32.iter().copied(), bits, true) };
        (s as f64, z as f64)
    };
    let mut p: Vec<(f64, f64)> = (0..rows).map(|r| params(order.iter().map(|&c| wm[r * n + c]).collect())).collect();
    let mut out = vec![0.0f32; rows * cols];
    for (pos, &j) in order.iter().enumerate() {
        if let Some(g) = group
            && pos % g == 0
        {
            p = (0..rows).map(|r| params(order[pos..(pos + g).min(n)].iter().map(|&c| wm[r * n + c]).collect())).collect();
        }
        let d = hinv[j * n + j];
        for r in 0..rows {
            let (s, z) = p[r];
            let s32 = s as f32 as f64;
            let q = ((wm[r * n + j] / s32).round_ties_even() + z).clamp(0.0, maxq);
            let deq = s32 * (q - z);
            out[r * n + j] = deq as f32;
            let e = (wm[r * n + j] - deq) / d;
            for &k in &order[pos + 1..] {
                wm[r * n + k] -= e * hinv[j * n + k];
            }
        }
        let col: Vec<f64> = (0..n).map(|a| hinv[a * n + j]).collect();
        for a in 0..n {
            for b in 0..n {
                hinv[a * n + b] -= col[a] * col[b] / d;
            }
        }
    }
    out
}

fn hessian_of(x: &[f32], tokens: usize, cols: usize) -> Hessian {
    let mut h = Hessian::new(cols);
    // Two batches, to exercise the running average.
    let half = tokens / 2;
    h.add_batch(&x[..half * cols], half).unwrap();
    h.add_batch(&x[half * cols..], tokens - half).unwrap();
    h
}

#[test]
fn hessian_is_two_xtx_over_n() {
    let x = [1.0f32, 2.0, 3.0, -1.0, 0.5, 0.0];
    let h = hessian_of(&x, 3, 2);
    // X^T X = [[1+9+0.25, 2-3+0], [.., 4+1+0]] = [[10.25, -1], [-1, 5]]; H = 2/3 of it.
    let want = [10.25 * 2.0 / 3.0, -2.0 / 3.0, -2.0 / 3.0, 10.0 / 3.0];
    for (a, b) in h.h.iter().zip(want) {
        assert!((a - b).abs() < 1e-12, "{a} vs {b}");
    }
    assert_eq!(h.n, 3);
}

#[test]
fn gptq_matches_algorithm_1() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let (rows, cols, tokens) = (6, 24, 64);
    let x = correlated_x(&mut rng, tokens, cols);
    let w = randn(&mut rng, rows * cols);
    let h = hessian_of(&x, tokens, cols);
    for (group, desc_act) in [(None, false), (Some(8), false), (None, true), (Some(8), true)] {
        let cfg = GptqConfig { bits: 3, group_size: group, sym: true, damp_percent: 0.01, desc_act, static_groups: false, blocksize: 8, mse: 0.0 };
        let got = gptq_quantize(&w, rows, cols, &h, &cfg).unwrap().q.dequantize();
        let want = reference_gptq(&w, rows, cols, &h.h, 3, group, desc_act, false);
        let max = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(max < 1e-4, "group {group:?} desc_act {desc_act}: max diff {max}");
        // Not RTN: GPTQ moves some weights to another code than plain rounding.
        let rtn = quantize_rtn(&w, rows, cols, &Scheme { bits: 3, sym: true, granularity: group.map_or(Granularity::PerChannel, Granularity::PerGroup) }).unwrap().dequantize();
        assert!(got.iter().zip(&rtn).any(|(a, b)| a != b));
    }
}

/// GPTQ with the MSE scale/zero search (`mse = 2.4`) against Algorithm 1 with the reference's
/// shrink search at each group start; and the search lowers the layer's output error.
#[test]
fn gptq_mse_matches_algorithm_1() {
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    let (rows, cols, tokens) = (6, 24, 64);
    let x = correlated_x(&mut rng, tokens, cols);
    let w = randn(&mut rng, rows * cols);
    let h = hessian_of(&x, tokens, cols);
    for desc_act in [false, true] {
        let cfg = GptqConfig { bits: 3, group_size: Some(8), sym: true, desc_act, blocksize: 8, mse: 2.4, ..GptqConfig::default() };
        let got = gptq_quantize(&w, rows, cols, &h, &cfg).unwrap().q.dequantize();
        let want = reference_gptq(&w, rows, cols, &h.h, 3, Some(8), desc_act, true);
        let max = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(max < 1e-4, "desc_act {desc_act}: max diff {max}");
        let plain = gptq_quantize(&w, rows, cols, &h, &GptqConfig { mse: 0.0, ..cfg }).unwrap().q.dequantize();
        assert!(got != plain, "the search changed no parameter");
    }
    for bad in [-1.0, f64::NAN, f64::INFINITY] {
        assert!(gptq_quantize(&w, rows, cols, &h, &GptqConfig { mse: bad, ..GptqConfig::default() }).is_err(), "mse {bad}");
    }
}

#[test]
fn gptq_ragged_groups_match_algorithm_1() {
    // 20 inputs in groups of 8: AutoGPTQ's ceil(20 / 8) = 3 groups (8, 8, 4). (Exact agreement
    // with the reference is sensitive to rounding near-ties: with seed 17 one code of one row
    // flips at a tie and its error feedback changes the rest of that row.)
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let (rows, cols, tokens) = (5, 20, 64);
    let x = correlated_x(&mut rng, tokens, cols);
    let w = randn(&mut rng, rows * cols);
    let h = hessian_of(&x, tokens, cols);
    for desc_act in [false, true] {
        let cfg = GptqConfig { bits: 3, group_size: Some(8), sym: true, damp_percent: 0.01, desc_act, static_groups: false, blocksize: 8, mse: 0.0 };
        let r = gptq_quantize(&w, rows, cols, &h, &cfg).unwrap();
        assert_eq!(r.q.groups(), 3);
        assert_eq!(r.q.scales.len(), rows * 3);
        let mut counts = [0usize; 3];
        for &g in &r.q.g_idx {
            counts[g as usize] += 1;
        }
        assert_eq!(counts, [8, 8, 4], "desc_act {desc_act}");
        if !desc_act {
            assert_eq!(r.q.g_idx, (0..cols as u32).map(|c| c / 8).collect::<Vec<_>>());
        }
        let got = r.q.dequantize();
        let want = reference_gptq(&w, rows, cols, &h.h, 3, Some(8), desc_act, false);
        let max = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        let bad: Vec<usize> = got.iter().zip(&want).enumerate().filter(|(_, (a, b))| (*a - *b).abs() > 1e-4).map(|(i, _)| i).collect();
        assert!(max < 1e-4, "desc_act {desc_act}: max diff {max} at {bad:?}");
    }
    // Static groups: the ragged last group's parameters are RTN's on the original weights.
    let cfg = GptqConfig { bits: 4, group_size: Some(8), sym: false, desc_act: true, static_groups: true, blocksize: 8, damp_percent: 0.01, mse: 0.0 };
    let r = gptq_quantize(&w, rows, cols, &h, &cfg).unwrap();
    let rtn = deco_quant::scheme::quantize_rtn_ragged(&w, rows, cols, &Scheme { bits: 4, sym: false, granularity: Granularity::PerGroup(8) }).unwrap();
    assert_eq!(r.q.scales, rtn.scales);
    assert_eq!(r.q.g_idx, rtn.g_idx);
}

/// Rows are quantized independently (Algorithm 1 shares only H⁻¹ between them), so the
/// parallel row chunks of `gptq_quantize` must give each row exactly what that row gets alone:
/// 70 rows (chunks of 32, 32 and 6) against 70 one-row calls, for every option that changes
/// the per-row loop.
#[test]
fn gptq_rows_are_independent_of_the_row_chunks() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let (rows, cols, tokens) = (70, 24, 64);
    let x = correlated_x(&mut rng, tokens, cols);
    let w = randn(&mut rng, rows * cols);
    let h = hessian_of(&x, tokens, cols);
    for (group, desc_act, static_groups, mse) in [(None, false, false, 0.0), (Some(8), true, false, 2.4), (Some(8), true, true, 0.0), (Some(16), false, false, 2.4)] {
        let cfg = GptqConfig { bits: 3, group_size: group, sym: false, damp_percent: 0.01, desc_act, static_groups, blocksize: 8, mse };
        let all = gptq_quantize(&w, rows, cols, &h, &cfg).unwrap();
        let groups = all.q.groups();
        let mut loss = 0.0;
        for r in 0..rows {
            let one = gptq_quantize(&w[r * cols..(r + 1) * cols], 1, cols, &h, &cfg).unwrap();
            assert_eq!(&all.q.codes[r * cols..(r + 1) * cols], &one.q.codes[..], "{cfg:?}: codes of row {r}");
            assert_eq!(&all.q.scales[r * groups..(r + 1) * groups], &one.q.scales[..], "{cfg:?}: scales of row {r}");
            assert_eq!(&all.q.zeros[r * groups..(r + 1) * groups], &one.q.zeros[..], "{cfg:?}: zeros of row {r}");
            assert_eq!(all.q.g_idx, one.q.g_idx);
            loss += one.loss;
        }
        assert!((all.loss - loss).abs() <= 1e-9 * loss, "{cfg:?}: loss {} vs {loss}", all.loss);
    }
    assert!(gptq_quantize(&[], 0, cols, &h, &GptqConfig::default()).is_err());
}

#[test]
fn gptq_desc_act_g_idx_and_static_groups() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let (rows, cols, tokens) = (4, 16, 64);
    let x: Vec<f32> = correlated_x(&mut rng, tokens, cols).iter().enumerate().map(|(i, v)| v * (1.0 + (i % cols) as f32)).collect();
    let w = randn(&mut rng, rows * cols);
    let h = hessian_of(&x, tokens, cols);
    let mut order: Vec<usize> = (0..cols).collect();
    order.sort_by(|&a, &b| h.h[b * cols + b].total_cmp(&h.h[a * cols + a]));
    let cfg = GptqConfig { bits: 4, group_size: Some(4), sym: false, damp_percent: 0.01, desc_act: true, static_groups: false, blocksize: 4, mse: 0.0 };
    let r = gptq_quantize(&w, rows, cols, &h, &cfg).unwrap();
    for (pos, &c) in order.iter().enumerate() {
        assert_eq!(r.q.g_idx[c] as usize, pos / 4, "column {c}");
    }
    let cfg_s = GptqConfig { static_groups: true, ..cfg };
    let rs = gptq_quantize(&w, rows, cols, &h, &cfg_s).unwrap();
    assert_eq!(rs.q.g_idx, (0..cols as u32).map(|c| c / 4).collect::<Vec<_>>());
    // Static groups: parameters are those of RTN on the original weights.
    let rtn = quantize_rtn(&w, rows, cols, &Scheme { bits: 4, sym: false, granularity: Granularity::PerGroup(4) }).unwrap();
    assert_eq!(rs.q.scales, rtn.scales);
    assert_eq!(rs.q.zeros, rtn.zeros);
}

#[test]
fn gptq_dead_columns_and_errors() {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let (rows, cols, tokens) = (3, 8, 32);
    let mut x = correlated_x(&mut rng, tokens, cols);
    for t in 0..tokens {
        x[t * cols + 2] = 0.0;
    }
    let w = randn(&mut rng, rows * cols);
    let h = hessian_of(&x, tokens, cols);
    let r = gptq_quantize(&w, rows, cols, &h, &GptqConfig { group_size: None, ..GptqConfig::default() }).unwrap();
    let d = r.q.dequantize();
    for row in 0..rows {
        assert_eq!(d[row * cols + 2], 0.0);
    }
    assert!(gptq_quantize(&w, rows, cols, &h, &GptqConfig { group_size: Some(0), ..GptqConfig::default() }).is_err());
    assert!(gptq_quantize(&w, rows, cols, &h, &GptqConfig { bits: 7, ..GptqConfig::default() }).is_err());
    assert!(gptq_quantize(&w[1..], rows, cols, &h, &GptqConfig::default()).is_err());
}

#[test]
fn gptq_beats_rtn_on_correlated_inputs() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let (rows, cols, tokens) = (32, 64, 512);
    let x = correlated_x(&mut rng, tokens, cols);
    let w = randn(&mut rng, rows * cols);
    let h = hessian_of(&x, tokens, cols);
    for bits in [3u32, 4] {
        let g = GptqConfig { bits, group_size: Some(32), sym: true, blocksize: 16, ..GptqConfig::default() };
        let gq = gptq_quantize(&w, rows, cols, &h, &g).unwrap().q.dequantize();
        let rq = quantize_rtn(&w, rows, cols, &Scheme { bits, sym: true, granularity: Granularity::PerGroup(32) }).unwrap().dequantize();
        let (eg, er) = (out_err(&x, &w, &gq, tokens, rows, cols), out_err(&x, &w, &rq, tokens, rows, cols));
        assert!(eg < 0.8 * er, "bits {bits}: gptq {eg} rtn {er}");
    }
}

/// A layer whose inputs have a few channels 20-50x larger than the rest (the LLM outlier
/// pattern), weights of unit scale.
fn outlier_layer(seed: u64) -> (Vec<f32>, Vec<f32>, usize, usize, usize, Vec<usize>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (rows, cols, tokens) = (48, 64, 256);
    let mut x = randn(&mut rng, tokens * cols);
    let planted = vec![3usize, 17, 40];
    for t in 0..tokens {
        for (k, &c) in planted.iter().enumerate() {
            x[t * cols + c] = x[t * cols + c] * 5.0 + 25.0 + 5.0 * k as f32;
        }
    }
    let w: Vec<f32> = randn(&mut rng, rows * cols).iter().map(|v| v * 0.05).collect();
    (x, w, rows, cols, tokens, planted)
}

#[test]
fn methods_beat_rtn_on_planted_outliers() {
    let (x, w, rows, cols, tokens, planted) = outlier_layer(1);
    let scheme = Scheme { bits: 4, sym: false, granularity: Granularity::PerChannel };
    let rtn = quantize_rtn(&w, rows, cols, &scheme).unwrap().dequantize();
    let e_rtn = out_err(&x, &w, &rtn, tokens, rows, cols);

    // GPTQ W4 per-channel.
    let h = hessian_of(&x, tokens, cols);
    let g = gptq_quantize(&w, rows, cols, &h, &GptqConfig { bits: 4, group_size: None, sym: false, blocksize: 16, ..GptqConfig::default() }).unwrap();
    let e_gptq = out_err(&x, &w, &g.q.dequantize(), tokens, rows, cols);
    assert!(e_gptq < e_rtn, "gptq {e_gptq} rtn {e_rtn}");

    // AWQ W4 per-channel: scale search with the layer output as the block, then clipping.
    let xm = act_mean_abs(&x, tokens, cols);
    let org = matmul_abt(&x, &w, tokens, cols, rows);
    let mut loss = |cand: &ScaleCandidate<'_>| -> deco_quant::Result<f64> {
        let o = matmul_abt(&x, &cand.weight(0), tokens, cols, rows);
        Ok(o.iter().zip(&org).map(|(a, b)| (a - b).powi(2)).sum::<f64>() / o.len() as f64)
    };
    let s = search_scale(&xm, &[(&w, rows)], cols, &scheme, 20, &mut loss).unwrap();
    assert!(s.ratio > 0.0, "the search should protect the salient channels (ratio {})", s.ratio);
    assert_eq!(s.losses.len(), 20);
    // Scaled weight and inputs: fold s into W, divide x.
    let mut ws = w.clone();
    for r in 0..rows {
        for c in 0..cols {
            ws[r * cols + c] *= s.scales[c];
        }
    }
    let xs: Vec<f32> = x.iter().enumerate().map(|(i, v)| v / s.scales[i % cols]).collect();
    let clip = search_clip(&ws, rows, cols, &xs, tokens, &scheme, 20, 0.5).unwrap();
    apply_clip(&mut ws, rows, cols, cols, &clip);
    let q = quantize_rtn(&ws, rows, cols, &scheme).unwrap().dequantize();
    let awq: Vec<f32> = q.iter().enumerate().map(|(i, v)| v / s.scales[i % cols]).collect();
    let e_awq = out_err(&x, &w, &awq, tokens, rows, cols);
    let e_awq_noclip = out_err(&x, &w, &scaled_fake_quant(&w, rows, cols, &s.scales, &scheme).unwrap(), tokens, rows, cols);
    assert!(e_awq_noclip < e_rtn, "awq scale only {e_awq_noclip} rtn {e_rtn}");
    assert!(e_awq < e_rtn, "awq {e_awq} rtn {e_rtn}");

    // W8A8: naive per-token int8 activations vs SmoothQuant vs LLM.int8().
    let w8 = absmax_int8_rows(&w, rows, cols);
    let xq = quant_act_per_token(&x, tokens, cols, None);
    let naive = {
        let a = matmul_abt(&x, &w, tokens, cols, rows);
        let b = matmul_abt(&xq, &w8, tokens, cols, rows);
        a.iter().zip(&b).map(|(p, q)| (p - q).powi(2)).sum::<f64>()
    };
    let sm = smooth_scales(&act_max_abs(&x, tokens, cols), &[(&w, rows)], cols, 0.5).unwrap();
    let mut wsm = w.clone();
    for r in 0..rows {
        for c in 0..cols {
            wsm[r * cols + c] *= sm[c];
        }
    }
    let xsm: Vec<f32> = x.iter().enumerate().map(|(i, v)| v / sm[i % cols]).collect();
    let smooth = {
        let a = matmul_abt(&x, &w, tokens, cols, rows);
        let b = matmul_abt(&quant_act_per_token(&xsm, tokens, cols, None), &absmax_int8_rows(&wsm, rows, cols), tokens, cols, rows);
        a.iter().zip(&b).map(|(p, q)| (p - q).powi(2)).sum::<f64>()
    };
    assert!(smooth < naive, "smoothquant {smooth} naive w8a8 {naive}");
    for mask in [outlier_columns(&x, tokens, cols, 6.0), outlier_columns_auto(&act_max_abs(&x, tokens, cols))] {
        for &c in &planted {
            assert!(mask[c], "planted channel {c} not detected");
        }
        assert!(mask.iter().filter(|&&m| m).count() <= 6);
        let a = matmul_abt(&x, &w, tokens, cols, rows);
        let b = matmul_abt(&quant_act_per_token(&x, tokens, cols, Some(&mask)), &w8, tokens, cols, rows);
        let int8 = a.iter().zip(&b).map(|(p, q)| (p - q).powi(2)).sum::<f64>();
        assert!(int8 < naive, "llm.int8 {int8} naive w8a8 {naive}");
    }
}

/// The scale search's candidates, computed row by row, are bit for bit the whole-matrix
/// `Q(W·diag(s))·diag(s)⁻¹` of `scaled_fake_quant` (per group, dividing and ragged; per
/// channel; per tensor; symmetric and not; 2 to 8 bits; zeros and a NaN), for every grid point.
#[test]
fn awq_scale_candidates_rows_equal_the_whole_matrix() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let (cols, tokens) = (80, 16);
    let x = randn(&mut rng, tokens * cols);
    let xm = act_mean_abs(&x, tokens, cols);
    let (mut w1, mut w2) = (randn(&mut rng, 24 * cols), randn(&mut rng, 7 * cols));
    // Signed zeros, a whole zero group and a NaN take the edge paths of the range.
    w1[5] = 0.0;
    w1[6] = -0.0;
    w1[2 * cols..2 * cols + 16].fill(0.0);
    w2[3] = f32::NAN;
    let weights: [(&[f32], usize); 2] = [(&w1, 24), (&w2, 7)];
    for granularity in [Granularity::PerGroup(16), Granularity::PerGroup(32), Granularity::PerGroup(128), Granularity::PerChannel, Granularity::PerTensor] {
        for (bits, sym) in [(2, false), (3, true), (4, false), (4, true), (8, false)] {
            let scheme = Scheme { bits, sym, granularity };
            let mut seen = 0;
            let mut check = |cand: &ScaleCandidate<'_>| -> deco_quant::Result<f64> {
                for (i, &(w, rows)) in weights.iter().enumerate() {
                    let want = scaled_fake_quant(w, rows, cols, cand.scales, &scheme).unwrap();
                    let got = cand.weight(i);
                    assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{scheme:?}, weight {i}");
                }
                seen += 1;
                Ok(seen as f64)
            };
            search_scale(&xm, &weights, cols, &scheme, 5, &mut check).unwrap();
            assert_eq!(seen, 5);
        }
    }
}

/// The clipping search picks, per row and group, the clip value a brute-force llm-awq
/// `auto_clip_layer` picks (the f64 output error of every candidate over the tokens), or one
/// whose error is within rounding of it: the search computes the same sums through the group's
/// Gram matrix.
#[test]
fn awq_clip_search_matches_brute_force_reference() {
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    let (tokens, rows, cols, gs) = (96usize, 7usize, 80usize, 32usize);
    let mut x = randn(&mut rng, tokens * cols);
    for t in 0..tokens {
        x[t * cols + 5] *= 8.0;
    }
    let mut w = randn(&mut rng, rows * cols);
    w[3 * cols + 40] = 6.0;
    let scheme = Scheme { bits: 3, sym: false, granularity: Granularity::PerGroup(gs) };
    let (n_grid, max_shrink) = (20usize, 0.5);
    let clip = search_clip(&w, rows, cols, &x, tokens, &scheme, n_grid, max_shrink).unwrap();
    let groups = cols.div_ceil(gs);
    assert_eq!(clip.len(), rows * groups);
    let row_scheme = Scheme { granularity: Granularity::PerChannel, ..scheme };
    for g in 0..groups {
        let (c0, c1) = (g * gs, ((g + 1) * gs).min(cols));
        let n = c1 - c0;
        for r in 0..rows {
            let wr = &w[r * cols + c0..r * cols + c1];
            let mx = wr.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            // The output error of clip value m, in f64 over every token.
            let err_of = |m: f32| -> f64 {
                let clamped: Vec<f32> = wr.iter().map(|v| v.clamp(-m, m)).collect();
                let q = quantize_rtn(&clamped, 1, n, &row_scheme).unwrap().dequantize();
                (0..tokens)
                    .map(|t| {
                        let xt = &x[t * cols + c0..t * cols + c1];
                        let d: f64 = xt.iter().zip(&q).zip(wr).map(|((&a, &b), &c)| a as f64 * (b as f64 - c as f64)).sum();
                        d * d
                    })
                    .sum()
            };
            let steps = (max_shrink * n_grid as f64) as usize;
            let best = (0..steps).map(|i| err_of(mx * (1.0 - i as f32 / n_grid as f32))).fold(f64::INFINITY, f64::min);
            let got = err_of(clip[r * groups + g]);
            assert!(got <= best * (1.0 + 1e-5) + 1e-12, "row {r} group {g}: clip {} error {got}, best {best}", clip[r * groups + g]);
        }
    }
}

#[test]
fn awq_and_smoothquant_scales_finite_for_zero_channels() {
    let x_mean = [0.0f32, 1.0, 4.0, 0.0];
    for i in 0..20 {
        let s = deco_quant::awq::scales_for_ratio(&x_mean, i as f64 / 20.0);
        assert!(s.iter().all(|v| v.is_finite() && *v > 0.0));
    }
    // Hand value: r = 0.5: s = [1e-4 -> 1e-4, 1, 2, 1e-4]; norm sqrt(2 * 1e-4).
    let s = deco_quant::awq::scales_for_ratio(&x_mean, 0.5);
    let norm = (2.0f64 * 1e-4).sqrt();
    assert!((s[2] as f64 - 2.0 / norm).abs() < 1e-3);
    let w = [0.0f32, 1.0, 2.0, 0.0];
    let sm = smooth_scales(&[0.0, 4.0, 9.0, 1.0], &[(&w, 1)], 4, 0.5).unwrap();
    assert!(sm.iter().all(|v| v.is_finite() && *v > 0.0));
    assert!((sm[1] - 2.0).abs() < 1e-6 && (sm[2] - 3.0 / 2f32.sqrt()).abs() < 1e-6);
    assert!(smooth_scales(&[1.0], &[(&[1.0], 1)], 1, 1.5).is_err());
}

#[test]
fn nf4_codebook_and_storage() {
    let m = dynamic_map();
    assert_eq!(m.len(), 256);
    assert!(m.windows(2).all(|p| p[0] <= p[1]));
    assert!(m.contains(&0.0) && m.contains(&1.0));
    assert_eq!(NF4_CODE[7], 0.0);
    // Exact codebook values times a power-of-two absmax survive the round trip up to the
    // double-quantization error of the absmax.
    let w: Vec<f32> = (0..128).map(|i| NF4_CODE[i % 16] * 2.0).collect();
    let t = Nf4Tensor::quantize(&w, 64).unwrap();
    assert_eq!(t.codes[..16], (0..16u8).collect::<Vec<_>>()[..]);
    let bpw = Nf4Tensor::quantize(&vec![1.0f32; 64 * 256], 64).unwrap().bits_per_weight();
    assert!((bpw - (4.0 + 8.0 / 64.0 + 64.0 / (64.0 * 256.0))).abs() < 1e-9, "{bpw}");
    assert!(Nf4Tensor::quantize(&w, 0).is_err());
}
