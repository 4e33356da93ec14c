//! Producing and writing quantized checkpoints: GPTQ (AutoGPTQ layout), AWQ GEMM,
//! compressed-tensors `pack-quantized`, GGUF Q8_0 / Q4_0 / Q4_1 / F32 (dequantized), and "fake"
//! (fake-quantized f32) Hugging Face directories.
//!
//! [`quantize_linears`] returns the integer form of each decoder linear ([`QuantizedTensor`]) from
//! the layer-by-layer loop of [`crate::pipeline::quantize_model`]; [`write_packed_dir`] packs them with
//! [`deco_formats::quantized::encode`] into a directory that
//! [`deco_formats::checkpoint::Checkpoint::open`] reads back (dequantizing on load), and that
//! AutoGPTQ / AutoAWQ / compressed-tensors loaders read as their own format. [`write_gguf_model`]
//! re-quantizes the linears of a GGUF model with ggml's block quantizers; [`write_gguf_f32`]
//! dequantizes every quantized tensor of a GGUF model to F32.
//!
//! The packing orders are documented in `docs/formats.md`.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use burn::tensor::Device;
use deco_formats::checkpoint::{hf_tensor_names, hf_to_gguf_name, permute_qk};
use deco_formats::config::{Architecture, ModelConfig};
use deco_formats::ggml::{self, GgmlType};
use deco_formats::gguf::{GgufFile, MetadataValue, TensorToWrite, write_gguf};
use deco_formats::quantized::{IntLinear, QuantConfig, StTensor, encode, write_safetensors_dir};
use deco_formats::tokenizer::Tokenizer;
use deco_model::calibrate::{CalibDtype, Linear};

use crate::pipeline::{Method, TensorFn, quantize_model};
use crate::scheme::{QuantizedTensor, Scheme};
use crate::{Error, Result, invalid};

pub use crate::scheme::quantize_rtn_ragged;

/// Quantizes every decoder linear of a model and keeps the integer forms, keyed by transformers
/// weight name (`model.layers.{i}.self_attn.q_proj.weight`, ...): the `quantized` map of
/// [`crate::pipeline::quantize_model`] (the same layer-by-layer loop; RTN with AutoGPTQ's ragged
/// groups, GPTQ true-sequential). `progress(layer)` is called after each layer.
///
/// # Errors
/// [`Error::InvalidParameter`] naming `method` for NF4, SmoothQuant and LLM.int8() (no integer
/// codes with zero points; write them as fake-quantized f32) and for AWQ (its scales are folded
/// into the norms, which this map cannot carry: use `quantize_model` and
/// [`crate::pipeline::QuantizedModel::source`]); otherwise `quantize_model`'s errors.
#[allow(clippy::too_many_arguments)] // the model, its calibration and the method's settings
pub fn quantize_linears(
    cfg: &ModelConfig,
    tensor: &TensorFn<'_>,
    device: &Device,
    windows: &[Vec<u32>],
    method: &Method,
    scheme: &Scheme,
    dtype: CalibDtype,
    progress: &mut dyn FnMut(usize),
) -> Result<BTreeMap<String, QuantizedTensor>> {
    match method {
        Method::Rtn | Method::Gptq(_) => Ok(quantize_model(cfg, tensor, device, windows, method, scheme, dtype, progress)?.quantized),
        Method::Awq(_) => Err(invalid("method", "AWQ folds scales into the norms; use pipeline::quantize_model and its source()")),
        _ => Err(invalid("method", "NF4, SmoothQuant and LLM.int8() have no integer codes with zero points; export them as fake-quantized f32")),
    }
}

