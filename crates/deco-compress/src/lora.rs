//! LoRA and QLoRA adapters on a frozen Llama / Qwen2 base, in PEFT's layout.
//!
//! LoRA (Hu et al. 2022, §4.1): a frozen linear `y = x · Wᵀ` gets a trainable low-rank update,
//! `y = x · Wᵀ + s · (dropout(x) · Aᵀ) · Bᵀ`, `A` `[r, in]`, `B` `[out, r]`, `s = lora_alpha / r`
//! (`lora_alpha / √r` with rsLoRA, read from PEFT configs only). QLoRA (Dettmers et al. 2023, §3)
//! is the same with the frozen base weights stored in NF4 with double quantization
//! ([`nf4_base`]: every decoder linear, block size 64, through `deco_quant`'s NF4, the code of
//! `deco quantize --method nf4`); the adapters train in f32 through the dequantized weights
//! (the paper's bf16 compute dtype is f32 here; paged optimizers are a GPU-memory device and
//! are not needed on the CPU).
//!
//! Conventions follow PEFT (`peft.tuners.lora.layer.Linear`, `LoraConfig`):
//! - parameters `r`, `lora_alpha`, `lora_dropout`, `target_modules` (`q_proj`, `k_proj`, `v_proj`,
//!   `o_proj`, `gate_proj`, `up_proj`, `down_proj`, or `all-linear`);
//! - initialization `init_lora_weights=True`: `A` Kaiming-uniform with `a = √5`, i.e.
//!   `U(-1/√in, 1/√in)`, `B` zeros, so the adapted model starts equal to the base
//!   ([`LoraAdapters::init`]);
//! - dropout on the adapter's input only (each adapter its own mask), inverted scaling `1/(1-p)`;
//! - saved as `adapter_config.json` + `adapter_model.safetensors` with tensor names
//!   `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` `[r, in]` and
//!   `...lora_B.weight` `[out, r]` ([`HostAdapters::save`], [`HostAdapters::load`]), so
//!   `peft.PeftModel.from_pretrained` loads them; deco's own training record goes to a separate
//!   `deco_lora.json` that PEFT ignores.
//!
//! The adapted forward is the one decoder (`deco_model::decoder::Pass::layer`) on
//! [`LoraLayer`], a [`LayerParams`] that adds the adapters' outputs to the frozen projections of a
//! [`StudentModel`] layer; [`lora_forward`] runs it through [`StudentModel::forward_layers`].
//! For inference the adapters are merged into the weights, `W' = W + s · B · A`
//! ([`HostAdapters::merged_source`]), which is what `deco generate / serve / eval --lora` load.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::Instant;

use burn::module::{Module, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Distribution, Tensor, TensorData};
use deco_formats::config::ModelConfig;
use deco_model::calibrate::Linear;
use deco_model::decoder::{Branch, LayerParams, NoHook, Proj};
use deco_model::host::to_host;
use deco_quant::pipeline::{Method, quantize_model};
use deco_quant::scheme::{Granularity, Scheme};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::distill::{CotSequence, StepLog, TokenKind, adam_config, check_schedule, cross_entropy_weighted, loss_value, scalar, step_rng};
use crate::pipeline::TensorFn;
use crate::student::{StudentLayer, StudentModel};
use crate::{Error, Result, invalid, io_err};

/// PEFT's adapter configuration file.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// PEFT's adapter weights file.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
/// deco's training record beside the PEFT files (base quantization, steps, data); PEFT ignores it.
pub const DECO_LORA_META: &str = "deco_lora.json";
/// NF4 block size of the QLoRA base (bitsandbytes' and the paper's default).
pub const NF4_BLOCKSIZE: usize = 64;

/// PEFT's module name of a decoder linear (`q_proj`, ..., `down_proj`).
pub fn module_name(l: Linear) -> &'static str {
    match l {
        Linear::Q => "q_proj",
        Linear::K => "k_proj",
        Linear::V => "v_proj",
        Linear::O => "o_proj",
        Linear::Gate => "gate_proj",
        Linear::Up => "up_proj",
        Linear::Down => "down_proj",
    }
}

/// Parses PEFT `target_modules` names: `q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`,
/// `up_proj`, `down_proj`, or `all-linear` (all seven; PEFT's spelling, the LM head excluded as
/// PEFT does). Returns them in execution order ([`Linear::ALL`]), without duplicates.
///
/// # Errors
/// [`Error::InvalidParameter`] (`target_modules`) for an empty list or an unknown name (the
/// message lists the valid ones).
pub fn parse_target_modules<S: AsRef<str>>(names: &[S]) -> Result<Vec<Linear>> {
    let mut set = Vec::new();
    for n in names {
        let n = n.as_ref().trim();
        if n == "all-linear" {
            set.extend(Linear::ALL);
            continue;
        }
        match Linear::ALL.iter().find(|&&l| module_name(l) == n) {
            Some(&l) => set.push(l),
            None => {
                return Err(invalid(
                    "target_modules",
                    format!("unknown module `{n}`; valid: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, all-linear"),
                ));
            }
        }
    }
    if set.is_empty() {
        return Err(invalid("target_modules", "no module given"));
    }
    Ok(Linear::ALL.into_iter().filter(|l| set.contains(l)).collect())
}

