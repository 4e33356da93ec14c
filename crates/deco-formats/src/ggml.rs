//! GGML tensor types and their block (de)quantization.
//!
//! GGML stores a tensor as a flat sequence of *blocks*: a block holds
//! [`GgmlType::block_size`] elements in [`GgmlType::type_size`] bytes (for the float types a block
//! is one element). Quantized blocks carry one or more `f16` scales and packed low-bit integers.
//! All fields are little-endian.
//!
//! The layouts and the arithmetic follow llama.cpp's `ggml/src/ggml-common.h` (block structs)
//! and `ggml/src/ggml-quants.c` (`dequantize_row_*`, `quantize_row_*_ref`) exactly, including the
//! order of floating-point operations, so that the results are bit-identical to ggml's scalar
//! reference code and to gguf-py's `gguf.quants` (the independent reference used by the tests).
//! No fused multiply-add is used.
//!
//! Entry points: [`dequantize`], [`dequantize_into`], [`quantize_q8_0`], [`quantize_q4_0`],
//! [`quantize_q4_1`].

use std::fmt;

use half::f16;
use half::slice::HalfFloatSliceExt;

/// Elements per block of the "legacy" quant types (`QK4_0`, `QK4_1`, `QK5_0`, `QK5_1`, `QK8_0`).
pub const QK: usize = 32;
/// Elements per super-block of the k-quants (`QK_K` in ggml-common.h).
pub const QK_K: usize = 256;
/// Size of the packed 6-bit scale/min array of Q4_K and Q5_K (`K_SCALE_SIZE`).
const K_SCALE_SIZE: usize = 12;

/// Errors of GGML type handling and (de)quantization.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GgmlError {
    /// A type id that is not a GGML type (or one ggml has removed, like 4, 5, 31..33, 36..38).
    #[error("unknown GGML tensor type id {0}")]
    UnknownType(u32),
    /// A known type that this module cannot dequantize or quantize.
    #[error("unsupported tensor type {0}")]
    Unsupported(GgmlType),
    /// An element count that is not a whole number of blocks.
    #[error("{n_elements} elements is not a multiple of the {ty} block size {block_size}")]
    NotBlockMultiple {
        /// The tensor type.
        ty: GgmlType,
        /// Element count given.
        n_elements: usize,
        /// Elements per block of `ty`.
        block_size: usize,
    },
    /// The byte size of an element count overflows `usize`.
    #[error("{n_elements} elements of {ty} overflow the addressable byte size")]
    SizeOverflow {
        /// The tensor type.
        ty: GgmlType,
        /// Element count given.
        n_elements: usize,
    },
    /// The data buffer has the wrong length for the element count.
    #[error("{ty} data for {n_elements} elements must be {expected} bytes, got {actual} bytes")]
    DataLength {
        /// The tensor type.
        ty: GgmlType,
        /// Element count.
        n_elements: usize,
        /// Bytes expected (`ty.bytes_for(n_elements)`).
        expected: usize,
        /// Bytes given.
        actual: usize,
    },
}

/// `Result` with [`GgmlError`].
pub type Result<T> = std::result::Result<T, GgmlError>;

