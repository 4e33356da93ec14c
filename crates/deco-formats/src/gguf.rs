//! GGUF reader (versions 2 and 3).
//!
//! Layout, as specified in ggml's `docs/gguf.md` and implemented by `gguf-py/gguf/gguf_reader.py`:
//!
//! ```text
//! magic "GGUF" | version u32 | tensor_count u64 | metadata_kv_count u64
//! metadata_kv_count x (key: string, value_type: u32, value)
//! tensor_count x (name: string, n_dims: u32, dims: n_dims x u64, type: u32, offset: u64)
//! padding to `general.alignment` (default 32)
//! tensor data; each tensor at data_start + offset, offsets multiples of the alignment
//! ```
//!
//! Strings are a `u64` length followed by UTF-8 bytes; everything is little-endian. Tensor
//! dimensions are listed fastest-varying first (`ne[0]` is the row length), so a PyTorch weight of
//! shape `[out, in]` appears with dims `[in, out]`; [`TensorInfo::shape`] gives the row-major
//! (PyTorch) order.
//!
//! The file is memory-mapped: opening a 100 MB model reads only its header, and tensor bytes are
//! borrowed straight from the map.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use crate::ggml::GgmlType;
use crate::{Error, Result};

/// A GGUF metadata value (`gguf_type` in ggml).
#[derive(Debug, Clone, PartialEq)]
pub enum MetadataValue {
    /// `GGUF_TYPE_UINT8`
    U8(u8),
    /// `GGUF_TYPE_INT8`
    I8(i8),
    /// `GGUF_TYPE_UINT16`
    U16(u16),
    /// `GGUF_TYPE_INT16`
    I16(i16),
    /// `GGUF_TYPE_UINT32`
    U32(u32),
    /// `GGUF_TYPE_INT32`
    I32(i32),
    /// `GGUF_TYPE_FLOAT32`
    F32(f32),
    /// `GGUF_TYPE_BOOL`
    Bool(bool),
    /// `GGUF_TYPE_STRING`
    String(String),
    /// `GGUF_TYPE_ARRAY` (elements all of one type, possibly nested arrays)
    Array(Vec<MetadataValue>),
    /// `GGUF_TYPE_UINT64`
    U64(u64),
    /// `GGUF_TYPE_INT64`
    I64(i64),
    /// `GGUF_TYPE_FLOAT64`
    F64(f64),
}

impl MetadataValue {
    /// The GGUF type name (`"u32"`, `"string"`, `"array"`, ...).
    pub fn type_name(&self) -> &'static str {
        match self {
            Self::U8(_) => "u8",
            Self::I8(_) => "i8",
            Self::U16(_) => "u16",
            Self::I16(_) => "i16",
            Self::U32(_) => "u32",
            Self::I32(_) => "i32",
            Self::F32(_) => "f32",
            Self::Bool(_) => "bool",
            Self::String(_) => "string",
            Self::Array(_) => "array",
            Self::U64(_) => "u64",
            Self::I64(_) => "i64",
            Self::F64(_) => "f64",
        }
    }

    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Self::U8(v) => Some(v.into()),
            Self::U16(v) => Some(v.into()),
            Self::U32(v) => Some(v.into()),
            Self::U64(v) => Some(v),
            Self::I8(v) => u64::try_from(v).ok(),
            Self::I16(v) => u64::try_from(v).ok(),
            Self::I32(v) => u64::try_from(v).ok(),
            Self::I64(v) => u64::try_from(v).ok(),
            Self::Bool(_) | Self::F32(_) | Self::F64(_) | Self::String(_) | Self::Array(_) => None,
        }
    }

    /// The value as a float, if it is numeric.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            // The shortest decimal that round-trips the f32 (1e-5 rather than 9.99999974e-6),
            // so values copied into a `config.json` read as their authors wrote them.
            Self::F32(v) => Some(v.to_string().parse::<f64>().unwrap_or(f64::from(v))),
            Self::F64(v) => Some(v),
            Self::I8(v) => Some(v.into()),
            Self::I16(v) => Some(v.into()),
            Self::I32(v) => Some(v.into()),
            // Integer metadata values are small in practice; precision loss is acceptable here.
            Self::I64(v) => Some(v as f64),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    /// The value as a string slice.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value as a bool.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Self::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The value as an array.
    pub fn as_array(&self) -> Option<&[MetadataValue]> {
        match self {
            Self::Array(a) => Some(a),
            _ => None,
        }
    }
}

