//! `deco prune`: unstructured / N:M (magnitude, Wanda, SparseGPT) and structured (heads,
//! neurons, layers) pruning of a model, written atomically as a Hugging Face directory (or the
//! compact sparse form).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use deco_compress::export::{write_dense_dir, write_sparse_dir};
use deco_compress::indicatif::{ProgressBar, ProgressStyle};
use deco_compress::mask::Pattern;
use deco_compress::pipeline::{Method as UMethod, calibration_windows, prune_model};
use deco_compress::sparsegpt::SparseGptConfig;
use deco_compress::structured::{HeadMode, StructuredPlan, StructuredSpec, decoder_params, importance, total_params};
use deco_compress::unstructured::Scope;
use deco_formats::checkpoint::Checkpoint;
use deco_formats::hf_export::ExportDtype;

use crate::ModelArgs;

/// Pruning method.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PruneMethod {
    /// Unstructured / N:M by |W| (no calibration).
    Magnitude,
    /// Unstructured / N:M by |W|·‖X_j‖₂ per output row (Sun et al. 2024).
    Wanda,
    /// Unstructured / N:M with Hessian-based mask and OBS update (Frantar & Alistarh 2023).
    Sparsegpt,
    /// Structured: attention heads (GQA-aware, see --head-mode).
    Heads,
    /// Structured: MLP intermediate channels.
    Neurons,
    /// Structured: whole decoder layers (block influence).
    Layers,
    /// Sheared-LLaMA targeted structured pruning (Xia et al. 2024): hard-concrete masks on
    /// layers / heads / channels / hidden, Lagrangian constraint toward `--target`, trained on
    /// wiki + Shakespeare + GSM with dynamic batch loading; exports the pruned model.
    Sheared,
}

/// Comparison group of magnitude pruning.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum ScopeArg {
    /// All weights of a linear layer together.
    Layer,
    /// Each output row.
    Row,
}

/// How heads are removed under GQA.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum HeadModeArg {
    /// Remove the same number of query heads from every KV group (KV heads stay).
    Query,
    /// Remove whole KV groups (the KV head and its query heads).
    Kv,
}

/// How the sparsity mask evolves in the recovery fine-tune (`--finetune-steps`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum MaskUpdateArg {
    /// Keep the one-shot mask (masked gradients; the pattern stays bit for bit).
    Fixed,
    /// Re-select the masks every `--mask-update-every` steps from a moving average of the Wanda
    /// score, dense shadow weights trained with the straight-through estimator.
    Ema,
}

/// Output format.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum FormatArg {
    /// Hugging Face directory (model.safetensors): loads everywhere.
    Dense,
    /// Bitmask + nonzero values (model.sparse.safetensors): smaller; read with deco_compress::sparse.
    Sparse,
}

/// Weight dtype of the output.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum DtypeArg {
    /// 32-bit float.
    F32,
    /// bfloat16.
    Bf16,
}

