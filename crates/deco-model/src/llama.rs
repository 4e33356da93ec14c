//! The Llama / Qwen2 decoder.
//!
//! Reference: transformers `models/llama/modeling_llama.py` (`LlamaForCausalLM`) and
//! `models/qwen2/modeling_qwen2.py`; Touvron et al. 2023 ("LLaMA"), §2.2.

use std::sync::{Arc, OnceLock};

use burn::tensor::{Device, Int, Tensor, TensorData};
use deco_formats::checkpoint::{Checkpoint, hf_expected_shape, hf_to_gguf_name};
use deco_formats::config::{Architecture, ModelConfig};
use deco_formats::ggml::GgmlType;
use deco_kernels::attention::{AttnShape, SeqKv, paged_decode_attention};
use deco_kernels::ops::RopeTable;
use deco_kernels::quant::{BlockType, PackedMatrix};

use crate::decoder::{Attend, Branch, DecoderLayer, LinearWeight, NoHook, Pass, TensorSource, causal_gqa_attention, config_inv_freq, fetch_checked, gpu_kernels, rms_norm};
use crate::host::{to_host, to_host_rows};
use crate::kv_cache::{HostKv, KvCache, SeqId};
use crate::{Error, Result};

/// One sequence's new tokens in a batched forward. Their positions continue the sequence's cache:
/// `cache.seq_len(seq) ..`.
#[derive(Debug, Clone, Copy)]
pub struct SeqInput<'a> {
    /// The sequence.
    pub seq: SeqId,
    /// New token ids (at least one).
    pub tokens: &'a [u32],
    /// `None`: the tokens continue the sequence in order (causal). `Some(parents)`: they are the
    /// nodes of a token tree (Medusa's candidate tree, Cai et al. 2024 §2.1.2), `parents[i]` the
    /// index of node `i`'s parent among `tokens` (`< i`) or `None` for a node that follows the
    /// cache directly; node `i` sits at position `cache.seq_len(seq) + depth(i)` and attends to
    /// the cache and to its own path only (on the CPU with a host cache the fused decode
    /// attention over the path's rows, see `Llama::attention_fused`; otherwise
    /// `deco_kernels::ops::tree_gqa_attention`). Its keys and values are appended in node
    /// order; keep a path with [`KvCache::keep_rows`].
    pub tree: Option<&'a [Option<usize>]>,
}

/// Which positions of each sequence get logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsWanted {
    /// Only the last new token of each sequence (generation).
    Last,
    /// Every new token (scoring, perplexity, speculative verification).
    All,
}

/// Result of [`Llama::forward`].
#[derive(Debug, Clone)]
pub struct ForwardOutput {
    /// `[rows, vocab]` logits, f32. With [`LogitsWanted::Last`] one row per input sequence in
    /// input order; with [`LogitsWanted::All`] every new token of every sequence, sequences
    /// concatenated in input order.
    pub logits: Tensor<2>,
    /// `[rows, hidden]`: the final hidden states (after the last RMSNorm) of the same rows.
    pub hidden: Tensor<2>,
    /// Row range of each input sequence in `logits`.
    pub rows: Vec<std::ops::Range<usize>>,
}

impl ForwardOutput {
    /// Copies the logits to the host, one `Vec` per row.
    ///
    /// # Errors
    /// [`Error::TensorRead`] if the device read fails.
    pub fn logits_rows(&self) -> Result<Vec<Vec<f32>>> {
        to_host_rows(self.logits.clone())
    }
}

/// Token embeddings: dense on the device, or packed rows dequantized on lookup.
#[allow(clippy::large_enum_variant)] // one per model
#[derive(Debug, Clone)]
enum Embedding {
    /// `[vocab, hidden]` f32.
    Dense(Tensor<2>),
    /// `[vocab, hidden]` GGUF blocks.
    Packed(Arc<PackedMatrix>),
}

/// A source of packed weights: `Ok(Some(matrix))` (HF layout `[out, in]`) for a weight kept in
/// its GGUF blocks, `Ok(None)` for one that must be loaded as f32.
type PackedSource<'a> = &'a dyn Fn(&str) -> Result<Option<PackedMatrix>>;

/// Counts of linear weights by storage ([`Llama::weight_storage`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WeightStorage {
    /// f32 on the model's device ([`LinearWeight::Dense`], or [`LinearWeight::Host`] on the CPU).
    pub dense: usize,
    /// GGUF blocks on the host, CPU kernels ([`LinearWeight::Packed`]).
    pub host_packed: usize,
    /// GGUF blocks on a GPU device, CubeCL kernel (`LinearWeight::Device`).
    pub device_packed: usize,
}

/// A Llama-family causal language model with weights on a burn device.
#[derive(Debug, Clone)]
pub struct Llama {
    /// Hyper-parameters.
    pub config: ModelConfig,
    device: Device,
    embed: Embedding,
    layers: Vec<DecoderLayer>,
    norm: Tensor<1>,
    /// The LM head (out = `vocab`, in = `hidden`).
    head: LinearWeight,
    /// `[hidden, vocab]` f32, built on first use of [`Llama::lm_head`] when `head` is packed.
    lm_head_dense: OnceLock<Tensor<2>>,
    rope: RopeTable,
    /// Use the fused CPU decode attention for sequences with one new token (see
    /// [`Llama::set_fused_decode_attention`]).
    fused_decode: bool,
}

