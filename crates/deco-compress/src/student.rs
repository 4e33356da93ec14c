//! A trainable Llama / Qwen2 decoder: the *student* of distillation and recovery fine-tuning.
//!
//! [`StudentModel`] is a burn `#[derive(Module)]` whose weights are [`Param`]s, so it trains on
//! an autodiff device (`Device::flex().autodiff()`) with burn-optim. Its forward is the same math
//! as `deco_model::Llama::forward` because it is the same code: each layer runs the one decoder
//! layer, `deco_model::decoder::Pass::layer`, with [`StudentLayer`] as its weights
//! ([`LayerParams`]), `WindowAttention` (full sequences from position 0, no KV cache: training,
//! scoring) and, in [`StudentModel::forward_masked`], a hook that multiplies the structural masks
//! in. On an autodiff device the decoder uses the burn compositions of `deco_kernels::ops`, so
//! autodiff runs through them. Embedding, final RMSNorm and LM head (tied or not) are here.
//!
//! Weights are stored transposed, `[in, out]` (`y = x @ w`), Q/K/V and gate/up fused along the
//! output dimension as in `deco_model::Llama`. [`StudentModel::from_source`] loads any f32 tensor
//! source in transformers names and layout (e.g. `Checkpoint::tensor`);
//! [`StudentModel::to_hf_tensors`] gives them back for export.

use std::collections::HashMap;

use burn::module::{Module, Param};
use burn::tensor::{Device, Int, Tensor, TensorData};
use deco_formats::checkpoint::{hf_expected_shape, hf_tensor_names};
use deco_formats::config::ModelConfig;
use deco_kernels::ops::RopeTable;
use deco_model::calibrate::Site;
use deco_model::decoder::{Branch, LayerHook, LayerParams, NoHook, Pass, Proj, WindowAttention, config_inv_freq, rms_norm};
use deco_model::host::{fuse_transposed, to_host, transpose};

use crate::pipeline::TensorFn;
use crate::{Error, Result, invalid};

/// Tensors by transformers name: `name -> (row-major shape, f32 values)`.
pub type HfTensors = HashMap<String, (Vec<usize>, Vec<f32>)>;

/// One decoder layer's trainable weights (transposed, `[in, out]`).
#[derive(Module, Debug)]
pub struct StudentLayer {
    /// `[hidden]`: `input_layernorm.weight`.
    pub attn_norm: Param<Tensor<1>>,
    /// `[hidden, q + 2·kv]`: q_proj, k_proj, v_proj fused (transposed).
    pub wqkv: Param<Tensor<2>>,
    /// `[q + 2·kv]`: Q/K/V biases (Qwen2).
    pub bqkv: Option<Param<Tensor<1>>>,
    /// `[q, hidden]`: o_proj (transposed).
    pub wo: Param<Tensor<2>>,
    /// `[hidden]`: `post_attention_layernorm.weight`.
    pub ffn_norm: Param<Tensor<1>>,
    /// `[hidden, 2·intermediate]`: gate_proj and up_proj fused (transposed).
    pub w_gate_up: Param<Tensor<2>>,
    /// `[intermediate, hidden]`: down_proj (transposed).
    pub w_down: Param<Tensor<2>>,
}

/// A trainable Llama-family causal LM (see the module docs).
#[derive(Module, Debug)]
pub struct StudentModel {
    /// `[vocab, hidden]`: token embedding (also the LM head when tied).
    pub embed: Param<Tensor<2>>,
    /// Decoder layers.
    pub layers: Vec<StudentLayer>,
    /// `[hidden]`: final RMSNorm.
    pub norm: Param<Tensor<1>>,
    /// `[hidden, vocab]`: untied LM head (transposed); `None` when tied to [`Self::embed`].
    pub lm_head: Option<Param<Tensor<2>>>,
}