/// Arguments of `deco prune`.
#[derive(Debug, Args)]
pub struct PruneArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Method(s); structured methods combine, e.g. `--method heads,neurons --sparsity 0.34,0.6`.
    #[arg(long, value_enum, value_delimiter = ',', required = true)]
    method: Vec<PruneMethod>,
    /// Fraction removed, one per method (or one for all): of each linear layer's weights
    /// (unstructured), of the query heads per KV group / of the KV groups, of the MLP
    /// channels, of the layers.
    #[arg(long, value_delimiter = ',', default_value = "0.5")]
    sparsity: Vec<f64>,
    /// N:M semi-structured pattern for magnitude / wanda / sparsegpt (N kept of every M), e.g. 2:4.
    #[arg(long)]
    nm: Option<String>,
    /// Comparison group of magnitude pruning.
    #[arg(long, value_enum, default_value_t = ScopeArg::Layer)]
    scope: ScopeArg,
    /// How heads are removed under grouped-query attention.
    #[arg(long, value_enum, default_value_t = HeadModeArg::Query)]
    head_mode: HeadModeArg,
    /// Calibration windows.
    #[arg(long, default_value_t = 32)]
    nsamples: usize,
    /// Tokens per calibration window.
    #[arg(long, default_value_t = 256)]
    seqlen: usize,
    /// Seed of the calibration window starts.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Calibration text: `wiki`, `shakespeare` (the data set's train split) or a UTF-8 file.
    #[arg(long, default_value = "wiki")]
    calib: String,
    /// Use at most this many characters of the calibration text.
    #[arg(long, default_value_t = 400_000)]
    calib_chars: usize,
    /// SparseGPT block size.
    #[arg(long, default_value_t = 128)]
    blocksize: usize,
    /// SparseGPT dampening (fraction of the mean Hessian diagonal).
    #[arg(long, default_value_t = 0.01)]
    percdamp: f64,
    /// Output format.
    #[arg(long, value_enum, default_value_t = FormatArg::Dense)]
    format: FormatArg,
    /// Output weight dtype.
    #[arg(long, value_enum, default_value_t = DtypeArg::F32)]
    dtype: DtypeArg,
    /// Output directory (must not exist, or be empty); written atomically.
    #[arg(long)]
    out: PathBuf,
    /// Sheared: target architecture `LAYERS,HEADS,INTERMEDIATE,HIDDEN` (heads per layer).
    #[arg(long)]
    target: Option<String>,
    /// Sheared: optimizer steps.
    #[arg(long, default_value_t = 60)]
    steps: usize,
    /// Sheared and the recovery fine-tune: sequences (of `--seqlen` tokens) per step.
    #[arg(long, default_value_t = 2)]
    batch_size: usize,
    /// Sheared and the recovery fine-tune: Adam learning rate of the weights.
    #[arg(long, default_value_t = 1e-4)]
    lr: f64,
    /// Recovery fine-tune after unstructured / N:M pruning: optimizer steps of next-token
    /// cross-entropy on the calibration text (`--calib`), the sparsity held exactly at its
    /// target (0: one-shot pruning only).
    #[arg(long, default_value_t = 0)]
    finetune_steps: usize,
    /// The fine-tune's mask: the one-shot mask fixed, or moving-average (Wanda score) updates.
    #[arg(long, value_enum, default_value_t = MaskUpdateArg::Fixed)]
    mask_update: MaskUpdateArg,
    /// `--mask-update ema`: EMA factor of the score per step, in [0, 1).
    #[arg(long, default_value_t = 0.9)]
    mask_ema: f64,
    /// `--mask-update ema`: steps between mask re-selections.
    #[arg(long, default_value_t = 10)]
    mask_update_every: usize,
}

fn bar(len: usize, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(len as u64);
    if let Ok(style) = ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} layers, {elapsed} (eta {eta})") {
        pb.set_style(style.progress_chars("=> "));
    }
    pb.set_message(what.to_string());
    pb
}

