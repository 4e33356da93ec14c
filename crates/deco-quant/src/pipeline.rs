//! Whole-model quantization of a Llama-family checkpoint, layer by layer.
//!
//! One loop ([`quantize_model`]) serves every method:
//!
//! - RTN and NF4 quantize each linear on its own (no calibration);
//! - GPTQ follows GPTQ `llama.py` `llama_sequential`: each layer's inputs come from the
//!   already-quantized layers before it; inside a layer, `true_sequential` order
//!   q/k/v → o → gate/up → down;
//! - AWQ follows llm-awq `run_awq`: per layer, on the full-precision inputs, the scale searches
//!   (q/k/v through `input_layernorm` with the attention block as objective, gate/up through
//!   `post_attention_layernorm` with the MLP, o through v_proj when their shapes match, down
//!   through up_proj with down_proj alone), the scales folded into the norms / preceding linear,
//!   then the clipping search (all linears but q/k), then RTN of the scaled and clipped weights;
//!   the next layer's inputs are the full-precision layer outputs;
//! - SmoothQuant (W8A8) follows smoothquant `smooth_lm` + `quantize_llama_like`: migration
//!   scales from the per-channel activation maxima folded into both RMSNorms, per-channel absmax
//!   int8 weights, per-token int8 activations at run time ([`crate::smooth::ActQuant`]);
//! - LLM.int8() quantizes weights vector-wise (absmax int8 rows) and keeps outlier activation
//!   columns in floating point at run time (threshold, or columns found on calibration data).
//!
//! Output: fake-quantized f32 weights under transformers names (feed [`QuantizedModel::source`]
//! to `deco_model::Llama::load_from`), the integer form of each linear where the method has one
//! (RTN, GPTQ, AWQ), the tensors changed by scale folding (norms), and the run-time activation
//! scheme of W8A8 / LLM.int8().

use std::collections::{BTreeMap, HashMap};

use burn::tensor::{Device, Tensor, TensorData};
use deco_formats::config::ModelConfig;
use deco_model::calibrate::{CalibDtype, Calibrator, LayerWeights, Linear, Site};
use deco_model::decoder::DecoderLayer;
use deco_model::host::{to_host, with_host};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::awq::{AwqConfig, ScaleCandidate, act_mean_abs, apply_clip, search_clip, search_scale};
use crate::gptq::{GptqConfig, Hessian, gptq_quantize};
use crate::nf4::Nf4Tensor;
use crate::scheme::{Granularity, QuantizedTensor, Scheme, absmax_int8_rows, check_bits, quantize_rtn_ragged};
use crate::smooth::{ActMode, ActQuant, act_max_abs, outlier_columns_auto, smooth_scales};
use crate::{Error, Result, invalid};

/// Quantization method of [`quantize_model`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Method {
    /// Round to nearest (ragged last group allowed, as AutoGPTQ).
    Rtn,
    /// GPTQ with the given options (`bits`, `group_size`, `sym` come from them).
    Gptq(GptqConfig),
    /// NF4, block size `group_size` (64), double quantization.
    Nf4,
    /// AWQ scale + clip search, then RTN with the scheme (Lin et al. 2024).
    Awq(AwqConfig),
    /// SmoothQuant W8A8 with migration strength `alpha` in `[0, 1]` (Xiao et al. 2023, eq. 4).
    SmoothQuant {
        /// Migration strength α (0.5 in the paper for most models).
        alpha: f64,
    },
    /// LLM.int8(): vector-wise int8 weights, outlier activation columns in float.
    LlmInt8 {
        /// Outlier threshold on `|x|` (6.0 in the paper); used when `auto` is false.
        threshold: f32,
        /// Fixed outlier columns from calibration (`max|X_j| > mean + 3σ`) instead of the
        /// per-batch threshold.
        auto: bool,
    },
}

impl Method {
    /// Whether the method needs calibration windows.
    pub fn needs_calibration(&self) -> bool {
        matches!(self, Method::Gptq(_) | Method::Awq(_) | Method::SmoothQuant { .. } | Method::LlmInt8 { auto: true, .. })
    }
}

