//! Sheared-LLaMA targeted structured pruning (Xia et al. 2024, "Sheared LLaMA: Accelerating
//! Language Model Pre-training via Structured Pruning", §2.1–2.2).
//!
//! - **Masks.** Hard-concrete gates (Louizos et al. 2018, §3; CoFi, Xia et al. 2022) on decoder
//!   layers `[L]`, attention heads `[L, H]`, MLP intermediate channels `[L, I]` and hidden
//!   dimensions `[d]`, with learned log-α ([`MaskLogits`]). A training sample is
//!   `z = clamp(sigmoid((ln u - ln(1-u) + log α) / β) · (ζ - γ) + γ, 0, 1)`, `u ~ U(0, 1)`, with
//!   β = 2/3, γ = -0.1, ζ = 1.1 (Louizos eq. 10–11); `P(z > 0) = sigmoid(log α - β ln(-γ/ζ))`
//!   (eq. 12). The masks multiply into the student's forward ([`StudentModel::forward_masked`]).
//! - **Target architecture and Lagrangian.** For each structure `k` (layers, heads, channels,
//!   hidden dimensions) the expected kept fraction `ŝ_k` (mean `P(z > 0)`) is pushed toward the
//!   target's `t_k` by `λ₁ₖ (ŝ_k - t_k) + λ₂ₖ (ŝ_k - t_k)²` (Sheared-LLaMA eq. 1), minimized over
//!   weights and masks and *maximized* over the λ (gradient ascent: `λ₁ₖ += η_λ (ŝ_k - t_k)`,
//!   `λ₂ₖ += η_λ (ŝ_k - t_k)²`). The LM loss is next-token cross-entropy. The expected decoder
//!   size `Ŝ = Σ_l P(z_l) · D̂ · (2·d_h·Σ_h P(z_lh) + 2·kv + 3·Σ_i P(z_li))`, `D̂ = Σ_j P(z_j)`
//!   (q/o per query head, k/v kept as in `structured`'s default GQA mode), normalized by the full
//!   model's, is reported ([`MaskLogits::expected_size`]). (A single constraint on `Ŝ` alone,
//!   tried first, lets the optimizer shrink whichever structure is cheapest — the hidden
//!   dimensions — and the final architecture then does not match what was learned.)
//! - **Final architecture.** The units with the largest log α are kept, exactly the target
//!   counts ([`ShearedResult::plan`], reusing [`StructuredPlan`]; heads per KV group as
//!   [`HeadMode::QueryPerGroup`]), with the deterministic gate values of the kept units folded
//!   into the weights ([`ShearedResult::tensor`]). Differences from the paper: RMSNorm of the
//!   sliced model averages over the kept hidden dimensions only; heads are pruned per KV group.
//! - **Continued training** is `deco distill` / [`crate::distill`] on the pruned model.
//! - **Dynamic batch loading** (§2.2, Alg. 1): domain weights updated from the excess of each
//!   domain's loss over a reference loss, `w_i ∝ w_i · exp(η · max(ℓ_i - ref_i, 0))`
//!   ([`update_domain_weights`]), used by [`shear`] when given several domains.

use burn::module::{Module, Param};
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::activation::sigmoid;
use burn::tensor::{Device, Tensor, TensorData};
use deco_formats::config::ModelConfig;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::distill::cross_entropy_weighted;
use crate::pipeline::TensorFn;
use crate::structured::{HeadMode, Importance, StructuredPlan, StructuredSpec};
use crate::student::{Masks, StudentModel};
use crate::{Error, Result, invalid};

/// Hard-concrete temperature β (Louizos et al. 2018).
pub const BETA: f64 = 2.0 / 3.0;
/// Lower stretch γ.
pub const GAMMA: f64 = -0.1;
/// Upper stretch ζ.
pub const ZETA: f64 = 1.1;

