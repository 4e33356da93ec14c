//! GGML dequantization and quantization against independent reference vectors.
//!
//! The vectors in `tests/data/dequant/` were written by `gen.py` there with llama.cpp's gguf-py
//! (`gguf.quants.dequantize` / `quantize`, numpy re-implementations of ggml-quants.c); F64 and
//! Q8_K, which gguf-py cannot dequantize, have a plain numpy reference. Both sides perform the
//! same f32 operations in the same order, so values are compared **exactly** (bit for bit, 0 ulp).
//! The real-model test reads the SmolLM2 GGUF from the fetch cache or the mirror
//! (`common::asset`).

mod common;

use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;

use deco_formats::ggml::{self, GgmlError, GgmlType};

fn data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/dequant")
}

fn read(name: &str) -> Vec<u8> {
    let p = data_dir().join(name);
    std::fs::read(&p).unwrap_or_else(|e| panic!("cannot read reference file {}: {e}", p.display()))
}

fn read_f32(name: &str) -> Vec<f32> {
    let b = read(name);
    assert_eq!(b.len() % 4, 0, "{name}: length not a multiple of 4");
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn manifest() -> serde_json::Value {
    serde_json::from_slice(&read("model.json")).expect("model.json is valid JSON")
}

/// Asserts bitwise equality, reporting the first differing index.
fn assert_bits_eq(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!("{what}: element {i}: got {:e} ({:#010x}), expected {:e} ({:#010x})", got[i], got[i].to_bits(), want[i], want[i].to_bits());
    }
}

const DEQUANT_TYPES: [GgmlType; 15] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::F64,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::Q8_K,
];

#[test]
fn dequantize_matches_gguf_py_for_every_supported_type() {
    for ty in DEQUANT_TYPES {
        assert!(ty.can_dequantize(), "{ty}");
        let data = read(&format!("{ty}.bin"));
        let want = read_f32(&format!("{ty}.f32"));
        assert!(want.len() >= 128, "{ty}: reference too small");
        let got = ggml::dequantize(ty, &data, want.len()).unwrap_or_else(|e| panic!("{ty}: {e}"));
        assert_bits_eq(ty.name(), &got, &want);

        // the into-slice variant agrees
        let mut out = vec![f32::NAN; want.len()];
        ggml::dequantize_into(ty, &data, &mut out).unwrap_or_else(|e| panic!("{ty}: {e}"));
        assert_bits_eq(&format!("{ty} (into)"), &out, &want);

        // blocks are independent: dequantizing a prefix of whole blocks gives the prefix
        let n = want.len() / 2 / ty.block_size() * ty.block_size();
        let nb = ty.bytes_for(n).expect("whole blocks");
        let part = ggml::dequantize(ty, &data[..nb], n).unwrap_or_else(|e| panic!("{ty}: {e}"));
        assert_bits_eq(&format!("{ty} (prefix)"), &part, &want[..n]);
    }
}

#[test]
fn reference_vectors_exercise_nonzero_values() {
    // guards against a degenerate generator (e.g. all-zero scales) that would make the
    // comparison above trivially pass
    for ty in DEQUANT_TYPES {
        let want = read_f32(&format!("{ty}.f32"));
        let nonzero = want.iter().filter(|v| **v != 0.0).count();
        assert!(nonzero * 2 > want.len(), "{ty}: only {nonzero} of {} reference values are nonzero", want.len());
        let distinct: std::collections::BTreeSet<u32> = want.iter().map(|v| v.to_bits()).collect();
        assert!(distinct.len() > 16, "{ty}: only {} distinct values", distinct.len());
    }
}

#[test]
fn large_inputs_use_the_parallel_path_and_agree() {
    // > 2^18 elements so that dequantize splits over threads; blocks repeat the reference data
    for ty in [GgmlType::Q4_K, GgmlType::Q8_0, GgmlType::F16, GgmlType::Q6_K] {
        let data = read(&format!("{ty}.bin"));
        let want = read_f32(&format!("{ty}.f32"));
        let reps = (1 << 19) / want.len() + 1;
        let big_data: Vec<u8> = data.iter().copied().cycle().take(data.len() * reps).collect();
        let big_want: Vec<f32> = want.iter().copied().cycle().take(want.len() * reps).collect();
        let got = ggml::dequantize(ty, &big_data, big_want.len()).unwrap_or_else(|e| panic!("{ty}: {e}"));
        assert_bits_eq(&format!("{ty} x{reps}"), &got, &big_want);
    }
}

