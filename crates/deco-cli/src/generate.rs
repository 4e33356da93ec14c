//! `deco generate`: prompt in, streamed text out, with every decoding strategy of
//! `deco-generate` (greedy, sampling, beam search, contrastive decoding and search, speculative
//! decoding, early exit).

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use deco_decoding::{SamplingParams, StopStringMatcher};
use deco_formats::chat_template::{ChatMessage, ChatTemplate};
use deco_formats::checkpoint::Checkpoint;

use deco_formats::tokenizer::Tokenizer;
use deco_generate::{
    BeamSearchParams, ContrastiveDecodingParams, EarlyStopping, LlamaSession, ModelDrafter, PromptLookupDrafter,
};
use deco_serve::{EngineConfig, EngineEvent, GenerateRequest, Strategy as EngineStrategy};
use deco_model::early_exit::{EarlyExitConfig, EarlyExitStats};
use deco_model::{DenseKvCache, Llama, LogitsWanted, SeqInput};

use crate::ModelArgs;

/// Decoding strategy of `deco generate`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Strategy {
    /// Argmax of the processed logits.
    Greedy,
    /// Sampling from the processed distribution.
    Sample,
    /// Beam search (`--num-beams`, `--length-penalty`, `--early-stopping`, `-n`).
    Beam,
    /// Contrastive decoding, Li et al. 2023 (`--amateur-model` or `--amateur-layers`).
    Contrastive,
    /// Contrastive search, Su et al. 2022 (`--penalty-alpha`, `--top-k`).
    ContrastiveSearch,
    /// Speculative decoding (`--draft-model`, or `--draft-layers`, or `--prompt-lookup`).
    Speculative,
    /// Entropy-threshold early exit (`--exit-entropy`).
    EarlyExit,
}

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
    /// Decoding strategy (default: greedy when --temperature is 0, else sample).
    #[arg(long, value_enum)]
    strategy: Option<Strategy>,
    /// Sampling temperature; 0 (the default) is greedy decoding, as Hugging Face's
    /// `do_sample=False`. A positive value turns sampling on.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Keep the `top_k` most likely tokens (0 = off). Only used when sampling; for
    /// contrastive search, the number of candidates (default 4).
    #[arg(long)]
    top_k: Option<i64>,
    /// Nucleus sampling: keep the smallest set of tokens whose probability reaches `top_p`.
    #[arg(long)]
    top_p: Option<f32>,
    /// Min-p: keep tokens with probability >= min_p * max probability.
    #[arg(long)]
    min_p: Option<f32>,
    /// Locally typical sampling mass.
    #[arg(long)]
    typical_p: Option<f32>,
    /// Repetition penalty over prompt + output (Hugging Face; 1 = off).
    #[arg(long)]
    repetition_penalty: Option<f32>,
    /// OpenAI frequency penalty (output tokens).
    #[arg(long)]
    frequency_penalty: Option<f32>,
    /// OpenAI presence penalty (output tokens).
    #[arg(long)]
    presence_penalty: Option<f32>,
    /// Forbid repeating any n-gram of this size.
    #[arg(long)]
    no_repeat_ngram_size: Option<usize>,
    /// EOS is blocked until this many tokens were generated.
    #[arg(long)]
    min_new_tokens: Option<usize>,
    /// Stop string (repeatable); excluded from the output.
    #[arg(long)]
    stop: Vec<String>,
    /// Print the chosen token's log-probability and the top N alternatives per token (JSON
    /// lines on stderr).
    #[arg(long)]
    logprobs: Option<usize>,
    /// Number of sequences: independent samples (seeds seed, seed+1, ...) or, for beam
    /// search, the number of returned beams.
    #[arg(short = 'n', long = "num-return-sequences", default_value_t = 1)]
    n: usize,
    /// Beam search: number of beams.
    #[arg(long, default_value_t = 4)]
    num_beams: usize,
    /// Beam search: exponent of the length normalisation (score = sum logprobs / len^alpha).
    #[arg(long, default_value_t = 1.0)]
    length_penalty: f32,
    /// Beam search: true, false or never (Hugging Face `early_stopping`).
    #[arg(long, default_value = "false")]
    early_stopping: String,
    /// Contrastive search: degeneration penalty weight.
    #[arg(long, default_value_t = 0.6)]
    penalty_alpha: f32,
    /// Speculative decoding: draft model (GGUF or HF dir) sharing the tokenizer.
    #[arg(long)]
    draft_model: Option<PathBuf>,
    /// Speculative decoding without --draft-model: draft with the target's first K layers.
    #[arg(long, default_value_t = 8)]
    draft_layers: usize,
    /// Speculative decoding: draft by prompt lookup (n-gram match in the context) instead.
    #[arg(long)]
    prompt_lookup: bool,
    /// Speculative decoding: tokens drafted per round (gamma).
    #[arg(long, default_value_t = 5)]
    num_speculative_tokens: usize,
    /// Contrastive decoding: amateur model sharing the tokenizer.
    #[arg(long)]
    amateur_model: Option<PathBuf>,
    /// Contrastive decoding without --amateur-model: the expert's first K layers.
    #[arg(long, default_value_t = 8)]
    amateur_layers: usize,
    /// Contrastive decoding: plausibility cutoff alpha (keep p >= alpha * max p).
    #[arg(long, default_value_t = 0.1)]
    contrastive_alpha: f32,
    /// Contrastive decoding: temperature of the amateur.
    #[arg(long, default_value_t = 1.0)]
    amateur_temperature: f32,
    /// Early exit: exit when the intermediate entropy (nats) is below this.
    #[arg(long, default_value_t = 1.0)]
    exit_entropy: f32,
    /// Early exit: first layer count tested.
    #[arg(long, default_value_t = 8)]
    exit_min_layers: usize,
    /// Early exit: test every K layers.
    #[arg(long, default_value_t = 4)]
    exit_check_every: usize,
    /// Seed of the sampler's random generator (same seed, same tokens).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Keep generating past end-of-sequence tokens (benchmarks).
    #[arg(long)]
    ignore_eos: bool,
    /// AutoDeco heads directory (`deco autodeco train --out`): each token is sampled with
    /// temperature = T × --temperature and top_p = clamp(P × --top-p, 0, 1), T and P predicted by
    /// the heads. Implies --strategy sample (user temperature 1) unless --strategy greedy.
    #[arg(long)]
    autodeco: Option<PathBuf>,
    /// With --autodeco: write each generated token's (token, T, P, final temperature, final
    /// top_p) to this CSV file.
    #[arg(long, requires = "autodeco")]
    trace_decoding: Option<PathBuf>,
    /// With --trace-decoding: also plot T and P per token to this SVG file.
    #[arg(long, requires = "trace_decoding")]
    trace_plot: Option<PathBuf>,
}

