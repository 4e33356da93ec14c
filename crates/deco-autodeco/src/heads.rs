//! The AutoDeco heads: a temperature head and a top-p head on the base model's final hidden state.
//!
//! Source: AutoDeco (Wang et al. 2025, arXiv 2510.26697, §3.1) and its reference implementation
//! `model/templlm_auto.py` (`TempHead`, `TopPHead`):
//!
//! - `TempHead`: `T = 2 · sigmoid(W₂ · relu(W₁ · h + b₁) + b₂)`, so `T ∈ (0, 2)`;
//!   `W₁: [H → 256]`, `W₂: [256 → 1]`. Option (deco): a LayerNorm on `h` first
//!   ([`AutoDecoConfig::temp_layer_norm`]), the stability fix of the seed text.
//! - `TopPHead`: `P = sigmoid(W₂ · relu(W₁ · [h, T, s] + b₁) + b₂)` with `T` detached and `s` the
//!   four statistics of `softmax(logits / T)` ([`crate::stats::prob_stats`]); without
//!   [`AutoDecoConfig::use_enhanced_features`] the input is `[h, T]` (`H + 1` wide).
//!
//! Two implementations with the same weights: the burn [`AutoDecoHeads`] module (training, with
//! autodiff) and [`HostHeads`] (inference: two small matrix-vector products per token on the host,
//! no device round trip). `tests` checks they agree.
//!
//! # Storage
//! A heads directory holds `autodeco_config.json` ([`AutoDecoConfig`]) and
//! `autodeco_heads.safetensors` with the reference's tensor names and PyTorch `nn.Linear` layout
//! (`weight: [out, in]`, f32): `temp_head.mlp.0.{weight,bias}`, `temp_head.mlp.2.{weight,bias}`,
//! `top_p_head.mlp.0.{weight,bias}`, `top_p_head.mlp.2.{weight,bias}`, and with the LayerNorm
//! option `temp_head.norm.{weight,bias}` (deco only).
//!
//! The reference's own layout ([`HostHeads::export_official`], read by [`HostHeads::load`] as
//! well): `config.json` is the base model's configuration with `model_type: "autodeco"`,
//! `base_model_type`, `base_model_name_or_path`, `enable_temperature_head`,
//! `enable_top_p_head`, `use_enhanced_features`, `temperature_hidden_size`,
//! `top_p_hidden_size` and `architectures: ["AutoDecoModelForCausalLM"]`
//! (`AutoDecoModelForCausalLMConfig`); the head tensors, with the same names, are in
//! `model.safetensors` (the reference's loader reads every `*.safetensors` of the directory and
//! keeps the `temp_head.*` / `top_p_head.*` keys, as [`HostHeads::load`] does).

use std::collections::HashMap;
use std::path::Path;

use burn::module::{Module, Param};
use burn::nn::{LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::activation::{relu, sigmoid};
use burn::tensor::{Device, Tensor, TensorData};
use safetensors::tensor::{Dtype, TensorView};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result, invalid, io_err};
use crate::stats::{NUM_STATS, prob_stats};

/// File name of the heads' weights inside a heads directory.
pub const WEIGHTS_FILE: &str = "autodeco_heads.safetensors";
/// File name of the heads' configuration inside a heads directory.
pub const CONFIG_FILE: &str = "autodeco_config.json";
/// Weights file of the reference implementation's layout (`save_pretrained` of
/// `AutoDecoModelForCausalLM`, the base model's keys left out).
pub const OFFICIAL_WEIGHTS_FILE: &str = "model.safetensors";
/// Configuration file of the reference implementation's layout.
pub const OFFICIAL_CONFIG_FILE: &str = "config.json";
/// Hidden width of the reference's heads (`nn.Linear(hidden_size, 256)`, fixed there).
pub const OFFICIAL_HEAD_HIDDEN: usize = 256;
/// LayerNorm epsilon of the optional temperature-head norm (PyTorch's default).
pub const LAYER_NORM_EPS: f64 = 1e-5;

