//! Every selector prunes exactly the requested number of weights / keeps the N:M pattern, and
//! the sparse storage round-trips exactly (proptest).

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use deco_compress::mask::{Pattern, pruned_count};
use deco_compress::sparse::SparseTensor;
use deco_compress::sparsegpt::{SparseGptConfig, sparsegpt_prune};
use deco_compress::unstructured::{ColumnNorms, Scope, magnitude_prune, wanda_prune};
use deco_quant::gptq::Hessian;
use proptest::prelude::*;

fn pattern() -> impl Strategy<Value = Pattern> {
    prop_oneof![
        (0.0f64..0.95).prop_map(Pattern::Unstructured),
        Just(Pattern::NM { n: 2, m: 4 }),
        Just(Pattern::NM { n: 1, m: 4 }),
        Just(Pattern::NM { n: 4, m: 8 }),
    ]
}

/// `(rows, cols, weights, activations [tokens, cols])` with `cols` a multiple of 8.
fn problem() -> impl Strategy<Value = (usize, usize, Vec<f32>, Vec<f32>)> {
    (1usize..6, 1usize..5, 4usize..24).prop_flat_map(|(rows, c8, tokens)| {
        let cols = 8 * c8;
        (
            Just(rows),
            Just(cols),
            proptest::collection::vec(-2.0f32..2.0, rows * cols),
            proptest::collection::vec(-3.0f32..3.0, tokens * cols),
        )
    })
}

fn check_mask(keep: &[bool], rows: usize, cols: usize, p: Pattern, per_row: bool) -> Result<(), TestCaseError> {
    match p {
        Pattern::Unstructured(s) => {
            if per_row {
                for r in 0..rows {
                    let z = keep[r * cols..(r + 1) * cols].iter().filter(|&&k| !k).count();
                    prop_assert_eq!(z, pruned_count(s, cols));
                }
            } else {
                prop_assert_eq!(keep.iter().filter(|&&k| !k).count(), pruned_count(s, rows * cols));
            }
        }
        Pattern::NM { n, m } => {
            for g in keep.chunks(m) {
                prop_assert_eq!(g.iter().filter(|&&k| k).count(), n);
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn masks_have_exact_sparsity((rows, cols, w, x) in problem(), p in pattern()) {
        let tokens = x.len() / cols;
        // Magnitude, per layer and per row.
        for scope in [Scope::Layer, Scope::Row] {
            let mut wm = w.clone();
            let m = magnitude_prune(&mut wm, rows, cols, p, scope).unwrap();
            check_mask(&m.keep, rows, cols, p, scope == Scope::Row)?;
            for (v, k) in wm.iter().zip(&m.keep) {
                prop_assert!(*k || *v == 0.0);
            }
            if let Pattern::Unstructured(_) = p {
                // Every kept |w| ≥ every pruned |w| in the comparison group.
                let group_len = if scope == Scope::Layer { rows * cols } else { cols };
                let groups: Vec<std::ops::Range<usize>> = (0..rows * cols).step_by(group_len).map(|g0| g0..g0 + group_len).collect();
                for g in groups {
                    let kept_min = g.clone().filter(|&i| m.keep[i]).map(|i| w[i].abs()).fold(f32::INFINITY, f32::min);
                    let pruned_max = g.filter(|&i| !m.keep[i]).map(|i| w[i].abs()).fold(0.0, f32::max);
                    prop_assert!(kept_min >= pruned_max);
                }
            }
        }
        // Wanda.
        let mut norms = ColumnNorms::new(cols);
        norms.add_batch(&x, tokens).unwrap();
        let mut ww = w.clone();
        let m = wanda_prune(&mut ww, rows, cols, &norms, p).unwrap();
        check_mask(&m.keep, rows, cols, p, true)?;
        // SparseGPT (blocks of 16 so that several blocks are exercised).
        let mut h = Hessian::new(cols);
        h.add_batch(&x, tokens).unwrap();
        let r = sparsegpt_prune(&w, rows, cols, &h, p, &SparseGptConfig { blocksize: 16, percdamp: 0.01 }).unwrap();
        check_mask(&r.mask.keep, rows, cols, p, false)?;
        for (v, k) in r.weights.iter().zip(&r.mask.keep) {
            prop_assert!(*k || *v == 0.0);
            prop_assert!(v.is_finite());
        }
    }

    #[test]
    fn sparse_storage_round_trip_is_exact(rows in 1usize..9, cols in 1usize..33, seed in any::<u64>(), s in 0.0f64..1.0) {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let data: Vec<f32> = (0..rows * cols).map(|_| if rng.random::<f64>() < s { 0.0 } else { f32::from_bits(rng.random::<u32>() & 0xbfff_ffff) }).collect();
        let t = SparseTensor::encode(&[rows, cols], &data);
        prop_assert_eq!(t.values.len(), data.iter().filter(|&&v| v != 0.0).count());
        let back = t.decode().unwrap();
        for (a, b) in data.iter().zip(&back) {
            prop_assert_eq!(a.to_bits(), b.to_bits());
        }
    }
}

#[test]
fn invalid_input_is_an_error_not_a_panic() {
    let mut w = vec![1.0f32; 12];
    assert!(magnitude_prune(&mut w, 2, 6, Pattern::NM { n: 2, m: 4 }, Scope::Row).is_err());
    assert!(magnitude_prune(&mut w, 3, 6, Pattern::Unstructured(0.5), Scope::Row).is_err());
    assert!(magnitude_prune(&mut w, 2, 6, Pattern::Unstructured(1.5), Scope::Row).is_err());
    let h = Hessian::new(6);
    assert!(sparsegpt_prune(&w, 2, 6, &h, Pattern::Unstructured(0.5), &SparseGptConfig { blocksize: 0, percdamp: 0.01 }).is_err());
    assert!(sparsegpt_prune(&w, 2, 6, &h, Pattern::Unstructured(0.5), &SparseGptConfig { blocksize: 4, percdamp: -1.0 }).is_err());
    assert!(sparsegpt_prune(&w, 3, 6, &h, Pattern::Unstructured(0.5), &SparseGptConfig::default()).is_err());
    let bad = SparseTensor { shape: vec![2, 4], mask: Some(vec![0xff]), values: vec![1.0; 3] };
    assert!(bad.decode().is_err());
}
