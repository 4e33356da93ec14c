//! Server soak and fault test of `deco serve` (issue 17 part 3; docs/reliability.md).
//!
//! Shared by the example `serve_soak` (`cargo xtask bench serve --soak`: 10,000 requests from 64
//! clients) and the integration test `tests/serve_soak.rs` (a few hundred requests in CI).
//!
//! It starts the real `deco serve` binary as a child process on a loopback port and drives it
//! with HTTP/1.1 clients (hyper's client connection, one TCP connection per request):
//!
//! 1. **Soak**: `requests` requests from `clients` concurrent clients. Each request is drawn from
//!    a seeded generator: `/v1/completions` or `/v1/chat/completions`, streaming or not, `n` of 1
//!    to 3, `max_tokens` 1 to 24, greedy or sampled, stop strings, `stream_options.include_usage`,
//!    logprobs. Mixed in: 20 % cancelled at a random point (after some streamed events or after a
//!    random delay), 5 % slow readers (a pause between body frames), 2 % clients that send the
//!    request and never read (raw socket, held open, then dropped), 2 % bodies over the server's
//!    2 MiB limit (must get a 413 with an OpenAI error body, which the client, still sending,
//!    must be able to read), 4 % malformed bodies (truncated or non-object JSON, wrong types,
//!    out-of-range parameters, invalid UTF-8, unknown model: must get 400 with an OpenAI error
//!    body).
//! 2. Every response that completes is checked: status, JSON of every event, one
//!    `finish_reason` per choice and nothing after it, `[DONE]` last, `n` choices, no stop string
//!    in the text, `usage` arithmetic (`total = prompt + completion`, `completion <= n *
//!    max_tokens`, and `= n * max_tokens` when every choice finished by `length`).
//! 3. **Leaks**: once the clients are done, `/metrics` must report 0 KV blocks in use and 0
//!    pending requests; the resident memory of the server (`/proc/PID/status`) is sampled every
//!    250 ms: its peak must stay under the stated bound (model file + KV cache + 512 MiB) and the
//!    peak of the last fifth of the soak must not exceed the peak of its second fifth by more than
//!    10 % (the first fifth is the warm-up: the KV pool's pages and the allocator's arenas are
//!    touched for the first time).
//! 4. **Drain**: 32 long streams are started; once each has produced a token the server gets
//!    SIGTERM. Each stream must still finish complete (48 tokens, `length`); meanwhile `/health`
//!    and a new completion request must get 503; and the process must exit with status 0.
//!
//! The server must never crash (exit before SIGTERM) and its stderr must not contain a panic.

#![allow(dead_code, clippy::unwrap_used)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// The command line of the harness examples (`serve_soak`, `scale_out`): `--flag value` pairs
/// in order. A flag without a value exits with status 2 and `usage`.
pub fn flag_pairs(prog: &str, usage: &str) -> Vec<(String, String)> {
    let mut args = std::env::args().skip(1);
    let mut pairs = Vec::new();
    while let Some(flag) = args.next() {
        let Some(value) = args.next() else { exit_usage(prog, &format!("{flag} needs a value; {usage}")) };
        pairs.push((flag, value));
    }
    pairs
}

/// `value` of `flag` as a count, or exit with status 2 naming both.
pub fn flag_num(prog: &str, flag: &str, value: &str) -> usize {
    value.parse().unwrap_or_else(|_| exit_usage(prog, &format!("{flag}: `{value}` is not a number")))
}

/// Prints `prog: msg` and exits with status 2 (a usage error of a harness example).
pub fn exit_usage(prog: &str, msg: &str) -> ! {
    eprintln!("{prog}: {msg}");
    std::process::exit(2)
}

/// Settings of one soak run.
#[derive(Debug, Clone)]
pub struct Config {
    /// The `deco` binary.
    pub deco: PathBuf,
    /// The model (GGUF file or HF directory).
    pub model: PathBuf,
    /// Requests of the soak phase.
    pub requests: usize,
    /// Concurrent clients.
    pub clients: usize,
    /// Seed of the request generator.
    pub seed: u64,
    /// `--kv-cache-mib` of the server (small, so that blocks are scarce and preemption happens).
    pub kv_cache_mib: usize,
    /// Streams of the drain phase.
    pub drain_streams: usize,
    /// Where the server's stderr goes.
    pub log: PathBuf,
    /// More `deco serve` arguments (e.g. speculative decoding settings).
    pub extra_args: Vec<String>,
}

/// What happened to one request.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Completed and valid.
    Ok,
    /// The client gave up on purpose before the end.
    Cancelled,
    /// The client never read; dropped after holding the connection.
    NeverRead,
    /// Refused as expected (413 oversize, 400 malformed).
    Refused(u16),
    /// Anything unexpected: the reason.
    Failed(String),
}

/// The kinds of fault mixed into the soak.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// A well-behaved client.
    None,
    /// Streaming: drop after this many body frames; non-streaming: drop after this many ms.
    Cancel(u64),
    /// Pause this many ms between body frames.
    Slow(u64),
    /// Send, never read, hold this many ms, close.
    NeverRead(u64),
    /// A body over the 2 MiB limit.
    Oversize,
    /// A malformed body (variant index).
    Malformed(u8),
}

/// One generated request.
#[derive(Debug, Clone)]
pub struct Req {
    /// Chat endpoint (else completions).
    pub chat: bool,
    /// SSE streaming.
    pub stream: bool,
    /// Choices.
    pub n: usize,
    /// `max_tokens`.
    pub max_tokens: usize,
    /// Stop strings.
    pub stop: Vec<String>,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// The fault of this client.
    pub fault: Fault,
    /// The body bytes.
    pub body: Vec<u8>,
}