/// The format-neutral integer form of a [`QuantizedTensor`] (per-tensor parameters broadcast to
/// every row; zero points as integers). Scales keep their f32 values; the packed formats round
/// them to f16 when writing.
pub fn to_int_linear(q: &QuantizedTensor) -> IntLinear {
    let g = q.groups();
    let mut scales = Vec::with_capacity(q.rows * g);
    let mut zeros = Vec::with_capacity(q.rows * g);
    for r in 0..q.rows {
        let pr = if q.param_rows == 1 { 0 } else { r };
        scales.extend_from_slice(&q.scales[pr * g..(pr + 1) * g]);
        zeros.extend(q.zeros[pr * g..(pr + 1) * g].iter().map(|&z| z as i32));
    }
    IntLinear {
        out_features: q.rows,
        in_features: q.cols,
        bits: q.bits,
        group_size: q.group_size,
        codes: q.codes.clone(),
        scales,
        zeros,
        g_idx: q.g_idx.clone(),
    }
}

/// What an export wrote.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ExportStats {
    /// Bytes written (all files).
    pub bytes: u64,
    /// Number of quantized linear layers.
    pub linears: usize,
}

fn dir_size(p: &Path) -> u64 {
    if p.is_file() {
        return std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    }
    std::fs::read_dir(p)
        .map(|rd| rd.filter_map(|e| e.ok()).map(|e| dir_size(&e.path())).sum())
        .unwrap_or(0)
}

fn generation_config(cfg: &ModelConfig, tok: &Tokenizer) -> String {
    let mut g = serde_json::json!({ "_from_model_config": true });
    if let Some(b) = cfg.bos_token_id {
        g["bos_token_id"] = b.into();
    }
    let eos = tok.eos_token_ids();
    if !eos.is_empty() {
        g["eos_token_id"] = eos.to_vec().into();
    }
    serde_json::to_string_pretty(&g).unwrap_or_default()
}

/// Writes a Hugging Face directory whose decoder linears are packed in `qcfg`'s format
/// (`model.safetensors` with `<layer>.qweight` ... or `<layer>.weight_packed` ...; every other
/// tensor f32 from `tensor`), `config.json` with `quantization_config`, for GPTQ also AutoGPTQ's
/// `quantize_config.json`, `generation_config.json` and the tokenizer. Atomic: written into a
/// temporary sibling and renamed.
///
/// # Errors
/// The [`encode`] errors of the format (e.g. a GPTQ v1 zero point of 0, bits the format cannot
/// pack) naming the layer, missing tensors, I/O errors.
pub fn write_packed_dir(
    cfg: &ModelConfig,
    tensor: &TensorFn<'_>,
    tok: &Tokenizer,
    quantized: &BTreeMap<String, QuantizedTensor>,
    qcfg: &QuantConfig,
    out_dir: &Path,
) -> Result<ExportStats> {
    let mut tensors: Vec<(String, StTensor)> = Vec::new();
    for name in hf_tensor_names(cfg) {
        match quantized.get(&name) {
            Some(q) => {
                let prefix = name.strip_suffix(".weight").unwrap_or(&name);
                tensors.extend(encode(&to_int_linear(q), qcfg, prefix, out_dir)?);
            }
            None => {
                let (shape, data) = tensor(&name)?;
                tensors.push((name, StTensor::f32(shape, &data)));
            }
        }
    }
    let mut config = cfg.to_hf_json("float32");
    config["quantization_config"] = qcfg.to_json();
    let pretty = |v: &serde_json::Value| serde_json::to_string_pretty(v).unwrap_or_default();
    let mut files = vec![("config.json", pretty(&config)), ("generation_config.json", generation_config(cfg, tok))];
    if qcfg.method == deco_formats::quantized::QuantMethod::Gptq {
        files.push(("quantize_config.json", pretty(&qcfg.to_json())));
    }
    write_safetensors_dir(out_dir, &tensors, &files, &|d| tok.save_hf(d))?;
    Ok(ExportStats { bytes: dir_size(out_dir), linears: quantized.len() })
}

