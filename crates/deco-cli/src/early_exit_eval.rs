//! `deco eval early-exit`: teacher-forced quality of entropy-threshold early exit against the
//! full model on a text (perplexity of both, top-1 agreement, fraction of layers skipped).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use deco_model::early_exit::{EarlyExitConfig, EarlyExitScore, score_early_exit};

use crate::ModelArgs;

/// Arguments of `deco eval early-exit`.
#[derive(Debug, Args)]
pub struct EarlyExitEvalArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// UTF-8 text file to score (no BOS; non-overlapping windows as `deco eval ppl`).
    #[arg(long)]
    text: PathBuf,
    /// Tokens per window.
    #[arg(long, default_value_t = 256)]
    seqlen: usize,
    /// Score at most this many windows.
    #[arg(long, default_value_t = 1)]
    max_windows: usize,
    /// Use only the first N characters of the file.
    #[arg(long)]
    max_chars: Option<usize>,
    /// Exit when the intermediate entropy (nats) is below this.
    #[arg(long, default_value_t = 1.0)]
    exit_entropy: f32,
    /// First layer count tested.
    #[arg(long, default_value_t = 8)]
    exit_min_layers: usize,
    /// Test every K layers.
    #[arg(long, default_value_t = 4)]
    exit_check_every: usize,
}

/// Runs the command: per-window lines on stderr, one JSON summary line on stdout.
pub fn run(args: &EarlyExitEvalArgs) -> Result<()> {
    if args.seqlen < 2 {
        bail!("--seqlen must be at least 2, got {}", args.seqlen);
    }
    let bytes = std::fs::read(&args.text).with_context(|| format!("reading {}", args.text.display()))?;
    let text = String::from_utf8(bytes).map_err(|e| anyhow::anyhow!("{}: not valid UTF-8 ({e})", args.text.display()))?;
    let text: String = match args.max_chars {
        Some(n) => text.chars().take(n).collect(),
        None => text,
    };
    let (model, tok) = crate::runtime::load(&args.model)?;
    if args.seqlen > model.max_context() {
        bail!("--seqlen {} exceeds the model context {}", args.seqlen, model.max_context());
    }
    let ids = tok.encode_with(&text, false, true)?;
    let windows = crate::runtime::window_count(ids.len(), args.seqlen, Some(args.max_windows), &args.text)?;
    let cfg = EarlyExitConfig { entropy_threshold: args.exit_entropy, min_layers: args.exit_min_layers, check_every: args.exit_check_every };
    let mut total = EarlyExitScore::default();
    let t0 = Instant::now();
    for w in 0..windows {
        let s = score_early_exit(&model, &ids[w * args.seqlen..(w + 1) * args.seqlen], &cfg)?;
        eprintln!(
            "window {}/{windows}: full ppl {:.4}, early-exit ppl {:.4}, top-1 agreement {:.4}, layers skipped {:.4}",
            w + 1,
            s.full_ppl(),
            s.exit_ppl(),
            s.top1_agreement(),
            s.stats.skipped_fraction()
        );
        total.merge(&s);
    }
    let summary = serde_json::json!({
        "windows": windows,
        "seqlen": args.seqlen,
        "predictions": total.predictions,
        "exit_entropy": args.exit_entropy,
        "exit_min_layers": args.exit_min_layers,
        "exit_check_every": args.exit_check_every,
        "num_layers": model.num_layers(),
        "full_ppl": total.full_ppl(),
        "exit_ppl": total.exit_ppl(),
        "top1_agreement": total.top1_agreement(),
        "layers_skipped": total.stats.skipped_fraction(),
        "seconds": t0.elapsed().as_secs_f64(),
    });
    println!("{summary}");
    Ok(())
}
