//! Medusa-1 heads (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with
//! Multiple Decoding Heads", §2.1.1 and §2.2.1; reference implementation
//! github.com/FasterDecoding/Medusa): `K` extra heads on the frozen base model's final hidden
//! state, head `k` (1-based) predicting the token `k + 1` positions ahead.
//!
//! # The heads
//! At the position of token `x_t`, with final hidden state `h_t` `[H]` (after the last RMSNorm),
//! head `k` computes
//!
//! ```text
//! h_k = h_t + silu(W_k · h_t + b_k)          W_k: [H, H], b_k: [H]   (one ResBlock)
//! logits_k = LM_head(h_k)                    [V], predicts x_{t+1+k}
//! ```
//!
//! as the reference's `ResBlock.forward` and `MedusaModelABC.__init__`
//! (`medusa/model/medusa_model.py`: `nn.Sequential(ResBlock(hidden) * medusa_num_layers,
//! nn.Linear(hidden, vocab, bias=False))`). `ResBlock.__init__` zero-initialises
//! `linear.weight` (each head starts as the identity, i.e. as the base LM head) and leaves the
//! bias at `nn.Linear`'s default `U(±1/sqrt(H))`; [`MedusaModule::init`] does the same.
//!
//! Difference from the reference: there every head owns a trainable copy of the LM head
//! (`medusa_head.{k}.1.weight`, `[V, H]`, initialised from the base's); deco keeps the base's
//! own LM head frozen and shared by every head ([`MedusaConfig::shared_lm_head`], always true;
//! the issue allows "shared or own"). A heads directory therefore holds only the ResBlocks
//! (`K · (H² + H)` floats: 1.3 M for SmolLM2-135M's `H = 576`, `K = 4`, instead of
//! 1.3 M + 113 M), and one packed LM-head product serves all heads at inference.
//! Only `medusa_num_layers = 1` (the reference's default and its published heads) is supported.
//!
//! # Storage
//! A heads directory (written crash-safely, [`deco_formats::atomic::write_dir`]) holds
//! `config.json` ([`MedusaConfig`], the reference's `MedusaConfig` field names plus
//! `hidden_size`, `vocab_size`, `shared_lm_head`) and `medusa_lm_head.safetensors` (the
//! reference's file name) with, for `k = 0..K` (0-based as in the reference), the f32 tensors
//! `medusa_head.{k}.0.linear.weight` `[H, H]` (PyTorch `[out, in]`) and
//! `medusa_head.{k}.0.linear.bias` `[H]`.
//!
//! # Training (feature `train`)
//! Medusa-1: the base is frozen, its final hidden states are computed once per position
//! ([`collect_hidden`]) and the heads train on them with the loss of the paper's §2.2.1,
//! `L = Σ_k λ_k · CE(logits_k(h_t), x_{t+1+k})` with `λ_k = decay^(k-1)` (the paper: "λ_k as the
//! k-th power of a constant like 0.8"; `decay^(k-1)` is that times the constant `1/decay`, to
//! which Adam's updates are invariant; the reference's `train_legacy.py`
//! `CustomizedTrainer.compute_loss` weights every head 1, which is `decay = 1`). See `train`.
//! The number of heads is [`deco_generate::medusa::DraftHeads::num_heads`] (or
//! `config().medusa_num_heads`).

use std::collections::HashMap;
use std::path::Path;

use burn::module::{Module, Param};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::silu;
use burn::tensor::{Device, Tensor, TensorData};
use deco_model::decoder::LinearWeight;
use deco_model::{DenseKvCache, Llama, LogitsWanted, SeqInput};
use safetensors::tensor::{Dtype, TensorView};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result, invalid};

/// Configuration file of a heads directory (the reference's name).
pub const CONFIG_FILE: &str = "config.json";
/// Weights file of a heads directory (the reference's name).
pub const WEIGHTS_FILE: &str = "medusa_lm_head.safetensors";
/// Default number of heads (the issue's; the reference's `MedusaConfig` default is 5, its
/// training scripts use 3 to 5).
pub const DEFAULT_NUM_HEADS: usize = 4;
/// Default decay of the per-head loss weights, `λ_k = 0.8^(k-1)` (Cai et al. 2024 §2.2.1).
pub const DEFAULT_LOSS_DECAY: f64 = 0.8;

fn default_num_heads() -> usize {
    DEFAULT_NUM_HEADS
}
fn default_num_layers() -> usize {
    1
}
fn default_true() -> bool {
    true
}

/// Shape of a set of Medusa heads (`config.json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MedusaConfig {
    /// Number of heads `K` (the reference's `medusa_num_heads`).
    #[serde(default = "default_num_heads")]
    pub medusa_num_heads: usize,
    /// ResBlocks per head (the reference's `medusa_num_layers`); only 1 is supported.
    #[serde(default = "default_num_layers")]
    pub medusa_num_layers: usize,
    /// The base model's hidden size `H`.
    pub hidden_size: usize,
    /// The base model's vocabulary size `V`.
    pub vocab_size: usize,
    /// What the heads were trained on (informational).
    #[serde(default)]
    pub base_model_name_or_path: Option<String>,
    /// deco: every head ends in the base model's own frozen LM head (not stored). Heads with
    /// their own LM-head copies (the reference's `medusa_head.{k}.1.weight`) are refused.
    #[serde(default = "default_true")]
    pub shared_lm_head: bool,
}

impl MedusaConfig {
    /// `num_heads` heads of one ResBlock for a base of hidden size `hidden_size` and vocabulary
    /// `vocab_size`, sharing its LM head.
    pub fn new(num_heads: usize, hidden_size: usize, vocab_size: usize) -> Self {
        Self { medusa_num_heads: num_heads, medusa_num_layers: 1, hidden_size, vocab_size, base_model_name_or_path: None, shared_lm_head: true }
    }

    /// Checks what deco supports.
    ///
    /// # Errors
    /// [`Error::InvalidParameter`] for no heads, a number of layers other than 1, a zero
    /// hidden size or vocabulary, or heads with their own LM head.
    pub fn validate(&self) -> Result<()> {
        if self.medusa_num_heads == 0 {
            return Err(invalid("medusa_num_heads", "must be at least 1, got 0"));
        }
        if self.medusa_num_layers != 1 {
            return Err(invalid(
                "medusa_num_layers",
                format!("only 1 ResBlock per head is supported (the reference's default), got {}", self.medusa_num_layers),
            ));
        }
        if self.hidden_size == 0 || self.vocab_size == 0 {
            return Err(invalid("hidden_size", format!("hidden_size {} and vocab_size {} must be positive", self.hidden_size, self.vocab_size)));
        }
        if !self.shared_lm_head {
            return Err(invalid(
                "shared_lm_head",
                "is false: heads with their own LM-head copies (the reference's `medusa_head.{k}.1.weight`) are not supported; deco's heads share the base model's LM head",
            ));
        }
        Ok(())
    }

    /// Checks the heads fit a base of hidden size `hidden_size` and vocabulary `vocab_size`.
    ///
    /// # Errors
    /// [`Error::Shape`] naming both values.
    pub fn check_model(&self, hidden_size: usize, vocab_size: usize) -> Result<()> {
        if self.hidden_size != hidden_size {
            return Err(Error::Shape(format!("the Medusa heads have hidden size {}, the model has hidden size {hidden_size}", self.hidden_size)));
        }
        if self.vocab_size != vocab_size {
            return Err(Error::Shape(format!("the Medusa heads have vocabulary size {}, the model has vocabulary size {vocab_size}", self.vocab_size)));
        }
        Ok(())
    }
}