/// A GGML tensor element type, with ggml's numeric id (`enum ggml_type` in ggml.h, mirrored by
/// gguf-py's `GGMLQuantizationType`). Ids 4, 5 (Q4_2, Q4_3), 31..33 (Q4_0_4_4 ...) and 36..38
/// (IQ4_NL_4_4 ...) were removed from ggml and are rejected as unknown.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u32)]
pub enum GgmlType {
    /// IEEE-754 binary32.
    F32 = 0,
    /// IEEE-754 binary16.
    F16 = 1,
    /// 4-bit, 32-element blocks, f16 scale (`block_q4_0`).
    Q4_0 = 2,
    /// 4-bit, 32-element blocks, f16 scale and min (`block_q4_1`).
    Q4_1 = 3,
    /// 5-bit, 32-element blocks, f16 scale (`block_q5_0`).
    Q5_0 = 6,
    /// 5-bit, 32-element blocks, f16 scale and min (`block_q5_1`).
    Q5_1 = 7,
    /// 8-bit, 32-element blocks, f16 scale (`block_q8_0`).
    Q8_0 = 8,
    /// 8-bit, 32-element blocks, f16 scale and sum (`block_q8_1`; an internal dot-product type).
    Q8_1 = 9,
    /// 2-bit k-quant, 256-element super-blocks (`block_q2_K`).
    Q2_K = 10,
    /// 3-bit k-quant (`block_q3_K`).
    Q3_K = 11,
    /// 4-bit k-quant (`block_q4_K`).
    Q4_K = 12,
    /// 5-bit k-quant (`block_q5_K`).
    Q5_K = 13,
    /// 6-bit k-quant (`block_q6_K`).
    Q6_K = 14,
    /// 8-bit k-quant with f32 scale (`block_q8_K`; an internal dot-product type).
    Q8_K = 15,
    /// 2.06-bit i-quant (`block_iq2_xxs`).
    IQ2_XXS = 16,
    /// 2.31-bit i-quant (`block_iq2_xs`).
    IQ2_XS = 17,
    /// 3.06-bit i-quant (`block_iq3_xxs`).
    IQ3_XXS = 18,
    /// 1.56-bit i-quant (`block_iq1_s`).
    IQ1_S = 19,
    /// 4-bit non-linear, 32-element blocks (`block_iq4_nl`).
    IQ4_NL = 20,
    /// 3.44-bit i-quant (`block_iq3_s`).
    IQ3_S = 21,
    /// 2.5-bit i-quant (`block_iq2_s`).
    IQ2_S = 22,
    /// 4.25-bit non-linear i-quant (`block_iq4_xs`).
    IQ4_XS = 23,
    /// Signed 8-bit integer.
    I8 = 24,
    /// Signed 16-bit integer.
    I16 = 25,
    /// Signed 32-bit integer.
    I32 = 26,
    /// Signed 64-bit integer.
    I64 = 27,
    /// IEEE-754 binary64.
    F64 = 28,
    /// 1.75-bit i-quant (`block_iq1_m`).
    IQ1_M = 29,
    /// bfloat16 (upper half of an f32).
    BF16 = 30,
    /// Ternary 1.69-bit (`block_tq1_0`).
    TQ1_0 = 34,
    /// Ternary 2-bit (`block_tq2_0`).
    TQ2_0 = 35,
    /// OCP microscaling FP4 (E2M1 with E8M0 scale, `block_mxfp4`).
    MXFP4 = 39,
    /// NVIDIA FP4, 64-element blocks (`block_nvfp4`).
    NVFP4 = 40,
    /// 1-bit, 128-element blocks (`block_q1_0`).
    Q1_0 = 41,
}

impl GgmlType {
    /// Every known type, in id order.
    pub const ALL: [GgmlType; 34] = [
        Self::F32,
        Self::F16,
        Self::Q4_0,
        Self::Q4_1,
        Self::Q5_0,
        Self::Q5_1,
        Self::Q8_0,
        Self::Q8_1,
        Self::Q2_K,
        Self::Q3_K,
        Self::Q4_K,
        Self::Q5_K,
        Self::Q6_K,
        Self::Q8_K,
        Self::IQ2_XXS,
        Self::IQ2_XS,
        Self::IQ3_XXS,
        Self::IQ1_S,
        Self::IQ4_NL,
        Self::IQ3_S,
        Self::IQ2_S,
        Self::IQ4_XS,
        Self::I8,
        Self::I16,
        Self::I32,
        Self::I64,
        Self::F64,
        Self::IQ1_M,
        Self::BF16,
        Self::TQ1_0,
        Self::TQ2_0,
        Self::MXFP4,
        Self::NVFP4,
        Self::Q1_0,
    ];

    /// The ggml type id (`ggml_type` value, as stored in GGUF tensor infos).
    pub fn id(self) -> u32 {
        self as u32
    }

