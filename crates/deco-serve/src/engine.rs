//! The engine: one thread that owns the model, the paged KV cache and the scheduler, and runs
//! continuous batching (Yu et al. 2022, Orca; vLLM's `LLMEngine`/`EngineCore` loop).
//!
//! Each iteration: take new requests and cancellations from the command channel, drop requests
//! whose client has gone (their event receiver was dropped), ask the [`Scheduler`] for a step,
//! run **one** [`Llama::forward`] over every scheduled chunk (prefill chunks and decodes
//! together), then for each sequence whose chunk reached its end: sample the next token with
//! the sequence's own [`Sampler`], apply stop tokens / stop strings / length, detokenize
//! incrementally and send an [`EngineEvent`] to the request's channel. Finished and cancelled
//! sequences free their blocks at once.
//!
//! `n > 1`: the prompt is prefilled once; when it completes, the sequence is forked
//! ([`PagedKvCache::fork`], copy-on-write) into `n` sequences, each with its own sampler (seed
//! `seed + i` when the request is seeded).
//!
//! This is the one decode loop of deco: `deco generate`, `deco serve` and `deco autodeco eval`
//! run on it. Sampling (with AutoDeco heads when the engine has them and the request wants them)
//! and early exit (its decode tokens run [`Llama::forward_early_exit`] one sequence at a time)
//! are the per-token path above. The other strategies ([`Strategy`]: beam search, speculative
//! decoding, contrastive search and decoding) are [`deco_generate::StepMachine`]s. Their
//! sequences are ordinary scheduler and cache sequences: the prompt's is prefilled as above;
//! the machine's forks, feeds, truncations and removals ([`deco_generate::Op`]) become cache
//! forks, scheduled tokens (each fed sequence asks for its own number of logits rows,
//! [`Llama::forward_rows`]), cut-back sequences and freed blocks, so a beam group or a
//! speculative verify chunk runs in the same batched forward as every other request, shares its
//! prompt blocks copy-on-write, and can be preempted and recomputed. The engine's second model
//! ([`DraftModel`], its own paged cache) runs the machines' draft feeds at the start of each step,
//! one batched forward per drafting round. A machine is advanced once every sequence it fed has
//! its rows (a barrier per request step); the choices it releases are detokenized and stop
//! strings applied as for sampling.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use deco_decoding::{
    FinishReason, ProcessContext, Sampler, SamplingParams, StopStringMatcher, StoppingCriteria,
};
use deco_formats::tokenizer::Tokenizer;
use deco_model::early_exit::EarlyExitConfig;
use deco_model::{Llama, SeqId, SeqInput};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

use deco_generate::{
    BeamSearch, BeamSearchParams, ContrastiveDecoding, ContrastiveDecodingParams, ContrastiveSearch, DraftHeads, DraftSchedule, DraftSource, Local, Medusa,
    MedusaTree, Op, Role, SeqRows, Speculative, StepMachine, TypicalAcceptance,
};

use crate::paged_cache::{CacheShape, KvCacheDtype, PagedKvCache};
use crate::structured::Constraint;
use crate::scheduler::{SchedSeq, Scheduler, SchedulerConfig};
use crate::{Error, Result};
use deco_autodeco::HostHeads;
use deco_decoding::{LogitsProcessorList, SamplerOrder};

/// Engine settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks in the pool.
    pub num_blocks: usize,
    /// Element type of the cached keys and values (f32 by default; f16 on the CPU halves the
    /// cache's memory and the bytes a decode step reads).
    pub kv_cache_dtype: KvCacheDtype,
    /// Scheduler limits.
    pub scheduler: SchedulerConfig,
    /// Most requests admitted and not finished (running plus queued); beyond it
    /// [`EngineHandle::submit`] fails with [`Error::Overloaded`] (HTTP 429).
    pub max_pending_requests: usize,
    /// Largest `n` accepted.
    pub max_n: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            num_blocks: 2048,
            kv_cache_dtype: KvCacheDtype::F32,
            scheduler: SchedulerConfig::default(),
            max_pending_requests: 512,
            max_n: 16,
        }
    }
}

/// One generated token as reported to the client.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenInfo {
    /// Token id.
    pub id: u32,
    /// The AutoDeco heads' `(T, P)` for this token, when they chose its temperature and top-p.
    pub autodeco: Option<(f32, f32)>,
    /// Raw model log-probability (natural log), when logprobs were requested.
    pub logprob: Option<f32>,
    /// The most likely alternatives (raw distribution), most likely first.
    pub top: Vec<(u32, f32)>,
}

/// What the engine sends to a request's channel.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    /// New output of sequence `index` (0..n): text safe to show (stop strings held back) and
    /// the tokens generated in this step (not counting a final EOS / stop token).
    Delta {
        /// Choice index.
        index: usize,
        /// Newly released text.
        text: String,
        /// Tokens of this step.
        tokens: Vec<TokenInfo>,
    },
    /// Sequence `index` finished.
    Finished {
        /// Choice index.
        index: usize,
        /// Why.
        reason: FinishReason,
        /// Tokens it generated (including a final EOS / stop token).
        completion_tokens: usize,
        /// Prompt tokens of the request served from the prefix cache when it was first
        /// scheduled (OpenAI's `usage.prompt_tokens_details.cached_tokens`; the same for every
        /// choice of the request).
        cached_prompt_tokens: usize,
        /// The strategy's sum of log-probabilities of the choice's tokens, when it keeps one
        /// (beam search); `None` for sampling.
        cumulative_logprob: Option<f64>,
    },
    /// The request failed inside the engine; no further events follow.
    Failed(String),
}

/// A decoding strategy run by the engine as a [`StepMachine`] (plain sampling and greedy
/// decoding are the engine's own per-token path).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Strategy {
    /// Beam search with Hugging Face semantics ([`BeamSearch`]); `num_return_sequences` is the
    /// request's `n`.
    Beam(BeamSearchParams),
    /// Contrastive search ([`ContrastiveSearch`], Su et al. 2022) with degeneration penalty
    /// `penalty_alpha` over the request's `top_k` candidates.
    ContrastiveSearch {
        /// Hugging Face's `penalty_alpha`, in `[0, 1]`.
        penalty_alpha: f32,
    },
    /// Contrastive decoding ([`ContrastiveDecoding`], Li et al. 2023) with the engine's second
    /// model ([`EngineOptions::draft`]) as the amateur.
    ContrastiveDecoding(ContrastiveDecodingParams),
    /// Entropy-threshold early exit (`deco_model::early_exit`): the request samples as usual,
    /// and each of its decode tokens runs [`Llama::forward_early_exit`], which stops at the
    /// first tested layer whose intermediate distribution is confident enough (a per-token
    /// depth cannot share the batched forward; its prefill does).
    EarlyExit(EarlyExitConfig),
    /// Speculative decoding ([`Speculative`]) with `num_speculative_tokens` drafts per round from
    /// `source` ([`DraftSource::Model`] needs the engine's draft model, see [`EngineOptions`]).
    Speculative {
        /// Draft tokens per round (γ; the initial γ under a heuristic schedule).
        num_speculative_tokens: usize,
        /// Where drafts come from.
        source: DraftSource,
        /// How γ evolves.
        schedule: DraftSchedule,
    },
    /// Medusa decoding ([`Medusa`], Cai et al. 2024) with the engine's heads and candidate tree
    /// ([`EngineOptions::medusa`]).
    Medusa,
}

/// Medusa heads as an engine setting (`deco generate --medusa`, `deco serve --medusa`): every
/// request it can serve unchanged runs as [`Strategy::Medusa`] (one choice, no structured output,
/// no logprobs, no AutoDeco heads at work, no other strategy asked); the others decode as usual.
#[derive(Debug, Clone)]
pub struct MedusaSetting {
    /// The heads (`deco_autodeco::medusa::MedusaHeads`).
    pub heads: Arc<dyn DraftHeads>,
    /// The candidate tree (the reference's `medusa_choices`).
    pub tree: MedusaTree,
    /// Acceptance of candidates when sampling.
    pub acceptance: TypicalAcceptance,
}

/// The engine's second model: the draft of speculative decoding or the amateur of contrastive
/// decoding. Another model sharing the served model's tokenizer, or the served model itself run
/// through its first `num_layers` layers (self-speculative decoding, a truncated amateur). It
/// has its own paged cache.
#[derive(Debug, Clone)]
pub struct DraftModel {
    /// The model.
    pub model: Llama,
    /// Layers run (`model.num_layers()` for a separate model).
    pub num_layers: usize,
}

/// Speculative decoding as a server setting (vLLM's `--speculative-model` /
/// `--num-speculative-tokens`): every request it can serve unchanged in distribution runs as
/// [`Strategy::Speculative`] (one choice, no structured output, no logprobs, and no AutoDeco
/// heads at work); the others sample as usual.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Speculation {
    /// Draft tokens per round (γ).
    pub num_speculative_tokens: usize,
    /// Where drafts come from.
    pub source: DraftSource,
    /// How γ evolves.
    pub schedule: DraftSchedule,
}

/// Optional parts of an engine.
#[derive(Debug, Default)]
pub struct EngineOptions {
    /// AutoDeco heads (see [`spawn_engine_with`]).
    pub autodeco: Option<HostHeads>,
    /// The draft model of speculative requests with [`DraftSource::Model`].
    pub draft: Option<DraftModel>,
    /// Speculative decoding for every eligible request.
    pub speculation: Option<Speculation>,
    /// Medusa decoding for every eligible request.
    pub medusa: Option<MedusaSetting>,
}

/// A generation request.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    /// Prompt token ids (at least one).
    pub prompt: Vec<u32>,
    /// Sampling parameters; `max_new_tokens` must be set (the server fills in a default).
    pub params: SamplingParams,
    /// Number of sequences to generate.
    pub n: usize,
    /// Structured-output constraint (compiled by [`crate::Grammars::compile`]); each of the `n`
    /// sequences gets its own copy of its state.
    pub constraint: Option<Constraint>,
    /// A strategy other than sampling; `None` samples (greedy at temperature 0).
    pub strategy: Option<Strategy>,
    /// Whether the engine's AutoDeco heads choose this request's temperature and top-p
    /// (`None`: yes when the engine has heads; `Some(true)` without heads is refused). A greedy
    /// request stays greedy; its tokens report the heads' predictions.
    pub autodeco: Option<bool>,
}

impl GenerateRequest {
    /// A sampling request without constraint.
    pub fn sample(prompt: Vec<u32>, params: SamplingParams, n: usize) -> Self {
        Self { prompt, params, n, constraint: None, strategy: None, autodeco: None }
    }

