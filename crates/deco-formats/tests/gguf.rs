//! GGUF reader and writer: every metadata type, v2 and v3, alignment, corrupt files, and the real
//! SmolLM2 header checked against the model card in ../shared/README.md.

use deco_formats::Error;
use deco_formats::config::{Architecture, ModelConfig};
use deco_formats::ggml::{GgmlType, quantize_q8_0};
use deco_formats::gguf::{GgufFile, MetadataValue as V, TensorToWrite, write_gguf};

mod common;

fn all_types_metadata(alignment: u32) -> Vec<(String, V)> {
    vec![
        ("general.architecture".into(), V::String("llama".into())),
        ("general.alignment".into(), V::U32(alignment)),
        ("t.u8".into(), V::U8(250)),
        ("t.i8".into(), V::I8(-7)),
        ("t.u16".into(), V::U16(65_000)),
        ("t.i16".into(), V::I16(-32_000)),
        ("t.u32".into(), V::U32(4_000_000_000)),
        ("t.i32".into(), V::I32(-2_000_000_000)),
        ("t.f32".into(), V::F32(1.5e-5)),
        ("t.bool".into(), V::Bool(true)),
        ("t.string".into(), V::String("héllo ✓".into())),
        ("t.u64".into(), V::U64(u64::MAX - 1)),
        ("t.i64".into(), V::I64(i64::MIN + 1)),
        ("t.f64".into(), V::F64(-2.5e300)),
        ("t.array_str".into(), V::Array(vec![V::String("a".into()), V::String("".into())])),
        ("t.array_nested".into(), V::Array(vec![V::Array(vec![V::I32(1), V::I32(2)]), V::Array(vec![V::I32(3)])])),
        ("t.array_empty".into(), V::Array(vec![])),
    ]
}

#[test]
fn write_then_read_round_trips_every_type_and_tensor() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("all.gguf");
    let f32_data: Vec<f32> = (0..6).map(|i| i as f32 * 0.25 - 1.0).collect();
    let f32_bytes: Vec<u8> = f32_data.iter().flat_map(|x| x.to_le_bytes()).collect();
    let q_src: Vec<f32> = (0..64).map(|i| ((i * 37 % 64) as f32 - 32.0) / 8.0).collect();
    let q_bytes = quantize_q8_0(&q_src).expect("quantize");
    let meta = all_types_metadata(64);
    write_gguf(
        &path,
        &meta,
        &[
            TensorToWrite { name: "a".into(), shape: vec![2, 3], ggml_type: GgmlType::F32, data: &f32_bytes },
            TensorToWrite { name: "q".into(), shape: vec![2, 32], ggml_type: GgmlType::Q8_0, data: &q_bytes },
        ],
    )
    .expect("write");

    let g = GgufFile::open(&path).expect("read back");
    assert_eq!(g.version, 3);
    assert_eq!(g.alignment, 64);
    assert_eq!(g.data_offset % 64, 0);
    assert_eq!(g.metadata_order, meta.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>());
    for (k, v) in &meta {
        assert_eq!(g.get(k), Some(v), "{k}");
    }
    let a = g.tensor_info("a").expect("a");
    assert_eq!(a.dims, vec![3, 2], "GGUF dims are fastest-first");
    assert_eq!(a.shape(), vec![2, 3]);
    assert_eq!(g.dequantize("a").expect("a").1, f32_data);
    let q = g.tensor_info("q").expect("q");
    assert_eq!(q.offset % 64, 0);
    let (_, deq) = g.dequantize("q").expect("q");
    // Q8_0: error at most half a step, step d = max|x| / 127 per block of 32, plus the f16
    // rounding of d (relative 2^-11) times |q| <= 127.
    for (blk_src, blk_deq) in q_src.chunks(32).zip(deq.chunks(32)) {
        let step = blk_src.iter().fold(0.0f32, |m, x| m.max(x.abs())) / 127.0;
        for (x, y) in blk_src.iter().zip(blk_deq) {
            assert!((x - y).abs() <= step / 2.0 + 127.0 * step / 2048.0, "{x} vs {y}");
        }
    }
    assert!(g.describe().contains("t.string"));

    // Releasing a tensor's pages keeps its bytes readable and unchanged (they fault back in from
    // the file); unknown names are ignored.
    let before = g.tensor_bytes("q").expect("q").1.to_vec();
    g.release_tensor_pages("q");
    g.release_tensor_pages("a");
    g.release_tensor_pages("no such tensor");
    assert_eq!(g.tensor_bytes("q").expect("q").1, &before[..]);
    assert_eq!(g.dequantize("a").expect("a").1, f32_data);
}

