//! Integer-quantized linear layers in the on-disk layouts of AutoGPTQ, AutoAWQ (GEMM) and
//! compressed-tensors (`pack-quantized`): packing, unpacking, their `config.json` /
//! `quantize_config.json` entries, and dequantization on load.
//!
//! Everything here works on plain integer arrays ([`IntLinear`]); the quantizers that produce
//! them live in `deco-quant` (which depends on this crate, not the other way round).
//!
//! Layouts (shapes row-major; `pf = 32 / bits` codes per 32-bit word, code `j` of a word at bits
//! `bits·j ..`, least significant first, unless an order map says otherwise):
//!
//! | format | tensor | shape | dtype | packing |
//! |---|---|---|---|---|
//! | GPTQ (AutoGPTQ `qlinear_cuda_old.QuantLinear.pack`) | `qweight` | `[in/pf, out]` | i32 | word `[r, o]` holds codes of inputs `r·pf + j`, column `o` |
//! | | `qzeros` | `[groups, out/pf]` | i32 | word `[g, k]` holds `zero - 1` (v1) of outputs `k·pf + j` |
//! | | `scales` | `[groups, out]` | f16 | |
//! | | `g_idx` | `[in]` | i32 | group of each input column |
//! | AWQ GEMM (AutoAWQ `WQLinear_GEMM.from_linear`) | `qweight` | `[in, out/8]` | i32 | word `[i, k]`, slot `j` holds output `8k + [0,2,4,6,1,3,5,7][j]` |
//! | | `qzeros` | `[groups, out/8]` | i32 | same order, zero stored as is |
//! | | `scales` | `[groups, out]` | f16 | |
//! | compressed-tensors >= 0.18 (`pack_quantized.helpers.pack_to_int32`) | `weight_packed` | `[out, ceil(in·bits/32)]` | i32 | dense ([`pack_dense`]): row `o` is one bit stream, input `k`'s `q + 2^(bits-1)` at bits `k·bits ..` (for 3 bits, files of older versions with 10 codes per word are read too) |
//! | | `weight_scale` | `[out, groups]` | f16 | |
//! | | `weight_zero_point` (asym only) | `[ceil(out·bits/32), groups]` | i32 | dense along outputs (`packed_dim=0`) |
//! | | `weight_g_idx` (read only: `actorder: "group"` of versions < 0.19) | `[in]` | i32 | written never: act-order is `actorder: "weight"`, groups in column order |
//! | | `weight_shape` | `[2]` | i64 | `[out, in]` |
//!
//! In deco's terms a code `q` is unsigned (`0 ..= 2^bits - 1`) and the value is
//! `scale · (q - zero)`; compressed-tensors' signed codes and zero points are these minus
//! `2^(bits-1)`, which cancels in the difference.

use std::collections::HashMap;
use std::path::Path;

use serde_json::{Value, json};

use crate::{Error, Result};

/// A `[out, in]` linear weight quantized to integer codes with per-(output, group) scales and
/// zero points: `w[o, i] = scales[o, g_idx[i]] · (codes[o, i] - zeros[o, g_idx[i]])`.
#[derive(Debug, Clone, PartialEq)]
pub struct IntLinear {
    /// Output features (rows).
    pub out_features: usize,
    /// Input features (columns).
    pub in_features: usize,
    /// Bits per code (2, 3, 4 or 8).
    pub bits: u32,
    /// Input columns per group (`in_features` for one group per output channel). With
    /// act-order, the group of a column is `g_idx[c]`, not `c / group_size`.
    pub group_size: usize,
    /// `[out, in]` codes in `0 ..= 2^bits - 1`.
    pub codes: Vec<u8>,
    /// `[out, groups]` scales (the step of each group).
    pub scales: Vec<f32>,
    /// `[out, groups]` integer zero points.
    pub zeros: Vec<i32>,
    /// `[in]` group of each input column.
    pub g_idx: Vec<u32>,
}

impl IntLinear {
    /// Number of groups per output row.
    pub fn groups(&self) -> usize {
        self.scales.len() / self.out_features.max(1)
    }

    /// Whether `g_idx` is the plain `c / group_size` assignment (no act-order permutation).
    pub fn is_sequential(&self) -> bool {
        self.g_idx.iter().enumerate().all(|(c, &g)| g as usize == c / self.group_size.max(1))
    }

    /// Checks the array lengths and value ranges; returns what is wrong.
    ///
    /// # Errors
    /// A message naming the inconsistent field.
    pub fn check(&self) -> std::result::Result<(), String> {
        let (o, i) = (self.out_features, self.in_features);
        if !(1..=8).contains(&self.bits) {
            return Err(format!("bits {} outside 1..=8", self.bits));
        }
        if self.group_size == 0 {
            return Err("group_size 0".into());
        }
        if self.codes.len() != o * i {
            return Err(format!("{} codes for a {o}x{i} weight", self.codes.len()));
        }
        let g = self.groups();
        if g == 0 || self.scales.len() != o * g || self.zeros.len() != o * g {
            return Err(format!("{} scales / {} zeros for {o} rows", self.scales.len(), self.zeros.len()));
        }
        if self.g_idx.len() != i {
            return Err(format!("g_idx has {} entries for {i} input features", self.g_idx.len()));
        }
        if let Some((c, gi)) = self.g_idx.iter().enumerate().find(|(_, x)| **x as usize >= g) {
            return Err(format!("g_idx[{c}] = {gi} but there are only {g} groups"));
        }
        let maxq = (1u32 << self.bits) - 1;
        if let Some(p) = self.codes.iter().position(|&q| q as u32 > maxq) {
            return Err(format!("code {} at {p} exceeds {maxq}", self.codes[p]));
        }
        Ok(())
    }

    /// Dequantizes to `[out, in]` f32: `scale · (q - zero)`, the exact product rounded once to
    /// f32 (the same formula as `deco_quant::scheme::dequantize_value`).
    pub fn dequantize(&self) -> Vec<f32> {
        let g = self.groups();
        let mut out = Vec::with_capacity(self.out_features * self.in_features);
        for r in 0..self.out_features {
            for c in 0..self.in_features {
                let p = r * g + self.g_idx[c] as usize;
                let q = self.codes[r * self.in_features + c] as f64;
                out.push((self.scales[p] as f64 * (q - self.zeros[p] as f64)) as f32);
            }
        }
        out
    }
}

