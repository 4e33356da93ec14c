//! The four distribution statistics the top-p head sees.
//!
//! Source: AutoDeco `model/templlm_auto.py`, `TopPHead.compute_prob_stats`, applied to
//! `softmax(logits / (T + 1e-8))`: max probability, entropy `-Σ p ln(p + 1e-8)`, the unbiased
//! variance of the probabilities (`torch.var`, divisor `V - 1`) and the top-5 mass.

/// Number of statistics.
pub const NUM_STATS: usize = 4;

/// `[max_prob, entropy, variance, top5_mass]` of `softmax(logits / (temperature + 1e-8))`,
/// computed in f64. `logits`: one row, length `vocab` (≥ 2). `-inf` entries have probability 0.
pub fn prob_stats(logits: &[f32], temperature: f32) -> [f32; NUM_STATS] {
    let t = f64::from(temperature) + 1e-8;
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() || logits.len() < 2 {
        return [0.0; NUM_STATS];
    }
    let mut sum = 0.0f64;
    let mut probs: Vec<f64> = logits
        .iter()
        .map(|&l| {
            let e = ((f64::from(l) - f64::from(max)) / t).exp();
            sum += e;
            e
        })
        .collect();
    let n = probs.len() as f64;
    let mut entropy = 0.0;
    let mut top5 = [0.0f64; 5];
    for p in &mut probs {
        *p /= sum;
        entropy -= *p * (*p + 1e-8).ln();
        if *p > top5[4] {
            top5[4] = *p;
            top5.sort_by(|a, b| b.total_cmp(a));
        }
    }
    let mean = 1.0 / n;
    let var = probs.iter().map(|p| (p - mean) * (p - mean)).sum::<f64>() / (n - 1.0);
    [top5[0] as f32, entropy as f32, var as f32, top5.iter().sum::<f64>() as f32]
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
        let h: f64 = -p.iter().map(|x| x * (x + 1e-8).ln()).sum::<f64>();
        let var: f64 = p.iter().map(|x| (x - 0.25) * (x - 0.25)).sum::<f64>() / 3.0;
        assert!((f64::from(s[0]) - 0.4).abs() < 1e-6);
        assert!((f64::from(s[1]) - h).abs() < 1e-6);
        assert!((f64::from(s[2]) - var).abs() < 1e-7);
        assert!((f64::from(s[3]) - 1.0).abs() < 1e-6);
    }
}
