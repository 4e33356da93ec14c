//! Uniform integer quantization schemes (round-to-nearest, "RTN").
//!
//! The scale/zero convention is AutoGPTQ's `Quantizer.find_params` / `quantize`
//! (IST-DASLab/gptq `quant.py`), so that codes written here mean the same in the GPTQ export:
//!
//! - `maxq = 2^bits - 1`; over a group of values `xmin = min(min x, 0)`, `xmax = max(max x, 0)`
//!   (the range always contains zero);
//! - symmetric (`sym`): `xmax = max(|xmin|, xmax)`, `xmin = -xmax` *only when some value is
//!   negative* (AutoGPTQ's `xmin[tmp] = -xmax[tmp]` with `tmp = xmin < 0`), `zero = (maxq + 1) / 2`.
//!   As in AutoGPTQ, a symmetric group with no negative value therefore gets `scale = xmax / maxq`
//!   around the mid-point zero, and its values above `scale * (maxq - zero)` clip to that level;
//! - asymmetric: `zero = round(-xmin / scale)`;
//! - `scale = (xmax - xmin) / maxq` (a group of zeros gets `xmin = -1, xmax = 1`);
//! - code `q = clamp(round(x / scale) + zero, 0, maxq)`, value `scale * (q - zero)`.
//!
//! Rounding is half to even (`torch.round`). Every value inside the representable range
//! `[scale * -zero, scale * (maxq - zero)]` is reproduced within half a step (`scale / 2`), values
//! outside it map to the nearest end, and in asymmetric mode 0.0 is the exact code `zero`.

use crate::{Result, invalid};

/// Which values share one scale and zero point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Granularity {
    /// One scale for the whole matrix.
    PerTensor,
    /// One scale per output channel (row of `[out, in]`).
    PerChannel,
    /// One scale per output channel and per run of `group_size` consecutive input columns.
    PerGroup(usize),
}

/// A uniform quantization scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scheme {
    /// Bits per code: 2, 3, 4 or 8.
    pub bits: u32,
    /// Symmetric (fixed zero point `2^(bits-1)`) or asymmetric (per-group zero point).
    pub sym: bool,
    /// Which values share parameters.
    pub granularity: Granularity,
}

impl Scheme {
    /// Largest code, `2^bits - 1`.
    pub fn maxq(&self) -> u32 {
        (1u32 << self.bits) - 1
    }

    /// Checks `bits` and that `group_size` divides `cols`.
    ///
    /// # Errors
    /// [`crate::Error::InvalidParameter`] naming `bits` or `group_size`.
    pub fn validate(&self, cols: usize) -> Result<()> {
        check_bits(self.bits)?;
        if let Granularity::PerGroup(g) = self.granularity {
            if g == 0 {
                return Err(invalid("group_size", "must be positive"));
            }
            if !cols.is_multiple_of(g) {
                return Err(invalid("group_size", format!("{g} does not divide the input dimension {cols}")));
            }
        }
        Ok(())
    }

    /// Number of column groups for `cols` input columns: `ceil(cols / group_size)` per group
    /// (AutoGPTQ's count, the last group shorter when the size does not divide `cols`), else 1.
    pub fn groups(&self, cols: usize) -> usize {
        match self.granularity {
            Granularity::PerGroup(g) if g > 0 => cols.div_ceil(g),
            _ => 1,
        }
    }
}

/// Checks that `bits` is one of 2, 3, 4, 8.
///
/// # Errors
/// [`crate::Error::InvalidParameter`] naming `bits`.
pub fn check_bits(bits: u32) -> Result<()> {
    if matches!(bits, 2 | 3 | 4 | 8) { Ok(()) } else { Err(invalid("bits", format!("{bits} is not one of 2, 3, 4, 8"))) }
}

