//! Locating the real input files of deco-formats' tests.

use std::path::PathBuf;

/// Resolves a file of the shared data layout (`models/...`, `tokenizer-tests/...`): `$DECO_CACHE`
/// (filled by `cargo xtask fetch`, from the package registry when there is no mirror), then
/// `<workspace>/.cache`, then `$DECO_SHARED_DIR`, then the mirror `../shared`.
///
/// # Panics
/// When the file is in none of them, naming the command that fetches it.
pub fn asset(rel: &str) -> PathBuf {
    let mut candidates = Vec::new();
    if let Some(d) = std::env::var_os("DECO_CACHE") {
        candidates.push(PathBuf::from(d).join(rel));
    }
    candidates.push(PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../.cache")).join(rel));
    if let Some(d) = std::env::var_os("DECO_SHARED_DIR") {
        candidates.push(PathBuf::from(d).join(rel));
    }
    candidates.push(PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared")).join(rel));
    candidates.iter().find(|c| c.exists()).cloned().unwrap_or_else(|| {
        panic!("{rel} not found (looked in {candidates:?}); run `cargo xtask fetch` (or `cargo xtask test`) first")
    })
}

/// The default model: SmolLM2-135M-Instruct, Q4_1 GGUF.
#[allow(dead_code)] // not every test file uses it
pub fn smollm2_gguf() -> PathBuf {
    asset("models/SmolLM2-135M-Instruct.Q4_1.gguf")
}