    /// A request decoded by `strategy`, without constraint.
    pub fn with_strategy(prompt: Vec<u32>, params: SamplingParams, n: usize, strategy: Strategy) -> Self {
        Self { strategy: Some(strategy), ..Self::sample(prompt, params, n) }
    }

    /// Whether the heads apply to this request on an engine with (`has_heads`) or without them
    /// (a greedy request still gets their predictions reported, its tokens stay greedy).
    fn uses_heads(&self, has_heads: bool) -> bool {
        has_heads && self.autodeco != Some(false)
    }
}

/// Bucket bounds (seconds) of `vllm:time_to_first_token_seconds`, as vLLM's
/// `PrometheusStatLogger` (vllm/v1/metrics/loggers.py).
pub const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// Bucket bounds (seconds) of `vllm:time_per_output_token_seconds`, as vLLM.
pub const TPOT_BUCKETS: [f64; 19] = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];
/// Bucket bounds (seconds) of `vllm:e2e_request_latency_seconds`, as vLLM.
pub const E2E_BUCKETS: [f64; 21] = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
];

/// A Prometheus histogram with fixed upper bounds, updated without locks: one counter per
/// bucket (an observation lands in the first bucket whose bound is >= it, or in `+Inf`) and the
/// sum in nanoseconds.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    /// `bounds.len() + 1` counters, not cumulative; the last is `+Inf`.
    counts: Vec<AtomicU64>,
    sum_ns: AtomicU64,
}

impl Histogram {
    /// An empty histogram with these upper bounds (seconds, increasing).
    pub fn new(bounds: &'static [f64]) -> Self {
        Self { bounds, counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(), sum_ns: AtomicU64::new(0) }
    }

    /// Records one observation (seconds; negative or NaN count as 0).
    pub fn observe(&self, secs: f64) {
        let secs = if secs.is_finite() && secs > 0.0 { secs } else { 0.0 };
        let i = self.bounds.iter().position(|&b| secs <= b).unwrap_or(self.bounds.len());
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add((secs * 1e9) as u64, Ordering::Relaxed);
    }

    /// Number of observations.
    pub fn count(&self) -> u64 {
        self.counts.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }

    /// Sum of the observations, in seconds.
    pub fn sum(&self) -> f64 {
        self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9
    }

    /// `(upper bound, cumulative count)` per bucket, ending with `(+inf, count)`.
    pub fn cumulative(&self) -> Vec<(f64, u64)> {
        let mut acc = 0;
        self.counts
            .iter()
            .enumerate()
            .map(|(i, c)| {
                acc += c.load(Ordering::Relaxed);
                (self.bounds.get(i).copied().unwrap_or(f64::INFINITY), acc)
            })
            .collect()
    }
}

/// The latency histograms of `/metrics` (vLLM's names and buckets).
#[derive(Debug)]
pub struct LatencyHistograms {
    /// Request arrival (submission) to its first generated token.
    pub time_to_first_token: Histogram,
    /// Time between consecutive tokens of one sequence (vLLM's per-token
    /// `time_per_output_token` observations, its inter-token latency).
    pub time_per_output_token: Histogram,
    /// Request arrival to its last sequence finishing.
    pub e2e_request_latency: Histogram,
}

impl Default for LatencyHistograms {
    fn default() -> Self {
        Self {
            time_to_first_token: Histogram::new(&TTFT_BUCKETS),
            time_per_output_token: Histogram::new(&TPOT_BUCKETS),
            e2e_request_latency: Histogram::new(&E2E_BUCKETS),
        }
    }
}

/// Counters and gauges exported at `/metrics`.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Sequences waiting for admission.
    pub waiting: AtomicUsize,
    /// Sequences running.
    pub running: AtomicUsize,
    /// Requests submitted and not finished.
    pub pending_requests: AtomicUsize,
    /// KV blocks in use.
    pub kv_blocks_used: AtomicUsize,
    /// KV blocks free (including evictable cached ones).
    pub kv_blocks_free: AtomicUsize,
    /// KV blocks total.
    pub kv_blocks_total: AtomicUsize,
    /// Tokens per KV block.
    pub block_size: AtomicUsize,
    /// Whether the KV cache stores f16 (`cache_dtype` `float16`) rather than f32.
    pub kv_cache_f16: AtomicBool,
    /// Tokens generated.
    pub generation_tokens: AtomicU64,
    /// Prompt tokens computed (excluding prefix-cache hits and counting recomputation).
    pub prompt_tokens_computed: AtomicU64,
    /// Prompt tokens of requests whose prefill finished (the whole prompt, cached part included,
    /// once per request: vLLM's `prompt_tokens`).
    pub prompt_tokens: AtomicU64,
    /// Prompt tokens looked up in the prefix cache at admission (vLLM's `prefix_cache_queries`).
    pub prefix_cache_queries: AtomicU64,
    /// Prompt tokens served from the prefix cache at admission (vLLM's `prefix_cache_hits`).
    pub prefix_cache_hit_tokens: AtomicU64,
    /// Requests finished (all their sequences).
    pub requests_finished: AtomicU64,
    /// Sequences finished with `finish_reason` `stop` (EOS, stop token or stop string).
    pub finished_stop: AtomicU64,
    /// Sequences finished with `finish_reason` `length`.
    pub finished_length: AtomicU64,
    /// Requests cancelled (client gone or aborted).
    pub requests_cancelled: AtomicU64,
    /// Preemptions.
    pub preemptions: AtomicU64,
    /// Engine steps (forward passes).
    pub steps: AtomicU64,
    /// Errors of forward passes.
    pub step_errors: AtomicU64,
    /// Draft tokens proposed by speculative decoding (vLLM's `spec_decode_num_draft_tokens`).
    pub spec_draft_tokens: AtomicU64,
    /// Draft tokens accepted (vLLM's `spec_decode_num_accepted_tokens`).
    pub spec_accepted_tokens: AtomicU64,
    /// Forward passes of the draft model.
    pub draft_steps: AtomicU64,
    /// Time in the served model's forward passes (the step's whole forward), nanoseconds.
    pub forward_ns: AtomicU64,
    /// Time in the AutoDeco heads' predictions, nanoseconds.
    pub autodeco_heads_ns: AtomicU64,
    /// Time choosing tokens (logits processors and the sampler, heads excluded), nanoseconds.
    pub sampling_ns: AtomicU64,
    /// Early exit: layers run by decode tokens of early-exit requests, and their models'
    /// depth summed over the same tokens.
    pub early_exit_layers_run: AtomicU64,
    /// See [`Metrics::early_exit_layers_run`].
    pub early_exit_layers_total: AtomicU64,
    /// Structured-output masks computed (one per constrained token).
    pub structured_masks: AtomicU64,
    /// Time spent computing and applying them, in nanoseconds.
    pub structured_mask_ns: AtomicU64,
    /// Latency histograms.
    pub latency: LatencyHistograms,
}

/// A Prometheus label value with `\`, `"` and newlines escaped.
/// A request's sampler; without `logprobs` a greedy one skips the chosen token's log-probability,
/// which nothing returns then ([`Sampler::set_chosen_logprob`]).
fn engine_sampler(params: &SamplingParams) -> Result<Sampler> {
    let mut sampler = Sampler::new(params)?;
    sampler.set_chosen_logprob(params.logprobs.is_some());
    Ok(sampler)
}

