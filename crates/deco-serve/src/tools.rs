//! Tool calls (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`): the request's tool
//! list checked, rendered through the model's chat template (its `tools` variable, as
//! transformers' `apply_chat_template(tools=...)`), the output parsed back into
//! `message.tool_calls`, and for `tool_choice: "required"` or a named function the output
//! constrained by a grammar (module [`crate::structured`]) so that it is a well-formed call.
//!
//! # Formats
//! One call format is supported, [`ToolFormat::Hermes`]: each call is
//! `<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>`, the
//! format of Qwen2.5 (and Hermes 2 Pro, Qwen3) chat templates; vLLM's `hermes` tool parser
//! (`vllm/entrypoints/openai/tool_parsers/hermes_tool_parser.py`) reads the same. A model's
//! format is recognized from its chat template ([`ToolFormat::detect`]); a request with tools
//! for a template that renders none is refused.
//!
//! # Semantics (and where they differ from vLLM)
//! - `auto` (the default when `tools` is given): the model decides; every complete
//!   `<tool_call>` block whose body parses as `{"name": string, "arguments": object}` becomes a
//!   call, text outside the blocks is `content` (`null` when there is none). A block that does
//!   not parse stays in `content` as text, as vLLM's hermes parser does.
//! - `required`: the output is one or more calls (one with `parallel_tool_calls: false`) of the
//!   given functions, each `arguments` valid under the function's `parameters` schema, enforced
//!   by token masks. vLLM constrains `required` to a JSON array of calls instead of the model's
//!   own format; deco keeps the format the model was trained on.
//! - a named function (`{"type": "function", "function": {"name": ...}}`): exactly one call of
//!   that function, constrained the same way.
//! - `none`: the tools are not rendered and the output is not parsed (vLLM renders them unless
//!   `--exclude-tools-when-tool-choice-none`; deco does not, so the model is not prompted to
//!   call what it may not call).
//! - `parallel_tool_calls: false` in `auto` mode keeps the first call and drops later ones
//!   (the model cannot be told); under `required` it is enforced by the grammar.
//! - `finish_reason` is `"tool_calls"` when the choice stopped (EOS or the grammar's end) with
//!   at least one call; a choice cut by `max_tokens` stays `"length"`.
//! - Streaming: text is streamed as `delta.content` as it comes, except a tail that could be
//!   the start of `<tool_call>` and whitespace right before a call; each call is sent as one
//!   `delta.tool_calls` entry (`index`, `id`, `type`, `function.name`, the whole
//!   `function.arguments`) when its closing tag arrives. The streamed content and calls
//!   concatenate to the non-streamed message.

use std::sync::Arc;

use serde_json::{Map, Value, json};

/// A request error: the message and the request field it is about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolError {
    /// What is wrong.
    pub message: String,
    /// The request field (`tools`, `tool_choice`, `parallel_tool_calls`, `messages`).
    pub param: &'static str,
}

fn err<T>(param: &'static str, message: impl Into<String>) -> Result<T, ToolError> {
    Err(ToolError { message: message.into(), param })
}

/// How a model writes tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, calls separated by
    /// `\n` (Qwen2.5's chat template, Hermes 2 Pro).
    Hermes,
}

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

impl ToolFormat {
    /// The format a chat template renders tools in, if any: [`ToolFormat::Hermes`] when the
    /// template uses the `tools` variable and writes `<tool_call>` tags.
    pub fn detect(template_source: &str) -> Option<Self> {
        (template_source.contains("tools") && template_source.contains(OPEN)).then_some(Self::Hermes)
    }
}

/// How a response's output is read back into tool calls: in which format, and whether every
/// call is kept (`parallel_tool_calls`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolOutput {
    /// The model's call format.
    pub format: ToolFormat,
    /// Keep every call (else only the first).
    pub parallel: bool,
    /// The functions of the request (a bare JSON call must name one of them).
    pub names: Arc<[String]>,
}

