//! `deco convert` semantics: a GGUF exported to a Hugging Face directory loads back with the same
//! configuration, tokenizer, tensors and (up to summation order) logits.

use burn::tensor::Device;
use deco_formats::checkpoint::{Checkpoint, hf_tensor_names};
use deco_formats::hf_export::{ExportDtype, write_hf_dir};
use deco_formats::tokenizer::Tokenizer;
use deco_model::{DenseKvCache, Llama, LogitsWanted, SeqInput};
use deco_tests::smollm2_gguf;

fn logits(model: &Llama, tokens: &[u32]) -> Vec<f32> {
    let mut cache = DenseKvCache::new(model.config.num_hidden_layers);
    model
        .forward(&[SeqInput { seq: 0, tokens, tree: None }], &mut cache, LogitsWanted::Last)
        .expect("forward")
        .logits_rows()
        .expect("logits")
        .remove(0)
}

#[test]
fn converted_directory_gives_the_same_logits_as_the_gguf() {
    let gguf = Checkpoint::open(smollm2_gguf()).expect("open gguf");
    let tok = Tokenizer::from_gguf(gguf.gguf().expect("gguf")).expect("tokenizer");
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tmp.path().join("smollm2-hf");
    write_hf_dir(&gguf, &tok, &out, ExportDtype::F32).expect("export");

    // No temporary directory is left beside the output.
    let leftovers: Vec<_> = std::fs::read_dir(tmp.path()).expect("list").map(|e| e.expect("entry").file_name()).collect();
    assert_eq!(leftovers, vec![std::ffi::OsString::from("smollm2-hf")]);
    // A second export into the now non-empty directory is refused.
    assert!(write_hf_dir(&gguf, &tok, &out, ExportDtype::F32).is_err());

    let hf = Checkpoint::open(&out).expect("open converted dir");
    assert_eq!(hf.config, gguf.config);
    // Every tensor is bit-identical (f32 export of the dequantized, un-permuted weights).
    for name in hf_tensor_names(&gguf.config) {
        assert_eq!(hf.tensor(&name).expect("hf tensor"), gguf.tensor(&name).expect("gguf tensor"), "{name}");
    }

    let hf_tok = Tokenizer::from_hf_dir(&out).expect("tokenizer from dir");
    let text = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n";
    let ids = tok.encode(text, true).expect("encode");
    assert_eq!(hf_tok.encode(text, true).expect("encode"), ids);
    assert_eq!(hf_tok.chat_template(), tok.chat_template());
    assert_eq!(hf_tok.eos_token_ids(), tok.eos_token_ids());

    // The GGUF keeps its Q4_1/Q8_0 weights packed (deco_kernels::quant) while the directory runs
    // the dense f32 path on the same values: equal up to summation order.
    let dev = Device::flex();
    let a = Llama::load(&gguf, &dev, Some(256)).expect("load gguf");
    let b = Llama::load(&hf, &dev, Some(256)).expect("load hf");
    let (la, lb) = (logits(&a, &ids), logits(&b, &ids));
    let err = la.iter().zip(&lb).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
    eprintln!("max |logit(gguf) - logit(converted)| = {err:.2e}");
    assert!(err <= 1e-3, "converted model's logits differ by {err}");
}

#[test]
fn bf16_export_stays_close_to_f32() {
    let gguf = Checkpoint::open(smollm2_gguf()).expect("open gguf");
    let tok = Tokenizer::from_gguf(gguf.gguf().expect("gguf")).expect("tokenizer");
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tmp.path().join("bf16");
    write_hf_dir(&gguf, &tok, &out, ExportDtype::Bf16).expect("export");
    let hf = Checkpoint::open(&out).expect("open");
    for name in ["model.embed_tokens.weight", "model.layers.3.self_attn.k_proj.weight", "model.norm.weight"] {
        let (_, x) = gguf.tensor(name).expect("f32");
        let (_, y) = hf.tensor(name).expect("bf16");
        for (a, b) in x.iter().zip(&y) {
            // bf16 keeps 8 significant bits: relative rounding error at most 2^-8.
            assert!((a - b).abs() <= a.abs() * (1.0 / 256.0), "{name}: {a} -> {b}");
        }
    }
}
