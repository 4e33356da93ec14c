//! Quantized checkpoints of the real SmolLM2 written to disk (the code path of `deco quantize`:
//! `quantize_linears` + `write_packed_dir` / `write_gguf_model`) load through `Checkpoint::open`
//! and run: the GPTQ directory (RTN 4-bit, g128 with AutoGPTQ's ragged last group on 576
//! inputs) has the perplexity of the in-memory fake-quantized model within 1e-3 relative by the
//! golden protocol (first 20,000 chars of wiki_test, 4 windows of 256, no BOS); AWQ and
//! compressed-tensors directories unpack to the exact integer codes; GGUF Q4_0 / Q8_0 files hold
//! exactly ggml's blocks of the permuted weights and run on the packed kernels.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::collections::{BTreeMap, HashMap};
use std::sync::OnceLock;

use burn::tensor::Device;
use deco_formats::checkpoint::{Checkpoint, unpermute_qk};
use deco_formats::ggml::{self, GgmlType};
use deco_formats::gguf::GgufFile;
use deco_formats::quantized::{QuantConfig, QuantMethod, round_to_f16};
use deco_formats::tokenizer::Tokenizer;
use deco_model::{DenseKvCache, Llama, LogitsWanted, SeqInput};
use deco_quant::export::{ggml_quantize_linear, quantize_linears, to_int_linear, write_gguf_model, write_packed_dir};
use deco_quant::pipeline::Method;
use deco_quant::scheme::{Granularity, QuantizedTensor, Scheme};
use deco_tests::{asset, smollm2_gguf};

fn ckpt() -> &'static Checkpoint {
    static C: OnceLock<Checkpoint> = OnceLock::new();
    C.get_or_init(|| Checkpoint::open(smollm2_gguf()).expect("open SmolLM2"))
}

fn tok() -> Tokenizer {
    Tokenizer::from_gguf(ckpt().gguf().unwrap()).unwrap()
}

fn src(n: &str) -> deco_model::Result<(Vec<usize>, Vec<f32>)> {
    Ok(ckpt().tensor(n)?)
}

fn rtn(bits: u32, sym: bool, gs: usize) -> BTreeMap<String, QuantizedTensor> {
    let scheme = Scheme { bits, sym, granularity: Granularity::PerGroup(gs) };
    quantize_linears(&ckpt().config, &src, &Device::flex(), &[], &Method::Rtn, &scheme, deco_model::calibrate::CalibDtype::F32, &mut |_| {}).unwrap()
}

/// Golden-protocol perplexity (first 20,000 chars of wiki_test, 4 windows of 256, no BOS).
fn ppl(model: &Llama) -> f64 {
    let text: String = std::fs::read_to_string(asset("data/wiki_test.txt")).unwrap().chars().take(20_000).collect();
    let ids = tok().encode_with(&text, false, true).unwrap();
    let (mut nll, mut n) = (0.0f64, 0usize);
    for w in 0..4 {
        let window = &ids[w * 256..(w + 1) * 256];
        let mut cache = DenseKvCache::new(model.config.num_hidden_layers);
        let rows = model.forward(&[SeqInput { seq: 0, tokens: window, tree: None }], &mut cache, LogitsWanted::All).unwrap().logits_rows().unwrap();
        for (row, &t) in rows.iter().zip(&window[1..]) {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = row.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln() + max;
            nll += lse - row[t as usize] as f64;
            n += 1;
        }
    }
    (nll / n as f64).exp()
}

/// The in-memory fake-quantized model: `q.dequantize()` in place of each linear.
fn fake_model(q: &BTreeMap<String, QuantizedTensor>, f16_scales: bool) -> Llama {
    let lin: HashMap<String, Vec<f32>> = q
        .iter()
        .map(|(k, t)| {
            let mut t = t.clone();
            if f16_scales {
                t.scales.iter_mut().for_each(|s| *s = round_to_f16(*s));
            }
            (k.clone(), t.dequantize())
        })
        .collect();
    let source = |n: &str| -> deco_model::Result<(Vec<usize>, Vec<f32>)> {
        let (shape, data) = src(n)?;
        Ok((shape, lin.get(n).cloned().unwrap_or(data)))
    };
    Llama::load_from(&ckpt().config, &source, &Device::flex(), Some(256)).unwrap()
}

fn dir_mb(p: &std::path::Path) -> f64 {
    std::fs::read_dir(p).unwrap().map(|e| e.unwrap().metadata().unwrap().len()).sum::<u64>() as f64 / 1e6
}

#[test]
fn gptq_dir_of_smollm2_has_the_in_memory_perplexity() {
    let q = rtn(4, true, 128);
    assert_eq!(q["model.layers.0.self_attn.q_proj.weight"].groups(), 5); // ceil(576 / 128)
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("smollm2-gptq-w4g128");
    let qc = QuantConfig::new(QuantMethod::Gptq, 4, Some(128), true);
    write_packed_dir(&ckpt().config, &src, &tok(), &q, &qc, &dir).unwrap();
    let disk = Checkpoint::open(&dir).unwrap();
    assert_eq!(disk.quant_config(), Some(&qc));
    // Exact integer round trip on one layer of each shape.
    for name in ["model.layers.0.self_attn.k_proj.weight", "model.layers.29.mlp.down_proj.weight"] {
        let got = disk.quantized_linear(name).unwrap().unwrap();
        let want = to_int_linear(&q[name]);
        assert_eq!((&got.codes, &got.zeros, &got.g_idx), (&want.codes, &want.zeros, &want.g_idx));
    }
    assert!(Tokenizer::from_hf_dir(&dir).is_ok());
    let p_disk = ppl(&Llama::load(&disk, &Device::flex(), Some(256)).unwrap());
    let p_mem = ppl(&fake_model(&q, false));
    let p_mem16 = ppl(&fake_model(&q, true));
    let rel = (p_disk - p_mem).abs() / p_mem;
    eprintln!(
        "GPTQ W4 g128 sym dir ({:.1} MB): ppl {p_disk:.4}; in-memory fake quant {p_mem:.4} (f16 scales {p_mem16:.4}); rel {rel:.2e}",
        dir_mb(&dir)
    );
    assert!(rel < 1e-3, "disk {p_disk} vs in-memory {p_mem}");
    // With the stored (f16) scales the two are the same weights.
    assert!((p_disk - p_mem16).abs() / p_mem16 < 1e-5, "disk {p_disk} vs in-memory f16 {p_mem16}");
}