const PROMPTS: &[&str] = &[
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "Write a haiku about autumn leaves.",
    "def fibonacci(n):",
    "Explain what a KV cache is in one sentence.",
    "Écris une phrase sur la mer et le vent.",
    "List three prime numbers:",
    "Q: What is 12 times 7?\nA:",
    "The quick brown fox 🦊 jumps over",
    "To be, or not to be, that is the question:",
    "In 1969, the first humans landed on the Moon. The mission was called",
    "Translate to German: Good morning, how are you?",
];

const LONG_PREFIX: &str = "You are a helpful assistant. Answer briefly and precisely. The following text is background \
    material that every request of this group shares, so that the server's prefix cache is exercised: \
    Shakespeare wrote thirty-seven plays and one hundred fifty-four sonnets; Hamlet, Macbeth, Othello and King Lear \
    are counted among his great tragedies, while A Midsummer Night's Dream and Twelfth Night are comedies.";

const STOPS: &[&[&str]] = &[&["\n"], &[".", "!"], &[" the"], &["e"], &["\n\n", "3"]];

/// Draws request `i` of the soak from the seeded generator.
pub fn make_request(seed: u64, i: usize) -> Req {
    let mut rng = ChaCha8Rng::seed_from_u64(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i as u64);
    let chat = rng.random_bool(0.5);
    let stream = rng.random_bool(0.6);
    let n = match rng.random_range(0..10) {
        0 => 3,
        1 | 2 => 2,
        _ => 1,
    };
    let max_tokens = rng.random_range(1..=24usize);
    let stop: Vec<String> = if rng.random_bool(0.3) { STOPS[rng.random_range(0..STOPS.len())].iter().map(|s| s.to_string()).collect() } else { vec![] };
    let include_usage = stream && rng.random_bool(0.5);
    let logprobs = rng.random_bool(0.1);
    let temperature = [0.0, 0.7, 1.0][rng.random_range(0..3)];
    let prompt = PROMPTS[rng.random_range(0..PROMPTS.len())];
    let prompt = if rng.random_bool(0.25) { format!("{LONG_PREFIX}\n{prompt}") } else { prompt.to_string() };
    let mut body = if chat {
        let mut messages = vec![];
        if rng.random_bool(0.3) {
            messages.push(json!({"role": "system", "content": "You are terse."}));
        }
        messages.push(json!({"role": "user", "content": prompt}));
        let mut b = json!({"model": "soak", "messages": messages});
        if logprobs {
            b["logprobs"] = json!(true);
            b["top_logprobs"] = json!(2);
        }
        b
    } else {
        let mut b = json!({"model": "soak", "prompt": prompt});
        if logprobs {
            b["logprobs"] = json!(2);
        }
        b
    };
    body["max_tokens"] = json!(max_tokens);
    body["n"] = json!(n);
    body["temperature"] = json!(temperature);
    body["seed"] = json!(i);
    if stream {
        body["stream"] = json!(true);
        if include_usage {
            body["stream_options"] = json!({"include_usage": true});
        }
    }
    if !stop.is_empty() {
        body["stop"] = json!(stop);
    }
    let r: f64 = rng.random();
    let fault = if r < 0.20 {
        Fault::Cancel(if stream { rng.random_range(0..6) } else { rng.random_range(0..1500) })
    } else if r < 0.25 {
        Fault::Slow(rng.random_range(20..150))
    } else if r < 0.27 {
        Fault::NeverRead(rng.random_range(500..3000))
    } else if r < 0.29 {
        Fault::Oversize
    } else if r < 0.33 {
        Fault::Malformed(rng.random_range(0..9))
    } else {
        Fault::None
    };
    let bytes = match fault {
        Fault::Oversize => {
            let mut b = body.clone();
            let big = "x".repeat(3 << 20);
            if chat {
                b["messages"] = json!([{"role": "user", "content": big}]);
            } else {
                b["prompt"] = json!(big);
            }
            serde_json::to_vec(&b).unwrap()
        }
        Fault::Malformed(k) => malformed(&body, k, &mut rng),
        _ => serde_json::to_vec(&body).unwrap(),
    };
    Req { chat, stream, n, max_tokens, stop, include_usage, fault, body: bytes }
}

/// Malformed body number `k` (all must be answered 400).
fn malformed(body: &Value, k: u8, rng: &mut ChaCha8Rng) -> Vec<u8> {
    let good = serde_json::to_vec(body).unwrap();
    let mut b = body.clone();
    match k {
        0 => {
            let cut = rng.random_range(1..good.len() - 1);
            good[..cut].to_vec()
        }
        1 => b"[1, 2, 3]".to_vec(),
        2 => b"".to_vec(),
        3 => {
            b["max_tokens"] = json!("ten");
            serde_json::to_vec(&b).unwrap()
        }
        4 => {
            b["temperature"] = json!(-1.0);
            serde_json::to_vec(&b).unwrap()
        }
        5 => {
            b["top_p"] = json!(1.5);
            serde_json::to_vec(&b).unwrap()
        }
        6 => {
            b["n"] = json!(0);
            serde_json::to_vec(&b).unwrap()
        }
        7 => {
            let mut v = good.clone();
            let at = v.len() / 2;
            v.splice(at..at, [0xff, 0xfe, 0x80]);
            v
        }
        _ => {
            b["model"] = json!("no-such-model");
            serde_json::to_vec(&b).unwrap()
        }
    }
}