impl ToolOutput {
    /// A fresh parser for one choice.
    pub fn parser(&self) -> ToolCallParser {
        let ToolFormat::Hermes = self.format;
        ToolCallParser::new(self.parallel, self.names.clone())
    }
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// Do not call tools (tools are not rendered).
    None,
    /// The model decides.
    Auto,
    /// At least one call.
    Required,
    /// Exactly one call of this function.
    Function(String),
}

/// A request's checked tool settings.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolRequest {
    /// The tools, as given (`{"type": "function", "function": {"name", "description",
    /// "parameters", "strict"}}`), for the template's `tools` variable.
    pub tools: Vec<Value>,
    /// `tool_choice` (default `auto` with tools, `none` without).
    pub choice: ToolChoice,
    /// `parallel_tool_calls` (default true).
    pub parallel: bool,
}

fn valid_name(n: &str) -> bool {
    !n.is_empty() && n.len() <= 64 && n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

impl ToolRequest {
    /// Reads `tools`, `tool_choice` and `parallel_tool_calls` from a chat request body;
    /// `None` when it has no tools (an empty list counts as none) and `tool_choice` is absent
    /// or `"none"`.
    ///
    /// # Errors
    /// A [`ToolError`] naming the field: `tools` not a list of `{"type": "function",
    /// "function": {...}}` objects, a function name outside OpenAI's `[a-zA-Z0-9_-]{1,64}`,
    /// names given twice, `parameters` not a JSON-schema object; `tool_choice` not `none`,
    /// `auto`, `required` or `{"type": "function", "function": {"name"}}`, naming a function
    /// not in `tools`, or other than `none` without tools; `parallel_tool_calls` not a boolean.
    pub fn parse(body: &Value) -> Result<Option<Self>, ToolError> {
        let tools = match body.get("tools") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => a.clone(),
            Some(_) => return err("tools", "tools must be a list of tools"),
        };
        let mut names: Vec<&str> = Vec::with_capacity(tools.len());
        for (i, t) in tools.iter().enumerate() {
            if t.get("type").and_then(Value::as_str) != Some("function") {
                return err("tools", format!("tools[{i}].type must be \"function\" (the only tool type)"));
            }
            let Some(f) = t.get("function").and_then(Value::as_object) else {
                return err("tools", format!("tools[{i}].function must be an object"));
            };
            let Some(name) = f.get("name").and_then(Value::as_str) else {
                return err("tools", format!("tools[{i}].function.name must be a string"));
            };
            if !valid_name(name) {
                return err("tools", format!("tools[{i}].function.name {name:?} must be 1 to 64 of a-z, A-Z, 0-9, _ and -"));
            }
            if names.contains(&name) {
                return err("tools", format!("tools[{i}]: the function name {name:?} is given twice"));
            }
            match f.get("parameters") {
                None | Some(Value::Null | Value::Object(_)) => {}
                Some(_) => return err("tools", format!("tools[{i}].function.parameters must be a JSON schema object")),
            }
            names.push(name);
        }
        let choice = match body.get("tool_choice") {
            None | Some(Value::Null) => {
                if tools.is_empty() {
                    ToolChoice::None
                } else {
                    ToolChoice::Auto
                }
            }
            Some(Value::String(s)) => match s.as_str() {
                "none" => ToolChoice::None,
                "auto" => ToolChoice::Auto,
                "required" => ToolChoice::Required,
                other => return err("tool_choice", format!("tool_choice {other:?} is not one of none, auto, required, or a function")),
            },
            Some(c @ Value::Object(_)) => {
                let name = (c.get("type").and_then(Value::as_str) == Some("function"))
                    .then(|| c.get("function").and_then(|f| f.get("name")).and_then(Value::as_str))
                    .flatten();
                let Some(name) = name else {
                    return err("tool_choice", "a named tool_choice must be {\"type\": \"function\", \"function\": {\"name\": ...}}");
                };
                if !names.contains(&name) {
                    return err("tool_choice", format!("tool_choice names the function {name:?}, which is not in tools"));
                }
                ToolChoice::Function(name.to_string())
            }
            Some(_) => return err("tool_choice", "tool_choice must be a string or an object"),
        };
        if tools.is_empty() && choice != ToolChoice::None {
            return err("tool_choice", "tool_choice is only allowed when tools are given");
        }
        let parallel = match body.get("parallel_tool_calls") {
            None | Some(Value::Null) => true,
            Some(Value::Bool(b)) => *b,
            Some(_) => return err("parallel_tool_calls", "parallel_tool_calls must be a boolean"),
        };
        if tools.is_empty() {
            return Ok(None);
        }
        Ok(Some(Self { tools, choice, parallel }))
    }

    /// Whether the tools are rendered and the output parsed (every choice but `none`).
    pub fn active(&self) -> bool {
        self.choice != ToolChoice::None
    }

    /// The function names, in the order given.
    pub fn names(&self) -> Arc<[String]> {
        self.tools.iter().filter_map(|t| t["function"]["name"].as_str().map(str::to_string)).collect()
    }

    /// The Lark grammar (llguidance's syntax) that `required` and named choices constrain the
    /// output to, in `format`; `None` for `auto` and `none`. Each call body is a JSON object
    /// `{"name": <const>, "arguments": <the function's parameters schema>}` written with the
    /// separators of the template's `tojson` (`", "`, `": "`), no other whitespace.
    pub fn grammar(&self, format: ToolFormat) -> Option<String> {
        let ToolFormat::Hermes = format;
        let (funcs, many): (Vec<&Value>, bool) = match &self.choice {
            ToolChoice::None | ToolChoice::Auto => return None,
            ToolChoice::Required => (self.tools.iter().collect(), self.parallel),
            ToolChoice::Function(n) => (self.tools.iter().filter(|t| t["function"]["name"] == n.as_str()).collect(), false),
        };
        let variants: Vec<Value> = funcs
            .iter()
            .map(|t| {
                let f = &t["function"];
                let params = match f.get("parameters") {
                    Some(p @ Value::Object(_)) => p.clone(),
                    _ => json!({"type": "object"}),
                };
                json!({
                    "type": "object",
                    "properties": {"name": {"const": f["name"]}, "arguments": params},
                    "required": ["name", "arguments"],
                    "additionalProperties": false,
                })
            })
            .collect();
        let schema = json!({
            "x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "},
            "anyOf": variants,
        });
        let repeat = if many { " (\"\\n\" call)*" } else { "" };
        Some(format!("start: call{repeat}\ncall: \"<tool_call>\\n\" body \"\\n</tool_call>\"\nbody: %json {schema}\n"))
    }
}

