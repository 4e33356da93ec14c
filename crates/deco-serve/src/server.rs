//! The HTTP server (axum on tokio): OpenAI-compatible endpoints, SSE streaming, health and
//! Prometheus metrics, graceful shutdown.
//!
//! | route | method | what |
//! |---|---|---|
//! | `/v1/completions` | POST | text completion (`prompt` string, list of strings, ids) |
//! | `/v1/chat/completions` | POST | chat completion through the model's chat template |
//! | `/v1/models` | GET | the served model |
//! | `/health` | GET | 200 while serving; 503 while the model is loading and while draining |
//! | `/metrics` | GET | Prometheus text under deco's and vLLM's names ([`crate::engine::Metrics::render`]) |
//!
//! Errors use OpenAI's body `{"error": {"message", "type", "param", "code"}}`: 400
//! `invalid_request_error` for malformed JSON, unknown model, out-of-range parameters or a
//! prompt beyond the context; 413 for a body over [`MAX_BODY_BYTES`]; 429 when too many
//! requests are pending; 503 while the model is loading and while shutting down.
//!
//! Lifecycle ([`serve_with`] and [`Readiness`]): the listener can be bound before the model is
//! loaded; until [`Readiness::set_ready`] every route but `/health` answers 503 (`/health` too,
//! as the readiness probe of a load balancer or Kubernetes). On the shutdown signal the server
//! drains: new generation requests get 503, `/health` 503, the requests already accepted run to
//! the end, and only when none is left does it stop accepting connections and return.
//!
//! An oversize body is still read and dropped (up to [`DRAIN_BODY_BYTES`], for at most
//! [`DRAIN_BODY_TIME`]) before the 413 is sent, as nginx's lingering close does: a server that
//! closes the connection while the client is still sending makes the kernel reset it, and the
//! client never reads the answer (seen in the soak test, 10 of 190 oversize requests, before
//! this).
//! A client that disconnects drops its event receiver, and the engine frees its blocks at the
//! next step.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use deco_decoding::{FinishReason, SamplingParams};
use deco_formats::chat_template::{ChatMessage, ChatTemplate};
use deco_formats::tokenizer::Tokenizer;
use futures_util::stream::{self, BoxStream, StreamExt};
use deco_generate::{BeamSearchParams, ContrastiveDecodingParams, EarlyStopping};
use deco_model::early_exit::EarlyExitConfig;
use serde_json::{Value, json};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::engine::{EngineEvent, EngineHandle, GenerateRequest, Strategy, TokenInfo};
use crate::openai::{CHAT_KEYS, COMPLETION_KEYS, ChatRequest, CompletionRequest, Content, Prompt, ROLES, error_body, sampling_params, unknown_field};
use crate::structured::{Constraint, Grammars, OutputConstraint};
use crate::tools::{self, ToolCallParser, ToolError, ToolFormat, ToolRequest};
use crate::{Error, Result};

/// Shared state of the handlers.
#[derive(Debug)]
pub struct ServerState {
    /// The engine.
    pub engine: EngineHandle,
    /// The model's tokenizer.
    pub tokenizer: Arc<Tokenizer>,
    /// The model's chat template, if it has one.
    pub template: Option<ChatTemplate>,
    /// Name under which the model is served (`model` field).
    pub model_name: String,
    /// The structured-output compiler for this tokenizer (`None` when it could not be built,
    /// e.g. no EOS token: then constrained requests get a 400).
    pub grammars: Option<Arc<Grammars>>,
}

impl ServerState {
    /// The state of a server for `engine`, with the structured-output compiler built from
    /// `tokenizer` (see [`Grammars::new`]).
    pub fn new(engine: EngineHandle, tokenizer: Arc<Tokenizer>, template: Option<ChatTemplate>, model_name: String) -> Self {
        let grammars = Grammars::new(tokenizer.clone()).ok().map(Arc::new);
        Self { engine, tokenizer, template, model_name, grammars }
    }
}

/// What the routes serve: nothing while the model is loading, then the [`ServerState`]; and
/// whether the server is draining. See the [module docs](self).
#[derive(Debug, Default)]
pub struct Readiness {
    state: OnceLock<Arc<ServerState>>,
    draining: AtomicBool,
}

impl Readiness {
    /// A server whose model is still loading (every route answers 503).
    pub fn loading() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// A server ready to serve `state`.
    pub fn ready(state: Arc<ServerState>) -> Arc<Self> {
        let r = Self::default();
        let _ = r.state.set(state);
        Arc::new(r)
    }

    /// The model is loaded: from now on the routes serve `state`.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] if a state was set before.
    pub fn set_ready(&self, state: Arc<ServerState>) -> Result<()> {
        self.state.set(state).map_err(|_| Error::InvalidRequest("the server is already serving a model".into()))
    }

    /// Starts draining: `/health` answers 503 and the engine refuses new requests (503); the
    /// accepted ones run on.
    pub fn begin_drain(&self) {
        self.draining.store(true, Ordering::SeqCst);
        if let Some(st) = self.state.get() {
            st.engine.stop_accepting();
        }
    }

    /// Loaded and not draining: what `/health` reports.
    pub fn is_ready(&self) -> bool {
        self.state.get().is_some() && !self.draining.load(Ordering::SeqCst)
    }

    /// Requests accepted by the engine and not finished (0 while loading).
    pub fn pending_requests(&self) -> usize {
        self.state.get().map_or(0, |st| st.engine.metrics.pending_requests.load(Ordering::SeqCst))
    }

    fn state(&self) -> ApiResult<Arc<ServerState>> {
        self.state.get().cloned().ok_or_else(|| ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: "the model is still loading; retry when /health answers 200".into(),
            kind: "server_error",
            param: None,
            code: Some("model_loading"),
        })
    }
}

/// An error response in OpenAI's format.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    kind: &'static str,
    param: Option<String>,
    code: Option<&'static str>,
}

impl ApiError {
    /// The HTTP status of the response.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The error message (`error.message`).
    pub fn message(&self) -> &str {
        &self.message
    }

    fn bad(message: impl Into<String>) -> Self {
        Self { status: StatusCode::BAD_REQUEST, message: message.into(), kind: "invalid_request_error", param: None, code: None }
    }

    fn param(mut self, p: impl Into<String>) -> Self {
        self.param = Some(p.into());
        self
    }
}

