//! Two real `deco serve` replicas behind a real nginx (`tests/scaleout/mod.rs`): the balanced
//! phase must lose no request, and when one replica is killed mid-run only requests whose
//! stream was on it may fail: every request started after the kill must succeed (nginx passes
//! it to the live replica). The full-size run with 64 clients is `cargo run --release -p
//! deco-cli --example scale_out` (docs/deployment.md). Needs nginx (`apt-get install
//! nginx-light`; `.ci/run` installs it).

mod scaleout;
mod soak;

#[test]
fn replicas_behind_nginx_survive_a_killed_replica() {
    let dir = tempfile::tempdir().expect("tempdir");
    let c = scaleout::Config {
        deco: env!("CARGO_BIN_EXE_deco").into(),
        model: deco_tests::smollm2_gguf(),
        replicas: 2,
        clients: 8,
        requests: 32,
        max_tokens: 12,
        kv_cache_mib: 32,
        dir: dir.path().to_path_buf(),
    };
    let r = scaleout::run(&c).unwrap_or_else(|e| panic!("scale-out run: {e}"));
    let md = scaleout::render(&c, &r);
    println!("{md}");
    assert_eq!(r.throughput_failed, 0, "{md}\n{:?}", r.failures);
    assert!(r.direct_tok_s > 0.0 && r.balanced_tok_s > 0.0, "{md}");
    assert!(r.started_after_kill > 0, "no request started after the kill: {md}");
    assert_eq!(r.failed_after_kill, 0, "requests started after the kill failed: {md}\n{:?}", r.failures);
    assert!(r.kill_failed <= r.in_flight_at_kill, "more failures than requests in flight at the kill: {md}\n{:?}", r.failures);
    assert_eq!(r.kill_ok + r.kill_failed, c.requests, "{md}");
}