    /// llama.cpp's upper-case name, e.g. `"Q4_K"`, `"BF16"` (as in gguf-py and `gguf-dump`).
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q5_0 => "Q5_0",
            Self::Q5_1 => "Q5_1",
            Self::Q8_0 => "Q8_0",
            Self::Q8_1 => "Q8_1",
            Self::Q2_K => "Q2_K",
            Self::Q3_K => "Q3_K",
            Self::Q4_K => "Q4_K",
            Self::Q5_K => "Q5_K",
            Self::Q6_K => "Q6_K",
            Self::Q8_K => "Q8_K",
            Self::IQ2_XXS => "IQ2_XXS",
            Self::IQ2_XS => "IQ2_XS",
            Self::IQ3_XXS => "IQ3_XXS",
            Self::IQ1_S => "IQ1_S",
            Self::IQ4_NL => "IQ4_NL",
            Self::IQ3_S => "IQ3_S",
            Self::IQ2_S => "IQ2_S",
            Self::IQ4_XS => "IQ4_XS",
            Self::I8 => "I8",
            Self::I16 => "I16",
            Self::I32 => "I32",
            Self::I64 => "I64",
            Self::F64 => "F64",
            Self::IQ1_M => "IQ1_M",
            Self::BF16 => "BF16",
            Self::TQ1_0 => "TQ1_0",
            Self::TQ2_0 => "TQ2_0",
            Self::MXFP4 => "MXFP4",
            Self::NVFP4 => "NVFP4",
            Self::Q1_0 => "Q1_0",
        }
    }

    /// Elements per block (`blck_size` in ggml's type traits; 1 for the plain types).
    pub fn block_size(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::BF16 | Self::F64 => 1,
            Self::I8 | Self::I16 | Self::I32 | Self::I64 => 1,
            Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q5_1 | Self::Q8_0 | Self::Q8_1 => QK,
            Self::IQ4_NL | Self::MXFP4 => 32,
            Self::NVFP4 => 64,
            Self::Q1_0 => 128,
            Self::Q2_K
            | Self::Q3_K
            | Self::Q4_K
            | Self::Q5_K
            | Self::Q6_K
            | Self::Q8_K
            | Self::IQ2_XXS
            | Self::IQ2_XS
            | Self::IQ3_XXS
            | Self::IQ1_S
            | Self::IQ3_S
            | Self::IQ2_S
            | Self::IQ4_XS
            | Self::IQ1_M
            | Self::TQ1_0
            | Self::TQ2_0 => QK_K,
        }
    }

    /// Bytes per block (`sizeof(block_*)` in ggml-common.h; element size for the plain types).
    ///
    /// Q8_1 is 36 bytes (`ggml_half2 ds` + 32 quants) as in current ggml; gguf-py's table still
    /// lists the old 40-byte layout with two f32 fields.
    pub fn type_size(self) -> usize {
        const K: usize = QK_K;
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::F64 => 8,
            Self::I8 => 1,
            Self::I16 => 2,
            Self::I32 => 4,
            Self::I64 => 8,
            Self::Q4_0 => 2 + QK / 2,
            Self::Q4_1 => 2 + 2 + QK / 2,
            Self::Q5_0 => 2 + 4 + QK / 2,
            Self::Q5_1 => 2 + 2 + 4 + QK / 2,
            Self::Q8_0 => 2 + QK,
            Self::Q8_1 => 2 + 2 + QK,
            Self::Q2_K => 2 + 2 + K / 16 + K / 4,
            Self::Q3_K => 2 + K / 4 + K / 8 + 12,
            Self::Q4_K => 2 + 2 + K_SCALE_SIZE + K / 2,
            Self::Q5_K => 2 + 2 + K_SCALE_SIZE + K / 8 + K / 2,
            Self::Q6_K => 2 + K / 2 + K / 4 + K / 16,
            Self::Q8_K => 4 + K + K / 8,
            Self::IQ2_XXS => 2 + K / 4,
            Self::IQ2_XS => 2 + K / 4 + K / 32,
            Self::IQ3_XXS => 2 + K / 4 + K / 8,
            Self::IQ1_S => 2 + K / 8 + K / 16,
            Self::IQ4_NL => 2 + 16,
            Self::IQ3_S => 2 + K / 4 + K / 8 + K / 32 + 4,
            Self::IQ2_S => 2 + K / 4 + K / 16,
            Self::IQ4_XS => 2 + 2 + K / 2 + K / 64,
            Self::IQ1_M => K / 8 + K / 16 + K / 32,
            Self::TQ1_0 => 2 + 4 * 13,
            Self::TQ2_0 => 2 + 64,
            Self::MXFP4 => 1 + 16,
            Self::NVFP4 => 4 + 32,
            Self::Q1_0 => 2 + 16,
        }
    }

    /// Bytes needed for `n_elements` elements of this type.
    ///
    /// # Errors
    /// [`GgmlError::NotBlockMultiple`] if `n_elements` is not a multiple of
    /// [`block_size`](Self::block_size); [`GgmlError::SizeOverflow`] if the size overflows `usize`.
    pub fn bytes_for(self, n_elements: usize) -> Result<usize> {
        let bs = self.block_size();
        if !n_elements.is_multiple_of(bs) {
            return Err(GgmlError::NotBlockMultiple { ty: self, n_elements, block_size: bs });
        }
        (n_elements / bs)
            .checked_mul(self.type_size())
            .ok_or(GgmlError::SizeOverflow { ty: self, n_elements })
    }

    /// Whether this is a block-quantized type (anything but the plain float and integer types).
    pub fn is_quantized(self) -> bool {
        !matches!(
            self,
            Self::F32 | Self::F16 | Self::BF16 | Self::F64 | Self::I8 | Self::I16 | Self::I32 | Self::I64
        )
    }

    /// Whether [`dequantize`] supports this type.
    pub fn can_dequantize(self) -> bool {
        matches!(
            self,
            Self::F32
                | Self::F16
                | Self::BF16
                | Self::F64
                | Self::Q4_0
                | Self::Q4_1
                | Self::Q5_0
                | Self::Q5_1
                | Self::Q8_0
                | Self::Q2_K
                | Self::Q3_K
                | Self::Q4_K
                | Self::Q5_K
                | Self::Q6_K
                | Self::Q8_K
        )
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl TryFrom<u32> for GgmlType {
    type Error = GgmlError;

    /// Maps a ggml type id to its type.
    ///
    /// # Errors
    /// [`GgmlError::UnknownType`] naming the id if it is not a (current) ggml type.
    fn try_from(id: u32) -> Result<Self> {
        Self::ALL.iter().copied().find(|t| t.id() == id).ok_or(GgmlError::UnknownType(id))
    }
}

/// Dequantizes `n_elements` elements of type `ty` from `data` to `f32`.
///
/// `data` must be exactly `ty.bytes_for(n_elements)` bytes. Follows ggml-quants.c
/// `dequantize_row_*` bit for bit (F16 via IEEE conversion, BF16 by a 16-bit shift, F64 by
/// rounding to nearest). Large inputs are split over up to 8 threads (`std::thread::scope`).
///
/// # Errors
/// [`GgmlError::Unsupported`] for a type without a dequantizer here (see
/// [`GgmlType::can_dequantize`]; the IQ*, TQ*, integer, Q8_1, MXFP4, NVFP4 and Q1_0 types),
/// [`GgmlError::NotBlockMultiple`] / [`GgmlError::DataLength`] on a size mismatch.
pub fn dequantize(ty: GgmlType, data: &[u8], n_elements: usize) -> Result<Vec<f32>> {
    check(ty, data, n_elements)?;
    let mut out = vec![0.0f32; n_elements];
    dequantize_into(ty, data, &mut out)?;
    Ok(out)
}

/// Dequantizes `data` (type `ty`) into `out`; the element count is `out.len()`.
///
/// Same semantics as [`dequantize`]; `data` must be exactly `ty.bytes_for(out.len())` bytes.
///
/// # Errors
/// As [`dequantize`]; on error `out` is left unchanged.
pub fn dequantize_into(ty: GgmlType, data: &[u8], out: &mut [f32]) -> Result<()> {
    check(ty, data, out.len())?;
    match ty {
        GgmlType::F32 => run::<4, 1>(data, out, |b, y| y[0] = f32::from_le_bytes(*b)),
        GgmlType::F64 => run::<8, 1>(data, out, |b, y| y[0] = f64::from_le_bytes(*b) as f32),
        GgmlType::BF16 => run::<2, 1>(data, out, |b, y| {
            y[0] = f32::from_bits(u32::from(u16::from_le_bytes(*b)) << 16);
        }),
        GgmlType::F16 => {
            run::<512, 256>(data, out, f16_chunk);
            // the tail shorter than one 256-element chunk (data.len() == 2 * out.len() was checked)
            let n_full = out.len() / 256 * 256;
            run::<2, 1>(&data[n_full * 2..], &mut out[n_full..], |b, y| y[0] = f16::from_le_bytes(*b).to_f32());
        }
        GgmlType::Q4_0 => run::<18, 32>(data, out, dequant_q4_0),
        GgmlType::Q4_1 => run::<20, 32>(data, out, dequant_q4_1),
        GgmlType::Q5_0 => run::<22, 32>(data, out, dequant_q5_0),
        GgmlType::Q5_1 => run::<24, 32>(data, out, dequant_q5_1),
        GgmlType::Q8_0 => run::<34, 32>(data, out, dequant_q8_0),
        GgmlType::Q2_K => run::<84, 256>(data, out, dequant_q2_k),
        GgmlType::Q3_K => run::<110, 256>(data, out, dequant_q3_k),
        GgmlType::Q4_K => run::<144, 256>(data, out, dequant_q4_k),
        GgmlType::Q5_K => run::<176, 256>(data, out, dequant_q5_k),
        GgmlType::Q6_K => run::<210, 256>(data, out, dequant_q6_k),
        GgmlType::Q8_K => run::<292, 256>(data, out, dequant_q8_k),
        _ => return Err(GgmlError::Unsupported(ty)),
    }
    Ok(())
}

/// Validates type support and the data length for `n_elements` elements.
fn check(ty: GgmlType, data: &[u8], n_elements: usize) -> Result<()> {
    if !ty.can_dequantize() {
        return Err(GgmlError::Unsupported(ty));
    }
    let expected = ty.bytes_for(n_elements)?;
    if data.len() != expected {
        return Err(GgmlError::DataLength { ty, n_elements, expected, actual: data.len() });
    }
    Ok(())
}

/// Below this many output elements, dequantization runs on the calling thread.
const PARALLEL_MIN_ELEMENTS: usize = 1 << 18;

/// Applies `f` to every (TS-byte block, BS-element output) pair of `data` / `out`, whose lengths
/// the caller has checked to be whole, matching block counts (trailing partial chunks are
/// ignored, which the F16 path uses). Splits the work over threads for large inputs.
fn run<const TS: usize, const BS: usize>(data: &[u8], out: &mut [f32], f: impl Fn(&[u8; TS], &mut [f32; BS]) + Sync) {
    let (blocks, _) = data.as_chunks::<TS>();
    let (outs, _) = out.as_chunks_mut::<BS>();
    let n_blocks = blocks.len().min(outs.len());
    let threads = if n_blocks * BS >= PARALLEL_MIN_ELEMENTS {
        std::thread::available_parallelism().map_or(1, |n| n.get()).min(8)
    } else {
        1
    };
    if threads <= 1 {
        blocks.iter().zip(outs.iter_mut()).for_each(|(b, y)| f(b, y));
        return;
    }
    let per = n_blocks.div_ceil(threads);
    let f = &f;
    std::thread::scope(|s| {
        for (bs, ys) in blocks.chunks(per).zip(outs.chunks_mut(per)) {
            s.spawn(move || bs.iter().zip(ys.iter_mut()).for_each(|(b, y)| f(b, y)));
        }
    });
}

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from(b[i]) | (u16::from(b[i + 1]) << 8)).to_f32()
}

