//! SmoothQuant (Xiao et al. 2023, §4, eq. 4; mit-han-lab/smoothquant `smooth_ln_fcs`,
//! `fake_quant.W8A8Linear`) and LLM.int8() (Dettmers et al. 2022, §3.2; bitsandbytes
//! `MatMul8bitLt`) on the host. The device-side activation hooks are in `crate::pipeline`.

use crate::{Error, Result, invalid};

/// Per-input-channel maximum absolute activation `max_t |x[t, j]|` over `[tokens, cols]`.
pub fn act_max_abs(x: &[f32], tokens: usize, cols: usize) -> Vec<f32> {
    let mut m = vec![0.0f32; cols];
    for t in 0..tokens {
        for (a, &v) in m.iter_mut().zip(&x[t * cols..(t + 1) * cols]) {
            *a = a.max(v.abs());
        }
    }
    m
}

/// SmoothQuant migration scales `s_j = max|X_j|^α / max|W_j|^(1−α)`, with `max|W_j|` taken over
/// all `weights` (`(data, rows)`, `[rows, cols]`) that read the same input and clamped to
/// `≥ 1e-5`, and `s` clamped to `≥ 1e-5` (so all-zero channels stay finite).
///
/// The smoothed model divides the input (fold `1/s` into the preceding RMSNorm weight) and
/// multiplies weight column `j` by `s_j`: `X W ᵀ = (X diag(s)⁻¹)(W diag(s))ᵀ`.
///
/// # Errors
/// `alpha` outside `[0, 1]`, shape mismatches.
pub fn smooth_scales(act_max: &[f32], weights: &[(&[f32], usize)], cols: usize, alpha: f64) -> Result<Vec<f32>> {
    if !(0.0..=1.0).contains(&alpha) {
        return Err(invalid("alpha", format!("{alpha} is outside [0, 1]")));
    }
    if act_max.len() != cols {
        return Err(Error::Shape(format!("{} activation maxima for {cols} input features", act_max.len())));
    }
    let mut wmax = vec![0.0f32; cols];
    for (w, rows) in weights {
        if w.len() != rows * cols {
            return Err(Error::Shape(format!("weight of {} values for {rows}x{cols}", w.len())));
        }
        for r in 0..*rows {
            for (m, &v) in wmax.iter_mut().zip(&w[r * cols..(r + 1) * cols]) {
                *m = m.max(v.abs());
            }
        }
    }
    Ok(act_max
        .iter()
        .zip(&wmax)
        .map(|(&a, &wm)| {
            let s = (a as f64).powf(alpha) / (wm.max(1e-5) as f64).powf(1.0 - alpha);
            s.max(1e-5) as f32
        })
        .collect())
}

/// Per-token dynamic symmetric int8 fake quantization of `[tokens, cols]` activations
/// (SmoothQuant `quantize_activation_per_token_absmax`: `scale = max|x_t| / 127`).
///
/// With `keep` (LLM.int8()), columns marked `true` are outliers: they are left in floating point
/// and excluded from the row's absmax, as bitsandbytes does for columns whose magnitude reaches
/// the threshold.
pub fn quant_act_per_token(x: &[f32], tokens: usize, cols: usize, keep: Option<&[bool]>) -> Vec<f32> {
    let mut out = x.to_vec();
    for t in 0..tokens {
        let row = &mut out[t * cols..(t + 1) * cols];
        let amax = row
            .iter()
            .enumerate()
            .filter(|(j, _)| keep.is_none_or(|k| !k[*j]))
            .fold(0.0f32, |m, (_, v)| m.max(v.abs()));
        if amax == 0.0 {
            continue;
        }
        let s = amax / 127.0;
        for (j, v) in row.iter_mut().enumerate() {
            if keep.is_none_or(|k| !k[j]) {
                *v = (*v / s).round_ties_even().clamp(-127.0, 127.0) * s;
            }
        }
    }
    out
}

/// LLM.int8() outlier columns of a batch: columns where some `|x| ≥ threshold` (default 6.0).
pub fn outlier_columns(x: &[f32], tokens: usize, cols: usize, threshold: f32) -> Vec<bool> {
    act_max_abs(x, tokens, cols).iter().map(|&m| m >= threshold).collect()
}

/// Automatic outlier dimensions from calibration: `max|X_j| > mean + 3σ` of the per-channel
/// magnitudes (the seed's variant of LLM.int8() without a fixed threshold).
pub fn outlier_columns_auto(act_max: &[f32]) -> Vec<bool> {
    let n = act_max.len().max(1) as f64;
    let mean = act_max.iter().map(|&v| v as f64).sum::<f64>() / n;
    let var = act_max.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
    let cut = mean + 3.0 * var.sqrt();
    act_max.iter().map(|&v| v as f64 > cut).collect()
}