/// Runs the command.
pub fn run(args: &PruneArgs) -> Result<()> {
    if args.method.contains(&PruneMethod::Sheared) {
        if args.method.len() != 1 {
            bail!("--method sheared cannot be combined with other methods");
        }
        return run_sheared(args);
    }
    if args.target.is_some() {
        bail!("--target applies to --method sheared only");
    }
    if args.finetune_steps == 0 && args.mask_update != MaskUpdateArg::Fixed {
        bail!("--mask-update ema needs --finetune-steps N (N >= 1)");
    }
    let methods = &args.method;
    let structured = |m: &PruneMethod| matches!(m, PruneMethod::Heads | PruneMethod::Neurons | PruneMethod::Layers);
    let n_struct = methods.iter().filter(|m| structured(m)).count();
    if n_struct != 0 && n_struct != methods.len() {
        bail!("--method: structured (heads, neurons, layers) and unstructured methods cannot be combined in one run");
    }
    if n_struct == 0 && methods.len() != 1 {
        bail!("--method: give one unstructured method");
    }
    if n_struct > 0 && args.finetune_steps > 0 {
        bail!("--finetune-steps applies to unstructured and N:M pruning (magnitude, wanda, sparsegpt); after structured pruning use `deco distill`");
    }
    let mut dedup = methods.clone();
    dedup.sort_by_key(|m| *m as u8);
    dedup.dedup();
    if dedup.len() != methods.len() {
        bail!("--method lists a method twice");
    }
    let sparsity: Vec<f64> = match args.sparsity.len() {
        1 => vec![args.sparsity[0]; methods.len()],
        n if n == methods.len() => args.sparsity.clone(),
        n => bail!("--sparsity has {n} values for {} methods", methods.len()),
    };
    for &s in &sparsity {
        if !(0.0..1.0).contains(&s) {
            bail!("--sparsity {s} must be in [0, 1)");
        }
    }
    if args.nm.is_some() && n_struct > 0 {
        bail!("--nm applies to magnitude, wanda and sparsegpt only");
    }
    let pattern = match &args.nm {
        Some(t) => match Pattern::parse(t)? {
            p @ Pattern::NM { .. } => p,
            Pattern::Unstructured(_) => bail!("--nm expects N:M such as 2:4, got `{t}`"),
        },
        None => Pattern::Unstructured(sparsity[0]),
    };
    if args.finetune_steps > 0 {
        finetune_config(args, pattern)?;
    }
    if args.out.exists() && std::fs::read_dir(&args.out).map(|mut d| d.next().is_some()).unwrap_or(true) {
        bail!("{}: output directory exists and is not empty", args.out.display());
    }
    let device = crate::runtime::device(&args.model)?;
    let ckpt = Checkpoint::open(&args.model.model)?;
    let tok = crate::runtime::load_tokenizer(&args.model.model)?;
    let cfg = ckpt.config.clone();
    let src = |n: &str| -> deco_model::Result<(Vec<usize>, Vec<f32>)> { Ok(ckpt.tensor(n)?) };

    let needs_calib = n_struct > 0 || methods[0] != PruneMethod::Magnitude;
    let t0 = Instant::now();
    let mut text_ids = Vec::new();
    let windows = if needs_calib || args.finetune_steps > 0 {
        let path = match args.calib.as_str() {
            "wiki" => crate::runtime::data_file(&args.model.model, "wiki_train.txt", "--calib FILE")?,
            "shakespeare" => crate::runtime::data_file(&args.model.model, "shakespeare/train.txt", "--calib FILE")?,
            f => PathBuf::from(f),
        };
        let bytes = std::fs::read(&path).with_context(|| format!("reading calibration text {}", path.display()))?;
        let text = String::from_utf8(bytes).map_err(|e| anyhow::anyhow!("{}: not valid UTF-8 ({e})", path.display()))?;
        let text: String = text.chars().take(args.calib_chars).collect();
        let ids = tok.encode_with(&text, false, true)?;
        if args.seqlen > cfg.max_position_embeddings {
            bail!("--seqlen {} exceeds the model context {}", args.seqlen, cfg.max_position_embeddings);
        }
        let w = calibration_windows(&ids, args.nsamples, args.seqlen, args.seed).with_context(|| format!("calibration text {}", path.display()))?;
        eprintln!("calibration: {} windows x {} tokens from {}", args.nsamples, args.seqlen, path.display());
        text_ids = ids;
        if needs_calib { w } else { Vec::new() }
    } else {
        Vec::new()
    };
    let calib_tokens: usize = windows.iter().map(Vec::len).sum();
    let dtype = match args.dtype {
        DtypeArg::F32 => ExportDtype::F32,
        DtypeArg::Bf16 => ExportDtype::Bf16,
    };
    let layers = cfg.num_hidden_layers;
    if n_struct == 0 {
        let method = match methods[0] {
            PruneMethod::Magnitude => UMethod::Magnitude(match args.scope {
                ScopeArg::Layer => Scope::Layer,
                ScopeArg::Row => Scope::Row,
            }),
            PruneMethod::Wanda => UMethod::Wanda,
            _ => UMethod::SparseGpt(SparseGptConfig { blocksize: args.blocksize, percdamp: args.percdamp }),
        };
        let pb = bar(layers, &format!("{:?} {}", methods[0], args.nm.clone().unwrap_or_else(|| format!("{}", sparsity[0]))));
        let pruned = prune_model(&cfg, &src, &device, &windows, &method, pattern, &mut |_| pb.inc(1))?;
        pb.finish();
        let secs = t0.elapsed().as_secs_f64();
        let mut sparsity_out = pruned.sparsity();
        let mut ft_summary = String::new();
        let tuned = if args.finetune_steps > 0 {
            let (tensors, summary, s) = finetune(args, &cfg, &src, &pruned, pattern, &text_ids)?;
            ft_summary = summary;
            sparsity_out = s;
            Some(tensors)
        } else {
            None
        };
        eprintln!("writing {}", args.out.display());
        let tuned_source = |n: &str| -> deco_model::Result<(Vec<usize>, Vec<f32>)> {
            match tuned.as_ref().and_then(|t| t.get(n)) {
                Some(v) => Ok(v.clone()),
                None => src(n),
            }
        };
        let pruned_source = pruned.source(&src);
        let source: &deco_compress::pipeline::TensorFn<'_> = if tuned.is_some() { &tuned_source } else { &pruned_source };
        match args.format {
            FormatArg::Dense => write_dense_dir(&ckpt, &tok, &cfg, source, &args.out, dtype)?,
            FormatArg::Sparse => write_sparse_dir(&ckpt, &tok, &cfg, source, &args.out, dtype)?,
        }
        println!(
            "[prune] method={:?} pattern={} sparsity={sparsity_out:.4} calib_tokens={calib_tokens} prune_s={secs:.1}{ft_summary} params={} out={}",
            methods[0],
            args.nm.clone().unwrap_or_else(|| format!("{}", sparsity[0])),
            total_params(&cfg),
            args.out.display()
        );
    } else {
        let mut spec = StructuredSpec {
            head_mode: match args.head_mode {
                HeadModeArg::Query => HeadMode::QueryPerGroup,
                HeadModeArg::Kv => HeadMode::KvGroups,
            },
            ..StructuredSpec::default()
        };
        for (m, &s) in methods.iter().zip(&sparsity) {
            match m {
                PruneMethod::Heads => spec.heads = s,
                PruneMethod::Neurons => spec.neurons = s,
                _ => spec.layers = s,
            }
        }
        let pb = bar(layers, "importance");
        let imp = importance(&cfg, &src, &device, &windows, &mut |_| pb.inc(1))?;
        pb.finish();
        let plan = StructuredPlan::from_importance(&cfg, &imp, &spec)?;
        plan.validate(&cfg)?;
        let pcfg = plan.config(&cfg);
        let secs = t0.elapsed().as_secs_f64();
        let tensor = |n: &str| plan.pruned_tensor(&cfg, &src, n);
        eprintln!("writing {}", args.out.display());
        match args.format {
            FormatArg::Dense => write_dense_dir(&ckpt, &tok, &pcfg, &tensor, &args.out, dtype)?,
            FormatArg::Sparse => write_sparse_dir(&ckpt, &tok, &pcfg, &tensor, &args.out, dtype)?,
        }
        println!(
            "[prune] method={} heads={}/{} kv_heads={}/{} intermediate={}/{} layers={}/{} decoder_params={}/{} params={}/{} calib_tokens={calib_tokens} prune_s={secs:.1} out={}",
            methods.iter().map(|m| format!("{m:?}").to_lowercase()).collect::<Vec<_>>().join("+"),
            pcfg.num_attention_heads,
            cfg.num_attention_heads,
            pcfg.num_key_value_heads,
            cfg.num_key_value_heads,
            pcfg.intermediate_size,
            cfg.intermediate_size,
            pcfg.num_hidden_layers,
            cfg.num_hidden_layers,
            decoder_params(&pcfg),
            decoder_params(&cfg),
            total_params(&pcfg),
            total_params(&cfg),
            args.out.display()
        );
    }
    Ok(())
}