fn label_value(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

impl Metrics {
    /// Prometheus text exposition (format 0.0.4) of the metrics, twice: under deco's own names
    /// (`deco_...`, no labels) and under vLLM's (`vllm:...`, labels `model_name` and
    /// `engine="0"`, counters suffixed `_total` as `prometheus_client` writes them), so that
    /// routers and dashboards built for vLLM read deco unchanged:
    ///
    /// | vLLM name | type | deco's value |
    /// |---|---|---|
    /// | `vllm:num_requests_running` / `_waiting` | gauge | sequences running / waiting (a choice of `n > 1` is a sequence, as vLLM's child requests) |
    /// | `vllm:kv_cache_usage_perc` (and the older `vllm:gpu_cache_usage_perc`) | gauge | `1 - free / total` KV blocks, a fraction in [0, 1] as vLLM's |
    /// | `vllm:prompt_tokens_total` | counter | [`Metrics::prompt_tokens`] |
    /// | `vllm:generation_tokens_total` | counter | [`Metrics::generation_tokens`] |
    /// | `vllm:prefix_cache_queries_total` / `_hits_total` | counter | prompt tokens looked up / found at admission |
    /// | `vllm:num_preemptions_total` | counter | [`Metrics::preemptions`] |
    /// | `vllm:spec_decode_num_draft_tokens_total` / `_accepted_tokens_total` | counter | speculative draft tokens proposed / accepted |
    /// | `vllm:request_success_total{finished_reason}` | counter | `stop` and `length` per sequence, `abort` per cancelled request |
    /// | `vllm:time_to_first_token_seconds`, `vllm:time_per_output_token_seconds`, `vllm:e2e_request_latency_seconds` | histogram | [`LatencyHistograms`], vLLM's buckets |
    /// | `vllm:cache_config_info` | gauge (1) | labels `block_size`, `num_gpu_blocks` (the pool's blocks, host memory on CPU), `cache_dtype`, `enable_prefix_caching` |
    pub fn render(&self, model_name: &str) -> String {
        let mut out = String::new();
        let mut put = |name: &str, kind: &str, help: &str, v: u64| {
            out.push_str(&format!("# HELP deco_{name} {help}\n# TYPE deco_{name} {kind}\ndeco_{name} {v}\n"));
        };
        let g = |a: &AtomicUsize| a.load(Ordering::Relaxed) as u64;
        let c = |a: &AtomicU64| a.load(Ordering::Relaxed);
        put("num_requests_waiting", "gauge", "Sequences waiting for admission.", g(&self.waiting));
        put("num_requests_running", "gauge", "Sequences running.", g(&self.running));
        put("num_requests_pending", "gauge", "Requests accepted and not finished.", g(&self.pending_requests));
        put("kv_blocks_used", "gauge", "KV cache blocks in use.", g(&self.kv_blocks_used));
        put("kv_blocks_free", "gauge", "KV cache blocks free.", g(&self.kv_blocks_free));
        put("kv_blocks_total", "gauge", "KV cache blocks in the pool.", g(&self.kv_blocks_total));
        put("generation_tokens_total", "counter", "Tokens generated.", c(&self.generation_tokens));
        put("prompt_tokens_total", "counter", "Prompt tokens computed.", c(&self.prompt_tokens_computed));
        put("prefix_cache_hit_tokens_total", "counter", "Prompt tokens served from the prefix cache.", c(&self.prefix_cache_hit_tokens));
        put("requests_finished_total", "counter", "Requests finished.", c(&self.requests_finished));
        put("requests_cancelled_total", "counter", "Requests cancelled.", c(&self.requests_cancelled));
        put("preemptions_total", "counter", "Sequences preempted (recompute).", c(&self.preemptions));
        put("engine_steps_total", "counter", "Engine steps (forward passes).", c(&self.steps));
        put("engine_step_errors_total", "counter", "Failed forward passes.", c(&self.step_errors));
        put("structured_masks_total", "counter", "Structured-output token masks computed.", c(&self.structured_masks));
        put("draft_steps_total", "counter", "Forward passes of the draft model.", c(&self.draft_steps));
        put("structured_mask_nanoseconds_total", "counter", "Time computing and applying structured-output masks, in nanoseconds.", c(&self.structured_mask_ns));

        let labels = format!("model_name=\"{}\",engine=\"0\"", label_value(model_name));
        let mut vput = |name: &str, kind: &str, help: &str, series: &[(String, String)]| {
            out.push_str(&format!("# HELP vllm:{name} {help}\n# TYPE vllm:{name} {kind}\n"));
            for (suffix_and_labels, v) in series {
                out.push_str(&format!("vllm:{name}{suffix_and_labels} {v}\n"));
            }
        };
        let one = |v: String| vec![(format!("{{{labels}}}"), v)];
        let total = g(&self.kv_blocks_total);
        let usage = if total == 0 { 0.0 } else { 1.0 - g(&self.kv_blocks_free) as f64 / total as f64 };
        vput("num_requests_running", "gauge", "Number of requests in model execution batches.", &one(g(&self.running).to_string()));
        vput("num_requests_waiting", "gauge", "Number of requests waiting to be processed.", &one(g(&self.waiting).to_string()));
        vput("kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", &one(usage.to_string()));
        vput("gpu_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage. DEPRECATED: Use vllm:kv_cache_usage_perc instead.", &one(usage.to_string()));
        for (name, help, v) in [
            ("prompt_tokens", "Number of prefill tokens processed.", c(&self.prompt_tokens)),
            ("generation_tokens", "Number of generation tokens processed.", c(&self.generation_tokens)),
            ("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", c(&self.prefix_cache_queries)),
            ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", c(&self.prefix_cache_hit_tokens)),
            ("num_preemptions", "Cumulative number of preemption from the engine.", c(&self.preemptions)),
            ("spec_decode_num_draft_tokens", "Number of draft tokens.", c(&self.spec_draft_tokens)),
            ("spec_decode_num_accepted_tokens", "Number of accepted tokens.", c(&self.spec_accepted_tokens)),
        ] {
            vput(&format!("{name}_total"), "counter", help, &one(v.to_string()));
        }
        let success: Vec<(String, String)> = [("stop", c(&self.finished_stop)), ("length", c(&self.finished_length)), ("abort", c(&self.requests_cancelled))]
            .iter()
            .map(|(reason, v)| (format!("{{{labels},finished_reason=\"{reason}\"}}"), v.to_string()))
            .collect();
        vput("request_success_total", "counter", "Count of successfully processed requests.", &success);
        for (name, help, h) in [
            ("time_to_first_token_seconds", "Histogram of time to first token in seconds.", &self.latency.time_to_first_token),
            ("time_per_output_token_seconds", "Histogram of time per output token in seconds.", &self.latency.time_per_output_token),
            ("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", &self.latency.e2e_request_latency),
        ] {
            let mut series: Vec<(String, String)> = h
                .cumulative()
                .into_iter()
                .map(|(le, n)| {
                    let le = if le.is_infinite() { "+Inf".to_string() } else { format!("{le:?}") };
                    (format!("_bucket{{{labels},le=\"{le}\"}}"), n.to_string())
                })
                .collect();
            series.push((format!("_sum{{{labels}}}"), h.sum().to_string()));
            series.push((format!("_count{{{labels}}}"), h.count().to_string()));
            vput(name, "histogram", help, &series);
        }
        let info = format!(
            "{{{labels},block_size=\"{}\",num_gpu_blocks=\"{total}\",cache_dtype=\"{}\",enable_prefix_caching=\"True\"}}",
            g(&self.block_size),
            if self.kv_cache_f16.load(Ordering::Relaxed) { KvCacheDtype::F16 } else { KvCacheDtype::F32 }.name()
        );
        vput("cache_config_info", "gauge", "Information of the LLMEngine CacheConfig", &[(info, "1".to_string())]);
        out
    }
}

enum Command {
    Add { id: u64, req: Box<GenerateRequest>, machine: Option<Box<dyn StepMachine>>, events: UnboundedSender<EngineEvent>, arrival: Instant },
    Abort(u64),
}

/// Cheap, clonable access to a running engine.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
    next_id: Arc<AtomicU64>,
    /// Live counters.
    pub metrics: Arc<Metrics>,
    config: EngineConfig,
    max_context: usize,
    stopping: Arc<AtomicBool>,
    eos: Arc<Vec<u32>>,
    has_draft: bool,
    speculation: Option<Speculation>,
    medusa: Option<Arc<MedusaSetting>>,
    has_autodeco: bool,
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Command::Add { id, .. } => write!(f, "Add({id})"),
            Command::Abort(id) => write!(f, "Abort({id})"),
        }
    }
}

impl EngineHandle {
    /// The model's usable context length.
    pub fn max_context(&self) -> usize {
        self.max_context
    }

    /// The engine settings.
    pub fn config(&self) -> EngineConfig {
        self.config
    }

    /// Whether the engine has AutoDeco heads.
    pub fn has_autodeco(&self) -> bool {
        self.has_autodeco
    }

    /// Whether the engine has a second model (speculative draft or contrastive amateur).
    pub fn has_second_model(&self) -> bool {
        self.has_draft
    }

    /// Checks a request and queues it; returns its id and the channel of its events.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] (empty prompt, `n` out of range, `max_new_tokens` missing, prompt
    /// plus `max_new_tokens` beyond the context or the KV pool, invalid sampling parameters),
    /// [`Error::Overloaded`] when `max_pending_requests` requests are in flight,
    /// [`Error::EngineStopped`].
    pub fn submit(&self, req: GenerateRequest) -> Result<(u64, UnboundedReceiver<EngineEvent>)> {
        if self.stopping.load(Ordering::Relaxed) {
            return Err(Error::EngineStopped);
        }
        req.params.validate()?;
        if req.prompt.is_empty() {
            return Err(Error::InvalidRequest("the prompt is empty".into()));
        }
        if req.n == 0 || req.n > self.config.max_n {
            return Err(Error::InvalidRequest(format!("n must be in 1..={}, got {}", self.config.max_n, req.n)));
        }
        if req.autodeco == Some(true) && !self.has_autodeco {
            return Err(Error::InvalidRequest("autodeco: this server has no AutoDeco heads (deco serve --autodeco DIR)".into()));
        }
        let max_new = req
            .params
            .max_new_tokens
            .ok_or_else(|| Error::InvalidRequest("max_tokens must be given".into()))?;
        let total = req.prompt.len() + max_new;
        if total > self.max_context {
            return Err(Error::InvalidRequest(format!(
                "This model's maximum context length is {} tokens. However, you requested {total} tokens ({} in the prompt, {max_new} for the completion). Please reduce the prompt or max_tokens.",
                self.max_context,
                req.prompt.len()
            )));
        }
        let capacity = self.config.num_blocks * self.config.block_size;
        if total > capacity {
            return Err(Error::InvalidRequest(format!(
                "the request needs {total} tokens of KV cache but the server's pool holds {capacity}"
            )));
        }
        let machine = self.machine(&req)?;
        let pending = self.metrics.pending_requests.fetch_add(1, Ordering::SeqCst);
        if pending >= self.config.max_pending_requests {
            self.metrics.pending_requests.fetch_sub(1, Ordering::SeqCst);
            return Err(Error::Overloaded(self.config.max_pending_requests));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (etx, erx) = unbounded_channel();
        if self.tx.send(Command::Add { id, req: Box::new(req), machine, events: etx, arrival: Instant::now() }).is_err() {
            self.metrics.pending_requests.fetch_sub(1, Ordering::SeqCst);
            return Err(Error::EngineStopped);
        }
        Ok((id, erx))
    }

    /// The step machine of a request's strategy (or of the engine's [`Speculation`] for an
    /// eligible sampling request), checked against the request and the pool.
    fn machine(&self, req: &GenerateRequest) -> Result<Option<Box<dyn StepMachine>>> {
        let speculate = self.speculation.filter(|_| {
            req.n == 1 && req.constraint.is_none() && req.params.logprobs.is_none() && !req.uses_heads(self.has_autodeco)
        });
        let medusa = self.medusa.as_ref().filter(|_| {
            req.n == 1 && req.constraint.is_none() && req.params.logprobs.is_none() && !req.uses_heads(self.has_autodeco)
        });
        let strategy = req
            .strategy
            .or(medusa.map(|_| Strategy::Medusa))
            .or(speculate.map(|s| Strategy::Speculative { num_speculative_tokens: s.num_speculative_tokens, source: s.source, schedule: s.schedule }));
        let Some(strategy) = strategy else { return Ok(None) };
        if req.constraint.is_some() {
            return Err(Error::InvalidRequest("structured output (response_format, guided_*, tools) works with sampling only, not with another decoding strategy".into()));
        }
        match strategy {
            Strategy::EarlyExit(cfg) => {
                if cfg.min_layers == 0 || cfg.check_every == 0 || !cfg.entropy_threshold.is_finite() {
                    return Err(Error::InvalidRequest("early exit: min_layers and check_every must be >= 1 and entropy_threshold finite".into()));
                }
                if req.uses_heads(self.has_autodeco) {
                    return Err(Error::InvalidRequest("early exit cannot be combined with AutoDeco heads (they read the full model's hidden state)".into()));
                }
                Ok(None)
            }
            Strategy::Beam(b) => {
                let beam = BeamSearchParams { num_return_sequences: req.n, ..b };
                // Every beam may hold its own copy of the whole context at the end (no sharing
                // assumed): the group must fit in the pool, or it would preempt itself forever.
                let bs = self.config.block_size;
                let per_beam = (req.prompt.len() + req.params.max_new_tokens.unwrap_or(0)).div_ceil(bs) + 1;
                let need = per_beam * (beam.num_beams + 1);
                if need > self.config.num_blocks {
                    return Err(Error::InvalidRequest(format!(
                        "beam search with {} beams needs up to {need} KV blocks, the server's pool has {}",
                        beam.num_beams, self.config.num_blocks
                    )));
                }
                let m = BeamSearch::new(&req.prompt, &req.params, &beam, &self.eos, self.max_context)
                    .map_err(|e| Error::InvalidRequest(e.to_string()))?;
                Ok(Some(Box::new(m)))
            }
            Strategy::ContrastiveSearch { penalty_alpha } => {
                if req.n != 1 {
                    return Err(Error::InvalidRequest("contrastive search is deterministic: one choice per request (n = 1)".into()));
                }
                let m = ContrastiveSearch::new(&req.prompt, &req.params, penalty_alpha, &self.eos, self.max_context)
                    .map_err(|e| Error::InvalidRequest(e.to_string()))?;
                Ok(Some(Box::new(m)))
            }
            Strategy::ContrastiveDecoding(cd) => {
                if req.n != 1 {
                    return Err(Error::InvalidRequest("contrastive decoding runs one choice per request (n = 1)".into()));
                }
                if !self.has_draft {
                    return Err(Error::InvalidRequest("contrastive decoding needs an amateur model: start the engine with a second model (deco serve --amateur-model / --amateur-layers)".into()));
                }
                let m = ContrastiveDecoding::new(&req.prompt, &req.params, &cd, &self.eos, self.max_context)
                    .map_err(|e| Error::InvalidRequest(e.to_string()))?;
                Ok(Some(Box::new(m)))
            }
            Strategy::Speculative { num_speculative_tokens, source, schedule } => {
                if req.n != 1 {
                    return Err(Error::InvalidRequest("speculative decoding runs one choice per request (n = 1)".into()));
                }
                if source == DraftSource::Model && !self.has_draft {
                    return Err(Error::InvalidRequest("speculative decoding with a draft model needs an engine started with one".into()));
                }
                let m = Speculative::new(&req.prompt, &req.params, source, num_speculative_tokens, &self.eos, self.max_context)
                    .map_err(|e| Error::InvalidRequest(e.to_string()))?
                    .with_schedule(schedule);
                Ok(Some(Box::new(m)))
            }
            Strategy::Medusa => {
                let Some(ms) = &self.medusa else {
                    return Err(Error::InvalidRequest("Medusa decoding needs an engine started with Medusa heads (deco serve --medusa DIR)".into()));
                };
                if req.n != 1 {
                    return Err(Error::InvalidRequest("Medusa decoding runs one choice per request (n = 1)".into()));
                }
                if req.params.logprobs.is_some() {
                    return Err(Error::InvalidRequest("Medusa decoding does not report logprobs".into()));
                }
                let m = Medusa::new(&req.prompt, &req.params, ms.heads.clone(), ms.tree.clone(), ms.acceptance, &self.eos, self.max_context)
                    .map_err(|e| Error::InvalidRequest(e.to_string()))?;
                Ok(Some(Box::new(m)))
            }
        }
    }

    /// Cancels a request (its blocks are freed at the next step). Dropping the event receiver
    /// has the same effect.
    pub fn abort(&self, id: u64) {
        let _ = self.tx.send(Command::Abort(id));
    }

    /// Refuses new requests from now on (graceful shutdown: running ones finish).
    pub fn stop_accepting(&self) {
        self.stopping.store(true, Ordering::Relaxed);
    }
}

/// UTF-8-safe incremental detokenization (the `tokenizers` `DecodeStream` algorithm, as in
/// [`deco_formats::tokenizer::StreamDecoder`], without borrowing the tokenizer).
#[derive(Debug, Default)]
struct Detok {
    ids: Vec<u32>,
    prefix: String,
    prefix_index: usize,
}

impl Detok {
    fn step(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        if self.prefix.is_empty() && !self.ids.is_empty() {
            let p = tok.decode(&self.ids, true)?;
            if !p.ends_with('\u{FFFD}') {
                self.prefix = p;
                self.prefix_index = self.ids.len();
            }
        }
        self.ids.push(id);
        let text = tok.decode(&self.ids, true)?;
        if text.len() > self.prefix.len() && !text.ends_with('\u{FFFD}') && text.starts_with(self.prefix.as_str()) {
            let new_text = text[self.prefix.len()..].to_owned();
            let new_prefix_index = self.ids.len() - self.prefix_index;
            self.ids.drain(..self.prefix_index);
            self.prefix = tok.decode(&self.ids, true)?;
            self.prefix_index = new_prefix_index;
            Ok(new_text)
        } else {
            Ok(String::new())
        }
    }

