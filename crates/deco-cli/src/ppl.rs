//! `deco eval ppl`: perplexity over non-overlapping windows.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use deco_model::{DenseKvCache, KvCache, LogitsWanted, SeqInput};
use deco_serve::{CacheShape, KvCacheDtype, PagedKvCache};

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
    /// Element type of the KV cache the window's attention reads: `f32` (default) or `f16`
    /// (the serving engine's paged cache with f16 blocks, as `deco generate --kv-cache-dtype
    /// f16`): measures what the rounding of the keys and values costs.
    #[arg(long, default_value = "f32")]
    kv_cache_dtype: KvCacheDtype,
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
        let cfg = &model.config;
        let mut cache: Box<dyn KvCache> = match args.kv_cache_dtype {
            KvCacheDtype::F32 => Box::new(DenseKvCache::new(cfg.num_hidden_layers)),
            dtype => {
                let block_size = 16;
                let shape = CacheShape {
                    n_layers: cfg.num_hidden_layers,
                    kv_heads: cfg.num_key_value_heads,
                    head_dim: cfg.head_dim,
                    block_size,
                    num_blocks: args.seqlen.div_ceil(block_size) + 1,
                };
                Box::new(PagedKvCache::with_dtype(shape, dtype, model.device())?)
            }
        };
        let rows = model.forward(&[SeqInput { seq: 0, tokens: window, tree: None }], cache.as_mut(), LogitsWanted::All)?.logits_rows()?;
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