impl From<Error> for ApiError {
    fn from(e: Error) -> Self {
        let message = e.to_string();
        match e {
            Error::InvalidRequest(_) | Error::Decoding(_) => Self::bad(message),
            Error::Overloaded(_) => Self { status: StatusCode::TOO_MANY_REQUESTS, message, kind: "rate_limit_error", param: None, code: Some("server_overloaded") },
            Error::EngineStopped => Self { status: StatusCode::SERVICE_UNAVAILABLE, message, kind: "server_error", param: None, code: None },
            _ => Self { status: StatusCode::INTERNAL_SERVER_ERROR, message, kind: "server_error", param: None, code: None },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(error_body(&self.message, self.kind, self.param.as_deref(), self.code))).into_response()
    }
}

type ApiResult<T> = std::result::Result<T, ApiError>;

/// Largest request body accepted, in bytes (2 MiB, axum's default limit).
pub const MAX_BODY_BYTES: usize = 2 << 20;
/// Most bytes of an oversize body read (and dropped) before the 413 is sent.
pub const DRAIN_BODY_BYTES: usize = 64 << 20;
/// Longest time spent reading an oversize body before the 413 is sent.
pub const DRAIN_BODY_TIME: std::time::Duration = std::time::Duration::from_secs(5);

/// Reads a request body of at most [`MAX_BODY_BYTES`]; for a larger one, drains the rest (see
/// the module docs) and answers 413.
async fn read_body(body: Body) -> ApiResult<Bytes> {
    let mut stream = body.into_data_stream();
    let mut buf: Vec<u8> = Vec::new();
    let mut total = 0usize;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| ApiError::bad(format!("cannot read the request body: {e}")))?;
        total += chunk.len();
        if total > MAX_BODY_BYTES {
            let deadline = tokio::time::Instant::now() + DRAIN_BODY_TIME;
            while total <= DRAIN_BODY_BYTES {
                match tokio::time::timeout_at(deadline, stream.next()).await {
                    Ok(Some(Ok(c))) => total += c.len(),
                    _ => break,
                }
            }
            return Err(ApiError {
                status: StatusCode::PAYLOAD_TOO_LARGE,
                message: format!("the request body is larger than {MAX_BODY_BYTES} bytes"),
                kind: "invalid_request_error",
                param: None,
                code: Some("request_too_large"),
            });
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(Bytes::from(buf))
}

/// The router with every route, serving `state`.
pub fn router(state: Arc<ServerState>) -> Router {
    router_with(Readiness::ready(state))
}

/// The router with every route, serving what `gate` holds (see [`Readiness`]).
pub fn router_with(gate: Arc<Readiness>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .with_state(gate)
}

/// Serves `state` on `listener` until `shutdown` resolves, then drains (see [`serve_with`]).
///
/// # Errors
/// [`Error::Io`] from the socket.
pub async fn serve(listener: tokio::net::TcpListener, state: Arc<ServerState>, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<()> {
    serve_with(listener, Readiness::ready(state), shutdown).await
}

/// How often a draining server checks whether its accepted requests have finished.
const DRAIN_POLL: std::time::Duration = std::time::Duration::from_millis(50);

/// Serves what `gate` holds on `listener` (503 until it is ready) until `shutdown` resolves;
/// then drains: [`Readiness::begin_drain`], keeps answering (`/health` 503, new requests 503)
/// until every accepted request has finished, then stops accepting connections, lets the open
/// responses end and returns.
///
/// # Errors
/// [`Error::Io`] from the socket.
pub async fn serve_with(listener: tokio::net::TcpListener, gate: Arc<Readiness>, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<()> {
    let g = gate.clone();
    axum::serve(listener, router_with(gate))
        .with_graceful_shutdown(async move {
            shutdown.await;
            g.begin_drain();
            while g.pending_requests() > 0 {
                tokio::time::sleep(DRAIN_POLL).await;
            }
        })
        .await?;
    Ok(())
}

/// Resolves on ctrl-c (SIGINT) or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}

async fn health(State(gate): State<Arc<Readiness>>) -> StatusCode {
    if gate.is_ready() { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE }
}

async fn metrics(State(gate): State<Arc<Readiness>>) -> ApiResult<Response> {
    let st = gate.state()?;
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], st.engine.metrics.render(&st.model_name)).into_response())
}

async fn models(State(gate): State<Arc<Readiness>>) -> ApiResult<Json<Value>> {
    let st = gate.state()?;
    Ok(Json(json!({
        "object": "list",
        "data": [{
            "id": st.model_name,
            "object": "model",
            "created": now(),
            "owned_by": "deco",
            "max_model_len": st.engine.max_context(),
        }]
    })))
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// What the request parsers need to know about the server: everything but the engine, so that
/// [`prepare_completion`] and [`prepare_chat`] can run (and be fuzzed) without a model.
#[derive(Debug, Clone, Copy)]
pub struct RequestContext<'a> {
    /// The model's tokenizer.
    pub tokenizer: &'a Tokenizer,
    /// The model's chat template.
    pub template: Option<&'a ChatTemplate>,
    /// The served model name.
    pub model_name: &'a str,
    /// Largest prompt + completion, in tokens, that one sequence may use: the model's context
    /// and the KV pool's capacity, whichever is smaller (the default `max_tokens` of a chat
    /// request is what is left of it after the prompt).
    pub max_sequence_tokens: usize,
    /// The structured-output compiler (`None`: constrained requests are refused).
    pub grammars: Option<&'a Grammars>,
}

impl ServerState {
    /// The parsers' view of this server.
    pub fn request_context(&self) -> RequestContext<'_> {
        let cfg = self.engine.config();
        RequestContext {
            tokenizer: &self.tokenizer,
            template: self.template.as_ref(),
            model_name: &self.model_name,
            max_sequence_tokens: self.engine.max_context().min(cfg.num_blocks * cfg.block_size),
            grammars: self.grammars.as_deref(),
        }
    }
}