#[test]
fn version_2_is_read_and_version_1_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("v.gguf");
    write_gguf(&path, &all_types_metadata(32), &[]).expect("write");
    let mut bytes = std::fs::read(&path).expect("read");
    // v2 and v3 share the layout (v3 only added big-endian files); patch the version field.
    bytes[4..8].copy_from_slice(&2u32.to_le_bytes());
    std::fs::write(&path, &bytes).expect("write v2");
    let g = GgufFile::open(&path).expect("v2");
    assert_eq!(g.version, 2);
    assert_eq!(g.get("t.f64"), Some(&V::F64(-2.5e300)));
    bytes[4..8].copy_from_slice(&1u32.to_le_bytes());
    std::fs::write(&path, &bytes).expect("write v1");
    assert!(matches!(GgufFile::open(&path), Err(Error::UnsupportedGgufVersion { version: 1, .. })));
}

#[test]
fn corrupt_headers_are_errors_not_panics() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("c.gguf");
    let data = [0u8; 64];
    write_gguf(
        &path,
        &[("general.architecture".into(), V::String("llama".into())), ("k".into(), V::Bool(false))],
        &[TensorToWrite { name: "t".into(), shape: vec![16], ggml_type: GgmlType::F32, data: &data }],
    )
    .expect("write");
    let good = std::fs::read(&path).expect("read");
    let check = |bytes: &[u8], what: &str| {
        std::fs::write(&path, bytes).expect("write");
        let err = GgufFile::open(&path).expect_err(what).to_string();
        assert!(err.contains("c.gguf"), "{what}: error does not name the file: {err}");
        err
    };
    // Every prefix of the file is truncated somewhere: header, metadata, tensor info or data.
    for cut in [0, 3, 7, 15, 23, 30, 60, good.len() - 1] {
        let err = check(&good[..cut], "prefix");
        assert!(err.contains("truncated") || err.contains("not a GGUF"), "cut {cut}: {err}");
    }
    // Bool byte 2.
    let key_k = [1, 0, 0, 0, 0, 0, 0, 0, b'k'];
    let pos = good.windows(9).position(|w| w == key_k).expect("key k") + 9 + 4;
    let mut b = good.clone();
    b[pos] = 2;
    assert!(check(&b, "bool").contains("bool byte 2"));
    // Unknown value type 13.
    let mut b = good.clone();
    b[pos - 4..pos].copy_from_slice(&13u32.to_le_bytes());
    assert!(check(&b, "value type").contains("unknown metadata value type 13"));
    // Absurd tensor count.
    let mut b = good.clone();
    b[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(check(&b, "count").contains("impossible count"));
}

#[test]
fn write_refuses_inconsistent_tensors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("bad.gguf");
    let data = [0u8; 10];
    let err = write_gguf(&path, &[], &[TensorToWrite { name: "t".into(), shape: vec![4], ggml_type: GgmlType::F32, data: &data }])
        .expect_err("length mismatch");
    assert!(err.to_string().contains("10 bytes given"), "{err}");
    assert!(!path.exists(), "no partial output");
    let err = write_gguf(&path, &[("m".into(), V::Array(vec![V::U8(1), V::I8(1)]))], &[]).expect_err("mixed array");
    assert!(err.to_string().contains("one type"), "{err}");
}

