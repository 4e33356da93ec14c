//! The one Llama / Qwen2 decoder layer, shared by inference, quantization calibration and
//! training.
//!
//! A decoder layer (transformers `LlamaDecoderLayer` / `Qwen2DecoderLayer`; Touvron et al. 2023,
//! §2.2) is, for the residual stream `x` `[tokens, hidden]`:
//!
//! ```text
//! xn  = rms_norm(x, input_layernorm)                       site AttnIn  (q/k/v_proj input)
//! q, k, v = split(xn · Wqkvᵀ + bqkv); q, k = rope(q), rope(k)
//! att = attention(q, k, v)                                 site AttnOut (o_proj input)
//! x2  = x + branch(att · Woᵀ)
//! xn2 = rms_norm(x2, post_attention_layernorm)             site MlpIn   (gate/up_proj input)
//! h   = silu(xn2 · Wgᵀ) ⊙ (xn2 · Wuᵀ)                      site DownIn  (down_proj input)
//! y   = x2 + branch(h · Wdᵀ)
//! ```
//!
//! [`Pass`] runs these stages; what differs between its users is given to it:
//! - the weights, through [`LayerParams`]: [`DecoderLayer`] (f32 on the device or packed GGUF
//!   blocks: `crate::Llama` and `crate::calibrate::Calibrator`), or burn `Param`s of a trainable
//!   model (`deco_compress::student::StudentModel`);
//! - the attention over keys and values, through [`Attend`]: the KV cache of `crate::Llama`
//!   (incremental decoding, batched sequences at different positions) or [`WindowAttention`]
//!   (independent windows from position 0, no cache: calibration and training);
//! - a [`LayerHook`] that sees (and may replace) the input of the linear layers at each
//!   [`Site`] and each residual branch: the activation observers of the quantizers, run-time
//!   activation quantization (SmoothQuant W8A8, LLM.int8()) and the structural masks of pruning.
//!
//! On a GPU device (features `wgpu` / `cuda`), RMSNorm, RoPE, prefill attention and the
//! matmuls of packed GGUF weights ([`LinearWeight::Device`]) run the CubeCL kernels of
//! `deco_kernels::cube`; on the CPU, on an autodiff device (no backward for
//! the kernels), or when a kernel refuses a shape, the burn compositions of `deco_kernels::ops`
//! they are tested against.

use burn::tensor::{Device, Int, Tensor, TensorData};
use deco_formats::checkpoint::hf_expected_shape;
use deco_formats::config::{ModelConfig, RopeScaling};
use deco_kernels::ops::{RopeTable, rope_inv_freq, swiglu};
use deco_kernels::quant::PackedMatrix;
use std::sync::Arc;

use crate::calibrate::CalibDtype;
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

impl Site {
    /// All four, in execution order.
    pub const ALL: [Site; 4] = [Site::AttnIn, Site::AttnOut, Site::MlpIn, Site::DownIn];
}

/// The two residual branches of a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Branch {
    /// Attention: `att · Woᵀ`, added to `x`.
    Attention,
    /// MLP: `h · Wdᵀ`, added to `x2`.
    Mlp,
}

/// The four (fused) projections of a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Proj {
    /// q_proj, k_proj, v_proj fused: `[tokens, hidden] → [tokens, q + 2·kv]`.
    Qkv,
    /// o_proj: `[tokens, q] → [tokens, hidden]`.
    O,
    /// gate_proj, up_proj fused: `[tokens, hidden] → [tokens, 2·intermediate]`.
    GateUp,
    /// down_proj: `[tokens, intermediate] → [tokens, hidden]`.
    Down,
}

/// Observes or transforms the activations of a layer as [`Pass`] runs it. Both methods default
/// to the identity. They take `&self` so that one hook can serve every layer of a pass while
/// others hold it; a hook that records uses interior mutability ([`Capture`]).
pub trait LayerHook {
    /// The input the linear layers at `site` of layer `layer` actually see, same shape as `x`
    /// (`[tokens, in]`): return `x` to observe only (calibration statistics), or a transformed
    /// copy (activation quantization, a head or neuron mask).
    fn input(&self, layer: usize, site: Site, x: Tensor<2>) -> Tensor<2> {
        let _ = (layer, site);
        x
    }

    /// A residual branch's output before it is added to the stream, `[tokens, hidden]` (layer
    /// and hidden-dimension masks).
    fn branch(&self, layer: usize, branch: Branch, y: Tensor<2>) -> Tensor<2> {
        let _ = (layer, branch);
        y
    }
}

/// The identity hook.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoHook;

impl LayerHook for NoHook {}

/// A hook that keeps the input of every site of the layers it sees: the last input seen at each
/// site (`[tokens, in]`).
#[derive(Debug, Default)]
pub struct Capture {
    captured: std::cell::RefCell<[Option<Tensor<2>>; 4]>,
}

impl Capture {
    /// The captured inputs in [`Site::ALL`] order, `None` for a site not run.
    pub fn into_inputs(self) -> [Option<Tensor<2>>; 4] {
        self.captured.into_inner()
    }
}

impl LayerHook for Capture {
    fn input(&self, _layer: usize, site: Site, x: Tensor<2>) -> Tensor<2> {
        self.captured.borrow_mut()[site as usize] = Some(x.clone());
        x
    }
}

