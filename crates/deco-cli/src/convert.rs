//! `deco convert`: GGUF to a Hugging Face directory.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use deco_formats::checkpoint::Checkpoint;
use deco_formats::hf_export::{ExportDtype, write_hf_dir};

/// Output weight dtype.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum OutDtype {
    /// 32-bit float (exact copy of the dequantized weights).
    F32,
    /// bfloat16 (round to nearest even).
    Bf16,
}

/// Arguments of `deco convert`.
#[derive(Debug, Args)]
pub struct ConvertArgs {
    /// Input GGUF file.
    gguf: PathBuf,
    /// Output directory (must not exist, or be empty).
    out_dir: PathBuf,
    /// Weight dtype of the written safetensors.
    #[arg(long, value_enum, default_value_t = OutDtype::F32)]
    dtype: OutDtype,
}

/// Runs the command.
pub fn run(args: &ConvertArgs) -> Result<()> {
    if args.gguf.is_dir() {
        bail!("{}: expected a GGUF file, got a directory", args.gguf.display());
    }
    let ckpt = Checkpoint::open(&args.gguf)?;
    let gguf = ckpt.gguf().context("not a GGUF checkpoint")?;
    let tok = deco_formats::tokenizer::Tokenizer::from_gguf(gguf)?;
    let dtype = match args.dtype {
        OutDtype::F32 => ExportDtype::F32,
        OutDtype::Bf16 => ExportDtype::Bf16,
    };
    write_hf_dir(&ckpt, &tok, &args.out_dir, dtype)?;
    eprintln!("wrote {}", args.out_dir.display());
    Ok(())
}
