//! A model checkpoint seen through Hugging Face tensor names and layouts, whatever the file.
//!
//! [`Checkpoint::open`] accepts a GGUF file or a Hugging Face directory (`config.json` +
//! `model.safetensors` or `model.safetensors.index.json` shards). Tensors come out as f32 in
//! row-major order under their transformers names (`model.layers.0.self_attn.q_proj.weight`,
//! shape `[out_features, in_features]`).
//!
//! GGUF files written by llama.cpp's `convert_hf_to_gguf.py` store the Q and K projections of the
//! `llama` architecture permuted for llama.cpp's interleaved ("normal") RoPE:
//! `w.reshape(n_head, 2, d/2, in).swapaxes(1, 2)`. This module undoes that permutation so that
//! the model uses HF's rotate-half RoPE for every source. Qwen2 is not permuted (llama.cpp runs it
//! with NEOX RoPE, the same as HF).
//!
//! A directory quantized by AutoGPTQ, AutoAWQ (GEMM) or compressed-tensors (`pack-quantized`),
//! recognised by the `quantization_config` of `config.json` or a `quantize_config.json`, serves
//! each packed linear's `<layer>.weight` dequantized to f32 on load
//! ([`crate::quantized::decode`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::config::{Architecture, ModelConfig};
use crate::gguf::GgufFile;
use crate::quantized::{QuantConfig, RawTensor};
use crate::{Error, Result};

/// Where the tensors come from.
enum Source {
    Gguf(Box<GgufFile>),
    Safetensors {
        /// HF tensor name -> shard file.
        index: BTreeMap<String, PathBuf>,
        /// Memory-mapped shards with their headers, parsed once at open.
        shards: BTreeMap<PathBuf, Shard>,
        /// Quantization settings of a GPTQ / AWQ / compressed-tensors directory.
        quant: Option<QuantConfig>,
    },
}

/// One memory-mapped safetensors file and its header. The header is parsed and validated
/// (offsets contiguous, sizes matching dtype x shape, data ending at the end of the file) once,
/// when the checkpoint is opened; tensors are then sliced out of the map without parsing again.
struct Shard {
    mmap: memmap2::Mmap,
    /// Byte offset of the data section (8 + header length).
    data_start: usize,
    meta: safetensors::tensor::Metadata,
}

impl Shard {
    /// The stored form of `name`, or `None` when this shard has no such tensor.
    fn raw(&self, name: &str) -> Option<RawTensor<'_>> {
        let info = self.meta.info(name)?;
        let (s, e) = info.data_offsets;
        let data = self.mmap.get(self.data_start.checked_add(s)?..self.data_start.checked_add(e)?)?;
        Some(RawTensor { dtype: info.dtype, shape: info.shape.clone(), data })
    }
}

/// An opened checkpoint with its configuration.
pub struct Checkpoint {
    path: PathBuf,
    /// Model hyper-parameters.
    pub config: ModelConfig,
    source: Source,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint").field("path", &self.path).field("config", &self.config).finish()
    }
}

/// Maps a transformers tensor name to its GGUF name.
///
/// Source: llama.cpp `gguf-py/gguf/tensor_mapping.py` (`MODEL_TENSOR.*` for LLAMA / QWEN2).
pub fn hf_to_gguf_name(hf: &str) -> Option<String> {
    let fixed = match hf {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_string());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, tail) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let g = match tail {
        "input_layernorm.weight" => "attn_norm.weight",
        "post_attention_layernorm.weight" => "ffn_norm.weight",
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.v_proj.weight" => "attn_v.weight",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "self_attn.q_proj.bias" => "attn_q.bias",
        "self_attn.k_proj.bias" => "attn_k.bias",
        "self_attn.v_proj.bias" => "attn_v.bias",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        _ => return None,
    };
    Some(format!("blk.{layer}.{g}"))
}