/// Reads a linear weight of a GGUF checkpoint as packed blocks if its type has packed kernels
/// (Q4_0, Q4_1, Q8_0, Q4_K, Q5_0, Q6_K), un-permuting llama.cpp's Q/K rows as `Checkpoint::tensor` does.
fn gguf_packed(ckpt: &Checkpoint, hf_name: &str) -> Result<Option<PackedMatrix>> {
    let Some(g) = ckpt.gguf() else { return Ok(None) };
    let Some(gname) = hf_to_gguf_name(hf_name) else { return Ok(None) };
    let Some(info) = g.tensor_info(&gname) else { return Ok(None) };
    let ty = match info.ggml_type {
        GgmlType::Q4_0 => BlockType::Q4_0,
        GgmlType::Q4_1 => BlockType::Q4_1,
        GgmlType::Q8_0 => BlockType::Q8_0,
        GgmlType::Q4_K => BlockType::Q4_K,
        GgmlType::Q5_0 => BlockType::Q5_0,
        GgmlType::Q6_K => BlockType::Q6_K,
        _ => return Ok(None),
    };
    let shape = info.shape();
    let cfg = &ckpt.config;
    if shape.len() != 2 || Some(&shape) != hf_expected_shape(cfg, hf_name).as_ref() {
        // Let the dense path report the mismatch.
        return Ok(None);
    }
    let (_, bytes) = g.tensor_bytes(&gname)?;
    let m = PackedMatrix::new(ty, shape[0], shape[1], bytes.to_vec())
        .map_err(|e| Error::InvalidInput(format!("weight `{hf_name}`: {e}")))?;
    g.release_tensor_pages(&gname);
    let heads = if cfg.model_type != Architecture::Llama {
        None
    } else if hf_name.ends_with("q_proj.weight") {
        Some(cfg.num_attention_heads)
    } else if hf_name.ends_with("k_proj.weight") {
        Some(cfg.num_key_value_heads)
    } else {
        None
    };
    let Some(n_head) = heads else { return Ok(Some(m)) };
    // `deco_formats::checkpoint::unpermute_qk` on rows: HF row h·d + i·d/2 + j is GGUF row
    // h·d + 2j + i.
    let rows = shape[0];
    if n_head == 0 || !rows.is_multiple_of(2 * n_head) {
        return Ok(None);
    }
    let d = rows / n_head;
    let half = d / 2;
    let mut perm = vec![0usize; rows];
    for h in 0..n_head {
        for j in 0..half {
            for i in 0..2 {
                perm[h * d + i * half + j] = h * d + 2 * j + i;
            }
        }
    }
    Ok(Some(m.permute_rows(&perm).map_err(|e| Error::InvalidInput(e.to_string()))?))
}

impl Llama {
    /// Loads the weights of `ckpt` onto `device`.
    ///
    /// Linear weights (and the token embedding / LM head) stored in a GGUF file as Q4_0, Q4_1,
    /// Q5_0, Q8_0, Q4_K or Q6_K stay in their packed blocks: on the host for the packed CPU
    /// kernels of [`deco_kernels::quant`] when `device` is the CPU (`flex`), in device memory for
    /// the CubeCL quantized matmul on a GPU device (features `wgpu` / `cuda`; the token
    /// embedding stays on the host, a row per token is dequantized and uploaded). Every other
    /// weight, and every weight on an autodiff device, is dequantized to f32 on `device`.
    ///
    /// `max_positions` bounds the RoPE table (and so the usable context); `None` uses the model's
    /// `max_position_embeddings`.
    ///
    /// # Errors
    /// The checkpoint's errors: missing tensors, shape mismatches, unsupported quantization types.
    pub fn load(ckpt: &Checkpoint, device: &Device, max_positions: Option<usize>) -> Result<Self> {
        let packed = |name: &str| gguf_packed(ckpt, name);
        let on_cpu = *device == Device::flex();
        let packed: Option<PackedSource<'_>> = if on_cpu || gpu_kernels(device) { Some(&packed) } else { None };
        Self::build(&ckpt.config, &|name| Ok(ckpt.tensor(name)?), packed, device, max_positions)
    }

    /// Builds the model from any source of f32 tensors in transformers names and layout
    /// (`tensor(name) -> (shape, row-major data)`), e.g. weights that a quantizer or a pruner
    /// has just rewritten.
    ///
    /// # Errors
    /// Whatever `tensor` returns for a missing or malformed weight.
    pub fn load_from(
        config: &ModelConfig,
        tensor: &TensorSource<'_>,
        device: &Device,
        max_positions: Option<usize>,
    ) -> Result<Self> {
        Self::build(config, tensor, None, device, max_positions)
    }