/// `x` rounded to the nearest f16 (ties to even) and back: the value a f16 `scales` tensor
/// stores for `x`.
pub fn round_to_f16(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

/// The on-disk quantized format of a checkpoint directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantMethod {
    /// AutoGPTQ (`quant_method: "gptq"`).
    Gptq,
    /// AutoAWQ GEMM (`quant_method: "awq"`, `version: "gemm"`).
    Awq,
    /// compressed-tensors `pack-quantized` (`quant_method: "compressed-tensors"`).
    CompressedTensors,
}

impl QuantMethod {
    /// Short name used in messages ("GPTQ", "AWQ", "compressed-tensors").
    pub fn name(self) -> &'static str {
        match self {
            Self::Gptq => "GPTQ",
            Self::Awq => "AWQ",
            Self::CompressedTensors => "compressed-tensors",
        }
    }
}

/// The quantization settings of a checkpoint (AutoGPTQ `BaseQuantizeConfig` names).
#[derive(Debug, Clone, PartialEq)]
pub struct QuantConfig {
    /// The on-disk format.
    pub method: QuantMethod,
    /// Bits per code.
    pub bits: u32,
    /// Input columns per group; `None` = one group per output channel (`group_size: -1`).
    pub group_size: Option<usize>,
    /// Symmetric (zero point fixed at `2^(bits-1)`).
    pub sym: bool,
    /// GPTQ act-order (a stored `g_idx` permutes the group assignment).
    pub desc_act: bool,
    /// GPTQ dampening fraction (recorded, not used for loading).
    pub damp_percent: f64,
    /// GPTQ static groups (recorded).
    pub static_groups: bool,
    /// GPTQ true-sequential (recorded).
    pub true_sequential: bool,
    /// GPTQ `checkpoint_format: "gptq_v2"` (zero points stored as is, not minus one).
    pub gptq_v2: bool,
}

impl QuantConfig {
    /// A configuration with GPTQ's defaults for the fields a method does not use.
    pub fn new(method: QuantMethod, bits: u32, group_size: Option<usize>, sym: bool) -> Self {
        Self {
            method,
            bits,
            group_size,
            sym,
            desc_act: false,
            damp_percent: 0.01,
            static_groups: false,
            true_sequential: true,
            gptq_v2: false,
        }
    }

    fn group_size_json(&self) -> Value {
        match self.group_size {
            Some(g) => json!(g),
            None => json!(-1),
        }
    }

    /// The `quantization_config` object of `config.json` (transformers' `GPTQConfig`,
    /// `AwqConfig`, compressed-tensors `QuantizationConfig`).
    pub fn to_json(&self) -> Value {
        match self.method {
            QuantMethod::Gptq => json!({
                "quant_method": "gptq",
                "bits": self.bits,
                "group_size": self.group_size_json(),
                "desc_act": self.desc_act,
                "sym": self.sym,
                "damp_percent": self.damp_percent,
                "static_groups": self.static_groups,
                "true_sequential": self.true_sequential,
                "checkpoint_format": if self.gptq_v2 { "gptq_v2" } else { "gptq" },
                "model_file_base_name": "model",
            }),
            QuantMethod::Awq => json!({
                "quant_method": "awq",
                "bits": self.bits,
                "group_size": self.group_size_json(),
                "zero_point": true,
                "version": "gemm",
                "modules_to_not_convert": null,
            }),
            QuantMethod::CompressedTensors => {
                let (strategy, gs) = match self.group_size {
                    Some(g) => ("group", json!(g)),
                    None => ("channel", Value::Null),
                };
                json!({
                    "quant_method": "compressed-tensors",
                    "format": "pack-quantized",
                    "quantization_status": "compressed",
                    "config_groups": {
                        "group_0": {
                            "targets": ["Linear"],
                            "weights": {
                                "num_bits": self.bits,
                                "type": "int",
                                "symmetric": self.sym,
                                "strategy": strategy,
                                "group_size": gs,
                                "actorder": if self.desc_act { json!("weight") } else { Value::Null },
                                "dynamic": false,
                                "observer": "minmax",
                            },
                            "input_activations": null,
                            "output_activations": null,
                            "format": "pack-quantized",
                        }
                    },
                    "ignore": ["lm_head"],
                    "kv_cache_scheme": null,
                })
            }
        }
    }