/// One head's ResBlock on the host, PyTorch layout.
#[derive(Debug, Clone, PartialEq)]
pub struct ResBlockWeights {
    /// `[H, H]` row-major, `[out, in]` (`z = W · h`).
    pub weight: Vec<f32>,
    /// `[H]`.
    pub bias: Vec<f32>,
}

impl ResBlockWeights {
    /// The identity block of the reference's initialisation with a zero bias (`W = 0`, `b = 0`).
    pub fn zeros(hidden: usize) -> Self {
        Self { weight: vec![0.0; hidden * hidden], bias: vec![0.0; hidden] }
    }

    /// `h + silu(W · h + b)` for one vector `h` `[H]` (f32, 8 partial sums per dot product).
    pub fn apply(&self, h: &[f32], out: &mut Vec<f32>) {
        let n = h.len();
        out.clear();
        out.extend(self.weight.chunks_exact(n).zip(&self.bias).zip(h).map(|((row, &b), &x)| {
            let mut acc = [0f32; 8];
            let (rc, rt) = row.split_at(n - n % 8);
            let (hc, ht) = h.split_at(n - n % 8);
            for (r8, h8) in rc.chunks_exact(8).zip(hc.chunks_exact(8)) {
                for ((a, r), x) in acc.iter_mut().zip(r8).zip(h8) {
                    *a += r * x;
                }
            }
            let mut z = acc.iter().sum::<f32>() + b;
            for (r, x) in rt.iter().zip(ht) {
                z += r * x;
            }
            x + z / (1.0 + (-z).exp())
        }));
    }
}

/// Medusa heads for inference: the ResBlocks on the host and the base model's LM head.
#[derive(Debug, Clone)]
pub struct MedusaHeads {
    config: MedusaConfig,
    blocks: Vec<ResBlockWeights>,
    lm_head: LinearWeight,
    device: Device,
}

impl MedusaHeads {
    /// Heads of `config` with `blocks` (one per head) on `model`'s LM head.
    ///
    /// # Errors
    /// An invalid `config`; heads for another hidden size or vocabulary than `model`'s
    /// (the message names both values); blocks of the wrong count or size.
    pub fn new(config: MedusaConfig, blocks: Vec<ResBlockWeights>, model: &Llama) -> Result<Self> {
        config.validate()?;
        config.check_model(model.config.hidden_size, model.config.vocab_size)?;
        let h = config.hidden_size;
        if blocks.len() != config.medusa_num_heads {
            return Err(Error::Shape(format!("{} ResBlocks for {} Medusa heads", blocks.len(), config.medusa_num_heads)));
        }
        if let Some((k, _)) = blocks.iter().enumerate().find(|(_, b)| b.weight.len() != h * h || b.bias.len() != h) {
            return Err(Error::Shape(format!("Medusa head {k}: ResBlock of {} weights and {} biases, expected {} and {h}", blocks[k].weight.len(), blocks[k].bias.len(), h * h)));
        }
        Ok(Self { config, blocks, lm_head: model.lm_head_weight(), device: model.device().clone() })
    }

    /// Reads a heads directory (module docs) for `model`.
    ///
    /// # Errors
    /// [`Error::Heads`] naming the file for a missing or unreadable file, bad JSON, an
    /// unsupported configuration, a missing tensor, a tensor of the wrong dtype or shape, or
    /// non-finite weights; [`Error::Shape`] for heads of another hidden size or vocabulary than
    /// `model`'s (naming both values).
    pub fn load(dir: &Path, model: &Llama) -> Result<Self> {
        let (config, blocks) = load_blocks(dir)?;
        config.check_model(model.config.hidden_size, model.config.vocab_size).map_err(|e| Error::Heads { path: dir.display().to_string(), msg: e.to_string() })?;
        Self::new(config, blocks, model)
    }

    /// Writes the heads directory `dir` crash-safely (module docs).
    ///
    /// # Errors
    /// [`Error::Io`] / [`Error::Heads`] on failure.
    pub fn save(&self, dir: &Path) -> Result<()> {
        save_blocks(dir, &self.config, &self.blocks, &[])
    }

    /// The configuration.
    pub fn config(&self) -> &MedusaConfig {
        &self.config
    }

    /// The ResBlocks, head 1 first.
    pub fn blocks(&self) -> &[ResBlockWeights] {
        &self.blocks
    }

    /// Logits of every head at one final hidden state `hidden` `[H]`: `K × [V]`, head 1 first.
    /// The ResBlocks run on the host; the `K` rows `h_k` then go through the LM head in one
    /// product (`[K, H] → [K, V]`; the packed kernels unpack each weight block once for all
    /// rows).
    ///
    /// # Errors
    /// [`Error::Shape`] for a wrong `hidden` length; the LM head's errors.
    pub fn head_logits(&self, hidden: &[f32]) -> Result<Vec<Vec<f32>>> {
        self.first_head_logits(hidden, self.blocks.len())
    }

    /// [`MedusaHeads::head_logits`] of heads `1..=heads` only (`min(heads, K) × [V]`, nothing
    /// for 0): the other ResBlocks and LM-head rows are not computed.
    ///
    /// # Errors
    /// As [`MedusaHeads::head_logits`].
    pub fn first_head_logits(&self, hidden: &[f32], heads: usize) -> Result<Vec<Vec<f32>>> {
        let h = self.config.hidden_size;
        if hidden.len() != h {
            return Err(Error::Shape(format!("a hidden state of {} values for Medusa heads of hidden size {h}", hidden.len())));
        }
        let k = heads.min(self.blocks.len());
        if k == 0 {
            return Ok(Vec::new());
        }
        // On the CPU, from outside the pool (the engine's thread between two tree forwards): on
        // a pool worker with the spinning team, as `Llama::forward` runs its pass, instead of a
        // rayon fork-join (a futex wake-up of the sleeping workers) per kernel call.
        deco_model::host::on_cpu_team(&self.device, || self.head_rows(hidden, k))
    }

    /// The logits of heads `1..=k` at `hidden` (`k` in `1..=K`): [`MedusaHeads::first_head_logits`]'s work.
    fn head_rows(&self, hidden: &[f32], k: usize) -> Result<Vec<Vec<f32>>> {
        let h = self.config.hidden_size;
        let mut rows = Vec::with_capacity(k * h);
        let mut tmp = Vec::with_capacity(h);
        for b in &self.blocks[..k] {
            b.apply(hidden, &mut tmp);
            rows.extend_from_slice(&tmp);
        }
        let x = Tensor::<2>::from_data(TensorData::new(rows, [k, h]), &self.device);
        let logits = deco_model::host::to_host_rows(self.lm_head.apply(x)?)?;
        if logits.len() != k || logits.iter().any(|r| r.len() != self.config.vocab_size) {
            return Err(Error::Shape(format!("the LM head returned {} rows for {k} heads", logits.len())));
        }
        Ok(logits)
    }
}

impl deco_generate::medusa::DraftHeads for MedusaHeads {
    fn num_heads(&self) -> usize {
        self.config.medusa_num_heads
    }

    fn head_logits(&self, hidden: &[f32]) -> deco_generate::Result<Vec<Vec<f32>>> {
        MedusaHeads::head_logits(self, hidden).map_err(generate_err)
    }

    fn first_head_logits(&self, hidden: &[f32], heads: usize) -> deco_generate::Result<Vec<Vec<f32>>> {
        MedusaHeads::first_head_logits(self, hidden, heads).map_err(generate_err)
    }
}

