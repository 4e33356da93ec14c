//! Small dense linear algebra on row-major f64 matrices (Cholesky factorization, triangular and
//! SPD inverses), enough for GPTQ's and SparseGPT's `H⁻¹`: blocked, with the bulk of the work
//! in `matrixmultiply`'s GEMM.

use deco_kernels::quant::SyncPtr;

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

/// Block size of the blocked factorizations (rows of a panel).
const NB: usize = 64;

/// `C[m, n] -= A[m, k] · B[k, n]` on row-major storage given by pointers and row strides;
/// `b_t` reads `B` as the transpose of a row-major `[n, k]` block.
///
/// # Safety
/// Every addressed element is in bounds of one allocation; `C` does not overlap `A` or `B`.
#[allow(clippy::too_many_arguments)] // a BLAS call
unsafe fn gemm_sub(m: usize, k: usize, nn: usize, a: *const f64, lda: usize, b: *const f64, ldb: usize, b_t: bool, c: *mut f64, ldc: usize, alpha: f64) {
    if m == 0 || k == 0 || nn == 0 {
        return;
    }
    let (rsb, csb) = if b_t { (1, ldb as isize) } else { (ldb as isize, 1) };
    // SAFETY: forwarded from the caller.
    unsafe { matrixmultiply::dgemm(m, k, nn, alpha, a, lda as isize, 1, b, rsb, csb, 1.0, c, ldc as isize, 1) }
}

/// Columns of `C` per parallel task of [`gemm_sub_par`] (a multiple of every `matrixmultiply`
/// f64 kernel's width).
const PAR_COLS: usize = 128;

/// [`gemm_sub`] with `C`'s columns cut into runs of [`PAR_COLS`], one rayon task each. Each
/// element of `C` is summed by the same kernel over `k` in the same order as in one call, so
/// the bits do not change.
///
/// # Safety
/// As [`gemm_sub`].
#[allow(clippy::too_many_arguments)] // a BLAS call
unsafe fn gemm_sub_par(m: usize, k: usize, nn: usize, a: *const f64, lda: usize, b: *const f64, ldb: usize, b_t: bool, c: *mut f64, ldc: usize, alpha: f64) {
    use rayon::prelude::*;
    if nn <= PAR_COLS || m * k * nn < 1 << 20 {
        // SAFETY: forwarded from the caller.
        return unsafe { gemm_sub(m, k, nn, a, lda, b, ldb, b_t, c, ldc, alpha) };
    }
    let (a, b, c) = (SyncPtr(a.cast_mut()), SyncPtr(b.cast_mut()), SyncPtr(c));
    (0..nn.div_ceil(PAR_COLS)).into_par_iter().for_each(|t| {
        let j0 = t * PAR_COLS;
        let w = PAR_COLS.min(nn - j0);
        // Columns j0 .. j0 + w of B (row j0 of its stored transpose) and of C.
        let bo = if b_t { j0 * ldb } else { j0 };
        // SAFETY: a sub-block of the caller's in-bounds operands; the tasks write disjoint
        // columns of C, which overlaps neither A nor B.
        unsafe { gemm_sub(m, k, w, a.get(), lda, b.get().add(bo), ldb, b_t, c.get().add(j0), ldc, alpha) };
    });
}