/// The weights of one decoder layer, however they are held.
pub trait LayerParams {
    /// The RMSNorm weight before a branch, `[hidden]`: `input_layernorm` for
    /// [`Branch::Attention`], `post_attention_layernorm` for [`Branch::Mlp`].
    fn norm(&self, branch: Branch) -> Tensor<1>;

    /// Q/K/V biases concatenated, `[q + 2·kv]` (Qwen2), or `None`.
    fn qkv_bias(&self) -> Option<Tensor<1>>;

    /// `x · Wᵀ` for one projection (shapes in [`Proj`]).
    ///
    /// # Errors
    /// A packed kernel's shape refusal or a failed device read.
    fn project(&self, proj: Proj, x: Tensor<2>) -> Result<Tensor<2>>;
}

/// Attention of one layer over its keys and values.
pub trait Attend {
    /// Attends `q` `[tokens, heads, head_dim]` (RoPE applied) over the keys and values that
    /// `k`, `v` `[tokens, kv_heads, head_dim]` (this pass's tokens, RoPE applied to `k`) add to
    /// whatever the implementation holds; returns `[tokens, heads · head_dim]`, causal.
    ///
    /// # Errors
    /// The cache's errors (full pool, unknown sequence).
    fn attend(&mut self, layer: usize, q: Tensor<3>, k: Tensor<3>, v: Tensor<3>) -> Result<Tensor<2>>;
}

/// Causal attention within independent windows of one token matrix, each starting at position
/// 0, with no cache: the attention of calibration (GPTQ's and llm-awq's layer-by-layer runs) and
/// of training on full sequences.
#[derive(Debug, Clone, Copy)]
pub struct WindowAttention<'a> {
    /// `(first row, length)` of each window, in row order, covering the matrix.
    pub spans: &'a [(usize, usize)],
}

impl WindowAttention<'_> {
    /// The fused CPU kernel over every window at once, reading the token matrix in place:
    /// [`deco_kernels::window_attention::causal_window_attention`] (blocks of 32 queries against
    /// tiles of 32 keys) where the CPU runs it (AVX2 + FMA, `head_dim` a multiple of 8); else
    /// token `j` of a window is a decode query over the window's first `j + 1` keys (one
    /// [`deco_kernels::attention::paged_decode_attention`] call, parallel over all tokens of all
    /// windows, as the prefill of [`crate::Llama`] computes causal attention).
    fn attend_host(&self, q: Tensor<3>, k: Tensor<3>, v: Tensor<3>) -> Result<Tensor<2>> {
        use deco_kernels::attention::{AttnShape, SeqKv, paged_decode_attention};
        let [n, heads, hd] = q.dims();
        let [_, kvh, _] = k.dims();
        let kvrow = kvh * hd;
        let device = q.device();
        let table = [0u32];
        let mut out = deco_kernels::team::zeroed(n * heads * hd);
        // The three inputs borrowed in place where the CPU device allows it (`with_host`).
        use crate::host::with_host;
        let shape = AttnShape { n_heads: heads, kv_heads: kvh, head_dim: hd };
        if deco_kernels::window_attention::supported(shape) {
            // Blocks of queries against tiles of keys (FlashAttention-style), where the CPU runs it.
            let attended = with_host(&q, |qh| {
                with_host(&k, |kh| with_host(&v, |vh| deco_kernels::window_attention::causal_window_attention(qh, kh, vh, shape, self.spans, &mut out)))
            });
            attended.and_then(|r| r).and_then(|r| r)?.map_err(|e| Error::InvalidInput(format!("window attention: {e}")))?;
            return Ok(Tensor::from_data(TensorData::new(out, [n, heads * hd]), &device));
        }
        let attended = with_host(&q, |qh| {
            with_host(&k, |kh| {
                with_host(&v, |vh| {
                    let mut views = Vec::with_capacity(n);
                    for &(s, len) in self.spans {
                        let (kw, vw) = (&kh[s * kvrow..(s + len) * kvrow], &vh[s * kvrow..(s + len) * kvrow]);
                        views.extend((1..=len).map(|l| SeqKv { k: kw, v: vw, block_table: &table, block_size: len, len: l }));
                    }
                    paged_decode_attention(qh, AttnShape { n_heads: heads, kv_heads: kvh, head_dim: hd }, &views, &mut out)
                })
            })
        });
        attended.and_then(|r| r).and_then(|r| r)?.map_err(|e| Error::InvalidInput(format!("window attention: {e}")))?;
        Ok(Tensor::from_data(TensorData::new(out, [n, heads * hd]), &device))
    }
}

impl Attend for WindowAttention<'_> {
    fn attend(&mut self, _layer: usize, q: Tensor<3>, k: Tensor<3>, v: Tensor<3>) -> Result<Tensor<2>> {
        let [n, _, _] = q.dims();
        let covered = self.spans.iter().map(|s| s.1).sum::<usize>() == n && self.spans.iter().all(|&(s, l)| l > 0 && s + l <= n);
        if covered && q.device() == Device::flex() && !q.device().is_autodiff() {
            return self.attend_host(q, k, v);
        }
        if let [(0, _)] = self.spans {
            return Ok(causal_gqa_attention(q, k, v, 0));
        }
        let [_, heads, hd] = q.dims();
        let [_, kvh, _] = k.dims();
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
        Ok(Tensor::cat(outs, 0))
    }
}

