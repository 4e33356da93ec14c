//! `deco distill`: knowledge distillation of a frozen teacher into a student (e.g. a pruned
//! model): forward KL with temperature, MiniLLM reverse KL on student samples, or
//! chain-of-thought on GSM8K-style data. See `deco_compress::distill`.
//!
//! Checkpoints are Hugging Face directories `OUT/checkpoint-NNNNNN` (the step), each written
//! into a hidden temporary directory and renamed into place (`deco_compress::export::
//! write_dense_dir`, installed by `deco_formats::atomic::write_dir`); the last two are kept.
//! `--resume` continues from the highest-numbered checkpoint in `OUT`, with its step count;
//! the Adam moments restart (they are not saved). Batches depend only on `(seed, step)`, so a
//! resumed run sees the batches the uninterrupted run would have.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use burn::tensor::Device;
use clap::{Args, ValueEnum};
use deco_compress::distill::{DistillConfig, DistillData, Objective, StepLog, cot_sequence, distill, parse_gsm_jsonl};
use deco_compress::export::write_dense_dir;
use deco_compress::indicatif::{ProgressBar, ProgressStyle};
use deco_compress::student::{StudentModel, num_params};
use deco_formats::checkpoint::Checkpoint;
use deco_formats::hf_export::ExportDtype;
use deco_model::Llama;

/// Distillation objective.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ObjectiveArg {
    /// Forward KL on logits with temperature (Hinton et al. 2015), optionally mixed with CE.
    Kd,
    /// Per-token reverse KL on student samples (MiniLLM, Gu et al. 2024).
    ReverseKl,
    /// Chain-of-thought: CE(answer) + λ·CE(rationale) on GSM8K-style JSON lines.
    Cot,
}

/// Arguments of `deco distill`.
#[derive(Debug, Args)]
pub struct DistillArgs {
    /// Teacher: GGUF file or Hugging Face directory (frozen).
    #[arg(long)]
    teacher: PathBuf,
    /// Student: GGUF file or Hugging Face directory (e.g. the output of `deco prune`).
    #[arg(long)]
    student: PathBuf,
    /// Loss.
    #[arg(long, value_enum)]
    objective: ObjectiveArg,
    /// Total optimizer steps.
    #[arg(long, default_value_t = 200)]
    steps: usize,
    /// Sequences per step.
    #[arg(long, default_value_t = 4)]
    batch_size: usize,
    /// Tokens per sequence (CoT: longest sequence; longer examples are truncated).
    #[arg(long, default_value_t = 128)]
    seqlen: usize,
    /// Adam learning rate.
    #[arg(long, default_value_t = 2e-4)]
    lr: f64,
    /// Softmax temperature τ of the KL objectives.
    #[arg(long, default_value_t = 1.0)]
    temperature: f64,
    /// kd: weight (1-α) of the next-token cross-entropy mixed into the KD loss, in [0, 1].
    #[arg(long, default_value_t = 0.0)]
    ce_weight: f64,
    /// cot: weight λ of the rationale tokens.
    #[arg(long, default_value_t = 1.0)]
    rationale_weight: f64,
    /// Seed of batch sampling and student sampling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Training data: a UTF-8 text (kd, reverse-kl; default the wiki train split) or JSON lines
    /// with `question` / `answer` (cot; default gsm_train.jsonl).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Use at most this many characters of a text data file.
    #[arg(long, default_value_t = 1_000_000)]
    data_chars: usize,
    /// Keep the embedding / tied LM head fixed (cheaper steps).
    #[arg(long)]
    freeze_embeddings: bool,
    /// Write a checkpoint every this many steps (and after the last).
    #[arg(long, default_value_t = 50)]
    checkpoint_every: usize,
    /// Continue from the last checkpoint in --out (step count included; Adam state restarts).
    #[arg(long)]
    resume: bool,
    /// CPU threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Output directory (checkpoints `checkpoint-NNNNNN`, `distill_log.csv`).
    #[arg(long)]
    out: PathBuf,
}