/// Learned log α of every gate.
#[derive(Module, Debug)]
pub struct MaskLogits {
    /// `[L]`.
    pub layers: Param<Tensor<1>>,
    /// `[L, heads]`.
    pub heads: Param<Tensor<2>>,
    /// `[L, intermediate]`.
    pub intermediate: Param<Tensor<2>>,
    /// `[hidden]`.
    pub hidden: Param<Tensor<1>>,
}

fn sample_gate<const D: usize>(log_alpha: Tensor<D>, rng: &mut ChaCha8Rng) -> Tensor<D> {
    let shape = log_alpha.shape();
    let n = shape.num_elements();
    let noise: Vec<f32> = (0..n)
        .map(|_| {
            let u = rng.random::<f64>().clamp(1e-6, 1.0 - 1e-6);
            (u.ln() - (1.0 - u).ln()) as f32
        })
        .collect();
    let noise: Tensor<D> = Tensor::from_data(TensorData::new(noise, shape), &log_alpha.device());
    sigmoid(log_alpha.add(noise).div_scalar(BETA)).mul_scalar(ZETA - GAMMA).add_scalar(GAMMA).clamp(0.0, 1.0)
}

fn deterministic_gate<const D: usize>(log_alpha: Tensor<D>) -> Tensor<D> {
    sigmoid(log_alpha).mul_scalar(ZETA - GAMMA).add_scalar(GAMMA).clamp(0.0, 1.0)
}

/// `P(z > 0) = sigmoid(log α - β ln(-γ/ζ))` (Louizos et al. 2018, eq. 12), element-wise.
pub fn open_probability<const D: usize>(log_alpha: Tensor<D>) -> Tensor<D> {
    sigmoid(log_alpha.sub_scalar(BETA * (-GAMMA / ZETA).ln()))
}

impl MaskLogits {
    /// Every log α set to `init` (e.g. 3: gates start almost surely open).
    pub fn init(cfg: &ModelConfig, init: f32, device: &Device) -> Self {
        let l = cfg.num_hidden_layers;
        let p1 = |n: usize| Param::from_tensor(Tensor::<1>::from_data(TensorData::new(vec![init; n], [n]), device));
        let p2 = |r: usize, c: usize| Param::from_tensor(Tensor::<2>::from_data(TensorData::new(vec![init; r * c], [r, c]), device));
        Self { layers: p1(l), heads: p2(l, cfg.num_attention_heads), intermediate: p2(l, cfg.intermediate_size), hidden: p1(cfg.hidden_size) }
    }

    /// Hard-concrete samples of all gates (training).
    pub fn sample(&self, rng: &mut ChaCha8Rng) -> Masks {
        Masks {
            layers: sample_gate(self.layers.val(), rng),
            heads: sample_gate(self.heads.val(), rng),
            intermediate: sample_gate(self.intermediate.val(), rng),
            hidden: sample_gate(self.hidden.val(), rng),
        }
    }

    /// Deterministic gates `clamp(sigmoid(log α)(ζ - γ) + γ, 0, 1)` (evaluation).
    pub fn deterministic(&self) -> Masks {
        Masks {
            layers: deterministic_gate(self.layers.val()),
            heads: deterministic_gate(self.heads.val()),
            intermediate: deterministic_gate(self.intermediate.val()),
            hidden: deterministic_gate(self.hidden.val()),
        }
    }

    /// Expected parameter count of the masked decoder divided by the full decoder's (see the
    /// module docs), differentiable in log α. Output `[1]`.
    pub fn expected_size(&self, cfg: &ModelConfig) -> Tensor<1> {
        let (hd, kvd) = (cfg.head_dim as f64, (cfg.num_key_value_heads * cfg.head_dim) as f64);
        let d = open_probability(self.hidden.val()).sum(); // [1]
        let heads = open_probability(self.heads.val()).sum_dim(1).squeeze_dim::<1>(1); // [L]
        let inter = open_probability(self.intermediate.val()).sum_dim(1).squeeze_dim::<1>(1); // [L]
        let per_layer = heads.mul_scalar(2.0 * hd).add_scalar(2.0 * kvd).add(inter.mul_scalar(3.0));
        let total = open_probability(self.layers.val()).mul(per_layer).sum().mul(d);
        total.div_scalar(full_size(cfg))
    }