/// A heads error as the engine's error type.
fn generate_err(e: Error) -> deco_generate::GenerateError {
    match e {
        Error::Model(m) => deco_generate::GenerateError::Model(m),
        other => deco_generate::GenerateError::InvalidInput(other.to_string()),
    }
}

/// Tensor names of head `k` (0-based): `(weight, bias)`.
pub fn tensor_names(k: usize) -> (String, String) {
    (format!("medusa_head.{k}.0.linear.weight"), format!("medusa_head.{k}.0.linear.bias"))
}

/// Writes `config` and `blocks` as the heads directory `dir` crash-safely, with `extra` files
/// (name, bytes) in the same atomic step (`loss.csv`, `accuracy.json`).
///
/// # Errors
/// An invalid `config` or blocks of the wrong size; [`Error::Io`] / [`Error::Heads`].
pub fn save_blocks(dir: &Path, config: &MedusaConfig, blocks: &[ResBlockWeights], extra: &[(&str, &[u8])]) -> Result<()> {
    config.validate()?;
    let h = config.hidden_size;
    if blocks.len() != config.medusa_num_heads || blocks.iter().any(|b| b.weight.len() != h * h || b.bias.len() != h) {
        return Err(Error::Shape(format!("{} ResBlocks of the wrong size for {} heads of hidden size {h}", blocks.len(), config.medusa_num_heads)));
    }
    let herr = |msg: String| Error::Heads { path: dir.join(WEIGHTS_FILE).display().to_string(), msg };
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::with_capacity(2 * blocks.len());
    for (k, b) in blocks.iter().enumerate() {
        let (wn, bn) = tensor_names(k);
        tensors.push((wn, vec![h, h], crate::heads::f32_bytes(&b.weight)));
        tensors.push((bn, vec![h], crate::heads::f32_bytes(&b.bias)));
    }
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, s, d)| TensorView::new(Dtype::F32, s.clone(), d).map(|v| (n.clone(), v)))
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| herr(e.to_string()))?;
    let mut meta = HashMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    let bytes = safetensors::serialize(views, Some(meta)).map_err(|e| herr(e.to_string()))?;
    let json = serde_json::to_string_pretty(config).map_err(|e| Error::Heads { path: dir.join(CONFIG_FILE).display().to_string(), msg: e.to_string() })? + "\n";
    let mut files: Vec<(&str, &[u8])> = vec![(WEIGHTS_FILE, &bytes), (CONFIG_FILE, json.as_bytes())];
    files.extend_from_slice(extra);
    crate::heads::write_files(dir, &files)
}

/// Reads a heads directory's configuration and ResBlocks (no model needed).
///
/// # Errors
/// [`Error::Heads`] naming the file: missing / unreadable file, bad JSON, unsupported
/// configuration, missing tensor, wrong dtype or shape, non-finite weights.
pub fn load_blocks(dir: &Path) -> Result<(MedusaConfig, Vec<ResBlockWeights>)> {
    let herr = |p: &Path, msg: String| Error::Heads { path: p.display().to_string(), msg };
    let cpath = dir.join(CONFIG_FILE);
    let text = std::fs::read_to_string(&cpath).map_err(|e| herr(&cpath, format!("cannot read the Medusa config ({e})")))?;
    let config: MedusaConfig = serde_json::from_str(&text).map_err(|e| herr(&cpath, format!("invalid Medusa config: {e}")))?;
    config.validate().map_err(|e| herr(&cpath, e.to_string()))?;
    let wpath = dir.join(WEIGHTS_FILE);
    let bytes = std::fs::read(&wpath).map_err(|e| herr(&wpath, format!("cannot read the Medusa weights ({e})")))?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| herr(&wpath, format!("not a safetensors file: {e}")))?;
    let h = config.hidden_size;
    let get = |name: &str, shape: &[usize]| -> Result<Vec<f32>> {
        let t = st.tensor(name).map_err(|_| herr(&wpath, format!("missing tensor `{name}`")))?;
        if t.dtype() != Dtype::F32 {
            return Err(herr(&wpath, format!("tensor `{name}` is {:?}, expected F32", t.dtype())));
        }
        if t.shape() != shape {
            return Err(herr(&wpath, format!("tensor `{name}` has shape {:?}, expected {shape:?}", t.shape())));
        }
        let v: Vec<f32> = t.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        if v.iter().any(|x| !x.is_finite()) {
            return Err(herr(&wpath, format!("tensor `{name}` has non-finite values")));
        }
        Ok(v)
    };
    let mut blocks = Vec::with_capacity(config.medusa_num_heads);
    for k in 0..config.medusa_num_heads {
        let (wn, bn) = tensor_names(k);
        blocks.push(ResBlockWeights { weight: get(&wn, &[h, h])?, bias: get(&bn, &[h])? });
    }
    Ok((config, blocks))
}

// ---------------------------------------------------------------------------------------------
// The burn module (training and batched evaluation).

/// The reference's `ResBlock`: `x + silu(linear(x))`, `linear: [H → H]` with bias.
#[derive(Module, Debug)]
pub struct ResBlock {
    /// `nn.Linear(H, H)` (burn layout: weight `[in, out]`).
    pub linear: Linear,
}

impl ResBlock {
    /// `x + silu(linear(x))`.
    ///
    /// # Shapes
    /// `[n, H] → [n, H]`
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        x.clone() + silu(self.linear.forward(x))
    }
}

/// The `K` ResBlocks of a set of Medusa heads (the LM head is the base's, outside the module).
#[derive(Module, Debug)]
pub struct MedusaModule {
    /// One block per head, head 1 first.
    pub blocks: Vec<ResBlock>,
}

impl MedusaModule {
    /// Fresh heads as the reference's `ResBlock.__init__`: zero weight, bias
    /// `U(±1/sqrt(H))` (`nn.Linear`'s default), on `device` (seed it first for reproducible
    /// biases; use an autodiff device to train).
    ///
    /// # Errors
    /// An invalid `config`.
    pub fn init(config: &MedusaConfig, device: &Device) -> Result<Self> {
        config.validate()?;
        let h = config.hidden_size;
        let bound = 1.0 / (h as f64).sqrt();
        let blocks = (0..config.medusa_num_heads)
            .map(|_| {
                let mut l = LinearConfig::new(h, h).with_initializer(burn::nn::Initializer::Uniform { min: -bound, max: bound }).init(device);
                l.weight = Param::from_tensor(Tensor::zeros([h, h], device));
                ResBlock { linear: l }
            })
            .collect();
        Ok(Self { blocks })
    }

    /// The module of host `blocks` on `device`.
    pub fn from_blocks(blocks: &[ResBlockWeights], hidden: usize, device: &Device) -> Self {
        let blocks = blocks
            .iter()
            .map(|b| {
                // PyTorch [out, in] -> burn [in, out].
                let w = deco_model::host::transpose(&b.weight, hidden, hidden);
                ResBlock {
                    linear: Linear {
                        weight: Param::from_tensor(Tensor::from_data(TensorData::new(w, [hidden, hidden]), device)),
                        bias: Some(Param::from_tensor(Tensor::from_data(TensorData::new(b.bias.clone(), [hidden]), device))),
                    },
                }
            })
            .collect();
        Self { blocks }
    }