/// A tensor source: transformers name → (shape, row-major f32).
pub type TensorFn<'a> = dyn Fn(&str) -> deco_model::Result<(Vec<usize>, Vec<f32>)> + 'a;

/// The result of [`quantize_model`].
#[derive(Debug, Clone)]
pub struct QuantizedModel {
    /// Every decoder linear weight, fake-quantized, `[out, in]`, under its transformers name (in
    /// the basis of the stored model: after AWQ / SmoothQuant scale folding).
    pub linears: HashMap<String, Vec<f32>>,
    /// Integer forms of the linears (RTN, GPTQ, AWQ; empty for NF4, W8A8, LLM.int8()).
    pub quantized: BTreeMap<String, QuantizedTensor>,
    /// Other tensors changed by the method (RMSNorm weights with folded AWQ / SmoothQuant scales).
    pub other: HashMap<String, Vec<f32>>,
    /// Run-time activation quantization (SmoothQuant, LLM.int8()).
    pub act_quant: Option<ActQuant>,
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

    /// A tensor source that serves the quantized linears and changed norms, and falls back to
    /// `base` for everything else (embeddings, other norms).
    pub fn source<'a>(&'a self, base: &'a TensorFn<'a>) -> impl Fn(&str) -> deco_model::Result<(Vec<usize>, Vec<f32>)> + 'a {
        move |name: &str| match self.linears.get(name).or_else(|| self.other.get(name)) {
            Some(w) => {
                let (shape, _) = base(name)?;
                Ok((shape, w.clone()))
            }
            None => base(name),
        }
    }

    fn record(&mut self, name: String, q: QuantizedTensor) {
        self.storage_bits += q.bits_per_weight() * (q.rows * q.cols) as f64;
        self.weights += q.rows * q.cols;
        self.linears.insert(name.clone(), q.dequantize());
        self.quantized.insert(name, q);
    }

    fn record_f32(&mut self, name: String, w: Vec<f32>, bits_per_weight: f64) {
        self.storage_bits += bits_per_weight * w.len() as f64;
        self.weights += w.len();
        self.linears.insert(name, w);
    }
}

/// `nsamples` random windows of `seqlen` tokens from a token stream (GPTQ `get_wikitext2`:
/// uniform random starts, seeded).
///
/// # Errors
/// [`Error::InvalidParameter`] if `nsamples` or `seqlen` is 0; [`Error::Calibration`] if the
/// stream is shorter than one window.
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

/// `xᵀx` (`[cols, cols]`, f64 on the host) of a `[tokens, cols]` calibration tensor, for the
/// Hessians of GPTQ and SparseGPT: on the CPU through the half-work symmetric kernel
/// ([`deco_kernels::dense::gram`], or [`deco_kernels::bf16::gram`] of the bf16-rounded `x` under
/// [`CalibDtype::Bf16`], [`deco_kernels::int16::gram`] under [`CalibDtype::Int16`]), on a GPU as
/// a device matmul.
///
/// # Errors
/// A failed device read; [`Error::Calibration`] for bf16 on a CPU without AVX-512 BF16, int16
/// on one without AVX2.
pub fn gram(x: &Tensor<2>, dtype: CalibDtype) -> Result<Vec<f64>> {
    if x.device() == Device::flex() {
        let [n, cols] = x.dims();
        let g = with_host(x, |xs| match dtype {
            CalibDtype::Bf16 => deco_kernels::bf16::gram(xs, n, cols),
            CalibDtype::Int16 => deco_kernels::int16::gram(xs, n, cols),
            CalibDtype::F32 => deco_kernels::dense::gram(xs, n, cols),
        })?
        .map_err(|e| Error::Calibration(format!("Gram matrix: {e}")))?;
        return Ok(g.iter().map(|&v| v as f64).collect());
    }
    let g = x.clone().transpose().matmul(x.clone());
    Ok(to_host(g)?.iter().map(|&v| v as f64).collect())
}

