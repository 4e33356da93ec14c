//! `deco serve`: the OpenAI-compatible HTTP server (see `deco_serve` and docs/serving.md).

use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;
use deco_formats::chat_template::ChatTemplate;
use deco_serve::{EngineConfig, SchedulerConfig, ServerState};

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
    let model = deco_model::Llama::load(&ckpt, &device, args.max_model_len)
        .with_context(|| format!("loading weights from {}", args.model.model.display()))?;
    let cfg = &model.config;
    let bytes_per_block = 2 * cfg.num_hidden_layers * args.block_size * cfg.num_key_value_heads * cfg.head_dim * 4;
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
        scheduler: SchedulerConfig { max_num_seqs: args.max_num_seqs, max_num_batched_tokens: args.max_num_batched_tokens },
        max_pending_requests: args.max_pending_requests,
        ..EngineConfig::default()
    };
    let max_context = model.max_context();
    let heads = args.autodeco.as_deref().map(deco_autodeco::HostHeads::load).transpose()?;
    let (engine, join) = deco_serve::spawn_engine_with(model, tokenizer.clone(), config, heads)?;
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
