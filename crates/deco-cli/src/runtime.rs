//! Loading a model, its tokenizer and the compute device from command-line options.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use burn::tensor::Device;
use deco_formats::checkpoint::Checkpoint;
use deco_formats::gguf::GgufFile;
use deco_formats::tokenizer::Tokenizer;
use deco_model::Llama;

use crate::ModelArgs;

/// Sets the CPU thread pool size (once per process) and returns the selected device.
pub fn device(args: &ModelArgs) -> Result<Device> {
    if let Some(n) = args.threads {
        anyhow::ensure!(n > 0, "--threads must be at least 1");
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .context("configuring the CPU thread pool")?;
    }
    if args.q8_activations {
        deco_kernels::quant::set_activation_precision(deco_kernels::quant::ActivationPrecision::Q8).context("--q8-activations")?;
    }
    Ok(deco_kernels::select_device(&args.device)?)
}

/// Loads the tokenizer of a GGUF file or a Hugging Face directory.
pub fn load_tokenizer(path: &Path) -> Result<Tokenizer> {
    if path.is_dir() {
        Ok(Tokenizer::from_hf_dir(path)?)
    } else {
        let g = GgufFile::open(path)?;
        Ok(Tokenizer::from_gguf(&g)?)
    }
}

/// Loads model weights and tokenizer.
pub fn load(args: &ModelArgs) -> Result<(Llama, Tokenizer)> {
    let device = device(args)?;
    let ckpt = Checkpoint::open(&args.model)?;
    let tok = load_tokenizer(&args.model)?;
    // Checkpoint errors already name the file and the tensor.
    let model = load_llama(&ckpt, &device, None, args.lora.as_deref())?;
    Ok((model, tok))
}

/// Loads the weights of `ckpt`, with the PEFT LoRA adapters of `lora` merged in
/// (`deco_compress::lora::HostAdapters::merged_source`: `W + s·B·A` for every adapted linear,
/// all weights then dense f32) when given.
///
/// # Errors
/// Checkpoint errors; an adapter directory that cannot be read or does not fit the model (the
/// message names the directory and the problem).
pub fn load_llama(ckpt: &Checkpoint, device: &Device, max_positions: Option<usize>, lora: Option<&Path>) -> Result<Llama> {
    let Some(dir) = lora else {
        return Ok(Llama::load(ckpt, device, max_positions)?);
    };
    let adapters = deco_compress::lora::HostAdapters::load(dir, &ckpt.config).with_context(|| format!("--lora {}", dir.display()))?;
    let src = |n: &str| -> deco_model::Result<(Vec<usize>, Vec<f32>)> { Ok(ckpt.tensor(n)?) };
    let merged = adapters.merged_source(&src);
    let c = &adapters.config;
    eprintln!(
        "lora: merging {} adapters (r={}, lora_alpha={}, scaling {}) from {} into f32 weights",
        adapters.weights.len(),
        c.r,
        c.lora_alpha,
        c.scaling(),
        dir.display()
    );
    Ok(Llama::load_from(&ckpt.config, &merged, device, max_positions)?)
}

/// Number of non-overlapping `seqlen`-token windows of `tokens` tokens to score, at most
/// `max_windows` (`None`: all), for the commands that score a text (`eval ppl`, `eval kld`,
/// `eval early-exit`, `eval layer-error`).
///
/// # Errors
/// When not even one window fits: the message names `text`, its token count and `seqlen`.
pub fn window_count(tokens: usize, seqlen: usize, max_windows: Option<usize>, text: &Path) -> Result<usize> {
    let n = (tokens / seqlen).min(max_windows.unwrap_or(usize::MAX));
    anyhow::ensure!(n > 0, "{}: {tokens} tokens is less than one window of {seqlen}", text.display());
    Ok(n)
}