/// One forward pass's shared inputs: the configuration, the RoPE table and the absolute
/// position of every token row. Its methods are the stages of a decoder layer (see the module
/// docs); [`Pass::layer`] runs them all.
#[derive(Debug, Clone, Copy)]
pub struct Pass<'a> {
    /// Hyper-parameters.
    pub cfg: &'a ModelConfig,
    /// cos/sin tables covering every position of `positions`.
    pub rope: &'a RopeTable,
    /// `[tokens]`: the position of each row of the residual stream.
    pub positions: &'a Tensor<1, Int>,
}

impl Pass<'_> {
    /// `rms_norm(x, norm(branch))`: the input of the branch's first projections,
    /// `[tokens, hidden]`.
    pub fn norm(&self, w: &dyn LayerParams, branch: Branch, x: Tensor<2>) -> Tensor<2> {
        rms_norm(x, &w.norm(branch), self.cfg.rms_norm_eps)
    }

    /// Q, K, V of layer `layer` from the normalized input `xn` `[tokens, hidden]` (site
    /// [`Site::AttnIn`]), with the bias and RoPE applied: q `[tokens, heads, head_dim]`, k and v
    /// `[tokens, kv_heads, head_dim]`.
    ///
    /// # Errors
    /// [`LayerParams::project`]'s.
    pub fn qkv(&self, layer: usize, w: &dyn LayerParams, xn: Tensor<2>, hook: &dyn LayerHook) -> Result<(Tensor<3>, Tensor<3>, Tensor<3>)> {
        let cfg = self.cfg;
        let [n, _] = xn.dims();
        let (heads, kvh, hd) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
        let (qd, kvd) = (heads * hd, kvh * hd);
        let mut qkv = w.project(Proj::Qkv, hook.input(layer, Site::AttnIn, xn))?;
        if let Some(b) = w.qkv_bias() {
            qkv = qkv.add(b.unsqueeze_dim::<2>(0));
        }
        let device = qkv.device();
        if device == Device::flex() && !device.is_autodiff() {
            // On the CPU without autodiff: one pass splits the projection and rotates q and k
            // on the host (the same bits as the tensor ops below, see `RopeTable::apply_host`).
            let positions: Vec<usize> = self.positions.to_data().iter::<i64>().map(|p| usize::try_from(p).unwrap_or(usize::MAX)).collect();
            let split = crate::host::with_host(&qkv, |h| {
                // Each of q, k, v gathered from its columns of the fused rows, blocks of rows in
                // parallel (the calibration passes split tens of thousands of rows).
                let row = qd + 2 * kvd;
                let part = |c0: usize, w: usize| -> Vec<f32> {
                    const ROWS: usize = 256;
                    let mut out = deco_kernels::team::zeroed(n * w);
                    deco_kernels::team::par_chunks_mut(&mut out, ROWS * w.max(1), |i, chunk| {
                        for (r, dst) in chunk.chunks_exact_mut(w.max(1)).enumerate() {
                            let t = i * ROWS + r;
                            dst.copy_from_slice(&h[t * row + c0..t * row + c0 + w]);
                        }
                    });
                    out
                };
                (part(0, qd), part(qd, kvd), part(qd + kvd, kvd))
            })?;
            let (mut q, mut k, v) = split;
            let rope_err = |e: deco_kernels::Error| Error::InvalidInput(format!("rope: {e}"));
            if self.rope.apply_host(&mut q, heads, &positions).map_err(rope_err)?
                && self.rope.apply_host(&mut k, kvh, &positions).map_err(rope_err)?
            {
                return Ok((
                    Tensor::from_data(TensorData::new(q, [n, heads, hd]), &device),
                    Tensor::from_data(TensorData::new(k, [n, kvh, hd]), &device),
                    Tensor::from_data(TensorData::new(v, [n, kvh, hd]), &device),
                ));
            }
        }
        let q = qkv.clone().slice([0..n, 0..qd]).reshape([n, heads, hd]);
        let k = qkv.clone().slice([0..n, qd..qd + kvd]).reshape([n, kvh, hd]);
        let v = qkv.slice([0..n, qd + kvd..qd + 2 * kvd]).reshape([n, kvh, hd]);
        Ok((rope(self.rope, q, self.positions), rope(self.rope, k, self.positions), v))
    }

    /// `x + branch(att · Woᵀ)`: the residual stream after attention, from the attention output
    /// `att` `[tokens, q]` (site [`Site::AttnOut`]).
    ///
    /// # Errors
    /// [`LayerParams::project`]'s.
    pub fn attn_residual(&self, layer: usize, w: &dyn LayerParams, x: Tensor<2>, att: Tensor<2>, hook: &dyn LayerHook) -> Result<Tensor<2>> {
        let o = w.project(Proj::O, hook.input(layer, Site::AttnOut, att))?;
        Ok(x.add(hook.branch(layer, Branch::Attention, o)))
    }

    /// `silu(xn2 · Wgᵀ) ⊙ (xn2 · Wuᵀ)` from the normalized `xn2` `[tokens, hidden]` (site
    /// [`Site::MlpIn`]): the input of down_proj, `[tokens, intermediate]`.
    ///
    /// # Errors
    /// [`LayerParams::project`]'s.
    pub fn mlp_act(&self, layer: usize, w: &dyn LayerParams, xn2: Tensor<2>, hook: &dyn LayerHook) -> Result<Tensor<2>> {
        let (n, i) = (xn2.dims()[0], self.cfg.intermediate_size);
        let gu = w.project(Proj::GateUp, hook.input(layer, Site::MlpIn, xn2))?;
        let device = gu.device();
        if device == Device::flex() && !device.is_autodiff() {
            // On the CPU without autodiff: the fused host SwiGLU (one pass, vectorized exp).
            let mut h = deco_kernels::team::zeroed(n * i);
            crate::host::with_host(&gu, |host| deco_kernels::act::swiglu(host, n, i, &mut h))?.map_err(|e| Error::InvalidInput(format!("swiglu: {e}")))?;
            return Ok(Tensor::from_data(TensorData::new(h, [n, i]), &device));
        }
        Ok(swiglu(gu.clone().slice([0..n, 0..i]), gu.slice([0..n, i..2 * i])))
    }

    /// `x2 + branch(h · Wdᵀ)`: the layer's output, from the SwiGLU output `h` (site
    /// [`Site::DownIn`]).
    ///
    /// # Errors
    /// [`LayerParams::project`]'s.
    pub fn mlp_residual(&self, layer: usize, w: &dyn LayerParams, x2: Tensor<2>, h: Tensor<2>, hook: &dyn LayerHook) -> Result<Tensor<2>> {
        let d = w.project(Proj::Down, hook.input(layer, Site::DownIn, h))?;
        Ok(x2.add(hook.branch(layer, Branch::Mlp, d)))
    }

    /// The whole layer `layer` over the residual stream `x` `[tokens, hidden]`, attention by
    /// `attend`: returns `[tokens, hidden]`.
    ///
    /// # Errors
    /// The weights' and `attend`'s errors.
    pub fn layer(&self, layer: usize, w: &dyn LayerParams, x: Tensor<2>, attend: &mut dyn Attend, hook: &dyn LayerHook) -> Result<Tensor<2>> {
        let xn = self.norm(w, Branch::Attention, x.clone());
        let (q, k, v) = self.qkv(layer, w, xn, hook)?;
        let att = attend.attend(layer, q, k, v)?;
        let x2 = self.attn_residual(layer, w, x, att, hook)?;
        let xn2 = self.norm(w, Branch::Mlp, x2.clone());
        let h = self.mlp_act(layer, w, xn2, hook)?;
        self.mlp_residual(layer, w, x2, h, hook)
    }
}