/// Shape and options of the heads (`autodeco_config.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AutoDecoConfig {
    /// Hidden size `H` of the base model.
    pub hidden_size: usize,
    /// Width of each head's hidden layer (256 in the paper).
    #[serde(default = "default_head_hidden")]
    pub head_hidden_size: usize,
    /// The top-p head also sees the four statistics of `softmax(logits / T)` (reference
    /// `use_enhanced_features`, default true).
    #[serde(default = "default_true")]
    pub use_enhanced_features: bool,
    /// A LayerNorm on `h` before the temperature head (deco option, default false).
    #[serde(default)]
    pub temp_layer_norm: bool,
    /// Vocabulary size of the base model the heads were trained on (checked at load).
    pub vocab_size: usize,
    /// Free text naming the base model (file name), for people.
    #[serde(default)]
    pub base_model: Option<String>,
}

fn default_head_hidden() -> usize {
    256
}
fn default_true() -> bool {
    true
}

impl AutoDecoConfig {
    /// The paper's heads for a base model of hidden size `hidden_size` and vocabulary `vocab_size`.
    pub fn new(hidden_size: usize, vocab_size: usize) -> Self {
        Self {
            hidden_size,
            head_hidden_size: 256,
            use_enhanced_features: true,
            temp_layer_norm: false,
            vocab_size,
            base_model: None,
        }
    }

    /// The configuration without its free-text `base_model` (for comparing shapes and options).
    pub fn without_base_model(&self) -> Self {
        Self { base_model: None, ..self.clone() }
    }

    /// Input width of the top-p head: `H + 1 (+ 4)`.
    pub fn top_p_input(&self) -> usize {
        self.hidden_size + 1 + if self.use_enhanced_features { NUM_STATS } else { 0 }
    }

    /// Number of trainable parameters of both heads.
    pub fn num_params(&self) -> usize {
        let k = self.head_hidden_size;
        let temp = self.hidden_size * k + k + k + 1 + if self.temp_layer_norm { 2 * self.hidden_size } else { 0 };
        let top_p = self.top_p_input() * k + k + k + 1;
        temp + top_p
    }

    /// Checks the sizes.
    ///
    /// # Errors
    /// [`Error::InvalidParameter`] for a zero size.
    pub fn validate(&self) -> Result<()> {
        if self.hidden_size == 0 || self.head_hidden_size == 0 || self.vocab_size < 2 {
            return Err(invalid("autodeco config", "hidden_size, head_hidden_size must be >= 1 and vocab_size >= 2"));
        }
        // Bounds far above any real model (hidden 16,384, vocabulary 256k), so that sizes
        // derived from them (`top_p_input`, `num_params`) cannot overflow.
        if self.hidden_size > 1 << 20 || self.head_hidden_size > 1 << 16 || self.vocab_size > 1 << 24 {
            return Err(invalid("autodeco config", "hidden_size must be <= 2^20, head_hidden_size <= 2^16 and vocab_size <= 2^24"));
        }
        Ok(())
    }
}

/// Temperature head: `[n, H] -> [n, 1]`, values in `(0, 2)`.
#[derive(Module, Debug)]
pub struct TempHead {
    /// Optional LayerNorm on the input.
    pub norm: Option<LayerNorm>,
    /// `Linear(H, 256)`.
    pub fc1: Linear,
    /// `Linear(256, 1)`.
    pub fc2: Linear,
}

impl TempHead {
    /// `2 · sigmoid(fc2(relu(fc1(norm(h)))))`.
    ///
    /// # Shapes
    /// - `hidden`: `[n, H]`
    /// - output: `[n, 1]`
    pub fn forward(&self, hidden: Tensor<2>) -> Tensor<2> {
        let x = match &self.norm {
            Some(n) => n.forward(hidden),
            None => hidden,
        };
        sigmoid(self.fc2.forward(relu(self.fc1.forward(x)))) * 2.0
    }
}

/// Top-p head: `[n, H + 1 (+ 4)] -> [n, 1]`, values in `(0, 1)`.
#[derive(Module, Debug)]
pub struct TopPHead {
    /// `Linear(H + 1 (+ 4), 256)`.
    pub fc1: Linear,
    /// `Linear(256, 1)`.
    pub fc2: Linear,
}

