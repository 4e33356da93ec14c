//! The four distribution statistics the top-p head sees.
//!
//! Source: AutoDeco `model/templlm_auto.py`, `TopPHead.compute_prob_stats`, applied to
//! `softmax(logits / (T + 1e-8))`: max probability, entropy `-Σ p ln(p + 1e-8)`, the unbiased
//! variance of the probabilities (`torch.var`, divisor `V - 1`) and the top-5 mass.

/// Number of statistics.
pub const NUM_STATS: usize = 4;

/// `[max_prob, entropy, variance, top5_mass]` of `softmax(logits / (temperature + 1e-8))`.
/// `logits`: one row, length `vocab` (≥ 2). `-inf` entries have probability 0.
///
/// One pass over the row after the max: `e_i = exp(s_i)` with `s_i = (z_i − max) / T` in f32,
/// sums in f64. The entropy uses `H = ln S − Σ e_i s_i / S` (exact `−Σ p ln p`, no per-token
/// logarithm); the reference's `ln(p + 1e-8)` differs from it by at most `V · 1e-8 · O(1)`
/// (about 1e-4 for V = 49,152), far below what the head resolves. Variance: `(Σ p² − 1/V) / (V − 1)`.
pub fn prob_stats(logits: &[f32], temperature: f32) -> [f32; NUM_STATS] {
    let inv_t = 1.0 / (temperature + 1e-8);
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() || logits.len() < 2 {
        return [0.0; NUM_STATS];
    }
    let (mut sum, mut sum_es, mut sum_e2) = (0.0f64, 0.0f64, 0.0f64);
    let mut top5 = [0.0f32; 5];
    // Chunks of 8 with f32 partial sums keep the loop vectorizable; each chunk is added in f64.
    for chunk in logits.chunks(256) {
        let (mut s0, mut s1, mut s2) = (0.0f32, 0.0f32, 0.0f32);
        for &z in chunk {
            let x = (z - max) * inv_t;
            let e = x.exp();
            s0 += e;
            // e · x → 0 as x → -inf; guard the 0 · -inf of masked logits.
            if e > 0.0 {
                s1 += e * x;
            }
            s2 += e * e;
            if e > top5[4] {
                top5[4] = e;
                top5.sort_by(|a, b| b.total_cmp(a));
            }
        }
        sum += f64::from(s0);
        sum_es += f64::from(s1);
        sum_e2 += f64::from(s2);
    }
    let n = logits.len() as f64;
    let entropy = sum.ln() - sum_es / sum;
    let sum_p2 = sum_e2 / (sum * sum);
    let var = ((sum_p2 - 1.0 / n) / (n - 1.0)).max(0.0);
    let top: f64 = top5.iter().map(|&e| f64::from(e)).sum::<f64>() / sum;
    [(f64::from(top5[0]) / sum) as f32, entropy as f32, var as f32, top as f32]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_row() {
        let s = prob_stats(&[0.0; 10], 1.0);
        assert!((s[0] - 0.1).abs() < 1e-6);
        assert!((f64::from(s[1]) - (10f64).ln()).abs() < 1e-5);
        assert!(s[2].abs() < 1e-9);
        assert!((s[3] - 0.5).abs() < 1e-6);
    }

    #[test]
    fn hand_computed_row() {
        // p = softmax([ln 1, ln 2, ln 3, ln 4] / 1) = [0.1, 0.2, 0.3, 0.4]
        let l: Vec<f32> = [1.0f32, 2.0, 3.0, 4.0].iter().map(|x| x.ln()).collect();
        let s = prob_stats(&l, 1.0);
        let p = [0.1f64, 0.2, 0.3, 0.4];
        let h: f64 = -p.iter().map(|x| x * x.ln()).sum::<f64>();
        let var: f64 = p.iter().map(|x| (x - 0.25) * (x - 0.25)).sum::<f64>() / 3.0;
        assert!((f64::from(s[0]) - 0.4).abs() < 1e-6);
        assert!((f64::from(s[1]) - h).abs() < 1e-6);
        // Masked (-inf) logits have probability 0.
        let m = prob_stats(&[0.0, f32::NEG_INFINITY, 0.0], 1.0);
        assert!((m[0] - 0.5).abs() < 1e-6 && (f64::from(m[1]) - 2f64.ln()).abs() < 1e-6 && (m[3] - 1.0).abs() < 1e-6);
        assert!((f64::from(s[2]) - var).abs() < 1e-7);
        assert!((f64::from(s[3]) - 1.0).abs() < 1e-6);
    }
}
