//! Whole-model quantization of a Llama-family checkpoint, layer by layer
//! (GPTQ `llama.py` `llama_sequential`: each layer's inputs come from the already-quantized
//! layers before it; inside a layer, `true_sequential` order q/k/v → o → gate/up → down).
//!
//! Output: fake-quantized f32 weights under transformers names (feed them to
//! `deco_model::Llama::load_from`), plus the integer form of each quantized linear.

use std::collections::HashMap;

use burn::tensor::{Device, Tensor};
use deco_formats::config::ModelConfig;
use deco_model::calibrate::{Calibrator, LayerWeights, Linear, to_host};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::gptq::{GptqConfig, Hessian, gptq_quantize};
use crate::nf4::Nf4Tensor;
use crate::scheme::{Granularity, Scheme, quantize_rtn};
use crate::{Error, Result, invalid};

/// Quantization method of [`quantize_model`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Method {
    /// Round to nearest.
    Rtn,
    /// GPTQ with the given options (`bits`, `group_size`, `sym` come from them).
    Gptq(GptqConfig),
    /// NF4, block size `group_size` (64), double quantization.
    Nf4,
}

/// A tensor source: transformers name → (shape, row-major f32).
pub type TensorFn<'a> = dyn Fn(&str) -> deco_model::Result<(Vec<usize>, Vec<f32>)> + 'a;

/// The result of [`quantize_model`].
#[derive(Debug, Clone)]
pub struct QuantizedModel {
    /// Every decoder linear weight, fake-quantized, `[out, in]`, under its transformers name.
    pub linears: HashMap<String, Vec<f32>>,
    /// Total bits of the quantized linears' storage (codes and parameters).
    pub storage_bits: f64,
    /// Number of quantized weights.
    pub weights: usize,
}

impl QuantizedModel {
    /// Average storage bits per quantized weight, parameters included.
    pub fn bits_per_weight(&self) -> f64 {
        self.storage_bits / self.weights.max(1) as f64
    }

    /// A tensor source that serves the quantized linears and falls back to `base` for
    /// everything else (embeddings, norms).
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

/// `nsamples` random windows of `seqlen` tokens from a token stream (GPTQ `get_wikitext2`:
/// uniform random starts, seeded).
///
/// # Errors
/// [`Error::Calibration`] if the stream is shorter than one window or `nsamples`/`seqlen` is 0.
pub fn calibration_windows(tokens: &[u32], nsamples: usize, seqlen: usize, seed: u64) -> Result<Vec<Vec<u32>>> {
    if nsamples == 0 || seqlen == 0 {
        return Err(invalid("nsamples", "nsamples and seqlen must be positive"));
    }
    if tokens.len() <= seqlen {
        return Err(Error::Calibration(format!("{} calibration tokens, need more than seqlen {seqlen}", tokens.len())));
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    Ok((0..nsamples)
        .map(|_| {
            let s = rng.random_range(0..tokens.len() - seqlen);
            tokens[s..s + seqlen].to_vec()
        })
        .collect())
}

fn gram(x: &Tensor<2>) -> Result<Vec<f64>> {
    let g = x.clone().transpose().matmul(x.clone());
    Ok(to_host(g)?.iter().map(|&v| v as f64).collect())
}

/// Quantizes every decoder linear of a model.
///
/// `windows` (calibration) is needed by GPTQ only. `progress(layer)` is called after each layer.
///
/// # Errors
/// Invalid parameters, a `group_size` that does not divide a layer's input dimension, missing
/// tensors, empty calibration.
pub fn quantize_model(
    cfg: &ModelConfig,
    tensor: &TensorFn<'_>,
    device: &Device,
    windows: &[Vec<u32>],
    method: &Method,
    scheme: &Scheme,
    progress: &mut dyn FnMut(usize),
) -> Result<QuantizedModel> {
    let mut out = QuantizedModel { linears: HashMap::new(), storage_bits: 0.0, weights: 0 };
    let calib = match method {
        Method::Gptq(_) => {
            if windows.is_empty() {
                return Err(Error::Calibration("GPTQ needs calibration windows".into()));
            }
            let lens: Vec<usize> = windows.iter().map(Vec::len).collect();
            let c = Calibrator::new(cfg, device, &lens)?;
            let (_, embed) = tensor("model.embed_tokens.weight")?;
            let x = c.embed(&embed, windows)?;
            Some((c, x))
        }
        _ => None,
    };
    let name = |li: usize, l: Linear| format!("model.layers.{li}.{}.weight", l.hf_suffix());
    match (method, calib) {
        (Method::Gptq(g), Some((c, mut x))) => {
            for li in 0..cfg.num_hidden_layers {
                let mut lw = LayerWeights::fetch(cfg, li, tensor)?;
                let n = c.tokens();
                let mut quant = |lw: &mut LayerWeights, inp: &Tensor<2>, ls: &[Linear]| -> Result<()> {
                    let (_, cols) = ls[0].dims(cfg);
                    let mut h = Hessian::new(cols);
                    h.add_gram(&gram(inp)?, n)?;
                    for &l in ls {
                        let (rows, cols) = l.dims(cfg);
                        let r = gptq_quantize(lw.linear(l), rows, cols, &h, g)?;
                        out.storage_bits += r.q.bits_per_weight() * (rows * cols) as f64;
                        out.weights += rows * cols;
                        *lw.linear_mut(l) = r.q.dequantize();
                    }
                    Ok(())
                };
                let dl = c.upload(&lw);
                let xn = c.attn_in(&dl, x.clone());
                quant(&mut lw, &xn, &[Linear::Q, Linear::K, Linear::V])?;
                let dl = c.upload(&lw);
                let a = c.attention(&dl, xn, None);
                quant(&mut lw, &a, &[Linear::O])?;
                let dl = c.upload(&lw);
                let x2 = c.attn_residual(&dl, x, a, None);
                let xn2 = c.mlp_in(&dl, x2.clone());
                quant(&mut lw, &xn2, &[Linear::Gate, Linear::Up])?;
                let dl = c.upload(&lw);
                let hmid = c.swiglu_out(&dl, xn2, None);
                quant(&mut lw, &hmid, &[Linear::Down])?;
                let dl = c.upload(&lw);
                x = c.mlp_residual(&dl, x2, hmid, None);
                for l in Linear::ALL {
                    out.linears.insert(name(li, l), lw.linear(l).to_vec());
                }
                progress(li);
            }
        }
        _ => {
            for li in 0..cfg.num_hidden_layers {
                let lw = LayerWeights::fetch(cfg, li, tensor)?;
                for l in Linear::ALL {
                    let (rows, cols) = l.dims(cfg);
                    let w = lw.linear(l);
                    let deq = match method {
                        Method::Nf4 => {
                            let bs = match scheme.granularity {
                                Granularity::PerGroup(g) => g,
                                _ => 64,
                            };
                            let t = Nf4Tensor::quantize(w, bs)?;
                            out.storage_bits += t.bits_per_weight() * w.len() as f64;
                            t.dequantize()
                        }
                        _ => {
                            let q = quantize_rtn(w, rows, cols, scheme)?;
                            out.storage_bits += q.bits_per_weight() * w.len() as f64;
                            q.dequantize()
                        }
                    };
                    out.weights += w.len();
                    out.linears.insert(name(li, l), deq);
                }
                progress(li);
            }
        }
    }
    Ok(out)
}
