//! Packed export formats round trip exactly: quantize (RTN / GPTQ) → pack
//! ([`deco_formats::quantized::encode`]) → write a safetensors directory → open it with
//! `Checkpoint` → unpack gives the identical integer codes, zero points and `g_idx`, the f16
//! scales, and dequantized weights bit for bit equal to deco-quant's own
//! `QuantizedTensor::dequantize` with those scales. Covers GPTQ (v1 zero - 1, 2/4/8 bits, odd and
//! ragged group counts, act-order `g_idx`), AWQ GEMM, compressed-tensors pack-quantized
//! (sym/asym, 3/4/8 bits with padding, act-order), a hand-computed AutoGPTQ word, and bad input.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::collections::BTreeMap;
use std::path::PathBuf;

use deco_formats::checkpoint::Checkpoint;
use deco_formats::quantized::{QuantConfig, QuantMethod, StTensor, encode, round_to_f16, write_safetensors_dir};
use deco_model::calibrate::Linear;
use deco_quant::export::{quantize_rtn_ragged, to_int_linear};
use deco_quant::gptq::{GptqConfig, Hessian, gptq_quantize};
use deco_quant::scheme::{Granularity, QuantizedTensor, Scheme};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const HIDDEN: usize = 96; // 3 groups of 32 (an odd count); ragged with 40
const INTER: usize = 256;
const VOCAB: usize = 64;

fn randn(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let u1: f64 = rng.random_range(1e-12..1.0);
            let u2: f64 = rng.random_range(0.0..1.0);
            ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
        })
        .collect()
}

fn config_json() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
        "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": 1,
        "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 32,
        "max_position_embeddings": 128, "tie_word_embeddings": true,
    })
}

fn dims(l: Linear) -> (usize, usize) {
    match l {
        Linear::Q | Linear::O => (HIDDEN, HIDDEN),
        Linear::K | Linear::V => (32, HIDDEN),
        Linear::Gate | Linear::Up => (INTER, HIDDEN),
        Linear::Down => (HIDDEN, INTER),
    }
}

fn tmp(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("deco-export-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    p
}

/// The layer-0 linears quantized with `f(weights, rows, cols)`.
fn quantize_layer(seed: u64, f: &dyn Fn(&[f32], usize, usize) -> QuantizedTensor) -> BTreeMap<String, QuantizedTensor> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    Linear::ALL
        .iter()
        .map(|&l| {
            let (r, c) = dims(l);
            let w: Vec<f32> = randn(&mut rng, r * c).iter().map(|v| v * 0.05).collect();
            (format!("model.layers.0.{}.weight", l.hf_suffix()), f(&w, r, c))
        })
        .collect()
}

fn rtn(bits: u32, sym: bool, g: Granularity) -> impl Fn(&[f32], usize, usize) -> QuantizedTensor {
    move |w, r, c| quantize_rtn_ragged(w, r, c, &Scheme { bits, sym, granularity: g }).unwrap()
}

/// GPTQ against the Hessian of random correlated inputs (so `desc_act` permutes columns).
fn gptq(cfg: GptqConfig) -> impl Fn(&[f32], usize, usize) -> QuantizedTensor {
    move |w, r, c| {
        let mut rng = ChaCha8Rng::seed_from_u64(c as u64);
        let tokens = 2 * c;
        let scale: Vec<f32> = (0..c).map(|j| 0.2 + (j % 7) as f32).collect();
        let x: Vec<f32> = randn(&mut rng, tokens * c).iter().enumerate().map(|(k, v)| v * scale[k % c]).collect();
        let mut h = Hessian::new(c);
        h.add_batch(&x, tokens).unwrap();
        gptq_quantize(w, r, c, &h, &cfg).unwrap().q
    }
}

