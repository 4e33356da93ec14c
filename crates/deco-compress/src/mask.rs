//! Sparsity patterns and mask selection from per-weight scores.
//!
//! A [`Mask`] marks the *kept* weights of a `[rows, cols]` (`[out, in]`) matrix. Every selector
//! prunes exactly the number of weights its pattern asks for, breaking ties in scores by the
//! lower flat index first (a stable sort), so masks are deterministic.

use crate::{Error, Result, invalid};

/// Which weights of a linear layer may be zero.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Pattern {
    /// A fraction `s ∈ [0, 1)` of the weights is zero; the count is `round(s · len)` of the
    /// scope the method ranks in (a row, a layer, a SparseGPT block).
    Unstructured(f64),
    /// N:M semi-structured sparsity: in every run of `m` consecutive input columns of a row, at
    /// most `n` weights are nonzero (exactly `m - n` are pruned). `2:4` is NVIDIA's sparse
    /// tensor-core pattern. (SparseGPT's and Wanda's `prunen:prunem` count the *pruned* weights;
    /// for 2:4 and 4:8 the two conventions coincide.)
    NM {
        /// Kept weights per group.
        n: usize,
        /// Group length (consecutive input columns).
        m: usize,
    },
}

impl Pattern {
    /// Parses `0.5` (unstructured) or `2:4` (N:M).
    ///
    /// # Errors
    /// [`Error::InvalidParameter`] for text that is neither, or an invalid pattern.
    pub fn parse(text: &str) -> Result<Self> {
        let p = if let Some((n, m)) = text.split_once(':') {
            let num = |s: &str| s.trim().parse::<usize>().map_err(|_| invalid("nm", format!("`{text}` is not N:M")));
            Pattern::NM { n: num(n)?, m: num(m)? }
        } else {
            Pattern::Unstructured(text.trim().parse::<f64>().map_err(|_| invalid("sparsity", format!("`{text}` is not a number")))?)
        };
        p.validate()?;
        Ok(p)
    }

    /// Checks the parameters: `0 ≤ s < 1` (finite); `0 < n < m` for N:M.
    ///
    /// # Errors
    /// [`Error::InvalidParameter`].
    pub fn validate(&self) -> Result<()> {
        match *self {
            Pattern::Unstructured(s) if (0.0..1.0).contains(&s) => Ok(()),
            Pattern::Unstructured(s) => Err(invalid("sparsity", format!("{s} must be in [0, 1)"))),
            Pattern::NM { n, m } if n > 0 && n < m => Ok(()),
            Pattern::NM { n, m } => Err(invalid("nm", format!("{n}:{m} needs 0 < N < M"))),
        }
    }

    /// Checks that the pattern applies to a matrix with `cols` input columns (`m` divides it).
    ///
    /// # Errors
    /// [`Error::InvalidParameter`].
    pub fn check_cols(&self, cols: usize) -> Result<()> {
        self.validate()?;
        if let Pattern::NM { n, m } = *self
            && !cols.is_multiple_of(m)
        {
            return Err(invalid("nm", format!("{n}:{m}: group length {m} does not divide the input dimension {cols}")));
        }
        Ok(())
    }

    /// Fraction of zero weights the pattern gives.
    pub fn sparsity(&self) -> f64 {
        match *self {
            Pattern::Unstructured(s) => s,
            Pattern::NM { n, m } => (m - n) as f64 / m as f64,
        }
    }
}

/// Weights pruned out of `len` at sparsity `s`: `round(s · len)`.
pub fn pruned_count(s: f64, len: usize) -> usize {
    ((s * len as f64).round() as usize).min(len)
}

/// Kept/pruned flags of a `[rows, cols]` weight, row-major (`true` = kept).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mask {
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    /// `rows · cols` flags, row-major.
    pub keep: Vec<bool>,
}

impl Mask {
    /// All kept.
    pub fn dense(rows: usize, cols: usize) -> Self {
        Self { rows, cols, keep: vec![true; rows * cols] }
    }

    /// Pruned (false) entries.
    pub fn pruned(&self) -> usize {
        self.keep.iter().filter(|&&k| !k).count()
    }

    /// Fraction of pruned entries.
    pub fn sparsity(&self) -> f64 {
        self.pruned() as f64 / self.keep.len().max(1) as f64
    }

    /// Zeroes the pruned entries of `w` (`[rows, cols]`).
    ///
    /// # Errors
    /// [`Error::Shape`] if `w` has the wrong length.
    pub fn apply(&self, w: &mut [f32]) -> Result<()> {
        if w.len() != self.keep.len() {
            return Err(Error::Shape(format!("mask of {} entries applied to {} weights", self.keep.len(), w.len())));
        }
        for (x, &k) in w.iter_mut().zip(&self.keep) {
            if !k {
                *x = 0.0;
            }
        }
        Ok(())
    }

