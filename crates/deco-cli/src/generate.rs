//! `deco generate`: prompt in, streamed text out.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use deco_decoding::{ProcessContext, Sampler, SamplingParams};
use deco_formats::chat_template::{ChatMessage, ChatTemplate};
use deco_model::{DenseKvCache, LogitsWanted, SeqInput};

use crate::ModelArgs;

/// Arguments of `deco generate`.
#[derive(Debug, Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt text.
    #[arg(long, conflicts_with = "prompt_file")]
    prompt: Option<String>,
    /// Read the prompt from a UTF-8 file.
    #[arg(long)]
    prompt_file: Option<PathBuf>,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    /// System message for `--chat` (default: the template's own default, if any).
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// Maximum number of tokens to generate.
    #[arg(long, default_value_t = 256)]
    max_new_tokens: usize,
    /// Sampling temperature; 0 (the default) is greedy decoding, as Hugging Face's
    /// `do_sample=False`. A positive value turns sampling on.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Keep the `top_k` most likely tokens (0 = off). Only used when sampling.
    #[arg(long)]
    top_k: Option<i64>,
    /// Nucleus sampling: keep the smallest set of tokens whose probability reaches `top_p`.
    #[arg(long)]
    top_p: Option<f32>,
    /// Seed of the sampler's random generator (same seed, same tokens).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Keep generating past end-of-sequence tokens (benchmarks).
    #[arg(long)]
    ignore_eos: bool,
}

/// Runs the command.
pub fn run(args: &GenerateArgs) -> Result<()> {
    let prompt = match (&args.prompt, &args.prompt_file) {
        (Some(p), None) => p.clone(),
        (None, Some(f)) => {
            let bytes = std::fs::read(f).with_context(|| format!("reading prompt file {}", f.display()))?;
            String::from_utf8(bytes).map_err(|e| anyhow::anyhow!("{}: prompt file is not valid UTF-8 ({e})", f.display()))?
        }
        _ => bail!("give the prompt with --prompt TEXT or --prompt-file FILE"),
    };
    if args.max_new_tokens == 0 {
        bail!("--max-new-tokens must be at least 1");
    }
    let params = SamplingParams {
        do_sample: Some(args.temperature > 0.0),
        temperature: Some(args.temperature),
        top_k: args.top_k,
        top_p: args.top_p,
        seed: Some(args.seed),
        max_new_tokens: Some(args.max_new_tokens),
        ..Default::default()
    };
    params.validate()?;
    let mut sampler = Sampler::new(&params)?;

    let (model, tok) = crate::runtime::load(&args.model)?;
    let text = if args.chat {
        let source = tok.chat_template().context("the model has no chat template; drop --chat")?;
        let template = ChatTemplate::new(source)?;
        let mut messages = Vec::new();
        if let Some(s) = &args.system {
            messages.push(ChatMessage::new("system", s.clone()));
        }
        messages.push(ChatMessage::new("user", prompt));
        let bos = tok.bos_token().unwrap_or_default();
        let eos = tok.eos_token().unwrap_or_default();
        template.render(&messages, true, &bos, &eos)?
    } else {
        prompt
    };
    // Chat templates contain special-token text; plain prompts are parsed the same way, as
    // llama.cpp's `llama-cli` does.
    let prompt_ids = tok.encode(&text, true)?;
    if prompt_ids.is_empty() {
        bail!("the prompt is empty after tokenization");
    }
    if prompt_ids.len() + 1 > model.max_context() {
        bail!("the prompt has {} tokens; the model's context is {}", prompt_ids.len(), model.max_context());
    }
    let budget = args.max_new_tokens.min(model.max_context() - prompt_ids.len());
    let eos: Vec<u32> = tok.eos_token_ids().to_vec();

    let mut cache = DenseKvCache::new(model.config.num_hidden_layers);
    let mut stream = tok.stream_decoder(true);
    let mut out = std::io::stdout().lock();
    let mut output: Vec<u32> = Vec::new();

    let t0 = Instant::now();
    let mut logits = model
        .forward(&[SeqInput { seq: 0, tokens: &prompt_ids }], &mut cache, LogitsWanted::Last)?
        .logits_rows()?
        .remove(0);
    let prefill_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    for step in 0..budget {
        let ctx = ProcessContext::new(&prompt_ids, &output, &eos);
        let token = sampler.sample(&ctx, &mut logits)?.token;
        output.push(token);
        if !args.ignore_eos && eos.contains(&token) {
            break;
        }
        let piece = stream.step(token)?;
        if !piece.is_empty() {
            out.write_all(piece.as_bytes())?;
            out.flush()?;
        }
        if step + 1 == budget {
            break;
        }
        logits = model
            .forward(&[SeqInput { seq: 0, tokens: &[token] }], &mut cache, LogitsWanted::Last)?
            .logits_rows()?
            .remove(0);
    }
    let decode_s = t1.elapsed().as_secs_f64();
    let rest = stream.flush()?;
    writeln!(out, "{rest}")?;
    drop(out);
    // Decode speed counts the forward passes after the prefill: one per generated token but the last.
    let decode_steps = output.len().saturating_sub(1);
    eprintln!(
        "[stats] prompt_tokens={} prompt_tok_s={:.2} decode_tokens={} decode_tok_s={:.2}",
        prompt_ids.len(),
        prompt_ids.len() as f64 / prefill_s,
        output.len(),
        if decode_steps > 0 { decode_steps as f64 / decode_s } else { 0.0 },
    );
    Ok(())
}