/// Mean squared difference of two equally shaped device tensors.
fn mse(a: &Tensor<2>, b: &Tensor<2>) -> Result<f64> {
    let d = a.clone().sub(b.clone());
    let m = d.clone().mul(d).mean().reshape([1, 1]);
    Ok(to_host(m)?.first().copied().unwrap_or(f32::NAN) as f64)
}

/// Checks the method's own parameters and the scheme's bits / group size.
fn validate(method: &Method, scheme: &Scheme) -> Result<()> {
    match method {
        Method::Rtn | Method::Awq(_) => check_bits(scheme.bits)?,
        Method::Gptq(g) => check_bits(g.bits)?,
        _ => {}
    }
    if matches!(method, Method::Rtn | Method::Awq(_) | Method::Nf4) && scheme.granularity == Granularity::PerGroup(0) {
        return Err(invalid("group_size", "must be positive"));
    }
    match method {
        Method::Awq(a) if a.n_grid == 0 => Err(invalid("n_grid", "must be positive")),
        Method::Awq(a) if !(0.0..1.0).contains(&a.max_shrink) => Err(invalid("max_shrink", format!("{} is outside [0, 1)", a.max_shrink))),
        Method::SmoothQuant { alpha } if !(0.0..=1.0).contains(alpha) => Err(invalid("alpha", format!("{alpha} is outside [0, 1]"))),
        Method::LlmInt8 { threshold, auto: false } if !(*threshold > 0.0 && threshold.is_finite()) => {
            Err(invalid("threshold", format!("{threshold} must be positive")))
        }
        _ => Ok(()),
    }
}

/// The full-precision stages of one layer: the inputs of every site and the output.
struct Stages {
    xn: Tensor<2>,
    att: Tensor<2>,
    x2: Tensor<2>,
    xn2: Tensor<2>,
    h: Tensor<2>,
    y: Tensor<2>,
}

fn stages(c: &Calibrator, lw: &LayerWeights, x: &Tensor<2>) -> Result<Stages> {
    let dl = c.upload(lw);
    let xn = c.attn_in(&dl, x.clone());
    let att = c.attention(&dl, xn.clone())?;
    let x2 = c.attn_residual(&dl, x.clone(), att.clone())?;
    let xn2 = c.mlp_in(&dl, x2.clone());
    let h = c.swiglu_out(&dl, xn2.clone())?;
    let y = c.mlp_residual(&dl, x2.clone(), h.clone())?;
    Ok(Stages { xn, att, x2, xn2, h, y })
}

fn scale_cols(w: &mut [f32], cols: usize, s: &[f32]) {
    for row in w.chunks_mut(cols) {
        for (v, &f) in row.iter_mut().zip(s) {
            *v *= f;
        }
    }
}

fn div_rows(w: &mut [f32], cols: usize, s: &[f32]) {
    for (row, &f) in w.chunks_mut(cols).zip(s) {
        for v in row {
            *v /= f;
        }
    }
}

/// Every `step`-th token row of `[tokens, cols]` `x` (`step = max(tokens / want, 1)`, llm-awq
/// `auto_clip_layer`'s even subsampling) and their count.
fn subsample(x: &[f32], tokens: usize, cols: usize, want: usize) -> (Vec<f32>, usize) {
    let step = (tokens / want.max(1)).max(1);
    let mut out = Vec::new();
    let mut n = 0;
    for t in (0..tokens).step_by(step) {
        out.extend_from_slice(&x[t * cols..(t + 1) * cols]);
        n += 1;
    }
    (out, n)
}

