//! Loading a model, its tokenizer and the compute device from command-line options.

use std::path::Path;

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
