//! `deco lora train` / `deco lora eval`: LoRA and QLoRA adapters (see `deco_compress::lora`).
//!
//! `train` fine-tunes adapters on GSM8K-style JSON lines with the loss on the answer (rationale
//! and `#### N`, not the question) over a frozen base that is NF4 with double quantization
//! (`--quant nf4`, QLoRA) or f32 (`--quant none`). Checkpoints are PEFT adapter directories
//! `OUT/checkpoint-NNNNNN` (each built in a hidden temporary directory and renamed into place;
//! the last two are kept); at the end the final adapter's files are also installed at the top
//! of `OUT` (each file atomically), so `OUT` is what `peft.PeftModel.from_pretrained` and
//! `deco generate / serve / eval ppl --lora OUT` read. `--resume` continues from the highest
//! checkpoint (its step count; Adam restarts). Batches depend only on `(seed, step)`.
//!
//! `eval` prints the held-out answer loss (mean NLL per answer token) of the base, or of the
//! base with adapters applied on the fly (`LoraLayer`, not merged).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use burn::module::Module;
use burn::tensor::Device;
use clap::{Args, Subcommand, ValueEnum};
use deco_compress::distill::{CotExample, CotSequence, StepLog, cot_sequence, parse_gsm_jsonl};
use deco_compress::indicatif::{ProgressBar, ProgressStyle};
use deco_compress::lora::{HostAdapters, LoraAdapters, LoraConfig, LoraTrainConfig, NF4_BLOCKSIZE, completion_loss, nf4_base, parse_target_modules, train_lora};
use deco_compress::student::StudentModel;
use deco_formats::chat_template::ChatTemplate;
use deco_formats::checkpoint::Checkpoint;
use deco_formats::config::ModelConfig;
use deco_formats::tokenizer::Tokenizer;

/// `deco lora` subcommands.
#[derive(Debug, Subcommand)]
pub enum LoraCommand {
    /// Train LoRA adapters on a frozen base (NF4 with double quantization: QLoRA; or f32) with
    /// the loss on the answers of GSM8K-style JSON lines; writes a PEFT adapter directory.
    Train(TrainArgs),
    /// Held-out answer loss (mean NLL per answer token) of a base, with or without adapters.
    Eval(EvalArgs),
}

/// The frozen base's storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum QuantArg {
    /// Every decoder linear NF4 (blocks of 64, double quantization), dequantized for compute: QLoRA.
    Nf4,
    /// The weights as loaded (f32; GGUF blocks dequantized).
    None,
}

/// How a question is presented to the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PromptArg {
    /// The model's chat template (user turn + generation prompt), as `deco autodeco eval` and
    /// `deco generate --chat` prompt it; the answer ends with the EOS token.
    Chat,
    /// `Question: q\nAnswer: ` (the prompt of `deco distill --objective cot`).
    Plain,
}

/// Arguments of `deco lora train`.
#[derive(Debug, Args)]
pub struct TrainArgs {
    /// Base model: GGUF file or Hugging Face directory (frozen).
    #[arg(long)]
    model: PathBuf,
    /// Storage of the frozen base's decoder linears.
    #[arg(long, value_enum, default_value = "nf4")]
    quant: QuantArg,
    /// Adapted modules (PEFT names, comma-separated): q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj or all-linear.
    #[arg(long, value_delimiter = ',', default_value = "all-linear")]
    target_modules: Vec<String>,
    /// Rank r.
    #[arg(long, default_value_t = 16)]
    r: usize,
    /// lora_alpha: the update is scaled by alpha / r.
    #[arg(long, default_value_t = 32.0)]
    alpha: f64,
    /// lora_dropout on the adapters' input, in [0, 1).
    #[arg(long, default_value_t = 0.05)]
    dropout: f64,
    /// Total optimizer steps.
    #[arg(long, default_value_t = 200)]
    steps: usize,
    /// Sequences per step.
    #[arg(long, default_value_t = 4)]
    batch_size: usize,
    /// Longest sequence in tokens (longer examples are truncated).
    #[arg(long, default_value_t = 256)]
    seqlen: usize,
    /// Adam learning rate.
    #[arg(long, default_value_t = 2e-4)]
    lr: f64,
    /// Seed of the adapter initialization, batch sampling and dropout.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// JSON lines with `question` and `answer` (`... #### N`); default gsm_train.jsonl.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Prompt format.
    #[arg(long, value_enum, default_value = "chat")]
    prompt: PromptArg,
    /// Write a checkpoint every this many steps (and after the last).
    #[arg(long, default_value_t = 50)]
    checkpoint_every: usize,
    /// Continue from the last checkpoint in --out (step count included; Adam state restarts).
    #[arg(long)]
    resume: bool,
    /// CPU threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Output directory (PEFT adapter files, checkpoints `checkpoint-NNNNNN`, `lora_log.csv`).
    #[arg(long)]
    out: PathBuf,
}