/// llm-awq `auto_scale_block` + `apply_scale` + `auto_clip_block` + `apply_clip` on one layer
/// (`lw` is modified in place: scaled norms and weights, clipped weights). Returns nothing; the
/// caller quantizes the weights and feeds the full-precision output `st.y` forward.
#[allow(clippy::too_many_arguments)] // the calibrators, the layer, its stages and the options
fn awq_layer(
    c: &Calibrator,
    sub: &Calibrator,
    cfg: &ModelConfig,
    lw: &mut LayerWeights,
    x: &Tensor<2>,
    st: &Stages,
    scheme: &Scheme,
    a: &AwqConfig,
) -> Result<()> {
    let n = c.tokens();
    let (hid, inter) = (cfg.hidden_size, cfg.intermediate_size);
    let qd = Linear::O.dims(cfg).1;
    // The statistics (`mean|x|` over all tokens) and the clipping samples read the stage
    // activations in place; the block losses run on the first `search_windows` windows (`sub`),
    // copied out once.
    let stat = |t: &Tensor<2>| -> Result<(Vec<f32>, Vec<f32>, usize)> {
        let [_, cols] = t.dims();
        Ok(with_host(t, |h| {
            let (xs, k) = subsample(h, n, cols, a.clip_tokens);
            (act_mean_abs(h, n, cols), xs, k)
        })?)
    };
    let (xn_mean, xn_clip, xn_t) = stat(&st.xn)?;
    let (att_mean, att_clip, att_t) = stat(&st.att)?;
    let (xn2_mean, xn2_clip, xn2_t) = stat(&st.xn2)?;
    let (h_mean, h_clip, h_t) = stat(&st.h)?;
    let m = sub.tokens();
    let rows_of = |t: &Tensor<2>| -> Result<Tensor<2>> {
        let [_, d] = t.dims();
        Ok(with_host(t, |h| Tensor::from_data(TensorData::new(h[..m * d].to_vec(), [m, d]), &t.device()))?)
    };
    let x = &rows_of(x)?;
    let st = &Stages { xn: rows_of(&st.xn)?, att: rows_of(&st.att)?, x2: rows_of(&st.x2)?, xn2: rows_of(&st.xn2)?, h: rows_of(&st.h)?, y: rows_of(&st.y)? };
    let c = sub;
    // The searches below run on the unscaled layer: each candidate replaces only the linears it
    // scales, and only their fused weights are uploaded again.
    let base = c.upload(lw);
    let lw_ref: &LayerWeights = lw;
    let search = |ls: &[Linear], m: &[f32], cols: usize, loss: &mut dyn FnMut(&DecoderLayer) -> Result<f64>| -> Result<Vec<f32>> {
        let ws: Vec<(&[f32], usize)> = ls.iter().map(|&l| (lw_ref.linear(l), l.dims(cfg).0)).collect();
        // Each candidate's rows are quantized straight into the layout of the products.
        let mut block = |cand: &ScaleCandidate<'_>| -> Result<f64> {
            let row = |l: Linear, r: usize, buf: &mut [f32]| {
                let i = ls.iter().position(|&x| x == l).expect("upload_rows asks for replaced linears only");
                cand.row(i, r, buf);
            };
            loss(&c.upload_rows(&base, lw_ref, ls, &row))
        };
        Ok(search_scale(m, &ws, cols, scheme, a.n_grid, &mut block)?.scales)
    };
    // 1. q/k/v through input_layernorm; objective: the attention block output.
    let s_qkv = search(&[Linear::Q, Linear::K, Linear::V], &xn_mean, hid, &mut |d| {
        let a2 = c.attention(d, st.xn.clone())?;
        mse(&c.attn_residual(d, x.clone(), a2)?, &st.x2)
    })?;
    // 2. o through v_proj (only when v_proj's output is o_proj's input: no GQA).
    let v_out = Linear::V.dims(cfg).0;
    let s_o = if v_out == qd {
        Some(search(&[Linear::O], &att_mean, qd, &mut |d| mse(&c.attn_residual(d, x.clone(), st.att.clone())?, &st.x2))?)
    } else {
        None
    };
    // 3. gate/up through post_attention_layernorm; objective: the MLP output.
    let s_mlp = search(&[Linear::Gate, Linear::Up], &xn2_mean, hid, &mut |d| {
        let hc = c.swiglu_out(d, st.xn2.clone())?;
        mse(&c.mlp_residual(d, st.x2.clone(), hc)?, &st.y)
    })?;
    // 4. down through up_proj; objective: down_proj's output.
    let s_down = search(&[Linear::Down], &h_mean, inter, &mut |d| mse(&c.mlp_residual(d, st.x2.clone(), st.h.clone())?, &st.y))?;
    // apply_scale: norm / s (input side), weight columns · s.
    for (n, s) in lw.attn_norm.iter_mut().zip(&s_qkv) {
        *n /= s;
    }
    for l in [Linear::Q, Linear::K, Linear::V] {
        scale_cols(lw.linear_mut(l), hid, &s_qkv);
    }
    if let Some(s) = &s_o {
        div_rows(lw.linear_mut(Linear::V), hid, s);
        scale_cols(lw.linear_mut(Linear::O), qd, s);
    }
    for (n, s) in lw.ffn_norm.iter_mut().zip(&s_mlp) {
        *n /= s;
    }
    for l in [Linear::Gate, Linear::Up] {
        scale_cols(lw.linear_mut(l), hid, &s_mlp);
    }
    div_rows(lw.linear_mut(Linear::Up), hid, &s_down);
    scale_cols(lw.linear_mut(Linear::Down), inter, &s_down);
    if a.clip {
        // auto_clip_block: every linear but q/k, on the (scaled) inputs.
        type ClipInput<'a> = (Linear, (&'a [f32], usize), usize, Option<&'a [f32]>);
        let inputs: [ClipInput<'_>; 5] = [
            (Linear::V, (&xn_clip, xn_t), hid, Some(&s_qkv)),
            (Linear::O, (&att_clip, att_t), qd, s_o.as_deref()),
            (Linear::Gate, (&xn2_clip, xn2_t), hid, Some(&s_mlp)),
            (Linear::Up, (&xn2_clip, xn2_t), hid, Some(&s_mlp)),
            (Linear::Down, (&h_clip, h_t), inter, Some(&s_down)),
        ];
        for (l, (xh, t), cols, s) in inputs {
            // The samples as the scaled layer sees them: columns divided by s.
            let mut xs = xh.to_vec();
            if let Some(s) = s {
                for row in xs.chunks_mut(cols) {
                    for (v, f) in row.iter_mut().zip(s) {
                        *v /= f;
                    }
                }
            }
            let rows = l.dims(cfg).0;
            let clip = search_clip(lw.linear(l), rows, cols, &xs, t, scheme, a.n_grid, a.max_shrink)?;
            let gs = match scheme.granularity {
                Granularity::PerGroup(g) => g.min(cols),
                _ => cols,
            };
            apply_clip(lw.linear_mut(l), rows, cols, gs, &clip);
        }
    }
    Ok(())
}

