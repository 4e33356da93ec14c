//! `deco quantize`: quantize a model (RTN, GPTQ, AWQ, NF4, SmoothQuant W8A8, LLM.int8()) and
//! write it as a GPTQ / AWQ GEMM / compressed-tensors directory, a GGUF Q8_0 / Q4_0 / Q4_1 file,
//! a GGUF F32 file (`gguf-f32`: the source GGUF's quantized tensors dequantized, no method),
//! or a fake-quantized f32 directory (W8A8 and LLM.int8(): plus `deco_act_quant.json`, the
//! run-time activation scheme that `deco eval kld` applies). Output is atomic (temporary
//! sibling, renamed at the end). Prints one `[quantize]` line on stdout with
//! `bits_per_weight`, `linear_bytes`, `model_bytes` (other tensors at f16) and `seconds`
//! (quantization only).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};
use clap::{Args, ValueEnum};
use deco_formats::checkpoint::Checkpoint;
use deco_formats::ggml::GgmlType;
use deco_formats::quantized::{QuantConfig, QuantMethod};
use deco_model::calibrate::CalibDtype;
use deco_quant::awq::AwqConfig;
use deco_quant::export::{write_fake_dir, write_gguf_f32, write_gguf_model, write_packed_dir};
use deco_quant::gptq::GptqConfig;
use deco_quant::pipeline::{Method, calibration_windows, quantize_model};
use deco_quant::scheme::{Granularity, Scheme};
use indicatif::{ProgressBar, ProgressStyle};

use crate::ModelArgs;

/// `--calib-dtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum CalibDtypeArg {
    /// f32 products.
    F32,
    /// bf16 inputs, f32 sums (AVX-512 BF16 only).
    Bf16,
    /// 16-bit integer inputs scaled per block of 64 values, exact block sums (x86-64 AVX2 only).
    Int16,
}

