//! Model hyper-parameters in Hugging Face `config.json` terms, read from GGUF metadata or from a
//! `config.json`.
//!
//! The field names are those of transformers' `LlamaConfig` / `Qwen2Config`; the GGUF keys are the
//! ones written by llama.cpp's `convert_hf_to_gguf.py` (`{arch}.embedding_length`, ...).

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::gguf::GgufFile;
use crate::{Error, Result};

/// The decoder architectures deco implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Architecture {
    /// Llama (and SmolLM2, Llama 2/3, Mistral without sliding window): RMSNorm, RoPE, GQA, SwiGLU.
    Llama,
    /// Qwen2 / Qwen2.5: Llama plus biases on the Q, K and V projections.
    Qwen2,
}

impl Architecture {
    /// Parses a GGUF `general.architecture` or HF `model_type` value.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "llama" => Some(Self::Llama),
            "qwen2" => Some(Self::Qwen2),
            _ => None,
        }
    }

    /// The GGUF / HF `model_type` name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
        }
    }

    /// The HF `architectures[0]` class name.
    pub fn hf_class(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
        }
    }
}

/// RoPE frequency scaling (`rope_scaling` in HF configs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "rope_type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// Position interpolation: every frequency divided by `factor` (Chen et al. 2023).
    Linear {
        /// Scale factor.
        factor: f64,
    },
    /// Llama 3.1 frequency-dependent scaling (transformers `_compute_llama3_parameters`).
    Llama3 {
        /// Scale factor.
        factor: f64,
        /// Low-frequency factor.
        low_freq_factor: f64,
        /// High-frequency factor.
        high_freq_factor: f64,
        /// Context length before scaling.
        original_max_position_embeddings: usize,
    },
}

/// Hyper-parameters of a Llama-family decoder, HF names.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Architecture (`model_type`).
    pub model_type: Architecture,
    /// Vocabulary size (rows of the embedding).
    pub vocab_size: usize,
    /// Model width `H`.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (GQA groups); equals `num_attention_heads` for MHA.
    pub num_key_value_heads: usize,
    /// Per-head dimension (`hidden_size / num_attention_heads` unless given).
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base θ.
    pub rope_theta: f64,
    /// Optional RoPE scaling.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<RopeScaling>,
    /// Context length the model was trained for.
    pub max_position_embeddings: usize,
    /// Whether the LM head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Biases on Q/K/V projections (true for Qwen2).
    #[serde(default)]
    pub attention_bias: bool,
    /// BOS token id, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bos_token_id: Option<u32>,
    /// EOS token ids.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub eos_token_id: Vec<u32>,
}

