//! Whole-model unstructured / N:M pruning, layer by layer.
//!
//! Sequential like the references' `llama_sequential` (sparsegpt) and `prune_wanda` (wanda):
//! the calibration windows are embedded once; for each decoder layer the inputs of its seven
//! linear layers are captured with the layer's dense weights (and the already-pruned layers
//! before it), all seven are pruned, and the layer is rerun with its pruned weights to give the
//! next layer's input. Embedding, tied LM head and norms stay dense (as in both references).

use std::collections::HashMap;

use burn::tensor::{Device, Tensor};
use deco_formats::config::ModelConfig;
use deco_model::calibrate::{Calibrator, LayerWeights, Linear};
use deco_model::decoder::NoHook;
use deco_model::host::to_host;
use deco_quant::gptq::Hessian;

use crate::mask::{Mask, Pattern};
use crate::sparsegpt::{SparseGptConfig, sparsegpt_prune};
use crate::unstructured::{ColumnNorms, Scope, magnitude_prune, wanda_prune};
use crate::{Error, Result};

pub use deco_quant::pipeline::{TensorFn, calibration_windows};

/// Unstructured (or N:M) pruning method.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Method {
    /// `|W|`, ranked per layer or per output row; no calibration.
    Magnitude(Scope),
    /// `|W| · ‖X_j‖₂`, ranked per output row (Sun et al. 2024).
    Wanda,
    /// Hessian-based mask selection and OBS update (Frantar & Alistarh 2023).
    SparseGpt(SparseGptConfig),
}

impl Method {
    /// Whether the method needs calibration windows.
    pub fn needs_calibration(&self) -> bool {
        !matches!(self, Method::Magnitude(_))
    }
}

/// The pruned linear weights of a model.
#[derive(Debug, Clone, Default)]
pub struct PrunedModel {
    /// Every decoder linear weight, `[out, in]`, under its transformers name.
    pub linears: HashMap<String, Vec<f32>>,
    /// Zero weights among the pruned linears (mask plus any weight that was zero already).
    pub zeros: usize,
    /// Weights of the pruned linears.
    pub weights: usize,
    /// The kept/pruned flags of every pruned linear (`[out, in]`), under its transformers name:
    /// the sparsity pattern a recovery fine-tune keeps ([`crate::sparse_ft`]).
    pub masks: HashMap<String, Mask>,
}

impl PrunedModel {
    /// Fraction of zeros among the decoder linear weights.
    pub fn sparsity(&self) -> f64 {
        self.zeros as f64 / self.weights.max(1) as f64
    }

    /// A tensor source that serves the pruned linears and falls back to `base` for everything
    /// else (embedding, norms), for `deco_model::Llama::load_from`.
    pub fn source<'a>(&'a self, base: &'a TensorFn<'a>) -> impl Fn(&str) -> deco_model::Result<(Vec<usize>, Vec<f32>)> + 'a {
        move |name: &str| match self.linears.get(name) {
            Some(w) => {
                let (shape, _) = base(name)?;
                Ok((shape, w.clone()))
            }
            None => base(name),
        }
    }
}

/// `xᵀx` of a `[tokens, cols]` device tensor, as f64 on the host (GPTQ's
/// [`deco_quant::pipeline::gram`]).
///
/// # Errors
/// A failed device read.
pub fn gram(x: &Tensor<2>) -> Result<Vec<f64>> {
    Ok(deco_quant::pipeline::gram(x, deco_model::calibrate::CalibDtype::F32)?)
}

/// Per-column `Σ_t x_tj²` of a `[tokens, cols]` device tensor.
pub fn column_sum_sq(x: &Tensor<2>) -> Result<Vec<f32>> {
    Ok(to_host(x.clone().powi_scalar(2).sum_dim(0))?)
}

fn name(li: usize, l: Linear) -> String {
    format!("model.layers.{li}.{}.weight", l.hf_suffix())
}

