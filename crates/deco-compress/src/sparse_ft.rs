//! Sparse fine-tuning after one-shot pruning: a recovery fine-tune that keeps the sparsity of
//! every decoder linear exactly at its target.
//!
//! Two ways to treat the mask ([`MaskUpdate`]):
//!
//! - [`MaskUpdate::Fixed`]: the one-shot mask is kept. The forward uses `W ⊙ M`, so the gradient
//!   of a pruned weight is exactly zero (masked gradients); with Adam (no weight decay) a weight
//!   whose gradient has always been zero never moves, so the pruned weights stay exactly zero and
//!   the pattern is the one-shot pattern, bit for bit. This is the recovery fine-tune of the
//!   SparseGPT / Wanda papers (Frantar & Alistarh 2023 §5; Sun et al. 2024 §5, there with LoRA).
//! - [`MaskUpdate::Ema`]: moving-average sparse training. Dense shadow weights `W` are trained
//!   through the masked forward with the straight-through estimator (`W ⊙ M` in the forward, the
//!   gradient of `W ⊙ M` applied to all of `W`, as SR-STE, Zhou et al. 2021 §3), so pruned weights
//!   keep learning and can come back. An exponential moving average of the Wanda score
//!   `S_ij ← β S_ij + (1 − β) |W_ij| · ‖X_j‖` (Sun et al. 2024 eq. 1, with `‖X_j‖` the RMS of input
//!   feature `j` over the step's tokens) is kept for every weight, and every `every` steps the
//!   mask is re-selected from it with the pattern's own rule (per output row: the same count per
//!   row for unstructured sparsity, N of every M for N:M), so the sparsity never leaves the target.
//!   This is the moving-average mask estimation the book describes (MAST); the dense-shadow STE
//!   update is how this module realizes the regrowth. At the end the model is `W ⊙ M`.
//!
//! The loss is the mean next-token cross-entropy on windows of a token stream (the calibration
//! text), batches drawn per step from `(seed, step)` as in [`crate::distill`]. The embedding and
//! the tied LM head are frozen; norms (dense) train with the linears.

use std::cell::RefCell;
use std::collections::HashMap;
use std::time::Instant;

use burn::optim::GradientsParams;
use burn::tensor::{Tensor, TensorData};
use deco_formats::config::ModelConfig;
use deco_model::calibrate::Linear;
use deco_model::decoder::{Branch, LayerHook, LayerParams, Proj, Site};
use deco_model::host::{fuse_transposed, to_host, transpose};

use crate::distill::{StepLog, adam_config, check_schedule, cross_entropy_weighted, loss_value, next_token_labels, step_rng, windows};
use crate::mask::{Mask, Pattern, select_per_row};
use crate::student::{HfTensors, StudentLayer, StudentModel};
use crate::{Error, Result, invalid};

/// How the sparsity mask evolves during the fine-tune (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MaskUpdate {
    /// The one-shot mask, fixed; masked gradients.
    Fixed,
    /// Masks re-selected every `every` steps from a moving average (factor `beta` per step) of
    /// the Wanda score, dense shadow weights trained with the straight-through estimator.
    Ema {
        /// EMA factor per step, in `[0, 1)`.
        beta: f64,
        /// Steps between mask re-selections, `>= 1`.
        every: usize,
    },
}

/// Options of [`sparse_finetune`].
#[derive(Debug, Clone, PartialEq)]
pub struct SparseFtConfig {
    /// Optimizer steps.
    pub steps: usize,
    /// Sequences per step.
    pub batch_size: usize,
    /// Tokens per sequence.
    pub seqlen: usize,
    /// Adam learning rate, in `(0, 1]`.
    pub lr: f64,
    /// Seed of the batch windows.
    pub seed: u64,
    /// Fixed mask or moving-average mask updates.
    pub mask_update: MaskUpdate,
    /// The sparsity pattern the masks follow (used by [`MaskUpdate::Ema`]'s re-selection).
    pub pattern: Pattern,
    /// Gradient clipping by norm per parameter tensor; `None` disables it.
    pub clip_norm: Option<f32>,
}

impl SparseFtConfig {
    /// Checks the ranges.
    ///
    /// # Errors
    /// [`Error::InvalidParameter`] naming the parameter.
    pub fn validate(&self) -> Result<()> {
        check_schedule("finetune_steps", self.steps, self.batch_size, self.seqlen, self.lr)?;
        if let MaskUpdate::Ema { beta, every } = self.mask_update {
            if !(0.0..1.0).contains(&beta) {
                return Err(invalid("mask_ema", format!("must be in [0, 1), got {beta}")));
            }
            if every == 0 {
                return Err(invalid("mask_update_every", "must be at least 1"));
            }
        }
        self.pattern.validate()
    }
}

