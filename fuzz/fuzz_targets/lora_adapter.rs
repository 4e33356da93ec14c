//! PEFT LoRA adapter directories (`adapter_config.json` + `adapter_model.safetensors`) as
//! `deco generate/serve --lora DIR` read them (`HostAdapters::load`) for a model of the tiny
//! Llama 3 test configuration (`tests/data/tiny/llama3/config.json`: hidden 32, 2 layers), then
//! every adapted linear's merged delta `scaling · B A`. Input: a little-endian u16 length, that
//! many bytes of the config, then the safetensors file.
#![no_main]

use std::sync::OnceLock;

use deco_compress::lora::{ADAPTER_CONFIG, ADAPTER_WEIGHTS, HostAdapters};
use deco_formats::config::ModelConfig;
use libfuzzer_sys::fuzz_target;

/// The tiny model's configuration, parsed once.
fn model_config() -> &'static ModelConfig {
    static C: OnceLock<ModelConfig> = OnceLock::new();
    C.get_or_init(|| {
        let d = deco_fuzz::scratch_dir("lora").join("model");
        std::fs::create_dir_all(&d).expect("model config directory");
        let p = d.join("config.json");
        std::fs::write(&p, include_str!("../../tests/data/tiny/llama3/config.json")).expect("write the model config");
        ModelConfig::from_hf_json(&p).expect("the tiny test config parses")
    })
}

fuzz_target!(|data: &[u8]| {
    let cfg = model_config();
    let Some((config, st)) = deco_fuzz::split_pair(data) else { return };
    let d = deco_fuzz::scratch_dir("lora");
    deco_fuzz::write_pair(d, (ADAPTER_CONFIG, config), (ADAPTER_WEIGHTS, st));
    let Ok(a) = HostAdapters::load(d, cfg) else { return };
    for li in 0..cfg.num_hidden_layers {
        for l in deco_model::calibrate::Linear::ALL {
            let (out, inp) = l.dims(cfg);
            if let Some(delta) = a.delta(li, l, out, inp) {
                assert_eq!(delta.len(), out * inp);
            }
        }
    }
});