/// The range `[xmin, xmax]` of AutoGPTQ's `find_params`: it always contains 0, and a symmetric
/// scheme mirrors it (`xmin = -xmax` only when some value is negative). An all-zero group gives
/// `(0, 0)` (the caller widens it).
fn group_range(values: impl IntoIterator<Item = f32>, sym: bool) -> (f64, f64) {
    let (mut lo, mut hi) = (0.0f64, 0.0f64);
    for v in values {
        lo = lo.min(v as f64);
        hi = hi.max(v as f64);
    }
    if sym {
        hi = hi.max(-lo);
        if lo < 0.0 {
            lo = -hi;
        }
    }
    (lo, hi)
}

/// Scale and zero point of one group (AutoGPTQ `Quantizer.find_params`, `weight=True`).
///
/// Returns `(scale, zero)`; `scale > 0` and finite for finite input, `zero` an integer in
/// `0..=maxq` stored as f32.
pub fn find_params(values: impl IntoIterator<Item = f32>, bits: u32, sym: bool) -> (f32, f32) {
    let (lo, hi) = group_range(values, sym);
    if lo == 0.0 && hi == 0.0 { params_of_range(-1.0, 1.0, bits, sym) } else { params_of_range(lo, hi, bits, sym) }
}

/// `(scale, zero)` of the range `[lo, hi]`: `scale = (hi − lo) / maxq`, `zero` the mid-point
/// `(maxq + 1) / 2` if symmetric, else `clamp(round(−lo / scale), 0, maxq)`.
fn params_of_range(lo: f64, hi: f64, bits: u32, sym: bool) -> (f32, f32) {
    let maxq = ((1u32 << bits) - 1) as f64;
    let scale = ((hi - lo) / maxq) as f32;
    let zero = if sym { (maxq + 1.0) / 2.0 } else { (-lo / scale as f64).round_ties_even().clamp(0.0, maxq) };
    (scale, zero as f32)
}

/// Scale and zero point of one group chosen by a shrink search on the range (IST-DASLab/gptq
/// `Quantizer.find_params` with `mse=True`, GPTQModel's `mse` option): starting from the
/// [`find_params`] range `[xmin, xmax]`, try `[p·xmin, p·xmax]` for `p = 1 − i/grid`,
/// `i = 0..⌊maxshrink·grid⌋` (the reference's `grid = 100`, `maxshrink = 0.8`), and keep the one
/// with the smallest `Σ |q(x) − x|^norm` (`norm = 2.4` in the reference). Ties keep the larger
/// range (the reference's strict `err < best`). Symmetric schemes keep the mid-point zero.
///
/// `values` is read once per candidate, so it is a slice. Returns `(scale, zero)` like [`find_params`];
/// with `p = 1` the candidate is exactly [`find_params`]'s, so the search never does worse than
/// min-max on its own objective.
pub fn find_params_mse(values: &[f32], bits: u32, sym: bool, norm: f64, grid: usize, maxshrink: f64) -> (f32, f32) {
    // The range find_params uses (the reference keeps xmin / xmax for the search).
    let (lo, hi) = group_range(values.iter().copied(), sym);
    if lo == 0.0 && hi == 0.0 {
        return find_params(values.iter().copied(), bits, sym);
    }
    let maxq = (1u32 << bits) - 1;
    // Σ |q(x) − x|^norm, stopped as soon as it reaches the best so far (its terms are
    // non-negative, so the candidate is already rejected by the strict `e < best`).
    let err_of = |s: f32, z: f32, best: f64| -> f64 { group_err_bounded(values, s, z, maxq, norm as f32, best) };
    // p = 1 is find_params' own (scale, zero): the fallback if no candidate is finite.
    let (mut best_s, mut best_z) = params_of_range(lo, hi, bits, sym);
    let mut best = f64::INFINITY;
    let steps = (maxshrink * grid as f64) as usize;
    for i in 0..steps {
        let p = 1.0 - i as f64 / grid as f64;
        let (s1, z1) = params_of_range(p * lo, p * hi, bits, sym);
        if !(s1 > 0.0 && s1.is_finite()) {
            continue;
        }
        let e = err_of(s1, z1, best);
        if e < best {
            best = e;
            best_s = s1;
            best_z = z1;
        }
    }
    (best_s, best_z)
}