/// Turns the `tool_calls` of an OpenAI assistant message into the template's form: each
/// `function.arguments` JSON string parsed into its object (vLLM's `_postprocess_messages`;
/// chat templates write `arguments | tojson`).
///
/// # Errors
/// A [`ToolError`] (`messages`) for a call that is not an object with `function.name`, or
/// whose `arguments` is neither a JSON object nor a string holding one.
pub fn message_tool_calls(calls: &[Value]) -> Result<Vec<Value>, ToolError> {
    calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut c = c.clone();
            let Some(f) = c.get_mut("function").and_then(Value::as_object_mut) else {
                return err("messages", format!("tool_calls[{i}].function must be an object"));
            };
            if !f.get("name").is_some_and(Value::is_string) {
                return err("messages", format!("tool_calls[{i}].function.name must be a string"));
            }
            let args = match f.get("arguments") {
                None | Some(Value::Null) => Value::Object(Map::new()),
                Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
                    Ok(v @ Value::Object(_)) => v,
                    _ => return err("messages", format!("tool_calls[{i}].function.arguments must be a JSON object (as a string)")),
                },
                Some(v @ Value::Object(_)) => v.clone(),
                Some(_) => return err("messages", format!("tool_calls[{i}].function.arguments must be a JSON object (as a string)")),
            };
            f.insert("arguments".into(), args);
            Ok(c)
        })
        .collect()
}