    /// Copies the blocks to the host (PyTorch layout).
    ///
    /// # Errors
    /// [`Error::TensorRead`].
    pub fn to_blocks(&self) -> Result<Vec<ResBlockWeights>> {
        self.blocks
            .iter()
            .map(|b| {
                let w = b.linear.weight.val();
                let [d_in, d_out] = w.dims();
                let w = w.detach().try_into_vec_as::<f32>().map_err(|e| Error::TensorRead(format!("{e:?}")))?;
                let bias = match &b.linear.bias {
                    Some(p) => p.val().detach().try_into_vec_as::<f32>().map_err(|e| Error::TensorRead(format!("{e:?}")))?,
                    None => vec![0.0; d_out],
                };
                Ok(ResBlockWeights { weight: deco_model::host::transpose(&w, d_in, d_out), bias })
            })
            .collect()
    }

    /// Every head's logits for a batch, stacked head-major: rows `k·n .. (k+1)·n` are head
    /// `k + 1`'s.
    ///
    /// # Shapes
    /// - `hidden`: `[n, H]`, `lm_head`: `[H, V]` (`model.lm_head()`)
    /// - output: `[K·n, V]`
    pub fn logits(&self, hidden: Tensor<2>, lm_head: Tensor<2>) -> Tensor<2> {
        let ys: Vec<Tensor<2>> = self.blocks.iter().map(|b| b.forward(hidden.clone())).collect();
        Tensor::cat(ys, 0).matmul(lm_head)
    }
}

// ---------------------------------------------------------------------------------------------
// Data: the frozen base's hidden states on (prompt, response) sequences.

/// One training sequence: a prompt followed by a (self-distilled) response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MedusaSequence {
    /// Prompt then response ids.
    pub tokens: Vec<u32>,
    /// Index in `tokens` of the first response token.
    pub response_start: usize,
}

/// Final hidden states of the frozen base at the training positions of a set of sequences.
///
/// The positions of a sequence are `t = response_start - 1 ..= len - 2`, those whose next token
/// (the base head's target) is a response token; head `k` at position `t` targets
/// `x_{t+1+k}` when it exists ([`MedusaPool::target`]). (The reference's labels also keep
/// prompt positions whose `k`-ahead token is a response token, a few per sequence; deco starts
/// at the first position Medusa decoding reads, the prompt's last.)
#[derive(Debug, Clone, Default)]
pub struct MedusaPool {
    /// Hidden size `H`.
    pub hidden_size: usize,
    /// `[n, H]` row-major.
    pub hidden: Vec<f32>,
    /// `[n]`: (sequence index, position `t`).
    pub positions: Vec<(u32, u32)>,
    /// The sequences' tokens.
    pub sequences: Vec<Vec<u32>>,
}

impl MedusaPool {
    /// Number of positions.
    pub fn len(&self) -> usize {
        self.positions.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }

    /// Head `k`'s (1-based) target at position row `i`: `x_{t+1+k}`, if within the sequence.
    pub fn target(&self, i: usize, k: usize) -> Option<u32> {
        let (s, t) = self.positions[i];
        self.sequences[s as usize].get(t as usize + 1 + k).copied()
    }

    /// Hidden rows of positions `rows`, `[rows.len(), H]` row-major.
    pub fn gather(&self, rows: &[usize]) -> Vec<f32> {
        let h = self.hidden_size;
        let mut x = Vec::with_capacity(rows.len() * h);
        for &r in rows {
            x.extend_from_slice(&self.hidden[r * h..(r + 1) * h]);
        }
        x
    }
}

/// Runs the frozen base over each sequence (one forward each, `LogitsWanted::All`) and keeps the
/// final hidden states of its training positions ([`MedusaPool`]). Sequences longer than the
/// model's context or with an empty response are skipped. `progress(done, total)` after each.
///
/// # Errors
/// Model errors; [`Error::Data`] for a `response_start` of 0 or beyond the sequence, or when no
/// sequence yields a position.
pub fn collect_hidden(model: &Llama, seqs: &[MedusaSequence], progress: &mut dyn FnMut(usize, usize)) -> Result<MedusaPool> {
    let h = model.config.hidden_size;
    let mut pool = MedusaPool { hidden_size: h, ..Default::default() };
    for (si, s) in seqs.iter().enumerate() {
        if s.response_start == 0 || s.response_start > s.tokens.len() {
            return Err(Error::Data(format!("sequence {si}: response start {} outside 1..={}", s.response_start, s.tokens.len())));
        }
        if s.tokens.len() > model.max_context() || s.response_start == s.tokens.len() {
            progress(si + 1, seqs.len());
            continue;
        }
        let mut cache = DenseKvCache::new(model.num_layers());
        let out = model.forward(&[SeqInput { seq: 0, tokens: &s.tokens, tree: None }], &mut cache, LogitsWanted::All)?;
        let first = s.response_start - 1;
        let last = s.tokens.len() - 2; // the last position with a next token
        let idx = pool.sequences.len() as u32;
        if last >= first {
            let hid = deco_model::host::to_host(out.hidden.slice([first..last + 1, 0..h]))?;
            pool.hidden.extend_from_slice(&hid);
            pool.positions.extend((first..=last).map(|t| (idx, t as u32)));
        }
        pool.sequences.push(s.tokens.clone());
        progress(si + 1, seqs.len());
    }
    if pool.is_empty() {
        return Err(Error::Data("no response positions in the Medusa training sequences".into()));
    }
    Ok(pool)
}

// ---------------------------------------------------------------------------------------------
// Evaluation.

/// Held-out accuracy of one head.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct HeadAccuracy {
    /// Head `k` (1-based): predicts the token `k + 1` ahead.
    pub head: usize,
    /// Positions with a target.
    pub positions: usize,
    /// Fraction whose argmax is the target.
    pub top1: f64,
    /// Fraction whose 5 most likely tokens hold the target.
    pub top5: f64,
    /// Mean cross-entropy (nats).
    pub loss: f64,
}

/// Rank of `target` in `row` (0 = the argmax; ties count against the target).
fn rank_of(row: &[f32], target: usize) -> usize {
    let v = row[target];
    row.iter().enumerate().filter(|&(i, &x)| x > v || (x == v && i < target)).count()
}

/// Per-head top-1 / top-5 accuracy and cross-entropy of `heads` on positions `rows` of `pool`
/// (batches of 64 positions), with the frozen LM head `lm_head` `[H, V]` on `device`.
///
/// # Errors
/// [`Error::Shape`] for a pool / LM head of another hidden size; [`Error::TensorRead`].
pub fn evaluate(heads: &MedusaModule, pool: &MedusaPool, rows: &[usize], lm_head: &Tensor<2>, device: &Device) -> Result<Vec<HeadAccuracy>> {
    let k_heads = heads.blocks.len();
    let h = pool.hidden_size;
    let [lh, v] = lm_head.dims();
    if lh != h {
        return Err(Error::Shape(format!("the LM head has hidden size {lh}, the hidden states {h}")));
    }
    let mut n = vec![0usize; k_heads];
    let mut top1 = vec![0usize; k_heads];
    let mut top5 = vec![0usize; k_heads];
    let mut ce = vec![0f64; k_heads];
    for chunk in rows.chunks(64) {
        let x = Tensor::<2>::from_data(TensorData::new(pool.gather(chunk), [chunk.len(), h]), device);
        let logits = heads.logits(x, lm_head.clone()).detach().try_into_vec_as::<f32>().map_err(|e| Error::TensorRead(format!("{e:?}")))?;
        for k in 0..k_heads {
            for (j, &r) in chunk.iter().enumerate() {
                let Some(y) = pool.target(r, k + 1) else { continue };
                let row = &logits[(k * chunk.len() + j) * v..(k * chunk.len() + j + 1) * v];
                let rank = rank_of(row, y as usize);
                n[k] += 1;
                top1[k] += usize::from(rank == 0);
                top5[k] += usize::from(rank < 5);
                let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                let lse = f64::from(m) + row.iter().map(|&x| f64::from(x - m).exp()).sum::<f64>().ln();
                ce[k] += lse - f64::from(row[y as usize]);
            }
        }
    }
    Ok((0..k_heads)
        .map(|k| {
            let d = n[k].max(1) as f64;
            HeadAccuracy { head: k + 1, positions: n[k], top1: top1[k] as f64 / d, top5: top5[k] as f64 / d, loss: ce[k] / d }
        })
        .collect())
}

