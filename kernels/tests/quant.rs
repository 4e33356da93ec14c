//! Packed quantized matmul vs a plain reference: dequantize with `deco_formats::ggml` (ggml's
//! scalar `dequantize_row_*`), then multiply in f64.

use deco_formats::ggml;
use deco_kernels::quant::{BlockType, Isa, PackedMatrix, QuantizedActivations, q8_isa};
use proptest::prelude::*;

mod common;
use common::ggml_type;

/// Packed blocks for `w`: ggml's quantizers for the 32-blocks; for Q4_K, Q5_0 and Q6_K (no
/// quantizer in deco-formats) raw blocks with every code, scale and min bit pseudo-random and
/// the block scales set from the magnitude of `w` (the reference then dequantizes these exact
/// bytes with ggml's arithmetic).
fn quantize(ty: BlockType, w: &[f32]) -> Vec<u8> {
    if let Some(q) = common::ggml_quantize(ty, w) {
        return q;
    }
    match ty {
        BlockType::Q4_0 | BlockType::Q4_1 | BlockType::Q8_0 => unreachable!("ggml quantizes these"),
        BlockType::Q4_K => {
            let amax = w.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-3);
            let bits = values(w.len() as u64 ^ w[0].to_bits() as u64, w.len() / 256 * 144, 1.0);
            let mut out = Vec::with_capacity(w.len() / 256 * 144);
            for (b, r) in bits.chunks_exact(144).enumerate() {
                let d = half::f16::from_f32(amax / (15.0 * 63.0) * (1.0 + (b % 3) as f32));
                let dmin = half::f16::from_f32(amax / 63.0);
                out.extend(d.to_bits().to_le_bytes());
                out.extend(dmin.to_bits().to_le_bytes());
                out.extend(r[4..].iter().map(|v| (v.to_bits() >> 7) as u8));
            }
            out
        }
        BlockType::Q6_K => {
            // Every ql / qh bit and scale pseudo-random (scales in −64..64, extremes included),
            // d from the magnitude of `w`.
            let amax = w.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-3);
            let bits = values(w.len() as u64 ^ 0x66, w.len() / 256 * 210, 1.0);
            let mut out = Vec::with_capacity(w.len() / 256 * 210);
            for (b, r) in bits.chunks_exact(210).enumerate() {
                out.extend(r[..192].iter().map(|v| (v.to_bits() >> 7) as u8));
                out.extend(r[192..208].iter().enumerate().map(|(j, v)| match (b + j) % 7 {
                    0 => 0x80u8, // -128
                    1 => 0x7F,
                    _ => ((v.to_bits() >> 9) as u8 & 0x7F).wrapping_sub(64),
                }));
                out.extend(half::f16::from_f32(amax / (32.0 * 64.0)).to_bits().to_le_bytes());
            }
            out
        }
        BlockType::Q5_0 => {
            // d = max|w| / 16 per block; codes and 5th bits pseudo-random.
            let bits = values(w.len() as u64 ^ 0x55, w.len() / 32 * 22, 1.0);
            let mut out = Vec::with_capacity(w.len() / 32 * 22);
            for (wb, r) in w.chunks_exact(32).zip(bits.chunks_exact(22)) {
                let amax = wb.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-3);
                out.extend(half::f16::from_f32(amax / 16.0).to_bits().to_le_bytes());
                out.extend(r[2..].iter().map(|v| (v.to_bits() >> 7) as u8));
            }
            out
        }
    }
}

/// Deterministic pseudo-random values in [-scale, scale) (xorshift), with a per-row offset so
/// that Q4_1's min matters.
fn values(seed: u64, len: usize, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 40) as f32 / (1u64 << 24) as f32;
            (2.0 * u - 1.0) * scale + if (i / 97) % 3 == 0 { 0.3 * scale } else { 0.0 }
        })
        .collect()
}