#[test]
fn f16_lengths_that_are_not_a_multiple_of_the_chunk() {
    let data = read("F16.bin");
    let want = read_f32("F16.f32");
    for n in [0, 1, 7, 255, 256, 257, 300, 511] {
        let got = ggml::dequantize(GgmlType::F16, &data[..2 * n], n).expect("valid F16");
        assert_bits_eq(&format!("F16 n={n}"), &got, &want[..n]);
    }
}

#[test]
fn hand_computed_blocks() {
    // Q8_0: d = 0.5 (f16 0x3800), q = -128, -1, 0, 1, 127, then zeros
    let mut b = vec![0x00, 0x38];
    let mut q = [0u8; 32];
    for (i, v) in [-128i8, -1, 0, 1, 127].iter().enumerate() {
        q[i] = *v as u8;
    }
    b.extend_from_slice(&q);
    let y = ggml::dequantize(GgmlType::Q8_0, &b, 32).expect("valid block");
    assert_eq!(&y[..5], &[-64.0, -0.5, 0.0, 0.5, 63.5]);

    // Q4_0: d = 2 (0x4000); byte 0x1F: low nibble 15 -> (15-8)*2 = 14 at 0, high 1 -> -14 at 16
    let mut b = vec![0x00, 0x40, 0x1F];
    b.extend_from_slice(&[0x88; 15]);
    let y = ggml::dequantize(GgmlType::Q4_0, &b, 32).expect("valid block");
    assert_eq!((y[0], y[16], y[1], y[17]), (14.0, -14.0, 0.0, 0.0));

    // Q4_1: d = 1 (0x3C00), m = -3 (0xC200); byte 0x52 -> 2 - 3 = -1 at 0, 5 - 3 = 2 at 16
    let mut b = vec![0x00, 0x3C, 0x00, 0xC2, 0x52];
    b.extend_from_slice(&[0; 15]);
    let y = ggml::dequantize(GgmlType::Q4_1, &b, 32).expect("valid block");
    assert_eq!((y[0], y[16], y[1], y[17]), (-1.0, 2.0, -3.0, -3.0));

    // Q5_0: d = 1; qh bit 0 set (element 0 gets +16) and bit 16 set (element 16); qs = 0
    // -> element 0: (0|16) - 16 = 0, element 16: 0, element 1: -16
    let mut b = vec![0x00, 0x3C, 0x01, 0x00, 0x01, 0x00];
    b.extend_from_slice(&[0; 16]);
    let y = ggml::dequantize(GgmlType::Q5_0, &b, 32).expect("valid block");
    assert_eq!((y[0], y[16], y[1], y[17]), (0.0, 0.0, -16.0, -16.0));

    // BF16 0x3F80 = 1.0, 0xC040 = -3.0
    let y = ggml::dequantize(GgmlType::BF16, &[0x80, 0x3F, 0x40, 0xC0], 2).expect("valid");
    assert_eq!(y, [1.0, -3.0]);
}

#[test]
fn quantizers_match_gguf_py_bit_for_bit() {
    type Quantizer = fn(&[f32]) -> ggml::Result<Vec<u8>>;
    let cases: [(GgmlType, Quantizer); 3] = [
        (GgmlType::Q8_0, ggml::quantize_q8_0),
        (GgmlType::Q4_0, ggml::quantize_q4_0),
        (GgmlType::Q4_1, ggml::quantize_q4_1),
    ];
    for (ty, quantize) in cases {
        let x = read_f32(&format!("quant_{ty}.in.f32"));
        let want = read(&format!("quant_{ty}.bytes"));
        let got = quantize(&x).unwrap_or_else(|e| panic!("{ty}: {e}"));
        assert_eq!(got.len(), ty.bytes_for(x.len()).expect("whole blocks"), "{ty}: length");
        if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
            let ts = ty.type_size();
            panic!("{ty}: byte {i} (block {}, offset {}): got {:#04x}, expected {:#04x}", i / ts, i % ts, got[i], want[i]);
        }

        // round trip: every value is reproduced within half a quantization step (+ f16 scale
        // rounding), using our dequantizer
        let y = ggml::dequantize(ty, &got, x.len()).expect("valid blocks");
        for (bi, (xb, yb)) in x.chunks(32).zip(y.chunks(32)).enumerate() {
            let (lo, hi) = xb.iter().fold((f32::MAX, f32::MIN), |(l, h), &v| (l.min(v), h.max(v)));
            let amax = lo.abs().max(hi.abs());
            let step = match ty {
                GgmlType::Q8_0 => amax / 127.0,
                GgmlType::Q4_0 => amax / 8.0,
                _ => (hi - lo) / 15.0,
            };
            let tol = 0.5 * step + 2e-3 * amax + 1e-30;
            for (j, (a, b)) in xb.iter().zip(yb).enumerate() {
                // Q4_0 cannot represent +8 steps: the extreme of the opposite sign clips
                let tol = if ty == GgmlType::Q4_0 { tol + step } else { tol };
                assert!((a - b).abs() <= tol, "{ty} block {bi} elem {j}: {a} -> {b} (tol {tol})");
            }
        }
    }
}