struct Conn {
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn send(addr: SocketAddr, path: &str, method: &str, body: Vec<u8>) -> Result<(Conn, hyper::Response<hyper::body::Incoming>), String> {
    let stream = TcpStream::connect(addr).await.map_err(|e| format!("connect: {e}"))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake::<_, Full<Bytes>>(hyper_util::rt::TokioIo::new(stream)).await.map_err(|e| format!("handshake: {e}"))?;
    let conn = Conn {
        task: tokio::spawn(async move {
            let _ = conn.await;
        }),
    };
    let req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr.to_string())
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| format!("request: {e}"))?;
    let resp = sender.send_request(req).await.map_err(|e| format!("send: {e}"))?;
    Ok((conn, resp))
}

/// GET a path, return (status, body).
pub async fn get(addr: SocketAddr, path: &str) -> Result<(u16, String), String> {
    let (_c, resp) = send(addr, path, "GET", vec![]).await?;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.map_err(|e| format!("body: {e}"))?.to_bytes();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// Timings of a completed request (ms).
#[derive(Debug, Clone, Copy, Default)]
pub struct Timing {
    /// Request to last byte.
    pub e2e_ms: f64,
    /// Request to the first content event (streams only).
    pub ttft_ms: Option<f64>,
}

/// Runs one request with its fault; returns the outcome and, when it completed, its timing.
pub async fn run_request(addr: SocketAddr, r: &Req) -> (Outcome, Option<Timing>) {
    let path = if r.chat { "/v1/chat/completions" } else { "/v1/completions" };
    let t0 = Instant::now();
    if let Fault::NeverRead(ms) = r.fault {
        let res = async {
            let mut s = TcpStream::connect(addr).await?;
            let head = format!("POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n", r.body.len());
            s.write_all(head.as_bytes()).await?;
            s.write_all(&r.body).await?;
            tokio::time::sleep(Duration::from_millis(ms)).await;
            std::io::Result::Ok(())
        }
        .await;
        return match res {
            Ok(()) => (Outcome::NeverRead, None),
            Err(e) => (Outcome::Failed(format!("never-read client: {e}")), None),
        };
    }
    let (conn, resp) = match send(addr, path, "POST", r.body.clone()).await {
        Ok(x) => x,
        // Also for an oversize body: the server must read it (and answer 413), not reset the
        // connection while the client is still sending.
        Err(e) => return (Outcome::Failed(format!("{e} ({:?})", r.fault)), None),
    };
    let status = resp.status().as_u16();
    let ctype = resp.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    match r.fault {
        Fault::Oversize | Fault::Malformed(_) => {
            let want = if r.fault == Fault::Oversize { 413 } else { 400 };
            let body = match resp.into_body().collect().await {
                Ok(b) => b.to_bytes(),
                Err(e) => return (Outcome::Failed(format!("{:?}: body: {e}", r.fault)), None),
            };
            if status != want {
                return (Outcome::Failed(format!("{:?}: status {status} instead of {want}: {}", r.fault, String::from_utf8_lossy(&body))), None);
            }
            let v: Value = match serde_json::from_slice(&body) {
                Ok(v) => v,
                Err(e) => return (Outcome::Failed(format!("{status} body is not JSON ({e})")), None),
            };
            if !v["error"]["message"].is_string() || v["error"]["type"] != "invalid_request_error" {
                return (Outcome::Failed(format!("{status} body is not an OpenAI error: {v}")), None);
            }
            drop(conn);
            return (Outcome::Refused(status), None);
        }
        _ => {}
    }
    if status != 200 {
        let body = resp.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
        return (Outcome::Failed(format!("status {status}: {}", String::from_utf8_lossy(&body))), None);
    }
    let mut body = resp.into_body();
    let mut buf: Vec<u8> = Vec::new();
    let mut frames = 0u64;
    let mut ttft = None;
    let deadline = Duration::from_secs(180);
    loop {
        if let Fault::Cancel(k) = r.fault
            && r.stream
            && frames >= k
        {
            drop(body);
            drop(conn);
            return (Outcome::Cancelled, None);
        }
        let next = body.frame();
        let frame = match r.fault {
            Fault::Cancel(ms) if !r.stream => match tokio::time::timeout(Duration::from_millis(ms).saturating_sub(t0.elapsed()), next).await {
                Ok(f) => f,
                Err(_) => {
                    drop(conn);
                    return (Outcome::Cancelled, None);
                }
            },
            _ => match tokio::time::timeout(deadline.saturating_sub(t0.elapsed()), next).await {
                Ok(f) => f,
                Err(_) => return (Outcome::Failed(format!("no end after {} s (hang)", deadline.as_secs())), None),
            },
        };
        let Some(frame) = frame else { break };
        let frame = match frame {
            Ok(f) => f,
            Err(e) => return (Outcome::Failed(format!("body frame: {e}")), None),
        };
        if let Ok(data) = frame.into_data() {
            if ttft.is_none() && r.stream && (contains(&data, b"\"text\":\"") && !contains(&data, b"\"text\":\"\"") || contains(&data, b"\"content\":\"") && !contains(&data, b"\"content\":\"\"")) {
                ttft = Some(t0.elapsed().as_secs_f64() * 1e3);
            }
            buf.extend_from_slice(&data);
            frames += 1;
        }
        if let Fault::Slow(ms) = r.fault {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
    }
    let e2e_ms = t0.elapsed().as_secs_f64() * 1e3;
    drop(conn);
    let check = if r.stream {
        if !ctype.starts_with("text/event-stream") {
            Err(format!("streaming content-type `{ctype}`"))
        } else {
            check_stream(r, &buf)
        }
    } else if !ctype.starts_with("application/json") {
        Err(format!("content-type `{ctype}`"))
    } else {
        check_json(r, &buf)
    };
    match check {
        Ok(()) => (Outcome::Ok, Some(Timing { e2e_ms, ttft_ms: ttft })),
        Err(e) => (Outcome::Failed(format!("{e}; request {}", String::from_utf8_lossy(&r.body))), None),
    }
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

fn check_usage(r: &Req, u: &Value, all_length: bool) -> Result<(), String> {
    let (p, c, t) = (u["prompt_tokens"].as_u64(), u["completion_tokens"].as_u64(), u["total_tokens"].as_u64());
    let (Some(p), Some(c), Some(t)) = (p, c, t) else { return Err(format!("usage fields missing: {u}")) };
    if p == 0 || t != p + c {
        return Err(format!("usage arithmetic: {u}"));
    }
    let max = (r.n * r.max_tokens) as u64;
    if c > max || (all_length && c != max) {
        return Err(format!("usage.completion_tokens {c} with n={} max_tokens={} (all length: {all_length})", r.n, r.max_tokens));
    }
    Ok(())
}

fn check_text(r: &Req, text: &str) -> Result<(), String> {
    for s in &r.stop {
        if text.contains(s.as_str()) {
            return Err(format!("text {text:?} contains stop string {s:?}"));
        }
    }
    Ok(())
}

fn check_finish(f: &Value) -> Result<bool, String> {
    match f.as_str() {
        Some("length") => Ok(true),
        Some("stop") => Ok(false),
        _ => Err(format!("finish_reason {f}")),
    }
}

/// Checks a non-streamed response body.
pub fn check_json(r: &Req, body: &[u8]) -> Result<(), String> {
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("response is not JSON ({e})"))?;
    let object = if r.chat { "chat.completion" } else { "text_completion" };
    if v["object"] != object {
        return Err(format!("object {} instead of {object}", v["object"]));
    }
    let choices = v["choices"].as_array().ok_or("no choices")?;
    if choices.len() != r.n {
        return Err(format!("{} choices for n={}", choices.len(), r.n));
    }
    let mut all_length = true;
    let mut seen = vec![false; r.n];
    for c in choices {
        let i = c["index"].as_u64().ok_or("choice without index")? as usize;
        if i >= r.n || std::mem::replace(&mut seen[i], true) {
            return Err(format!("choice index {i} repeated or out of range"));
        }
        all_length &= check_finish(&c["finish_reason"])?;
        let text = if r.chat {
            if c["message"]["role"] != "assistant" {
                return Err(format!("message role {}", c["message"]["role"]));
            }
            c["message"]["content"].as_str()
        } else {
            c["text"].as_str()
        };
        check_text(r, text.ok_or("choice without text")?)?;
    }
    check_usage(r, &v["usage"], all_length)
}

/// Checks a streamed (SSE) response body.
pub fn check_stream(r: &Req, body: &[u8]) -> Result<(), String> {
    let text = std::str::from_utf8(body).map_err(|e| format!("stream is not UTF-8: {e}"))?;
    if !text.ends_with("\n\n") {
        return Err("stream does not end with a complete event".into());
    }
    let events: Vec<&str> = text.trim_end_matches('\n').split("\n\n").collect();
    let object = if r.chat { "chat.completion.chunk" } else { "text_completion" };
    let mut texts = vec![String::new(); r.n];
    let mut finished = vec![None::<bool>; r.n];
    let mut usage = None;
    let mut id = None;
    for (k, ev) in events.iter().enumerate() {
        let data = ev.lines().filter_map(|l| l.strip_prefix("data:")).map(str::trim_start).collect::<Vec<_>>().join("\n");
        if data == "[DONE]" {
            if k + 1 != events.len() {
                return Err("events after [DONE]".into());
            }
            break;
        }
        if k + 1 == events.len() {
            return Err(format!("the stream does not end with [DONE] (last event {data:?})"));
        }
        let v: Value = serde_json::from_str(&data).map_err(|e| format!("event {k} is not JSON ({e}): {data:?}"))?;
        if v.get("error").is_some() {
            return Err(format!("error event: {v}"));
        }
        if v["object"] != object {
            return Err(format!("chunk object {}", v["object"]));
        }
        let this_id = v["id"].as_str().ok_or("chunk without id")?.to_string();
        if id.get_or_insert_with(|| this_id.clone()) != &this_id {
            return Err("chunk ids differ".into());
        }
        let choices = v["choices"].as_array().ok_or("chunk without choices")?;
        if !v["usage"].is_null() {
            if !r.include_usage || !choices.is_empty() || usage.is_some() {
                return Err(format!("unexpected usage chunk: {v}"));
            }
            usage = Some(v["usage"].clone());
            continue;
        }
        for c in choices {
            let i = c["index"].as_u64().ok_or("chunk choice without index")? as usize;
            if i >= r.n {
                return Err(format!("chunk choice index {i} for n={}", r.n));
            }
            if finished[i].is_some() {
                return Err(format!("chunk for choice {i} after its finish_reason"));
            }
            let piece = if r.chat { &c["delta"]["content"] } else { &c["text"] };
            if let Some(p) = piece.as_str() {
                texts[i].push_str(p);
            }
            if !c["finish_reason"].is_null() {
                finished[i] = Some(check_finish(&c["finish_reason"])?);
            }
        }
    }
    if finished.iter().any(Option::is_none) {
        return Err(format!("not every choice finished: {finished:?}"));
    }
    for t in &texts {
        check_text(r, t)?;
    }
    let all_length = finished.iter().all(|f| *f == Some(true));
    match (r.include_usage, usage) {
        (true, Some(u)) => check_usage(r, &u, all_length),
        (true, None) => Err("include_usage but no usage chunk".into()),
        (false, _) => Ok(()),
    }
}

/// Resident set sampler of the server process.
#[derive(Debug, Default)]
pub struct RssLog {
    /// (seconds since start, RSS MiB, soak requests done).
    pub samples: Vec<(f64, f64, usize)>,
}

fn proc_status_mib(pid: u32, key: &str) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let l = s.lines().find(|l| l.starts_with(key))?;
    Some(l.split_whitespace().nth(1)?.parse::<f64>().ok()? / 1024.0)
}

/// Everything a soak run measured.
#[derive(Debug, Default)]
pub struct Report {
    /// Soak requests by outcome.
    pub ok: usize,
    /// Cancelled on purpose.
    pub cancelled: usize,
    /// Never-read clients.
    pub never_read: usize,
    /// Refused with 413.
    pub refused_413: usize,
    /// Refused with 400.
    pub refused_400: usize,
    /// Unexpected outcomes (first 20 reasons in `failures`).
    pub failed: usize,
    /// Reasons of the first failures.
    pub failures: Vec<String>,
    /// Slow readers that completed.
    pub slow_ok: usize,
    /// Soak wall time (s).
    pub soak_s: f64,
    /// End-to-end latency of well-behaved completed requests: p50, p99, max (ms).
    pub e2e_ms: (f64, f64, f64),
    /// Time to first token of well-behaved streams: p50, p99 (ms).
    pub ttft_ms: (f64, f64),
    /// `/metrics` after the soak.
    pub kv_blocks_used: Option<u64>,
    /// Pending requests after the soak.
    pub pending: Option<u64>,
    /// Preemptions counted by the server.
    pub preemptions: Option<u64>,
    /// Cancellations counted by the server.
    pub server_cancelled: Option<u64>,
    /// Failed forward passes counted by the server.
    pub step_errors: Option<u64>,
    /// RSS when the server was ready (MiB).
    pub rss_ready_mib: f64,
    /// Peak RSS over the run (VmHWM just before SIGTERM, MiB).
    pub rss_peak_mib: f64,
    /// The stated bound (MiB).
    pub rss_bound_mib: f64,
    /// Peak RSS of the second and of the last fifth of the soak (MiB).
    pub rss_second_last_mib: (f64, f64),
    /// Drain streams that finished complete after SIGTERM.
    pub drain_ok: usize,
    /// Drain streams.
    pub drain_total: usize,
    /// Answers to `/health` and to a new completion request while draining after SIGTERM.
    pub after_sigterm: String,
    /// Exit status of the server after SIGTERM.
    pub exit: String,
    /// Seconds from SIGTERM to exit.
    pub drain_s: f64,
    /// The server died before SIGTERM.
    pub crashed: bool,
    /// The server's stderr mentions a panic.
    pub panicked: bool,
}

impl Report {
    /// Every check of the module docs, as (name, passed, detail).
    pub fn checks(&self) -> Vec<(&'static str, bool, String)> {
        vec![
            ("no crash", !self.crashed && !self.panicked, format!("crashed {}, panic in stderr {}", self.crashed, self.panicked)),
            ("every completed response valid", self.failed == 0, format!("{} failed", self.failed)),
            ("0 KV blocks leaked", self.kv_blocks_used == Some(0) && self.pending == Some(0), format!("deco_kv_blocks_used {}, deco_num_requests_pending {}", opt(self.kv_blocks_used), opt(self.pending))),
            ("0 failed forward passes", self.step_errors == Some(0), format!("deco_engine_step_errors_total {}", opt(self.step_errors))),
            ("peak RSS under the bound", self.rss_peak_mib <= self.rss_bound_mib, format!("{:.0} MiB <= {:.0} MiB", self.rss_peak_mib, self.rss_bound_mib)),
            (
                "no RSS growth",
                self.rss_second_last_mib.1 <= self.rss_second_last_mib.0 * 1.10,
                format!("last fifth {:.0} MiB <= 1.10 x second fifth {:.0} MiB", self.rss_second_last_mib.1, self.rss_second_last_mib.0),
            ),
            ("drain completes in-flight streams", self.drain_ok == self.drain_total && self.drain_total > 0, format!("{}/{}", self.drain_ok, self.drain_total)),
            ("503 while draining", self.after_sigterm == "/health 503, new completion 503", self.after_sigterm.clone()),
            ("exit 0 after SIGTERM", self.exit == "0", format!("exit {} after {:.1} s", self.exit, self.drain_s)),
        ]
    }

    /// All checks passed.
    pub fn passed(&self) -> bool {
        self.checks().iter().all(|c| c.1)
    }

    /// The report as JSON.
    pub fn to_json(&self, c: &Config) -> Value {
        json!({
            "requests": c.requests, "clients": c.clients, "seed": c.seed, "kv_cache_mib": c.kv_cache_mib,
            "ok": self.ok, "slow_ok": self.slow_ok, "cancelled": self.cancelled, "never_read": self.never_read,
            "refused_413": self.refused_413, "refused_400": self.refused_400, "failed": self.failed, "failures": self.failures,
            "soak_s": self.soak_s,
            "e2e_ms": {"p50": self.e2e_ms.0, "p99": self.e2e_ms.1, "max": self.e2e_ms.2},
            "ttft_ms": {"p50": self.ttft_ms.0, "p99": self.ttft_ms.1},
            "kv_blocks_used": self.kv_blocks_used, "pending": self.pending, "preemptions": self.preemptions,
            "server_cancelled": self.server_cancelled, "step_errors": self.step_errors,
            "rss_ready_mib": self.rss_ready_mib, "rss_peak_mib": self.rss_peak_mib, "rss_bound_mib": self.rss_bound_mib,
            "rss_second_fifth_mib": self.rss_second_last_mib.0, "rss_last_fifth_mib": self.rss_second_last_mib.1,
            "drain_ok": self.drain_ok, "drain_total": self.drain_total, "after_sigterm": self.after_sigterm,
            "exit": self.exit, "drain_s": self.drain_s, "crashed": self.crashed, "panicked": self.panicked,
            "checks": self.checks().iter().map(|(n, ok, d)| json!({"check": n, "passed": ok, "detail": d})).collect::<Vec<_>>(),
            "passed": self.passed(),
        })
    }
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn metric(text: &str, name: &str) -> Option<u64> {
    text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Starts `deco serve`, returns the child and its address.
pub fn start_server(c: &Config) -> Result<(Child, SocketAddr), String> {
    let log = std::fs::File::create(&c.log).map_err(|e| format!("cannot create {}: {e}", c.log.display()))?;
    let mut child = Command::new(&c.deco)
        .args(["serve", "--port", "0", "--served-model-name", "soak", "--max-model-len", "2048"])
        .arg("--model")
        .arg(&c.model)
        .args(["--kv-cache-mib", &c.kv_cache_mib.to_string()])
        .args(&c.extra_args)
        .stdout(Stdio::piped())
        .stderr(log)
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", c.deco.display()))?;
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(stdout));
    let line = lines.next().ok_or("deco serve exited before listening")?.map_err(|e| e.to_string())?;
    let addr = line.strip_prefix("listening on http://").ok_or_else(|| format!("unexpected first line {line:?}"))?;
    let addr: SocketAddr = addr.trim().parse().map_err(|e| format!("address {addr}: {e}"))?;
    // Keep draining stdout so the child never blocks on it.
    std::thread::spawn(move || for _ in lines {});
    // The listener is bound before the model is loaded: /health answers 503 until it is.
    let start = Instant::now();
    loop {
        match health_status(addr) {
            Ok(200) => break,
            Ok(503) | Err(_) if start.elapsed() < Duration::from_secs(120) => std::thread::sleep(Duration::from_millis(50)),
            other => {
                let _ = child.kill();
                return Err(format!("deco serve did not become ready: /health gave {other:?}"));
            }
        }
    }
    Ok((child, addr))
}

/// The status code of `GET /health` (blocking, one connection).
///
/// # Errors
/// When the connection or the read fails, or the answer is not HTTP.
pub fn health_status(addr: SocketAddr) -> Result<u16, String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(10))).map_err(|e| e.to_string())?;
    s.write_all(b"GET /health HTTP/1.1\r\nHost: deco\r\nConnection: close\r\n\r\n").map_err(|e| e.to_string())?;
    let mut head = [0u8; 12];
    s.read_exact(&mut head).map_err(|e| e.to_string())?;
    let line = String::from_utf8_lossy(&head);
    line.strip_prefix("HTTP/1.1 ").and_then(|c| c.get(..3)).and_then(|c| c.parse().ok()).ok_or_else(|| format!("not an HTTP answer: {line:?}"))
}