/// A request body checked and turned into prompts and sampling parameters, ready for
/// [`EngineHandle::submit`] (one submission per prompt).
#[derive(Debug, Clone)]
pub struct PreparedRequest {
    /// Token ids of each prompt (several for a completion request with a list of prompts).
    pub prompts: Vec<Vec<u32>>,
    /// Sampling parameters, validated; `max_new_tokens` is set unless it depends on the prompt
    /// (then [`PreparedRequest::max_new_tokens_for`] gives it).
    pub params: SamplingParams,
    /// Choices per prompt.
    pub n: usize,
    /// Stream server-sent events.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// Report logprobs.
    pub want_logprobs: bool,
    /// The compiled structured-output constraint, if the request asked for one (a
    /// `tool_choice` of `required` or a named function compiles into one too).
    pub constraint: Option<Constraint>,
    /// How the output is read back into tool calls (chat requests with tools, unless
    /// `tool_choice` is `none`).
    pub tool_output: Option<tools::ToolOutput>,
    /// The decoding strategy when not plain sampling (beam search, contrastive search, early
    /// exit).
    pub strategy: Option<Strategy>,
    /// The request's `autodeco` field: whether the server's AutoDeco heads choose its
    /// temperature and top-p (`None`: yes when the server has heads).
    pub autodeco: Option<bool>,
    default_max: DefaultMax,
}

#[derive(Debug, Clone, Copy)]
enum DefaultMax {
    /// OpenAI's default for completions: 16.
    Fixed(usize),
    /// Chat: the rest of the sequence budget.
    RestOf(usize),
}

impl PreparedRequest {
    /// `max_new_tokens` of one prompt: the request's, else the endpoint's default (16 for
    /// completions as OpenAI; the rest of the sequence budget for chat), at least 1.
    pub fn max_new_tokens_for(&self, prompt_len: usize) -> usize {
        self.params.max_new_tokens.unwrap_or(match self.default_max {
            DefaultMax::Fixed(m) => m,
            DefaultMax::RestOf(cap) => cap.saturating_sub(prompt_len),
        }).max(1)
    }
}