/// Arguments of `deco lora eval`.
#[derive(Debug, Args)]
pub struct EvalArgs {
    /// Base model: GGUF file or Hugging Face directory.
    #[arg(long)]
    model: PathBuf,
    /// Storage of the base's decoder linears.
    #[arg(long, value_enum, default_value = "none")]
    quant: QuantArg,
    /// PEFT LoRA adapter directory applied on the fly (omit for the base alone).
    #[arg(long)]
    lora: Option<PathBuf>,
    /// JSON lines with `question` and `answer`; default gsm_eval.jsonl.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Problems scored (the first N after --offset).
    #[arg(long, default_value_t = 100)]
    limit: usize,
    /// Skip the first N problems.
    #[arg(long, default_value_t = 0)]
    offset: usize,
    /// Sequences per forward.
    #[arg(long, default_value_t = 4)]
    batch_size: usize,
    /// Longest sequence in tokens (longer examples are truncated).
    #[arg(long, default_value_t = 512)]
    seqlen: usize,
    /// Prompt format.
    #[arg(long, value_enum, default_value = "chat")]
    prompt: PromptArg,
    /// CPU threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
}

/// Runs a `deco lora` subcommand.
pub fn run(cmd: &LoraCommand) -> Result<()> {
    match cmd {
        LoraCommand::Train(a) => train(a),
        LoraCommand::Eval(a) => eval(a),
    }
}

fn threads(n: Option<usize>) -> Result<()> {
    if let Some(n) = n {
        anyhow::ensure!(n > 0, "--threads must be at least 1");
        rayon::ThreadPoolBuilder::new().num_threads(n).build_global().context("configuring the CPU thread pool")?;
    }
    Ok(())
}

/// Tokenized chain-of-thought sequences of a GSM8K-style file.
fn sequences(tok: &Tokenizer, examples: &[CotExample], prompt: PromptArg) -> Result<(Vec<CotSequence>, u32)> {
    let encode = |s: &str| -> deco_compress::Result<Vec<u32>> { Ok(tok.encode_with(s, false, false)?) };
    let eos = tok.eos_token_id();
    let seqs = match prompt {
        PromptArg::Plain => examples.iter().map(|e| cot_sequence(e, &encode, eos)).collect::<deco_compress::Result<Vec<_>>>()?,
        PromptArg::Chat => {
            let source = tok.chat_template().context("--prompt chat: the model has no chat template (use --prompt plain)")?;
            let template = ChatTemplate::new(source)?;
            let mut out = Vec::with_capacity(examples.len());
            for e in examples {
                // The chat prompt's tokens (special tokens parsed), then the answer as in
                // `cot_sequence`: rationale tokens, answer tokens + EOS.
                let prompt_ids = tok.encode(&deco_autodeco::data::chat_prompt(tok, &template, None, &e.question)?, true)?;
                let plain = cot_sequence(&CotExample { question: String::new(), ..e.clone() }, &encode, eos)?;
                let skip = plain.kinds.iter().take_while(|k| **k == deco_compress::distill::TokenKind::Ignore).count();
                let mut ids = prompt_ids.clone();
                ids.extend_from_slice(&plain.ids[skip..]);
                let mut kinds = vec![deco_compress::distill::TokenKind::Ignore; prompt_ids.len()];
                kinds.extend_from_slice(&plain.kinds[skip..]);
                out.push(CotSequence { ids, kinds });
            }
            out
        }
    };
    Ok((seqs, eos.unwrap_or(0)))
}

