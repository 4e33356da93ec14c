//! Small dense linear algebra on row-major f64 matrices (Cholesky factorizations and inverse),
//! enough for GPTQ's `H⁻¹` and written so the inner loops are contiguous dot products.

use crate::{Error, Result};

fn dot(a: &[f64], b: &[f64]) -> f64 {
    let mut acc = [0.0f64; 4];
    let chunks = a.len() / 4;
    for i in 0..chunks {
        for l in 0..4 {
            acc[l] += a[4 * i + l] * b[4 * i + l];
        }
    }
    let mut s = acc[0] + acc[1] + acc[2] + acc[3];
    for i in 4 * chunks..a.len() {
        s += a[i] * b[i];
    }
    s
}

/// Lower Cholesky factor `L` of a symmetric positive definite `[n, n]` matrix (`A = L Lᵀ`);
/// only the lower triangle of `a` is read. The upper triangle of the result is zero.
///
/// # Errors
/// [`Error::NotPositiveDefinite`] with the failing pivot.
pub fn cholesky_lower(a: &[f64], n: usize) -> Result<Vec<f64>> {
    let mut l = vec![0.0f64; n * n];
    for j in 0..n {
        let (done, rest) = l.split_at_mut(j * n);
        let _ = done;
        let s = a[j * n + j] - dot(&rest[..j], &rest[..j]);
        if s <= 0.0 || !s.is_finite() {
            return Err(Error::NotPositiveDefinite { pivot: j });
        }
        let d = s.sqrt();
        rest[j] = d;
        for i in j + 1..n {
            let v = (a[i * n + j] - dot(&l[i * n..i * n + j], &l[j * n..j * n + j])) / d;
            l[i * n + j] = v;
        }
    }
    Ok(l)
}

/// `A⁻¹` from the lower Cholesky factor `L` of `A` (torch `cholesky_inverse`).
pub fn cholesky_inverse(l: &[f64], n: usize) -> Vec<f64> {
    // xt[j][k] = (L⁻¹)[k][j], nonzero for k >= j.
    let mut xt = vec![0.0f64; n * n];
    for j in 0..n {
        xt[j * n + j] = 1.0 / l[j * n + j];
        for i in j + 1..n {
            let s = dot(&l[i * n + j..i * n + i], &xt[j * n + j..j * n + i]);
            xt[j * n + i] = -s / l[i * n + i];
        }
    }
    // A⁻¹ = L⁻ᵀ L⁻¹: (A⁻¹)[a][b] = sum_k X[k][a] X[k][b], k >= max(a, b).
    let mut inv = vec![0.0f64; n * n];
    for a in 0..n {
        for b in a..n {
            let v = dot(&xt[a * n + b..a * n + n], &xt[b * n + b..b * n + n]);
            inv[a * n + b] = v;
            inv[b * n + a] = v;
        }
    }
    inv
}

/// Upper Cholesky factor `U` of `A⁻¹` (`A⁻¹ = Uᵀ U`), the form GPTQ's `fasterquant` uses
/// (`torch.linalg.cholesky(cholesky_inverse(cholesky(H)), upper=True)`).
///
/// # Errors
/// [`Error::NotPositiveDefinite`] if `A` (or numerically `A⁻¹`) is not positive definite.
pub fn inverse_upper_cholesky(a: &[f64], n: usize) -> Result<Vec<f64>> {
    let l = cholesky_lower(a, n)?;
    let inv = cholesky_inverse(&l, n);
    let l2 = cholesky_lower(&inv, n)?;
    let mut u = vec![0.0f64; n * n];
    for i in 0..n {
        for j in 0..=i {
            u[j * n + i] = l2[i * n + j];
        }
    }
    Ok(u)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn inverse_and_factors_on_a_known_matrix() {
        // A = [[4, 2], [2, 3]]: L = [[2, 0], [1, sqrt 2]], A⁻¹ = [[3, -2], [-2, 4]] / 8.
        let a = [4.0, 2.0, 2.0, 3.0];
        let l = cholesky_lower(&a, 2).unwrap();
        assert!((l[0] - 2.0).abs() < 1e-12 && (l[2] - 1.0).abs() < 1e-12 && (l[3] - 2f64.sqrt()).abs() < 1e-12);
        let inv = cholesky_inverse(&l, 2);
        let want = [3.0 / 8.0, -2.0 / 8.0, -2.0 / 8.0, 4.0 / 8.0];
        for (x, y) in inv.iter().zip(want) {
            assert!((x - y).abs() < 1e-12);
        }
        let u = inverse_upper_cholesky(&a, 2).unwrap();
        assert_eq!(u[2], 0.0);
        // Uᵀ U == A⁻¹
        for i in 0..2 {
            for j in 0..2 {
                let s: f64 = (0..2).map(|k| u[k * 2 + i] * u[k * 2 + j]).sum();
                assert!((s - want[i * 2 + j]).abs() < 1e-12);
            }
        }
        assert!(matches!(cholesky_lower(&[1.0, 2.0, 2.0, 1.0], 2), Err(Error::NotPositiveDefinite { pivot: 1 })));
    }
}