/// One call parsed from the output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedCall {
    /// Function name.
    pub name: String,
    /// The arguments, as compact JSON text (OpenAI's `function.arguments` string).
    pub arguments: String,
}

/// What [`ToolCallParser`] hands on: text for `content`, or a complete call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolDelta {
    /// Text for `delta.content`.
    Content(String),
    /// The `index`-th call of the choice (0-based).
    Call {
        /// Position among the choice's calls.
        index: usize,
        /// The call.
        call: ParsedCall,
    },
}

/// Incremental parser of one choice's output in [`ToolFormat::Hermes`]: feed it the text as it
/// is generated ([`ToolCallParser::push`]), then [`ToolCallParser::finish`]; the non-streamed
/// response runs the same parser over the whole text, so both agree.
///
/// Small models often write the call object without the tags (Qwen2.5-Coder-0.5B answers
/// "What is the weather in Paris?" with a bare `{"name": "get_weather", "arguments": ...}`):
/// an output that is, as a whole, one such object naming a function of the request is read as
/// that call (llama.cpp's Hermes parser accepts untagged calls too; vLLM's does not). Such an
/// output is held back until it ends, so a streamed answer that starts with `{` arrives at the
/// end.
#[derive(Debug, Clone)]
pub struct ToolCallParser {
    buf: String,
    in_call: bool,
    calls: usize,
    keep_calls: usize,
    names: Arc<[String]>,
    emitted: bool,
}

/// Parses a call body `{"name": string, "arguments": object}` (`arguments` may also be a JSON
/// string holding an object, or be absent: `{}`).
fn parse_call(body: &str) -> Option<ParsedCall> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let args = match v.get("arguments").or_else(|| v.get("parameters")) {
        None => Value::Object(Map::new()),
        Some(a @ Value::Object(_)) => a.clone(),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s).ok()? {
            a @ Value::Object(_) => a,
            _ => return None,
        },
        Some(_) => return None,
    };
    Some(ParsedCall { name, arguments: args.to_string() })
}

/// Length of the longest suffix of `s` that is a proper prefix of `pat`.
fn partial_suffix(s: &str, pat: &str) -> usize {
    (1..pat.len().min(s.len() + 1)).rev().find(|&k| s.is_char_boundary(s.len() - k) && pat.starts_with(&s[s.len() - k..])).unwrap_or(0)
}

impl ToolCallParser {
    /// A parser keeping every call (`parallel_tool_calls: true`) or only the first, for a
    /// request with the functions `names`.
    pub fn new(parallel: bool, names: Arc<[String]>) -> Self {
        Self { buf: String::new(), in_call: false, calls: 0, keep_calls: if parallel { usize::MAX } else { 1 }, names, emitted: false }
    }

    /// Nothing handed on yet and the output so far starts (after whitespace) with `{`: it may
    /// be an untagged call.
    fn maybe_bare(&self) -> bool {
        self.calls == 0 && !self.emitted && self.buf.trim_start().starts_with('{')
    }

    /// Calls emitted so far.
    pub fn calls(&self) -> usize {
        self.calls.min(self.keep_calls)
    }

    fn emit_call(&mut self, body: &str, out: &mut Vec<ToolDelta>) {
        match parse_call(body) {
            Some(call) => {
                if self.calls < self.keep_calls {
                    out.push(ToolDelta::Call { index: self.calls, call });
                }
                self.calls += 1;
            }
            None => out.push(ToolDelta::Content(format!("{OPEN}{body}{CLOSE}"))),
        }
    }

    fn content(&mut self, text: &str, out: &mut Vec<ToolDelta>) {
        // After the calls allowed by `parallel_tool_calls`, the rest is dropped.
        if !text.is_empty() && self.calls < self.keep_calls {
            self.emitted = true;
            out.push(ToolDelta::Content(text.to_string()));
        }
    }

