//! Structured pruning: attention heads, MLP neurons (intermediate channels) and whole decoder
//! layers, chosen by importance scores on calibration data. The result is a smaller *dense*
//! model with a valid configuration.
//!
//! Importance (one pass of the dense model over the calibration windows, [`importance`]):
//!
//! | unit | score | reference |
//! |---|---|---|
//! | query head `h` of a layer | `‖A_h‖_F · ‖W_o[:, h]‖_F`: norm of the head's attention output over all calibration tokens times the norm of the o_proj columns it feeds | activation-norm × weight-norm (the Wanda score summed over a structure, as in Wanda §5 / FLAP) |
//! | KV group `g` | sum of its query heads' scores | |
//! | neuron `j` | `‖X_j‖₂ · ‖W_down[:, j]‖₂`, `X` the down_proj input (SwiGLU output) | same |
//! | layer | block influence `1 - mean_t cos(x_t, y_t)` of the layer's input and output hidden states | ShortGPT (Men et al. 2024) |
//!
//! **Heads under GQA.** A query head shares its key/value head with the other heads of its
//! group, so heads are removed in one of two ways ([`HeadMode`]):
//! - [`HeadMode::QueryPerGroup`] (default): every KV group loses the same number of its
//!   lowest-scoring query heads; all KV heads stay. `num_attention_heads` shrinks, the group size
//!   stays uniform (as transformers' `repeat_kv` needs), K/V projections are untouched.
//! - [`HeadMode::KvGroups`]: whole KV groups are removed (the KV head and all its query heads);
//!   `num_key_value_heads` and `num_attention_heads` shrink together.
//!
//! The config has one head count and one intermediate size for all layers, so every layer keeps
//! the same *number* of heads / neurons; *which* ones is chosen per layer.
//!
//! [`StructuredPlan::masked_tensor`] gives the original-size model with the removed units
//! zeroed instead (o_proj columns of removed heads, down_proj columns of removed neurons, o_proj
//! and down_proj of removed layers, which makes the layer the identity): it computes the same
//! function as the smaller model and is the independent check of the slicing.

use burn::tensor::{Device, Tensor};
use deco_formats::config::ModelConfig;
use deco_model::calibrate::{Calibrator, LayerWeights, Linear};
use deco_model::host::to_host;

use crate::mask::pruned_count;
use crate::pipeline::{TensorFn, column_sum_sq};
use crate::{Error, Result, invalid};

/// How attention heads are removed under grouped-query attention (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HeadMode {
    /// The same number of query heads removed from every KV group.
    #[default]
    QueryPerGroup,
    /// Whole KV groups removed (KV head and its query heads).
    KvGroups,
}

/// What to remove, as fractions of each unit.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StructuredSpec {
    /// Fraction of query heads per group ([`HeadMode::QueryPerGroup`]) or of KV groups
    /// ([`HeadMode::KvGroups`]) removed from every layer, rounded to a count (at least one kept).
    pub heads: f64,
    /// How heads are removed.
    pub head_mode: HeadMode,
    /// Fraction of MLP intermediate channels removed from every layer.
    pub neurons: f64,
    /// Fraction of decoder layers removed.
    pub layers: f64,
}

impl StructuredSpec {
    /// Checks every fraction is in `[0, 1)`.
    ///
    /// # Errors
    /// [`Error::InvalidParameter`].
    pub fn validate(&self) -> Result<()> {
        for (name, v) in [("heads", self.heads), ("neurons", self.neurons), ("layers", self.layers)] {
            if !(0.0..1.0).contains(&v) {
                return Err(invalid("sparsity", format!("{name} fraction {v} must be in [0, 1)")));
            }
        }
        Ok(())
    }
}

/// Importance scores of every unit (higher = more important), from [`importance`].
#[derive(Debug, Clone, PartialEq)]
pub struct Importance {
    /// `[layers][num_attention_heads]`.
    pub heads: Vec<Vec<f64>>,
    /// `[layers][intermediate_size]`.
    pub neurons: Vec<Vec<f64>>,
    /// `[layers]`: block influence.
    pub layers: Vec<f64>,
}

fn frob_cols(w: &[f32], rows: usize, cols: usize, c0: usize, c1: usize) -> f64 {
    (0..rows).map(|r| w[r * cols + c0..r * cols + c1].iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>()).sum::<f64>().sqrt()
}

