//! Hugging Face model directories: `config.json` (with `quantization_config`) and a
//! `model.safetensors`, then every tensor deco would load by its transformers name, including
//! the packed GPTQ / AWQ / compressed-tensors linears. Input layout: a little-endian u16 length,
//! that many bytes of config.json, then the safetensors file.
#![no_main]

use deco_formats::checkpoint::{Checkpoint, hf_tensor_names};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((config, st)) = deco_fuzz::split_pair(data) else { return };
    let d = deco_fuzz::scratch_dir("hf");
    deco_fuzz::write_pair(d, ("config.json", config), ("model.safetensors", st));
    let Ok(ck) = Checkpoint::open(d) else { return };
    for name in hf_tensor_names(&ck.config).iter().take(4096) {
        let _ = ck.tensor(name);
        let _ = ck.quantized_linear(name);
    }
});
