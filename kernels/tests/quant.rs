//! Packed quantized matmul vs a plain reference: dequantize with `deco_formats::ggml` (ggml's
//! scalar `dequantize_row_*`), then multiply in f64.

use deco_formats::ggml::{self, GgmlType};
use deco_kernels::quant::{BlockType, Isa, PackedMatrix};
use proptest::prelude::*;

fn ggml_type(ty: BlockType) -> GgmlType {
    match ty {
        BlockType::Q4_0 => GgmlType::Q4_0,
        BlockType::Q4_1 => GgmlType::Q4_1,
        BlockType::Q8_0 => GgmlType::Q8_0,
    }
}

fn quantize(ty: BlockType, w: &[f32]) -> Vec<u8> {
    match ty {
        BlockType::Q4_0 => ggml::quantize_q4_0(w),
        BlockType::Q4_1 => ggml::quantize_q4_1(w),
        BlockType::Q8_0 => ggml::quantize_q8_0(w),
    }
    .expect("quantize")
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

fn block_type() -> impl Strategy<Value = BlockType> {
    prop_oneof![Just(BlockType::Q4_0), Just(BlockType::Q4_1), Just(BlockType::Q8_0)]
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
        check(ty, rows, blocks * 32, n, seed, Isa::Scalar)?;
        for isa in [Isa::Avx2, Isa::Avx512] {
            if isa.is_available() {
                check(ty, rows, blocks * 32, n, seed, isa)?;
            }
        }
        check_with(ty, rows, blocks * 32, n, seed, Isa::detect(), true)?;
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
    for ty in [BlockType::Q4_0, BlockType::Q4_1, BlockType::Q8_0] {
        let (rows, cols) = (7, 96);
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
