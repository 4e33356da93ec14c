//! AWQ: activation-aware weight quantization (Lin et al. 2024, "AWQ", §3.2–3.3), following
//! mit-han-lab/llm-awq `auto_scale.auto_scale_block` / `_search_module_scale` and
//! `auto_clip.auto_clip_layer`.
//!
//! The searches here are model-agnostic: the caller passes the block whose output error is
//! minimised as a closure (see `deco_quant::pipeline` for the Llama wiring: Q/K/V scaled through
//! the input RMSNorm with the attention block as the objective, gate/up through the post-attention
//! RMSNorm with the MLP as objective, down through up_proj).

use crate::scheme::{Granularity, Scheme, check_bits, fake_quant_ragged};
use crate::{Error, Result};

/// Per-input-channel mean absolute activation `mean_t |x[t, j]|` (llm-awq `get_act_scale`).
///
/// `x` is `[tokens, cols]`; returns `[cols]`.
///
/// Blocks of tokens are summed in parallel (f64 partial sums per block, added in block order),
/// so the means are those of one f64 pass up to f64 rounding.
pub fn act_mean_abs(x: &[f32], tokens: usize, cols: usize) -> Vec<f32> {
    const TOKENS: usize = 512;
    let blocks = tokens.div_ceil(TOKENS);
    let mut partial = vec![0.0f64; blocks * cols];
    deco_kernels::team::par_chunks_mut(&mut partial, cols.max(1), |b, acc| {
        for t in b * TOKENS..((b + 1) * TOKENS).min(tokens) {
            for (a, &v) in acc.iter_mut().zip(&x[t * cols..(t + 1) * cols]) {
                *a += v.abs() as f64;
            }
        }
    });
    let mut acc = vec![0.0f64; cols];
    for p in partial.chunks_exact(cols.max(1)) {
        for (a, v) in acc.iter_mut().zip(p) {
            *a += v;
        }
    }
    acc.iter().map(|&a| (a / tokens.max(1) as f64) as f32).collect()
}

/// AWQ scales for one grid point: `s = max(mean|x|^ratio, 1e-4)`, then `s / sqrt(max s · min s)`.
/// Always finite and positive, also for all-zero channels (`0^ratio` is clamped to `1e-4`).
pub fn scales_for_ratio(x_mean: &[f32], ratio: f64) -> Vec<f32> {
    let s: Vec<f64> = x_mean.iter().map(|&m| (m as f64).powf(ratio).max(1e-4)).collect();
    let mx = s.iter().copied().fold(f64::MIN, f64::max);
    let mn = s.iter().copied().fold(f64::MAX, f64::min);
    let norm = (mx * mn).sqrt();
    s.iter().map(|&v| (v / norm) as f32).collect()
}

/// `Q(W · diag(s)) · diag(s)⁻¹` for a `[rows, cols]` weight: the weight as the scaled layer sees
/// it after quantization, expressed back in the unscaled input basis.
///
/// Groups that do not divide `cols` are ragged ([`crate::scheme::quantize_rtn_ragged`]).
///
/// # Errors
/// As [`fake_quant_ragged`].
pub fn scaled_fake_quant(w: &[f32], rows: usize, cols: usize, s: &[f32], scheme: &Scheme) -> Result<Vec<f32>> {
    let mut ws = w.to_vec();
    for r in 0..rows {
        for c in 0..cols {
            ws[r * cols + c] *= s[c];
        }
    }
    let mut q = fake_quant_ragged(&ws, rows, cols, scheme)?;
    for r in 0..rows {
        for c in 0..cols {
            q[r * cols + c] /= s[c];
        }
    }
    Ok(q)
}

/// Outcome of [`search_scale`].
#[derive(Debug, Clone)]
pub struct ScaleSearch {
    /// Best scales `[cols]`.
    pub scales: Vec<f32>,
    /// Best exponent `r`.
    pub ratio: f64,
    /// Block loss at each grid point `r = i / n_grid`.
    pub losses: Vec<f64>,
}

