//! Hugging Face chat templates (Jinja) rendered with `minijinja`.
//!
//! The environment mirrors transformers' `_compile_jinja_template` / `apply_chat_template`
//! (`transformers/utils/chat_template_utils.py`):
//!
//! - `trim_blocks` and `lstrip_blocks` on, trailing newline of the template dropped (Jinja's
//!   default `keep_trailing_newline=False`), `{% break %}` / `{% continue %}` available
//!   (`jinja2.ext.loopcontrols`);
//! - `raise_exception(message)` fails the render with `message`;
//! - `strftime_now(format)` formats the current time (UTC here: no time-zone database);
//! - `tojson` is transformers' override: `json.dumps(x, ensure_ascii=False, indent=None,
//!   separators=None, sort_keys=False)`, so no HTML escaping and Python's `", "` / `": "`
//!   separators;
//! - Python string/dict methods (`.strip()`, `.startswith()`, `.items()`, ...) through
//!   `minijinja-contrib`'s `pycompat::unknown_method_callback`;
//! - render variables `messages`, `add_generation_prompt`, `bos_token`, `eos_token` (plus
//!   whatever [`ChatTemplate::render_with`] is given, e.g. `tools`).
//!
//! Not supported: transformers' `{% generation %}` block (`AssistantTracker`, used only to build
//! assistant masks).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, ErrorKind, State};
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// One chat message (`{"role": ..., "content": ...}` in transformers), with the tool-calling
/// fields of OpenAI's messages. The optional fields are left out of the template's `message`
/// when `None`, so `message.tool_calls is defined` is false for them, as in transformers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// The message text.
    pub content: String,
    /// An assistant message's tool calls, each `{"id", "type": "function", "function": {"name",
    /// "arguments"}}` with `arguments` a JSON object (transformers' form; an OpenAI request's
    /// arguments string is parsed first, as vLLM does).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// A `tool` message's answer to this call id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// The name of the author (or of the tool, for a `tool` message).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    /// A message with the given role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into(), tool_calls: None, tool_call_id: None, name: None }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

const NAME: &str = "chat_template";

fn template_error(what: &str, e: &minijinja::Error) -> Error {
    let mut msg = format!("{what}: {}", e.kind());
    if let Some(detail) = e.detail() {
        msg.push_str(": ");
        msg.push_str(detail);
    }
    if let Some(line) = e.line() {
        msg.push_str(&format!(" (template line {line})"));
    }
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        msg.push_str(&format!(": {s}"));
        source = s.source();
    }
    Error::ChatTemplate(msg)
}

/// Fixed part of the budget of one render (minijinja "fuel"). A render's budget is
/// [`render_fuel`]: this, plus [`RENDER_FUEL_PER_MESSAGE`] per message, plus
/// [`RENDER_FUEL_PER_INPUT_BYTE`] per byte of the conversation and extra variables, so the work
/// a template may do grows with its input and not beyond.
///
/// minijinja charges one unit per template instruction, plus one per 64 bytes or 2 list slots
/// an operation produces and one per 2 items a filter visits, checked before the allocation
/// where the size is known. A hostile template (nested loops, runaway macro recursion, a string
/// or list doubled in a loop) stops with an "out of fuel" error instead of running for minutes
/// or exhausting memory: a render produces at most 64 bytes per unit (about 3 MiB for a short
/// conversation). The real templates deco is tested with use about 50 units per message; 20,000
/// messages render through each of them (measured in the tests).
pub const RENDER_FUEL_BASE: u64 = 50_000;

/// Budget added per message (see [`RENDER_FUEL_BASE`]).
pub const RENDER_FUEL_PER_MESSAGE: u64 = 200;

/// Budget added per byte of input: the messages and the extra variables as JSON (see
/// [`RENDER_FUEL_BASE`]); a render may copy each input byte about 64 times.
pub const RENDER_FUEL_PER_INPUT_BYTE: u64 = 1;

/// The budget of rendering `messages` with the extra variables `extra`:
/// `RENDER_FUEL_BASE + RENDER_FUEL_PER_MESSAGE · messages + RENDER_FUEL_PER_INPUT_BYTE · bytes`,
/// `bytes` the length of the messages and of `extra` as JSON.
pub fn render_fuel(messages: &[ChatMessage], extra: &serde_json::Value) -> u64 {
    let bytes = serde_json::to_vec(messages).map_or(0, |v| v.len()) + serde_json::to_vec(extra).map_or(0, |v| v.len());
    RENDER_FUEL_BASE
        .saturating_add(RENDER_FUEL_PER_MESSAGE.saturating_mul(messages.len() as u64))
        .saturating_add(RENDER_FUEL_PER_INPUT_BYTE.saturating_mul(bytes as u64))
}

