//! `deco serve`: the OpenAI-compatible HTTP server (see `deco_serve` and docs/serving.md).

use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;
use deco_formats::chat_template::ChatTemplate;
use deco_generate::{DraftSchedule, DraftSource, PromptLookupDrafter};
use deco_serve::{CacheShape, DraftModel, EngineConfig, EngineOptions, KvCacheDtype, SchedulerConfig, ServerState, Speculation};

use crate::ModelArgs;

/// Arguments of `deco serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Address to bind (loopback by default).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// TCP port (0 picks a free one; the chosen address is printed).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Name the model is served under (`model` field). Default: the file or directory name.
    #[arg(long)]
    served_model_name: Option<String>,
    /// Tokens per KV-cache block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// KV-cache size in MiB (sets the number of blocks).
    #[arg(long, default_value_t = 1024)]
    kv_cache_mib: usize,
    /// Element type of the KV cache (vLLM's option): `f32` (default) or `f16` (twice the
    /// blocks in the same `--kv-cache-mib`, half the bytes a decode step reads; CPU only).
    #[arg(long, default_value = "f32")]
    kv_cache_dtype: KvCacheDtype,
    /// Most sequences per step.
    #[arg(long, default_value_t = 64)]
    max_num_seqs: usize,
    /// Most tokens per step (chunked-prefill budget).
    #[arg(long, default_value_t = 512)]
    max_num_batched_tokens: usize,
    /// Most requests in flight before new ones get HTTP 429.
    #[arg(long, default_value_t = 512)]
    max_pending_requests: usize,
    /// Context length to serve (default: the model's).
    #[arg(long)]
    max_model_len: Option<usize>,
    /// AutoDeco heads directory: every sampled token uses the heads' temperature and top-p
    /// (`T × temperature`, `clamp(P × top_p)`); greedy requests stay greedy.
    #[arg(long)]
    autodeco: Option<std::path::PathBuf>,
    /// Speculative decoding (vLLM's flag): a draft model (GGUF or HF dir) sharing the
    /// tokenizer, or `[ngram]` for prompt lookup. Every request with n = 1, no structured output
    /// and no logprobs is then decoded speculatively (same output distribution).
    #[arg(long, conflicts_with = "speculative_draft_layers")]
    speculative_model: Option<String>,
    /// Speculative decoding with the served model's first K layers as the draft
    /// (self-speculative; a deco extension).
    #[arg(long)]
    speculative_draft_layers: Option<usize>,
    /// Draft tokens per speculative round (vLLM's flag).
    #[arg(long, default_value_t = 5)]
    num_speculative_tokens: usize,
    /// How the drafts per round evolve: `constant`, or `heuristic` (Hugging Face's
    /// `num_assistant_tokens_schedule`: +2 after a fully accepted round, −1 after a rejection).
    #[arg(long, default_value = "constant")]
    num_assistant_tokens_schedule: String,
    /// Prompt lookup (`[ngram]`): longest n-gram matched (vLLM's flag).
    #[arg(long, default_value_t = 2)]
    ngram_prompt_lookup_max: usize,
    /// Contrastive decoding's amateur (GGUF or HF dir) sharing the tokenizer: requests may then
    /// ask for `contrastive_decoding` (Li et al. 2023).
    #[arg(long, conflicts_with = "amateur_layers")]
    amateur_model: Option<std::path::PathBuf>,
    /// Contrastive decoding with the served model's first K layers as the amateur.
    #[arg(long)]
    amateur_layers: Option<usize>,
    /// Medusa heads directory (`deco medusa train --out`): every request with n = 1, no
    /// structured output, no logprobs and no other strategy is decoded with the heads'
    /// candidates verified by tree attention (greedy output unchanged; sampling uses the
    /// typical acceptance). Exclusive with speculative decoding.
    #[arg(long, conflicts_with_all = ["speculative_model", "speculative_draft_layers"])]
    medusa: Option<std::path::PathBuf>,
    /// Medusa candidate tree (the reference's `medusa_choices` JSON).
    #[arg(long, requires = "medusa")]
    medusa_choices: Option<String>,
    /// Medusa typical acceptance: the hard threshold epsilon.
    #[arg(long, default_value_t = deco_generate::medusa::DEFAULT_POSTERIOR_THRESHOLD)]
    posterior_threshold: f32,
    /// Medusa typical acceptance: the entropy factor delta.
    #[arg(long, default_value_t = deco_generate::medusa::DEFAULT_POSTERIOR_ALPHA)]
    posterior_alpha: f32,
}