/// A linear layer's weight for `y = x · Wᵀ`, `x` `[tokens, in]`.
#[allow(clippy::large_enum_variant)] // a few hundred per model; boxing buys nothing
#[derive(Debug, Clone)]
pub enum LinearWeight {
    /// f32 on the device, transposed: `[in, out]` (`y = x @ w`).
    Dense(Tensor<2>),
    /// Dense on the host, transposed: `[in, out]`, f32 row-major multiplied by
    /// [`deco_kernels::dense::matmul`] (the CPU device without autodiff: a streaming kernel at
    /// few tokens instead of `gemm`'s packing), or bf16-packed for the calibration passes
    /// ([`HostWeights`]).
    Host(Arc<HostDense>),
    /// GGUF blocks on the host, `[out, in]`, multiplied by the packed CPU kernels of
    /// [`deco_kernels::quant`] (the activations go to the host and back).
    Packed(Arc<PackedMatrix>),
    /// GGUF blocks of different types on the host, stacked along the output dimension (parts
    /// `[out_i, in]`, outputs side by side in order): a fused Q/K/V whose V is Q8_0 and Q/K
    /// Q5_0, as llama.cpp's Q4_K_M files of models whose hidden size is not a multiple of 256
    /// have. One packed kernel call per part, instead of a dequantized f32 copy.
    PackedParts(Arc<[PackedMatrix]>),
    /// GGUF blocks on a GPU device, `[out, in]`, multiplied by the CubeCL kernel of
    /// [`deco_kernels::cube::CubePackedMatrix`] (dequantized in registers, nothing leaves the
    /// device). Features `wgpu` / `cuda` only.
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    Device(Arc<deco_kernels::cube::CubePackedMatrix>),
}

impl LinearWeight {
    /// `x · Wᵀ`: `[tokens, in] → [tokens, out]`.
    ///
    /// # Errors
    /// [`Error::TensorRead`] for a failed host read of `x` (packed), [`Error::InvalidInput`] for
    /// a packed kernel's shape refusal.
    pub fn apply(&self, x: Tensor<2>) -> Result<Tensor<2>> {
        match self {
            LinearWeight::Dense(w) => Ok(x.matmul(w.clone())),
            LinearWeight::Host(w) => {
                let [n, _] = x.dims();
                let device = x.device();
                let mut y = deco_kernels::team::zeroed(n * w.out);
                crate::host::with_host(&x, |xs| match &w.weights {
                    HostWeights::Bf16(p) => deco_kernels::bf16::matmul(xs, n, p, &mut y),
                    HostWeights::Int16(p) => deco_kernels::int16::matmul(xs, n, p, &mut y),
                    HostWeights::F32(data) => deco_kernels::dense::matmul(xs, n, data, w.inner, w.out, &mut y),
                })?
                .map_err(|e| Error::InvalidInput(e.to_string()))?;
                Ok(Tensor::from_data(TensorData::new(y, [n, w.out]), &device))
            }
            LinearWeight::Packed(m) => {
                let [n, _] = x.dims();
                let device = x.device();
                let mut y = deco_kernels::team::zeroed(n * m.rows());
                crate::host::with_host(&x, |xs| m.matmul(xs, n, &mut y))?.map_err(|e| Error::InvalidInput(e.to_string()))?;
                Ok(Tensor::from_data(TensorData::new(y, [n, m.rows()]), &device))
            }
            LinearWeight::PackedParts(parts) => {
                let [n, _] = x.dims();
                let device = x.device();
                let total: usize = parts.iter().map(PackedMatrix::rows).sum();
                let mut y = deco_kernels::team::zeroed(n * total);
                crate::host::with_host(&x, |xs| -> deco_kernels::Result<()> {
                    let (mut off, mut part) = (0, Vec::new());
                    for m in parts.iter() {
                        let rows = m.rows();
                        part.resize(n * rows, 0.0);
                        m.matmul(xs, n, &mut part)?;
                        for (dst, src) in y.chunks_exact_mut(total).zip(part.chunks_exact(rows.max(1))) {
                            dst[off..off + rows].copy_from_slice(src);
                        }
                        off += rows;
                    }
                    Ok(())
                })?
                .map_err(|e| Error::InvalidInput(e.to_string()))?;
                Ok(Tensor::from_data(TensorData::new(y, [n, total]), &device))
            }
            #[cfg(any(feature = "wgpu", feature = "cuda"))]
            LinearWeight::Device(m) => m.matmul(x).map_err(|e| Error::InvalidInput(e.to_string())),
        }
    }