impl fmt::Display for MetadataValue {
    /// Short human form; arrays longer than 8 elements are abbreviated with their length.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::U8(v) => write!(f, "{v}"),
            Self::I8(v) => write!(f, "{v}"),
            Self::U16(v) => write!(f, "{v}"),
            Self::I16(v) => write!(f, "{v}"),
            Self::U32(v) => write!(f, "{v}"),
            Self::I32(v) => write!(f, "{v}"),
            Self::F32(v) => write!(f, "{v}"),
            Self::Bool(v) => write!(f, "{v}"),
            Self::String(s) => {
                if s.chars().count() > 80 {
                    let head: String = s.chars().take(77).collect();
                    write!(f, "{head:?}... ({} chars)", s.chars().count())
                } else {
                    write!(f, "{s:?}")
                }
            }
            Self::Array(a) => {
                let ty = a.first().map_or("?", |v| v.type_name());
                if a.len() > 8 {
                    write!(f, "[{ty}; {}] [", a.len())?;
                    for (i, v) in a.iter().take(4).enumerate() {
                        if i > 0 {
                            f.write_str(", ")?;
                        }
                        write!(f, "{v}")?;
                    }
                    f.write_str(", ...]")
                } else {
                    f.write_str("[")?;
                    for (i, v) in a.iter().enumerate() {
                        if i > 0 {
                            f.write_str(", ")?;
                        }
                        write!(f, "{v}")?;
                    }
                    f.write_str("]")
                }
            }
            Self::U64(v) => write!(f, "{v}"),
            Self::I64(v) => write!(f, "{v}"),
            Self::F64(v) => write!(f, "{v}"),
        }
    }
}

/// One entry of the GGUF tensor table.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// Tensor name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Dimensions as stored in GGUF, fastest-varying first (`ne[0]` = row length).
    pub dims: Vec<u64>,
    /// Element type.
    pub ggml_type: GgmlType,
    /// Byte offset of the data relative to the start of the data section.
    pub offset: u64,
    /// Size of the data in bytes (from the type's block size).
    pub n_bytes: usize,
}

impl TensorInfo {
    /// Row-major (PyTorch) shape: the GGUF dims reversed.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }

    /// Number of elements.
    pub fn n_elements(&self) -> usize {
        self.dims.iter().map(|&d| d as usize).product()
    }
}

/// A memory-mapped GGUF file.
pub struct GgufFile {
    path: PathBuf,
    mmap: memmap2::Mmap,
    /// File format version (2 or 3).
    pub version: u32,
    /// Metadata in file order (keys are unique; a duplicate key is an error).
    pub metadata: BTreeMap<String, MetadataValue>,
    /// Metadata keys in file order.
    pub metadata_order: Vec<String>,
    /// Tensor table in file order.
    pub tensors: Vec<TensorInfo>,
    /// Alignment of the data section (`general.alignment`, default 32).
    pub alignment: u64,
    /// Absolute file offset of the data section.
    pub data_offset: u64,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("n_metadata", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .finish()
    }
}

/// Upper bound on any count read from a header before allocation: guards against corrupt files
/// that declare absurd sizes.
const MAX_COUNT: u64 = 1 << 28;

