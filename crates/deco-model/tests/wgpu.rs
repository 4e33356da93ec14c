//! The model on the wgpu device (CubeCL RMSNorm, RoPE, FlashAttention-2 prefill and packed GGUF
//! matmul kernels, see deco_model::decoder) against the same model on flex: prefill logits of
//! two sequences of different lengths, then three batched decode steps, for the tiny Llama 3
//! and Qwen2 checkpoints of `tests/data/tiny` (GQA, RoPE, Qwen2's QKV biases) and for tiny GGUF
//! models whose weights hold every packed block type. Run by the wgpu tier of `cargo xtask
//! test` (Mesa lavapipe in CI).
#![cfg(feature = "wgpu")]

use burn::tensor::Device;
use deco_formats::checkpoint::Checkpoint;
use deco_model::{DenseKvCache, Llama, LogitsWanted, SeqInput, WeightStorage};

/// Prefill + decode on `device`; every position's logits of the prefill, then each decode step's.
fn run(dir: &str, device: &Device) -> Vec<Vec<f32>> {
    run_checked(dir, device, |_| {})
}

/// [`run`], first checking the loaded model with `check`.
fn run_checked(dir: &str, device: &Device, check: impl Fn(&Llama)) -> Vec<Vec<f32>> {
    let ckpt = Checkpoint::open(dir).expect("tiny checkpoint");
    let model = Llama::load(&ckpt, device, None).expect("load");
    check(&model);
    let vocab = model.config.vocab_size as u32;
    let a: Vec<u32> = (0..11).map(|i| (i * 7 + 3) % vocab).collect();
    let b: Vec<u32> = (0..5).map(|i| (i * 13 + 1) % vocab).collect();
    let mut cache = DenseKvCache::new(model.num_layers());
    let mut rows = model
        .forward(&[SeqInput { seq: 0, tokens: &a, tree: None }, SeqInput { seq: 1, tokens: &b, tree: None }], &mut cache, LogitsWanted::All)
        .expect("prefill")
        .logits_rows()
        .expect("logits");
    for step in 0..3u32 {
        let (ta, tb) = ([(step * 5 + 2) % vocab], [(step * 11 + 4) % vocab]);
        let out = model
            .forward(&[SeqInput { seq: 0, tokens: &ta, tree: None }, SeqInput { seq: 1, tokens: &tb, tree: None }], &mut cache, LogitsWanted::All)
            .expect("decode")
            .logits_rows()
            .expect("logits");
        rows.extend(out);
    }
    rows
}

#[test]
fn wgpu_forward_matches_flex() {
    for name in ["llama3", "qwen2"] {
        let dir = format!("{}/../../tests/data/tiny/{name}", env!("CARGO_MANIFEST_DIR"));
        let flex = run(&dir, &Device::flex());
        let gpu = run(&dir, &deco_kernels::select_device("wgpu").expect("wgpu device"));
        assert_eq!(flex.len(), gpu.len());
        assert_eq!(flex.len(), 11 + 5 + 2 * 3);
        let mut worst = 0.0f32;
        for (f, g) in flex.iter().zip(&gpu) {
            assert_eq!(f.len(), g.len());
            for (x, y) in f.iter().zip(g) {
                let err = (x - y).abs() / (1.0 + x.abs());
                worst = worst.max(err);
                assert!(err <= 1e-4, "{name}: flex {x} vs wgpu {y}");
            }
        }
        eprintln!("{name}: worst relative logit difference wgpu vs flex {worst:.2e}");
    }
}

