//! `deco medusa train` / `deco medusa eval`: Medusa-1 heads (Cai et al. 2024) on a frozen base,
//! trained on self-distilled data.
//!
//! Data: the prompts of a GSM-style JSONL file (`question` field) or of a plain text file (one
//! prompt per line). Each prompt is put in the model's chat template and the base model's own
//! greedy response (`--max-new-tokens`) is generated on the serving engine (all prompts
//! submitted at once, so continuous batching decodes them together): the paper's
//! self-distillation (§2.3.2), for when the model's fine-tuning data is not at hand. The heads
//! then train on the base's final hidden states over prompt + response
//! (`deco_autodeco::medusa`).
//!
//! `train` writes OUT atomically: `config.json`, `medusa_lm_head.safetensors`, `loss.csv`,
//! `accuracy.json` (per-head held-out top-1 / top-5, timings), then `loss.svg` into it.
//!
//! While it trains, every `--checkpoint-every` steps the heads and the loss log so far go to
//! `OUT/checkpoint-NNNNNN` (one atomic directory each; the last two are kept), and the
//! self-distilled sequences to `OUT/self_distilled.json` (atomic, once). `--resume` continues
//! from the highest checkpoint on those same sequences: the same batches as an uninterrupted run,
//! the Adam moments restarting from zero (`deco_autodeco::medusa::train_from`). At the end OUT is
//! replaced in one step by the final heads, which removes the checkpoints.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use deco_autodeco::medusa::{
    self, HeadAccuracy, MedusaConfig, MedusaHeads, MedusaLogRow, MedusaModule, MedusaPool, MedusaSequence, MedusaTrainConfig, collect_hidden,
};
use deco_formats::chat_template::ChatTemplate;
use deco_formats::tokenizer::Tokenizer;
use deco_model::Llama;
use rand::SeedableRng;
use rand::seq::SliceRandom;

use crate::ModelArgs;
use crate::autodeco::bar;

/// Medusa subcommands.
#[derive(Debug, Subcommand)]
pub enum MedusaCommand {
    /// Train Medusa-1 heads on a frozen base with self-distilled data (the base's own greedy
    /// answers to the prompts of --data); prints the per-head held-out accuracy.
    Train(TrainArgs),
    /// Per-head top-1 / top-5 accuracy of trained heads on self-distilled text of --data.
    /// Prints one JSON line last.
    Eval(EvalArgs),
}

/// Options of `deco medusa train`.
#[derive(Debug, Args)]
pub struct TrainArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompts: GSM-style JSONL (`question` field) or a text file with one prompt per line.
    #[arg(long)]
    data: PathBuf,
    /// Output heads directory (replaced atomically).
    #[arg(long)]
    out: PathBuf,
    /// Number of Medusa heads K (head k predicts the token k+1 ahead).
    #[arg(long, default_value_t = medusa::DEFAULT_NUM_HEADS)]
    num_heads: usize,
    /// Optimizer steps.
    #[arg(long, default_value_t = 300)]
    steps: usize,
    /// Adam learning rate.
    #[arg(long, alias = "learning-rate", default_value_t = 1e-3)]
    lr: f64,
    /// Positions per step.
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// λ_k = decay^(k-1), the weight of head k's loss (paper: 0.8; 1 = the reference's
    /// train_legacy.py).
    #[arg(long, default_value_t = medusa::DEFAULT_LOSS_DECAY)]
    loss_decay: f64,
    /// New tokens of each self-distilled response (greedy).
    #[arg(long, default_value_t = 128)]
    max_new_tokens: usize,
    /// Prompts taken from --data (its first N; 0 = all).
    #[arg(long, default_value_t = 256)]
    max_examples: usize,
    /// Fraction of the sequences held out for the accuracy report.
    #[arg(long, default_value_t = 0.1)]
    heldout_fraction: f64,
    /// Seed (held-out split, head initialisation, position sampling).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Held-out evaluation period (steps; 0: start and end only).
    #[arg(long, default_value_t = 50)]
    eval_every: usize,
    /// Responses decoded together by the engine.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Write a checkpoint (`OUT/checkpoint-NNNNNN`: the heads and the log so far) every this
    /// many steps (0: none).
    #[arg(long, default_value_t = 100)]
    checkpoint_every: usize,
    /// Continue from the last checkpoint in OUT (same options as the interrupted run).
    #[arg(long)]
    resume: bool,
}

