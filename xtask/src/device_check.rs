//! `cargo xtask device-check`: prepares the one-shot GPU check of issue 13 in `device-check/`
//! (git-ignored), to be carried to a device machine and run there with
//! `bash device-check/run.sh`.
//!
//! The device machine cannot fetch anything and takes at most 64 MiB of files per call, so
//! the folder holds only what the check needs (see `xtask/scripts/device_check.sh`):
//! - `deco` (or `deco.xz` when large): the CUDA release binary of `cargo xtask build --cuda`,
//!   stripped;
//! - `smollm2.header`, `qwen1.5b.header`: the headers (metadata, tokenizer, tensor table) of
//!   SmolLM2-135M-Instruct Q4_1 and Qwen2.5-Coder-1.5B-Instruct Q4_K_M, from which
//!   `gguf_shape_clone.py fill` writes same-shape files with random weights there;
//! - `fidelity.txt` (the fidelity prompts of the golden reference), `wiki.txt` (8,000
//!   characters of the Wikipedia test text), `prompt512.txt` and
//!   `prompt128.txt` (prompts of about 512 and 128 tokens);
//! - the scripts `run.sh`, `gguf_shape_clone.py`, `device_streams.py`.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::fetch::{self, What};
use crate::util;
use crate::{cuda, python};

/// Options of `cargo xtask device-check`.
pub struct Options {
    /// The cache directory.
    pub cache: PathBuf,
    /// Ignore the mirror.
    pub no_mirror: bool,
    /// A CUDA `deco` binary to use instead of building one.
    pub deco_bin: Option<PathBuf>,
    /// `CUDARC_CUDA_VERSION` of the build.
    pub cuda_version: String,
}

/// A binary over this size travels xz-compressed.
const COMPRESS_OVER: u64 = 24 << 20;

/// What travels: at most this many bytes (the tool's 64 MiB, less the repository itself).
const BUDGET: u64 = 56 << 20;

/// The first `chars` characters of `text`, cut after the last whole word.
fn words(text: &str, chars: usize) -> String {
    let cut: String = text.chars().take(chars).collect();
    match cut.rfind(char::is_whitespace) {
        Some(i) if cut.chars().count() == chars => cut[..i].to_string(),
        _ => cut,
    }
}