fn read_examples(path: &Path) -> Result<Vec<CotExample>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    parse_gsm_jsonl(&text).with_context(|| path.display().to_string())
}

/// The frozen base on `device`, its linears NF4-quantized when asked.
fn base_model(ckpt: &Checkpoint, quant: QuantArg, device: &Device) -> Result<StudentModel> {
    let cfg = &ckpt.config;
    let src = |n: &str| -> deco_model::Result<(Vec<usize>, Vec<f32>)> { Ok(ckpt.tensor(n)?) };
    let model = match quant {
        QuantArg::None => StudentModel::from_source(cfg, &src, device)?,
        QuantArg::Nf4 => {
            let t0 = Instant::now();
            let linears = nf4_base(cfg, &src, &mut |_| {})?;
            eprintln!("base: {} decoder linears in NF4 (block {NF4_BLOCKSIZE}, double quantization) in {:.1}s", linears.len(), t0.elapsed().as_secs_f64());
            let q = |n: &str| -> deco_model::Result<(Vec<usize>, Vec<f32>)> {
                match linears.get(n) {
                    Some(w) => Ok((src(n)?.0, w.clone())),
                    None => src(n),
                }
            };
            StudentModel::from_source(cfg, &q, device)?
        }
    };
    Ok(model.no_grad())
}

fn check_lora_config(have: &LoraConfig, want: &LoraConfig, dir: &Path) -> Result<()> {
    if have.r != want.r || have.lora_alpha != want.lora_alpha || have.target_modules != want.target_modules {
        bail!(
            "--resume: {} has r={} alpha={} target_modules={:?}, the command asks for r={} alpha={} target_modules={:?}",
            dir.display(),
            have.r,
            have.lora_alpha,
            have.target_modules,
            want.r,
            want.lora_alpha,
            want.target_modules
        );
    }
    Ok(())
}

fn quant_name(q: QuantArg) -> &'static str {
    match q {
        QuantArg::Nf4 => "nf4",
        QuantArg::None => "none",
    }
}