/// One grid point of [`search_scale`]: every weight sharing the input as
/// `Q(W · diag(s)) · diag(s)⁻¹` ([`scaled_fake_quant`]), computed row by row on request, so that
/// the block loss can pack each row straight into the layout its products use (deco's
/// calibrator packs bf16 weights from rows) instead of holding f32 copies of the candidate.
pub struct ScaleCandidate<'a> {
    /// The scales `s` (`[cols]`).
    pub scales: &'a [f32],
    weights: &'a [(&'a [f32], usize)],
    cols: usize,
    scheme: &'a Scheme,
    /// Per-tensor schemes have one range for the whole matrix, so their rows are not
    /// independent: the candidate is computed whole once.
    whole: Option<Vec<Vec<f32>>>,
}

impl ScaleCandidate<'_> {
    /// Writes row `r` (`[cols]`) of weight `i` (the order of [`search_scale`]'s `weights`) into
    /// `out`: the values [`scaled_fake_quant`] gives, bit for bit. May be called concurrently.
    ///
    /// # Panics
    /// If `i` or `r` is out of range or `out.len() != cols`.
    pub fn row(&self, i: usize, r: usize, out: &mut [f32]) {
        let c = self.cols;
        match &self.whole {
            Some(ws) => out.copy_from_slice(&ws[i][r * c..(r + 1) * c]),
            None => {
                let gs = match self.scheme.granularity {
                    Granularity::PerGroup(g) => g,
                    _ => c,
                };
                out.copy_from_slice(&self.weights[i].0[r * c..(r + 1) * c]);
                crate::scheme::scaled_fake_quant_row(out, self.scales, gs, self.scheme.bits, self.scheme.sym);
            }
        }
    }

    /// Weight `i` whole (`[rows_i, cols]`).
    pub fn weight(&self, i: usize) -> Vec<f32> {
        let (c, rows) = (self.cols, self.weights[i].1);
        let mut w = vec![0.0f32; rows * c];
        for (r, out) in w.chunks_exact_mut(c.max(1)).enumerate() {
            self.row(i, r, out);
        }
        w
    }
}