#[test]
fn awq_and_compressed_tensors_dirs_of_smollm2_unpack_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    for (qc, q) in [
        (QuantConfig::new(QuantMethod::Awq, 4, Some(64), false), rtn(4, false, 64)),
        (QuantConfig::new(QuantMethod::CompressedTensors, 4, Some(128), false), rtn(4, false, 128)),
    ] {
        let dir = tmp.path().join(qc.method.name());
        write_packed_dir(&ckpt().config, &src, &tok(), &q, &qc, &dir).unwrap();
        let disk = Checkpoint::open(&dir).unwrap();
        for (name, t) in &q {
            let got = disk.quantized_linear(name).unwrap().unwrap();
            let want = to_int_linear(t);
            assert_eq!(got.codes, want.codes, "{name}");
            assert_eq!(got.zeros, want.zeros, "{name}");
            assert_eq!(got.scales, want.scales.iter().map(|&s| round_to_f16(s)).collect::<Vec<_>>(), "{name}");
        }
        let p = ppl(&Llama::load(&disk, &Device::flex(), Some(256)).unwrap());
        eprintln!("{} W4 asym dir ({:.1} MB): ppl {p:.4}", qc.method.name(), dir_mb(&dir));
        assert!(p > 20.0 && p < 60.0, "ppl {p}");
    }
}

#[test]
fn gguf_exports_hold_ggml_blocks_and_run() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = &ckpt().config;
    for ty in [GgmlType::Q4_0, GgmlType::Q8_0] {
        let path = tmp.path().join(format!("smollm2-{}.gguf", ty.name()));
        write_gguf_model(ckpt().gguf().unwrap(), cfg, &src, ty, &path, &mut |_| {}).unwrap();
        let g = GgufFile::open(&path).unwrap();
        assert_eq!(g.get("general.file_type").and_then(|v| v.as_u64()), Some(if ty == GgmlType::Q4_0 { 2 } else { 7 }));
        for name in ["model.layers.0.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight", "model.layers.5.mlp.up_proj.weight"] {
            let (shape, w) = src(name).unwrap();
            let want = ggml_quantize_linear(cfg, name, &w, shape[1], ty).unwrap();
            let gname = deco_formats::checkpoint::hf_to_gguf_name(name).unwrap();
            let (info, bytes) = g.tensor_bytes(&gname).unwrap();
            assert_eq!(info.ggml_type, ty);
            assert_eq!(bytes, &want[..], "{name}: stored blocks");
            // Read back through Checkpoint: ggml dequantization, un-permuted to HF rows.
            let (_, got) = Checkpoint::open(&path).unwrap().tensor(name).unwrap();
            let mut deq = ggml::dequantize(ty, &want, w.len()).unwrap();
            if name.contains("q_proj") {
                deq = unpermute_qk(&deq, cfg.num_attention_heads, shape[1]);
            } else if name.contains("k_proj") {
                deq = unpermute_qk(&deq, cfg.num_key_value_heads, shape[1]);
            }
            assert_eq!(got, deq, "{name}: dequantized");
        }
        // llama-quantize --pure's layout: the token embedding is stored as `ty` too (the
        // source's bytes when it is already `ty`, else ggml's quantization of its values), the
        // norms are copied, tensors are in llama.cpp's order, and the quantization version and
        // file type are the last keys.
        let src_g = ckpt().gguf().unwrap();
        let (src_info, src_bytes) = src_g.tensor_bytes("token_embd.weight").unwrap();
        let (info, bytes) = g.tensor_bytes("token_embd.weight").unwrap();
        assert_eq!(info.ggml_type, ty);
        if src_info.ggml_type == ty {
            assert_eq!(bytes, src_bytes);
        } else {
            let values = src_g.dequantize("token_embd.weight").unwrap().1;
            let want = match ty { GgmlType::Q8_0 => ggml::quantize_q8_0(&values), _ => ggml::quantize_q4_0(&values) }.unwrap();
            assert_eq!(bytes, &want[..], "token_embd.weight");
        }
        assert_eq!(g.tensor_bytes("output_norm.weight").unwrap().1, src_g.tensor_bytes("output_norm.weight").unwrap().1);
        let names: Vec<&str> = g.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(&names[..4], &["output_norm.weight", "token_embd.weight", "blk.0.attn_k.weight", "blk.0.attn_norm.weight"]);
        assert_eq!(names.iter().position(|n| n.starts_with("blk.10.")), Some(2 + 10 * 9), "blk.10 after blk.0-9 (numeric, not lexicographic)");
        assert_eq!(&g.metadata_order[g.metadata_order.len() - 2..], &["general.quantization_version", "general.file_type"]);
        let p = ppl(&Llama::load(&Checkpoint::open(&path).unwrap(), &Device::flex(), Some(256)).unwrap());
        let mb = std::fs::metadata(&path).unwrap().len() as f64 / 1e6;
        eprintln!("GGUF {} ({mb:.1} MB): ppl {p:.4}", ty.name());
        assert!(p > 20.0 && p < 40.0, "ppl {p}");
    }
}
