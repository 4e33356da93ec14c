//! The reference implementation's checkpoint layout (`config.json` with `model_type:
//! "autodeco"` over the base configuration, head tensors in `model.safetensors`): export,
//! import, bit-exact round trips, and clear errors for heads that do not fit.

use std::path::Path;

use burn::tensor::Device;
use deco_autodeco::heads::{AutoDecoConfig, AutoDecoHeads, CONFIG_FILE, HostHeads, OFFICIAL_CONFIG_FILE, OFFICIAL_WEIGHTS_FILE, WEIGHTS_FILE};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use safetensors::tensor::TensorView;

/// The tiny Llama 3 checkpoint's transformers configuration (hidden 32, vocabulary 97).
fn base_config() -> serde_json::Value {
    let p = format!("{}/../../tests/data/tiny/llama3/config.json", env!("CARGO_MANIFEST_DIR"));
    serde_json::from_str(&std::fs::read_to_string(p).expect("tiny config")).expect("JSON")
}

fn heads(cfg: &AutoDecoConfig) -> HostHeads {
    AutoDecoHeads::init(cfg, &Device::flex()).expect("init").to_host(cfg).expect("host")
}

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("deco-official-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn bytes(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Predictions of both heads on a few random inputs, as bits.
fn predictions(h: &HostHeads, seed: u64) -> Vec<(u32, u32)> {
    let cfg = h.config();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..5)
        .map(|_| {
            let hidden: Vec<f32> = (0..cfg.hidden_size).map(|_| rng.random_range(-3.0f32..3.0)).collect();
            let logits: Vec<f32> = (0..cfg.vocab_size).map(|_| rng.random_range(-8.0f32..8.0)).collect();
            let o = h.predict(&hidden, &logits).expect("predict");
            (o.temperature.to_bits(), o.top_p.to_bits())
        })
        .collect()
}

