//! Decoding with the heads: at every step the heads read the position's final hidden state and
//! raw logits and predict `(T, P)`; the token is then sampled with
//! `temperature = T × user temperature` and `top_p = clamp(P × user top_p, 0, 1)` through the
//! usual processor chain (all other parameters unchanged).
//!
//! A greedy request (user temperature 0 / `do_sample: false`) stays greedy; the heads are still
//! evaluated so the trace shows what they predicted. The combined temperature is floored at
//! `1e-2` (the temperature loss's clamp), so a saturated head never turns a sampled request into
//! an unwarped one.
//!
//! Source: AutoDeco §3.3 (inference: "the predicted T and P replace the static values");
//! combining them multiplicatively with the user's values is deco's choice (the reference's vLLM
//! integration uses the predicted values directly, i.e. user temperature = top_p = 1).

use std::collections::HashMap;
use std::time::Instant;

use rayon::prelude::*;

use deco_decoding::{
    FinishReason, LogitsProcessorList, ProcessContext, SampleOutput, Sampler, SamplerOrder, SamplingParams, StoppingCriteria,
};
use deco_generate::{CausalLm, Generation};
use deco_model::LogitsWanted;

use crate::error::{Error, Result};
use crate::heads::{HeadOutput, HostHeads};

/// Smallest combined temperature (see the module docs).
pub const MIN_TEMPERATURE: f32 = 1e-2;

/// One decoded token with the heads' predictions (`--trace-decoding`).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct TraceRow {
    /// 0-based index of the generated token.
    pub step: usize,
    /// The token chosen.
    pub token: u32,
    /// The temperature head's output `T`.
    pub temperature: f32,
    /// The top-p head's output `P`.
    pub top_p: f32,
    /// The temperature used (`T × user temperature`, 0 for greedy).
    pub final_temperature: f32,
    /// The top-p used (`clamp(P × user top_p, 0, 1)`).
    pub final_top_p: f32,
}

/// The sampling parameters for one token: `user` with temperature and top-p replaced by the
/// combination with the heads' `out` (unchanged for a greedy request).
pub fn combine(user: &SamplingParams, out: HeadOutput) -> SamplingParams {
    if user.is_greedy() {
        return user.clone();
    }
    let t = (user.temperature.unwrap_or(1.0) * out.temperature).max(MIN_TEMPERATURE);
    let p = (user.top_p.unwrap_or(1.0) * out.top_p).clamp(0.0, 1.0);
    SamplingParams { temperature: Some(t), top_p: Some(p), do_sample: Some(true), ..user.clone() }
}

/// One sequence to generate.
#[derive(Debug, Clone)]
pub struct SeqRequest {
    /// Prompt ids (non-empty).
    pub prompt: Vec<u32>,
    /// The user's parameters (seed included).
    pub params: SamplingParams,
}

/// Where [`generate_batch`]'s time went (wall clock, seconds).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct BatchStats {
    /// Model forwards (prefill and decode).
    pub forward_s: f64,
    /// AutoDeco heads, statistics included (0 without heads).
    pub heads_s: f64,
    /// Processor chains and sampling.
    pub sample_s: f64,
    /// Tokens generated.
    pub tokens: usize,
    /// Batched decode forwards.
    pub decode_steps: usize,
}

/// A finished sequence of [`generate_batch`].
#[derive(Debug, Clone)]
pub struct SeqResult {
    /// The generation (tokens, logprobs, finish reason).
    pub generation: Generation,
    /// Per-token head predictions (empty without heads).
    pub trace: Vec<TraceRow>,
}

struct Active {
    req: usize,
    seq: u64,
    sampler: Sampler,
    stopping: StoppingCriteria,
    budget: usize,
    output: Generation,
    trace: Vec<TraceRow>,
    logits: Vec<f32>,
    hidden: Vec<f32>,
}

/// Generates every request, `max_batch` sequences at a time, with one batched forward per step
/// (ragged: each sequence at its own length). Requests with identical prompts inside a wave share
/// one prefill (the cache is forked), which makes `n` samples of one prompt cheap. With `heads`,
/// each token's temperature and top-p come from them ([`combine`]).
///
/// `sink(request_index, tokens)` streams each new token; returning true stops that sequence with
/// [`FinishReason::Stop`] (stop strings are the caller's, as in `deco_generate::generate`).
///
/// # Errors
/// Invalid parameters, an empty or too long prompt, model errors, heads of another model.
pub fn generate_batch(
    lm: &mut dyn CausalLm,
    heads: Option<&HostHeads>,
    requests: &[SeqRequest],
    eos_token_ids: &[u32],
    max_batch: usize,
    order: SamplerOrder,
    sink: &mut dyn FnMut(usize, &[u32]) -> bool,
) -> Result<Vec<SeqResult>> {
    generate_batch_timed(lm, heads, requests, eos_token_ids, max_batch, order, sink).map(|(r, _)| r)
}

