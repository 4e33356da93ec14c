//! Shared pieces of the deco-serve tests that talk to a real server over loopback HTTP.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use deco_serve::Readiness;
use serde_json::Value;

/// A server on a free loopback port, in its own tokio runtime, until [`TestServer::stop`].
pub struct TestServer {
    /// Where it listens.
    pub addr: SocketAddr,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<deco_serve::Result<()>>,
    rt: tokio::runtime::Runtime,
}

impl TestServer {
    /// Serves what `gate` holds (`deco_serve::serve_with`).
    pub fn start(gate: Arc<Readiness>) -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
        let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop, rx) = tokio::sync::oneshot::channel::<()>();
        let task = rt.spawn(deco_serve::serve_with(listener, gate, async {
            let _ = rx.await;
        }));
        Self { addr, stop, task, rt }
    }

    /// Sends the shutdown signal without waiting (the server drains).
    pub fn signal(self) -> Stopping {
        let _ = self.stop.send(());
        Stopping { task: self.task, rt: self.rt }
    }
}

/// A server that got its shutdown signal.
pub struct Stopping {
    task: tokio::task::JoinHandle<deco_serve::Result<()>>,
    rt: tokio::runtime::Runtime,
}

impl Stopping {
    /// Waits until the server has drained and returned.
    pub fn join(self) {
        self.rt.block_on(self.task).expect("server task").expect("server");
    }
}

/// One HTTP/1.1 request on a new connection (`Connection: close`); returns the status and the
/// raw body (chunked framing left in place for streams).
pub fn http(addr: SocketAddr, method: &str, path: &str, body: Option<&Value>) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(300))).expect("timeout");
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    write!(s, "{method} {path} HTTP/1.1\r\nHost: deco\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).expect("send");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read");
    let status = out.get(9..12).and_then(|c| c.parse().ok()).unwrap_or_else(|| panic!("not HTTP: {out:?}"));
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    (status, body)
}

/// Runs `python3 tests/python/<script> --base-url http://<addr>/v1 <extra...>` (the official
/// client tests), killing it after `limit`; returns its exit code (`None` if killed by a
/// signal).
///
/// # Panics
/// When python3 cannot be started or the script runs past `limit`.
pub fn run_client_script(script: &str, addr: SocketAddr, extra: &[&std::ffi::OsStr], limit: Duration) -> Option<i32> {
    let path = deco_tests::workspace_root().join("tests/python").join(script);
    let mut child = std::process::Command::new("python3")
        .arg(&path)
        .arg("--base-url")
        .arg(format!("http://{addr}/v1"))
        .args(extra)
        .spawn()
        .unwrap_or_else(|e| panic!("python3 must be installed to run {script}: {e}"));
    let start = std::time::Instant::now();
    loop {
        if let Some(s) = child.try_wait().expect("wait") {
            return s.code();
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("{script} did not finish in {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