/// A tiny GGUF model whose linear weights are raw random blocks of every packed type (Q8_0,
/// Q4_0, Q4_1, Q5_0, Q4_K, Q6_K: a type per fused group, rotating over layers; the tied token
/// embedding / LM head in Q6_K), with small f16 scales; hidden 256 and intermediate 512 so that
/// the 256-weight k-quant super-blocks fit every input dimension.
fn tiny_packed_gguf(arch: &str, path: &std::path::Path) {
    use deco_formats::ggml::GgmlType;
    use deco_formats::gguf::{MetadataValue as V, TensorToWrite, write_gguf};
    let (hidden, ffn, heads, kv_heads, head_dim, layers, vocab) = (256usize, 512usize, 4usize, 2usize, 64usize, 2usize, 320usize);
    let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ arch.len() as u64;
    let mut next = move || {
        state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        (state >> 33) as u32
    };
    // Small finite f16 scales (2^-8 .. 2^-6), exactly representable.
    const SCALES: [u16; 4] = [0x1C00, 0x1E00, 0x2000, 0x2200];
    let mut blocks = |ty: GgmlType, rows: usize, cols: usize| -> Vec<u8> {
        let (bb, bl, f16_at): (usize, usize, &[usize]) = match ty {
            GgmlType::Q8_0 => (34, 32, &[0]),
            GgmlType::Q4_0 => (18, 32, &[0]),
            GgmlType::Q4_1 => (20, 32, &[0, 2]),
            GgmlType::Q5_0 => (22, 32, &[0]),
            GgmlType::Q4_K => (144, 256, &[0, 2]),
            GgmlType::Q6_K => (210, 256, &[208]),
            _ => unreachable!("packed types only"),
        };
        let mut out: Vec<u8> = (0..rows * cols / bl * bb).map(|_| next() as u8).collect();
        for blk in out.chunks_exact_mut(bb) {
            for &at in f16_at {
                let s = SCALES[(next() % 4) as usize];
                blk[at..at + 2].copy_from_slice(&s.to_le_bytes());
            }
            if ty == GgmlType::Q4_K {
                // 6-bit sub-block scales and mins: keep the mins small so that weights centre.
                for b in &mut blk[4..16] {
                    *b &= 0x9f;
                }
            }
        }
        out
    };
    let f32s = |v: Vec<f32>| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let types = [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q4_K, GgmlType::Q6_K];
    let mut data: Vec<(String, Vec<usize>, GgmlType, Vec<u8>)> = Vec::new();
    data.push(("token_embd.weight".into(), vec![vocab, hidden], GgmlType::Q6_K, blocks(GgmlType::Q6_K, vocab, hidden)));
    for l in 0..layers {
        let ty = |k: usize| types[(l * 4 + k) % types.len()];
        let norm: Vec<f32> = (0..hidden).map(|i| 1.0 + 0.01 * ((i * 7 + l) % 13) as f32).collect();
        data.push((format!("blk.{l}.attn_norm.weight"), vec![hidden], GgmlType::F32, f32s(norm.clone())));
        for (name, rows) in [("attn_q", heads * head_dim), ("attn_k", kv_heads * head_dim), ("attn_v", kv_heads * head_dim)] {
            data.push((format!("blk.{l}.{name}.weight"), vec![rows, hidden], ty(0), blocks(ty(0), rows, hidden)));
            if arch == "qwen2" {
                let b: Vec<f32> = (0..rows).map(|i| 0.02 * ((i % 5) as f32 - 2.0)).collect();
                data.push((format!("blk.{l}.{name}.bias"), vec![rows], GgmlType::F32, f32s(b)));
            }
        }
        data.push((format!("blk.{l}.attn_output.weight"), vec![hidden, heads * head_dim], ty(1), blocks(ty(1), hidden, heads * head_dim)));
        data.push((format!("blk.{l}.ffn_norm.weight"), vec![hidden], GgmlType::F32, f32s(norm)));
        data.push((format!("blk.{l}.ffn_gate.weight"), vec![ffn, hidden], ty(2), blocks(ty(2), ffn, hidden)));
        data.push((format!("blk.{l}.ffn_up.weight"), vec![ffn, hidden], ty(2), blocks(ty(2), ffn, hidden)));
        data.push((format!("blk.{l}.ffn_down.weight"), vec![hidden, ffn], ty(3), blocks(ty(3), hidden, ffn)));
    }
    data.push(("output_norm.weight".into(), vec![hidden], GgmlType::F32, f32s(vec![1.0; hidden])));
    let k = |s: &str| format!("{arch}.{s}");
    let meta = vec![
        ("general.architecture".to_string(), V::String(arch.into())),
        (k("block_count"), V::U32(layers as u32)),
        (k("context_length"), V::U32(64)),
        (k("embedding_length"), V::U32(hidden as u32)),
        (k("feed_forward_length"), V::U32(ffn as u32)),
        (k("attention.head_count"), V::U32(heads as u32)),
        (k("attention.head_count_kv"), V::U32(kv_heads as u32)),
        (k("attention.layer_norm_rms_epsilon"), V::F32(1e-6)),
        (k("rope.freq_base"), V::F32(10_000.0)),
    ];
    let tensors: Vec<TensorToWrite<'_>> =
        data.iter().map(|(name, shape, ty, bytes)| TensorToWrite { name: name.clone(), shape: shape.clone(), ggml_type: *ty, data: bytes }).collect();
    write_gguf(path, &meta, &tensors).expect("write tiny GGUF");
}

/// The packed path on the GPU: a GGUF model whose linears hold every packed block type runs
/// on wgpu with its weights in their blocks (`LinearWeight::Device`, the CubeCL quantized
/// matmul; RoPE, RMSNorm and prefill attention kernels) and gives flex's logits (the CPU packed
/// kernels), prefill and batched decode, Llama (Q/K rows un-permuted) and Qwen2 (biases).
#[test]
fn wgpu_packed_gguf_matches_flex() {
    let dir = std::env::temp_dir().join(format!("deco-wgpu-packed-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    for arch in ["llama", "qwen2"] {
        let path = dir.join(format!("{arch}.gguf"));
        tiny_packed_gguf(arch, &path);
        let p = path.to_str().expect("utf-8 temp path");
        // 2 layers × (Q/K/V, O, gate/up, down) + the tied LM head, all packed: on the host for
        // flex's CPU kernels, on the device for wgpu (no f32 copy).
        let linears = 2 * 4 + 1;
        let flex = run_checked(p, &Device::flex(), |m| {
            assert_eq!(m.weight_storage(), WeightStorage { dense: 0, host_packed: linears, device_packed: 0 });
        });
        let gpu = run_checked(p, &deco_kernels::select_device("wgpu").expect("wgpu device"), |m| {
            assert_eq!(m.weight_storage(), WeightStorage { dense: 0, host_packed: 0, device_packed: linears });
        });
        assert_eq!(flex.len(), gpu.len());
        let mut worst = 0.0f32;
        let mut scale = 0.0f32;
        for (f, g) in flex.iter().zip(&gpu) {
            for (x, y) in f.iter().zip(g) {
                let err = (x - y).abs() / (1.0 + x.abs());
                worst = worst.max(err);
                scale = scale.max(x.abs());
                assert!(err <= 1e-4, "{arch}: flex {x} vs wgpu {y}");
            }
        }
        // The logits must not be trivially equal (all zero): the weights do something.
        assert!(scale > 0.1, "{arch}: logits too small to compare ({scale})");
        eprintln!("{arch} (packed GGUF): worst relative logit difference wgpu vs flex {worst:.2e}, largest |logit| {scale:.2}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