#[test]
fn smollm2_header_matches_model_card() {
    let path = common::smollm2_gguf();
    let g = GgufFile::open(&path).expect("open SmolLM2 (run `cargo xtask fetch`)");
    assert_eq!(g.file_size(), 98_362_432);
    assert_eq!(g.architecture().expect("arch"), "llama");
    assert_eq!(g.get_str("tokenizer.ggml.pre").expect("pre"), "smollm");
    // 30 layers x 9 tensors + token_embd + output_norm; tied embeddings (no output.weight).
    assert_eq!(g.tensors.len(), 272);
    assert!(g.tensor_info("output.weight").is_none());
    let ty = |n: &str| g.tensor_info(n).expect(n).ggml_type;
    assert_eq!(ty("token_embd.weight"), GgmlType::Q8_0);
    assert_eq!(ty("blk.7.ffn_down.weight"), GgmlType::Q4_1);
    assert_eq!(ty("blk.7.attn_norm.weight"), GgmlType::F32);
    assert!(g.get("tokenizer.chat_template").and_then(V::as_str).is_some_and(|t| t.contains("<|im_start|>")));

    let cfg = ModelConfig::from_gguf(&g).expect("config");
    assert_eq!(cfg.model_type, Architecture::Llama);
    assert_eq!(
        (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim),
        (30, 576, 9, 3, 64)
    );
    assert_eq!((cfg.intermediate_size, cfg.vocab_size, cfg.max_position_embeddings), (1536, 49152, 8192));
    assert_eq!(cfg.rope_theta, 100_000.0);
    assert!((cfg.rms_norm_eps - 1e-5).abs() < 1e-12);
    assert!(cfg.tie_word_embeddings && !cfg.attention_bias);
}

/// Regressions found by `cargo xtask fuzz gguf` (docs/reliability.md): lengths and offsets near
/// `u64::MAX` overflowed the arithmetic of the error path (a panic with overflow checks, a wrong
/// "needed" size without). They are truncation errors naming the field.
#[test]
fn fuzz_regressions_huge_lengths_and_offsets_are_truncation_errors() {
    let header = |n_tensors: u64, n_kv: u64| {
        let mut b = b"GGUF".to_vec();
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&n_tensors.to_le_bytes());
        b.extend_from_slice(&n_kv.to_le_bytes());
        b
    };
    // A metadata key whose length is u64::MAX.
    let mut b = header(0, 1);
    b.extend_from_slice(&u64::MAX.to_le_bytes());
    let e = GgufFile::from_bytes("key.gguf", &b).err().expect("must fail").to_string();
    assert!(e.contains("metadata key #0") && e.contains(&u64::MAX.to_string()), "{e}");
    // An array of strings whose first element has length u64::MAX (the fuzzer's input).
    let mut b = header(0, 1);
    b.extend_from_slice(&1u64.to_le_bytes());
    b.push(b'k');
    b.extend_from_slice(&9u32.to_le_bytes()); // array
    b.extend_from_slice(&8u32.to_le_bytes()); // of strings
    b.extend_from_slice(&1u64.to_le_bytes());
    b.extend_from_slice(&u64::MAX.to_le_bytes());
    let e = GgufFile::from_bytes("array.gguf", &b).err().expect("must fail").to_string();
    assert!(e.contains("metadata `k`"), "{e}");
    // A tensor whose (aligned) offset is near u64::MAX: its data end overflows.
    let mut b = header(1, 0);
    b.extend_from_slice(&1u64.to_le_bytes());
    b.push(b't');
    b.extend_from_slice(&1u32.to_le_bytes());
    b.extend_from_slice(&4u64.to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes()); // F32
    b.extend_from_slice(&(u64::MAX - 31).to_le_bytes());
    let e = GgufFile::from_bytes("offset.gguf", &b).err().expect("must fail").to_string();
    assert!(e.contains("data of tensor `t`"), "{e}");
}