/// Quantization algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum MethodArg {
    /// Round to nearest (AutoGPTQ's scale/zero convention).
    Rtn,
    /// GPTQ (needs --calib).
    Gptq,
    /// NormalFloat-4, blocks of --group-size (64 by convention), double quantization; `fake` only.
    Nf4,
    /// AWQ (needs --calib): activation-aware scale search folded into the norms, clip search, RTN.
    Awq,
    /// SmoothQuant W8A8 (needs --calib, --alpha): int8 weights per channel, int8 activations per
    /// token at run time; `fake` only.
    Smoothquant,
    /// LLM.int8(): int8 weights per row, outlier activation columns (|x| >= --threshold, or
    /// --auto-outliers from --calib) kept in float at run time; `fake` only.
    Int8,
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
    /// GGUF Q8_0 as `llama-quantize --pure` writes it, byte for byte: linears, token embedding
    /// and output head in Q8_0 (ggml's quantizer), norms copied (needs a GGUF source).
    #[value(name = "gguf-q8_0")]
    GgufQ8_0,
    /// GGUF Q4_0 as `llama-quantize --pure` writes it.
    #[value(name = "gguf-q4_0")]
    GgufQ4_0,
    /// GGUF Q4_1 as `llama-quantize --pure` writes it.
    #[value(name = "gguf-q4_1")]
    GgufQ4_1,
    /// GGUF with every quantized tensor of the GGUF source (linears, and token embedding /
    /// output when quantized) dequantized to F32, norms copied: the same network, unquantized
    /// storage. Takes no method (`--bits`, `--group-size` are ignored).
    #[value(name = "gguf-f32")]
    GgufF32,
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
    /// Input columns per group; -1 for one group per output channel. Default: 128 (AutoGPTQ's);
    /// for `--format gptq|awq|compressed-tensors` the largest of 128, 64, 32 that divides every
    /// linear's input (their loaders need whole groups: vLLM's GPTQ/Marlin kernels and
    /// gptqmodel refuse a ragged last group, so those formats refuse a size that does not
    /// divide). `--format fake` accepts any size (AutoGPTQ's ragged last group).
    #[arg(long, allow_hyphen_values = true)]
    group_size: Option<i64>,
    /// Symmetric quantization (the default, as AutoGPTQ's, except for `--format awq`).
    #[arg(long, conflicts_with = "asym")]
    sym: bool,
    /// Asymmetric quantization (per-group zero point; the default for `--format awq`, whose GEMM
    /// layout stores zero points, as AutoAWQ's `zero_point=True`).
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
    /// GPTQ: MSE-optimal scale/zero search per group (GPTQModel's `mse`): the norm p of the
    /// shrink search's sum |q(x) - x|^p (2.4, the reference's); 0 = min-max parameters.
    /// Default 2.4 (GPTQModel's default is 0; see docs/quantization.md for why deco differs).
    #[arg(long, allow_hyphen_values = true)]
    mse: Option<f64>,
    /// Precision of the calibration products (the layer-by-layer forward over the calibration
    /// windows and GPTQ's Hessians): `bf16` rounds the linears' inputs and weights to bf16 and
    /// sums in f32 (AVX-512 BF16, about twice the f32 rate), `int16` quantizes them to 16-bit
    /// integers per block of 64 values (AVX2 `vpmaddwd`, 1.1-1.45x the f32 rate on Zen 3),
    /// `f32` keeps the model's arithmetic. Default: bf16 where the CPU has AVX-512 BF16, else
    /// f32 (docs/quantization.md has the measured effect on perplexity). `bf16` and `int16` are
    /// refused where they cannot run.
    #[arg(long, value_enum)]
    calib_dtype: Option<CalibDtypeArg>,
    /// SmoothQuant migration strength alpha in [0, 1].
    #[arg(long, default_value_t = 0.5)]
    alpha: f64,
    /// LLM.int8() outlier threshold on |x| (> 0).
    #[arg(long, default_value_t = 6.0)]
    threshold: f32,
    /// LLM.int8(): fixed outlier columns per layer from calibration (max|X_j| > mean + 3 sigma)
    /// instead of --threshold (needs --calib).
    #[arg(long)]
    auto_outliers: bool,
    /// AWQ: skip the clipping search.
    #[arg(long)]
    no_clip: bool,
    /// Calibration windows (GPTQ, AWQ, SmoothQuant, LLM.int8() --auto-outliers).
    #[arg(long, default_value_t = 128)]
    nsamples: usize,
    /// Tokens per calibration window. 256: on SmolLM2 GPTQ calibrated on 128 windows of 256
    /// tokens beats 128 windows of 512 on every text, at 256- and 512-token evaluation alike,
    /// in half the time (docs/quantization.md).
    #[arg(long, default_value_t = 256)]
    seqlen: usize,
    /// Seed of the calibration window starts.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// UTF-8 calibration text (GPTQ, AWQ, SmoothQuant, --auto-outliers). Repeat for a mixed
    /// corpus: the --nsamples windows are split evenly over the files (the first files get the
    /// remainder), each file's window starts drawn with seed --seed + its index. Default: the
    /// mixed corpus wiki_train.txt + shakespeare/train.txt from `cargo xtask fetch`'s cache.
    #[arg(long)]
    calib: Vec<PathBuf>,
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

/// Group sizes the packed formats' loaders accept besides -1 (vLLM's Marlin kernels: 32, 64,
/// 128), largest first: the default picks the first that divides every linear's input.
const LOADER_GROUP_SIZES: [usize; 3] = [128, 64, 32];

/// The input widths of the decoder's linears (q/k/v/gate/up take `hidden_size`, o_proj the
/// attention width, down_proj `intermediate_size`).
fn input_dims(cfg: &deco_formats::config::ModelConfig) -> [usize; 3] {
    [cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim]
}

fn is_packed(f: FormatArg) -> bool {
    matches!(f, FormatArg::Gptq | FormatArg::Awq | FormatArg::CompressedTensors)
}