/// Structural masks of [`StudentModel::forward_masked`] (values in `[0, 1]`, typically the
/// hard-concrete samples of [`crate::sheared`]).
#[derive(Debug, Clone)]
pub struct Masks {
    /// `[layers]`.
    pub layers: Tensor<1>,
    /// `[layers, num_attention_heads]`.
    pub heads: Tensor<2>,
    /// `[layers, intermediate_size]`.
    pub intermediate: Tensor<2>,
    /// `[hidden_size]`.
    pub hidden: Tensor<1>,
}

impl LayerParams for StudentLayer {
    fn norm(&self, branch: Branch) -> Tensor<1> {
        match branch {
            Branch::Attention => self.attn_norm.val(),
            Branch::Mlp => self.ffn_norm.val(),
        }
    }

    fn qkv_bias(&self) -> Option<Tensor<1>> {
        self.bqkv.as_ref().map(Param::val)
    }

    fn project(&self, proj: Proj, x: Tensor<2>) -> deco_model::Result<Tensor<2>> {
        let w = match proj {
            Proj::Qkv => &self.wqkv,
            Proj::O => &self.wo,
            Proj::GateUp => &self.w_gate_up,
            Proj::Down => &self.w_down,
        };
        Ok(x.matmul(w.val()))
    }
}

/// The structural masks of [`StudentModel::forward_masked`] as a decoder hook: heads on the
/// attention output (o_proj's input), neurons on the SwiGLU output (down_proj's input), layer ×
/// hidden on both residual branches.
struct MaskHook<'a> {
    masks: &'a Masks,
    heads: usize,
    head_dim: usize,
    inter: usize,
}

impl LayerHook for MaskHook<'_> {
    fn input(&self, li: usize, site: Site, x: Tensor<2>) -> Tensor<2> {
        let m = self.masks;
        match site {
            Site::AttnOut => {
                let [n, qd] = x.dims();
                let hz = m.heads.clone().slice([li..li + 1, 0..self.heads]).reshape([1, self.heads, 1]);
                x.reshape([n, self.heads, self.head_dim]).mul(hz).reshape([n, qd])
            }
            Site::DownIn => x.mul(m.intermediate.clone().slice([li..li + 1, 0..self.inter])),
            Site::AttnIn | Site::MlpIn => x,
        }
    }

    fn branch(&self, li: usize, _branch: Branch, y: Tensor<2>) -> Tensor<2> {
        let lz = self.masks.layers.clone().slice(li..li + 1).unsqueeze_dim::<2>(0);
        y.mul(lz).mul(self.masks.hidden.clone().unsqueeze_dim::<2>(0))
    }
}

