//! `deco autodeco train`: train AutoDeco heads on a frozen base model.
//!
//! Every `--checkpoint-every` steps the heads and the loss log so far are written to
//! `OUT/checkpoint-NNNNNN` (one atomic directory each; the last two are kept). `--resume`
//! continues from the highest-numbered one: the same batches and masks as an uninterrupted run,
//! the Adam moments restarting from zero (see `deco_autodeco::train::train_from`). At the end
//! OUT is replaced, in one step, by the final heads and `loss.csv` (the checkpoints go with the
//! old directory), then `loss.svg` is written into it.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use deco_autodeco::data::{ChatExample, TokenPool, chat_example, collect_tokens, read_gsm_jsonl, strip_calculator};
use deco_autodeco::heads::AutoDecoConfig;
use deco_autodeco::loss::LossConfig;
use deco_autodeco::heads::HostHeads;
use deco_autodeco::train::{FrozenHead, LogRow, ResumeFrom, TrainConfig, log_csv, parse_log_csv, train_from, write_log_csv};
use deco_formats::chat_template::ChatTemplate;
use indicatif::{ProgressBar, ProgressStyle};

use crate::ModelArgs;

/// AutoDeco subcommands.
#[derive(Debug, Subcommand)]
pub enum AutodecoCommand {
    /// Train temperature / top-p heads on a frozen base (GSM-style JSONL: `question`, `answer`).
    Train(TrainArgs),
    /// GSM accuracy (pass@k) of one decoding configuration, optionally with AutoDeco heads.
    /// Prints one JSON summary line last.
    Eval(EvalArgs),
    /// Write heads in the reference implementation's layout (config.json with model_type
    /// "autodeco" + model.safetensors), loadable by its `AutoDecoModelForCausalLM`. Heads in
    /// that layout are read by every `--autodeco DIR` as they are.
    Export(ExportArgs),
    /// The meta-instruction stage: fine-tune trained heads with a ranking loss so that a "low
    /// randomness" instruction lowers the predicted T and P and a "creative" one raises them;
    /// measured before and after on held-out questions and held-out phrasings.
    MetaTrain(Box<MetaTrainArgs>),
}

/// Options of `deco autodeco meta-train`.
#[derive(Debug, Args)]
pub struct MetaTrainArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Stage-one heads directory (either layout), trained on this model.
    #[arg(long)]
    heads: PathBuf,
    /// JSONL questions with worked answers (`question`, `answer`), e.g. gsm_train.jsonl.
    #[arg(long)]
    data: PathBuf,
    /// Output heads directory (replaced atomically; holds meta_report.json, meta_log.csv and
    /// meta_trace.svg besides the heads).
    #[arg(long)]
    out: PathBuf,
    /// Optimizer steps.
    #[arg(long, default_value_t = 2000)]
    steps: usize,
    /// Questions per step (in the three variants).
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    /// Answer positions per question and step; the ranking compares per-question means over them.
    #[arg(long, default_value_t = 8)]
    positions_per_question: usize,
    /// Adam learning rate.
    #[arg(long, default_value_t = 2e-3)]
    learning_rate: f64,
    /// Margin of the temperature ranking.
    #[arg(long, default_value_t = 0.25)]
    margin_t: f32,
    /// Margin of the top-p ranking (0: leave the top-p head out; no logits needed).
    #[arg(long, default_value_t = 0.02)]
    margin_p: f32,
    /// Weight of the anchor to the stage-one predictions without an instruction.
    #[arg(long, default_value_t = 30.0)]
    anchor_weight: f32,
    /// Seed (phrasing choice, question and position sampling).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Training questions (the first N of --data).
    #[arg(long, default_value_t = 96)]
    max_examples: usize,
    /// Held-out questions (the next N), measured with the held-out phrasings.
    #[arg(long, default_value_t = 32)]
    heldout_examples: usize,
    /// Answer positions kept per question (teacher-forced on the reference answer).
    #[arg(long, default_value_t = 32)]
    max_positions: usize,
    /// Keep the base model's hidden states in this file and reuse them when the model, data
    /// and question options match (a rerun with other loss settings skips the base model).
    #[arg(long)]
    pool_cache: Option<PathBuf>,
}

