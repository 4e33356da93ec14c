//! SparseGPT (blocked, lazy-update, Cholesky form) against a plain O(n³) implementation of the
//! paper's sequential OBS procedure written here in f64: explicit `H⁻¹` by Gauss-Jordan, one
//! column at a time, the OBS weight update `δ = -(w_j / [H_F⁻¹]_jj) · [H_F⁻¹]_{j,:}` for every
//! pruned weight of column `j`, then the Gaussian elimination of column `j` from `H_F⁻¹`
//! (Frantar & Alistarh 2023, eqs. 3-4). Mask selection uses the same rule (saliency
//! `w² / [H_F⁻¹]_jj` over 128-column-style blocks or N:M groups, from the weights as updated so far).

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use deco_compress::mask::{Pattern, pruned_count};
use deco_compress::sparsegpt::{SparseGptConfig, sparsegpt_prune};
use deco_quant::gptq::Hessian;
use rand::{Rng, SeedableRng};

fn inverse(a: &[f64], n: usize) -> Vec<f64> {
    let mut m = a.to_vec();
    let mut inv = vec![0.0; n * n];
    for i in 0..n {
        inv[i * n + i] = 1.0;
    }
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

/// Returns `(weights, keep)`.
fn naive(w: &[f32], rows: usize, n: usize, h: &[f64], pattern: Pattern, block: usize, percdamp: f64) -> (Vec<f64>, Vec<bool>) {
    let mut w: Vec<f64> = w.iter().map(|&v| v as f64).collect();
    let mut h = h.to_vec();
    let mean = (0..n).map(|i| h[i * n + i]).sum::<f64>() / n as f64;
    for i in 0..n {
        h[i * n + i] += percdamp * mean;
    }
    let mut hinv = inverse(&h, n); // H_F⁻¹ with F = {j, .., n-1} (earlier rows/cols eliminated)
    let mut keep = vec![true; rows * n];
    for j in 0..n {
        // Mask selection at the start of a block / group, with the current H_F⁻¹ diagonals:
        // [H_F⁻¹]_kk for k ≥ j is what eliminating columns j..k-1 would give; compute it by
        // eliminating on a copy.
        let sel_len = match pattern {
            Pattern::Unstructured(_) if j % block == 0 => (block).min(n - j),
            Pattern::NM { m, .. } if j % m == 0 => m,
            _ => 0,
        };
        if sel_len > 0 {
            let mut hc = hinv.clone();
            let mut d = vec![0.0; sel_len];
            for (k, dk) in d.iter_mut().enumerate() {
                let c = j + k;
                *dk = hc[c * n + c];
                let row: Vec<f64> = (0..n).map(|x| hc[c * n + x]).collect();
                for a in 0..n {
                    for b in 0..n {
                        hc[a * n + b] -= row[a] * row[b] / *dk;
                    }
                }
            }
            let sal = |r: usize, k: usize| w[r * n + j + k] * w[r * n + j + k] / d[k];
            match pattern {
                Pattern::Unstructured(s) => {
                    let cnt = pruned_count(s, rows * (j + sel_len)) - pruned_count(s, rows * j);
                    let mut all: Vec<(f64, usize, usize)> = (0..rows).flat_map(|r| (0..sel_len).map(move |k| (r, k))).map(|(r, k)| (sal(r, k), r, k)).collect();
                    all.sort_by(|a, b| a.0.total_cmp(&b.0).then((a.1, a.2).cmp(&(b.1, b.2))));
                    for &(_, r, k) in &all[..cnt] {
                        keep[r * n + j + k] = false;
                    }
                }
                Pattern::NM { n: kn, m } => {
                    for r in 0..rows {
                        let mut g: Vec<(f64, usize)> = (0..m).map(|k| (sal(r, k), k)).collect();
                        g.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
                        for &(_, k) in &g[..m - kn] {
                            keep[r * n + j + k] = false;
                        }
                    }
                }
            }
        }
        // OBS update of every row whose weight j is pruned.
        let djj = hinv[j * n + j];
        for r in 0..rows {
            if !keep[r * n + j] {
                let f = w[r * n + j] / djj;
                for c in j..n {
                    w[r * n + c] -= f * hinv[j * n + c];
                }
                w[r * n + j] = 0.0;
            }
        }
        // Eliminate column j: H_{F\j}⁻¹ = H_F⁻¹ - H_F⁻¹[:, j] H_F⁻¹[j, :] / [H_F⁻¹]_jj.
        let row: Vec<f64> = (0..n).map(|x| hinv[j * n + x]).collect();
        for a in 0..n {
            for b in 0..n {
                hinv[a * n + b] -= row[a] * row[b] / djj;
            }
        }
    }
    (w, keep)
}

#[test]
fn sparsegpt_matches_naive_sequential_obs() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let (rows, cols, tokens) = (70, 48, 96); // 70 rows: three parallel row chunks (32, 32, 6)
    let w: Vec<f32> = (0..rows * cols).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    // Correlated inputs so that the OBS update matters.
    let base: Vec<f32> = (0..tokens * 8).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let mix: Vec<f32> = (0..8 * cols).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let x: Vec<f32> = (0..tokens)
        .flat_map(|t| {
            let (base, mix) = (&base, &mix);
            (0..cols).map(move |c| (0..8).map(|k| base[t * 8 + k] * mix[k * cols + c]).sum::<f32>() + 0.1 * ((t * 31 + c * 7) % 13) as f32 / 13.0)
        })
        .collect();
    let mut h = Hessian::new(cols);
    h.add_batch(&x, tokens).unwrap();
    for (pattern, block) in [(Pattern::Unstructured(0.5), 16), (Pattern::Unstructured(0.3), 20), (Pattern::NM { n: 2, m: 4 }, 16), (Pattern::NM { n: 4, m: 8 }, 24)] {
        let cfg = SparseGptConfig { blocksize: block, percdamp: 0.01 };
        let got = sparsegpt_prune(&w, rows, cols, &h, pattern, &cfg).unwrap();
        let (want, keep) = naive(&w, rows, cols, &h.h, pattern, block, 0.01);
        assert_eq!(got.mask.keep, keep, "{pattern:?}: masks differ");
        let max = got.weights.iter().zip(&want).map(|(&a, &b)| (a as f64 - b).abs()).fold(0.0, f64::max);
        assert!(max < 1e-5, "{pattern:?}: max weight difference {max}");
        // The update matters: SparseGPT is not the masked original.
        let changed = got.weights.iter().zip(&w).zip(&keep).filter(|((a, b), k)| **k && (**a - **b).abs() > 1e-3).count();
        assert!(changed > rows * cols / 8, "{pattern:?}: only {changed} kept weights were updated");
        // Lower reconstruction error ‖(W - Ŵ) X‖ than the masked original with the same mask.
        let err = |what: &[f32]| -> f64 {
            (0..tokens).map(|t| (0..rows).map(|r| {
                let d: f64 = (0..cols).map(|c| (w[r * cols + c] - what[r * cols + c]) as f64 * x[t * cols + c] as f64).sum();
                d * d
            }).sum::<f64>()).sum()
        };
        let masked: Vec<f32> = w.iter().zip(&keep).map(|(&v, &k)| if k { v } else { 0.0 }).collect();
        assert!(err(&got.weights) < err(&masked), "{pattern:?}: SparseGPT error not below masking");
    }
}