struct Cursor<'a> {
    path: &'a Path,
    data: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.data.len());
        match end {
            Some(end) => {
                let s = &self.data[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(Error::Truncated {
                path: self.path.to_path_buf(),
                what: what(),
                needed: (self.pos as u64).saturating_add(n as u64),
                len: self.data.len() as u64,
            }),
        }
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn invalid(&self, msg: String) -> Error {
        Error::Invalid { path: self.path.to_path_buf(), format: "GGUF", msg }
    }

    fn count(&mut self, what: &dyn Fn() -> String) -> Result<usize> {
        let n = self.u64(what)?;
        if n > MAX_COUNT {
            return Err(self.invalid(format!("{} declares an impossible count {n}", what())));
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let n = self.u64(what)?;
        if n > self.data.len() as u64 {
            return Err(Error::Truncated {
                path: self.path.to_path_buf(),
                what: what(),
                needed: (self.pos as u64).saturating_add(n),
                len: self.data.len() as u64,
            });
        }
        let bytes = self.take(n as usize, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|e| self.invalid(format!("{}: string is not valid UTF-8 ({e})", what())))
    }

    fn value(&mut self, ty: u32, what: &dyn Fn() -> String, depth: u32) -> Result<MetadataValue> {
        use MetadataValue as V;
        Ok(match ty {
            0 => V::U8(self.array::<1>(what)?[0]),
            1 => V::I8(i8::from_le_bytes(self.array(what)?)),
            2 => V::U16(u16::from_le_bytes(self.array(what)?)),
            3 => V::I16(i16::from_le_bytes(self.array(what)?)),
            4 => V::U32(self.u32(what)?),
            5 => V::I32(i32::from_le_bytes(self.array(what)?)),
            6 => V::F32(f32::from_le_bytes(self.array(what)?)),
            7 => match self.array::<1>(what)?[0] {
                0 => V::Bool(false),
                1 => V::Bool(true),
                b => return Err(self.invalid(format!("{}: bool byte {b} is not 0 or 1", what()))),
            },
            8 => V::String(self.string(what)?),
            9 => {
                if depth > 4 {
                    return Err(self.invalid(format!("{}: arrays nested too deeply", what())));
                }
                let elem_ty = self.u32(what)?;
                let n = self.count(what)?;
                // Each element takes at least one byte: a count beyond the remaining bytes is corrupt.
                if n > self.data.len() - self.pos {
                    return Err(Error::Truncated {
                        path: self.path.to_path_buf(),
                        what: what(),
                        needed: (self.pos + n) as u64,
                        len: self.data.len() as u64,
                    });
                }
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.value(elem_ty, what, depth + 1)?);
                }
                V::Array(v)
            }
            10 => V::U64(self.u64(what)?),
            11 => V::I64(i64::from_le_bytes(self.array(what)?)),
            12 => V::F64(f64::from_le_bytes(self.array(what)?)),
            t => return Err(self.invalid(format!("{}: unknown metadata value type {t}", what()))),
        })
    }
}

