//! `cargo xtask fuzz TARGET --time S`: builds the libFuzzer targets of `fuzz/` with the nightly
//! toolchain (the instrumentation flags cargo-fuzz uses: sancov inline 8-bit counters, PC table,
//! compare tracing, AddressSanitizer, debug assertions and overflow checks), seeds the corpus
//! from the real files, runs one target for S seconds and reports executions and findings.
//!
//! Layout under the cache: `fuzz/target` (build), `fuzz/corpus/TARGET` (grows across runs),
//! `fuzz/artifacts/TARGET` (crashing, leaking, timing-out inputs, named by libFuzzer).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::ValueEnum;

use crate::fetch::{self, What};
use crate::util;

/// A fuzz target of `fuzz/fuzz_targets/`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Target {
    /// GGUF header, metadata, tensor table, data offsets, and what deco derives from them.
    Gguf,
    /// Chat templates: compile and render with and without tools.
    #[value(name = "chat_template")]
    ChatTemplate,
    /// Hugging Face directories: config.json (+ quantization_config) and model.safetensors.
    #[value(name = "hf_dir")]
    HfDir,
}

impl Target {
    fn name(self) -> &'static str {
        match self {
            Target::Gguf => "gguf",
            Target::ChatTemplate => "chat_template",
            Target::HfDir => "hf_dir",
        }
    }

    /// libFuzzer's `-max_len`: large enough for real headers and templates.
    fn max_len(self) -> usize {
        match self {
            Target::Gguf => 65_536,
            Target::ChatTemplate => 16_384,
            Target::HfDir => 131_072,
        }
    }
}

/// Options of one run.
pub struct Options {
    /// The cache directory (model and tokenizer files for the seeds; build, corpus, artifacts).
    pub cache: PathBuf,
    /// Ignore the mirror when fetching the seed files.
    pub no_mirror: bool,
    /// The target.
    pub target: Target,
    /// Seconds to fuzz.
    pub time: u64,
}

const RUSTFLAGS: &str = "-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions -Coverflow-checks \
-Zsanitizer=address";
const TRIPLE: &str = "x86_64-unknown-linux-gnu";

/// Builds, seeds and runs one target; fails when libFuzzer reports a finding.
pub fn run(o: &Options) -> Result<()> {
    let root = util::workspace_root();
    let dir = o.cache.join("fuzz");
    let target_dir = dir.join("target");
    eprintln!("building fuzz targets (cargo +nightly, ASan + sancov) into {}", target_dir.display());
    util::run(
        Command::new("cargo")
            .current_dir(root.join("fuzz"))
            .args(["+nightly", "build", "--release", "--bins", "--target", TRIPLE])
            .env("RUSTFLAGS", RUSTFLAGS)
            .env("CARGO_TARGET_DIR", &target_dir),
    )
    .context("building the fuzz targets needs the nightly toolchain (`rustup toolchain install nightly`) and a C++ compiler")?;
    let bin = target_dir.join(TRIPLE).join("release").join(o.target.name());

    let corpus = dir.join("corpus").join(o.target.name());
    let artifacts = dir.join("artifacts").join(o.target.name());
    fs::create_dir_all(&corpus).with_context(|| format!("cannot create {}", corpus.display()))?;
    fs::create_dir_all(&artifacts).with_context(|| format!("cannot create {}", artifacts.display()))?;
    seed(o, &root, &corpus)?;
    let before = count_files(&artifacts)?;

    let log = dir.join(format!("{}.log", o.target.name()));
    eprintln!("fuzzing {} for {} s (log: {})", o.target.name(), o.time, log.display());
    let mut artifact_prefix = std::ffi::OsString::from("-artifact_prefix=");
    artifact_prefix.push(&artifacts);
    artifact_prefix.push("/");
    let out = Command::new(&bin)
        .arg(format!("-max_total_time={}", o.time))
        .arg(format!("-max_len={}", o.target.max_len()))
        .args(["-timeout=1", "-rss_limit_mb=2048", "-malloc_limit_mb=2048", "-print_final_stats=1"])
        .arg(&artifact_prefix)
        .arg(&corpus)
        .output()
        .with_context(|| format!("cannot run {}", bin.display()))?;
    let text = String::from_utf8_lossy(&out.stderr).into_owned();
    fs::write(&log, text.as_bytes()).with_context(|| format!("cannot write {}", log.display()))?;
    let stat = |k: &str| -> Option<u64> {
        text.lines().find_map(|l| l.strip_prefix(&format!("stat::{k}:")).and_then(|v| v.trim().parse().ok()))
    };
    let execs = stat("number_of_executed_units").unwrap_or(0);
    // libFuzzer's last line: "Done N runs in S second(s)".
    let secs = text
        .lines()
        .find_map(|l| l.strip_prefix("Done ").and_then(|r| r.split(" in ").nth(1)).and_then(|r| r.split(' ').next()).and_then(|v| v.parse::<u64>().ok()))
        .unwrap_or(o.time)
        .max(1);
    let peak = stat("peak_rss_mb").unwrap_or(0);
    let new_artifacts = count_files(&artifacts)? - before;
    println!(
        "fuzz {}: {execs} executions in {secs} s ({}/s), corpus {} inputs, peak RSS {peak} MB, {new_artifacts} new finding(s) in {}",
        o.target.name(),
        execs / secs,
        count_files(&corpus)?,
        artifacts.display()
    );
    if !out.status.success() || new_artifacts > 0 {
        let tail: Vec<&str> = text.lines().rev().take(30).collect();
        bail!(
            "libFuzzer reported a finding ({}); last lines:\n{}",
            out.status,
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    }
    Ok(())
}

fn count_files(dir: &Path) -> Result<usize> {
    Ok(fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))?.count())
}