/// 256 f16 values -> f32 with half's (SIMD where available) slice conversion.
fn f16_chunk(b: &[u8; 512], y: &mut [f32; 256]) {
    let mut h = [f16::ZERO; 256];
    for (hv, pair) in h.iter_mut().zip(b.as_chunks::<2>().0) {
        *hv = f16::from_le_bytes(*pair);
    }
    h.convert_to_f32_slice(y);
}

/// `dequantize_row_q4_0`: block {f16 d; u8 qs[16]}; y[j] = (lo(qs[j]) - 8) d, y[j+16] = (hi - 8) d.
fn dequant_q4_0(b: &[u8; 18], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        let x0 = i32::from(qs[j] & 0x0F) - 8;
        let x1 = i32::from(qs[j] >> 4) - 8;
        y[j] = x0 as f32 * d;
        y[j + 16] = x1 as f32 * d;
    }
}

/// `dequantize_row_q4_1`: block {f16 d; f16 m; u8 qs[16]}; y = q d + m.
fn dequant_q4_1(b: &[u8; 20], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qs = &b[4..20];
    for j in 0..16 {
        y[j] = f32::from(qs[j] & 0x0F) * d + m;
        y[j + 16] = f32::from(qs[j] >> 4) * d + m;
    }
}

/// `dequantize_row_q5_0`: block {f16 d; u8 qh[4]; u8 qs[16]}; 5th bit j of element j in qh.
fn dequant_q5_0(b: &[u8; 22], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    for j in 0..16 {
        let xh0 = (((qh >> j) << 4) & 0x10) as u8;
        let xh1 = ((qh >> (j + 12)) & 0x10) as u8;
        let x0 = i32::from((qs[j] & 0x0F) | xh0) - 16;
        let x1 = i32::from((qs[j] >> 4) | xh1) - 16;
        y[j] = x0 as f32 * d;
        y[j + 16] = x1 as f32 * d;
    }
}

