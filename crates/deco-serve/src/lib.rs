//! Serving for deco: many users at once from one model on one machine.
//!
//! - [`block_pool`]: reference-counted fixed-size KV blocks, O(1) free queue, prefix cache
//!   (Kwon et al. 2023, PagedAttention; vLLM v1 block pool).
//! - [`paged_cache`]: [`PagedKvCache`], the block tables and storage, implementing
//!   [`deco_model::KvCache`]; copy-on-write forks.
//! - [`scheduler`]: continuous batching (Yu et al. 2022, Orca) with chunked prefill,
//!   FCFS admission, preemption by recompute.
//! - [`engine`]: the engine thread: one batched forward per step, per-request sampling, stop
//!   handling, streaming events.
//! - [`server`] and [`openai`]: the OpenAI-compatible HTTP API (axum).
//! - [`structured`]: structured output (JSON schema, Lark grammar, regex) as token masks
//!   (llguidance).
//! - [`tools`]: tool calls (`tools`, `tool_choice`): rendering, output parsing, grammars for
//!   `required` and named functions.

pub mod block_pool;
pub mod engine;
pub mod error;
pub mod openai;
pub mod paged_cache;
pub mod scheduler;
pub mod server;
pub mod structured;
pub mod tools;

pub use block_pool::{BlockId, BlockPool, PrefixKey};
pub use engine::{DraftModel, EngineConfig, EngineEvent, EngineHandle, EngineOptions, GenerateRequest, Histogram, LatencyHistograms, MedusaSetting, Metrics, Speculation, Strategy, TokenInfo, spawn_engine, spawn_engine_opts, spawn_engine_with};
pub use error::{Error, Result};
pub use paged_cache::{CacheShape, KvCacheDtype, PagedKvCache};
pub use scheduler::{Chunk, SchedSeq, Scheduler, SchedulerConfig, StepPlan, TreeTail};
pub use structured::{Constraint, Grammars, OutputConstraint};
pub use server::{ApiError, PreparedRequest, Readiness, RequestContext, ServerState, prepare_chat, prepare_completion, router, router_with, serve, serve_with, shutdown_signal};