/// One row of [`SparseFtOutput::mask_log`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MaskUpdateLog {
    /// Step after which the masks were re-selected.
    pub step: usize,
    /// Fraction of the decoder linear weights whose kept/pruned flag changed.
    pub changed: f64,
    /// Fraction of pruned weights after the update.
    pub sparsity: f64,
}

/// Result of [`sparse_finetune`].
#[derive(Debug)]
pub struct SparseFtOutput {
    /// Every tensor of the model in transformers names and layout, the decoder linears masked
    /// (exactly zero where [`Self::masks`] says pruned).
    pub tensors: HfTensors,
    /// The final masks (`[out, in]`) by linear weight name.
    pub masks: HashMap<String, Mask>,
    /// Loss per step.
    pub log: Vec<StepLog>,
    /// Mask re-selections ([`MaskUpdate::Ema`] only).
    pub mask_log: Vec<MaskUpdateLog>,
    /// Weights at pruned positions that were not exactly zero before the final `W ⊙ M`: 0 for a
    /// [`MaskUpdate::Fixed`] run started from the pruned weights (the masked gradients never move
    /// them); the regrowth candidates' count for [`MaskUpdate::Ema`].
    pub stray: usize,
}

/// The four fused weights of a layer in [`StudentLayer`] order: qkv, o, gate|up, down, with the
/// linears each one fuses and the decoder site whose activations feed it.
const FUSED: [(&[Linear], Site); 4] = [
    (&[Linear::Q, Linear::K, Linear::V], Site::AttnIn),
    (&[Linear::O], Site::AttnOut),
    (&[Linear::Gate, Linear::Up], Site::MlpIn),
    (&[Linear::Down], Site::DownIn),
];

fn site_index(site: Site) -> usize {
    match site {
        Site::AttnIn => 0,
        Site::AttnOut => 1,
        Site::MlpIn => 2,
        Site::DownIn => 3,
    }
}

fn weight_name(li: usize, l: Linear) -> String {
    format!("model.layers.{li}.{}.weight", l.hf_suffix())
}

fn fused_weight(layer: &StudentLayer, k: usize) -> Tensor<2> {
    match k {
        0 => layer.wqkv.val(),
        1 => layer.wo.val(),
        2 => layer.w_gate_up.val(),
        _ => layer.w_down.val(),
    }
}

/// A layer's weights seen through its masks (`[in, out]` 0/1, fused like the weights).
struct MaskedLayer<'a> {
    base: &'a StudentLayer,
    masks: &'a [Tensor<2>; 4],
    straight_through: bool,
}

impl LayerParams for MaskedLayer<'_> {
    fn norm(&self, branch: Branch) -> Tensor<1> {
        self.base.norm(branch)
    }

    fn qkv_bias(&self) -> Option<Tensor<1>> {
        self.base.qkv_bias()
    }

    fn project(&self, proj: Proj, x: Tensor<2>) -> deco_model::Result<Tensor<2>> {
        let k = match proj {
            Proj::Qkv => 0,
            Proj::O => 1,
            Proj::GateUp => 2,
            Proj::Down => 3,
        };
        let w = fused_weight(self.base, k);
        let m = self.masks[k].clone();
        let eff = if self.straight_through {
            // Value W ⊙ M, gradient to all of W: W − stop_grad(W ⊙ (1 − M)).
            w.clone().sub(w.mul(m.neg().add_scalar(1.0)).detach())
        } else {
            w.mul(m)
        };
        Ok(x.matmul(eff))
    }
}

/// Records the per-feature RMS of every linear's input (`[1, in]`, detached) during a forward.
struct NormHook {
    norms: RefCell<Vec<[Option<Tensor<2>>; 4]>>,
}

impl LayerHook for NormHook {
    fn input(&self, layer: usize, site: Site, x: Tensor<2>) -> Tensor<2> {
        let cols = x.dims()[1];
        let rms = x.clone().detach().powi_scalar(2).mean_dim(0).sqrt().reshape([1, cols]);
        if let Some(slot) = self.norms.borrow_mut().get_mut(layer) {
            slot[site_index(site)] = Some(rms);
        }
        x
    }
}