/// Finds the data file `data/REL` (e.g. `wiki_train.txt`) where `cargo xtask fetch` and the tests
/// put it: `$DECO_CACHE/data`, `.cache/data`, `$DECO_SHARED_DIR/data`, `../shared/data`, then
/// beside the model (`<root>/models/M` -> `<root>/data/REL`). `hint` names the flag that gives the
/// file explicitly.
///
/// # Errors
/// When no candidate exists: the message lists every place looked and the hint.
pub fn data_file(model: &Path, rel: &str, hint: &str) -> Result<PathBuf> {
    let mut c = Vec::new();
    if let Ok(d) = std::env::var("DECO_CACHE") {
        c.push(PathBuf::from(d).join("data").join(rel));
    }
    c.push(PathBuf::from(".cache/data").join(rel));
    if let Ok(d) = std::env::var("DECO_SHARED_DIR") {
        c.push(PathBuf::from(d).join("data").join(rel));
    }
    c.push(PathBuf::from("../shared/data").join(rel));
    if let Some(root) = model.parent().and_then(Path::parent) {
        c.push(root.join("data").join(rel));
    }
    c.iter()
        .find(|p| p.exists())
        .cloned()
        .with_context(|| format!("data file {rel} not found (looked in {c:?}); run `cargo xtask fetch` or pass {hint}"))
}

/// Prefix of a directory being discarded by [`discard_dir`] (hidden, so that no listing of
/// checkpoints or outputs sees it).
const DISCARD_PREFIX: &str = ".discard-";

/// Removes the directory `dir` crash-safely: first renamed to a hidden sibling
/// (`.discard-NAME`, one atomic step), then deleted. A process killed while deleting leaves only
/// that hidden directory, never a half-deleted one under `dir`'s name (a training checkpoint
/// missing its weights file, found by the crash-safety test of `deco medusa train`); the next
/// [`prune_checkpoints`] deletes such leftovers.
///
/// # Errors
/// The rename's or the deletion's I/O error.
pub fn discard_dir(dir: &Path) -> std::io::Result<()> {
    let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let hidden = dir.with_file_name(format!("{DISCARD_PREFIX}{name}"));
    if hidden.exists() {
        std::fs::remove_dir_all(&hidden)?;
    }
    std::fs::rename(dir, &hidden)?;
    std::fs::remove_dir_all(&hidden)
}

/// Keeps the newest `keep` training checkpoints of `out` ([`checkpoints`]) and discards the
/// others with [`discard_dir`], then deletes hidden leftovers of discards a killed run did not
/// finish. Best effort: a failure leaves an extra checkpoint or leftover behind, nothing
/// incomplete under a checkpoint's name.
pub fn prune_checkpoints(out: &Path, keep: usize) {
    if let Ok(all) = checkpoints(out) {
        for (_, old) in all.iter().rev().skip(keep) {
            let _ = discard_dir(old);
        }
    }
    if let Ok(entries) = std::fs::read_dir(out) {
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with(DISCARD_PREFIX) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
}

/// Training checkpoints `out/checkpoint-NNNNNN` (`deco distill`, `deco autodeco train`) as
/// `(step, path)`, ascending.
///
/// # Errors
/// An unreadable `out`.
pub fn checkpoints(out: &Path) -> Result<Vec<(usize, PathBuf)>> {
    let mut v = Vec::new();
    if out.is_dir() {
        for e in std::fs::read_dir(out).with_context(|| format!("reading {}", out.display()))? {
            let e = e?;
            let name = e.file_name().to_string_lossy().to_string();
            if let Some(n) = name.strip_prefix("checkpoint-").and_then(|s| s.parse::<usize>().ok()) {
                v.push((n, e.path()));
            }
        }
    }
    v.sort();
    Ok(v)
}

/// Opens the training log `path` (`step,loss,tokens,secs`) for appending, writing the header to a
/// new file. With `resume`, a killed run may have logged steps past its last checkpoint, or half
/// a line: only the header and the complete lines up to `start_step` are kept (rewritten
/// crash-safely) (`deco distill`, `deco lora train`).
///
/// # Errors
/// An unreadable or unwritable log.
pub fn open_step_log(path: &Path, resume: bool, start_step: usize) -> Result<std::fs::File> {
    use std::io::Write;
    if resume && path.exists() {
        let old = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let kept: String = old
            .lines()
            .enumerate()
            .filter(|(i, l)| {
                let fields: Vec<&str> = l.split(',').collect();
                *i == 0 || (fields.len() == 4 && fields[0].parse::<usize>().is_ok_and(|s| s <= start_step))
            })
            .map(|(_, l)| format!("{l}\n"))
            .collect();
        deco_formats::atomic::write_file(path, kept.as_bytes()).with_context(|| format!("rewriting {}", path.display()))?;
    }
    let new_log = !path.exists();
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(path).with_context(|| format!("{}", path.display()))?;
    if new_log {
        writeln!(f, "step,loss,tokens,secs")?;
    }
    Ok(f)
}

/// Keeps the memory that the compression jobs free for their next allocation instead of giving
/// it back to the kernel (glibc: no `mmap` for large blocks, no trimming of the heap).
///
/// A calibration pass allocates ~1.5 GB of fresh activations per decoder layer of SmolLM2-135M
/// (each `[32768, width]` stage output, its host copies and bf16 conversions, 75-400 MB apiece).
/// glibc serves blocks above 32 MiB with `mmap` and unmaps them on `free`, so every layer
/// faulted in and zeroed ~45 GB of pages over a run: 27-30 s of system time in a 77 s
/// `deco quantize --method gptq` (11 M minor faults). Served from the heap, the freed blocks
/// are reused: 2.3 s of system time, 0.4 M faults, 61 s, byte-identical output, peak RSS
/// 1.52 → 1.65 GB (docs/performance.md, eighteenth session). Other allocators did not help
/// (jemalloc and mimalloc also return large blocks eagerly; the eleventh session's table).
///
/// Only for the batch jobs (`quantize`, `prune`): a server's memory should go back when idle.
/// Does nothing on other platforms.
pub fn retain_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator parameters; it is called before the job's threads
    // allocate anything large. A failed call (returns 0) leaves glibc's defaults.
    unsafe {
        libc::mallopt(libc::M_MMAP_MAX, 0);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}

/// Bytes per piece of [`encode_corpus`].
const CORPUS_PIECE: usize = 1 << 18;

/// `text` cut into consecutive pieces of at least `piece` bytes, each ending at a paragraph
/// break (the first blank line `"\n\n"` at or after `piece` bytes into it; the last piece takes
/// the rest). The pieces concatenate to `text`.
fn corpus_pieces(text: &str, piece: usize) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = text;
    while rest.len() > piece {
        // `piece` may fall inside a character: search from the next boundary.
        let from = (piece..rest.len()).find(|&i| rest.is_char_boundary(i)).unwrap_or(rest.len());
        let Some(cut) = rest[from..].find("\n\n").map(|i| from + i + 2) else { break };
        let (head, tail) = rest.split_at(cut);
        out.push(head);
        rest = tail;
    }
    if !rest.is_empty() || out.is_empty() {
        out.push(rest);
    }
    out
}