/// `Σ |dequantize(quantize(x)) − x|^norm` over `values` under `(scale, zero)`, in f32 as the
/// reference computes it (IST-DASLab/gptq `quant.py`, `Quantizer.find_params` with `mse=True`:
/// `q = clamp(round(x / scale) + zero, 0, maxq)`, `(scale·(q − zero) − x).abs().pow(norm)` on the
/// f32 weight), with [`pow_nonneg_f32`] for the power; returns as soon as a partial sum reaches
/// `bound` (the value returned is then some partial sum `>= bound`). Only the search's choice
/// of candidate reads it; the codes themselves come from [`quantize_value`].
///
/// The terms are the same on every instruction set (no fused multiply-adds, IEEE rounding of
/// each operation, partial sums added in a fixed order); AVX-512 and AVX2 builds of the same
/// loop only vectorize it.
pub(crate) fn group_err_bounded(values: &[f32], scale: f32, zero: f32, maxq: u32, norm: f32, bound: f64) -> f64 {
    group_err_wide(values, scale, zero, maxq, norm, bound)
}

wide_dispatch!(group_err_wide(values: &[f32], scale: f32, zero: f32, maxq: u32, norm: f32, bound: f64) -> f64, group_err_body);

#[inline(always)]
fn group_err_body(values: &[f32], scale: f32, zero: f32, maxq: u32, norm: f32, bound: f64) -> f64 {
    const LANES: usize = 16;
    let mq = maxq as f32;
    let mut total = 0.0f64;
    for block in values.chunks(LANES) {
        let mut acc = [0.0f32; LANES];
        for (a, &x) in acc.iter_mut().zip(block) {
            *a = err_term(x, scale, zero, mq, norm);
        }
        // A fixed pairwise order, so that wider vectors give the same bits.
        let mut w = LANES;
        while w > 1 {
            w /= 2;
            for l in 0..w {
                acc[l] += acc[l + w];
            }
        }
        total += acc[0] as f64;
        if total >= bound {
            return total;
        }
    }
    total
}

/// One term `|scale·(q − zero) − x|^norm` of [`group_err_bounded`], in f32.
#[inline(always)]
fn err_term(x: f32, s: f32, z: f32, mq: f32, norm: f32) -> f32 {
    let q = (round_half_even_f32(x / s) + z).clamp(0.0, mq);
    let d = (s * (q - z) - x).abs();
    pow_nonneg_f32(d, norm)
}

/// [`round_half_even`] in f32 (`c = ±2^23`), branch-free so that loops over it vectorize.
#[inline(always)]
fn round_half_even_f32(x: f32) -> f32 {
    const TWO23: f32 = 8_388_608.0;
    let c = TWO23.copysign(x);
    let r = (x + c) - c;
    if x.abs() < TWO23 { r } else { x }
}

/// `d^p` in f32 for `d >= 0` and `p > 0` (0 for `d = 0` and below 2^-126, `+inf` on overflow),
/// within `2e-7·(1 + |p log2 d|)` relative of the exact power, for the MSE search. `ln m = 2 atanh((m − 1)/(m + 1))` to the 9th power
/// (`m` in `[√½, √2)`, truncation below 3e-9), `e^t` Taylor to the 7th power on
/// `|t| <= ln 2 / 2` (below 6e-9). Branch-free and without fused multiply-adds, so every
/// instruction set gives the same bits.
#[inline(always)]
pub(crate) fn pow_nonneg_f32(d: f32, p: f32) -> f32 {
    const TWO23: f32 = 8_388_608.0;
    let bits = d.to_bits();
    // Biased exponent as a float without an integer conversion (2^23 + e, minus 2^23 + 127).
    let e = f32::from_bits((bits >> 23) | 0x4B00_0000) - (TWO23 + 127.0);
    let m = f32::from_bits((bits & 0x007F_FFFF) | 0x3F80_0000);
    let big = m > std::f32::consts::SQRT_2;
    let m = if big { m * 0.5 } else { m };
    let e = if big { e + 1.0 } else { e };
    let s = (m - 1.0) / (m + 1.0);
    let s2 = s * s;
    let mut poly = 1.0 / 9.0;
    for c in [1.0 / 7.0, 1.0 / 5.0, 1.0 / 3.0, 1.0] {
        poly = poly * s2 + c;
    }
    let ln_m = 2.0 * s * poly;
    let y = (p * (e + ln_m * std::f32::consts::LOG2_E)).clamp(-160.0, 160.0);
    let k = round_half_even_f32(y);
    let t = (y - k) * std::f32::consts::LN_2;
    // e^t, Taylor: 1 + t + t²/2! + … + t⁷/7!.
    let mut r = 1.0 / 5_040.0;
    for c in [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        r = r * t + c;
    }
    // 2^k from its biased exponent k + 127 in [1, 254] (the low bits of 2^23 + k + 127).
    let kc = k.clamp(-126.0, 127.0);
    let two_k = f32::from_bits((kc + (TWO23 + 127.0)).to_bits() << 23);
    let v = r * two_k;
    let v = if k > 127.0 { f32::INFINITY } else { v };
    if k < -126.0 || d == 0.0 { 0.0 } else { v }
}