/// The fused `[in, Σ out]` f32 mask of a layer's fused weight `k` from the per-linear masks.
fn fused_mask(cfg: &ModelConfig, masks: &HashMap<String, Mask>, li: usize, k: usize) -> Result<(Vec<f32>, usize, usize)> {
    let (linears, _) = FUSED[k];
    let inner = linears[0].dims(cfg).1;
    let mut parts = Vec::with_capacity(linears.len());
    for &l in linears {
        let name = weight_name(li, l);
        let (rows, cols) = l.dims(cfg);
        let m = masks.get(&name).ok_or_else(|| invalid("masks", format!("no mask for `{name}`")))?;
        if (m.rows, m.cols) != (rows, cols) || m.keep.len() != rows * cols {
            return Err(Error::Shape(format!("mask of `{name}` is {}x{}, the weight {rows}x{cols}", m.rows, m.cols)));
        }
        parts.push((m.keep.iter().map(|&k| if k { 1.0f32 } else { 0.0 }).collect::<Vec<f32>>(), rows));
    }
    let refs: Vec<(&[f32], usize)> = parts.iter().map(|(d, r)| (d.as_slice(), *r)).collect();
    let total: usize = parts.iter().map(|p| p.1).sum();
    Ok((fuse_transposed(&refs, inner), inner, total))
}

fn upload_masks(cfg: &ModelConfig, masks: &HashMap<String, Mask>, device: &burn::tensor::Device) -> Result<Vec<[Tensor<2>; 4]>> {
    (0..cfg.num_hidden_layers)
        .map(|li| {
            let t = |k: usize| -> Result<Tensor<2>> {
                let (d, inner, total) = fused_mask(cfg, masks, li, k)?;
                Ok(Tensor::from_data(TensorData::new(d, [inner, total]), device))
            };
            Ok([t(0)?, t(1)?, t(2)?, t(3)?])
        })
        .collect()
}

/// A fused weight's score EMA on the host, `[in, Σ out]` row-major like the weight.
struct Score {
    inner: usize,
    total: usize,
    values: Vec<f32>,
}

/// Folds the step's Wanda scores `|W| · ‖X_j‖` into the EMAs (the first step initializes them).
/// Host arithmetic: the EMA must not keep a chain of device tensors alive from step to step.
fn update_scores(model: &StudentModel, norms: &[[Option<Tensor<2>>; 4]], scores: &mut Vec<[Score; 4]>, beta: f64) -> Result<()> {
    let first = scores.is_empty();
    for (li, layer) in model.layers.iter().enumerate() {
        let mut four = Vec::with_capacity(4);
        for k in 0..4 {
            let n = norms.get(li).and_then(|s| s[k].clone()).ok_or_else(|| invalid("model", format!("no activations recorded for layer {li}")))?;
            let n = to_host(n)?;
            let w = fused_weight(layer, k).detach();
            let [inner, total] = w.dims();
            let w = to_host(w)?;
            if n.len() != inner {
                return Err(Error::Shape(format!("layer {li}: {} activation norms for {inner} inputs", n.len())));
            }
            if first {
                let values = w.chunks_exact(total.max(1)).zip(&n).flat_map(|(row, &nj)| row.iter().map(move |&v| v.abs() * nj)).collect();
                four.push(Score { inner, total, values });
            } else {
                let s = &mut scores[li][k];
                let (b, a) = (beta as f32, (1.0 - beta) as f32);
                for ((row, &nj), srow) in w.chunks_exact(total.max(1)).zip(&n).zip(s.values.chunks_exact_mut(total.max(1))) {
                    for (sv, &v) in srow.iter_mut().zip(row) {
                        *sv = b * *sv + a * v.abs() * nj;
                    }
                }
            }
        }
        if first {
            let [a, b, c, d]: [Score; 4] = four.try_into().map_err(|_| invalid("model", "four fused weights per layer"))?;
            scores.push([a, b, c, d]);
        }
    }
    Ok(())
}

/// Re-selects the masks from the score EMAs with `pattern` per output row; returns the new masks
/// and the number of flags that changed.
fn reselect(cfg: &ModelConfig, scores: &[[Score; 4]], old: &HashMap<String, Mask>, pattern: Pattern) -> Result<(HashMap<String, Mask>, usize)> {
    let mut out = HashMap::with_capacity(old.len());
    let mut changed = 0;
    for (li, layer) in scores.iter().enumerate() {
        for (k, s) in layer.iter().enumerate() {
            let back = transpose(&s.values, s.inner, s.total); // [Σ out, in]
            let mut row = 0;
            for &l in FUSED[k].0 {
                let (rows, cols) = l.dims(cfg);
                let sc: Vec<f64> = back[row * cols..(row + rows) * cols].iter().map(|&v| f64::from(v)).collect();
                let m = select_per_row(&sc, rows, cols, pattern)?;
                let name = weight_name(li, l);
                if let Some(o) = old.get(&name) {
                    changed += o.keep.iter().zip(&m.keep).filter(|(a, b)| a != b).count();
                }
                out.insert(name, m);
                row += rows;
            }
        }
    }
    Ok((out, changed))
}