    /// Parses a `quantization_config` object (or AutoGPTQ's `quantize_config.json`, which has no
    /// `quant_method` and is read as GPTQ). `path` names the file in errors.
    ///
    /// # Errors
    /// [`Error::Invalid`] for an unknown `quant_method` / `format` / `version`, missing or
    /// mistyped `bits` / `group_size`, or bits other than 2, 3, 4, 8.
    pub fn from_json(v: &Value, path: &Path) -> Result<Self> {
        let bad = |msg: String| Error::Invalid { path: path.to_path_buf(), format: "quantization config", msg };
        let obj = v.as_object().ok_or_else(|| bad("not a JSON object".into()))?;
        let method = match obj.get("quant_method").and_then(Value::as_str) {
            None | Some("gptq") => QuantMethod::Gptq,
            Some("awq") => QuantMethod::Awq,
            Some("compressed-tensors") => QuantMethod::CompressedTensors,
            Some(m) => return Err(bad(format!("unsupported quant_method `{m}` (supported: gptq, awq, compressed-tensors)"))),
        };
        let int = |v: &Value, key: &str| -> Result<i64> {
            v.get(key).and_then(Value::as_i64).ok_or_else(|| bad(format!("`{key}` is missing or not an integer")))
        };
        let group = |g: i64| -> Result<Option<usize>> {
            match g {
                -1 => Ok(None),
                g if g > 0 => Ok(Some(g as usize)),
                g => Err(bad(format!("group_size {g} (expected a positive size or -1)"))),
            }
        };
        let flag = |v: &Value, key: &str, default: bool| -> Result<bool> {
            match v.get(key) {
                None | Some(Value::Null) => Ok(default),
                Some(Value::Bool(b)) => Ok(*b),
                Some(x) => Err(bad(format!("`{key}` is {x}, expected true or false"))),
            }
        };
        let mut cfg = match method {
            QuantMethod::Gptq => {
                let mut c = Self::new(method, int(v, "bits")? as u32, group(int(v, "group_size")?)?, flag(v, "sym", true)?);
                c.desc_act = flag(v, "desc_act", false)?;
                c.static_groups = flag(v, "static_groups", false)?;
                c.true_sequential = flag(v, "true_sequential", true)?;
                c.damp_percent = v.get("damp_percent").and_then(Value::as_f64).unwrap_or(0.01);
                c.gptq_v2 = match v.get("checkpoint_format").and_then(Value::as_str) {
                    None | Some("gptq") => false,
                    Some("gptq_v2") => true,
                    Some(f) => return Err(bad(format!("unsupported checkpoint_format `{f}` (supported: gptq, gptq_v2)"))),
                };
                c
            }
            QuantMethod::Awq => {
                let bits = int(v, "bits").or_else(|_| int(v, "w_bit"))?;
                let gs = int(v, "group_size").or_else(|_| int(v, "q_group_size"))?;
                match v.get("version").and_then(Value::as_str).map(str::to_ascii_lowercase).as_deref() {
                    None | Some("gemm") => {}
                    Some(other) => return Err(bad(format!("AWQ version `{other}` is not supported (only gemm)"))),
                }
                // AWQ GEMM always stores zero points; `zero_point: false` still means the
                // stored qzeros are used.
                Self::new(method, bits as u32, group(gs)?, !flag(v, "zero_point", true)?)
            }
            QuantMethod::CompressedTensors => {
                match v.get("format").and_then(Value::as_str) {
                    Some("pack-quantized") => {}
                    other => {
                        return Err(bad(format!("compressed-tensors format {other:?} is not supported (only pack-quantized)")));
                    }
                }
                let groups = v.get("config_groups").and_then(Value::as_object).ok_or_else(|| bad("no `config_groups` object".into()))?;
                if groups.len() != 1 {
                    return Err(bad(format!("{} config_groups; only one is supported", groups.len())));
                }
                let w = groups.values().next().and_then(|g| g.get("weights")).ok_or_else(|| bad("config group without `weights`".into()))?;
                if let Some(t) = w.get("type").and_then(Value::as_str)
                    && t != "int"
                {
                    return Err(bad(format!("weights type `{t}` is not supported (only int)")));
                }
                let gs = match w.get("strategy").and_then(Value::as_str) {
                    Some("group") => Some(int(w, "group_size")? as usize),
                    Some("channel") => None,
                    s => return Err(bad(format!("weights strategy {s:?} is not supported (group, channel)"))),
                };
                let mut c = Self::new(method, int(w, "num_bits")? as u32, gs, flag(w, "symmetric", true)?);
                c.desc_act = matches!(w.get("actorder").and_then(Value::as_str), Some("group" | "dynamic" | "weight" | "static"));
                c
            }
        };
        if !matches!(cfg.bits, 2 | 3 | 4 | 8) {
            return Err(bad(format!("bits {} is not one of 2, 3, 4, 8", cfg.bits)));
        }
        if cfg.group_size == Some(0) {
            cfg.group_size = None;
        }
        Ok(cfg)
    }

    /// The quantization settings of a Hugging Face directory: `config.json`'s
    /// `quantization_config`, else AutoGPTQ's `quantize_config.json`; `None` for an
    /// unquantized directory.
    ///
    /// # Errors
    /// [`Error::Io`] / [`Error::Invalid`] for unreadable or malformed files, and the errors of
    /// [`QuantConfig::from_json`].
    pub fn from_dir(dir: &Path) -> Result<Option<Self>> {
        let read = |p: &Path| -> Result<Value> {
            let text = std::fs::read_to_string(p).map_err(|e| Error::io(p, e))?;
            serde_json::from_str(&text).map_err(|e| Error::Invalid { path: p.to_path_buf(), format: "JSON", msg: e.to_string() })
        };
        let config = dir.join("config.json");
        if config.exists()
            && let Some(q) = read(&config)?.get("quantization_config")
        {
            return Self::from_json(q, &config).map(Some);
        }
        let qc = dir.join("quantize_config.json");
        if qc.exists() {
            return Self::from_json(&read(&qc)?, &qc).map(Some);
        }
        Ok(None)
    }
}

/// A tensor ready for a safetensors file.
#[derive(Debug, Clone, PartialEq)]
pub struct StTensor {
    /// Element type.
    pub dtype: safetensors::Dtype,
    /// Row-major shape.
    pub shape: Vec<usize>,
    /// Little-endian bytes.
    pub data: Vec<u8>,
}

impl StTensor {
    /// An f32 tensor.
    pub fn f32(shape: Vec<usize>, v: &[f32]) -> Self {
        // Whole values at a time (a `flat_map` over the bytes pushed them one by one: ~0.5 s of
        // the 541 MB that `deco quantize --format fake` writes for SmolLM2-135M).
        let mut data = Vec::with_capacity(v.len() * 4);
        for x in v {
            data.extend_from_slice(&x.to_le_bytes());
        }
        Self { dtype: safetensors::Dtype::F32, shape, data }
    }

    /// An f16 tensor (values rounded to nearest even).
    pub fn f16(shape: Vec<usize>, v: &[f32]) -> Self {
        Self { dtype: safetensors::Dtype::F16, shape, data: v.iter().flat_map(|&x| half::f16::from_f32(x).to_le_bytes()).collect() }
    }

    /// An i32 tensor.
    pub fn i32(shape: Vec<usize>, v: &[i32]) -> Self {
        Self { dtype: safetensors::Dtype::I32, shape, data: v.iter().flat_map(|x| x.to_le_bytes()).collect() }
    }

    /// An i64 tensor.
    pub fn i64(shape: Vec<usize>, v: &[i64]) -> Self {
        Self { dtype: safetensors::Dtype::I64, shape, data: v.iter().flat_map(|x| x.to_le_bytes()).collect() }
    }
}

/// A borrowed tensor read from a safetensors file.
#[derive(Debug, Clone)]
pub struct RawTensor<'a> {
    /// Element type.
    pub dtype: safetensors::Dtype,
    /// Row-major shape.
    pub shape: Vec<usize>,
    /// Little-endian bytes.
    pub data: &'a [u8],
}