/// Computes the importance of heads, neurons and layers over the calibration windows with the
/// dense model. `progress(layer)` is called after each layer.
///
/// # Errors
/// No windows, windows longer than the context, missing tensors.
pub fn importance(cfg: &ModelConfig, tensor: &TensorFn<'_>, device: &Device, windows: &[Vec<u32>], progress: &mut dyn FnMut(usize)) -> Result<Importance> {
    if windows.is_empty() {
        return Err(Error::Calibration("structured pruning needs calibration windows".into()));
    }
    let lens: Vec<usize> = windows.iter().map(Vec::len).collect();
    let c = Calibrator::new(cfg, device, &lens)?;
    let (_, embed) = tensor("model.embed_tokens.weight")?;
    let mut x = c.embed(&embed, windows)?;
    let (h, q, hd, inter) = (cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.head_dim, cfg.intermediate_size);
    let mut imp = Importance { heads: Vec::new(), neurons: Vec::new(), layers: Vec::new() };
    for li in 0..cfg.num_hidden_layers {
        let lw = LayerWeights::fetch(cfg, li, tensor)?;
        let dl = c.upload(&lw);
        let (inputs, y) = c.layer_capture(&dl, x.clone())?;
        let a_sq = column_sum_sq(&inputs[1])?;
        let wo = lw.linear(Linear::O);
        imp.heads.push(
            (0..cfg.num_attention_heads)
                .map(|hh| {
                    let act = a_sq[hh * hd..(hh + 1) * hd].iter().map(|&v| v as f64).sum::<f64>().sqrt();
                    act * frob_cols(wo, h, q, hh * hd, (hh + 1) * hd)
                })
                .collect(),
        );
        let d_sq = column_sum_sq(&inputs[3])?;
        let wd = lw.linear(Linear::Down);
        imp.neurons.push((0..inter).map(|j| (d_sq[j] as f64).sqrt() * frob_cols(wd, h, inter, j, j + 1)).collect());
        // Block influence: 1 - mean cosine similarity of input and output rows.
        let dot = x.clone().mul(y.clone()).sum_dim(1);
        let nx = x.clone().powi_scalar(2).sum_dim(1).sqrt();
        let ny = y.clone().powi_scalar(2).sum_dim(1).sqrt();
        let cos: Tensor<2> = dot.div(nx.mul(ny).clamp_min(1e-12));
        let cos = to_host(cos)?;
        let mean = cos.iter().map(|&v| v as f64).sum::<f64>() / cos.len().max(1) as f64;
        imp.layers.push(1.0 - mean);
        x = y;
        progress(li);
    }
    Ok(imp)
}

/// Indices of the `keep` highest scores, ascending (ties: lower index kept).
fn top_sorted(scores: &[f64], keep: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    idx.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    let mut k: Vec<usize> = idx[..keep.min(scores.len())].to_vec();
    k.sort_unstable();
    k
}

/// Which units survive: indices into the *original* model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StructuredPlan {
    /// Kept decoder layers, ascending; new layer `j` is original layer `layers[j]`.
    pub layers: Vec<usize>,
    /// Kept query heads of every original layer, ascending, grouped by KV head.
    pub heads: Vec<Vec<usize>>,
    /// Kept KV heads of every original layer, ascending.
    pub kv_heads: Vec<Vec<usize>>,
    /// Kept intermediate channels of every original layer, ascending.
    pub neurons: Vec<Vec<usize>>,
}

