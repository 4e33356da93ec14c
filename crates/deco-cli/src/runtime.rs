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
    let model = Llama::load(&ckpt, &device, None)?;
    Ok((model, tok))
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