/// Hyper-parameters of the adapters (PEFT `LoraConfig` names).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// Rank `r` of `A` `[r, in]` and `B` `[out, r]`, at least 1.
    pub r: usize,
    /// `lora_alpha`: the update is scaled by `lora_alpha / r`; must be positive.
    pub lora_alpha: f64,
    /// Dropout probability on the adapters' input during training, in `[0, 1)`.
    pub lora_dropout: f64,
    /// The adapted linears of every decoder layer.
    pub target_modules: Vec<Linear>,
    /// rsLoRA scaling `lora_alpha / √r` (Kalajdzievski 2023; only read from PEFT configs).
    pub use_rslora: bool,
}

impl Default for LoraConfig {
    fn default() -> Self {
        Self { r: 16, lora_alpha: 32.0, lora_dropout: 0.05, target_modules: Linear::ALL.to_vec(), use_rslora: false }
    }
}

impl LoraConfig {
    /// Checks the ranges.
    ///
    /// # Errors
    /// [`Error::InvalidParameter`] naming `r` (0), `lora_alpha` (not a positive finite number),
    /// `lora_dropout` (outside `[0, 1)`) or `target_modules` (empty).
    pub fn validate(&self) -> Result<()> {
        if self.r == 0 {
            return Err(invalid("r", "the rank must be at least 1"));
        }
        if !(self.lora_alpha.is_finite() && self.lora_alpha > 0.0) {
            return Err(invalid("lora_alpha", format!("must be a positive number, got {}", self.lora_alpha)));
        }
        if !(self.lora_dropout.is_finite() && (0.0..1.0).contains(&self.lora_dropout)) {
            return Err(invalid("lora_dropout", format!("must be in [0, 1), got {}", self.lora_dropout)));
        }
        if self.target_modules.is_empty() {
            return Err(invalid("target_modules", "no module given"));
        }
        Ok(())
    }

    /// The factor `s` of the update `s · B · A`: `lora_alpha / r` (PEFT `scaling`), or
    /// `lora_alpha / √r` with rsLoRA.
    pub fn scaling(&self) -> f64 {
        if self.use_rslora { self.lora_alpha / (self.r as f64).sqrt() } else { self.lora_alpha / self.r as f64 }
    }

    /// Trainable parameters per model: `Σ_layers Σ_targets r · (in + out)`.
    pub fn trainable_params(&self, cfg: &ModelConfig) -> usize {
        cfg.num_hidden_layers * self.target_modules.iter().map(|l| { let (o, i) = l.dims(cfg); self.r * (i + o) }).sum::<usize>()
    }

    /// PEFT's `adapter_config.json` for these adapters (the `LoraConfig` fields of PEFT 0.x,
    /// defaults for everything deco does not use).
    pub fn to_peft_json(&self, base_model_name_or_path: &str) -> serde_json::Value {
        let alpha = if self.lora_alpha.fract() == 0.0 && self.lora_alpha < 1e15 { serde_json::json!(self.lora_alpha as i64) } else { serde_json::json!(self.lora_alpha) };
        serde_json::json!({
            "alpha_pattern": {},
            "auto_mapping": null,
            "base_model_name_or_path": base_model_name_or_path,
            "bias": "none",
            "fan_in_fan_out": false,
            "inference_mode": true,
            "init_lora_weights": true,
            "layers_pattern": null,
            "layers_to_transform": null,
            "lora_alpha": alpha,
            "lora_dropout": self.lora_dropout,
            "modules_to_save": null,
            "peft_type": "LORA",
            "r": self.r,
            "rank_pattern": {},
            "revision": null,
            "target_modules": self.target_modules.iter().map(|&l| module_name(l)).collect::<Vec<_>>(),
            "task_type": "CAUSAL_LM",
            "use_dora": false,
            "use_rslora": self.use_rslora,
        })
    }

    /// Reads PEFT's `adapter_config.json` (as parsed JSON).
    ///
    /// # Errors
    /// [`Error::InvalidParameter`] for another PEFT method than LoRA, features deco does not
    /// implement (DoRA, `fan_in_fan_out`, adapter biases, per-module rank / alpha patterns), a
    /// missing or out-of-range `r` / `lora_alpha` / `lora_dropout`, or unknown target modules.
    pub fn from_peft_json(v: &serde_json::Value) -> Result<Self> {
        if let Some(t) = v.get("peft_type").and_then(|t| t.as_str()).filter(|t| *t != "LORA") {
            return Err(invalid("peft_type", format!("`{t}` adapters are not LoRA")));
        }
        let flag = |k: &str| v.get(k).and_then(serde_json::Value::as_bool).unwrap_or(false);
        if flag("use_dora") {
            return Err(invalid("use_dora", "DoRA adapters are not supported"));
        }
        if flag("fan_in_fan_out") {
            return Err(invalid("fan_in_fan_out", "transposed (Conv1D) base layers are not supported"));
        }
        if let Some(b) = v.get("bias").and_then(|b| b.as_str()).filter(|b| *b != "none") {
            return Err(invalid("bias", format!("adapter biases (`{b}`) are not supported")));
        }
        for k in ["rank_pattern", "alpha_pattern"] {
            if v.get(k).and_then(|p| p.as_object()).is_some_and(|o| !o.is_empty()) {
                return Err(invalid("rank_pattern", format!("per-module `{k}` is not supported")));
            }
        }
        let r = v.get("r").and_then(serde_json::Value::as_u64).ok_or_else(|| invalid("r", "missing or not a non-negative integer"))? as usize;
        let lora_alpha = v.get("lora_alpha").and_then(serde_json::Value::as_f64).ok_or_else(|| invalid("lora_alpha", "missing or not a number"))?;
        let lora_dropout = v.get("lora_dropout").and_then(serde_json::Value::as_f64).unwrap_or(0.0);
        let target_modules = match v.get("target_modules") {
            Some(serde_json::Value::String(s)) => parse_target_modules(&[s.as_str()])?,
            Some(serde_json::Value::Array(a)) => {
                let names: Vec<&str> = a.iter().map(|x| x.as_str().ok_or_else(|| invalid("target_modules", "not a list of strings"))).collect::<Result<_>>()?;
                parse_target_modules(&names)?
            }
            _ => return Err(invalid("target_modules", "missing (a list of module names)")),
        };
        let c = Self { r, lora_alpha, lora_dropout, target_modules, use_rslora: flag("use_rslora") };
        c.validate()?;
        Ok(c)
    }
}