/// Checks `W.matmul(x)` against the f64 product of the dequantized weights, with the bound
/// `|y − ref| ≤ 1e-5 · Σ|w x| + 1e-6` per element (f32 accumulation error). With `gemm`, checks
/// `matmul_dequant_gemm` instead.
fn check_with(ty: BlockType, rows: usize, cols: usize, n: usize, seed: u64, isa: Isa, gemm: bool) -> Result<(), TestCaseError> {
    let w = values(seed, rows * cols, 0.5);
    let x = values(seed ^ 0xABCD, n * cols, 2.0);
    let packed = quantize(ty, &w);
    let wd = ggml::dequantize(ggml_type(ty), &packed, rows * cols).expect("dequantize");
    let m = PackedMatrix::new(ty, rows, cols, packed).expect("packed");
    let mut y = vec![f32::NAN; n * rows];
    if gemm {
        m.matmul_dequant_gemm(&x, n, &mut y).expect("matmul");
    } else {
        m.matmul_with(&x, n, &mut y, isa).expect("matmul");
        // Batch invariance: each token alone gives bit-identical outputs.
        let t = n / 2;
        let mut y1 = vec![f32::NAN; rows];
        m.matmul_with(&x[t * cols..(t + 1) * cols], 1, &mut y1, isa).expect("matmul");
        prop_assert_eq!(&y1[..], &y[t * rows..(t + 1) * rows], "token {} alone differs", t);
    }
    for t in 0..n {
        for r in 0..rows {
            let (mut exact, mut mag) = (0.0f64, 0.0f64);
            for c in 0..cols {
                let p = wd[r * cols + c] as f64 * x[t * cols + c] as f64;
                exact += p;
                mag += p.abs();
            }
            let got = y[t * rows + r] as f64;
            let tol = 1e-5 * mag + 1e-6;
            prop_assert!(
                (got - exact).abs() <= tol,
                "{ty:?} {isa:?} rows={rows} cols={cols} n={n} at ({t},{r}): got {got}, want {exact} (tol {tol})"
            );
        }
    }
    Ok(())
}

fn check(ty: BlockType, rows: usize, cols: usize, n: usize, seed: u64, isa: Isa) -> Result<(), TestCaseError> {
    check_with(ty, rows, cols, n, seed, isa, false)
}

/// A row length of `blocks` 32-blocks, or 1..=3 super-blocks of 256 for Q4_K and Q6_K.
fn cols_for(ty: BlockType, blocks: usize) -> usize {
    if ty.block_len() == 256 { (blocks % 3 + 1) * 256 } else { blocks * 32 }
}

fn block_type() -> impl Strategy<Value = BlockType> {
    prop_oneof![Just(BlockType::Q4_0), Just(BlockType::Q4_1), Just(BlockType::Q8_0), Just(BlockType::Q4_K), Just(BlockType::Q5_0), Just(BlockType::Q6_K)]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// Ragged/odd shapes: rows 1..=75 (not multiples of the task chunk or the GEMM tile), 1..=12
    /// blocks per row, token counts on both sides of the GEMM threshold.
    #[test]
    fn matmul_matches_reference(
        ty in block_type(),
        rows in 1usize..=75,
        blocks in 1usize..=12,
        n in prop_oneof![1usize..=17, 60usize..=70],
        seed in any::<u64>(),
    ) {
        let cols = cols_for(ty, blocks);
        check(ty, rows, cols, n, seed, Isa::Scalar)?;
        for isa in [Isa::Avx2, Isa::Avx512] {
            if isa.is_available() {
                check(ty, rows, cols, n, seed, isa)?;
            }
        }
        check_with(ty, rows, cols, n, seed, Isa::detect(), true)?;
    }
}

#[test]
fn model_shapes_match_reference() {
    // SmolLM2-135M's projections (fused QKV, o, fused gate/up, down) for decode and prefill.
    for ty in [BlockType::Q4_0, BlockType::Q4_1, BlockType::Q8_0] {
        for (rows, cols) in [(960, 576), (576, 576), (3072, 576), (576, 1536)] {
            for n in [1, 2, 37] {
                check(ty, rows, cols, n, (rows * 31 + cols + n) as u64, Isa::detect()).expect("within tolerance");
            }
        }
    }
}

