//! Scale-out harness (issue 15 item 4): N real `deco serve` replicas behind a real nginx load
//! balancer (Debian's `nginx-light`), driven by the soak harness's HTTP clients and validators.
//!
//! 1. **Throughput**: the same streaming requests (exactly `max_tokens` tokens each, via
//!    `min_new_tokens`) from `clients` concurrent clients, first to one replica directly, then
//!    through nginx to all replicas: aggregate generated tokens per second of each, and the
//!    ratio.
//! 2. **A replica killed mid-run** (SIGKILL, no drain): a second batch through nginx; once a
//!    quarter of it has completed, replica 1 is killed. Counted: the requests that fail (their
//!    stream was on the killed replica) and, separately, the requests *started after* the kill,
//!    which must all succeed: nginx marks the dead upstream failed on the refused connection
//!    and passes the request to the next one (`proxy_next_upstream error`), which it may do
//!    for a POST because nothing was sent yet.
//!
//! nginx settings (written by [`nginx_conf`]): `least_conn`, upstream keep-alive, streaming-safe
//! proxying (`proxy_buffering off` so SSE events pass through as they are produced, HTTP/1.1 to
//! the upstream, a long `proxy_read_timeout`), `proxy_next_upstream error timeout http_502
//! http_503` with 2 tries, `max_fails=1 fail_timeout=10s`.

#![allow(dead_code, clippy::unwrap_used)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;

use super::soak::{self, Fault, Outcome, Req};

/// Settings of one scale-out run.
#[derive(Debug, Clone)]
pub struct Config {
    /// The `deco` binary.
    pub deco: PathBuf,
    /// The model.
    pub model: PathBuf,
    /// Replicas behind the balancer.
    pub replicas: usize,
    /// Concurrent clients.
    pub clients: usize,
    /// Requests of each phase.
    pub requests: usize,
    /// Generated tokens per request.
    pub max_tokens: usize,
    /// `--kv-cache-mib` of each replica.
    pub kv_cache_mib: usize,
    /// Working directory (nginx config, logs, replica logs).
    pub dir: PathBuf,
}

/// What a run measured.
#[derive(Debug, Default, Clone)]
pub struct Report {
    /// Aggregate generated tok/s against one replica directly.
    pub direct_tok_s: f64,
    /// Aggregate generated tok/s through nginx to every replica.
    pub balanced_tok_s: f64,
    /// Failed requests of the throughput phases (must be 0).
    pub throughput_failed: usize,
    /// Requests of the kill phase that succeeded.
    pub kill_ok: usize,
    /// Requests of the kill phase that failed.
    pub kill_failed: usize,
    /// Requests in flight when the replica was killed.
    pub in_flight_at_kill: usize,
    /// Requests started after the kill, and how many of them failed.
    pub started_after_kill: usize,
    /// Of those, failed.
    pub failed_after_kill: usize,
    /// Failure messages (first few).
    pub failures: Vec<String>,
}

/// A free loopback port (bound then released).
fn free_port() -> Result<u16, String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    Ok(l.local_addr().map_err(|e| e.to_string())?.port())
}

/// The nginx configuration of the module docs, for `upstreams`, listening on `port`.
pub fn nginx_conf(dir: &Path, port: u16, upstreams: &[SocketAddr]) -> String {
    let d = dir.display();
    let servers: String = upstreams.iter().map(|a| format!("        server {a} max_fails=1 fail_timeout=10s;\n")).collect();
    format!(
        "worker_processes 1;\ndaemon off;\npid {d}/nginx.pid;\nerror_log {d}/nginx-error.log warn;\n\
events {{ worker_connections 1024; }}\n\
http {{\n    access_log off;\n\
    client_body_temp_path {d}/body; proxy_temp_path {d}/proxy; fastcgi_temp_path {d}/fastcgi; uwsgi_temp_path {d}/uwsgi; scgi_temp_path {d}/scgi;\n\
    upstream deco {{\n        least_conn;\n{servers}        keepalive 32;\n    }}\n\
    server {{\n        listen 127.0.0.1:{port};\n        client_max_body_size 4m;\n\
        location / {{\n            proxy_pass http://deco;\n            proxy_http_version 1.1;\n            proxy_set_header Connection \"\";\n\
            proxy_buffering off;\n            proxy_read_timeout 600s;\n\
            proxy_next_upstream error timeout http_502 http_503;\n            proxy_next_upstream_tries 2;\n        }}\n    }}\n}}\n"
    )
}