fn train(args: &TrainArgs) -> Result<()> {
    let lc = LoraConfig { r: args.r, lora_alpha: args.alpha, lora_dropout: args.dropout, target_modules: parse_target_modules(&args.target_modules)?, use_rslora: false };
    lc.validate()?;
    let tc = LoraTrainConfig { steps: args.steps, batch_size: args.batch_size, seqlen: args.seqlen, lr: args.lr, seed: args.seed, clip_norm: Some(1.0) };
    tc.validate()?;
    threads(args.threads)?;
    let existing = crate::runtime::checkpoints(&args.out)?;
    let resume_from = if args.resume {
        let Some((step, path)) = existing.last().cloned() else {
            bail!("--resume: no checkpoint-NNNNNN directory in {}", args.out.display());
        };
        if step > args.steps {
            bail!("--resume: the last checkpoint is at step {step}, past --steps {}", args.steps);
        }
        if step == args.steps {
            // Training finished; a kill may have stopped the installation of the final files.
            install_final(&args.out, args.steps)?;
            println!("[lora] steps={step}..{step} (already trained; final adapter installed from {}) out={}", path.display(), args.out.display());
            return Ok(());
        }
        Some((step, path))
    } else {
        if args.out.exists() && std::fs::read_dir(&args.out).map(|mut d| d.next().is_some()).unwrap_or(true) {
            bail!("{}: output directory exists and is not empty (use --resume to continue)", args.out.display());
        }
        None
    };
    let ckpt = Checkpoint::open(&args.model).with_context(|| format!("model {}", args.model.display()))?;
    let cfg: ModelConfig = ckpt.config.clone();
    if args.seqlen > cfg.max_position_embeddings {
        bail!("--seqlen {} exceeds the model context {}", args.seqlen, cfg.max_position_embeddings);
    }
    let tok = crate::runtime::load_tokenizer(&args.model)?;
    let data_path = match &args.data {
        Some(p) => p.clone(),
        None => crate::runtime::data_file(&args.model, "gsm_train.jsonl", "--data FILE")?,
    };
    let (seqs, pad) = sequences(&tok, &read_examples(&data_path)?, args.prompt)?;
    let answer_tokens: usize = seqs.iter().map(|s| s.kinds.iter().filter(|k| **k != deco_compress::distill::TokenKind::Ignore).count()).sum();
    eprintln!("data: {} examples, {answer_tokens} answer tokens ({:?} prompt) from {}", seqs.len(), args.prompt, data_path.display());

    let dev = Device::flex().autodiff();
    let base = base_model(&ckpt, args.quant, &dev)?;
    let (start_step, adapters) = match &resume_from {
        Some((step, path)) => {
            let h = HostAdapters::load(path, &cfg).with_context(|| format!("--resume: {}", path.display()))?;
            check_lora_config(&h.config, &lc, path)?;
            (*step, h.to_module(&cfg, &dev))
        }
        None => (0, LoraAdapters::init(&cfg, &lc, args.seed, &dev)?),
    };
    let trainable = lc.trainable_params(&cfg);
    eprintln!(
        "lora: r={} alpha={} dropout={} target_modules={} -> {trainable} trainable params ({:.3}% of {}); base {} ({}), from step {start_step}",
        lc.r,
        lc.lora_alpha,
        lc.lora_dropout,
        lc.target_modules.iter().map(|&l| deco_compress::lora::module_name(l)).collect::<Vec<_>>().join(","),
        100.0 * trainable as f64 / deco_compress::student::num_params(&cfg) as f64,
        deco_compress::student::num_params(&cfg),
        quant_name(args.quant),
        args.model.display()
    );
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    let log_path = args.out.join("lora_log.csv");
    let mut log_file = crate::runtime::open_step_log(&log_path, resume_from.is_some(), start_step)?;
    let pb = ProgressBar::new(args.steps as u64);
    if let Ok(style) = ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} steps, {elapsed} (eta {eta})") {
        pb.set_style(style.progress_chars("=> "));
    }
    pb.set_position(start_step as u64);
    let t0 = Instant::now();
    let (mut first_loss, mut last_loss, mut secs, mut steps_run) = (f64::NAN, f64::NAN, 0.0f64, 0usize);
    let mut progress = |r: &StepLog| {
        if first_loss.is_nan() {
            first_loss = r.loss;
        }
        last_loss = r.loss;
        secs += r.secs;
        steps_run += 1;
        let _ = writeln!(log_file, "{},{:.6},{},{:.3}", r.step, r.loss, r.tokens, r.secs);
        pb.set_message(format!("lora loss {:.4} ({:.1}s/step)", r.loss, r.secs));
        pb.set_position(r.step as u64);
    };
    let model_name = args.model.display().to_string();
    let meta = |step: usize| {
        serde_json::json!({
            "base_model": model_name, "base_quant": quant_name(args.quant), "nf4_blocksize": NF4_BLOCKSIZE, "double_quant": args.quant == QuantArg::Nf4,
            "model_type": cfg.model_type.name(), "num_hidden_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size,
            "step": step, "steps": args.steps, "batch_size": args.batch_size, "seqlen": args.seqlen, "lr": args.lr, "seed": args.seed,
            "data": data_path.display().to_string(), "prompt": format!("{:?}", args.prompt).to_lowercase(), "loss": "mean NLL of answer tokens (rationale + #### N + EOS)",
            "trainable_params": trainable, "init": "kaiming_uniform(a=sqrt(5)) A, zero B (PEFT init_lora_weights=True)",
        })
    };
    let out = args.out.clone();
    let mut save = |step: usize, a: &LoraAdapters| -> deco_compress::Result<()> {
        let host = HostAdapters::from_module(a, &cfg, &lc)?;
        let dir = out.join(format!("checkpoint-{step:06}"));
        if dir.exists() {
            crate::runtime::discard_dir(&dir).map_err(|source| deco_compress::Error::Io { path: dir.clone(), source })?;
        }
        host.save(&dir, &model_name, &meta(step))?;
        // Keep the last two checkpoints (older ones discarded crash-safely).
        crate::runtime::prune_checkpoints(&out, 2);
        Ok(())
    };
    train_lora(&base, adapters, &cfg, &lc, &seqs, pad, &tc, start_step, args.checkpoint_every, &mut progress, &mut save)?;
    pb.finish();
    install_final(&args.out, args.steps)?;
    println!(
        "[lora] quant={} r={} alpha={} target_modules={} trainable_params={trainable} steps={}..{} step_s={:.2} minutes={:.2} loss_first={first_loss:.4} loss_last={last_loss:.4} out={}",
        quant_name(args.quant),
        lc.r,
        lc.lora_alpha,
        lc.target_modules.iter().map(|&l| deco_compress::lora::module_name(l)).collect::<Vec<_>>().join(","),
        start_step + 1,
        args.steps,
        secs / steps_run.max(1) as f64,
        t0.elapsed().as_secs_f64() / 60.0,
        args.out.display()
    );
    Ok(())
}