/// The transformers tensor names of a model with this configuration, in a canonical order.
pub fn hf_tensor_names(cfg: &ModelConfig) -> Vec<String> {
    let mut names = vec!["model.embed_tokens.weight".to_string()];
    for i in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{i}");
        names.push(format!("{p}.input_layernorm.weight"));
        for proj in ["q", "k", "v"] {
            names.push(format!("{p}.self_attn.{proj}_proj.weight"));
            if cfg.attention_bias {
                names.push(format!("{p}.self_attn.{proj}_proj.bias"));
            }
        }
        names.push(format!("{p}.self_attn.o_proj.weight"));
        names.push(format!("{p}.post_attention_layernorm.weight"));
        for proj in ["gate", "up", "down"] {
            names.push(format!("{p}.mlp.{proj}_proj.weight"));
        }
    }
    names.push("model.norm.weight".to_string());
    if !cfg.tie_word_embeddings {
        names.push("lm_head.weight".to_string());
    }
    names
}

/// The shape transformers gives each tensor.
pub fn hf_expected_shape(cfg: &ModelConfig, hf: &str) -> Option<Vec<usize>> {
    let (h, hd) = (cfg.hidden_size, cfg.head_dim);
    let q = cfg.num_attention_heads * hd;
    let kv = cfg.num_key_value_heads * hd;
    let i = cfg.intermediate_size;
    Some(match hf {
        "model.embed_tokens.weight" | "lm_head.weight" => vec![cfg.vocab_size, h],
        "model.norm.weight" => vec![h],
        _ => {
            let tail = hf.strip_prefix("model.layers.")?.split_once('.')?.1;
            match tail {
                "input_layernorm.weight" | "post_attention_layernorm.weight" => vec![h],
                "self_attn.q_proj.weight" => vec![q, h],
                "self_attn.k_proj.weight" | "self_attn.v_proj.weight" => vec![kv, h],
                "self_attn.o_proj.weight" => vec![h, q],
                "self_attn.q_proj.bias" => vec![q],
                "self_attn.k_proj.bias" | "self_attn.v_proj.bias" => vec![kv],
                "mlp.gate_proj.weight" | "mlp.up_proj.weight" => vec![i, h],
                "mlp.down_proj.weight" => vec![h, i],
                _ => return None,
            }
        }
    })
}

/// Undoes llama.cpp's Q/K permutation: `rows` = n_head * head_dim rows of `cols` values each.
///
/// llama.cpp (`LlamaModel.permute`): `w.reshape(n_head, 2, d/2, cols).swapaxes(1, 2)`, i.e. GGUF
/// row `h*d + 2j + i` holds HF row `h*d + i*d/2 + j`.
pub fn unpermute_qk(data: &[f32], n_head: usize, cols: usize) -> Vec<f32> {
    permute_rows_qk(data, n_head, cols, true)
}

/// The inverse of [`unpermute_qk`] (HF layout to GGUF layout), used when writing GGUF files.
pub fn permute_qk(data: &[f32], n_head: usize, cols: usize) -> Vec<f32> {
    permute_rows_qk(data, n_head, cols, false)
}