/// Starts nginx in the foreground with [`nginx_conf`]; waits until it accepts connections.
///
/// # Errors
/// When nginx is not installed (the message says how to install it) or does not start.
pub fn start_nginx(dir: &Path, upstreams: &[SocketAddr]) -> Result<(Child, SocketAddr), String> {
    let port = free_port()?;
    let conf = dir.join("nginx.conf");
    std::fs::write(&conf, nginx_conf(dir, port, upstreams)).map_err(|e| format!("cannot write {}: {e}", conf.display()))?;
    let nginx = ["/usr/sbin/nginx", "nginx"].into_iter().find(|p| Command::new(p).arg("-v").stderr(Stdio::null()).status().is_ok())
        .ok_or("nginx is not installed: apt-get install nginx-light (the scale-out test runs a real load balancer)")?;
    let log = std::fs::File::create(dir.join("nginx-stderr.log")).map_err(|e| e.to_string())?;
    let mut child = Command::new(nginx).arg("-p").arg(dir).arg("-c").arg(&conf).stderr(log).spawn().map_err(|e| format!("cannot start nginx: {e}"))?;
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let start = Instant::now();
    while std::net::TcpStream::connect(addr).is_err() {
        if start.elapsed() > Duration::from_secs(10) || child.try_wait().map(|s| s.is_some()).unwrap_or(true) {
            let _ = child.kill();
            let err = std::fs::read_to_string(dir.join("nginx-stderr.log")).unwrap_or_default();
            return Err(format!("nginx did not start: {err}"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok((child, addr))
}

/// Stops nginx with SIGTERM (its master then stops the workers; a SIGKILL would leave them
/// running) and waits for it.
pub fn stop_nginx(nginx: &mut Child) {
    let _ = Command::new("kill").args(["-TERM", &nginx.id().to_string()]).status();
    let start = Instant::now();
    while nginx.try_wait().map(|s| s.is_none()).unwrap_or(false) {
        if start.elapsed() > Duration::from_secs(10) {
            let _ = nginx.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = nginx.wait();
}

/// A well-behaved streaming completion of exactly `max_tokens` tokens with a usage chunk.
pub fn request(i: usize, max_tokens: usize) -> Req {
    let body = json!({
        "model": "soak", "prompt": format!("Request {i}: tell me about the sea."), "max_tokens": max_tokens,
        "min_new_tokens": max_tokens, "temperature": 0.8, "seed": i, "stream": true, "stream_options": {"include_usage": true},
    });
    Req { chat: false, stream: true, n: 1, max_tokens, stop: vec![], include_usage: true, fault: Fault::None, body: serde_json::to_vec(&body).unwrap() }
}

/// Per-request record of a phase: (started at, outcome).
type Log = Arc<Mutex<Vec<(Instant, Outcome)>>>;

/// Sends `n` requests from `clients` concurrent clients to `addr`; calls `on_done(completed)`
/// after each completion. Returns the log and the wall time.
async fn phase(addr: SocketAddr, n: usize, clients: usize, max_tokens: usize, on_done: Arc<dyn Fn(usize) + Send + Sync>) -> (Vec<(Instant, Outcome)>, f64) {
    let next = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let log: Log = Arc::new(Mutex::new(Vec::new()));
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let (next, done, log, on_done) = (next.clone(), done.clone(), log.clone(), on_done.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= n {
                    break;
                }
                let started = Instant::now();
                let (outcome, _) = soak::run_request(addr, &request(i, max_tokens)).await;
                log.lock().unwrap().push((started, outcome));
                on_done(done.fetch_add(1, Ordering::SeqCst) + 1);
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let wall = t0.elapsed().as_secs_f64();
    let v = std::mem::take(&mut *log.lock().unwrap());
    (v, wall)
}

/// Runs both phases of the module docs.
///
/// # Errors
/// When a replica or nginx cannot be started.
pub fn run(c: &Config) -> Result<Report, String> {
    std::fs::create_dir_all(&c.dir).map_err(|e| e.to_string())?;
    let mut replicas: Vec<(Child, SocketAddr)> = Vec::new();
    for r in 0..c.replicas {
        let sc = soak::Config { log: c.dir.join(format!("replica-{r}.log")), ..soak::server_only(c.deco.clone(), c.model.clone(), &c.dir, c.kv_cache_mib) };
        replicas.push(soak::start_server(&sc)?);
    }
    let upstreams: Vec<SocketAddr> = replicas.iter().map(|(_, a)| *a).collect();
    let (mut nginx, lb) = start_nginx(&c.dir, &upstreams)?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().map_err(|e| e.to_string())?;
    let mut rep = Report::default();
    let noop: Arc<dyn Fn(usize) + Send + Sync> = Arc::new(|_| {});
    let tokens = |log: &[(Instant, Outcome)]| log.iter().filter(|(_, o)| *o == Outcome::Ok).count() * c.max_tokens;
    let note = |log: &[(Instant, Outcome)], rep: &mut Report| {
        for (_, o) in log {
            if let Outcome::Failed(e) = o {
                rep.throughput_failed += 1;
                if rep.failures.len() < 10 {
                    rep.failures.push(e.clone());
                }
            }
        }
    };
    // 1. Throughput: one replica directly, then all of them through nginx.
    let (log, wall) = rt.block_on(phase(upstreams[0], c.requests, c.clients, c.max_tokens, noop.clone()));
    rep.direct_tok_s = tokens(&log) as f64 / wall;
    note(&log, &mut rep);
    let (log, wall) = rt.block_on(phase(lb, c.requests, c.clients, c.max_tokens, noop));
    rep.balanced_tok_s = tokens(&log) as f64 / wall;
    note(&log, &mut rep);

    // 2. Kill replica 1 once a quarter of the batch has completed.
    let victim = Arc::new(Mutex::new(Some(replicas.remove(1).0)));
    let killed_at: Arc<Mutex<Option<Instant>>> = Arc::new(Mutex::new(None));
    let fired = Arc::new(AtomicBool::new(false));
    let quarter = c.requests / 4;
    let on_done: Arc<dyn Fn(usize) + Send + Sync> = {
        let (victim, killed_at, fired) = (victim.clone(), killed_at.clone(), fired.clone());
        Arc::new(move |done| {
            if done >= quarter && !fired.swap(true, Ordering::SeqCst) {
                if let Some(mut ch) = victim.lock().unwrap().take() {
                    let _ = ch.kill();
                    let _ = ch.wait();
                }
                *killed_at.lock().unwrap() = Some(Instant::now());
            }
        })
    };
    let (log, _) = rt.block_on(phase(lb, c.requests, c.clients, c.max_tokens, on_done));
    let kill_time = killed_at.lock().unwrap().ok_or("the replica was never killed")?;
    for (started, o) in &log {
        let ok = *o == Outcome::Ok;
        if ok {
            rep.kill_ok += 1;
        } else {
            rep.kill_failed += 1;
            if rep.failures.len() < 10 {
                rep.failures.push(format!("{o:?}"));
            }
        }
        if *started > kill_time {
            rep.started_after_kill += 1;
            rep.failed_after_kill += usize::from(!ok);
        }
    }
    // In flight at the kill: started before it and not among the first `quarter` completions
    // (an upper bound: those whose stream could have been on the killed replica).
    rep.in_flight_at_kill = log.iter().filter(|(s, _)| *s <= kill_time).count().saturating_sub(quarter);
    stop_nginx(&mut nginx);
    for (mut ch, _) in replicas {
        let _ = ch.kill();
        let _ = ch.wait();
    }
    Ok(rep)
}

/// The report as markdown.
pub fn render(c: &Config, r: &Report) -> String {
    format!(
        "{} replicas of `deco serve` (SmolLM2-135M-Instruct Q4_1, `--kv-cache-mib {}`) behind nginx (least_conn), {} requests per phase from {} clients, {} streamed tokens each.\n\n\
         | phase | result |\n|---|---|\n\
         | one replica directly | {:.1} tok/s |\n\
         | through nginx to {} replicas | {:.1} tok/s ({:.2}x one replica) |\n\
         | failed requests in those two phases | {} |\n\
         | replica 1 killed (SIGKILL) after a quarter of the third batch | {} ok, {} failed; {} in flight at the kill (upper bound) |\n\
         | requests started after the kill | {}, of which {} failed |\n",
        c.replicas, c.kv_cache_mib, c.requests, c.clients, c.max_tokens,
        r.direct_tok_s, c.replicas, r.balanced_tok_s, r.balanced_tok_s / r.direct_tok_s, r.throughput_failed,
        r.kill_ok, r.kill_failed, r.in_flight_at_kill, r.started_after_kill, r.failed_after_kill
    )
}
