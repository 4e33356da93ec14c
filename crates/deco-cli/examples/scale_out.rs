//! Scale-out run of issue 15 item 4 (docs/deployment.md): N `deco serve` replicas behind nginx,
//! throughput vs one replica, then one replica killed mid-run.
//!
//! ```text
//! cargo run --release -p deco-cli --example scale_out -- --deco target/release/deco \
//!     --model SmolLM2-135M-Instruct.Q4_1.gguf [--replicas 2] [--clients 64] [--requests 256] \
//!     [--max-tokens 24] [--kv-cache-mib 128] [--dir DIR]
//! ```
//! What it does and checks: `tests/scaleout/mod.rs`. Prints the report as markdown; exits 1 when
//! a request started after the kill failed or a throughput phase lost a request.

#![allow(missing_docs)]

#[path = "../tests/scaleout/mod.rs"]
mod scaleout;
#[path = "../tests/soak/mod.rs"]
mod soak;

use std::path::PathBuf;

fn fail(msg: &str) -> ! {
    soak::exit_usage("scale_out", msg)
}

fn main() {
    let mut c = scaleout::Config {
        deco: PathBuf::new(),
        model: PathBuf::new(),
        replicas: 2,
        clients: 64,
        requests: 256,
        max_tokens: 24,
        kv_cache_mib: 128,
        dir: std::env::temp_dir().join("deco-scale-out"),
    };
    let usage = "usage: scale_out --deco BIN --model M [--replicas N] [--clients N] [--requests N] [--max-tokens N] [--kv-cache-mib N] [--dir DIR]";
    for (a, v) in soak::flag_pairs("scale_out", usage) {
        let num = |v: &str| soak::flag_num("scale_out", &a, v);
        match a.as_str() {
            "--deco" => c.deco = v.into(),
            "--model" => c.model = v.into(),
            "--replicas" => c.replicas = num(&v),
            "--clients" => c.clients = num(&v),
            "--requests" => c.requests = num(&v),
            "--max-tokens" => c.max_tokens = num(&v),
            "--kv-cache-mib" => c.kv_cache_mib = num(&v),
            "--dir" => c.dir = v.into(),
            _ => fail(&format!("unknown argument `{a}`; {usage}")),
        }
    }
    if c.deco.as_os_str().is_empty() || c.model.as_os_str().is_empty() {
        fail(usage);
    }
    if c.replicas < 2 {
        fail("--replicas must be at least 2 (one is killed)");
    }
    match scaleout::run(&c) {
        Ok(r) => {
            println!("{}", scaleout::render(&c, &r));
            if !r.failures.is_empty() {
                println!("failures: {:?}", r.failures);
            }
            if r.throughput_failed > 0 || r.failed_after_kill > 0 {
                std::process::exit(1);
            }
        }
        Err(e) => fail(&e),
    }
}