/// Prepares `device-check/`.
///
/// # Errors
/// Missing models (fetched first), a failed build, or a folder over the carry budget.
pub fn prepare(opts: &Options) -> Result<()> {
    fetch::fetch(&fetch::Options { cache: opts.cache.clone(), no_mirror: opts.no_mirror, what: vec![What::Model, What::Data, What::Golden, What::Qwen15b] })?;
    let dir = util::workspace_root().join("device-check");
    if dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("cannot clear {}", dir.display()))?;
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;

    let bin = match &opts.deco_bin {
        Some(b) => b.clone(),
        None => {
            let target = opts.cache.join("cuda").join("target");
            cuda::build(&cuda::Options { cache: opts.cache.clone(), check: false, target_dir: Some(target.clone()), cuda_version: opts.cuda_version.clone() })?;
            target.join("release").join("deco")
        }
    };
    if !bin.is_file() {
        bail!("{}: no such binary", bin.display());
    }
    let dest = dir.join("deco");
    std::fs::copy(&bin, &dest).with_context(|| format!("cannot copy {}", bin.display()))?;
    util::run(Command::new("strip").arg(&dest)).context("strip (binutils) failed")?;
    if util::file_size(&dest).unwrap_or(0) > COMPRESS_OVER {
        // The CUDA binary links LLVM statically; run.sh decompresses it with Python's lzma.
        util::run(Command::new("xz").args(["-T2", "-6", "-f"]).arg(&dest)).context("xz failed")?;
    }

    let py = python::system_python();
    let models = opts.cache.join("models");
    for (name, file) in [("smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"), ("qwen1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")] {
        util::run(Command::new(&py).arg(python::script("gguf_shape_clone.py")).arg("header").arg(models.join(file)).arg(dir.join(format!("{name}.header"))))?;
    }
    for s in ["gguf_shape_clone.py", "device_streams.py"] {
        std::fs::copy(python::script(s), dir.join(s)).with_context(|| format!("cannot copy {s}"))?;
    }
    std::fs::copy(python::script("device_check.sh"), dir.join("run.sh")).context("cannot copy device_check.sh")?;

    let wiki_path = opts.cache.join("data").join("wiki_test.txt");
    let wiki = std::fs::read_to_string(&wiki_path).with_context(|| format!("cannot read {}", wiki_path.display()))?;
    std::fs::write(dir.join("wiki.txt"), words(&wiki, 8000))?;
    // About 4.3 characters per token for both tokenizers on this text.
    std::fs::write(dir.join("prompt512.txt"), words(&wiki, 2400))?;
    std::fs::write(dir.join("prompt128.txt"), words(&wiki, 550))?;

    // The fidelity prompts (the golden reference's), for the CUDA-vs-CPU logits check.
    let golden_path = opts.cache.join("golden").join("smollm2-135m-instruct.json");
    let golden: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&golden_path).with_context(|| format!("cannot read {}", golden_path.display()))?)
        .with_context(|| format!("{}: not JSON", golden_path.display()))?;
    let prompts: Vec<&str> = golden["prompts"].as_array().map(|a| a.iter().filter_map(|p| p["text"].as_str()).collect()).unwrap_or_default();
    if prompts.is_empty() {
        bail!("{}: no prompts", golden_path.display());
    }
    std::fs::write(dir.join("fidelity.txt"), prompts.join("\n\n"))?;

    let total = folder_bytes(&dir)?;
    eprintln!("device-check/: {} (budget {})", util::human_bytes(total), util::human_bytes(BUDGET));
    if total > BUDGET {
        bail!("device-check/ holds {} bytes, over the {BUDGET}-byte carry budget", total);
    }
    eprintln!(
        "run it on a device machine: run(command = \"bash device-check/run.sh\", carry = [\"device-check\"], timeout_s = 420); results under $OUT"
    );
    Ok(())
}

/// Markers of the device-check section of docs/performance.md.
const BEGIN: &str = "<!-- device check begin -->";
const END: &str = "<!-- device check end -->";

/// Renders a device check's results (`$OUT` of `run.sh`, brought back by the device tool) as
/// markdown.
///
/// # Errors
/// A missing or malformed `summary.json`.
pub fn render(out: &Path) -> Result<String> {
    let read = |name: &str| std::fs::read_to_string(out.join(name)).unwrap_or_default();
    let summary: serde_json::Value = serde_json::from_str(&read("summary.json")).with_context(|| format!("{}: no valid summary.json", out.display()))?;
    let gpu = read("gpu.csv");
    let gpu = gpu.lines().nth(1).unwrap_or("(not recorded)").trim().to_string();
    let bw = summary["bandwidth_gb_s"].as_f64().map_or("not measured".to_string(), |b| format!("{b:.0} GB/s"));
    let mut md = format!(
        "Measured by `bash device-check/run.sh` (prepared by `cargo xtask device-check`) on {gpu}; copy bandwidth \
         (PyTorch device-to-device, bytes read + written) {bw}. Models: shape clones (real header and \
         tokenizer, random weights) of SmolLM2-135M-Instruct Q4_1 and Qwen2.5-Coder-1.5B-Instruct Q4_K_M.\n\n\
         | model | KL CUDA vs CPU (fidelity prompts) | top-1 agreement | prefill tok/s (512) | decode tok/s (batch 1) | weight MB / token | limit tok/s | fraction of limit | 16 streams tok/s | 64 streams tok/s |\n\
         |---|---|---|---|---|---|---|---|---|---|\n"
    );
    for m in ["smollm2", "qwen1.5b"] {
        let r = &summary[m];
        if r.is_null() {
            continue;
        }
        let kld = read(&format!("{m}.kld-fidelity.txt"));
        let field = |k: &str| kld.lines().find_map(|l| l.strip_prefix(&format!("{k}="))).unwrap_or("–").to_string();
        let f = |k: &str, d: usize| r[k].as_f64().map_or("–".to_string(), |v| format!("{v:.d$}"));
        let streams = |n: u64| {
            r["streams"].as_array().and_then(|a| a.iter().find(|s| s["streams"].as_u64() == Some(n))).and_then(|s| s["tok_s"].as_f64()).map_or("–".to_string(), |v| format!("{v:.1}"))
        };
        let mb = r["weight_bytes_per_token"].as_f64().map_or("–".to_string(), |b| format!("{:.1}", b / 1e6));
        let frac = r["fraction_of_limit"].as_f64().map_or("–".to_string(), |v| format!("{:.1} %", 100.0 * v));
        md.push_str(&format!(
            "| {m} | {} | {} | {} | {} | {mb} | {} | {frac} | {} | {} |\n",
            field("kld"),
            field("top1_agreement"),
            f("prefill_tok_s", 1),
            f("decode_tok_s", 1),
            f("limit_tok_s", 0),
            streams(16),
            streams(64)
        ));
    }
    Ok(md)
}

