//! GPTQ (Frantar et al. 2023, "GPTQ: Accurate Post-Training Quantization for Generative
//! Pre-trained Transformers", Algorithm 1), following IST-DASLab/gptq `GPTQ.fasterquant` and
//! AutoGPTQ's `g_idx` bookkeeping; optionally with the reference `Quantizer`'s MSE-optimal
//! scale/zero search per group (`mse`, GPTQModel's option of the same name).

use rayon::prelude::*;

use crate::scheme::{QuantizedTensor, dequantize_value, find_params, find_params_mse, quantize_value};
use crate::{Error, Result, invalid};

/// Running estimate of a linear layer's Hessian `H = 2 X Xᵀ / n` (`[in, in]`, f64) over `n`
/// calibration tokens (gptq `add_batch`, with `n` counting tokens; the scale of `H` does not
/// change GPTQ's result since the damping is relative).
#[derive(Debug, Clone)]
pub struct Hessian {
    /// Input features.
    pub cols: usize,
    /// `[cols, cols]`, row-major.
    pub h: Vec<f64>,
    /// Tokens accumulated.
    pub n: usize,
}

impl Hessian {
    /// An empty accumulator for `cols` input features.
    pub fn new(cols: usize) -> Self {
        Self { cols, h: vec![0.0; cols * cols], n: 0 }
    }

    /// Adds `tokens` input rows `x` (`[tokens, cols]`, row-major): `H ← (n H + 2 xᵀx) / (n + t)`.
    ///
    /// # Errors
    /// [`Error::Shape`] if `x.len() != tokens * cols`.
    pub fn add_batch(&mut self, x: &[f32], tokens: usize) -> Result<()> {
        let c = self.cols;
        if x.len() != tokens * c {
            return Err(Error::Shape(format!("{} values for {tokens} tokens of {c} features", x.len())));
        }
        let gram: Vec<f64> = {
            let xd: Vec<f64> = x.iter().map(|&v| v as f64).collect();
            let mut g = vec![0.0f64; c * c];
            // SAFETY: slices sized m*k, k*n, m*n with the given strides.
            unsafe {
                matrixmultiply::dgemm(
                    c, tokens, c, 1.0, xd.as_ptr(), 1, c as isize, xd.as_ptr(), c as isize, 1, 0.0, g.as_mut_ptr(),
                    c as isize, 1,
                );
            }
            g
        };
        self.add_gram(&gram, tokens)
    }

    /// Adds a precomputed Gram matrix `xᵀx` (`[cols, cols]`) of `tokens` rows.
    ///
    /// # Errors
    /// [`Error::Shape`] on a wrong size.
    pub fn add_gram(&mut self, gram: &[f64], tokens: usize) -> Result<()> {
        if gram.len() != self.cols * self.cols {
            return Err(Error::Shape(format!("Gram matrix of {} values for {} features", gram.len(), self.cols)));
        }
        let n2 = self.n + tokens;
        if n2 == 0 {
            return Ok(());
        }
        let a = self.n as f64 / n2 as f64;
        let b = 2.0 / n2 as f64;
        for (h, g) in self.h.iter_mut().zip(gram) {
            *h = *h * a + b * g;
        }
        self.n = n2;
        Ok(())
    }
}

/// GPTQ options (AutoGPTQ `BaseQuantizeConfig` names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GptqConfig {
    /// Bits per weight: 2, 3, 4 or 8.
    pub bits: u32,
    /// Input columns per group; `None` = one group per output channel (`group_size = -1`).
    pub group_size: Option<usize>,
    /// Symmetric quantization.
    pub sym: bool,
    /// Dampening added to the diagonal, as a fraction of its mean (default 0.01).
    pub damp_percent: f64,
    /// Quantize columns in order of decreasing `H_ii` ("act-order").
    pub desc_act: bool,
    /// Compute all group parameters from the original weights before the loop (so act-order
    /// does not scatter a group's parameters).
    pub static_groups: bool,
    /// Columns per lazy batch update (128).
    pub blocksize: usize,
    /// MSE-optimal scale/zero search per group (GPTQModel's `mse`, gptq `Quantizer(mse=True)`):
    /// the norm `p` of the shrink search's `Σ |q(x) − x|^p` objective (2.4 in the reference);
    /// `0.0` = plain min-max parameters ([`find_params`]). See [`find_params_mse`].
    pub mse: f64,
}