/// Runs the whole soak (see the module docs) and returns its report.
///
/// # Errors
/// When the server cannot be started or the harness itself fails (not when a check fails:
/// that is in the report).
pub fn run(c: &Config) -> Result<Report, String> {
    let (child, addr) = start_server(c)?;
    let pid = child.id();
    let child = Arc::new(Mutex::new(child));
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().map_err(|e| e.to_string())?;
    let mut rep = Report { rss_ready_mib: proc_status_mib(pid, "VmRSS:").unwrap_or(f64::NAN), ..Report::default() };
    let model_mib = std::fs::metadata(&c.model).map(|m| m.len() as f64 / (1 << 20) as f64).unwrap_or(0.0);
    rep.rss_bound_mib = model_mib + c.kv_cache_mib as f64 + 512.0;
    let done = Arc::new(AtomicUsize::new(0));
    let rss = Arc::new(Mutex::new(RssLog::default()));
    let crashed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop_sampler = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let t_start = Instant::now();
    let sampler = {
        let (done, rss, child, crashed, stop) = (done.clone(), rss.clone(), child.clone(), crashed.clone(), stop_sampler.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if let Some(m) = proc_status_mib(pid, "VmRSS:") {
                    rss.lock().unwrap().samples.push((t_start.elapsed().as_secs_f64(), m, done.load(Ordering::Relaxed)));
                }
                if matches!(child.lock().unwrap().try_wait(), Ok(Some(_))) {
                    crashed.store(true, Ordering::Relaxed);
                    return;
                }
                std::thread::sleep(Duration::from_millis(250));
            }
        })
    };
    let result = rt.block_on(async {
        // Soak.
        let next = Arc::new(AtomicUsize::new(0));
        let t0 = Instant::now();
        let mut tasks = Vec::new();
        for _ in 0..c.clients {
            let (next, done, seed, total) = (next.clone(), done.clone(), c.seed, c.requests);
            let t_start = t0;
            tasks.push(tokio::spawn(async move {
                let mut out = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= total {
                        break;
                    }
                    let r = make_request(seed, i);
                    let (o, t) = run_request(addr, &r).await;
                    let d = done.fetch_add(1, Ordering::Relaxed) + 1;
                    if total >= 1000 && d % (total / 10) == 0 {
                        eprintln!("soak: {d}/{total} requests done after {:.0} s", t_start.elapsed().as_secs_f64());
                    }
                    out.push((r.fault, o, t));
                }
                out
            }));
        }
        let (mut e2e, mut ttft) = (vec![], vec![]);
        for t in tasks {
            for (fault, o, t) in t.await.map_err(|e| e.to_string())? {
                match o {
                    Outcome::Ok => {
                        rep.ok += 1;
                        if matches!(fault, Fault::Slow(_)) {
                            rep.slow_ok += 1;
                        } else if let Some(t) = t {
                            e2e.push(t.e2e_ms);
                            ttft.extend(t.ttft_ms);
                        }
                    }
                    Outcome::Cancelled => rep.cancelled += 1,
                    Outcome::NeverRead => rep.never_read += 1,
                    Outcome::Refused(413) => rep.refused_413 += 1,
                    Outcome::Refused(_) => rep.refused_400 += 1,
                    Outcome::Failed(why) => {
                        rep.failed += 1;
                        if rep.failures.len() < 20 {
                            rep.failures.push(why);
                        }
                    }
                }
            }
        }
        rep.soak_s = t0.elapsed().as_secs_f64();
        rep.e2e_ms = (pct(&mut e2e, 0.5), pct(&mut e2e, 0.99), pct(&mut e2e, 1.0));
        rep.ttft_ms = (pct(&mut ttft, 0.5), pct(&mut ttft, 0.99));
        // Leaks: cancelled requests are freed at the engine's next step; wait for it.
        let mut metrics = String::new();
        for _ in 0..100 {
            metrics = get(addr, "/metrics").await?.1;
            if metric(&metrics, "deco_num_requests_pending") == Some(0) && metric(&metrics, "deco_kv_blocks_used") == Some(0) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        rep.kv_blocks_used = metric(&metrics, "deco_kv_blocks_used");
        rep.pending = metric(&metrics, "deco_num_requests_pending");
        rep.preemptions = metric(&metrics, "deco_preemptions_total");
        rep.server_cancelled = metric(&metrics, "deco_requests_cancelled_total");
        rep.step_errors = metric(&metrics, "deco_engine_step_errors_total");
        rep.rss_peak_mib = proc_status_mib(pid, "VmHWM:").unwrap_or(f64::NAN);
        // Drain.
        let started = Arc::new(AtomicUsize::new(0));
        let mut drains = Vec::new();
        rep.drain_total = c.drain_streams;
        for i in 0..c.drain_streams {
            let started = started.clone();
            drains.push(tokio::spawn(async move {
                let body = json!({"model": "soak", "prompt": format!("Drain stream {i}: tell a long story."), "max_tokens": 48, "min_new_tokens": 48,
                    "temperature": 0.8, "seed": i, "stream": true, "stream_options": {"include_usage": true}});
                let r = Req { chat: false, stream: true, n: 1, max_tokens: 48, stop: vec![], include_usage: true, fault: Fault::None, body: serde_json::to_vec(&body).unwrap() };
                let (conn, resp) = send(addr, "/v1/completions", "POST", r.body.clone()).await?;
                if resp.status() != 200 {
                    return Err(format!("drain stream status {}", resp.status()));
                }
                let mut body = resp.into_body();
                let mut buf = Vec::new();
                let mut counted = false;
                while let Some(f) = tokio::time::timeout(Duration::from_secs(120), body.frame()).await.map_err(|_| "drain stream hang".to_string())? {
                    if let Ok(d) = f.map_err(|e| format!("drain body: {e}"))?.into_data() {
                        buf.extend_from_slice(&d);
                        if !counted && contains(&buf, b"\"text\":\"") {
                            counted = true;
                            started.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                }
                drop(conn);
                check_stream(&r, &buf)?;
                // Every stream must have produced all 48 tokens.
                let text = std::str::from_utf8(&buf).unwrap_or("");
                if !text.contains("\"completion_tokens\":48") {
                    return Err("drain stream usage is not 48 completion tokens".into());
                }
                Ok::<(), String>(())
            }));
        }
        let wait = Instant::now();
        while started.load(Ordering::SeqCst) < c.drain_streams && wait.elapsed() < Duration::from_secs(120) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if crashed.load(Ordering::Relaxed) {
            return Err("the server exited before SIGTERM".to_string());
        }
        stop_sampler.store(true, Ordering::Relaxed);
        let hwm = proc_status_mib(pid, "VmHWM:").unwrap_or(f64::NAN);
        rep.rss_peak_mib = rep.rss_peak_mib.max(hwm);
        let t_term = Instant::now();
        let st = Command::new("kill").args(["-TERM", &pid.to_string()]).status().map_err(|e| format!("kill: {e}"))?;
        if !st.success() {
            return Err("kill -TERM failed".into());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        // While the streams drain, the server still answers: /health and new requests 503.
        let status = |r: Result<Result<(Conn, hyper::Response<hyper::body::Incoming>), String>, tokio::time::error::Elapsed>| match r {
            Err(_) => "no answer in 10 s".to_string(),
            Ok(Err(e)) => format!("refused ({e})"),
            Ok(Ok((_c, resp))) => resp.status().as_u16().to_string(),
        };
        let health = status(tokio::time::timeout(Duration::from_secs(10), send(addr, "/health", "GET", vec![])).await);
        let body = serde_json::to_vec(&serde_json::json!({"prompt": "Hello", "max_tokens": 4})).map_err(|e| e.to_string())?;
        let completion = status(tokio::time::timeout(Duration::from_secs(10), send(addr, "/v1/completions", "POST", body)).await);
        rep.after_sigterm = format!("/health {health}, new completion {completion}");
        for d in drains {
            match d.await.map_err(|e| e.to_string())? {
                Ok(()) => rep.drain_ok += 1,
                Err(e) => {
                    rep.failed += 1;
                    if rep.failures.len() < 20 {
                        rep.failures.push(format!("drain: {e}"));
                    }
                }
            }
        }
        Ok::<Instant, String>(t_term)
    });
    stop_sampler.store(true, Ordering::Relaxed);
    let _ = sampler.join();
    rep.crashed = crashed.load(Ordering::Relaxed);
    let t_term = match result {
        Ok(t) => t,
        Err(e) => {
            let _ = child.lock().unwrap().kill();
            return Err(e);
        }
    };
    let mut status = None;
    while t_term.elapsed() < Duration::from_secs(60) {
        if let Ok(Some(s)) = child.lock().unwrap().try_wait() {
            status = Some(s);
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    rep.drain_s = t_term.elapsed().as_secs_f64();
    rep.exit = match status {
        Some(s) => s.code().map_or_else(|| format!("signal ({s})"), |c| c.to_string()),
        None => {
            let _ = child.lock().unwrap().kill();
            "still running after 60 s".into()
        }
    };
    let samples = &rss.lock().unwrap().samples;
    let fifth = c.requests / 5;
    let peak = |lo: usize, hi: usize| samples.iter().filter(|s| s.2 >= lo && s.2 < hi).map(|s| s.1).fold(f64::NAN, f64::max);
    rep.rss_second_last_mib = (peak(fifth, 2 * fifth), peak(c.requests - fifth, c.requests + 1));
    let log = std::fs::read_to_string(&c.log).unwrap_or_default();
    rep.panicked = log.contains("panicked");
    Ok(rep)
}

fn opt(v: Option<u64>) -> String {
    v.map_or_else(|| "unknown".into(), |x| x.to_string())
}

/// The report as markdown lines (for stdout and docs/reliability.md).
pub fn render(c: &Config, r: &Report) -> String {
    let mut s = format!(
        "{} requests from {} clients in {:.1} s (seed {}, KV cache {} MiB): {} ok ({} of them slow readers), {} cancelled, {} never read, {} refused 413 (oversize), {} refused 400 (malformed), **{} failed**.\n\n",
        c.requests, c.clients, r.soak_s, c.seed, c.kv_cache_mib, r.ok, r.slow_ok, r.cancelled, r.never_read, r.refused_413, r.refused_400, r.failed
    );
    s.push_str(&format!(
        "Latency of the well-behaved completed requests: end to end p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms; streams' time to first token p50 {:.0} ms, p99 {:.0} ms. \
         Server counters after the soak: KV blocks in use {}, pending requests {}, preemptions {}, cancellations {}, failed forward passes {}.\n\n",
        r.e2e_ms.0, r.e2e_ms.1, r.e2e_ms.2, r.ttft_ms.0, r.ttft_ms.1, opt(r.kv_blocks_used), opt(r.pending), opt(r.preemptions), opt(r.server_cancelled), opt(r.step_errors)
    ));
    s.push_str(&format!(
        "Resident memory: {:.0} MiB when ready, peak {:.0} MiB (bound: model file + KV cache + 512 MiB = {:.0} MiB); peak of the second fifth of the soak {:.0} MiB, of the last fifth {:.0} MiB. \
         SIGTERM with {} streams in flight: {} finished complete, while draining {}, exit status {} after {:.1} s.\n\n",
        r.rss_ready_mib, r.rss_peak_mib, r.rss_bound_mib, r.rss_second_last_mib.0, r.rss_second_last_mib.1, r.drain_total, r.drain_ok, r.after_sigterm, r.exit, r.drain_s
    ));
    s.push_str("| check | result | measured |\n|---|---|---|\n");
    for (name, ok, d) in r.checks() {
        s.push_str(&format!("| {name} | {} | {d} |\n", if ok { "pass" } else { "**FAIL**" }));
    }
    if !r.failures.is_empty() {
        s.push_str("\nFirst failures:\n\n");
        for f in &r.failures {
            s.push_str(&format!("- {}\n", f.chars().take(400).collect::<String>()));
        }
    }
    s
}

/// A configuration that only starts the server (no soak or drain requests): the `deco` binary
/// `deco` on `model` with a `kv_cache_mib` pool, its log in `dir`.
pub fn server_only(deco: PathBuf, model: PathBuf, dir: &Path, kv_cache_mib: usize) -> Config {
    Config { deco, model, requests: 0, clients: 0, seed: 0, kv_cache_mib, drain_streams: 0, log: log_path(dir), extra_args: Vec::new() }
}

/// Default path of the server log inside `dir`.
pub fn log_path(dir: &Path) -> PathBuf {
    dir.join("deco-serve-soak.log")
}