/// Writes a Hugging Face directory with the given f32 linears (fake-quantized weights) in place
/// of the model's, everything else from `tensor`; no `quantization_config` (it loads as a plain
/// f32 model), plus the `extra` files (name, contents; e.g. `deco_act_quant.json`). Atomic like
/// [`write_packed_dir`].
///
/// # Errors
/// Missing tensors, a linear whose length does not match its shape, I/O errors.
pub fn write_fake_dir(
    cfg: &ModelConfig,
    tensor: &TensorFn<'_>,
    tok: &Tokenizer,
    linears: &HashMap<String, Vec<f32>>,
    extra: &[(&str, String)],
    out_dir: &Path,
) -> Result<ExportStats> {
    let mut tensors = Vec::new();
    for name in hf_tensor_names(cfg) {
        let (shape, data) = tensor(&name)?;
        let st = match linears.get(&name) {
            Some(w) if w.len() != data.len() => {
                return Err(Error::Shape(format!("{name}: {} values for shape {shape:?}", w.len())));
            }
            Some(w) => StTensor::f32(shape, w),
            None => StTensor::f32(shape, &data),
        };
        tensors.push((name, st));
    }
    let config = serde_json::to_string_pretty(&cfg.to_hf_json("float32")).unwrap_or_default();
    let mut files = vec![("config.json", config), ("generation_config.json", generation_config(cfg, tok))];
    files.extend(extra.iter().cloned());
    write_safetensors_dir(out_dir, &tensors, &files, &|d| tok.save_hf(d))?;
    Ok(ExportStats { bytes: dir_size(out_dir), linears: linears.len() })
}

/// llama.cpp's `general.file_type` (`LLAMA_FTYPE_MOSTLY_*`) of a model whose linears are `ty`.
fn file_type(ty: GgmlType) -> Option<u32> {
    match ty {
        GgmlType::Q4_0 => Some(2),
        GgmlType::Q4_1 => Some(3),
        GgmlType::Q8_0 => Some(7),
        _ => None,
    }
}

/// Quantizes a decoder linear (`[out, in]`, transformers layout) to GGML blocks in the GGUF
/// layout: llama Q/K rows permuted back for llama.cpp's RoPE
/// ([`deco_formats::checkpoint::permute_qk`]), then [`ggml::quantize_q8_0`] /
/// [`ggml::quantize_q4_0`] / [`ggml::quantize_q4_1`] row-major (blocks of 32 along the input).
///
/// # Errors
/// [`Error::InvalidParameter`] for another type; the ggml error for `in % 32 != 0`.
pub fn ggml_quantize_linear(cfg: &ModelConfig, hf_name: &str, w: &[f32], cols: usize, ty: GgmlType) -> Result<Vec<u8>> {
    let heads = if cfg.model_type != Architecture::Llama {
        None
    } else if hf_name.ends_with("q_proj.weight") {
        Some(cfg.num_attention_heads)
    } else if hf_name.ends_with("k_proj.weight") {
        Some(cfg.num_key_value_heads)
    } else {
        None
    };
    let permuted;
    let w = match heads {
        Some(n) => {
            permuted = permute_qk(w, n, cols);
            &permuted[..]
        }
        None => w,
    };
    ggml_quantize(hf_name, w, ty)
}

/// `w` (row-major, rows a multiple of 32 long) as `ty` blocks with ggml's reference quantizer;
/// errors name the tensor `name`.
fn ggml_quantize(name: &str, w: &[f32], ty: GgmlType) -> Result<Vec<u8>> {
    let fmt_err = |e: ggml::GgmlError| Error::Shape(format!("{name}: {e}"));
    match ty {
        GgmlType::Q8_0 => ggml::quantize_q8_0(w).map_err(fmt_err),
        GgmlType::Q4_0 => ggml::quantize_q4_0(w).map_err(fmt_err),
        GgmlType::Q4_1 => ggml::quantize_q4_1(w).map_err(fmt_err),
        other => Err(invalid("format", format!("GGUF export supports Q8_0, Q4_0, Q4_1, not {}", other.name()))),
    }
}

/// llama.cpp's `GGML_QNT_VERSION`, written as `general.quantization_version`.
pub const GGML_QNT_VERSION: u32 = 2;

/// Whether `llama-quantize` quantizes a tensor of a Llama-family model
/// (`tensor_allows_quantization` in llama.cpp's `src/llama-quant.cpp`, the rules that apply to
/// Llama / Qwen2 tensors): at least 2 dimensions, a name ending in `weight`, not a norm.
pub fn llama_quantizes(name: &str, dims: usize) -> bool {
    dims >= 2 && name.ends_with("weight") && !name.contains("_norm.weight")
}