/// `x` rounded to the nearest integer, ties to even, as [`f64::round_ties_even`] (up to the
/// sign of a zero result): `(x + c) − c` with `c = ±2^52` rounds in the FPU's default mode.
/// `round_ties_even` itself is a call to libm's `rint` on the baseline x86-64 target (no SSE4.1),
/// which dominated round-to-nearest quantization loops.
#[inline(always)]
pub(crate) fn round_half_even(x: f64) -> f64 {
    const TWO52: f64 = 4_503_599_627_370_496.0;
    if x.abs() < TWO52 {
        let c = TWO52.copysign(x);
        (x + c) - c
    } else {
        x
    }
}

/// The code of `x` (AutoGPTQ `quantize`): `clamp(round_half_even(x / scale) + zero, 0, maxq)`.
#[inline]
pub fn quantize_value(x: f32, scale: f32, zero: f32, maxq: u32) -> u8 {
    code_f64(x, scale, zero, maxq) as u8
}

/// [`quantize_value`]'s code as f64 (an integer in `0..=maxq`; NaN input gives 0, as the `u8`
/// conversion of a NaN does), for loops that dequantize it at once and vectorize better without
/// the `u8` round trip.
#[inline(always)]
fn code_f64(x: f32, scale: f32, zero: f32, maxq: u32) -> f64 {
    (round_half_even(x as f64 / scale as f64) + zero as f64).max(0.0).min(maxq as f64)
}

/// The value of a code: `scale * (q - zero)` (exact product rounded once to f32).
#[inline]
pub fn dequantize_value(q: u8, scale: f32, zero: f32) -> f32 {
    dequantize_f64(q as f64, scale, zero)
}

/// [`dequantize_value`] of a code held as f64 ([`code_f64`]).
#[inline(always)]
fn dequantize_f64(q: f64, scale: f32, zero: f32) -> f32 {
    (scale as f64 * (q - zero as f64)) as f32
}

/// A quantized `[rows, cols]` matrix: integer codes plus scales and zero points.
///
/// Parameters live in `[param_rows, groups]` arrays (`param_rows` is 1 per-tensor, `rows`
/// otherwise); column `c` of row `r` uses group `g_idx[c]` (consecutive groups for
/// [`Granularity::PerGroup`], a permuted assignment after GPTQ `desc_act`).
#[derive(Debug, Clone, PartialEq)]
pub struct QuantizedTensor {
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    /// Bits per code.
    pub bits: u32,
    /// Symmetric scheme.
    pub sym: bool,
    /// Input columns per group (`cols` for per-channel and per-tensor).
    pub group_size: usize,
    /// `[rows, cols]` codes in `0..2^bits`.
    pub codes: Vec<u8>,
    /// `[param_rows, groups]` scales.
    pub scales: Vec<f32>,
    /// `[param_rows, groups]` zero points (integers).
    pub zeros: Vec<f32>,
    /// `[cols]` group of each input column.
    pub g_idx: Vec<u32>,
    /// 1 for per-tensor parameters, `rows` otherwise.
    pub param_rows: usize,
}