impl TopPHead {
    /// `sigmoid(fc2(relu(fc1(features))))`.
    ///
    /// # Shapes
    /// - `features`: `[n, H + 1 (+ 4)]` = `[h, T, stats]`
    /// - output: `[n, 1]`
    pub fn forward(&self, features: Tensor<2>) -> Tensor<2> {
        sigmoid(self.fc2.forward(relu(self.fc1.forward(features))))
    }
}

/// Both heads (the trainable part of an AutoDeco model).
#[derive(Module, Debug)]
pub struct AutoDecoHeads {
    /// The temperature head.
    pub temp_head: TempHead,
    /// The top-p head.
    pub top_p_head: TopPHead,
}

fn linear(d_in: usize, d_out: usize, device: &Device) -> Linear {
    // PyTorch nn.Linear's default init (kaiming_uniform with a = sqrt(5), i.e. U(±1/sqrt(fan_in))
    // for weight and bias), as the reference heads use.
    let bound = 1.0 / (d_in as f64).sqrt();
    LinearConfig::new(d_in, d_out)
        .with_initializer(burn::nn::Initializer::Uniform { min: -bound, max: bound })
        .init(device)
}

impl AutoDecoHeads {
    /// Fresh heads (PyTorch `nn.Linear` default initialization), on `device` (use an autodiff
    /// device to train). Seed the device first for reproducible weights.
    ///
    /// # Errors
    /// An invalid `cfg`.
    pub fn init(cfg: &AutoDecoConfig, device: &Device) -> Result<Self> {
        cfg.validate()?;
        let k = cfg.head_hidden_size;
        Ok(Self {
            temp_head: TempHead {
                norm: cfg.temp_layer_norm.then(|| LayerNormConfig::new(cfg.hidden_size).with_epsilon(LAYER_NORM_EPS).init(device)),
                fc1: linear(cfg.hidden_size, k, device),
                fc2: linear(k, 1, device),
            },
            top_p_head: TopPHead { fc1: linear(cfg.top_p_input(), k, device), fc2: linear(k, 1, device) },
        })
    }

    /// Temperature for each row of `hidden`.
    ///
    /// # Shapes
    /// `[n, H] -> [n, 1]`
    pub fn temperature(&self, hidden: Tensor<2>) -> Tensor<2> {
        self.temp_head.forward(hidden)
    }

    /// Top-p for each row: the input is `[hidden, temperature.detach(), stats]` (stats only with
    /// enhanced features).
    ///
    /// # Shapes
    /// - `hidden`: `[n, H]`, `temperature`: `[n, 1]`, `stats`: `[n, 4]` (ignored without
    ///   enhanced features)
    /// - output: `[n, 1]`
    pub fn top_p(&self, hidden: Tensor<2>, temperature: Tensor<2>, stats: Option<Tensor<2>>) -> Tensor<2> {
        let mut parts = vec![hidden, temperature.detach()];
        parts.extend(stats);
        self.top_p_head.forward(Tensor::cat(parts, 1))
    }

    /// Copies the weights to the host for inference.
    ///
    /// # Errors
    /// [`Error::TensorRead`] if reading the device fails.
    pub fn to_host(&self, cfg: &AutoDecoConfig) -> Result<HostHeads> {
        let lin = |l: &Linear| -> Result<HostLinear> {
            let w = l.weight.val();
            let [d_in, d_out] = w.dims();
            let w = tensor_vec(w)?;
            let b = match &l.bias {
                Some(b) => tensor_vec1(b.val())?,
                None => vec![0.0; d_out],
            };
            Ok(HostLinear { d_in, d_out, w, b })
        };
        let norm = match &self.temp_head.norm {
            Some(n) => Some((
                tensor_vec1(n.gamma.val())?,
                match &n.beta {
                    Some(b) => tensor_vec1(b.val())?,
                    None => vec![0.0; cfg.hidden_size],
                },
            )),
            None => None,
        };
        Ok(HostHeads {
            cfg: cfg.clone(),
            temp_norm: norm,
            temp_fc1: lin(&self.temp_head.fc1)?,
            temp_fc2: lin(&self.temp_head.fc2)?,
            top_p_fc1: lin(&self.top_p_head.fc1)?,
            top_p_fc2: lin(&self.top_p_head.fc2)?,
        })
    }
}