    /// Expected kept fraction of each structure, `[4]`: layers, heads, intermediate channels,
    /// hidden dimensions (mean `P(z > 0)` over the gates of each kind), differentiable in log α:
    /// the quantities the Lagrangian constrains (Sheared-LLaMA eq. 1, one term per structure).
    pub fn expected_fractions(&self) -> Tensor<1> {
        Tensor::cat(
            vec![
                open_probability(self.layers.val()).mean(),
                open_probability(self.heads.val()).mean(),
                open_probability(self.intermediate.val()).mean(),
                open_probability(self.hidden.val()).mean(),
            ],
            0,
        )
    }
}

fn full_size(cfg: &ModelConfig) -> f64 {
    let (hd, kvd) = (cfg.head_dim as f64, (cfg.num_key_value_heads * cfg.head_dim) as f64);
    cfg.num_hidden_layers as f64 * cfg.hidden_size as f64 * (2.0 * hd * cfg.num_attention_heads as f64 + 2.0 * kvd + 3.0 * cfg.intermediate_size as f64)
}

/// The target architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target {
    /// Decoder layers kept.
    pub layers: usize,
    /// Query heads kept per layer (a multiple of `num_key_value_heads`).
    pub heads: usize,
    /// MLP channels kept per layer.
    pub intermediate: usize,
    /// Hidden dimensions kept.
    pub hidden: usize,
}

impl Target {
    /// Checks the target against `cfg`.
    ///
    /// # Errors
    /// [`Error::InvalidParameter`]: a count of 0, above the model's, or heads not a multiple of the
    /// KV heads.
    pub fn validate(&self, cfg: &ModelConfig) -> Result<()> {
        let ok = |v: usize, max: usize| v >= 1 && v <= max;
        if !ok(self.layers, cfg.num_hidden_layers) || !ok(self.heads, cfg.num_attention_heads) || !ok(self.intermediate, cfg.intermediate_size) || !ok(self.hidden, cfg.hidden_size) {
            return Err(invalid("target", format!("{self:?} must be within 1..= the model's sizes")));
        }
        if !self.heads.is_multiple_of(cfg.num_key_value_heads) {
            return Err(invalid("target", format!("{} heads is not a multiple of the {} KV heads", self.heads, cfg.num_key_value_heads)));
        }
        Ok(())
    }

    /// Kept fraction of each structure (layers, heads, intermediate, hidden), the targets of
    /// [`MaskLogits::expected_fractions`].
    pub fn fractions(&self, cfg: &ModelConfig) -> [f64; 4] {
        [
            self.layers as f64 / cfg.num_hidden_layers as f64,
            self.heads as f64 / cfg.num_attention_heads as f64,
            self.intermediate as f64 / cfg.intermediate_size as f64,
            self.hidden as f64 / cfg.hidden_size as f64,
        ]
    }

    /// The target's decoder size as a fraction of `cfg`'s (the formula of
    /// [`MaskLogits::expected_size`] with counts).
    pub fn size(&self, cfg: &ModelConfig) -> f64 {
        let (hd, kvd) = (cfg.head_dim as f64, (cfg.num_key_value_heads * cfg.head_dim) as f64);
        self.layers as f64 * self.hidden as f64 * (2.0 * hd * self.heads as f64 + 2.0 * kvd + 3.0 * self.intermediate as f64) / full_size(cfg)
    }
}