impl QuantizedTensor {
    /// Number of groups per parameter row.
    pub fn groups(&self) -> usize {
        self.scales.len() / self.param_rows
    }

    /// Dequantizes to a `[rows, cols]` f32 matrix (rows in parallel).
    pub fn dequantize(&self) -> Vec<f32> {
        use rayon::prelude::*;
        let g = self.groups();
        let mut out = vec![0.0f32; self.rows * self.cols];
        if self.cols == 0 {
            return out;
        }
        out.par_chunks_mut(self.cols * RTN_ROW_CHUNK).enumerate().for_each(|(i, chunk)| {
            for (k, row) in chunk.chunks_exact_mut(self.cols).enumerate() {
                let r = i * RTN_ROW_CHUNK + k;
                let pr = if self.param_rows == 1 { 0 } else { r };
                for (c, v) in row.iter_mut().enumerate() {
                    let p = pr * g + self.g_idx[c] as usize;
                    *v = dequantize_value(self.codes[r * self.cols + c], self.scales[p], self.zeros[p]);
                }
            }
        });
        out
    }

    /// Storage cost in bits per weight: the codes plus 16-bit scales and `bits`-bit zero points
    /// (the AutoGPTQ layout; `g_idx` not counted since it is implied unless `desc_act`).
    pub fn bits_per_weight(&self) -> f64 {
        let params = self.scales.len() as f64 * (16.0 + self.bits as f64);
        self.bits as f64 + params / (self.rows * self.cols) as f64
    }
}

/// Round-to-nearest quantization of a `[rows, cols]` row-major matrix.
///
/// # Errors
/// [`crate::Error::InvalidParameter`] for unsupported `bits` or a `group_size` that does not
/// divide `cols`; [`crate::Error::Shape`] if `w.len() != rows * cols`.
pub fn quantize_rtn(w: &[f32], rows: usize, cols: usize, scheme: &Scheme) -> Result<QuantizedTensor> {
    quantize_rtn_wide(w, rows, cols, scheme)
}

// The round-to-nearest passes compiled for the widest vectors (`wide_dispatch!`, lib.rs):
// the same f64 operations in the same order on every path, so the same codes.
wide_dispatch!(quantize_rtn_wide(w: &[f32], rows: usize, cols: usize, scheme: &Scheme) -> Result<QuantizedTensor>, quantize_rtn_body);
wide_dispatch!(rtn_rows(w: &[f32], rows: usize, cols: usize, scheme: &Scheme) -> Result<QuantizedTensor>, rtn_rows_body);
wide_dispatch!(scaled_fake_quant_row_wide(x: &mut [f32], s: &[f32], gs: usize, bits: u32, sym: bool) -> (), scaled_fake_quant_row_body);

/// One row of AWQ's `Q(W · diag(s)) · diag(s)⁻¹` ([`crate::awq::scaled_fake_quant`]) in place:
/// `x` holds the row and receives the result, `s` the scales (`[cols]` each), the groups `gs`
/// columns from the start (the last one ragged; `gs = cols` per channel). The same values as
/// the matrix function gives for this row: each group's [`find_params`] of `x · s`,
/// [`quantize_value`], [`dequantize_value`], then `/ s` (with `s = 1` the plain fake
/// quantization of [`fake_quant_ragged`]). `bits` must be valid ([`check_bits`]) and `gs > 0`.
pub(crate) fn scaled_fake_quant_row(x: &mut [f32], s: &[f32], gs: usize, bits: u32, sym: bool) {
    scaled_fake_quant_row_wide(x, s, gs.max(1), bits, sym);
}

