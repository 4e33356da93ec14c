//! `deco generate`: prompt in, streamed text out, with every decoding strategy of
//! `deco-generate` (greedy, sampling, beam search, contrastive decoding and search, speculative
//! decoding, early exit, AutoDeco). Every strategy runs on the serving engine
//! (`deco_serve::engine`), the decode loop `deco serve` runs: the same settings give the same
//! tokens in both.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use deco_decoding::SamplingParams;
use deco_formats::chat_template::{ChatMessage, ChatTemplate};
use deco_formats::checkpoint::Checkpoint;

use deco_formats::tokenizer::Tokenizer;
use deco_generate::{BeamSearchParams, ContrastiveDecodingParams, DraftSource, EarlyStopping, PromptLookupDrafter};
use deco_serve::{DraftModel, EngineConfig, EngineEvent, EngineOptions, GenerateRequest, KvCacheDtype, Strategy as EngineStrategy, TokenInfo};
use deco_model::Llama;
use deco_model::early_exit::EarlyExitConfig;

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
    /// Medusa heads (`--medusa DIR`, `--medusa-choices`), Cai et al. 2024.
    Medusa,
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
    /// Speculative decoding: tokens drafted per round (gamma; the initial gamma with the
    /// heuristic schedule).
    #[arg(long, default_value_t = 5)]
    num_speculative_tokens: usize,
    /// Speculative decoding: `constant` gamma, or `heuristic` (Hugging Face's
    /// `num_assistant_tokens_schedule`: +2 after a fully accepted round, -1 after a rejection).
    #[arg(long, default_value = "constant")]
    num_assistant_tokens_schedule: String,
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
    /// Element type of the KV cache (vLLM's option): `f32` (default, the keys and values as
    /// computed) or `f16` (half the cache memory and half the bytes a decode step reads, as
    /// llama.cpp's default cache; CPU only; see docs/performance.md for its perplexity cost).
    #[arg(long, default_value = "f32")]
    kv_cache_dtype: KvCacheDtype,
    /// AutoDeco heads directory (`deco autodeco train --out`): each token is sampled with
    /// temperature = T × --temperature and top_p = clamp(P × --top-p, 0, 1), T and P predicted by
    /// the heads. Implies --strategy sample (user temperature 1) unless --strategy greedy.
    #[arg(long)]
    autodeco: Option<PathBuf>,
    /// With --autodeco: write each generated token's (token, T, P, final temperature, final
    /// top_p) to this CSV file.
    #[arg(long, requires = "autodeco")]
    trace_decoding: Option<PathBuf>,
    /// Medusa heads directory (`deco medusa train --out`): candidates of the heads verified with
    /// tree attention, several tokens per forward (implies --strategy medusa). Greedy output is
    /// identical to --strategy greedy.
    #[arg(long)]
    medusa: Option<PathBuf>,
    /// Medusa candidate tree as the reference's `medusa_choices` JSON (e.g.
    /// `[[0],[1],[0,0]]`: head 1's top two tokens, then head 2's top token after the first).
    /// Default: `[[0]]` (deco_generate::medusa::DEFAULT_CHOICES, the fastest tree measured on a CPU).
    #[arg(long, requires = "medusa")]
    medusa_choices: Option<String>,
    /// Medusa typical acceptance when sampling: the hard threshold epsilon.
    #[arg(long, default_value_t = deco_generate::medusa::DEFAULT_POSTERIOR_THRESHOLD)]
    posterior_threshold: f32,
    /// Medusa typical acceptance when sampling: the entropy factor delta.
    #[arg(long, default_value_t = deco_generate::medusa::DEFAULT_POSTERIOR_ALPHA)]
    posterior_alpha: f32,
    /// With --trace-decoding: also plot T and P per token to this SVG file.
    #[arg(long, requires = "trace_decoding")]
    trace_plot: Option<PathBuf>,
}

/// One choice returned by [`run_on_engine`].
struct EngineChoice {
    text: String,
    /// Tokens generated (an end token included).
    tokens: usize,
    /// The strategy's sum of log-probabilities (beam search), NaN otherwise.
    cumulative_logprob: f64,
}