/// Quantizes every decoder linear of a model with `method` (see the module docs).
///
/// `scheme` gives bits / symmetry / groups for RTN and AWQ, the block size for NF4
/// (`PerGroup(64)`); GPTQ takes them from its config; W8A8 and LLM.int8() are always int8.
/// `windows` (calibration token windows) are needed by GPTQ, AWQ, SmoothQuant and automatic
/// LLM.int8(). `dtype` is the precision of the calibration forward and of GPTQ's Hessians
/// ([`CalibDtype`]; the methods without calibration run no products). `progress(layer)` is
/// called after each layer.
///
/// # Errors
/// [`Error::InvalidParameter`] naming `bits`, `group_size`, `alpha`, `threshold`, `n_grid`;
/// [`Error::Calibration`] without calibration windows where needed; missing tensors;
/// [`Error::NotPositiveDefinite`] from GPTQ; the model error of [`Calibrator::with_dtype`] for
/// bf16 where it cannot run.
#[allow(clippy::too_many_arguments)] // the model, its calibration and the method's settings
pub fn quantize_model(
    cfg: &ModelConfig,
    tensor: &TensorFn<'_>,
    device: &Device,
    windows: &[Vec<u32>],
    method: &Method,
    scheme: &Scheme,
    dtype: CalibDtype,
    progress: &mut dyn FnMut(usize),
) -> Result<QuantizedModel> {
    validate(method, scheme)?;
    let mut out = QuantizedModel {
        linears: HashMap::new(),
        quantized: BTreeMap::new(),
        other: HashMap::new(),
        act_quant: match method {
            Method::SmoothQuant { .. } => Some(ActQuant { mode: ActMode::PerToken, columns: BTreeMap::new() }),
            Method::LlmInt8 { auto: true, .. } => Some(ActQuant { mode: ActMode::Fixed, columns: BTreeMap::new() }),
            Method::LlmInt8 { threshold, .. } => Some(ActQuant { mode: ActMode::Threshold(*threshold), columns: BTreeMap::new() }),
            _ => None,
        },
        storage_bits: 0.0,
        weights: 0,
    };
    let mut calib = if method.needs_calibration() {
        if windows.is_empty() || windows.iter().all(Vec::is_empty) {
            return Err(Error::Calibration("this method needs calibration windows (empty calibration text?)".into()));
        }
        let lens: Vec<usize> = windows.iter().map(Vec::len).collect();
        let c = Calibrator::new(cfg, device, &lens)?.with_dtype(dtype)?;
        let (_, embed) = tensor("model.embed_tokens.weight")?;
        let x = c.embed(&embed, windows)?;
        Some((c, x))
    } else {
        None
    };
    let name = |li: usize, l: Linear| format!("model.layers.{li}.{}.weight", l.hf_suffix());
    let norm_names = |li: usize| (format!("model.layers.{li}.input_layernorm.weight"), format!("model.layers.{li}.post_attention_layernorm.weight"));
    for li in 0..cfg.num_hidden_layers {
        let mut lw = LayerWeights::fetch(cfg, li, tensor)?;
        match (method, calib.as_mut()) {
            (Method::Gptq(g), Some((c, x))) => {
                let n = c.tokens();
                let mut quant = |lw: &mut LayerWeights, inp: &Tensor<2>, ls: &[Linear]| -> Result<()> {
                    let (_, cols) = ls[0].dims(cfg);
                    let mut h = Hessian::new(cols);
                    h.add_gram(&gram(inp, c.dtype())?, n)?;
                    for &l in ls {
                        let (rows, cols) = l.dims(cfg);
                        let r = gptq_quantize(lw.linear(l), rows, cols, &h, g)?;
                        *lw.linear_mut(l) = r.q.dequantize();
                        out.record(name(li, l), r.q);
                    }
                    Ok(())
                };
                // After each group is quantized only its fused weight is uploaded again.
                let refresh = |dl: &DecoderLayer, lw: &LayerWeights, ls: &[Linear]| {
                    let parts: Vec<(Linear, &[f32])> = ls.iter().map(|&l| (l, lw.linear(l))).collect();
                    c.upload_replacing(dl, lw, &parts)
                };
                let dl = c.upload(&lw);
                let xn = c.attn_in(&dl, x.clone());
                let qkv = [Linear::Q, Linear::K, Linear::V];
                quant(&mut lw, &xn, &qkv)?;
                let dl = refresh(&dl, &lw, &qkv);
                let a = c.attention(&dl, xn)?;
                quant(&mut lw, &a, &[Linear::O])?;
                let dl = refresh(&dl, &lw, &[Linear::O]);
                let x2 = c.attn_residual(&dl, x.clone(), a)?;
                let xn2 = c.mlp_in(&dl, x2.clone());
                quant(&mut lw, &xn2, &[Linear::Gate, Linear::Up])?;
                let dl = refresh(&dl, &lw, &[Linear::Gate, Linear::Up]);
                let hmid = c.swiglu_out(&dl, xn2)?;
                quant(&mut lw, &hmid, &[Linear::Down])?;
                let dl = refresh(&dl, &lw, &[Linear::Down]);
                *x = c.mlp_residual(&dl, x2, hmid)?;
            }
            (Method::Awq(a), Some((c, x))) => {
                let st = stages(c, &lw, x)?;
                let k = a.search_windows.clamp(1, windows.len());
                let lens: Vec<usize> = windows[..k].iter().map(Vec::len).collect();
                let sub = Calibrator::new(cfg, device, &lens)?.with_dtype(dtype)?;
                awq_layer(c, &sub, cfg, &mut lw, x, &st, scheme, a)?;
                for l in Linear::ALL {
                    let (rows, cols) = l.dims(cfg);
                    out.record(name(li, l), quantize_rtn_ragged(lw.linear(l), rows, cols, scheme)?);
                }
                let (n1, n2) = norm_names(li);
                out.other.insert(n1, lw.attn_norm.clone());
                out.other.insert(n2, lw.ffn_norm.clone());
                *x = st.y;
            }
            (Method::SmoothQuant { alpha }, Some((c, x))) => {
                let st = stages(c, &lw, x)?;
                let n = c.tokens();
                let hid = cfg.hidden_size;
                for (inp, ls, is_attn) in [(&st.xn, [Linear::Q, Linear::K, Linear::V].as_slice(), true), (&st.xn2, [Linear::Gate, Linear::Up].as_slice(), false)] {
                    let amax = act_max_abs(&to_host(inp.clone())?, n, hid);
                    let ws: Vec<(&[f32], usize)> = ls.iter().map(|&l| (lw.linear(l), l.dims(cfg).0)).collect();
                    let s = smooth_scales(&amax, &ws, hid, *alpha)?;
                    let norm = if is_attn { &mut lw.attn_norm } else { &mut lw.ffn_norm };
                    for (v, f) in norm.iter_mut().zip(&s) {
                        *v /= f;
                    }
                    for &l in ls {
                        scale_cols(lw.linear_mut(l), hid, &s);
                    }
                }
                for l in Linear::ALL {
                    let (rows, cols) = l.dims(cfg);
                    out.record_f32(name(li, l), absmax_int8_rows(lw.linear(l), rows, cols), 8.0 + 16.0 / cols as f64);
                }
                let (n1, n2) = norm_names(li);
                out.other.insert(n1, lw.attn_norm.clone());
                out.other.insert(n2, lw.ffn_norm.clone());
                *x = st.y;
            }
            (Method::LlmInt8 { .. }, cal) => {
                if let (Some((c, x)), Some(aq)) = (cal, out.act_quant.as_mut()) {
                    let st = stages(c, &lw, x)?;
                    let n = c.tokens();
                    for (site, t) in [(Site::AttnIn, &st.xn), (Site::AttnOut, &st.att), (Site::MlpIn, &st.xn2), (Site::DownIn, &st.h)] {
                        let [_, cols] = t.dims();
                        let amax = act_max_abs(&to_host(t.clone())?, n, cols);
                        aq.set_columns(li, site, &outlier_columns_auto(&amax));
                    }
                    *x = st.y;
                }
                for l in Linear::ALL {
                    let (rows, cols) = l.dims(cfg);
                    out.record_f32(name(li, l), absmax_int8_rows(lw.linear(l), rows, cols), 8.0 + 16.0 / cols as f64);
                }
            }
            (Method::Nf4, _) => {
                let bs = match scheme.granularity {
                    Granularity::PerGroup(g) => g,
                    _ => 64,
                };
                for l in Linear::ALL {
                    let t = Nf4Tensor::quantize(lw.linear(l), bs)?;
                    let bpw = t.bits_per_weight();
                    out.record_f32(name(li, l), t.dequantize(), bpw);
                }
            }
            _ => {
                for l in Linear::ALL {
                    let (rows, cols) = l.dims(cfg);
                    out.record(name(li, l), quantize_rtn_ragged(lw.linear(l), rows, cols, scheme)?);
                }
            }
        }
        progress(li);
    }
    Ok(out)
}

