//! Layer-by-layer execution for post-training quantization.
//!
//! Quantizers (GPTQ, AWQ, SmoothQuant) need the *inputs of every linear layer* on calibration
//! tokens, one decoder layer at a time, so that a layer can be quantized before the next one's
//! inputs are computed from its (quantized) outputs — the sequential scheme of GPTQ's `llama.py`
//! and llm-awq's `run_awq`. [`Calibrator`] runs a Llama decoder layer in stages on weights the
//! caller holds on the host ([`LayerWeights`], transformers names and `[out, in]` layout), and
//! exposes each stage's output:
//!
//! | stage | returns | is the input of |
//! |---|---|---|
//! | [`Calibrator::attn_in`] | `rms_norm(x, input_layernorm)` | q_proj, k_proj, v_proj |
//! | [`Calibrator::attention`] | attention output (before o_proj) | o_proj |
//! | [`Calibrator::mlp_in`] | `rms_norm(x + attn·Woᵀ, post_attention_layernorm)` | gate_proj, up_proj |
//! | [`Calibrator::swiglu_out`] | `silu(gate) * up` | down_proj |
//!
//! The same stages with an [`ActHook`] run a whole model whose linear layers quantize their
//! inputs at run time (SmoothQuant W8A8, LLM.int8()), see [`Calibrator::forward_logits`].
//! The computation is `Llama::layer_forward`'s (same kernels), checked against it by
//! `tests/quant_calib.rs`.

use burn::tensor::{Device, Int, Tensor, TensorData};
use deco_formats::config::ModelConfig;
use deco_kernels::ops::{RopeTable, causal_gqa_attention, rms_norm, swiglu};

use crate::llama::config_inv_freq;
use crate::{Error, Result};

/// Where a linear layer reads its input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Site {
    /// The input RMSNorm output (q/k/v_proj).
    AttnIn,
    /// The attention output (o_proj).
    AttnOut,
    /// The post-attention RMSNorm output (gate/up_proj).
    MlpIn,
    /// The SwiGLU output (down_proj).
    DownIn,
}

/// The seven linear layers of a decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Linear {
    /// `self_attn.q_proj`
    Q,
    /// `self_attn.k_proj`
    K,
    /// `self_attn.v_proj`
    V,
    /// `self_attn.o_proj`
    O,
    /// `mlp.gate_proj`
    Gate,
    /// `mlp.up_proj`
    Up,
    /// `mlp.down_proj`
    Down,
}

impl Linear {
    /// All seven, in execution order.
    pub const ALL: [Linear; 7] = [Linear::Q, Linear::K, Linear::V, Linear::O, Linear::Gate, Linear::Up, Linear::Down];

    /// The transformers name below `model.layers.{i}.` (without `.weight`).
    pub fn hf_suffix(self) -> &'static str {
        match self {
            Linear::Q => "self_attn.q_proj",
            Linear::K => "self_attn.k_proj",
            Linear::V => "self_attn.v_proj",
            Linear::O => "self_attn.o_proj",
            Linear::Gate => "mlp.gate_proj",
            Linear::Up => "mlp.up_proj",
            Linear::Down => "mlp.down_proj",
        }
    }

    /// Which activation the layer reads.
    pub fn site(self) -> Site {
        match self {
            Linear::Q | Linear::K | Linear::V => Site::AttnIn,
            Linear::O => Site::AttnOut,
            Linear::Gate | Linear::Up => Site::MlpIn,
            Linear::Down => Site::DownIn,
        }
    }

    /// `(out_features, in_features)` under `cfg`.
    pub fn dims(self, cfg: &ModelConfig) -> (usize, usize) {
        let (h, q, kv, i) = (
            cfg.hidden_size,
            cfg.num_attention_heads * cfg.head_dim,
            cfg.num_key_value_heads * cfg.head_dim,
            cfg.intermediate_size,
        );
        match self {
            Linear::Q => (q, h),
            Linear::K | Linear::V => (kv, h),
            Linear::O => (h, q),
            Linear::Gate | Linear::Up => (i, h),
            Linear::Down => (h, i),
        }
    }
}

