//! `deco quantize`: quantize a model (RTN, GPTQ, NF4) and write it as a GPTQ / AWQ GEMM /
//! compressed-tensors directory, a GGUF Q8_0 / Q4_0 / Q4_1 file, or a fake-quantized f32
//! directory. Output is atomic (temporary sibling, renamed at the end).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};
use clap::{Args, ValueEnum};
use deco_formats::checkpoint::Checkpoint;
use deco_formats::ggml::GgmlType;
use deco_formats::quantized::{QuantConfig, QuantMethod};
use deco_quant::export::{quantize_linears, write_fake_dir, write_gguf_model, write_packed_dir};
use deco_quant::gptq::GptqConfig;
use deco_quant::pipeline::{Method, calibration_windows, quantize_model};
use deco_quant::scheme::{Granularity, Scheme};
use indicatif::{ProgressBar, ProgressStyle};

use crate::ModelArgs;

/// Quantization algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum MethodArg {
    /// Round to nearest (AutoGPTQ's scale/zero convention).
    Rtn,
    /// GPTQ (needs --calib).
    Gptq,
    /// NormalFloat-4, blocks of --group-size (64 by convention), double quantization; `fake` only.
    Nf4,
}

/// Output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FormatArg {
    /// AutoGPTQ directory (qweight/qzeros/scales/g_idx, quantize_config.json, v1 zeros).
    Gptq,
    /// AutoAWQ GEMM directory (4-bit, interleaved packing).
    Awq,
    /// compressed-tensors `pack-quantized` directory.
    CompressedTensors,
    /// GGUF with Q8_0 linears (ggml's quantizer; needs a GGUF source).
    #[value(name = "gguf-q8_0")]
    GgufQ8_0,
    /// GGUF with Q4_0 linears.
    #[value(name = "gguf-q4_0")]
    GgufQ4_0,
    /// GGUF with Q4_1 linears.
    #[value(name = "gguf-q4_1")]
    GgufQ4_1,
    /// Hugging Face directory with fake-quantized f32 weights.
    Fake,
}

/// Arguments of `deco quantize`.
#[derive(Debug, Args)]
pub struct QuantizeArgs {
    /// GGUF file or Hugging Face model directory to quantize.
    #[arg(long)]
    model: PathBuf,
    /// Algorithm.
    #[arg(long, value_enum, default_value_t = MethodArg::Rtn)]
    method: MethodArg,
    /// Bits per weight (2, 3, 4, 8).
    #[arg(long, default_value_t = 4)]
    bits: u32,
    /// Input columns per group; -1 for one group per output channel. A size that does not divide
    /// a layer's input gets AutoGPTQ's ragged last group (RTN only).
    #[arg(long, default_value_t = 128, allow_hyphen_values = true)]
    group_size: i64,
    /// Symmetric quantization (the default, as AutoGPTQ's).
    #[arg(long, conflicts_with = "asym")]
    sym: bool,
    /// Asymmetric quantization (per-group zero point).
    #[arg(long)]
    asym: bool,
    /// GPTQ act-order: quantize columns by decreasing Hessian diagonal (writes a permuted g_idx).
    #[arg(long)]
    desc_act: bool,
    /// GPTQ static groups.
    #[arg(long)]
    static_groups: bool,
    /// GPTQ dampening, fraction of the mean Hessian diagonal.
    #[arg(long, default_value_t = 0.01)]
    damp_percent: f64,
    /// Calibration windows (GPTQ).
    #[arg(long, default_value_t = 128)]
    nsamples: usize,
    /// Tokens per calibration window.
    #[arg(long, default_value_t = 512)]
    seqlen: usize,
    /// Seed of the calibration window starts.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// UTF-8 calibration text (GPTQ).
    #[arg(long)]
    calib: Option<PathBuf>,
    /// Output format.
    #[arg(long, value_enum)]
    format: FormatArg,
    /// Output directory (GGUF formats: output file). Must not exist (or be an empty directory).
    #[arg(long)]
    out: PathBuf,
    /// Compute device for GPTQ calibration: flex (CPU, default), wgpu, cuda.
    #[arg(long, default_value = "flex")]
    device: String,
    /// CPU threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
}

fn progress(layers: usize, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(layers as u64);
    if let Ok(style) = ProgressStyle::with_template("{msg} [{elapsed_precise}] {bar:30} layer {pos}/{len} (eta {eta})") {
        pb.set_style(style);
    }
    pb.set_message(what.to_string());
    pb
}

