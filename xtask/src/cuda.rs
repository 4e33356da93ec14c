//! `cargo xtask build --cuda`: the release `deco` with `--features cuda`, built offline.
//!
//! burn's CUDA backend compiles CubeCL kernels through `cubecl-llvm`, whose build dependency
//! `tracel-llvm-bundler` downloads a static LLVM 23.1 from GitHub releases, a host this
//! project's machines cannot reach. Its build script skips the download when the marker
//! `<data_local_dir>/tracel/tracel-llvm-<version>/.tracel-llvm-installed` exists, and then only
//! runs `<that dir>/bin/llvm-config --link-static ...` (`data_local_dir` is `$XDG_DATA_HOME`,
//! default `~/.local/share`). This task supplies that directory from the package registry:
//!
//! 1. a virtualenv `<cache>/cuda/venv` with the PyPI wheel `mlc-llvm-static[all]==23.1.1.post0`
//!    (static LLVM 23.1.1 with the NVPTX target and a Python `llvm-config`);
//! 2. `<cache>/cuda/xdg/tracel/tracel-llvm-<version>/{bin,lib,include,share}` linked to the
//!    wheel's `python -m mlc_llvm_static.config --prefix`, plus the marker (the version is the
//!    bundler's, read from `Cargo.lock`);
//! 3. the system libraries `llvm-config --system-libs` names (`-lz -lzstd`, ...) made linkable:
//!    where only the runtime `libNAME.so.N` is installed (no `-dev` package), a `libNAME.so`
//!    link in `<cache>/cuda/syslib`, given to the linker through `LIBRARY_PATH`;
//! 4. `cargo build --release -p deco-cli --features cuda` (or `cargo check` with `--check`) with
//!    `XDG_DATA_HOME=<cache>/cuda/xdg` and `CUDARC_CUDA_VERSION` (cudarc's bindings; it loads
//!    libcuda and NVRTC at run time, so no CUDA toolkit is needed to build), into its own target
//!    directory (default `<cache>/cuda/target`).
//!
//! Nothing is written outside the cache and the target directory. At run time the binary needs
//! the NVIDIA driver (`libcuda.so`) and NVRTC; kernels using math functions also need
//! `libdevice.10.bc` (PyPI `nvidia-nvvm`, found through `CUDA_PATH`). See docs/performance.md.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::python;
use crate::util::{self, run};

/// The wheel that supplies LLVM.
const LLVM_WHEEL: &str = "mlc-llvm-static[all]==23.1.1.post0";
/// The LLVM major version `cubecl-llvm` 0.11 links against.
const LLVM_MAJOR: &str = "23.";
/// Default `CUDARC_CUDA_VERSION`: CUDA 12.8 bindings (run on any driver of 12.8 or later).
pub const DEFAULT_CUDA_VERSION: &str = "12080";

/// Options of `cargo xtask build --cuda`.
pub struct Options {
    /// The cache directory.
    pub cache: PathBuf,
    /// `cargo check` instead of `cargo build --release` (what CI runs: the real build scripts,
    /// LLVM's link flags and the C++ shims, without the final link).
    pub check: bool,
    /// Target directory (default `<cache>/cuda/target`).
    pub target_dir: Option<PathBuf>,
    /// `CUDARC_CUDA_VERSION` (e.g. 12080 for CUDA 12.8).
    pub cuda_version: String,
}

/// The environment of a CUDA build.
pub struct CudaEnv {
    /// `XDG_DATA_HOME` holding `tracel/tracel-llvm-<version>`.
    pub xdg: PathBuf,
    /// Extra linker search directory (`LIBRARY_PATH`).
    pub syslib: PathBuf,
    /// The LLVM prefix of the wheel.
    pub llvm_prefix: PathBuf,
}