impl GgufFile {
    /// Opens and parses a GGUF file; tensor data stays memory-mapped.
    ///
    /// # Errors
    /// [`Error::Io`] if the file cannot be opened, [`Error::NotGguf`] for a wrong magic,
    /// [`Error::UnsupportedGgufVersion`], [`Error::Truncated`] if the header or any tensor's data
    /// extends past the end of the file, [`Error::Invalid`] for unknown value types, duplicate
    /// keys or tensor names, misaligned offsets, and [`Error::Ggml`] for unknown tensor types.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the map is read-only; deco never writes to model files while they are open.
        // A concurrent external truncation could fault, which is the usual mmap caveat that
        // llama.cpp and safetensors accept as well.
        let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        Self::parse(path.to_path_buf(), mmap)
    }

    /// Parses a GGUF image held in memory (a copy is placed in an anonymous read-only map);
    /// `path` only names it in errors. Used by the fuzz targets and by callers that receive a
    /// model over a channel other than a file.
    ///
    /// # Errors
    /// As [`GgufFile::open`]; [`Error::Io`] if the anonymous map cannot be created.
    pub fn from_bytes(path: impl Into<PathBuf>, bytes: &[u8]) -> Result<Self> {
        let path = path.into();
        if bytes.is_empty() {
            return Err(Error::NotGguf { path, found: String::new() });
        }
        let mut map = memmap2::MmapMut::map_anon(bytes.len()).map_err(|e| Error::io(&path, e))?;
        map.copy_from_slice(bytes);
        let mmap = map.make_read_only().map_err(|e| Error::io(&path, e))?;
        Self::parse(path, mmap)
    }

    fn parse(path: PathBuf, mmap: memmap2::Mmap) -> Result<Self> {
        let data: &[u8] = &mmap;
        let mut c = Cursor { path: &path, data, pos: 0 };
        if data.len() < 4 || &data[..4] != b"GGUF" {
            let n = data.len().min(4);
            return Err(Error::NotGguf {
                path: path.clone(),
                found: String::from_utf8_lossy(&data[..n]).into_owned(),
            });
        }
        c.pos = 4;
        let version = c.u32(&|| "version".into())?;
        if version != 2 && version != 3 {
            return Err(Error::UnsupportedGgufVersion { path: path.clone(), version });
        }
        let n_tensors = c.count(&|| "tensor count".into())?;
        let n_kv = c.count(&|| "metadata count".into())?;

        let mut metadata = BTreeMap::new();
        let mut metadata_order = Vec::with_capacity(n_kv.min(4096));
        for i in 0..n_kv {
            let key = c.string(&|| format!("metadata key #{i}"))?;
            let ty = c.u32(&|| format!("type of metadata `{key}`"))?;
            let value = c.value(ty, &|| format!("metadata `{key}`"), 0)?;
            if metadata.insert(key.clone(), value).is_some() {
                return Err(c.invalid(format!("duplicate metadata key `{key}`")));
            }
            metadata_order.push(key);
        }

        let alignment = match metadata.get("general.alignment") {
            None => 32,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() => a,
                _ => return Err(c.invalid(format!("general.alignment {v} is not a power of two"))),
            },
        };

        let mut tensors = Vec::with_capacity(n_tensors.min(1 << 16));
        let mut names = std::collections::HashSet::new();
        for i in 0..n_tensors {
            let name = c.string(&|| format!("tensor #{i} name"))?;
            let n_dims = c.u32(&|| format!("tensor `{name}` n_dims"))?;
            if n_dims == 0 || n_dims > 4 {
                return Err(c.invalid(format!("tensor `{name}` has {n_dims} dimensions (1..=4 allowed)")));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                let d = c.u64(&|| format!("tensor `{name}` dims"))?;
                if d == 0 || d > MAX_COUNT * 16 {
                    return Err(c.invalid(format!("tensor `{name}` has dimension {d}")));
                }
                dims.push(d);
            }
            let ty_id = c.u32(&|| format!("tensor `{name}` type"))?;
            let ggml_type = GgmlType::try_from(ty_id).map_err(|source| Error::Ggml {
                path: path.clone(),
                name: name.clone(),
                source,
            })?;
            let offset = c.u64(&|| format!("tensor `{name}` offset"))?;
            if offset % alignment != 0 {
                return Err(c.invalid(format!(
                    "tensor `{name}` offset {offset} is not a multiple of the alignment {alignment}"
                )));
            }
            let n_elements = dims
                .iter()
                .try_fold(1usize, |acc, &d| acc.checked_mul(d as usize))
                .ok_or_else(|| c.invalid(format!("tensor `{name}` has too many elements")))?;
            let n_bytes = ggml_type.bytes_for(n_elements).map_err(|source| Error::Ggml {
                path: path.clone(),
                name: name.clone(),
                source,
            })?;
            if !names.insert(name.clone()) {
                return Err(c.invalid(format!("duplicate tensor name `{name}`")));
            }
            tensors.push(TensorInfo { name, dims, ggml_type, offset, n_bytes });
        }

        let data_offset = (c.pos as u64).div_ceil(alignment) * alignment;
        for t in &tensors {
            let end = data_offset.saturating_add(t.offset).saturating_add(t.n_bytes as u64);
            if end > data.len() as u64 {
                return Err(Error::Truncated {
                    path: path.clone(),
                    what: format!("data of tensor `{}`", t.name),
                    needed: end,
                    len: data.len() as u64,
                });
            }
        }

        Ok(Self { path, mmap, version, metadata, metadata_order, tensors, alignment, data_offset })
    }

    /// The file path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Size of the file in bytes.
    pub fn file_size(&self) -> u64 {
        self.mmap.len() as u64
    }

    /// A metadata value by key.
    pub fn get(&self, key: &str) -> Option<&MetadataValue> {
        self.metadata.get(key)
    }

    fn meta_err(&self, key: &str, msg: impl Into<String>) -> Error {
        Error::Metadata { path: self.path.clone(), key: key.to_string(), msg: msg.into() }
    }

    /// A required string value.
    ///
    /// # Errors
    /// [`Error::Metadata`] if missing or not a string.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        match self.get(key) {
            None => Err(self.meta_err(key, "missing")),
            Some(v) => v.as_str().ok_or_else(|| self.meta_err(key, format!("expected string, found {}", v.type_name()))),
        }
    }

    /// A required non-negative integer value.
    ///
    /// # Errors
    /// [`Error::Metadata`] if missing or not a non-negative integer.
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        match self.get(key) {
            None => Err(self.meta_err(key, "missing")),
            Some(v) => v
                .as_u64()
                .ok_or_else(|| self.meta_err(key, format!("expected a non-negative integer, found {v}"))),
        }
    }

    /// A required numeric value as f64.
    ///
    /// # Errors
    /// [`Error::Metadata`] if missing or not numeric.
    pub fn get_f64(&self, key: &str) -> Result<f64> {
        match self.get(key) {
            None => Err(self.meta_err(key, "missing")),
            Some(v) => v.as_f64().ok_or_else(|| self.meta_err(key, format!("expected a number, found {v}"))),
        }
    }

    /// A required array of strings.
    ///
    /// # Errors
    /// [`Error::Metadata`] if missing, not an array, or an element is not a string.
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>> {
        let a = self
            .get(key)
            .ok_or_else(|| self.meta_err(key, "missing"))?
            .as_array()
            .ok_or_else(|| self.meta_err(key, "expected an array"))?;
        a.iter()
            .map(|v| v.as_str().ok_or_else(|| self.meta_err(key, format!("element {v} is not a string"))))
            .collect()
    }

    /// `general.architecture` (e.g. `llama`, `qwen2`).
    ///
    /// # Errors
    /// [`Error::Metadata`] if missing.
    pub fn architecture(&self) -> Result<&str> {
        self.get_str("general.architecture")
    }

    /// A tensor's table entry by name.
    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The raw bytes of a tensor (borrowed from the memory map).
    ///
    /// # Errors
    /// [`Error::TensorNotFound`].
    pub fn tensor_bytes(&self, name: &str) -> Result<(&TensorInfo, &[u8])> {
        let t = self
            .tensor_info(name)
            .ok_or_else(|| Error::TensorNotFound { path: self.path.clone(), name: name.to_string() })?;
        let start = (self.data_offset + t.offset) as usize;
        // Bounds were checked in `parse`.
        Ok((t, &self.mmap[start..start + t.n_bytes]))
    }

    /// Dequantizes a tensor to f32 in row-major order; returns it with its row-major shape.
    /// Afterwards the tensor's pages of the memory map are released
    /// ([`GgufFile::release_tensor_pages`]).
    ///
    /// # Errors
    /// [`Error::TensorNotFound`], or [`Error::Ggml`] for a type deco cannot dequantize.
    pub fn dequantize(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let (t, bytes) = self.tensor_bytes(name)?;
        let values = crate::ggml::dequantize(t.ggml_type, bytes, t.n_elements()).map_err(|source| Error::Ggml {
            path: self.path.clone(),
            name: name.to_string(),
            source,
        })?;
        self.release_tensor_pages(name);
        Ok((t.shape(), values))
    }

    /// Drops the resident pages of a tensor's bytes from this process (`madvise(MADV_DONTNEED)`
    /// on the read-only file mapping, rounded out to whole pages): once a loader has copied or
    /// converted a tensor, its mapped pages no longer count towards the resident set, so loading
    /// does not hold the file twice. The bytes stay readable: a later access faults them back in
    /// from the file. Best effort: errors (and unknown names) are ignored.
    pub fn release_tensor_pages(&self, name: &str) {
        let Some(t) = self.tensor_info(name) else { return };
        let page = 4096usize;
        let start = (self.data_offset + t.offset) as usize;
        let (lo, hi) = (start / page * page, (start + t.n_bytes).div_ceil(page) * page);
        let hi = hi.min(self.mmap.len());
        #[cfg(unix)]
        if hi > lo {
            // SAFETY: the map is a read-only (shared) file mapping that this process never
            // writes, so discarding its pages cannot lose data; later reads fault them back in
            // from the page cache / file.
            let _ = unsafe { self.mmap.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, lo, hi - lo) };
        }
        #[cfg(not(unix))]
        let _ = (lo, hi);
    }

    /// A human-readable report: metadata (one key per line, long values abbreviated) and the
    /// tensor table (name, type, row-major shape, bytes). This is what `deco inspect` prints.
    pub fn describe(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let _ = writeln!(s, "file: {}", self.path.display());
        let _ = writeln!(
            s,
            "GGUF v{}, {} bytes, {} metadata keys, {} tensors, alignment {}, data at offset {}",
            self.version,
            self.file_size(),
            self.metadata.len(),
            self.tensors.len(),
            self.alignment,
            self.data_offset
        );
        let _ = writeln!(s, "\nmetadata:");
        for k in &self.metadata_order {
            if let Some(v) = self.metadata.get(k) {
                let _ = writeln!(s, "  {k:<44} {:<7} {v}", v.type_name());
            }
        }
        let _ = writeln!(s, "\ntensors:");
        let _ = writeln!(s, "  {:<36} {:<6} {:>18} {:>12}", "name", "type", "shape", "bytes");
        let mut counts: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
        for t in &self.tensors {
            let shape = format!("{:?}", t.shape());
            let _ = writeln!(s, "  {:<36} {:<6} {:>18} {:>12}", t.name, t.ggml_type.name(), shape, t.n_bytes);
            let e = counts.entry(t.ggml_type.name()).or_default();
            e.0 += 1;
            e.1 += t.n_elements();
        }
        let total: usize = self.tensors.iter().map(TensorInfo::n_elements).sum();
        let _ = writeln!(s, "\n{total} parameters");
        for (ty, (n, el)) in counts {
            let _ = writeln!(s, "  {ty:<6} {n:>4} tensors {el:>12} elements");
        }
        s
    }
}

