//! Writing a Hugging Face model directory (`deco convert`).
//!
//! The directory holds `model.safetensors` (transformers names and layout, f32 or bf16),
//! `config.json`, `generation_config.json`, `tokenizer.json` and `tokenizer_config.json` (with the
//! chat template). Everything is written into a hidden sibling directory that is renamed into
//! place at the end, so an interrupted export never leaves a half-written model.

use std::collections::HashMap;
use std::path::Path;

use crate::checkpoint::{Checkpoint, hf_tensor_names};
use crate::config::ModelConfig;
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

/// Weight dtype of an exported checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExportDtype {
    /// 32-bit float: an exact copy of the (dequantized) weights.
    F32,
    /// bfloat16, rounded to nearest even.
    Bf16,
}

impl ExportDtype {
    /// transformers' `torch_dtype` name.
    pub fn torch_name(self) -> &'static str {
        match self {
            Self::F32 => "float32",
            Self::Bf16 => "bfloat16",
        }
    }
}

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> Error + '_ {
    move |e| Error::io(path, e)
}

/// Writes `ckpt` (with `tok`) as a Hugging Face directory at `out_dir`.
///
/// `out_dir` must not exist or be an empty directory.
///
/// # Errors
/// [`Error::Invalid`] if `out_dir` is a non-empty directory; reading errors of the checkpoint;
/// [`Error::Io`] for write failures (the partial output is removed).
pub fn write_hf_dir(ckpt: &Checkpoint, tok: &Tokenizer, out_dir: &Path, dtype: ExportDtype) -> Result<()> {
    if !crate::atomic::is_absent_or_empty(out_dir).map_err(io_err(out_dir))? {
        return Err(Error::Invalid { path: out_dir.to_path_buf(), format: "output directory", msg: "exists and is not empty".into() });
    }
    crate::atomic::write_dir(out_dir, |tmp| write_contents(ckpt, tok, tmp, dtype), |p, e| Error::io(p, e))
}

fn write_contents(ckpt: &Checkpoint, tok: &Tokenizer, dir: &Path, dtype: ExportDtype) -> Result<()> {
    write_weights(ckpt, dir, dtype)?;
    write_hf_metadata(&ckpt.config, tok, dir, dtype)
}

/// `dir/model.safetensors`: every tensor of `ckpt` under its transformers name, in `dtype`.
fn write_weights(ckpt: &Checkpoint, dir: &Path, dtype: ExportDtype) -> Result<()> {
    let cfg = &ckpt.config;
    let mut buffers: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for name in hf_tensor_names(cfg) {
        let (shape, data) = ckpt.tensor(&name)?;
        let bytes: Vec<u8> = match dtype {
            ExportDtype::F32 => data.iter().flat_map(|x| x.to_le_bytes()).collect(),
            ExportDtype::Bf16 => data.iter().flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()).collect(),
        };
        buffers.push((name, shape, bytes));
    }
    let st_dtype = match dtype {
        ExportDtype::F32 => safetensors::Dtype::F32,
        ExportDtype::Bf16 => safetensors::Dtype::BF16,
    };
    let st_path = dir.join("model.safetensors");
    let st_err = |msg: String| Error::Invalid { path: st_path.clone(), format: "safetensors", msg };
    let views = buffers
        .iter()
        .map(|(n, s, b)| {
            safetensors::tensor::TensorView::new(st_dtype, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| st_err(format!("{n}: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(meta), &st_path).map_err(|e| st_err(e.to_string()))
}

/// Writes the files of a Hugging Face directory other than the weights into the existing
/// directory `dir` (not atomically: for a directory that is itself being built, e.g. inside
/// [`crate::atomic::write_dir`]): `config.json` of `cfg` with `torch_dtype` = `dtype`,
/// `generation_config.json` (BOS and the tokenizer's end-of-generation ids) and the tokenizer
/// files ([`Tokenizer::save_hf`]).
///
/// # Errors
/// [`Error::Io`] for write failures; the tokenizer's save errors.
pub fn write_hf_metadata(cfg: &ModelConfig, tok: &Tokenizer, dir: &Path, dtype: ExportDtype) -> Result<()> {
    let json = |v: &serde_json::Value| serde_json::to_string_pretty(v).unwrap_or_default();
    let config_path = dir.join("config.json");
    std::fs::write(&config_path, json(&cfg.to_hf_json(dtype.torch_name()))).map_err(io_err(&config_path))?;

    let mut generation = serde_json::json!({ "_from_model_config": true });
    if let Some(b) = cfg.bos_token_id {
        generation["bos_token_id"] = b.into();
    }
    // The end-of-generation set of the tokenizer (llama.cpp's EOG rule), so that a converted
    // model stops where the GGUF one does.
    let eos = tok.eos_token_ids();
    if !eos.is_empty() {
        generation["eos_token_id"] = eos.to_vec().into();
    }
    let gen_path = dir.join("generation_config.json");
    std::fs::write(&gen_path, json(&generation)).map_err(io_err(&gen_path))?;
    tok.save_hf(dir)
}
