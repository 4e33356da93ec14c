//! OpenAI-compatible request parsing and response bodies (`/v1/completions`,
//! `/v1/chat/completions`), following the OpenAI API reference and vLLM's
//! `entrypoints/openai/protocol.py` (extra sampling fields are accepted at the top level).

use deco_decoding::SamplingParams;
use serde::Deserialize;
use serde_json::{Value, json};

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with `usage` before `[DONE]`.
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// `prompt` of a completion request.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// One text.
    Text(String),
    /// Several texts (one completion group each).
    Texts(Vec<String>),
    /// One pre-tokenized prompt.
    Ids(Vec<u32>),
    /// Several pre-tokenized prompts.
    IdsList(Vec<Vec<u32>>),
}

/// The OpenAI-specific fields of `/v1/completions`; sampling fields are read separately into
/// [`SamplingParams`].
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// Model name; must be the served one when given.
    #[serde(default)]
    pub model: Option<String>,
    /// The prompt(s).
    pub prompt: Prompt,
    /// Most tokens to generate (default 16, as OpenAI).
    #[serde(default)]
    pub max_tokens: Option<usize>,
    /// Completions per prompt (default 1).
    #[serde(default)]
    pub n: Option<usize>,
    /// Stream server-sent events.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Streaming options.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Number of alternatives per token to report (0..=20).
    #[serde(default)]
    pub logprobs: Option<usize>,
    /// Echo the prompt (not supported: rejected when true).
    #[serde(default)]
    pub echo: Option<bool>,
    /// Server-side best-of (only `best_of == n` or absent is accepted).
    #[serde(default)]
    pub best_of: Option<usize>,
    /// Insertion suffix (not supported: rejected when given).
    #[serde(default)]
    pub suffix: Option<String>,
}

/// Message content: a string or a list of `{"type": "text", "text": ...}` parts.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Content parts; only text parts are accepted.
    Parts(Vec<ContentPart>),
}

/// One content part.
#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    /// Part type; must be `text`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text.
    #[serde(default)]
    pub text: Option<String>,
}

/// A chat message of a request.
#[derive(Debug, Clone, Deserialize)]
pub struct RequestMessage {
    /// Role.
    pub role: String,
    /// Content (null allowed for assistant messages).
    #[serde(default)]
    pub content: Option<Content>,
    /// An assistant message's tool calls (`{"id", "type", "function": {"name", "arguments"}}`).
    #[serde(default)]
    pub tool_calls: Option<Vec<Value>>,
    /// The call a `tool` message answers.
    #[serde(default)]
    pub tool_call_id: Option<String>,
    /// Author name (the tool's name for a `tool` message).
    #[serde(default)]
    pub name: Option<String>,
}

/// The OpenAI-specific fields of `/v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    /// Model name.
    #[serde(default)]
    pub model: Option<String>,
    /// The conversation.
    pub messages: Vec<RequestMessage>,
    /// Most tokens to generate (default: the rest of the context).
    #[serde(default)]
    pub max_tokens: Option<usize>,
    /// Newer name of `max_tokens`.
    #[serde(default)]
    pub max_completion_tokens: Option<usize>,
    /// Choices (default 1).
    #[serde(default)]
    pub n: Option<usize>,
    /// Stream server-sent events.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Streaming options.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Return logprobs of the output tokens.
    #[serde(default)]
    pub logprobs: Option<bool>,
    /// Alternatives per token (0..=20), requires `logprobs`.
    #[serde(default)]
    pub top_logprobs: Option<usize>,
    /// Add the generation prompt (default true; vLLM extension).
    #[serde(default)]
    pub add_generation_prompt: Option<bool>,
}

/// Keys that are OpenAI request fields rather than [`SamplingParams`] fields, or whose meaning
/// differs (`logprobs`).
const NON_SAMPLING_KEYS: &[&str] = &[
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "stream",
    "stream_options", "logprobs", "top_logprobs", "echo", "best_of", "suffix", "user",
    "add_generation_prompt", "response_format", "tools", "tool_choice", "parallel_tool_calls",
    "guided_json", "guided_regex", "guided_grammar", "num_beams", "length_penalty", "early_stopping", "penalty_alpha", "early_exit", "contrastive_decoding", "autodeco",
];

/// The request fields of `/v1/completions` besides [`SamplingParams::FIELDS`].
pub const COMPLETION_KEYS: &[&str] = &[
    "model", "prompt", "max_tokens", "n", "stream", "stream_options", "logprobs", "echo", "best_of", "suffix", "user",
    "response_format", "guided_json", "guided_regex", "guided_grammar", "tools", "tool_choice", "parallel_tool_calls",
    "num_beams", "length_penalty", "early_stopping", "penalty_alpha", "early_exit", "contrastive_decoding", "autodeco",
];

/// The request fields of `/v1/chat/completions` besides [`SamplingParams::FIELDS`].
pub const CHAT_KEYS: &[&str] = &[
    "model", "messages", "max_tokens", "max_completion_tokens", "n", "stream", "stream_options", "logprobs",
    "top_logprobs", "user", "add_generation_prompt", "response_format", "tools", "tool_choice", "parallel_tool_calls",
    "guided_json", "guided_regex", "guided_grammar", "num_beams", "length_penalty", "early_stopping", "penalty_alpha", "early_exit", "contrastive_decoding", "autodeco",
];

/// The first field of a request object (in its order) that is neither one of `endpoint_keys`
/// nor a [`SamplingParams`] field, ignoring `null`s: a parameter deco would otherwise silently
/// ignore (e.g. `echo` on chat, vLLM's `guided_choice`, a misspelled `temprature`).
pub fn unknown_field<'a>(body: &'a Value, endpoint_keys: &[&str]) -> Option<&'a str> {
    body.as_object()?
        .iter()
        .find(|(k, v)| !v.is_null() && !endpoint_keys.contains(&k.as_str()) && !SamplingParams::FIELDS.contains(&k.as_str()))
        .map(|(k, _)| k.as_str())
}

/// Chat message roles deco renders through the model's template.
pub const ROLES: &[&str] = &["system", "user", "assistant", "tool"];

/// Reads the sampling fields (every [`SamplingParams`] field by name, OpenAI names included)
/// from a request object.
///
/// # Errors
/// The serde message for a wrong type.
pub fn sampling_params(body: &Value) -> Result<SamplingParams, String> {
    let mut obj = body.as_object().cloned().unwrap_or_default();
    for k in NON_SAMPLING_KEYS {
        obj.remove(*k);
    }
    // `null` means absent for every field.
    obj.retain(|_, v| !v.is_null());
    serde_json::from_value(Value::Object(obj)).map_err(|e| e.to_string())
}

/// An OpenAI error body: `{"error": {"message", "type", "param", "code"}}`.
pub fn error_body(message: &str, kind: &str, param: Option<&str>, code: Option<&str>) -> Value {
    json!({"error": {"message": message, "type": kind, "param": param, "code": code}})
}