impl Default for GptqConfig {
    fn default() -> Self {
        Self { bits: 4, group_size: Some(128), sym: true, damp_percent: 0.01, desc_act: false, static_groups: false, blocksize: 128, mse: 0.0 }
    }
}

/// Result of [`gptq_quantize`].
#[derive(Debug, Clone)]
pub struct GptqResult {
    /// Codes, parameters and `g_idx` (AutoGPTQ semantics: group `g_idx[c]` of column `c`).
    pub q: QuantizedTensor,
    /// `Σ (w - q)² / [H⁻¹]_jj / 2` over all weights (gptq's reported "error").
    pub loss: f64,
}

/// Quantizes a `[rows, cols]` weight against the Hessian of its inputs with GPTQ.
///
/// Follows `fasterquant`: dead inputs (`H_ii = 0`) get `H_ii = 1` and zero weights; damping
/// `damp_percent · mean(diag H)`; `U = chol(H⁻¹)` upper; columns processed in blocks of
/// `blocksize` with the rank-`blocksize` update of the remaining columns after each block
/// (lazy batch updates); with groups, a group's parameters are found when its first column
/// is reached from the weights as updated by the *previous blocks* (the reference reads the
/// outer `W`, not the block copy). With `desc_act` columns are permuted by decreasing `H_ii`
/// and `g_idx` maps each original column to its group; with `static_groups` groups are the
/// original consecutive column runs, parameters from the unmodified weights.
///
/// A `group_size` that does not divide `cols` gives AutoGPTQ's ragged groups:
/// `ceil(cols / group_size)` groups, the last one shorter (in quantization order: with
/// `desc_act` the short group holds the columns of smallest `H_ii`). AutoGPTQ allocates
/// `ceil(infeatures / group_size)` groups in `QuantLinear` and its `fasterquant` slices
/// `W[:, i:i + groupsize]`, which is short at the end.
///
/// # Errors
/// Invalid `bits` / `group_size` (0) / `blocksize` / `damp_percent` / `mse` (negative or not
/// finite),
/// shape mismatches or an empty weight, [`Error::NotPositiveDefinite`].
pub fn gptq_quantize(w: &[f32], rows: usize, cols: usize, hessian: &Hessian, cfg: &GptqConfig) -> Result<GptqResult> {
    crate::scheme::check_bits(cfg.bits)?;
    if w.len() != rows * cols || hessian.cols != cols {
        return Err(Error::Shape(format!(
            "weight of {} values for {rows}x{cols}, Hessian for {} columns",
            w.len(),
            hessian.cols
        )));
    }
    if cfg.blocksize == 0 {
        return Err(invalid("blocksize", "must be positive"));
    }
    if !(cfg.damp_percent > 0.0 && cfg.damp_percent.is_finite()) {
        return Err(invalid("damp_percent", format!("{} must be a positive fraction", cfg.damp_percent)));
    }
    if !(cfg.mse >= 0.0 && cfg.mse.is_finite()) {
        return Err(invalid("mse", format!("{} must be 0 (off) or a positive norm such as 2.4", cfg.mse)));
    }
    let gs = match cfg.group_size {
        Some(0) => return Err(invalid("group_size", "must be positive")),
        Some(g) => g,
        None => cols,
    };
    let grouped = cfg.group_size.is_some();
    if rows == 0 || cols == 0 {
        return Err(Error::Shape(format!("empty weight {rows}x{cols}")));
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
    let row_params = |wm: &[f64], r: usize, c0: usize, c1: usize| -> (f32, f32) {
        if cfg.mse > 0.0 {
            let v: Vec<f32> = wm[r * n + c0..r * n + c1].iter().map(|&v| v as f32).collect();
            find_params_mse(&v, cfg.bits, cfg.sym, cfg.mse, 100, 0.8)
        } else {
            find_params(wm[r * n + c0..r * n + c1].iter().map(|&v| v as f32), cfg.bits, cfg.sym)
        }
    };
    // Static groups: parameters per original group from the (dead-column-zeroed) weights.
    let static_params: Option<Vec<Vec<(f32, f32)>>> = (grouped && cfg.static_groups)
        .then(|| (0..n.div_ceil(gs)).map(|g| (0..rows).into_par_iter().map(|r| row_params(&wm, r, g * gs, ((g + 1) * gs).min(n))).collect()).collect());
    let perm: Vec<usize> = if cfg.desc_act {
        let mut p: Vec<usize> = (0..n).collect();
        // torch.argsort(descending=True) is not stable; a stable order is one valid choice.
        p.sort_by(|&a, &b| h[b * n + b].total_cmp(&h[a * n + a]));
        p
    } else {
        (0..n).collect()
    };
    if cfg.desc_act {
        let wp = wm.clone();
        for r in 0..rows {
            for (j, &pj) in perm.iter().enumerate() {
                wm[r * n + j] = wp[r * n + pj];
            }
        }
        let hp = h.clone();
        for (i, &pi) in perm.iter().enumerate() {
            for (j, &pj) in perm.iter().enumerate() {
                h[i * n + j] = hp[pi * n + pj];
            }
        }
    }
    let mean_diag = (0..n).map(|i| h[i * n + i]).sum::<f64>() / n as f64;
    let damp = cfg.damp_percent * mean_diag;
    for i in 0..n {
        h[i * n + i] += damp;
    }
    let hinv = crate::linalg::inverse_upper_cholesky(&h, n)?;

    // Group of each permuted column (AutoGPTQ's g_idx before un-permuting).
    let col_group: Vec<u32> = (0..n)
        .map(|col| match (&static_params, grouped) {
            (_, false) => 0,
            (Some(_), true) => (perm[col] / gs) as u32,
            (None, true) => (col / gs) as u32,
        })
        .collect();
    // Algorithm 1 treats the rows independently (a row's quantization error only updates its
    // own later columns; H⁻¹ is shared), so runs of ROW_CHUNK rows go through the whole column
    // loop in parallel. The chunks are fixed by the shape, not by the thread count, and each
    // row's arithmetic is the same as in one pass over all rows.
    let job = RowsJob { n, hinv: &hinv, cfg, gs, grouped, col_group: &col_group, row_params: &row_params };
    let chunks: Vec<RowsOut> = wm
        .par_chunks_mut(ROW_CHUNK * n)
        .enumerate()
        .map(|(ci, wc)| {
            let r0 = ci * ROW_CHUNK;
            let nr = wc.len() / n;
            let sp = static_params.as_ref().map(|sp| sp.iter().map(|g| &g[r0..r0 + nr]).collect::<Vec<_>>());
            gptq_rows_dispatch(&job, wc, nr, sp.as_deref())
        })
        .collect();
    let mut codes_p = Vec::with_capacity(rows * n);
    let mut loss = 0.0f64;
    let mut group_params: Vec<Vec<(f32, f32)>> = vec![Vec::with_capacity(rows); chunks.first().map_or(0, |c| c.params.len())];
    for c in chunks {
        codes_p.extend_from_slice(&c.codes);
        loss += c.loss;
        for (g, p) in group_params.iter_mut().zip(c.params) {
            g.extend(p);
        }
    }
    let params: Vec<Vec<(f32, f32)>> = match static_params {
        Some(sp) => sp,
        None => group_params,
    };
    let groups = params.len();
    let mut scales = vec![0.0f32; rows * groups];
    let mut zeros = vec![0.0f32; rows * groups];
    for (g, p) in params.iter().enumerate() {
        for r in 0..rows {
            scales[r * groups + g] = p[r].0;
            zeros[r * groups + g] = p[r].1;
        }
    }
    // Undo the permutation: original column perm[j] holds permuted column j.
    let mut codes = vec![0u8; rows * n];
    let mut g_idx = vec![0u32; n];
    for (j, &pj) in perm.iter().enumerate() {
        g_idx[pj] = col_group[j];
        for r in 0..rows {
            codes[r * n + pj] = codes_p[r * n + j];
        }
    }
    Ok(GptqResult {
        q: QuantizedTensor {
            rows,
            cols,
            bits: cfg.bits,
            sym: cfg.sym,
            group_size: gs,
            codes,
            scales,
            zeros,
            g_idx,
            param_rows: rows,
        },
        loss,
    })
}

// `gptq_rows` compiled for the widest vectors this CPU has (the column updates are f64 AXPYs;
// the baseline x86-64 build has SSE2 only): the same bits on every path.
wide_dispatch!(gptq_rows_dispatch(job: &RowsJob<'_>, wm: &mut [f64], nr: usize, static_params: Option<&[&[(f32, f32)]]>) -> RowsOut, gptq_rows);

/// What every row chunk of one [`gptq_quantize`] shares.
struct RowsJob<'a> {
    /// Columns (inputs).
    n: usize,
    /// The upper factor of `H⁻¹`, `[n, n]`, in permuted order.
    hinv: &'a [f64],
    cfg: &'a GptqConfig,
    /// Columns per group (`n` without groups).
    gs: usize,
    grouped: bool,
    /// Group of each permuted column.
    col_group: &'a [u32],
    row_params: &'a RowParams<'a>,
}

/// Rows per parallel task of [`gptq_quantize`].
const ROW_CHUNK: usize = 32;

/// `(scale, zero)` of row `r`'s columns `c0..c1` of a `[rows, n]` weight block.
type RowParams<'a> = dyn Fn(&[f64], usize, usize, usize) -> (f32, f32) + Sync + 'a;

/// What [`gptq_rows`] returns for its rows.
struct RowsOut {
    /// `[nr, n]` codes in permuted column order.
    codes: Vec<u8>,
    /// Per group (in order of first use), `nr` (scale, zero) pairs.
    params: Vec<Vec<(f32, f32)>>,
    /// The rows' share of [`GptqResult::loss`].
    loss: f64,
}

/// Algorithm 1 over `nr` rows `wm` (`[nr, n]`, permuted, dead columns zeroed; updated in
/// place) with the shared upper factor `job.hinv` of `H⁻¹`: lazy batches of `cfg.blocksize`
/// columns, group parameters found when a group's first column is reached (from the weights
/// as updated by the previous blocks), or taken from `static_params` (`[groups][nr]`) by the
/// group `job.col_group[col]` of each permuted column.
#[inline(always)]
fn gptq_rows(job: &RowsJob<'_>, wm: &mut [f64], nr: usize, static_params: Option<&[&[(f32, f32)]]>) -> RowsOut {
    let RowsJob { n, hinv, cfg, gs, grouped, col_group, row_params } = *job;
    let maxq = (1u32 << cfg.bits) - 1;
    let mut cur: Vec<(f32, f32)> = if grouped { vec![(1.0, 0.0); nr] } else { (0..nr).map(|r| row_params(wm, r, 0, n)).collect() };
    let mut params: Vec<Vec<(f32, f32)>> = Vec::new();
    if !grouped {
        params.push(cur.clone());
    }
    let mut codes = vec![0u8; nr * n];
    let mut loss = 0.0f64;
    let bs = cfg.blocksize;
    let mut w1 = vec![0.0f64; bs.min(n) * nr];
    let mut err1 = vec![0.0f64; bs.min(n) * nr];
    let mut i1 = 0;
    while i1 < n {
        let i2 = (i1 + bs).min(n);
        let count = i2 - i1;
        // Block copy, transposed: w1[i][r] = W[r, i1 + i].
        for r in 0..nr {
            for i in 0..count {
                w1[i * nr + r] = wm[r * n + i1 + i];
            }
        }
        for i in 0..count {
            let col = i1 + i;
            if grouped {
                if let Some(sp) = static_params {
                    let g = col_group[col] as usize;
                    for (r, c) in cur.iter_mut().enumerate() {
                        *c = sp[g][r];
                    }
                } else if col % gs == 0 {
                    cur = (0..nr).map(|r| row_params(wm, r, col, (col + gs).min(n))).collect();
                    params.push(cur.clone());
                }
            }
            let d = hinv[col * n + col];
            let (head, tail) = w1.split_at_mut((i + 1) * nr);
            let wcol = &head[i * nr..];
            let e = &mut err1[i * nr..(i + 1) * nr];
            for r in 0..nr {
                let (s, z) = cur[r];
                let code = quantize_value(wcol[r] as f32, s, z, maxq);
                codes[r * n + col] = code;
                let q = dequantize_value(code, s, z) as f64;
                let diff = wcol[r] - q;
                loss += diff * diff / (d * d) / 2.0;
                e[r] = diff / d;
            }
            crate::linalg::block_column_update(tail, e, &hinv[col * n + i1 + i + 1..col * n + i2]);
        }
        crate::linalg::lazy_batch_update(wm, nr, n, &err1, i1, i2, hinv);
        i1 = i2;
    }
    RowsOut { codes, params, loss }
}