    fn flush(&mut self, tok: &Tokenizer) -> Result<String> {
        let text = tok.decode(&self.ids, true)?;
        let rest = if text.len() > self.prefix.len() { text.get(self.prefix.len()..).unwrap_or("").to_owned() } else { String::new() };
        self.ids.clear();
        self.prefix.clear();
        self.prefix_index = 0;
        Ok(rest)
    }
}

struct SeqState {
    req: u64,
    index: usize,
    sampler: Sampler,
    matcher: StopStringMatcher,
    detok: Detok,
    generated: Vec<u32>,
    /// When this sequence's last token was sampled.
    last_token: Option<Instant>,
    /// Its structured-output state.
    constraint: Option<Constraint>,
}

struct ReqState {
    events: UnboundedSender<EngineEvent>,
    prompt: Vec<u32>,
    params: SamplingParams,
    stopping: StoppingCriteria,
    n: usize,
    forked: bool,
    seqs: Vec<SeqId>,
    want_logprobs: Option<usize>,
    /// When the request was submitted.
    arrival: Instant,
    /// Whether a token has been sampled for it yet.
    first_token_seen: bool,
    /// Prompt tokens found in the prefix cache when it was first scheduled.
    cached_tokens: Option<usize>,
    /// The step machine of a [`Strategy`] request.
    machine: Option<MachineState>,
    /// Early exit for the request's decode tokens.
    early_exit: Option<EarlyExitConfig>,
    /// Whether the AutoDeco heads choose its temperature and top-p.
    use_heads: bool,
}

/// Logits rows and hidden-state rows collected for one fed sequence.
type CollectedRows = (Vec<Vec<f32>>, Vec<Vec<f32>>);

/// A request driven by a [`StepMachine`].
struct MachineState {
    machine: Box<dyn StepMachine>,
    /// Request-local target sequence ids to engine ids.
    seqs: HashMap<Local, SeqId>,
    /// Target sequences fed since the last advance: (local id, rows wanted, hidden wanted).
    fed: Vec<(Local, usize, bool)>,
    /// Rows collected for fed target sequences, by local id.
    rows: HashMap<Local, CollectedRows>,
    /// Request-local draft sequence ids to the draft cache's ids.
    draft_seqs: HashMap<Local, SeqId>,
    /// Draft feeds not run yet.
    draft_feeds: Vec<(Local, Vec<u32>)>,
    /// Draft sequences fed since the last advance, and their rows.
    draft_fed: Vec<Local>,
    draft_rows: HashMap<Local, Vec<f32>>,
    /// Per choice: detokenizer, stop strings, tokens released, done.
    choices: Vec<ChoiceOut>,
}

/// The client-side state of one choice of a step-machine request.
struct ChoiceOut {
    detok: Detok,
    matcher: StopStringMatcher,
    released: usize,
    done: bool,
}

impl MachineState {
    /// Whether every fed sequence has its rows (target: and is still fully computed, so a
    /// sequence preempted after reporting is waited for again).
    fn ready(&self, sched: &Scheduler) -> bool {
        if !self.draft_fed.is_empty() {
            return self.draft_feeds.is_empty() && self.draft_fed.iter().all(|l| self.draft_rows.contains_key(l));
        }
        !self.fed.is_empty()
            && self.fed.iter().all(|&(l, want, _)| {
                self.rows.get(&l).is_some_and(|r| r.0.len() == want)
                    && self.seqs.get(&l).and_then(|&sid| sched.get(sid)).is_some_and(|s| s.num_computed == s.tokens.len())
            })
    }