fn parse_body(body: &[u8]) -> ApiResult<Value> {
    let v: Value = serde_json::from_slice(body).map_err(|e| ApiError::bad(format!("invalid JSON body: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::bad("the request body must be a JSON object"));
    }
    Ok(v)
}

/// Reads the strategy fields of a request under Hugging Face's names: `num_beams` (> 1 selects
/// beam search, with `n` as `num_return_sequences`), `length_penalty`, `early_stopping` (`true`,
/// `false` or `"never"`); `penalty_alpha` (> 0, with `top_k` > 1 candidates, selects contrastive
/// search; 0 is greedy decoding, as in Hugging Face). What a strategy cannot honour is refused,
/// naming the field: sampling (`temperature > 0`, `do_sample`), the warpers, `stop` strings
/// for beam search, `logprobs`, `n` beyond what the strategy returns, two strategies at once,
/// and a strategy's fields without the strategy.
fn parse_strategy(v: &Value, params: &SamplingParams, n: usize) -> ApiResult<Option<Strategy>> {
    let field = |k: &str| v.get(k).filter(|x| !x.is_null());
    let num_beams = match field("num_beams") {
        None => 1,
        Some(x) => x.as_u64().filter(|&b| b >= 1).ok_or_else(|| ApiError::bad("num_beams must be a positive integer").param("num_beams"))? as usize,
    };
    let penalty_alpha = match field("penalty_alpha") {
        None => None,
        Some(x) => Some(
            x.as_f64()
                .filter(|a| (0.0..=1.0).contains(a))
                .ok_or_else(|| ApiError::bad("penalty_alpha must be a number in [0, 1]").param("penalty_alpha"))? as f32,
        ),
    };
    if num_beams == 1 {
        for k in ["length_penalty", "early_stopping"] {
            if field(k).is_some() {
                return Err(ApiError::bad(format!("{k} applies to beam search only; set num_beams > 1")).param(k));
            }
        }
    }
    let contrastive = penalty_alpha.filter(|&a| a > 0.0);
    if let Some(x) = field("contrastive_decoding") {
        if num_beams > 1 || contrastive.is_some() || field("early_exit").is_some() {
            return Err(ApiError::bad("contrastive_decoding cannot be combined with beam search, contrastive search or early exit").param("contrastive_decoding"));
        }
        let d = ContrastiveDecodingParams::default();
        let obj = x.as_object().ok_or_else(|| ApiError::bad("contrastive_decoding must be an object {alpha, amateur_temperature}").param("contrastive_decoding"))?;
        if let Some(k) = obj.keys().find(|k| !["alpha", "amateur_temperature"].contains(&k.as_str())) {
            return Err(ApiError::bad(format!("contrastive_decoding has no field `{k}` (alpha, amateur_temperature)")).param("contrastive_decoding"));
        }
        let num = |k: &str, default: f32| -> ApiResult<f32> {
            match obj.get(k).filter(|v| !v.is_null()) {
                None => Ok(default),
                Some(v) => v.as_f64().filter(|f| f.is_finite()).map(|f| f as f32).ok_or_else(|| ApiError::bad(format!("contrastive_decoding.{k} must be a number")).param("contrastive_decoding")),
            }
        };
        if n != 1 || params.logprobs.is_some() {
            return Err(ApiError::bad("contrastive decoding returns one choice without logprobs").param(if n != 1 { "n" } else { "logprobs" }));
        }
        let cd = ContrastiveDecodingParams { alpha: num("alpha", d.alpha)?, amateur_temperature: num("amateur_temperature", d.amateur_temperature)? };
        return Ok(Some(Strategy::ContrastiveDecoding(cd)));
    }
    if let Some(x) = field("early_exit") {
        if num_beams > 1 || contrastive.is_some() {
            return Err(ApiError::bad("early_exit cannot be combined with beam or contrastive search").param("early_exit"));
        }
        let d = EarlyExitConfig::default();
        let obj = x.as_object().ok_or_else(|| ApiError::bad("early_exit must be an object {entropy_threshold, min_layers, check_every}").param("early_exit"))?;
        if let Some(k) = obj.keys().find(|k| !["entropy_threshold", "min_layers", "check_every"].contains(&k.as_str())) {
            return Err(ApiError::bad(format!("early_exit has no field `{k}` (entropy_threshold, min_layers, check_every)")).param("early_exit"));
        }
        let num = |k: &str| obj.get(k).filter(|v| !v.is_null());
        let bad = |k: &str, what: &str| ApiError::bad(format!("early_exit.{k} must be {what}")).param("early_exit");
        let entropy_threshold = match num("entropy_threshold") {
            None => d.entropy_threshold,
            Some(v) => v.as_f64().filter(|t| t.is_finite()).ok_or_else(|| bad("entropy_threshold", "a finite number of nats"))? as f32,
        };
        let count = |k: &str, default: usize| -> ApiResult<usize> {
            match num(k) {
                None => Ok(default),
                Some(v) => v.as_u64().filter(|&n| n >= 1).map(|n| n as usize).ok_or_else(|| bad(k, "an integer >= 1")),
            }
        };
        let cfg = EarlyExitConfig { entropy_threshold, min_layers: count("min_layers", d.min_layers)?, check_every: count("check_every", d.check_every)? };
        return Ok(Some(Strategy::EarlyExit(cfg)));
    }
    if num_beams == 1 && contrastive.is_none() {
        return Ok(None);
    }
    if num_beams > 1 && contrastive.is_some() {
        return Err(ApiError::bad("num_beams and penalty_alpha select two strategies (beam search, contrastive search); choose one").param("penalty_alpha"));
    }
    let name = if num_beams > 1 { "beam search" } else { "contrastive search" };
    if params.do_sample == Some(true) || params.temperature.is_some_and(|t| t > 0.0) {
        return Err(ApiError::bad(format!("{name} is deterministic (Hugging Face do_sample=False); its sampling variant is not implemented: set temperature to 0 or leave it out")).param("temperature"));
    }
    let top_k_is_candidates = contrastive.is_some();
    let unsupported = [
        ("top_k", !top_k_is_candidates && params.top_k.is_some_and(|k| k > 0)),
        ("top_p", params.top_p.is_some_and(|p| p < 1.0)),
        ("min_p", params.min_p.is_some_and(|p| p > 0.0)),
        ("typical_p", params.typical_p.is_some_and(|p| p < 1.0)),
        ("epsilon_cutoff", params.epsilon_cutoff.is_some_and(|p| p > 0.0)),
        ("eta_cutoff", params.eta_cutoff.is_some_and(|p| p > 0.0)),
        ("stop", num_beams > 1 && params.stop.as_ref().is_some_and(|s| !s.is_empty())),
        ("logprobs", params.logprobs.is_some()),
    ];
    if let Some((k, _)) = unsupported.iter().find(|w| w.1) {
        return Err(ApiError::bad(format!("{k} is not supported with {name}")).param(*k));
    }
    if let Some(penalty_alpha) = contrastive {
        if n != 1 {
            return Err(ApiError::bad("contrastive search is deterministic: n must be 1").param("n"));
        }
        if params.top_k.is_none_or(|k| k <= 1) {
            return Err(ApiError::bad("contrastive search needs top_k > 1 candidates (Hugging Face's rule)").param("top_k"));
        }
        return Ok(Some(Strategy::ContrastiveSearch { penalty_alpha }));
    }
    let length_penalty = match field("length_penalty") {
        None => 1.0,
        Some(x) => x.as_f64().filter(|f| f.is_finite()).ok_or_else(|| ApiError::bad("length_penalty must be a finite number").param("length_penalty"))? as f32,
    };
    let early_stopping = match field("early_stopping") {
        None => EarlyStopping::False,
        Some(Value::Bool(true)) => EarlyStopping::True,
        Some(Value::Bool(false)) => EarlyStopping::False,
        Some(Value::String(s)) if s == "never" => EarlyStopping::Never,
        Some(_) => return Err(ApiError::bad("early_stopping must be true, false or \"never\"").param("early_stopping")),
    };
    if n > num_beams {
        return Err(ApiError::bad(format!("n ({n}) must not exceed num_beams ({num_beams}): beam search returns its best n beams")).param("n"));
    }
    Ok(Some(Strategy::Beam(BeamSearchParams { num_beams, length_penalty, early_stopping, num_return_sequences: n })))
}

/// The request's `autodeco` field (a boolean) if given.
fn parse_autodeco(v: &Value) -> ApiResult<Option<bool>> {
    match v.get("autodeco") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(ApiError::bad("autodeco must be true or false").param("autodeco")),
    }
}

/// Refuses a request field deco does not implement (`echo` on chat, a vLLM extension deco
/// lacks, a misspelling) with a 400 naming it, instead of ignoring it.
fn refuse_unknown_fields(v: &Value, endpoint_keys: &[&str]) -> ApiResult<()> {
    match unknown_field(v, endpoint_keys) {
        Some(k) => Err(ApiError::bad(format!("unsupported request field `{k}`: deco serve does not implement it, and ignoring it would change the meaning of the request")).param(k)),
        None => Ok(()),
    }
}

/// Refuses tool fields on `/v1/completions` instead of ignoring them: tool calls are a chat
/// feature (OpenAI's completions API has none).
fn refuse_completion_tools(v: &Value) -> ApiResult<()> {
    match v.get("tools") {
        None | Some(Value::Null) => {}
        Some(Value::Array(a)) if a.is_empty() => {}
        Some(_) => return Err(ApiError::bad("tools are only supported on /v1/chat/completions").param("tools")),
    }
    match v.get("tool_choice") {
        None | Some(Value::Null) => {}
        Some(Value::String(c)) if c == "none" => {}
        Some(c) => return Err(ApiError::bad(format!("tool_choice {c} is only supported on /v1/chat/completions")).param("tool_choice")),
    }
    Ok(())
}

impl From<ToolError> for ApiError {
    fn from(e: ToolError) -> Self {
        Self::bad(e.message).param(e.param)
    }
}

/// The output constraint a request asks for: OpenAI's `response_format` (`text`,
/// `json_object`, `json_schema` with `json_schema.schema`; `strict` is always honoured, the
/// output is constrained either way) or vLLM's `guided_json` (a schema, as an object or a JSON
/// string), `guided_regex`, `guided_grammar` (llguidance's Lark syntax). At most one.
fn output_constraint(v: &Value) -> ApiResult<Option<(OutputConstraint, &'static str)>> {
    let mut found: Vec<(OutputConstraint, &'static str)> = Vec::new();
    match v.get("response_format") {
        None | Some(Value::Null) => {}
        Some(f) => match f.get("type").and_then(Value::as_str) {
            Some("text") => {}
            Some("json_object") => found.push((OutputConstraint::JsonObject, "response_format")),
            Some("json_schema") => {
                let schema = f
                    .get("json_schema")
                    .and_then(|j| j.get("schema"))
                    .filter(|s| s.is_object() || s.is_boolean())
                    .ok_or_else(|| ApiError::bad("response_format json_schema needs json_schema.schema (a JSON schema object)").param("response_format"))?;
                found.push((OutputConstraint::JsonSchema(schema.clone()), "response_format"));
            }
            _ => return Err(ApiError::bad(format!("response_format {f} is not one of text, json_object, json_schema")).param("response_format")),
        },
    }
    match v.get("guided_json") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => {
            let schema: Value = serde_json::from_str(s).map_err(|e| ApiError::bad(format!("guided_json is not JSON: {e}")).param("guided_json"))?;
            found.push((OutputConstraint::JsonSchema(schema), "guided_json"));
        }
        Some(s @ (Value::Object(_) | Value::Bool(_))) => found.push((OutputConstraint::JsonSchema(s.clone()), "guided_json")),
        Some(_) => return Err(ApiError::bad("guided_json must be a JSON schema (object or string)").param("guided_json")),
    }
    for (key, make) in [("guided_regex", OutputConstraint::Regex as fn(String) -> OutputConstraint), ("guided_grammar", OutputConstraint::Lark)] {
        match v.get(key) {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) => found.push((make(s.clone()), key)),
            Some(_) => return Err(ApiError::bad(format!("{key} must be a string")).param(key)),
        }
    }
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|(_, k)| *k).collect();
        return Err(ApiError::bad(format!("give at most one output constraint, got {}", names.join(", "))));
    }
    Ok(found.pop())
}

