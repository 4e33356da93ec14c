//! A short soak of the real `deco serve` process (the full one is `cargo xtask bench serve
//! --soak`, see docs/reliability.md): a few hundred requests with every fault of
//! `tests/soak/mod.rs` mixed in, then SIGTERM with streams in flight. Every check of the report
//! must pass.

mod soak;

/// The `deco` binary under test on SmolLM2 with a `kv_cache_mib` pool, its log in `dir`; no
/// soak or drain requests.
fn config(dir: &std::path::Path, kv_cache_mib: usize) -> soak::Config {
    soak::server_only(env!("CARGO_BIN_EXE_deco").into(), deco_tests::smollm2_gguf(), dir, kv_cache_mib)
}

#[test]
fn soak_with_faults_then_sigterm_drains() {
    let dir = tempfile::tempdir().expect("tempdir");
    // 22 blocks of 16 tokens for 32 clients: sequences are preempted (recompute) as they grow.
    let c = soak::Config { requests: 300, clients: 32, seed: 7, drain_streams: 8, ..config(dir.path(), 16) };
    let rep = soak::run(&c).expect("soak harness");
    let md = soak::render(&c, &rep);
    eprintln!("{md}");
    assert!(rep.passed(), "soak checks failed:\n{md}\nserver log:\n{}", std::fs::read_to_string(&c.log).unwrap_or_default());
    // The mix really contained every fault kind, and the preemption path ran.
    assert!(rep.cancelled > 0 && rep.refused_400 > 0 && rep.ok > 100, "{md}");
    assert!(rep.preemptions.is_some_and(|p| p > 0), "no preemption: {md}");
}

