//! Speculative decoding on the serving engine, at batch 1 and with concurrent requests
//! (docs/decoding.md, `cargo xtask bench decoding`).
//!
//! ```text
//! cargo run --release -p deco-serve --example spec_bench -- --target T.gguf [--draft D.gguf]
//!     [--gamma 3] [--concurrency 1,8] [--max-new-tokens 96] [--repeats 3] [--prompt TEXT]...
//! ```
//! For each configuration (plain greedy decoding; the draft model with γ drafts, constant or
//! with Hugging Face's heuristic schedule; prompt lookup likewise) and each concurrency `c`, a
//! fresh engine (the one `deco serve` and `deco generate` run) gets `c` greedy chat requests at
//! once (the prompts in turn; for `c = 1` each prompt alone, times summed) and the wall time
//! from the first submission to the last token is measured, `--repeats` times (median; the
//! configurations interleaved in each repeat). Every configuration's texts must equal plain decoding's (T = 0).
//! Prints one JSON line per (configuration, concurrency): tokens, wall seconds (median),
//! decode seconds (median of the wall time after the first token of every request arrived),
//! speedups over plain decoding, acceptance rate.

use std::sync::Arc;
use std::time::Instant;

use burn::tensor::Device;
use deco_decoding::SamplingParams;
use deco_formats::chat_template::{ChatMessage, ChatTemplate};
use deco_formats::checkpoint::Checkpoint;
use deco_formats::gguf::GgufFile;
use deco_formats::tokenizer::Tokenizer;
use deco_generate::{DraftSchedule, DraftSource, PromptLookupDrafter};
use deco_model::Llama;
use deco_serve::{DraftModel, EngineConfig, EngineEvent, EngineOptions, GenerateRequest, SchedulerConfig, Strategy};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

struct Run {
    wall_s: f64,
    decode_s: f64,
    tokens: usize,
    texts: Vec<Vec<u32>>,
    drafted: u64,
    accepted: u64,
}