/// A source of f32 tensors: transformers name → (shape, row-major data), as
/// [`crate::Llama::load_from`] takes.
pub type TensorSource<'a> = dyn Fn(&str) -> Result<(Vec<usize>, Vec<f32>)> + 'a;

/// One decoder layer's weights on the host, transformers layout (`[out, in]` row-major).
#[derive(Debug, Clone)]
pub struct LayerWeights {
    /// `input_layernorm.weight`, `[hidden]`.
    pub attn_norm: Vec<f32>,
    /// `post_attention_layernorm.weight`, `[hidden]`.
    pub ffn_norm: Vec<f32>,
    /// The linear weights in [`Linear::ALL`] order.
    pub linears: [Vec<f32>; 7],
    /// Q, K, V biases (Qwen2), concatenated `[q + 2 kv]`.
    pub bqkv: Option<Vec<f32>>,
}

impl LayerWeights {
    /// Reads layer `li` from a tensor source (as [`crate::Llama::load_from`] takes).
    ///
    /// # Errors
    /// Whatever `tensor` returns; [`Error::InvalidInput`] for a wrong size.
    pub fn fetch(
        cfg: &ModelConfig,
        li: usize,
        tensor: &TensorSource<'_>,
    ) -> Result<Self> {
        let p = format!("model.layers.{li}");
        let get = |name: String, len: usize| -> Result<Vec<f32>> {
            let (_, d) = tensor(&name)?;
            if d.len() != len {
                return Err(Error::InvalidInput(format!("weight `{name}` has {} values, expected {len}", d.len())));
            }
            Ok(d)
        };
        let h = cfg.hidden_size;
        let lin = |l: Linear| -> Result<Vec<f32>> {
            let (o, i) = l.dims(cfg);
            get(format!("{p}.{}.weight", l.hf_suffix()), o * i)
        };
        let bqkv = if cfg.attention_bias {
            let (q, kv) = (Linear::Q.dims(cfg).0, Linear::K.dims(cfg).0);
            let mut b = get(format!("{p}.self_attn.q_proj.bias"), q)?;
            b.extend(get(format!("{p}.self_attn.k_proj.bias"), kv)?);
            b.extend(get(format!("{p}.self_attn.v_proj.bias"), kv)?);
            Some(b)
        } else {
            None
        };
        Ok(Self {
            attn_norm: get(format!("{p}.input_layernorm.weight"), h)?,
            ffn_norm: get(format!("{p}.post_attention_layernorm.weight"), h)?,
            linears: [lin(Linear::Q)?, lin(Linear::K)?, lin(Linear::V)?, lin(Linear::O)?, lin(Linear::Gate)?, lin(Linear::Up)?, lin(Linear::Down)?],
            bqkv,
        })
    }

    /// The weight of one linear layer, `[out, in]`.
    pub fn linear(&self, l: Linear) -> &[f32] {
        &self.linears[l as usize]
    }

    /// Mutable weight of one linear layer.
    pub fn linear_mut(&mut self, l: Linear) -> &mut Vec<f32> {
        &mut self.linears[l as usize]
    }
}

/// A layer's weights uploaded for [`Calibrator`]: norms and transposed (`[in, out]`) weights.
#[derive(Debug, Clone)]
pub struct DeviceLayer {
    attn_norm: Tensor<1>,
    ffn_norm: Tensor<1>,
    wqkv: Tensor<2>,
    bqkv: Option<Tensor<1>>,
    wo: Tensor<2>,
    w_gate_up: Tensor<2>,
    w_down: Tensor<2>,
}