/// Seeds an empty corpus: GGUF prefixes of the real files (4 KiB and 64 KiB of every tokenizer
/// vocabulary and of SmolLM2, covering the header, metadata and tensor table), the chat
/// templates of `fuzz/seeds/chat_template` (taken from those files' metadata), or the tiny test
/// checkpoints as (config.json, safetensors) pairs.
fn seed(o: &Options, root: &Path, corpus: &Path) -> Result<()> {
    if count_files(corpus)? > 0 {
        return Ok(());
    }
    match o.target {
        Target::Gguf => {
            fetch::fetch(&fetch::Options { cache: o.cache.clone(), no_mirror: o.no_mirror, what: vec![What::Model, What::TokenizerTests] })?;
            let mut files = vec![o.cache.join("models/SmolLM2-135M-Instruct.Q4_1.gguf")];
            let tt = o.cache.join("tokenizer-tests");
            for e in fs::read_dir(&tt).with_context(|| format!("cannot list {}", tt.display()))? {
                let p = e?.path();
                if p.extension().is_some_and(|x| x == "gguf") {
                    files.push(p);
                }
            }
            files.sort();
            for f in &files {
                let bytes = fs::read(f).with_context(|| format!("cannot read {}", f.display()))?;
                let stem = f.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
                for n in [4096usize, 65_536] {
                    let p = corpus.join(format!("{stem}-{n}"));
                    fs::write(&p, &bytes[..n.min(bytes.len())]).with_context(|| format!("cannot write {}", p.display()))?;
                }
            }
        }
        Target::HfDir => {
            // The tiny test checkpoints (tests/data/tiny): config.json + each safetensors file.
            let tiny = root.join("tests/data/tiny");
            for model in ["llama3", "qwen2"] {
                let d = tiny.join(model);
                let config = fs::read(d.join("config.json")).with_context(|| format!("cannot read {}/config.json", d.display()))?;
                for e in fs::read_dir(&d).with_context(|| format!("cannot list {}", d.display()))? {
                    let p = e?.path();
                    let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                    if !name.starts_with("model") || !name.ends_with(".safetensors") {
                        continue;
                    }
                    let mut seed = u16::try_from(config.len()).context("config.json over 64 KiB")?.to_le_bytes().to_vec();
                    seed.extend_from_slice(&config);
                    seed.extend_from_slice(&fs::read(&p).with_context(|| format!("cannot read {}", p.display()))?);
                    fs::write(corpus.join(format!("{model}-{name}")), seed).context("cannot write a seed")?;
                }
            }
        }
        Target::ChatTemplate => {
            let seeds = root.join("fuzz/seeds/chat_template");
            for e in fs::read_dir(&seeds).with_context(|| format!("cannot list {}", seeds.display()))? {
                let p = e?.path();
                let to = corpus.join(p.file_name().context("seed without a name")?);
                fs::copy(&p, &to).with_context(|| format!("cannot copy {}", p.display()))?;
            }
        }
    }
    eprintln!("seeded {} with {} inputs", corpus.display(), count_files(corpus)?);
    Ok(())
}
