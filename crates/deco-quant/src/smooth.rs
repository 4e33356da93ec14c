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

/// How [`ActQuant`] quantizes the input of every linear layer at run time.
#[derive(Debug, Clone, PartialEq)]
pub enum ActMode {
    /// SmoothQuant W8A8: per-token dynamic symmetric int8 of the whole input
    /// ([`quant_act_per_token`]; smoothquant `W8A8Linear(act_quant="per_token")`).
    PerToken,
    /// LLM.int8(): columns where some `|x| ≥ threshold` in the current batch stay in floating
    /// point, the rest is per-token int8 ([`outlier_columns`], bitsandbytes `MatMul8bitLt`).
    Threshold(f32),
    /// LLM.int8() with fixed outlier columns per layer and site, chosen on calibration data by
    /// [`outlier_columns_auto`] (`max|X_j| > mean + 3σ`).
    Fixed,
}

/// Run-time activation quantization of a whole model (a [`deco_model::decoder::LayerHook`]):
/// what `deco_act_quant.json` beside a fake-quantized W8A8 / LLM.int8() checkpoint describes.
#[derive(Debug, Clone, PartialEq)]
pub struct ActQuant {
    /// The scheme.
    pub mode: ActMode,
    /// [`ActMode::Fixed`]: outlier input columns of `(layer, site)`; absent = none.
    pub columns: std::collections::BTreeMap<(usize, usize), Vec<u32>>,
}

/// File name of the activation-scheme description written beside W8A8 / LLM.int8() weights.
pub const ACT_QUANT_FILE: &str = "deco_act_quant.json";

fn site_index(site: deco_model::calibrate::Site) -> usize {
    use deco_model::calibrate::Site;
    match site {
        Site::AttnIn => 0,
        Site::AttnOut => 1,
        Site::MlpIn => 2,
        Site::DownIn => 3,
    }
}

const SITE_NAMES: [&str; 4] = ["attn_in", "attn_out", "mlp_in", "down_in"];

impl ActQuant {
    /// Quantizes `[tokens, cols]` host activations of `(layer, site)`.
    pub fn apply_host(&self, layer: usize, site: deco_model::calibrate::Site, x: &[f32], tokens: usize, cols: usize) -> Vec<f32> {
        match &self.mode {
            ActMode::PerToken => quant_act_per_token(x, tokens, cols, None),
            ActMode::Threshold(t) => {
                let keep = outlier_columns(x, tokens, cols, *t);
                quant_act_per_token(x, tokens, cols, Some(&keep))
            }
            ActMode::Fixed => {
                let mut keep = vec![false; cols];
                if let Some(cs) = self.columns.get(&(layer, site_index(site))) {
                    for &c in cs {
                        if let Some(k) = keep.get_mut(c as usize) {
                            *k = true;
                        }
                    }
                }
                quant_act_per_token(x, tokens, cols, Some(&keep))
            }
        }
    }

    /// The JSON description (`{"activations": "per_token_int8", "outliers": "none" |
    /// "threshold" | "fixed", "threshold": t, "columns": {"<layer>.<site>": [..]}}`).
    pub fn to_json(&self) -> serde_json::Value {
        let mut v = serde_json::json!({ "activations": "per_token_int8", "weights": "per_channel_absmax_int8" });
        match &self.mode {
            ActMode::PerToken => v["outliers"] = "none".into(),
            ActMode::Threshold(t) => {
                v["outliers"] = "threshold".into();
                v["threshold"] = (*t as f64).into();
            }
            ActMode::Fixed => {
                v["outliers"] = "fixed".into();
                let mut m = serde_json::Map::new();
                for ((l, s), cs) in &self.columns {
                    m.insert(format!("{l}.{}", SITE_NAMES[*s]), cs.clone().into());
                }
                v["columns"] = m.into();
            }
        }
        v
    }

    /// Parses [`ActQuant::to_json`]'s output.
    ///
    /// # Errors
    /// [`Error::InvalidParameter`] naming the field that is missing or malformed.
    pub fn from_json(v: &serde_json::Value) -> Result<Self> {
        if v["activations"].as_str() != Some("per_token_int8") {
            return Err(invalid("activations", "only \"per_token_int8\" is supported"));
        }
        let mut columns = std::collections::BTreeMap::new();
        let mode = match v["outliers"].as_str() {
            Some("none") => ActMode::PerToken,
            Some("threshold") => {
                let t = v["threshold"].as_f64().ok_or_else(|| invalid("threshold", "missing"))?;
                ActMode::Threshold(t as f32)
            }
            Some("fixed") => {
                let m = v["columns"].as_object().ok_or_else(|| invalid("columns", "missing"))?;
                for (k, cs) in m {
                    let (l, s) = k.split_once('.').ok_or_else(|| invalid("columns", format!("bad key {k}")))?;
                    let l: usize = l.parse().map_err(|_| invalid("columns", format!("bad layer in {k}")))?;
                    let s = SITE_NAMES.iter().position(|n| *n == s).ok_or_else(|| invalid("columns", format!("bad site in {k}")))?;
                    let cs = cs
                        .as_array()
                        .ok_or_else(|| invalid("columns", format!("{k} is not an array")))?
                        .iter()
                        .map(|c| c.as_u64().map(|c| c as u32).ok_or_else(|| invalid("columns", format!("{k}: not an index"))))
                        .collect::<Result<Vec<u32>>>()?;
                    columns.insert((l, s), cs);
                }
                ActMode::Fixed
            }
            _ => return Err(invalid("outliers", "expected \"none\", \"threshold\" or \"fixed\"")),
        };
        Ok(Self { mode, columns })
    }

    /// Sets the fixed outlier columns of `(layer, site)` from a mask.
    pub fn set_columns(&mut self, layer: usize, site: deco_model::calibrate::Site, mask: &[bool]) {
        let cs: Vec<u32> = mask.iter().enumerate().filter(|p| *p.1).map(|(i, _)| i as u32).collect();
        if !cs.is_empty() {
            self.columns.insert((layer, site_index(site)), cs);
        }
    }
}

impl deco_model::decoder::LayerHook for ActQuant {
    fn input(&self, layer: usize, site: deco_model::calibrate::Site, x: burn::tensor::Tensor<2>) -> burn::tensor::Tensor<2> {
        let [tokens, cols] = x.dims();
        let device = x.device();
        // On failure to read the tensor back, leave the input unquantized (never happens on the
        // CPU backend; the hook has no error channel).
        match deco_model::host::to_host(x.clone()) {
            Ok(h) => {
                let q = self.apply_host(layer, site, &h, tokens, cols);
                burn::tensor::Tensor::from_data(burn::tensor::TensorData::new(q, [tokens, cols]), &device)
            }
            Err(_) => x,
        }
    }
}