/// Prunes every decoder linear layer of a model to `pattern`.
///
/// `windows` (calibration token windows, e.g. from [`calibration_windows`]) is needed by Wanda and
/// SparseGPT. `progress(layer)` is called after each layer.
///
/// # Errors
/// Invalid pattern (e.g. N:M with `m` not dividing a layer's input size), missing tensors,
/// calibration windows missing or longer than the context, a Hessian that cannot be factored.
pub fn prune_model(
    cfg: &ModelConfig,
    tensor: &TensorFn<'_>,
    device: &Device,
    windows: &[Vec<u32>],
    method: &Method,
    pattern: Pattern,
    progress: &mut dyn FnMut(usize),
) -> Result<PrunedModel> {
    pattern.validate()?;
    for l in Linear::ALL {
        pattern.check_cols(l.dims(cfg).1)?;
    }
    let mut out = PrunedModel::default();
    let record = |out: &mut PrunedModel, li: usize, lw: &LayerWeights, masks: Vec<(Linear, Mask)>| {
        for l in Linear::ALL {
            let w = lw.linear(l);
            out.zeros += w.iter().filter(|&&v| v == 0.0).count();
            out.weights += w.len();
            out.linears.insert(name(li, l), w.to_vec());
        }
        for (l, m) in masks {
            out.masks.insert(name(li, l), m);
        }
    };
    if let Method::Magnitude(scope) = *method {
        for li in 0..cfg.num_hidden_layers {
            let mut lw = LayerWeights::fetch(cfg, li, tensor)?;
            let mut masks = Vec::with_capacity(Linear::ALL.len());
            for l in Linear::ALL {
                let (rows, cols) = l.dims(cfg);
                masks.push((l, magnitude_prune(lw.linear_mut(l), rows, cols, pattern, scope)?));
            }
            record(&mut out, li, &lw, masks);
            progress(li);
        }
        return Ok(out);
    }
    if windows.is_empty() {
        return Err(Error::Calibration(format!("{method:?} needs calibration windows")));
    }
    let lens: Vec<usize> = windows.iter().map(Vec::len).collect();
    let c = Calibrator::new(cfg, device, &lens)?;
    let (_, embed) = tensor("model.embed_tokens.weight")?;
    let mut x = c.embed(&embed, windows)?;
    let n = c.tokens();
    for li in 0..cfg.num_hidden_layers {
        let mut lw = LayerWeights::fetch(cfg, li, tensor)?;
        let dl = c.upload(&lw);
        let inputs = c.site_inputs(&dl, x.clone())?;
        let mut masks = Vec::with_capacity(Linear::ALL.len());
        let groups: [(usize, &[Linear]); 4] = [
            (0, &[Linear::Q, Linear::K, Linear::V]),
            (1, &[Linear::O]),
            (2, &[Linear::Gate, Linear::Up]),
            (3, &[Linear::Down]),
        ];
        for (site, ls) in groups {
            let inp = &inputs[site];
            let cols = ls[0].dims(cfg).1;
            match method {
                Method::Wanda => {
                    let mut norms = ColumnNorms::new(cols);
                    norms.add_sums(&column_sum_sq(inp)?, n)?;
                    for &l in ls {
                        let rows = l.dims(cfg).0;
                        masks.push((l, wanda_prune(lw.linear_mut(l), rows, cols, &norms, pattern)?));
                    }
                }
                Method::SparseGpt(sg) => {
                    let mut h = Hessian::new(cols);
                    h.add_gram(&gram(inp)?, n)?;
                    for &l in ls {
                        let rows = l.dims(cfg).0;
                        let r = sparsegpt_prune(lw.linear(l), rows, cols, &h, pattern, sg)?;
                        *lw.linear_mut(l) = r.weights;
                        masks.push((l, r.mask));
                    }
                }
                Method::Magnitude(_) => {}
            }
        }
        drop(inputs);
        let dl = c.upload(&lw);
        x = c.layer(li, &dl, x, &NoHook)?;
        record(&mut out, li, &lw, masks);
        progress(li);
    }
    Ok(out)
}