/// The group size used: `--group-size`, else 128, or for the packed formats the largest of
/// [`LOADER_GROUP_SIZES`] dividing every input width (-1 if none does).
fn group_size(args: &QuantizeArgs, cfg: &deco_formats::config::ModelConfig) -> i64 {
    match args.group_size {
        Some(g) => g,
        None if is_packed(args.format) => {
            LOADER_GROUP_SIZES.iter().find(|&&g| input_dims(cfg).iter().all(|d| d % g == 0)).map_or(-1, |&g| g as i64)
        }
        None => 128,
    }
}

/// Symmetric or not: `--sym` / `--asym`, else symmetric except for `--format awq`.
fn is_sym(args: &QuantizeArgs) -> bool {
    if args.asym {
        false
    } else {
        args.sym || args.format != FormatArg::Awq
    }
}

/// Checks the method / format / bits combination before any work is done.
fn validate(args: &QuantizeArgs, cfg: &deco_formats::config::ModelConfig) -> Result<()> {
    ensure!(matches!(args.bits, 2 | 3 | 4 | 8), "--bits {} is not one of 2, 3, 4, 8", args.bits);
    let gsz = group_size(args, cfg);
    ensure!(gsz == -1 || gsz > 0, "--group-size must be positive or -1, got {gsz}");
    let sym = is_sym(args);
    ensure!((0.0..=1.0).contains(&args.alpha), "--alpha {} is outside [0, 1]", args.alpha);
    ensure!(args.threshold > 0.0 && args.threshold.is_finite(), "--threshold must be positive, got {}", args.threshold);
    let act = matches!(args.method, MethodArg::Smoothquant | MethodArg::Int8);
    if act {
        ensure!(
            args.format == FormatArg::Fake,
            "--method {:?} quantizes activations at run time: only --format fake (f32 weights + deco_act_quant.json, evaluated by `deco eval kld`) can hold it",
            args.method
        );
        ensure!(args.bits == 8, "--method {:?} is int8: --bits must be 8 (got {})", args.method, args.bits);
    }
    if args.auto_outliers {
        ensure!(args.method == MethodArg::Int8, "--auto-outliers applies to --method int8 only");
    }
    match args.format {
        FormatArg::GgufQ8_0 | FormatArg::GgufQ4_0 | FormatArg::GgufQ4_1 => {
            ensure!(
                args.method == MethodArg::Rtn,
                "GGUF formats use ggml's own block quantizers (round to nearest, blocks of 32); use --method rtn"
            );
            let want = if args.format == FormatArg::GgufQ8_0 { 8 } else { 4 };
            ensure!(args.bits == want, "--format {:?} stores {want}-bit codes, got --bits {}", args.format, args.bits);
        }
        FormatArg::GgufF32 => {
            ensure!(
                args.method == MethodArg::Rtn,
                "--format gguf-f32 dequantizes the source's tensors (no quantization method applies); drop --method {:?}",
                args.method
            );
        }
        FormatArg::Fake => {}
        packed => {
            ensure!(
                args.method != MethodArg::Nf4,
                "NF4 has no integer codes with zero points; use --format fake for NF4"
            );
            if gsz > 0 {
                let g = gsz as usize;
                if let Some(d) = input_dims(cfg).into_iter().find(|d| d % g != 0) {
                    let valid: Vec<String> = LOADER_GROUP_SIZES.iter().filter(|&&v| input_dims(cfg).iter().all(|d| d % v == 0)).map(|v| v.to_string()).chain(["-1".to_string()]).collect();
                    bail!(
                        "--group-size {g} does not divide the input width {d} of this model's linears: --format {packed:?} loaders (vLLM's GPTQ/Marlin kernels, gptqmodel, AutoAWQ) need whole groups; valid here: {} (or --format fake, which allows a ragged last group)",
                        valid.join(", ")
                    );
                }
            }
            match packed {
                FormatArg::Gptq => {
                    ensure!(matches!(args.bits, 2 | 4 | 8), "--format gptq supports --bits 2, 4, 8 (got {})", args.bits);
                }
                FormatArg::Awq => {
                    ensure!(args.bits == 4, "AWQ GEMM stores 4-bit codes only (got --bits {})", args.bits);
                    ensure!(!args.desc_act, "AWQ has no g_idx; --desc-act cannot be stored");
                    ensure!(!sym, "the AWQ GEMM format stores zero points (AutoAWQ's zero_point=True): drop --sym");
                }
                FormatArg::CompressedTensors => {
                    ensure!(
                        !args.desc_act || args.static_groups,
                        "compressed-tensors >= 0.19 stores act-order only as `actorder: \"weight\"` (groups in the original column order, no g_idx): add --static-groups to --desc-act"
                    );
                }
                _ => {}
            }
            if packed == FormatArg::Gptq && !sym {
                eprintln!("note: GPTQ v1 stores zero - 1; a group whose zero point is 0 will be refused (use --sym to avoid)");
            }
        }
    }
    if needs_calib(args) {
        let files = if args.calib.is_empty() { DEFAULT_CALIB.len() } else { args.calib.len() };
        ensure!(
            args.nsamples >= files,
            "--nsamples {} is fewer than the {files} calibration files (at least one window per file)",
            args.nsamples
        );
    }
    if args.method != MethodArg::Gptq && (args.desc_act || args.static_groups) {
        bail!("--desc-act / --static-groups apply to --method gptq only");
    }
    if args.calib_dtype.is_some() && !needs_calib(args) {
        bail!("--calib-dtype applies to the methods that calibrate (gptq, awq, smoothquant, int8 --auto-outliers)");
    }
    if let Some(m) = args.mse {
        ensure!(args.method == MethodArg::Gptq, "--mse applies to --method gptq only");
        ensure!(m >= 0.0 && m.is_finite(), "--mse {m} must be 0 (off) or a positive norm such as 2.4");
    }
    Ok(())
}

