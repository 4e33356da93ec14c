//! Crash-safe outputs: a file or directory appears at its path complete or not at all, even when
//! the writing process is killed (SIGKILL) at any instant.
//!
//! The content is written to a temporary sibling (same directory, so the final step is a rename
//! within one file system), flushed with `fsync`, and then renamed onto the destination; the
//! parent directory is synced after the rename. A directory that already exists is swapped with
//! the new one in one step (`renameat2(RENAME_EXCHANGE)` on Linux) before the old content is
//! deleted, so the path never shows a partial or missing directory; elsewhere the old directory
//! is first moved aside (the path is briefly absent). This is the pattern of SQLite's and
//! LevelDB's manifest updates (write-new, fsync, rename) as described in Pillai et al., "All File
//! Systems Are Not Created Equal", OSDI 2014, section 3.
//!
//! Temporaries are named `.NAME.deco-tmp-PID`; those left by a killed process (whose PID no
//! longer runs) are removed by the next write to the same destination.

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

fn parent_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

fn name_of(path: &Path) -> String {
    path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "out".into())
}

/// The temporary sibling of `path` owned by this process.
fn temp_sibling(path: &Path) -> PathBuf {
    parent_of(path).join(format!(".{}.deco-tmp-{}", name_of(path), std::process::id()))
}

/// Whether process `pid` still runs (Linux: `/proc/PID`; elsewhere assumed alive).
fn pid_alive(pid: u32) -> bool {
    if cfg!(target_os = "linux") { Path::new(&format!("/proc/{pid}")).exists() } else { true }
}

/// Removes `.NAME.deco-tmp-PID` siblings of `path` left by processes that no longer run.
fn remove_stale_temps(path: &Path) {
    let prefix = format!(".{}.deco-tmp-", name_of(path));
    let Ok(entries) = std::fs::read_dir(parent_of(path)) else { return };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name.strip_prefix(&prefix).and_then(|p| p.parse::<u32>().ok()) else { continue };
        if pid != std::process::id() && !pid_alive(pid) {
            let p = e.path();
            let _ = if p.is_dir() { std::fs::remove_dir_all(&p) } else { std::fs::remove_file(&p) };
        }
    }
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    // Directories can be opened read-only and fsynced on Unix; Windows cannot open them this way.
    if cfg!(unix) { File::open(dir)?.sync_all() } else { Ok(()) }
}

/// fsyncs every file under `dir` and the directories themselves.
fn sync_tree(dir: &Path) -> io::Result<()> {
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let p = e.path();
        if e.file_type()?.is_dir() {
            sync_tree(&p)?;
        } else {
            File::open(&p)?.sync_all()?;
        }
    }
    sync_dir(dir)
}

/// Writes `bytes` to `path` atomically (temporary sibling, fsync, rename), replacing any file
/// there.
///
/// # Errors
/// Any I/O error, with the temporary removed; `path` is then untouched.
pub fn write_file(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let dir = parent_of(path);
    std::fs::create_dir_all(&dir)?;
    remove_stale_temps(path);
    let tmp = temp_sibling(path);
    let result = (|| {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, path)?;
        sync_dir(&dir)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Builds a directory with `fill` (given an empty temporary sibling of `out`) and installs it at
/// `out` atomically: a missing or empty `out` is replaced by a rename, an existing one is
/// exchanged with the new directory (Linux) and then deleted. On error the temporary is removed
/// and `out` is untouched.
///
/// `io_err` turns the I/O errors of the installation into the caller's error type.
///
/// # Errors
/// What `fill` returns, or `io_err(path, error)` for a failed file-system step.
pub fn write_dir<E>(out: &Path, fill: impl FnOnce(&Path) -> Result<(), E>, io_err: impl Fn(&Path, io::Error) -> E) -> Result<(), E> {
    let parent = parent_of(out);
    std::fs::create_dir_all(&parent).map_err(|e| io_err(&parent, e))?;
    remove_stale_temps(out);
    let tmp = temp_sibling(out);
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| io_err(&tmp, e))?;
    }
    std::fs::create_dir(&tmp).map_err(|e| io_err(&tmp, e))?;
    let result = fill(&tmp).and_then(|()| {
        sync_tree(&tmp).map_err(|e| io_err(&tmp, e))?;
        install_dir(&tmp, out).map_err(|e| io_err(out, e))?;
        sync_dir(&parent).map_err(|e| io_err(&parent, e))
    });
    if tmp.exists() {
        // After an exchange `tmp` holds the old directory; after a failure, the partial new one.
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
}

fn is_empty_dir(p: &Path) -> io::Result<bool> {
    Ok(std::fs::read_dir(p)?.next().is_none())
}

/// Whether `path` does not exist or is an empty directory: where the commands that refuse to
/// overwrite a model directory may write one.
///
/// # Errors
/// An I/O error reading `path`; a file at `path` is an [`io::ErrorKind::AlreadyExists`] error.
pub fn is_absent_or_empty(path: &Path) -> io::Result<bool> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(true),
        Err(e) => Err(e),
        Ok(m) if m.is_dir() => is_empty_dir(path),
        Ok(_) => Err(io::Error::new(io::ErrorKind::AlreadyExists, "exists and is not a directory")),
    }
}