/// Counters of a [`run_on_engine`] run.
struct EngineRun {
    choices: Vec<EngineChoice>,
    /// Forward passes of the served model (prefill included).
    steps: u64,
    /// Speculative decoding: draft tokens proposed and accepted, draft-model forwards.
    drafted: u64,
    accepted: u64,
    draft_steps: u64,
    /// Early exit: layers run and the models' depth, summed over decode tokens.
    exit_layers_run: u64,
    exit_layers_total: u64,
    /// When the first text arrived.
    first_text_at: Option<Instant>,
}

/// Receives each piece of output: choice index, text, tokens.
type OnDelta<'a> = dyn FnMut(usize, &str, &[TokenInfo]) -> Result<()> + 'a;

/// Runs one request on the serving engine (`deco_serve::engine`, the decode loop `deco serve`
/// runs, so `deco generate` and `deco serve` give the same tokens) with a KV pool sized for
/// `width` parallel sequences of the request, keys and values stored as `kv`.
/// `on_delta(index, text, tokens)` sees every piece of output as the engine releases it (stop
/// strings already applied).
fn run_on_engine(
    model: &Llama,
    tok: &Tokenizer,
    kv: KvCacheDtype,
    req: GenerateRequest,
    width: usize,
    options: EngineOptions,
    on_delta: &mut OnDelta<'_>,
) -> Result<EngineRun> {
    let block_size = EngineConfig::default().block_size;
    let per_seq = (req.prompt.len() + req.params.max_new_tokens.unwrap_or(0)).div_ceil(block_size) + 1;
    let config = EngineConfig { num_blocks: per_seq * (width + 1) + 1, max_n: req.n.max(1), kv_cache_dtype: kv, ..EngineConfig::default() };
    let n = req.n;
    let (engine, join) = deco_serve::spawn_engine_opts(model.clone(), std::sync::Arc::new(tok.clone()), config, options)?;
    let (_, mut rx) = engine.submit(req)?;
    let mut choices: Vec<Option<EngineChoice>> = (0..n).map(|_| None).collect();
    let mut texts = vec![String::new(); n];
    let mut first_text_at = None;
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            EngineEvent::Delta { index, text, tokens } => {
                if first_text_at.is_none() && !tokens.is_empty() {
                    first_text_at = Some(Instant::now());
                }
                on_delta(index, &text, &tokens)?;
                texts[index].push_str(&text);
            }
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
    let load = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    let m = &engine.metrics;
    let (steps, drafted, accepted, draft_steps) = (load(&m.steps), load(&m.spec_draft_tokens), load(&m.spec_accepted_tokens), load(&m.draft_steps));
    let (exit_layers_run, exit_layers_total) = (load(&m.early_exit_layers_run), load(&m.early_exit_layers_total));
    drop(rx);
    drop(engine);
    let _ = join.join();
    let choices: Option<Vec<EngineChoice>> = choices.into_iter().collect();
    Ok(EngineRun {
        choices: choices.context("the engine stopped before every choice finished")?,
        steps,
        drafted,
        accepted,
        draft_steps,
        exit_layers_run,
        exit_layers_total,
        first_text_at,
    })
}

/// Prints text deltas of choice 0 as they come (`n == 1`); with several choices the texts are
/// printed whole at the end by the caller. `--logprobs` writes one JSON line per token on
/// stderr.
fn stream_to_stdout(n: usize, logprobs: bool) -> impl FnMut(usize, &str, &[TokenInfo]) -> Result<()> {
    move |index: usize, text: &str, tokens: &[TokenInfo]| -> Result<()> {
        if logprobs {
            for t in tokens {
                let top: Vec<serde_json::Value> = t.top.iter().map(|(id, lp)| serde_json::json!({"token": id, "logprob": lp})).collect();
                eprintln!("{}", serde_json::json!({"index": index, "token": t.id, "logprob": t.logprob, "top_logprobs": top}));
            }
        }
        if n == 1 {
            let mut out = std::io::stdout().lock();
            out.write_all(text.as_bytes())?;
            out.flush()?;
        }
        Ok(())
    }
}

