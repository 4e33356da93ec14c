//! Compact storage of sparse weights: a bitmask plus the nonzero values.
//!
//! File `model.sparse.safetensors` (a plain safetensors file) beside the usual `config.json` and
//! tokenizer files. For a sparse tensor `NAME` (the decoder linear weights):
//!
//! | entry | dtype | shape | content |
//! |---|---|---|---|
//! | `NAME.mask` | U8 | `[ceil(numel / 8)]` | bit `i` (byte `i / 8`, bit `i % 8`, LSB first) set iff flat element `i` (row-major) is nonzero |
//! | `NAME.values` | F32 or BF16 | `[nnz]` | the nonzero elements in row-major order |
//!
//! and the header metadata `shape:NAME` = `"rows,cols"`. Every other tensor (embedding, norms) is
//! stored dense under its own name. Metadata `format` = `deco-sparse-v1`.
//!
//! Cost per weight: `1 + (1 - s) · b` bits at sparsity `s` with `b`-bit values, so 17 bits
//! (f32) or 9 bits (bf16) at 50%, vs 32 / 16 dense. A zero of either sign is stored as absent
//! and comes back as `+0.0`; every other f32 value (NaN included) round-trips bit for bit with
//! F32 values.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use deco_formats::config::ModelConfig;
use deco_formats::hf_export::ExportDtype;

use crate::{Error, Result, io_err};

/// The sparse weight file's name.
pub const SPARSE_FILE: &str = "model.sparse.safetensors";
const FORMAT: &str = "deco-sparse-v1";

/// Whether a tensor is stored sparse: 2-D tensors of the decoder layers.
pub fn is_sparse_candidate(name: &str, shape: &[usize]) -> bool {
    shape.len() == 2 && name.starts_with("model.layers.")
}

/// A tensor in the form it is stored.
#[derive(Debug, Clone, PartialEq)]
pub struct SparseTensor {
    /// Logical shape.
    pub shape: Vec<usize>,
    /// Nonzero bitmask (`None`: dense, `values` holds every element).
    pub mask: Option<Vec<u8>>,
    /// The nonzero values in row-major order (or all values when dense).
    pub values: Vec<f32>,
}

impl SparseTensor {
    /// Bitmask + nonzero values of `data` (row-major, `shape.iter().product()` values).
    pub fn encode(shape: &[usize], data: &[f32]) -> Self {
        let mut mask = vec![0u8; data.len().div_ceil(8)];
        let mut values = Vec::new();
        for (i, &v) in data.iter().enumerate() {
            if v != 0.0 {
                mask[i / 8] |= 1 << (i % 8);
                values.push(v);
            }
        }
        Self { shape: shape.to_vec(), mask: Some(mask), values }
    }

    /// A dense tensor.
    pub fn dense(shape: &[usize], data: &[f32]) -> Self {
        Self { shape: shape.to_vec(), mask: None, values: data.to_vec() }
    }

    /// Elements of the logical shape.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The dense row-major data.
    ///
    /// # Errors
    /// [`Error::Shape`] if the mask length or the number of set bits does not match.
    pub fn decode(&self) -> Result<Vec<f32>> {
        let n = self.numel();
        let Some(mask) = &self.mask else {
            if self.values.len() != n {
                return Err(Error::Shape(format!("dense tensor of {} values for shape {:?}", self.values.len(), self.shape)));
            }
            return Ok(self.values.clone());
        };
        if mask.len() != n.div_ceil(8) {
            return Err(Error::Shape(format!("mask of {} bytes for {n} elements", mask.len())));
        }
        let mut out = vec![0.0f32; n];
        let mut vals = self.values.iter();
        for (i, o) in out.iter_mut().enumerate() {
            if mask[i / 8] >> (i % 8) & 1 == 1 {
                *o = *vals.next().ok_or_else(|| Error::Shape("fewer values than set mask bits".into()))?;
            }
        }
        if vals.next().is_some() {
            return Err(Error::Shape("more values than set mask bits".into()));
        }
        Ok(out)
    }
}

fn value_bytes(v: &[f32], dtype: ExportDtype) -> Vec<u8> {
    match dtype {
        ExportDtype::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ExportDtype::Bf16 => v.iter().flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()).collect(),
    }
}