/// Packs `[rows, cols]` codes (each `< 2^bits`) into 32-bit words along `dim` (0: rows, 1:
/// columns), `32 / bits` codes per word, code `j` of a word at bit `bits · j`; `order[j]` is the
/// offset (within the word's run of codes) of the code in slot `j` (identity for GPTQ and
/// compressed-tensors, `[0,2,4,6,1,3,5,7]` for AWQ). A ragged end is zero padded (the packed
/// dimension becomes `ceil(n / (32/bits))`).
///
/// Returns `(packed, packed_rows, packed_cols)`.
pub fn pack_u32(values: &[u32], rows: usize, cols: usize, bits: u32, dim: usize, order: &[usize]) -> (Vec<i32>, usize, usize) {
    let pf = (32 / bits) as usize;
    let (pr, pc) = if dim == 0 { (rows.div_ceil(pf), cols) } else { (rows, cols.div_ceil(pf)) };
    let mut out = vec![0u32; pr * pc];
    for r in 0..pr {
        for c in 0..pc {
            let mut w = 0u32;
            for (j, &o) in order.iter().enumerate().take(pf) {
                let (sr, sc) = if dim == 0 { (r * pf + o, c) } else { (r, c * pf + o) };
                if sr < rows && sc < cols {
                    w |= values[sr * cols + sc] << (bits as usize * j);
                }
            }
            out[r * pc + c] = w;
        }
    }
    (out.into_iter().map(|w| w as i32).collect(), pr, pc)
}

/// The inverse of [`pack_u32`]: `[rows, cols]` codes from words packed along `dim`.
pub fn unpack_u32(packed: &[i32], rows: usize, cols: usize, bits: u32, dim: usize, order: &[usize]) -> Vec<u32> {
    let pf = (32 / bits) as usize;
    let pc = if dim == 0 { cols } else { cols.div_ceil(pf) };
    let mask = if bits == 32 { u32::MAX } else { (1u32 << bits) - 1 };
    let mut out = vec![0u32; rows * cols];
    for r in 0..rows {
        for c in 0..cols {
            let (wr, wc, k) = if dim == 0 { (r / pf, c, r % pf) } else { (r, c / pf, c % pf) };
            let slot = order.iter().position(|&o| o == k).unwrap_or(k);
            let w = packed[wr * pc + wc] as u32;
            out[r * cols + c] = (w >> (bits as usize * slot)) & mask;
        }
    }
    out
}

/// Packs `[rows, cols]` codes (each `< 2^bits`) densely along `dim` (0: rows, 1: columns), as
/// compressed-tensors' `pack_to_int32` since 0.18: each line along `dim` is one little-endian
/// bit stream in which code `k` occupies bits `k·bits .. (k+1)·bits`, split across two words
/// when it straddles a word boundary, so a line of `n` codes takes `ceil(n·bits / 32)` words
/// (no padding bits; for 2, 4 and 8 bits this is the same as [`pack_u32`] with the identity
/// order, for 3 bits it is not: the older layout put 10 codes in a word).
///
/// Returns `(packed, packed_rows, packed_cols)`.
pub fn pack_dense(values: &[u32], rows: usize, cols: usize, bits: u32, dim: usize) -> (Vec<i32>, usize, usize) {
    let (lines, n) = if dim == 0 { (cols, rows) } else { (rows, cols) };
    let words = (n * bits as usize).div_ceil(32);
    let mut out = vec![0u32; lines * words];
    for line in 0..lines {
        for k in 0..n {
            let v = if dim == 0 { values[k * cols + line] } else { values[line * cols + k] };
            let bit = k * bits as usize;
            let (w, off) = (bit / 32, bit % 32);
            let idx = |w: usize| if dim == 0 { w * cols + line } else { line * words + w };
            out[idx(w)] |= v << off;
            if off + bits as usize > 32 {
                out[idx(w + 1)] |= v >> (32 - off);
            }
        }
    }
    let (pr, pc) = if dim == 0 { (words, cols) } else { (rows, words) };
    (out.into_iter().map(|w| w as i32).collect(), pr, pc)
}

/// The inverse of [`pack_dense`]: `[rows, cols]` codes from words packed densely along `dim`.
/// `packed` must hold `ceil(n·bits / 32)` words per line.
pub fn unpack_dense(packed: &[i32], rows: usize, cols: usize, bits: u32, dim: usize) -> Vec<u32> {
    let n = if dim == 0 { rows } else { cols };
    let words = (n * bits as usize).div_ceil(32);
    let mask = (1u64 << bits) - 1;
    let mut out = vec![0u32; rows * cols];
    for r in 0..rows {
        for c in 0..cols {
            let (line, k) = if dim == 0 { (c, r) } else { (r, c) };
            let word = |w: usize| -> u64 {
                if w >= words {
                    return 0;
                }
                (if dim == 0 { packed[w * cols + line] } else { packed[line * words + w] }) as u32 as u64
            };
            let bit = k * bits as usize;
            let (w, off) = (bit / 32, bit % 32);
            let pair = word(w) | (word(w + 1) << 32);
            out[r * cols + c] = ((pair >> off) & mask) as u32;
        }
    }
    out
}

/// AWQ's packing order of 8 4-bit codes in a word (AutoAWQ `WQLinear_GEMM.from_linear`
/// `order_map`): slot `j` holds the code at offset `AWQ_ORDER[j]`.
pub const AWQ_ORDER: [usize; 8] = [0, 2, 4, 6, 1, 3, 5, 7];

fn identity(bits: u32) -> Vec<usize> {
    (0..(32 / bits) as usize).collect()
}

fn transpose<T: Copy>(v: &[T], rows: usize, cols: usize) -> Vec<T> {
    let mut out = Vec::with_capacity(v.len());
    for c in 0..cols {
        for r in 0..rows {
            out.push(v[r * cols + c]);
        }
    }
    out
}