/// One choice returned by [`run_on_engine`].
struct EngineChoice {
    text: String,
    /// Tokens generated (an end token included).
    tokens: usize,
    cumulative_logprob: f64,
}

/// Runs one request on the serving engine (`deco_serve::engine`, the decode loop `deco serve`
/// runs) with a KV pool sized for `width` parallel sequences of the request; returns its choices
/// in index order and the number of forward passes the engine ran.
fn run_on_engine(model: &Llama, tok: &Tokenizer, req: GenerateRequest, width: usize) -> Result<(Vec<EngineChoice>, u64)> {
    let block_size = EngineConfig::default().block_size;
    let per_seq = (req.prompt.len() + req.params.max_new_tokens.unwrap_or(0)).div_ceil(block_size) + 1;
    let config = EngineConfig { num_blocks: per_seq * (width + 1) + 1, max_n: req.n.max(1), ..EngineConfig::default() };
    let n = req.n;
    let (engine, join) = deco_serve::spawn_engine(model.clone(), std::sync::Arc::new(tok.clone()), config)?;
    let (_, mut rx) = engine.submit(req)?;
    let mut choices: Vec<Option<EngineChoice>> = (0..n).map(|_| None).collect();
    let mut texts = vec![String::new(); n];
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            EngineEvent::Delta { index, text, .. } => texts[index].push_str(&text),
            EngineEvent::Finished { index, completion_tokens, cumulative_logprob, .. } => {
                let text = std::mem::take(&mut texts[index]);
                choices[index] = Some(EngineChoice { text, tokens: completion_tokens, cumulative_logprob: cumulative_logprob.unwrap_or(f64::NAN) });
                if choices.iter().all(Option::is_some) {
                    break;
                }
            }
            EngineEvent::Failed(e) => bail!("generation failed: {e}"),
        }
    }
    let steps = engine.metrics.steps.load(std::sync::atomic::Ordering::Relaxed);
    drop(rx);
    drop(engine);
    let _ = join.join();
    let choices: Option<Vec<EngineChoice>> = choices.into_iter().collect();
    Ok((choices.context("the engine stopped before every choice finished")?, steps))
}

fn load_second(path: &std::path::Path, model: &Llama) -> Result<Llama> {
    let ckpt = Checkpoint::open(path)?;
    let m = Llama::load(&ckpt, model.device(), None).with_context(|| format!("loading weights from {}", path.display()))?;
    if m.config.vocab_size != model.config.vocab_size {
        bail!("{} has vocabulary {}, the model has {}", path.display(), m.config.vocab_size, model.config.vocab_size);
    }
    Ok(m)
}