// ---------------------------------------------------------------------------------------------
// Trainable adapters
// ---------------------------------------------------------------------------------------------

/// One adapter's trainable factors, stored transposed for `x · Aᵀ · Bᵀ`.
#[derive(Module, Debug)]
pub struct LoraLinear {
    /// `[in, r]`: `lora_A.weight` transposed.
    pub a: Param<Tensor<2>>,
    /// `[r, out]`: `lora_B.weight` transposed.
    pub b: Param<Tensor<2>>,
}

impl LoraLinear {
    /// `s · (x · Aᵀ) · Bᵀ`.
    ///
    /// # Shapes
    /// `x`: `[tokens, in]`; output `[tokens, out]`.
    pub fn delta(&self, x: Tensor<2>, scaling: f64) -> Tensor<2> {
        x.matmul(self.a.val()).matmul(self.b.val()).mul_scalar(scaling)
    }
}

/// The adapters of one decoder layer (`None`: module not adapted).
#[derive(Module, Debug)]
pub struct LoraLayerAdapters {
    /// q_proj.
    pub q: Option<LoraLinear>,
    /// k_proj.
    pub k: Option<LoraLinear>,
    /// v_proj.
    pub v: Option<LoraLinear>,
    /// o_proj.
    pub o: Option<LoraLinear>,
    /// gate_proj.
    pub gate: Option<LoraLinear>,
    /// up_proj.
    pub up: Option<LoraLinear>,
    /// down_proj.
    pub down: Option<LoraLinear>,
}

impl LoraLayerAdapters {
    /// The adapter of one linear, if any.
    pub fn get(&self, l: Linear) -> Option<&LoraLinear> {
        match l {
            Linear::Q => self.q.as_ref(),
            Linear::K => self.k.as_ref(),
            Linear::V => self.v.as_ref(),
            Linear::O => self.o.as_ref(),
            Linear::Gate => self.gate.as_ref(),
            Linear::Up => self.up.as_ref(),
            Linear::Down => self.down.as_ref(),
        }
    }

    fn slot(&mut self, l: Linear) -> &mut Option<LoraLinear> {
        match l {
            Linear::Q => &mut self.q,
            Linear::K => &mut self.k,
            Linear::V => &mut self.v,
            Linear::O => &mut self.o,
            Linear::Gate => &mut self.gate,
            Linear::Up => &mut self.up,
            Linear::Down => &mut self.down,
        }
    }

    fn empty() -> Self {
        Self { q: None, k: None, v: None, o: None, gate: None, up: None, down: None }
    }
}

/// All adapters of a model: the trainable module of [`train_lora`] (burn `Module`, so burn-optim
/// updates it and nothing else).
#[derive(Module, Debug)]
pub struct LoraAdapters {
    /// One entry per decoder layer.
    pub layers: Vec<LoraLayerAdapters>,
}

fn param2(data: Vec<f32>, rows: usize, cols: usize, device: &Device) -> Param<Tensor<2>> {
    Param::from_tensor(Tensor::from_data(TensorData::new(data, [rows, cols]), device))
}

impl LoraAdapters {
    /// Fresh adapters as PEFT's `init_lora_weights=True` makes them: `A` Kaiming-uniform with
    /// `a = √5` (torch `nn.init.kaiming_uniform_`: bound `gain · √(3 / fan_in)`,
    /// `gain = √(2 / (1 + a²))`, so `U(-1/√in, 1/√in)`), `B` zeros. Values come from a ChaCha8
    /// stream seeded with `seed` (layer by layer, modules in execution order), on `device` (an
    /// autodiff device to train).
    ///
    /// # Errors
    /// [`LoraConfig::validate`]'s.
    pub fn init(cfg: &ModelConfig, lc: &LoraConfig, seed: u64, device: &Device) -> Result<Self> {
        lc.validate()?;
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for _ in 0..cfg.num_hidden_layers {
            let mut la = LoraLayerAdapters::empty();
            for &l in &lc.target_modules {
                let (out, inp) = l.dims(cfg);
                let bound = 1.0 / (inp as f64).sqrt();
                let a: Vec<f32> = (0..inp * lc.r).map(|_| rng.random_range(-bound..bound) as f32).collect();
                // `a` is generated in PEFT's `[r, in]` order, then stored transposed.
                let at = deco_model::host::transpose(&a, lc.r, inp);
                *la.slot(l) = Some(LoraLinear { a: param2(at, inp, lc.r, device), b: param2(vec![0.0; lc.r * out], lc.r, out, device) });
            }
            layers.push(la);
        }
        Ok(Self { layers })
    }
}