/// Encodes one linear layer in `cfg`'s format: the tensors to store under `prefix` (e.g.
/// `model.layers.0.self_attn.q_proj`) with their suffixes (`qweight`, `qzeros`, `scales`,
/// `g_idx` for GPTQ; `qweight`, `qzeros`, `scales` for AWQ; `weight_packed`, `weight_scale`,
/// `weight_zero_point`, `weight_g_idx`, `weight_shape` for compressed-tensors). Scales are
/// stored as f16 (nearest even).
///
/// Sources: AutoGPTQ `qlinear_cuda_old.QuantLinear.pack`, AutoAWQ `WQLinear_GEMM.from_linear`,
/// compressed-tensors `pack_quantized.PackedQuantizationCompressor.compress_weight`.
///
/// # Errors
/// [`Error::Invalid`] naming `path` (the output) and `prefix` when the layer cannot be written
/// in this format: bits the format does not pack (GPTQ: 2, 4, 8; AWQ: 4; compressed-tensors:
/// 2, 3, 4, 8), dimensions that are not multiples of the pack factor (GPTQ, AWQ), a GPTQ v1
/// zero point of 0 (stored as `zero - 1 = -1`), an AWQ group size that does not divide the
/// input or an act-order `g_idx` in AWQ, a symmetric compressed-tensors layer whose zero
/// points are not `2^(bits-1)`, scales that overflow f16, or inconsistent arrays.
pub fn encode(l: &IntLinear, cfg: &QuantConfig, prefix: &str, path: &Path) -> Result<Vec<(String, StTensor)>> {
    let bad = |msg: String| Error::Invalid { path: path.to_path_buf(), format: cfg.method.name(), msg: format!("`{prefix}`: {msg}") };
    l.check().map_err(&bad)?;
    if l.bits != cfg.bits {
        return Err(bad(format!("layer has {} bits, the configuration {}", l.bits, cfg.bits)));
    }
    let (o, i, bits) = (l.out_features, l.in_features, l.bits);
    let g = l.groups();
    let maxq = (1i32 << bits) - 1;
    if let Some(p) = l.zeros.iter().position(|&z| z < 0 || z > maxq) {
        return Err(bad(format!("zero point {} at {p} outside 0..={maxq}", l.zeros[p])));
    }
    if let Some(p) = l.scales.iter().position(|&s| !round_to_f16(s).is_finite()) {
        return Err(bad(format!("scale {} at {p} is not representable as f16", l.scales[p])));
    }
    let pf = (32 / bits) as usize;
    let key = |s: &str| format!("{prefix}.{s}");
    let codes_u32: Vec<u32> = l.codes.iter().map(|&q| q as u32).collect();
    // [groups, out] views of the parameters.
    let scales_go = transpose(&l.scales, o, g);
    let zeros_go = transpose(&l.zeros, o, g);
    match cfg.method {
        QuantMethod::Gptq => {
            if !matches!(bits, 2 | 4 | 8) {
                return Err(bad(format!(
                    "{bits}-bit GPTQ is not supported by this exporter (2, 4, 8; AutoGPTQ's 3-bit layout straddles words)"
                )));
            }
            if i % pf != 0 || o % pf != 0 {
                return Err(bad(format!("in_features {i} and out_features {o} must be multiples of {pf} for {bits}-bit GPTQ")));
            }
            if !cfg.desc_act && !l.is_sequential() {
                return Err(bad("g_idx is permuted (act-order) but desc_act is false".into()));
            }
            let gs = l.group_size;
            if g != i.div_ceil(gs) {
                return Err(bad(format!("{g} groups, AutoGPTQ expects ceil({i} / {gs}) = {}", i.div_ceil(gs))));
            }
            let zero_off = if cfg.gptq_v2 { 0 } else { 1 };
            if let Some(p) = zeros_go.iter().position(|&z| z - zero_off < 0) {
                return Err(bad(format!(
                    "zero point 0 (group {}, output {}) cannot be stored in GPTQ v1, which stores zero - 1 \
                     (-1 would corrupt the packed word); quantize with --sym or choose another format",
                    p / o,
                    p % o
                )));
            }
            let qw_in = transpose(&codes_u32, o, i); // [in, out]
            let (qweight, qr, qc) = pack_u32(&qw_in, i, o, bits, 0, &identity(bits));
            let zm: Vec<u32> = zeros_go.iter().map(|&z| (z - zero_off) as u32).collect();
            let (qzeros, zr, zc) = pack_u32(&zm, g, o, bits, 1, &identity(bits));
            let g_idx: Vec<i32> = l.g_idx.iter().map(|&x| x as i32).collect();
            Ok(vec![
                (key("qweight"), StTensor::i32(vec![qr, qc], &qweight)),
                (key("qzeros"), StTensor::i32(vec![zr, zc], &qzeros)),
                (key("scales"), StTensor::f16(vec![g, o], &scales_go)),
                (key("g_idx"), StTensor::i32(vec![i], &g_idx)),
            ])
        }
        QuantMethod::Awq => {
            if bits != 4 {
                return Err(bad(format!("AWQ GEMM stores 4-bit codes only, got {bits} bits")));
            }
            if o % 8 != 0 {
                return Err(bad(format!("out_features {o} must be a multiple of 8 for AWQ")));
            }
            if i % l.group_size != 0 || g != i / l.group_size {
                return Err(bad(format!("group size {} must divide in_features {i} for AWQ", l.group_size)));
            }
            if !l.is_sequential() {
                return Err(bad("AWQ has no g_idx; act-order (permuted groups) cannot be stored".into()));
            }
            let qw_in = transpose(&codes_u32, o, i);
            let (qweight, qr, qc) = pack_u32(&qw_in, i, o, 4, 1, &AWQ_ORDER);
            let zu: Vec<u32> = zeros_go.iter().map(|&z| z as u32).collect();
            let (qzeros, zr, zc) = pack_u32(&zu, g, o, 4, 1, &AWQ_ORDER);
            Ok(vec![
                (key("qweight"), StTensor::i32(vec![qr, qc], &qweight)),
                (key("qzeros"), StTensor::i32(vec![zr, zc], &qzeros)),
                (key("scales"), StTensor::f16(vec![g, o], &scales_go)),
            ])
        }
        QuantMethod::CompressedTensors => {
            if !matches!(bits, 2 | 3 | 4 | 8) {
                return Err(bad(format!("{bits}-bit compressed-tensors packing is not supported (2, 3, 4, 8)")));
            }
            let mid = 1i32 << (bits - 1);
            if cfg.sym && l.zeros.iter().any(|&z| z != mid) {
                return Err(bad(format!("symmetric compressed-tensors needs every zero point at {mid} (signed 0)")));
            }
            if !l.is_sequential() {
                return Err(bad(if cfg.desc_act {
                    "g_idx is permuted (act-order with dynamic groups), which compressed-tensors >= 0.19 cannot store: its `actorder: \"weight\"` keeps the groups in column order (quantize with static groups)".into()
                } else {
                    "g_idx is permuted (act-order) but actorder is not set".into()
                }));
            }
            let (packed, pr, pc) = pack_dense(&codes_u32, o, i, bits, 1);
            let mut t = vec![
                (key("weight_packed"), StTensor::i32(vec![pr, pc], &packed)),
                (key("weight_scale"), StTensor::f16(vec![o, g], &l.scales)),
                (key("weight_shape"), StTensor::i64(vec![2], &[o as i64, i as i64])),
            ];
            if !cfg.sym {
                let zu: Vec<u32> = l.zeros.iter().map(|&z| z as u32).collect();
                let (zp, zr, zc) = pack_dense(&zu, o, g, bits, 0);
                t.push((key("weight_zero_point"), StTensor::i32(vec![zr, zc], &zp)));
            }
            Ok(t)
        }
    }
}