/// Transforms the input of the linear layers at one site before the matmul (run-time activation
/// quantization). `layer` is the decoder layer index.
pub trait ActHook {
    /// Returns the input the linear layers at `site` actually see, same shape as `x`
    /// (`[tokens, in]`).
    fn apply(&self, layer: usize, site: Site, x: Tensor<2>) -> Tensor<2>;
}

/// Runs decoder layers stage by stage over a fixed batch of independent windows (each starting
/// at position 0), all tokens as one `[tokens, hidden]` matrix.
#[derive(Debug, Clone)]
pub struct Calibrator {
    cfg: ModelConfig,
    device: Device,
    rope: RopeTable,
    positions: Tensor<1, Int>,
    /// `(start, len)` of each window in the token matrix.
    spans: Vec<(usize, usize)>,
    tokens: usize,
}

fn tensor2(data: Vec<f32>, rows: usize, cols: usize, device: &Device) -> Tensor<2> {
    Tensor::from_data(TensorData::new(data, [rows, cols]), device)
}

fn transpose(data: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; data.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = data[r * cols + c];
        }
    }
    out
}

/// Copies a 2-D tensor to the host, row-major.
///
/// # Errors
/// [`Error::TensorRead`] if the device read fails.
pub fn to_host(t: Tensor<2>) -> Result<Vec<f32>> {
    t.try_into_vec_as::<f32>().map_err(|e| Error::TensorRead(format!("{e:?}")))
}

impl Calibrator {
    /// A runner for windows of the given lengths (each ≥ 1, at most the model context).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for no windows, an empty window or one longer than
    /// `max_position_embeddings`.
    pub fn new(cfg: &ModelConfig, device: &Device, window_lens: &[usize]) -> Result<Self> {
        if window_lens.is_empty() || window_lens.contains(&0) {
            return Err(Error::InvalidInput("calibration needs at least one non-empty window".into()));
        }
        let max = *window_lens.iter().max().unwrap_or(&1);
        if max > cfg.max_position_embeddings {
            return Err(Error::InvalidInput(format!(
                "window of {max} tokens exceeds the context {}",
                cfg.max_position_embeddings
            )));
        }
        let mut spans = Vec::new();
        let mut pos = Vec::new();
        for &l in window_lens {
            spans.push((pos.len(), l));
            pos.extend((0..l as i64).collect::<Vec<_>>());
        }
        let tokens = pos.len();
        Ok(Self {
            cfg: cfg.clone(),
            device: device.clone(),
            rope: RopeTable::new(&config_inv_freq(cfg), max, device),
            positions: Tensor::from_data(TensorData::new(pos, [tokens]), device),
            spans,
            tokens,
        })
    }

    /// Total tokens of all windows.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Embeds the windows' tokens with `embed` (`[vocab, hidden]` host matrix):
    /// the residual stream entering layer 0, `[tokens, hidden]`.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] if the windows do not match the runner's lengths, or
    /// [`Error::TokenOutOfRange`].
    pub fn embed(&self, embed: &[f32], windows: &[Vec<u32>]) -> Result<Tensor<2>> {
        let h = self.cfg.hidden_size;
        if windows.len() != self.spans.len() || windows.iter().zip(&self.spans).any(|(w, s)| w.len() != s.1) {
            return Err(Error::InvalidInput("windows do not match the calibrator's window lengths".into()));
        }
        let mut out = Vec::with_capacity(self.tokens * h);
        for &t in windows.iter().flatten() {
            let t = t as usize;
            if t >= self.cfg.vocab_size || (t + 1) * h > embed.len() {
                return Err(Error::TokenOutOfRange { id: t as u32, vocab: self.cfg.vocab_size });
            }
            out.extend_from_slice(&embed[t * h..(t + 1) * h]);
        }
        Ok(tensor2(out, self.tokens, h, &self.device))
    }

