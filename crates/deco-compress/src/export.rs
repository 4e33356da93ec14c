//! Writing pruned models to disk, atomically.
//!
//! Both writers build the directory under a hidden sibling name: the tokenizer, generation
//! config and chat template as `deco convert` writes them
//! ([`deco_formats::hf_export::write_hf_metadata`]), then the pruned model's `config.json` and
//! weights; [`deco_formats::atomic::write_dir`] installs it at the end, so an interrupted run
//! never leaves a half-written model.
//!
//! - [`write_dense_dir`]: a Hugging Face directory (`model.safetensors`), loadable by
//!   `deco_formats::checkpoint::Checkpoint::open`, every `deco` command, and transformers.
//! - [`write_sparse_dir`]: the compact sparse form of [`crate::sparse`]
//!   (`model.sparse.safetensors`), loadable with [`crate::sparse::SparseCheckpoint`].

use std::collections::HashMap;
use std::path::Path;

use deco_formats::checkpoint::{Checkpoint, hf_tensor_names};
use deco_formats::config::ModelConfig;
use deco_formats::hf_export::{ExportDtype, write_hf_metadata};
use deco_formats::tokenizer::Tokenizer;

use crate::pipeline::TensorFn;
use crate::sparse::{SPARSE_FILE, SparseTensor, is_sparse_candidate};
use crate::{Error, Result, io_err};

fn check_out(out: &Path) -> Result<()> {
    if !deco_formats::atomic::is_absent_or_empty(out).map_err(io_err(out))? {
        return Err(crate::invalid("out", format!("{} exists and is not empty", out.display())));
    }
    Ok(())
}

/// Builds the directory at a temporary sibling of `out` with `fill`, then installs it at `out`
/// crash-safely ([`deco_formats::atomic::write_dir`]).
fn atomically(ckpt: &Checkpoint, tok: &Tokenizer, cfg: &ModelConfig, out: &Path, dtype: ExportDtype, fill: &dyn Fn(&Path) -> Result<()>) -> Result<()> {
    check_out(out)?;
    let build = |tmp: &Path| -> Result<()> {
        // Tokenizer and generation config as `deco convert` writes them for the source model,
        // then the pruned model's config.json and weights.
        write_hf_metadata(&ckpt.config, tok, tmp, dtype)?;
        let cfg_path = tmp.join("config.json");
        let json = serde_json::to_string_pretty(&cfg.to_hf_json(dtype.torch_name())).map_err(|e| crate::invalid("config", e.to_string()))?;
        std::fs::write(&cfg_path, json).map_err(io_err(&cfg_path))?;
        fill(tmp)
    };
    deco_formats::atomic::write_dir(out, build, |p, e| io_err(p)(e))
}

fn st_err(path: &Path) -> impl Fn(String) -> Error + '_ {
    move |msg| Error::SparseFormat { path: path.to_path_buf(), msg }
}

/// Writes a dense Hugging Face directory for the model `cfg` whose tensors come from `tensor`
/// (e.g. [`crate::pipeline::PrunedModel::source`] or [`crate::structured::StructuredPlan::pruned_tensor`]);
/// tokenizer files come from `ckpt` / `tok`.
///
/// # Errors
/// `out` is a non-empty directory; tensor errors; I/O errors (the partial output is removed).
pub fn write_dense_dir(ckpt: &Checkpoint, tok: &Tokenizer, cfg: &ModelConfig, tensor: &TensorFn<'_>, out: &Path, dtype: ExportDtype) -> Result<()> {
    atomically(ckpt, tok, cfg, out, dtype, &|dir| {
        let mut buffers: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
        for name in hf_tensor_names(cfg) {
            let (shape, data) = tensor(&name)?;
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
        let path = dir.join("model.safetensors");
        let views = buffers
            .iter()
            .map(|(n, s, b)| safetensors::tensor::TensorView::new(st_dtype, s.clone(), b).map(|v| (n.clone(), v)).map_err(|e| st_err(&path)(format!("{n}: {e}"))))
            .collect::<Result<Vec<_>>>()?;
        let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
        safetensors::serialize_to_file(views, Some(meta), &path).map_err(|e| st_err(&path)(e.to_string()))
    })
}

/// Writes the sparse form: decoder linear weights as bitmask + nonzero values
/// ([`SparseTensor`]), everything else dense, values in `dtype`.
///
/// # Errors
/// As [`write_dense_dir`].
pub fn write_sparse_dir(ckpt: &Checkpoint, tok: &Tokenizer, cfg: &ModelConfig, tensor: &TensorFn<'_>, out: &Path, dtype: ExportDtype) -> Result<()> {
    atomically(ckpt, tok, cfg, out, dtype, &|dir| {
        let mut tensors = Vec::new();
        for name in hf_tensor_names(cfg) {
            let (shape, data) = tensor(&name)?;
            if is_sparse_candidate(&name, &shape) {
                tensors.push((name, SparseTensor::encode(&shape, &data)));
            } else {
                tensors.push((name, SparseTensor::dense(&shape, &data)));
            }
        }
        crate::sparse::write_file(&dir.join(SPARSE_FILE), &tensors, dtype)
    })
}
