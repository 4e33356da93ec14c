//! A short soak of the real `deco serve` process (the full one is `cargo xtask bench serve
//! --soak`, see docs/reliability.md): a few hundred requests with every fault of
//! `tests/soak/mod.rs` mixed in, then SIGTERM with streams in flight. Every check of the report
//! must pass.

mod soak;

#[test]
fn soak_with_faults_then_sigterm_drains() {
    let dir = tempfile::tempdir().expect("tempdir");
    let c = soak::Config {
        deco: env!("CARGO_BIN_EXE_deco").into(),
        model: deco_tests::smollm2_gguf(),
        requests: 300,
        clients: 32,
        seed: 7,
        kv_cache_mib: 64,
        drain_streams: 8,
        log: soak::log_path(dir.path()),
    };
    let rep = soak::run(&c).expect("soak harness");
    let md = soak::render(&c, &rep);
    eprintln!("{md}");
    assert!(rep.passed(), "soak checks failed:\n{md}\nserver log:\n{}", std::fs::read_to_string(&c.log).unwrap_or_default());
    // The mix really contained every fault kind.
    assert!(rep.cancelled > 0 && rep.refused_400 > 0 && rep.ok > 100, "{md}");
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