/// File of OUT holding the self-distilled sequences while the heads train (for `--resume`).
const SELF_DISTILLED_FILE: &str = "self_distilled.json";

/// Options of `deco medusa eval`.
#[derive(Debug, Args)]
pub struct EvalArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Medusa heads directory (`deco medusa train`).
    #[arg(long)]
    medusa: PathBuf,
    /// Prompts: GSM-style JSONL (`question` field) or a text file with one prompt per line.
    #[arg(long)]
    data: PathBuf,
    /// Prompts evaluated (after --offset; 0 = all).
    #[arg(long, default_value_t = 64)]
    max_examples: usize,
    /// Skip the first N prompts (e.g. those trained on).
    #[arg(long, default_value_t = 0)]
    offset: usize,
    /// New tokens of each self-distilled response (greedy).
    #[arg(long, default_value_t = 128)]
    max_new_tokens: usize,
    /// Responses decoded together by the engine.
    #[arg(long, default_value_t = 32)]
    batch: usize,
}

/// Runs a Medusa subcommand.
pub fn run(cmd: &MedusaCommand) -> Result<()> {
    match cmd {
        MedusaCommand::Train(a) => run_train(a),
        MedusaCommand::Eval(a) => run_eval(a),
    }
}

/// The prompts of `path`: the `question` of each line of a JSONL file (a `.jsonl` name or a
/// first line starting with `{`), else every non-empty line.
fn read_prompts(path: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let jsonl = path.extension().is_some_and(|e| e == "jsonl") || text.trim_start().starts_with('{');
    let prompts: Vec<String> = if jsonl {
        deco_autodeco::data::read_gsm_jsonl(path)?.into_iter().map(|it| it.question).collect()
    } else {
        text.lines().map(str::trim).filter(|l| !l.is_empty()).map(str::to_string).collect()
    };
    if prompts.is_empty() {
        bail!("{}: no prompts", path.display());
    }
    Ok(prompts)
}

/// Self-distillation: each prompt in the chat template, the base's greedy response of up to
/// `max_new_tokens` tokens generated on the serving engine, `batch` sequences at a time.
/// Responses that end in an end-of-sequence token keep it (the engine does not release it as
/// text: the tokenizer's EOS id is appended).
fn self_distill(model: &Llama, tok: &Tokenizer, prompts: &[String], max_new_tokens: usize, batch: usize) -> Result<Vec<MedusaSequence>> {
    use deco_decoding::{FinishReason, SamplingParams};
    let source = tok.chat_template().context("the model has no chat template (the prompts are rendered as chat turns)")?;
    let template = ChatTemplate::new(source)?;
    let params = SamplingParams { do_sample: Some(false), temperature: Some(0.0), max_new_tokens: Some(max_new_tokens), ..Default::default() };
    params.validate()?;
    let mut encoded = Vec::with_capacity(prompts.len());
    for (i, p) in prompts.iter().enumerate() {
        let text = deco_autodeco::data::chat_prompt(tok, &template, None, p)?;
        let ids = tok.encode(&text, true).with_context(|| format!("prompt {}", i + 1))?;
        if ids.len() + max_new_tokens > model.max_context() {
            bail!("prompt {}: {} tokens + --max-new-tokens {max_new_tokens} exceed the model's context of {}", i + 1, ids.len(), model.max_context());
        }
        encoded.push(ids);
    }
    let longest = encoded.iter().map(Vec::len).max().unwrap_or(0) + max_new_tokens;
    let block_size = deco_serve::EngineConfig::default().block_size;
    let config = deco_serve::EngineConfig {
        num_blocks: (longest.div_ceil(block_size) + 1) * batch + 1,
        scheduler: deco_serve::SchedulerConfig { max_num_seqs: batch, ..Default::default() },
        max_pending_requests: encoded.len() + 1,
        ..Default::default()
    };
    let (engine, join) = deco_serve::spawn_engine_opts(model.clone(), std::sync::Arc::new(tok.clone()), config, deco_serve::EngineOptions::default())?;
    let mut rxs = Vec::with_capacity(encoded.len());
    for ids in &encoded {
        rxs.push(engine.submit(deco_serve::GenerateRequest::sample(ids.clone(), params.clone(), 1))?.1);
    }
    let pb = bar(rxs.len() as u64, "generate");
    let mut seqs = Vec::with_capacity(rxs.len());
    for (ids, mut rx) in encoded.into_iter().zip(rxs) {
        let mut out = Vec::new();
        loop {
            match rx.blocking_recv() {
                Some(deco_serve::EngineEvent::Delta { tokens, .. }) => out.extend(tokens.iter().map(|t| t.id)),
                Some(deco_serve::EngineEvent::Finished { reason, completion_tokens, .. }) => {
                    if reason == FinishReason::EosToken
                        && completion_tokens == out.len() + 1
                        && let Some(eos) = tok.eos_token_id()
                    {
                        out.push(eos);
                    }
                    break;
                }
                Some(deco_serve::EngineEvent::Failed(e)) => bail!("generation failed: {e}"),
                None => bail!("the engine stopped"),
            }
        }
        let response_start = ids.len();
        let mut tokens = ids;
        tokens.extend(out);
        seqs.push(MedusaSequence { tokens, response_start });
        pb.inc(1);
    }
    pb.finish();
    drop(engine);
    let _ = join.join();
    Ok(seqs)
}