#[cfg(feature = "train")]
pub use training::*;

#[cfg(feature = "train")]
mod training {
    use burn::module::Module;
    use burn::optim::{AdamConfig, GradientsParams};
    use burn::tensor::activation::log_softmax;
    use burn::tensor::{Int, Tensor, TensorData};
    use rand::seq::SliceRandom;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::{DEFAULT_LOSS_DECAY, HeadAccuracy, MedusaConfig, MedusaModule, MedusaPool, ResBlockWeights, evaluate};
    use crate::error::{Error, Result, invalid};

    /// Training options (the reference's names where it has one).
    #[derive(Debug, Clone, PartialEq)]
    pub struct MedusaTrainConfig {
        /// Optimizer steps.
        pub steps: usize,
        /// Positions per step (every head sees all of them).
        pub batch_size: usize,
        /// Adam learning rate (the reference's scripts: 1e-3).
        pub learning_rate: f64,
        /// `λ_k = loss_decay^(k-1)` (paper §2.2.1: 0.8; the reference's `train_legacy.py`: 1).
        pub loss_decay: f64,
        /// Seed of the biases' initialisation and the position sampling.
        pub seed: u64,
        /// Held-out evaluation period in steps (0: only at the start and the end).
        pub eval_every: usize,
        /// Held-out positions evaluated during training (the final evaluation takes all).
        pub max_heldout: usize,
    }

    impl Default for MedusaTrainConfig {
        fn default() -> Self {
            Self { steps: 300, batch_size: 64, learning_rate: 1e-3, loss_decay: DEFAULT_LOSS_DECAY, seed: 0, eval_every: 50, max_heldout: 512 }
        }
    }

    impl MedusaTrainConfig {
        /// Checks the ranges.
        ///
        /// # Errors
        /// [`Error::InvalidParameter`] naming the parameter.
        pub fn validate(&self) -> Result<()> {
            if self.steps == 0 {
                return Err(invalid("steps", "must be at least 1"));
            }
            if self.batch_size == 0 {
                return Err(invalid("batch_size", "must be at least 1"));
            }
            if !(self.learning_rate.is_finite() && self.learning_rate > 0.0) {
                return Err(invalid("learning_rate", format!("must be a positive number, got {}", self.learning_rate)));
            }
            if !(self.loss_decay.is_finite() && self.loss_decay > 0.0 && self.loss_decay <= 1.0) {
                return Err(invalid("loss_decay", format!("must be in (0, 1], got {}", self.loss_decay)));
            }
            Ok(())
        }
    }

    /// One row of the training log.
    #[derive(Debug, Clone, PartialEq)]
    pub struct MedusaLogRow {
        /// Step (1-based; 0 = before training, held-out only).
        pub step: usize,
        /// `Σ_k λ_k · CE_k` of this step's batch (NaN at step 0).
        pub loss: f64,
        /// Per-head training cross-entropy of the batch (empty at step 0).
        pub head_loss: Vec<f64>,
        /// Held-out accuracy when evaluated at this step.
        pub heldout: Option<Vec<HeadAccuracy>>,
    }

    /// The CSV header of [`log_csv`] for `k` heads.
    pub fn log_csv_header(k: usize) -> String {
        let mut s = String::from("step,loss");
        for i in 1..=k {
            s.push_str(&format!(",loss_head{i}"));
        }
        for i in 1..=k {
            s.push_str(&format!(",heldout_loss_head{i}"));
        }
        for i in 1..=k {
            s.push_str(&format!(",heldout_top1_head{i}"));
        }
        s
    }

    /// The training log as CSV (`step,loss,loss_head1..K,heldout_loss_head1..K,
    /// heldout_top1_head1..K`; empty cells where not measured).
    pub fn log_csv(log: &[MedusaLogRow], k: usize) -> String {
        let f = |x: f64| if x.is_nan() { String::new() } else { format!("{x:.6}") };
        let mut s = log_csv_header(k) + "\n";
        for r in log {
            s.push_str(&format!("{},{}", r.step, f(r.loss)));
            for i in 0..k {
                s.push_str(&format!(",{}", r.head_loss.get(i).map_or(String::new(), |&x| f(x))));
            }
            for i in 0..k {
                s.push_str(&format!(",{}", r.heldout.as_ref().and_then(|h| h.get(i)).map_or(String::new(), |a| f(a.loss))));
            }
            for i in 0..k {
                s.push_str(&format!(",{}", r.heldout.as_ref().and_then(|h| h.get(i)).map_or(String::new(), |a| f(a.top1))));
            }
            s.push('\n');
        }
        s
    }

    /// Parses a log written by [`log_csv`] for `k` heads (a checkpoint's `loss.csv`, read back by
    /// a resumed run). Writing the parsed rows again gives the same text; the held-out
    /// `positions` and `top5`, which the CSV does not hold, come back as 0 and NaN.
    ///
    /// # Errors
    /// [`Error::Data`] for another header, a row with the wrong number of fields or a field
    /// that is not a number.
    pub fn parse_log_csv(text: &str, k: usize) -> Result<Vec<MedusaLogRow>> {
        let mut lines = text.lines();
        let header = log_csv_header(k);
        if lines.next() != Some(header.as_str()) {
            return Err(Error::Data(format!("the Medusa log does not start with `{header}`")));
        }
        let num = |f: &str| -> Result<f64> {
            if f.is_empty() { Ok(f64::NAN) } else { f.parse::<f64>().map_err(|_| Error::Data(format!("`{f}` in the Medusa log is not a number"))) }
        };
        let mut rows = Vec::new();
        for (i, line) in lines.enumerate() {
            let f: Vec<&str> = line.split(',').collect();
            if f.len() != 2 + 3 * k {
                return Err(Error::Data(format!("row {} of the Medusa log has {} fields, expected {}", i + 1, f.len(), 2 + 3 * k)));
            }
            let step = f[0].parse::<usize>().map_err(|_| Error::Data(format!("row {} of the Medusa log: step `{}`", i + 1, f[0])))?;
            let loss = num(f[1])?;
            let head_loss = if step == 0 { Vec::new() } else { f[2..2 + k].iter().map(|x| num(x)).collect::<Result<Vec<_>>>()? };
            let held: Vec<(f64, f64)> = (0..k).map(|j| Ok((num(f[2 + k + j])?, num(f[2 + 2 * k + j])?))).collect::<Result<_>>()?;
            let heldout = held.iter().any(|(l, t)| !l.is_nan() || !t.is_nan()).then(|| {
                held.iter().enumerate().map(|(j, &(loss, top1))| HeadAccuracy { head: j + 1, positions: 0, top1, top5: f64::NAN, loss }).collect()
            });
            rows.push(MedusaLogRow { step, loss, head_loss, heldout });
        }
        Ok(rows)
    }

    /// Where a resumed [`train_from`] starts.
    #[derive(Debug, Clone)]
    pub struct MedusaResume {
        /// Optimizer steps already done.
        pub step: usize,
        /// The heads after `step` steps (a checkpoint's).
        pub blocks: Vec<ResBlockWeights>,
    }