/// One batch of `prompts.len()` concurrent requests on a fresh engine.
fn run_batch(model: &Llama, tok: &Arc<Tokenizer>, draft: Option<&Llama>, strategy: Option<Strategy>, prompts: &[Vec<u32>], max_new: usize) -> R<Run> {
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0) + max_new;
    let config = EngineConfig {
        num_blocks: (longest.div_ceil(16) + 2) * (prompts.len() + 1),
        scheduler: SchedulerConfig { max_num_seqs: prompts.len().max(1), max_num_batched_tokens: 512 },
        ..EngineConfig::default()
    };
    let draft = draft.map(|m| DraftModel { model: m.clone(), num_layers: m.num_layers() });
    let (engine, join) = deco_serve::spawn_engine_opts(model.clone(), tok.clone(), config, EngineOptions { draft, ..EngineOptions::default() })?;
    let params = SamplingParams { temperature: Some(0.0), max_new_tokens: Some(max_new), ..SamplingParams::default() };
    let t0 = Instant::now();
    let mut rxs = Vec::new();
    for p in prompts {
        let req = GenerateRequest { strategy, ..GenerateRequest::sample(p.clone(), params.clone(), 1) };
        rxs.push(engine.submit(req)?.1);
    }
    // Every channel is polled, so each request's first token is timed when it arrives.
    let n = rxs.len();
    let mut texts: Vec<Vec<u32>> = vec![Vec::new(); n];
    let mut first_tokens: Vec<Option<f64>> = vec![None; n];
    let mut done = vec![false; n];
    while done.iter().any(|d| !d) {
        let mut idle = true;
        for (i, rx) in rxs.iter_mut().enumerate() {
            while !done[i] {
                match rx.try_recv() {
                    Ok(EngineEvent::Delta { tokens, .. }) => {
                        idle = false;
                        if first_tokens[i].is_none() && !tokens.is_empty() {
                            first_tokens[i] = Some(t0.elapsed().as_secs_f64());
                        }
                        texts[i].extend(tokens.iter().map(|t| t.id));
                    }
                    Ok(EngineEvent::Finished { .. }) => done[i] = true,
                    Ok(EngineEvent::Failed(e)) => return Err(e.into()),
                    Err(tokio::sync::mpsc::error::TryRecvError::Empty) => break,
                    Err(tokio::sync::mpsc::error::TryRecvError::Disconnected) => return Err("the engine stopped".into()),
                }
            }
        }
        if idle {
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
    }
    let wall_s = t0.elapsed().as_secs_f64();
    let load = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    let (drafted, accepted) = (load(&engine.metrics.spec_draft_tokens), load(&engine.metrics.spec_accepted_tokens));
    drop(engine);
    let _ = join.join();
    // Decode time: after the last request's first token (every prefill done).
    let prefill_done = first_tokens.iter().map(|t| t.unwrap_or(0.0)).fold(0.0, f64::max);
    let tokens = texts.iter().map(Vec::len).sum();
    Ok(Run { wall_s, decode_s: wall_s - prefill_done, tokens, texts, drafted, accepted })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

fn main() -> R<()> {
    let mut target = None;
    let mut draft_path = None;
    let mut gamma = 3usize;
    let mut conc = vec![1usize, 8];
    let mut max_new = 96usize;
    let mut repeats = 3usize;
    let mut prompts: Vec<String> = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--target" => target = Some(val()?),
            "--draft" => draft_path = Some(val()?),
            "--gamma" => gamma = val()?.parse()?,
            "--concurrency" => conc = val()?.split(',').map(str::parse).collect::<Result<_, _>>()?,
            "--max-new-tokens" => max_new = val()?.parse()?,
            "--repeats" => repeats = val()?.parse()?,
            "--prompt" => prompts.push(val()?),
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    let target = target.ok_or("--target is required")?;
    if prompts.is_empty() {
        return Err("give at least one --prompt".into());
    }
    let load = |p: &str| -> R<Llama> { Ok(Llama::load(&Checkpoint::open(p)?, &Device::flex(), Some(4096))?) };
    let model = load(&target)?;
    let draft = draft_path.as_deref().map(load).transpose()?;
    let tok = Arc::new(Tokenizer::from_gguf(&GgufFile::open(&target)?)?);
    let template = ChatTemplate::new(tok.chat_template().ok_or("the model has no chat template")?)?;
    let (bos, eos) = (tok.bos_token().unwrap_or_default(), tok.eos_token().unwrap_or_default());
    let encoded: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| -> R<Vec<u32>> { Ok(tok.encode(&template.render(&[ChatMessage::new("user", p.clone())], true, &bos, &eos)?, true)?) })
        .collect::<R<_>>()?;
    let spec = |source, schedule| Some(Strategy::Speculative { num_speculative_tokens: gamma, source, schedule });
    let lookup = DraftSource::PromptLookup(PromptLookupDrafter::default());
    let mut configs: Vec<(String, Option<Strategy>)> = vec![("plain".into(), None)];
    if draft.is_some() {
        configs.push((format!("draft model, γ={gamma}"), spec(DraftSource::Model, DraftSchedule::Constant)));
        configs.push((format!("draft model, γ from {gamma}, heuristic"), spec(DraftSource::Model, DraftSchedule::Heuristic)));
    }
    configs.push((format!("prompt lookup (ngram 2), γ={gamma}"), spec(lookup, DraftSchedule::Constant)));
    configs.push((format!("prompt lookup (ngram 2), γ from {gamma}, heuristic"), spec(lookup, DraftSchedule::Heuristic)));
    for &c in &conc {
        // Concurrency 1: every prompt alone, one after the other (times and tokens summed);
        // otherwise one batch of `c` requests, the prompts in turn.
        let batches: Vec<Vec<Vec<u32>>> =
            if c == 1 { encoded.iter().map(|p| vec![p.clone()]).collect() } else { vec![(0..c).map(|i| encoded[i % encoded.len()].clone()).collect()] };
        let mut runs: Vec<Vec<Run>> = (0..configs.len()).map(|_| Vec::new()).collect();
        for _ in 0..repeats {
            for (ci, (_, strategy)) in configs.iter().enumerate() {
                let d = if matches!(strategy, Some(Strategy::Speculative { source: DraftSource::Model, .. })) { draft.as_ref() } else { None };
                let mut total = Run { wall_s: 0.0, decode_s: 0.0, tokens: 0, texts: Vec::new(), drafted: 0, accepted: 0 };
                for batch in &batches {
                    let r = run_batch(&model, &tok, d, *strategy, batch, max_new)?;
                    total.wall_s += r.wall_s;
                    total.decode_s += r.decode_s;
                    total.tokens += r.tokens;
                    total.texts.extend(r.texts);
                    total.drafted += r.drafted;
                    total.accepted += r.accepted;
                }
                runs[ci].push(total);
            }
        }
        let plain_wall = median(runs[0].iter().map(|r| r.wall_s).collect());
        let plain_decode = median(runs[0].iter().map(|r| r.decode_s).collect());
        for (ci, (name, _)) in configs.iter().enumerate() {
            let rs = &runs[ci];
            let same = rs.iter().all(|r| r.texts == runs[0][0].texts);
            let wall = median(rs.iter().map(|r| r.wall_s).collect());
            let decode = median(rs.iter().map(|r| r.decode_s).collect());
            let (drafted, accepted) = rs.iter().fold((0, 0), |a, r| (a.0 + r.drafted, a.1 + r.accepted));
            println!(
                "{}",
                serde_json::json!({
                    "config": name, "concurrency": c, "tokens": rs[0].tokens, "wall_s": wall, "decode_s": decode,
                    "tok_s": rs[0].tokens as f64 / wall, "speedup": plain_wall / wall, "decode_speedup": plain_decode / decode,
                    "acceptance": if drafted == 0 { serde_json::Value::Null } else { serde_json::json!(accepted as f64 / drafted as f64) },
                    "equals_plain": same,
                })
            );
        }
    }
    Ok(())
}