/// Sheared-LLaMA dynamic batch loading (Xia et al. 2024, Alg. 1): `w_i ∝ w_i ·
/// exp(η · max(ℓ_i - ref_i, 0))`, normalized to sum 1.
///
/// # Errors
/// [`Error::Shape`] for slices of different lengths or empty ones.
pub fn update_domain_weights(weights: &[f64], losses: &[f64], reference: &[f64], eta: f64) -> Result<Vec<f64>> {
    if weights.is_empty() || weights.len() != losses.len() || weights.len() != reference.len() {
        return Err(Error::Shape("weights, losses and reference losses must be equally long and non-empty".into()));
    }
    let raw: Vec<f64> = weights.iter().zip(losses).zip(reference).map(|((w, l), r)| w * (eta * (l - r).max(0.0)).exp()).collect();
    let s: f64 = raw.iter().sum();
    Ok(raw.iter().map(|v| v / s).collect())
}

/// Options of [`shear`].
#[derive(Debug, Clone, PartialEq)]
pub struct ShearConfig {
    /// The target architecture.
    pub target: Target,
    /// Optimizer steps.
    pub steps: usize,
    /// Sequences per step.
    pub batch_size: usize,
    /// Tokens per sequence.
    pub seqlen: usize,
    /// Adam learning rate of the model weights.
    pub lr: f64,
    /// Adam learning rate of the mask log α.
    pub mask_lr: f64,
    /// Gradient-ascent step η_λ of the Lagrange multipliers.
    pub lambda_lr: f64,
    /// Initial log α.
    pub init_log_alpha: f32,
    /// Dynamic batch loading step η (0: fixed uniform domain weights).
    pub domain_eta: f64,
    /// Update the domain weights every this many steps (Alg. 1's `m`), from the domain losses
    /// averaged since the last update.
    pub domain_update_every: usize,
    /// Seed.
    pub seed: u64,
}

/// One training step's record.
#[derive(Debug, Clone, PartialEq)]
pub struct ShearLog {
    /// Step, 1-based.
    pub step: usize,
    /// LM cross-entropy (nats).
    pub lm_loss: f64,
    /// Expected size `Ŝ` (fraction of the full decoder).
    pub expected_size: f64,
    /// Expected kept fractions (layers, heads, intermediate, hidden).
    pub fractions: [f64; 4],
    /// `(λ₁, λ₂)` of each structure after the step.
    pub lambdas: [(f64, f64); 4],
    /// Domain weights used for the step.
    pub domain_weights: Vec<f64>,
}

/// The outcome of [`shear`]: the trained weights and masks.
#[derive(Debug)]
pub struct ShearedResult {
    /// Weights (inner device).
    pub model: StudentModel,
    /// Mask log α (inner device).
    pub masks: MaskLogits,
    /// Training log.
    pub log: Vec<ShearLog>,
}

fn host1(t: Tensor<1>) -> Result<Vec<f64>> {
    let n = t.dims()[0];
    Ok(deco_model::host::to_host(t.reshape([1, n]))?.into_iter().map(f64::from).collect())
}

fn host2(t: Tensor<2>) -> Result<Vec<Vec<f64>>> {
    let [r, c] = t.dims();
    let v = deco_model::host::to_host(t)?;
    Ok((0..r).map(|i| v[i * c..(i + 1) * c].iter().map(|&x| f64::from(x)).collect()).collect())
}

fn top(scores: &[f64], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    idx.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx.sort_unstable();
    idx
}

impl ShearedResult {
    /// The kept layers, heads and channels (largest log α, the target counts) and kept hidden
    /// dimensions.
    ///
    /// # Errors
    /// An invalid target; device reads.
    pub fn plan(&self, cfg: &ModelConfig, target: &Target) -> Result<(StructuredPlan, Vec<usize>)> {
        target.validate(cfg)?;
        let imp = Importance { heads: host2(self.masks.heads.val())?, neurons: host2(self.masks.intermediate.val())?, layers: host1(self.masks.layers.val())? };
        let frac = |keep: usize, n: usize| (n - keep) as f64 / n as f64;
        let spec = StructuredSpec {
            heads: frac(target.heads, cfg.num_attention_heads),
            head_mode: HeadMode::QueryPerGroup,
            neurons: frac(target.intermediate, cfg.intermediate_size),
            layers: frac(target.layers, cfg.num_hidden_layers),
        };
        let plan = StructuredPlan::from_importance(cfg, &imp, &spec)?;
        plan.validate(cfg)?;
        let hidden = top(&host1(self.masks.hidden.val())?, target.hidden);
        Ok((plan, hidden))
    }