/// Checks the method / format / bits combination before any work is done.
fn validate(args: &QuantizeArgs, cfg: &deco_formats::config::ModelConfig) -> Result<()> {
    ensure!(matches!(args.bits, 2 | 3 | 4 | 8), "--bits {} is not one of 2, 3, 4, 8", args.bits);
    ensure!(args.group_size == -1 || args.group_size > 0, "--group-size must be positive or -1, got {}", args.group_size);
    let sym = !args.asym;
    match args.format {
        FormatArg::GgufQ8_0 | FormatArg::GgufQ4_0 | FormatArg::GgufQ4_1 => {
            ensure!(
                args.method == MethodArg::Rtn,
                "GGUF formats use ggml's own block quantizers (round to nearest, blocks of 32); use --method rtn"
            );
            let want = if args.format == FormatArg::GgufQ8_0 { 8 } else { 4 };
            ensure!(args.bits == want, "--format {:?} stores {want}-bit codes, got --bits {}", args.format, args.bits);
        }
        FormatArg::Fake => {}
        packed => {
            ensure!(
                args.method != MethodArg::Nf4,
                "NF4 has no integer codes with zero points; use --format fake for NF4"
            );
            match packed {
                FormatArg::Gptq => {
                    ensure!(matches!(args.bits, 2 | 4 | 8), "--format gptq supports --bits 2, 4, 8 (got {})", args.bits);
                }
                FormatArg::Awq => {
                    ensure!(args.bits == 4, "AWQ GEMM stores 4-bit codes only (got --bits {})", args.bits);
                    ensure!(!args.desc_act, "AWQ has no g_idx; --desc-act cannot be stored");
                    if args.group_size > 0 {
                        let g = args.group_size as usize;
                        for d in [cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim] {
                            ensure!(d % g == 0, "AWQ needs --group-size to divide every input dimension; {g} does not divide {d}");
                        }
                    }
                }
                _ => {}
            }
            if packed == FormatArg::Gptq && !sym {
                eprintln!("note: GPTQ v1 stores zero - 1; a group whose zero point is 0 will be refused (use --sym to avoid)");
            }
        }
    }
    if args.method == MethodArg::Gptq {
        ensure!(args.calib.is_some(), "--method gptq needs --calib FILE (calibration text)");
    } else if args.desc_act || args.static_groups {
        bail!("--desc-act / --static-groups apply to --method gptq only");
    }
    Ok(())
}

/// Runs the command.
pub fn run(args: &QuantizeArgs) -> Result<()> {
    let start = Instant::now();
    if args.out.exists() && !(args.out.is_dir() && std::fs::read_dir(&args.out).map(|mut d| d.next().is_none()).unwrap_or(false)) {
        bail!("{}: exists (the output must not exist, or be an empty directory)", args.out.display());
    }
    let margs = ModelArgs { model: args.model.clone(), device: args.device.clone(), threads: args.threads };
    let device = crate::runtime::device(&margs)?;
    let ckpt = Checkpoint::open(&args.model)?;
    let cfg = ckpt.config.clone();
    validate(args, &cfg)?;
    let tok = crate::runtime::load_tokenizer(&args.model)?;
    let src = |n: &str| -> deco_model::Result<(Vec<usize>, Vec<f32>)> { Ok(ckpt.tensor(n)?) };
    let sym = !args.asym;
    let granularity = if args.group_size < 0 { Granularity::PerChannel } else { Granularity::PerGroup(args.group_size as usize) };
    let scheme = Scheme { bits: args.bits, sym, granularity };
    let method = match args.method {
        MethodArg::Rtn => Method::Rtn,
        MethodArg::Nf4 => Method::Nf4,
        MethodArg::Gptq => Method::Gptq(GptqConfig {
            bits: args.bits,
            group_size: (args.group_size > 0).then_some(args.group_size as usize),
            sym,
            damp_percent: args.damp_percent,
            desc_act: args.desc_act,
            static_groups: args.static_groups,
            blocksize: 128,
        }),
    };
    let windows = match (&args.calib, args.method) {
        (Some(path), MethodArg::Gptq) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("reading calibration text {}", path.display()))?;
            let ids = tok.encode_with(&text, false, true)?;
            calibration_windows(&ids, args.nsamples, args.seqlen, args.seed).with_context(|| format!("calibration text {}", path.display()))?
        }
        _ => Vec::new(),
    };
    let layers = cfg.num_hidden_layers;
    let ggml = match args.format {
        FormatArg::GgufQ8_0 => Some(GgmlType::Q8_0),
        FormatArg::GgufQ4_0 => Some(GgmlType::Q4_0),
        FormatArg::GgufQ4_1 => Some(GgmlType::Q4_1),
        _ => None,
    };
    let stats = if let Some(ty) = ggml {
        let g = ckpt.gguf().context("GGUF export needs a GGUF source model (its tokenizer and metadata are copied)")?;
        let pb = progress(layers, "gguf");
        let s = write_gguf_model(g, &cfg, &src, ty, &args.out, &mut |_| pb.inc(1))?;
        pb.finish();
        s
    } else if args.format == FormatArg::Fake {
        let pb = progress(layers, "quantize");
        let linears = if args.method == MethodArg::Nf4 {
            let scheme = Scheme { granularity: Granularity::PerGroup(if args.group_size > 0 { args.group_size as usize } else { 64 }), ..scheme };
            quantize_model(&cfg, &src, &device, &windows, &method, &scheme, &mut |_| pb.inc(1))?.linears
        } else {
            quantize_linears(&cfg, &src, &device, &windows, &method, &scheme, &mut |_| pb.inc(1))?
                .into_iter()
                .map(|(k, q)| (k, q.dequantize()))
                .collect()
        };
        pb.finish();
        write_fake_dir(&cfg, &src, &tok, &linears, &args.out)?
    } else {
        let pb = progress(layers, "quantize");
        let q = quantize_linears(&cfg, &src, &device, &windows, &method, &scheme, &mut |_| pb.inc(1))?;
        pb.finish();
        let qm = match args.format {
            FormatArg::Gptq => QuantMethod::Gptq,
            FormatArg::Awq => QuantMethod::Awq,
            _ => QuantMethod::CompressedTensors,
        };
        let mut qc = QuantConfig::new(qm, args.bits, (args.group_size > 0).then_some(args.group_size as usize), sym);
        qc.desc_act = args.desc_act;
        qc.static_groups = args.static_groups;
        qc.damp_percent = args.damp_percent;
        write_packed_dir(&cfg, &src, &tok, &q, &qc, &args.out)?
    };
    eprintln!(
        "wrote {} ({:.1} MB, {} quantized linears) in {:.1}s",
        args.out.display(),
        stats.bytes as f64 / 1e6,
        stats.linears,
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