#[test]
fn dequantize_is_bit_identical_to_ggml() {
    for ty in [BlockType::Q4_0, BlockType::Q4_1, BlockType::Q8_0, BlockType::Q4_K, BlockType::Q5_0, BlockType::Q6_K] {
        let (rows, cols) = (7, if ty.block_len() == 256 { 512 } else { 96 });
        let packed = quantize(ty, &values(5, rows * cols, 1.0));
        let want = ggml::dequantize(ggml_type(ty), &packed, rows * cols).expect("dequantize");
        let m = PackedMatrix::new(ty, rows, cols, packed).expect("packed");
        assert_eq!(m.dequantize(), want);
        let mut two = vec![0.0; 2 * cols];
        m.dequantize_rows(3, &mut two).expect("rows");
        assert_eq!(two, want[3 * cols..5 * cols]);
        assert!(m.dequantize_rows(6, &mut two).is_err());
    }
}

#[test]
fn permute_and_concat_rows() {
    let ty = BlockType::Q4_1;
    let a = PackedMatrix::new(ty, 3, 64, quantize(ty, &values(1, 3 * 64, 1.0))).expect("a");
    let b = PackedMatrix::new(ty, 2, 64, quantize(ty, &values(2, 2 * 64, 1.0))).expect("b");
    let ab = PackedMatrix::concat_rows(&[&a, &b]).expect("concat");
    assert_eq!(ab.rows(), 5);
    let (da, db, dab) = (a.dequantize(), b.dequantize(), ab.dequantize());
    assert_eq!(dab[..3 * 64], da[..]);
    assert_eq!(dab[3 * 64..], db[..]);
    let p = ab.permute_rows(&[4, 0]).expect("permute");
    assert_eq!(p.dequantize(), [&dab[4 * 64..5 * 64], &dab[..64]].concat());
    assert!(ab.permute_rows(&[5]).is_err());
    let c = PackedMatrix::new(BlockType::Q8_0, 1, 64, quantize(BlockType::Q8_0, &values(3, 64, 1.0))).expect("c");
    assert!(PackedMatrix::concat_rows(&[&a, &c]).is_err());
    assert!(PackedMatrix::concat_rows(&[]).is_err());
}

#[test]
fn bad_inputs_are_errors() {
    assert!(PackedMatrix::new(BlockType::Q8_0, 2, 33, vec![0; 68]).is_err());
    assert!(PackedMatrix::new(BlockType::Q8_0, 2, 32, vec![0; 67]).is_err());
    let m = PackedMatrix::new(BlockType::Q8_0, 2, 32, vec![0; 68]).expect("ok");
    let mut y = vec![0.0; 2];
    assert!(m.matmul(&[0.0; 31], 1, &mut y).is_err());
    assert!(m.matmul(&[0.0; 32], 1, &mut y[..1]).is_err());
    assert!(m.matmul(&[0.0; 32], 1, &mut y).is_ok());
}

/// The instruction sets `matmul_q8_with` runs on here: the portable kernel everywhere, and
/// the x86 ones this CPU has.
fn q8_isas() -> Vec<Isa> {
    let mut v = vec![Isa::Scalar];
    let mut y = [0.0f32; 1];
    let m = PackedMatrix::new(BlockType::Q8_0, 1, 32, vec![0; 34]).expect("ok");
    for isa in [Isa::Avx2, Isa::Avx512] {
        if m.matmul_q8_with(&[0.0; 32], 1, &mut y, isa).is_ok() {
            v.push(isa);
        }
    }
    v
}