/// Compiles the request's output constraint, if any.
fn compile_constraint(st: &RequestContext<'_>, v: &Value) -> ApiResult<Option<Constraint>> {
    let Some((c, param)) = output_constraint(v)? else { return Ok(None) };
    let Some(g) = st.grammars else {
        return Err(ApiError::bad("structured output is not available for this model's tokenizer").param(param));
    };
    g.compile(&c).map(Some).map_err(|e| ApiError::bad(e.to_string()).param(param))
}

fn check_model(st: &RequestContext<'_>, model: Option<&str>) -> ApiResult<()> {
    match model {
        Some(m) if m != st.model_name => Err(ApiError {
            code: Some("model_not_found"),
            ..ApiError::bad(format!("The model `{m}` does not exist; this server serves `{}`.", st.model_name)).param("model")
        }),
        _ => Ok(()),
    }
}

/// Per-choice accumulation of a non-streamed response.
#[derive(Debug, Default, Clone)]
struct ChoiceAcc {
    text: String,
    tokens: Vec<TokenInfo>,
    finish: Option<FinishReason>,
    completion_tokens: usize,
}

/// Submissions of one HTTP request: one per prompt.
struct Submitted {
    rxs: Vec<UnboundedReceiver<EngineEvent>>,
    prompt_tokens: usize,
    n: usize,
    tool_output: Option<tools::ToolOutput>,
}

/// Token counts of a finished response.
#[derive(Debug, Clone, Copy, Default)]
struct Usage {
    prompt: usize,
    completion: usize,
    /// Prompt tokens served from the prefix cache (summed over the prompts).
    cached: usize,
}

fn submit_all(st: &ServerState, prep: PreparedRequest) -> ApiResult<Submitted> {
    // What this server was not started with is named (the engine would refuse it anyway).
    if prep.autodeco == Some(true) && !st.engine.has_autodeco() {
        return Err(ApiError::bad("autodeco: this server has no AutoDeco heads (deco serve --autodeco DIR)").param("autodeco"));
    }
    if matches!(prep.strategy, Some(Strategy::ContrastiveDecoding(_))) && !st.engine.has_second_model() {
        return Err(ApiError::bad("contrastive_decoding needs an amateur model: deco serve --amateur-model P or --amateur-layers K").param("contrastive_decoding"));
    }
    let mut rxs = Vec::with_capacity(prep.prompts.len());
    let mut prompt_tokens = 0;
    let tool_output = prep.tool_output.clone();
    let max_new: Vec<usize> = prep.prompts.iter().map(|p| prep.max_new_tokens_for(p.len())).collect();
    for (prompt, max) in prep.prompts.into_iter().zip(max_new) {
        let mut params = prep.params.clone();
        params.max_new_tokens = Some(max);
        prompt_tokens += prompt.len();
        // Receivers already obtained are dropped on error, which cancels those requests.
        let (_, rx) = st.engine.submit(GenerateRequest { prompt, params, n: prep.n, constraint: prep.constraint.clone(), strategy: prep.strategy, autodeco: prep.autodeco })?;
        rxs.push(rx);
    }
    Ok(Submitted { rxs, prompt_tokens, n: prep.n, tool_output })
}

fn token_text(tok: &Tokenizer, id: u32) -> String {
    tok.decode(&[id], false).unwrap_or_default()
}

fn token_bytes(tok: &Tokenizer, id: u32) -> Vec<u8> {
    tok.token_to_piece(id).unwrap_or_default()
}

fn completion_logprobs(tok: &Tokenizer, tokens: &[TokenInfo]) -> Value {
    let mut offset = 0;
    let (mut strs, mut lps, mut tops, mut offs) = (vec![], vec![], vec![], vec![]);
    for t in tokens {
        let s = token_text(tok, t.id);
        offs.push(offset);
        offset += s.len();
        strs.push(s);
        lps.push(t.logprob);
        let top: serde_json::Map<String, Value> = t.top.iter().map(|&(id, lp)| (token_text(tok, id), json!(lp))).collect();
        tops.push(Value::Object(top));
    }
    json!({"tokens": strs, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs})
}

fn chat_logprobs(tok: &Tokenizer, tokens: &[TokenInfo]) -> Value {
    let content: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let top: Vec<Value> = t
                .top
                .iter()
                .map(|&(id, lp)| json!({"token": token_text(tok, id), "logprob": lp, "bytes": token_bytes(tok, id)}))
                .collect();
            json!({"token": token_text(tok, t.id), "logprob": t.logprob, "bytes": token_bytes(tok, t.id), "top_logprobs": top})
        })
        .collect();
    json!({"content": content})
}