    /// Feeds generated text; returns what can be handed on now.
    pub fn push(&mut self, text: &str) -> Vec<ToolDelta> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            if self.in_call {
                let Some(i) = self.buf.find(CLOSE) else { break };
                let body = self.buf[..i].to_string();
                self.buf.drain(..i + CLOSE.len());
                self.in_call = false;
                self.emit_call(&body, &mut out);
            } else if let Some(i) = self.buf.find(OPEN) {
                // Whitespace right before a call is not content.
                let before = self.buf[..i].trim_end().to_string();
                self.content(&before, &mut out);
                self.buf.drain(..i + OPEN.len());
                self.in_call = true;
            } else if self.maybe_bare() {
                break;
            } else {
                // Hold back what could start `<tool_call>`, and trailing whitespace (it is
                // dropped if a call follows).
                let keep = partial_suffix(&self.buf, OPEN);
                let head_end = self.buf.len() - keep;
                let cut = self.buf[..head_end].trim_end().len();
                let head = self.buf[..cut].to_string();
                self.content(&head, &mut out);
                self.buf.drain(..cut);
                break;
            }
        }
        out
    }

    /// The end of the output: an unclosed `<tool_call>` block becomes a call if its body
    /// parses (a model may stop right after the JSON), else content; held-back text is
    /// flushed as content.
    pub fn finish(&mut self) -> Vec<ToolDelta> {
        let mut out = Vec::new();
        let bare = self.maybe_bare();
        let rest = std::mem::take(&mut self.buf);
        if self.in_call {
            self.in_call = false;
            match parse_call(&rest) {
                Some(_) => self.emit_call(&rest, &mut out),
                None => self.content(&format!("{OPEN}{rest}"), &mut out),
            }
        } else if bare && parse_call(&rest).is_some_and(|c| self.names.contains(&c.name)) {
            let body = rest.trim().to_string();
            self.emit_call(&body, &mut out);
        } else if self.calls == 0 {
            // Trailing whitespace of a plain answer is kept; after calls it is dropped.
            self.content(&rest, &mut out);
        } else {
            let t = rest.trim();
            self.content(t, &mut out);
        }
        out
    }
}

/// The parser's output joined: the content text, and the calls in OpenAI's form (with their
/// `index` when `streamed`, as `delta.tool_calls` entries).
fn join(deltas: &[ToolDelta], id_prefix: &str, streamed: bool) -> (String, Vec<Value>) {
    let mut content = String::new();
    let mut calls = Vec::new();
    for d in deltas {
        match d {
            ToolDelta::Content(t) => content.push_str(t),
            ToolDelta::Call { index, call } => calls.push(call_json(*index, call, id_prefix, streamed)),
        }
    }
    (content, calls)
}

/// The `delta` of a streamed chat chunk from what the parser handed on: `content` and
/// `tool_calls` entries; `None` when there is nothing.
pub fn stream_delta(deltas: &[ToolDelta], id_prefix: &str) -> Option<Value> {
    let (content, calls) = join(deltas, id_prefix, true);
    let mut delta = Map::new();
    if !content.is_empty() {
        delta.insert("content".into(), Value::String(content));
    }
    if !calls.is_empty() {
        delta.insert("tool_calls".into(), Value::Array(calls));
    }
    (!delta.is_empty()).then_some(Value::Object(delta))
}

/// A choice's message from the parser's output: `content` (`null` when empty and there are
/// calls) and `tool_calls` with ids `call_<request>_<choice>_<index>`.
pub fn message(deltas: &[ToolDelta], id_prefix: &str) -> Value {
    let (content, calls) = join(deltas, id_prefix, false);
    let mut m = json!({"role": "assistant", "content": if content.is_empty() && !calls.is_empty() { Value::Null } else { Value::String(content) }});
    if !calls.is_empty() {
        m["tool_calls"] = Value::Array(calls);
    }
    m
}