    /// Uploads a layer's weights (fusing Q/K/V and gate/up as the model does).
    pub fn upload(&self, w: &LayerWeights) -> DeviceLayer {
        let cfg = &self.cfg;
        let d = &self.device;
        let h = cfg.hidden_size;
        let cat_t = |ls: &[Linear]| -> Tensor<2> {
            let parts: Vec<Tensor<2>> = ls
                .iter()
                .map(|&l| {
                    let (o, i) = l.dims(cfg);
                    tensor2(transpose(w.linear(l), o, i), i, o, d)
                })
                .collect();
            Tensor::cat(parts, 1)
        };
        let (o_out, o_in) = Linear::O.dims(cfg);
        let (d_out, d_in) = Linear::Down.dims(cfg);
        DeviceLayer {
            attn_norm: Tensor::from_data(TensorData::new(w.attn_norm.clone(), [h]), d),
            ffn_norm: Tensor::from_data(TensorData::new(w.ffn_norm.clone(), [h]), d),
            wqkv: cat_t(&[Linear::Q, Linear::K, Linear::V]),
            bqkv: w.bqkv.as_ref().map(|b| Tensor::from_data(TensorData::new(b.clone(), [b.len()]), d)),
            wo: tensor2(transpose(w.linear(Linear::O), o_out, o_in), o_in, o_out, d),
            w_gate_up: cat_t(&[Linear::Gate, Linear::Up]),
            w_down: tensor2(transpose(w.linear(Linear::Down), d_out, d_in), d_in, d_out, d),
        }
    }

    fn hooked(hook: Option<(&dyn ActHook, usize)>, site: Site, x: Tensor<2>) -> Tensor<2> {
        match hook {
            Some((h, li)) => h.apply(li, site, x),
            None => x,
        }
    }

    /// `rms_norm(x, input_layernorm)`: the input of q/k/v_proj, `[tokens, hidden]`.
    pub fn attn_in(&self, l: &DeviceLayer, x: Tensor<2>) -> Tensor<2> {
        rms_norm(x, &l.attn_norm, self.cfg.rms_norm_eps)
    }

    /// Causal attention of every window over `xn` (the [`Calibrator::attn_in`] output):
    /// the input of o_proj, `[tokens, heads * head_dim]`.
    pub fn attention(&self, l: &DeviceLayer, xn: Tensor<2>, hook: Option<(&dyn ActHook, usize)>) -> Tensor<2> {
        let cfg = &self.cfg;
        let n = self.tokens;
        let (heads, kvh, hd) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
        let (qd, kvd) = (heads * hd, kvh * hd);
        let xn = Self::hooked(hook, Site::AttnIn, xn);
        let mut qkv = xn.matmul(l.wqkv.clone());
        if let Some(b) = &l.bqkv {
            qkv = qkv.add(b.clone().unsqueeze_dim::<2>(0));
        }
        let q = qkv.clone().slice([0..n, 0..qd]).reshape([n, heads, hd]);
        let k = qkv.clone().slice([0..n, qd..qd + kvd]).reshape([n, kvh, hd]);
        let v = qkv.slice([0..n, qd + kvd..qd + 2 * kvd]).reshape([n, kvh, hd]);
        let q = self.rope.apply(q, &self.positions);
        let k = self.rope.apply(k, &self.positions);
        let outs: Vec<Tensor<2>> = self
            .spans
            .iter()
            .map(|&(s, len)| {
                let r = s..s + len;
                causal_gqa_attention(
                    q.clone().slice([r.clone(), 0..heads, 0..hd]),
                    k.clone().slice([r.clone(), 0..kvh, 0..hd]),
                    v.clone().slice([r, 0..kvh, 0..hd]),
                    0,
                )
            })
            .collect();
        Tensor::cat(outs, 0)
    }

    /// `x + attn · Woᵀ`: the residual stream after attention.
    pub fn attn_residual(&self, l: &DeviceLayer, x: Tensor<2>, attn: Tensor<2>, hook: Option<(&dyn ActHook, usize)>) -> Tensor<2> {
        x.add(Self::hooked(hook, Site::AttnOut, attn).matmul(l.wo.clone()))
    }