/// The version of `tracel-llvm-bundler` in `Cargo.lock` (e.g. `23.1.0-4`).
fn bundler_version() -> Result<String> {
    let lock = util::workspace_root().join("Cargo.lock");
    let text = std::fs::read_to_string(&lock).with_context(|| format!("cannot read {}", lock.display()))?;
    let mut lines = text.lines();
    while let Some(l) = lines.next() {
        if l.trim() == "name = \"tracel-llvm-bundler\""
            && let Some(v) = lines.next().and_then(|v| v.trim().strip_prefix("version = \"")).and_then(|v| v.strip_suffix('"'))
        {
            return Ok(v.to_string());
        }
    }
    bail!("{}: no tracel-llvm-bundler package (is the cuda feature's dependency tree locked?)", lock.display())
}

/// Creates (or replaces) the symbolic link `link -> target`.
fn symlink(target: &Path, link: &Path) -> Result<()> {
    if std::fs::symlink_metadata(link).is_ok() {
        if std::fs::read_link(link).ok().as_deref() == Some(target) {
            return Ok(());
        }
        std::fs::remove_file(link).with_context(|| format!("cannot replace {}", link.display()))?;
    }
    std::os::unix::fs::symlink(target, link).with_context(|| format!("cannot link {} -> {}", link.display(), target.display()))
}

/// Directories the system linker searches by default (for `-lNAME`).
const SYSTEM_LIB_DIRS: [&str; 6] = ["/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/lib/x86_64-linux-gnu", "/lib64"];

/// Makes `-lNAME` linkable: nothing when `libNAME.so` or `libNAME.a` is on a system path; a
/// link `syslib/libNAME.so -> libNAME.so.N` when only the runtime library is installed.
fn ensure_linkable(name: &str, syslib: &Path) -> Result<()> {
    for d in SYSTEM_LIB_DIRS {
        let d = Path::new(d);
        if d.join(format!("lib{name}.so")).exists() || d.join(format!("lib{name}.a")).exists() {
            return Ok(());
        }
    }
    for d in SYSTEM_LIB_DIRS {
        let Ok(entries) = std::fs::read_dir(d) else { continue };
        let prefix = format!("lib{name}.so.");
        let mut found: Vec<PathBuf> =
            entries.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.file_name().is_some_and(|f| f.to_string_lossy().starts_with(&prefix))).collect();
        found.sort();
        if let Some(lib) = found.first() {
            eprintln!("linking {} as lib{name}.so (no development package installed)", lib.display());
            return symlink(lib, &syslib.join(format!("lib{name}.so")));
        }
    }
    bail!("LLVM needs the system library `{name}` (-l{name}), which is not installed: install lib{name}-dev (e.g. `apt-get install zlib1g-dev libzstd-dev`)")
}

