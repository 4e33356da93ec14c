//! SparseGPT (Frantar & Alistarh 2023, "SparseGPT: Massive Language Models Can Be Accurately
//! Pruned in One-Shot", Algorithm 1), following IST-DASLab/sparsegpt `SparseGPT.fasterprune`.
//!
//! For a linear layer with weight `W` (`[rows, cols]`) and the Hessian `H = 2XXᵀ/n` of its inputs
//! (shared with GPTQ: [`deco_quant::gptq::Hessian`]), columns are visited left to right in blocks
//! of `blocksize` (128). With `U = chol(H⁻¹)` (upper, so `U_jj² = [H_F⁻¹]_jj` of the remaining
//! columns `F`):
//!
//! - mask selection: unstructured, per block, the weights of lowest `w² / U_jj²` over all rows of
//!   the block (the OBS saliency, eq. 3 of the paper); N:M, at the first column of each group of
//!   `m` columns, the `m - n` lowest `w² / U_jj²` of the group, per row, from the weights as
//!   updated so far;
//! - OBS update: pruning column `j` (row error `e = (w_j - q_j) / U_jj`, `q_j = 0` where pruned)
//!   updates the remaining columns of the block `W[:, k] -= e · U_jk`, and after the block the
//!   columns right of it `W[:, i2:] -= E · U[i1:i2, i2:]` (lazy batch update).
//!
//! Deviation from the reference: the reference keeps weights with `tmp > sort(tmp)[int(n·s)]`,
//! pruning `⌊n·s⌋ + 1` per block (and more on ties); here each block prunes exactly its share
//! `round(s · rows · i2) - round(s · rows · i1)`, so the layer has exactly `round(s · rows · cols)`
//! zeros in its mask.

use deco_quant::gptq::Hessian;
use rayon::prelude::*;

use crate::mask::{Mask, Pattern, pruned_count};
use crate::{Error, Result, invalid};

/// SparseGPT options (reference defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SparseGptConfig {
    /// Columns per block (lazy batch update and unstructured mask selection), 128.
    pub blocksize: usize,
    /// Dampening added to the diagonal of `H`, as a fraction of its mean, 0.01.
    pub percdamp: f64,
}

impl Default for SparseGptConfig {
    fn default() -> Self {
        Self { blocksize: 128, percdamp: 0.01 }
    }
}

/// Result of [`sparsegpt_prune`].
#[derive(Debug, Clone)]
pub struct SparseGptResult {
    /// The pruned and updated weight, `[rows, cols]`; exactly zero where `mask` is false.
    pub weights: Vec<f32>,
    /// The kept weights.
    pub mask: Mask,
    /// `Σ (w - q)² / U_jj² / 2` over all weights (the reference's reported error).
    pub loss: f64,
}

/// Prunes a `[rows, cols]` weight (`[out, in]`) against the Hessian of its inputs.
///
/// Dead inputs (`H_jj = 0`) get `H_jj = 1` and zero weights, as in the reference.
///
/// # Errors
/// [`Error::Shape`] for mismatched sizes or an empty weight; [`Error::InvalidParameter`] for an invalid pattern,
/// `blocksize` 0 or not a multiple of `m`, a non-positive `percdamp`;
/// [`Error::Quant`] (not positive definite) if the damped Hessian cannot be factored.
pub fn sparsegpt_prune(w: &[f32], rows: usize, cols: usize, hessian: &Hessian, pattern: Pattern, cfg: &SparseGptConfig) -> Result<SparseGptResult> {
    if w.len() != rows * cols || hessian.cols != cols {
        return Err(Error::Shape(format!("weight of {} values for {rows}x{cols}, Hessian for {} columns", w.len(), hessian.cols)));
    }
    if rows == 0 || cols == 0 {
        return Err(Error::Shape(format!("empty weight {rows}x{cols}")));
    }
    pattern.check_cols(cols)?;
    if cfg.blocksize == 0 {
        return Err(invalid("blocksize", "must be positive"));
    }
    if let Pattern::NM { m, .. } = pattern
        && !cfg.blocksize.is_multiple_of(m)
    {
        return Err(invalid("blocksize", format!("{} is not a multiple of the N:M group {m}", cfg.blocksize)));
    }
    if !(cfg.percdamp > 0.0 && cfg.percdamp.is_finite()) {
        return Err(invalid("percdamp", format!("{} must be a positive fraction", cfg.percdamp)));
    }
    let n = cols;
    let mut wm: Vec<f64> = w.iter().map(|&v| v as f64).collect();
    let mut h = hessian.h.clone();
    for i in 0..n {
        if h[i * n + i] == 0.0 {
            h[i * n + i] = 1.0;
            for r in 0..rows {
                wm[r * n + i] = 0.0;
            }
        }
    }
    let damp = cfg.percdamp * (0..n).map(|i| h[i * n + i]).sum::<f64>() / n as f64;
    for i in 0..n {
        h[i * n + i] += damp;
    }
    let hinv = deco_quant::linalg::inverse_upper_cholesky(&h, n)?;

    let mut keep = vec![true; rows * n];
    let mut loss = 0.0f64;
    let bs = cfg.blocksize;
    let mut i1 = 0;
    while i1 < n {
        let i2 = (i1 + bs).min(n);
        let count = i2 - i1;
        // Unstructured: the block's mask over all rows together (pruned flag of W[r, i1 + i] at
        // i · rows + r), from the weights as updated by the previous blocks.
        let block_mask: Option<Vec<bool>> = match pattern {
            Pattern::Unstructured(s) => {
                let k = pruned_count(s, rows * i2) - pruned_count(s, rows * i1);
                let tmp: Vec<f64> = (0..count * rows)
                    .map(|f| {
                        let (i, r) = (f / rows, f % rows);
                        let d = hinv[(i1 + i) * n + i1 + i];
                        let w = wm[r * n + i1 + i];
                        w * w / (d * d)
                    })
                    .collect();
                // The k lowest in the order (saliency, then the reference's flattening order,
                // row-major W1[:, i1:i2]): a total order, so selecting them (O(len), Hoare's
                // quickselect) gives the same set as sorting the whole block.
                let mut idx: Vec<usize> = (0..count * rows).collect();
                let key = |f: usize| (f % rows) * count + f / rows;
                if k < idx.len() {
                    idx.select_nth_unstable_by(k, |&a, &b| tmp[a].total_cmp(&tmp[b]).then(key(a).cmp(&key(b))));
                }
                let mut pruned = vec![false; count * rows];
                for &f in &idx[..k] {
                    pruned[f] = true;
                }
                Some(pruned)
            }
            Pattern::NM { .. } => None,
        };
        // Given the block's mask, rows are independent (a row's errors only update that row):
        // runs of ROW_CHUNK rows in parallel, fixed by the shape, not by the thread count.
        let losses: Vec<f64> = wm
            .par_chunks_mut(ROW_CHUNK * n)
            .zip(keep.par_chunks_mut(ROW_CHUNK * n))
            .enumerate()
            .map(|(ci, (wc, kc))| {
                let r0 = ci * ROW_CHUNK;
                let nr = wc.len() / n;
                let mask_of = |i: usize, r: usize| block_mask.as_ref().is_some_and(|m| m[i * rows + r0 + r]);
                block_rows(wc, kc, nr, n, i1, i2, &hinv, pattern, &mask_of)
            })
            .collect();
        loss += losses.iter().sum::<f64>();
        i1 = i2;
    }
    let weights: Vec<f32> = wm.iter().zip(&keep).map(|(&v, &k)| if k { v as f32 } else { 0.0 }).collect();
    Ok(SparseGptResult { weights, mask: Mask { rows, cols, keep }, loss })
}