fn tensor_vec(t: Tensor<2>) -> Result<Vec<f32>> {
    t.detach().try_into_vec_as::<f32>().map_err(|e| Error::TensorRead(format!("{e:?}")))
}
fn tensor_vec1(t: Tensor<1>) -> Result<Vec<f32>> {
    t.detach().try_into_vec_as::<f32>().map_err(|e| Error::TensorRead(format!("{e:?}")))
}

/// A linear layer on the host, burn layout: `w` is `[d_in, d_out]` row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct HostLinear {
    /// Input width.
    pub d_in: usize,
    /// Output width.
    pub d_out: usize,
    /// `[d_in, d_out]` row-major.
    pub w: Vec<f32>,
    /// `[d_out]`.
    pub b: Vec<f32>,
}

impl HostLinear {
    /// `out = b + x · W` (`x` `[d_in]`, `out` `[d_out]`), the rows of `W` added in input order
    /// (no fused multiply-add, so every ISA gives the same bits); AVX2 code where the CPU has it.
    fn forward(&self, x: &[f32], out: &mut Vec<f32>) {
        out.clear();
        out.extend_from_slice(&self.b);
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above).
            unsafe { axpy_rows_avx2(&self.w, self.d_out, x, out) };
            return;
        }
        axpy_rows(&self.w, self.d_out, x, out);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn axpy_rows_avx2(w: &[f32], d_out: usize, x: &[f32], out: &mut [f32]) {
    axpy_rows(w, d_out, x, out);
}

/// `out += Σ_i x_i · w[i]` over the rows `w[i]` (`d_out` wide) of `w`.
#[inline(always)]
fn axpy_rows(w: &[f32], d_out: usize, x: &[f32], out: &mut [f32]) {
    for (i, &xi) in x.iter().enumerate() {
        if xi == 0.0 {
            continue;
        }
        let row = &w[i * d_out..(i + 1) * d_out];
        for (o, &wv) in out.iter_mut().zip(row) {
            *o += xi * wv;
        }
    }
}

/// The heads on the host: per-token inference without a device round trip.
#[derive(Debug, Clone, PartialEq)]
pub struct HostHeads {
    cfg: AutoDecoConfig,
    temp_norm: Option<(Vec<f32>, Vec<f32>)>,
    temp_fc1: HostLinear,
    temp_fc2: HostLinear,
    top_p_fc1: HostLinear,
    top_p_fc2: HostLinear,
}

/// One token's predicted decoding parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HeadOutput {
    /// Predicted temperature `T ∈ (0, 2)`.
    pub temperature: f32,
    /// Predicted top-p `P ∈ (0, 1)`.
    pub top_p: f32,
}