/// Sets up the LLVM the CUDA build links (steps 1-3 of the module docs).
///
/// # Errors
/// pip, the wheel's `llvm-config`, or a missing system library.
pub fn setup(cache: &Path) -> Result<CudaEnv> {
    let dir = cache.join("cuda");
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let venv = dir.join("venv");
    let py = venv.join("bin").join("python");
    if !py.exists() {
        run(Command::new(python::system_python()).args(["-m", "venv"]).arg(&venv)).context("cannot create the LLVM virtualenv")?;
    }
    python::ensure_packages(&py, "import mlc_llvm_static.config", &[LLVM_WHEEL], &[])?;
    let (prefix, _) = util::output(Command::new(&py).args(["-m", "mlc_llvm_static.config", "--prefix"]))?;
    let llvm_prefix = PathBuf::from(prefix.trim());
    let config = llvm_prefix.join("bin").join("llvm-config");
    let (version, _) = util::output(Command::new(&config).arg("--version"))?;
    if !version.trim().starts_with(LLVM_MAJOR) {
        bail!("{} reports LLVM {}, cubecl-llvm needs {LLVM_MAJOR}x", config.display(), version.trim());
    }
    let (targets, _) = util::output(Command::new(&config).arg("--targets-built"))?;
    if !targets.split_whitespace().any(|t| t == "NVPTX") {
        bail!("the LLVM of {LLVM_WHEEL} was built without the NVPTX target ({})", targets.trim());
    }

    let xdg = dir.join("xdg");
    let llvm = xdg.join("tracel").join(format!("tracel-llvm-{}", bundler_version()?));
    std::fs::create_dir_all(&llvm).with_context(|| format!("cannot create {}", llvm.display()))?;
    for sub in ["bin", "lib", "include", "share"] {
        let target = llvm_prefix.join(sub);
        if target.exists() {
            symlink(&target, &llvm.join(sub))?;
        }
    }
    // Written once: the bundler's build script reruns (and everything above cubecl-llvm
    // rebuilds) whenever the marker's modification time changes.
    let marker = llvm.join(".tracel-llvm-installed");
    if !marker.exists() {
        std::fs::write(&marker, b"").context("cannot write the bundler's marker")?;
    }

    let syslib = dir.join("syslib");
    std::fs::create_dir_all(&syslib).with_context(|| format!("cannot create {}", syslib.display()))?;
    let (libs, _) = util::output(Command::new(&config).args(["--link-static", "--system-libs"]))?;
    for lib in libs.split_whitespace().filter_map(|l| l.strip_prefix("-l")) {
        ensure_linkable(lib, &syslib)?;
    }
    eprintln!("LLVM {} (NVPTX) from {LLVM_WHEEL}: {}", version.trim(), llvm_prefix.display());
    Ok(CudaEnv { xdg, syslib, llvm_prefix })
}

/// `cargo xtask build --cuda`.
///
/// # Errors
/// [`setup`]'s, and a failed cargo build.
pub fn build(opts: &Options) -> Result<()> {
    if !opts.cuda_version.chars().all(|c| c.is_ascii_digit()) || opts.cuda_version.len() != 5 {
        bail!("--cuda-version {}: expected cudarc's form, e.g. 12080 for CUDA 12.8", opts.cuda_version);
    }
    let env = setup(&opts.cache)?;
    let target = opts.target_dir.clone().unwrap_or_else(|| opts.cache.join("cuda").join("target"));
    let library_path = match std::env::var_os("LIBRARY_PATH") {
        Some(p) if !p.is_empty() => {
            let mut v = env.syslib.clone().into_os_string();
            v.push(":");
            v.push(p);
            v
        }
        _ => env.syslib.clone().into_os_string(),
    };
    let mut cmd = util::cargo();
    if opts.check {
        cmd.args(["check", "-p", "deco-cli", "--features", "cuda"]);
    } else {
        cmd.args(["build", "--release", "-p", "deco-cli", "--features", "cuda"]);
    }
    cmd.env("XDG_DATA_HOME", &env.xdg)
        .env("CUDARC_CUDA_VERSION", &opts.cuda_version)
        .env("LIBRARY_PATH", library_path)
        .env("CARGO_TARGET_DIR", &target)
        .env_remove("DOCS_RS");
    run(&mut cmd).context("the CUDA build failed")?;
    if opts.check {
        eprintln!("deco-cli --features cuda type-checks (real build scripts, LLVM {})", env.llvm_prefix.display());
    } else {
        let bin = target.join("release").join("deco");
        let size = util::file_size(&bin).map(util::human_bytes).unwrap_or_else(|| "missing".into());
        eprintln!("CUDA binary: {} ({size}); run it with `--device cuda` on a machine with the NVIDIA driver", bin.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bundler_version_is_read_from_the_lock_file() {
        // The workspace locks the cuda feature's tree (burn-cuda -> cubecl-llvm).
        let v = bundler_version().expect("locked");
        assert!(v.starts_with("23."), "{v}");
    }

    #[test]
    fn missing_system_library_is_named() {
        let dir = std::env::temp_dir().join(format!("deco-xtask-syslib-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let err = ensure_linkable("deco-no-such-library", &dir).expect_err("missing");
        assert!(err.to_string().contains("deco-no-such-library"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
