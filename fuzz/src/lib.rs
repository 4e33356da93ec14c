//! Helpers shared by the fuzz targets of `fuzz_targets/`.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// A scratch directory for this process (`/dev/shm` when there is one, else the temporary
/// directory), named `deco-fuzz-TAG-PID`, created on first use. One target per process, so one
/// directory per process.
///
/// # Panics
/// When the directory cannot be created (the fuzz run cannot go on).
pub fn scratch_dir(tag: &str) -> &'static Path {
    static D: OnceLock<PathBuf> = OnceLock::new();
    D.get_or_init(|| {
        let base = if Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
        let d = base.join(format!("deco-fuzz-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("fuzz scratch directory");
        d
    })
}

/// Splits an input of the two-file layout of `hf_dir`, `hf_tokenizer` and `autodeco_heads` (a
/// little-endian u16 length, that many bytes of the first file, the rest is the second; the
/// length is clamped to what is there). `None` for inputs under 2 bytes.
pub fn split_pair(data: &[u8]) -> Option<(&[u8], &[u8])> {
    let (len, rest) = data.split_first_chunk::<2>()?;
    Some(rest.split_at(usize::from(u16::from_le_bytes(*len)).min(rest.len())))
}

/// Writes the two files of a [`split_pair`] input into the scratch directory `dir`.
///
/// # Panics
/// When a file cannot be written.
pub fn write_pair(dir: &Path, first: (&str, &[u8]), second: (&str, &[u8])) {
    std::fs::write(dir.join(first.0), first.1).expect("write the first file");
    std::fs::write(dir.join(second.0), second.1).expect("write the second file");
}