/// `cargo xtask device-check --record DIR`: writes [`render`]'s table into docs/performance.md
/// between its device-check markers.
///
/// # Errors
/// [`render`]'s, or docs/performance.md without the markers.
pub fn record(out: &Path) -> Result<()> {
    let md = render(out)?;
    let doc = util::workspace_root().join("docs").join("performance.md");
    let text = std::fs::read_to_string(&doc).with_context(|| format!("cannot read {}", doc.display()))?;
    let (Some(b), Some(e)) = (text.find(BEGIN), text.find(END)) else {
        bail!("{}: no {BEGIN} / {END} markers", doc.display());
    };
    let new = format!("{}{BEGIN}\n{md}{}", &text[..b], &text[e..]);
    let tmp = doc.with_extension("md.tmp");
    std::fs::write(&tmp, new).with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, &doc).with_context(|| format!("cannot replace {}", doc.display()))?;
    eprintln!("{}: device check results recorded", doc.display());
    Ok(())
}

fn folder_bytes(dir: &Path) -> Result<u64> {
    let mut total = 0;
    for e in std::fs::read_dir(dir)? {
        total += e?.metadata()?.len();
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::words;

    #[test]
    fn renders_a_dry_run() {
        let dir = std::env::temp_dir().join(format!("deco-devcheck-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        std::fs::write(dir.join("gpu.csv"), "name, memory.total\nNVIDIA H200, 143771 MiB\n").expect("write");
        std::fs::write(dir.join("smollm2.kld-fidelity.txt"), "kld=0.000001\ntop1_agreement=1.0000\n").expect("write");
        let summary = serde_json::json!({"bandwidth_gb_s": 4300.0, "smollm2": {"weight_bytes_per_token": 96576768, "limit_tok_s": 44524.0,
            "prefill_tok_s": 5000.0, "decode_tok_s": 900.0, "fraction_of_limit": 0.0202, "streams": [{"streams": 16, "tok_s": 4000.0}]}});
        std::fs::write(dir.join("summary.json"), summary.to_string()).expect("write");
        let md = super::render(&dir).expect("render");
        assert!(md.contains("NVIDIA H200, 143771 MiB"), "{md}");
        assert!(md.contains("| smollm2 | 0.000001 | 1.0000 | 5000.0 | 900.0 | 96.6 | 44524 | 2.0 % | 4000.0 | – |"), "{md}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn prompts_end_on_a_word() {
        assert_eq!(words("alpha beta gamma", 8), "alpha");
        assert_eq!(words("alpha", 8), "alpha");
    }
}