/// Writes a 1-layer model directory with `quantized` packed in `qcfg`'s format.
fn write_model(dir: &std::path::Path, qcfg: &QuantConfig, quantized: &BTreeMap<String, QuantizedTensor>, gptq_file_only: bool) {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut tensors = vec![
        ("model.embed_tokens.weight".to_string(), StTensor::f32(vec![VOCAB, HIDDEN], &randn(&mut rng, VOCAB * HIDDEN))),
        ("model.norm.weight".to_string(), StTensor::f32(vec![HIDDEN], &vec![1.0; HIDDEN])),
        ("model.layers.0.input_layernorm.weight".to_string(), StTensor::f32(vec![HIDDEN], &vec![1.0; HIDDEN])),
        ("model.layers.0.post_attention_layernorm.weight".to_string(), StTensor::f32(vec![HIDDEN], &vec![1.0; HIDDEN])),
    ];
    for (name, q) in quantized {
        tensors.extend(encode(&to_int_linear(q), qcfg, name.strip_suffix(".weight").unwrap(), dir).unwrap());
    }
    let mut config = config_json();
    let mut files = Vec::new();
    if gptq_file_only {
        files.push(("quantize_config.json", qcfg.to_json().to_string()));
    } else {
        config["quantization_config"] = qcfg.to_json();
    }
    files.push(("config.json", config.to_string()));
    write_safetensors_dir(dir, &tensors, &files, &|_| Ok(())).unwrap();
}

/// Opens `dir` and checks every linear against `quantized` exactly.
fn assert_round_trip(dir: &std::path::Path, quantized: &BTreeMap<String, QuantizedTensor>) {
    let ck = Checkpoint::open(dir).unwrap();
    assert!(ck.quant_config().is_some());
    for (name, q) in quantized {
        let mut want = to_int_linear(q);
        want.scales.iter_mut().for_each(|s| *s = round_to_f16(*s));
        let got = ck.quantized_linear(name).unwrap().expect("packed linear");
        assert_eq!(got.codes, want.codes, "{name}: codes");
        assert_eq!(got.zeros, want.zeros, "{name}: zeros");
        assert_eq!(got.g_idx, want.g_idx, "{name}: g_idx");
        assert_eq!(got.scales, want.scales, "{name}: scales");
        // Dequantized on load == deco-quant's own dequantization with the stored f16 scales.
        let mut q16 = q.clone();
        q16.scales.iter_mut().for_each(|s| *s = round_to_f16(*s));
        let (shape, w) = ck.tensor(name).unwrap();
        assert_eq!(shape, vec![q.rows, q.cols]);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&w), bits(&q16.dequantize()), "{name}: dequantized values");
    }
    // Unquantized tensors still load.
    assert_eq!(ck.tensor("model.norm.weight").unwrap().1, vec![1.0; HIDDEN]);
}