#[inline(always)]
fn scaled_fake_quant_row_body(x: &mut [f32], s: &[f32], gs: usize, bits: u32, sym: bool) {
    const L: usize = 16;
    let maxq = (1u32 << bits) - 1;
    for (og, sg) in x.chunks_mut(gs).zip(s.chunks(gs)) {
        // The scaled group and its range in L lanes: an f32 min / max is exact, and a NaN never
        // replaces a lane (`v < a` is false), as in `group_range`'s f64 `min` / `max`.
        let (mut lo, mut hi) = ([0.0f32; L], [0.0f32; L]);
        let lanes = |o: &mut [f32], s: &[f32], lo: &mut [f32; L], hi: &mut [f32; L]| {
            for (i, (o, &f)) in o.iter_mut().zip(s).enumerate() {
                let v = *o * f;
                *o = v;
                lo[i] = if v < lo[i] { v } else { lo[i] };
                hi[i] = if v > hi[i] { v } else { hi[i] };
            }
        };
        let mut oc = og.chunks_exact_mut(L);
        for (o, s) in (&mut oc).zip(sg.chunks_exact(L)) {
            lanes(o, s, &mut lo, &mut hi);
        }
        let tail = sg.len() / L * L;
        lanes(oc.into_remainder(), &sg[tail..], &mut lo, &mut hi);
        let lo = lo.iter().fold(0.0f32, |a, &l| if l < a { l } else { a });
        let hi = hi.iter().fold(0.0f32, |a, &h| if h > a { h } else { a });
        let (scale, zero) = find_params([lo, hi], bits, sym);
        // quantize_value then dequantize_value, with the code kept in f64.
        for (o, &f) in og.iter_mut().zip(sg) {
            *o = dequantize_f64(code_f64(*o, scale, zero, maxq), scale, zero) / f;
        }
    }
}

#[inline(always)]
fn quantize_rtn_body(w: &[f32], rows: usize, cols: usize, scheme: &Scheme) -> Result<QuantizedTensor> {
    scheme.validate(cols)?;
    if w.len() != rows * cols {
        return Err(crate::Error::Shape(format!("{} values for a {rows}x{cols} matrix", w.len())));
    }
    let maxq = scheme.maxq();
    let (group_size, groups) = match scheme.granularity {
        Granularity::PerGroup(g) => (g, cols / g),
        _ => (cols, 1),
    };
    let per_tensor = scheme.granularity == Granularity::PerTensor;
    let param_rows = if per_tensor { 1 } else { rows };
    let mut scales = Vec::with_capacity(param_rows * groups);
    let mut zeros = Vec::with_capacity(param_rows * groups);
    if per_tensor {
        let (s, z) = find_params(w.iter().copied(), scheme.bits, scheme.sym);
        scales.push(s);
        zeros.push(z);
    } else {
        for r in 0..rows {
            for g in 0..groups {
                let row = &w[r * cols + g * group_size..r * cols + (g + 1) * group_size];
                let (s, z) = find_params(row.iter().copied(), scheme.bits, scheme.sym);
                scales.push(s);
                zeros.push(z);
            }
        }
    }
    let g_idx: Vec<u32> = (0..cols).map(|c| (c / group_size) as u32).collect();
    let mut codes = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        let pr = if per_tensor { 0 } else { r };
        for g in 0..groups {
            let (s, z) = (scales[pr * groups + g], zeros[pr * groups + g]);
            let run = &w[r * cols + g * group_size..r * cols + (g + 1) * group_size];
            codes.extend(run.iter().map(|&x| quantize_value(x, s, z, maxq)));
        }
    }
    Ok(QuantizedTensor {
        rows,
        cols,
        bits: scheme.bits,
        sym: scheme.sym,
        group_size,
        codes,
        scales,
        zeros,
        g_idx,
        param_rows,
    })
}

/// Fake quantization (quantize then dequantize) with [`quantize_rtn`].
///
/// # Errors
/// As [`quantize_rtn`].
pub fn fake_quant(w: &[f32], rows: usize, cols: usize, scheme: &Scheme) -> Result<Vec<f32>> {
    Ok(quantize_rtn(w, rows, cols, scheme)?.dequantize())
}

/// Symmetric absmax int8 fake quantization of each row (`scale = max|row| / 127`, codes in
/// `-127..=127`): SmoothQuant's `quantize_weight_per_channel_absmax` and the vector-wise weight
/// quantization of LLM.int8() (bitsandbytes `CB`/`SCB`). All-zero rows stay zero.
pub fn absmax_int8_rows(w: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(w.len());
    for r in 0..rows {
        let row = &w[r * cols..(r + 1) * cols];
        let amax = row.iter().fold(0.0f32, |m, &v| m.max(v.abs()));
        if amax == 0.0 {
            out.extend(std::iter::repeat_n(0.0, cols));
            continue;
        }
        let s = amax / 127.0;
        out.extend(row.iter().map(|&v| (v / s).round_ties_even().clamp(-127.0, 127.0) * s));
    }
    out
}