// ---------------------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------------------

/// A frozen [`StudentLayer`] with adapters: `project(p, x) = x · W_pᵀ + s · dropout(x) · Aᵀ · Bᵀ`,
/// the fused outputs of [`Proj::Qkv`] (q|k|v) and [`Proj::GateUp`] (gate|up) getting the
/// concatenated updates of their parts (zeros for a part without adapter).
pub struct LoraLayer<'a> {
    /// The frozen base weights.
    pub base: &'a StudentLayer,
    /// This layer's adapters.
    pub adapters: &'a LoraLayerAdapters,
    /// `s` ([`LoraConfig::scaling`]).
    pub scaling: f64,
    /// Dropout probability applied now (0 for evaluation).
    pub dropout: f64,
    /// `(q, kv, intermediate, hidden)` output widths.
    pub widths: (usize, usize, usize, usize),
}

impl LoraLayer<'_> {
    fn dropped(&self, x: &Tensor<2>) -> Tensor<2> {
        if self.dropout <= 0.0 {
            return x.clone();
        }
        let keep = 1.0 - self.dropout;
        let mask: Tensor<2> = Tensor::random(x.dims(), Distribution::Bernoulli(keep), &x.device());
        x.clone().mul(mask).div_scalar(keep)
    }
}

impl LayerParams for LoraLayer<'_> {
    fn norm(&self, branch: Branch) -> Tensor<1> {
        self.base.norm(branch)
    }

    fn qkv_bias(&self) -> Option<Tensor<1>> {
        self.base.qkv_bias()
    }

    fn project(&self, proj: Proj, x: Tensor<2>) -> deco_model::Result<Tensor<2>> {
        let (q, kv, i, h) = self.widths;
        let parts: &[(Linear, usize)] = match proj {
            Proj::Qkv => &[(Linear::Q, q), (Linear::K, kv), (Linear::V, kv)],
            Proj::O => &[(Linear::O, h)],
            Proj::GateUp => &[(Linear::Gate, i), (Linear::Up, i)],
            Proj::Down => &[(Linear::Down, h)],
        };
        let y = self.base.project(proj, x.clone())?;
        if parts.iter().all(|&(l, _)| self.adapters.get(l).is_none()) {
            return Ok(y);
        }
        let n = x.dims()[0];
        let device = x.device();
        let deltas: Vec<Tensor<2>> = parts
            .iter()
            .map(|&(l, out)| match self.adapters.get(l) {
                Some(m) => m.delta(self.dropped(&x), self.scaling),
                None => Tensor::zeros([n, out], &device),
            })
            .collect();
        Ok(y.add(if deltas.len() == 1 { deltas.into_iter().next().unwrap_or_else(|| Tensor::zeros([n, 0], &device)) } else { Tensor::cat(deltas, 1) }))
    }
}

/// Logits of the base with adapters (see [`StudentModel::forward`] for the batch layout; the
/// embedding / tied head is frozen). `train` applies `lora_dropout`; evaluation passes `false`.
/// The base's weights should not require gradients (`base.no_grad()`) so that only the adapters
/// are trained.
///
/// # Shapes
/// `ids`: `batch` sequences of `seq` tokens; output `[batch · seq, vocab]`.
///
/// # Errors
/// As [`StudentModel::forward`]; [`Error::Shape`] when the adapters have another layer count.
pub fn lora_forward(base: &StudentModel, adapters: &LoraAdapters, cfg: &ModelConfig, lc: &LoraConfig, ids: &[Vec<u32>], train: bool) -> Result<Tensor<2>> {
    if adapters.layers.len() != base.layers.len() {
        return Err(Error::Shape(format!("adapters for {} layers, the model has {}", adapters.layers.len(), base.layers.len())));
    }
    let widths = (cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size, cfg.hidden_size);
    let dropout = if train { lc.lora_dropout } else { 0.0 };
    let layers: Vec<LoraLayer<'_>> = base
        .layers
        .iter()
        .zip(&adapters.layers)
        .map(|(b, a)| LoraLayer { base: b, adapters: a, scaling: lc.scaling(), dropout, widths })
        .collect();
    let refs: Vec<&dyn LayerParams> = layers.iter().map(|l| l as &dyn LayerParams).collect();
    base.forward_layers(cfg, ids, true, Some(&refs), &NoHook, None)
}

// ---------------------------------------------------------------------------------------------
// Host form, PEFT files, merging
// ---------------------------------------------------------------------------------------------

/// Adapters on the host in PEFT's layout: per `(layer, module)`, `A` `[r, in]` and `B`
/// `[out, r]` row-major f32.
#[derive(Debug, Clone, PartialEq)]
pub struct HostAdapters {
    /// The hyper-parameters.
    pub config: LoraConfig,
    /// `(layer, module) -> (A [r, in], B [out, r])`.
    pub weights: BTreeMap<(usize, LinearKey), (Vec<f32>, Vec<f32>)>,
}

/// A [`Linear`] with an order (for [`BTreeMap`] keys): its index in [`Linear::ALL`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LinearKey(pub usize);