    /// Configuration of the pruned model.
    ///
    /// # Errors
    /// As [`ShearedResult::plan`].
    pub fn config(&self, cfg: &ModelConfig, target: &Target) -> Result<ModelConfig> {
        let (plan, hidden) = self.plan(cfg, target)?;
        let mut c = plan.config(cfg);
        c.hidden_size = hidden.len();
        Ok(c)
    }

    /// All tensors of the pruned model (transformers names and layout), with the deterministic
    /// gates of the kept units folded into the weights: head gates into o_proj columns, channel
    /// gates into down_proj columns, layer and hidden gates into o_proj / down_proj rows, hidden
    /// gates into the embedding columns when it is not tied to the LM head (a tied one is left
    /// as trained).
    ///
    /// # Errors
    /// As [`ShearedResult::plan`].
    pub fn tensors(&self, cfg: &ModelConfig, target: &Target) -> Result<crate::student::HfTensors> {
        let (plan, hidden) = self.plan(cfg, target)?;
        let mut pcfg = plan.config(cfg);
        let det = self.masks.deterministic();
        let (zl, zh, zi, zd) = (host1(det.layers)?, host2(det.heads)?, host2(det.intermediate)?, host1(det.hidden)?);
        let full = self.model.to_hf_tensors(cfg)?;
        let src = |n: &str| full.get(n).cloned().ok_or_else(|| deco_model::Error::InvalidInput(format!("missing `{n}`")));
        let src: &TensorFn<'_> = &src;
        let hd = cfg.head_dim;
        let mut out = crate::student::HfTensors::new();
        for name in deco_formats::checkpoint::hf_tensor_names(&pcfg) {
            let (shape, mut data) = plan.pruned_tensor(cfg, src, &name)?;
            // Fold the gates (in the pruned model's index space).
            if let Some(rest) = name.strip_prefix("model.layers.") {
                let (li, tail) = rest.split_once('.').ok_or_else(|| invalid("name", name.clone()))?;
                let li: usize = li.parse().map_err(|_| invalid("name", name.clone()))?;
                let orig = plan.layers[li];
                let cols = shape.get(1).copied().unwrap_or(1);
                if tail == "self_attn.o_proj.weight" {
                    for r in 0..shape[0] {
                        for (j, &h) in plan.heads[orig].iter().enumerate() {
                            for c in j * hd..(j + 1) * hd {
                                data[r * cols + c] *= (zh[orig][h] * zl[orig] * zd[r]) as f32;
                            }
                        }
                    }
                } else if tail == "mlp.down_proj.weight" {
                    for r in 0..shape[0] {
                        for (j, &ch) in plan.neurons[orig].iter().enumerate() {
                            data[r * cols + j] *= (zi[orig][ch] * zl[orig] * zd[r]) as f32;
                        }
                    }
                }
            } else if name == "model.embed_tokens.weight" && !cfg.tie_word_embeddings {
                // (Tied embeddings: the hidden gate cannot be folded into the input side alone.)
                for r in 0..shape[0] {
                    for (c, z) in zd.iter().enumerate() {
                        data[r * cols_of(&shape) + c] *= *z as f32;
                    }
                }
            }
            out.insert(name, (shape, data));
        }
        // Slice the hidden dimensions.
        pcfg.hidden_size = hidden.len();
        let mut sliced = crate::student::HfTensors::new();
        for (name, (shape, data)) in out {
            let cols = cols_of(&shape);
            let is_hidden_rows = name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight");
            let is_vec = shape.len() == 1 && name.ends_with("norm.weight");
            let (s, d) = if is_vec {
                (vec![hidden.len()], hidden.iter().map(|&j| data[j]).collect())
            } else if shape.len() == 2 && is_hidden_rows {
                (vec![hidden.len(), cols], hidden.iter().flat_map(|&r| data[r * cols..(r + 1) * cols].iter().copied()).collect())
            } else if shape.len() == 2 {
                // q/k/v/gate/up, embedding, lm_head: hidden is the column (input) dimension.
                (vec![shape[0], hidden.len()], (0..shape[0]).flat_map(|r| hidden.iter().map(move |&c| (r, c))).map(|(r, c)| data[r * cols + c]).collect())
            } else {
                (shape, data)
            };
            sliced.insert(name, (s, d));
        }
        Ok(sliced)
    }
}