fn round_trip(name: &str, qcfg: QuantConfig, quantized: BTreeMap<String, QuantizedTensor>) {
    let dir = tmp(name);
    write_model(&dir, &qcfg, &quantized, false);
    assert_round_trip(&dir, &quantized);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn gptq_4bit_asym_odd_group_count_round_trips() {
    let q = quantize_layer(1, &rtn(4, false, Granularity::PerGroup(32)));
    assert_eq!(q["model.layers.0.self_attn.q_proj.weight"].groups(), 3);
    round_trip("gptq4", QuantConfig::new(QuantMethod::Gptq, 4, Some(32), false), q);
}

#[test]
fn gptq_ragged_groups_round_trip() {
    // 96 inputs in groups of 40 -> 3 groups (40, 40, 16), 256 -> 7 groups: AutoGPTQ's
    // ceil(in / group_size).
    let q = quantize_layer(2, &rtn(4, true, Granularity::PerGroup(40)));
    assert_eq!(q["model.layers.0.self_attn.q_proj.weight"].groups(), 3);
    assert_eq!(q["model.layers.0.mlp.down_proj.weight"].groups(), 7);
    round_trip("gptq_ragged", QuantConfig::new(QuantMethod::Gptq, 4, Some(40), true), q);
}

#[test]
fn gptq_desc_act_g_idx_round_trips() {
    let cfg = GptqConfig { bits: 4, group_size: Some(32), sym: false, desc_act: true, ..GptqConfig::default() };
    let q = quantize_layer(3, &gptq(cfg));
    let gi = &q["model.layers.0.self_attn.q_proj.weight"].g_idx;
    assert!(gi.iter().enumerate().any(|(c, &g)| g as usize != c / 32), "act-order should permute g_idx");
    let mut qc = QuantConfig::new(QuantMethod::Gptq, 4, Some(32), false);
    qc.desc_act = true;
    round_trip("gptq_act", qc.clone(), q.clone());
    // The same with the AutoGPTQ quantize_config.json only (no quantization_config).
    let dir = tmp("gptq_act_file");
    write_model(&dir, &qc, &q, true);
    assert_round_trip(&dir, &q);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn gptq_2_and_8_bit_per_channel_round_trip() {
    round_trip("gptq2", QuantConfig::new(QuantMethod::Gptq, 2, Some(32), true), quantize_layer(4, &rtn(2, true, Granularity::PerGroup(32))));
    round_trip("gptq8", QuantConfig::new(QuantMethod::Gptq, 8, None, false), quantize_layer(5, &rtn(8, false, Granularity::PerChannel)));
}

#[test]
fn awq_gemm_round_trips() {
    round_trip("awq", QuantConfig::new(QuantMethod::Awq, 4, Some(32), false), quantize_layer(6, &rtn(4, false, Granularity::PerGroup(32))));
}

#[test]
fn compressed_tensors_round_trip() {
    let ct = |bits, gs, sym| QuantConfig::new(QuantMethod::CompressedTensors, bits, gs, sym);
    round_trip("ct4s", ct(4, Some(32), true), quantize_layer(7, &rtn(4, true, Granularity::PerGroup(32))));
    round_trip("ct8a", ct(8, None, false), quantize_layer(8, &rtn(8, false, Granularity::PerChannel)));
    // 3 bits, packed densely (compressed-tensors >= 0.18): 96 inputs -> 9 words per row, codes
    // straddling words; 32 outputs -> 3 words of zero points per group.
    round_trip("ct3a", ct(3, Some(32), false), quantize_layer(9, &rtn(3, false, Granularity::PerGroup(32))));
    let mut qc = ct(4, Some(32), false);
    qc.desc_act = true;
    // Act-order is stored as `actorder: "weight"` (static groups, no g_idx); dynamic groups
    // (a permuted g_idx) cannot be stored and are refused.
    let cfg = GptqConfig { bits: 4, group_size: Some(32), sym: false, desc_act: true, static_groups: true, ..GptqConfig::default() };
    round_trip("ct_act", qc.clone(), quantize_layer(10, &gptq(cfg)));
    let dynamic = quantize_layer(10, &gptq(GptqConfig { static_groups: false, ..cfg }));
    let l = to_int_linear(dynamic.values().next().expect("a layer"));
    assert!(!l.is_sequential(), "act-order with dynamic groups should permute g_idx");
    let err = encode(&l, &qc, "x", std::path::Path::new("mem")).expect_err("dynamic act-order refused").to_string();
    assert!(err.contains("static groups"), "{err}");
}

/// AutoGPTQ `QuantLinear.pack` on an 8x8 layer, written out by hand from its loops:
/// `qweight[row] |= intweight[j] << (bits * (j - i))` over the 8 inputs of a word (`intweight`
/// is `[in, out]`), `qzeros[:, col] |= (zeros - 1)[:, j] << (bits * (j - i))`.
#[test]
fn gptq_words_match_autogptq_pack_loop() {
    let (o, i) = (8usize, 8usize);
    let codes: Vec<u8> = (0..o * i).map(|k| ((k / i + 3 * (k % i)) % 16) as u8).collect();
    let zeros: Vec<i32> = (0..o).map(|r| 1 + r as i32).collect();
    let l = deco_formats::quantized::IntLinear {
        out_features: o,
        in_features: i,
        bits: 4,
        group_size: 8,
        codes: codes.clone(),
        scales: vec![0.5; o],
        zeros: zeros.clone(),
        g_idx: vec![0; i],
    };
    let t = encode(&l, &QuantConfig::new(QuantMethod::Gptq, 4, Some(8), false), "x", std::path::Path::new("mem")).unwrap();
    let word = |k: &str| -> Vec<u32> {
        let st = &t.iter().find(|(n, _)| n == k).unwrap().1;
        st.data.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
    };
    let qweight = word("x.qweight");
    assert_eq!(qweight.len(), o); // [in/8 = 1, out = 8]
    for (col, &w) in qweight.iter().enumerate() {
        let mut want = 0u32;
        for j in 0..8 {
            want |= (codes[col * i + j] as u32) << (4 * j);
        }
        assert_eq!(w, want, "output {col}");
    }
    // Output 0: codes (0, 3, 6, 9, 12, 15, 2, 5) -> 0x52fc9630.
    assert_eq!(qweight[0], 0x52fc_9630);
    // zeros 1..=8 stored minus one: nibbles 0..=7 -> 0x76543210.
    assert_eq!(word("x.qzeros"), vec![0x7654_3210]);
}

#[test]
fn unrepresentable_layers_are_refused_with_clear_errors() {
    let p = std::path::Path::new("/out");
    // A group with no negative value gets zero point 0: not storable as zero - 1 in GPTQ v1.
    let w: Vec<f32> = (0..8 * 32).map(|k| (k % 5) as f32 * 0.1).collect();
    let q = quantize_rtn_ragged(&w, 8, 32, &Scheme { bits: 4, sym: false, granularity: Granularity::PerGroup(32) }).unwrap();
    assert!(q.zeros.contains(&0.0));
    let e = encode(&to_int_linear(&q), &QuantConfig::new(QuantMethod::Gptq, 4, Some(32), false), "m.l", p).unwrap_err().to_string();
    assert!(e.contains("zero point 0") && e.contains("m.l") && e.contains("/out"), "{e}");
    // gptq_v2 stores zeros as is and accepts it.
    let mut v2 = QuantConfig::new(QuantMethod::Gptq, 4, Some(32), false);
    v2.gptq_v2 = true;
    assert!(encode(&to_int_linear(&q), &v2, "m.l", p).is_ok());
    // Bits a format cannot pack.
    let q8 = quantize_rtn_ragged(&w, 8, 32, &Scheme { bits: 8, sym: true, granularity: Granularity::PerGroup(32) }).unwrap();
    let e = encode(&to_int_linear(&q8), &QuantConfig::new(QuantMethod::Awq, 8, Some(32), true), "m.l", p).unwrap_err().to_string();
    assert!(e.contains("4-bit"), "{e}");
    let q3 = quantize_rtn_ragged(&w, 8, 32, &Scheme { bits: 3, sym: true, granularity: Granularity::PerGroup(32) }).unwrap();
    let e = encode(&to_int_linear(&q3), &QuantConfig::new(QuantMethod::Gptq, 3, Some(32), true), "m.l", p).unwrap_err().to_string();
    assert!(e.contains("3-bit GPTQ"), "{e}");
    // AWQ cannot store ragged groups.
    let qr = quantize_rtn_ragged(&w, 8, 32, &Scheme { bits: 4, sym: true, granularity: Granularity::PerGroup(12) }).unwrap();
    let e = encode(&to_int_linear(&qr), &QuantConfig::new(QuantMethod::Awq, 4, Some(12), true), "m.l", p).unwrap_err().to_string();
    assert!(e.contains("must divide"), "{e}");
}

#[test]
fn bad_checkpoints_give_errors_not_panics() {
    let q = quantize_layer(11, &rtn(4, true, Granularity::PerGroup(32)));
    let qc = QuantConfig::new(QuantMethod::Gptq, 4, Some(32), true);
    // Corrupt quantization_config: bits not a number, then unsupported bits.
    for (bad, needle) in [(serde_json::json!("four"), "`bits`"), (serde_json::json!(5), "bits 5")] {
        let dir = tmp("badcfg");
        write_model(&dir, &qc, &q, false);
        let cpath = dir.join("config.json");
        let mut c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cpath).unwrap()).unwrap();
        c["quantization_config"]["bits"] = bad;
        std::fs::write(&cpath, c.to_string()).unwrap();
        let e = Checkpoint::open(&dir).unwrap_err().to_string();
        assert!(e.contains(needle) && e.contains("config.json"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
    // Truncated JSON in quantize_config.json.
    let dir = tmp("badjson");
    write_model(&dir, &qc, &q, true);
    std::fs::write(dir.join("quantize_config.json"), "{\"bits\": 4, ").unwrap();
    let e = Checkpoint::open(&dir).unwrap_err().to_string();
    assert!(e.contains("quantize_config.json"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
    // A config that says 8 bits for 4-bit data: qweight shape mismatch on load.
    let dir = tmp("badshape");
    write_model(&dir, &qc, &q, false);
    let cpath = dir.join("config.json");
    let mut c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cpath).unwrap()).unwrap();
    c["quantization_config"]["bits"] = 8.into();
    std::fs::write(&cpath, c.to_string()).unwrap();
    let ck = Checkpoint::open(&dir).unwrap();
    let e = ck.tensor("model.layers.0.self_attn.q_proj.weight").unwrap_err().to_string();
    assert!(e.contains("q_proj.qweight") && e.contains("shape"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
    // Unknown quant_method.
    let dir = tmp("badmethod");
    write_model(&dir, &qc, &q, false);
    let mut c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    c["quantization_config"]["quant_method"] = "bitsandbytes".into();
    std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
    let e = Checkpoint::open(&dir).unwrap_err().to_string();
    assert!(e.contains("bitsandbytes"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn ragged_rtn_equals_rtn_when_groups_divide() {
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    let w = randn(&mut rng, 4 * 64);
    for (bits, sym) in [(4, false), (4, true), (3, false), (8, true)] {
        let s = Scheme { bits, sym, granularity: Granularity::PerGroup(16) };
        assert_eq!(quantize_rtn_ragged(&w, 4, 64, &s).unwrap(), deco_quant::scheme::quantize_rtn(&w, 4, 64, &s).unwrap());
    }
    // Ragged: the last group's parameters come from its 4 columns only.
    let s = Scheme { bits: 4, sym: false, granularity: Granularity::PerGroup(20) };
    let q = quantize_rtn_ragged(&w, 4, 64, &s).unwrap();
    assert_eq!(q.groups(), 4);
    let tail = deco_quant::scheme::quantize_rtn(&w.chunks(64).flat_map(|r| r[60..].to_vec()).collect::<Vec<_>>(), 4, 4, &Scheme { bits: 4, sym: false, granularity: Granularity::PerChannel }).unwrap();
    for r in 0..4 {
        assert_eq!(q.scales[r * 4 + 3], tail.scales[r]);
        assert_eq!(&q.codes[r * 64 + 60..r * 64 + 64], &tail.codes[r * 4..r * 4 + 4]);
    }
}

/// A small GGUF source with Q8_0 / Q4_1 / Q4_0 / F16 / F32 tensors (as a quantized llama GGUF).
fn write_source_gguf(path: &std::path::Path, extra: Option<deco_formats::gguf::TensorToWrite<'_>>) {
    use deco_formats::ggml::{GgmlType, quantize_q4_0, quantize_q4_1, quantize_q8_0};
    use deco_formats::gguf::{MetadataValue, TensorToWrite, write_gguf};
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    let embd = quantize_q8_0(&randn(&mut rng, VOCAB * HIDDEN)).unwrap();
    let q = quantize_q4_1(&randn(&mut rng, HIDDEN * HIDDEN)).unwrap();
    let down = quantize_q4_0(&randn(&mut rng, HIDDEN * INTER)).unwrap();
    // F16: 1.0, -2.0, 0.5, 65504 (max), repeated.
    let f16: Vec<u8> = (0..HIDDEN).flat_map(|i| [0x3C00u16, 0xC000, 0x3800, 0x7BFF][i % 4].to_le_bytes()).collect();
    let norm: Vec<u8> = randn(&mut rng, HIDDEN).iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut tensors = vec![
        TensorToWrite { name: "token_embd.weight".into(), shape: vec![VOCAB, HIDDEN], ggml_type: GgmlType::Q8_0, data: &embd },
        TensorToWrite { name: "blk.0.attn_norm.weight".into(), shape: vec![HIDDEN], ggml_type: GgmlType::F32, data: &norm },
        TensorToWrite { name: "blk.0.attn_q.weight".into(), shape: vec![HIDDEN, HIDDEN], ggml_type: GgmlType::Q4_1, data: &q },
        TensorToWrite { name: "blk.0.ffn_down.weight".into(), shape: vec![HIDDEN, INTER], ggml_type: GgmlType::Q4_0, data: &down },
        TensorToWrite { name: "output_norm.weight".into(), shape: vec![HIDDEN], ggml_type: GgmlType::F16, data: &f16 },
    ];
    tensors.extend(extra);
    let meta = vec![
        ("general.architecture".to_string(), MetadataValue::String("llama".into())),
        ("general.file_type".to_string(), MetadataValue::U32(3)),
        ("llama.block_count".to_string(), MetadataValue::U32(1)),
        ("tokenizer.ggml.tokens".to_string(), MetadataValue::Array(vec![MetadataValue::String("a".into()), MetadataValue::String("b".into())])),
    ];
    write_gguf(path, &meta, &tensors).unwrap();
}

#[test]
fn gguf_f32_export_equals_the_dequantized_source() {
    use deco_formats::ggml::GgmlType;
    use deco_formats::gguf::{GgufFile, MetadataValue};
    let dir = tmp("gguf-f32");
    std::fs::create_dir_all(&dir).unwrap();
    let (src_path, out) = (dir.join("src.gguf"), dir.join("out.f32.gguf"));
    write_source_gguf(&src_path, None);
    let src = GgufFile::open(&src_path).unwrap();
    let mut calls = 0;
    let stats = deco_quant::export::write_gguf_f32(&src, &out, &mut |_| calls += 1).unwrap();
    assert_eq!((stats.linears, calls), (4, 4), "Q8_0, Q4_1, Q4_0 and F16 tensors converted");
    assert_eq!(stats.bytes, std::fs::metadata(&out).unwrap().len());
    let got = GgufFile::open(&out).unwrap();
    // Same tensors in the same order and shapes, all F32, values bit for bit the dequantized source.
    assert_eq!(got.tensors.iter().map(|t| (&t.name, t.shape())).collect::<Vec<_>>(), src.tensors.iter().map(|t| (&t.name, t.shape())).collect::<Vec<_>>());
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for t in &src.tensors {
        let g = got.tensor_info(&t.name).unwrap();
        assert_eq!(g.ggml_type, GgmlType::F32, "{}", t.name);
        assert_eq!(bits(&got.dequantize(&t.name).unwrap().1), bits(&src.dequantize(&t.name).unwrap().1), "{}", t.name);
    }
    assert_eq!(&got.dequantize("output_norm.weight").unwrap().1[..4], &[1.0, -2.0, 0.5, 65504.0]);
    // The F32 norm is copied byte for byte.
    assert_eq!(got.tensor_bytes("blk.0.attn_norm.weight").unwrap().1, src.tensor_bytes("blk.0.attn_norm.weight").unwrap().1);
    // Metadata copied in order; file type ALL_F32.
    assert_eq!(got.metadata_order, src.metadata_order);
    assert_eq!(got.get("general.file_type"), Some(&MetadataValue::U32(deco_quant::export::FILE_TYPE_ALL_F32)));
    for k in src.metadata_order.iter().filter(|k| *k != "general.file_type") {
        assert_eq!(got.get(k), src.get(k), "{k}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn gguf_f32_export_of_an_undequantizable_tensor_is_an_error_and_writes_nothing() {
    use deco_formats::ggml::GgmlType;
    use deco_formats::gguf::{GgufFile, TensorToWrite};
    let dir = tmp("gguf-f32-bad");
    std::fs::create_dir_all(&dir).unwrap();
    let (src_path, out) = (dir.join("src.gguf"), dir.join("out.gguf"));
    let q8_1 = vec![0u8; GgmlType::Q8_1.bytes_for(64).unwrap()];
    write_source_gguf(&src_path, Some(TensorToWrite { name: "blk.0.odd.weight".into(), shape: vec![2, 32], ggml_type: GgmlType::Q8_1, data: &q8_1 }));
    let src = GgufFile::open(&src_path).unwrap();
    let e = deco_quant::export::write_gguf_f32(&src, &out, &mut |_| {}).unwrap_err().to_string();
    assert!(e.contains("blk.0.odd.weight"), "{e}");
    assert!(!out.exists());
    std::fs::remove_dir_all(&dir).unwrap();
}