    /// Rows wanted from a chunk of target sequence `local` covering positions
    /// `start..start + len` of a sequence of `total` tokens: the positions in the fed window.
    fn rows_in_chunk(&self, local: Local, start: usize, len: usize, total: usize) -> (usize, bool) {
        match self.fed.iter().find(|f| f.0 == local) {
            Some(&(_, want, hidden)) => ((start + len).saturating_sub(start.max(total.saturating_sub(want))), hidden),
            None => (0, false),
        }
    }
}

/// The draft model with its own paged cache.
struct DraftRunner {
    model: Llama,
    num_layers: usize,
    cache: PagedKvCache,
    next_seq: SeqId,
}

struct Engine {
    model: Llama,
    tokenizer: Arc<Tokenizer>,
    cache: PagedKvCache,
    sched: Scheduler,
    rx: mpsc::Receiver<Command>,
    metrics: Arc<Metrics>,
    reqs: HashMap<u64, ReqState>,
    seqs: HashMap<SeqId, SeqState>,
    /// Sequences of step-machine requests: their request and local id.
    machine_seqs: HashMap<SeqId, (u64, Local)>,
    next_seq: SeqId,
    eos: Vec<u32>,
    /// AutoDeco heads: when present, every sampled token uses the predicted temperature and
    /// top-p (`T × temperature`, `clamp(P × top_p)`; greedy requests stay greedy).
    autodeco: Option<HostHeads>,
    /// The draft model of speculative requests.
    draft: Option<DraftRunner>,
}

/// Starts the engine thread for `model`; returns the handle and the thread's join handle (it
/// exits when every handle is dropped and no work is left).
///
/// # Errors
/// [`Error::InvalidRequest`] for an invalid cache geometry; [`Error::Io`] if the thread cannot
/// be spawned.
pub fn spawn_engine(model: Llama, tokenizer: Arc<Tokenizer>, config: EngineConfig) -> Result<(EngineHandle, std::thread::JoinHandle<()>)> {
    spawn_engine_with(model, tokenizer, config, None)
}

/// [`spawn_engine`] with AutoDeco heads: every sampled token of every request is drawn with the
/// heads' per-token temperature and top-p combined with the request's
/// ([`deco_autodeco::decode::combine`]); greedy requests stay greedy.
///
/// # Errors
/// As [`spawn_engine`], and [`Error::InvalidRequest`] for heads of another hidden size or
/// vocabulary.
pub fn spawn_engine_with(
    model: Llama,
    tokenizer: Arc<Tokenizer>,
    config: EngineConfig,
    autodeco: Option<HostHeads>,
) -> Result<(EngineHandle, std::thread::JoinHandle<()>)> {
    spawn_engine_opts(model, tokenizer, config, EngineOptions { autodeco, ..EngineOptions::default() })
}

/// [`spawn_engine`] with the optional parts of [`EngineOptions`]: AutoDeco heads and the draft
/// model of speculative decoding (its paged cache gets `config.num_blocks` blocks of its own).
///
/// # Errors
/// As [`spawn_engine_with`], and [`Error::InvalidRequest`] for a draft model of another
/// vocabulary or a layer count outside `1..=` its depth.
pub fn spawn_engine_opts(
    model: Llama,
    tokenizer: Arc<Tokenizer>,
    config: EngineConfig,
    options: EngineOptions,
) -> Result<(EngineHandle, std::thread::JoinHandle<()>)> {
    let EngineOptions { autodeco, draft, speculation, medusa } = options;
    if let Some(ms) = &medusa
        && ms.tree.depth() > ms.heads.num_heads()
    {
        return Err(Error::InvalidRequest(format!(
            "the Medusa tree is {} deep, the heads predict {} positions",
            ms.tree.depth(),
            ms.heads.num_heads()
        )));
    }
    if let Some(sp) = speculation {
        if sp.num_speculative_tokens == 0 {
            return Err(Error::InvalidRequest("num_speculative_tokens must be at least 1".into()));
        }
        if sp.source == DraftSource::Model && draft.is_none() {
            return Err(Error::InvalidRequest("speculative decoding with a draft model needs the draft model".into()));
        }
    }
    let draft = match draft {
        None => None,
        Some(d) => {
            if d.model.config.vocab_size != model.config.vocab_size {
                return Err(Error::InvalidRequest(format!(
                    "the draft model has vocabulary {}, the served model {}",
                    d.model.config.vocab_size, model.config.vocab_size
                )));
            }
            if d.num_layers == 0 || d.num_layers > d.model.num_layers() {
                return Err(Error::InvalidRequest(format!("draft layers must be in 1..={}, got {}", d.model.num_layers(), d.num_layers)));
            }
            let dc = &d.model.config;
            let shape = CacheShape {
                n_layers: d.num_layers,
                kv_heads: dc.num_key_value_heads,
                head_dim: dc.head_dim,
                block_size: config.block_size,
                num_blocks: config.num_blocks,
            };
            let cache = PagedKvCache::with_dtype(shape, config.kv_cache_dtype, d.model.device())?;
            Some(DraftRunner { model: d.model, num_layers: d.num_layers, cache, next_seq: 1 })
        }
    };
    if let Some(h) = &autodeco
        && (h.config().hidden_size != model.config.hidden_size || h.config().vocab_size != model.config.vocab_size)
    {
        return Err(Error::InvalidRequest(format!(
            "AutoDeco heads for hidden size {} / vocabulary {}, the model has {} / {}",
            h.config().hidden_size,
            h.config().vocab_size,
            model.config.hidden_size,
            model.config.vocab_size
        )));
    }
    let cfg = &model.config;
    let shape = CacheShape {
        n_layers: model.num_layers(),
        kv_heads: cfg.num_key_value_heads,
        head_dim: cfg.head_dim,
        block_size: config.block_size,
        num_blocks: config.num_blocks,
    };
    let cache = PagedKvCache::with_dtype(shape, config.kv_cache_dtype, model.device())?;
    let (tx, rx) = mpsc::channel();
    let metrics = Arc::new(Metrics::default());
    metrics.kv_blocks_total.store(config.num_blocks, Ordering::Relaxed);
    metrics.kv_blocks_free.store(config.num_blocks, Ordering::Relaxed);
    metrics.block_size.store(config.block_size, Ordering::Relaxed);
    metrics.kv_cache_f16.store(config.kv_cache_dtype == KvCacheDtype::F16, Ordering::Relaxed);
    let handle = EngineHandle {
        tx,
        next_id: Arc::new(AtomicU64::new(1)),
        metrics: metrics.clone(),
        config,
        max_context: model.max_context(),
        stopping: Arc::new(AtomicBool::new(false)),
        eos: Arc::new(tokenizer.eos_token_ids().to_vec()),
        has_draft: draft.is_some(),
        speculation,
        medusa: medusa.map(Arc::new),
        has_autodeco: autodeco.is_some(),
    };
    let eos = tokenizer.eos_token_ids().to_vec();
    let mut engine = Engine {
        model,
        tokenizer,
        cache,
        sched: Scheduler::new(config.scheduler),
        rx,
        metrics,
        reqs: HashMap::new(),
        seqs: HashMap::new(),
        machine_seqs: HashMap::new(),
        next_seq: 1,
        eos,
        autodeco,
        draft,
    };
    let join = std::thread::Builder::new().name("deco-engine".into()).spawn(move || engine.run())?;
    Ok((handle, join))
}

impl Engine {
    fn run(&mut self) {
        loop {
            // Block while idle; poll otherwise.
            if self.sched.is_idle() {
                match self.rx.recv_timeout(Duration::from_millis(200)) {
                    Ok(cmd) => self.command(cmd),
                    Err(mpsc::RecvTimeoutError::Timeout) => continue,
                    Err(mpsc::RecvTimeoutError::Disconnected) => return,
                }
            }
            while let Ok(cmd) = self.rx.try_recv() {
                self.command(cmd);
            }
            let gone: Vec<u64> = self.reqs.iter().filter(|(_, r)| r.events.is_closed()).map(|(&id, _)| id).collect();
            for id in gone {
                self.cancel(id);
            }
            if !self.sched.is_idle() {
                self.step();
            }
            self.publish();
        }
    }

    fn publish(&self) {
        let m = &self.metrics;
        m.waiting.store(self.sched.num_waiting(), Ordering::Relaxed);
        m.running.store(self.sched.num_running(), Ordering::Relaxed);
        m.kv_blocks_used.store(self.cache.pool().num_used(), Ordering::Relaxed);
        m.kv_blocks_free.store(self.cache.pool().num_free(), Ordering::Relaxed);
        m.preemptions.store(self.sched.preemptions(), Ordering::Relaxed);
        m.prefix_cache_queries.store(self.sched.prefix_cache_queries(), Ordering::Relaxed);
        m.prefix_cache_hit_tokens.store(self.sched.prefix_cache_hits(), Ordering::Relaxed);
    }

    fn command(&mut self, cmd: Command) {
        match cmd {
            Command::Abort(id) => self.cancel(id),
            Command::Add { id, req, machine, events, arrival } => {
                let req = *req;
                let use_heads = req.uses_heads(self.autodeco.is_some());
                let params = req.params;
                let make = || -> Result<(StoppingCriteria, Sampler, StopStringMatcher)> {
                    Ok((StoppingCriteria::from_params(&params, &self.eos)?, engine_sampler(&params)?, StopStringMatcher::from_params(&params)?))
                };
                let (stopping, sampler, matcher) = match make() {
                    Ok(x) => x,
                    Err(e) => {
                        let _ = events.send(EngineEvent::Failed(e.to_string()));
                        self.metrics.pending_requests.fetch_sub(1, Ordering::SeqCst);
                        return;
                    }
                };
                let sid = self.next_seq;
                self.next_seq += 1;
                let prompt_rows = machine.as_ref().map_or((1, false), |m| m.prompt_rows());
                if prompt_rows.0 > 1 {
                    self.sched.add_uncached(sid, req.prompt.clone());
                } else {
                    self.sched.add(sid, req.prompt.clone());
                }
                let machine = match machine.map(|m| -> Result<MachineState> {
                    let choices = (0..m.num_choices())
                        .map(|_| Ok(ChoiceOut { detok: Detok::default(), matcher: StopStringMatcher::from_params(&params)?, released: 0, done: false }))
                        .collect::<Result<Vec<_>>>()?;
                    Ok(MachineState {
                        machine: m,
                        seqs: HashMap::from([(0, sid)]),
                        fed: vec![(0, prompt_rows.0.clamp(1, req.prompt.len()), prompt_rows.1)],
                        rows: HashMap::new(),
                        draft_seqs: HashMap::new(),
                        draft_feeds: Vec::new(),
                        draft_fed: Vec::new(),
                        draft_rows: HashMap::new(),
                        choices,
                    })
                }) {
                    None => None,
                    Some(Ok(m)) => {
                        self.machine_seqs.insert(sid, (id, 0));
                        Some(m)
                    }
                    Some(Err(e)) => {
                        self.sched.remove(sid, &mut self.cache);
                        let _ = events.send(EngineEvent::Failed(e.to_string()));
                        self.metrics.pending_requests.fetch_sub(1, Ordering::SeqCst);
                        return;
                    }
                };
                if machine.is_none() {
                    self.seqs.insert(sid, SeqState { req: id, index: 0, sampler, matcher, detok: Detok::default(), generated: Vec::new(), last_token: None, constraint: req.constraint });
                }
                let n = machine.as_ref().map_or(req.n, |m| m.choices.len());
                self.reqs.insert(
                    id,
                    ReqState {
                        events,
                        prompt: req.prompt,
                        want_logprobs: params.logprobs,
                        params,
                        stopping,
                        n,
                        forked: n == 1 || machine.is_some(),
                        seqs: vec![sid],
                        arrival,
                        first_token_seen: false,
                        cached_tokens: None,
                        machine,
                        early_exit: match req.strategy {
                            Some(Strategy::EarlyExit(cfg)) => Some(cfg),
                            _ => None,
                        },
                        use_heads,
                    },
                );
            }
        }
    }

    fn drop_seq(&mut self, sid: SeqId) {
        self.sched.remove(sid, &mut self.cache);
        self.seqs.remove(&sid);
        self.machine_seqs.remove(&sid);
    }

    /// The request a sequence belongs to.
    fn req_of(&self, sid: SeqId) -> Option<u64> {
        self.seqs.get(&sid).map(|s| s.req).or_else(|| self.machine_seqs.get(&sid).map(|&(r, _)| r))
    }

    /// Frees every sequence of a request that left `reqs`: its target sequences and, for a
    /// step machine, its draft-model sequences.
    fn free_request(&mut self, r: ReqState) {
        for sid in r.seqs {
            self.drop_seq(sid);
        }
        if let (Some(m), Some(d)) = (r.machine, self.draft.as_mut()) {
            for sid in m.draft_seqs.into_values() {
                let _ = d.cache.free_seq(sid);
            }
        }
    }