/// Lower Cholesky factor `L` of a symmetric positive definite `[n, n]` matrix (`A = L Lᵀ`);
/// only the lower triangle of `a` is read. The upper triangle of the result is zero.
///
/// Blocked right-looking factorization (LAPACK `dpotrf`'s order): each 64-column panel is
/// factored with dot products, and the trailing lower triangle is updated with one matrix
/// product per block row, so almost all of the `n³/3` multiply-adds run in a GEMM kernel.
///
/// # Errors
/// [`Error::NotPositiveDefinite`] with the failing pivot.
pub fn cholesky_lower(a: &[f64], n: usize) -> Result<Vec<f64>> {
    let mut l = a.to_vec();
    for k0 in (0..n).step_by(NB) {
        let k1 = (k0 + NB).min(n);
        // Diagonal block, left-looking inside the panel.
        for j in k0..k1 {
            let lj = &l[j * n + k0..j * n + j];
            let s = l[j * n + j] - dot(lj, lj);
            if s <= 0.0 || !s.is_finite() {
                return Err(Error::NotPositiveDefinite { pivot: j });
            }
            let d = s.sqrt();
            l[j * n + j] = d;
            for i in j + 1..k1 {
                let v = (l[i * n + j] - dot(&l[i * n + k0..i * n + j], &l[j * n + k0..j * n + j])) / d;
                l[i * n + j] = v;
            }
        }
        // Panel below it: row i solves L_ik L_kkᵀ = A_ik by forward substitution.
        let (head, tail) = l.split_at_mut(k1 * n);
        let diag = &head[k0 * n..];
        tail.chunks_mut(n).for_each(|row| {
            for j in k0..k1 {
                let v = (row[j] - dot(&row[k0..j], &diag[(j - k0) * n + k0..(j - k0) * n + j])) / diag[(j - k0) * n + j];
                row[j] = v;
            }
        });
        // Trailing update, one block row per rayon task: A[i0..i1, k1..i1] -= P_i P_[k1..i1]ᵀ
        // with P the panel columns k0..k1 (the part right of the diagonal is never read).
        {
            use rayon::prelude::*;
            let p = SyncPtr(l.as_mut_ptr());
            (k1..n).step_by(NB).collect::<Vec<_>>().into_par_iter().for_each(|i0| {
                let p = p.get();
                let i1 = (i0 + NB).min(n);
                // SAFETY: A = rows i0..i1 × cols k0..k1, B = rows k1..i1 × cols k0..k1 (read as
                // its transpose), C = rows i0..i1 × cols k1..i1: in bounds; C's columns
                // (>= k1) are disjoint from the panel's (< k1), which no task writes, and each
                // task writes its own rows i0..i1.
                unsafe {
                    gemm_sub(i1 - i0, k1 - k0, i1 - k1, p.add(i0 * n + k0), n, p.add(k1 * n + k0), n, true, p.add(i0 * n + k1), n, -1.0);
                }
            });
        }
    }
    for i in 0..n {
        l[i * n + i + 1..(i + 1) * n].fill(0.0);
    }
    Ok(l)
}

