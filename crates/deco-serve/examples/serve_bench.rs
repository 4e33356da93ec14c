//! Serving benchmark and load test (docs/serving.md).
//!
//! ```text
//! cargo run --release -p deco-serve --example serve_bench -- MODEL.gguf [--quick] [--q8-activations]
//! ```
//! Starts the server in-process on a loopback port, then with raw HTTP/1.1 streaming clients:
//! 1. for 1, 4, 16, 64 concurrent streams: requests of 32 generated tokens (`min_new_tokens`
//!    = `max_tokens`, so EOS cannot cut them short), aggregate generated tok/s, time to first
//!    token and inter-token latency p50/p99;
//! 2. structured output: the 1- and 16-stream cases again with `response_format: json_object`
//!    (up to 32 tokens, the grammar may end a request earlier): inter-token latency p50 next to
//!    the unconstrained one, and the mean time the engine spent per token mask (`/metrics`);
//! 3. a load test: 1,000 requests (mixed lengths, some chat) from 64 concurrent clients;
//!    counts failures and checks `/metrics` reports every KV block free afterwards.
//!
//! Prints peak resident memory (VmHWM) of the process at the end.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow_free::*;
use burn::tensor::Device;
use deco_formats::chat_template::ChatTemplate;
use deco_formats::checkpoint::Checkpoint;
use deco_formats::gguf::GgufFile;
use deco_formats::tokenizer::Tokenizer;
use deco_model::Llama;
use deco_serve::{EngineConfig, SchedulerConfig, ServerState};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

mod anyhow_free {
    pub type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;
}

/// One streamed request: returns (status ok, chunk arrival times relative to start).
async fn stream_request(addr: std::net::SocketAddr, path: &str, body: String) -> R<(bool, Vec<Duration>)> {
    let start = Instant::now();
    let mut s = TcpStream::connect(addr).await?;
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await?;
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).await?;
    let ok = line.contains(" 200 ");
    let mut times = Vec::new();
    let mut done = false;
    loop {
        line.clear();
        if r.read_line(&mut line).await? == 0 {
            break;
        }
        if let Some(data) = line.strip_prefix("data: ") {
            if data.trim() == "[DONE]" {
                done = true;
                break;
            }
            if data.contains("\"text\":\"") && !data.contains("\"text\":\"\"") || data.contains("\"content\":\"") && !data.contains("\"content\":\"\"") {
                times.push(start.elapsed());
            }
        }
    }
    Ok((ok && done, times))
}

async fn get(addr: std::net::SocketAddr, path: &str) -> R<String> {
    let mut s = TcpStream::connect(addr).await?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes()).await?;
    let mut out = String::new();
    tokio::io::AsyncReadExt::read_to_string(&mut s, &mut out).await?;
    Ok(out)
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn vm_hwm_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmHWM")).and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok()))
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