/// Binds the listener, prints `listening on http://ADDR` and answers 503 (`/health` too) while
/// the model loads; then serves until ctrl-c / SIGTERM, drains in-flight requests (`/health` 503
/// meanwhile) and returns.
pub fn run(args: &ServeArgs) -> Result<()> {
    anyhow::ensure!(args.block_size > 0, "--block-size must be at least 1");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let listener = rt
        .block_on(tokio::net::TcpListener::bind((args.host.as_str(), args.port)))
        .with_context(|| format!("binding {}:{}", args.host, args.port))?;
    let addr = listener.local_addr()?;
    let gate = deco_serve::Readiness::loading();
    let server = rt.spawn(deco_serve::serve_with(listener, gate.clone(), deco_serve::shutdown_signal()));
    println!("listening on http://{addr}");

    let device = crate::runtime::device(&args.model)?;
    let ckpt = deco_formats::checkpoint::Checkpoint::open(&args.model.model)?;
    let tokenizer = Arc::new(crate::runtime::load_tokenizer(&args.model.model)?);
    let model = crate::runtime::load_llama(&ckpt, &device, args.max_model_len, args.model.lora.as_deref())
        .with_context(|| format!("loading weights from {}", args.model.model.display()))?;
    let cfg = &model.config;
    let geometry = CacheShape {
        n_layers: cfg.num_hidden_layers,
        kv_heads: cfg.num_key_value_heads,
        head_dim: cfg.head_dim,
        block_size: args.block_size,
        num_blocks: 0,
    };
    let bytes_per_block = geometry.bytes_per_block(args.kv_cache_dtype);
    let num_blocks = (args.kv_cache_mib * 1024 * 1024 / bytes_per_block).max(1);
    let template = match tokenizer.chat_template() {
        Some(src) => Some(ChatTemplate::new(src).context("compiling the model's chat template")?),
        None => None,
    };
    let model_name = args.served_model_name.clone().unwrap_or_else(|| {
        args.model.model.file_name().map_or_else(|| "model".into(), |f| f.to_string_lossy().into_owned())
    });
    let config = EngineConfig {
        block_size: args.block_size,
        num_blocks,
        kv_cache_dtype: args.kv_cache_dtype,
        scheduler: SchedulerConfig { max_num_seqs: args.max_num_seqs, max_num_batched_tokens: args.max_num_batched_tokens },
        max_pending_requests: args.max_pending_requests,
        ..EngineConfig::default()
    };
    let max_context = model.max_context();
    let heads = args.autodeco.as_deref().map(deco_autodeco::HostHeads::load).transpose()?;
    let (draft, source) = match (&args.speculative_model, args.speculative_draft_layers) {
        (Some(m), _) if m == "[ngram]" => {
            anyhow::ensure!(args.ngram_prompt_lookup_max >= 1, "--ngram-prompt-lookup-max must be at least 1");
            (None, Some(DraftSource::PromptLookup(PromptLookupDrafter { max_matching_ngram_size: args.ngram_prompt_lookup_max })))
        }
        (Some(path), _) => {
            let ck = deco_formats::checkpoint::Checkpoint::open(path)?;
            let d = deco_model::Llama::load(&ck, &device, args.max_model_len).with_context(|| format!("loading the draft model {path}"))?;
            let num_layers = d.num_layers();
            (Some(DraftModel { model: d, num_layers }), Some(DraftSource::Model))
        }
        (None, Some(k)) => (Some(DraftModel { model: model.clone(), num_layers: k }), Some(DraftSource::Model)),
        (None, None) => (None, None),
    };
    let amateur = match (&args.amateur_model, args.amateur_layers) {
        (Some(path), _) => {
            let ck = deco_formats::checkpoint::Checkpoint::open(path)?;
            let a = deco_model::Llama::load(&ck, &device, args.max_model_len).with_context(|| format!("loading the amateur model {}", path.display()))?;
            let num_layers = a.num_layers();
            Some(DraftModel { model: a, num_layers })
        }
        (None, Some(k)) => Some(DraftModel { model: model.clone(), num_layers: k }),
        (None, None) => None,
    };
    // The engine has one second model: the draft or the amateur.
    let draft = match (draft, amateur) {
        (Some(_), Some(_)) => anyhow::bail!("a speculative draft model and a contrastive-decoding amateur cannot both be loaded (the engine has one second model)"),
        (d, a) => d.or(a),
    };
    let schedule: DraftSchedule = args.num_assistant_tokens_schedule.parse()?;
    let speculation = source.map(|source| Speculation { num_speculative_tokens: args.num_speculative_tokens, source, schedule });
    let medusa = match &args.medusa {
        Some(dir) => Some(crate::generate::medusa_setting(dir, args.medusa_choices.as_deref(), args.posterior_threshold, args.posterior_alpha, &model)?),
        None => None,
    };
    let options = EngineOptions { autodeco: heads, draft, speculation, medusa };
    let (engine, join) = deco_serve::spawn_engine_opts(model, tokenizer.clone(), config, options)?;
    gate.set_ready(Arc::new(ServerState::new(engine, tokenizer, template, model_name.clone())))?;
    eprintln!(
        "deco serve: model `{model_name}` (context {max_context}) ready, KV cache {num_blocks} blocks x {} tokens ({} MiB)",
        args.block_size,
        num_blocks * bytes_per_block / (1024 * 1024)
    );
    rt.block_on(server).context("the server task failed")??;
    eprintln!("deco serve: drained, shutting down");
    drop(gate);
    drop(rt);
    let _ = join.join();
    Ok(())
}