impl LinearKey {
    /// The key of `l`.
    pub fn of(l: Linear) -> Self {
        Self(Linear::ALL.iter().position(|&x| x == l).unwrap_or(0))
    }
    /// The linear.
    pub fn linear(self) -> Linear {
        Linear::ALL[self.0.min(6)]
    }
}

/// PEFT's tensor name of one factor: `base_model.model.model.layers.{i}.{self_attn|mlp}.{m}.lora_{A|B}.weight`.
pub fn peft_tensor_name(layer: usize, l: Linear, factor_b: bool) -> String {
    format!("base_model.model.model.layers.{layer}.{}.lora_{}.weight", l.hf_suffix(), if factor_b { "B" } else { "A" })
}

/// Parses a PEFT tensor name into `(layer, module, is_B)`.
fn parse_peft_name(name: &str) -> Option<(usize, Linear, bool)> {
    let rest = name.strip_prefix("base_model.model.model.layers.")?;
    let (idx, rest) = rest.split_once('.')?;
    let layer = idx.parse().ok()?;
    for l in Linear::ALL {
        for (suffix, b) in [(".lora_A.weight", false), (".lora_B.weight", true)] {
            if rest.strip_suffix(suffix) == Some(l.hf_suffix()) {
                return Some((layer, l, b));
            }
        }
    }
    None
}

fn st_err(path: &Path, msg: impl Into<String>) -> Error {
    Error::Adapter { path: path.to_path_buf(), msg: msg.into() }
}

impl HostAdapters {
    /// Reads the trained module back to the host.
    ///
    /// # Errors
    /// [`Error::Model`] for a failed device read; [`Error::Shape`] for a module that does not
    /// match `cfg`.
    pub fn from_module(m: &LoraAdapters, cfg: &ModelConfig, lc: &LoraConfig) -> Result<Self> {
        if m.layers.len() != cfg.num_hidden_layers {
            return Err(Error::Shape(format!("adapters for {} layers, the model has {}", m.layers.len(), cfg.num_hidden_layers)));
        }
        let mut weights = BTreeMap::new();
        for (li, la) in m.layers.iter().enumerate() {
            for l in Linear::ALL {
                if let Some(ad) = la.get(l) {
                    let (out, inp) = l.dims(cfg);
                    if ad.a.val().dims() != [inp, lc.r] || ad.b.val().dims() != [lc.r, out] {
                        return Err(Error::Shape(format!("layer {li} {}: adapter shapes do not match the model", module_name(l))));
                    }
                    let a = deco_model::host::transpose(&to_host(ad.a.val())?, inp, lc.r);
                    let b = deco_model::host::transpose(&to_host(ad.b.val())?, lc.r, out);
                    weights.insert((li, LinearKey::of(l)), (a, b));
                }
            }
        }
        Ok(Self { config: lc.clone(), weights })
    }

    /// The trainable module on `device` (e.g. to resume training).
    pub fn to_module(&self, cfg: &ModelConfig, device: &Device) -> LoraAdapters {
        let r = self.config.r;
        let mut layers: Vec<LoraLayerAdapters> = (0..cfg.num_hidden_layers).map(|_| LoraLayerAdapters::empty()).collect();
        for (&(li, key), (a, b)) in &self.weights {
            let l = key.linear();
            let (out, inp) = l.dims(cfg);
            if let Some(la) = layers.get_mut(li) {
                *la.slot(l) = Some(LoraLinear {
                    a: param2(deco_model::host::transpose(a, r, inp), inp, r, device),
                    b: param2(deco_model::host::transpose(b, out, r), r, out, device),
                });
            }
        }
        LoraAdapters { layers }
    }

    /// `s · B · A` of one adapted linear, `[out, in]` row-major (f64 accumulation), or `None`.
    pub fn delta(&self, layer: usize, l: Linear, out: usize, inp: usize) -> Option<Vec<f32>> {
        let (a, b) = self.weights.get(&(layer, LinearKey::of(l)))?;
        let (r, s) = (self.config.r, self.config.scaling());
        let mut d = vec![0.0f32; out * inp];
        let mut row = vec![0.0f64; inp];
        for o in 0..out {
            row.iter_mut().for_each(|x| *x = 0.0);
            for k in 0..r {
                let bk = f64::from(b[o * r + k]);
                if bk == 0.0 {
                    continue;
                }
                for (x, &av) in row.iter_mut().zip(&a[k * inp..(k + 1) * inp]) {
                    *x += bk * f64::from(av);
                }
            }
            for (dst, &x) in d[o * inp..(o + 1) * inp].iter_mut().zip(&row) {
                *dst = (s * x) as f32;
            }
        }
        Some(d)
    }

