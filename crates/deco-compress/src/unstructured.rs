//! Magnitude and Wanda pruning of one linear layer.
//!
//! - Magnitude: score `|W_ij|`, ranked over the whole layer or within each output row.
//! - Wanda (Sun et al. 2024, "A Simple and Effective Pruning Approach for Large Language
//!   Models", eq. 1; locuslab/wanda `prune_wanda`): score `S_ij = |W_ij| · ‖X_j‖₂`, where
//!   `‖X_j‖₂` is the norm of input feature `j` over all calibration tokens, ranked within each
//!   output row (the paper's "per output" comparison group). No weight update.

use crate::mask::{Mask, Pattern, select_per_layer, select_per_row};
use crate::{Error, Result};

/// Where magnitude pruning compares weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// All weights of the layer together.
    Layer,
    /// Each output row separately.
    Row,
}

/// Running `Σ_t x_tj²` of each input feature `j` (Wanda's `scaler_row` times the token count;
/// the ranking within a row does not depend on the normalization).
#[derive(Debug, Clone)]
pub struct ColumnNorms {
    /// `Σ_t x_tj²`, `[cols]`.
    pub sum_sq: Vec<f64>,
    /// Tokens accumulated.
    pub tokens: usize,
}

impl ColumnNorms {
    /// Empty accumulator for `cols` features.
    pub fn new(cols: usize) -> Self {
        Self { sum_sq: vec![0.0; cols], tokens: 0 }
    }

    /// Adds `tokens` rows of `x` (`[tokens, cols]`, row-major).
    ///
    /// # Errors
    /// [`Error::Shape`] on a wrong length.
    pub fn add_batch(&mut self, x: &[f32], tokens: usize) -> Result<()> {
        let c = self.sum_sq.len();
        if x.len() != tokens * c {
            return Err(Error::Shape(format!("{} values for {tokens} tokens of {c} features", x.len())));
        }
        for row in x.chunks_exact(c.max(1)) {
            for (s, &v) in self.sum_sq.iter_mut().zip(row) {
                *s += (v as f64) * (v as f64);
            }
        }
        self.tokens += tokens;
        Ok(())
    }

    /// Adds precomputed per-column sums of squares of `tokens` rows.
    ///
    /// # Errors
    /// [`Error::Shape`] on a wrong length.
    pub fn add_sums(&mut self, sum_sq: &[f32], tokens: usize) -> Result<()> {
        if sum_sq.len() != self.sum_sq.len() {
            return Err(Error::Shape(format!("{} column sums for {} features", sum_sq.len(), self.sum_sq.len())));
        }
        for (s, &v) in self.sum_sq.iter_mut().zip(sum_sq) {
            *s += v as f64;
        }
        self.tokens += tokens;
        Ok(())
    }

    /// `‖X_j‖₂` for every column.
    pub fn norms(&self) -> Vec<f64> {
        self.sum_sq.iter().map(|s| s.sqrt()).collect()
    }
}

fn check(w: &[f32], rows: usize, cols: usize) -> Result<()> {
    if w.len() != rows * cols {
        return Err(Error::Shape(format!("{} weights for a {rows}x{cols} matrix", w.len())));
    }
    Ok(())
}

/// Magnitude pruning of `w` (`[rows, cols]`, `[out, in]`) in place; returns the mask.
///
/// # Errors
/// [`Error::Shape`], invalid pattern (N:M with `m` not dividing `cols`).
pub fn magnitude_prune(w: &mut [f32], rows: usize, cols: usize, pattern: Pattern, scope: Scope) -> Result<Mask> {
    check(w, rows, cols)?;
    let scores: Vec<f64> = w.iter().map(|v| v.abs() as f64).collect();
    let mask = match scope {
        Scope::Layer => select_per_layer(&scores, rows, cols, pattern)?,
        Scope::Row => select_per_row(&scores, rows, cols, pattern)?,
    };
    mask.apply(w)?;
    Ok(mask)
}

/// Wanda scores `|W_ij| · ‖X_j‖₂` (`[rows, cols]`) from column norms `x_norm` (`[cols]`).
///
/// # Errors
/// [`Error::Shape`].
pub fn wanda_scores(w: &[f32], rows: usize, cols: usize, x_norm: &[f64]) -> Result<Vec<f64>> {
    check(w, rows, cols)?;
    if x_norm.len() != cols {
        return Err(Error::Shape(format!("{} activation norms for {cols} input features", x_norm.len())));
    }
    Ok(w.chunks_exact(cols.max(1)).flat_map(|row| row.iter().zip(x_norm).map(|(&v, &n)| v.abs() as f64 * n)).collect())
}

/// Wanda pruning of `w` (`[rows, cols]`) in place, ranked per output row; returns the mask.
///
/// # Errors
/// [`Error::Shape`], invalid pattern.
pub fn wanda_prune(w: &mut [f32], rows: usize, cols: usize, norms: &ColumnNorms, pattern: Pattern) -> Result<Mask> {
    let scores = wanda_scores(w, rows, cols, &norms.norms())?;
    let mask = select_per_row(&scores, rows, cols, pattern)?;
    mask.apply(w)?;
    Ok(mask)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn wanda_differs_from_magnitude_when_activations_differ() {
        // Row [1, 2]; the first input is 10x larger: Wanda keeps column 0, magnitude column 1.
        let mut n = ColumnNorms::new(2);
        n.add_batch(&[10.0, 1.0, 0.0, 0.0], 2).unwrap();
        let mut w = vec![1.0f32, 2.0];
        let m = wanda_prune(&mut w, 1, 2, &n, Pattern::Unstructured(0.5)).unwrap();
        assert_eq!(m.keep, vec![true, false]);
        assert_eq!(w, vec![1.0, 0.0]);
        let mut w = vec![1.0f32, 2.0];
        magnitude_prune(&mut w, 1, 2, Pattern::Unstructured(0.5), Scope::Layer).unwrap();
        assert_eq!(w, vec![0.0, 2.0]);
        assert!(n.add_batch(&[1.0], 1).is_err());
    }
}