    fn cancel(&mut self, id: u64) {
        if let Some(r) = self.reqs.remove(&id) {
            self.free_request(r);
            self.metrics.requests_cancelled.fetch_add(1, Ordering::Relaxed);
            self.metrics.pending_requests.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Runs the pending draft-model feeds of every step-machine request, one batched forward
    /// of the draft model per round, advancing the machines with the rows, until no machine
    /// feeds its draft any more (they have then fed the target, or finished).
    fn run_drafts(&mut self) {
        loop {
            let mut ids: Vec<u64> = self.reqs.iter().filter(|(_, r)| r.machine.as_ref().is_some_and(|m| !m.draft_feeds.is_empty())).map(|(&id, _)| id).collect();
            if ids.is_empty() {
                return;
            }
            ids.sort_unstable();
            let Some(d) = self.draft.as_mut() else {
                for id in ids {
                    self.fail(id, "the strategy fed a draft model, but this engine has none".into());
                }
                return;
            };
            // (request, local, draft sequence, tokens)
            let mut work: Vec<(u64, Local, SeqId, Vec<u32>)> = Vec::new();
            let mut failed: Vec<(u64, String)> = Vec::new();
            for &id in &ids {
                let Some(m) = self.reqs.get_mut(&id).and_then(|r| r.machine.as_mut()) else { continue };
                for (local, tokens) in m.draft_feeds.drain(..) {
                    let sid = *m.draft_seqs.entry(local).or_insert_with(|| {
                        d.next_seq += 1;
                        d.next_seq
                    });
                    let total = deco_model::KvCache::seq_len(&d.cache, sid) + tokens.len();
                    if let Err(e) = d.cache.reserve(sid, total) {
                        failed.push((id, format!("draft model cache: {e}")));
                        continue;
                    }
                    m.draft_fed.push(local);
                    work.push((id, local, sid, tokens));
                }
            }
            work.retain(|w| !failed.iter().any(|f| f.0 == w.0));
            if !work.is_empty() {
                let inputs: Vec<SeqInput<'_>> = work.iter().map(|w| SeqInput { seq: w.2, tokens: &w.3, tree: None }).collect();
                let ones = vec![1; inputs.len()];
                let out = d.model.forward_rows(&inputs, &mut d.cache, &ones, d.num_layers).and_then(|o| o.logits_rows());
                self.metrics.draft_steps.fetch_add(1, Ordering::Relaxed);
                match out {
                    Ok(rows) => {
                        for (w, row) in work.iter().zip(rows) {
                            if let Some(m) = self.reqs.get_mut(&w.0).and_then(|r| r.machine.as_mut()) {
                                m.draft_rows.insert(w.1, row);
                            }
                        }
                    }
                    Err(e) => failed.extend(work.iter().map(|w| (w.0, format!("draft forward pass failed: {e}")))),
                }
            }
            for (id, msg) in failed {
                self.fail(id, msg);
            }
            for id in ids {
                self.advance_machine(id);
            }
        }
    }

    fn fail(&mut self, id: u64, msg: String) {
        if let Some(r) = self.reqs.get(&id) {
            let _ = r.events.send(EngineEvent::Failed(msg));
        }
        self.cancel(id);
    }

    fn step(&mut self) {
        self.run_drafts();
        let plan = self.sched.schedule(&mut self.cache);
        // A step-machine sequence preempted after it reported rows reports them again once
        // recomputed.
        for sid in &plan.preempted {
            if let Some(&(req_id, local)) = self.machine_seqs.get(sid)
                && let Some(m) = self.reqs.get_mut(&req_id).and_then(|r| r.machine.as_mut())
            {
                m.rows.remove(&local);
            }
        }
        if plan.chunks.is_empty() {
            return;
        }
        for c in &plan.chunks {
            // A token tree's nodes are not a continuation: their ids are not recorded, so that
            // no block of tree keys enters the prefix cache (the kept path is recorded when
            // the strategy keeps it).
            if c.tree.is_none() {
                self.cache.record_tokens(c.seq, &c.tokens);
            }
            // A request's first chunk starts after the prompt tokens the prefix cache held.
            let req = self.req_of(c.seq);
            if let Some(r) = req.and_then(|r| self.reqs.get_mut(&r)) {
                r.cached_tokens.get_or_insert(c.start);
            }
            let prompt_len = req.and_then(|r| self.reqs.get(&r)).map_or(0, |r| r.prompt.len());
            let prompt_part = prompt_len.saturating_sub(c.start).min(c.tokens.len());
            self.metrics.prompt_tokens_computed.fetch_add(prompt_part as u64, Ordering::Relaxed);
        }
        let inputs: Vec<SeqInput<'_>> = plan.chunks.iter().map(|c| SeqInput { seq: c.seq, tokens: &c.tokens, tree: c.tree.as_deref() }).collect();
        // Rows per chunk: the last token's for sampling; for a step machine's sequence, the
        // positions of the chunk in the window its feed asked rows for (at least one row is
        // computed; extra rows are dropped).
        let wanted: Vec<(usize, bool)> = plan
            .chunks
            .iter()
            .map(|c| match self.machine_seqs.get(&c.seq) {
                Some(&(req_id, local)) => {
                    let total = self.sched.get(c.seq).map_or(0, |s| s.tokens.len());
                    self.reqs.get(&req_id).and_then(|r| r.machine.as_ref()).map_or((0, false), |m| m.rows_in_chunk(local, c.start, c.tokens.len(), total))
                }
                None => (usize::from(c.samples), false),
            })
            .collect();
        let counts: Vec<usize> = wanted.iter().map(|w| w.0.max(1)).collect();
        let with_hidden = plan.chunks.iter().any(|c| self.req_of(c.seq).and_then(|r| self.reqs.get(&r)).is_some_and(|r| r.use_heads)) || wanted.iter().any(|w| w.1);
        // Decode tokens of early-exit requests run alone, through their own depth.
        let exits: Vec<Option<EarlyExitConfig>> = plan
            .chunks
            .iter()
            .map(|c| if c.tokens.len() == 1 { self.req_of(c.seq).and_then(|r| self.reqs.get(&r)).and_then(|r| r.early_exit) } else { None })
            .collect();
        let t_forward = Instant::now();
        let out = self.forward_split(&inputs, &counts, &exits, with_hidden);
        self.metrics.forward_ns.fetch_add(t_forward.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.metrics.steps.fetch_add(1, Ordering::Relaxed);
        let (all_rows, all_hidden, ranges) = match out {
            Ok(r) => r,
            Err(e) => {
                self.metrics.step_errors.fetch_add(1, Ordering::Relaxed);
                let msg = format!("forward pass failed: {e}");
                let reqs: Vec<u64> = plan.chunks.iter().filter_map(|c| self.req_of(c.seq)).collect();
                for r in reqs {
                    self.fail(r, msg.clone());
                }
                return;
            }
        };
        // AutoDeco heads of every sampling row of the step at once, in parallel (rows of
        // sequences with structured output are masked first, so theirs run in `sample_one`).
        let mut predicted: Vec<Option<deco_autodeco::heads::HeadOutput>> = vec![None; plan.chunks.len()];
        if let Some(heads) = &self.autodeco {
            let todo: Vec<(usize, usize)> = plan
                .chunks
                .iter()
                .enumerate()
                .filter(|(ci, c)| {
                    c.samples
                        && !self.machine_seqs.contains_key(&c.seq)
                        && self.seqs.get(&c.seq).is_some_and(|s| s.constraint.is_none() && self.reqs.get(&s.req).is_some_and(|r| r.use_heads))
                        && all_hidden.len() >= ranges[*ci].end
                        && !ranges[*ci].is_empty()
                })
                .map(|(ci, _)| (ci, ranges[ci].end - 1))
                .collect();
            if !todo.is_empty() {
                let t = Instant::now();
                let outs: Vec<(usize, Option<deco_autodeco::heads::HeadOutput>)> = {
                    use rayon::prelude::*;
                    todo.par_iter().map(|&(ci, r)| (ci, heads.predict(&all_hidden[r], &all_rows[r]).ok())).collect()
                };
                for (ci, o) in outs {
                    predicted[ci] = o;
                }
                self.metrics.autodeco_heads_ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
            }
        }
        let mut presampled = self.presample(&plan.chunks, &all_rows, &ranges);
        let mut machine_reqs = Vec::new();
        for (ci, c) in plan.chunks.iter().enumerate() {
            self.sched.computed(c.seq, c.tokens.len());
            let range = ranges[ci].clone();
            if let Some(&(req_id, local)) = self.machine_seqs.get(&c.seq) {
                let (n, hidden) = wanted[ci];
                if n > 0
                    && let Some(m) = self.reqs.get_mut(&req_id).and_then(|r| r.machine.as_mut())
                {
                    let keep = range.end - n..range.end;
                    let e = m.rows.entry(local).or_default();
                    e.0.extend(all_rows[keep.clone()].iter().cloned());
                    if hidden {
                        e.1.extend(all_hidden[keep].iter().cloned());
                    }
                    if !machine_reqs.contains(&req_id) {
                        machine_reqs.push(req_id);
                    }
                }
                continue;
            }
            if !c.samples {
                continue;
            }
            let row = all_rows[range.end - 1].clone();
            let hidden_row = all_hidden.get(range.end - 1).map(Vec::as_slice);
            let Some(req_id) = self.seqs.get(&c.seq).map(|s| s.req) else { continue };
            // n > 1: fork the prefilled prompt into n sequences.
            let mut targets = vec![c.seq];
            if let Some(r) = self.reqs.get_mut(&req_id)
                && !r.forked
            {
                r.forked = true;
                let (n, params) = (r.n, r.params.clone());
                for i in 1..n {
                    let child = self.next_seq;
                    self.next_seq += 1;
                    let mut p = params.clone();
                    p.seed = params.seed.map(|s| s.wrapping_add(i as u64));
                    let made = (|| -> Result<(Sampler, StopStringMatcher)> {
                        self.cache.fork(c.seq, child)?;
                        Ok((engine_sampler(&p)?, StopStringMatcher::from_params(&p)?))
                    })();
                    match made {
                        Ok((sampler, matcher)) => {
                            let tokens = self.sched.get(c.seq).map(|s| s.tokens.clone()).unwrap_or_default();
                            let num_computed = tokens.len();
                            self.sched.add_running(SchedSeq { id: child, tokens, num_computed, tree: None });
                            let constraint = self.seqs.get(&c.seq).and_then(|s| s.constraint.clone());
                            self.seqs.insert(child, SeqState { req: req_id, index: i, sampler, matcher, detok: Detok::default(), generated: Vec::new(), last_token: None, constraint });
                            if let Some(r) = self.reqs.get_mut(&req_id) {
                                r.seqs.push(child);
                            }
                            targets.push(child);
                        }
                        Err(e) => {
                            self.fail(req_id, format!("forking sequence: {e}"));
                            break;
                        }
                    }
                }
            }
            for sid in targets {
                let mut row = row.clone();
                let pre = if sid == c.seq { presampled[ci].take() } else { None };
                if let Err(e) = self.sample_one(sid, &mut row, hidden_row, predicted[ci], pre) {
                    self.fail(req_id, e.to_string());
                    break;
                }
            }
        }
        for req_id in machine_reqs {
            self.advance_machine(req_id);
        }
    }

    /// One step's forward: the batched forward of every chunk, except decode tokens of
    /// early-exit requests (`exits[i]`), which run [`Llama::forward_early_exit`] one by one.
    /// Returns the logits rows, the hidden rows (when `with_hidden`; empty for early-exit
    /// rows) and each chunk's row range, in chunk order.
    #[allow(clippy::type_complexity)]
    fn forward_split(
        &mut self,
        inputs: &[SeqInput<'_>],
        counts: &[usize],
        exits: &[Option<EarlyExitConfig>],
        with_hidden: bool,
    ) -> deco_model::Result<(Vec<Vec<f32>>, Vec<Vec<f32>>, Vec<std::ops::Range<usize>>)> {
        let batched: Vec<usize> = (0..inputs.len()).filter(|&i| exits[i].is_none()).collect();
        let (mut b_logits, mut b_hidden, mut b_ranges) = (Vec::new(), Vec::new(), Vec::new());
        if !batched.is_empty() {
            let b_inputs: Vec<SeqInput<'_>> = batched.iter().map(|&i| inputs[i]).collect();
            let b_counts: Vec<usize> = batched.iter().map(|&i| counts[i]).collect();
            let o = self.model.forward_rows(&b_inputs, &mut self.cache, &b_counts, self.model.num_layers())?;
            b_logits = o.logits_rows()?;
            if with_hidden {
                b_hidden = deco_model::host::to_host_rows(o.hidden)?;
            }
            b_ranges = o.rows;
        }
        if batched.len() == inputs.len() {
            return Ok((b_logits, b_hidden, b_ranges));
        }
        let (mut logits, mut hidden, mut ranges) = (Vec::new(), Vec::new(), Vec::with_capacity(inputs.len()));
        let mut b = 0;
        let depth = self.model.num_layers() as u64;
        for (i, inp) in inputs.iter().enumerate() {
            let start = logits.len();
            match exits[i] {
                Some(cfg) => {
                    let step = self.model.forward_early_exit(inp.seq, inp.tokens[0], &mut self.cache, &cfg)?;
                    self.metrics.early_exit_layers_run.fetch_add(step.exit_layer as u64, Ordering::Relaxed);
                    self.metrics.early_exit_layers_total.fetch_add(depth, Ordering::Relaxed);
                    logits.push(step.logits);
                    if with_hidden {
                        hidden.push(Vec::new());
                    }
                }
                None => {
                    let r = b_ranges[b].clone();
                    logits.extend(b_logits[r.clone()].iter().cloned());
                    if with_hidden {
                        hidden.extend(b_hidden[r].iter().cloned());
                    }
                    b += 1;
                }
            }
            ranges.push(start..logits.len());
        }
        Ok((logits, hidden, ranges))
    }

    /// Advances the step machine of `req_id` once every sequence it fed has its rows (see
    /// [`MachineState::ready`]), then applies its cache operations and releases its output.
    fn advance_machine(&mut self, req_id: u64) {
        let Some(r) = self.reqs.get_mut(&req_id) else { return };
        let Some(m) = r.machine.as_mut() else { return };
        if !m.ready(&self.sched) {
            return;
        }
        let rows: Vec<SeqRows> = if m.draft_fed.is_empty() {
            let fed = std::mem::take(&mut m.fed);
            fed.into_iter()
                .filter_map(|(seq, _, _)| m.rows.remove(&seq).map(|(logits, hidden)| SeqRows { seq, role: Role::Target, logits, hidden }))
                .collect()
        } else {
            let fed = std::mem::take(&mut m.draft_fed);
            fed.into_iter().filter_map(|seq| m.draft_rows.remove(&seq).map(|row| SeqRows { seq, role: Role::Draft, logits: vec![row], hidden: Vec::new() })).collect()
        };
        m.rows.clear();
        m.draft_rows.clear();
        let step = match m.machine.advance(rows) {
            Ok(s) => s,
            Err(e) => return self.fail(req_id, e.to_string()),
        };
        self.metrics.spec_draft_tokens.fetch_add(step.drafted as u64, Ordering::Relaxed);
        self.metrics.spec_accepted_tokens.fetch_add(step.accepted as u64, Ordering::Relaxed);
        let last = step.is_final();
        if let Err(e) = self.apply_ops(req_id, step.ops) {
            return self.fail(req_id, format!("strategy step: {e}"));
        }
        let all_done = match self.release(req_id, step.output) {
            Ok(done) => done,
            Err(e) => return self.fail(req_id, e.to_string()),
        };
        if (last || all_done)
            && let Some(r) = self.reqs.remove(&req_id)
        {
            self.metrics.latency.e2e_request_latency.observe(r.arrival.elapsed().as_secs_f64());
            self.free_request(r);
            self.metrics.requests_finished.fetch_add(1, Ordering::Relaxed);
            self.metrics.pending_requests.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Applies a step machine's cache operations to the scheduler, the paged cache and the
    /// draft model's cache.
    fn apply_ops(&mut self, req_id: u64, ops: Vec<Op>) -> Result<()> {
        let unknown = |l: Local| Error::InvalidRequest(format!("the strategy used sequence {l}, which it does not hold"));
        let (mut target_feeds, mut draft_feeds) = (false, false);
        for op in ops {
            let Some(r) = self.reqs.get_mut(&req_id) else { return Ok(()) };
            let Some(m) = r.machine.as_mut() else { return Ok(()) };
            match op {
                Op::Fork { from, to } => {
                    let src = *m.seqs.get(&from).ok_or_else(|| unknown(from))?;
                    if m.seqs.contains_key(&to) {
                        return Err(Error::InvalidRequest(format!("the strategy forked into sequence {to}, which exists")));
                    }
                    let child = self.next_seq;
                    self.next_seq += 1;
                    self.cache.fork(src, child)?;
                    let tokens = self.sched.get(src).map(|s| s.tokens.clone()).unwrap_or_default();
                    let num_computed = tokens.len();
                    self.sched.add_running(SchedSeq { id: child, tokens, num_computed, tree: None });
                    m.seqs.insert(to, child);
                    r.seqs.push(child);
                    self.machine_seqs.insert(child, (req_id, to));
                }
                Op::Feed { seq, tokens, rows, hidden } => {
                    let sid = *m.seqs.get(&seq).ok_or_else(|| unknown(seq))?;
                    if tokens.is_empty() || rows == 0 || rows > tokens.len() {
                        return Err(Error::InvalidRequest(format!("the strategy fed {} tokens wanting {rows} rows", tokens.len())));
                    }
                    for t in tokens {
                        self.sched.push_token(sid, t);
                    }
                    m.fed.push((seq, rows, hidden));
                    target_feeds = true;
                }
                Op::FeedTree { seq, tokens, parents } => {
                    let sid = *m.seqs.get(&seq).ok_or_else(|| unknown(seq))?;
                    let n = tokens.len();
                    let budget = self.sched.config().max_num_batched_tokens;
                    if n == 0 || parents.len() != n || parents.iter().enumerate().any(|(i, p)| p.is_some_and(|p| p >= i)) {
                        return Err(Error::InvalidRequest(format!("the strategy fed a token tree of {n} nodes with invalid parents {parents:?}")));
                    }
                    if n > budget {
                        return Err(Error::InvalidRequest(format!("a token tree of {n} nodes exceeds the step budget of {budget} tokens (max_num_batched_tokens)")));
                    }
                    if !self.sched.set_tree(sid, &tokens, parents) {
                        return Err(Error::InvalidRequest(format!("the strategy fed a token tree to sequence {seq}, which has uncomputed tokens or a pending tree")));
                    }
                    m.fed.push((seq, n, true));
                    target_feeds = true;
                }
                Op::KeepTreePath { seq, path } => {
                    let sid = *m.seqs.get(&seq).ok_or_else(|| unknown(seq))?;
                    if path.windows(2).any(|w| w[0] >= w[1]) {
                        return Err(Error::InvalidRequest(format!("tree path {path:?} is not increasing")));
                    }
                    let (start, kept) = self
                        .sched
                        .keep_tree_path(sid, &path)
                        .ok_or_else(|| Error::InvalidRequest(format!("the strategy kept tree nodes {path:?} of sequence {seq}, which has no such computed tree")))?;
                    deco_model::KvCache::keep_rows(&mut self.cache, sid, start, &path)?;
                    self.cache.record_computed(sid, &kept);
                }
                Op::Truncate { seq, len } => {
                    let sid = *m.seqs.get(&seq).ok_or_else(|| unknown(seq))?;
                    self.sched.truncate(sid, len);
                    if deco_model::KvCache::seq_len(&self.cache, sid) > len {
                        deco_model::KvCache::truncate(&mut self.cache, sid, len)?;
                    }
                }
                Op::Remove(seq) => {
                    let sid = m.seqs.remove(&seq).ok_or_else(|| unknown(seq))?;
                    r.seqs.retain(|&x| x != sid);
                    self.drop_seq(sid);
                }
                Op::DraftFeed { seq, tokens } => {
                    if tokens.is_empty() {
                        return Err(Error::InvalidRequest("the strategy fed its draft no tokens".into()));
                    }
                    m.draft_feeds.push((seq, tokens));
                    draft_feeds = true;
                }
                Op::DraftTruncate { seq, len } => {
                    let sid = *m.draft_seqs.get(&seq).ok_or_else(|| unknown(seq))?;
                    if let Some(d) = self.draft.as_mut()
                        && deco_model::KvCache::seq_len(&d.cache, sid) > len
                    {
                        deco_model::KvCache::truncate(&mut d.cache, sid, len)?;
                    }
                }
                Op::DraftRemove(seq) => {
                    let sid = m.draft_seqs.remove(&seq).ok_or_else(|| unknown(seq))?;
                    if let Some(d) = self.draft.as_mut() {
                        d.cache.free_seq(sid)?;
                    }
                }
            }
        }
        if target_feeds && draft_feeds {
            return Err(Error::InvalidRequest("the strategy fed the target and the draft model in one step".into()));
        }
        Ok(())
    }

    /// Sends a step machine's released choices to the client: the text of their tokens (an end
    /// token is counted, not shown; stop strings end a choice as in sampling) and, for finished
    /// choices, their end. Returns whether every choice of the request is now done.
    fn release(&mut self, req_id: u64, output: Vec<deco_generate::Choice>) -> Result<bool> {
        let Some(r) = self.reqs.get_mut(&req_id) else { return Ok(true) };
        let Some(m) = r.machine.as_mut() else { return Ok(true) };
        let now = Instant::now();
        for c in output {
            let n_choices = m.choices.len();
            let Some(ch) = m.choices.get_mut(c.index) else {
                return Err(Error::InvalidRequest(format!("the strategy released choice {}, the request has {n_choices}", c.index)));
            };
            if ch.done {
                continue;
            }
            if !r.first_token_seen && !c.tokens.is_empty() {
                r.first_token_seen = true;
                self.metrics.latency.time_to_first_token.observe(now.duration_since(r.arrival).as_secs_f64());
                self.metrics.prompt_tokens.fetch_add(r.prompt.len() as u64, Ordering::Relaxed);
            }
            let mut text = String::new();
            let mut tokens = Vec::with_capacity(c.tokens.len());
            let mut finish = c.finish;
            for &t in &c.tokens {
                ch.released += 1;
                if self.eos.contains(&t) {
                    continue;
                }
                tokens.push(TokenInfo { id: t, autodeco: None, logprob: None, top: Vec::new() });
                let step = ch.matcher.push(&ch.detok.step(&self.tokenizer, t)?);
                text.push_str(&step.text);
                if step.stop.is_some() {
                    finish = Some(FinishReason::Stop);
                    break;
                }
            }
            self.metrics.generation_tokens.fetch_add(tokens.len() as u64, Ordering::Relaxed);
            if finish.is_some() && !ch.matcher.is_stopped() {
                let rest = ch.detok.flush(&self.tokenizer)?;
                let more = ch.matcher.push(&rest);
                text.push_str(&more.text);
                if more.stop.is_some() {
                    finish = Some(FinishReason::Stop);
                } else {
                    text.push_str(&ch.matcher.flush());
                }
            }
            let _ = r.events.send(EngineEvent::Delta { index: c.index, text, tokens });
            if let Some(reason) = finish {
                ch.done = true;
                let cached_prompt_tokens = r.cached_tokens.unwrap_or(0);
                let _ = r.events.send(EngineEvent::Finished { index: c.index, reason, completion_tokens: ch.released, cached_prompt_tokens, cumulative_logprob: c.cumulative_logprob });
                match reason {
                    FinishReason::Length => &self.metrics.finished_length,
                    FinishReason::Stop | FinishReason::EosToken => &self.metrics.finished_stop,
                }
                .fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(m.choices.iter().all(|c| c.done))
    }

    /// The plain draws of a step, in parallel over its sequences (`None` where a row is left
    /// to [`Engine::sample_one`]): each sampling row of a sequence without structured output,
    /// AutoDeco heads or a pending `n > 1` fork gets its token from its own seeded sampler
    /// ([`Sampler::sample`], the same call `sample_one` makes), so the tokens do not depend on
    /// which thread draws them or in which order. With 16 streams of SmolLM2 at temperature
    /// 0.8 the serial draws (three passes of `exp` over the 49,152 logits each) were ~23 % of
    /// the engine's wall time, with the model's threads idle.
    fn presample(
        &mut self,
        chunks: &[crate::scheduler::Chunk],
        all_rows: &[Vec<f32>],
        ranges: &[std::ops::Range<usize>],
    ) -> Vec<Option<std::result::Result<deco_decoding::SampleOutput, deco_decoding::DecodingError>>> {
        let mut out: Vec<Option<_>> = (0..chunks.len()).map(|_| None).collect();
        let heads = self.autodeco.is_some();
        let eligible: HashMap<SeqId, usize> = chunks
            .iter()
            .enumerate()
            .filter(|(ci, c)| {
                c.samples
                    && !ranges[*ci].is_empty()
                    && ranges[*ci].end <= all_rows.len()
                    && !self.machine_seqs.contains_key(&c.seq)
                    && self.seqs.get(&c.seq).is_some_and(|s| {
                        s.constraint.is_none() && self.reqs.get(&s.req).is_some_and(|r| (r.n == 1 || r.forked) && !(heads && r.use_heads))
                    })
            })
            .map(|(ci, c)| (c.seq, ci))
            .collect();
        if eligible.len() < 2 {
            return out;
        }
        let (reqs, eos) = (&self.reqs, &self.eos);
        // (chunk, sequence, its request's prompt): a request also holds a step machine, which
        // is not `Sync`, so only the prompt goes to the pool.
        let mut work: Vec<(usize, &mut SeqState, &[u32])> = self
            .seqs
            .iter_mut()
            .filter_map(|(sid, s)| {
                let prompt = reqs.get(&s.req)?.prompt.as_slice();
                eligible.get(sid).map(|&ci| (ci, s, prompt))
            })
            .collect();
        let t = Instant::now();
        let drawn: Vec<(usize, std::result::Result<deco_decoding::SampleOutput, deco_decoding::DecodingError>)> = {
            use rayon::prelude::*;
            work.par_iter_mut()
                .map(|(ci, s, prompt)| {
                    let mut row = all_rows[ranges[*ci].end - 1].clone();
                    (*ci, s.sampler.sample(&ProcessContext::new(prompt, &s.generated, eos), &mut row))
                })
                .collect()
        };
        // The engine's wall time in sampling, as for the serial draws (and the parallel AutoDeco
        // heads' pass), not the sum over the pool's threads.
        self.metrics.sampling_ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        for (ci, drawn) in drawn {
            out[ci] = Some(drawn);
        }
        out
    }

    /// Samples the next token of `sid` from its logits `row`; with AutoDeco heads the
    /// prediction `predicted` made for this row in the step's parallel pass, else computed here
    /// (after the structured-output mask). `pre`: the draw [`Engine::presample`] made for this
    /// row, used as is.
    fn sample_one(
        &mut self,
        sid: SeqId,
        row: &mut [f32],
        hidden: Option<&[f32]>,
        predicted: Option<deco_autodeco::heads::HeadOutput>,
        pre: Option<std::result::Result<deco_decoding::SampleOutput, deco_decoding::DecodingError>>,
    ) -> Result<()> {
        let Some(s) = self.seqs.get_mut(&sid) else { return Ok(()) };
        let Some(r) = self.reqs.get_mut(&s.req) else { return Ok(()) };
        let ctx = ProcessContext::new(&r.prompt, &s.generated, &self.eos);
        // Structured output: the grammar's mask comes first in the chain.
        if let Some(c) = s.constraint.as_mut() {
            let t0 = Instant::now();
            c.apply(row)?;
            self.metrics.structured_mask_ns.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
            self.metrics.structured_masks.fetch_add(1, Ordering::Relaxed);
        }
        let mut predicted_tp = None;
        let t_sample = Instant::now();
        let out = match (&self.autodeco, hidden, pre) {
            (_, _, Some(drawn)) => drawn?,
            (Some(heads), Some(h), None) if r.use_heads => {
                // The step's parallel pass skipped rows with structured output (`predicted` is
                // None there), so a given prediction is for this very (unmasked) row.
                let predicted = match predicted {
                    Some(p) => p,
                    None => {
                        let p = heads.predict(h, row)?;
                        self.metrics.autodeco_heads_ns.fetch_add(t_sample.elapsed().as_nanos() as u64, Ordering::Relaxed);
                        p
                    }
                };
                predicted_tp = Some((predicted.temperature, predicted.top_p));
                let t = Instant::now();
                let p = deco_autodeco::decode::combine(&r.params, predicted);
                let processors = LogitsProcessorList::from_params(&p, SamplerOrder::HuggingFace)?;
                let out = s.sampler.sample_with(&processors, &ctx, row)?;
                self.metrics.sampling_ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                out
            }
            _ => {
                let out = s.sampler.sample(&ctx, row)?;
                self.metrics.sampling_ns.fetch_add(t_sample.elapsed().as_nanos() as u64, Ordering::Relaxed);
                out
            }
        };
        s.generated.push(out.token);
        self.metrics.generation_tokens.fetch_add(1, Ordering::Relaxed);
        let grammar_done = match s.constraint.as_mut() {
            Some(c) => {
                c.commit(out.token)?;
                c.is_finished()
            }
            None => false,
        };
        let now = Instant::now();
        let lat = &self.metrics.latency;
        if let Some(last) = s.last_token {
            lat.time_per_output_token.observe(now.duration_since(last).as_secs_f64());
        }
        s.last_token = Some(now);
        if !r.first_token_seen {
            r.first_token_seen = true;
            lat.time_to_first_token.observe(now.duration_since(r.arrival).as_secs_f64());
            self.metrics.prompt_tokens.fetch_add(r.prompt.len() as u64, Ordering::Relaxed);
        }
        let n_gen = s.generated.len();
        let mut finish = r.stopping.check(out.token, n_gen);
        let mut text = String::new();
        let mut tokens = Vec::new();
        if !matches!(finish, Some(FinishReason::EosToken | FinishReason::Stop)) {
            let piece = s.detok.step(&self.tokenizer, out.token)?;
            let mut step = s.matcher.push(&piece);
            if step.stop.is_some() {
                finish = Some(FinishReason::Stop);
            } else if finish.is_some() || grammar_done || r.prompt.len() + n_gen >= self.model.max_context() {
                // A complete grammar stops the sequence like a stop token whose text is kept.
                if grammar_done {
                    finish = Some(FinishReason::Stop);
                } else {
                    finish.get_or_insert(FinishReason::Length);
                }
                let rest = s.detok.flush(&self.tokenizer)?;
                let more = s.matcher.push(&rest);
                step.text.push_str(&more.text);
                if more.stop.is_some() {
                    finish = Some(FinishReason::Stop);
                } else {
                    step.text.push_str(&s.matcher.flush());
                }
            }
            text = step.text;
            let info = match (r.want_logprobs, out.logprobs) {
                (Some(_), Some(lp)) => TokenInfo {
                    id: out.token,
                    autodeco: predicted_tp,
                    logprob: Some(lp.raw_logprob),
                    top: lp.raw_top_logprobs.iter().map(|t| (t.token, t.logprob)).collect(),
                },
                _ => TokenInfo { id: out.token, autodeco: predicted_tp, logprob: None, top: Vec::new() },
            };
            tokens.push(info);
        }
        let index = s.index;
        let req_id = s.req;
        let events = r.events.clone();
        let cached_prompt_tokens = r.cached_tokens.unwrap_or(0);
        let _ = events.send(EngineEvent::Delta { index, text, tokens });
        match finish {
            None => self.sched.push_token(sid, out.token),
            Some(reason) => {
                let _ = events.send(EngineEvent::Finished { index, reason, completion_tokens: n_gen, cached_prompt_tokens, cumulative_logprob: None });
                match reason {
                    FinishReason::Length => &self.metrics.finished_length,
                    FinishReason::Stop | FinishReason::EosToken => &self.metrics.finished_stop,
                }
                .fetch_add(1, Ordering::Relaxed);
                self.drop_seq(sid);
                if let Some(r) = self.reqs.get_mut(&req_id) {
                    r.seqs.retain(|&x| x != sid);
                    if r.seqs.is_empty() && r.forked {
                        self.metrics.latency.e2e_request_latency.observe(r.arrival.elapsed().as_secs_f64());
                        self.reqs.remove(&req_id);
                        self.metrics.requests_finished.fetch_add(1, Ordering::Relaxed);
                        self.metrics.pending_requests.fetch_sub(1, Ordering::SeqCst);
                    }
                }
            }
        }
        Ok(())
    }
}