/// The validators reject what they must: each broken body below differs from a valid one in one
/// way.
#[test]
fn validators_reject_broken_responses() {
    let req = |chat, n, max_tokens, stop: &[&str], include_usage| soak::Req {
        chat,
        stream: true,
        n,
        max_tokens,
        stop: stop.iter().map(|s| s.to_string()).collect(),
        include_usage,
        fault: soak::Fault::None,
        body: vec![],
    };
    let ev = |v: serde_json::Value| format!("data: {v}\n\n");
    let chunk = |i: usize, text: &str, finish: Option<&str>| {
        ev(serde_json::json!({"id": "c1", "object": "text_completion", "choices": [{"index": i, "text": text, "finish_reason": finish}]}))
    };
    let usage = |p: u64, c: u64| ev(serde_json::json!({"id": "c1", "object": "text_completion", "choices": [], "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}}));
    let done = "data: [DONE]\n\n";
    let r = req(false, 2, 3, &["."], true);
    let good = [chunk(0, "a b", None), chunk(1, "c", Some("stop")), chunk(0, " d", Some("length")), usage(5, 4), done.to_string()].concat();
    assert_eq!(soak::check_stream(&r, good.as_bytes()), Ok(()));
    let bad = [
        ("no [DONE]", [chunk(0, "a", Some("stop")), chunk(1, "c", Some("stop")), usage(5, 2)].concat()),
        ("a choice never finishes", [chunk(0, "a", Some("stop")), usage(5, 2), done.to_string()].concat()),
        ("text after finish", [chunk(0, "a", Some("stop")), chunk(1, "c", Some("stop")), chunk(0, "x", None), usage(5, 2), done.to_string()].concat()),
        ("stop string in the text", [chunk(0, "a.", Some("stop")), chunk(1, "c", Some("stop")), usage(5, 2), done.to_string()].concat()),
        ("usage over n * max_tokens", [chunk(0, "a", Some("stop")), chunk(1, "c", Some("stop")), usage(5, 7), done.to_string()].concat()),
        ("all length but fewer tokens", [chunk(0, "a", Some("length")), chunk(1, "c", Some("length")), usage(5, 5), done.to_string()].concat()),
        ("no usage chunk", [chunk(0, "a", Some("stop")), chunk(1, "c", Some("stop")), done.to_string()].concat()),
        ("index out of range", [chunk(0, "a", Some("stop")), chunk(2, "c", Some("stop")), usage(5, 2), done.to_string()].concat()),
        ("invalid finish_reason", [chunk(0, "a", Some("stop")), chunk(1, "c", Some("eos")), usage(5, 2), done.to_string()].concat()),
        ("events after [DONE]", [chunk(0, "a", Some("stop")), chunk(1, "c", Some("stop")), usage(5, 2), done.to_string(), done.to_string()].concat()),
        ("truncated event", [chunk(0, "a", Some("stop")), chunk(1, "c", Some("stop")), usage(5, 2), "data: [DONE]".to_string()].concat()),
        ("error event", [chunk(0, "a", Some("stop")), ev(serde_json::json!({"error": {"message": "boom"}})), done.to_string()].concat()),
    ];
    for (why, body) in bad {
        assert!(soak::check_stream(&r, body.as_bytes()).is_err(), "accepted a stream with {why}: {body}");
    }
    let r = req(true, 1, 4, &["!"], false);
    let ok = serde_json::json!({"object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}});
    assert_eq!(soak::check_json(&r, ok.to_string().as_bytes()), Ok(()));
    for (why, edit) in [
        ("wrong object", ("/object", serde_json::json!("text_completion"))),
        ("wrong role", ("/choices/0/message/role", serde_json::json!("user"))),
        ("stop string", ("/choices/0/message/content", serde_json::json!("hi!"))),
        ("total mismatch", ("/usage/total_tokens", serde_json::json!(12))),
        ("length with 3 of 4 tokens", ("/usage/completion_tokens", serde_json::json!(3))),
        ("null finish", ("/choices/0/finish_reason", serde_json::Value::Null)),
    ] {
        let mut v = ok.clone();
        *v.pointer_mut(edit.0).expect("pointer") = edit.1;
        assert!(soak::check_json(&r, v.to_string().as_bytes()).is_err(), "accepted a body with {why}: {v}");
    }
}

/// A body over the 2 MiB limit gets a 413 with an OpenAI error body, also for a client that
/// sends its whole body before it reads (as Python `requests` or curl do). Before the server
/// drained oversize bodies it closed the connection after 2 MiB, the client's write failed with
/// a reset and it never saw the answer (10 of 190 oversize requests of the 10,000-request soak).
#[test]
fn oversize_bodies_get_a_413_the_client_can_read() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().expect("tempdir");
    let c = config(dir.path(), 16);
    let (mut child, addr) = soak::start_server(&c).expect("start deco serve");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let outcomes: Vec<Result<(), String>> = rt.block_on(async {
        let mut v = Vec::new();
        for (path, mib) in [("/v1/completions", 3usize), ("/v1/chat/completions", 3), ("/v1/completions", 24), ("/v1/chat/completions", 24)] {
            let big = "x".repeat(mib << 20);
            let body = if path.contains("chat") { serde_json::json!({"messages": [{"role": "user", "content": big}]}) } else { serde_json::json!({"prompt": big}) };
            let body = serde_json::to_vec(&body).expect("json");
            let r = async {
                let mut s = tokio::net::TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
                let head = format!("POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len());
                s.write_all(head.as_bytes()).await.map_err(|e| format!("writing the head: {e}"))?;
                s.write_all(&body).await.map_err(|e| format!("writing the {mib} MiB body: {e}"))?;
                let mut out = Vec::new();
                s.read_to_end(&mut out).await.map_err(|e| format!("reading the answer: {e}"))?;
                let text = String::from_utf8_lossy(&out).into_owned();
                let json = text.split("\r\n\r\n").nth(1).unwrap_or("");
                let v: serde_json::Value = serde_json::from_str(json).map_err(|e| format!("answer body is not JSON ({e}): {text}"))?;
                if !text.starts_with("HTTP/1.1 413") || v["error"]["code"] != "request_too_large" {
                    return Err(format!("expected a 413 OpenAI error, got: {text}"));
                }
                Ok(())
            };
            v.push(tokio::time::timeout(std::time::Duration::from_secs(60), r).await.unwrap_or_else(|_| Err("no answer in 60 s".into())));
        }
        v
    });
    let _ = child.kill();
    let _ = child.wait();
    for (i, o) in outcomes.iter().enumerate() {
        assert!(o.is_ok(), "oversize request {i}: {o:?}");
    }
}