    /// Trains fresh Medusa-1 heads (`config`) on `train` positions with Adam, evaluating on
    /// `heldout` positions, and returns the heads (host copy) and the log. `lm_head` is the
    /// base's `[H, V]` LM head (`model.lm_head()`, dequantized f32) on `device`, the base's
    /// device; training runs on its autodiff wrapper with the LM head as a constant.
    ///
    /// Each step draws `batch_size` positions uniformly (seeded), runs every ResBlock on their
    /// hidden states, the `K·B` rows through the LM head, and minimises
    /// `Σ_k λ_k · mean_{positions with x_{t+1+k}} CE(logits_k, x_{t+1+k})`,
    /// `λ_k = loss_decay^(k-1)` (Cai et al. 2024 §2.2.1; the reference's
    /// `medusa/train/train_legacy.py` `CustomizedTrainer.compute_loss` has the same
    /// per-head mean cross-entropy with `λ_k = 1`).
    ///
    /// # Errors
    /// Invalid `tc` / `config`; an empty pool; a hidden size or vocabulary differing between
    /// pool, config and LM head; device read failures.
    pub fn train(
        config: &MedusaConfig,
        tc: &MedusaTrainConfig,
        train: &MedusaPool,
        heldout: &MedusaPool,
        lm_head: &Tensor<2>,
        device: &burn::tensor::Device,
        progress: &mut dyn FnMut(&MedusaLogRow),
    ) -> Result<(Vec<ResBlockWeights>, Vec<MedusaLogRow>)> {
        train_from(config, tc, train, heldout, lm_head, device, None, 0, progress, &mut |_, _| Ok(()))
    }