/// Output error of one decoder linear under each candidate weight set (see
/// [`layer_output_errors`]).
#[derive(Debug, Clone, PartialEq)]
pub struct LinearError {
    /// Decoder layer index.
    pub layer: usize,
    /// Which linear.
    pub linear: Linear,
    /// `‖X (W − Ŵ_c)ᵀ‖²_F / ‖X Wᵀ‖²_F` for each candidate `c` (unitless, 0 = exact).
    pub rel: Vec<f64>,
}

/// `Σ_r d_r G d_rᵀ` for the rows `d_r` of `d` (`[rows, cols]`) and a symmetric Gram matrix `g`
/// (`[cols, cols]`): `‖X dᵀ‖²_F` when `g = XᵀX`.
fn quad_form_rows(d: &[f64], rows: usize, cols: usize, g: &[f64]) -> f64 {
    let mut dg = vec![0.0f64; rows * cols];
    // SAFETY: d is [rows, cols], g [cols, cols], dg [rows, cols], all row-major and in bounds.
    unsafe {
        matrixmultiply::dgemm(
            rows, cols, cols, 1.0, d.as_ptr(), cols as isize, 1, g.as_ptr(), cols as isize, 1, 0.0, dg.as_mut_ptr(), cols as isize, 1,
        );
    }
    dg.iter().zip(d).map(|(a, b)| a * b).sum()
}