    /// `Wᵀ` as f32 `[in, out]` on `device` (a dense copy of a packed weight: exact, as ggml's
    /// dequantization; on a GPU device the kernel multiplies the identity, which never leaves
    /// the device).
    ///
    /// # Errors
    /// A packed kernel's shape refusal.
    pub fn dense_transposed(&self, device: &Device) -> Result<Tensor<2>> {
        match self {
            LinearWeight::Dense(w) => Ok(w.clone()),
            LinearWeight::Host(w) => {
                let data = match &w.weights {
                    HostWeights::F32(data) => data.clone(),
                    HostWeights::Bf16(p) => p.unpack(),
                    HostWeights::Int16(p) => p.unpack(),
                };
                Ok(Tensor::from_data(TensorData::new(data, [w.inner, w.out]), device))
            }
            LinearWeight::Packed(m) => {
                let t = crate::host::transpose(&m.dequantize(), m.rows(), m.cols());
                Ok(Tensor::from_data(TensorData::new(t, [m.cols(), m.rows()]), device))
            }
            LinearWeight::PackedParts(parts) => {
                let deq: Vec<Vec<f32>> = parts.iter().map(PackedMatrix::dequantize).collect();
                let refs: Vec<(&[f32], usize)> = deq.iter().zip(parts.iter()).map(|(d, m)| (d.as_slice(), m.rows())).collect();
                let inner = parts.first().map_or(0, PackedMatrix::cols);
                let total: usize = parts.iter().map(PackedMatrix::rows).sum();
                Ok(Tensor::from_data(TensorData::new(crate::host::fuse_transposed(&refs, inner), [inner, total]), device))
            }
            #[cfg(any(feature = "wgpu", feature = "cuda"))]
            LinearWeight::Device(m) => {
                // I · Wᵀ: each output is one weight times 1 plus zeros, exact. `cols` tokens is
                // within the kernel's grid (checked by `LinearWeight::packed`).
                let eye = Tensor::<2>::eye(m.cols(), device);
                m.matmul(eye).map_err(|e| Error::InvalidInput(e.to_string()))
            }
        }
    }

    /// The weight of a packed matrix for `device`: on a GPU device (features `wgpu` / `cuda`,
    /// no autodiff) uploaded for the CubeCL kernel when its grid takes the matrix (at most
    /// `CubePackedMatrix::MAX_ROWS` rows and columns), else kept on the host for the CPU
    /// kernels, in the layout of the process's activation precision
    /// ([`PackedMatrix::for_activation_precision`]: Q4_K / Q6_K rows interleaved for the
    /// 8-bit-activation kernels).
    pub fn packed(m: PackedMatrix, device: &Device) -> Self {
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        if gpu_kernels(device) && m.rows().max(m.cols()) <= deco_kernels::cube::CubePackedMatrix::MAX_ROWS {
            return LinearWeight::Device(Arc::new(deco_kernels::cube::CubePackedMatrix::upload(&m, device)));
        }
        let _ = device;
        LinearWeight::Packed(Arc::new(m.for_activation_precision()))
    }

    /// Packed matrices that read the same input, stacked along the output dimension: runs of
    /// equal block type are concatenated ([`PackedMatrix::concat_rows`]); one run is
    /// [`LinearWeight::packed`], several are [`LinearWeight::PackedParts`] on the CPU. `None`
    /// where the parts cannot stay packed (a GPU device whose kernel takes one matrix, or
    /// different row lengths): the caller fuses them dense.
    pub fn packed_stack(parts: Vec<PackedMatrix>, device: &Device) -> Option<Self> {
        let mut runs: Vec<PackedMatrix> = Vec::new();
        for m in parts {
            match runs.last_mut() {
                Some(last) if last.ty() == m.ty() => *last = PackedMatrix::concat_rows(&[&*last, &m]).ok()?,
                _ => runs.push(m),
            }
        }
        if runs.windows(2).any(|w| w[0].cols() != w[1].cols()) {
            return None;
        }
        match runs.len() {
            0 => None,
            1 => runs.pop().map(|m| Self::packed(m, device)),
            _ if gpu_kernels(device) => None,
            _ => Some(LinearWeight::PackedParts(runs.into_iter().map(PackedMatrix::for_activation_precision).collect())),
        }
    }
}

