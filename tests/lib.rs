//! Shared helpers of deco's integration tests: locating the real model and reference files.
//!
//! Files are looked up in `$DECO_CACHE` (filled by `cargo xtask fetch`), then in
//! `$DECO_SHARED_DIR`, then in `../shared` beside the workspace (the local mirror). A missing file
//! fails the test with a message saying how to fetch it.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::OnceLock;

/// The workspace root.
pub fn workspace_root() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// Resolves a file of the shared data layout (`models/...`, `golden/...`, `data/...`).
///
/// # Panics
/// When the file is in none of the locations: the test cannot run without it.
pub fn asset(rel: &str) -> PathBuf {
    let mut candidates = Vec::new();
    if let Ok(c) = std::env::var("DECO_CACHE") {
        candidates.push(PathBuf::from(c).join(rel));
    }
    candidates.push(workspace_root().join(".cache").join(rel));
    if let Ok(s) = std::env::var("DECO_SHARED_DIR") {
        candidates.push(PathBuf::from(s).join(rel));
    }
    candidates.push(workspace_root().join("../shared").join(rel));
    for c in &candidates {
        if c.exists() {
            return c.clone();
        }
    }
    panic!("{rel} not found (looked in {candidates:?}); run `cargo xtask fetch` first")
}

/// The default model: SmolLM2-135M-Instruct, Q4_1 GGUF.
pub fn smollm2_gguf() -> PathBuf {
    asset("models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// Largest element-wise absolute difference of two equally long slices.
///
/// # Panics
/// When the lengths differ.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "comparing slices of different lengths");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Index of the largest value, the lowest index on ties (greedy decoding's rule).
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (`cargo xtask fetch --what qwen-0.5b`; the test
/// tier fetches it): the tool-calling model.
pub fn qwen05b_gguf() -> PathBuf {
    asset("models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
}

/// The float64 golden reference of SmolLM2 (`golden/smollm2-135m-instruct.{json,safetensors}`:
/// a numpy forward over gguf-py's dequantization, sharing no code with deco's model).
#[derive(Debug)]
pub struct Golden {
    /// The prompts' JSON records (`index`, `ids`, greedy continuation, margins).
    pub prompts: Vec<serde_json::Value>,
    /// Reference tensors by name (`prompt{i}.last_logits` `[vocab]`, `prompt0.all_logits`
    /// `[tokens, vocab]`): shape and f32 values.
    pub tensors: HashMap<String, (Vec<usize>, Vec<f32>)>,
}

/// The golden reference, read once.
///
/// # Panics
/// When the files are missing or malformed (see [`asset`]).
pub fn golden() -> &'static Golden {
    static G: OnceLock<Golden> = OnceLock::new();
    G.get_or_init(|| {
        let json: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(asset("golden/smollm2-135m-instruct.json")).expect("read golden json"),
        )
        .expect("parse golden json");
        let bytes = std::fs::read(asset("golden/smollm2-135m-instruct.safetensors")).expect("read golden safetensors");
        let st = safetensors::SafeTensors::deserialize(&bytes).expect("parse golden safetensors");
        let mut tensors = HashMap::new();
        for (name, view) in st.tensors() {
            assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
            let data = view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            tensors.insert(name, (view.shape().to_vec(), data));
        }
        Golden { prompts: json["prompts"].as_array().expect("prompts").clone(), tensors }
    })
}

/// A JSON list of token ids.
///
/// # Panics
/// When `v` is not a list of non-negative integers.
pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().expect("id list").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}