fn cols_of(shape: &[usize]) -> usize {
    shape.get(1).copied().unwrap_or(1)
}

/// Learns masks and weights toward `sc.target` (see the module docs) on the token streams of
/// `domains` (one or more; several enable dynamic batch loading when `sc.domain_eta > 0`, with
/// `reference_losses` per domain, e.g. the unpruned model's). `model` must be on an autodiff
/// device.
///
/// # Errors
/// Invalid target / options, too short data, model errors.
pub fn shear(model: StudentModel, cfg: &ModelConfig, domains: &[Vec<u32>], reference_losses: &[f64], sc: &ShearConfig, progress: &mut dyn FnMut(&ShearLog)) -> Result<ShearedResult> {
    sc.target.validate(cfg)?;
    if sc.steps == 0 || sc.batch_size == 0 || sc.seqlen < 2 {
        return Err(invalid("shear", "steps, batch_size must be >= 1 and seqlen >= 2"));
    }
    if domains.is_empty() || domains.iter().any(|d| d.len() <= sc.seqlen) || reference_losses.len() != domains.len() {
        return Err(invalid("data", "every domain needs more than seqlen tokens and a reference loss"));
    }
    for (name, v) in [("lr", sc.lr), ("mask_lr", sc.mask_lr), ("lambda_lr", sc.lambda_lr)] {
        if !(v.is_finite() && v > 0.0) {
            return Err(invalid(if name == "lr" { "lr" } else { "mask_lr" }, format!("{name} must be positive, got {v}")));
        }
    }
    let device = model.embed.val().device();
    let mut model = model;
    let mut masks = MaskLogits::init(cfg, sc.init_log_alpha, &device);
    let mut opt_model = AdamConfig::new().init();
    let mut opt_masks = AdamConfig::new().init();
    let tf = sc.target.fractions(cfg);
    let tf_t: Tensor<1> = Tensor::from_data(TensorData::new(tf.iter().map(|&v| v as f32).collect::<Vec<_>>(), [4]), &device);
    let mut lambdas = [(0.0f64, 0.0f64); 4];
    let mut weights = vec![1.0 / domains.len() as f64; domains.len()];
    let mut acc_sum = vec![0.0f64; domains.len()];
    let mut acc_cnt = vec![0usize; domains.len()];
    let mut rng = ChaCha8Rng::seed_from_u64(sc.seed);
    let mut log = Vec::new();
    for step in 1..=sc.steps {
        // Batch: domains drawn by weight, a random window from each.
        let mut ids = Vec::with_capacity(sc.batch_size);
        let mut dom = Vec::with_capacity(sc.batch_size);
        for _ in 0..sc.batch_size {
            let mut u = rng.random::<f64>();
            let mut d = domains.len() - 1;
            for (i, w) in weights.iter().enumerate() {
                u -= w;
                if u <= 0.0 {
                    d = i;
                    break;
                }
            }
            let s = rng.random_range(0..domains[d].len() - sc.seqlen);
            ids.push(domains[d][s..s + sc.seqlen].to_vec());
            dom.push(d);
        }
        let z = masks.sample(&mut rng);
        let logits = model.forward_masked(cfg, &ids, false, Some(&z))?;
        let n = sc.batch_size * sc.seqlen;
        let per = (1.0 / (sc.batch_size * (sc.seqlen - 1)) as f64) as f32;
        let mut labels = Vec::with_capacity(n);
        let mut w = Vec::with_capacity(n);
        for s in &ids {
            for j in 0..sc.seqlen {
                labels.push(if j + 1 < sc.seqlen { s[j + 1] } else { 0 });
                w.push(if j + 1 < sc.seqlen { per } else { 0.0 });
            }
        }
        // Per-domain losses for dynamic batch loading (host, no gradient).
        if domains.len() > 1 && sc.domain_eta > 0.0 {
            let [_, v] = logits.dims();
            let lp = burn::tensor::activation::log_softmax(logits.clone().detach(), 1);
            let lph = deco_model::host::to_host(lp)?;
            let mut sum = vec![0.0; domains.len()];
            let mut cnt = vec![0usize; domains.len()];
            for (b, &d) in dom.iter().enumerate() {
                for j in 0..sc.seqlen - 1 {
                    let r = b * sc.seqlen + j;
                    sum[d] -= f64::from(lph[r * v + labels[r] as usize]);
                    cnt[d] += 1;
                }
            }
            for d in 0..domains.len() {
                acc_sum[d] += sum[d];
                acc_cnt[d] += cnt[d];
            }
        }
        let lm = cross_entropy_weighted(logits, &labels, &w)?;
        let fr = masks.expected_fractions();
        let gap = fr.clone().sub(tf_t.clone());
        let l1: Tensor<1> = Tensor::from_data(TensorData::new(lambdas.iter().map(|l| l.0 as f32).collect::<Vec<_>>(), [4]), &device);
        let l2: Tensor<1> = Tensor::from_data(TensorData::new(lambdas.iter().map(|l| l.1 as f32).collect::<Vec<_>>(), [4]), &device);
        let lag = gap.clone().mul(l1).sum().add(gap.clone().mul(gap).mul(l2).sum());
        let lm_v = host1(lm.clone().detach())?[0];
        let s_v = host1(masks.expected_size(cfg).detach())?[0];
        let fr_v = host1(fr.detach())?;
        let loss = lm.add(lag);
        let mut grads = loss.backward();
        let gm = GradientsParams::from_module(&mut grads, &model);
        let gk = GradientsParams::from_module(&mut grads, &masks);
        model = opt_model.step(sc.lr, model, gm);
        masks = opt_masks.step(sc.mask_lr, masks, gk);
        // Gradient ascent on the multipliers.
        let fractions = [fr_v[0], fr_v[1], fr_v[2], fr_v[3]];
        for ((lam, f), t) in lambdas.iter_mut().zip(&fractions).zip(&tf) {
            lam.0 += sc.lambda_lr * (f - t);
            lam.1 += sc.lambda_lr * (f - t) * (f - t);
        }
        let row = ShearLog { step, lm_loss: lm_v, expected_size: s_v, fractions, lambdas, domain_weights: weights.clone() };
        progress(&row);
        log.push(row);
        if domains.len() > 1 && sc.domain_eta > 0.0 && step % sc.domain_update_every.max(1) == 0 {
            // Domains not seen since the last update count as on target.
            let losses: Vec<f64> = (0..domains.len()).map(|d| if acc_cnt[d] > 0 { acc_sum[d] / acc_cnt[d] as f64 } else { reference_losses[d] }).collect();
            weights = update_domain_weights(&weights, &losses, reference_losses, sc.domain_eta)?;
            acc_sum.iter_mut().for_each(|x| *x = 0.0);
            acc_cnt.iter_mut().for_each(|x| *x = 0);
        }
    }
    Ok(ShearedResult { model: model.valid(), masks: masks.valid(), log })
}