/// Fine-tunes `model` (on an autodiff device, loaded with the one-shot pruned weights — and, for
/// [`MaskUpdate::Ema`], the original dense values at the pruned positions, so that a regrown
/// weight restarts from its dense value) on next-token cross-entropy over windows of `tokens`,
/// keeping every decoder linear at the sparsity of `masks` (by transformers weight name,
/// `[out, in]`, as [`crate::pipeline::PrunedModel::masks`]). `progress` is called after every
/// step.
///
/// # Errors
/// [`Error::InvalidParameter`] for a bad config, a token stream shorter than a window, or a
/// missing mask; [`Error::Shape`] for a mask of the wrong size; a loss that is not finite; model
/// and device-read errors.
pub fn sparse_finetune(
    mut model: StudentModel,
    cfg: &ModelConfig,
    masks: &HashMap<String, Mask>,
    tokens: &[u32],
    sc: &SparseFtConfig,
    progress: &mut dyn FnMut(&StepLog),
) -> Result<SparseFtOutput> {
    sc.validate()?;
    if model.layers.len() != cfg.num_hidden_layers {
        return Err(invalid("config", "layer count differs from the model"));
    }
    let device = model.embed.val().device();
    let mut masks = masks.clone();
    let mut mask_t = upload_masks(cfg, &masks, &device)?;
    let total_weights: usize = masks.values().map(|m| m.keep.len()).sum();
    let ema = match sc.mask_update {
        MaskUpdate::Ema { beta, every } => Some((beta, every)),
        MaskUpdate::Fixed => None,
    };
    let mut scores: Vec<[Score; 4]> = Vec::new();
    let mut optim = adam_config(sc.clip_norm).init();
    let mut log = Vec::with_capacity(sc.steps);
    let mut mask_log = Vec::new();
    for step in 1..=sc.steps {
        let t0 = Instant::now();
        let mut rng = step_rng(sc.seed, step);
        let ids = windows(tokens, sc.batch_size, sc.seqlen, &mut rng)?;
        let hook = NormHook { norms: RefCell::new(vec![[None, None, None, None]; if ema.is_some() { cfg.num_hidden_layers } else { 0 }]) };
        let views: Vec<MaskedLayer<'_>> = model.layers.iter().zip(&mask_t).map(|(base, m)| MaskedLayer { base, masks: m, straight_through: ema.is_some() }).collect();
        let refs: Vec<&dyn LayerParams> = views.iter().map(|v| v as &dyn LayerParams).collect();
        let logits = model.forward_layers(cfg, &ids, true, Some(&refs), &hook, None)?;
        drop(refs);
        drop(views);
        let (labels, w) = next_token_labels(&ids);
        let loss = cross_entropy_weighted(logits, &labels, &w)?;
        let lv = loss_value(&loss, step)?;
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(sc.lr, model, grads);
        if let Some((beta, every)) = ema {
            update_scores(&model, &hook.norms.into_inner(), &mut scores, beta)?;
            if step % every == 0 || step == sc.steps {
                let (m, changed) = reselect(cfg, &scores, &masks, sc.pattern)?;
                masks = m;
                mask_t = upload_masks(cfg, &masks, &device)?;
                let pruned: usize = masks.values().map(Mask::pruned).sum();
                mask_log.push(MaskUpdateLog { step, changed: changed as f64 / total_weights.max(1) as f64, sparsity: pruned as f64 / total_weights.max(1) as f64 });
            }
        }
        let row = StepLog { step, loss: lv, tokens: sc.batch_size * sc.seqlen, secs: t0.elapsed().as_secs_f64() };
        progress(&row);
        log.push(row);
    }
    let mut tensors = model.to_hf_tensors(cfg)?;
    let mut stray = 0;
    for (name, m) in &masks {
        let (_, w) = tensors.get_mut(name).ok_or_else(|| invalid("masks", format!("mask for `{name}`, which the model does not have")))?;
        stray += w.iter().zip(&m.keep).filter(|&(&v, &k)| !k && v != 0.0).count();
        m.apply(w)?;
    }
    Ok(SparseFtOutput { tensors, masks, log, mask_log, stray })
}