/// Runs the command.
pub fn run(args: &DistillArgs) -> Result<()> {
    let dc = DistillConfig {
        objective: match args.objective {
            ObjectiveArg::Kd => Objective::Kd,
            ObjectiveArg::ReverseKl => Objective::ReverseKl,
            ObjectiveArg::Cot => Objective::Cot,
        },
        steps: args.steps,
        batch_size: args.batch_size,
        seqlen: args.seqlen,
        lr: args.lr,
        temperature: args.temperature,
        ce_weight: args.ce_weight,
        rationale_weight: args.rationale_weight,
        seed: args.seed,
        freeze_embeddings: args.freeze_embeddings,
        clip_norm: Some(1.0),
    };
    dc.validate()?;
    if let Some(n) = args.threads {
        anyhow::ensure!(n > 0, "--threads must be at least 1");
        rayon::ThreadPoolBuilder::new().num_threads(n).build_global().context("configuring the CPU thread pool")?;
    }
    // Where to start: a fresh run needs an empty --out; --resume needs a checkpoint there.
    let existing = crate::runtime::checkpoints(&args.out)?;
    let (start_step, student_path) = if args.resume {
        let Some((step, path)) = existing.last().cloned() else {
            bail!("--resume: no checkpoint-NNNNNN directory in {}", args.out.display());
        };
        if step >= args.steps {
            bail!("--resume: the last checkpoint is at step {step}, nothing to do for --steps {}", args.steps);
        }
        (step, path)
    } else {
        if args.out.exists() && std::fs::read_dir(&args.out).map(|mut d| d.next().is_some()).unwrap_or(true) {
            bail!("{}: output directory exists and is not empty (use --resume to continue)", args.out.display());
        }
        (0, args.student.clone())
    };

    let dev = Device::flex();
    let tckpt = Checkpoint::open(&args.teacher).with_context(|| format!("teacher {}", args.teacher.display()))?;
    let sckpt = Checkpoint::open(&student_path).with_context(|| format!("student {}", student_path.display()))?;
    let cfg = sckpt.config.clone();
    if tckpt.config.vocab_size != cfg.vocab_size {
        bail!("teacher vocabulary {} != student vocabulary {}: distillation needs the same tokenizer", tckpt.config.vocab_size, cfg.vocab_size);
    }
    if args.seqlen > cfg.max_position_embeddings.min(tckpt.config.max_position_embeddings) {
        bail!("--seqlen {} exceeds the model context", args.seqlen);
    }
    let tok = crate::runtime::load_tokenizer(&args.student)?;
    if tok.vocab_size() > cfg.vocab_size {
        bail!("tokenizer has {} tokens, the student's vocabulary {}", tok.vocab_size(), cfg.vocab_size);
    }

    // Data (all checks before anything is written).
    let data_path = match (&args.data, dc.objective) {
        (Some(p), _) => p.clone(),
        (None, Objective::Cot) => crate::runtime::data_file(&args.teacher, "gsm_train.jsonl", "--data FILE")?,
        (None, _) => crate::runtime::data_file(&args.teacher, "wiki_train.txt", "--data FILE")?,
    };
    let text = std::fs::read_to_string(&data_path).with_context(|| format!("reading {}", data_path.display()))?;
    let data = if dc.objective == Objective::Cot {
        let ex = parse_gsm_jsonl(&text).with_context(|| format!("{}", data_path.display()))?;
        let encode = |s: &str| -> deco_compress::Result<Vec<u32>> { Ok(tok.encode_with(s, false, false)?) };
        let eos = tok.eos_token_id();
        let seqs = ex.iter().map(|e| cot_sequence(e, &encode, eos)).collect::<deco_compress::Result<Vec<_>>>()?;
        eprintln!("data: {} chain-of-thought examples (dataset rationales) from {}", seqs.len(), data_path.display());
        DistillData::Cot { seqs, pad: eos.unwrap_or(0) }
    } else {
        let text: String = text.chars().take(args.data_chars).collect();
        let ids = tok.encode_with(&text, false, true)?;
        if ids.len() <= args.seqlen {
            bail!("{}: {} tokens, need more than --seqlen {}", data_path.display(), ids.len(), args.seqlen);
        }
        eprintln!("data: {} tokens from {}", ids.len(), data_path.display());
        DistillData::Tokens(ids)
    };

    let teacher = Llama::load(&tckpt, &dev, Some(args.seqlen))?;
    let src = |n: &str| -> deco_model::Result<(Vec<usize>, Vec<f32>)> { Ok(sckpt.tensor(n)?) };
    let student = StudentModel::from_source(&cfg, &src, &dev.clone().autodiff())?;
    eprintln!(
        "student: {} params ({} layers, {} heads / {} kv, intermediate {}), from step {start_step}; teacher: {}",
        num_params(&cfg),
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.intermediate_size,
        args.teacher.display()
    );
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    let log_path = args.out.join("distill_log.csv");
    let mut log_file = crate::runtime::open_step_log(&log_path, args.resume, start_step)?;

    let pb = ProgressBar::new(args.steps as u64);
    if let Ok(style) = ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} steps, {elapsed} (eta {eta})") {
        pb.set_style(style.progress_chars("=> "));
    }
    pb.set_position(start_step as u64);
    let t0 = Instant::now();
    let mut tokens = 0usize;
    let mut first_loss = f64::NAN;
    let mut last_loss = f64::NAN;
    let mut progress = |r: &StepLog| {
        tokens += r.tokens;
        if first_loss.is_nan() {
            first_loss = r.loss;
        }
        last_loss = r.loss;
        let _ = writeln!(log_file, "{},{:.6},{},{:.3}", r.step, r.loss, r.tokens, r.secs);
        pb.set_message(format!("{:?} loss {:.4} ({:.0} tok/s)", dc.objective, r.loss, r.tokens as f64 / r.secs.max(1e-9)));
        pb.set_position(r.step as u64);
    };
    let out = args.out.clone();
    let mut save = |step: usize, s: &StudentModel| -> deco_compress::Result<()> {
        let m = s.to_hf_tensors(&cfg)?;
        let dir = out.join(format!("checkpoint-{step:06}"));
        let tensor = |n: &str| m.get(n).cloned().ok_or_else(|| deco_model::Error::InvalidInput(format!("missing `{n}`")));
        if dir.exists() {
            crate::runtime::discard_dir(&dir).map_err(|source| deco_compress::Error::Io { path: dir.clone(), source })?;
        }
        write_dense_dir(&sckpt, &tok, &cfg, &tensor, &dir, ExportDtype::F32)?;
        // Keep the last two checkpoints (older ones discarded crash-safely).
        crate::runtime::prune_checkpoints(&out, 2);
        Ok(())
    };
    distill(student, &cfg, &teacher, &data, &dc, start_step, args.checkpoint_every, &mut progress, &mut save)?;
    pb.finish();
    let minutes = t0.elapsed().as_secs_f64() / 60.0;
    println!(
        "[distill] objective={:?} steps={}..{} tokens={tokens} minutes={minutes:.2} loss_first={first_loss:.4} loss_last={last_loss:.4} out={}",
        dc.objective,
        start_step + 1,
        args.steps,
        out.join(format!("checkpoint-{:06}", args.steps)).display()
    );
    Ok(())
}
