//! Soak and fault test of `deco serve` (issue 17 part 3; run by `cargo xtask bench serve --soak`).
//!
//! ```text
//! cargo run --release -p deco-cli --example serve_soak -- --deco target/release/deco \
//!     --model SmolLM2-135M-Instruct.Q4_1.gguf [--requests 10000] [--clients 64] [--seed 1] \
//!     [--kv-cache-mib 48] [--drain-streams 32] [--out report.json] [--log serve.log]
//! ```
//! What it does and checks: `tests/soak/mod.rs`. Prints the report as markdown; exits 1 when a
//! check fails.

#![allow(missing_docs)]

#[path = "../tests/soak/mod.rs"]
mod soak;

use std::path::PathBuf;

fn main() {
    let mut c = soak::Config {
        deco: PathBuf::new(),
        model: PathBuf::new(),
        requests: 10_000,
        clients: 64,
        seed: 1,
        kv_cache_mib: 48,
        drain_streams: 32,
        log: std::env::temp_dir().join("deco-serve-soak.log"),
        extra_args: Vec::new(),
    };
    let mut out = None;
    let usage = "usage: serve_soak --deco BIN --model M [--requests N] [--clients N] [--seed S] [--kv-cache-mib N] [--drain-streams N] [--out FILE.json] [--log FILE]";
    for (a, v) in soak::flag_pairs("serve_soak", usage) {
        let num = |v: &str| soak::flag_num("serve_soak", &a, v);
        match a.as_str() {
            "--deco" => c.deco = v.into(),
            "--model" => c.model = v.into(),
            "--requests" => c.requests = num(&v),
            "--clients" => c.clients = num(&v),
            "--seed" => c.seed = num(&v) as u64,
            "--kv-cache-mib" => c.kv_cache_mib = num(&v),
            "--drain-streams" => c.drain_streams = num(&v),
            "--out" => out = Some(PathBuf::from(v)),
            "--log" => c.log = v.into(),
            _ => fail(&format!("unknown argument `{a}`; {usage}")),
        }
    }
    if c.deco.as_os_str().is_empty() || c.model.as_os_str().is_empty() {
        fail(usage);
    }
    if c.requests == 0 || c.clients == 0 {
        fail("--requests and --clients must be at least 1");
    }
    let rep = soak::run(&c).unwrap_or_else(|e| fail(&format!("soak harness failed: {e}")));
    println!("{}", soak::render(&c, &rep));
    if let Some(p) = out {
        let text = serde_json::to_string_pretty(&rep.to_json(&c)).unwrap_or_default();
        if let Err(e) = std::fs::write(&p, text) {
            fail(&format!("cannot write {}: {e}", p.display()));
        }
    }
    if !rep.passed() {
        std::process::exit(1);
    }
}

fn fail(msg: &str) -> ! {
    soak::exit_usage("serve_soak", msg)
}
