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
/// Two passes over the row: the max and the five largest logits (the top-5 probabilities are
/// those of the top-5 logits), then `e_i = exp(s_i)` with `s_i = (z_i − max) / T` by a
/// branch-free polynomial [`exp_f32`] (vectorized by the compiler; AVX2+FMA code chosen at run
/// time where the CPU has it), f32 partial sums over chunks of 256 added in f64. The entropy
/// uses `H = ln S − Σ e_i s_i / S` (exact `−Σ p ln p`, no per-token logarithm); the reference's
/// `ln(p + 1e-8)` differs from it by at most `V · 1e-8 · O(1)` (about 1e-4 for V = 49,152), far
/// below what the head resolves. Variance: `(Σ p² − 1/V) / (V − 1)`.
pub fn prob_stats(logits: &[f32], temperature: f32) -> [f32; NUM_STATS] {
    let inv_t = 1.0 / (temperature + 1e-8);
    if logits.len() < 2 {
        return [0.0; NUM_STATS];
    }
    // Pass 1: the max and the five largest logits (rarely more than a comparison each).
    let mut top5 = [f32::NEG_INFINITY; 5];
    for &z in logits {
        if z > top5[4] {
            let mut i = 4;
            while i > 0 && z > top5[i - 1] {
                top5[i] = top5[i - 1];
                i -= 1;
            }
            top5[i] = z;
        }
    }
    let max = top5[0];
    if !max.is_finite() {
        return [0.0; NUM_STATS];
    }
    // Pass 2: Σ e, Σ e·s, Σ e².
    let (sum, sum_es, sum_e2) = exp_sums(logits, max, inv_t);
    let n = logits.len() as f64;
    let entropy = sum.ln() - sum_es / sum;
    let sum_p2 = sum_e2 / (sum * sum);
    let var = ((sum_p2 - 1.0 / n) / (n - 1.0)).max(0.0);
    let top: f64 = top5.iter().map(|&z| f64::from(((z - max) * inv_t).exp())).sum::<f64>() / sum;
    [(1.0 / sum) as f32, entropy as f32, var as f32, top as f32]
}

/// `(Σ e_i, Σ e_i s_i, Σ e_i²)` with `s_i = (z_i − max) · inv_t`, `e_i = exp_f32(s_i)`.
fn exp_sums(logits: &[f32], max: f32, inv_t: f32) -> (f64, f64, f64) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has AVX2 and FMA (checked just above).
        return unsafe { exp_sums_avx2(logits, max, inv_t) };
    }
    exp_sums_body(logits, max, inv_t)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_sums_avx2(logits: &[f32], max: f32, inv_t: f32) -> (f64, f64, f64) {
    exp_sums_body(logits, max, inv_t)
}

#[inline(always)]
fn exp_sums_body(logits: &[f32], max: f32, inv_t: f32) -> (f64, f64, f64) {
    let (mut sum, mut sum_es, mut sum_e2) = (0.0f64, 0.0f64, 0.0f64);
    for chunk in logits.chunks(256) {
        // Eight lanes of partial sums, so that the loop is a vector loop.
        let (mut s0, mut s1, mut s2) = ([0.0f32; 8], [0.0f32; 8], [0.0f32; 8]);
        let mut it = chunk.chunks_exact(8);
        for c in &mut it {
            for l in 0..8 {
                let x = ((c[l] - max) * inv_t).max(EXP_MIN);
                let e = exp_f32(x);
                s0[l] += e;
                s1[l] += e * x;
                s2[l] += e * e;
            }
        }
        for &z in it.remainder() {
            let x = ((z - max) * inv_t).max(EXP_MIN);
            let e = exp_f32(x);
            s0[0] += e;
            s1[0] += e * x;
            s2[0] += e * e;
        }
        sum += s0.iter().map(|&v| f64::from(v)).sum::<f64>();
        sum_es += s1.iter().map(|&v| f64::from(v)).sum::<f64>();
        sum_e2 += s2.iter().map(|&v| f64::from(v)).sum::<f64>();
    }
    (sum, sum_es, sum_e2)
}