impl LinearWeight {
    /// A dense weight from transformers weights `[out_i, inner]` (host, row-major) that read the
    /// same input, fused along the output dimension ([`crate::host::fuse_transposed`]) and
    /// uploaded to `device` as `[inner, Σ out_i]`.
    pub fn dense_fused(parts: &[(&[f32], usize)], inner: usize, device: &Device) -> Self {
        Self::dense_fused_as(parts, inner, device, CalibDtype::F32)
    }

    /// [`LinearWeight::dense_fused`] in the precision of `dtype`'s products on the host: f32,
    /// or the same weight rounded to bf16 and packed for bf16 products ([`HostWeights::Bf16`]),
    /// or quantized to 16-bit block-scaled integers and packed for their products
    /// ([`HostWeights::Int16`]), straight from the `[out_i, inner]` rows. `dtype` is ignored off
    /// the host (the caller checks the kernels' `available` and the device first, see
    /// [`crate::calibrate::Calibrator::with_dtype`]).
    pub fn dense_fused_as(parts: &[(&[f32], usize)], inner: usize, device: &Device, dtype: CalibDtype) -> Self {
        if dtype != CalibDtype::F32 && Self::host_dense(device) {
            let outs: Vec<usize> = parts.iter().map(|p| p.1).collect();
            return Self::dense_fused_rows_as(&outs, inner, device, dtype, &|i, r, buf| buf.copy_from_slice(&parts[i].0[r * inner..(r + 1) * inner]));
        }
        let total: usize = parts.iter().map(|p| p.1).sum();
        let fused = crate::host::fuse_transposed(parts, inner);
        if Self::host_dense(device) {
            return LinearWeight::Host(Arc::new(HostDense { inner, out: total, weights: HostWeights::F32(fused) }));
        }
        LinearWeight::Dense(Tensor::from_data(TensorData::new(fused, [inner, total]), device))
    }

    /// [`LinearWeight::dense_fused_as`] of weights given row by row: part `i` has `outs[i]`
    /// output rows, and `row(i, r, buf)` writes row `r` of part `i` (`[inner]`, the
    /// `[out_i, inner]` layout) into `buf`. `row` is called concurrently, once per row. Under
    /// bf16 or int16 on the host the rows go straight into the packed weight
    /// ([`deco_kernels::bf16::PackedBf16::from_rows`], [`deco_kernels::int16::PackedInt16::from_rows`])
    /// without an f32 copy of the whole weight; otherwise they are collected first. For weights
    /// computed row by row (AWQ's scale candidates, see `deco_quant::awq`).
    pub fn dense_fused_rows_as(outs: &[usize], inner: usize, device: &Device, dtype: CalibDtype, row: &(dyn Fn(usize, usize, &mut [f32]) + Sync)) -> Self {
        let total: usize = outs.iter().sum();
        if dtype != CalibDtype::F32 && Self::host_dense(device) {
            // Output o of the fused weight is row o - start_i of the part i it falls in.
            let part_of = |o: usize| -> (usize, usize) {
                let mut start = 0;
                for (i, &n) in outs.iter().enumerate() {
                    if o < start + n {
                        return (i, o - start);
                    }
                    start += n;
                }
                unreachable!("from_rows asks for rows below the total only")
            };
            let fused_row = |o: usize, buf: &mut [f32]| {
                let (i, r) = part_of(o);
                row(i, r, buf);
            };
            let weights = if dtype == CalibDtype::Int16 {
                HostWeights::Int16(deco_kernels::int16::PackedInt16::from_rows(inner, total, fused_row))
            } else {
                HostWeights::Bf16(deco_kernels::bf16::PackedBf16::from_rows(inner, total, fused_row))
            };
            return LinearWeight::Host(Arc::new(HostDense { inner, out: total, weights }));
        }
        let mats: Vec<Vec<f32>> = outs
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let mut m = vec![0.0f32; n * inner];
                deco_kernels::team::par_chunks_mut(&mut m, inner.max(1), |r, buf| row(i, r, buf));
                m
            })
            .collect();
        let parts: Vec<(&[f32], usize)> = mats.iter().zip(outs).map(|(m, &n)| (m.as_slice(), n)).collect();
        Self::dense_fused_as(&parts, inner, device, CalibDtype::F32)
    }

    /// Whether dense weights for `device` live on the host ([`LinearWeight::Host`]): the CPU
    /// device without autodiff.
    fn host_dense(device: &Device) -> bool {
        *device == Device::flex() && !device.is_autodiff()
    }
}

/// A dense weight on the host for [`LinearWeight::Host`], `[inner, out]`.
#[derive(Debug, Clone)]
pub struct HostDense {
    /// Input features.
    pub inner: usize,
    /// Output features.
    pub out: usize,
    /// The values, in the precision of the products.
    pub weights: HostWeights,
}