/// Size of the stack segment a render runs on, in bytes (virtual: pages are only committed as
/// they are used, and the segment is unmapped when the render returns). Nesting is bounded by
/// the budget ([`render_fuel`]; each level costs a few instructions), and dropping or iterating
/// a nested value recurses once per level. Measured (release build): the deepest list nesting
/// of a ~1.05 M fuel budget (a 1 MB message, ~150,000 levels) overflows a 4 MiB segment and
/// fits in 8 MiB, so this size holds the budgets of inputs some 60 times larger than that (the
/// server refuses bodies over 2 MiB).
pub const RENDER_STACK_BYTES: usize = 512 << 20;

/// Renders on a fresh stack segment of [`RENDER_STACK_BYTES`] on the calling thread (the
/// `stacker` crate: `mmap`, a guard page, a switch of the stack pointer; the segment is unmapped
/// when the render returns), and drops everything the render built there.
///
/// Earlier versions rendered on threads with a stack of that size, first one per render
/// (about 1 ms per render in the fuzzing build, where the sanitizer clears the shadow of the
/// whole stack when a thread ends), then on a pool of reused threads. A pooled thread outlives
/// the render: LeakSanitizer, checking between two fuzzing inputs while such a thread was alive,
/// twice reported the thread's own allocations (the spawn closure, glibc's thread-local
/// destructor nodes) as leaked (docs/reliability.md). A render now starts no thread and leaves
/// nothing behind when it returns. The segment costs about 6 µs per render (a trivial template:
/// 9.5 µs against 3.9 µs on a pooled thread, release build, beside a build).
fn render_on_large_stack(env: Environment<'static>, ctx: Value) -> Result<String> {
    stacker::maybe_grow(RENDER_STACK_BYTES, RENDER_STACK_BYTES, move || {
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            let tmpl = env.get_template(NAME).map_err(|e| template_error("render error", &e))?;
            tmpl.render(ctx).map_err(|e| template_error("render error", &e))
        }));
        // Everything the render built is dropped here, on the large stack.
        drop(env);
        match outcome {
            Ok(result) => result,
            Err(_) => Err(Error::ChatTemplate("the template engine panicked".into())),
        }
    })
}

impl ChatTemplate {
    /// Compiles a Jinja chat template (e.g. `tokenizer.chat_template` from GGUF metadata or
    /// `chat_template` from `tokenizer_config.json`).
    ///
    /// # Errors
    /// [`Error::ChatTemplate`] with the syntax error and its line.
    pub fn new(source: impl Into<String>) -> Result<Self> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .map_err(|e| template_error("syntax configuration", &e))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        let source = source.into();
        env.add_template_owned(NAME, source.clone()).map_err(|e| template_error("syntax error", &e))?;
        Ok(Self { env, source })
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders a conversation like transformers' `apply_chat_template(messages, tokenize=False,
    /// add_generation_prompt=...)`, with `bos_token` and `eos_token` as template variables.
    ///
    /// # Errors
    /// [`Error::ChatTemplate`] if rendering fails (including `raise_exception` in the template).
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<String> {
        self.render_with(messages, add_generation_prompt, bos_token, eos_token, &serde_json::Value::Null)
    }

    /// [`ChatTemplate::render`] with extra template variables: the keys of `extra` (a JSON
    /// object, e.g. `{"tools": [...]}`, or `null`) are added to the context, overriding the
    /// defaults.
    ///
    /// # Errors
    /// [`Error::ChatTemplate`] if `extra` is neither an object nor `null`, or rendering fails.
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        bos_token: &str,
        eos_token: &str,
        extra: &serde_json::Value,
    ) -> Result<String> {
        let mut ctx: Vec<(String, Value)> = vec![
            ("messages".into(), Value::from(minijinja::value::Serde(messages))),
            ("add_generation_prompt".into(), Value::from(add_generation_prompt)),
            ("bos_token".into(), Value::from(bos_token)),
            ("eos_token".into(), Value::from(eos_token)),
        ];
        match extra {
            serde_json::Value::Null => {}
            serde_json::Value::Object(map) => {
                for (k, v) in map {
                    ctx.retain(|(name, _)| name != k);
                    ctx.push((k.clone(), Value::from(minijinja::value::Serde(v))));
                }
            }
            other => {
                return Err(Error::ChatTemplate(format!("extra variables must be a JSON object, got {other}")));
            }
        }
        let ctx = Value::from_pairs(ctx);
        // The budget belongs to the environment: a cheap copy (the compiled template and the
        // functions are shared) carries this render's.
        let mut env = self.env.clone();
        env.set_fuel(Some(render_fuel(messages, extra)));
        // On a large stack: dropping or iterating a value nested N deep recurses N deep, and a
        // budget of F fuel lets a template nest lists about F / 7 deep (hundreds of thousands
        // of levels for a few megabytes of input).
        render_on_large_stack(env, ctx)
    }
}