/// One call in OpenAI's form; with `streamed`, with its `index` (a `delta.tool_calls` entry).
fn call_json(index: usize, call: &ParsedCall, id_prefix: &str, streamed: bool) -> Value {
    let mut v = json!({
        "id": format!("call_{id_prefix}_{index}"),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    });
    if streamed {
        v["index"] = json!(index);
    }
    v
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}})
    }

    fn names() -> Arc<[String]> {
        ["get_weather", "a", "b", "f", "ü"].iter().map(|s| s.to_string()).collect()
    }

    fn parser(parallel: bool) -> ToolCallParser {
        ToolCallParser::new(parallel, names())
    }

    fn run(parser: &mut ToolCallParser, pieces: &[&str]) -> Vec<ToolDelta> {
        let mut out: Vec<ToolDelta> = pieces.iter().flat_map(|p| parser.push(p)).collect();
        out.extend(parser.finish());
        out
    }

    /// Merges adjacent content deltas (streams split content arbitrarily).
    fn merged(ds: Vec<ToolDelta>) -> Vec<ToolDelta> {
        let mut out: Vec<ToolDelta> = Vec::new();
        for d in ds {
            match (out.last_mut(), d) {
                (Some(ToolDelta::Content(a)), ToolDelta::Content(b)) => a.push_str(&b),
                (_, d) => out.push(d),
            }
        }
        out
    }

    #[test]
    fn parses_qwen_calls_and_content() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\", \"unit\": \"c\"}}\n</tool_call>";
        let out = run(&mut parser(true), &[text]);
        assert_eq!(
            merged(out),
            vec![
                ToolDelta::Content("Let me check.".into()),
                ToolDelta::Call { index: 0, call: ParsedCall { name: "get_weather".into(), arguments: r#"{"city":"Paris"}"#.into() } },
                ToolDelta::Call { index: 1, call: ParsedCall { name: "get_weather".into(), arguments: r#"{"city":"Rome","unit":"c"}"#.into() } },
            ]
        );
        let m = message(&run(&mut parser(false), &[text]), "x");
        assert_eq!(m["tool_calls"].as_array().map(Vec::len), Some(1), "parallel_tool_calls false keeps one call: {m}");
        assert_eq!(m["content"], "Let me check.");
    }

    #[test]
    fn plain_text_and_broken_blocks_stay_content() {
        let text = "No tools needed.  \n";
        assert_eq!(merged(run(&mut parser(true), &[text])), vec![ToolDelta::Content(text.into())]);
        let broken = "<tool_call>\nnot json\n</tool_call>";
        assert_eq!(merged(run(&mut parser(true), &[broken])), vec![ToolDelta::Content(broken.into())]);
        // Unclosed but complete body: a call; unclosed and incomplete: content.
        let unclosed = "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n";
        let m = message(&run(&mut parser(true), &[unclosed]), "x");
        assert_eq!(m["tool_calls"][0]["function"]["name"], "f");
        assert_eq!(m["content"], Value::Null);
        let cut = "<tool_call>\n{\"name\": \"f\", \"argu";
        assert_eq!(merged(run(&mut parser(true), &[cut])), vec![ToolDelta::Content(cut.into())]);
        // An untagged call naming a function of the request; JSON that is not one stays text.
        let bare = " {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n";
        let m = message(&run(&mut parser(true), &[bare]), "x");
        assert_eq!((m["content"].clone(), m["tool_calls"][0]["function"]["arguments"].clone()), (Value::Null, json!(r#"{"city":"Paris"}"#)));
        for text in ["{\"name\": \"unknown\", \"arguments\": {}}", "{\"a\": 1}", "{\"name\": \"f\"} and more"] {
            assert_eq!(merged(run(&mut parser(true), &[text])), vec![ToolDelta::Content(text.into())], "{text}");
        }
        // Text that only looks like the start of a tag is released at the end.
        assert_eq!(merged(run(&mut parser(true), &["a <tool_ca"])), vec![ToolDelta::Content("a <tool_ca".into())]);
    }

    proptest! {
        /// Splitting the output anywhere (as token deltas do) changes nothing but how content
        /// is chunked.
        #[test]
        fn streaming_equals_whole(cuts in proptest::collection::vec(0usize..200, 0..12), which in 0usize..4) {
            let texts = [
                "Sure.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": \"<tool_call>\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"b\", \"arguments\": {}}\n</tool_call>",
                "Plain answer with < and <tool and </tool_call> in it.\n\n",
                "é <tool_call>{\"name\": \"ü\", \"arguments\": \"{\\\"k\\\": 1}\"}</tool_call> trailing",
                "\n{\"name\": \"f\", \"arguments\": {\"x\": [1, 2]}}",
            ];
            let text = texts[which];
            let mut idx: Vec<usize> = cuts.iter().map(|c| c % (text.len() + 1)).filter(|&c| text.is_char_boundary(c)).collect();
            idx.sort_unstable();
            idx.dedup();
            let mut pieces = Vec::new();
            let mut last = 0;
            for c in idx {
                pieces.push(&text[last..c]);
                last = c;
            }
            pieces.push(&text[last..]);
            let whole = merged(run(&mut parser(true), &[text]));
            let streamed = merged(run(&mut parser(true), &pieces));
            prop_assert_eq!(whole, streamed);
        }
    }

    #[test]
    fn request_validation_names_the_field() {
        let ok = ToolRequest::parse(&json!({"tools": [weather()]})).unwrap().unwrap();
        assert_eq!(ok.choice, ToolChoice::Auto);
        assert!(ok.parallel);
        assert_eq!(ToolRequest::parse(&json!({"tools": []})).unwrap(), None);
        assert_eq!(ToolRequest::parse(&json!({"tool_choice": "none"})).unwrap(), None);
        let cases = [
            (json!({"tools": {}}), "tools"),
            (json!({"tools": [{"type": "code_interpreter"}]}), "tools"),
            (json!({"tools": [{"type": "function", "function": {"name": "a b"}}]}), "tools"),
            (json!({"tools": [weather(), weather()]}), "tools"),
            (json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}), "tools"),
            (json!({"tool_choice": "auto"}), "tool_choice"),
            (json!({"tools": [weather()], "tool_choice": "sometimes"}), "tool_choice"),
            (json!({"tools": [weather()], "tool_choice": {"type": "function", "function": {"name": "nope"}}}), "tool_choice"),
            (json!({"tools": [weather()], "parallel_tool_calls": "yes"}), "parallel_tool_calls"),
        ];
        for (body, param) in cases {
            let e = ToolRequest::parse(&body).expect_err(&body.to_string());
            assert_eq!(e.param, param, "{body}: {}", e.message);
        }
    }

    #[test]
    fn grammar_only_for_required_and_named() {
        let mut r = ToolRequest::parse(&json!({"tools": [weather()]})).unwrap().unwrap();
        assert_eq!(r.grammar(ToolFormat::Hermes), None);
        r.choice = ToolChoice::Required;
        let g = r.grammar(ToolFormat::Hermes).unwrap();
        assert!(g.contains("(\"\\n\" call)*") && g.contains("\"const\":\"get_weather\""), "{g}");
        r.choice = ToolChoice::Function("get_weather".into());
        assert!(!r.grammar(ToolFormat::Hermes).unwrap().contains("call)*"));
    }

    #[test]
    fn assistant_arguments_strings_become_objects() {
        let calls = [json!({"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}})];
        assert_eq!(message_tool_calls(&calls).unwrap()[0]["function"]["arguments"], json!({"x": 1}));
        let bad = [json!({"function": {"name": "f", "arguments": "[1]"}})];
        assert_eq!(message_tool_calls(&bad).unwrap_err().param, "messages");
    }

    #[test]
    fn detects_qwen_template() {
        assert_eq!(ToolFormat::detect("{% if tools %}<tool_call>{% endif %}"), Some(ToolFormat::Hermes));
        assert_eq!(ToolFormat::detect("{{ messages[0].content }}"), None);
    }
}