/// Installs the adapter of `out/checkpoint-<steps>` at the top of `out` (each file atomically;
/// the weights first so that a config never names missing weights). A run killed during this
/// step is completed by `--resume`.
fn install_final(out: &Path, steps: usize) -> Result<()> {
    let last = out.join(format!("checkpoint-{steps:06}"));
    for f in [deco_compress::lora::ADAPTER_WEIGHTS, deco_compress::lora::DECO_LORA_META, deco_compress::lora::ADAPTER_CONFIG] {
        let bytes = std::fs::read(last.join(f)).with_context(|| format!("reading {}", last.join(f).display()))?;
        deco_formats::atomic::write_file(&out.join(f), &bytes).with_context(|| format!("writing {}", out.join(f).display()))?;
    }
    Ok(())
}

fn eval(args: &EvalArgs) -> Result<()> {
    if args.limit == 0 || args.batch_size == 0 || args.seqlen < 2 {
        bail!("--limit and --batch-size must be at least 1, --seqlen at least 2");
    }
    threads(args.threads)?;
    let ckpt = Checkpoint::open(&args.model).with_context(|| format!("model {}", args.model.display()))?;
    let cfg = ckpt.config.clone();
    let tok = crate::runtime::load_tokenizer(&args.model)?;
    let data_path = match &args.data {
        Some(p) => p.clone(),
        None => crate::runtime::data_file(&args.model, "gsm_eval.jsonl", "--data FILE")?,
    };
    let examples: Vec<CotExample> = read_examples(&data_path)?.into_iter().skip(args.offset).take(args.limit).collect();
    if examples.is_empty() {
        bail!("{}: no problems after --offset {}", data_path.display(), args.offset);
    }
    let (seqs, pad) = sequences(&tok, &examples, args.prompt)?;
    let dev = Device::flex();
    let adapters = match &args.lora {
        Some(d) => Some(HostAdapters::load(d, &cfg).with_context(|| format!("--lora {}", d.display()))?),
        None => None,
    };
    let base = base_model(&ckpt, args.quant, &dev)?;
    let t0 = Instant::now();
    let module = adapters.as_ref().map(|h| (h.to_module(&cfg, &dev), h.config.clone()));
    let (loss, n) = completion_loss(&base, module.as_ref().map(|(m, c)| (m, c)), &cfg, &seqs, args.seqlen, pad, args.batch_size)?;
    println!(
        "[lora-eval] model={} quant={} lora={} problems={} answer_tokens={n} seconds={:.1}",
        args.model.display(),
        quant_name(args.quant),
        args.lora.as_ref().map_or("none".to_string(), |p| p.display().to_string()),
        seqs.len(),
        t0.elapsed().as_secs_f64()
    );
    println!("answer_loss={loss:.4}");
    Ok(())
}