/// Moves whole rows between the GGUF order (`h*d + 2j + i`) and the HF order (`h*d + i*d/2 + j`).
fn permute_rows_qk(data: &[f32], n_head: usize, cols: usize, to_hf: bool) -> Vec<f32> {
    let rows = data.len() / cols;
    let d = rows / n_head;
    let half = d / 2;
    let mut out = vec![0.0f32; data.len()];
    for h in 0..n_head {
        for j in 0..half {
            for i in 0..2 {
                let gguf_row = h * d + 2 * j + i;
                let hf_row = h * d + i * half + j;
                let (src, dst) = if to_hf { (gguf_row, hf_row) } else { (hf_row, gguf_row) };
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&data[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

impl Checkpoint {
    /// Opens a GGUF file or a Hugging Face model directory.
    ///
    /// # Errors
    /// [`Error::Io`] for a missing path; the errors of [`GgufFile::open`] and
    /// [`ModelConfig::from_gguf`] / [`ModelConfig::from_hf_json`]; [`Error::Invalid`] for a bad
    /// safetensors header or index.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
        if meta.is_dir() {
            Self::open_hf_dir(path)
        } else {
            let g = GgufFile::open(path)?;
            let config = ModelConfig::from_gguf(&g)?;
            Ok(Self { path: path.to_path_buf(), config, source: Source::Gguf(Box::new(g)) })
        }
    }

    fn open_hf_dir(dir: &Path) -> Result<Self> {
        let config = ModelConfig::from_hf_json(&dir.join("config.json"))?;
        let quant = QuantConfig::from_dir(dir)?;
        let mut index = BTreeMap::new();
        let mut shards = BTreeMap::new();
        let single = dir.join("model.safetensors");
        let index_path = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if single.exists() {
            vec![single]
        } else if index_path.exists() {
            let text = std::fs::read_to_string(&index_path).map_err(|e| Error::io(&index_path, e))?;
            let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Invalid {
                path: index_path.clone(),
                format: "safetensors index",
                msg: e.to_string(),
            })?;
            let map = v.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| Error::Invalid {
                path: index_path.clone(),
                format: "safetensors index",
                msg: "no `weight_map` object".into(),
            })?;
            let mut files: Vec<PathBuf> = map
                .values()
                .filter_map(|f| f.as_str())
                .map(|f| dir.join(f))
                .collect();
            files.sort();
            files.dedup();
            files
        } else {
            return Err(Error::Io {
                path: single,
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "neither model.safetensors nor model.safetensors.index.json exists",
                ),
            });
        };
        for f in files {
            let file = std::fs::File::open(&f).map_err(|e| Error::io(&f, e))?;
            // SAFETY: read-only map of a model file that deco does not modify while open.
            let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(&f, e))?;
            let (n, meta) = safetensors::SafeTensors::read_metadata(&mmap).map_err(|e| Error::Invalid {
                path: f.clone(),
                format: "safetensors",
                msg: e.to_string(),
            })?;
            for name in meta.tensors().keys() {
                index.insert(name.clone(), f.clone());
            }
            shards.insert(f, Shard { mmap, data_start: 8 + n, meta });
        }
        Ok(Self { path: dir.to_path_buf(), config, source: Source::Safetensors { index, shards, quant } })
    }

    /// The path this checkpoint was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The quantization settings of a GPTQ / AWQ / compressed-tensors directory (`None` for
    /// GGUF files and unquantized directories).
    pub fn quant_config(&self) -> Option<&QuantConfig> {
        match &self.source {
            Source::Safetensors { quant, .. } => quant.as_ref(),
            Source::Gguf(_) => None,
        }
    }

    /// The integer form (codes, scales, zero points, `g_idx`) of a packed linear of a GPTQ /
    /// AWQ / compressed-tensors directory, by its transformers weight name
    /// (`model.layers.0.self_attn.q_proj.weight`); `None` when the checkpoint is not quantized
    /// or stores this weight unpacked.
    ///
    /// # Errors
    /// The errors of [`crate::quantized::decode`] (missing companion tensors, wrong shapes or
    /// dtypes), [`Error::Invalid`] for an unreadable shard.
    pub fn quantized_linear(&self, hf_name: &str) -> Result<Option<crate::quantized::IntLinear>> {
        let Source::Safetensors { index, shards, quant: Some(q) } = &self.source else { return Ok(None) };
        let Some(prefix) = hf_name.strip_suffix(".weight") else { return Ok(None) };
        if index.contains_key(hf_name) || !index.contains_key(&format!("{prefix}.{}", crate::quantized::marker(q.method))) {
            return Ok(None);
        }
        self.decode_packed(index, shards, q, hf_name, prefix).map(Some)
    }

    /// Dequantizes the packed linear stored under `prefix` (`<prefix>.qweight` ... or
    /// `<prefix>.weight_packed` ...) as a `[out, in]` f32 weight.
    fn dequantize_packed(
        &self,
        index: &BTreeMap<String, PathBuf>,
        shards: &BTreeMap<PathBuf, Shard>,
        quant: &QuantConfig,
        hf_name: &str,
        prefix: &str,
    ) -> Result<(Vec<usize>, Vec<f32>)> {
        let l = self.decode_packed(index, shards, quant, hf_name, prefix)?;
        Ok((vec![l.out_features, l.in_features], l.dequantize()))
    }

    fn decode_packed(
        &self,
        index: &BTreeMap<String, PathBuf>,
        shards: &BTreeMap<PathBuf, Shard>,
        quant: &QuantConfig,
        hf_name: &str,
        prefix: &str,
    ) -> Result<crate::quantized::IntLinear> {
        let not_found = || Error::TensorNotFound { path: self.path.clone(), name: hf_name.to_string() };
        let shape = hf_expected_shape(&self.config, hf_name).filter(|s| s.len() == 2).ok_or_else(not_found)?;
        let get = |name: &str| -> Option<RawTensor<'_>> { shards.get(index.get(name)?)?.raw(name) };
        crate::quantized::decode(&get, quant, prefix, shape[0], shape[1], &self.path)
    }

    /// The GGUF file, when the checkpoint is one.
    pub fn gguf(&self) -> Option<&GgufFile> {
        match &self.source {
            Source::Gguf(g) => Some(g),
            Source::Safetensors { .. } => None,
        }
    }

    /// A tensor by transformers name, as f32 in row-major HF layout, with its shape checked
    /// against the configuration.
    ///
    /// # Errors
    /// [`Error::TensorNotFound`], [`Error::ShapeMismatch`], [`Error::Ggml`] for an unsupported
    /// quantization type, [`Error::Invalid`] for an unsupported safetensors dtype.
    pub fn tensor(&self, hf_name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let not_found = || Error::TensorNotFound { path: self.path.clone(), name: hf_name.to_string() };
        let (shape, data) = match &self.source {
            Source::Gguf(g) => {
                let gname = hf_to_gguf_name(hf_name).ok_or_else(not_found)?;
                if g.tensor_info(&gname).is_none() {
                    return Err(not_found());
                }
                let (shape, mut data) = g.dequantize(&gname)?;
                if self.config.model_type == Architecture::Llama {
                    let heads = if hf_name.ends_with("q_proj.weight") || hf_name.ends_with("q_proj.bias") {
                        Some(self.config.num_attention_heads)
                    } else if hf_name.ends_with("k_proj.weight") || hf_name.ends_with("k_proj.bias") {
                        Some(self.config.num_key_value_heads)
                    } else {
                        None
                    };
                    if let Some(n_head) = heads {
                        let cols = if shape.len() == 2 { shape[1] } else { 1 };
                        if data.len() % (n_head * cols * 2) != 0 {
                            return Err(Error::ShapeMismatch {
                                path: self.path.clone(),
                                name: hf_name.to_string(),
                                found: shape,
                                expected: hf_expected_shape(&self.config, hf_name).unwrap_or_default(),
                            });
                        }
                        data = unpermute_qk(&data, n_head, cols);
                    }
                }
                (shape, data)
            }
            Source::Safetensors { index, shards, quant } => {
                if !index.contains_key(hf_name)
                    && let Some(q) = quant
                    && let Some(prefix) = hf_name.strip_suffix(".weight")
                    && index.contains_key(&format!("{prefix}.{}", crate::quantized::marker(q.method)))
                {
                    return self.dequantize_packed(index, shards, q, hf_name, prefix);
                }
                let file = index.get(hf_name).ok_or_else(not_found)?;
                let view = shards.get(file).and_then(|sh| sh.raw(hf_name)).ok_or_else(not_found)?;
                let bytes = view.data;
                let data: Vec<f32> = match view.dtype {
                    safetensors::Dtype::F32 => bytes
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                        .collect(),
                    safetensors::Dtype::F16 => bytes
                        .chunks_exact(2)
                        .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                        .collect(),
                    safetensors::Dtype::BF16 => bytes
                        .chunks_exact(2)
                        .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                        .collect(),
                    other => {
                        return Err(Error::Invalid {
                            path: file.clone(),
                            format: "safetensors",
                            msg: format!("tensor `{hf_name}` has dtype {other:?}; supported: F32, F16, BF16"),
                        });
                    }
                };
                (view.shape, data)
            }
        };
        if let Some(expected) = hf_expected_shape(&self.config, hf_name)
            && expected != shape
        {
            return Err(Error::ShapeMismatch { path: self.path.clone(), name: hf_name.to_string(), found: shape, expected });
        }
        Ok((shape, data))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qk_permutation_matches_llama_cpp_reshape_and_inverts() {
        // 2 heads of d = 4, 1 column: HF rows [h0: a0 a1 b0 b1 | h1: ...] where a = first half.
        let hf: Vec<f32> = (0..8).map(|x| x as f32).collect();
        // llama.cpp: reshape(2, 2, 2, 1).swapaxes(1, 2): per head [x0, x2, x1, x3].
        let gguf = permute_qk(&hf, 2, 1);
        assert_eq!(gguf, vec![0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0]);
        assert_eq!(unpermute_qk(&gguf, 2, 1), hf);
    }
}