/// Round-to-nearest quantization like [`quantize_rtn`], but a per-group scheme whose group size
/// does not divide `cols` gets AutoGPTQ's ragged groups: `ceil(cols / group_size)` groups,
/// `g_idx[c] = c / group_size`, the last group shorter (AutoGPTQ `QuantLinear` allocates
/// `ceil(infeatures / group_size)` groups). When the size divides `cols` the result is exactly
/// [`quantize_rtn`]'s.
///
/// # Errors
/// [`crate::Error::InvalidParameter`] for unsupported bits or group size 0;
/// [`crate::Error::Shape`] if `w.len() != rows * cols`.
pub fn quantize_rtn_ragged(w: &[f32], rows: usize, cols: usize, scheme: &Scheme) -> Result<QuantizedTensor> {
    use rayon::prelude::*;
    if matches!(scheme.granularity, Granularity::PerTensor) || rows <= RTN_ROW_CHUNK || w.len() != rows * cols {
        return rtn_rows(w, rows, cols, scheme);
    }
    // Per-channel and per-group parameters belong to one row: runs of rows in parallel, their
    // codes and parameters concatenated in row order (the same values as one pass).
    let parts = (0..rows.div_ceil(RTN_ROW_CHUNK))
        .into_par_iter()
        .map(|i| {
            let (r0, r1) = (i * RTN_ROW_CHUNK, ((i + 1) * RTN_ROW_CHUNK).min(rows));
            rtn_rows(&w[r0 * cols..r1 * cols], r1 - r0, cols, scheme)
        })
        .collect::<Result<Vec<_>>>()?;
    let mut parts = parts.into_iter();
    let mut q = parts.next().expect("rows > RTN_ROW_CHUNK");
    for p in parts {
        q.codes.extend_from_slice(&p.codes);
        q.scales.extend_from_slice(&p.scales);
        q.zeros.extend_from_slice(&p.zeros);
    }
    q.rows = rows;
    q.param_rows = rows;
    Ok(q)
}

/// Rows per parallel task of [`quantize_rtn_ragged`] and [`QuantizedTensor::dequantize`].
const RTN_ROW_CHUNK: usize = 64;

/// [`quantize_rtn_ragged`] in one pass over the rows (dispatched as `rtn_rows`).
#[inline(always)]
fn rtn_rows_body(w: &[f32], rows: usize, cols: usize, scheme: &Scheme) -> Result<QuantizedTensor> {
    let gs = match scheme.granularity {
        Granularity::PerGroup(g) if g > 0 && !cols.is_multiple_of(g) => g,
        _ => return quantize_rtn_body(w, rows, cols, scheme),
    };
    check_bits(scheme.bits)?;
    if w.len() != rows * cols {
        return Err(crate::Error::Shape(format!("{} values for a {rows}x{cols} matrix", w.len())));
    }
    let groups = cols.div_ceil(gs);
    let maxq = scheme.maxq();
    let mut scales = Vec::with_capacity(rows * groups);
    let mut zeros = Vec::with_capacity(rows * groups);
    let mut codes = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        let row = &w[r * cols..(r + 1) * cols];
        for g in 0..groups {
            let run = &row[g * gs..((g + 1) * gs).min(cols)];
            let (s, z) = find_params(run.iter().copied(), scheme.bits, scheme.sym);
            scales.push(s);
            zeros.push(z);
            codes.extend(run.iter().map(|&x| quantize_value(x, s, z, maxq)));
        }
    }
    Ok(QuantizedTensor {
        rows,
        cols,
        bits: scheme.bits,
        sym: scheme.sym,
        group_size: gs,
        codes,
        scales,
        zeros,
        g_idx: (0..cols).map(|c| (c / gs) as u32).collect(),
        param_rows: rows,
    })
}