fn main() -> R<()> {
    let args: Vec<String> = std::env::args().collect();
    let path = args.get(1).ok_or("usage: serve_bench MODEL.gguf [--quick] [--q8-activations]")?.clone();
    let quick = args.iter().any(|a| a == "--quick");
    if args.iter().any(|a| a == "--q8-activations") {
        // As `deco serve --q8-activations`.
        deco_kernels::quant::set_activation_precision(deco_kernels::quant::ActivationPrecision::Q8)?;
    }
    let device = Device::default();
    let ckpt = Checkpoint::open(&path)?;
    let tokenizer = Arc::new(Tokenizer::from_gguf(&GgufFile::open(&path)?)?);
    let model = Llama::load(&ckpt, &device, Some(2048))?;
    let template = tokenizer.chat_template().map(ChatTemplate::new).transpose()?;
    let config = EngineConfig {
        block_size: 16,
        num_blocks: 1024,
        scheduler: SchedulerConfig { max_num_seqs: 64, max_num_batched_tokens: 512 },
        max_pending_requests: 2048,
        ..EngineConfig::default()
    };
    let (engine, _join) = deco_serve::spawn_engine(model, tokenizer.clone(), config)?;
    let state = Arc::new(ServerState::new(engine, tokenizer, template, "m".into()));
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        tokio::spawn(deco_serve::serve(listener, state, std::future::pending()));
        let ntok = 32;
        let mut itl_plain = std::collections::HashMap::new();
        println!("| streams | requests | generated tok | wall s | aggregate tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |");
        println!("|---|---|---|---|---|---|---|---|---|");
        for &c in &[1usize, 4, 16, 64] {
            let per_client = if quick { 1 } else if c == 1 { 3 } else { 2 };
            let t0 = Instant::now();
            let mut tasks = Vec::new();
            for i in 0..c {
                tasks.push(tokio::spawn(async move {
                    let mut res = Vec::new();
                    for j in 0..per_client {
                        let body = format!(
                            r#"{{"prompt":"Request {i}-{j}: write a short story about a robot","max_tokens":{ntok},"min_new_tokens":{ntok},"temperature":0.8,"seed":{},"stream":true}}"#,
                            i * 100 + j
                        );
                        res.push(stream_request(addr, "/v1/completions", body).await);
                    }
                    res
                }));
            }
            let (mut ttft, mut itl, mut toks, mut n) = (vec![], vec![], 0usize, 0usize);
            for t in tasks {
                for r in t.await? {
                    let (ok, times) = r?;
                    assert!(ok, "request failed");
                    n += 1;
                    toks += times.len();
                    if let Some(f) = times.first() {
                        ttft.push(f.as_secs_f64() * 1e3);
                    }
                    itl.extend(times.windows(2).map(|w| (w[1] - w[0]).as_secs_f64() * 1e3));
                }
            }
            let wall = t0.elapsed().as_secs_f64();
            itl_plain.insert(c, pct(&mut itl, 0.5));
            println!(
                "| {c} | {n} | {toks} | {wall:.1} | {:.1} | {:.0} | {:.0} | {:.0} | {:.0} |",
                toks as f64 / wall,
                pct(&mut ttft, 0.5),
                pct(&mut ttft, 0.99),
                pct(&mut itl, 0.5),
                pct(&mut itl, 0.99)
            );
        }
        // Structured output: the same streams constrained to a JSON object.
        let mut parts = Vec::new();
        for &c in &[1usize, 16] {
            let before = get(addr, "/metrics").await?;
            let mut tasks = Vec::new();
            for i in 0..c {
                tasks.push(tokio::spawn(async move {
                    let body = format!(
                        r#"{{"prompt":"Request {i}: a robot described as JSON:","max_tokens":{ntok},"temperature":0.8,"seed":{i},"stream":true,"response_format":{{"type":"json_object"}}}}"#
                    );
                    stream_request(addr, "/v1/completions", body).await
                }));
            }
            let mut itl = Vec::new();
            for t in tasks {
                let (ok, times) = t.await??;
                assert!(ok, "structured request failed");
                itl.extend(times.windows(2).map(|w| (w[1] - w[0]).as_secs_f64() * 1e3));
            }
            let after = get(addr, "/metrics").await?;
            let m = |text: &str, name: &str| -> f64 { text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok()).unwrap_or(f64::NAN) };
            let masks = m(&after, "deco_structured_masks_total") - m(&before, "deco_structured_masks_total");
            let ns = m(&after, "deco_structured_mask_nanoseconds_total") - m(&before, "deco_structured_mask_nanoseconds_total");
            let mask_ms = ns / masks / 1e6;
            let itl50 = pct(&mut itl, 0.5);
            let plain = itl_plain.get(&c).copied().unwrap_or(f64::NAN);
            parts.push(format!(
                "{c} stream{}: ITL p50 {itl50:.1} ms (unconstrained {plain:.1} ms), mask {:.3} ms per token over {masks:.0} tokens = {:.1} % of the unconstrained ITL",
                if c == 1 { "" } else { "s" },
                mask_ms,
                100.0 * mask_ms * c as f64 / plain
            ));
        }
        println!("\nstructured output (json_object): {}", parts.join("; "));
        // Load test.
        let total = if quick { 128 } else { 1000 };
        let clients = 64;
        let t0 = Instant::now();
        let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for _ in 0..clients {
            let next = next.clone();
            tasks.push(tokio::spawn(async move {
                let (mut ok, mut fail, mut toks) = (0usize, 0usize, 0usize);
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if i >= total {
                        break;
                    }
                    let m = 4 + i % 13;
                    let (path, body) = if i.is_multiple_of(3) {
                        ("/v1/chat/completions", format!(r#"{{"messages":[{{"role":"user","content":"Question {i}: name a colour."}}],"max_tokens":{m},"seed":{i},"stream":true}}"#))
                    } else {
                        ("/v1/completions", format!(r#"{{"prompt":"Item {i}. The weather today","max_tokens":{m},"temperature":0.7,"seed":{i},"stream":true}}"#))
                    };
                    match stream_request(addr, path, body).await {
                        Ok((true, t)) => {
                            ok += 1;
                            toks += t.len();
                        }
                        _ => fail += 1,
                    }
                }
                (ok, fail, toks)
            }));
        }
        let (mut ok, mut fail, mut toks) = (0, 0, 0);
        for t in tasks {
            let (a, b, c) = t.await?;
            ok += a;
            fail += b;
            toks += c;
        }
        let wall = t0.elapsed().as_secs_f64();
        tokio::time::sleep(Duration::from_millis(500)).await;
        let metrics = get(addr, "/metrics").await?;
        let used = metrics.lines().find(|l| l.starts_with("deco_kv_blocks_used ")).unwrap_or("?").to_string();
        let preempt = metrics.lines().find(|l| l.starts_with("deco_preemptions_total ")).unwrap_or("?").to_string();
        let hits = metrics.lines().find(|l| l.starts_with("deco_prefix_cache_hit_tokens_total ")).unwrap_or("?").to_string();
        println!("\nload test: {total} requests from {clients} clients in {wall:.1} s: {ok} ok, {fail} failed, {toks} streamed chunks ({:.1}/s); {used}; {preempt}; {hits}", toks as f64 / wall);
        println!("peak RSS (VmHWM): {:.0} MiB", vm_hwm_mib());
        R::Ok(())
    })?;
    Ok(())
}
