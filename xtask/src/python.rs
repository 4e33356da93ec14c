//! Python side: `pip download` from the package registry, a private virtualenv in the cache
//! (`<cache>/venv`) for the data scripts and the llama.cpp benchmark.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::util::{self, run};

/// The Python used to create the venv and to run `pip download`: `$DECO_PYTHON` or `python3`.
pub fn system_python() -> OsString {
    std::env::var_os("DECO_PYTHON")
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "python3".into())
}

/// `xtask/scripts/NAME`.
pub fn script(name: &str) -> PathBuf {
    util::workspace_root()
        .join("xtask")
        .join("scripts")
        .join(name)
}

/// Downloads `package==version` (no dependencies) into `<cache>/downloads/package-version/` and
/// returns the archive (wheel or sdist). Reuses a completed earlier download.
pub fn pip_download(cache: &Path, package: &str, version: &str, extra: &[&str]) -> Result<PathBuf> {
    let dir = cache.join("downloads").join(format!("{package}-{version}"));
    let done = dir.join(".complete");
    if !done.exists() {
        if dir.exists() {
            std::fs::remove_dir_all(&dir)
                .with_context(|| format!("cannot clear incomplete download {}", dir.display()))?;
        }
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
        let mut cmd = Command::new(system_python());
        cmd.args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--ignore-requires-python",
        ])
        .args(["--disable-pip-version-check", "--progress-bar", "off", "-d"])
        .arg(&dir)
        .args(extra)
        .arg(format!("{package}=={version}"));
        run(&mut cmd).with_context(|| format!("pip download of {package}=={version} failed"))?;
        std::fs::write(&done, b"").with_context(|| format!("cannot write {}", done.display()))?;
    }
    let mut archives = Vec::new();
    for e in std::fs::read_dir(&dir).with_context(|| format!("cannot list {}", dir.display()))? {
        let p = e?.path();
        if p.file_name()
            .is_some_and(|n| !n.to_string_lossy().starts_with('.'))
        {
            archives.push(p);
        }
    }
    match archives.as_slice() {
        [one] => Ok(one.clone()),
        _ => bail!(
            "{}: expected exactly one archive for {package}=={version}, found {archives:?}",
            dir.display()
        ),
    }
}

/// The cache's virtualenv python (`<cache>/venv/bin/python`), created on first use.
pub fn venv_python(cache: &Path) -> Result<PathBuf> {
    let venv = cache.join("venv");
    let py = venv.join("bin").join("python");
    if !py.exists() {
        eprintln!("creating Python virtualenv {}", venv.display());
        run(Command::new(system_python())
            .args(["-m", "venv"])
            .arg(&venv))
        .with_context(|| {
            format!(
                "cannot create the virtualenv {} (is the python3 venv module installed? \
                 set DECO_PYTHON to another interpreter)",
                venv.display()
            )
        })?;
    }
    Ok(py)
}

/// Makes sure `check` (Python code that exits 0 when the packages are usable) succeeds in the
/// venv, installing `requirements` with pip otherwise.
pub fn ensure_packages(
    py: &Path,
    check: &str,
    requirements: &[&str],
    envs: &[(&str, &str)],
) -> Result<()> {
    let ok = Command::new(py)
        .args(["-c", check])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if ok {
        return Ok(());
    }
    eprintln!("installing into the venv: {}", requirements.join(" "));
    let mut cmd = Command::new(py);
    cmd.args([
        "-m",
        "pip",
        "install",
        "--disable-pip-version-check",
        "--progress-bar",
        "off",
    ]);
    cmd.args(requirements);
    for (k, v) in envs {
        cmd.env(k, v);
    }
    run(&mut cmd).with_context(|| format!("pip install {} failed", requirements.join(" ")))?;
    let ok = Command::new(py)
        .args(["-c", check])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        bail!(
            "installed {} but `{check}` still fails in {}",
            requirements.join(" "),
            py.display()
        );
    }
    Ok(())
}