/// Options of `deco autodeco export`.
#[derive(Debug, Args)]
pub struct ExportArgs {
    /// Heads directory (either layout).
    #[arg(long)]
    heads: PathBuf,
    /// The base model the heads were trained on (GGUF file or Hugging Face directory): its
    /// configuration goes into config.json.
    #[arg(long)]
    model: PathBuf,
    /// What the reference loads the base model from (a Hub id such as
    /// HuggingFaceTB/SmolLM2-135M-Instruct, or a directory). Default: `--model`.
    #[arg(long)]
    base_model_name_or_path: Option<String>,
    /// Output directory (replaced atomically).
    #[arg(long)]
    out: PathBuf,
}

/// Options of `deco autodeco eval`.
#[derive(Debug, Args)]
pub struct EvalArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// JSONL problems with `question` and `answer` (`#### N`) or `final`.
    #[arg(long)]
    data: PathBuf,
    /// AutoDeco heads directory (omit for static decoding).
    #[arg(long)]
    heads: Option<PathBuf>,
    /// Static temperature (0 = greedy); with --heads, multiplies the predicted T.
    #[arg(long, default_value_t = 1.0)]
    temperature: f32,
    /// Static top-p; with --heads, multiplies the predicted P.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Samples per problem (pass@k for k = 1, 2, 4, ... up to n).
    #[arg(short = 'n', long, default_value_t = 1)]
    n: usize,
    /// Problems evaluated (the first N).
    #[arg(long, default_value_t = 200)]
    limit: usize,
    /// Skip the first N problems.
    #[arg(long, default_value_t = 0)]
    offset: usize,
    /// Maximum new tokens per answer.
    #[arg(long, default_value_t = 256)]
    max_new_tokens: usize,
    /// Sequences decoded together.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Base seed (sample j of problem i uses seed + 1000 i + j).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Text appended to each question (meta-instructions such as "Please answer with low randomness.").
    #[arg(long)]
    instruction: Option<String>,
    /// Write every output as JSON lines here.
    #[arg(long)]
    outputs: Option<PathBuf>,
    /// Label of this configuration in the summary.
    #[arg(long, default_value = "")]
    label: String,
}

/// Options of `deco autodeco train`.
#[derive(Debug, Args)]
pub struct TrainArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// JSONL training data with `question` and `answer` fields (e.g. gsm_train.jsonl).
    #[arg(long)]
    data: PathBuf,
    /// Output heads directory (autodeco_config.json + autodeco_heads.safetensors).
    #[arg(long)]
    out: PathBuf,
    /// Optimizer steps.
    #[arg(long, default_value_t = 400)]
    steps: usize,
    /// Positions per step.
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// Adam learning rate.
    #[arg(long, default_value_t = 1e-3)]
    learning_rate: f64,
    /// Seed (example order, head init, position sampling, masking).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Training examples taken from the file (its first N; 0 = all).
    #[arg(long, default_value_t = 160)]
    max_examples: usize,
    /// Held-out examples (the next N after the training ones).
    #[arg(long, default_value_t = 16)]
    heldout_examples: usize,
    /// Probability of dropping an easy token (base argmax = label) from the temperature loss.
    #[arg(long, default_value_t = 0.6)]
    easy_token_drop_prob: f64,
    /// Soft top-p steepness α.
    #[arg(long, default_value_t = 30.0)]
    alpha: f32,
    /// Do not weight each position's loss by the base's probability of the label.
    #[arg(long)]
    no_base_prob_weight: bool,
    /// Also apply easy-token masking to the top-p loss.
    #[arg(long)]
    mask_top_p: bool,
    /// LayerNorm before the temperature head.
    #[arg(long)]
    temp_layer_norm: bool,
    /// Top-p head without the four distribution statistics.
    #[arg(long)]
    no_stats: bool,
    /// Keep GSM8K calculator annotations `<<a*b=c>>` in the answers (stripped by default).
    #[arg(long)]
    keep_calculator: bool,
    /// Held-out evaluation period (steps).
    #[arg(long, default_value_t = 50)]
    eval_every: usize,
    /// Loss curve CSV (default: OUT/loss.csv).
    #[arg(long)]
    log_csv: Option<PathBuf>,
    /// Write a checkpoint (`OUT/checkpoint-NNNNNN`) every this many steps (0: none).
    #[arg(long, default_value_t = 100)]
    checkpoint_every: usize,
    /// Continue from the last checkpoint in OUT (same options as the interrupted run).
    #[arg(long)]
    resume: bool,
    /// Loss curve SVG plot (default: OUT/loss.svg).
    #[arg(long)]
    plot: Option<PathBuf>,
}