/// Writes `tensors` to a sparse safetensors file at `path`.
///
/// # Errors
/// [`Error::SparseFormat`] from the safetensors writer, [`Error::Io`].
pub fn write_file(path: &Path, tensors: &[(String, SparseTensor)], dtype: ExportDtype) -> Result<()> {
    let bad = |msg: String| Error::SparseFormat { path: path.to_path_buf(), msg };
    let st_dtype = match dtype {
        ExportDtype::F32 => safetensors::Dtype::F32,
        ExportDtype::Bf16 => safetensors::Dtype::BF16,
    };
    let mut meta = HashMap::from([("format".to_string(), FORMAT.to_string())]);
    let mut buffers: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, t) in tensors {
        match &t.mask {
            Some(mask) => {
                meta.insert(format!("shape:{name}"), t.shape.iter().map(usize::to_string).collect::<Vec<_>>().join(","));
                buffers.push((format!("{name}.mask"), safetensors::Dtype::U8, vec![mask.len()], mask.clone()));
                buffers.push((format!("{name}.values"), st_dtype, vec![t.values.len()], value_bytes(&t.values, dtype)));
            }
            None => buffers.push((name.clone(), st_dtype, t.shape.clone(), value_bytes(&t.values, dtype))),
        }
    }
    let views = buffers
        .iter()
        .map(|(n, d, s, b)| safetensors::tensor::TensorView::new(*d, s.clone(), b).map(|v| (n.clone(), v)).map_err(|e| bad(format!("{n}: {e}"))))
        .collect::<Result<Vec<_>>>()?;
    safetensors::serialize_to_file(views, Some(meta), path).map_err(|e| bad(e.to_string()))
}

/// A model directory written by [`crate::export::write_sparse_dir`].
#[derive(Debug)]
pub struct SparseCheckpoint {
    path: PathBuf,
    /// The model configuration (`config.json`).
    pub config: ModelConfig,
    bytes: Vec<u8>,
    shapes: HashMap<String, Vec<usize>>,
}

fn floats(bytes: &[u8], dtype: safetensors::Dtype) -> Option<Vec<f32>> {
    match dtype {
        safetensors::Dtype::F32 => Some(bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()),
        safetensors::Dtype::BF16 => Some(bytes.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect()),
        _ => None,
    }
}

impl SparseCheckpoint {
    /// Opens a sparse model directory (`config.json` + `model.sparse.safetensors`).
    ///
    /// # Errors
    /// [`Error::Io`] for a missing file, [`Error::Format`] for a bad `config.json`,
    /// [`Error::SparseFormat`] for a file that is not a deco sparse checkpoint.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let config = ModelConfig::from_hf_json(&dir.join("config.json"))?;
        let path = dir.join(SPARSE_FILE);
        let bytes = std::fs::read(&path).map_err(io_err(&path))?;
        let bad = |msg: String| Error::SparseFormat { path: path.clone(), msg };
        let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| bad(e.to_string()))?;
        let meta = header.metadata().clone().unwrap_or_default();
        if meta.get("format").map(String::as_str) != Some(FORMAT) {
            return Err(bad(format!("metadata `format` is not `{FORMAT}`")));
        }
        let mut shapes = HashMap::new();
        for (k, v) in &meta {
            if let Some(name) = k.strip_prefix("shape:") {
                let s = v.split(',').map(|x| x.trim().parse::<usize>()).collect::<std::result::Result<Vec<_>, _>>().map_err(|_| bad(format!("bad shape `{v}` of `{name}`")))?;
                shapes.insert(name.to_string(), s);
            }
        }
        Ok(Self { path, config, bytes, shapes })
    }

    /// The stored form of a tensor.
    ///
    /// # Errors
    /// [`Error::SparseFormat`] for a missing tensor or an unsupported dtype.
    pub fn stored(&self, name: &str) -> Result<SparseTensor> {
        let bad = |msg: String| Error::SparseFormat { path: self.path.clone(), msg };
        let st = safetensors::SafeTensors::deserialize(&self.bytes).map_err(|e| bad(e.to_string()))?;
        let read = |n: &str| -> Result<(Vec<usize>, Vec<f32>)> {
            let v = st.tensor(n).map_err(|_| bad(format!("no tensor `{n}`")))?;
            let f = floats(v.data(), v.dtype()).ok_or_else(|| bad(format!("tensor `{n}` has dtype {:?}; expected F32 or BF16", v.dtype())))?;
            Ok((v.shape().to_vec(), f))
        };
        match self.shapes.get(name) {
            Some(shape) => {
                let m = st.tensor(&format!("{name}.mask")).map_err(|_| bad(format!("no tensor `{name}.mask`")))?;
                let (_, values) = read(&format!("{name}.values"))?;
                Ok(SparseTensor { shape: shape.clone(), mask: Some(m.data().to_vec()), values })
            }
            None => {
                let (shape, values) = read(name)?;
                Ok(SparseTensor { shape, mask: None, values })
            }
        }
    }

    /// A tensor by transformers name, dense f32 `(shape, row-major data)`.
    ///
    /// # Errors
    /// As [`SparseCheckpoint::stored`], plus [`Error::Shape`] for an inconsistent mask.
    pub fn tensor(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let t = self.stored(name)?;
        let d = t.decode()?;
        Ok((t.shape, d))
    }

    /// [`SparseCheckpoint::tensor`] with `deco_model`'s error type, for
    /// `deco_model::Llama::load_from(&ckpt.config, &|n| ckpt.model_tensor(n), ..)`.
    ///
    /// # Errors
    /// [`deco_model::Error::InvalidInput`] carrying the message.
    pub fn model_tensor(&self, name: &str) -> deco_model::Result<(Vec<usize>, Vec<f32>)> {
        self.tensor(name).map_err(|e| deco_model::Error::InvalidInput(e.to_string()))
    }
}