fn sigmoid_f(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

impl HostHeads {
    /// The configuration.
    pub fn config(&self) -> &AutoDecoConfig {
        &self.cfg
    }

    /// Predicts `(T, P)` for one position from its final hidden state `[H]` and raw logits
    /// `[vocab]` (the statistics are computed from `softmax(logits / T)`).
    ///
    /// # Errors
    /// [`Error::Shape`] if `hidden` is not `H` long or `logits` not `vocab_size` long, or if the
    /// prediction is not finite (weights so large that f32 overflows).
    pub fn predict(&self, hidden: &[f32], logits: &[f32]) -> Result<HeadOutput> {
        if hidden.len() != self.cfg.hidden_size {
            return Err(Error::Shape(format!("hidden state has {} values, the heads expect {}", hidden.len(), self.cfg.hidden_size)));
        }
        if logits.len() != self.cfg.vocab_size {
            return Err(Error::Shape(format!("logits row has {} values, the heads expect vocab {}", logits.len(), self.cfg.vocab_size)));
        }
        let mut a = Vec::with_capacity(self.cfg.head_hidden_size);
        let mut b = Vec::with_capacity(1);
        let normed;
        let x: &[f32] = match &self.temp_norm {
            Some((g, beta)) => {
                let n = hidden.len() as f64;
                let mean = hidden.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
                let var = hidden.iter().map(|&v| (f64::from(v) - mean).powi(2)).sum::<f64>() / n;
                let inv = 1.0 / (var + LAYER_NORM_EPS).sqrt();
                normed = hidden
                    .iter()
                    .zip(g.iter().zip(beta))
                    .map(|(&v, (&g, &bt))| ((f64::from(v) - mean) * inv) as f32 * g + bt)
                    .collect::<Vec<f32>>();
                &normed
            }
            None => hidden,
        };
        self.temp_fc1.forward(x, &mut a);
        a.iter_mut().for_each(|v| *v = v.max(0.0));
        self.temp_fc2.forward(&a, &mut b);
        let temperature = 2.0 * sigmoid_f(b[0]);
        let mut feat = Vec::with_capacity(self.cfg.top_p_input());
        feat.extend_from_slice(hidden);
        feat.push(temperature);
        if self.cfg.use_enhanced_features {
            feat.extend_from_slice(&prob_stats(logits, temperature));
        }
        self.top_p_fc1.forward(&feat, &mut a);
        a.iter_mut().for_each(|v| *v = v.max(0.0));
        self.top_p_fc2.forward(&a, &mut b);
        let top_p = sigmoid_f(b[0]);
        if !temperature.is_finite() || !top_p.is_finite() {
            // Finite but huge weights can overflow to inf - inf.
            return Err(Error::Shape(format!("the heads produced a non-finite prediction (temperature {temperature}, top_p {top_p}); their weights overflow f32")));
        }
        Ok(HeadOutput { temperature, top_p })
    }

    /// Size of the weights in bytes (f32).
    pub fn num_bytes(&self) -> usize {
        self.cfg.num_params() * 4
    }

    /// Rebuilds the burn module on `device` (e.g. an autodiff device to continue training).
    pub fn to_module(&self, device: &Device) -> AutoDecoHeads {
        let lin = |l: &HostLinear| Linear {
            weight: Param::from_tensor(Tensor::from_data(TensorData::new(l.w.clone(), [l.d_in, l.d_out]), device)),
            bias: Some(Param::from_tensor(Tensor::from_data(TensorData::new(l.b.clone(), [l.d_out]), device))),
        };
        let norm = self.temp_norm.as_ref().map(|(g, b)| {
            let mut n = LayerNormConfig::new(self.cfg.hidden_size).with_epsilon(LAYER_NORM_EPS).init(device);
            n.gamma = Param::from_tensor(Tensor::from_data(TensorData::new(g.clone(), [g.len()]), device));
            n.beta = Some(Param::from_tensor(Tensor::from_data(TensorData::new(b.clone(), [b.len()]), device)));
            n
        });
        AutoDecoHeads {
            temp_head: TempHead { norm, fc1: lin(&self.temp_fc1), fc2: lin(&self.temp_fc2) },
            top_p_head: TopPHead { fc1: lin(&self.top_p_fc1), fc2: lin(&self.top_p_fc2) },
        }
    }

    /// Writes `dir/autodeco_config.json` and `dir/autodeco_heads.safetensors` crash-safely: both
    /// go to a temporary directory next to `dir`, which then replaces `dir` in one step
    /// ([`deco_formats::atomic::write_dir`]; an existing `dir` is replaced, never left partial).
    ///
    /// # Errors
    /// [`Error::Io`] on any file-system failure.
    pub fn save(&self, dir: &Path) -> Result<()> {
        self.save_with(dir, &[])
    }

    /// [`HostHeads::save`] with more files (name, bytes) written into the same directory in the
    /// same atomic step (a checkpoint's `loss.csv`).
    ///
    /// # Errors
    /// As [`HostHeads::save`].
    pub fn save_with(&self, dir: &Path, extra: &[(&str, &[u8])]) -> Result<()> {
        let bytes = self.weights_bytes(dir)?;
        let json = serde_json::to_string_pretty(&self.cfg).map_err(|e| Error::Heads { path: dir.join(CONFIG_FILE).display().to_string(), msg: e.to_string() })?;
        let mut files: Vec<(&str, &[u8])> = vec![(WEIGHTS_FILE, &bytes)];
        let json = json + "\n";
        files.push((CONFIG_FILE, json.as_bytes()));
        files.extend_from_slice(extra);
        write_files(dir, &files)
    }

    /// Writes the heads in the reference implementation's layout (module docs): `config.json`
    /// = `base_config` (the base model's transformers configuration, e.g.
    /// `ModelConfig::to_hf_json`) plus the AutoDeco fields, and `model.safetensors` with the
    /// head tensors, crash-safely as [`HostHeads::save`]. `base_model_name_or_path` is what the
    /// reference loads the base from (a Hub id or a local directory).
    ///
    /// # Errors
    /// [`Error::InvalidParameter`] for heads the reference cannot hold (a temperature-head
    /// LayerNorm, a head width other than 256) or a `base_config` whose `hidden_size` /
    /// `vocab_size` differ from the heads'; [`Error::Io`] on file-system failures.
    pub fn export_official(&self, dir: &Path, base_config: &serde_json::Value, base_model_name_or_path: &str) -> Result<()> {
        if self.temp_norm.is_some() {
            return Err(invalid("autodeco export", "heads with a temperature-head LayerNorm (a deco option) have no place in the reference layout"));
        }
        if self.cfg.head_hidden_size != OFFICIAL_HEAD_HIDDEN {
            return Err(invalid("autodeco export", format!("the reference's heads are {OFFICIAL_HEAD_HIDDEN} wide, these are {}", self.cfg.head_hidden_size)));
        }
        let mut config = match base_config {
            serde_json::Value::Object(m) => m.clone(),
            _ => return Err(invalid("autodeco export", "the base configuration is not a JSON object")),
        };
        for (key, want) in [("hidden_size", self.cfg.hidden_size), ("vocab_size", self.cfg.vocab_size)] {
            let got = config.get(key).and_then(serde_json::Value::as_u64);
            if got != Some(want as u64) {
                return Err(invalid("autodeco export", format!("the base model's {key} is {got:?}, the heads were trained for {want}")));
            }
        }
        let base_type = config.get("model_type").cloned().unwrap_or(serde_json::Value::Null);
        let h = self.cfg.hidden_size;
        config.insert("model_type".into(), "autodeco".into());
        config.insert("base_model_type".into(), base_type);
        config.insert("base_model_name_or_path".into(), base_model_name_or_path.into());
        config.insert("_name_or_path".into(), base_model_name_or_path.into());
        config.insert("architectures".into(), serde_json::json!(["AutoDecoModelForCausalLM"]));
        config.insert("enable_temperature_head".into(), true.into());
        config.insert("enable_top_p_head".into(), true.into());
        config.insert("use_enhanced_features".into(), self.cfg.use_enhanced_features.into());
        config.insert("temperature_hidden_size".into(), h.into());
        config.insert("top_p_hidden_size".into(), h.into());
        let json = serde_json::to_string_pretty(&serde_json::Value::Object(config))
            .map_err(|e| Error::Heads { path: dir.join(OFFICIAL_CONFIG_FILE).display().to_string(), msg: e.to_string() })?
            + "\n";
        let bytes = self.weights_bytes(dir)?;
        write_files(dir, &[(OFFICIAL_WEIGHTS_FILE, &bytes), (OFFICIAL_CONFIG_FILE, json.as_bytes())])
    }

    /// The safetensors bytes of the head tensors (PyTorch layout, reference names).
    fn weights_bytes(&self, dir: &Path) -> Result<Vec<u8>> {
        let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
        let mut push_lin = |name: &str, l: &HostLinear| {
            // burn [in, out] -> PyTorch [out, in]
            let mut t = vec![0f32; l.w.len()];
            for i in 0..l.d_in {
                for o in 0..l.d_out {
                    t[o * l.d_in + i] = l.w[i * l.d_out + o];
                }
            }
            tensors.push((format!("{name}.weight"), vec![l.d_out, l.d_in], f32_bytes(&t)));
            tensors.push((format!("{name}.bias"), vec![l.d_out], f32_bytes(&l.b)));
        };
        push_lin("temp_head.mlp.0", &self.temp_fc1);
        push_lin("temp_head.mlp.2", &self.temp_fc2);
        push_lin("top_p_head.mlp.0", &self.top_p_fc1);
        push_lin("top_p_head.mlp.2", &self.top_p_fc2);
        if let Some((g, b)) = &self.temp_norm {
            tensors.push(("temp_head.norm.weight".into(), vec![g.len()], f32_bytes(g)));
            tensors.push(("temp_head.norm.bias".into(), vec![b.len()], f32_bytes(b)));
        }
        let views: Vec<(String, TensorView<'_>)> = tensors
            .iter()
            .map(|(n, s, d)| TensorView::new(Dtype::F32, s.clone(), d).map(|v| (n.clone(), v)))
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| Error::Heads { path: dir.display().to_string(), msg: e.to_string() })?;
        let mut meta = HashMap::new();
        meta.insert("format".to_string(), "pt".to_string());
        safetensors::serialize(views, Some(meta)).map_err(|e| Error::Heads { path: dir.display().to_string(), msg: e.to_string() })
    }

    /// Reads a heads directory: deco's layout (`autodeco_config.json`, written by
    /// [`HostHeads::save`]) or the reference implementation's (`config.json` with
    /// `model_type: "autodeco"`, head tensors in the directory's `*.safetensors`; see the module
    /// docs). For the reference layout the head width is read from `temp_head.mlp.0.weight`
    /// and the vocabulary from the base configuration it carries.
    ///
    /// # Errors
    /// [`Error::Heads`] naming the file for a missing file, bad JSON, a configuration that is
    /// not AutoDeco's, a disabled head, a missing tensor, a tensor of the wrong shape or dtype,
    /// or non-finite weights.
    pub fn load(dir: &Path) -> Result<Self> {
        let herr = |p: &Path, msg: String| Error::Heads { path: p.display().to_string(), msg };
        let cpath = dir.join(CONFIG_FILE);
        if cpath.exists() || !dir.join(OFFICIAL_CONFIG_FILE).exists() {
            let text = std::fs::read_to_string(&cpath).map_err(|e| herr(&cpath, format!("cannot read AutoDeco config ({e})")))?;
            let cfg: AutoDecoConfig = serde_json::from_str(&text).map_err(|e| herr(&cpath, format!("invalid AutoDeco config: {e}")))?;
            cfg.validate().map_err(|e| herr(&cpath, e.to_string()))?;
            let wpath = dir.join(WEIGHTS_FILE);
            let bytes = std::fs::read(&wpath).map_err(|e| herr(&wpath, format!("cannot read heads weights ({e})")))?;
            let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| herr(&wpath, format!("not a safetensors file: {e}")))?;
            return Self::from_tensors(cfg, &wpath, &|name| st.tensor(name).ok().map(|t| (wpath.clone(), t)));
        }
        // The reference implementation's layout.
        let cpath = dir.join(OFFICIAL_CONFIG_FILE);
        let text = std::fs::read_to_string(&cpath).map_err(|e| herr(&cpath, format!("cannot read ({e})")))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| herr(&cpath, format!("invalid JSON: {e}")))?;
        if v.get("model_type").and_then(|t| t.as_str()) != Some("autodeco") {
            return Err(herr(&cpath, format!("not an AutoDeco configuration (model_type {:?}, expected \"autodeco\")", v.get("model_type"))));
        }
        for key in ["enable_temperature_head", "enable_top_p_head"] {
            if v.get(key).and_then(|b| b.as_bool()) == Some(false) {
                return Err(herr(&cpath, format!("{key} is false: deco needs both heads")));
            }
        }
        let size = |key: &str| v.get(key).and_then(serde_json::Value::as_u64).map(|x| x as usize);
        let hidden_size = size("temperature_hidden_size")
            .or_else(|| size("hidden_size"))
            .ok_or_else(|| herr(&cpath, "no temperature_hidden_size or hidden_size".into()))?;
        if let Some(p) = size("top_p_hidden_size").filter(|&p| p != hidden_size) {
            return Err(herr(&cpath, format!("top_p_hidden_size {p} differs from temperature_hidden_size {hidden_size}")));
        }
        let vocab_size = size("vocab_size").ok_or_else(|| herr(&cpath, "no vocab_size (the base model's configuration)".into()))?;
        // Every `*.safetensors` of the directory, in name order (the reference's loader).
        let mut files: Vec<std::path::PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| herr(dir, format!("cannot list ({e})")))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        let mut blobs = Vec::with_capacity(files.len());
        for f in &files {
            blobs.push((f.clone(), std::fs::read(f).map_err(|e| herr(f, format!("cannot read ({e})")))?));
        }
        let mut parsed = Vec::with_capacity(blobs.len());
        for (f, b) in &blobs {
            parsed.push((f.clone(), safetensors::SafeTensors::deserialize(b).map_err(|e| herr(f, format!("not a safetensors file: {e}")))?));
        }
        let find = |name: &str| parsed.iter().find_map(|(f, st)| st.tensor(name).ok().map(|t| (f.clone(), t)));
        let head_hidden_size = match find("temp_head.mlp.0.weight") {
            Some((_, t)) if t.shape().len() == 2 => t.shape()[0],
            Some((f, t)) => return Err(herr(&f, format!("tensor `temp_head.mlp.0.weight` has shape {:?}, expected [width, {hidden_size}]", t.shape()))),
            None => return Err(herr(dir, "missing tensor `temp_head.mlp.0.weight` (no *.safetensors of the directory holds it)".into())),
        };
        let cfg = AutoDecoConfig {
            hidden_size,
            head_hidden_size,
            use_enhanced_features: v.get("use_enhanced_features").and_then(|b| b.as_bool()).unwrap_or(true),
            temp_layer_norm: false,
            vocab_size,
            base_model: v.get("base_model_name_or_path").and_then(|b| b.as_str()).map(str::to_string),
        };
        cfg.validate().map_err(|e| herr(&cpath, e.to_string()))?;
        Self::from_tensors(cfg, dir, &find)
    }

    /// The heads of `cfg` from named tensors (`find(name) -> (file, view)`; `source` names where
    /// a missing tensor was looked for), checked.
    fn from_tensors<'a>(cfg: AutoDecoConfig, source: &Path, find: &dyn Fn(&str) -> Option<(std::path::PathBuf, TensorView<'a>)>) -> Result<Self> {
        let herr = |p: &Path, msg: String| Error::Heads { path: p.display().to_string(), msg };
        let get = |name: &str, shape: &[usize]| -> Result<Vec<f32>> {
            let (wpath, t) = find(name).ok_or_else(|| herr(source, format!("missing tensor `{name}`")))?;
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
        let lin = |name: &str, d_in: usize, d_out: usize| -> Result<HostLinear> {
            let t = get(&format!("{name}.weight"), &[d_out, d_in])?;
            let mut w = vec![0f32; t.len()];
            for o in 0..d_out {
                for i in 0..d_in {
                    w[i * d_out + o] = t[o * d_in + i];
                }
            }
            Ok(HostLinear { d_in, d_out, w, b: get(&format!("{name}.bias"), &[d_out])? })
        };
        let k = cfg.head_hidden_size;
        let h = cfg.hidden_size;
        let temp_norm = if cfg.temp_layer_norm {
            Some((get("temp_head.norm.weight", &[h])?, get("temp_head.norm.bias", &[h])?))
        } else {
            None
        };
        Ok(Self {
            temp_norm,
            temp_fc1: lin("temp_head.mlp.0", h, k)?,
            temp_fc2: lin("temp_head.mlp.2", k, 1)?,
            top_p_fc1: lin("top_p_head.mlp.0", cfg.top_p_input(), k)?,
            top_p_fc2: lin("top_p_head.mlp.2", k, 1)?,
            cfg,
        })
    }
}

/// Writes `files` (name, bytes) as the directory `dir`, crash-safely
/// ([`deco_formats::atomic::write_dir`]: a temporary sibling replaces `dir` in one step).
pub(crate) fn write_files(dir: &Path, files: &[(&str, &[u8])]) -> Result<()> {
    deco_formats::atomic::write_dir(
        dir,
        |tmp| {
            for (name, bytes) in files {
                let p = tmp.join(name);
                std::fs::write(&p, bytes).map_err(io_err(&p))?;
            }
            Ok(())
        },
        |p, e| io_err(p)(e),
    )?;
    Ok(())
}

pub(crate) fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