    /// A tensor source that serves `W + s · B · A` for every adapted linear and `base` for the
    /// rest (for `deco_model::Llama::load_from` or `StudentModel::from_source`).
    pub fn merged_source<'a>(&'a self, base: &'a TensorFn<'a>) -> impl Fn(&str) -> deco_model::Result<(Vec<usize>, Vec<f32>)> + 'a {
        move |name: &str| {
            let (shape, mut w) = base(name)?;
            if let Some((li, l)) = linear_of(name)
                && shape.len() == 2
                && let Some(d) = self.delta(li, l, shape[0], shape[1])
            {
                if d.len() != w.len() {
                    return Err(deco_model::Error::InvalidInput(format!("`{name}`: adapter shape does not match {shape:?}")));
                }
                for (x, dx) in w.iter_mut().zip(d) {
                    *x += dx;
                }
            }
            Ok((shape, w))
        }
    }

    /// Number of trainable scalars.
    pub fn num_params(&self) -> usize {
        self.weights.values().map(|(a, b)| a.len() + b.len()).sum()
    }

    /// Writes PEFT's `adapter_config.json` and `adapter_model.safetensors` (f32, metadata
    /// `format: pt`) plus `extra` as [`DECO_LORA_META`] into `out`, atomically (built in a hidden
    /// sibling directory, then renamed: `deco_formats::atomic::write_dir`).
    ///
    /// # Errors
    /// `out` exists and is not empty; I/O errors (nothing is left at `out`).
    pub fn save(&self, out: &Path, base_model_name_or_path: &str, extra: &serde_json::Value) -> Result<()> {
        if !deco_formats::atomic::is_absent_or_empty(out).map_err(io_err(out))? {
            return Err(invalid("out", format!("{} exists and is not empty", out.display())));
        }
        let config = serde_json::to_string_pretty(&self.config.to_peft_json(base_model_name_or_path)).map_err(|e| invalid("config", e.to_string()))?;
        let meta = serde_json::to_string_pretty(extra).map_err(|e| invalid("config", e.to_string()))?;
        let build = |dir: &Path| -> Result<()> {
            let p = dir.join(ADAPTER_CONFIG);
            std::fs::write(&p, &config).map_err(io_err(&p))?;
            let p = dir.join(DECO_LORA_META);
            std::fs::write(&p, &meta).map_err(io_err(&p))?;
            let path = dir.join(ADAPTER_WEIGHTS);
            let mut buffers: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
            for (&(li, key), (a, b)) in &self.weights {
                let l = key.linear();
                let (out, inp) = (b.len() / self.config.r, a.len() / self.config.r);
                buffers.push((peft_tensor_name(li, l, false), vec![self.config.r, inp], a.iter().flat_map(|x| x.to_le_bytes()).collect()));
                buffers.push((peft_tensor_name(li, l, true), vec![out, self.config.r], b.iter().flat_map(|x| x.to_le_bytes()).collect()));
            }
            let views = buffers
                .iter()
                .map(|(n, s, b)| safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b).map(|v| (n.clone(), v)).map_err(|e| st_err(&path, format!("{n}: {e}"))))
                .collect::<Result<Vec<_>>>()?;
            let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
            safetensors::serialize_to_file(views, Some(meta), &path).map_err(|e| st_err(&path, e.to_string()))
        };
        deco_formats::atomic::write_dir(out, build, |p, e| io_err(p)(e))
    }

    /// Loads a PEFT LoRA adapter directory for a model of configuration `cfg`.
    ///
    /// Accepts f32, f16 and bf16 tensors. Adapters may cover a subset of the layers
    /// (`layers_to_transform`).
    ///
    /// # Errors
    /// [`Error::Io`] for missing files; [`Error::InvalidParameter`] for a bad config
    /// ([`LoraConfig::from_peft_json`]); [`Error::Shape`] for an adapter of another architecture:
    /// a tensor name deco does not know, a layer the model does not have, a module not listed in
    /// `target_modules`, an `A` / `B` whose shape is not `[r, in]` / `[out, r]` for this model, or
    /// an `A` without its `B`.
    pub fn load(dir: &Path, cfg: &ModelConfig) -> Result<Self> {
        let cpath = dir.join(ADAPTER_CONFIG);
        let text = std::fs::read_to_string(&cpath).map_err(io_err(&cpath))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| st_err(&cpath, e.to_string()))?;
        let config = LoraConfig::from_peft_json(&v)?;
        let wpath = dir.join(ADAPTER_WEIGHTS);
        let bytes = std::fs::read(&wpath).map_err(io_err(&wpath))?;
        let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| st_err(&wpath, e.to_string()))?;
        // Per adapted linear: (A, B) as they are found.
        type Factors = (Option<Vec<f32>>, Option<Vec<f32>>);
        let mut parts: BTreeMap<(usize, LinearKey), Factors> = BTreeMap::new();
        let r = config.r;
        // In name order, so that the first problem reported does not depend on hashing.
        let mut tensors = st.tensors();
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, view) in tensors {
            let (li, l, is_b) = parse_peft_name(&name).ok_or_else(|| {
                Error::Shape(format!("{}: tensor `{name}` is not a LoRA factor of a Llama-family decoder linear (an adapter for another architecture?)", wpath.display()))
            })?;
            if li >= cfg.num_hidden_layers {
                return Err(Error::Shape(format!("{}: `{name}` is for layer {li}, the model has {} layers (an adapter for another model?)", wpath.display(), cfg.num_hidden_layers)));
            }
            if !config.target_modules.contains(&l) {
                return Err(Error::Shape(format!("{}: `{name}` adapts {}, which target_modules does not list", wpath.display(), module_name(l))));
            }
            let (out, inp) = l.dims(cfg);
            let want = if is_b { vec![out, r] } else { vec![r, inp] };
            if view.shape() != want.as_slice() {
                return Err(Error::Shape(format!(
                    "{}: `{name}` has shape {:?}, the model's {} with r = {r} needs {want:?} (an adapter for another architecture?)",
                    wpath.display(),
                    view.shape(),
                    module_name(l)
                )));
            }
            let data: Vec<f32> = match view.dtype() {
                safetensors::Dtype::F32 => view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
                safetensors::Dtype::F16 => view.data().chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
                safetensors::Dtype::BF16 => view.data().chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
                d => return Err(st_err(&wpath, format!("`{name}`: dtype {d:?} is not supported (f32, f16, bf16)"))),
            };
            let e = parts.entry((li, LinearKey::of(l))).or_default();
            if is_b { e.1 = Some(data) } else { e.0 = Some(data) }
        }
        let mut weights = BTreeMap::new();
        for ((li, key), (a, b)) in parts {
            match (a, b) {
                (Some(a), Some(b)) => {
                    weights.insert((li, key), (a, b));
                }
                _ => return Err(Error::Shape(format!("{}: layer {li} {} has only one of lora_A / lora_B", wpath.display(), module_name(key.linear())))),
            }
        }
        if weights.is_empty() {
            return Err(st_err(&wpath, "no LoRA tensors"));
        }
        Ok(Self { config, weights })
    }
}

