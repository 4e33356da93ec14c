//! Numerics on one logits row: max, log-sum-exp, softmax, log-softmax, argmax, orderings.
//!
//! Every function works on a row of `vocab_size` `f32` logits, treats `-inf` as "probability 0",
//! and accumulates sums in `f64` so that a 150k-token vocabulary does not lose mass to rounding.

use std::cmp::Ordering;

/// Largest logit of the row (NaN entries are ignored); `-inf` for an empty or all-`-inf` row.
pub fn max_logit(logits: &[f32]) -> f32 {
    // 16 independent running maxima (vectorized by the compiler), then their maximum: the
    // maximum of a set does not depend on the order, and `f32::max` skips NaN in every lane.
    let mut lanes = [f32::NEG_INFINITY; 16];
    let mut chunks = logits.chunks_exact(16);
    for c in &mut chunks {
        for (l, &x) in lanes.iter_mut().zip(c) {
            *l = l.max(x);
        }
    }
    lanes.iter().chain(chunks.remainder()).copied().fold(f32::NEG_INFINITY, f32::max)
}

/// Index of the largest logit; ties go to the lowest token id. `None` when the row is empty or
/// every entry is `-inf` or NaN.
///
/// This is the greedy rule of every decoder in this crate (Hugging Face's `argmax`,
/// llama.cpp's `llama_sampler_init_greedy` both return the first maximum).
pub fn argmax(logits: &[f32]) -> Option<usize> {
    // The maximum first (a vectorized pass), then its first position: the lowest id among the
    // ties, never a NaN (NaN equals nothing) nor `-inf` (excluded by the check).
    let m = max_logit(logits);
    if m == f32::NEG_INFINITY {
        return None;
    }
    logits.iter().position(|&x| x == m)
}

/// `ln(sum_i exp(logits[i]))` computed stably: the max is subtracted, each term is an `f32`
/// `exp` and the sum is accumulated in `f64`.
///
/// Returns `-inf` when every entry is `-inf` (or the row is empty).
pub fn log_sum_exp(logits: &[f32]) -> f64 {
    let m = max_logit(logits);
    if m == f32::NEG_INFINITY {
        return f64::NEG_INFINITY;
    }
    f64::from(m) + sum_exp_shifted(logits, m).ln()
}

/// `sum_i exp(logits[i] - m)` with `f32` terms and an `f64` accumulator (NaN entries skipped).
pub(crate) fn sum_exp_shifted(logits: &[f32], m: f32) -> f64 {
    // The exponentials of a piece first, then their sum in row order: the same terms added in
    // the same order as one fused loop, but the running sum is not saved and restored around
    // every `expf` call.
    const PIECE: usize = 256;
    let mut e = [0.0f32; PIECE];
    let mut total = 0.0f64;
    for c in logits.chunks(PIECE) {
        for (ei, &x) in e.iter_mut().zip(c) {
            *ei = (x - m).exp();
        }
        for (&ei, &x) in e.iter().zip(c) {
            if !x.is_nan() {
                total += f64::from(ei);
            }
        }
    }
    total
}

/// Softmax of the row: `p_i = exp(l_i) / sum_j exp(l_j)`, same length as the input.
///
/// `-inf` logits get probability exactly 0. An all-`-inf` row gives all zeros (there is no
/// distribution); callers that need one check [`max_logit`] first.
pub fn softmax(logits: &[f32]) -> Vec<f32> {
    let lse = log_sum_exp(logits);
    if lse == f64::NEG_INFINITY {
        return vec![0.0; logits.len()];
    }
    logits
        .iter()
        .map(|&x| (f64::from(x) - lse).exp() as f32)
        .collect()
}

/// Log-softmax of the row: `log p_i = l_i - logsumexp(l)`; `-inf` stays `-inf`.
///
/// An all-`-inf` row gives all `-inf`.
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let lse = log_sum_exp(logits);
    if lse == f64::NEG_INFINITY {
        return vec![f32::NEG_INFINITY; logits.len()];
    }
    logits
        .iter()
        .map(|&x| (f64::from(x) - lse) as f32)
        .collect()
}

/// Order "larger logit first, then lower id", the tie rule used by every sorted filter here.
pub(crate) fn desc_then_id(logits: &[f32], a: usize, b: usize) -> Ordering {
    logits[b].total_cmp(&logits[a]).then(a.cmp(&b))
}

/// The `k` best entries (largest logit first, ties by lower id) among those that are not `-inf`.
pub(crate) fn top_n(logits: &[f32], k: usize) -> Vec<usize> {
    if k == 0 {
        return Vec::new();
    }
    let mut idx: Vec<usize> = (0..logits.len())
        .filter(|&i| logits[i] > f32::NEG_INFINITY)
        .collect();
    if idx.len() > k {
        idx.select_nth_unstable_by(k - 1, |&a, &b| desc_then_id(logits, a, b));
        idx.truncate(k);
    }
    idx.sort_unstable_by(|&a, &b| desc_then_id(logits, a, b));
    idx
}

/// Value of the `k`-th largest logit (1-based; `k >= 1`), `-inf` if the row has fewer than `k`
/// entries that are not `-inf`.
pub(crate) fn kth_largest(logits: &[f32], k: usize) -> f32 {
    debug_assert!(k >= 1);
    let mut vals: Vec<f32> = logits
        .iter()
        .copied()
        .filter(|x| *x > f32::NEG_INFINITY)
        .collect();
    if vals.len() < k {
        return f32::NEG_INFINITY;
    }
    let (_, kth, _) = vals.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
    *kth
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_of_log_probs_recovers_them() {
        // logits = ln([0.5, 0.25, 0.25]) + 3 (a shift must not matter)
        let l = [0.5f32.ln() + 3.0, 0.25f32.ln() + 3.0, 0.25f32.ln() + 3.0];
        let p = softmax(&l);
        assert!((p[0] - 0.5).abs() < 1e-6 && (p[1] - 0.25).abs() < 1e-6);
        let lp = log_softmax(&l);
        assert!((lp[0] - 0.5f32.ln()).abs() < 1e-6);
    }

    #[test]
    fn neg_inf_entries_get_zero_mass_and_all_neg_inf_is_defined() {
        let ninf = f32::NEG_INFINITY;
        let p = softmax(&[0.0, ninf, 0.0]);
        assert_eq!(p, vec![0.5, 0.0, 0.5]);
        assert_eq!(softmax(&[ninf, ninf]), vec![0.0, 0.0]);
        assert_eq!(log_softmax(&[ninf]), vec![ninf]);
        assert_eq!(argmax(&[ninf, ninf]), None);
    }

    #[test]
    fn argmax_ties_go_to_lowest_id() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), Some(1));
        assert_eq!(argmax(&[f32::NAN, -1.0]), Some(1));
    }

    #[test]
    fn top_n_and_kth() {
        let l = [0.1, 5.0, 3.0, 5.0, f32::NEG_INFINITY];
        assert_eq!(top_n(&l, 3), vec![1, 3, 2]);
        assert_eq!(top_n(&l, 10), vec![1, 3, 2, 0]);
        assert_eq!(kth_largest(&l, 2), 5.0);
        assert_eq!(kth_largest(&l, 3), 3.0);
        assert_eq!(kth_largest(&l, 5), f32::NEG_INFINITY);
    }
}