fn hidden_pool(model: &Llama, seqs: &[MedusaSequence], label: &str) -> Result<MedusaPool> {
    let pb = bar(seqs.len() as u64, label);
    let pool = collect_hidden(model, seqs, &mut |d, _| pb.set_position(d as u64))?;
    pb.finish();
    Ok(pool)
}

fn print_accuracy(acc: &[HeadAccuracy]) {
    eprintln!("[medusa] held-out accuracy (head k predicts the token k+1 ahead):");
    eprintln!("  head  positions   top-1   top-5   loss");
    for a in acc {
        eprintln!("  {:>4}  {:>9}  {:>6.3}  {:>6.3}  {:>5.3}", a.head, a.positions, a.top1, a.top5, a.loss);
    }
}

fn run_train(a: &TrainArgs) -> Result<()> {
    if a.num_heads == 0 {
        bail!("--num-heads must be at least 1, got 0");
    }
    if a.max_new_tokens < 2 || a.batch == 0 {
        bail!("--max-new-tokens must be at least 2 and --batch at least 1");
    }
    if !(0.0..1.0).contains(&a.heldout_fraction) {
        bail!("--heldout-fraction must be in [0, 1), got {}", a.heldout_fraction);
    }
    let tc = MedusaTrainConfig {
        steps: a.steps,
        batch_size: a.batch_size,
        learning_rate: a.lr,
        loss_decay: a.loss_decay,
        seed: a.seed,
        eval_every: a.eval_every,
        ..Default::default()
    };
    tc.validate()?;
    let mut prompts = read_prompts(&a.data)?;
    if a.max_examples > 0 {
        prompts.truncate(a.max_examples);
    }
    let t_all = Instant::now();
    let (model, tok) = crate::runtime::load(&a.model)?;
    let mut config = MedusaConfig::new(a.num_heads, model.config.hidden_size, model.config.vocab_size);
    config.base_model_name_or_path = Some(a.model.model.display().to_string());
    config.validate()?;

    // Where to start: --resume needs a checkpoint in OUT; a fresh run refuses to mix with one.
    let existing = crate::runtime::checkpoints(&a.out)?;
    let resume = if a.resume {
        let Some((step, dir)) = existing.last().cloned() else { bail!("--resume: no checkpoint-NNNNNN directory in {}", a.out.display()) };
        let (ck_config, blocks) = medusa::load_blocks(&dir).with_context(|| format!("--resume: loading {}", dir.display()))?;
        if (ck_config.medusa_num_heads, ck_config.hidden_size, ck_config.vocab_size) != (config.medusa_num_heads, config.hidden_size, config.vocab_size) {
            bail!("--resume: {} holds {} heads for hidden size {} and vocabulary {}, this run trains {} heads for {} and {}", dir.display(), ck_config.medusa_num_heads, ck_config.hidden_size, ck_config.vocab_size, config.medusa_num_heads, config.hidden_size, config.vocab_size);
        }
        let csv = dir.join("loss.csv");
        let text = std::fs::read_to_string(&csv).with_context(|| format!("--resume: reading {}", csv.display()))?;
        let log = medusa::parse_log_csv(&text, a.num_heads).with_context(|| csv.display().to_string())?;
        eprintln!("[medusa] resuming from {} (step {step} of {})", dir.display(), a.steps);
        Some((medusa::MedusaResume { step, blocks }, log))
    } else {
        if !existing.is_empty() {
            bail!("{} holds checkpoints of an interrupted run: use --resume to continue it, or remove them", a.out.display());
        }
        None
    };

    let t0 = Instant::now();
    let saved = a.out.join(SELF_DISTILLED_FILE);
    let mut seqs = if resume.is_some() && saved.is_file() {
        let text = std::fs::read_to_string(&saved).with_context(|| format!("--resume: reading {}", saved.display()))?;
        let seqs: Vec<MedusaSequence> = serde_json::from_str(&text).with_context(|| format!("--resume: {} is not a list of sequences", saved.display()))?;
        if seqs.iter().any(|s| s.response_start == 0 || s.response_start >= s.tokens.len() || s.tokens.iter().any(|&t| t as usize >= model.config.vocab_size)) {
            bail!("--resume: {} holds a sequence without a response or with a token outside the vocabulary", saved.display());
        }
        eprintln!("[medusa] {} self-distilled sequences read from {}", seqs.len(), saved.display());
        seqs
    } else {
        let seqs = self_distill(&model, &tok, &prompts, a.max_new_tokens, a.batch)?;
        if a.checkpoint_every > 0 {
            std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
            deco_formats::atomic::write_file(&saved, serde_json::to_string(&seqs)?.as_bytes()).with_context(|| format!("writing {}", saved.display()))?;
        }
        seqs
    };
    let generate_s = t0.elapsed().as_secs_f64();
    let new_tokens: usize = seqs.iter().map(|s| s.tokens.len() - s.response_start).sum();
    eprintln!("[medusa] {} self-distilled responses, {new_tokens} tokens, in {generate_s:.1}s", seqs.len());
    seqs.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(a.seed));
    let n_held = if seqs.len() < 2 { 0 } else { ((seqs.len() as f64 * a.heldout_fraction).ceil() as usize).min(seqs.len() - 1) };
    let (held, train) = seqs.split_at(n_held);

    let t0 = Instant::now();
    let train_pool = hidden_pool(&model, train, "hidden")?;
    let held_pool = if held.is_empty() { MedusaPool { hidden_size: model.config.hidden_size, ..Default::default() } } else { hidden_pool(&model, held, "held-out")? };
    let hidden_s = t0.elapsed().as_secs_f64();
    eprintln!(
        "[medusa] {} training positions from {} sequences, {} held-out from {n_held}; hidden states in {hidden_s:.1}s",
        train_pool.len(),
        train.len(),
        held_pool.len()
    );

    let t0 = Instant::now();
    let pb = bar(a.steps as u64, "train");
    let (resume, log_so_far) = match resume {
        Some((r, log)) => (Some(r), log),
        None => (None, Vec::new()),
    };
    let log_cell = std::cell::RefCell::new(log_so_far);
    let mut progress = |r: &MedusaLogRow| {
        log_cell.borrow_mut().push(r.clone());
        pb.set_position(r.step as u64);
        if r.loss.is_finite() {
            pb.set_prefix(format!("loss {:.3}", r.loss));
        }
        if let Some(h) = &r.heldout {
            let t: Vec<String> = h.iter().map(|x| format!("{:.3}", x.top1)).collect();
            pb.println(format!("step {:>5}: held-out top-1 per head [{}]", r.step, t.join(", ")));
        }
    };
    let lm_head = model.lm_head().clone();
    let out = a.out.clone();
    let mut save = |step: usize, blocks: &[medusa::ResBlockWeights]| -> deco_autodeco::Result<()> {
        let csv = medusa::log_csv(&log_cell.borrow(), config.medusa_num_heads);
        medusa::save_blocks(&out.join(format!("checkpoint-{step:06}")), &config, blocks, &[("loss.csv", csv.as_bytes())])?;
        // Keep the last two checkpoints (older ones discarded crash-safely).
        crate::runtime::prune_checkpoints(&out, 2);
        Ok(())
    };
    let (blocks, _) = medusa::train_from(&config, &tc, &train_pool, &held_pool, &lm_head, model.device(), resume, a.checkpoint_every, &mut progress, &mut save)?;
    pb.finish();
    let log = log_cell.into_inner();
    let train_s = t0.elapsed().as_secs_f64();

    let t0 = Instant::now();
    let heads = MedusaHeads::new(config.clone(), blocks, &model)?;
    let module = MedusaModule::from_blocks(heads.blocks(), config.hidden_size, model.device());
    let rows: Vec<usize> = (0..held_pool.len()).collect();
    let acc = if rows.is_empty() { Vec::new() } else { medusa::evaluate(&module, &held_pool, &rows, &lm_head, model.device())? };
    let eval_s = t0.elapsed().as_secs_f64();
    let report = serde_json::json!({
        "model": a.model.model.display().to_string(),
        "data": a.data.display().to_string(),
        "num_heads": a.num_heads,
        "steps": a.steps, "batch_size": a.batch_size, "lr": a.lr, "loss_decay": a.loss_decay, "seed": a.seed,
        "max_new_tokens": a.max_new_tokens,
        "train_sequences": train.len(), "heldout_sequences": n_held,
        "train_positions": train_pool.len(), "heldout_positions": held_pool.len(),
        "self_distilled_tokens": new_tokens,
        "heldout": acc,
        "seconds": { "generate": generate_s, "hidden": hidden_s, "train": train_s, "eval": eval_s, "total": t_all.elapsed().as_secs_f64() },
    });
    let csv = medusa::log_csv(&log, a.num_heads);
    let json = serde_json::to_string_pretty(&report)? + "\n";
    medusa::save_blocks(&a.out, &config, heads.blocks(), &[("loss.csv", csv.as_bytes()), ("accuracy.json", json.as_bytes())])
        .with_context(|| format!("writing {}", a.out.display()))?;
    let pts = |f: &dyn Fn(&MedusaLogRow) -> Option<f64>| -> Vec<(f64, f64)> { log.iter().filter_map(|r| f(r).map(|y| (r.step as f64, y))).collect() };
    let mut series = vec![("train loss (Σ λ_k CE_k)".to_string(), pts(&|r| r.loss.is_finite().then_some(r.loss)))];
    for k in 0..a.num_heads {
        series.push((format!("held-out CE head {}", k + 1), pts(&|r| r.heldout.as_ref().and_then(|h| h.get(k)).map(|x| x.loss))));
    }
    let series_ref: Vec<deco_autodeco::plot::Series<'_>> = series.iter().map(|(n, v)| (n.as_str(), v.clone())).collect();
    if let Err(e) = deco_autodeco::plot::line_chart_svg(&a.out.join("loss.svg"), "Medusa heads", "step", "loss (nats)", &series_ref) {
        eprintln!("[medusa] no loss plot: {e}");
    }
    print_accuracy(&acc);
    eprintln!(
        "[medusa] wrote {} (generate {generate_s:.1}s, hidden {hidden_s:.1}s, train {train_s:.1}s, eval {eval_s:.1}s, total {:.1}s)",
        a.out.display(),
        t_all.elapsed().as_secs_f64()
    );
    println!("{}", serde_json::to_string(&serde_json::json!({ "heldout": acc }))?);
    Ok(())
}