/// The values of a [`HostDense`] weight, in the precision its products run in.
#[derive(Debug, Clone)]
pub enum HostWeights {
    /// `[inner, out]` row-major f32, multiplied by [`deco_kernels::dense::matmul`] (a streaming
    /// kernel at few tokens, deco's tile beyond).
    F32(Vec<f32>),
    /// Rounded to bf16 and packed for [`deco_kernels::bf16::matmul`] (bf16-rounded activations,
    /// f32 sums) in every call: the calibration passes of
    /// [`crate::calibrate::CalibDtype::Bf16`]. No f32 copy is kept.
    Bf16(deco_kernels::bf16::PackedBf16),
    /// Quantized to 16-bit integers per output column and block of 64 inputs and packed for
    /// [`deco_kernels::int16::matmul`] (activations quantized likewise per token, exact integer
    /// block sums, f32 across blocks): the calibration passes of
    /// [`crate::calibrate::CalibDtype::Int16`]. No f32 copy is kept.
    Int16(deco_kernels::int16::PackedInt16),
}

/// One decoder layer's weights as the model runs them: norms on the device, Q/K/V and gate/up
/// fused along the output dimension, each projection dense on the device or packed.
#[derive(Debug, Clone)]
pub struct DecoderLayer {
    /// `[hidden]`: `input_layernorm.weight`.
    pub attn_norm: Tensor<1>,
    /// out = `q + 2·kv`, in = `hidden`.
    pub wqkv: LinearWeight,
    /// `[q + 2·kv]` when the architecture has attention biases.
    pub bqkv: Option<Tensor<1>>,
    /// out = `hidden`, in = `q`.
    pub wo: LinearWeight,
    /// `[hidden]`: `post_attention_layernorm.weight`.
    pub ffn_norm: Tensor<1>,
    /// out = `2·intermediate`, in = `hidden`.
    pub w_gate_up: LinearWeight,
    /// out = `hidden`, in = `intermediate`.
    pub w_down: LinearWeight,
}

impl LayerParams for DecoderLayer {
    fn norm(&self, branch: Branch) -> Tensor<1> {
        match branch {
            Branch::Attention => self.attn_norm.clone(),
            Branch::Mlp => self.ffn_norm.clone(),
        }
    }

    fn qkv_bias(&self) -> Option<Tensor<1>> {
        self.bqkv.clone()
    }

    fn project(&self, proj: Proj, x: Tensor<2>) -> Result<Tensor<2>> {
        match proj {
            Proj::Qkv => self.wqkv.apply(x),
            Proj::O => self.wo.apply(x),
            Proj::GateUp => self.w_gate_up.apply(x),
            Proj::Down => self.w_down.apply(x),
        }
    }
}

/// A source of f32 weights by transformers name: `name -> (row-major shape, values)`.
pub type TensorSource<'a> = dyn Fn(&str) -> Result<(Vec<usize>, Vec<f32>)> + 'a;

/// Reads weight `name` from `tensor` and checks it against the shape transformers gives it
/// under `cfg` (`deco_formats::checkpoint::hf_expected_shape`).
///
/// # Errors
/// [`Error::InvalidInput`] naming the weight for an unknown name or a wrong shape or length;
/// the source's own errors.
pub fn fetch_checked(cfg: &ModelConfig, tensor: &TensorSource<'_>, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
    let (shape, data) = tensor(name)?;
    let expected = hf_expected_shape(cfg, name).ok_or_else(|| Error::InvalidInput(format!("unknown weight name `{name}`")))?;
    if shape != expected || data.len() != expected.iter().product::<usize>() {
        return Err(Error::InvalidInput(format!(
            "weight `{name}` has shape {shape:?} ({} values), expected {expected:?}",
            data.len()
        )));
    }
    Ok((shape, data))
}

/// Inverse RoPE frequencies for a configuration, with its scaling applied (`head_dim / 2`
/// values, radians per position).
///
/// Llama 3 scaling follows transformers' `_compute_llama3_parameters`; linear scaling divides
/// every frequency by its factor.
pub fn config_inv_freq(cfg: &ModelConfig) -> Vec<f64> {
    let base = rope_inv_freq(cfg.head_dim, cfg.rope_theta);
    match &cfg.rope_scaling {
        None => base,
        Some(RopeScaling::Linear { factor }) => base.iter().map(|f| f / factor).collect(),
        Some(RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings }) => {
            let old = *original_max_position_embeddings as f64;
            let low_wavelen = old / low_freq_factor;
            let high_wavelen = old / high_freq_factor;
            base.iter()
                .map(|&f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
    }
}

/// Whether the fused CubeCL kernels apply on `device`: a GPU device (features `wgpu` / `cuda`)
/// without autodiff (the kernels have no backward pass). Always `false` in a CPU-only build.
pub fn gpu_kernels(device: &Device) -> bool {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    {
        *device != burn::tensor::Device::flex() && !device.is_autodiff()
    }
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    {
        let _ = device;
        false
    }
}

/// Whether `x` lives on a device whose fused CubeCL kernels apply ([`gpu_kernels`]).
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn on_kernel_device<const D: usize>(x: &Tensor<D>) -> bool {
    gpu_kernels(&x.device())
}

/// Rotate-half RoPE with `table` at `positions`: [`RopeTable::apply`], or the fused CubeCL
/// kernel on a GPU device without autodiff. Shapes: `x` `[tokens, heads, head_dim]`,
/// `positions` `[tokens]`.
pub fn rope(table: &RopeTable, x: Tensor<3>, positions: &Tensor<1, Int>) -> Tensor<3> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    if on_kernel_device(&x)
        && let Ok(y) = deco_kernels::cube::rope(table, x.clone(), positions)
    {
        return y;
    }
    table.apply(x, positions)
}