impl StudentModel {
    /// Loads the weights of a model with configuration `cfg` from `tensor` (transformers names,
    /// `[out, in]` row-major f32, e.g. `|n| Ok(ckpt.tensor(n)?)`) onto `device` (use an autodiff
    /// device to train).
    ///
    /// # Errors
    /// [`Error::Shape`] for a tensor whose shape differs from what `cfg` implies; the source's
    /// errors for missing tensors.
    pub fn from_source(cfg: &ModelConfig, tensor: &TensorFn<'_>, device: &Device) -> Result<Self> {
        let fetch = |name: &str| -> Result<(Vec<usize>, Vec<f32>)> {
            let (shape, data) = tensor(name)?;
            let want = hf_expected_shape(cfg, name).ok_or_else(|| Error::Shape(format!("unknown tensor `{name}`")))?;
            if shape != want || data.len() != want.iter().product::<usize>() {
                return Err(Error::Shape(format!("`{name}` has shape {shape:?}, expected {want:?}")));
            }
            Ok((shape, data))
        };
        let p1 = |name: &str| -> Result<Param<Tensor<1>>> {
            let (_, d) = fetch(name)?;
            let n = d.len();
            Ok(Param::from_tensor(Tensor::from_data(TensorData::new(d, [n]), device)))
        };
        // `[out_i, in]` weights transposed and concatenated along the output: `[in, Σ out_i]`.
        let fused = |names: &[String]| -> Result<Param<Tensor<2>>> {
            let parts = names.iter().map(|n| fetch(n)).collect::<Result<Vec<_>>>()?;
            let inner = parts.first().map_or(0, |(s, _)| s[1]);
            let refs: Vec<(&[f32], usize)> = parts.iter().map(|(s, d)| (d.as_slice(), s[0])).collect();
            let total: usize = refs.iter().map(|r| r.1).sum();
            Ok(Param::from_tensor(Tensor::from_data(TensorData::new(fuse_transposed(&refs, inner), [inner, total]), device)))
        };
        let (_, e) = fetch("model.embed_tokens.weight")?;
        let embed = Param::from_tensor(Tensor::from_data(TensorData::new(e, [cfg.vocab_size, cfg.hidden_size]), device));
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let bqkv = if cfg.attention_bias {
                let mut b = fetch(&format!("{p}.self_attn.q_proj.bias"))?.1;
                b.extend(fetch(&format!("{p}.self_attn.k_proj.bias"))?.1);
                b.extend(fetch(&format!("{p}.self_attn.v_proj.bias"))?.1);
                let n = b.len();
                Some(Param::from_tensor(Tensor::from_data(TensorData::new(b, [n]), device)))
            } else {
                None
            };
            layers.push(StudentLayer {
                attn_norm: p1(&format!("{p}.input_layernorm.weight"))?,
                wqkv: fused(&[format!("{p}.self_attn.q_proj.weight"), format!("{p}.self_attn.k_proj.weight"), format!("{p}.self_attn.v_proj.weight")])?,
                bqkv,
                wo: fused(&[format!("{p}.self_attn.o_proj.weight")])?,
                ffn_norm: p1(&format!("{p}.post_attention_layernorm.weight"))?,
                w_gate_up: fused(&[format!("{p}.mlp.gate_proj.weight"), format!("{p}.mlp.up_proj.weight")])?,
                w_down: fused(&[format!("{p}.mlp.down_proj.weight")])?,
            });
        }
        let lm_head = if cfg.tie_word_embeddings { None } else { Some(fused(&["lm_head.weight".to_string()])?) };
        Ok(Self { embed, layers, norm: p1("model.norm.weight")?, lm_head })
    }

    /// Logits of every position of `batch` sequences of equal length (full causal forward from
    /// position 0, no cache).
    ///
    /// `freeze_embeddings` detaches the embedding / tied LM head (no gradient reaches it; saves
    /// the `[hidden, vocab]` weight-gradient product per step).
    ///
    /// # Shapes
    /// - `ids`: `batch` sequences of `seq` tokens each
    /// - output: `[batch · seq, vocab]`, sequences concatenated in input order
    ///
    /// # Errors
    /// [`Error::InvalidParameter`] for an empty batch, sequences of different lengths, a token
    /// outside the vocabulary, or a layer count that differs from `cfg`.
    pub fn forward(&self, cfg: &ModelConfig, ids: &[Vec<u32>], freeze_embeddings: bool) -> Result<Tensor<2>> {
        self.forward_masked(cfg, ids, freeze_embeddings, None)
    }

    /// [`StudentModel::forward`] with structural masks multiplied in (Sheared-LLaMA, Xia et al.
    /// 2024, §2.1; CoFi, Xia et al. 2022, §3): `masks.hidden` on the embedding output and on every
    /// attention / MLP output before the residual add, `masks.heads[l]` on each head's attention
    /// output (before o_proj), `masks.intermediate[l]` on the SwiGLU output (before down_proj),
    /// `masks.layers[l]` on the layer's two residual updates. All-ones masks give
    /// [`StudentModel::forward`].
    ///
    /// # Shapes
    /// As [`StudentModel::forward`]; masks: `layers [L]`, `heads [L, heads]`,
    /// `intermediate [L, intermediate]`, `hidden [hidden]`.
    ///
    /// # Errors
    /// As [`StudentModel::forward`]; [`Error::Shape`] for masks of the wrong size.
    pub fn forward_masked(&self, cfg: &ModelConfig, ids: &[Vec<u32>], freeze_embeddings: bool, masks: Option<&Masks>) -> Result<Tensor<2>> {
        if let Some(m) = masks {
            let l = cfg.num_hidden_layers;
            if m.layers.dims() != [l] || m.heads.dims() != [l, cfg.num_attention_heads] || m.intermediate.dims() != [l, cfg.intermediate_size] || m.hidden.dims() != [cfg.hidden_size] {
                return Err(Error::Shape("masks do not match the model configuration".into()));
            }
        }
        let mask_hook = masks.map(|m| MaskHook { masks: m, heads: cfg.num_attention_heads, head_dim: cfg.head_dim, inter: cfg.intermediate_size });
        let hook: &dyn LayerHook = match &mask_hook {
            Some(h) => h,
            None => &NoHook,
        };
        let hidden_mask = masks.map(|m| m.hidden.clone());
        self.forward_layers(cfg, ids, freeze_embeddings, None, hook, hidden_mask)
    }

    /// The forward of [`StudentModel::forward`] with the decoder layers' weights given as views
    /// (`layers[l]` replaces `self.layers[l]`: a sparsity-masked weight, a LoRA-adapted one; the
    /// embedding, final norm and LM head stay this model's) and a [`LayerHook`] on every layer.
    /// `hidden_mask` (`[hidden]`) multiplies the embedding output (Sheared-LLaMA's hidden mask).
    ///
    /// # Shapes
    /// As [`StudentModel::forward`].
    ///
    /// # Errors
    /// As [`StudentModel::forward`]; [`Error::InvalidParameter`] when `layers` has a length other
    /// than the layer count.
    pub fn forward_layers(&self, cfg: &ModelConfig, ids: &[Vec<u32>], freeze_embeddings: bool, layers: Option<&[&dyn LayerParams]>, hook: &dyn LayerHook, hidden_mask: Option<Tensor<1>>) -> Result<Tensor<2>> {
        if let Some(l) = layers
            && l.len() != cfg.num_hidden_layers
        {
            return Err(invalid("layers", format!("{} layer views for {} layers", l.len(), cfg.num_hidden_layers)));
        }
        let seq = ids.first().map(Vec::len).unwrap_or(0);
        if seq == 0 || ids.iter().any(|s| s.len() != seq) {
            return Err(invalid("ids", "need at least one sequence, all of the same non-zero length"));
        }
        if self.layers.len() != cfg.num_hidden_layers {
            return Err(invalid("config", format!("{} layers in the model, {} in the config", self.layers.len(), cfg.num_hidden_layers)));
        }
        if let Some(&t) = ids.iter().flatten().find(|&&t| t as usize >= cfg.vocab_size) {
            return Err(invalid("ids", format!("token {t} outside the vocabulary of {}", cfg.vocab_size)));
        }
        let device = self.embed.val().device();
        let b = ids.len();
        let n = b * seq;
        let flat: Vec<i64> = ids.iter().flatten().map(|&t| t as i64).collect();
        let idx: Tensor<1, Int> = Tensor::from_data(TensorData::new(flat, [n]), &device);
        let pos: Vec<i64> = (0..b).flat_map(|_| 0..seq as i64).collect();
        let pos: Tensor<1, Int> = Tensor::from_data(TensorData::new(pos, [n]), &device);
        let rope = RopeTable::new(&config_inv_freq(cfg), seq, &device);
        let mut embed = self.embed.val();
        if freeze_embeddings {
            embed = embed.detach();
        }
        let mut x = embed.clone().select(0, idx);
        if let Some(m) = hidden_mask {
            x = x.mul(m.unsqueeze_dim::<2>(0));
        }
        let spans: Vec<(usize, usize)> = (0..b).map(|s| (s * seq, seq)).collect();
        let pass = Pass { cfg, rope: &rope, positions: &pos };
        for (li, layer) in self.layers.iter().enumerate() {
            let w: &dyn LayerParams = match layers {
                Some(v) => v[li],
                None => layer,
            };
            x = pass.layer(li, w, x, &mut WindowAttention { spans: &spans }, hook)?;
        }
        let hidden = rms_norm(x, &self.norm.val(), cfg.rms_norm_eps);
        Ok(match &self.lm_head {
            Some(w) => hidden.matmul(w.val()),
            None => hidden.matmul(embed.transpose()),
        })
    }

    /// The weights in transformers names and layout (`[out, in]` row-major f32), read back to the
    /// host: the input of `deco_compress::export::write_dense_dir` and of
    /// `deco_model::Llama::load_from`.
    ///
    /// # Errors
    /// [`Error::Model`] if a device read fails; [`Error::InvalidParameter`] if `cfg` does not
    /// describe this model.
    pub fn to_hf_tensors(&self, cfg: &ModelConfig) -> Result<HfTensors> {
        if self.layers.len() != cfg.num_hidden_layers {
            return Err(invalid("config", "layer count differs from the model"));
        }
        let mut m = HashMap::new();
        let h = cfg.hidden_size;
        // Splits a transposed fused `[in, Σ out_i]` weight into HF `[out_i, in]` tensors.
        let mut split = |w: &Param<Tensor<2>>, names: &[(String, usize)]| -> Result<()> {
            let t = w.val();
            let [inner, total] = t.dims();
            let d = to_host(t)?;
            let back = transpose(&d, inner, total); // [total, inner]
            let mut row = 0;
            for (name, out) in names {
                m.insert(name.clone(), (vec![*out, inner], back[row * inner..(row + out) * inner].to_vec()));
                row += out;
            }
            Ok(())
        };
        let (q, kv, i) = (cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size);
        for (li, l) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{li}");
            split(&l.wqkv, &[(format!("{p}.self_attn.q_proj.weight"), q), (format!("{p}.self_attn.k_proj.weight"), kv), (format!("{p}.self_attn.v_proj.weight"), kv)])?;
            split(&l.wo, &[(format!("{p}.self_attn.o_proj.weight"), h)])?;
            split(&l.w_gate_up, &[(format!("{p}.mlp.gate_proj.weight"), i), (format!("{p}.mlp.up_proj.weight"), i)])?;
            split(&l.w_down, &[(format!("{p}.mlp.down_proj.weight"), h)])?;
        }
        if let Some(w) = &self.lm_head {
            split(w, &[("lm_head.weight".to_string(), cfg.vocab_size)])?;
        }
        for (li, l) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{li}");
            m.insert(format!("{p}.input_layernorm.weight"), (vec![h], to_host(l.attn_norm.val())?));
            m.insert(format!("{p}.post_attention_layernorm.weight"), (vec![h], to_host(l.ffn_norm.val())?));
            if let Some(b) = &l.bqkv {
                let v = to_host(b.val())?;
                m.insert(format!("{p}.self_attn.q_proj.bias"), (vec![q], v[..q].to_vec()));
                m.insert(format!("{p}.self_attn.k_proj.bias"), (vec![kv], v[q..q + kv].to_vec()));
                m.insert(format!("{p}.self_attn.v_proj.bias"), (vec![kv], v[q + kv..].to_vec()));
            }
        }
        m.insert("model.norm.weight".into(), (vec![h], to_host(self.norm.val())?));
        m.insert("model.embed_tokens.weight".into(), (vec![cfg.vocab_size, h], to_host(self.embed.val())?));
        debug_assert!(hf_tensor_names(cfg).iter().all(|n| m.contains_key(n)));
        Ok(m)
    }
}

/// Number of scalar parameters of a model with this configuration (embedding, decoder, norms,
/// untied head; biases included).
pub fn num_params(cfg: &ModelConfig) -> usize {
    hf_tensor_names(cfg).iter().filter_map(|n| hf_expected_shape(cfg, n)).map(|s| s.iter().product::<usize>()).sum()
}