/// Fake quantization with [`quantize_rtn_ragged`] (ragged last group allowed).
///
/// # Errors
/// As [`quantize_rtn_ragged`].
pub fn fake_quant_ragged(w: &[f32], rows: usize, cols: usize, scheme: &Scheme) -> Result<Vec<f32>> {
    Ok(quantize_rtn_ragged(w, rows, cols, scheme)?.dequantize())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn pow_nonneg_f32_matches_f64_powf() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let mut worst = 0.0f64;
        for _ in 0..200_000 {
            // Magnitudes of quantization errors and beyond: 2^-60 .. 2^50.
            let d = (2f64.powf(rng.random_range(-60.0..50.0)) * rng.random_range(1.0..2.0)) as f32;
            let p = [2.4f32, 2.0, 1.0, 0.5, 3.7][rng.random_range(0..5)];
            let (got, want) = (pow_nonneg_f32(d, p) as f64, (d as f64).powf(p as f64));
            if want > 1e-37 && want < 1e38 {
                // The rounding of y = p·log2(d) (|y| up to ~220 here) is amplified by ln 2 · |y|.
                let tol = 2e-7 * (1.0 + (p as f64 * (d as f64).log2()).abs());
                worst = worst.max(((got - want) / want).abs() / tol);
            }
        }
        assert!(worst < 1.0, "worst relative error {worst} of the tolerance");
        assert_eq!(pow_nonneg_f32(0.0, 2.4), 0.0);
        assert_eq!(pow_nonneg_f32(1.0, 2.4), 1.0);
        assert_eq!(pow_nonneg_f32(2.0, 2.0), 4.0);
        assert_eq!(pow_nonneg_f32(1e30, 2.4), f32::INFINITY);
        assert_eq!(pow_nonneg_f32(1e-30, 2.4), 0.0);
    }

    #[test]
    fn round_half_even_is_round_ties_even() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let mut xs: Vec<f64> = vec![0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999999999999994, 4503599627370495.5, -4503599627370495.5, 1e300, -1e300, f64::INFINITY, 0.0, -0.0, 3.0];
        xs.extend((0..100_000).map(|_| rng.random_range(-300.0..300.0)));
        xs.extend((0..1000).map(|i| i as f64 * 0.5 - 250.0));
        for x in xs {
            let (got, want) = (round_half_even(x), x.round_ties_even());
            assert!(got == want, "{x}: {got} vs {want}");
        }
        assert!(round_half_even(f64::NAN).is_nan());
        let mut ys: Vec<f32> = vec![0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999997, 8388607.5, -8388607.5, 1e30, -1e30, f32::INFINITY, 0.0, 3.0];
        ys.extend((0..100_000).map(|_| rng.random_range(-300.0f32..300.0)));
        ys.extend((0..1000).map(|i| i as f32 * 0.5 - 250.0));
        for y in ys {
            let (got, want) = (round_half_even_f32(y), y.round_ties_even());
            assert!(got == want, "{y}: {got} vs {want}");
        }
    }

    #[test]
    fn bounded_group_error_is_the_sum_or_stops_past_the_bound() {
        let mut rng = ChaCha8Rng::seed_from_u64(4);
        for n in [1usize, 7, 8, 31, 32, 33, 128, 300] {
            let v: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
            let (s, z) = find_params(v.iter().copied(), 4, false);
            let want: f64 = v.iter().map(|&x| (dequantize_value(quantize_value(x, s, z, 15), s, z) as f64 - x as f64).abs().powf(2.4)).sum();
            let got = group_err_bounded(&v, s, z, 15, 2.4, f64::INFINITY);
            // f32 terms (each within ~4e-6 relative) summed in f32.
            assert!((got - want).abs() <= 2e-5 * want, "n {n}: {got} vs {want}");
            let half = group_err_bounded(&v, s, z, 15, 2.4, want / 2.0);
            assert!(half >= want / 2.0 && half <= got * (1.0 + 1e-6), "n {n}: stopped at {half}");
        }
    }
}