#[test]
fn export_import_round_trips_bit_exact() {
    let base = base_config();
    for enhanced in [true, false] {
        let cfg = AutoDecoConfig { use_enhanced_features: enhanced, ..AutoDecoConfig::new(32, 97) };
        let h = heads(&cfg);
        let a = tmp(&format!("a-{enhanced}"));
        h.export_official(&a, &base, "HuggingFaceTB/tiny-llama3").expect("export");
        // The reference's configuration: the base fields plus the AutoDeco ones.
        let c: serde_json::Value = serde_json::from_slice(&bytes(&a.join(OFFICIAL_CONFIG_FILE))).expect("JSON");
        assert_eq!(c["model_type"], "autodeco");
        assert_eq!(c["base_model_type"], "llama");
        assert_eq!(c["base_model_name_or_path"], "HuggingFaceTB/tiny-llama3");
        assert_eq!(c["architectures"], serde_json::json!(["AutoDecoModelForCausalLM"]));
        assert_eq!(c["temperature_hidden_size"], 32);
        assert_eq!(c["top_p_hidden_size"], 32);
        assert_eq!(c["use_enhanced_features"], enhanced);
        assert_eq!(c["num_hidden_layers"], base["num_hidden_layers"]);
        assert_eq!(c["rope_scaling"], base["rope_scaling"]);
        // Exactly the reference's head tensors, PyTorch `nn.Linear` shapes.
        let w = bytes(&a.join(OFFICIAL_WEIGHTS_FILE));
        let st = safetensors::SafeTensors::deserialize(&w).expect("safetensors");
        let mut names: Vec<String> = st.names().into_iter().map(str::to_string).collect();
        names.sort();
        assert_eq!(
            names,
            ["temp_head.mlp.0.bias", "temp_head.mlp.0.weight", "temp_head.mlp.2.bias", "temp_head.mlp.2.weight", "top_p_head.mlp.0.bias", "top_p_head.mlp.0.weight", "top_p_head.mlp.2.bias", "top_p_head.mlp.2.weight"]
        );
        let top_in = 32 + 1 + if enhanced { 4 } else { 0 };
        assert_eq!(st.tensor("top_p_head.mlp.0.weight").expect("t").shape(), [256, top_in]);
        assert_eq!(st.tensor("temp_head.mlp.0.weight").expect("t").shape(), [256, 32]);

        // Import: same configuration, same predictions bit for bit, and a second export and a
        // deco-layout save write the same bytes as the first.
        let back = HostHeads::load(&a).expect("load official");
        assert_eq!(back.config().without_base_model(), cfg.without_base_model());
        assert_eq!(back.config().base_model.as_deref(), Some("HuggingFaceTB/tiny-llama3"));
        assert_eq!(predictions(&back, 7), predictions(&h, 7));
        let b = tmp(&format!("b-{enhanced}"));
        back.export_official(&b, &base, "HuggingFaceTB/tiny-llama3").expect("export again");
        assert_eq!(bytes(&b.join(OFFICIAL_WEIGHTS_FILE)), w);
        assert_eq!(bytes(&b.join(OFFICIAL_CONFIG_FILE)), bytes(&a.join(OFFICIAL_CONFIG_FILE)));
        let (d1, d2) = (tmp(&format!("d1-{enhanced}")), tmp(&format!("d2-{enhanced}")));
        h.save(&d1).expect("save");
        back.save(&d2).expect("save");
        assert_eq!(bytes(&d1.join(WEIGHTS_FILE)), bytes(&d2.join(WEIGHTS_FILE)));
        // The deco layout still loads, and wins when a directory has both configurations.
        assert_eq!(predictions(&HostHeads::load(&d1).expect("deco layout"), 7), predictions(&h, 7));
        assert!(d1.join(CONFIG_FILE).exists());
        for d in [a, b, d1, d2] {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// The reference's loader reads every `*.safetensors` of the directory: heads split over two
/// files load the same.
#[test]
fn heads_split_over_files_load() {
    let cfg = AutoDecoConfig::new(32, 97);
    let h = heads(&cfg);
    let a = tmp("split");
    h.export_official(&a, &base_config(), "base").expect("export");
    let w = bytes(&a.join(OFFICIAL_WEIGHTS_FILE));
    let st = safetensors::SafeTensors::deserialize(&w).expect("safetensors");
    let part = |prefix: &str| -> Vec<u8> {
        let views: Vec<(String, TensorView<'_>)> =
            st.tensors().into_iter().filter(|(n, _)| n.starts_with(prefix)).collect();
        safetensors::serialize(views, None).expect("serialize")
    };
    let (t, p) = (part("temp_head"), part("top_p_head"));
    std::fs::remove_file(a.join(OFFICIAL_WEIGHTS_FILE)).expect("rm");
    std::fs::write(a.join("model-00001-of-00002.safetensors"), t).expect("write");
    std::fs::write(a.join("model-00002-of-00002.safetensors"), p).expect("write");
    assert_eq!(predictions(&HostHeads::load(&a).expect("split load"), 3), predictions(&h, 3));
    let _ = std::fs::remove_dir_all(a);
}

#[test]
fn bad_heads_give_clear_errors() {
    let base = base_config();
    let cfg = AutoDecoConfig::new(32, 97);
    let h = heads(&cfg);

    // Heads the reference cannot hold, or a base that is not theirs: refused at export.
    let mut wrong_base = base.clone();
    wrong_base["hidden_size"] = 64.into();
    let e = h.export_official(&tmp("x"), &wrong_base, "b").expect_err("hidden mismatch").to_string();
    assert!(e.contains("hidden_size"), "{e}");
    let mut wrong_vocab = base.clone();
    wrong_vocab["vocab_size"] = 98.into();
    let e = h.export_official(&tmp("x"), &wrong_vocab, "b").expect_err("vocab mismatch").to_string();
    assert!(e.contains("vocab_size"), "{e}");
    let normed = AutoDecoConfig { temp_layer_norm: true, ..cfg.clone() };
    let e = heads(&normed).export_official(&tmp("x"), &base, "b").expect_err("norm").to_string();
    assert!(e.contains("LayerNorm"), "{e}");
    let narrow = AutoDecoConfig { head_hidden_size: 64, ..cfg.clone() };
    let e = heads(&narrow).export_official(&tmp("x"), &base, "b").expect_err("width").to_string();
    assert!(e.contains("256"), "{e}");

    let dir = tmp("bad");
    h.export_official(&dir, &base, "b").expect("export");
    let w = bytes(&dir.join(OFFICIAL_WEIGHTS_FILE));
    let config = bytes(&dir.join(OFFICIAL_CONFIG_FILE));
    let rewrite = |f: &dyn Fn(&mut serde_json::Value)| {
        let mut c: serde_json::Value = serde_json::from_slice(&config).expect("JSON");
        f(&mut c);
        std::fs::write(dir.join(OFFICIAL_CONFIG_FILE), serde_json::to_vec(&c).expect("json")).expect("write");
    };

    // A missing tensor is named.
    let st = safetensors::SafeTensors::deserialize(&w).expect("safetensors");
    let views: Vec<(String, TensorView<'_>)> = st.tensors().into_iter().filter(|(n, _)| n != "top_p_head.mlp.2.bias").collect();
    std::fs::write(dir.join(OFFICIAL_WEIGHTS_FILE), safetensors::serialize(views, None).expect("serialize")).expect("write");
    let e = HostHeads::load(&dir).expect_err("missing tensor").to_string();
    assert!(e.contains("top_p_head.mlp.2.bias"), "{e}");
    std::fs::write(dir.join(OFFICIAL_WEIGHTS_FILE), &w).expect("restore");
    assert!(HostHeads::load(&dir).is_ok());

    // Heads of another hidden size than the configuration says.
    rewrite(&|c| {
        c["temperature_hidden_size"] = 48.into();
        c["top_p_hidden_size"] = 48.into();
    });
    let e = HostHeads::load(&dir).expect_err("wrong hidden size").to_string();
    assert!(e.contains("temp_head.mlp.0.weight") && e.contains("[256, 32]") && e.contains("48"), "{e}");

    // Not an AutoDeco configuration; a disabled head; no vocabulary.
    rewrite(&|c| c["model_type"] = "llama".into());
    let e = HostHeads::load(&dir).expect_err("model_type").to_string();
    assert!(e.contains("autodeco"), "{e}");
    rewrite(&|c| c["enable_top_p_head"] = false.into());
    let e = HostHeads::load(&dir).expect_err("disabled").to_string();
    assert!(e.contains("enable_top_p_head"), "{e}");
    rewrite(&|c| {
        c.as_object_mut().expect("object").remove("vocab_size");
    });
    let e = HostHeads::load(&dir).expect_err("vocab").to_string();
    assert!(e.contains("vocab_size"), "{e}");

    // A directory with neither configuration.
    let empty = tmp("empty");
    std::fs::create_dir_all(&empty).expect("dir");
    let e = HostHeads::load(&empty).expect_err("empty").to_string();
    assert!(e.contains(CONFIG_FILE), "{e}");
    for d in [dir, empty] {
        let _ = std::fs::remove_dir_all(d);
    }
}