#[test]
fn quantizers_reject_partial_blocks() {
    let x = vec![1.0f32; 33];
    for (name, r) in [
        ("Q8_0", ggml::quantize_q8_0(&x)),
        ("Q4_0", ggml::quantize_q4_0(&x)),
        ("Q4_1", ggml::quantize_q4_1(&x)),
    ] {
        let e = r.expect_err("33 values are not whole blocks");
        assert!(matches!(e, GgmlError::NotBlockMultiple { n_elements: 33, block_size: 32, .. }), "{e:?}");
        assert_eq!(e.to_string(), format!("33 elements is not a multiple of the {name} block size 32"));
    }
    assert_eq!(ggml::quantize_q8_0(&[]).expect("empty is fine"), Vec::<u8>::new());
}

#[test]
fn type_table_matches_gguf_py() {
    let m = manifest();
    let types = m["types"].as_array().expect("types array");
    assert_eq!(types.len(), GgmlType::ALL.len(), "number of types");
    for t in types {
        let name = t[0].as_str().expect("name");
        let id = t[1].as_u64().expect("id") as u32;
        let bs = t[2].as_u64().expect("block size") as usize;
        let ts = t[3].as_u64().expect("type size") as usize;
        let ty = GgmlType::try_from(id).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(ty.name(), name);
        assert_eq!(ty.id(), id);
        assert_eq!(ty as u32, id);
        assert_eq!(ty.block_size(), bs, "{name} block size");
        if ty == GgmlType::Q8_1 {
            // gguf-py still lists the old {f32 d; f32 s; i8 qs[32]} = 40 bytes; ggml-common.h has
            // {ggml_half2 ds; int8_t qs[32]} with static_assert size 2*2 + 32
            assert_eq!((ts, ty.type_size()), (40, 36));
        } else {
            assert_eq!(ty.type_size(), ts, "{name} type size");
        }
        assert_eq!(ty.to_string(), name);
        let plain = ["F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"].contains(&name);
        assert_eq!(ty.is_quantized(), !plain, "{name} is_quantized");
    }
}

#[test]
fn unknown_type_ids_are_rejected_by_id() {
    for id in [4u32, 5, 31, 32, 33, 36, 37, 38, 42, 1000, u32::MAX] {
        let e = GgmlType::try_from(id).expect_err("not a ggml type");
        assert_eq!(e, GgmlError::UnknownType(id));
        assert_eq!(e.to_string(), format!("unknown GGML tensor type id {id}"));
    }
}

#[test]
fn unsupported_types_name_the_type() {
    for ty in [
        GgmlType::IQ2_XXS,
        GgmlType::IQ4_NL,
        GgmlType::IQ4_XS,
        GgmlType::TQ2_0,
        GgmlType::I32,
        GgmlType::Q8_1,
        GgmlType::MXFP4,
    ] {
        assert!(!ty.can_dequantize());
        let n = ty.block_size();
        let data = vec![0u8; ty.type_size()];
        let e = ggml::dequantize(ty, &data, n).expect_err("unsupported");
        assert_eq!(e.to_string(), format!("unsupported tensor type {}", ty.name()));
        let mut out = vec![0.0; n];
        assert_eq!(ggml::dequantize_into(ty, &data, &mut out), Err(GgmlError::Unsupported(ty)));
    }
}