/// Parameters of the decoder layers (linear weights, biases and norms), embedding and head
/// excluded.
pub fn decoder_params(cfg: &ModelConfig) -> usize {
    let per: usize = Linear::ALL.iter().map(|l| {
        let (o, i) = l.dims(cfg);
        o * i
    }).sum::<usize>()
        + 2 * cfg.hidden_size
        + if cfg.attention_bias { (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim } else { 0 };
    per * cfg.num_hidden_layers
}

/// All parameters: decoder layers, embedding, final norm and (untied) LM head.
pub fn total_params(cfg: &ModelConfig) -> usize {
    let e = cfg.vocab_size * cfg.hidden_size;
    decoder_params(cfg) + e + cfg.hidden_size + if cfg.tie_word_embeddings { 0 } else { e }
}

impl StructuredPlan {
    /// Keeps everything.
    pub fn identity(cfg: &ModelConfig) -> Self {
        let l = cfg.num_hidden_layers;
        Self {
            layers: (0..l).collect(),
            heads: vec![(0..cfg.num_attention_heads).collect(); l],
            kv_heads: vec![(0..cfg.num_key_value_heads).collect(); l],
            neurons: vec![(0..cfg.intermediate_size).collect(); l],
        }
    }

    /// Chooses the kept units from importance scores.
    ///
    /// # Errors
    /// Invalid fractions; scores whose sizes do not match `cfg`.
    pub fn from_importance(cfg: &ModelConfig, imp: &Importance, spec: &StructuredSpec) -> Result<Self> {
        spec.validate()?;
        let l = cfg.num_hidden_layers;
        let (heads, kvh) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        if imp.heads.len() != l || imp.neurons.len() != l || imp.layers.len() != l
            || imp.heads.iter().any(|v| v.len() != heads)
            || imp.neurons.iter().any(|v| v.len() != cfg.intermediate_size)
        {
            return Err(Error::Shape("importance scores do not match the model configuration".into()));
        }
        let g = heads / kvh;
        let mut plan = Self::identity(cfg);
        for li in 0..l {
            let hs = &imp.heads[li];
            match spec.head_mode {
                HeadMode::QueryPerGroup => {
                    let keep = (g - pruned_count(spec.heads, g)).max(1);
                    plan.heads[li] = (0..kvh)
                        .flat_map(|k| top_sorted(&hs[k * g..(k + 1) * g], keep).into_iter().map(move |i| k * g + i))
                        .collect();
                }
                HeadMode::KvGroups => {
                    let keep = (kvh - pruned_count(spec.heads, kvh)).max(1);
                    let gs: Vec<f64> = (0..kvh).map(|k| hs[k * g..(k + 1) * g].iter().sum()).collect();
                    let kept = top_sorted(&gs, keep);
                    plan.heads[li] = kept.iter().flat_map(|&k| k * g..(k + 1) * g).collect();
                    plan.kv_heads[li] = kept;
                }
            }
            let keep_n = (cfg.intermediate_size - pruned_count(spec.neurons, cfg.intermediate_size)).max(1);
            plan.neurons[li] = top_sorted(&imp.neurons[li], keep_n);
        }
        plan.layers = top_sorted(&imp.layers, (l - pruned_count(spec.layers, l)).max(1));
        Ok(plan)
    }

    /// The configuration of the pruned model.
    pub fn config(&self, base: &ModelConfig) -> ModelConfig {
        let mut c = base.clone();
        c.num_hidden_layers = self.layers.len();
        let first = self.layers.first().copied().unwrap_or(0);
        c.num_attention_heads = self.heads.get(first).map_or(0, Vec::len);
        c.num_key_value_heads = self.kv_heads.get(first).map_or(0, Vec::len);
        c.intermediate_size = self.neurons.get(first).map_or(0, Vec::len);
        c
    }

    /// Checks the plan against `base`: indices in range, ascending, the same counts in every
    /// kept layer, a uniform GQA group size (every kept KV head keeps the same number of its
    /// own query heads).
    ///
    /// # Errors
    /// [`Error::InvalidParameter`] naming the problem.
    pub fn validate(&self, base: &ModelConfig) -> Result<()> {
        let bad = |m: String| invalid("plan", m);
        let asc = |v: &[usize], n: usize| v.windows(2).all(|w| w[0] < w[1]) && v.iter().all(|&i| i < n) && !v.is_empty();
        let l = base.num_hidden_layers;
        if !asc(&self.layers, l) || self.heads.len() != l || self.kv_heads.len() != l || self.neurons.len() != l {
            return Err(bad("layer lists do not match the model".into()));
        }
        let c = self.config(base);
        let g = base.num_attention_heads / base.num_key_value_heads;
        for &li in &self.layers {
            let (h, k, n) = (&self.heads[li], &self.kv_heads[li], &self.neurons[li]);
            if !asc(h, base.num_attention_heads) || !asc(k, base.num_key_value_heads) || !asc(n, base.intermediate_size) {
                return Err(bad(format!("layer {li}: unit indices out of range or not ascending")));
            }
            if h.len() != c.num_attention_heads || k.len() != c.num_key_value_heads || n.len() != c.intermediate_size {
                return Err(bad(format!("layer {li}: counts differ from the other layers")));
            }
            if !h.len().is_multiple_of(k.len()) {
                return Err(bad(format!("layer {li}: {} query heads for {} KV heads", h.len(), k.len())));
            }
            let per = h.len() / k.len();
            for (j, &kv) in k.iter().enumerate() {
                if h[j * per..(j + 1) * per].iter().any(|&q| q / g != kv) {
                    return Err(bad(format!("layer {li}: query heads not grouped under KV head {kv}")));
                }
            }
        }
        Ok(())
    }

    /// A tensor of the pruned model (names and shapes of [`StructuredPlan::config`]), sliced
    /// from the base model's tensor source.
    ///
    /// # Errors
    /// The base source's errors; an unknown layer index.
    pub fn pruned_tensor(&self, base_cfg: &ModelConfig, base: &TensorFn<'_>, name: &str) -> deco_model::Result<(Vec<usize>, Vec<f32>)> {
        let Some((li, tail)) = split_layer(name) else { return base(name) };
        let orig = *self
            .layers
            .get(li)
            .ok_or_else(|| deco_model::Error::InvalidInput(format!("`{name}`: the pruned model has {} layers", self.layers.len())))?;
        let (shape, data) = base(&format!("model.layers.{orig}.{tail}"))?;
        let hd = base_cfg.head_dim;
        let expand = |units: &[usize], size: usize| -> Vec<usize> { units.iter().flat_map(|&u| u * size..(u + 1) * size).collect() };
        let q_idx = expand(&self.heads[orig], hd);
        let kv_idx = expand(&self.kv_heads[orig], hd);
        let n_idx = &self.neurons[orig];
        let cols = shape.get(1).copied().unwrap_or(1);
        let rows_of = |idx: &[usize]| -> (Vec<usize>, Vec<f32>) {
            let d: Vec<f32> = idx.iter().flat_map(|&r| data[r * cols..(r + 1) * cols].iter().copied()).collect();
            let s = if shape.len() == 2 { vec![idx.len(), cols] } else { vec![idx.len()] };
            (s, d)
        };
        let cols_of = |idx: &[usize]| -> (Vec<usize>, Vec<f32>) {
            let d: Vec<f32> = (0..shape[0]).flat_map(|r| idx.iter().map(move |&c| r * cols + c)).map(|i| data[i]).collect();
            (vec![shape[0], idx.len()], d)
        };
        Ok(match tail {
            "self_attn.q_proj.weight" | "self_attn.q_proj.bias" => rows_of(&q_idx),
            "self_attn.k_proj.weight" | "self_attn.k_proj.bias" | "self_attn.v_proj.weight" | "self_attn.v_proj.bias" => rows_of(&kv_idx),
            "self_attn.o_proj.weight" => cols_of(&q_idx),
            "mlp.gate_proj.weight" | "mlp.up_proj.weight" => rows_of(n_idx),
            "mlp.down_proj.weight" => cols_of(n_idx),
            _ => (shape, data),
        })
    }

    /// A tensor of the *original-size* model in which the removed units are zeroed: o_proj
    /// columns of removed query heads, down_proj columns of removed neurons, and the whole
    /// o_proj and down_proj of removed layers (the layer becomes the identity). This model
    /// computes the same function as the pruned one.
    ///
    /// # Errors
    /// The base source's errors.
    pub fn masked_tensor(&self, base_cfg: &ModelConfig, base: &TensorFn<'_>, name: &str) -> deco_model::Result<(Vec<usize>, Vec<f32>)> {
        let (shape, mut data) = base(name)?;
        let Some((li, tail)) = split_layer(name) else { return Ok((shape, data)) };
        let removed_layer = !self.layers.contains(&li);
        let hd = base_cfg.head_dim;
        let cols = shape.get(1).copied().unwrap_or(1);
        let mut zero_cols = |keep: &dyn Fn(usize) -> bool| {
            for r in 0..shape[0] {
                for c in 0..cols {
                    if removed_layer || !keep(c) {
                        data[r * cols + c] = 0.0;
                    }
                }
            }
        };
        match tail {
            "self_attn.o_proj.weight" => zero_cols(&|c| self.heads[li].contains(&(c / hd))),
            "mlp.down_proj.weight" => zero_cols(&|c| self.neurons[li].binary_search(&c).is_ok()),
            _ => {}
        }
        Ok((shape, data))
    }
}

/// `model.layers.{i}.{tail}` → `(i, tail)`.
fn split_layer(name: &str) -> Option<(usize, &str)> {
    let (i, tail) = name.strip_prefix("model.layers.")?.split_once('.')?;
    Some((i.parse().ok()?, tail))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn top_sorted_keeps_highest_ascending() {
        assert_eq!(top_sorted(&[0.1, 3.0, 2.0, 3.0], 2), vec![1, 3]);
        assert_eq!(split_layer("model.layers.12.mlp.down_proj.weight"), Some((12, "mlp.down_proj.weight")));
        assert_eq!(split_layer("model.norm.weight"), None);
    }
}