/// `L⁻¹` of a lower triangular `[n, n]` matrix with a nonzero diagonal (lower triangular;
/// the upper triangle of `l` is not read).
///
/// Blocked: `M_ii = L_ii⁻¹` by substitution, then `M_ij = −M_ii Σ_{j<=k<i} L_ik M_kj`
/// for each block row `i`, both products in a GEMM kernel.
pub fn lower_triangular_inverse(l: &[f64], n: usize) -> Vec<f64> {
    let mut m = vec![0.0f64; n * n];
    for i0 in (0..n).step_by(NB) {
        let i1 = (i0 + NB).min(n);
        let b = i1 - i0;
        // Diagonal block: column j of L_ii⁻¹ by forward substitution.
        let mut d = vec![0.0f64; b * b];
        for j in 0..b {
            d[j * b + j] = 1.0 / l[(i0 + j) * n + i0 + j];
            for i in j + 1..b {
                let mut s = 0.0;
                for k in j..i {
                    s += l[(i0 + i) * n + i0 + k] * d[k * b + j];
                }
                d[i * b + j] = -s / l[(i0 + i) * n + i0 + i];
            }
        }
        for i in 0..b {
            m[(i0 + i) * n + i0..(i0 + i) * n + i1].copy_from_slice(&d[i * b..(i + 1) * b]);
        }
        if i0 > 0 {
            // T = L[i0..i1, 0..i0] · M[0..i0, 0..i0] (M's upper part is zero), then
            // M[i0..i1, 0..i0] = −M_ii T.
            let mut t = vec![0.0f64; b * i0];
            // SAFETY: A = rows i0..i1 × cols 0..i0 of l, B = the leading i0 × i0 of m, C = t
            // (b × i0): in bounds, t is its own allocation.
            unsafe {
                gemm_sub_par(b, i0, i0, l.as_ptr().add(i0 * n), n, m.as_ptr(), n, false, t.as_mut_ptr(), i0, 1.0);
            }
            let p = m.as_mut_ptr();
            // SAFETY: A = d (b × b), B = t (b × i0), C = rows i0..i1 × cols 0..i0 of m: in
            // bounds; C is disjoint from d and t (other allocations).
            unsafe {
                gemm_sub_par(b, b, i0, d.as_ptr(), b, t.as_ptr(), i0, false, p.add(i0 * n), n, -1.0);
            }
        }
    }
    m
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
/// Computed without forming `A⁻¹`: with `P` the order-reversing permutation and
/// `P A P = L̃ L̃ᵀ`, `A⁻¹ = (P L̃⁻¹ P)ᵀ (P L̃⁻¹ P)` and `P L̃⁻¹ P` is upper triangular with a
/// positive diagonal, so it is `U` (the factor is unique). One Cholesky factorization and one
/// triangular inverse (`2n³/3` multiply-adds) instead of the reference's three factorizations
/// and an inverse.
///
/// # Errors
/// [`Error::NotPositiveDefinite`] if `A` is not positive definite (the pivot is counted in
/// `A`'s own order).
pub fn inverse_upper_cholesky(a: &[f64], n: usize) -> Result<Vec<f64>> {
    let mut r = vec![0.0f64; n * n];
    for i in 0..n {
        for j in 0..n {
            r[i * n + j] = a[(n - 1 - i) * n + (n - 1 - j)];
        }
    }
    let lt = cholesky_lower(&r, n).map_err(|e| match e {
        Error::NotPositiveDefinite { pivot } => Error::NotPositiveDefinite { pivot: n - 1 - pivot },
        e => e,
    })?;
    let m = lower_triangular_inverse(&lt, n);
    for i in 0..n {
        for j in 0..n {
            r[i * n + j] = m[(n - 1 - i) * n + (n - 1 - j)];
        }
    }
    Ok(r)
}

/// The update inside a block of GPTQ / SparseGPT after column `i` of the block is fixed:
/// `W[:, j] -= e · U[col, j]` for the block's later columns `j`, stored column by column in
/// `rest` (`nr` rows each, column `i + 1` first), with `e` the column's `nr` scaled errors and
/// `u` the matching part of `U`'s row `col` (one entry per column of `rest`; zeros are skipped).
///
/// # Panics
/// If `rest` does not hold `u.len()` columns of `e.len()` rows (an internal invariant of the
/// callers).
#[inline(always)]
pub fn block_column_update(rest: &mut [f64], e: &[f64], u: &[f64]) {
    let nr = e.len();
    assert!(rest.len() >= u.len() * nr, "block_column_update: shapes");
    for (wj, &hij) in rest.chunks_exact_mut(nr.max(1)).zip(u) {
        if hij != 0.0 {
            for (w, &er) in wj.iter_mut().zip(e) {
                *w -= er * hij;
            }
        }
    }
}

/// The lazy batch update of GPTQ / SparseGPT after a block of columns `i1..i2`:
/// `W[:, i2..] -= E · U[i1..i2, i2..]` for the `nr` rows of `wm` (`[nr, n]`, row-major), with
/// `err` the block's scaled errors stored column by column (`err[i · nr + r]` for row `r`,
/// column `i1 + i`) and `u` the `[n, n]` upper factor of `H⁻¹`. One GEMM.
///
/// # Panics
/// If a slice is shorter than its shape implies (an internal invariant of the callers).
pub fn lazy_batch_update(wm: &mut [f64], nr: usize, n: usize, err: &[f64], i1: usize, i2: usize, u: &[f64]) {
    let count = i2 - i1;
    assert!(wm.len() >= nr * n && err.len() >= count * nr && u.len() >= n * n && i1 <= i2 && i2 <= n, "lazy_batch_update: shapes");
    if i2 == n || nr == 0 || count == 0 {
        return;
    }
    // SAFETY: err is [nr, count] with strides (1, nr); u rows i1..i2, cols i2..n with strides
    // (n, 1); wm columns i2..n of nr rows with strides (n, 1): all in bounds (checked above),
    // and wm is a distinct allocation from err and u.
    unsafe {
        matrixmultiply::dgemm(
            nr,
            count,
            n - i2,
            -1.0,
            err.as_ptr(),
            1,
            nr as isize,
            u.as_ptr().add(i1 * n + i2),
            n as isize,
            1,
            1.0,
            wm.as_mut_ptr().add(i2),
            n as isize,
            1,
        );
    }
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

    /// A random SPD matrix `X Xᵀ / k + 0.1 I` (`[n, n]`).
    fn spd(n: usize, seed: u64) -> Vec<f64> {
        let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
        let mut next = move || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
        };
        let k = n + 7;
        let x: Vec<f64> = (0..n * k).map(|_| next()).collect();
        let mut a = vec![0.0; n * n];
        for i in 0..n {
            for j in 0..n {
                a[i * n + j] = (0..k).map(|t| x[i * k + t] * x[j * k + t]).sum::<f64>() / k as f64 + if i == j { 0.1 } else { 0.0 };
            }
        }
        a
    }

    /// The column-parallel product gives the one-call product's bits (each element's sum over
    /// `k` runs in the same kernel in the same order), at the shapes of the blocked inverse.
    #[test]
    fn parallel_gemm_equals_one_call() {
        for &(m, k, nn) in &[(64usize, 64usize, 700usize), (64, 640, 640), (64, 1472, 1472), (64, 130, 1000), (3, 5, 300)] {
            let a: Vec<f64> = (0..m * k).map(|i| ((i * 7919) % 1000) as f64 / 997.0 - 0.5).collect();
            let b: Vec<f64> = (0..k * nn).map(|i| ((i * 104729) % 1000) as f64 / 991.0 - 0.5).collect();
            let mut one = vec![0.25f64; m * nn];
            let mut par = one.clone();
            // SAFETY: a is [m, k], b [k, nn], c [m, nn], row-major, separate allocations.
            unsafe {
                gemm_sub(m, k, nn, a.as_ptr(), k, b.as_ptr(), nn, false, one.as_mut_ptr(), nn, -1.0);
                gemm_sub_par(m, k, nn, a.as_ptr(), k, b.as_ptr(), nn, false, par.as_mut_ptr(), nn, -1.0);
            }
            assert!(one.iter().zip(&par).all(|(x, y)| x.to_bits() == y.to_bits()), "{m}x{k}x{nn}");
        }
    }

    #[test]
    fn blocked_factors_reproduce_the_matrix_and_its_inverse() {
        // Sizes below, at and across the 64-row blocks.
        for n in [1usize, 5, 63, 64, 65, 130, 200] {
            let a = spd(n, n as u64);
            let l = cholesky_lower(&a, n).unwrap();
            let mut worst = 0.0f64;
            for i in 0..n {
                for j in 0..n {
                    let s: f64 = (0..n).map(|k| l[i * n + k] * l[j * n + k]).sum();
                    worst = worst.max((s - a[i * n + j]).abs());
                    if j > i {
                        assert_eq!(l[i * n + j], 0.0);
                    }
                }
            }
            assert!(worst < 1e-12, "n {n}: |L Lᵀ - A| {worst:e}");
            // M = L⁻¹: M L = I.
            let m = lower_triangular_inverse(&l, n);
            for i in 0..n {
                for j in 0..n {
                    let s: f64 = (0..n).map(|k| m[i * n + k] * l[k * n + j]).sum();
                    assert!((s - if i == j { 1.0 } else { 0.0 }).abs() < 1e-9, "n {n}: (M L)[{i}][{j}] = {s}");
                }
            }
            // U upper with Uᵀ U A = I, and equal to the reference's chol(cholesky_inverse(L)).
            let u = inverse_upper_cholesky(&a, n).unwrap();
            let inv = cholesky_inverse(&l, n);
            for i in 0..n {
                for j in 0..n {
                    if i > j {
                        assert_eq!(u[i * n + j], 0.0);
                    }
                    let s: f64 = (0..n).map(|k| u[k * n + i] * u[k * n + j]).sum();
                    assert!((s - inv[i * n + j]).abs() < 1e-9 * (1.0 + inv[i * n + j].abs()), "n {n}: (UᵀU)[{i}][{j}] {s} vs {}", inv[i * n + j]);
                }
            }
            let l2 = cholesky_lower(&inv, n).unwrap();
            for i in 0..n {
                for j in 0..=i {
                    assert!((u[j * n + i] - l2[i * n + j]).abs() < 1e-9 * (1.0 + l2[i * n + j].abs()), "n {n}: U[{j}][{i}]");
                }
            }
        }
        // The pivot is reported in the matrix's own order.
        let mut a = spd(70, 1);
        a[69 * 70 + 69] = -1.0;
        assert!(matches!(inverse_upper_cholesky(&a, 70), Err(Error::NotPositiveDefinite { pivot: 69 })));
    }
}