/// `(layer, linear)` of a transformers decoder linear weight name (`model.layers.{i}.self_attn.q_proj.weight`).
pub fn linear_of(name: &str) -> Option<(usize, Linear)> {
    let rest = name.strip_prefix("model.layers.")?;
    let (idx, rest) = rest.split_once('.')?;
    let li = idx.parse().ok()?;
    let suffix = rest.strip_suffix(".weight")?;
    Linear::ALL.into_iter().find(|l| l.hf_suffix() == suffix).map(|l| (li, l))
}

/// The QLoRA base: every decoder linear of `tensor` quantized to NF4 (blocks of
/// [`NF4_BLOCKSIZE`], double quantization) and dequantized to f32, by `deco_quant`'s
/// `quantize_model` with `Method::Nf4` (exactly what `deco quantize --method nf4 --format fake
/// --group-size 64` writes); embedding, norms and an untied head stay as they are (QLoRA
/// quantizes the linear layers). Returns the dequantized linears by transformers name.
///
/// # Errors
/// `deco_quant`'s (missing tensors).
pub fn nf4_base(cfg: &ModelConfig, tensor: &TensorFn<'_>, progress: &mut dyn FnMut(usize)) -> Result<HashMap<String, Vec<f32>>> {
    let scheme = Scheme { bits: 4, sym: true, granularity: Granularity::PerGroup(NF4_BLOCKSIZE) };
    let qm = quantize_model(cfg, tensor, &Device::flex(), &[], &Method::Nf4, &scheme, deco_model::calibrate::CalibDtype::F32, progress)?;
    Ok(qm.linears)
}

// ---------------------------------------------------------------------------------------------
// Training
// ---------------------------------------------------------------------------------------------

/// Options of [`train_lora`].
#[derive(Debug, Clone, PartialEq)]
pub struct LoraTrainConfig {
    /// Total optimizer steps (a resumed run continues up to this number).
    pub steps: usize,
    /// Sequences per step.
    pub batch_size: usize,
    /// Longest sequence in tokens (longer examples are truncated).
    pub seqlen: usize,
    /// Adam learning rate, in `(0, 1]`.
    pub lr: f64,
    /// Seed of batch sampling and dropout.
    pub seed: u64,
    /// Gradient clipping by norm (per parameter tensor); `None` disables it.
    pub clip_norm: Option<f32>,
}

impl Default for LoraTrainConfig {
    fn default() -> Self {
        Self { steps: 200, batch_size: 4, seqlen: 256, lr: 2e-4, seed: 0, clip_norm: Some(1.0) }
    }
}

impl LoraTrainConfig {
    /// Checks the ranges.
    ///
    /// # Errors
    /// [`Error::InvalidParameter`] naming the parameter.
    pub fn validate(&self) -> Result<()> {
        check_schedule("steps", self.steps, self.batch_size, self.seqlen, self.lr)
    }
}

/// A padded batch of chain-of-thought sequences with completion-only labels.
#[derive(Debug, Clone, PartialEq)]
pub struct CompletionBatch {
    /// `batch` sequences of a common length (padded with the pad token).
    pub ids: Vec<Vec<u32>>,
    /// Next-token label of every row, `batch · len`.
    pub labels: Vec<u32>,
    /// Loss weight of every row: `1 / n` on the `n` rows whose label is a rationale or answer
    /// token (a mean over the batch's completion tokens), 0 on question and padding rows.
    pub weights: Vec<f32>,
    /// `n`: scored tokens.
    pub scored: usize,
}