/// The tensor names (relative to a layer prefix) that mark a layer as stored in `method`'s
/// format: `qweight` for GPTQ and AWQ, `weight_packed` for compressed-tensors.
pub fn marker(method: QuantMethod) -> &'static str {
    match method {
        QuantMethod::Gptq | QuantMethod::Awq => "qweight",
        QuantMethod::CompressedTensors => "weight_packed",
    }
}

fn read_i32(t: &RawTensor<'_>) -> Option<Vec<i32>> {
    match t.dtype {
        safetensors::Dtype::I32 => Some(t.data.chunks_exact(4).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()),
        safetensors::Dtype::I64 => Some(
            t.data.chunks_exact(8).map(|b| i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as i32).collect(),
        ),
        _ => None,
    }
}

fn read_float(t: &RawTensor<'_>) -> Option<Vec<f32>> {
    match t.dtype {
        safetensors::Dtype::F16 => Some(t.data.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect()),
        safetensors::Dtype::BF16 => Some(t.data.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect()),
        safetensors::Dtype::F32 => Some(t.data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()),
        _ => None,
    }
}

/// Decodes one linear layer stored under `prefix` in `cfg`'s format, for a weight of
/// `[out, in]` (from the model configuration). `get(name)` returns a stored tensor or `None`.
///
/// The inverse of [`encode`]: codes, zero points and `g_idx` come back exactly; scales come back
/// as the stored f16 values.
///
/// # Errors
/// [`Error::TensorNotFound`] for a missing required tensor; [`Error::Invalid`] naming `path` and
/// the tensor for a wrong dtype or shape (e.g. a `qweight` that does not match `[in·bits/32,
/// out]`), `g_idx` entries out of range, or bits the format cannot hold.
pub fn decode<'a>(
    get: &dyn Fn(&str) -> Option<RawTensor<'a>>,
    cfg: &QuantConfig,
    prefix: &str,
    out_features: usize,
    in_features: usize,
    path: &Path,
) -> Result<IntLinear> {
    let bad = |name: &str, msg: String| Error::Invalid {
        path: path.to_path_buf(),
        format: cfg.method.name(),
        msg: format!("`{prefix}.{name}`: {msg}"),
    };
    let need = |name: &str| -> Result<RawTensor<'a>> {
        get(&format!("{prefix}.{name}")).ok_or_else(|| Error::TensorNotFound { path: path.to_path_buf(), name: format!("{prefix}.{name}") })
    };
    let ints = |name: &str, t: &RawTensor<'_>, shape: &[usize]| -> Result<Vec<i32>> {
        if t.shape != shape {
            return Err(bad(name, format!("shape {:?}, expected {shape:?} for a [{out_features}, {in_features}] {}-bit weight", t.shape, cfg.bits)));
        }
        read_i32(t).ok_or_else(|| bad(name, format!("dtype {:?}, expected I32", t.dtype)))
    };
    let floats = |name: &str, t: &RawTensor<'_>, shape: &[usize]| -> Result<Vec<f32>> {
        if t.shape != shape {
            return Err(bad(name, format!("shape {:?}, expected {shape:?}", t.shape)));
        }
        read_float(t).ok_or_else(|| bad(name, format!("dtype {:?}, expected F16, BF16 or F32", t.dtype)))
    };
    let (o, i, bits) = (out_features, in_features, cfg.bits);
    let pf = (32 / bits) as usize;
    let gs = cfg.group_size.unwrap_or(i);
    let l = match cfg.method {
        QuantMethod::Gptq => {
            if !matches!(bits, 2 | 4 | 8) {
                return Err(bad("qweight", format!("{bits}-bit GPTQ is not supported (2, 4, 8)")));
            }
            if i % pf != 0 || o % pf != 0 {
                return Err(bad("qweight", format!("[{o}, {i}] is not a multiple of {pf} for {bits}-bit GPTQ")));
            }
            let g = i.div_ceil(gs);
            let qweight = ints("qweight", &need("qweight")?, &[i / pf, o])?;
            let qzeros = ints("qzeros", &need("qzeros")?, &[g, o / pf])?;
            let scales_go = floats("scales", &need("scales")?, &[g, o])?;
            let g_idx: Vec<u32> = match get(&format!("{prefix}.g_idx")) {
                Some(t) => ints("g_idx", &t, &[i])?.into_iter().map(|x| x as u32).collect(),
                None => (0..i).map(|c| (c / gs) as u32).collect(),
            };
            let codes_io = unpack_u32(&qweight, i, o, bits, 0, &identity(bits));
            let zeros_go = unpack_u32(&qzeros, g, o, bits, 1, &identity(bits));
            let off = if cfg.gptq_v2 { 0 } else { 1 };
            IntLinear {
                out_features: o,
                in_features: i,
                bits,
                group_size: gs,
                codes: transpose(&codes_io, i, o).into_iter().map(|q| q as u8).collect(),
                scales: transpose(&scales_go, g, o),
                zeros: transpose(&zeros_go, g, o).into_iter().map(|z| z as i32 + off).collect(),
                g_idx,
            }
        }
        QuantMethod::Awq => {
            if bits != 4 {
                return Err(bad("qweight", format!("AWQ GEMM stores 4-bit codes only, config says {bits}")));
            }
            if o % 8 != 0 || i % gs != 0 {
                return Err(bad("qweight", format!("[{o}, {i}] with group size {gs} is not an AWQ GEMM shape")));
            }
            let g = i / gs;
            let qweight = ints("qweight", &need("qweight")?, &[i, o / 8])?;
            let qzeros = ints("qzeros", &need("qzeros")?, &[g, o / 8])?;
            let scales_go = floats("scales", &need("scales")?, &[g, o])?;
            let codes_io = unpack_u32(&qweight, i, o, 4, 1, &AWQ_ORDER);
            let zeros_go = unpack_u32(&qzeros, g, o, 4, 1, &AWQ_ORDER);
            IntLinear {
                out_features: o,
                in_features: i,
                bits,
                group_size: gs,
                codes: transpose(&codes_io, i, o).into_iter().map(|q| q as u8).collect(),
                scales: transpose(&scales_go, g, o),
                zeros: transpose(&zeros_go, g, o).into_iter().map(|z| z as i32).collect(),
                g_idx: (0..i).map(|c| (c / gs) as u32).collect(),
            }
        }
        QuantMethod::CompressedTensors => {
            let g = i.div_ceil(gs);
            if let Some(t) = get(&format!("{prefix}.weight_shape")) {
                let s = read_i32(&t).ok_or_else(|| bad("weight_shape", format!("dtype {:?}, expected I32 or I64", t.dtype)))?;
                if s != [o as i32, i as i32] {
                    return Err(bad("weight_shape", format!("{s:?}, expected [{o}, {i}]")));
                }
            }
            // Dense packing (compressed-tensors >= 0.18); 3-bit files of older versions hold 10
            // codes per word, told apart by the packed width (equal widths hold equal words for
            // up to 10 codes, and real widths are multiples of 32, where they always differ).
            let dense_w = (i * bits as usize).div_ceil(32);
            let wt = need("weight_packed")?;
            let codes = if bits == 3 && wt.shape == [o, i.div_ceil(pf)] && i.div_ceil(pf) != dense_w {
                unpack_u32(&ints("weight_packed", &wt, &[o, i.div_ceil(pf)])?, o, i, bits, 1, &identity(bits))
            } else {
                unpack_dense(&ints("weight_packed", &wt, &[o, dense_w])?, o, i, bits, 1)
            };
            let scales = floats("weight_scale", &need("weight_scale")?, &[o, g])?;
            let zeros: Vec<i32> = if cfg.sym {
                vec![1i32 << (bits - 1); o * g]
            } else {
                let dense_h = (o * bits as usize).div_ceil(32);
                let zt = need("weight_zero_point")?;
                let z = if bits == 3 && zt.shape == [o.div_ceil(pf), g] && o.div_ceil(pf) != dense_h {
                    unpack_u32(&ints("weight_zero_point", &zt, &[o.div_ceil(pf), g])?, o, g, bits, 0, &identity(bits))
                } else {
                    unpack_dense(&ints("weight_zero_point", &zt, &[dense_h, g])?, o, g, bits, 0)
                };
                z.into_iter().map(|z| z as i32).collect()
            };
            let g_idx: Vec<u32> = match get(&format!("{prefix}.weight_g_idx")) {
                Some(t) => ints("weight_g_idx", &t, &[i])?.into_iter().map(|x| x as u32).collect(),
                None => (0..i).map(|c| (c / gs) as u32).collect(),
            };
            IntLinear {
                out_features: o,
                in_features: i,
                bits,
                group_size: gs,
                codes: codes.into_iter().map(|q| q as u8).collect(),
                scales,
                zeros,
                g_idx,
            }
        }
    };
    l.check().map_err(|m| bad(marker(cfg.method), m))?;
    Ok(l)
}