async fn collect(sub: Submitted) -> ApiResult<(Vec<ChoiceAcc>, Usage)> {
    let n = sub.n;
    let prompt = sub.prompt_tokens;
    let mut accs = vec![ChoiceAcc::default(); n * sub.rxs.len()];
    let mut cached = vec![0; sub.rxs.len()];
    for (pi, mut rx) in sub.rxs.into_iter().enumerate() {
        while let Some(ev) = rx.recv().await {
            match ev {
                EngineEvent::Delta { index, text, tokens } => {
                    let a = &mut accs[pi * n + index];
                    a.text.push_str(&text);
                    a.tokens.extend(tokens);
                }
                EngineEvent::Finished { index, reason, completion_tokens, cached_prompt_tokens, .. } => {
                    let a = &mut accs[pi * n + index];
                    a.finish = Some(reason);
                    a.completion_tokens = completion_tokens;
                    cached[pi] = cached_prompt_tokens;
                }
                EngineEvent::Failed(msg) => {
                    return Err(ApiError { status: StatusCode::INTERNAL_SERVER_ERROR, message: msg, kind: "server_error", param: None, code: None });
                }
            }
        }
    }
    if accs.iter().any(|a| a.finish.is_none()) {
        return Err(Error::EngineStopped.into());
    }
    let completion = accs.iter().map(|a| a.completion_tokens).sum();
    Ok((accs, Usage { prompt, completion, cached: cached.iter().sum() }))
}

/// OpenAI's `usage` object, with `prompt_tokens_details.cached_tokens` (prefix-cache hits).
fn usage(u: Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt, "completion_tokens": u.completion, "total_tokens": u.prompt + u.completion,
        "prompt_tokens_details": {"cached_tokens": u.cached},
    })
}

/// `finish_reason` of a chat choice read for tool calls: `"tool_calls"` when it stopped (EOS,
/// stop string or the grammar's end) with at least one call.
fn chat_finish_reason(f: FinishReason, parser: &ToolCallParser) -> &'static str {
    if parser.calls() > 0 && f != FinishReason::Length { "tool_calls" } else { f.as_openai_str() }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

/// Builds the SSE stream of a request: chunks per delta and finish, a usage chunk when asked,
/// then `[DONE]`. Dropping the stream (client gone) drops the receivers and so cancels.
fn sse_stream(st: Arc<ServerState>, sub: Submitted, kind: Kind, id: String, include_usage: bool, want_logprobs: bool) -> Sse<BoxStream<'static, std::result::Result<Event, std::convert::Infallible>>> {
    let n = sub.n;
    let tool_output = sub.tool_output.clone().filter(|_| kind == Kind::Chat);
    let id_prefix = id.trim_start_matches("chatcmpl-").to_string();
    let created = now();
    let model = st.model_name.clone();
    let prompt_tokens = sub.prompt_tokens;
    let total_choices = n * sub.rxs.len();
    let per_prompt: Vec<_> = sub
        .rxs
        .into_iter()
        .enumerate()
        .map(|(pi, rx)| stream::unfold(rx, move |mut rx| async move { rx.recv().await.map(|e| ((pi, e), rx)) }).boxed())
        .collect();
    let merged = stream::select_all(per_prompt);
    let object = if kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" };
    let chunk = {
        let (id, model) = (id.clone(), model.clone());
        move |choices: Value, usage: Option<Value>| -> Event {
            let mut body = json!({"id": id, "object": object, "created": created, "model": model, "choices": choices});
            if let Some(u) = usage {
                body["usage"] = u;
            }
            Event::default().data(body.to_string())
        }
    };
    let mut first: Vec<Event> = Vec::new();
    if kind == Kind::Chat {
        for i in 0..total_choices {
            first.push(chunk(json!([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]), None));
        }
    }
    struct S<M, C> {
        merged: M,
        chunk: C,
        queue: std::collections::VecDeque<Event>,
        completion: HashMap<usize, usize>,
        cached: HashMap<usize, usize>,
        tool_output: Option<tools::ToolOutput>,
        parsers: HashMap<usize, ToolCallParser>,
        done: bool,
    }
    let state = S { merged, chunk, queue: first.into(), completion: HashMap::new(), cached: HashMap::new(), tool_output, parsers: HashMap::new(), done: false };
    let tok = st.tokenizer.clone();
    let body = stream::unfold(state, move |mut s| {
        let tok = tok.clone();
        let id_prefix = id_prefix.clone();
        async move {
            loop {
                if let Some(e) = s.queue.pop_front() {
                    return Some((Ok(e), s));
                }
                if s.done {
                    return None;
                }
                match s.merged.next().await {
                    Some((pi, EngineEvent::Delta { index, text, tokens })) => {
                        let idx = pi * n + index;
                        if let Some(t) = &s.tool_output {
                            let deltas = s.parsers.entry(idx).or_insert_with(|| t.parser()).push(&text);
                            let delta = tools::stream_delta(&deltas, &format!("{id_prefix}_{idx}"));
                            if delta.is_none() && !want_logprobs {
                                continue;
                            }
                            let choice = json!({"index": idx, "delta": delta.unwrap_or_else(|| json!({})),
                                "logprobs": if want_logprobs { chat_logprobs(&tok, &tokens) } else { Value::Null }, "finish_reason": null});
                            s.queue.push_back((s.chunk)(json!([choice]), None));
                            continue;
                        }
                        if text.is_empty() && !want_logprobs {
                            continue;
                        }
                        let choice = match kind {
                            Kind::Chat => json!({"index": idx, "delta": {"content": text},
                                "logprobs": if want_logprobs { chat_logprobs(&tok, &tokens) } else { Value::Null }, "finish_reason": null}),
                            Kind::Completion => json!({"index": idx, "text": text,
                                "logprobs": if want_logprobs { completion_logprobs(&tok, &tokens) } else { Value::Null }, "finish_reason": null}),
                        };
                        s.queue.push_back((s.chunk)(json!([choice]), None));
                    }
                    Some((pi, EngineEvent::Finished { index, reason, completion_tokens, cached_prompt_tokens, .. })) => {
                        let idx = pi * n + index;
                        s.completion.insert(idx, completion_tokens);
                        s.cached.insert(pi, cached_prompt_tokens);
                        let mut finish = reason.as_openai_str();
                        if let Some(t) = &s.tool_output {
                            let parser = s.parsers.entry(idx).or_insert_with(|| t.parser());
                            let deltas = parser.finish();
                            finish = chat_finish_reason(reason, parser);
                            if let Some(delta) = tools::stream_delta(&deltas, &format!("{id_prefix}_{idx}")) {
                                s.queue.push_back((s.chunk)(json!([{"index": idx, "delta": delta, "logprobs": null, "finish_reason": null}]), None));
                            }
                        }
                        let choice = match kind {
                            Kind::Chat => json!({"index": idx, "delta": {}, "logprobs": null, "finish_reason": finish}),
                            Kind::Completion => json!({"index": idx, "text": "", "logprobs": null, "finish_reason": reason.as_openai_str()}),
                        };
                        s.queue.push_back((s.chunk)(json!([choice]), None));
                    }
                    Some((_, EngineEvent::Failed(msg))) => {
                        s.queue.push_back(Event::default().data(error_body(&msg, "server_error", None, None).to_string()));
                        s.done = true;
                    }
                    None => {
                        if include_usage {
                            let u = Usage { prompt: prompt_tokens, completion: s.completion.values().sum(), cached: s.cached.values().sum() };
                            s.queue.push_back((s.chunk)(json!([]), Some(usage(u))));
                        }
                        s.queue.push_back(Event::default().data("[DONE]"));
                        s.done = true;
                    }
                }
            }
        }
    });
    Sse::new(body.boxed())
}