/// `dequantize_row_q5_1`: block {f16 d; f16 m; u8 qh[4]; u8 qs[16]}; y = q d + m.
fn dequant_q5_1(b: &[u8; 24], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let qs = &b[8..24];
    for j in 0..16 {
        let xh0 = (((qh >> j) << 4) & 0x10) as u8;
        let xh1 = ((qh >> (j + 12)) & 0x10) as u8;
        let x0 = (qs[j] & 0x0F) | xh0;
        let x1 = (qs[j] >> 4) | xh1;
        y[j] = f32::from(x0) * d + m;
        y[j + 16] = f32::from(x1) * d + m;
    }
}

/// `dequantize_row_q8_0`: block {f16 d; i8 qs[32]}; y = q d.
fn dequant_q8_0(b: &[u8; 34], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    for (yj, &q) in y.iter_mut().zip(&b[2..34]) {
        *yj = f32::from(q as i8) * d;
    }
}

/// `dequantize_row_q2_K`: block {u8 scales[16]; u8 qs[64]; f16 d; f16 dmin}. Each 4-bit pair in
/// `scales` is (scale, min) of 16 elements; y = d sc q - dmin m with 2-bit q.
fn dequant_q2_k(b: &[u8; 84], y: &mut [f32; 256]) {
    let scales = &b[0..16];
    let d = f16_at(b, 80);
    let min = f16_at(b, 82);
    let mut is = 0;
    let mut o = 0;
    for n in 0..2 {
        let q = &b[16 + 32 * n..16 + 32 * n + 32];
        for shift in [0u32, 2, 4, 6] {
            for h in 0..2 {
                let sc = scales[is];
                is += 1;
                let dl = d * f32::from(sc & 0x0F);
                let ml = min * f32::from(sc >> 4);
                for &ql in &q[16 * h..16 * h + 16] {
                    y[o] = dl * f32::from((ql >> shift) & 3) - ml;
                    o += 1;
                }
            }
        }
    }
}