fn run_eval(a: &EvalArgs) -> Result<()> {
    if a.max_new_tokens < 2 || a.batch == 0 {
        bail!("--max-new-tokens must be at least 2 and --batch at least 1");
    }
    let prompts = read_prompts(&a.data)?;
    let mut prompts: Vec<String> = prompts.into_iter().skip(a.offset).collect();
    if prompts.is_empty() {
        bail!("{}: no prompts after --offset {}", a.data.display(), a.offset);
    }
    if a.max_examples > 0 {
        prompts.truncate(a.max_examples);
    }
    let (model, tok) = crate::runtime::load(&a.model)?;
    let heads = MedusaHeads::load(&a.medusa, &model).with_context(|| format!("loading Medusa heads from {}", a.medusa.display()))?;
    let t0 = Instant::now();
    let seqs = self_distill(&model, &tok, &prompts, a.max_new_tokens, a.batch)?;
    let pool = hidden_pool(&model, &seqs, "hidden")?;
    let module = MedusaModule::from_blocks(heads.blocks(), heads.config().hidden_size, model.device());
    let rows: Vec<usize> = (0..pool.len()).collect();
    let acc = medusa::evaluate(&module, &pool, &rows, model.lm_head(), model.device())?;
    print_accuracy(&acc);
    eprintln!("[medusa] {} sequences, {} positions, {:.1}s", seqs.len(), pool.len(), t0.elapsed().as_secs_f64());
    println!("{}", serde_json::to_string(&serde_json::json!({ "sequences": seqs.len(), "positions": pool.len(), "heldout": acc }))?);
    Ok(())
}
