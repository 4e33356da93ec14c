//! Small helpers: paths, hashing, running commands.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use sha2::{Digest, Sha256};

/// The workspace root (the directory above `xtask/`).
pub fn workspace_root() -> PathBuf {
    // `cargo run` (the `cargo xtask` alias) sets CARGO_MANIFEST_DIR for the process: prefer it
    // to the compile-time value, because with a CARGO_TARGET_DIR shared by two checkouts cargo
    // may run a binary built in the other one (it does not re-copy a fresh binary).
    let manifest_dir = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .filter(|d| d.join("Cargo.toml").is_file())
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    manifest_dir
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or(manifest_dir)
}

/// The cache directory: `--cache-dir`, else `$DECO_CACHE`, else `<workspace root>/.cache`.
pub fn cache_dir(flag: Option<&Path>) -> PathBuf {
    if let Some(p) = flag {
        return absolute(p);
    }
    match std::env::var_os("DECO_CACHE") {
        Some(v) if !v.is_empty() => absolute(Path::new(&v)),
        _ => workspace_root().join(".cache"),
    }
}

/// The local mirror (`<workspace root>/../shared`) when it exists.
pub fn mirror_dir() -> Option<PathBuf> {
    let m = workspace_root().join("..").join("shared");
    m.is_dir().then(|| m.canonicalize().unwrap_or(m))
}

fn absolute(p: &Path) -> PathBuf {
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir()
            .map(|d| d.join(p))
            .unwrap_or_else(|_| p.to_path_buf())
    }
}

/// sha256 of a file, lowercase hex.
pub fn sha256_file(path: &Path) -> Result<String> {
    let f = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut r = BufReader::with_capacity(1 << 20, f);
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = r
            .read(&mut buf)
            .with_context(|| format!("cannot read {}", path.display()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex(&h.finalize()))
}

/// Lowercase hex of bytes.
pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// Size in bytes, or `None` when the file does not exist.
pub fn file_size(path: &Path) -> Option<u64> {
    std::fs::metadata(path)
        .ok()
        .filter(|m| m.is_file())
        .map(|m| m.len())
}

/// The `cargo` that runs us (falls back to `cargo` on `PATH`).
pub fn cargo() -> Command {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut c = Command::new(cargo);
    c.current_dir(workspace_root());
    c
}

/// Runs a command with inherited stdio; fails unless it exits 0.
pub fn run(cmd: &mut Command) -> Result<()> {
    let shown = show(cmd);
    eprintln!("+ {shown}");
    let status = cmd
        .status()
        .with_context(|| format!("cannot start `{shown}`"))?;
    if !status.success() {
        bail!("`{shown}` failed ({status})");
    }
    Ok(())
}

/// Runs a command with no stdin and captured stdout / stderr (printing the command line first);
/// returns both. Fails, quoting stderr, unless it exits 0.
pub fn output(cmd: &mut Command) -> Result<(String, String)> {
    let shown = show(cmd);
    eprintln!("+ {shown}");
    let out = cmd
        .stdin(std::process::Stdio::null())
        .output()
        .with_context(|| format!("cannot start `{shown}`"))?;
    let (so, se) = (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned());
    if !out.status.success() {
        bail!("`{shown}` failed ({}): {}", out.status, se.trim());
    }
    Ok((so, se))
}

/// A command line for messages.
pub fn show(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        let a = a.to_string_lossy();
        if a.contains(' ') || a.is_empty() {
            s.push_str(&format!(" '{a}'"));
        } else {
            s.push(' ');
            s.push_str(&a);
        }
    }
    s
}

/// Human-readable byte count.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha256_of_known_bytes() -> Result<()> {
        let dir = std::env::temp_dir().join(format!("xtask-sha-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let p = dir.join("abc");
        std::fs::write(&p, b"abc")?;
        assert_eq!(
            sha256_file(&p)?,
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }

    #[test]
    fn human_bytes_units() {
        assert_eq!(human_bytes(12), "12 B");
        assert_eq!(human_bytes(98_362_432), "93.8 MiB");
    }
}