/// The default calibration corpus (paths under the data cache): general text of two registers,
/// so that GPTQ's Hessians are not those of one domain (docs/quantization.md: calibrating on
/// wiki alone leaves GPTQ barely ahead of RTN on Shakespeare; the mix wins on both and on an
/// unseen third text).
const DEFAULT_CALIB: [&str; 2] = ["wiki_train.txt", "shakespeare/train.txt"];

/// GPTQ's default `--mse` norm (the reference `Quantizer`'s 2.4).
const GPTQ_DEFAULT_MSE: f64 = 2.4;

/// Fewest calibration tokens per input feature of the widest linear below which `deco quantize`
/// warns that GPTQ will over-fit (measured on SmolLM2's down_proj: at 2.7 tokens per input
/// GPTQ's held-out output error exceeds RTN's, at 21 it is 17% below; docs/quantization.md).
const GPTQ_MIN_TOKENS_PER_INPUT: f64 = 16.0;

fn needs_calib(args: &QuantizeArgs) -> bool {
    matches!(args.method, MethodArg::Gptq | MethodArg::Awq | MethodArg::Smoothquant) || (args.method == MethodArg::Int8 && args.auto_outliers)
}

/// Runs the command.
pub fn run(args: &QuantizeArgs) -> Result<()> {
    let start = Instant::now();
    if args.out.exists() && !(args.out.is_dir() && std::fs::read_dir(&args.out).map(|mut d| d.next().is_none()).unwrap_or(false)) {
        bail!("{}: exists (the output must not exist, or be an empty directory)", args.out.display());
    }
    let margs = ModelArgs { model: args.model.clone(), device: args.device.clone(), threads: args.threads, q8_activations: false, lora: None };
    let device = crate::runtime::device(&margs)?;
    let ckpt = Checkpoint::open(&args.model)?;
    let cfg = ckpt.config.clone();
    validate(args, &cfg)?;
    let tok = crate::runtime::load_tokenizer(&args.model)?;
    let src = |n: &str| -> deco_model::Result<(Vec<usize>, Vec<f32>)> { Ok(ckpt.tensor(n)?) };
    let sym = is_sym(args);
    let gsz = group_size(args, &cfg);
    if args.group_size.is_none() && is_packed(args.format) && gsz != 128 {
        eprintln!("note: --group-size not given: using {gsz} (the largest of 128, 64, 32 dividing every linear's input width {:?})", input_dims(&cfg));
    }
    let granularity = if gsz < 0 { Granularity::PerChannel } else { Granularity::PerGroup(gsz as usize) };
    let scheme = Scheme { bits: args.bits, sym, granularity };
    let method = match args.method {
        MethodArg::Rtn => Method::Rtn,
        MethodArg::Nf4 => Method::Nf4,
        MethodArg::Awq => Method::Awq(AwqConfig { clip: !args.no_clip, ..AwqConfig::default() }),
        MethodArg::Smoothquant => Method::SmoothQuant { alpha: args.alpha },
        MethodArg::Int8 => Method::LlmInt8 { threshold: args.threshold, auto: args.auto_outliers },
        MethodArg::Gptq => Method::Gptq(GptqConfig {
            bits: args.bits,
            group_size: (gsz > 0).then_some(gsz as usize),
            sym,
            damp_percent: args.damp_percent,
            desc_act: args.desc_act,
            static_groups: args.static_groups,
            blocksize: 128,
            mse: args.mse.unwrap_or(GPTQ_DEFAULT_MSE),
        }),
    };
    let mut windows = Vec::new();
    if needs_calib(args) {
        let calib: Vec<PathBuf> = if args.calib.is_empty() {
            let files = DEFAULT_CALIB.iter().map(|rel| crate::runtime::data_file(&args.model, rel, "--calib FILE")).collect::<Result<Vec<_>>>()?;
            eprintln!("calibration: {} (default mixed corpus; --calib FILE to choose)", files.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(" + "));
            files
        } else {
            args.calib.clone()
        };
        let k = calib.len();
        // The files, and pieces of each, are tokenized in parallel (`encode_corpus`): most of
        // the time before the first layer.
        let encoded: Vec<Result<Vec<u32>>> = {
            use rayon::prelude::*;
            calib
                .par_iter()
                .map(|path| {
                    let text = std::fs::read_to_string(path).with_context(|| format!("reading calibration text {}", path.display()))?;
                    ensure!(!text.trim().is_empty(), "--calib {}: the calibration text is empty", path.display());
                    crate::runtime::encode_corpus(&tok, &text)
                })
                .collect()
        };
        for (i, (path, ids)) in calib.iter().zip(encoded).enumerate() {
            let ids = ids?;
            let n = args.nsamples / k + usize::from(i < args.nsamples % k);
            windows.extend(
                calibration_windows(&ids, n, args.seqlen, args.seed + i as u64).with_context(|| format!("calibration text {}", path.display()))?,
            );
        }
    }
    if args.method == MethodArg::Gptq {
        // GPTQ's compensation is a least-squares fit to the Hessian of each linear's inputs;
        // with few calibration tokens per input feature it fits noise (docs/quantization.md,
        // "GPTQ vs RTN at W4 g128 on text it was not calibrated on": down_proj of SmolLM2 at 4,096 tokens for 1,536 inputs).
        let tokens: usize = windows.iter().map(Vec::len).sum();
        let widest = cfg.intermediate_size.max(cfg.hidden_size).max(cfg.num_attention_heads * cfg.head_dim);
        let per = tokens as f64 / widest as f64;
        if per < GPTQ_MIN_TOKENS_PER_INPUT {
            eprintln!(
                "warning: GPTQ calibration has {tokens} tokens for linears of up to {widest} inputs ({per:.1} tokens per input, < {GPTQ_MIN_TOKENS_PER_INPUT}): \
                 the error compensation will over-fit the calibration text; raise --nsamples / --seqlen (see docs/quantization.md)"
            );
        }
    }
    let layers = cfg.num_hidden_layers;
    let ggml = match args.format {
        FormatArg::GgufQ8_0 => Some(GgmlType::Q8_0),
        FormatArg::GgufQ4_0 => Some(GgmlType::Q4_0),
        FormatArg::GgufQ4_1 => Some(GgmlType::Q4_1),
        _ => None,
    };
    let stats = if args.format == FormatArg::GgufF32 {
        let g = ckpt.gguf().context("--format gguf-f32 needs a GGUF source model (--model FILE.gguf)")?;
        let s = write_gguf_f32(g, &args.out, &mut |_| {})?;
        println!("[quantize] method=dequantize-f32 converted_tensors={} bytes={}", s.linears, s.bytes);
        s
    } else if let Some(ty) = ggml {
        let g = ckpt.gguf().context("GGUF export needs a GGUF source model (its tokenizer and metadata are copied)")?;
        let pb = progress(layers, "gguf");
        let s = write_gguf_model(g, &cfg, &src, ty, &args.out, &mut |_| pb.inc(1))?;
        pb.finish();
        s
    } else {
        let pb = progress(layers, "quantize");
        let scheme = if args.method == MethodArg::Nf4 {
            Scheme { granularity: Granularity::PerGroup(if gsz > 0 { gsz as usize } else { 64 }), ..scheme }
        } else {
            scheme
        };
        let t0 = Instant::now();
        let dtype = match args.calib_dtype {
            None => CalibDtype::auto(&device),
            Some(CalibDtypeArg::F32) => CalibDtype::F32,
            Some(CalibDtypeArg::Bf16) => CalibDtype::Bf16,
            Some(CalibDtypeArg::Int16) => CalibDtype::Int16,
        };
        if needs_calib(args) {
            let what = match dtype {
                CalibDtype::Bf16 => "bf16 (AVX-512 BF16; --calib-dtype f32 for f32)",
                CalibDtype::Int16 => "int16 (AVX2, 16-bit block-scaled integers)",
                CalibDtype::F32 => "f32",
            };
            eprintln!("calibration products: {what}");
        }
        let qm = quantize_model(&cfg, &src, &device, &windows, &method, &scheme, dtype, &mut |li| {
            pb.inc(1);
            if pb.is_hidden() {
                eprintln!("[quantize] layer {}/{layers} done at {:.1}s", li + 1, t0.elapsed().as_secs_f64());
            }
        })?;
        let secs = t0.elapsed().as_secs_f64();
        pb.finish();
        let total_params: usize = deco_formats::checkpoint::hf_tensor_names(&cfg)
            .iter()
            .map(|n| src(n).map(|(shape, _)| shape.iter().product::<usize>()))
            .sum::<deco_model::Result<usize>>()?;
        let linear_bytes = qm.storage_bits / 8.0;
        let model_bytes = linear_bytes + 2.0 * (total_params - qm.weights) as f64;
        println!(
            "[quantize] method={:?} bits_per_weight={:.4} linear_bytes={:.0} model_bytes={:.0} seconds={secs:.2}",
            args.method,
            qm.bits_per_weight(),
            linear_bytes,
            model_bytes
        );
        let qsrc = qm.source(&src);
        if args.format == FormatArg::Fake {
            let extra: Vec<(&str, String)> = match &qm.act_quant {
                Some(aq) => vec![(deco_quant::smooth::ACT_QUANT_FILE, serde_json::to_string_pretty(&aq.to_json())?)],
                None => Vec::new(),
            };
            write_fake_dir(&cfg, &qsrc, &tok, &qm.linears, &extra, &args.out)?
        } else {
            let qm_kind = match args.format {
                FormatArg::Gptq => QuantMethod::Gptq,
                FormatArg::Awq => QuantMethod::Awq,
                _ => QuantMethod::CompressedTensors,
            };
            let mut qc = QuantConfig::new(qm_kind, args.bits, (gsz > 0).then_some(gsz as usize), sym);
            qc.desc_act = args.desc_act;
            qc.static_groups = args.static_groups;
            qc.damp_percent = args.damp_percent;
            write_packed_dir(&cfg, &qsrc, &tok, &qm.quantized, &qc, &args.out)?
        }
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