/// `dequantize_row_q3_K`: block {u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d}. Sixteen 6-bit
/// signed scales (offset 32) unpacked with kmask1/kmask2; a cleared hmask bit subtracts 4.
fn dequant_q3_k(b: &[u8; 110], y: &mut [f32; 256]) {
    const KMASK1: u32 = 0x0303_0303;
    const KMASK2: u32 = 0x0f0f_0f0f;
    let hm = &b[0..32];
    let d_all = f16_at(b, 108);
    let s = &b[96..108];
    let mut aux = [
        u32::from_le_bytes([s[0], s[1], s[2], s[3]]),
        u32::from_le_bytes([s[4], s[5], s[6], s[7]]),
        u32::from_le_bytes([s[8], s[9], s[10], s[11]]),
        0,
    ];
    let tmp = aux[2];
    aux[2] = ((aux[0] >> 4) & KMASK2) | (((tmp >> 4) & KMASK1) << 4);
    aux[3] = ((aux[1] >> 4) & KMASK2) | (((tmp >> 6) & KMASK1) << 4);
    aux[0] = (aux[0] & KMASK2) | ((tmp & KMASK1) << 4);
    aux[1] = (aux[1] & KMASK2) | (((tmp >> 2) & KMASK1) << 4);
    let mut scales = [0i8; 16];
    for (k, a) in aux.iter().enumerate() {
        for (l, byte) in a.to_le_bytes().into_iter().enumerate() {
            scales[4 * k + l] = byte as i8;
        }
    }
    let mut is = 0;
    let mut o = 0;
    let mut m: u8 = 1;
    for n in 0..2 {
        let q = &b[32 + 32 * n..32 + 32 * n + 32];
        for shift in [0u32, 2, 4, 6] {
            for h in 0..2 {
                let dl = d_all * f32::from(i16::from(scales[is]) - 32);
                is += 1;
                for l in 16 * h..16 * h + 16 {
                    let lo = i16::from((q[l] >> shift) & 3);
                    let hi = if hm[l] & m != 0 { 0 } else { 4 };
                    y[o] = dl * f32::from(lo - hi);
                    o += 1;
                }
            }
            m = m.wrapping_shl(1);
        }
    }
}