/// A tensor to write with [`write_gguf`].
#[derive(Debug, Clone)]
pub struct TensorToWrite<'a> {
    /// Tensor name.
    pub name: String,
    /// Row-major (PyTorch) shape; written reversed, as GGUF dims.
    pub shape: Vec<usize>,
    /// Element type of `data`.
    pub ggml_type: GgmlType,
    /// Encoded data (`ggml_type.bytes_for(n_elements)` bytes).
    pub data: &'a [u8],
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn type_id(v: &MetadataValue) -> u32 {
    match v {
        MetadataValue::U8(_) => 0,
        MetadataValue::I8(_) => 1,
        MetadataValue::U16(_) => 2,
        MetadataValue::I16(_) => 3,
        MetadataValue::U32(_) => 4,
        MetadataValue::I32(_) => 5,
        MetadataValue::F32(_) => 6,
        MetadataValue::Bool(_) => 7,
        MetadataValue::String(_) => 8,
        MetadataValue::Array(_) => 9,
        MetadataValue::U64(_) => 10,
        MetadataValue::I64(_) => 11,
        MetadataValue::F64(_) => 12,
    }
}

fn put_value(out: &mut Vec<u8>, v: &MetadataValue) {
    use MetadataValue as V;
    match v {
        V::U8(x) => out.push(*x),
        V::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        V::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        V::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        V::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        V::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        V::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        V::Bool(x) => out.push(u8::from(*x)),
        V::String(s) => put_str(out, s),
        V::Array(a) => {
            // An empty array is written with element type u8, as gguf-py does for `[]`.
            out.extend_from_slice(&a.first().map_or(0, type_id).to_le_bytes());
            out.extend_from_slice(&(a.len() as u64).to_le_bytes());
            for e in a {
                put_value(out, e);
            }
        }
        V::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        V::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        V::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
    }
}