impl ModelConfig {
    /// Checks internal consistency (divisibility of heads, non-zero sizes).
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the inconsistent fields, with `path` as the source file.
    pub fn validate(&self, path: &Path) -> Result<()> {
        let bad = |msg: String| Error::Invalid { path: path.to_path_buf(), format: "model config", msg };
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v == 0 {
                return Err(bad(format!("{name} is 0")));
            }
        }
        if !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            return Err(bad(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_attention_heads, self.num_key_value_heads
            )));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(bad(format!("head_dim {} is odd; RoPE needs pairs", self.head_dim)));
        }
        // Written so that NaN fails too.
        let positive = |x: f64| x > 0.0;
        if !positive(self.rms_norm_eps) || !positive(self.rope_theta) {
            return Err(bad(format!(
                "rms_norm_eps {} and rope_theta {} must be positive",
                self.rms_norm_eps, self.rope_theta
            )));
        }
        Ok(())
    }

    /// Reads the configuration from GGUF metadata.
    ///
    /// # Errors
    /// [`Error::UnsupportedArchitecture`] for an architecture other than llama/qwen2,
    /// [`Error::Metadata`] for missing keys, [`Error::Invalid`] for inconsistent values.
    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let arch_name = g.architecture()?;
        let model_type = Architecture::parse(arch_name).ok_or_else(|| Error::UnsupportedArchitecture {
            path: g.path().to_path_buf(),
            arch: arch_name.to_string(),
        })?;
        let a = arch_name;
        let key = |k: &str| format!("{a}.{k}");
        let usize_key = |k: &str| -> Result<usize> { Ok(g.get_u64(&key(k))? as usize) };
        let hidden_size = usize_key("embedding_length")?;
        let num_attention_heads = usize_key("attention.head_count")?;
        let num_key_value_heads = match g.get(&key("attention.head_count_kv")) {
            Some(_) => usize_key("attention.head_count_kv")?,
            None => num_attention_heads,
        };
        let head_dim = match g.get(&key("attention.key_length")) {
            Some(_) => usize_key("attention.key_length")?,
            None => hidden_size.checked_div(num_attention_heads).unwrap_or(0),
        };
        let vocab_size = match g.get(&key("vocab_size")) {
            Some(_) => usize_key("vocab_size")?,
            None => match g.tensor_info("token_embd.weight") {
                Some(t) => t.shape()[0],
                None => g.get_str_array("tokenizer.ggml.tokens")?.len(),
            },
        };
        let rope_theta = match g.get(&key("rope.freq_base")) {
            Some(_) => g.get_f64(&key("rope.freq_base"))?,
            None => 10_000.0,
        };
        let rope_scaling = match g.get(&key("rope.scaling.type")).and_then(|v| v.as_str()) {
            None | Some("none") => None,
            Some("linear") => Some(RopeScaling::Linear { factor: g.get_f64(&key("rope.scaling.factor"))? }),
            Some(other) => {
                return Err(Error::Metadata {
                    path: g.path().to_path_buf(),
                    key: key("rope.scaling.type"),
                    msg: format!("RoPE scaling `{other}` is not supported (supported: none, linear)"),
                });
            }
        };
        let cfg = Self {
            model_type,
            vocab_size,
            hidden_size,
            intermediate_size: usize_key("feed_forward_length")?,
            num_hidden_layers: usize_key("block_count")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: g.get_f64(&key("attention.layer_norm_rms_epsilon"))?,
            rope_theta,
            rope_scaling,
            max_position_embeddings: usize_key("context_length")?,
            tie_word_embeddings: g.tensor_info("output.weight").is_none(),
            attention_bias: g.tensor_info("blk.0.attn_q.bias").is_some(),
            bos_token_id: g.get("tokenizer.ggml.bos_token_id").and_then(|v| v.as_u64()).map(|v| v as u32),
            eos_token_id: g
                .get("tokenizer.ggml.eos_token_id")
                .and_then(|v| v.as_u64())
                .map(|v| vec![v as u32])
                .unwrap_or_default(),
        };
        cfg.validate(g.path())?;
        Ok(cfg)
    }

    /// Reads a Hugging Face `config.json`.
    ///
    /// # Errors
    /// [`Error::Io`], [`Error::Invalid`] for malformed JSON or missing fields,
    /// [`Error::UnsupportedArchitecture`].
    pub fn from_hf_json(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::Invalid { path: path.to_path_buf(), format: "config.json", msg: e.to_string() })?;
        let bad = |msg: String| Error::Invalid { path: path.to_path_buf(), format: "config.json", msg };
        let model_type_name = v.get("model_type").and_then(|m| m.as_str()).unwrap_or("");
        let model_type = Architecture::parse(model_type_name).ok_or_else(|| Error::UnsupportedArchitecture {
            path: path.to_path_buf(),
            arch: model_type_name.to_string(),
        })?;
        let req = |k: &str| -> Result<usize> {
            v.get(k)
                .and_then(|x| x.as_u64())
                .map(|x| x as usize)
                .ok_or_else(|| bad(format!("missing or non-integer field `{k}`")))
        };
        let num_attention_heads = req("num_attention_heads")?;
        let hidden_size = req("hidden_size")?;
        let num_key_value_heads = v
            .get("num_key_value_heads")
            .and_then(|x| x.as_u64())
            .map_or(num_attention_heads, |x| x as usize);
        let head_dim = v
            .get("head_dim")
            .and_then(|x| x.as_u64())
            .map_or(hidden_size.checked_div(num_attention_heads).unwrap_or(0), |x| x as usize);
        let rope_scaling = match v.get("rope_scaling") {
            None | Some(serde_json::Value::Null) => None,
            Some(rs) => {
                let ty = rs.get("rope_type").or_else(|| rs.get("type")).and_then(|t| t.as_str()).unwrap_or("");
                let f = |k: &str| rs.get(k).and_then(|x| x.as_f64()).ok_or_else(|| bad(format!("rope_scaling.{k} missing")));
                match ty {
                    "default" => None,
                    "linear" => Some(RopeScaling::Linear { factor: f("factor")? }),
                    "llama3" => Some(RopeScaling::Llama3 {
                        factor: f("factor")?,
                        low_freq_factor: f("low_freq_factor")?,
                        high_freq_factor: f("high_freq_factor")?,
                        original_max_position_embeddings: f("original_max_position_embeddings")? as usize,
                    }),
                    other => return Err(bad(format!("rope_scaling type `{other}` is not supported (linear, llama3)"))),
                }
            }
        };
        let ids = |k: &str| -> Vec<u32> {
            match v.get(k) {
                Some(serde_json::Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
                Some(serde_json::Value::Array(a)) => a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32).collect(),
                _ => Vec::new(),
            }
        };
        let cfg = Self {
            model_type,
            vocab_size: req("vocab_size")?,
            hidden_size,
            intermediate_size: req("intermediate_size")?,
            num_hidden_layers: req("num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: v.get("rms_norm_eps").and_then(|x| x.as_f64()).unwrap_or(1e-6),
            rope_theta: v.get("rope_theta").and_then(|x| x.as_f64()).unwrap_or(10_000.0),
            rope_scaling,
            max_position_embeddings: req("max_position_embeddings")?,
            tie_word_embeddings: v.get("tie_word_embeddings").and_then(|x| x.as_bool()).unwrap_or(false),
            attention_bias: model_type == Architecture::Qwen2
                || v.get("attention_bias").and_then(|x| x.as_bool()).unwrap_or(false),
            bos_token_id: ids("bos_token_id").first().copied(),
            eos_token_id: ids("eos_token_id"),
        };
        cfg.validate(path)?;
        Ok(cfg)
    }

    /// The `config.json` a Hugging Face loader expects for this model.
    pub fn to_hf_json(&self, torch_dtype: &str) -> serde_json::Value {
        let mut v = serde_json::json!({
            "architectures": [self.model_type.hf_class()],
            "model_type": self.model_type.name(),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "torch_dtype": torch_dtype,
        });
        if let Some(b) = self.bos_token_id {
            v["bos_token_id"] = b.into();
        }
        match self.eos_token_id.as_slice() {
            [] => {}
            [e] => v["eos_token_id"] = (*e).into(),
            es => v["eos_token_id"] = es.to_vec().into(),
        }
        if let Some(rs) = &self.rope_scaling {
            v["rope_scaling"] = serde_json::to_value(rs).unwrap_or(serde_json::Value::Null);
        }
        v
    }
}