    /// Whether every row satisfies N:M (at most `n` kept in each group of `m` columns).
    pub fn satisfies_nm(&self, n: usize, m: usize) -> bool {
        m > 0 && self.cols.is_multiple_of(m) && self.keep.chunks(m).all(|g| g.iter().filter(|&&k| k).count() <= n)
    }
}

fn check_len(scores: &[f64], rows: usize, cols: usize) -> Result<()> {
    if scores.len() != rows * cols {
        return Err(Error::Shape(format!("{} scores for a {rows}x{cols} matrix", scores.len())));
    }
    Ok(())
}

/// Marks the `k` lowest of `scores[idx]` (ties: lower index first) as pruned in `keep`.
fn prune_lowest(scores: &[f64], idx: &mut [usize], k: usize, keep: &mut [bool]) {
    if k == 0 {
        return;
    }
    idx.sort_by(|&a, &b| scores[a].total_cmp(&scores[b]).then(a.cmp(&b)));
    for &i in &idx[..k] {
        keep[i] = false;
    }
}

/// Ranks all weights of the layer together: prunes the `round(s · rows · cols)` lowest scores
/// (magnitude pruning "per layer"). N:M patterns are inherently per row and go to
/// [`select_per_row`].
///
/// `scores` is `[rows, cols]` row-major; higher = more important.
///
/// # Errors
/// [`Error::Shape`], invalid pattern.
pub fn select_per_layer(scores: &[f64], rows: usize, cols: usize, pattern: Pattern) -> Result<Mask> {
    check_len(scores, rows, cols)?;
    pattern.check_cols(cols)?;
    match pattern {
        Pattern::Unstructured(s) => {
            let mut mask = Mask::dense(rows, cols);
            let mut idx: Vec<usize> = (0..rows * cols).collect();
            prune_lowest(scores, &mut idx, pruned_count(s, rows * cols), &mut mask.keep);
            Ok(mask)
        }
        Pattern::NM { .. } => select_per_row(scores, rows, cols, pattern),
    }
}

/// Ranks weights within each output row (Wanda's comparison group, Sun et al. 2024 §3): prunes
/// `round(s · cols)` lowest scores of every row, or for N:M the `m - n` lowest of every group of
/// `m` consecutive columns.
///
/// `scores` is `[rows, cols]` row-major; higher = more important.
///
/// # Errors
/// [`Error::Shape`], invalid pattern, `m` not dividing `cols`.
pub fn select_per_row(scores: &[f64], rows: usize, cols: usize, pattern: Pattern) -> Result<Mask> {
    check_len(scores, rows, cols)?;
    pattern.check_cols(cols)?;
    let mut mask = Mask::dense(rows, cols);
    let (group, k) = match pattern {
        Pattern::Unstructured(s) => (cols, pruned_count(s, cols)),
        Pattern::NM { n, m } => (m, m - n),
    };
    if group == 0 {
        return Ok(mask);
    }
    for g0 in (0..rows * cols).step_by(group) {
        let mut idx: Vec<usize> = (g0..g0 + group).collect();
        prune_lowest(scores, &mut idx, k, &mut mask.keep);
    }
    Ok(mask)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_validate() {
        assert_eq!(Pattern::parse("0.5").unwrap(), Pattern::Unstructured(0.5));
        assert_eq!(Pattern::parse("2:4").unwrap(), Pattern::NM { n: 2, m: 4 });
        assert!(Pattern::parse("1.0").is_err());
        assert!(Pattern::parse("-0.1").is_err());
        assert!(Pattern::parse("NaN").is_err());
        assert!(Pattern::parse("4:4").is_err());
        assert!(Pattern::parse("0:4").is_err());
        assert!(Pattern::parse("a:b").is_err());
        assert!(Pattern::NM { n: 2, m: 4 }.check_cols(6).is_err());
        assert!((Pattern::NM { n: 2, m: 8 }.sparsity() - 0.75).abs() < 1e-12);
    }

    #[test]
    fn per_row_picks_the_smallest_with_stable_ties() {
        let s = [3.0, 1.0, 2.0, 1.0, /* row 2 */ 0.0, 5.0, 5.0, 4.0];
        let m = select_per_row(&s, 2, 4, Pattern::Unstructured(0.5)).unwrap();
        assert_eq!(m.keep, vec![true, false, true, false, false, true, true, false]);
        let m = select_per_row(&s, 2, 4, Pattern::NM { n: 1, m: 2 }).unwrap();
        assert_eq!(m.keep, vec![true, false, true, false, false, true, true, false]);
        let m = select_per_layer(&s, 2, 4, Pattern::Unstructured(0.25)).unwrap();
        assert_eq!(m.keep, vec![true, false, true, true, false, true, true, true]);
    }
}