/// Runs an AutoDeco subcommand.
pub fn run(cmd: &AutodecoCommand) -> Result<()> {
    match cmd {
        AutodecoCommand::Train(a) => run_train(a),
        AutodecoCommand::Eval(a) => run_eval(a),
        AutodecoCommand::Export(a) => run_export(a),
        AutodecoCommand::MetaTrain(a) => run_meta_train(a),
    }
}

fn run_export(a: &ExportArgs) -> Result<()> {
    let heads = HostHeads::load(&a.heads).with_context(|| format!("loading heads {}", a.heads.display()))?;
    let ckpt = deco_formats::checkpoint::Checkpoint::open(&a.model).with_context(|| format!("opening {}", a.model.display()))?;
    let base = ckpt.config.to_hf_json("float32");
    let name = a.base_model_name_or_path.clone().unwrap_or_else(|| a.model.display().to_string());
    heads.export_official(&a.out, &base, &name).with_context(|| format!("exporting to {}", a.out.display()))?;
    eprintln!(
        "wrote {} (config.json, model.safetensors): AutoDeco heads for {} (hidden {}, vocabulary {})",
        a.out.display(),
        name,
        heads.config().hidden_size,
        heads.config().vocab_size
    );
    Ok(())
}

pub(crate) fn bar(len: u64, msg: &str) -> ProgressBar {
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template("{msg:>10} [{bar:40}] {pos}/{len} {elapsed_precise} eta {eta} {prefix}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    pb.set_message(msg.to_string());
    pb
}

fn run_train(a: &TrainArgs) -> Result<()> {
    let tc = TrainConfig {
        steps: a.steps,
        batch_size: a.batch_size,
        learning_rate: a.learning_rate,
        seed: a.seed,
        easy_token_drop_prob: a.easy_token_drop_prob,
        loss: LossConfig { alpha: a.alpha, weight_by_base_prob: !a.no_base_prob_weight, mask_top_p: a.mask_top_p },
        eval_every: a.eval_every,
        max_heldout: 512,
    };
    tc.validate()?;
    // Where to start: --resume needs a checkpoint in OUT; a fresh run refuses to mix with one.
    let existing = crate::runtime::checkpoints(&a.out)?;
    let (resume, log_so_far): (Option<ResumeFrom>, Vec<LogRow>) = if a.resume {
        let Some((step, dir)) = existing.last().cloned() else { bail!("--resume: no checkpoint-NNNNNN directory in {}", a.out.display()) };
        let heads = HostHeads::load(&dir).with_context(|| format!("--resume: loading {}", dir.display()))?;
        let csv = dir.join("loss.csv");
        let text = std::fs::read_to_string(&csv).with_context(|| format!("--resume: reading {}", csv.display()))?;
        let log = parse_log_csv(&text).with_context(|| csv.display().to_string())?;
        eprintln!("[autodeco] resuming from {} (step {step} of {})", dir.display(), a.steps);
        (Some(ResumeFrom { step, heads }), log)
    } else {
        if !existing.is_empty() {
            bail!("{} holds checkpoints of an interrupted run: use --resume to continue it, or remove them", a.out.display());
        }
        (None, Vec::new())
    };
    let items = read_gsm_jsonl(&a.data)?;
    if items.is_empty() {
        bail!("{}: no examples", a.data.display());
    }
    let n_train = if a.max_examples == 0 { items.len() } else { a.max_examples.min(items.len()) };
    let n_held = a.heldout_examples.min(items.len() - n_train);
    let (model, tok) = crate::runtime::load(&a.model)?;
    let source = tok.chat_template().context("the model has no chat template (AutoDeco trains on chat-formatted data)")?;
    let template = ChatTemplate::new(source)?;
    let mut examples: Vec<ChatExample> = Vec::with_capacity(n_train + n_held);
    for (i, it) in items.iter().take(n_train + n_held).enumerate() {
        let answer = if a.keep_calculator { it.answer.clone() } else { strip_calculator(&it.answer) };
        examples.push(chat_example(&tok, &template, &it.question, &answer).with_context(|| format!("{}: example {}", a.data.display(), i + 1))?);
    }
    let t0 = Instant::now();
    let pb = bar((n_train + n_held) as u64, "hidden");
    let mut cb = |d: usize, _t: usize| pb.set_position(d as u64);
    let train_pool = collect_tokens(&model, &examples[..n_train], &mut cb)?;
    let held_pool = if n_held > 0 {
        let mut cb2 = |d: usize, _t: usize| pb.set_position((n_train + d) as u64);
        collect_tokens(&model, &examples[n_train..], &mut cb2)?
    } else {
        TokenPool { hidden_size: model.config.hidden_size, ..Default::default() }
    };
    pb.finish();
    let collect_s = t0.elapsed().as_secs_f64();
    eprintln!(
        "[autodeco] {} training positions from {n_train} examples, {} held-out from {n_held}; base argmax accuracy {:.3}; hidden states in {collect_s:.1}s",
        train_pool.len(),
        held_pool.len(),
        train_pool.argmax_accuracy()
    );
    let mut cfg = AutoDecoConfig::new(model.config.hidden_size, model.config.vocab_size);
    cfg.use_enhanced_features = !a.no_stats;
    cfg.temp_layer_norm = a.temp_layer_norm;
    cfg.base_model = a.model.model.file_name().map(|s| s.to_string_lossy().into_owned());
    let head = FrozenHead { weight: model.lm_head().clone(), device: model.device().clone() };
    let pb = bar(a.steps as u64, "train");
    let t1 = Instant::now();
    let mut last_held = String::new();
    let log_cell = std::cell::RefCell::new(log_so_far);
    let mut progress = |r: &LogRow| {
        if !r.heldout_temp.is_nan() {
            last_held = format!("held-out temp {:.4} top_p {:.4}", r.heldout_temp, r.heldout_top_p);
        }
        pb.set_position(r.step as u64);
        pb.set_prefix(format!("loss {:.4}+{:.4} T {:.3} P {:.3} | {last_held}", r.train_temp, r.train_top_p, r.mean_temperature, r.mean_top_p));
        log_cell.borrow_mut().push(*r);
    };
    let out = a.out.clone();
    let mut save = |step: usize, h: &HostHeads| -> deco_autodeco::Result<()> {
        let csv = log_csv(&log_cell.borrow());
        h.save_with(&out.join(format!("checkpoint-{step:06}")), &[("loss.csv", csv.as_bytes())])?;
        // Keep the last two checkpoints (older ones discarded crash-safely).
        crate::runtime::prune_checkpoints(&out, 2);
        Ok(())
    };
    let (heads, _) = train_from(&cfg, &tc, &train_pool, &held_pool, &head, resume, a.checkpoint_every, &mut progress, &mut save)?;
    pb.finish();
    let log = log_cell.into_inner();
    let train_s = t1.elapsed().as_secs_f64();
    // The heads and (by default) their loss curve replace OUT in one step.
    match &a.log_csv {
        None => heads.save_with(&a.out, &[("loss.csv", log_csv(&log).as_bytes())])?,
        Some(csv) => {
            heads.save(&a.out)?;
            write_log_csv(csv, &log)?;
        }
    }
    let svg = a.plot.clone().unwrap_or_else(|| a.out.join("loss.svg"));
    let pts = |f: &dyn Fn(&deco_autodeco::train::LogRow) -> f64| log.iter().map(|r| (r.step as f64, f(r))).filter(|p| p.1.is_finite()).collect::<Vec<_>>();
    deco_autodeco::plot::line_chart_svg(
        &svg,
        "AutoDeco training",
        "step",
        "loss",
        &[
            ("train temp", pts(&|r| r.train_temp)),
            ("train top-p", pts(&|r| r.train_top_p)),
            ("held-out temp", pts(&|r| r.heldout_temp)),
            ("held-out top-p", pts(&|r| r.heldout_top_p)),
        ],
    )?;
    let first = log.first().map(|r| r.heldout_temp + r.heldout_top_p).unwrap_or(f64::NAN);
    let last = log.last().map(|r| r.heldout_temp + r.heldout_top_p).unwrap_or(f64::NAN);
    eprintln!(
        "[autodeco] params={} bytes={} steps={} train_positions={} train_s={train_s:.1} heldout_loss_before={first:.4} heldout_loss_after={last:.4}",
        cfg.num_params(),
        heads.num_bytes(),
        a.steps,
        train_pool.len()
    );
    println!("{}", a.out.display());
    Ok(())
}

fn run_meta_train(a: &MetaTrainArgs) -> Result<()> {
    use deco_autodeco::meta::{self, MetaConfig, Phrasings};

    let mc = MetaConfig {
        steps: a.steps,
        batch_size: a.batch_size,
        positions_per_question: a.positions_per_question,
        learning_rate: a.learning_rate,
        margin_t: a.margin_t,
        margin_p: a.margin_p,
        anchor_weight: a.anchor_weight,
        seed: a.seed,
    };
    mc.validate()?;
    if a.max_examples == 0 || a.heldout_examples == 0 || a.max_positions == 0 {
        bail!("--max-examples, --heldout-examples and --max-positions must be at least 1");
    }
    let stage_one = HostHeads::load(&a.heads).with_context(|| format!("loading heads {}", a.heads.display()))?;
    let items = read_gsm_jsonl(&a.data)?;
    if items.len() < a.max_examples + a.heldout_examples {
        bail!("{}: {} questions, --max-examples {} + --heldout-examples {} needed", a.data.display(), items.len(), a.max_examples, a.heldout_examples);
    }
    let (model, tok) = crate::runtime::load(&a.model)?;
    if stage_one.config().hidden_size != model.config.hidden_size || stage_one.config().vocab_size != model.config.vocab_size {
        bail!(
            "{}: heads for hidden {} / vocab {}, the model has {} / {}",
            a.heads.display(),
            stage_one.config().hidden_size,
            stage_one.config().vocab_size,
            model.config.hidden_size,
            model.config.vocab_size
        );
    }
    let source = tok.chat_template().context("the model has no chat template")?;
    let template = ChatTemplate::new(source)?;
    let indexed: Vec<(usize, &deco_autodeco::data::GsmItem)> = items.iter().enumerate().take(a.max_examples + a.heldout_examples).collect();
    let t0 = Instant::now();
    let key = format!(
        "model={} size={} data={} size={} examples={} heldout={} positions={} seed={}",
        a.model.model.display(),
        std::fs::metadata(&a.model.model).map(|m| m.len()).unwrap_or(0),
        a.data.display(),
        std::fs::metadata(&a.data).map(|m| m.len()).unwrap_or(0),
        a.max_examples,
        a.heldout_examples,
        a.max_positions,
        a.seed
    );
    let cached = match &a.pool_cache {
        Some(p) => meta::load_pools(p, &key, model.config.hidden_size)?,
        None => None,
    };
    let (train_pool, held_pool) = match cached {
        Some(mut pools) if pools.len() == 2 => {
            let held = pools.pop().unwrap_or_default();
            let train = pools.pop().unwrap_or_default();
            eprintln!("[autodeco meta] hidden states from {}", a.pool_cache.as_ref().map_or(String::new(), |p| p.display().to_string()));
            (train, held)
        }
        _ => {
            let pb = bar((a.max_examples + a.heldout_examples) as u64, "hidden");
            let mut cb = |d: usize, _t: usize| pb.set_position(d as u64);
            let train_pool = meta::collect_meta(&model, &tok, &template, &indexed[..a.max_examples], Phrasings::TrainOnePerPrompt, a.max_positions, a.seed, &mut cb)?;
            let mut cb2 = |d: usize, _t: usize| pb.set_position((a.max_examples + d) as u64);
            let held_pool = meta::collect_meta(&model, &tok, &template, &indexed[a.max_examples..], Phrasings::HeldOutAll, a.max_positions, a.seed, &mut cb2)?;
            pb.finish();
            if let Some(p) = &a.pool_cache {
                meta::save_pools(p, &key, model.config.hidden_size, &[&train_pool, &held_pool])?;
            }
            (train_pool, held_pool)
        }
    };
    let collect_s = t0.elapsed().as_secs_f64();
    let head = FrozenHead { weight: model.lm_head().clone(), device: model.device().clone() };
    let logits = |h: &[f32], n: usize| head.logits(h, n);
    let (before, trace_before) = meta::measure(&stage_one, &held_pool, &logits)?;
    let pb = bar(a.steps as u64, "rank");
    let t1 = Instant::now();
    let mut progress = |r: &meta::MetaLogRow| {
        pb.set_position(r.step as u64);
        pb.set_prefix(format!("rank T {:.4} P {:.4} anchor {:.5}", r.rank_t, r.rank_p, r.anchor));
    };
    let (heads, log) = meta::train_meta(&stage_one, &train_pool, &head, &mc, &mut progress)?;
    pb.finish();
    let train_s = t1.elapsed().as_secs_f64();
    let (after, trace_after) = meta::measure(&heads, &held_pool, &logits)?;
    let mut csv = String::from("step,rank_t,rank_p,anchor\n");
    for r in &log {
        csv.push_str(&format!("{},{:.6},{:.6},{:.6}\n", r.step, r.rank_t, r.rank_p, r.anchor));
    }
    let mut trace_csv = String::from("stage,variant,position,temperature,top_p\n");
    for (stage, tr) in [("before", &trace_before), ("after", &trace_after)] {
        for (name, rows) in ["none", "low", "high"].iter().zip(tr.iter()) {
            for (j, (t, p)) in rows.iter().enumerate() {
                trace_csv.push_str(&format!("{stage},{name},{j},{t:.6},{p:.6}\n"));
            }
        }
    }
    let report = serde_json::json!({
        "heads": a.heads, "model": a.model.model.file_name().map(|s| s.to_string_lossy().into_owned()),
        "train_questions": train_pool.len(), "heldout_questions": held_pool.len(), "max_positions": a.max_positions,
        "low_train": meta::LOW_TRAIN, "high_train": meta::HIGH_TRAIN, "low_heldout": meta::LOW_HELDOUT, "high_heldout": meta::HIGH_HELDOUT,
        "steps": a.steps, "batch_size": a.batch_size, "positions_per_question": a.positions_per_question, "learning_rate": a.learning_rate, "margin_t": a.margin_t, "margin_p": a.margin_p,
        "anchor_weight": a.anchor_weight, "seed": a.seed, "hidden_s": collect_s, "train_s": train_s,
        "before": before, "after": after,
    });
    let report_text = serde_json::to_string_pretty(&report)?;
    heads.save_with(&a.out, &[("meta_report.json", report_text.as_bytes()), ("meta_log.csv", csv.as_bytes()), ("meta_trace.csv", trace_csv.as_bytes())])?;
    let series = |tr: &meta::MetaTrace, k: usize| -> Vec<(f64, f64)> { tr[k].iter().enumerate().map(|(j, &(t, _))| (j as f64, f64::from(t))).collect() };
    deco_autodeco::plot::line_chart_svg(
        &a.out.join("meta_trace.svg"),
        "Predicted T along a held-out answer (teacher-forced)",
        "answer position",
        "T",
        &[
            ("no instruction, before", series(&trace_before, 0)),
            ("low randomness, before", series(&trace_before, 1)),
            ("creative, before", series(&trace_before, 2)),
            ("no instruction, after", series(&trace_after, 0)),
            ("low randomness, after", series(&trace_after, 1)),
            ("creative, after", series(&trace_after, 2)),
        ],
    )?;
    eprintln!(
        "[autodeco meta] held-out: before dT low {:+.4} high {:+.4} order {:.3}; after dT low {:+.4} high {:+.4} order {:.3} (hidden {collect_s:.1}s, train {train_s:.1}s)",
        before.delta_t_low, before.delta_t_high, before.frac_t_order, after.delta_t_low, after.delta_t_high, after.frac_t_order
    );
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}

fn run_eval(a: &EvalArgs) -> Result<()> {
    use deco_autodeco::eval::{is_correct, pass_at_k};
    use deco_decoding::SamplingParams;

    if a.n == 0 || a.batch == 0 || a.max_new_tokens == 0 || a.limit == 0 {
        bail!("-n, --batch, --max-new-tokens and --limit must be at least 1");
    }
    let items = read_gsm_jsonl(&a.data)?;
    let items: Vec<_> = items.into_iter().skip(a.offset).take(a.limit).collect();
    if items.is_empty() {
        bail!("{}: no problems after --offset {}", a.data.display(), a.offset);
    }
    let (model, tok) = crate::runtime::load(&a.model)?;
    let heads = match &a.heads {
        Some(d) => {
            let h = deco_autodeco::HostHeads::load(d)?;
            if h.config().hidden_size != model.config.hidden_size || h.config().vocab_size != model.config.vocab_size {
                bail!("{}: heads for hidden {} / vocab {}, the model has {} / {}", d.display(), h.config().hidden_size, h.config().vocab_size, model.config.hidden_size, model.config.vocab_size);
            }
            Some(h)
        }
        None => None,
    };
    let source = tok.chat_template().context("the model has no chat template")?;
    let template = ChatTemplate::new(source)?;
    let greedy = a.temperature == 0.0;
    let base = SamplingParams {
        do_sample: Some(!greedy),
        temperature: Some(a.temperature),
        top_p: Some(a.top_p),
        max_new_tokens: Some(a.max_new_tokens),
        ..Default::default()
    };
    base.validate()?;
    let mut requests = Vec::new();
    let mut refs = Vec::new();
    for (i, it) in items.iter().enumerate() {
        let q = match &a.instruction {
            Some(ins) => format!("{} {ins}", it.question),
            None => it.question.clone(),
        };
        let text = deco_autodeco::data::chat_prompt(&tok, &template, None, &q)?;
        let prompt = tok.encode(&text, true)?;
        let reference = it.r#final.clone().unwrap_or_else(|| it.answer.rsplit("####").next().unwrap_or("").trim().to_string());
        refs.push(reference);
        for j in 0..a.n {
            let seed = a.seed.wrapping_add(1000 * (a.offset + i) as u64 + j as u64);
            requests.push((prompt.clone(), SamplingParams { seed: Some(seed), ..base.clone() }));
        }
    }
    // Every sample is one request of the serving engine (the decode loop of `deco generate` and
    // `deco serve`), `--batch` of them in flight at once.
    let pb = bar(requests.len() as u64, if a.label.is_empty() { "eval" } else { &a.label });
    let t0 = Instant::now();
    let longest = requests.iter().map(|r| r.0.len()).max().unwrap_or(0) + a.max_new_tokens;
    let block_size = deco_serve::EngineConfig::default().block_size;
    let config = deco_serve::EngineConfig {
        num_blocks: (longest.div_ceil(block_size) + 1) * a.batch + 1,
        scheduler: deco_serve::SchedulerConfig { max_num_seqs: a.batch, ..Default::default() },
        max_pending_requests: requests.len() + 1,
        ..Default::default()
    };
    let has_heads = heads.is_some();
    let options = deco_serve::EngineOptions { autodeco: heads, ..Default::default() };
    let (engine, join) = deco_serve::spawn_engine_opts(model, std::sync::Arc::new(tok.clone()), config, options)?;
    let mut rxs = Vec::with_capacity(requests.len());
    for (prompt, params) in requests {
        let req = deco_serve::GenerateRequest { autodeco: Some(has_heads), ..deco_serve::GenerateRequest::sample(prompt, params, 1) };
        rxs.push(engine.submit(req)?.1);
    }
    // Per request: its tokens and the heads' (T, P) per token.
    type Sampled = (Vec<u32>, Vec<(f32, f32)>);
    let mut results: Vec<Sampled> = Vec::with_capacity(rxs.len());
    for mut rx in rxs {
        let (mut ids, mut tp) = (Vec::new(), Vec::new());
        loop {
            match rx.blocking_recv() {
                Some(deco_serve::EngineEvent::Delta { tokens, .. }) => {
                    for t in tokens {
                        ids.push(t.id);
                        tp.extend(t.autodeco);
                    }
                }
                Some(deco_serve::EngineEvent::Finished { .. }) => break,
                Some(deco_serve::EngineEvent::Failed(e)) => bail!("generation failed: {e}"),
                None => bail!("the engine stopped"),
            }
        }
        results.push((ids, tp));
        pb.set_position(results.len() as u64);
    }
    pb.finish();
    let wall = t0.elapsed().as_secs_f64();
    let load = |x: &std::sync::atomic::AtomicU64| x.load(std::sync::atomic::Ordering::Relaxed);
    let m = &engine.metrics;
    let (tokens, forward_s, heads_s, sample_s) =
        (load(&m.generation_tokens), load(&m.forward_ns) as f64 * 1e-9, load(&m.autodeco_heads_ns) as f64 * 1e-9, load(&m.sampling_ns) as f64 * 1e-9);
    drop(engine);
    let _ = join.join();
    let mut out_lines = String::new();
    let mut correct = vec![0usize; items.len()];
    let (mut sum_t, mut sum_p, mut n_tr) = (0.0f64, 0.0f64, 0usize);
    for (k, (ids, tp)) in results.iter().enumerate() {
        let i = k / a.n;
        let text = tok.decode(ids, true)?;
        let ok = is_correct(&text, &refs[i]);
        correct[i] += usize::from(ok);
        for &(t, p) in tp {
            sum_t += f64::from(t);
            sum_p += f64::from(p);
            n_tr += 1;
        }
        if a.outputs.is_some() {
            out_lines.push_str(&serde_json::to_string(&serde_json::json!({
                "problem": a.offset + i, "sample": k % a.n, "correct": ok, "reference": refs[i],
                "extracted": deco_autodeco::eval::extract_answer(&text), "tokens": ids.len(), "text": text,
            }))?);
            out_lines.push('\n');
        }
    }
    if let Some(p) = &a.outputs {
        deco_autodeco::write_atomic(p, out_lines.as_bytes())?;
    }
    let mut ks = vec![1usize];
    while ks.last().copied().unwrap_or(1) * 2 <= a.n {
        let next = ks.last().copied().unwrap_or(1) * 2;
        ks.push(next);
    }
    if !ks.contains(&a.n) {
        ks.push(a.n);
    }
    let mut pass = serde_json::Map::new();
    for &k in &ks {
        let v = correct.iter().map(|&c| pass_at_k(a.n, c, k)).sum::<f64>() / items.len() as f64;
        pass.insert(format!("pass@{k}"), serde_json::json!(v));
    }
    let summary = serde_json::json!({
        "label": a.label,
        "model": a.model.model.file_name().map(|s| s.to_string_lossy().into_owned()),
        "problems": items.len(), "n": a.n, "temperature": a.temperature, "top_p": a.top_p,
        "autodeco": a.heads.is_some(), "instruction": a.instruction,
        "pass": pass,
        "mean_T": if n_tr > 0 { serde_json::json!(sum_t / n_tr as f64) } else { serde_json::Value::Null },
        "mean_P": if n_tr > 0 { serde_json::json!(sum_p / n_tr as f64) } else { serde_json::Value::Null },
        "tokens": tokens, "wall_s": wall, "tok_s": tokens as f64 / wall,
        "forward_s": forward_s, "heads_s": heads_s, "sample_s": sample_s,
        "heads_overhead": if forward_s > 0.0 { heads_s / (forward_s + sample_s) } else { 0.0 },
    });
    println!("{summary}");
    Ok(())
}