/// transformers' `raise_exception`: fails the render with the given message.
fn raise_exception(message: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, format!("raise_exception: {message}")))
}

/// transformers' `strftime_now(format)`: `datetime.now().strftime(format)`, in UTC.
fn strftime_now(format: String) -> std::result::Result<Value, minijinja::Error> {
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    Ok(Value::from(strftime_utc(&format, secs)))
}

/// Formats a Unix time (UTC) with C `strftime` directives (the common subset:
/// `%Y %y %m %d %e %H %I %M %S %p %b %B %a %A %j %%` and `%F %T`); unknown directives are kept
/// verbatim, as Python does on glibc for unknown ones.
pub fn strftime_utc(format: &str, unix_secs: u64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
    let days = unix_secs / 86_400;
    let sod = unix_secs % 86_400;
    let (hour, minute, second) = (sod / 3600, sod % 3600 / 60, sod % 60);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_mar = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_mar + 2) / 153;
    let day = doy_mar - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(month - 1) as usize] + day + i64::from(leap && month > 2);
    let weekday = ((days as i64 + 3) % 7) as usize; // 1970-01-01 was a Thursday (index 3).
    let month_name = MONTHS[(month - 1) as usize];
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:2}")),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!("{hour12:02}")),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('b') | Some('h') => out.push_str(&month_name[..3]),
            Some('B') => out.push_str(month_name),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('F') => out.push_str(&format!("{year}-{month:02}-{day:02}")),
            Some('T') => out.push_str(&format!("{hour:02}:{minute:02}:{second:02}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Widest `tojson(indent=...)` accepted (real templates use 2 or 4).
const MAX_TOJSON_INDENT: usize = 64;

/// Deepest nesting `tojson` serializes (Python's `json.dumps` raises `RecursionError` near its
/// recursion limit of 1000).
pub const MAX_TOJSON_DEPTH: usize = 512;

/// transformers' `tojson` filter: `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)` with those keyword arguments accepted.
///
/// The work is charged to the render budget as it goes (one fuel per value visited, one per 4
/// bytes written, minijinja's rate for serialized output), and nesting deeper than
/// [`MAX_TOJSON_DEPTH`] is an error (Python raises `RecursionError`), so a template cannot make it
/// serialize a lazily doubled sequence of 2^32 items or overflow the stack.
fn tojson(state: &State, value: &Value, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match (v.as_i64(), v.as_str()) {
            (Some(n), _) => {
                // Python accepts any width; a hostile template must not allocate without bound.
                let n = usize::try_from(n).unwrap_or(0);
                if n > MAX_TOJSON_INDENT {
                    return Err(minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: indent {n} is over {MAX_TOJSON_INDENT}")));
                }
                Some(" ".repeat(n))
            }
            (None, Some(s)) => Some(s.to_owned()),
            _ => {
                return Err(minijinja::Error::new(ErrorKind::InvalidOperation, "tojson: indent must be an int or str"));
            }
        },
    };
    let (item_sep, key_sep) = match separators {
        Some(s) if s.len() == 2 => (s[0].clone(), s[1].clone()),
        Some(_) => {
            return Err(minijinja::Error::new(ErrorKind::InvalidOperation, "tojson: separators must be a pair"));
        }
        None if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
    };
    let opts = JsonOpts {
        ensure_ascii: ensure_ascii.unwrap_or(false),
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
        charged: std::cell::Cell::new(0),
    };
    let mut out = String::new();
    py_json(state, value, &opts, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

struct JsonOpts {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    /// Output length already charged to the render budget.
    charged: std::cell::Cell<usize>,
}

fn newline_indent(opts: &JsonOpts, level: usize, out: &mut String) {
    if let Some(ind) = &opts.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(ind);
        }
    }
}

/// Python `json.dumps` of a template value.
fn py_json(state: &State, v: &Value, opts: &JsonOpts, level: usize, out: &mut String) -> std::result::Result<(), minijinja::Error> {
    if level > MAX_TOJSON_DEPTH {
        return Err(minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: nesting deeper than {MAX_TOJSON_DEPTH}")));
    }
    charge(state, opts, out, 1)?;
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if v.is_integer() {
                out.push_str(&v.to_string());
            } else {
                let f = f64::try_from(v.clone())?;
                out.push_str(&py_float_repr(f));
            }
        }
        ValueKind::String => py_json_str(v.as_str().unwrap_or_default(), opts.ensure_ascii, out),
        ValueKind::Bytes => {
            let s = String::from_utf8_lossy(v.as_bytes().unwrap_or_default()).into_owned();
            py_json_str(&s, opts.ensure_ascii, out);
        }
        ValueKind::Map => {
            state.consume_fuel(v.len().unwrap_or(0) as u64)?;
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if opts.sort_keys {
                keys.sort_by_key(|a| a.to_string());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline_indent(opts, level + 1, out);
                let key = match k.as_str() {
                    Some(s) => s.to_owned(),
                    None if k.is_none() => "null".to_owned(),
                    None if k.kind() == ValueKind::Bool => (if k.is_true() { "true" } else { "false" }).to_owned(),
                    None => k.to_string(),
                };
                py_json_str(&key, opts.ensure_ascii, out);
                out.push_str(&opts.key_sep);
                py_json(state, &v.get_item(k)?, opts, level + 1, out)?;
            }
            newline_indent(opts, level, out);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            // Streamed, not collected: the sequence may be a lazy concatenation far longer
            // than the budget allows to visit.
            let mut empty = true;
            for item in v.try_iter()? {
                out.push_str(if empty { "[" } else { &opts.item_sep });
                empty = false;
                newline_indent(opts, level + 1, out);
                py_json(state, &item, opts, level + 1, out)?;
            }
            if empty {
                out.push_str("[]");
                return Ok(());
            }
            newline_indent(opts, level, out);
            out.push(']');
        }
        _ => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: object of kind {} is not JSON serializable", v.kind()),
            ));
        }
    }
    charge(state, opts, out, 0)
}

