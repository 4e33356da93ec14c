//! GSM evaluation helpers: answer extraction and the unbiased pass@k estimator.

/// The number a model's output answers with: the number after the last `####` if there is one,
/// else the last number inside the last `\boxed{...}` (the form Qwen2.5 and most math-tuned
/// models answer in; as the Qwen2.5-Math evaluation's `extract_answer`), else the last number in
/// the text. Commas inside numbers and a trailing `.` are removed, `$`
/// and `%` ignored; returns the normalized number text (e.g. `"1250"`, `"-3.5"`).
pub fn extract_answer(output: &str) -> Option<String> {
    let tail = match output.rfind("####") {
        Some(i) => {
            let after = &output[i + 4..];
            if let Some(n) = numbers(after).into_iter().next() {
                return Some(n);
            }
            output
        }
        None => output,
    };
    if let Some(i) = tail.rfind("\\boxed{") {
        let inner = &tail[i + "\\boxed{".len()..];
        // The braces' content, nested braces included (`\boxed{\frac{1}{2}}`); an unclosed box
        // (a cut-off answer) runs to the end.
        let mut depth = 1usize;
        let end = inner
            .char_indices()
            .find(|&(_, c)| {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    _ => {}
                }
                depth == 0
            })
            .map_or(inner.len(), |(j, _)| j);
        if let Some(n) = numbers(&inner[..end]).pop() {
            return Some(n);
        }
    }
    numbers(tail).pop()
}

fn numbers(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let chars: Vec<char> = text.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let neg = c == '-' && i + 1 < chars.len() && chars[i + 1].is_ascii_digit() && (i == 0 || !chars[i - 1].is_ascii_alphanumeric());
        if c.is_ascii_digit() || neg {
            let mut s = String::new();
            if neg {
                s.push('-');
                i += 1;
            }
            while i < chars.len() {
                let d = chars[i];
                if d.is_ascii_digit() {
                    s.push(d);
                } else if (d == ',' || d == '.') && i + 1 < chars.len() && chars[i + 1].is_ascii_digit() {
                    if d == '.' {
                        s.push('.');
                    }
                } else {
                    break;
                }
                i += 1;
            }
            out.push(normalize(&s));
        } else {
            i += 1;
        }
    }
    out
}

fn normalize(s: &str) -> String {
    match s.split_once('.') {
        Some((int, frac)) => {
            let frac = frac.trim_end_matches('0');
            if frac.is_empty() { int.to_string() } else { format!("{int}.{frac}") }
        }
        None => s.to_string(),
    }
}

/// True when `output`'s extracted answer equals `reference` (both normalized).
pub fn is_correct(output: &str, reference: &str) -> bool {
    let r = numbers(reference).pop();
    match (extract_answer(output), r) {
        (Some(a), Some(b)) => a == b,
        _ => false,
    }
}

/// Unbiased pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", §2.1,
/// Eq. 1): `1 − C(n − c, k) / C(n, k)` for `n` samples of which `c` are correct, computed as
/// `1 − Π_{i = n−c+1}^{n} (1 − k / i)` (the paper's numerically stable form). `k ≤ n`.
pub fn pass_at_k(n: usize, c: usize, k: usize) -> f64 {
    if n < k || k == 0 {
        return f64::NAN;
    }
    if n - c < k {
        return 1.0;
    }
    let mut prod = 1.0;
    for i in (n - c + 1)..=n {
        prod *= 1.0 - k as f64 / i as f64;
    }
    1.0 - prod
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extraction() {
        assert_eq!(extract_answer("so 3 + 4 = 7\n#### 7").as_deref(), Some("7"));
        assert_eq!(extract_answer("The answer is $1,250.").as_deref(), Some("1250"));
        assert_eq!(extract_answer("It is 2.50 dollars").as_deref(), Some("2.5"));
        assert_eq!(extract_answer("drops to -3 degrees").as_deref(), Some("-3"));
        assert_eq!(extract_answer("no numbers"), None);
        assert_eq!(extract_answer("#### 12 then 13").as_deref(), Some("12"));
        assert_eq!(extract_answer("is \\(\\boxed{1,200}\\) minutes, not 3").as_deref(), Some("1200"));
        assert_eq!(extract_answer("\\boxed{5} then \\boxed{\\frac{7}{2}} step 9").as_deref(), Some("2"));
        assert_eq!(extract_answer("\\[ \\boxed{120").as_deref(), Some("120"));
        assert_eq!(extract_answer("\\boxed{x} so 4").as_deref(), Some("4"));
        assert!(is_correct("she has 10%", "10"));
        assert!(!is_correct("she has 11", "10"));
    }

    fn binom(n: u64, k: u64) -> f64 {
        (0..k).fold(1.0, |acc, i| acc * (n - i) as f64 / (i + 1) as f64)
    }

    #[test]
    fn pass_at_k_matches_binomials() {
        for n in 1..=16u64 {
            for c in 0..=n {
                for k in 1..=n {
                    let direct = 1.0 - binom(n - c, k) / binom(n, k);
                    let got = pass_at_k(n as usize, c as usize, k as usize);
                    assert!((got - direct).abs() < 1e-9, "n={n} c={c} k={k}: {got} vs {direct}");
                }
            }
        }
        assert_eq!(pass_at_k(16, 0, 4), 0.0);
        assert!((pass_at_k(4, 1, 1) - 0.25).abs() < 1e-12);
    }
}