/// Checks a `/v1/completions` body and tokenizes its prompt(s); everything the handler does
/// before it submits to the engine.
///
/// # Errors
/// A 400 [`ApiError`] naming the problem: not JSON or not an object, a field of the wrong type,
/// another model, an unsupported field (`echo`, `suffix`, `best_of != n`), `max_tokens` 0, an
/// invalid sampling parameter, an empty prompt, token ids beyond the vocabulary, `tools` /
/// `tool_choice` (a chat feature), an output constraint (`response_format`, `guided_json`,
/// `guided_regex`, `guided_grammar`) that is malformed or does not compile.
pub fn prepare_completion(st: &RequestContext<'_>, body: &[u8]) -> std::result::Result<PreparedRequest, ApiError> {
    let v = parse_body(body)?;
    let req: CompletionRequest = serde_json::from_value(v.clone()).map_err(|e| ApiError::bad(format!("invalid completion request: {e}")))?;
    check_model(st, req.model.as_deref())?;
    refuse_completion_tools(&v)?;
    refuse_unknown_fields(&v, COMPLETION_KEYS)?;
    let constraint = compile_constraint(st, &v)?;
    let mut params = sampling_params(&v).map_err(|e| ApiError::bad(format!("invalid sampling parameter: {e}")))?;
    if req.echo == Some(true) {
        return Err(ApiError::bad("echo is not supported").param("echo"));
    }
    if req.suffix.is_some() {
        return Err(ApiError::bad("suffix is not supported").param("suffix"));
    }
    let n = req.n.unwrap_or(1);
    if let Some(b) = req.best_of
        && b != n
    {
        return Err(ApiError::bad("best_of different from n is not supported").param("best_of"));
    }
    if let Some(m) = req.max_tokens {
        if m == 0 {
            return Err(ApiError::bad("max_tokens must be at least 1").param("max_tokens"));
        }
        params.max_new_tokens = Some(m);
    }
    params.logprobs = req.logprobs;
    params.validate().map_err(|e| ApiError::bad(e.to_string()))?;
    let strategy = parse_strategy(&v, &params, n)?;
    let prompts: Vec<Vec<u32>> = match req.prompt {
        Prompt::Text(t) => vec![st.tokenizer.encode_with(&t, true, true).map_err(Error::from)?],
        Prompt::Texts(ts) => ts.iter().map(|t| st.tokenizer.encode_with(t, true, true)).collect::<std::result::Result<_, _>>().map_err(Error::from)?,
        Prompt::Ids(ids) => vec![ids],
        Prompt::IdsList(l) => l,
    };
    if prompts.is_empty() || prompts.iter().any(Vec::is_empty) {
        return Err(ApiError::bad("the prompt must not be empty").param("prompt"));
    }
    let vocab = st.tokenizer.vocab_size();
    if prompts.iter().flatten().any(|&t| t as usize >= vocab) {
        return Err(ApiError::bad(format!("prompt token ids must be below the vocabulary size {vocab}")).param("prompt"));
    }
    Ok(PreparedRequest {
        prompts,
        params,
        n,
        stream: req.stream == Some(true),
        include_usage: req.stream_options.and_then(|o| o.include_usage).unwrap_or(false),
        want_logprobs: req.logprobs.is_some(),
        constraint,
        tool_output: None,
        strategy,
        autodeco: parse_autodeco(&v)?,
        default_max: DefaultMax::Fixed(16),
    })
}

async fn completions(State(gate): State<Arc<Readiness>>, body: Body) -> ApiResult<Response> {
    // The body is read first: answering before it is read would make the kernel reset the
    // connection of a client still sending (see the module docs).
    let body = read_body(body).await?;
    let st = gate.state()?;
    let prep = prepare_completion(&st.request_context(), &body)?;
    let (stream, include_usage, want_logprobs) = (prep.stream, prep.include_usage, prep.want_logprobs);
    let sub = submit_all(&st, prep)?;
    let id = format!("cmpl-{}", uniq());
    if stream {
        return Ok(sse_stream(st.clone(), sub, Kind::Completion, id, include_usage, want_logprobs).into_response());
    }
    let (accs, counts) = collect(sub).await?;
    let choices: Vec<Value> = accs
        .iter()
        .enumerate()
        .map(|(i, a)| {
            json!({
                "index": i,
                "text": a.text,
                "logprobs": if want_logprobs { completion_logprobs(&st.tokenizer, &a.tokens) } else { Value::Null },
                "finish_reason": a.finish.map(|f| f.as_openai_str()),
            })
        })
        .collect();
    Ok(Json(json!({
        "id": id, "object": "text_completion", "created": now(), "model": st.model_name,
        "choices": choices, "usage": usage(counts),
    }))
    .into_response())
}

fn uniq() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    format!("{:x}{:04x}", now(), N.fetch_add(1, Ordering::Relaxed))
}