/// The options of `--finetune-steps`, checked (before any pruning work).
fn finetune_config(args: &PruneArgs, pattern: Pattern) -> Result<deco_compress::sparse_ft::SparseFtConfig> {
    use deco_compress::sparse_ft::{MaskUpdate, SparseFtConfig};
    let mask_update = match args.mask_update {
        MaskUpdateArg::Fixed => MaskUpdate::Fixed,
        MaskUpdateArg::Ema => MaskUpdate::Ema { beta: args.mask_ema, every: args.mask_update_every },
    };
    let sc = SparseFtConfig { steps: args.finetune_steps, batch_size: args.batch_size, seqlen: args.seqlen, lr: args.lr, seed: args.seed, mask_update, pattern, clip_norm: Some(1.0) };
    sc.validate()?;
    Ok(sc)
}

/// The recovery fine-tune of `--finetune-steps` on the pruned model: returns the tuned tensors
/// (transformers names), a summary for the `[prune]` line and the final sparsity.
fn finetune(
    args: &PruneArgs,
    cfg: &deco_formats::config::ModelConfig,
    src: &deco_compress::pipeline::TensorFn<'_>,
    pruned: &deco_compress::pipeline::PrunedModel,
    pattern: Pattern,
    tokens: &[u32],
) -> Result<(deco_compress::student::HfTensors, String, f64)> {
    use burn::tensor::Device;
    use deco_compress::sparse_ft::{MaskUpdate, sparse_finetune};
    use deco_compress::student::StudentModel;

    let sc = finetune_config(args, pattern)?;
    let mask_update = sc.mask_update;
    anyhow::ensure!(tokens.len() > args.seqlen, "--calib text has {} tokens, need more than --seqlen {}", tokens.len(), args.seqlen);
    // Fixed: the pruned weights. EMA: the pruned weights where kept, the dense ones where pruned
    // (a regrown weight restarts from its dense value).
    let start = |n: &str| -> deco_model::Result<(Vec<usize>, Vec<f32>)> {
        let (shape, mut w) = src(n)?;
        if let (Some(p), Some(m)) = (pruned.linears.get(n), pruned.masks.get(n)) {
            for ((x, &pv), &k) in w.iter_mut().zip(p).zip(&m.keep) {
                if k || mask_update == MaskUpdate::Fixed {
                    *x = pv;
                }
            }
        }
        Ok((shape, w))
    };
    let model = StudentModel::from_source(cfg, &start, &Device::flex().autodiff())?;
    let pb = ProgressBar::new(args.finetune_steps as u64);
    if let Ok(style) = ProgressStyle::with_template("fine-tune [{bar:30}] {pos}/{len} steps, {elapsed} (eta {eta}) {msg}") {
        pb.set_style(style.progress_chars("=> "));
    }
    let t0 = Instant::now();
    let out = sparse_finetune(model, cfg, &pruned.masks, tokens, &sc, &mut |r| {
        pb.set_position(r.step as u64);
        pb.set_message(format!("loss {:.4}", r.loss));
    })?;
    pb.finish();
    let mean = |rows: &[deco_compress::distill::StepLog]| rows.iter().map(|r| r.loss).sum::<f64>() / rows.len().max(1) as f64;
    let k = out.log.len().min(10);
    // Fraction of decoder weights whose flag changed, summed over the re-selections (EMA only).
    let changed = out.mask_log.iter().fold(0.0f64, |acc, m| acc + m.changed);
    let pruned_n: usize = out.masks.values().map(|m| m.pruned()).sum();
    let total: usize = out.masks.values().map(|m| m.keep.len()).sum();
    let summary = format!(
        " finetune_steps={} mask_update={:?} finetune_tokens={} loss_first10={:.4} loss_last10={:.4} mask_changed_total={changed:.4} stray={} finetune_s={:.1}",
        args.finetune_steps,
        args.mask_update,
        args.finetune_steps * args.batch_size * args.seqlen,
        mean(&out.log[..k]),
        mean(&out.log[out.log.len() - k..]),
        out.stray,
        t0.elapsed().as_secs_f64()
    )
    .to_lowercase();
    Ok((out.tensors, summary, pruned_n as f64 / total.max(1) as f64))
}

