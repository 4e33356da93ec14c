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
//! The stages are those of the one decoder layer, [`crate::decoder::Pass`], with the attention
//! of [`WindowAttention`]; a [`LayerHook`] in [`Calibrator::layer`] /
//! [`Calibrator::forward_logits`] runs a whole model whose linear layers quantize their inputs
//! at run time (SmoothQuant W8A8, LLM.int8()). `tests/quant_calib.rs` checks the result against
//! `Llama::forward`.

use burn::tensor::{Device, Int, Tensor, TensorData};
use deco_formats::config::ModelConfig;
use deco_kernels::ops::RopeTable;

pub use crate::decoder::Site;
use crate::decoder::{Branch, Capture, DecoderLayer, LayerHook, LinearWeight, NoHook, Pass, TensorSource, WindowAttention, config_inv_freq, fetch_checked, rms_norm};
use crate::{Error, Result};

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
    /// Whatever `tensor` returns; [`Error::InvalidInput`] naming a weight of the wrong shape.
    pub fn fetch(
        cfg: &ModelConfig,
        li: usize,
        tensor: &TensorSource<'_>,
    ) -> Result<Self> {
        let p = format!("model.layers.{li}");
        let get = |name: String| -> Result<Vec<f32>> { Ok(fetch_checked(cfg, tensor, &name)?.1) };
        let lin = |l: Linear| get(format!("{p}.{}.weight", l.hf_suffix()));
        let bqkv = if cfg.attention_bias {
            let mut b = get(format!("{p}.self_attn.q_proj.bias"))?;
            b.extend(get(format!("{p}.self_attn.k_proj.bias"))?);
            b.extend(get(format!("{p}.self_attn.v_proj.bias"))?);
            Some(b)
        } else {
            None
        };
        Ok(Self {
            attn_norm: get(format!("{p}.input_layernorm.weight"))?,
            ffn_norm: get(format!("{p}.post_attention_layernorm.weight"))?,
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

/// Precision of the calibration products: the linear layers' matmuls of a [`Calibrator`] and
/// the Hessians `XᵀX` its callers form from the stage outputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CalibDtype {
    /// f32 inputs, f32 sums (the model's own arithmetic).
    #[default]
    F32,
    /// bf16-rounded inputs (weights and activations), exact products, f32 sums
    /// ([`deco_kernels::bf16`]): about twice the f32 rate on CPUs with AVX-512 BF16, the
    /// precision class of the reference GPTQ / AWQ implementations' fp16 / bf16 GPU forwards.
    /// Norms, attention, SwiGLU and the residual stream stay f32.
    Bf16,
    /// 16-bit integer inputs scaled per block of 64 values (per token for the activations, per
    /// output column for the weights, per feature and 64 tokens for the Hessians' inputs;
    /// 13.5 bits relative to the block's largest value), exact integer block sums, f32 across
    /// blocks ([`deco_kernels::int16`], AVX2 `vpmaddwd`): the same class of approximation for
    /// CPUs without AVX-512 BF16. Opt-in. Norms, attention, SwiGLU and the residual stream stay
    /// f32.
    Int16,
}

impl CalibDtype {
    /// The fastest precision this device offers for calibration: [`CalibDtype::Bf16`] on the
    /// CPU device without autodiff when [`deco_kernels::bf16::available`], else f32.
    pub fn auto(device: &Device) -> Self {
        if bf16_host(device) { CalibDtype::Bf16 } else { CalibDtype::F32 }
    }
}

/// Whether bf16 calibration products run on `device`.
fn bf16_host(device: &Device) -> bool {
    cpu_host(device) && deco_kernels::bf16::available()
}

/// Whether `device` runs the calibration products on the host: the CPU device without
/// autodiff (where [`LinearWeight`]s are host weights and the low-precision kernels apply).
fn cpu_host(device: &Device) -> bool {
    *device == Device::flex() && !device.is_autodiff()
}

/// Runs decoder layers stage by stage over a fixed batch of independent windows (each starting
/// at position 0), all tokens as one `[tokens, hidden]` matrix.
#[derive(Debug, Clone)]
pub struct Calibrator {
    cfg: ModelConfig,
    dtype: CalibDtype,
    device: Device,
    rope: RopeTable,
    positions: Tensor<1, Int>,
    /// `(start, len)` of each window in the token matrix.
    spans: Vec<(usize, usize)>,
    tokens: usize,
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
            dtype: CalibDtype::F32,
            device: device.clone(),
            rope: RopeTable::new(&config_inv_freq(cfg), max, device),
            positions: Tensor::from_data(TensorData::new(pos, [tokens]), device),
            spans,
            tokens,
        })
    }

    /// The runner with its linear layers' products in `dtype` (f32 by default).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for [`CalibDtype::Bf16`] or [`CalibDtype::Int16`] where it cannot
    /// run: a device other than the CPU without autodiff, or a CPU without AVX-512 BF16 (bf16) or
    /// AVX2 (int16).
    pub fn with_dtype(mut self, dtype: CalibDtype) -> Result<Self> {
        if dtype == CalibDtype::Bf16 && !bf16_host(&self.device) {
            return Err(Error::InvalidInput(
                "bf16 calibration needs the CPU device (flex, no autodiff) on a CPU with AVX-512 BF16; use f32".into(),
            ));
        }
        if dtype == CalibDtype::Int16 && !(cpu_host(&self.device) && deco_kernels::int16::available()) {
            return Err(Error::InvalidInput("int16 calibration needs the CPU device (flex, no autodiff) on an x86-64 CPU with AVX2; use f32".into()));
        }
        self.dtype = dtype;
        Ok(self)
    }

    /// The precision of the linear layers' products.
    pub fn dtype(&self) -> CalibDtype {
        self.dtype
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
        Ok(Tensor::from_data(TensorData::new(out, [self.tokens, h]), &self.device))
    }

    /// Uploads a layer's weights (fusing Q/K/V and gate/up as the model does), dense f32, or
    /// packed for the products of [`CalibDtype::Bf16`] / [`CalibDtype::Int16`] (no f32 copy).
    pub fn upload(&self, w: &LayerWeights) -> DecoderLayer {
        let cfg = &self.cfg;
        let d = &self.device;
        let fused = |ls: &[Linear]| -> LinearWeight {
            let parts: Vec<(&[f32], usize)> = ls.iter().map(|&l| (w.linear(l), l.dims(cfg).0)).collect();
            LinearWeight::dense_fused_as(&parts, ls[0].dims(cfg).1, d, self.dtype)
        };
        let t1 = |v: &[f32]| Tensor::from_data(TensorData::new(v.to_vec(), [v.len()]), d);
        DecoderLayer {
            attn_norm: t1(&w.attn_norm),
            wqkv: fused(&[Linear::Q, Linear::K, Linear::V]),
            bqkv: w.bqkv.as_deref().map(t1),
            wo: fused(&[Linear::O]),
            ffn_norm: t1(&w.ffn_norm),
            w_gate_up: fused(&[Linear::Gate, Linear::Up]),
            w_down: fused(&[Linear::Down]),
        }
    }

    /// `base` (an [`Calibrator::upload`] of `w`) with the linears of `parts` replaced by the given
    /// `[out, in]` weights: only the fused groups (Q/K/V, O, gate/up, down) that hold a replaced
    /// linear are rebuilt, the others are shared with `base`. For searches that try many
    /// candidates for a few linears (AWQ's scale grid).
    ///
    /// # Panics
    /// Never for parts of the shapes [`Linear::dims`] gives (the fused weight is built from
    /// them).
    pub fn upload_replacing(&self, base: &DecoderLayer, w: &LayerWeights, parts: &[(Linear, &[f32])]) -> DecoderLayer {
        let cfg = &self.cfg;
        let replaced: Vec<Linear> = parts.iter().map(|p| p.0).collect();
        self.upload_rows(base, w, &replaced, &|l, r, buf| {
            let cols = l.dims(cfg).1;
            let p = parts.iter().find(|p| p.0 == l).map_or_else(|| w.linear(l), |p| p.1);
            buf.copy_from_slice(&p[r * cols..(r + 1) * cols]);
        })
    }

    /// [`Calibrator::upload_replacing`] with the replaced linears given row by row:
    /// `row(l, r, buf)` writes row `r` (`[in]`) of linear `l` ∈ `replaced` into `buf`. It is
    /// called concurrently, once per row; under [`CalibDtype::Bf16`] or [`CalibDtype::Int16`]
    /// the rows go straight into the packed weight ([`LinearWeight::dense_fused_rows_as`]), so a candidate computed
    /// row by row (AWQ's scaled and quantized weights) is never held as a whole f32 matrix.
    pub fn upload_rows(&self, base: &DecoderLayer, w: &LayerWeights, replaced: &[Linear], row: &(dyn Fn(Linear, usize, &mut [f32]) + Sync)) -> DecoderLayer {
        let cfg = &self.cfg;
        let d = &self.device;
        let fused = |ls: &[Linear], old: &LinearWeight| -> LinearWeight {
            if !ls.iter().any(|l| replaced.contains(l)) {
                return old.clone();
            }
            let outs: Vec<usize> = ls.iter().map(|l| l.dims(cfg).0).collect();
            let inner = ls[0].dims(cfg).1;
            LinearWeight::dense_fused_rows_as(&outs, inner, d, self.dtype, &|i, r, buf| {
                let l = ls[i];
                if replaced.contains(&l) {
                    row(l, r, buf);
                } else {
                    buf.copy_from_slice(&w.linear(l)[r * inner..(r + 1) * inner]);
                }
            })
        };
        DecoderLayer {
            attn_norm: base.attn_norm.clone(),
            wqkv: fused(&[Linear::Q, Linear::K, Linear::V], &base.wqkv),
            bqkv: base.bqkv.clone(),
            wo: fused(&[Linear::O], &base.wo),
            ffn_norm: base.ffn_norm.clone(),
            w_gate_up: fused(&[Linear::Gate, Linear::Up], &base.w_gate_up),
            w_down: fused(&[Linear::Down], &base.w_down),
        }
    }

    fn pass(&self) -> Pass<'_> {
        Pass { cfg: &self.cfg, rope: &self.rope, positions: &self.positions }
    }

    /// `rms_norm(x, input_layernorm)`: the input of q/k/v_proj, `[tokens, hidden]`.
    pub fn attn_in(&self, l: &DecoderLayer, x: Tensor<2>) -> Tensor<2> {
        self.pass().norm(l, Branch::Attention, x)
    }

    /// Causal attention of every window over `xn` (the [`Calibrator::attn_in`] output):
    /// the input of o_proj, `[tokens, heads * head_dim]`.
    ///
    /// # Errors
    /// A projection's errors (none for the dense weights of [`Calibrator::upload`]).
    pub fn attention(&self, l: &DecoderLayer, xn: Tensor<2>) -> Result<Tensor<2>> {
        let (q, k, v) = self.pass().qkv(0, l, xn, &NoHook)?;
        crate::decoder::Attend::attend(&mut WindowAttention { spans: &self.spans }, 0, q, k, v)
    }

    /// `x + attn · Woᵀ`: the residual stream after attention.
    ///
    /// # Errors
    /// As [`Calibrator::attention`].
    pub fn attn_residual(&self, l: &DecoderLayer, x: Tensor<2>, attn: Tensor<2>) -> Result<Tensor<2>> {
        self.pass().attn_residual(0, l, x, attn, &NoHook)
    }

    /// `rms_norm(x2, post_attention_layernorm)`: the input of gate/up_proj.
    pub fn mlp_in(&self, l: &DecoderLayer, x2: Tensor<2>) -> Tensor<2> {
        self.pass().norm(l, Branch::Mlp, x2)
    }

    /// `silu(xn2 · Wgᵀ) * (xn2 · Wuᵀ)`: the input of down_proj, `[tokens, intermediate]`.
    ///
    /// # Errors
    /// As [`Calibrator::attention`].
    pub fn swiglu_out(&self, l: &DecoderLayer, xn2: Tensor<2>) -> Result<Tensor<2>> {
        self.pass().mlp_act(0, l, xn2, &NoHook)
    }

    /// `x2 + h · Wdᵀ`: the layer's output.
    ///
    /// # Errors
    /// As [`Calibrator::attention`].
    pub fn mlp_residual(&self, l: &DecoderLayer, x2: Tensor<2>, h: Tensor<2>) -> Result<Tensor<2>> {
        self.pass().mlp_residual(0, l, x2, h, &NoHook)
    }

    /// The whole layer `li` ([`Pass::layer`]) with `hook` on its activations.
    ///
    /// # Errors
    /// As [`Calibrator::attention`].
    pub fn layer(&self, li: usize, l: &DecoderLayer, x: Tensor<2>, hook: &dyn LayerHook) -> Result<Tensor<2>> {
        self.pass().layer(li, l, x, &mut WindowAttention { spans: &self.spans }, hook)
    }

    /// The layer with the input of every site captured:
    /// `([attn_in, attn_out, mlp_in, down_in], output)`.
    ///
    /// # Errors
    /// As [`Calibrator::attention`].
    pub fn layer_capture(&self, l: &DecoderLayer, x: Tensor<2>) -> Result<([Tensor<2>; 4], Tensor<2>)> {
        let cap = Capture::default();
        let out = self.layer(0, l, x, &cap)?;
        let [Some(a), Some(b), Some(c), Some(d)] = cap.into_inputs() else {
            return Err(Error::InvalidInput("a decoder stage was not run".into()));
        };
        Ok(([a, b, c, d], out))
    }

    /// The input of every site, `[attn_in, attn_out, mlp_in, down_in]` as
    /// [`Calibrator::layer_capture`] captures them (the same stages, so the same bits), without
    /// the layer's output: down_proj's product and the last residual add are not computed
    /// (a quarter of the layer's multiply-adds). For callers that discard the output (Wanda's
    /// and SparseGPT's capture pass, whose next-layer input comes from the pruned weights).
    ///
    /// # Errors
    /// As [`Calibrator::attention`].
    pub fn site_inputs(&self, l: &DecoderLayer, x: Tensor<2>) -> Result<[Tensor<2>; 4]> {
        let xn = self.attn_in(l, x.clone());
        let a = self.attention(l, xn.clone())?;
        let x2 = self.attn_residual(l, x, a.clone())?;
        let xn2 = self.mlp_in(l, x2);
        let h = self.swiglu_out(l, xn2.clone())?;
        Ok([xn, a, xn2, h])
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
        hook: &dyn LayerHook,
    ) -> Result<Tensor<2>> {
        let h = self.cfg.hidden_size;
        let mut x = self.embed(embed, windows)?;
        for li in 0..self.cfg.num_hidden_layers {
            let dl = self.upload(&layer_weights(li)?);
            x = self.layer(li, &dl, x, hook)?;
        }
        let normw = Tensor::from_data(TensorData::new(norm.to_vec(), [h]), &self.device);
        let xn = rms_norm(x, &normw, self.cfg.rms_norm_eps);
        let v = lm_head.len() / h;
        let head: Tensor<2> = Tensor::from_data(TensorData::new(lm_head.to_vec(), [v, h]), &self.device);
        Ok(xn.matmul(head.transpose()))
    }
}