    fn build(
        config: &ModelConfig,
        tensor: &TensorSource<'_>,
        packed: Option<PackedSource<'_>>,
        device: &Device,
        max_positions: Option<usize>,
    ) -> Result<Self> {
        let cfg = config.clone();
        let h = cfg.hidden_size;
        let fetch = |name: &str| fetch_checked(&cfg, tensor, name);
        let get = |name: &str| -> Result<Vec<f32>> { Ok(fetch(name)?.1) };
        let t1 = |v: Vec<f32>| -> Tensor<1> {
            let n = v.len();
            Tensor::from_data(TensorData::new(v, [n]), device)
        };

        // The weights `names` stacked along the output dimension: packed when every part is
        // packed (one matrix per run of equal block type), dense (transposed, `[in, sum out]`)
        // otherwise.
        let linear = |names: &[String], inner: usize| -> Result<LinearWeight> {
            if let Some(pk) = packed {
                let mut parts = Vec::with_capacity(names.len());
                for n in names {
                    match pk(n)? {
                        Some(m) => parts.push(m),
                        None => break,
                    }
                }
                if parts.len() == names.len()
                    && let Some(w) = LinearWeight::packed_stack(parts, device)
                {
                    return Ok(w);
                }
            }
            let parts = names.iter().map(|n| fetch(n)).collect::<Result<Vec<_>>>()?;
            let refs: Vec<(&[f32], usize)> = parts.iter().map(|(s, d)| (d.as_slice(), s[0])).collect();
            Ok(LinearWeight::dense_fused(&refs, inner, device))
        };

        let packed_embed = match packed {
            Some(pk) => pk("model.embed_tokens.weight")?.map(Arc::new),
            None => None,
        };
        let (embed, head) = match packed_embed {
            Some(m) => {
                let head = if cfg.tie_word_embeddings {
                    LinearWeight::packed(PackedMatrix::clone(&m), device)
                } else {
                    linear(&["lm_head.weight".to_string()], h)?
                };
                (Embedding::Packed(m), head)
            }
            None => {
                let embed_data = get("model.embed_tokens.weight")?;
                let head = if cfg.tie_word_embeddings {
                    LinearWeight::dense_fused(&[(&embed_data, cfg.vocab_size)], h, device)
                } else {
                    linear(&["lm_head.weight".to_string()], h)?
                };
                (Embedding::Dense(Tensor::from_data(TensorData::new(embed_data, [cfg.vocab_size, h]), device)), head)
            }
        };
        let lm_head_dense = OnceLock::new();
        if let LinearWeight::Dense(w) = &head {
            let _ = lm_head_dense.set(w.clone());
        }

        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let wqkv = linear(
                &[
                    format!("{p}.self_attn.q_proj.weight"),
                    format!("{p}.self_attn.k_proj.weight"),
                    format!("{p}.self_attn.v_proj.weight"),
                ],
                h,
            )?;
            let bqkv = if cfg.attention_bias {
                let mut b = get(&format!("{p}.self_attn.q_proj.bias"))?;
                b.extend(get(&format!("{p}.self_attn.k_proj.bias"))?);
                b.extend(get(&format!("{p}.self_attn.v_proj.bias"))?);
                Some(t1(b))
            } else {
                None
            };
            let q = cfg.num_attention_heads * cfg.head_dim;
            let inter = cfg.intermediate_size;
            layers.push(DecoderLayer {
                attn_norm: t1(get(&format!("{p}.input_layernorm.weight"))?),
                wqkv,
                bqkv,
                wo: linear(&[format!("{p}.self_attn.o_proj.weight")], q)?,
                ffn_norm: t1(get(&format!("{p}.post_attention_layernorm.weight"))?),
                w_gate_up: linear(&[format!("{p}.mlp.gate_proj.weight"), format!("{p}.mlp.up_proj.weight")], h)?,
                w_down: linear(&[format!("{p}.mlp.down_proj.weight")], inter)?,
            });
        }
        let norm = t1(get("model.norm.weight")?);
        let max_pos = max_positions.unwrap_or(cfg.max_position_embeddings).min(cfg.max_position_embeddings);
        let rope = RopeTable::new(&config_inv_freq(&cfg), max_pos, device);
        let fused_decode = *device == Device::flex();
        Ok(Self { config: cfg, device: device.clone(), embed, layers, norm, head, lm_head_dense, rope, fused_decode })
    }

    /// Turns the fused CPU decode attention on or off (on by default when the model lives on the
    /// CPU `flex` device; it is never used on other devices).
    ///
    /// When on, in every layer the sequences of a batch that have exactly one new token (decode)
    /// and whose cache supports host storage ([`KvCache::supports_host_kv`]) get their attention
    /// from one call of `deco_kernels::attention::paged_decode_attention`, which reads keys and
    /// values in place from the cache ([`KvCache::host_view`]); sequences with several new
    /// tokens (prefill, verification) keep the burn path (`causal_gqa_attention` on the
    /// gathered keys and values). Off: every sequence takes the burn path (the reference).
    pub fn set_fused_decode_attention(&mut self, on: bool) {
        self.fused_decode = on && self.device == Device::flex();
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Context length usable with this instance (bounded by the RoPE table).
    pub fn max_context(&self) -> usize {
        self.rope.max_positions()
    }

    /// Runs new tokens of several sequences through the model, appending their keys and values
    /// to `cache`, and returns logits and final hidden states for the positions `wanted`.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for an empty batch or a sequence with no tokens,
    /// [`Error::TokenOutOfRange`], [`Error::ContextOverflow`] when a sequence would exceed
    /// [`Llama::max_context`].
    pub fn forward(&self, inputs: &[SeqInput<'_>], cache: &mut dyn KvCache, wanted: LogitsWanted) -> Result<ForwardOutput> {
        self.forward_partial(inputs, cache, wanted, self.layers.len())
    }

    /// Like [`Llama::forward`] but through the first `num_layers` decoder layers only, followed by
    /// the final RMSNorm and the LM head: the shallow "draft" or "amateur" model of
    /// self-speculative decoding (Zhang et al. 2024, "Draft & Verify") and of contrastive decoding
    /// with a truncated expert. `cache` must be used with the same `num_layers` throughout (it
    /// holds keys and values for those layers only).
    ///
    /// # Errors
    /// As [`Llama::forward`], and [`Error::InvalidInput`] if `num_layers` is 0 or exceeds the
    /// model's depth.
    pub fn forward_partial(
        &self,
        inputs: &[SeqInput<'_>],
        cache: &mut dyn KvCache,
        wanted: LogitsWanted,
        num_layers: usize,
    ) -> Result<ForwardOutput> {
        let rows: Vec<usize> = inputs
            .iter()
            .map(|i| match wanted {
                LogitsWanted::Last => 1,
                LogitsWanted::All => i.tokens.len(),
            })
            .collect();
        self.forward_rows(inputs, cache, &rows, num_layers)
    }

    /// Like [`Llama::forward_partial`], with the number of positions that get logits chosen per
    /// sequence: the last `rows[i]` new tokens of sequence `i` (`1..=tokens.len()`), e.g. every
    /// token of a speculative verification chunk next to the last token of a prefill chunk in
    /// the same batch.
    ///
    /// # Errors
    /// As [`Llama::forward_partial`], and [`Error::InvalidInput`] if `rows` does not give one
    /// count in `1..=tokens.len()` per sequence.
    pub fn forward_rows(&self, inputs: &[SeqInput<'_>], cache: &mut dyn KvCache, rows: &[usize], num_layers: usize) -> Result<ForwardOutput> {
        if num_layers == 0 || num_layers > self.layers.len() {
            return Err(Error::InvalidInput(format!(
                "num_layers must be in 1..={}, got {num_layers}",
                self.layers.len()
            )));
        }
        if rows.len() != inputs.len() || inputs.iter().zip(rows).any(|(i, &r)| r == 0 || r > i.tokens.len()) {
            return Err(Error::InvalidInput("rows must give one count in 1..=tokens per sequence".into()));
        }
        // Run the whole pass on a worker of the current rayon pool, with the pool's other
        // workers as a spinning team for the parallel kernels inside (packed matmuls,
        // attention, SwiGLU: `deco_kernels::team`), instead of handing every call over from an
        // outside thread and blocking it, or waking a sleeping worker per call (~150 calls per
        // token).
        // CPU only: a GPU device keeps its stream per thread, so its forwards stay where they
        // were called.
        crate::host::on_cpu_team(&self.device, || self.forward_inner(inputs, cache, rows, num_layers))
    }

    fn forward_inner(&self, inputs: &[SeqInput<'_>], cache: &mut dyn KvCache, rows: &[usize], num_layers: usize) -> Result<ForwardOutput> {
        let batch = self.prepare(inputs, &*cache)?;
        let mut x = self.embed_tokens(&batch);
        for li in 0..num_layers {
            x = self.layer_forward(li, x, &batch, inputs, cache)?;
        }
        for (inp, span) in inputs.iter().zip(&batch.spans) {
            cache.advance(inp.seq, span.len);
        }
        Ok(self.head(x, &batch, rows))
    }

    /// Number of decoder layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// How the model's linear weights (every layer's fused Q/K/V, O, fused gate/up and down
    /// projections, and the LM head) are held.
    pub fn weight_storage(&self) -> WeightStorage {
        let mut s = WeightStorage::default();
        let layers = self.layers.iter().flat_map(|l| [&l.wqkv, &l.wo, &l.w_gate_up, &l.w_down]);
        for w in layers.chain(std::iter::once(&self.head)) {
            match w {
                LinearWeight::Dense(_) | LinearWeight::Host(_) => s.dense += 1,
                LinearWeight::Packed(_) | LinearWeight::PackedParts(_) => s.host_packed += 1,
                #[cfg(any(feature = "wgpu", feature = "cuda"))]
                LinearWeight::Device(_) => s.device_packed += 1,
            }
        }
        s
    }

    /// The LM head as the forward runs it (out = `vocab`, in = `hidden`; packed GGUF blocks or
    /// dense), a cheap clone (the weights are shared): `head.apply(h)` maps final hidden states
    /// `[rows, hidden]` (after the last RMSNorm) to logits `[rows, vocab]` with the same kernel as
    /// [`Llama::forward`]. Extra heads on the final hidden state (Medusa's shared LM head) use it.
    pub fn lm_head_weight(&self) -> LinearWeight {
        self.head.clone()
    }

    /// The LM head, `[hidden, vocab]` (transposed: `logits = hidden @ lm_head`), f32.
    ///
    /// For a packed (quantized GGUF) head this dequantizes it on first call and keeps the copy
    /// (`4 · hidden · vocab` bytes); the forward pass itself never needs it.
    pub fn lm_head(&self) -> &Tensor<2> {
        self.lm_head_dense.get_or_init(|| {
            // A packed head's shapes were checked when it was loaded: the dense copy cannot
            // be refused.
            self.head.dense_transposed(&self.device).expect("the LM head's own shapes")
        })
    }

    /// Validates a batch and lays out its tokens and positions.
    pub(crate) fn prepare(&self, inputs: &[SeqInput<'_>], cache: &dyn KvCache) -> Result<Batch> {
        let cfg = &self.config;
        if inputs.is_empty() {
            return Err(Error::InvalidInput("empty batch".into()));
        }
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        let mut spans = Vec::with_capacity(inputs.len());
        for inp in inputs {
            if inp.tokens.is_empty() {
                return Err(Error::InvalidInput(format!("sequence {} has no new tokens", inp.seq)));
            }
            let past = cache.seq_len(inp.seq);
            let needed = past + inp.tokens.len();
            if needed > self.max_context() {
                return Err(Error::ContextOverflow { seq: inp.seq, needed, max: self.max_context() });
            }
            let start = ids.len();
            let depths = match inp.tree {
                None => None,
                Some(parents) => Some(tree_depths(inp.seq, parents, inp.tokens.len())?),
            };
            for (i, &t) in inp.tokens.iter().enumerate() {
                if t as usize >= cfg.vocab_size {
                    return Err(Error::TokenOutOfRange { id: t, vocab: cfg.vocab_size });
                }
                ids.push(t as i64);
                positions.push((past + depths.as_ref().map_or(i, |d| d[i])) as i64);
            }
            spans.push(Span { start, len: inp.tokens.len(), past });
        }
        let n = ids.len();
        let dev = &self.device;
        Ok(Batch {
            n,
            host_ids: ids.iter().map(|&t| t as usize).collect(),
            ids: Tensor::from_data(TensorData::new(ids, [n]), dev),
            positions: Tensor::from_data(TensorData::new(positions, [n]), dev),
            spans,
        })
    }

    /// Token embeddings of a batch, `[tokens, hidden]`.
    pub(crate) fn embed_tokens(&self, batch: &Batch) -> Tensor<2> {
        match &self.embed {
            Embedding::Dense(e) => e.clone().select(0, batch.ids.clone()),
            Embedding::Packed(m) => {
                let h = m.cols();
                let mut out = vec![0.0f32; batch.n * h];
                for (o, &id) in out.chunks_exact_mut(h).zip(&batch.host_ids) {
                    // Ids are checked against the vocabulary in `prepare`, and `o` is one row,
                    // so this cannot fail; a failure would leave a zero row.
                    let _ = m.dequantize_rows(id, o);
                }
                Tensor::from_data(TensorData::new(out, [batch.n, h]), &self.device)
            }
        }
    }

    /// The decoder stages ([`Pass`]) over a prepared batch.
    fn pass<'a>(&'a self, batch: &'a Batch) -> Pass<'a> {
        Pass { cfg: &self.config, rope: &self.rope, positions: &batch.positions }
    }

    /// Appends layer `li`'s keys and values for the residual stream `x` (`[tokens, hidden]`) to
    /// `cache` without running its attention or MLP: what a layer skipped by early exit leaves
    /// for later tokens (CALM, Schuster et al. 2022, §4.2: the exit state propagated).
    pub(crate) fn layer_kv_only(
        &self,
        li: usize,
        x: Tensor<2>,
        batch: &Batch,
        inputs: &[SeqInput<'_>],
        cache: &mut dyn KvCache,
    ) -> Result<()> {
        let pass = self.pass(batch);
        let layer = &self.layers[li];
        let xn = pass.norm(layer, Branch::Attention, x);
        let (_, k, v) = pass.qkv(li, layer, xn, &NoHook)?;
        for (inp, sp) in inputs.iter().zip(&batch.spans) {
            cache.append(li, inp.seq, batch.rows(&k, sp), batch.rows(&v, sp))?;
        }
        Ok(())
    }

    /// One decoder layer ([`Pass::layer`]: pre-norm attention and SwiGLU MLP with residuals)
    /// over the batch's residual stream `x`, `[tokens, hidden]`; attention against `cache`, to
    /// which the layer's keys and values are appended.
    pub(crate) fn layer_forward(
        &self,
        li: usize,
        x: Tensor<2>,
        batch: &Batch,
        inputs: &[SeqInput<'_>],
        cache: &mut dyn KvCache,
    ) -> Result<Tensor<2>> {
        let mut attend = CacheAttention { model: self, batch, inputs, cache };
        self.pass(batch).layer(li, &self.layers[li], x, &mut attend, &NoHook)
    }

    /// Attention of layer `li` on a GPU device with a device paged cache: the sequences with one
    /// new token write their keys and values into their blocks ([`KvCache::append_device`]) and
    /// are attended by one CubeCL paged decode attention call over the device blocks
    /// (`deco_kernels::cube::paged_decode_attention`); the others (prefill chunks, speculative
    /// verification) take the FlashAttention path on their gathered keys and values.
    /// `[tokens, heads * head_dim]` in batch order; nothing leaves the device.
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    #[allow(clippy::too_many_arguments)]
    fn attention_device_paged(
        &self,
        li: usize,
        q: Tensor<3>,
        k: Tensor<3>,
        v: Tensor<3>,
        batch: &Batch,
        inputs: &[SeqInput<'_>],
        cache: &mut dyn KvCache,
    ) -> Result<Tensor<2>> {
        let cfg = &self.config;
        let (heads, hd) = (cfg.num_attention_heads, cfg.head_dim);
        let qrow = heads * hd;
        let decode: Vec<usize> = (0..batch.spans.len()).filter(|&i| batch.spans[i].len == 1).collect();
        let prefill_out = multi_token_attention(li, &q, &k, &v, batch, inputs, cache, &|i| batch.spans[i].len != 1)?;
        for &i in &decode {
            let sp = &batch.spans[i];
            cache.append_device(li, inputs[i].seq, batch.rows(&k, sp), batch.rows(&v, sp))?;
        }
        let cache = &*cache;
        let views = decode
            .iter()
            .map(|&i| {
                let (seq, len) = (inputs[i].seq, batch.spans[i].past + 1);
                cache
                    .device_view(li, seq, len)
                    .ok_or_else(|| Error::InvalidInput(format!("KV cache has no device view of sequence {seq} at layer {li}")))
            })
            .collect::<Result<Vec<_>>>()?;
        let Some(first) = views.first() else {
            return Err(Error::InvalidInput("device paged attention without decode sequences".into()));
        };
        let (kc, vc) = (first.k.clone(), first.v.clone());
        let seqs: Vec<deco_kernels::cube::PagedSeq<'_>> =
            views.iter().map(|w| deco_kernels::cube::PagedSeq { block_table: w.block_table, len: w.len }).collect();
        let qd = if decode.len() == batch.spans.len() {
            q
        } else {
            let idx: Vec<i64> = decode.iter().map(|&i| batch.spans[i].start as i64).collect();
            let m = idx.len();
            q.select(0, Tensor::<1, Int>::from_data(TensorData::new(idx, [m]), &self.device))
        };
        let out = deco_kernels::cube::paged_decode_attention(qd, kc, vc, &seqs)
            .map_err(|e| Error::InvalidInput(format!("paged decode attention: {e}")))?
            .reshape([decode.len(), qrow]);
        Ok(interleave(prefill_out, &batch.spans, Some(out)))
    }

    /// Attention of layer `li` with the fused CPU kernel for every sequence of the batch;
    /// `[tokens, heads * head_dim]` in batch order.
    ///
    /// The sequences' new keys and values go to the cache with [`KvCache::append_host`] (the
    /// same positions [`KvCache::append`] would write), then one [`paged_decode_attention`] call
    /// reads the caches in place, with one query row per new token: new token `j` of a sequence
    /// with `past` cached positions attends to the first `past + j + 1` (causal attention as a
    /// batch of decode queries of growing length). A prefill token therefore gets the same bits
    /// as the same token decoded alone.
    ///
    /// A token tree ([`SeqInput::tree`]) goes through the same kernel: node `i` at depth `d`
    /// reads a view of `past + d + 1` rows, the cache's first `past` positions then the rows of
    /// its path from the root down to itself, given to the kernel as a table of physical rows
    /// (blocks of one position). The rows are those causal decoding of the path would read, in
    /// the same order, so a node gets the same bits as its path's last token decoded alone
    /// (Medusa's tree verification at T = 0 is then exactly greedy decoding).
    #[allow(clippy::too_many_arguments)]
    fn attention_fused(
        &self,
        li: usize,
        q: Tensor<3>,
        k: Tensor<3>,
        v: Tensor<3>,
        batch: &Batch,
        inputs: &[SeqInput<'_>],
        cache: &mut dyn KvCache,
    ) -> Result<Tensor<2>> {
        let cfg = &self.config;
        let (heads, kvh, hd) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
        let (qrow, kvrow) = (heads * hd, kvh * hd);
        let (qh, kh, vh) = (to_host(q)?, to_host(k)?, to_host(v)?);
        for (inp, sp) in inputs.iter().zip(&batch.spans) {
            let rows = sp.start * kvrow..(sp.start + sp.len) * kvrow;
            cache.append_host(li, inp.seq, &kh[rows.clone()], &vh[rows], kvh, hd)?;
        }
        let cache = &*cache;
        let view = |seq: SeqId, len: usize| {
            cache.host_view(li, seq, len).ok_or_else(|| Error::InvalidInput(format!("KV cache has no host view of sequence {seq} at layer {li}")))
        };
        // Per tree node: its sequence's whole view and its row table, built before the views
        // that borrow the tables.
        let mut tables: Vec<(HostKv<'_>, Vec<u32>)> = Vec::new();
        for (inp, sp) in inputs.iter().zip(&batch.spans) {
            if is_tree(inp, sp) {
                let parents = inp.tree.unwrap_or_default();
                let full = view(inp.seq, sp.past + sp.len)?;
                let phys = |p: usize| -> Result<u32> {
                    u32::try_from(full.physical_row(p))
                        .map_err(|_| Error::InvalidInput(format!("sequence {}: KV row {p} beyond u32 rows", inp.seq)))
                };
                let prefix = (0..sp.past).map(phys).collect::<Result<Vec<u32>>>()?;
                for i in 0..sp.len {
                    let (mut path, mut n) = (vec![i], i);
                    while let Some(p) = parents[n] {
                        path.push(p);
                        n = p;
                    }
                    let mut rows = prefix.clone();
                    for &n in path.iter().rev() {
                        rows.push(phys(sp.past + n)?);
                    }
                    tables.push((full, rows));
                }
            }
        }
        let mut views = Vec::with_capacity(batch.n);
        let mut t = 0;
        for (inp, sp) in inputs.iter().zip(&batch.spans) {
            let tree = is_tree(inp, sp);
            for j in 0..sp.len {
                if tree {
                    let (full, rows) = &tables[t];
                    t += 1;
                    let len = rows.len();
                    views.push(match *full {
                        HostKv::F32(s) => HostKv::F32(SeqKv { block_table: rows, block_size: 1, len, ..s }),
                        HostKv::F16(s) => HostKv::F16(SeqKv { block_table: rows, block_size: 1, len, ..s }),
                    });
                } else {
                    views.push(view(inp.seq, sp.past + j + 1)?);
                }
            }
        }
        let mut out = vec![0.0f32; views.len() * qrow];
        let shape = AttnShape { n_heads: heads, kv_heads: kvh, head_dim: hd };
        // One cache, one element type: the views are all f32 or all f16.
        let f32_views: Vec<_> = views.iter().filter_map(|v| if let HostKv::F32(s) = v { Some(*s) } else { None }).collect();
        let done = if f32_views.len() == views.len() {
            paged_decode_attention(&qh, shape, &f32_views, &mut out)
        } else {
            let f16_views: Vec<_> = views.iter().filter_map(|v| if let HostKv::F16(s) = v { Some(*s) } else { None }).collect();
            if f16_views.len() != views.len() {
                return Err(Error::InvalidInput("fused attention: the KV cache returned views of two element types".into()));
            }
            paged_decode_attention(&qh, shape, &f16_views, &mut out)
        };
        done.map_err(|e| Error::InvalidInput(format!("fused attention: {e}")))?;
        Ok(Tensor::from_data(TensorData::new(out, [views.len(), qrow]), &self.device))
    }

    /// Final RMSNorm and LM head over the last `rows[i]` positions of each sequence of the
    /// residual stream `x`.
    pub(crate) fn head(&self, x: Tensor<2>, batch: &Batch, rows: &[usize]) -> ForwardOutput {
        let mut ranges = Vec::with_capacity(rows.len());
        let mut idx: Vec<i64> = Vec::new();
        for (s, &r) in batch.spans.iter().zip(rows) {
            ranges.push(idx.len()..idx.len() + r);
            idx.extend((s.start + s.len - r..s.start + s.len).map(|i| i as i64));
        }
        let x = if idx.len() == batch.n {
            x
        } else {
            let m = idx.len();
            let idx: Tensor<1, Int> = Tensor::from_data(TensorData::new(idx, [m]), &self.device);
            x.select(0, idx)
        };
        let hidden = rms_norm(x, &self.norm, self.config.rms_norm_eps);
        // A packed head can only fail on a host read of `hidden`; fall back to the dense copy.
        let logits = match self.head.apply(hidden.clone()) {
            Ok(l) => l,
            Err(_) => hidden.clone().matmul(self.lm_head().clone()),
        };
        ForwardOutput { logits, hidden, rows: ranges }
    }
}

/// Whether sequence input `inp` with span `sp` is a token tree of more than one node (tree
/// attention, [`SeqInput::tree`]).
fn is_tree(inp: &SeqInput<'_>, sp: &Span) -> bool {
    sp.len > 1 && inp.tree.is_some_and(|t| t.len() > 1)
}

/// Attention of the batch's sequences `i` with `take(i)` through the burn path: their keys and
/// values appended with [`KvCache::append`], then causal (or tree) attention over the gathered
/// cache. `Some([len, heads · head_dim])` per such sequence, `None` for the others.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
#[allow(clippy::too_many_arguments)]
fn multi_token_attention(
    li: usize,
    q: &Tensor<3>,
    k: &Tensor<3>,
    v: &Tensor<3>,
    batch: &Batch,
    inputs: &[SeqInput<'_>],
    cache: &mut dyn KvCache,
    take: &dyn Fn(usize) -> bool,
) -> Result<Vec<Option<Tensor<2>>>> {
    let mut out = vec![None; batch.spans.len()];
    for (i, (inp, sp)) in inputs.iter().zip(&batch.spans).enumerate() {
        if take(i) {
            let (kall, vall) = cache.append(li, inp.seq, batch.rows(k, sp), batch.rows(v, sp))?;
            out[i] = Some(span_attention(batch.rows(q, sp), kall, vall, sp.past, inp.tree));
        }
    }
    Ok(out)
}

/// Attention of one sequence's new rows over its gathered cache: causal, or tree attention for a
/// token tree ([`SeqInput::tree`]; the burn composition on every device, trees are small).
fn span_attention(q: Tensor<3>, k: Tensor<3>, v: Tensor<3>, past: usize, tree: Option<&[Option<usize>]>) -> Tensor<2> {
    match tree {
        Some(parents) if parents.len() > 1 => deco_kernels::ops::tree_gqa_attention(q, k, v, past, parents),
        _ => causal_gqa_attention(q, k, v, past),
    }
}

/// Depth of every node of a token tree ([`SeqInput::tree`]), checking that it has one parent
/// entry per token and that each parent precedes its child.
fn tree_depths(seq: SeqId, parents: &[Option<usize>], tokens: usize) -> Result<Vec<usize>> {
    if parents.len() != tokens {
        return Err(Error::InvalidInput(format!("sequence {seq}: a token tree of {} parents for {tokens} tokens", parents.len())));
    }
    let mut depth = Vec::with_capacity(tokens);
    for (i, p) in parents.iter().enumerate() {
        depth.push(match *p {
            None => 0,
            Some(p) if p < i => depth[p] + 1,
            Some(p) => return Err(Error::InvalidInput(format!("sequence {seq}: tree node {i} has parent {p}, which does not precede it"))),
        });
    }
    Ok(depth)
}

/// The attention outputs of a batch in batch order: each sequence's rows from `parts` (`Some`)
/// or, in order, its `span.len` next rows of `fused` (`[rows of the None sequences, width]`).
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn interleave(parts: Vec<Option<Tensor<2>>>, spans: &[Span], fused: Option<Tensor<2>>) -> Tensor<2> {
    if let Some(f) = &fused
        && parts.iter().all(Option::is_none)
    {
        return f.clone();
    }
    let mut out = Vec::with_capacity(parts.len());
    let mut d = 0;
    for (p, sp) in parts.into_iter().zip(spans) {
        match (p, &fused) {
            (Some(t), _) => out.push(t),
            (None, Some(f)) => {
                let width = f.dims()[1];
                out.push(f.clone().slice([d..d + sp.len, 0..width]));
                d += sp.len;
            }
            (None, None) => {}
        }
    }
    if out.len() == 1 { out.remove(0) } else { Tensor::cat(out, 0) }
}

/// Attention of a batch against a [`KvCache`]: each sequence's new keys and values are appended
/// to its cache and its queries attend over everything cached (causal from its past length, or
/// along its path for a token tree); with the fused decode attention on and a cache with host
/// storage, every sequence goes through [`Llama::attention_fused`].
struct CacheAttention<'a, 'b> {
    model: &'a Llama,
    batch: &'a Batch,
    inputs: &'a [SeqInput<'b>],
    cache: &'a mut dyn KvCache,
}

impl Attend for CacheAttention<'_, '_> {
    fn attend(&mut self, li: usize, q: Tensor<3>, k: Tensor<3>, v: Tensor<3>) -> Result<Tensor<2>> {
        let (batch, inputs) = (self.batch, self.inputs);
        let cache = &mut *self.cache;
        if self.model.fused_decode && cache.supports_host_kv() {
            return self.model.attention_fused(li, q, k, v, batch, inputs, cache);
        }
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        if cache.supports_device_paged() && gpu_kernels(&self.model.device) && batch.spans.iter().any(|sp| sp.len == 1) {
            return self.model.attention_device_paged(li, q, k, v, batch, inputs, cache);
        }
        let mut outs = Vec::with_capacity(batch.spans.len());
        for (inp, sp) in inputs.iter().zip(&batch.spans) {
            let (kall, vall) = cache.append(li, inp.seq, batch.rows(&k, sp), batch.rows(&v, sp))?;
            outs.push(span_attention(batch.rows(&q, sp), kall, vall, sp.past, inp.tree));
        }
        Ok(if outs.len() == 1 { outs.remove(0) } else { Tensor::cat(outs, 0) })
    }
}

/// One sequence's place in a prepared batch.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Span {
    /// First row of the sequence in the batch's token matrix.
    pub start: usize,
    /// Number of new tokens.
    pub len: usize,
    /// Tokens already cached before this forward.
    pub past: usize,
}

/// A validated batch: token ids and absolute positions of all new tokens, `[tokens]` each.
#[derive(Debug, Clone)]
pub(crate) struct Batch {
    pub n: usize,
    /// The token ids on the host (for packed embedding lookups).
    pub host_ids: Vec<usize>,
    pub ids: Tensor<1, Int>,
    pub positions: Tensor<1, Int>,
    pub spans: Vec<Span>,
}

impl Batch {
    /// The rows of one sequence of a `[tokens, heads, head_dim]` tensor (the whole tensor, without
    /// a copy, when the batch holds a single sequence).
    pub(crate) fn rows(&self, t: &Tensor<3>, sp: &Span) -> Tensor<3> {
        if self.spans.len() == 1 {
            return t.clone();
        }
        let [_, heads, hd] = t.dims();
        t.clone().slice([sp.start..sp.start + sp.len, 0..heads, 0..hd])
    }
}