/// Checks a `/v1/chat/completions` body, renders the conversation through the model's chat
/// template and tokenizes it; everything the handler does before it submits to the engine.
///
/// # Errors
/// A 400 [`ApiError`] naming the problem: not JSON or not an object, a field of the wrong type,
/// another model, no chat template, no messages, a non-text content part, `max_tokens` 0,
/// `top_logprobs` without `logprobs`, an invalid sampling parameter, a template that fails to
/// render (or exceeds its render budget), an output constraint that is malformed or does not
/// compile; for tools (module [`crate::tools`]): a malformed `tools`, `tool_choice` or
/// `parallel_tool_calls`, an assistant message's `tool_calls` whose arguments are not a JSON
/// object, tools for a template that renders none, `required` / a named function together with
/// another output constraint, parameter schemas llguidance cannot compile.
pub fn prepare_chat(st: &RequestContext<'_>, body: &[u8]) -> std::result::Result<PreparedRequest, ApiError> {
    let v = parse_body(body)?;
    let req: ChatRequest = serde_json::from_value(v.clone()).map_err(|e| ApiError::bad(format!("invalid chat request: {e}")))?;
    check_model(st, req.model.as_deref())?;
    refuse_unknown_fields(&v, CHAT_KEYS)?;
    if let Some(m) = req.messages.iter().find(|m| !ROLES.contains(&m.role.as_str())) {
        return Err(ApiError::bad(format!("message role `{}` is not supported (expected one of {})", m.role, ROLES.join(", "))).param("messages"));
    }
    let tool_req = ToolRequest::parse(&v)?.filter(ToolRequest::active);
    let mut constraint = compile_constraint(st, &v)?;
    let mut params = sampling_params(&v).map_err(|e| ApiError::bad(format!("invalid sampling parameter: {e}")))?;
    let Some(template) = st.template else {
        return Err(ApiError::bad("this model has no chat template; use /v1/completions"));
    };
    let mut tool_output = None;
    if let Some(t) = &tool_req {
        let Some(format) = ToolFormat::detect(template.source()) else {
            return Err(ApiError::bad("this model's chat template does not render tools, so deco cannot prompt it to call them; send tools only to a model whose template has tool calls (e.g. Qwen2.5)").param("tools"));
        };
        if let Some(grammar) = t.grammar(format) {
            if constraint.is_some() {
                return Err(ApiError::bad("tool_choice required or a named function constrains the output already; it cannot be combined with response_format or guided_*").param("tool_choice"));
            }
            let Some(g) = st.grammars else {
                return Err(ApiError::bad("constrained tool calls are not available for this model's tokenizer").param("tool_choice"));
            };
            constraint = Some(g.compile(&OutputConstraint::Lark(grammar)).map_err(|e| ApiError::bad(format!("the tools' parameter schemas: {e}")).param("tools"))?);
        }
        tool_output = Some(tools::ToolOutput { format, parallel: t.parallel, names: t.names() });
    }
    if req.messages.is_empty() {
        return Err(ApiError::bad("messages must not be empty").param("messages"));
    }
    let mut messages = Vec::with_capacity(req.messages.len());
    for m in &req.messages {
        let content = match &m.content {
            None => String::new(),
            Some(Content::Text(t)) => t.clone(),
            Some(Content::Parts(parts)) => {
                let mut s = String::new();
                for p in parts {
                    if p.kind != "text" {
                        return Err(ApiError::bad(format!("content part type `{}` is not supported (text only)", p.kind)).param("messages"));
                    }
                    s.push_str(p.text.as_deref().unwrap_or(""));
                }
                s
            }
        };
        let mut msg = ChatMessage::new(m.role.clone(), content);
        msg.tool_calls = m.tool_calls.as_deref().map(tools::message_tool_calls).transpose()?;
        msg.tool_call_id.clone_from(&m.tool_call_id);
        msg.name.clone_from(&m.name);
        messages.push(msg);
    }
    let n = req.n.unwrap_or(1);
    if let Some(m) = req.max_completion_tokens.or(req.max_tokens) {
        if m == 0 {
            return Err(ApiError::bad("max_tokens must be at least 1").param("max_tokens"));
        }
        params.max_new_tokens = Some(m);
    }
    let want_logprobs = req.logprobs == Some(true);
    if req.top_logprobs.is_some() && !want_logprobs {
        return Err(ApiError::bad("top_logprobs requires logprobs: true").param("top_logprobs"));
    }
    params.logprobs = want_logprobs.then(|| req.top_logprobs.unwrap_or(0));
    params.validate().map_err(|e| ApiError::bad(e.to_string()))?;
    let strategy = parse_strategy(&v, &params, n)?;
    let bos = st.tokenizer.bos_token().unwrap_or_default();
    let eos = st.tokenizer.eos_token().unwrap_or_default();
    let extra = tool_req.as_ref().map_or(Value::Null, |t| json!({"tools": t.tools}));
    let text = template
        .render_with(&messages, req.add_generation_prompt.unwrap_or(true), &bos, &eos, &extra)
        .map_err(|e| ApiError::bad(e.to_string()))?;
    let prompt = st.tokenizer.encode_with(&text, false, true).map_err(Error::from)?;
    Ok(PreparedRequest {
        prompts: vec![prompt],
        params,
        n,
        stream: req.stream == Some(true),
        include_usage: req.stream_options.and_then(|o| o.include_usage).unwrap_or(false),
        want_logprobs,
        constraint,
        tool_output,
        strategy,
        autodeco: parse_autodeco(&v)?,
        default_max: DefaultMax::RestOf(st.max_sequence_tokens),
    })
}

async fn chat_completions(State(gate): State<Arc<Readiness>>, body: Body) -> ApiResult<Response> {
    // The body is read first: answering before it is read would make the kernel reset the
    // connection of a client still sending (see the module docs).
    let body = read_body(body).await?;
    let st = gate.state()?;
    let prep = prepare_chat(&st.request_context(), &body)?;
    let (stream, include_usage, want_logprobs) = (prep.stream, prep.include_usage, prep.want_logprobs);
    let sub = submit_all(&st, prep)?;
    let tool_output = sub.tool_output.clone();
    let uid = uniq();
    let id = format!("chatcmpl-{uid}");
    if stream {
        return Ok(sse_stream(st.clone(), sub, Kind::Chat, id, include_usage, want_logprobs).into_response());
    }
    let (accs, counts) = collect(sub).await?;
    let choices: Vec<Value> = accs
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let (message, finish) = match &tool_output {
                None => (json!({"role": "assistant", "content": a.text}), a.finish.map(|f| f.as_openai_str())),
                Some(t) => {
                    let mut parser = t.parser();
                    let mut deltas = parser.push(&a.text);
                    deltas.extend(parser.finish());
                    (tools::message(&deltas, &format!("{uid}_{i}")), a.finish.map(|f| chat_finish_reason(f, &parser)))
                }
            };
            json!({
                "index": i,
                "message": message,
                "logprobs": if want_logprobs { chat_logprobs(&st.tokenizer, &a.tokens) } else { Value::Null },
                "finish_reason": finish,
            })
        })
        .collect();
    Ok(Json(json!({
        "id": id, "object": "chat.completion", "created": now(), "model": st.model_name,
        "choices": choices, "usage": usage(counts),
    }))
    .into_response())
}
