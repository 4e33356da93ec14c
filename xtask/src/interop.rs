//! `cargo xtask interop`: deco's exports read unchanged by today's loaders (issue 15 item 5,
//! docs/formats.md "Interop tier").
//!
//! Installs its own virtualenv (`<cache>/interop/venv`: torch, transformers 5, gptqmodel,
//! optimum, compressed-tensors 0.20, gguf, peft; about 6 GB, mostly torch's CUDA libraries, which
//! its PyPI wheel needs even on a CPU) and builds llama.cpp's `llama-quantize` from the
//! llama-cpp-python sdist (`<cache>/build/llama.cpp-<v>-quantize`, ~6 min on 2 cores, once).
//! Then, on SmolLM2-135M-Instruct and the first 20,000 characters of the Wikipedia test text:
//!
//! - GPTQ (sym), AWQ GEMM (asym, its default) and compressed-tensors `pack-quantized` (sym),
//!   4 bits, and compressed-tensors at 3 bits (its dense layout since 0.18), group size 64,
//!   written by `deco quantize`: transformers'
//!   `AutoModelForCausalLM.from_pretrained` loads each on the CPU in float32 (GPTQ / AWQ through
//!   gptqmodel's kernels, compressed-tensors through its decompressor) and its perplexity
//!   (`xtask/scripts/interop.py ppl`: the text tokenized by the export's own tokenizer with
//!   `AutoTokenizer`, the protocol of `deco eval ppl`, 16 windows of 256 tokens) must be
//!   within 0.02 % of `deco eval ppl` on the same directory;
//! - LoRA: a QLoRA adapter directory written by `deco lora train` (r 8, all seven linears, 3
//!   steps) loads with `peft.PeftModel.from_pretrained` on the f32 HF export (`deco convert`),
//!   all 420 adapter tensors under PEFT's names, with the perplexity of `deco eval ppl --lora`
//!   within the same 0.02 %;
//! - GGUF Q8_0, Q4_0, Q4_1: `deco quantize --format gguf-<type>` of an f32 GGUF (deco's
//!   `gguf-f32` dequantization of the Q4_1 model) must be byte-identical to `llama-quantize
//!   --pure` of the same f32 file.
//!
//! Prints a table and writes `<cache>/interop/report.json`; fails when a check fails.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};
use serde_json::{Value, json};

use crate::fetch::{self, What};
use crate::util::{self, output, run};
use crate::{bench, python};

/// Options of `cargo xtask interop`.
#[derive(Debug, Clone)]
pub struct Options {
    /// The cache directory.
    pub cache: PathBuf,
    /// Ignore the local mirror.
    pub no_mirror: bool,
    /// A prebuilt `deco` binary (default: build it).
    pub deco_bin: Option<PathBuf>,
}

/// Largest relative perplexity difference accepted between deco and the Python loader.
pub const PPL_TOLERANCE: f64 = 2e-4;

/// Pinned loader versions (the versions this tier was written against; `>=` where the package
/// moves fast and only the major version matters).
const REQUIREMENTS: &[&str] = &[
    "setuptools>=77",
    "torch==2.15.0",
    "transformers>=5,<6",
    "gptqmodel==7.7.0",
    "optimum>=2",
    "compressed-tensors==0.20.*",
    "gguf>=0.17",
    "peft>=0.13",
    "tokenizers",
    "cmake>=3.21,<5",
    "ninja>=1.11",
];

/// The llama-cpp-python sdist whose vendored llama.cpp provides `llama-quantize`.
const LLAMA_CPP_SDIST: (&str, &str) = ("llama-cpp-python", "0.3.36");

fn venv(cache: &Path) -> Result<PathBuf> {
    let dir = cache.join("interop").join("venv");
    let py = dir.join("bin").join("python");
    if !py.exists() {
        eprintln!("creating the interop virtualenv {}", dir.display());
        run(Command::new(python::system_python()).args(["-m", "venv"]).arg(&dir))
            .with_context(|| format!("cannot create the virtualenv {}", dir.display()))?;
    }
    python::ensure_packages(
        &py,
        "import torch, transformers, gptqmodel, optimum, compressed_tensors, gguf, peft, tokenizers, cmake, ninja",
        REQUIREMENTS,
        &[],
    )?;
    Ok(py)
}

fn deco_ppl(deco: &Path, model: &Path, text: &Path) -> Result<f64> {
    deco_ppl_with(deco, model, text, &[])
}