/// Writes a GGUF v3 file (the layout of gguf-py's `GGUFWriter`): header, metadata in the given
/// order, tensor infos, then each tensor's data aligned to `general.alignment` (32 unless the
/// metadata sets it). The file is written to `path` + `.tmp` and renamed into place.
///
/// # Errors
/// [`Error::Invalid`] for arrays mixing element types, a tensor whose data length does not match
/// its type and shape, or a bad alignment; [`Error::Io`] for write failures.
pub fn write_gguf(path: &Path, metadata: &[(String, MetadataValue)], tensors: &[TensorToWrite<'_>]) -> Result<()> {
    let invalid = |msg: String| Error::Invalid { path: path.to_path_buf(), format: "GGUF", msg };
    let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => 32u64,
        Some((_, v)) => v.as_u64().filter(|a| *a > 0 && a.is_power_of_two()).ok_or_else(|| invalid(format!("general.alignment {v} is not a power of two")))?,
    };
    fn check_array(v: &MetadataValue) -> bool {
        match v {
            MetadataValue::Array(a) => {
                a.windows(2).all(|w| type_id(&w[0]) == type_id(&w[1])) && a.iter().all(check_array)
            }
            _ => true,
        }
    }
    let mut out = Vec::new();
    out.extend_from_slice(b"GGUF");
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (k, v) in metadata {
        if !check_array(v) {
            return Err(invalid(format!("metadata `{k}`: array elements must all have one type")));
        }
        put_str(&mut out, k);
        out.extend_from_slice(&type_id(v).to_le_bytes());
        put_value(&mut out, v);
    }
    let mut offset = 0u64;
    let mut offsets = Vec::with_capacity(tensors.len());
    for t in tensors {
        let n: usize = t.shape.iter().product();
        let expected = t.ggml_type.bytes_for(n).map_err(|e| invalid(format!("tensor `{}`: {e}", t.name)))?;
        if expected != t.data.len() {
            return Err(invalid(format!(
                "tensor `{}`: {} bytes given, {} {:?} needs {expected}",
                t.name,
                t.data.len(),
                t.ggml_type.name(),
                t.shape
            )));
        }
        put_str(&mut out, &t.name);
        out.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
        for &d in t.shape.iter().rev() {
            out.extend_from_slice(&(d as u64).to_le_bytes());
        }
        out.extend_from_slice(&t.ggml_type.id().to_le_bytes());
        out.extend_from_slice(&offset.to_le_bytes());
        offsets.push(offset);
        offset = (offset + t.data.len() as u64).div_ceil(alignment) * alignment;
    }
    let data_start = (out.len() as u64).div_ceil(alignment) * alignment;
    out.resize(data_start as usize, 0);
    for (t, off) in tensors.iter().zip(offsets) {
        out.resize((data_start + off) as usize, 0);
        out.extend_from_slice(t.data);
    }
    crate::atomic::write_file(path, &out).map_err(|e| Error::io(path, e))
}