/// RMSNorm of every row (Zhang & Sennrich 2019): `deco_kernels::ops::rms_norm`, its fused
/// CubeCL kernel on a GPU device without autodiff, or on the CPU (`Flex`) without autodiff
/// `deco_kernels::ops::rms_norm_host` (one pass per row instead of seven tensor operations,
/// each allocating its output, on the calling thread of a decode step while the team waits; the
/// same values up to f32 rounding of the sum of squares). Shapes: `x` `[tokens, hidden]`,
/// `weight` `[hidden]`.
pub fn rms_norm(x: Tensor<2>, weight: &Tensor<1>, eps: f64) -> Tensor<2> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    if on_kernel_device(&x)
        && let Ok(y) = deco_kernels::cube::rms_norm(x.clone(), weight, eps)
    {
        return y;
    }
    let device = x.device();
    if device == Device::flex() && !device.is_autodiff() {
        let [n, h] = x.dims();
        let mut out = vec![0.0f32; n * h];
        let done = crate::host::with_host(&x, |xs| crate::host::with_host(weight, |ws| deco_kernels::ops::rms_norm_host(xs, ws, eps, &mut out)));
        if let Ok(Ok(Ok(()))) = done {
            return Tensor::from_data(TensorData::new(out, [n, h]), &device);
        }
    }
    deco_kernels::ops::rms_norm(x, weight, eps)
}

/// `deco_kernels::ops::causal_gqa_attention` or FlashAttention-2 on the device. Shapes: `q`
/// `[tokens, heads, head_dim]`, `k`, `v` `[past + tokens, kv_heads, head_dim]`, output
/// `[tokens, heads · head_dim]`.
pub(crate) fn causal_gqa_attention(q: Tensor<3>, k: Tensor<3>, v: Tensor<3>, past: usize) -> Tensor<2> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    if on_kernel_device(&q)
        && let Ok(y) = deco_kernels::cube::flash_attention(q.clone(), k.clone(), v.clone(), past)
    {
        return y;
    }
    deco_kernels::ops::causal_gqa_attention(q, k, v, past)
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Tensor, TensorData};
    use deco_formats::ggml::{self, GgmlType};
    use deco_kernels::quant::{BlockType, PackedMatrix};

    use super::LinearWeight;

    fn values(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// Parts of different block types stay packed (one part per run of equal type) and give the
    /// f64 product of the dequantized weights (ggml's dequantization), parts side by side; the
    /// dense copy is the same weights transposed.
    #[test]
    fn mixed_type_stack_matches_dequantized_reference() {
        let (cols, n) = (64, 3);
        let spec = [(GgmlType::Q4_0, BlockType::Q4_0, 40), (GgmlType::Q4_0, BlockType::Q4_0, 8), (GgmlType::Q8_0, BlockType::Q8_0, 24), (GgmlType::Q4_0, BlockType::Q4_0, 16)];
        let (mut parts, mut deq) = (Vec::new(), Vec::new());
        for (i, &(g, b, rows)) in spec.iter().enumerate() {
            let w = values(i as u64 + 1, rows * cols);
            let bytes = if b == BlockType::Q8_0 { ggml::quantize_q8_0(&w) } else { ggml::quantize_q4_0(&w) }.expect("quantize");
            deq.extend(ggml::dequantize(g, &bytes, rows * cols).expect("dequantize"));
            parts.push(PackedMatrix::new(b, rows, cols, bytes).expect("packed"));
        }
        let total: usize = spec.iter().map(|s| s.2).sum();
        let device = Device::flex();
        let w = LinearWeight::packed_stack(parts, &device).expect("stays packed");
        let LinearWeight::PackedParts(p) = &w else { panic!("expected PackedParts, got {w:?}") };
        assert_eq!(p.iter().map(|m| (m.ty(), m.rows())).collect::<Vec<_>>(), [(BlockType::Q4_0, 48), (BlockType::Q8_0, 24), (BlockType::Q4_0, 16)]);
        let x = values(99, n * cols);
        let y = w.apply(Tensor::from_data(TensorData::new(x.clone(), [n, cols]), &device)).expect("apply");
        assert_eq!(y.dims(), [n, total]);
        let y = y.try_into_vec_as::<f32>().expect("read");
        for t in 0..n {
            for r in 0..total {
                let (mut want, mut mag) = (0.0f64, 0.0f64);
                for c in 0..cols {
                    let p = f64::from(deq[r * cols + c]) * f64::from(x[t * cols + c]);
                    want += p;
                    mag += p.abs();
                }
                let got = f64::from(y[t * total + r]);
                assert!((got - want).abs() <= 1e-5 * mag + 1e-6, "({t}, {r}): {got} vs {want}");
            }
        }
        let dense = w.dense_transposed(&device).expect("dense").try_into_vec_as::<f32>().expect("read");
        for r in 0..total {
            for c in 0..cols {
                assert_eq!(dense[c * total + r], deq[r * cols + c], "dense copy at ({r}, {c})");
            }
        }
    }

    /// One type stays one packed matrix.
    #[test]
    fn same_type_stack_is_one_matrix() {
        let w = values(5, 2 * 32);
        let parts = (0..2).map(|_| PackedMatrix::new(BlockType::Q8_0, 1, 32, ggml::quantize_q8_0(&w[..32]).expect("q")).expect("packed")).collect();
        let w = LinearWeight::packed_stack(parts, &Device::flex()).expect("packed");
        assert!(matches!(&w, LinearWeight::Packed(m) if m.rows() == 2), "{w:?}");
    }
}
