//! `deco`: run, inspect, convert and evaluate Llama-family models.
//!
//! Every subcommand that takes `--model` accepts a GGUF file or a Hugging Face directory
//! (`config.json`, `model.safetensors`, `tokenizer.json`).

mod autodeco;
mod convert;
mod distill;
mod early_exit_eval;
mod generate;
mod ppl;
mod prune;
mod quantize;
mod kld;
mod layer_error;
mod lora;
mod medusa;
mod runtime;
mod serve;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};

/// deco: load, decode, serve and compress Llama-family language models.
#[derive(Debug, Parser)]
#[command(name = "deco", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// One value per process, parsed once: boxing the large argument structs buys nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Command {
    /// Generate text from a prompt, streaming it to stdout.
    Generate(generate::GenerateArgs),
    /// Serve the model over an OpenAI-compatible HTTP API (continuous batching, paged KV cache).
    Serve(serve::ServeArgs),
    /// Tokenize text and print the ids as a JSON list.
    Tokenize(TokenizeArgs),
    /// Print a GGUF file's metadata and tensor table (or a HF directory's config and tensors).
    Inspect {
        /// GGUF file or Hugging Face directory.
        file: PathBuf,
    },
    /// Convert a GGUF model to a Hugging Face directory (safetensors, config, tokenizer).
    Convert(convert::ConvertArgs),
    /// Evaluate a model.
    #[command(subcommand)]
    Eval(EvalCommand),
    /// Prune a model: magnitude / Wanda / SparseGPT (unstructured or N:M) or structured heads,
    /// neurons, layers; writes a Hugging Face directory (or the sparse form).
    Prune(prune::PruneArgs),
    /// Distill a frozen teacher into a student (e.g. a pruned model): kd, reverse-kl or cot.
    Distill(distill::DistillArgs),
    /// AutoDeco: learned per-token temperature and top-p heads (train them here; decode with
    /// `deco generate --autodeco HEADS`).
    #[command(subcommand)]
    Autodeco(autodeco::AutodecoCommand),
    /// LoRA / QLoRA adapters: train them on a frozen (NF4 or f32) base, evaluate them (apply
    /// them with `--lora DIR` on generate, serve, eval ppl).
    #[command(subcommand)]
    Lora(lora::LoraCommand),
    /// Medusa-1 heads (Cai et al. 2024): train them on a frozen base with self-distilled
    /// data, measure their per-head accuracy.
    #[command(subcommand)]
    Medusa(medusa::MedusaCommand),
    /// Quantize a model (RTN, GPTQ, NF4) and write it as GPTQ / AWQ / compressed-tensors / GGUF /
    /// fake-quantized f32.
    Quantize(quantize::QuantizeArgs),
}

#[derive(Debug, Subcommand)]
enum EvalCommand {
    /// Perplexity over non-overlapping windows of a text file (no BOS; each window scored on
    /// its seqlen-1 next-token predictions). Prints `ppl=<value>` last.
    Ppl(ppl::PplArgs),
    /// Mean KL(reference || model) per token, top-1 agreement and both perplexities.
    Kld(kld::KldArgs),
    /// Early exit vs the full model, teacher-forced: both perplexities, top-1 agreement, layers skipped.
    EarlyExit(early_exit_eval::EarlyExitEvalArgs),
    /// Per-layer relative output error of quantized models against their base, on the base
    /// model's activations of a (held-out) text.
    LayerError(layer_error::LayerErrorArgs),
}

/// Options shared by the commands that load a model.
#[derive(Debug, Args, Clone)]
pub struct ModelArgs {
    /// GGUF file or Hugging Face model directory.
    #[arg(long)]
    pub model: PathBuf,
    /// Compute device: flex (CPU, default), wgpu, cuda.
    #[arg(long, default_value = "flex")]
    pub device: String,
    /// CPU threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Quantize the activations to 8 bits per block of 32 inside the packed-weight (GGUF
    /// Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q6_K) matmuls and use integer dot products, as llama.cpp does:
    /// faster, less accurate (see docs/performance.md). Any CPU: AVX-512 VNNI or AVX2 integer
    /// kernels on x86-64, NEON on ARM (`sdot` with the dotprod extension), portable loops
    /// elsewhere; all give the same bits.
    #[arg(long)]
    pub q8_activations: bool,
    /// PEFT LoRA adapter directory (`deco lora train`, `peft` `save_pretrained`) merged into the
    /// weights at load, `W + lora_alpha/r · B·A`; the model is then held in f32 (no packed GGUF
    /// blocks).
    #[arg(long)]
    pub lora: Option<PathBuf>,
}

#[derive(Debug, Args)]
struct TokenizeArgs {
    /// GGUF file or Hugging Face model directory.
    #[arg(long)]
    model: PathBuf,
    /// The text to tokenize.
    #[arg(long)]
    text: String,
    /// Treat special-token text such as `<|im_start|>` as plain text.
    #[arg(long)]
    no_parse_special: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(args) => generate::run(&args),
        Command::Serve(args) => serve::run(&args),
        Command::Tokenize(args) => tokenize(&args),
        Command::Inspect { file } => inspect(&file),
        Command::Convert(args) => convert::run(&args),
        Command::Eval(EvalCommand::Ppl(args)) => ppl::run(&args),
        Command::Prune(args) => {
            runtime::retain_freed_memory();
            prune::run(&args)
        }
        Command::Distill(args) => distill::run(&args),
        Command::Autodeco(cmd) => autodeco::run(&cmd),
        Command::Eval(EvalCommand::Kld(args)) => kld::run(&args),
        Command::Eval(EvalCommand::EarlyExit(args)) => early_exit_eval::run(&args),
        Command::Eval(EvalCommand::LayerError(args)) => layer_error::run(&args),
        Command::Quantize(args) => {
            runtime::retain_freed_memory();
            quantize::run(&args)
        }
        Command::Lora(cmd) => lora::run(&cmd),
        Command::Medusa(cmd) => medusa::run(&cmd),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn tokenize(args: &TokenizeArgs) -> Result<()> {
    let tok = runtime::load_tokenizer(&args.model)?;
    let ids = tok.encode(&args.text, !args.no_parse_special)?;
    println!("{}", serde_json::to_string(&ids)?);
    Ok(())
}

fn inspect(path: &std::path::Path) -> Result<()> {
    if path.is_dir() {
        let ckpt = deco_formats::checkpoint::Checkpoint::open(path)?;
        println!("directory: {}", path.display());
        println!("{}", serde_json::to_string_pretty(&ckpt.config.to_hf_json("float32"))?);
        for name in deco_formats::checkpoint::hf_tensor_names(&ckpt.config) {
            let (shape, _) = ckpt.tensor(&name).with_context(|| format!("reading {name}"))?;
            println!("  {name:<56} {shape:?}");
        }
    } else {
        let g = deco_formats::gguf::GgufFile::open(path)?;
        print!("{}", g.describe());
    }
    Ok(())
}