/// Grid search of the AWQ scale exponent (llm-awq `_search_module_scale`): for
/// `r = 0, 1/n_grid, …, (n_grid-1)/n_grid`, quantize every weight sharing the input with
/// [`scaled_fake_quant`] ([`ScaleCandidate`], row by row) and evaluate `block_loss` (the
/// block's output MSE against the original); keep the best `r`.
///
/// `weights` are `(data, rows)` pairs of `[rows, cols]` matrices.
///
/// # Errors
/// Invalid scheme, `n_grid == 0`, or whatever `block_loss` returns.
pub fn search_scale(
    x_mean: &[f32],
    weights: &[(&[f32], usize)],
    cols: usize,
    scheme: &Scheme,
    n_grid: usize,
    block_loss: &mut dyn FnMut(&ScaleCandidate<'_>) -> Result<f64>,
) -> Result<ScaleSearch> {
    if n_grid == 0 {
        return Err(crate::invalid("n_grid", "must be positive"));
    }
    if x_mean.len() != cols {
        return Err(Error::Shape(format!("{} activation means for {cols} input features", x_mean.len())));
    }
    check_bits(scheme.bits)?;
    if scheme.granularity == Granularity::PerGroup(0) {
        return Err(crate::invalid("group_size", "must be positive"));
    }
    if let Some((w, rows)) = weights.iter().find(|(w, rows)| w.len() != rows * cols) {
        return Err(Error::Shape(format!("{} values for a {rows}x{cols} weight", w.len())));
    }
    let mut best: Option<(f64, f64, Vec<f32>)> = None;
    let mut losses = Vec::with_capacity(n_grid);
    for i in 0..n_grid {
        let ratio = i as f64 / n_grid as f64;
        let s = scales_for_ratio(x_mean, ratio);
        let whole = match scheme.granularity {
            Granularity::PerTensor => Some(weights.iter().map(|(w, rows)| scaled_fake_quant(w, *rows, cols, &s, scheme)).collect::<Result<Vec<_>>>()?),
            _ => None,
        };
        let loss = block_loss(&ScaleCandidate { scales: &s, weights, cols, scheme, whole })?;
        losses.push(loss);
        if best.as_ref().is_none_or(|b| loss < b.0) {
            best = Some((loss, ratio, s));
        }
    }
    let (_, ratio, scales) = best.expect("n_grid > 0");
    Ok(ScaleSearch { scales, ratio, losses })
}

/// Clipping search (llm-awq `auto_clip_layer`): for every output row and group, the clip value
/// `max|w| · (1 - i/n_grid)`, `i < max_shrink · n_grid`, whose quantized group output
/// `x_g · clamp(w_g)ᵀ` has the least MSE over the `tokens` inputs `x` (`[tokens, cols]`).
/// Returns the clip values `[rows, groups]`, `groups = ceil(cols / group_size)` (the last group
/// ragged when the size does not divide `cols`).
///
/// The squared error of row `r` is computed as `d_rᵀ G d_r` (`G = x_gᵀ x_g`, `d_r` the row's
/// quantization change), the same sum as the reference's `(x_g q_rᵀ − x_g w_rᵀ)²` over tokens
/// with `group_size` instead of `tokens` multiply-adds per weight and candidate; groups run in
/// parallel.
///
/// # Errors
/// Invalid bits, group size 0, shapes.
#[allow(clippy::too_many_arguments)] // llm-awq's `auto_clip_layer` parameters, one to one
pub fn search_clip(
    w: &[f32],
    rows: usize,
    cols: usize,
    x: &[f32],
    tokens: usize,
    scheme: &Scheme,
    n_grid: usize,
    max_shrink: f64,
) -> Result<Vec<f32>> {
    check_bits(scheme.bits)?;
    if w.len() != rows * cols || x.len() != tokens * cols {
        return Err(Error::Shape("search_clip: weight or input size".into()));
    }
    let gs_full = match scheme.granularity {
        Granularity::PerGroup(0) => return Err(crate::invalid("group_size", "must be positive")),
        Granularity::PerGroup(g) => g.min(cols),
        _ => cols,
    };
    let groups = cols.div_ceil(gs_full);
    let steps = ((max_shrink * n_grid as f64) as usize).max(1);
    // Groups are independent: one rayon task each, the best clip value per row returned.
    let per_group: Vec<Vec<f32>> = {
        use rayon::prelude::*;
        (0..groups)
            .into_par_iter()
            .map(|g| -> Result<Vec<f32>> {
                let gs = gs_full.min(cols - g * gs_full);
                let c0 = g * gs_full;
                let mut xg = vec![0.0f32; tokens * gs];
                let mut wg = vec![0.0f32; rows * gs];
                for t in 0..tokens {
                    xg[t * gs..(t + 1) * gs].copy_from_slice(&x[t * cols + c0..t * cols + c0 + gs]);
                }
                for r in 0..rows {
                    wg[r * gs..(r + 1) * gs].copy_from_slice(&w[r * cols + c0..r * cols + c0 + gs]);
                }
                // Σ_t (x_t · (q_r − w_r))² = d_rᵀ G d_r with G = x_gᵀ x_g (`[gs, gs]`) and
                // d_r = q_r − w_r: the reference's output error from one Gram matrix per group
                // instead of a `[tokens, rows]` product per candidate (gs instead of tokens
                // multiply-adds per weight and candidate).
                let gram = deco_kernels::dense::gram(&xg, tokens, gs).expect("xg is tokens × gs");
                let org_max: Vec<f32> = (0..rows).map(|r| wg[r * gs..(r + 1) * gs].iter().fold(0.0f32, |m, v| m.max(v.abs()))).collect();
                let mut best_err = vec![f64::INFINITY; rows];
                let mut best = vec![0.0f32; rows];
                let mut dg = vec![0.0f32; rows * gs];
                let mut d = vec![0.0f32; rows * gs];
                let ones = vec![1.0f32; gs];
                for i in 0..steps {
                    let f = 1.0 - i as f32 / n_grid as f32;
                    // d_r = Q(clamp(w_r, ±m_r)) − w_r, one row at a time (the values of
                    // `fake_quant_ragged` of the clamped rows, per channel).
                    for ((dr, wr), &om) in d.chunks_exact_mut(gs).zip(wg.chunks_exact(gs)).zip(&org_max) {
                        let m = om * f;
                        for (dv, &wv) in dr.iter_mut().zip(wr) {
                            *dv = wv.clamp(-m, m);
                        }
                        crate::scheme::scaled_fake_quant_row(dr, &ones, gs, scheme.bits, scheme.sym);
                        for (dv, &wv) in dr.iter_mut().zip(wr) {
                            *dv -= wv;
                        }
                    }
                    // dg = d · G (G is symmetric, so it is its own `[in, out]` layout).
                    deco_kernels::dense::matmul(&d, rows, &gram, gs, gs, &mut dg).expect("d is rows × gs, G gs × gs");
                    for r in 0..rows {
                        let row = r * gs..(r + 1) * gs;
                        let err: f64 = dg[row.clone()].iter().zip(&d[row]).map(|(&a, &b)| a as f64 * b as f64).sum();
                        if err < best_err[r] {
                            best_err[r] = err;
                            best[r] = org_max[r] * f;
                        }
                    }
                }
                Ok(best)
            })
            .collect::<Result<_>>()?
    };
    let mut best_val = vec![0.0f32; rows * groups];
    for (g, best) in per_group.iter().enumerate() {
        for r in 0..rows {
            best_val[r * groups + g] = best[r];
        }
    }
    Ok(best_val)
}

/// Clamps every group of `w` (`[rows, cols]`) to `±clip[r, g]` (llm-awq `apply_clip`); group
/// `g` holds columns `g·group_size ..` (`group_size = cols` for per-channel clip values, as
/// [`search_clip`] returns them; `clip` is `[rows, ceil(cols / group_size)]`).
pub fn apply_clip(w: &mut [f32], rows: usize, cols: usize, group_size: usize, clip: &[f32]) {
    let groups = clip.len() / rows.max(1);
    let gs = group_size.max(1);
    for r in 0..rows {
        for c in 0..cols {
            let m = clip[r * groups + c / gs];
            w[r * cols + c] = w[r * cols + c].clamp(-m, m);
        }
    }
}


/// Options of whole-model AWQ ([`crate::pipeline::Method::Awq`]), llm-awq's defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AwqConfig {
    /// Grid points of the scale exponent search (`n_grid = 20` in `_search_module_scale`).
    pub n_grid: usize,
    /// Run the clipping search after scaling (`mse_range`, on by default).
    pub clip: bool,
    /// Largest clip shrink (`max_shrink = 0.5` in `auto_clip_layer`).
    pub max_shrink: f64,
    /// Calibration tokens (evenly subsampled) of the clipping search (`n_sample_token = 512`).
    pub clip_tokens: usize,
    /// Calibration windows (the first ones) on which the scale search evaluates its block loss;
    /// the activation statistics `mean|x|` use all windows. llm-awq evaluates the loss on all
    /// its 128 × 512 tokens; a few windows keep the 20-point search affordable on a CPU
    /// (4 windows of 256 tokens by default).
    pub search_windows: usize,
}

impl Default for AwqConfig {
    fn default() -> Self {
        Self { n_grid: 20, clip: true, max_shrink: 0.5, clip_tokens: 512, search_windows: 4 }
    }
}