fn deco_ppl_with(deco: &Path, model: &Path, text: &Path, extra: &[&std::ffi::OsStr]) -> Result<f64> {
    let (out, err) = output(
        Command::new(deco)
            .args(["eval", "ppl", "--model"])
            .arg(model)
            .args(extra)
            .arg("--text")
            .arg(text)
            .args(["--seqlen", "256"]),
    )
    .with_context(|| format!("deco eval ppl on {}", model.display()))?;
    out.lines()
        .rev()
        .find_map(|l| l.strip_prefix("ppl=")?.trim().parse().ok())
        .with_context(|| format!("deco eval ppl printed no ppl=: {out}\n{err}"))
}

/// Runs the tier.
pub fn run_interop(o: &Options) -> Result<()> {
    fetch::fetch(&fetch::Options { cache: o.cache.clone(), no_mirror: o.no_mirror, what: vec![What::Model, What::Data] })?;
    let py = venv(&o.cache)?;
    let script = python::script("interop.py");
    let (package, version) = LLAMA_CPP_SDIST;
    let sdist = python::pip_download(&o.cache, package, version, &[])?;
    let work_llama = o.cache.join("build").join(format!("llama.cpp-{version}-quantize"));
    eprintln!("llama-quantize from {} (built once)", sdist.display());
    let (tool, _) = output(Command::new(&py).arg(&script).arg("build-quantize").arg("--sdist").arg(&sdist).arg("--work").arg(&work_llama))
        .context("building llama.cpp's llama-quantize (xtask/scripts/interop.py build-quantize)")?;
    let tool = PathBuf::from(tool.trim());
    let deco = bench::deco_binary(o.deco_bin.as_deref())?;

    let root = o.cache.join("interop").join("run");
    if root.exists() {
        fs::remove_dir_all(&root).with_context(|| format!("cannot clear {}", root.display()))?;
    }
    fs::create_dir_all(&root)?;
    let model = o.cache.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let wiki = fs::read_to_string(o.cache.join("data/wiki_test.txt")).context("data/wiki_test.txt")?;
    let text_path = root.join("wiki_20000.txt");
    fs::write(&text_path, wiki.chars().take(20_000).collect::<String>())?;

    let mut rows = Vec::new();
    let mut failures = Vec::new();
    // compressed-tensors at 3 bits too: the width whose packing changed in 0.18 (dense).
    for (format, bits, extra) in [("gptq", "4", &["--sym"][..]), ("awq", "4", &[][..]), ("compressed-tensors", "4", &["--sym"][..]), ("compressed-tensors", "3", &["--sym"][..])] {
        let dir = root.join(format!("{format}-w{bits}g64"));
        run(Command::new(&deco)
            .args(["quantize", "--model"])
            .arg(&model)
            .args(["--format", format, "--bits", bits, "--group-size", "64"])
            .args(extra)
            .arg("--out")
            .arg(&dir))
        .with_context(|| format!("deco quantize --format {format}"))?;
        let ours = deco_ppl(&deco, &dir, &text_path)?;
        let (out, err) = output(Command::new(&py).arg(&script).args(["ppl", "--model"]).arg(&dir).arg("--text").arg(&text_path).args(["--seqlen", "256"]))
            .with_context(|| format!("transformers could not load deco's {format} export"))?;
        let line = out.lines().rev().find(|l| l.starts_with('{')).with_context(|| format!("interop.py ppl printed no result: {out}\n{err}"))?;
        let theirs: Value = serde_json::from_str(line)?;
        let ppl = theirs["ppl"].as_f64().context("no ppl")?;
        let rel = (ours - ppl).abs() / ppl;
        let ok = rel <= PPL_TOLERANCE;
        let format = format!("{format} w{bits}");
        eprintln!("{format:>22}: deco ppl {ours:.4}, transformers {ppl:.4} (rel. diff {:.4} %) via {}: {}", rel * 100.0, theirs["quant_linear"], if ok { "ok" } else { "FAIL" });
        if !ok {
            failures.push(format!("{format}: perplexity differs by {:.4} % (limit {:.2} %)", rel * 100.0, PPL_TOLERANCE * 100.0));
        }
        rows.push(json!({"format": format, "group_size": 64, "bits": bits, "deco_ppl": ours, "loader_ppl": ppl, "rel_diff": rel,
            "loader_layers": theirs["quant_linear"], "versions": theirs["versions"], "ok": ok}));
    }

    // LoRA (docs/qlora.md): a PEFT adapter directory written by `deco lora train` (QLoRA, all
    // seven linears) loads with `peft.PeftModel.from_pretrained` on the f32 HF export of the
    // model, every adapter tensor placed under PEFT's name, and scores the text as
    // `deco eval ppl --lora` (adapters merged) does.
    let hf = root.join("smollm2-hf");
    run(Command::new(&deco).arg("convert").arg(&model).arg(&hf)).context("deco convert")?;
    let adapter = root.join("lora-all-linear");
    run(Command::new(&deco)
        .args(["lora", "train", "--model"])
        .arg(&model)
        .args(["--quant", "nf4", "--target-modules", "all-linear", "--r", "8", "--alpha", "16", "--steps", "3", "--batch-size", "2", "--seqlen", "128", "--lr", "1e-3", "--data"])
        .arg(o.cache.join("data/gsm_train.jsonl"))
        .arg("--out")
        .arg(&adapter))
    .context("deco lora train")?;
    let ours = deco_ppl_with(&deco, &hf, &text_path, &["--lora".as_ref(), adapter.as_os_str()])?;
    let (out, err) = output(Command::new(&py).arg(&script).args(["ppl", "--model"]).arg(&hf).arg("--text").arg(&text_path).args(["--seqlen", "256", "--lora"]).arg(&adapter))
        .context("peft could not load deco's LoRA adapter")?;
    let line = out.lines().rev().find(|l| l.starts_with('{')).with_context(|| format!("interop.py ppl --lora printed no result: {out}\n{err}"))?;
    let theirs: Value = serde_json::from_str(line)?;
    let ppl = theirs["ppl"].as_f64().context("no ppl")?;
    let rel = (ours - ppl).abs() / ppl;
    let placed = theirs["lora_tensors"].as_u64().unwrap_or(0);
    let ok = rel <= PPL_TOLERANCE && placed == 420;
    eprintln!("{:>22}: deco ppl {ours:.4}, transformers + peft {ppl:.4} (rel. diff {:.4} %), {placed} adapter tensors placed: {}", "lora r8 all-linear", rel * 100.0, if ok { "ok" } else { "FAIL" });
    if !ok {
        failures.push(format!("LoRA: perplexity differs by {:.4} % (limit {:.2} %) or {placed} of 420 adapter tensors placed", rel * 100.0, PPL_TOLERANCE * 100.0));
    }
    rows.push(json!({"format": "peft lora r8 all-linear", "deco_ppl": ours, "loader_ppl": ppl, "rel_diff": rel, "lora_tensors": placed, "versions": theirs["versions"], "ok": ok}));

    // GGUF Q8_0 / Q4_0 / Q4_1 against llama-quantize --pure of the same f32 file.
    let f32 = root.join("smollm2-f32.gguf");
    run(Command::new(&deco).args(["quantize", "--model"]).arg(&model).args(["--format", "gguf-f32", "--out"]).arg(&f32)).context("deco quantize --format gguf-f32")?;
    let mut ggufs = Vec::new();
    for (ty, bits) in [("q8_0", "8"), ("q4_0", "4"), ("q4_1", "4")] {
        let ours = root.join(format!("smollm2-{ty}.deco.gguf"));
        run(Command::new(&deco).args(["quantize", "--model"]).arg(&f32).args(["--format", &format!("gguf-{ty}"), "--bits", bits, "--out"]).arg(&ours))
            .with_context(|| format!("deco quantize --format gguf-{ty}"))?;
        let theirs = root.join(format!("smollm2-{ty}.llama.gguf"));
        run(Command::new(&tool).arg("--pure").arg(&f32).arg(&theirs).arg(ty.to_uppercase())).context("llama-quantize --pure")?;
        let (a, b) = (fs::read(&ours)?, fs::read(&theirs)?);
        let first_diff = a.iter().zip(&b).position(|(x, y)| x != y).or((a.len() != b.len()).then_some(a.len().min(b.len())));
        eprintln!(
            "{:>22}: deco {} bytes, llama-quantize --pure {} bytes: {}",
            format!("gguf {ty}"),
            a.len(),
            b.len(),
            match first_diff {
                None => "byte-identical".to_string(),
                Some(i) => format!("FAIL: first difference at byte {i}"),
            }
        );
        if let Some(i) = first_diff {
            failures.push(format!("GGUF {ty} differs from llama-quantize --pure at byte {i}"));
        }
        ggufs.push(json!({"type": ty, "deco_bytes": a.len(), "llama_quantize_bytes": b.len(), "first_difference": first_diff,
            "identical": first_diff.is_none(), "sha256": util::sha256_file(&ours)?}));
        fs::remove_file(&theirs)?;
    }
    let report = json!({"checks": rows, "gguf": ggufs, "llama_cpp": format!("{package} {version}"), "text": "first 20000 characters of data/wiki_test.txt", "seqlen": 256});
    let path = o.cache.join("interop").join("report.json");
    fs::write(&path, serde_json::to_string_pretty(&report)?)?;
    eprintln!("report: {}", path.display());
    ensure!(failures.is_empty(), "interop tier failed:\n  {}", failures.join("\n  "));
    if rows.len() != 5 {
        bail!("expected 5 loader checks, ran {}", rows.len());
    }
    Ok(())
}