/// Writes a Hugging Face directory atomically: `tensors` into `model.safetensors`, and each
/// `(file name, contents)` of `files` (e.g. `config.json`); `extra` then writes more files into
/// the temporary directory (the tokenizer). Everything goes into a hidden sibling directory that
/// is renamed to `out_dir` at the end, so an interrupted export leaves no half-written model.
///
/// # Errors
/// [`Error::Invalid`] if `out_dir` is a non-empty directory or a tensor's bytes do not match
/// its shape; [`Error::Io`] for write failures (the partial output is removed).
pub fn write_safetensors_dir(
    out_dir: &Path,
    tensors: &[(String, StTensor)],
    files: &[(&str, String)],
    extra: &dyn Fn(&Path) -> Result<()>,
) -> Result<()> {
    if !crate::atomic::is_absent_or_empty(out_dir).map_err(|e| Error::io(out_dir, e))? {
        return Err(Error::Invalid { path: out_dir.to_path_buf(), format: "output directory", msg: "exists and is not empty".into() });
    }
    let write = |tmp: &Path| -> Result<()> {
        let st_path = tmp.join("model.safetensors");
        let st_err = |msg: String| Error::Invalid { path: st_path.clone(), format: "safetensors", msg };
        let views = tensors
            .iter()
            .map(|(n, t)| {
                safetensors::tensor::TensorView::new(t.dtype, t.shape.clone(), &t.data)
                    .map(|v| (n.clone(), v))
                    .map_err(|e| st_err(format!("{n}: {e}")))
            })
            .collect::<Result<Vec<_>>>()?;
        let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
        safetensors::serialize_to_file(views, Some(meta), &st_path).map_err(|e| st_err(e.to_string()))?;
        for (f, text) in files {
            let p = tmp.join(f);
            std::fs::write(&p, text).map_err(|e| Error::io(&p, e))?;
        }
        extra(tmp)
    };
    crate::atomic::write_dir(out_dir, write, |p, e| Error::io(p, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_matches_reference_formulas_on_hand_examples() {
        // AutoGPTQ: qweight[row] |= intweight[j] << (bits * (j - i)) over 8 consecutive inputs.
        // Codes 1..=8 of input rows 0..8 in one output column -> 0x87654321.
        let v: Vec<u32> = (1..=8).collect();
        let (p, r, c) = pack_u32(&v, 8, 1, 4, 0, &identity(4));
        assert_eq!((r, c), (1, 1));
        assert_eq!(p[0] as u32, 0x8765_4321);
        // AWQ: qweight[:, col] |= intweight[:, col*8 + order_map[i]] << (4 i), order_map
        // [0,2,4,6,1,3,5,7]: codes 0..8 across outputs -> nibbles 0,2,4,6,1,3,5,7 from the
        // bottom = 0x75316420.
        let v: Vec<u32> = (0..8).collect();
        let (p, _, _) = pack_u32(&v, 1, 8, 4, 1, &AWQ_ORDER);
        assert_eq!(p[0] as u32, 0x7531_6420);
        assert_eq!(unpack_u32(&p, 1, 8, 4, 1, &AWQ_ORDER), v);
        // compressed-tensors' docstring example: 8-bit signed [1, 2] -> unsigned [129, 130],
        // padded -> 33409.
        let v = vec![129u32, 130];
        let (p, r, c) = pack_u32(&v, 1, 2, 8, 1, &identity(8));
        assert_eq!((r, c, p[0]), (1, 1, 33409));
        assert_eq!(unpack_u32(&p, 1, 2, 8, 1, &identity(8)), v);
    }

    /// compressed-tensors' dense layout from its definition (pack_to_int32's docstring: "element
    /// i ... from global bit position i*num_bits", no padding bits), written bit by bit: each
    /// line's codes appended least significant bit first to a bit vector, which is then cut
    /// into 32-bit words.
    fn dense_reference(values: &[u32], rows: usize, cols: usize, bits: u32, dim: usize) -> Vec<u32> {
        let (lines, n) = if dim == 0 { (cols, rows) } else { (rows, cols) };
        let words = (n * bits as usize).div_ceil(32);
        let mut per_line = Vec::new();
        for line in 0..lines {
            let mut stream: Vec<bool> = Vec::new();
            for k in 0..n {
                let v = if dim == 0 { values[k * cols + line] } else { values[line * cols + k] };
                stream.extend((0..bits).map(|b| (v >> b) & 1 == 1));
            }
            stream.resize(words * 32, false);
            per_line.push(stream.chunks(32).map(|w| w.iter().enumerate().fold(0u32, |acc, (b, &on)| acc | (u32::from(on) << b))).collect::<Vec<u32>>());
        }
        // Lay the lines out as `[lines, words]` (dim 1) or `[words, lines]` (dim 0).
        let mut out = vec![0u32; lines * words];
        for (line, ws) in per_line.iter().enumerate() {
            for (w, &x) in ws.iter().enumerate() {
                out[if dim == 0 { w * lines + line } else { line * words + w }] = x;
            }
        }
        out
    }

    #[test]
    fn dense_packing_matches_its_definition() {
        // A hand case: 3-bit codes 1..=11 in one row; code 10 (value 11 = 0b011) straddles the
        // first word: its low two bits are bits 30-31 of word 0, its high bit bit 0 of word 1.
        let v: Vec<u32> = (1..=11).map(|x| x % 8).collect();
        let (p, r, c) = pack_dense(&v, 1, 11, 3, 1);
        assert_eq!((r, c), (1, 2));
        assert_eq!((p[0] as u32) >> 30, 0b11);
        assert_eq!(p[1] as u32 & 1, 0);
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for bits in 1..=8u32 {
            for _ in 0..20 {
                let (rows, cols) = (1 + (next() % 40) as usize, 1 + (next() % 70) as usize);
                let v: Vec<u32> = (0..rows * cols).map(|_| (next() % (1 << bits)) as u32).collect();
                for dim in [0, 1] {
                    let (p, pr, pc) = pack_dense(&v, rows, cols, bits, dim);
                    let want = dense_reference(&v, rows, cols, bits, dim);
                    assert_eq!(p.iter().map(|&w| w as u32).collect::<Vec<_>>(), want, "bits {bits} dim {dim} [{rows}, {cols}]");
                    let n = if dim == 0 { rows } else { cols };
                    assert_eq!(pr * pc, want.len());
                    assert_eq!(if dim == 0 { pr } else { pc }, (n * bits as usize).div_ceil(32));
                    assert_eq!(unpack_dense(&p, rows, cols, bits, dim), v, "round trip bits {bits} dim {dim}");
                    if 32 % bits == 0 {
                        // Widths dividing 32: the same words as the older layout.
                        assert_eq!(pack_u32(&v, rows, cols, bits, dim, &identity(bits)).0, p);
                    }
                }
            }
        }
    }

    /// A 3-bit compressed-tensors layer written in the older layout (10 codes per word) still
    /// decodes to its codes; the same layer written now uses the dense layout.
    #[test]
    fn compressed_tensors_reads_the_older_3_bit_layout() {
        let (o, i, gs) = (32usize, 64usize, 32usize);
        let codes: Vec<u32> = (0..o * i).map(|k| ((k * 7 + k / i) % 8) as u32).collect();
        let zeros: Vec<u32> = (0..o * 2).map(|k| (k % 8) as u32).collect();
        let cfg = QuantConfig::new(QuantMethod::CompressedTensors, 3, Some(gs), false);
        let legacy = |name: &str| -> Option<StTensor> {
            match name {
                "x.weight_packed" => {
                    let (p, r, c) = pack_u32(&codes, o, i, 3, 1, &identity(3));
                    Some(StTensor::i32(vec![r, c], &p))
                }
                "x.weight_zero_point" => {
                    let (p, r, c) = pack_u32(&zeros, o, 2, 3, 0, &identity(3));
                    Some(StTensor::i32(vec![r, c], &p))
                }
                "x.weight_scale" => Some(StTensor::f16(vec![o, 2], &vec![0.25; o * 2])),
                _ => None,
            }
        };
        let tensors: Vec<(String, StTensor)> = ["x.weight_packed", "x.weight_zero_point", "x.weight_scale"].iter().filter_map(|n| legacy(n).map(|t| (n.to_string(), t))).collect();
        let get = |n: &str| tensors.iter().find(|(k, _)| k == n).map(|(_, t)| RawTensor { dtype: t.dtype, shape: t.shape.clone(), data: &t.data });
        let l = decode(&get, &cfg, "x", o, i, Path::new("mem")).expect("legacy decode");
        assert_eq!(l.codes.iter().map(|&q| u32::from(q)).collect::<Vec<_>>(), codes);
        assert_eq!(l.zeros.iter().map(|&z| z as u32).collect::<Vec<_>>(), zeros);
        // Written now: dense widths (64·3/32 = 6 words per row, 32·3/32 = 3 zero-point rows).
        let written = encode(&l, &cfg, "x", Path::new("mem")).expect("encode");
        let shape = |n: &str| written.iter().find(|(k, _)| k == n).map(|(_, t)| t.shape.clone());
        assert_eq!(shape("x.weight_packed"), Some(vec![o, 6]));
        assert_eq!(shape("x.weight_zero_point"), Some(vec![3, 2]));
        let get = |n: &str| written.iter().find(|(k, _)| k == n).map(|(_, t)| RawTensor { dtype: t.dtype, shape: t.shape.clone(), data: &t.data });
        let back = decode(&get, &cfg, "x", o, i, Path::new("mem")).expect("dense decode");
        assert_eq!(back.codes, l.codes);
        assert_eq!(back.zeros, l.zeros);
    }
}
