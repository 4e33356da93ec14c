//! `cargo xtask fuzz TARGET --time S`: builds the libFuzzer targets of `fuzz/` with the nightly
//! toolchain (the instrumentation cargo-fuzz uses: sancov inline 8-bit counters, PC table and
//! compare tracing, set per package in `fuzz/Cargo.toml`; AddressSanitizer, debug assertions
//! and overflow checks for every crate), seeds the corpus
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
    /// Hugging Face tokenizers: tokenizer_config.json and tokenizer.json, encode and decode.
    #[value(name = "hf_tokenizer")]
    HfTokenizer,
    /// OpenAI request bodies through the server's own parsers (`prepare_completion`/`prepare_chat`).
    #[value(name = "openai_request")]
    OpenaiRequest,
    /// AutoDeco head directories: autodeco_config.json and autodeco_heads.safetensors.
    #[value(name = "autodeco_heads")]
    AutodecoHeads,
    /// Medusa head directories: config.json and medusa_lm_head.safetensors.
    #[value(name = "medusa_heads")]
    MedusaHeads,
    /// PEFT LoRA adapter directories: adapter_config.json and adapter_model.safetensors.
    #[value(name = "lora_adapter")]
    LoraAdapter,
}

impl Target {
    fn name(self) -> &'static str {
        match self {
            Target::Gguf => "gguf",
            Target::ChatTemplate => "chat_template",
            Target::HfDir => "hf_dir",
            Target::HfTokenizer => "hf_tokenizer",
            Target::OpenaiRequest => "openai_request",
            Target::AutodecoHeads => "autodeco_heads",
            Target::MedusaHeads => "medusa_heads",
            Target::LoraAdapter => "lora_adapter",
        }
    }

    /// libFuzzer's `-max_len`: large enough for real headers and templates.
    fn max_len(self) -> usize {
        match self {
            Target::Gguf => 65_536,
            Target::ChatTemplate => 16_384,
            Target::HfDir => 131_072,
            Target::HfTokenizer => 65_536,
            Target::OpenaiRequest => 16_384,
            Target::AutodecoHeads => 16_384,
            Target::MedusaHeads => 16_384,
            Target::LoraAdapter => 16_384,
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

/// Flags for every crate: AddressSanitizer, debug assertions, overflow checks. The coverage
/// instrumentation (sancov inline 8-bit counters, PC table, compare tracing, as cargo-fuzz sets
/// it) is in `fuzz/Cargo.toml`'s release profile, per package.
const RUSTFLAGS: &str = "--cfg fuzzing -Cdebug-assertions -Coverflow-checks -Zsanitizer=address";
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
    let model = o.cache.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if o.target == Target::OpenaiRequest {
        fetch::fetch(&fetch::Options { cache: o.cache.clone(), no_mirror: o.no_mirror, what: vec![What::Model] })?;
    }
    let out = Command::new(&bin)
        .env("DECO_FUZZ_MODEL", &model)
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
                    let st = fs::read(&p).with_context(|| format!("cannot read {}", p.display()))?;
                    fs::write(corpus.join(format!("{model}-{name}")), pair_seed(&config, &st)?).context("cannot write a seed")?;
                }
            }
        }
        Target::HfTokenizer => seed_tokenizers(o, corpus)?,
        Target::AutodecoHeads => seed_heads(root, corpus)?,
        Target::ChatTemplate | Target::OpenaiRequest | Target::MedusaHeads | Target::LoraAdapter => {
            let seeds = root.join("fuzz/seeds").join(o.target.name());
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

/// A seed of the (u16 length, first file, second file) layout of `hf_dir`, `hf_tokenizer` and
/// `autodeco_heads` (`deco_fuzz::split_pair` reads it).
fn pair_seed(first: &[u8], second: &[u8]) -> Result<Vec<u8>> {
    let mut seed = u16::try_from(first.len()).context("first file of a seed over 64 KiB")?.to_le_bytes().to_vec();
    seed.extend_from_slice(first);
    seed.extend_from_slice(second);
    Ok(seed)
}

/// `hf_tokenizer` seeds from SmolLM2's real tokenizer: `deco convert` writes its Hugging Face
/// files (once, into `<cache>/fuzz/smollm2-hf`), then the byte-level BPE is cut to its first
/// `n` tokens (64 and 300; the merges among them, special tokens kept) so that one execution
/// stays fast; with and without tokenizer_config.json.
fn seed_tokenizers(o: &Options, corpus: &Path) -> Result<()> {
    fetch::fetch(&fetch::Options { cache: o.cache.clone(), no_mirror: o.no_mirror, what: vec![What::Model] })?;
    let hf = o.cache.join("fuzz/smollm2-hf");
    if !hf.join("tokenizer.json").is_file() {
        let deco = crate::bench::deco_binary(None)?;
        util::run(Command::new(&deco).arg("convert").arg(o.cache.join("models/SmolLM2-135M-Instruct.Q4_1.gguf")).arg(&hf).args(["--dtype", "bf16"]))
            .context("deco convert (for the tokenizer seeds)")?;
    }
    let read = |n: &str| fs::read(hf.join(n)).with_context(|| format!("cannot read {}/{n}", hf.display()));
    let config = read("tokenizer_config.json")?;
    let full: serde_json::Value = serde_json::from_slice(&read("tokenizer.json")?).context("tokenizer.json")?;
    for n in [64usize, 300] {
        let mut t = full.clone();
        let vocab = t["model"]["vocab"].as_object().context("tokenizer.json without model.vocab")?;
        let keep: serde_json::Map<String, serde_json::Value> =
            vocab.iter().filter(|(_, id)| id.as_u64().is_some_and(|i| (i as usize) < n)).map(|(k, v)| (k.clone(), v.clone())).collect();
        let merges: Vec<serde_json::Value> = t["model"]["merges"]
            .as_array()
            .map(|m| {
                m.iter()
                    .filter(|x| {
                        let parts: Vec<String> = match x {
                            serde_json::Value::String(s) => s.split(' ').map(str::to_string).collect(),
                            serde_json::Value::Array(a) => a.iter().filter_map(|p| p.as_str().map(str::to_string)).collect(),
                            _ => vec![],
                        };
                        parts.len() == 2 && keep.contains_key(&parts[0]) && keep.contains_key(&parts[1]) && keep.contains_key(&parts.concat())
                    })
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        t["model"]["vocab"] = serde_json::Value::Object(keep);
        t["model"]["merges"] = serde_json::Value::Array(merges);
        let bytes = serde_json::to_vec(&t)?;
        fs::write(corpus.join(format!("smollm2-{n}-with-config")), pair_seed(&config, &bytes)?)?;
        fs::write(corpus.join(format!("smollm2-{n}")), pair_seed(b"", &bytes)?)?;
    }
    Ok(())
}

/// `autodeco_heads` seeds: the shipped SmolLM2 heads (assets/autodeco) cut to tiny sizes (hidden
/// 8, head hidden 4, vocabulary 16: the top-left block of every real tensor), with and without
/// the enhanced features and the temperature LayerNorm, written as safetensors by hand (8-byte
/// header length, JSON header, little-endian f32 data).
fn seed_heads(root: &Path, corpus: &Path) -> Result<()> {
    let real = root.join("assets/autodeco/smollm2-135m-instruct-gsm/autodeco_heads.safetensors");
    let bytes = fs::read(&real).with_context(|| format!("cannot read {}", real.display()))?;
    let hlen = u64::from_le_bytes(bytes.get(..8).context("short safetensors")?.try_into()?) as usize;
    let header: serde_json::Value = serde_json::from_slice(bytes.get(8..8 + hlen).context("short safetensors header")?)?;
    let data = &bytes[8 + hlen..];
    // The real tensor `name` cut to `rows x cols` (zeros where the real one is smaller).
    let cut = |name: &str, rows: usize, cols: usize| -> Result<Vec<f32>> {
        let h = &header[name];
        let shape: Vec<usize> = h["shape"].as_array().context("shape")?.iter().filter_map(|v| v.as_u64().map(|x| x as usize)).collect();
        let start = h["data_offsets"][0].as_u64().context("offsets")? as usize;
        let (r0, c0) = if shape.len() == 2 { (shape[0], shape[1]) } else { (1, shape[0]) };
        let at = |r: usize, c: usize| -> f32 {
            if r >= r0 || c >= c0 {
                return 0.0;
            }
            let o = start + 4 * (r * c0 + c);
            data.get(o..o + 4).map_or(0.0, |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        };
        Ok((0..rows).flat_map(|r| (0..cols).map(move |c| (r, c))).map(|(r, c)| at(r, c)).collect())
    };
    let (h, k, vocab) = (8usize, 4usize, 16usize);
    for (enhanced, norm) in [(true, false), (false, false), (true, true)] {
        let top_in = h + 1 + if enhanced { 4 } else { 0 };
        let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = vec![
            ("temp_head.mlp.0.weight".into(), vec![k, h], cut("temp_head.mlp.0.weight", k, h)?),
            ("temp_head.mlp.0.bias".into(), vec![k], cut("temp_head.mlp.0.bias", 1, k)?),
            ("temp_head.mlp.2.weight".into(), vec![1, k], cut("temp_head.mlp.2.weight", 1, k)?),
            ("temp_head.mlp.2.bias".into(), vec![1], cut("temp_head.mlp.2.bias", 1, 1)?),
            ("top_p_head.mlp.0.weight".into(), vec![k, top_in], cut("top_p_head.mlp.0.weight", k, top_in)?),
            ("top_p_head.mlp.0.bias".into(), vec![k], cut("top_p_head.mlp.0.bias", 1, k)?),
            ("top_p_head.mlp.2.weight".into(), vec![1, k], cut("top_p_head.mlp.2.weight", 1, k)?),
            ("top_p_head.mlp.2.bias".into(), vec![1], cut("top_p_head.mlp.2.bias", 1, 1)?),
        ];
        if norm {
            tensors.push(("temp_head.norm.weight".into(), vec![h], vec![1.0; h]));
            tensors.push(("temp_head.norm.bias".into(), vec![h], vec![0.0; h]));
        }
        let mut head = serde_json::Map::new();
        head.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
        let mut payload = Vec::new();
        for (name, shape, v) in &tensors {
            let a = payload.len();
            payload.extend(v.iter().flat_map(|x| x.to_le_bytes()));
            head.insert(name.clone(), serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [a, payload.len()]}));
        }
        let mut hj = serde_json::to_vec(&serde_json::Value::Object(head))?;
        while hj.len() % 8 != 0 {
            hj.push(b' ');
        }
        let mut st = (hj.len() as u64).to_le_bytes().to_vec();
        st.extend_from_slice(&hj);
        st.extend_from_slice(&payload);
        let config = serde_json::json!({"hidden_size": h, "head_hidden_size": k, "use_enhanced_features": enhanced, "temp_layer_norm": norm, "vocab_size": vocab});
        fs::write(corpus.join(format!("heads-enhanced{enhanced}-norm{norm}")), pair_seed(&serde_json::to_vec_pretty(&config)?, &st)?)?;
    }
    Ok(())
}