/// Per-layer, per-linear relative output error of quantized weight sets against the base, on
/// the **base model's** activations of `windows` (the full-precision inputs of every linear,
/// layer by layer; nothing quantized is fed forward, so every linear is judged on the same
/// inputs). This is the diagnostic of issue 20: run it on held-out text to see, layer by
/// layer, where a quantizer's error exceeds another's (GPTQ vs RTN), and on the calibration
/// windows to see its in-sample error.
///
/// The error of linear `W` (`[out, in]`) with candidate `Ŵ` on inputs `X` (`[tokens, in]`) is
/// `‖X (W − Ŵ)ᵀ‖²_F / ‖X Wᵀ‖²_F`, computed exactly from the Gram matrix `XᵀX` in f64.
///
/// # Errors
/// Missing tensors in `base` or a candidate; [`Error::Calibration`] without windows.
pub fn layer_output_errors(
    cfg: &ModelConfig,
    base: &TensorFn<'_>,
    candidates: &[&TensorFn<'_>],
    device: &Device,
    windows: &[Vec<u32>],
    progress: &mut dyn FnMut(usize),
) -> Result<Vec<LinearError>> {
    if windows.is_empty() || windows.iter().all(Vec::is_empty) {
        return Err(Error::Calibration("the layer error needs at least one non-empty window".into()));
    }
    let lens: Vec<usize> = windows.iter().map(Vec::len).collect();
    let c = Calibrator::new(cfg, device, &lens)?;
    let (_, embed) = base("model.embed_tokens.weight")?;
    let mut x = c.embed(&embed, windows)?;
    let mut out = Vec::new();
    for li in 0..cfg.num_hidden_layers {
        let lw = LayerWeights::fetch(cfg, li, base)?;
        let cands: Vec<LayerWeights> = candidates.iter().map(|t| LayerWeights::fetch(cfg, li, t)).collect::<deco_model::Result<_>>()?;
        let dl = c.upload(&lw);
        let (inputs, y) = c.layer_capture(&dl, x)?;
        let grams: Vec<Vec<f64>> = inputs.iter().map(|x| gram(x, CalibDtype::F32)).collect::<Result<_>>()?;
        for l in Linear::ALL {
            let (rows, cols) = l.dims(cfg);
            let g = &grams[l.site() as usize];
            let w: Vec<f64> = lw.linear(l).iter().map(|&v| v as f64).collect();
            let norm = quad_form_rows(&w, rows, cols, g);
            let rel = cands
                .iter()
                .map(|cw| {
                    let d: Vec<f64> = lw.linear(l).iter().zip(cw.linear(l)).map(|(&a, &b)| a as f64 - b as f64).collect();
                    quad_form_rows(&d, rows, cols, g) / norm
                })
                .collect();
            out.push(LinearError { layer: li, linear: l, rel });
        }
        x = y;
        progress(li);
    }
    Ok(out)
}