/// Below this `exp_f32` returns exactly 0 (`e^-87.3` ≈ 1.2e-38 is the smallest normal f32
/// scale); masked `-inf` logits land here.
const EXP_MIN: f32 = -87.3;

/// `e^x` for `x ∈ [EXP_MIN, 0]` (`s_i ≤ 0` here) without branches: `x = n ln 2 + r`,
/// `|r| ≤ ln 2 / 2`, `e^r` by Cephes' `expf` polynomial (relative error about 1e-7, one or two
/// f32 ulps), `2^n` built in the exponent bits; exactly 0 at `x = EXP_MIN`.
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split in two (Cephes C1, C2) so that n · C1 is exact.
    const C1: f32 = 0.693_359_4;
    const C2: f32 = -2.121_944_4e-4;
    // Rounds to nearest without `round` (SSE2 has no rounding instruction): 1.5 · 2^23.
    const MAGIC: f32 = 12_582_912.0;
    let n = (x * LOG2E + MAGIC) - MAGIC;
    let r = x - n * C1 - n * C2;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5; // Cephes 5.0000001201e-1, the same f32
    let y = p * (r * r) + r + 1.0;
    // n ∈ [-126, 0] here: a normal power of two.
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    if x <= EXP_MIN { 0.0 } else { y * scale }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_f32_is_within_two_ulps() {
        let mut worst = 0.0f64;
        let mut x = EXP_MIN + 1e-3;
        while x <= 0.0 {
            let want = f64::from(x).exp();
            let got = f64::from(exp_f32(x));
            worst = worst.max((got - want).abs() / want);
            x += 0.001_37;
        }
        assert!(worst < 2.5e-7, "relative error {worst:e}");
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(EXP_MIN), 0.0);
    }

    /// The statistics in f64 from their definitions (softmax, −Σ p ln p, unbiased variance,
    /// sorted top-5 mass).
    fn reference(l: &[f32], t: f32) -> [f64; 4] {
        let inv = 1.0 / (f64::from(t) + 1e-8);
        let m = l.iter().map(|&z| f64::from(z)).fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = l.iter().map(|&z| ((f64::from(z) - m) * inv).exp()).collect();
        let s: f64 = e.iter().sum();
        let p: Vec<f64> = e.iter().map(|v| v / s).collect();
        let h = -p.iter().filter(|&&v| v > 0.0).map(|v| v * v.ln()).sum::<f64>();
        let n = p.len() as f64;
        let var = p.iter().map(|v| (v - 1.0 / n).powi(2)).sum::<f64>() / (n - 1.0);
        let mut q = p.clone();
        q.sort_by(|a, b| b.total_cmp(a));
        [q[0], h, var, q.iter().take(5).sum()]
    }

    #[test]
    fn random_rows_match_the_f64_definitions() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32
        };
        for (vocab, scale, t) in [(2usize, 1.0f32, 1.0f32), (7, 4.0, 0.3), (1000, 10.0, 1.0), (49_152, 12.0, 0.7), (3001, 30.0, 1.9)] {
            let mut row: Vec<f32> = (0..vocab).map(|_| (next() - 0.5) * 2.0 * scale).collect();
            if vocab > 10 {
                row[3] = f32::NEG_INFINITY;
            }
            let got = prob_stats(&row, t);
            let want = reference(&row, t);
            // Probabilities and the entropy (nats) within 1e-5 absolute; the variance (down to
            // 1e-10 for a flat row) within 1e-4 relative.
            let tol = [1e-5, 1e-5, 1e-4 * want[2] + 1e-14, 1e-5];
            for k in 0..4 {
                let err = (f64::from(got[k]) - want[k]).abs();
                assert!(err <= tol[k], "vocab {vocab} stat {k}: {} vs {} (error {err:e})", got[k], want[k]);
            }
        }
    }

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