/// `get_scale_min_k4`: the j-th 6-bit (scale, min) pair of Q4_K/Q5_K's 12-byte array.
#[inline]
fn get_scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// `dequantize_row_q4_K`: block {f16 d; f16 dmin; u8 scales[12]; u8 qs[128]}; eight groups of 32
/// with y = d sc q - dmin m.
fn dequant_q4_k(b: &[u8; 144], y: &mut [f32; 256]) {
    let d = f16_at(b, 0);
    let min = f16_at(b, 2);
    let scales = &b[4..16];
    for k in 0..4 {
        let q = &b[16 + 32 * k..16 + 32 * k + 32];
        let (sc1, m1) = get_scale_min_k4(2 * k, scales);
        let (sc2, m2) = get_scale_min_k4(2 * k + 1, scales);
        let (d1, m1) = (d * f32::from(sc1), min * f32::from(m1));
        let (d2, m2) = (d * f32::from(sc2), min * f32::from(m2));
        let o = 64 * k;
        for l in 0..32 {
            y[o + l] = d1 * f32::from(q[l] & 0x0F) - m1;
            y[o + 32 + l] = d2 * f32::from(q[l] >> 4) - m2;
        }
    }
}

/// `dequantize_row_q5_K`: block {f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}; like
/// Q4_K with a fifth bit from qh (bits 2k, 2k+1 for group pair k).
fn dequant_q5_k(b: &[u8; 176], y: &mut [f32; 256]) {
    let d = f16_at(b, 0);
    let min = f16_at(b, 2);
    let scales = &b[4..16];
    let qh = &b[16..48];
    for k in 0..4 {
        let ql = &b[48 + 32 * k..48 + 32 * k + 32];
        let (sc1, m1) = get_scale_min_k4(2 * k, scales);
        let (sc2, m2) = get_scale_min_k4(2 * k + 1, scales);
        let (d1, m1) = (d * f32::from(sc1), min * f32::from(m1));
        let (d2, m2) = (d * f32::from(sc2), min * f32::from(m2));
        let u1 = 1u8 << (2 * k);
        let u2 = 2u8 << (2 * k);
        let o = 64 * k;
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            y[o + l] = d1 * f32::from((ql[l] & 0x0F) + h1) - m1;
            y[o + 32 + l] = d2 * f32::from((ql[l] >> 4) + h2) - m2;
        }
    }
}