/// `matmul_q8` against two f64 references: (a) the dequantized weights times the *dequantized*
/// 8-bit activations (`q · d`), tight bound `1e-5 · Σ|w·x̂| + 1e-6` (checks the integer
/// arithmetic, offsets and scales); (b) the exact activations, bound `Σ_b (d_b / 2) · Σ_{i∈b}
/// |w_i|` from the activation rounding plus the f32 term. Also batch invariance.
fn check_q8(ty: BlockType, rows: usize, cols: usize, n: usize, seed: u64, isa: Isa) -> Result<(), TestCaseError> {
    let w = values(seed, rows * cols, 0.5);
    let x = values(seed ^ 0xABCD, n * cols, 2.0);
    let packed = quantize(ty, &w);
    let wd = ggml::dequantize(ggml_type(ty), &packed, rows * cols).expect("dequantize");
    let m = PackedMatrix::new(ty, rows, cols, packed).expect("packed");
    let qa = QuantizedActivations::quantize(&x, n, cols).expect("quantize x");
    let mut y = vec![f32::NAN; n * rows];
    m.matmul_q8_with(&x, n, &mut y, isa).expect("matmul_q8");
    let t = n / 2;
    let mut y1 = vec![f32::NAN; rows];
    m.matmul_q8_with(&x[t * cols..(t + 1) * cols], 1, &mut y1, isa).expect("matmul_q8");
    prop_assert_eq!(&y1[..], &y[t * rows..(t + 1) * rows], "token {} alone differs", t);
    // The interleaved layout of the k-quant kernels (`interleave8`; other types unchanged):
    // the same bits, every path (tiled, repacked, leftover rows), and the same GGUF rows back.
    let mi = m.clone().interleave8();
    prop_assert_eq!(mi.is_interleaved(), matches!(ty, BlockType::Q4_K | BlockType::Q6_K) && q8_isa() != Isa::Scalar);
    prop_assert_eq!(&mi.gguf_bytes()[..], m.as_bytes());
    let mut yi = vec![f32::NAN; n * rows];
    mi.matmul_q8_with(&x, n, &mut yi, isa).expect("matmul_q8 interleaved");
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    prop_assert_eq!(bits(&y), bits(&yi), "{:?} rows={}: interleaved rows differ", ty, rows);
    if rows >= 8 {
        let mut r1 = vec![f32::NAN; cols];
        mi.dequantize_rows(rows / 2, &mut r1).expect("dequantize_rows");
        prop_assert_eq!(&r1[..], &wd[rows / 2 * cols..(rows / 2 + 1) * cols]);
    }
    // The AVX2 integer kernels compute the same integer block sums and the same float
    // operations as the VNNI ones: the same bits, for every block type.
    if isa == Isa::Avx2 && q8_isas().contains(&Isa::Avx512) {
        let mut yv = vec![f32::NAN; n * rows];
        m.matmul_q8_with(&x, n, &mut yv, Isa::Avx512).expect("matmul_q8 vnni");
        prop_assert_eq!(bits(&y), bits(&yv), "{:?}: AVX2 and VNNI kernels differ", ty);
    }
    // The portable kernel (ARM, CPUs without AVX2) follows the x86 kernels' float operations
    // on the same exact integer sums: the same bits as the AVX2 kernels, every block type.
    if isa == Isa::Scalar && q8_isas().contains(&Isa::Avx2) {
        let mut yx = vec![f32::NAN; n * rows];
        m.matmul_q8_with(&x, n, &mut yx, Isa::Avx2).expect("matmul_q8 avx2");
        prop_assert_eq!(bits(&y), bits(&yx), "{:?} rows={} n={}: portable and AVX2 kernels differ", ty, rows, n);
    }
    for t in 0..n {
        for r in 0..rows {
            let (mut deq, mut deq_mag, mut exact, mut bound) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
            for c in 0..cols {
                let wv = wd[r * cols + c] as f64;
                let b = t * (cols / 32) + c / 32;
                let xh = qa.codes[t * cols + c] as f64 * qa.scales[b] as f64;
                deq += wv * xh;
                deq_mag += (wv * xh).abs();
                exact += wv * x[t * cols + c] as f64;
                bound += wv.abs() * qa.scales[b] as f64 / 2.0;
            }
            let got = y[t * rows + r] as f64;
            let tol = 1e-5 * deq_mag + 1e-6;
            prop_assert!((got - deq).abs() <= tol, "{ty:?} rows={rows} cols={cols} n={n} at ({t},{r}): got {got}, want {deq} (tol {tol})");
            prop_assert!((got - exact).abs() <= bound + tol, "{ty:?} at ({t},{r}): got {got}, exact {exact}, bound {bound}");
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn matmul_q8_matches_reference(
        ty in block_type(),
        rows in 1usize..=75,
        blocks in 1usize..=12,
        n in prop_oneof![1usize..=9, 60usize..=66],
        seed in any::<u64>(),
    ) {
        for isa in q8_isas() {
            check_q8(ty, rows, cols_for(ty, blocks), n, seed, isa)?;
        }
    }

    /// Codes in −127..=127, `|x − q·d| ≤ d/2` (plus the f32 rounding of `x · (1/d)`), the scaled
    /// sums, and `max|x|` mapping to ±127.
    #[test]
    fn activation_quantization_round_trip(blocks in 1usize..=8, n in 1usize..=3, seed in any::<u64>()) {
        let cols = blocks * 32;
        let mut x = values(seed, n * cols, 3.0);
        x[0] = 0.0;
        if n * cols >= 64 {
            x[32..64].fill(0.0); // an all-zero block
        }
        let qa = QuantizedActivations::quantize(&x, n, cols).expect("quantize");
        for (b, xb) in x.chunks_exact(32).enumerate() {
            let d = qa.scales[b];
            let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            prop_assert!((d - amax / 127.0).abs() <= 1e-7 * amax);
            let mut sum = 0i32;
            for (i, v) in xb.iter().enumerate() {
                let q = qa.codes[b * 32 + i];
                prop_assert!((-127..=127).contains(&q));
                // ggml's rule (quantize_row_q8_0): q = round(v * (1/d)). The reciprocal and the
                // product are each rounded to f32 (relative error <= EPSILON/2 each), so v * id can
                // sit up to |v/d| * EPSILON <= 127 * EPSILON code units from v/d and round to the
                // other neighbour: |v - q d| <= d/2 + 127 d EPSILON (seen: 0.50001 d).
                let bound = d / 2.0 + 127.0 * d * f32::EPSILON;
                prop_assert!((v - q as f32 * d).abs() <= bound * (1.0 + 1e-6), "block {b} value {v} code {q} d {d}");
                sum += i32::from(q);
            }
            prop_assert_eq!(qa.sums[b], d * sum as f32);
            prop_assert_eq!(qa.isums[b], sum);
            let lo: i32 = qa.codes[b * 32..b * 32 + 16].iter().map(|&q| i32::from(q)).sum();
            prop_assert_eq!(qa.isums_lo[b], lo);
            if amax > 0.0 {
                prop_assert!(qa.codes[b * 32..(b + 1) * 32].iter().any(|q| q.unsigned_abs() == 127));
            }
        }
    }
}

/// Long rows with a prompt's worth of tokens: the repacked prefill path (`matmul_repacked_q8`)
/// runs its spans of 64 blocks (80 here, so a span of 64 then one of 16, the running sums
/// carried in `y`), groups of 8 rows plus leftover rows, and token passes of 8 / 4 / 2 / 1
/// (from 32 tokens with VNNI, 8 with AVX2);
/// `check_q8` compares it with the f64 references, with the token alone (the per-token-group
/// kernel) bit for bit, and AVX2 with VNNI bit for bit.
#[test]
fn q8_long_rows_match_reference() {
    for ty in [BlockType::Q4_0, BlockType::Q4_1, BlockType::Q8_0, BlockType::Q4_K, BlockType::Q5_0, BlockType::Q6_K] {
        for isa in q8_isas() {
            for (rows, n, seed) in [(20, 13, 3u64), (8, 37, 4), (3, 33, 5)] {
                check_q8(ty, rows, 80 * 32, n, seed, isa).unwrap_or_else(|e| panic!("{ty:?} {isa:?} rows={rows} n={n}: {e}"));
            }
        }
    }
}

/// An interleaved matrix (`interleave8`) behaves as its GGUF rows everywhere else: row
/// permutation and concatenation, whole dequantization, the f32-activation products, and the
/// layout chosen from the activation precision.
#[test]
fn interleaved_rows_read_as_gguf_rows() {
    for ty in [BlockType::Q4_K, BlockType::Q6_K] {
        let (rows, cols, n) = (19usize, 512usize, 3usize);
        let m = PackedMatrix::new(ty, rows, cols, quantize(ty, &values(11, rows * cols, 0.5))).expect("packed");
        let mi = m.clone().interleave8();
        let x86_q8 = q8_isa() != Isa::Scalar;
        assert_eq!(mi.is_interleaved(), x86_q8, "{ty:?}");
        assert_eq!(mi.as_bytes().len(), m.as_bytes().len(), "{ty:?}: a permutation keeps the size");
        if x86_q8 {
            assert_ne!(mi.as_bytes(), m.as_bytes(), "{ty:?}: interleaving moved no byte");
        }
        assert_eq!(mi.dequantize(), m.dequantize(), "{ty:?}");
        let perm: Vec<usize> = (0..rows).rev().collect();
        assert_eq!(mi.permute_rows(&perm).expect("perm"), m.permute_rows(&perm).expect("perm"), "{ty:?}");
        assert_eq!(PackedMatrix::concat_rows(&[&mi, &m]).expect("cat"), PackedMatrix::concat_rows(&[&m, &m]).expect("cat"), "{ty:?}");
        let x = values(12, n * cols, 1.0);
        for isa in [Isa::Scalar, Isa::Avx2, Isa::Avx512] {
            let (mut a, mut b) = (vec![0.0f32; n * rows], vec![0.0f32; n * rows]);
            m.matmul_with(&x, n, &mut a, isa).expect("matmul");
            mi.matmul_with(&x, n, &mut b, isa).expect("matmul");
            assert_eq!(a, b, "{ty:?} {isa:?}");
        }
        let (mut a, mut b) = (vec![0.0f32; n * rows], vec![0.0f32; n * rows]);
        m.matmul_dequant_gemm(&x, n, &mut a).expect("gemm");
        mi.matmul_dequant_gemm(&x, n, &mut b).expect("gemm");
        assert_eq!(a, b, "{ty:?} gemm");
        // f32 activations (the default precision of this test process): GGUF rows kept.
        assert!(!m.clone().for_activation_precision().is_interleaved());
    }
}

#[test]
fn q8_bad_inputs_are_errors() {
    assert!(QuantizedActivations::quantize(&[0.0; 40], 1, 40).is_err());
    assert!(QuantizedActivations::quantize(&[0.0; 64], 1, 32).is_err());
    let ty = BlockType::Q4_1;
    let m = PackedMatrix::new(ty, 2, 64, quantize(ty, &values(1, 2 * 64, 1.0))).expect("m");
    let mut y = vec![0.0; 2];
    assert!(m.matmul_q8(&[0.0; 63], 1, &mut y).is_err());
    assert!(m.matmul_q8(&[0.0; 64], 1, &mut y[..1]).is_err());
    // An instruction set this CPU lacks is refused, not silently replaced: the x86 kernels
    // off x86-64, AVX-512 on a CPU without it.
    let lacks = |isa: Isa| !cfg!(target_arch = "x86_64") || !isa.is_available();
    for isa in [Isa::Avx2, Isa::Avx512] {
        if lacks(isa) {
            assert!(m.matmul_q8_with(&[0.0; 64], 1, &mut y, isa).is_err(), "{isa:?}");
        }
    }
}

/// Raw Q8_0 / Q4_0 blocks with the extreme codes (−128, which ggml's quantizer never emits, and
/// nibbles 0 / 15) through every available kernel, f32 and 8-bit activations.
#[test]
fn extreme_codes_match_reference() {
    let (rows, cols, n) = (5usize, 64usize, 3usize);
    for ty in [BlockType::Q8_0, BlockType::Q4_0, BlockType::Q4_1, BlockType::Q5_0] {
        let bb = ty.block_bytes();
        let mut data = vec![0u8; rows * cols / 32 * bb];
        for (i, blk) in data.chunks_exact_mut(bb).enumerate() {
            blk[0..2].copy_from_slice(&0x3C00u16.to_le_bytes()); // d = 1
            let q0 = if ty == BlockType::Q4_1 {
                blk[2..4].copy_from_slice(&0xB800u16.to_le_bytes()); // m = -0.5
                4
            } else {
                2
            };
            for (j, q) in blk[q0..].iter_mut().enumerate() {
                *q = match (ty, (i + j) % 3) {
                    (BlockType::Q8_0, 0) => 0x80, // -128
                    (BlockType::Q8_0, 1) => 0x7F,
                    (_, 0) => 0xF0,
                    (_, 1) => 0x0F,
                    _ => (i * 7 + j) as u8,
                };
            }
        }
        let wd = ggml::dequantize(ggml_type(ty), &data, rows * cols).expect("dequantize");
        let m = PackedMatrix::new(ty, rows, cols, data).expect("packed");
        let x = values(9, n * cols, 1.5);
        let qa = QuantizedActivations::quantize(&x, n, cols).expect("quantize");
        let reference = |xs: &dyn Fn(usize, usize) -> f64| -> Vec<f64> {
            (0..n).flat_map(|t| (0..rows).map(move |r| (t, r))).map(|(t, r)| (0..cols).map(|c| wd[r * cols + c] as f64 * xs(t, c)).sum()).collect()
        };
        let exact = reference(&|t, c| x[t * cols + c] as f64);
        for isa in [Isa::Scalar, Isa::Avx2, Isa::Avx512] {
            if !isa.is_available() {
                continue;
            }
            let mut y = vec![f32::NAN; n * rows];
            m.matmul_with(&x, n, &mut y, isa).expect("matmul");
            for (g, e) in y.iter().zip(&exact) {
                assert!((*g as f64 - e).abs() <= 1e-4 * (1.0 + e.abs()), "{ty:?} {isa:?}: {g} vs {e}");
            }
        }
        for isa in q8_isas() {
            let deq = reference(&|t, c| qa.codes[t * cols + c] as f64 * qa.scales[t * (cols / 32) + c / 32] as f64);
            let mut y = vec![f32::NAN; n * rows];
            m.matmul_q8_with(&x, n, &mut y, isa).expect("matmul_q8");
            for (g, e) in y.iter().zip(&deq) {
                assert!((*g as f64 - e).abs() <= 1e-4 * (1.0 + e.abs()), "{ty:?} q8 {isa:?}: {g} vs {e}");
            }
            // A non-finite activation reaches the outputs of its token, as in the f32 path.
            let mut xn = x.clone();
            xn[cols + 3] = f32::NAN;
            m.matmul_q8_with(&xn, n, &mut y, isa).expect("matmul_q8");
            assert!(y[rows..2 * rows].iter().all(|v| v.is_nan()));
            assert!(y[..rows].iter().chain(&y[2 * rows..]).all(|v| v.is_finite()));
        }
    }
}

/// A long input (quantized in parallel pieces) gives the same codes and scales as each token
/// quantized alone.
#[test]
fn long_activation_quantization_equals_per_token() {
    let (n, cols) = (150, 576);
    let mut x = values(99, n * cols, 3.0);
    x[70_000] = f32::INFINITY; // a non-finite block inside the second piece
    let all = QuantizedActivations::quantize(&x, n, cols).expect("quantize");
    let nb = cols / 32;
    for t in 0..n {
        let one = QuantizedActivations::quantize(&x[t * cols..(t + 1) * cols], 1, cols).expect("quantize");
        assert_eq!(&all.codes[t * cols..(t + 1) * cols], &one.codes[..], "token {t} codes");
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&all.scales[t * nb..(t + 1) * nb]), bits(&one.scales), "token {t} scales");
        assert_eq!(bits(&all.sums[t * nb..(t + 1) * nb]), bits(&one.sums), "token {t} sums");
        assert_eq!(&all.isums[t * nb..(t + 1) * nb], &one.isums[..], "token {t} integer sums");
        assert_eq!(&all.isums_lo[t * nb..(t + 1) * nb], &one.isums_lo[..], "token {t} first-half integer sums");
    }
    assert!(all.scales[70_000 / 32].is_nan());
}