/// `--method sheared`: Sheared-LLaMA on three domains (wiki, Shakespeare, GSM train), then the
/// hard prune to `--target`, written as a dense model.
fn run_sheared(args: &PruneArgs) -> Result<()> {
    use burn::tensor::Device;
    use deco_compress::distill::cross_entropy_weighted;
    use deco_compress::sheared::{ShearConfig, Target, shear};
    use deco_compress::student::StudentModel;

    let spec = args.target.as_deref().context("--method sheared needs --target LAYERS,HEADS,INTERMEDIATE,HIDDEN")?;
    let v: Vec<usize> = spec
        .split(',')
        .map(|x| x.trim().parse::<usize>())
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| anyhow::anyhow!("--target `{spec}`: {e}"))?;
    let [layers, heads, intermediate, hidden] = v[..] else {
        bail!("--target `{spec}`: expected four numbers LAYERS,HEADS,INTERMEDIATE,HIDDEN");
    };
    if args.steps == 0 || args.batch_size == 0 || args.seqlen < 2 {
        bail!("--steps and --batch-size must be at least 1 and --seqlen at least 2");
    }
    if !(args.lr.is_finite() && args.lr > 0.0) {
        bail!("--lr must be a positive number, got {}", args.lr);
    }
    if args.out.exists() && std::fs::read_dir(&args.out).map(|mut d| d.next().is_some()).unwrap_or(true) {
        bail!("{}: output directory exists and is not empty", args.out.display());
    }
    let ckpt = Checkpoint::open(&args.model.model)?;
    let cfg = ckpt.config.clone();
    let target = Target { layers, heads, intermediate, hidden };
    target.validate(&cfg)?;
    let _ = crate::runtime::device(&args.model)?;
    let tok = crate::runtime::load_tokenizer(&args.model.model)?;
    let src = |n: &str| -> deco_model::Result<(Vec<usize>, Vec<f32>)> { Ok(ckpt.tensor(n)?) };
    let mut domains = Vec::new();
    for rel in ["wiki_train.txt", "shakespeare/train.txt", "gsm_train.jsonl"] {
        let path = crate::runtime::data_file(&args.model.model, rel, "--calib FILE")?;
        let text: String = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?.chars().take(args.calib_chars).collect();
        let ids = tok.encode_with(&text, false, true)?;
        if ids.len() < 4 * args.seqlen {
            bail!("{}: only {} tokens, need at least {}", path.display(), ids.len(), 4 * args.seqlen);
        }
        domains.push(ids);
    }
    // Reference loss per domain: the unpruned model's next-token CE on two windows.
    let dense = StudentModel::from_source(&cfg, &src, &Device::flex())?;
    let seqlen = args.seqlen;
    let mut refs = Vec::new();
    for d in &domains {
        let ids = vec![d[..seqlen].to_vec(), d[d.len() / 2..d.len() / 2 + seqlen].to_vec()];
        let logits = dense.forward(&cfg, &ids, false)?;
        let (labels, w) = deco_compress::distill::next_token_labels(&ids);
        let l = cross_entropy_weighted(logits, &labels, &w)?.try_into_vec_as::<f32>().map_err(|e| anyhow::anyhow!("{e:?}"))?;
        refs.push(f64::from(l[0]));
    }
    drop(dense);
    let sc = ShearConfig {
        target,
        steps: args.steps,
        batch_size: args.batch_size,
        seqlen,
        lr: args.lr,
        mask_lr: 0.3,
        lambda_lr: 1.0,
        init_log_alpha: 3.0,
        domain_eta: 0.1,
        domain_update_every: 10,
        seed: args.seed,
    };
    let model = StudentModel::from_source(&cfg, &src, &Device::flex().autodiff())?;
    let pb = ProgressBar::new(args.steps as u64);
    if let Ok(style) = ProgressStyle::with_template("sheared [{bar:30}] {pos}/{len} steps, {elapsed} (eta {eta}) {msg}") {
        pb.set_style(style.progress_chars("=> "));
    }
    let t0 = Instant::now();
    let res = shear(model, &cfg, &domains, &refs, &sc, &mut |r| {
        pb.set_position(r.step as u64);
        pb.set_message(format!("lm {:.3} size {:.3} (target {:.3})", r.lm_loss, r.expected_size, target.size(&cfg)));
    })?;
    pb.finish();
    let pcfg = res.config(&cfg, &target)?;
    let tensors = res.tensors(&cfg, &target)?;
    let dtype = match args.dtype {
        DtypeArg::F32 => ExportDtype::F32,
        DtypeArg::Bf16 => ExportDtype::Bf16,
    };
    write_dense_dir(&ckpt, &tok, &pcfg, &|n| tensors.get(n).cloned().ok_or_else(|| deco_model::Error::InvalidInput(format!("missing tensor {n}"))), &args.out, dtype)?;
    eprintln!(
        "[prune] method=sheared steps={} tokens={} minutes={:.1} layers={} heads={} intermediate={} hidden={} out={}",
        args.steps,
        args.steps * args.batch_size * seqlen,
        t0.elapsed().as_secs_f64() / 60.0,
        pcfg.num_hidden_layers,
        pcfg.num_attention_heads,
        pcfg.intermediate_size,
        pcfg.hidden_size,
        args.out.display()
    );
    Ok(())
}