/// `dequantize_row_q6_K`: block {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}; 6-bit q (offset
/// 32), y = d sc q evaluated as (d sc) q.
fn dequant_q6_k(b: &[u8; 210], y: &mut [f32; 256]) {
    let d = f16_at(b, 208);
    for n in 0..2 {
        let ql = &b[64 * n..64 * n + 64];
        let qh = &b[128 + 32 * n..128 + 32 * n + 32];
        let sc = &b[192 + 8 * n..192 + 8 * n + 8];
        let o = 128 * n;
        for l in 0..32 {
            let is = l / 16;
            let q1 = i16::from((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) - 32;
            let q2 = i16::from((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32;
            let q3 = i16::from((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            let q4 = i16::from((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            y[o + l] = d * f32::from(sc[is] as i8) * f32::from(q1);
            y[o + l + 32] = d * f32::from(sc[is + 2] as i8) * f32::from(q2);
            y[o + l + 64] = d * f32::from(sc[is + 4] as i8) * f32::from(q3);
            y[o + l + 96] = d * f32::from(sc[is + 6] as i8) * f32::from(q4);
        }
    }
}

/// `dequantize_row_q8_K`: block {f32 d; i8 qs[256]; i16 bsums[16]}; y = d q (bsums unused).
fn dequant_q8_k(b: &[u8; 292], y: &mut [f32; 256]) {
    let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    for (yj, &q) in y.iter_mut().zip(&b[4..260]) {
        *yj = d * f32::from(q as i8);
    }
}

/// Checks that `x.len()` is a whole number of 32-element blocks.
fn check_quant_len(ty: GgmlType, x: &[f32]) -> Result<()> {
    if x.len().is_multiple_of(QK) {
        Ok(())
    } else {
        Err(GgmlError::NotBlockMultiple { ty, n_elements: x.len(), block_size: QK })
    }
}

/// `1/d`, or 0 when `d == 0` (ggml's `d ? 1.0f/d : 0.0f`).
#[inline]
fn inv(d: f32) -> f32 {
    if d != 0.0 { 1.0 / d } else { 0.0 }
}

/// Quantizes `x` to Q8_0 blocks (34 bytes per 32 values), exactly as ggml's
/// `quantize_row_q8_0_ref`: `d = max|x| / 127`, `q = roundf(x / d)` (ties away from zero), `d`
/// stored as f16 (round to nearest even).
///
/// # Errors
/// [`GgmlError::NotBlockMultiple`] if `x.len()` is not a multiple of 32.
pub fn quantize_q8_0(x: &[f32]) -> Result<Vec<u8>> {
    check_quant_len(GgmlType::Q8_0, x)?;
    let mut out = Vec::with_capacity(x.len() / QK * 34);
    for blk in x.chunks_exact(QK) {
        let amax = blk.iter().fold(0.0f32, |a, &v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = inv(d);
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        out.extend(blk.iter().map(|&v| ((v * id).round() as i8) as u8));
    }
    Ok(out)
}

/// Quantizes `x` to Q4_0 blocks (18 bytes per 32 values), exactly as ggml's
/// `quantize_row_q4_0_ref`: `d = max / -8` where `max` is the (first) element of largest
/// magnitude, `q = min(15, trunc(x / d + 8.5))`, low nibbles hold elements 0..16.
///
/// # Errors
/// [`GgmlError::NotBlockMultiple`] if `x.len()` is not a multiple of 32.
pub fn quantize_q4_0(x: &[f32]) -> Result<Vec<u8>> {
    check_quant_len(GgmlType::Q4_0, x)?;
    let mut out = Vec::with_capacity(x.len() / QK * 18);
    for blk in x.chunks_exact(QK) {
        let mut amax = 0.0f32;
        let mut max = 0.0f32;
        for &v in blk {
            if amax < v.abs() {
                amax = v.abs();
                max = v;
            }
        }
        let d = max / -8.0;
        let id = inv(d);
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        let q = |v: f32| ((v * id + 8.5) as i8).min(15) as u8;
        out.extend((0..QK / 2).map(|j| q(blk[j]) | (q(blk[j + QK / 2]) << 4)));
    }
    Ok(out)
}

/// Quantizes `x` to Q4_1 blocks (20 bytes per 32 values), exactly as ggml's
/// `quantize_row_q4_1_ref`: `d = (max - min) / 15`, `m = min`,
/// `q = min(15, trunc((x - min) / d + 0.5))`.
///
/// # Errors
/// [`GgmlError::NotBlockMultiple`] if `x.len()` is not a multiple of 32.
pub fn quantize_q4_1(x: &[f32]) -> Result<Vec<u8>> {
    check_quant_len(GgmlType::Q4_1, x)?;
    let mut out = Vec::with_capacity(x.len() / QK * 20);
    for blk in x.chunks_exact(QK) {
        let mut min = f32::MAX;
        let mut max = -f32::MAX;
        for &v in blk {
            if v < min {
                min = v;
            }
            if v > max {
                max = v;
            }
        }
        let d = (max - min) / 15.0;
        let id = inv(d);
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        out.extend_from_slice(&f16::from_f32(min).to_le_bytes());
        let q = |v: f32| (((v - min) * id + 0.5) as i8).min(15) as u8;
        out.extend((0..QK / 2).map(|j| q(blk[j]) | (q(blk[j + QK / 2]) << 4)));
    }
    Ok(out)
}