/// Puts the finished directory `tmp` at `out`.
fn install_dir(tmp: &Path, out: &Path) -> io::Result<()> {
    match std::fs::symlink_metadata(out) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return std::fs::rename(tmp, out),
        Err(e) => return Err(e),
        Ok(m) if m.is_dir() && is_empty_dir(out)? => {
            // `rename` replaces an empty directory in one step (POSIX rename(2)).
            return std::fs::rename(tmp, out);
        }
        Ok(m) if !m.is_dir() => {
            return Err(io::Error::new(io::ErrorKind::AlreadyExists, "exists and is not a directory"));
        }
        Ok(_) => {}
    }
    exchange(tmp, out)
}

#[cfg(target_os = "linux")]
fn exchange(a: &Path, b: &Path) -> io::Result<()> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let ca = CString::new(a.as_os_str().as_bytes()).map_err(io::Error::other)?;
    let cb = CString::new(b.as_os_str().as_bytes()).map_err(io::Error::other)?;
    // SAFETY: both paths are valid NUL-terminated strings that outlive the call; AT_FDCWD makes
    // them relative to the working directory as `rename` would.
    let r = unsafe { libc::renameat2(libc::AT_FDCWD, ca.as_ptr(), libc::AT_FDCWD, cb.as_ptr(), libc::RENAME_EXCHANGE) };
    if r == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

/// Without an atomic exchange: move the old directory aside, put the new one in place, and leave
/// the old one at `a` for the caller to delete (the path is absent between the two renames).
#[cfg(not(target_os = "linux"))]
fn exchange(a: &Path, b: &Path) -> io::Result<()> {
    let aside = parent_of(b).join(format!(".{}.deco-old-{}", name_of(b), std::process::id()));
    std::fs::rename(b, &aside)?;
    std::fs::rename(a, b)?;
    std::fs::rename(&aside, a)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_tree(dir: &Path) -> Vec<(String, Vec<u8>)> {
        let mut v: Vec<_> = std::fs::read_dir(dir)
            .expect("read_dir")
            .map(|e| {
                let e = e.expect("entry");
                (e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path()).expect("read"))
            })
            .collect();
        v.sort();
        v
    }

    fn siblings(dir: &Path) -> Vec<String> {
        let mut v: Vec<_> = std::fs::read_dir(dir).expect("read_dir").map(|e| e.expect("entry").file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    }

    #[test]
    fn write_dir_creates_replaces_and_leaves_no_temporary() {
        let root = tempfile::tempdir().expect("tempdir");
        let out = root.path().join("model");
        let io = |p: &Path, e: io::Error| format!("{}: {e}", p.display());
        write_dir(&out, |d| std::fs::write(d.join("a"), b"one").map_err(|e| e.to_string()), io).expect("first");
        assert_eq!(read_tree(&out), vec![("a".into(), b"one".to_vec())]);
        // Replacing a non-empty directory: the new content only, the old one gone.
        write_dir(&out, |d| std::fs::write(d.join("b"), b"two").map_err(|e| e.to_string()), io).expect("second");
        assert_eq!(read_tree(&out), vec![("b".into(), b"two".to_vec())]);
        assert_eq!(siblings(root.path()), vec!["model".to_string()]);
        // A failing fill leaves the previous directory and no temporary.
        let err = write_dir(&out, |d| {
            std::fs::write(d.join("c"), b"partial").map_err(|e| e.to_string())?;
            Err("disk full".to_string())
        }, io);
        assert_eq!(err, Err("disk full".to_string()));
        assert_eq!(read_tree(&out), vec![("b".into(), b"two".to_vec())]);
        assert_eq!(siblings(root.path()), vec!["model".to_string()]);
    }

    #[test]
    fn write_dir_refuses_to_replace_a_file() {
        let root = tempfile::tempdir().expect("tempdir");
        let out = root.path().join("model");
        std::fs::write(&out, b"a file").expect("write");
        let err = write_dir(&out, |_| Ok(()), |p: &Path, e: io::Error| format!("{}: {e}", p.display())).expect_err("must fail");
        assert!(err.contains("not a directory"), "{err}");
        assert_eq!(std::fs::read(&out).expect("read"), b"a file");
    }

    #[test]
    fn stale_temporaries_of_dead_processes_are_removed() {
        let root = tempfile::tempdir().expect("tempdir");
        let out = root.path().join("w.gguf");
        // PID 0 is never a user process (and /proc/0 does not exist).
        let stale = root.path().join(".w.gguf.deco-tmp-0");
        std::fs::write(&stale, b"half").expect("write");
        let other = root.path().join(".other.deco-tmp-0");
        std::fs::write(&other, b"not ours").expect("write");
        write_file(&out, b"whole").expect("write_file");
        assert_eq!(std::fs::read(&out).expect("read"), b"whole");
        if cfg!(target_os = "linux") {
            assert!(!stale.exists());
        }
        assert!(other.exists(), "temporaries of other destinations are left alone");
    }
}