/// Streams tokens to stdout through the UTF-8 stream decoder and the stop-string matcher.
struct Printer<'t> {
    stream: deco_formats::tokenizer::StreamDecoder<'t>,
    stops: StopStringMatcher,
    eos: Vec<u32>,
    ignore_eos: bool,
    out: std::io::StdoutLock<'static>,
    first_token_at: Option<Instant>,
    error: Option<anyhow::Error>,
}

impl Printer<'_> {
    /// Prints the tokens; true when a stop string matched.
    fn push(&mut self, tokens: &[u32]) -> bool {
        if self.first_token_at.is_none() {
            self.first_token_at = Some(Instant::now());
        }
        let r = (|| -> Result<bool> {
            for &t in tokens {
                if !self.ignore_eos && self.eos.contains(&t) {
                    return Ok(false);
                }
                let piece = self.stream.step(t)?;
                let step = self.stops.push(&piece);
                self.out.write_all(step.text.as_bytes())?;
                self.out.flush()?;
                if step.stop.is_some() {
                    return Ok(true);
                }
            }
            Ok(false)
        })();
        match r {
            Ok(stop) => stop,
            Err(e) => {
                self.error = Some(e);
                true
            }
        }
    }

    fn finish(mut self) -> Result<()> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        if !self.stops.is_stopped() {
            let rest = self.stream.flush()?;
            let step = self.stops.push(&rest);
            self.out.write_all(step.text.as_bytes())?;
            let held = self.stops.flush();
            self.out.write_all(held.as_bytes())?;
        }
        writeln!(self.out)?;
        Ok(())
    }
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
    if args.n == 0 {
        bail!("-n must be at least 1");
    }
    let strategy = args
        .strategy
        .unwrap_or(if args.temperature > 0.0 || args.autodeco.is_some() { Strategy::Sample } else { Strategy::Greedy });
    if args.autodeco.is_some() && !matches!(strategy, Strategy::Greedy | Strategy::Sample) {
        bail!("--autodeco works with --strategy sample or greedy, not {strategy:?}");
    }
    let temperature = match strategy {
        Strategy::Greedy => 0.0,
        Strategy::Sample if args.temperature == 0.0 => 1.0,
        _ => args.temperature,
    };
    let params = SamplingParams {
        do_sample: Some(temperature > 0.0),
        temperature: Some(temperature),
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        typical_p: args.typical_p,
        repetition_penalty: args.repetition_penalty,
        frequency_penalty: args.frequency_penalty,
        presence_penalty: args.presence_penalty,
        no_repeat_ngram_size: args.no_repeat_ngram_size,
        min_new_tokens: args.min_new_tokens,
        stop: if args.stop.is_empty() { None } else { Some(args.stop.clone()) },
        seed: Some(args.seed),
        max_new_tokens: Some(args.max_new_tokens),
        logprobs: args.logprobs,
        ..Default::default()
    };
    params.validate()?;

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
    let model_eos: Vec<u32> = tok.eos_token_ids().to_vec();
    let eos: Vec<u32> = if args.ignore_eos { Vec::new() } else { model_eos.clone() };

    let new_printer = || -> Result<Printer<'_>> {
        Ok(Printer {
            stream: tok.stream_decoder(true),
            stops: StopStringMatcher::from_params(&params)?,
            eos: model_eos.clone(),
            ignore_eos: args.ignore_eos,
            out: std::io::stdout().lock(),
            first_token_at: None,
            error: None,
        })
    };

    let t0 = Instant::now();
    let mut extra = String::new();
    let (num_tokens, first_at) = match strategy {
        Strategy::Beam => {
            if args.ignore_eos {
                bail!("--ignore-eos is not supported with beam search");
            }
            if !args.stop.is_empty() || args.logprobs.is_some() {
                bail!("--stop and --logprobs are not supported with beam search");
            }
            let beam = BeamSearchParams {
                num_beams: args.num_beams,
                length_penalty: args.length_penalty,
                early_stopping: args.early_stopping.parse::<EarlyStopping>()?,
                num_return_sequences: args.n,
            };
            let req = GenerateRequest { prompt: prompt_ids.clone(), params: params.clone(), n: args.n, constraint: None, strategy: Some(EngineStrategy::Beam(beam)) };
            let (choices, steps) = run_on_engine(&model, &tok, req, args.num_beams)?;
            let mut total = 0;
            let mut out = std::io::stdout().lock();
            for (i, c) in choices.iter().enumerate() {
                if choices.len() > 1 {
                    let score = c.cumulative_logprob / (c.tokens as f64).powf(f64::from(args.length_penalty));
                    writeln!(out, "--- beam {i} score={score:.4} sum_logprobs={:.4}", c.cumulative_logprob)?;
                }
                writeln!(out, "{}", c.text)?;
                total = total.max(c.tokens);
            }
            extra = format!(" forward_calls={steps}");
            if let Some(best) = choices.first() {
                let score = best.cumulative_logprob / (best.tokens as f64).powf(f64::from(args.length_penalty));
                extra.push_str(&format!(" best_sum_logprobs={:.6} best_score={score:.6} best_tokens={}", best.cumulative_logprob, best.tokens));
            }
            (total, None)
        }
        Strategy::Greedy | Strategy::Sample if args.autodeco.is_some() => {
            let dir = args.autodeco.as_ref().context("--autodeco")?;
            let heads = deco_autodeco::HostHeads::load(dir)?;
            if heads.config().hidden_size != model.config.hidden_size {
                bail!("{}: heads for hidden size {}, the model has {}", dir.display(), heads.config().hidden_size, model.config.hidden_size);
            }
            let mut total = 0;
            let mut first = None;
            let mut trace_all = Vec::new();
            let mut session = LlamaSession::new(&model);
            for i in 0..args.n {
                let p_i = SamplingParams { seed: Some(args.seed.wrapping_add(i as u64)), ..params.clone() };
                if args.n > 1 {
                    println!("--- sample {i}");
                }
                let mut p = new_printer()?;
                let req = [deco_autodeco::decode::SeqRequest { prompt: prompt_ids.clone(), params: p_i }];
                let mut out = deco_autodeco::decode::generate_batch(
                    &mut session,
                    Some(&heads),
                    &req,
                    &eos,
                    1,
                    deco_decoding::SamplerOrder::HuggingFace,
                    &mut |_, t: &[u32]| p.push(t),
                )?;
                first = first.or(p.first_token_at);
                p.finish()?;
                let r = out.remove(0);
                if args.logprobs.is_some() {
                    for s in &r.generation.samples {
                        eprintln!("{}", serde_json::to_string(s)?);
                    }
                }
                total += r.generation.tokens.len();
                let mean = |f: &dyn Fn(&deco_autodeco::decode::TraceRow) -> f32| {
                    r.trace.iter().map(|x| f64::from(f(x))).sum::<f64>() / r.trace.len().max(1) as f64
                };
                extra = format!(" autodeco_mean_T={:.4} autodeco_mean_P={:.4}", mean(&|x| x.temperature), mean(&|x| x.top_p));
                trace_all.extend(r.trace);
            }
            if let Some(path) = &args.trace_decoding {
                let piece = |t: u32| tok.decode(&[t], false).unwrap_or_default();
                deco_autodeco::decode::write_trace_csv(path, &trace_all, &piece)?;
                if let Some(svg) = &args.trace_plot {
                    let t: Vec<(f64, f64)> = trace_all.iter().enumerate().map(|(i, r)| (i as f64, f64::from(r.temperature))).collect();
                    let pp: Vec<(f64, f64)> = trace_all.iter().enumerate().map(|(i, r)| (i as f64, f64::from(r.top_p))).collect();
                    deco_autodeco::plot::line_chart_svg(svg, "AutoDeco per-token parameters", "generated token", "value", &[("temperature T", t), ("top-p P", pp)])?;
                }
            }
            (total, first)
        }
        Strategy::Greedy | Strategy::Sample => {
            let mut total = 0;
            let mut first = None;
            for i in 0..args.n {
                let p_i = SamplingParams { seed: Some(args.seed.wrapping_add(i as u64)), ..params.clone() };
                if args.n > 1 {
                    println!("--- sample {i}");
                }
                let mut p = new_printer()?;
                let g = deco_generate::generate(&mut LlamaSession::new(&model), &prompt_ids, &p_i, &eos, &mut |t: &[u32]| p.push(t))?;
                first = first.or(p.first_token_at);
                p.finish()?;
                if args.logprobs.is_some() {
                    for s in &g.samples {
                        eprintln!("{}", serde_json::to_string(s)?);
                    }
                }
                total += g.tokens.len();
            }
            (total, first)
        }
        Strategy::ContrastiveSearch => {
            let p_cs = SamplingParams { top_k: Some(args.top_k.unwrap_or(4)), ..params.clone() };
            let mut p = new_printer()?;
            let g = deco_generate::contrastive_search(&mut LlamaSession::new(&model), &prompt_ids, &p_cs, args.penalty_alpha, &eos, &mut |t: &[u32]| p.push(t))?;
            let first = p.first_token_at;
            p.finish()?;
            (g.tokens.len(), first)
        }
        Strategy::Contrastive => {
            let cd = ContrastiveDecodingParams { alpha: args.contrastive_alpha, amateur_temperature: args.amateur_temperature };
            let second;
            let mut amateur = match &args.amateur_model {
                Some(path) => {
                    second = load_second(path, &model)?;
                    LlamaSession::new(&second)
                }
                None => LlamaSession::truncated(&model, args.amateur_layers)?,
            };
            let mut p = new_printer()?;
            let g = deco_generate::contrastive_decoding(&mut LlamaSession::new(&model), &mut amateur, &prompt_ids, &params, &cd, &eos, &mut |t: &[u32]| p.push(t))?;
            let first = p.first_token_at;
            p.finish()?;
            (g.tokens.len(), first)
        }
        Strategy::Speculative => {
            let mut p = new_printer()?;
            let mut target = LlamaSession::new(&model);
            let gamma = args.num_speculative_tokens;
            let second;
            let out = if args.prompt_lookup {
                deco_generate::speculative_generate(&mut target, &mut PromptLookupDrafter::default(), &prompt_ids, &params, gamma, &eos, &mut |t: &[u32]| p.push(t))?
            } else {
                let draft = match &args.draft_model {
                    Some(path) => {
                        second = load_second(path, &model)?;
                        LlamaSession::new(&second)
                    }
                    None => LlamaSession::truncated(&model, args.draft_layers)?,
                };
                let mut drafter = ModelDrafter::new(draft, args.seed ^ 0x5eed_d4af)?;
                deco_generate::speculative_generate(&mut target, &mut drafter, &prompt_ids, &params, gamma, &eos, &mut |t: &[u32]| p.push(t))?
            };
            let first = p.first_token_at;
            p.finish()?;
            let s = out.stats;
            extra = format!(
                " drafted={} accepted={} acceptance_rate={:.3} target_forwards={}",
                s.drafted,
                s.accepted,
                s.acceptance_rate(),
                s.target_forward_calls
            );
            (out.generation.tokens.len(), first)
        }
        Strategy::EarlyExit => {
            let cfg = EarlyExitConfig { entropy_threshold: args.exit_entropy, min_layers: args.exit_min_layers, check_every: args.exit_check_every };
            let mut sampler = deco_decoding::Sampler::new(&params)?;
            let stopping = deco_decoding::StoppingCriteria::from_params(&params, &eos)?;
            let mut cache = DenseKvCache::new(model.num_layers());
            let mut p = new_printer()?;
            let mut logits = model.forward(&[SeqInput { seq: 0, tokens: &prompt_ids }], &mut cache, LogitsWanted::Last)?.logits_rows()?.remove(0);
            let mut output: Vec<u32> = Vec::new();
            let mut stats = EarlyExitStats::default();
            let budget = args.max_new_tokens.min(model.max_context() - prompt_ids.len());
            loop {
                let ctx = deco_decoding::ProcessContext::new(&prompt_ids, &output, &eos);
                let token = sampler.sample(&ctx, &mut logits)?.token;
                output.push(token);
                let user_stop = p.push(&[token]);
                if stopping.check(token, output.len()).is_some() || user_stop || output.len() >= budget {
                    break;
                }
                let step = model.forward_early_exit(0, token, &mut cache, &cfg)?;
                stats.record(&step, model.num_layers());
                logits = step.logits;
            }
            let first = p.first_token_at;
            p.finish()?;
            extra = format!(" layers_skipped={:.3}", stats.skipped_fraction());
            (output.len(), first)
        }
    };
    let total_s = t0.elapsed().as_secs_f64();
    // Prefill time = time to the first streamed token (for beam search, which streams nothing
    // until the end, the whole run: both rates then use the total time).
    let prefill_s = first_at.map_or(total_s, |t| t.duration_since(t0).as_secs_f64());
    let decode_s = first_at.map_or(total_s, |t| t.elapsed().as_secs_f64());
    let decode_steps = if first_at.is_some() { num_tokens.saturating_sub(1) } else { num_tokens };
    if !extra.is_empty() {
        eprintln!("[strategy] {strategy:?}{extra}");
    }
    eprintln!(
        "[stats] prompt_tokens={} prompt_tok_s={:.2} decode_tokens={} decode_tok_s={:.2}",
        prompt_ids.len(),
        prompt_ids.len() as f64 / prefill_s,
        num_tokens,
        if decode_steps > 0 { decode_steps as f64 / decode_s } else { 0.0 },
    );
    Ok(())
}