    /// `rms_norm(x2, post_attention_layernorm)`: the input of gate/up_proj.
    pub fn mlp_in(&self, l: &DeviceLayer, x2: Tensor<2>) -> Tensor<2> {
        rms_norm(x2, &l.ffn_norm, self.cfg.rms_norm_eps)
    }

    /// `silu(xn2 · Wgᵀ) * (xn2 · Wuᵀ)`: the input of down_proj, `[tokens, intermediate]`.
    pub fn swiglu_out(&self, l: &DeviceLayer, xn2: Tensor<2>, hook: Option<(&dyn ActHook, usize)>) -> Tensor<2> {
        let (n, i) = (self.tokens, self.cfg.intermediate_size);
        let gu = Self::hooked(hook, Site::MlpIn, xn2).matmul(l.w_gate_up.clone());
        swiglu(gu.clone().slice([0..n, 0..i]), gu.slice([0..n, i..2 * i]))
    }

    /// `x2 + h · Wdᵀ`: the layer's output.
    pub fn mlp_residual(&self, l: &DeviceLayer, x2: Tensor<2>, h: Tensor<2>, hook: Option<(&dyn ActHook, usize)>) -> Tensor<2> {
        x2.add(Self::hooked(hook, Site::DownIn, h).matmul(l.w_down.clone()))
    }

    /// The whole layer (all stages).
    pub fn layer(&self, l: &DeviceLayer, x: Tensor<2>, hook: Option<(&dyn ActHook, usize)>) -> Tensor<2> {
        let xn = self.attn_in(l, x.clone());
        let a = self.attention(l, xn, hook);
        let x2 = self.attn_residual(l, x, a, hook);
        let xn2 = self.mlp_in(l, x2.clone());
        let h = self.swiglu_out(l, xn2, hook);
        self.mlp_residual(l, x2, h, hook)
    }

    /// The layer with the input of every site captured:
    /// `([attn_in, attn_out, mlp_in, down_in], output)`.
    pub fn layer_capture(&self, l: &DeviceLayer, x: Tensor<2>) -> ([Tensor<2>; 4], Tensor<2>) {
        let xn = self.attn_in(l, x.clone());
        let a = self.attention(l, xn.clone(), None);
        let x2 = self.attn_residual(l, x, a.clone(), None);
        let xn2 = self.mlp_in(l, x2.clone());
        let h = self.swiglu_out(l, xn2.clone(), None);
        let out = self.mlp_residual(l, x2, h.clone(), None);
        ([xn, a, xn2, h], out)
    }

    /// Full-model logits of every position of every window, `[tokens, vocab]`, through layers
    /// fetched one at a time from `layer_weights` (so only one layer is on the device at once),
    /// then `rms_norm(·, norm)` and `lm_head` (`[vocab, hidden]`, e.g. the tied embedding).
    ///
    /// # Errors
    /// Whatever `layer_weights` returns; the embedding's errors.
    pub fn forward_logits(
        &self,
        windows: &[Vec<u32>],
        embed: &[f32],
        layer_weights: &mut dyn FnMut(usize) -> Result<LayerWeights>,
        norm: &[f32],
        lm_head: &[f32],
        hook: Option<&dyn ActHook>,
    ) -> Result<Tensor<2>> {
        let h = self.cfg.hidden_size;
        let mut x = self.embed(embed, windows)?;
        for li in 0..self.cfg.num_hidden_layers {
            let dl = self.upload(&layer_weights(li)?);
            x = self.layer(&dl, x, hook.map(|hk| (hk, li)));
        }
        let normw = Tensor::from_data(TensorData::new(norm.to_vec(), [h]), &self.device);
        let xn = rms_norm(x, &normw, self.cfg.rms_norm_eps);
        let v = lm_head.len() / h;
        let head = tensor2(lm_head.to_vec(), v, h, &self.device);
        Ok(xn.matmul(head.transpose()))
    }
}