/// [`generate_batch`] that also reports where the time went.
///
/// # Errors
/// As [`generate_batch`].
pub fn generate_batch_timed(
    lm: &mut dyn CausalLm,
    heads: Option<&HostHeads>,
    requests: &[SeqRequest],
    eos_token_ids: &[u32],
    max_batch: usize,
    order: SamplerOrder,
    sink: &mut dyn FnMut(usize, &[u32]) -> bool,
) -> Result<(Vec<SeqResult>, BatchStats)> {
    let mut stats = BatchStats::default();
    if let Some(h) = heads
        && h.config().vocab_size != lm.vocab_size()
    {
        return Err(Error::Shape(format!(
            "the heads were trained for vocabulary {}, the model has {}",
            h.config().vocab_size,
            lm.vocab_size()
        )));
    }
    let max_batch = max_batch.max(1);
    let mut results: Vec<Option<SeqResult>> = vec![None; requests.len()];
    for (wave_i, wave) in requests.chunks(max_batch).enumerate() {
        let base = wave_i * max_batch;
        // Prefill unique prompts.
        let mut leaders: HashMap<&[u32], usize> = HashMap::new();
        let mut unique: Vec<usize> = Vec::new();
        for (i, r) in wave.iter().enumerate() {
            if r.prompt.is_empty() {
                return Err(Error::InvalidParameter { name: "prompt", msg: format!("request {} has an empty prompt", base + i) });
            }
            if r.prompt.len() >= lm.max_context() {
                return Err(Error::InvalidParameter {
                    name: "prompt",
                    msg: format!("request {} has {} tokens; the model's context is {}", base + i, r.prompt.len(), lm.max_context()),
                });
            }
            if !leaders.contains_key(r.prompt.as_slice()) {
                leaders.insert(r.prompt.as_slice(), i);
                unique.push(i);
            }
        }
        for i in 0..wave.len() {
            lm.remove(i as u64);
        }
        let inputs: Vec<(u64, &[u32])> = unique.iter().map(|&i| (i as u64, wave[i].prompt.as_slice())).collect();
        let tf = Instant::now();
        let rows = lm.forward(&inputs, LogitsWanted::Last, heads.is_some())?;
        stats.forward_s += tf.elapsed().as_secs_f64();
        let mut first: HashMap<usize, (Vec<f32>, Vec<f32>)> = HashMap::new();
        for (k, &i) in unique.iter().enumerate() {
            let hid = if heads.is_some() { rows.hidden[k].clone() } else { Vec::new() };
            first.insert(i, (rows.logits[k].clone(), hid));
        }
        let mut active = Vec::with_capacity(wave.len());
        for (i, r) in wave.iter().enumerate() {
            let leader = leaders[r.prompt.as_slice()];
            if leader != i {
                lm.fork(leader as u64, i as u64)?;
            }
            let (logits, hidden) = first[&leader].clone();
            let max_new = r.params.max_new_tokens.unwrap_or(deco_generate::DEFAULT_MAX_NEW_TOKENS);
            active.push(Active {
                req: base + i,
                seq: i as u64,
                sampler: Sampler::with_order(&r.params, order)?,
                stopping: StoppingCriteria::from_params(&r.params, eos_token_ids)?,
                budget: max_new.min(lm.max_context() - r.prompt.len()),
                output: Generation { tokens: Vec::new(), logprobs: Vec::new(), samples: Vec::new(), finish_reason: FinishReason::Length },
                trace: Vec::new(),
                logits,
                hidden,
            });
        }
        while !active.is_empty() {
            let mut next: Vec<(u64, u32)> = Vec::new();
            let mut done = Vec::new();
            // The heads of every active sequence at once, in parallel (like the model's forward).
            let predicted: Vec<Option<HeadOutput>> = match heads {
                Some(h) => {
                    let th = Instant::now();
                    let p = active.par_iter().map(|a| h.predict(&a.hidden, &a.logits).map(Some)).collect::<Result<Vec<_>>>()?;
                    stats.heads_s += th.elapsed().as_secs_f64();
                    p
                }
                None => vec![None; active.len()],
            };
            for (ai, (a, predicted)) in active.iter_mut().zip(predicted).enumerate() {
                let r = &requests[a.req];
                let ctx = ProcessContext::new(&r.prompt, &a.output.tokens, eos_token_ids);
                let (out, head): (SampleOutput, Option<HeadOutput>) = match predicted {
                    Some(ho) => {
                        let ts = Instant::now();
                        let p = combine(&r.params, ho);
                        let procs = LogitsProcessorList::from_params(&p, order)?;
                        let o = a.sampler.sample_with(&procs, &ctx, &mut a.logits)?;
                        stats.sample_s += ts.elapsed().as_secs_f64();
                        (o, Some(ho))
                    }
                    None => {
                        let ts = Instant::now();
                        let o = a.sampler.sample(&ctx, &mut a.logits)?;
                        stats.sample_s += ts.elapsed().as_secs_f64();
                        (o, None)
                    }
                };
                stats.tokens += 1;
                let token = out.token;
                if let Some(ho) = head {
                    let p = combine(&r.params, ho);
                    a.trace.push(TraceRow {
                        step: a.output.tokens.len(),
                        token,
                        temperature: ho.temperature,
                        top_p: ho.top_p,
                        final_temperature: if r.params.is_greedy() { 0.0 } else { p.temperature.unwrap_or(1.0) },
                        final_top_p: p.top_p.unwrap_or(1.0),
                    });
                }
                a.output.tokens.push(token);
                a.output.logprobs.push(out.logprob);
                a.output.samples.push(out);
                let user_stop = sink(a.req, &[token]);
                let stop = if let Some(fr) = a.stopping.check(token, a.output.tokens.len()) {
                    a.output.finish_reason = fr;
                    true
                } else if user_stop {
                    a.output.finish_reason = FinishReason::Stop;
                    true
                } else {
                    a.output.tokens.len() >= a.budget
                };
                if stop {
                    done.push(ai);
                } else {
                    next.push((a.seq, token));
                }
            }
            for &ai in done.iter().rev() {
                let a = active.remove(ai);
                lm.remove(a.seq);
                results[a.req] = Some(SeqResult { generation: a.output, trace: a.trace });
            }
            if active.is_empty() {
                break;
            }
            let toks: Vec<[u32; 1]> = next.iter().map(|&(_, t)| [t]).collect();
            let inputs: Vec<(u64, &[u32])> = next.iter().zip(&toks).map(|(&(s, _), t)| (s, t.as_slice())).collect();
            let tf = Instant::now();
            let mut rows = lm.forward(&inputs, LogitsWanted::Last, heads.is_some())?;
            stats.forward_s += tf.elapsed().as_secs_f64();
            stats.decode_steps += 1;
            for (k, a) in active.iter_mut().enumerate() {
                a.logits = std::mem::take(&mut rows.logits[k]);
                if heads.is_some() {
                    a.hidden = std::mem::take(&mut rows.hidden[k]);
                }
            }
        }
    }
    let results = results
        .into_iter()
        .map(|r| r.ok_or_else(|| Error::Data("internal: a request did not finish".into())))
        .collect::<Result<Vec<_>>>()?;
    Ok((results, stats))
}

/// Writes a trace as CSV (`step,token,piece,temperature,top_p,final_temperature,final_top_p`),
/// atomically, one line per token. `piece(token)` gives the token's text; it is written quoted,
/// with control characters escaped as in Rust (`\n`) and quotes doubled.
///
/// # Errors
/// [`Error::Io`].
pub fn write_trace_csv(path: &std::path::Path, trace: &[TraceRow], piece: &dyn Fn(u32) -> String) -> Result<()> {
    let mut s = String::from("step,token,piece,temperature,top_p,final_temperature,final_top_p\n");
    for r in trace {
        // One line per token: control characters are escaped (`\n`), quotes doubled.
        let p = piece(r.token).escape_debug().to_string().replace("\\\"", "\"").replace('"', "\"\"");
        s.push_str(&format!(
            "{},{},\"{}\",{:.6},{:.6},{:.6},{:.6}\n",
            r.step, r.token, p, r.temperature, r.top_p, r.final_temperature, r.final_top_p
        ));
    }
    crate::write_atomic(path, s.as_bytes())
}