/// Rows per parallel task of [`sparsegpt_prune`].
const ROW_CHUNK: usize = 32;

/// One block `i1..i2` of Algorithm 1 over `nr` rows `wm` (`[nr, n]`, updated in place) and
/// their kept flags `keep`: the N:M selection (per row) or the caller's unstructured mask
/// (`block_mask(i, r)` for column `i1 + i` of local row `r`), the OBS updates inside the block,
/// then the lazy batch update of the columns right of it. Returns the rows' loss.
#[allow(clippy::too_many_arguments)] // the shared state of one block
fn block_rows(
    wm: &mut [f64],
    keep: &mut [bool],
    nr: usize,
    n: usize,
    i1: usize,
    i2: usize,
    hinv: &[f64],
    pattern: Pattern,
    block_mask: &dyn Fn(usize, usize) -> bool,
) -> f64 {
    let count = i2 - i1;
    let mut loss = 0.0f64;
    // Block copy, transposed: w1[i * nr + r] = W[r, i1 + i]; pruned1 likewise.
    let mut w1 = vec![0.0f64; count * nr];
    let mut pruned1 = vec![false; count * nr];
    for r in 0..nr {
        for i in 0..count {
            w1[i * nr + r] = wm[r * n + i1 + i];
            pruned1[i * nr + r] = block_mask(i, r);
        }
    }
    let mut err1 = vec![0.0f64; count * nr];
    for i in 0..count {
        let col = i1 + i;
        if let Pattern::NM { n: keep_n, m } = pattern
            && i % m == 0
        {
            for r in 0..nr {
                let mut g: Vec<(f64, usize)> = (i..i + m)
                    .map(|j| {
                        let d = hinv[(i1 + j) * n + i1 + j];
                        (w1[j * nr + r] * w1[j * nr + r] / (d * d), j)
                    })
                    .collect();
                g.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
                for &(_, j) in &g[..m - keep_n] {
                    pruned1[j * nr + r] = true;
                }
            }
        }
        let d = hinv[col * n + col];
        let (head, tail) = w1.split_at_mut((i + 1) * nr);
        let wcol = &mut head[i * nr..];
        let e = &mut err1[i * nr..(i + 1) * nr];
        for r in 0..nr {
            let q = if pruned1[i * nr + r] { 0.0 } else { wcol[r] };
            let diff = wcol[r] - q;
            loss += diff * diff / (d * d) / 2.0;
            e[r] = diff / d;
            wcol[r] = q;
        }
        deco_quant::linalg::block_column_update(tail, e, &hinv[col * n + i1 + i + 1..col * n + i2]);
    }
    for r in 0..nr {
        for i in 0..count {
            wm[r * n + i1 + i] = w1[i * nr + r];
            keep[r * n + i1 + i] = !pruned1[i * nr + r];
        }
    }
    // W[:, i2:] -= Err1 · Hinv[i1:i2, i2:]
    deco_quant::linalg::lazy_batch_update(wm, nr, n, &err1, i1, i2, hinv);
    loss
}