/// llama.cpp's tensor order in a quantized file (`weight_name_comparer` of
/// `llama-model-loader.h`: by layer `blk.N.`, tensors outside the layers first, then by name).
pub fn llama_tensor_order(a: &str, b: &str) -> std::cmp::Ordering {
    let layer = |n: &str| -> i64 {
        n.strip_prefix("blk.")
            .and_then(|r| r.split('.').next())
            .and_then(|d| d.parse().ok())
            .unwrap_or(-1)
    };
    layer(a).cmp(&layer(b)).then_with(|| a.cmp(b))
}

/// Writes a GGUF model the way `llama-quantize --pure SRC OUT <ty>` does, byte for byte: every
/// tensor llama.cpp quantizes ([`llama_quantizes`]: the decoder linears, the token embedding
/// and the output head) stored as `ty`, the others (norms) copied; tensors in llama.cpp's
/// order ([`llama_tensor_order`]); the metadata copied in order except
/// `general.quantization_version` and `general.file_type`, which are moved to the end (set to
/// [`GGML_QNT_VERSION`] and `ty`'s file type), as `gguf_set_val_u32` does, and the `split.*`
/// keys, which are dropped. The decoder linears are the f32 weights of `tensor` (HF layout,
/// e.g. GPTQ-processed) with their Q/K rows permuted back ([`ggml_quantize_linear`]); the other
/// quantized tensors are the source's own values (dequantized when the source stores another
/// type, copied when it stores `ty`, as llama-quantize). Blocks come from ggml's reference
/// quantizers. Atomic (written to a temporary file and renamed). Checked against llama.cpp's
/// `llama-quantize --pure` by `cargo xtask interop` (docs/formats.md).
///
/// # Errors
/// [`Error::InvalidParameter`] for a type other than Q8_0 / Q4_0 / Q4_1; missing tensors;
/// the ggml and GGUF writer errors.
pub fn write_gguf_model(
    src: &GgufFile,
    cfg: &ModelConfig,
    tensor: &TensorFn<'_>,
    ty: GgmlType,
    out: &Path,
    progress: &mut dyn FnMut(usize),
) -> Result<ExportStats> {
    let ft = file_type(ty).ok_or_else(|| invalid("format", format!("GGUF export supports Q8_0, Q4_0, Q4_1, not {}", ty.name())))?;
    let mut hf_of: HashMap<String, String> = HashMap::new();
    for n in hf_tensor_names(cfg) {
        if n.starts_with("model.layers.") && n.ends_with("_proj.weight")
            && let Some(g) = hf_to_gguf_name(&n)
        {
            hf_of.insert(g, n);
        }
    }
    let mut quantized: HashMap<String, Vec<u8>> = HashMap::new();
    for li in 0..cfg.num_hidden_layers {
        for l in Linear::ALL {
            let name = format!("model.layers.{li}.{}.weight", l.hf_suffix());
            let (shape, w) = tensor(&name)?;
            let cols = shape.get(1).copied().unwrap_or(1);
            quantized.insert(name.clone(), ggml_quantize_linear(cfg, &name, &w, cols, ty)?);
        }
        progress(li);
    }
    // The other tensors llama-quantize quantizes (token embedding, output head), in GGUF layout.
    let mut others: HashMap<String, Vec<u8>> = HashMap::new();
    for info in &src.tensors {
        if hf_of.contains_key(&info.name) || !llama_quantizes(&info.name, info.shape().len()) || info.ggml_type == ty {
            continue;
        }
        let (_, values) = src.dequantize(&info.name)?;
        others.insert(info.name.clone(), ggml_quantize(&info.name, &values, ty)?);
    }
    let mut to_write = Vec::with_capacity(src.tensors.len());
    for info in &src.tensors {
        let data = hf_of.get(&info.name).and_then(|h| quantized.get(h)).or_else(|| others.get(&info.name));
        match data {
            Some(bytes) => to_write.push(TensorToWrite { name: info.name.clone(), shape: info.shape(), ggml_type: ty, data: bytes }),
            None => {
                let (_, bytes) = src.tensor_bytes(&info.name)?;
                to_write.push(TensorToWrite { name: info.name.clone(), shape: info.shape(), ggml_type: info.ggml_type, data: bytes });
            }
        }
    }
    to_write.sort_by(|a, b| llama_tensor_order(&a.name, &b.name));
    let mut meta: Vec<(String, MetadataValue)> = Vec::with_capacity(src.metadata_order.len() + 2);
    for k in &src.metadata_order {
        if k == "general.file_type" || k == "general.quantization_version" || k.starts_with("split.") {
            continue;
        }
        if let Some(v) = src.metadata.get(k) {
            meta.push((k.clone(), v.clone()));
        }
    }
    meta.push(("general.quantization_version".into(), MetadataValue::U32(GGML_QNT_VERSION)));
    meta.push(("general.file_type".into(), MetadataValue::U32(ft)));
    write_gguf(out, &meta, &to_write)?;
    Ok(ExportStats { bytes: dir_size(out), linears: quantized.len() + others.len() })
}

