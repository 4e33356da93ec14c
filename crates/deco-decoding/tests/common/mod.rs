//! Shared helpers of the integration tests: independent softmax and a chi-square p-value.
#![allow(dead_code)]

/// Softmax in f64, written independently of the crate (`-inf` -> 0).
pub fn probs(logits: &[f32]) -> Vec<f64> {
    let m = logits
        .iter()
        .copied()
        .filter(|x| x.is_finite())
        .fold(f64::NEG_INFINITY, |a, b| a.max(f64::from(b)));
    let w: Vec<f64> = logits
        .iter()
        .map(|&x| {
            if x.is_finite() {
                (f64::from(x) - m).exp()
            } else {
                0.0
            }
        })
        .collect();
    let s: f64 = w.iter().sum();
    w.iter().map(|x| x / s).collect()
}

/// ln Γ(x) for x > 0 (Lanczos approximation, g = 7, n = 9; ~1e-15 relative).
pub fn ln_gamma(x: f64) -> f64 {
    const C: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    if x < 0.5 {
        // reflection
        let pi = std::f64::consts::PI;
        return (pi / (pi * x).sin()).ln() - ln_gamma(1.0 - x);
    }
    let x = x - 1.0;
    let mut a = C[0];
    let t = x + 7.5;
    for (i, c) in C.iter().enumerate().skip(1) {
        a += c / (x + i as f64);
    }
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + a.ln()
}

/// Regularized upper incomplete gamma Q(a, x) (series for x < a + 1, Lentz continued fraction
/// otherwise; Numerical Recipes §6.2).
pub fn gamma_q(a: f64, x: f64) -> f64 {
    if x <= 0.0 {
        return 1.0;
    }
    let gln = ln_gamma(a);
    if x < a + 1.0 {
        let mut ap = a;
        let mut sum = 1.0 / a;
        let mut del = sum;
        for _ in 0..10_000 {
            ap += 1.0;
            del *= x / ap;
            sum += del;
            if del.abs() < sum.abs() * 1e-15 {
                break;
            }
        }
        1.0 - sum * (-x + a * x.ln() - gln).exp()
    } else {
        let tiny = 1e-300;
        let mut b = x + 1.0 - a;
        let mut c = 1.0 / tiny;
        let mut d = 1.0 / b;
        let mut h = d;
        for i in 1..10_000 {
            let an = -(i as f64) * (i as f64 - a);
            b += 2.0;
            d = an * d + b;
            if d.abs() < tiny {
                d = tiny;
            }
            c = b + an / c;
            if c.abs() < tiny {
                c = tiny;
            }
            d = 1.0 / d;
            let del = d * c;
            h *= del;
            if (del - 1.0).abs() < 1e-15 {
                break;
            }
        }
        (-x + a * x.ln() - gln).exp() * h
    }
}

/// Survival function of the chi-square distribution with `df` degrees of freedom.
pub fn chi2_sf(stat: f64, df: usize) -> f64 {
    gamma_q(df as f64 / 2.0, stat / 2.0)
}

/// Pearson chi-square test of `counts` against probabilities `expected_p` over the categories
/// with `expected_p > 0`. Returns `(statistic, df, p_value)`. A category with probability 0 but
/// a nonzero count makes the p-value 0.
pub fn chi_square(counts: &[u64], expected_p: &[f64]) -> (f64, usize, f64) {
    let n: u64 = counts.iter().sum();
    let mut stat = 0.0;
    let mut cats = 0;
    for (&c, &p) in counts.iter().zip(expected_p) {
        if p > 0.0 {
            let e = p * n as f64;
            stat += (c as f64 - e).powi(2) / e;
            cats += 1;
        } else if c > 0 {
            return (f64::INFINITY, cats.max(2) - 1, 0.0);
        }
    }
    let df = cats - 1;
    (stat, df, chi2_sf(stat, df))
}

#[test]
fn chi2_sf_matches_tables() {
    // Known critical values: P(X > 3.841459) = 0.05 for df 1, P(X > 11.070498) = 0.05 for df 5,
    // P(X > 21.665994) = 0.01 for df 9; for df 2, sf(x) = exp(-x/2) exactly.
    assert!((chi2_sf(3.841_458_820_694_124, 1) - 0.05).abs() < 1e-9);
    assert!((chi2_sf(11.070_497_693_516_351, 5) - 0.05).abs() < 1e-9);
    assert!((chi2_sf(21.665_994_333_461_924, 9) - 0.01).abs() < 1e-9);
    for x in [0.1, 1.0, 2.0, 7.5, 30.0] {
        assert!(
            (chi2_sf(x, 2) - (-x / 2.0f64).exp()).abs() < 1e-12,
            "x = {x}"
        );
    }
    // Γ(5) = 24, Γ(0.5) = sqrt(pi)
    assert!((ln_gamma(5.0) - 24f64.ln()).abs() < 1e-12);
    assert!((ln_gamma(0.5) - std::f64::consts::PI.sqrt().ln()).abs() < 1e-12);
}