/// Builds a [`CompletionBatch`] from `seqs`, each truncated to `seqlen` tokens and padded with
/// `pad` to the longest: "loss on answers" as the QLoRA reference implementation trains by
/// default (artidoro/qlora `qlora.py`, `train_on_source=False`: the prompt is not scored); here
/// the completion is the rationale, the `#### N` answer and EOS.
///
/// # Shapes
/// `ids`: `batch` sequences of `len = min(longest, seqlen)` tokens; `labels`, `weights`:
/// `batch · len` (row `j` of sequence `i` predicts token `j + 1`; last rows unscored).
pub fn completion_batch(seqs: &[&CotSequence], seqlen: usize, pad: u32) -> CompletionBatch {
    let len = seqs.iter().map(|s| s.ids.len().min(seqlen)).max().unwrap_or(2).max(2);
    let mut ids = Vec::with_capacity(seqs.len());
    let mut labels = Vec::with_capacity(seqs.len() * len);
    let mut scored_rows = Vec::with_capacity(seqs.len() * len);
    for s in seqs {
        let mut x: Vec<u32> = s.ids.iter().copied().take(len).collect();
        let mut k: Vec<TokenKind> = s.kinds.iter().copied().take(len).collect();
        x.resize(len, pad);
        k.resize(len, TokenKind::Ignore);
        for j in 0..len {
            labels.push(if j + 1 < len { x[j + 1] } else { 0 });
            scored_rows.push(j + 1 < len && k[j + 1] != TokenKind::Ignore);
        }
        ids.push(x);
    }
    let scored = scored_rows.iter().filter(|&&b| b).count();
    let w = if scored > 0 { 1.0 / scored as f32 } else { 0.0 };
    let weights = scored_rows.iter().map(|&b| if b { w } else { 0.0 }).collect();
    CompletionBatch { ids, labels, weights, scored }
}

/// Mean negative log-likelihood (nats per token) of the completion tokens of `seqs` under the
/// base with `adapters` (or the base alone), no dropout, `batch` sequences per forward: the
/// held-out "answer loss". Returns `(mean nll, scored tokens)`.
///
/// # Errors
/// Model errors; [`Error::InvalidParameter`] for no scored token.
pub fn completion_loss(
    base: &StudentModel,
    adapters: Option<(&LoraAdapters, &LoraConfig)>,
    cfg: &ModelConfig,
    seqs: &[CotSequence],
    seqlen: usize,
    pad: u32,
    batch: usize,
) -> Result<(f64, usize)> {
    let (mut total, mut n) = (0.0, 0usize);
    for chunk in seqs.chunks(batch.max(1)) {
        let refs: Vec<&CotSequence> = chunk.iter().collect();
        let b = completion_batch(&refs, seqlen, pad);
        if b.scored == 0 {
            continue;
        }
        let logits = match adapters {
            Some((a, lc)) => lora_forward(base, a, cfg, lc, &b.ids, false)?,
            None => base.forward(cfg, &b.ids, true)?,
        };
        total += scalar(cross_entropy_weighted(logits, &b.labels, &b.weights)?)? * b.scored as f64;
        n += b.scored;
    }
    if n == 0 {
        return Err(invalid("data", "no completion token to score"));
    }
    Ok((total / n as f64, n))
}

/// Trains `adapters` (on an autodiff device) on the frozen `base` (same device, weights not
/// requiring gradients: `StudentModel::no_grad`) for steps `start_step + 1 ..= tc.steps` with
/// Adam (fresh moments), minimizing the mean cross-entropy of the completion tokens
/// ([`completion_batch`]). Each step draws `batch_size` sequences from a seed derived from
/// `(seed, step)` (a resumed run sees the same batches); dropout masks come from the device's
/// generator seeded the same way. Calls `progress` after every step and
/// `checkpoint(step, &adapters)` every `checkpoint_every` steps (0: never) and after the last.
///
/// # Errors
/// [`Error::InvalidParameter`] for bad configs, no data, or a non-finite loss; model and
/// checkpoint errors.
#[allow(clippy::too_many_arguments)]
pub fn train_lora(
    base: &StudentModel,
    mut adapters: LoraAdapters,
    cfg: &ModelConfig,
    lc: &LoraConfig,
    data: &[CotSequence],
    pad: u32,
    tc: &LoraTrainConfig,
    start_step: usize,
    checkpoint_every: usize,
    progress: &mut dyn FnMut(&StepLog),
    checkpoint: &mut dyn FnMut(usize, &LoraAdapters) -> Result<()>,
) -> Result<(LoraAdapters, Vec<StepLog>)> {
    lc.validate()?;
    tc.validate()?;
    if data.is_empty() {
        return Err(invalid("data", "no training sequences"));
    }
    let device = base.embed.val().device();
    let mut optim = adam_config(tc.clip_norm).init();
    let mut log = Vec::new();
    for step in start_step + 1..=tc.steps {
        let t0 = Instant::now();
        let mut rng = step_rng(tc.seed, step);
        device.seed(rng.random());
        let picked: Vec<&CotSequence> = (0..tc.batch_size).map(|_| &data[rng.random_range(0..data.len())]).collect();
        let b = completion_batch(&picked, tc.seqlen, pad);
        let tokens = b.ids.len() * b.ids.first().map_or(0, Vec::len);
        let logits = lora_forward(base, &adapters, cfg, lc, &b.ids, true)?;
        let loss = cross_entropy_weighted(logits, &b.labels, &b.weights)?;
        let lv = loss_value(&loss, step)?;
        let grads = GradientsParams::from_grads(loss.backward(), &adapters);
        adapters = optim.step(tc.lr, adapters, grads);
        let row = StepLog { step, loss: lv, tokens, secs: t0.elapsed().as_secs_f64() };
        progress(&row);
        log.push(row);
        if step == tc.steps || (checkpoint_every > 0 && step % checkpoint_every == 0) {
            checkpoint(step, &adapters)?;
        }
    }
    Ok((adapters, log))
}