/// llama.cpp's `general.file_type` of a model whose tensors are all F32 (`LLAMA_FTYPE_ALL_F32`).
pub const FILE_TYPE_ALL_F32: u32 = 0;

/// Writes `src` as an all-F32 GGUF: every block-quantized tensor (decoder linears, and the token
/// embedding / output head when they are quantized) and every F16 / BF16 tensor is dequantized
/// with [`ggml::dequantize`] and stored as F32 (ggml type 0) in the same GGUF layout (no
/// permutation, same names and shapes); F32 tensors (norms) and integer tensors are copied byte
/// for byte, and so is the metadata (tokenizer, hyper-parameters), with `general.file_type` set
/// to [`FILE_TYPE_ALL_F32`]. The values are exactly the source's dequantized values, so the
/// network is the same. Atomic (written to a temporary file and renamed). `progress(i)` is
/// called after each converted tensor (`i` counts from 0). [`ExportStats::linears`] counts the
/// converted tensors.
///
/// # Errors
/// A tensor type deco cannot dequantize (e.g. IQ formats) as [`Error::Format`] naming the
/// tensor; the GGUF writer's errors.
pub fn write_gguf_f32(src: &GgufFile, out: &Path, progress: &mut dyn FnMut(usize)) -> Result<ExportStats> {
    let widen = |t: GgmlType| t.is_quantized() || matches!(t, GgmlType::F16 | GgmlType::BF16);
    let mut converted: HashMap<String, Vec<u8>> = HashMap::new();
    for info in src.tensors.iter().filter(|t| widen(t.ggml_type)) {
        let (_, values) = src.dequantize(&info.name)?;
        let mut bytes = Vec::with_capacity(values.len() * 4);
        for v in &values {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        progress(converted.len());
        converted.insert(info.name.clone(), bytes);
    }
    let mut to_write = Vec::with_capacity(src.tensors.len());
    for info in &src.tensors {
        let (ggml_type, data) = match converted.get(&info.name) {
            Some(bytes) => (GgmlType::F32, &bytes[..]),
            None => (info.ggml_type, src.tensor_bytes(&info.name)?.1),
        };
        to_write.push(TensorToWrite { name: info.name.clone(), shape: info.shape(), ggml_type, data });
    }
    let mut meta: Vec<(String, MetadataValue)> = Vec::with_capacity(src.metadata_order.len() + 1);
    for k in &src.metadata_order {
        if let Some(v) = src.metadata.get(k) {
            let v = if k == "general.file_type" { MetadataValue::U32(FILE_TYPE_ALL_F32) } else { v.clone() };
            meta.push((k.clone(), v));
        }
    }
    if !src.metadata.contains_key("general.file_type") {
        meta.push(("general.file_type".into(), MetadataValue::U32(FILE_TYPE_ALL_F32)));
    }
    write_gguf(out, &meta, &to_write)?;
    Ok(ExportStats { bytes: dir_size(out), linears: converted.len() })
}