/// Ends the output of an engine run: a newline after the streamed text of one choice, or every
/// choice's text under a `--- {what} i` header.
fn print_choices(choices: &[EngineChoice], what: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    if choices.len() == 1 {
        writeln!(out)?;
        return Ok(());
    }
    for (i, c) in choices.iter().enumerate() {
        writeln!(out, "--- {what} {i}")?;
        writeln!(out, "{}", c.text)?;
    }
    Ok(())
}

/// The engine's second model: the model at `path` (sharing the vocabulary), or `model`'s first
/// `layers` layers.
fn second_model(path: Option<&std::path::Path>, layers: usize, model: &Llama) -> Result<DraftModel> {
    let Some(path) = path else { return Ok(DraftModel { model: model.clone(), num_layers: layers }) };
    let ckpt = Checkpoint::open(path)?;
    let m = Llama::load(&ckpt, model.device(), None).with_context(|| format!("loading weights from {}", path.display()))?;
    if m.config.vocab_size != model.config.vocab_size {
        bail!("{} has vocabulary {}, the model has {}", path.display(), m.config.vocab_size, model.config.vocab_size);
    }
    let num_layers = m.num_layers();
    Ok(DraftModel { model: m, num_layers })
}

/// The engine's Medusa setting: heads from `dir` (checked against `model`), the tree of
/// `choices` (JSON, the reference's `medusa_choices`; default
/// [`deco_generate::medusa::DEFAULT_CHOICES`] cut to the heads' depth) and typical acceptance.
pub fn medusa_setting(dir: &std::path::Path, choices: Option<&str>, posterior_threshold: f32, posterior_alpha: f32, model: &Llama) -> Result<deco_serve::MedusaSetting> {
    use deco_generate::DraftHeads;
    let heads = deco_autodeco::medusa::MedusaHeads::load(dir, model).with_context(|| format!("loading Medusa heads from {}", dir.display()))?;
    let k = heads.num_heads();
    let tree = match choices {
        Some(json) => {
            let c: Vec<Vec<usize>> = serde_json::from_str(json).context("--medusa-choices must be a JSON list of paths, e.g. [[0],[1],[0,0]]")?;
            deco_generate::MedusaTree::new(&c, k)?
        }
        None => deco_generate::MedusaTree::new(&deco_generate::medusa::default_choices(k), k)?,
    };
    if !(posterior_threshold > 0.0 && posterior_threshold <= 1.0 && posterior_alpha > 0.0 && posterior_alpha.is_finite()) {
        bail!("--posterior-threshold must be in (0, 1] and --posterior-alpha positive, got {posterior_threshold} and {posterior_alpha}");
    }
    Ok(deco_serve::MedusaSetting {
        heads: std::sync::Arc::new(heads),
        tree,
        acceptance: deco_generate::TypicalAcceptance { posterior_threshold, posterior_alpha },
    })
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
        .unwrap_or(if args.medusa.is_some() {
            Strategy::Medusa
        } else if args.temperature > 0.0 || args.autodeco.is_some() {
            Strategy::Sample
        } else {
            Strategy::Greedy
        });
    if (strategy == Strategy::Medusa) != args.medusa.is_some() {
        bail!("--strategy medusa and --medusa DIR go together");
    }
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
        ignore_eos: args.ignore_eos.then_some(true),
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
    // The second model (speculative draft or contrastive amateur) loads before the clock starts,
    // as the served model does.
    let second = match strategy {
        Strategy::Speculative if !args.prompt_lookup => Some(second_model(args.draft_model.as_deref(), args.draft_layers, &model)?),
        Strategy::Contrastive => Some(second_model(args.amateur_model.as_deref(), args.amateur_layers, &model)?),
        _ => None,
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
            let req = GenerateRequest::with_strategy(prompt_ids.clone(), params.clone(), args.n, EngineStrategy::Beam(beam));
            let run = run_on_engine(&model, &tok, args.kv_cache_dtype, req, args.num_beams, EngineOptions::default(), &mut |_, _, _| Ok(()))?;
            let (choices, steps) = (run.choices, run.steps);
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
            let req = GenerateRequest { autodeco: Some(true), ..GenerateRequest::sample(prompt_ids.clone(), params.clone(), args.n) };
            let mut trace: Vec<Vec<deco_autodeco::decode::TraceRow>> = vec![Vec::new(); args.n];
            let mut print = stream_to_stdout(args.n, args.logprobs.is_some());
            let options = EngineOptions { autodeco: Some(heads), ..EngineOptions::default() };
            let run = run_on_engine(&model, &tok, args.kv_cache_dtype, req, args.n, options, &mut |index: usize, text: &str, tokens: &[TokenInfo]| {
                for t in tokens {
                    if let Some((temperature, top_p)) = t.autodeco {
                        let used = deco_autodeco::decode::combine(&params, deco_autodeco::HeadOutput { temperature, top_p });
                        let step = trace[index].len();
                        let final_temperature = if params.is_greedy() { 0.0 } else { used.temperature.unwrap_or(1.0) };
                        trace[index].push(deco_autodeco::decode::TraceRow { step, token: t.id, temperature, top_p, final_temperature, final_top_p: used.top_p.unwrap_or(1.0) });
                    }
                }
                print(index, text, tokens)
            })?;
            print_choices(&run.choices, "sample")?;
            let all: Vec<deco_autodeco::decode::TraceRow> = trace.into_iter().flatten().collect();
            let mean = |f: &dyn Fn(&deco_autodeco::decode::TraceRow) -> f32| all.iter().map(|x| f64::from(f(x))).sum::<f64>() / all.len().max(1) as f64;
            extra = format!(" autodeco_mean_T={:.4} autodeco_mean_P={:.4}", mean(&|x| x.temperature), mean(&|x| x.top_p));
            if let Some(path) = &args.trace_decoding {
                let piece = |t: u32| tok.decode(&[t], false).unwrap_or_default();
                deco_autodeco::decode::write_trace_csv(path, &all, &piece)?;
                if let Some(svg) = &args.trace_plot {
                    let t: Vec<(f64, f64)> = all.iter().enumerate().map(|(i, r)| (i as f64, f64::from(r.temperature))).collect();
                    let pp: Vec<(f64, f64)> = all.iter().enumerate().map(|(i, r)| (i as f64, f64::from(r.top_p))).collect();
                    deco_autodeco::plot::line_chart_svg(svg, "AutoDeco per-token parameters", "generated token", "value", &[("temperature T", t), ("top-p P", pp)])?;
                }
            }
            (run.choices.iter().map(|c| c.tokens).sum(), run.first_text_at)
        }
        Strategy::Greedy | Strategy::Sample => {
            let req = GenerateRequest::sample(prompt_ids.clone(), params.clone(), args.n);
            let run = run_on_engine(&model, &tok, args.kv_cache_dtype, req, args.n, EngineOptions::default(), &mut stream_to_stdout(args.n, args.logprobs.is_some()))?;
            print_choices(&run.choices, "sample")?;
            (run.choices.iter().map(|c| c.tokens).sum(), run.first_text_at)
        }
        Strategy::ContrastiveSearch => {
            if args.n != 1 {
                bail!("contrastive search is deterministic; drop -n");
            }
            let p_cs = SamplingParams { top_k: Some(args.top_k.unwrap_or(4)), ..params.clone() };
            let req = GenerateRequest::with_strategy(prompt_ids.clone(), p_cs, 1, EngineStrategy::ContrastiveSearch { penalty_alpha: args.penalty_alpha });
            let run = run_on_engine(&model, &tok, args.kv_cache_dtype, req, args.top_k.unwrap_or(4).max(1) as usize + 1, EngineOptions::default(), &mut stream_to_stdout(1, false))?;
            print_choices(&run.choices, "sample")?;
            (run.choices[0].tokens, run.first_text_at)
        }
        Strategy::Contrastive => {
            if args.n != 1 {
                bail!("contrastive decoding generates one sequence; drop -n");
            }
            let cd = ContrastiveDecodingParams { alpha: args.contrastive_alpha, amateur_temperature: args.amateur_temperature };
            let req = GenerateRequest::with_strategy(prompt_ids.clone(), params.clone(), 1, EngineStrategy::ContrastiveDecoding(cd));
            let options = EngineOptions { draft: second, ..EngineOptions::default() };
            let run = run_on_engine(&model, &tok, args.kv_cache_dtype, req, 1, options, &mut stream_to_stdout(1, args.logprobs.is_some()))?;
            print_choices(&run.choices, "sample")?;
            (run.choices[0].tokens, run.first_text_at)
        }
        Strategy::Speculative => {
            if args.n != 1 {
                bail!("speculative decoding generates one sequence; drop -n");
            }
            let gamma = args.num_speculative_tokens;
            let source = if args.prompt_lookup { DraftSource::PromptLookup(PromptLookupDrafter::default()) } else { DraftSource::Model };
            let draft = second;
            let req = GenerateRequest::with_strategy(prompt_ids.clone(), params.clone(), 1, EngineStrategy::Speculative { num_speculative_tokens: gamma, source, schedule: args.num_assistant_tokens_schedule.parse()? });
            let options = EngineOptions { draft, ..EngineOptions::default() };
            let run = run_on_engine(&model, &tok, args.kv_cache_dtype, req, 1, options, &mut stream_to_stdout(1, args.logprobs.is_some()))?;
            print_choices(&run.choices, "sample")?;
            let rate = if run.drafted == 0 { 0.0 } else { run.accepted as f64 / run.drafted as f64 };
            extra = format!(
                " drafted={} accepted={} acceptance_rate={rate:.3} target_forwards={} draft_forwards={}",
                run.drafted, run.accepted, run.steps, run.draft_steps
            );
            (run.choices[0].tokens, run.first_text_at)
        }
        Strategy::Medusa => {
            if args.n != 1 {
                bail!("Medusa decoding generates one sequence; drop -n");
            }
            if args.logprobs.is_some() {
                bail!("--logprobs is not supported with Medusa decoding");
            }
            let dir = args.medusa.as_ref().context("--medusa")?;
            let setting = medusa_setting(dir, args.medusa_choices.as_deref(), args.posterior_threshold, args.posterior_alpha, &model)?;
            let req = GenerateRequest::with_strategy(prompt_ids.clone(), params.clone(), 1, EngineStrategy::Medusa);
            let options = EngineOptions { medusa: Some(setting), ..EngineOptions::default() };
            let run = run_on_engine(&model, &tok, args.kv_cache_dtype, req, 1, options, &mut stream_to_stdout(1, false))?;
            print_choices(&run.choices, "sample")?;
            let rounds = run.steps.saturating_sub(1);
            let mean = if rounds == 0 { 0.0 } else { (run.accepted + rounds) as f64 / rounds as f64 };
            extra = format!(" tree_forwards={rounds} accepted={} mean_accepted_length={mean:.3}", run.accepted);
            (run.choices[0].tokens, run.first_text_at)
        }
        Strategy::EarlyExit => {
            let cfg = EarlyExitConfig { entropy_threshold: args.exit_entropy, min_layers: args.exit_min_layers, check_every: args.exit_check_every };
            let req = GenerateRequest::with_strategy(prompt_ids.clone(), params.clone(), args.n, EngineStrategy::EarlyExit(cfg));
            let run = run_on_engine(&model, &tok, args.kv_cache_dtype, req, args.n, EngineOptions::default(), &mut stream_to_stdout(args.n, args.logprobs.is_some()))?;
            print_choices(&run.choices, "sample")?;
            let skipped = if run.exit_layers_total == 0 { 0.0 } else { 1.0 - run.exit_layers_run as f64 / run.exit_layers_total as f64 };
            extra = format!(" layers_skipped={skipped:.3}");
            (run.choices.iter().map(|c| c.tokens).sum(), run.first_text_at)
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