/// Charges `fuel` plus the bytes written since the last charge (4 per fuel).
fn charge(state: &State, opts: &JsonOpts, out: &str, fuel: u64) -> std::result::Result<(), minijinja::Error> {
    let new = out.len().saturating_sub(opts.charged.get());
    opts.charged.set(out.len());
    state.consume_fuel(fuel + new as u64 / 4)
}

/// Python `json` string encoding.
fn py_json_str(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c if ensure_ascii && (c as u32) > 0x7E => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python `repr(float)` (what `json.dumps` writes): shortest round-trip digits, positional for
/// exponents in [-4, 16), otherwise `d.ddde+XX`.
fn py_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0".into() } else { "0.0".into() };
    }
    // `{:e}` gives the shortest round-trip digits: "-1.2345e-7".
    let e = format!("{f:e}");
    let (mantissa, exp) = e.split_once('e').unwrap_or((&e, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = mantissa.strip_prefix('-').map_or(("", mantissa), |m| ("-", m));
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    if (-4..16).contains(&exp) {
        let n = digits.len() as i32;
        let point = exp + 1; // digits before the decimal point
        let body = if point <= 0 {
            format!("0.{}{}", "0".repeat((-point) as usize), digits)
        } else if point >= n {
            format!("{}{}.0", digits, "0".repeat((point - n) as usize))
        } else {
            format!("{}.{}", &digits[..point as usize], &digits[point as usize..])
        };
        format!("{sign}{body}")
    } else {
        let m = if digits.len() > 1 { format!("{}.{}", &digits[..1], &digits[1..]) } else { digits };
        let es = if exp < 0 { '-' } else { '+' };
        format!("{sign}{m}e{es}{:02}", exp.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_matches_python() {
        assert_eq!(py_float_repr(1.0), "1.0");
        assert_eq!(py_float_repr(0.5), "0.5");
        assert_eq!(py_float_repr(-2.25), "-2.25");
        assert_eq!(py_float_repr(1e16), "1e+16");
        assert_eq!(py_float_repr(123456789.0), "123456789.0");
        assert_eq!(py_float_repr(0.0001), "0.0001");
        assert_eq!(py_float_repr(0.00001), "1e-05");
        assert_eq!(py_float_repr(1.5e-7), "1.5e-07");
        assert_eq!(py_float_repr(0.1), "0.1");
    }

    #[test]
    fn strftime_known_dates() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        let t = 1_709_211_909;
        assert_eq!(strftime_utc("%Y-%m-%d %H:%M:%S", t), "2024-02-29 13:05:09");
        assert_eq!(strftime_utc("%d %b %Y", t), "29 Feb 2024");
        assert_eq!(strftime_utc("%A %B %j %I%p %%", t), "Thursday February 060 01PM %");
        assert_eq!(strftime_utc("%F %T", 0), "1970-01-01 00:00:00");
        assert_eq!(strftime_utc("%a", 0), "Thu");
    }
}