/// The tokens of a calibration corpus (no BOS/EOS, special-token text parsed): the text cut at
/// paragraph breaks into pieces of ~256 KiB ([`corpus_pieces`]), each tokenized on its own, in
/// parallel, and the ids concatenated. The tokens differ from one encoding of the whole text
/// only where a piece ends (its closing blank line is tokenized without the text after it); the
/// GPTQ and AWQ reference implementations likewise tokenize each calibration sample on its own.
/// A 4.4 MB text took ~3 s as one encoding (the `tokenizers` crate runs one thread per call).
///
/// # Errors
/// The tokenizer's.
pub fn encode_corpus(tok: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    use rayon::prelude::*;
    let pieces: Vec<Vec<u32>> = corpus_pieces(text, CORPUS_PIECE).par_iter().map(|p| tok.encode_with(p, false, true)).collect::<deco_formats::Result<_>>()?;
    Ok(pieces.concat())
}

#[cfg(test)]
mod tests {
    use super::corpus_pieces;

    #[test]
    fn corpus_pieces_end_at_paragraph_breaks_and_cover_the_text() {
        let para = "Ein Absatz mit Umlauten: äöü ß. ";
        let text: String = (0..200).map(|i| format!("{}{}", para.repeat(i % 7 + 1), if i % 3 == 0 { "\n\n\n" } else { "\n\n" })).collect();
        for piece in [1usize, 7, 100, 1000, text.len(), 10 * text.len()] {
            let p = corpus_pieces(&text, piece);
            assert_eq!(p.concat(), text, "piece {piece}");
            for (i, s) in p.iter().enumerate() {
                if i + 1 < p.len() {
                    assert!(s.len() >= piece && s.ends_with("\n\n"), "piece {piece}: {i} is {} bytes", s.len());
                }
            }
            if piece >= text.len() {
                assert_eq!(p.len(), 1);
            }
        }
        assert_eq!(corpus_pieces("", 10), vec![""]);
        assert_eq!(corpus_pieces("no break at all", 3), vec!["no break at all"]);
    }
}