    /// [`train`], optionally continued from a checkpoint (`resume`), handing the heads to
    /// `save` every `checkpoint_every` steps and after the last one (`checkpoint_every` 0:
    /// never).
    ///
    /// A resumed run draws the same batches as the uninterrupted run would (the position draws
    /// of the steps already done are replayed), so with the same pool it trains on the same
    /// positions; its Adam moments restart from zero, since a checkpoint holds the heads only
    /// (as `deco autodeco train`'s and `deco distill`'s do). The returned log holds the steps
    /// after `resume.step` only (no step-0 evaluation).
    ///
    /// # Errors
    /// Those of [`train`]; [`Error::InvalidParameter`] for a checkpoint past `tc.steps` or of
    /// other shapes; the errors of `save`.
    #[allow(clippy::too_many_arguments)]
    pub fn train_from(
        config: &MedusaConfig,
        tc: &MedusaTrainConfig,
        train: &MedusaPool,
        heldout: &MedusaPool,
        lm_head: &Tensor<2>,
        device: &burn::tensor::Device,
        resume: Option<MedusaResume>,
        checkpoint_every: usize,
        progress: &mut dyn FnMut(&MedusaLogRow),
        save: &mut dyn FnMut(usize, &[ResBlockWeights]) -> Result<()>,
    ) -> Result<(Vec<ResBlockWeights>, Vec<MedusaLogRow>)> {
        tc.validate()?;
        config.validate()?;
        if train.is_empty() {
            return Err(Error::Data("no training positions".into()));
        }
        let h = config.hidden_size;
        let [lh, v] = lm_head.dims();
        if train.hidden_size != h || lh != h || v != config.vocab_size {
            return Err(Error::Shape(format!(
                "hidden states of size {}, LM head [{lh}, {v}], heads for hidden size {h} and vocabulary {}",
                train.hidden_size, config.vocab_size
            )));
        }
        let k_heads = config.medusa_num_heads;
        let ad = device.clone().autodiff();
        ad.seed(tc.seed);
        let start = resume.as_ref().map_or(0, |r| r.step);
        let mut heads = MedusaModule::init(config, &ad)?;
        if let Some(r) = &resume {
            if r.step > tc.steps {
                return Err(invalid("resume", format!("the checkpoint is at step {}, beyond steps {}", r.step, tc.steps)));
            }
            if r.blocks.len() != k_heads || r.blocks.iter().any(|b| b.weight.len() != h * h || b.bias.len() != h) {
                return Err(invalid("resume", format!("the checkpoint's heads do not match {k_heads} heads of hidden size {h}")));
            }
            if r.step == tc.steps {
                return Ok((r.blocks.clone(), Vec::new()));
            }
            heads = MedusaModule::from_blocks(&r.blocks, h, &ad);
        }
        let lm_host = lm_head.clone().try_into_vec_as::<f32>().map_err(|e| Error::TensorRead(format!("{e:?}")))?;
        let lm_ad = Tensor::<2>::from_data(TensorData::new(lm_host, [h, v]), &ad);
        let lambda: Vec<f64> = (0..k_heads).map(|k| tc.loss_decay.powi(k as i32)).collect();
        let mut optim = AdamConfig::new().init();
        let mut rng = ChaCha8Rng::seed_from_u64(tc.seed);
        let mut held_rows: Vec<usize> = (0..heldout.len()).collect();
        held_rows.shuffle(&mut ChaCha8Rng::seed_from_u64(tc.seed ^ 0x5eed));
        held_rows.truncate(tc.max_heldout);
        let eval = |m: &MedusaModule| -> Result<Option<Vec<HeadAccuracy>>> {
            if held_rows.is_empty() {
                return Ok(None);
            }
            evaluate(m, heldout, &held_rows, lm_head, device).map(Some)
        };
        let mut log = Vec::with_capacity(tc.steps + 1 - start);
        let b = tc.batch_size;
        if resume.is_none() {
            let row0 = MedusaLogRow { step: 0, loss: f64::NAN, head_loss: Vec::new(), heldout: eval(&heads.valid())? };
            progress(&row0);
            log.push(row0);
        }
        for _ in 1..=start {
            for _ in 0..b {
                rng.random_range(0..train.len());
            }
        }
        for step in start + 1..=tc.steps {
            let rows: Vec<usize> = (0..b).map(|_| rng.random_range(0..train.len())).collect();
            // Targets and weights, head-major like `MedusaModule::logits`.
            let mut idx = Vec::with_capacity(k_heads * b);
            let mut valid = Vec::with_capacity(k_heads * b);
            let mut weight = Vec::with_capacity(k_heads * b);
            let mut counts = vec![0usize; k_heads];
            for (k, count) in counts.iter_mut().enumerate() {
                for &r in &rows {
                    let t = train.target(r, k + 1);
                    *count += usize::from(t.is_some());
                    idx.push(i64::from(t.unwrap_or(0)));
                    valid.push(if t.is_some() { 1f32 } else { 0.0 });
                }
                for j in 0..b {
                    weight.push(valid[k * b + j] * (lambda[k] / (*count).max(1) as f64) as f32);
                }
            }
            let x = Tensor::<2>::from_data(TensorData::new(train.gather(&rows), [b, h]), &ad);
            let logits = heads.logits(x, lm_ad.clone()); // [K·B, V]
            let idx = Tensor::<2, Int>::from_data(TensorData::new(idx, [k_heads * b, 1]), &ad);
            let nll = -log_softmax(logits, 1).gather(1, idx); // [K·B, 1]
            let w = Tensor::<2>::from_data(TensorData::new(weight, [k_heads * b, 1]), &ad);
            let loss = (nll.clone() * w).sum();
            // Per-head mean cross-entropy for the log.
            let nll_host = nll.detach().try_into_vec_as::<f32>().map_err(|e| Error::TensorRead(format!("{e:?}")))?;
            let head_loss: Vec<f64> = (0..k_heads)
                .map(|k| {
                    let s: f64 = (0..b).map(|j| f64::from(nll_host[k * b + j] * valid[k * b + j])).sum();
                    if counts[k] == 0 { f64::NAN } else { s / counts[k] as f64 }
                })
                .collect();
            let total: f64 = head_loss.iter().zip(&lambda).filter(|(l, _)| !l.is_nan()).map(|(l, w)| l * w).sum();
            let grads = GradientsParams::from_grads(loss.backward(), &heads);
            heads = optim.step(tc.learning_rate, heads, grads);
            let heldout_acc = if step == tc.steps || (tc.eval_every > 0 && step % tc.eval_every == 0) { eval(&heads.valid())? } else { None };
            let row = MedusaLogRow { step, loss: total, head_loss, heldout: heldout_acc };
            progress(&row);
            log.push(row);
            if checkpoint_every > 0 && (step % checkpoint_every == 0 || step == tc.steps) {
                save(step, &heads.valid().to_blocks()?)?;
            }
        }
        Ok((heads.valid().to_blocks()?, log))
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use deco_formats::checkpoint::Checkpoint;

    use super::*;

    fn tiny() -> Llama {
        let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/data/tiny/llama3"));
        Llama::load(&Checkpoint::open(&dir).expect("open"), &Device::flex(), Some(256)).expect("load")
    }

    fn random_blocks(k: usize, h: usize, seed: u64) -> Vec<ResBlockWeights> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..k)
            .map(|_| ResBlockWeights {
                weight: (0..h * h).map(|_| rng.random_range(-0.5f32..0.5)).collect(),
                bias: (0..h).map(|_| rng.random_range(-0.5f32..0.5)).collect(),
            })
            .collect()
    }

    fn hidden_of(model: &Llama, tokens: &[u32]) -> Vec<f32> {
        let mut cache = DenseKvCache::new(model.num_layers());
        let out = model.forward(&[SeqInput { seq: 0, tokens, tree: None }], &mut cache, LogitsWanted::Last).expect("forward");
        deco_model::host::to_host(out.hidden).expect("host")
    }

    /// `head_logits` against an independent f64 evaluation of `h + silu(W h + b)` followed by
    /// the dense LM head. Tolerance: `1e-4 · (1 + |reference|)` (f32 products of length 32).
    #[test]
    fn head_logits_match_f64_formula() {
        let model = tiny();
        let (h, v) = (model.config.hidden_size, model.config.vocab_size);
        let cfg = MedusaConfig::new(3, h, v);
        let blocks = random_blocks(3, h, 7);
        let heads = MedusaHeads::new(cfg, blocks.clone(), &model).expect("heads");
        let hid = hidden_of(&model, &[1, 5, 9, 13]);
        let got = heads.head_logits(&hid).expect("logits");
        let lm = deco_model::host::to_host(model.lm_head().clone()).expect("lm"); // [H, V]
        assert_eq!(got.len(), 3);
        for (k, b) in blocks.iter().enumerate() {
            let hk: Vec<f64> = (0..h)
                .map(|o| {
                    let z = f64::from(b.bias[o]) + (0..h).map(|i| f64::from(b.weight[o * h + i]) * f64::from(hid[i])).sum::<f64>();
                    f64::from(hid[o]) + z / (1.0 + (-z).exp())
                })
                .collect();
            for j in 0..v {
                let r: f64 = (0..h).map(|i| hk[i] * f64::from(lm[i * v + j])).sum();
                let g = f64::from(got[k][j]);
                assert!((g - r).abs() <= 1e-4 * (1.0 + r.abs()), "head {k} token {j}: {g} vs {r}");
            }
        }
        // The first two heads alone: the same rows (same tolerance), head 3 not computed.
        let two = heads.first_head_logits(&hid, 2).expect("two heads");
        assert_eq!(two.len(), 2);
        for (a, b) in two.iter().flatten().zip(got.iter().flatten()) {
            assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{a} vs {b}");
        }
        assert_eq!(heads.first_head_logits(&hid, 9).expect("all heads").len(), 3);
        assert!(heads.first_head_logits(&hid, 0).expect("no head").is_empty());
    }

    /// `W = 0, b = 0`: every head is the identity and gives the base model's next-token logits.
    #[test]
    fn zero_heads_give_base_logits() {
        let model = tiny();
        let (h, v) = (model.config.hidden_size, model.config.vocab_size);
        let heads = MedusaHeads::new(MedusaConfig::new(4, h, v), vec![ResBlockWeights::zeros(h); 4], &model).expect("heads");
        let tokens = [3u32, 1, 4, 1, 5];
        let mut cache = DenseKvCache::new(model.num_layers());
        let out = model.forward(&[SeqInput { seq: 0, tokens: &tokens, tree: None }], &mut cache, LogitsWanted::Last).expect("forward");
        let hid = deco_model::host::to_host(out.hidden).expect("host");
        let base = deco_model::host::to_host(out.logits).expect("host");
        let got = heads.head_logits(&hid).expect("logits");
        for row in &got {
            assert_eq!(row, &got[0], "every zero head gives the same row");
            let max_err = row.iter().zip(&base).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(max_err <= 1e-6, "zero heads differ from the base logits by {max_err}");
        }
        // Bit-exact against the same LM-head product on the one row.
        let one = model.lm_head_weight().apply(Tensor::<2>::from_data(TensorData::new(hid.clone(), [1, h]), model.device())).expect("apply");
        assert_eq!(deco_model::host::to_host(one).expect("host"), got[0]);
    }

    #[test]
    fn save_load_round_trip_is_bit_exact() {
        let model = tiny();
        let (h, v) = (model.config.hidden_size, model.config.vocab_size);
        let mut cfg = MedusaConfig::new(2, h, v);
        cfg.base_model_name_or_path = Some("tiny-llama3".into());
        let heads = MedusaHeads::new(cfg.clone(), random_blocks(2, h, 3), &model).expect("heads");
        let tmp = tempfile::tempdir().expect("tmp");
        let dir = tmp.path().join("medusa");
        heads.save(&dir).expect("save");
        let back = MedusaHeads::load(&dir, &model).expect("load");
        assert_eq!(back.config(), &cfg);
        for (a, b) in back.blocks().iter().zip(heads.blocks()) {
            assert_eq!(a.weight.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), b.weight.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
            assert_eq!(a.bias.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), b.bias.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
        }
        let names: Vec<String> = {
            let bytes = std::fs::read(dir.join(WEIGHTS_FILE)).expect("read");
            let st = safetensors::SafeTensors::deserialize(&bytes).expect("st");
            let mut n: Vec<String> = st.names().into_iter().map(str::to_string).collect();
            n.sort();
            n
        };
        assert_eq!(names, ["medusa_head.0.0.linear.bias", "medusa_head.0.0.linear.weight", "medusa_head.1.0.linear.bias", "medusa_head.1.0.linear.weight"]);
        // The module round trip (burn layout and back) is exact too.
        let m = MedusaModule::from_blocks(heads.blocks(), h, &Device::flex());
        assert_eq!(m.to_blocks().expect("blocks"), heads.blocks());
    }

    #[test]
    fn bad_heads_are_refused_with_clear_errors() {
        let model = tiny();
        let (h, v) = (model.config.hidden_size, model.config.vocab_size);
        let tmp = tempfile::tempdir().expect("tmp");
        // Another hidden size.
        let other = tmp.path().join("other");
        save_blocks(&other, &MedusaConfig::new(2, h + 8, v), &vec![ResBlockWeights::zeros(h + 8); 2], &[]).expect("save");
        let e = MedusaHeads::load(&other, &model).expect_err("must refuse").to_string();
        assert!(e.contains(&format!("hidden size {}", h + 8)) && e.contains(&format!("hidden size {h}")), "{e}");
        // No heads.
        let e = MedusaConfig::new(0, h, v).validate().expect_err("0 heads").to_string();
        assert!(e.contains("medusa_num_heads"), "{e}");
        let zero = tmp.path().join("zero");
        std::fs::create_dir_all(&zero).expect("mkdir");
        std::fs::write(zero.join(CONFIG_FILE), serde_json::to_string(&MedusaConfig::new(0, h, v)).expect("json")).expect("write");
        let e = MedusaHeads::load(&zero, &model).expect_err("0 heads").to_string();
        assert!(e.contains("medusa_num_heads") && e.contains("config.json"), "{e}");
        // Two layers.
        let mut two = MedusaConfig::new(2, h, v);
        two.medusa_num_layers = 2;
        assert!(two.validate().expect_err("2 layers").to_string().contains("medusa_num_layers"));
        // Missing directory, corrupt weights, missing tensor.
        let e = MedusaHeads::load(&tmp.path().join("nope"), &model).expect_err("missing").to_string();
        assert!(e.contains("config.json"), "{e}");
        let good = tmp.path().join("good");
        save_blocks(&good, &MedusaConfig::new(2, h, v), &vec![ResBlockWeights::zeros(h); 2], &[]).expect("save");
        std::fs::write(good.join(WEIGHTS_FILE), b"garbage").expect("write");
        let e = MedusaHeads::load(&good, &model).expect_err("corrupt").to_string();
        assert!(e.contains(WEIGHTS_FILE) && e.contains("not a safetensors"), "{e}");
        let three = tmp.path().join("three");
        save_blocks(&three, &MedusaConfig::new(2, h, v), &vec![ResBlockWeights::zeros(h); 2], &[]).expect("save");
        let mut c = MedusaConfig::new(3, h, v);
        c.base_model_name_or_path = None;
        std::fs::write(three.join(CONFIG_FILE), serde_json::to_string(&c).expect("json")).expect("write");
        let e = MedusaHeads::load(&three, &model).expect_err("missing tensor").to_string();
        assert!(e.contains("missing tensor `medusa_head.2.0.linear.weight`"), "{e}");
        // A wrong hidden length at inference.
        let heads = MedusaHeads::new(MedusaConfig::new(1, h, v), vec![ResBlockWeights::zeros(h)], &model).expect("heads");
        assert!(heads.head_logits(&[0.0; 3]).is_err());
    }

    /// A few Adam steps on the tiny model's hidden states lower the training loss, and the
    /// fresh heads are the reference's initialisation (zero weights).
    #[cfg(feature = "train")]
    #[test]
    fn training_reduces_the_loss() {
        let model = tiny();
        let (h, v) = (model.config.hidden_size, model.config.vocab_size);
        // A repetitive "response" the heads can learn: 1 2 3 4 5 6 1 2 3 ...
        let seqs: Vec<MedusaSequence> = (0..6)
            .map(|s| {
                let mut t: Vec<u32> = vec![7 + s as u32, 8, 9];
                t.extend((0..48).map(|i| 1 + (i % 6) as u32));
                MedusaSequence { tokens: t, response_start: 3 }
            })
            .collect();
        let pool = collect_hidden(&model, &seqs[..5], &mut |_, _| {}).expect("pool");
        let held = collect_hidden(&model, &seqs[5..], &mut |_, _| {}).expect("held");
        assert_eq!(pool.len(), 5 * 48); // t = 2 ..= 49
        let cfg = MedusaConfig::new(3, h, v);
        let fresh = MedusaModule::init(&cfg, &Device::flex()).expect("init").to_blocks().expect("blocks");
        assert!(fresh.iter().all(|b| b.weight.iter().all(|&w| w == 0.0) && b.bias.iter().any(|&x| x != 0.0)));
        let tc = MedusaTrainConfig { steps: 40, batch_size: 32, learning_rate: 1e-2, eval_every: 0, ..Default::default() };
        let (blocks, log) = train(&cfg, &tc, &pool, &held, model.lm_head(), model.device(), &mut |_| {}).expect("train");
        assert_eq!(log.len(), 41);
        let first: f64 = log[1..6].iter().map(|r| r.loss).sum::<f64>() / 5.0;
        let last: f64 = log[36..].iter().map(|r| r.loss).sum::<f64>() / 5.0;
        assert!(last < 0.8 * first, "loss {first} -> {last}");
        let before = log[0].heldout.as_ref().expect("heldout");
        let after = log[40].heldout.as_ref().expect("heldout");
        assert!(after[0].loss < before[0].loss, "{before:?} -> {after:?}");
        let heads = MedusaHeads::new(cfg.clone(), blocks, &model).expect("heads");
        assert_eq!(deco_generate::medusa::DraftHeads::num_heads(&heads), 3);
        let csv = log_csv(&log, 3);
        assert!(csv.starts_with("step,loss,loss_head1,loss_head2,loss_head3,heldout_loss_head1"));
        assert_eq!(csv.lines().count(), 42);
        // A checkpoint's log reads back to the same text.
        assert_eq!(log_csv(&parse_log_csv(&csv, 3).expect("parse"), 3), csv);
        assert!(parse_log_csv(&csv, 2).is_err());

        // Checkpoints every 10 steps; resuming from step 20 trains on the uninterrupted run's
        // batches: its first step's loss (before any update) is the uninterrupted step 21's.
        let mut saved: Vec<(usize, Vec<ResBlockWeights>)> = Vec::new();
        let (again, _) = train_from(&cfg, &tc, &pool, &held, model.lm_head(), model.device(), None, 10, &mut |_| {}, &mut |step, b| {
            saved.push((step, b.to_vec()));
            Ok(())
        })
        .expect("train with checkpoints");
        assert_eq!(saved.iter().map(|s| s.0).collect::<Vec<_>>(), [10, 20, 30, 40]);
        assert_eq!(again, saved[3].1, "the last checkpoint is the final heads");
        let resume = MedusaResume { step: 20, blocks: saved[1].1.clone() };
        let (_, tail) = train_from(&cfg, &tc, &pool, &held, model.lm_head(), model.device(), Some(resume), 0, &mut |_| {}, &mut |_, _| Ok(())).expect("resume");
        assert_eq!(tail.iter().map(|r| r.step).collect::<Vec<_>>(), (21..=40).collect::<Vec<_>>());
        assert_eq!(tail[0].loss, log[21].loss, "the resumed step 21 saw another batch or other heads");
        assert_eq!(tail[0].head_loss, log[21].head_loss);
        let past = MedusaResume { step: 41, blocks: saved[1].1.clone() };
        assert!(train_from(&cfg, &tc, &pool, &held, model.lm_head(), model.device(), Some(past), 0, &mut |_| {}, &mut |_, _| Ok(())).is_err());
    }

    #[test]
    fn pool_targets_look_ahead() {
        let pool = MedusaPool { hidden_size: 1, hidden: vec![0.0; 3], positions: vec![(0, 2), (0, 3), (0, 4)], sequences: vec![vec![10, 11, 12, 13, 14, 15]] };
        assert_eq!(pool.target(0, 1), Some(14)); // t = 2, head 1 -> x_4
        assert_eq!(pool.target(0, 3), None);
        assert_eq!(pool.target(1, 2), None);
        assert_eq!(pool.target(2, 1), None);
    }
}
