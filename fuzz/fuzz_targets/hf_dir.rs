//! Hugging Face model directories: `config.json` (with `quantization_config`) and a
//! `model.safetensors`, then every tensor deco would load by its transformers name, including
//! the packed GPTQ / AWQ / compressed-tensors linears. Input layout: a little-endian u16 length,
//! that many bytes of config.json, then the safetensors file.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use deco_formats::checkpoint::{Checkpoint, hf_tensor_names};
use libfuzzer_sys::fuzz_target;

fn dir() -> &'static PathBuf {
    static D: OnceLock<PathBuf> = OnceLock::new();
    D.get_or_init(|| {
        let base = if std::path::Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
        let d = base.join(format!("deco-fuzz-hf-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("fuzz scratch directory");
        d
    })
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let n = usize::from(u16::from_le_bytes([data[0], data[1]])).min(data.len() - 2);
    let (config, st) = data[2..].split_at(n);
    let d = dir();
    std::fs::write(d.join("config.json"), config).expect("write config");
    std::fs::write(d.join("model.safetensors"), st).expect("write safetensors");
    let Ok(ck) = Checkpoint::open(d) else { return };
    for name in hf_tensor_names(&ck.config).iter().take(4096) {
        let _ = ck.tensor(name);
        let _ = ck.quantized_linear(name);
    }
});