#[test]
fn wrong_lengths_state_expected_and_actual_bytes() {
    // Q4_K: 512 elements = 2 blocks = 288 bytes
    let data = vec![0u8; 287];
    let e = ggml::dequantize(GgmlType::Q4_K, &data, 512).expect_err("short data");
    assert_eq!(e, GgmlError::DataLength { ty: GgmlType::Q4_K, n_elements: 512, expected: 288, actual: 287 });
    assert_eq!(e.to_string(), "Q4_K data for 512 elements must be 288 bytes, got 287 bytes");
    assert!(ggml::dequantize(GgmlType::Q4_K, &[0u8; 289], 512).is_err(), "long data");

    // out slice of the wrong size is left untouched
    let mut out = vec![7.0f32; 64];
    let e = ggml::dequantize_into(GgmlType::Q8_0, &[0u8; 34], &mut out).expect_err("1 block for 2");
    assert!(matches!(e, GgmlError::DataLength { expected: 68, actual: 34, .. }), "{e:?}");
    assert!(out.iter().all(|v| *v == 7.0));

    // element count not a multiple of the block size
    let e = ggml::dequantize(GgmlType::Q6_K, &[0u8; 210], 100).expect_err("partial block");
    assert_eq!(e.to_string(), "100 elements is not a multiple of the Q6_K block size 256");
    assert!(matches!(GgmlType::Q4_0.bytes_for(31), Err(GgmlError::NotBlockMultiple { .. })));
    assert_eq!(GgmlType::Q4_0.bytes_for(64), Ok(36));
    assert_eq!(GgmlType::F32.bytes_for(3), Ok(12));
    assert!(matches!(GgmlType::F64.bytes_for(usize::MAX), Err(GgmlError::SizeOverflow { .. })));
}


#[test]
fn real_smollm2_tensors_match_gguf_py() {
    let m = manifest();
    let file = m["model_file"].as_str().expect("model_file");
    let path = common::asset(&format!("models/{file}"));
    let mut f = std::fs::File::open(&path).unwrap_or_else(|e| panic!("cannot open the model {}: {e}", path.display()));
    let size = f.metadata().expect("metadata").len();
    assert_eq!(size, m["model_size"].as_u64().expect("model_size"), "{}: unexpected size", path.display());

    let tensors = m["tensors"].as_object().expect("tensors");
    assert_eq!(tensors.len(), 2);
    for (name, t) in tensors {
        let ty_name = t["type"].as_str().expect("type");
        let ty = GgmlType::ALL.into_iter().find(|ty| ty.name() == ty_name).expect("known type");
        let n = t["n_elements"].as_u64().expect("n_elements") as usize;
        let n_bytes = t["n_bytes"].as_u64().expect("n_bytes") as usize;
        assert_eq!(ty.bytes_for(n), Ok(n_bytes), "{name}");
        let mut raw = vec![0u8; n_bytes];
        f.seek(SeekFrom::Start(t["offset"].as_u64().expect("offset"))).expect("seek");
        f.read_exact(&mut raw).expect("read tensor data");

        // first blocks: raw bytes and values
        let stem = t["stem"].as_str().expect("stem");
        let head = read(&format!("{stem}.bin"));
        assert_eq!(&raw[..head.len()], &head[..], "{name}: head bytes differ from the reference");
        let want_head = read_f32(&format!("{stem}.f32"));

        let t0 = std::time::Instant::now();
        let all = ggml::dequantize(ty, &raw, n).unwrap_or_else(|e| panic!("{name}: {e}"));
        eprintln!("{name}: {ty} {n} elements dequantized in {:?}", t0.elapsed());
        assert_bits_eq(&format!("{name} head"), &all[..want_head.len()], &want_head);

        // sampled positions across the whole tensor (exact) and whole-tensor statistics
        let idx = t["sample_index"].as_array().expect("sample_index");
        let val = t["sample_value"].as_array().expect("sample_value");
        for (i, v) in idx.iter().zip(val) {
            let i = i.as_u64().expect("index") as usize;
            let v = v.as_f64().expect("value") as f32;
            assert_eq!(all[i].to_bits(), v.to_bits(), "{name}[{i}]: got {}, expected {v}", all[i]);
        }
        let sum: f64 = all.iter().map(|&v| f64::from(v)).sum();
        let sum_sq: f64 = all.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        let max_abs = all.iter().fold(0.0f32, |a, &v| a.max(v.abs()));
        let (ws, wsq) = (t["sum"].as_f64().expect("sum"), t["sum_sq"].as_f64().expect("sum_sq"));
        // f64 sums in a different order: relative 1e-9 of the sum of |x|-scale (sqrt(n * sum_sq))
        let scale = (n as f64 * wsq).sqrt();
        assert!((sum - ws).abs() <= 1e-9 * scale, "{name}: sum {sum} vs {ws}");
        assert!((sum_sq - wsq).abs() <= 1e-9 * wsq, "{name}: sum_sq {sum_sq} vs {wsq}");
        assert_eq!(f64::from(max_abs), t["max_abs"].as_f64().expect("max_abs"), "{name}: max |x|");
    }
}
