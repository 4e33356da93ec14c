//! `deco eval ppl`: perplexity over non-overlapping windows.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use deco_model::{DenseKvCache, LogitsWanted, SeqInput};

use crate::ModelArgs;

/// Arguments of `deco eval ppl`.
#[derive(Debug, Args)]
pub struct PplArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// UTF-8 text file to score.
    #[arg(long)]
    text: PathBuf,
    /// Tokens per window.
    #[arg(long, default_value_t = 256)]
    seqlen: usize,
    /// Score at most this many windows.
    #[arg(long)]
    max_windows: Option<usize>,
    /// Use only the first N characters of the file (the golden protocol uses 20000).
    #[arg(long)]
    max_chars: Option<usize>,
}

/// Negative log-likelihood of `target` under `softmax(logits)`, in f64.
pub fn nll(logits: &[f32], target: u32) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    sum.ln() + max - logits[target as usize] as f64
}

/// Runs the command.
pub fn run(args: &PplArgs) -> Result<()> {
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
    // No BOS, special-token text parsed as llama.cpp's tokenizer does by default.
    let ids = tok.encode_with(&text, false, true)?;
    let windows = crate::runtime::window_count(ids.len(), args.seqlen, args.max_windows, &args.text)?;
    if args.seqlen > model.max_context() {
        bail!("--seqlen {} exceeds the model context {}", args.seqlen, model.max_context());
    }
    let mut total = 0.0f64;
    let mut count = 0usize;
    for w in 0..windows {
        let window = &ids[w * args.seqlen..(w + 1) * args.seqlen];
        let mut cache = DenseKvCache::new(model.config.num_hidden_layers);
        let rows = model.forward(&[SeqInput { seq: 0, tokens: window, tree: None }], &mut cache, LogitsWanted::All)?.logits_rows()?;
        let mut wn = 0.0;
        for (row, &target) in rows.iter().zip(&window[1..]) {
            wn += nll(row, target);
        }
        total += wn;
        count += args.seqlen - 1;
        eprintln!("window {}/{windows}: ppl {:.4}", w + 1, (wn / (args.seqlen - 1) as f64).exp());
    }
    println!("tokens_scored={count} windows={windows} seqlen={}", args.seqlen);
    println!("ppl={:.4}", (total / count as f64).exp());
    Ok(())
}
