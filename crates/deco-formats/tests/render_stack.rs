//! Where a chat template renders: on a large stack segment of the calling thread, with no
//! thread of its own. In a process of its own (this file holds one test, so no other test
//! starts threads while they are counted).
//!
//! Renders used to run on pooled threads with 512 MiB stacks. A pooled thread outlives its
//! render, and LeakSanitizer, checking between two fuzzing inputs, twice reported such a
//! thread's own allocations as leaked (`chat_template` fuzzing, seventh and eighth sessions;
//! docs/reliability.md). A render now leaves no thread behind, and still survives the deepest
//! nesting its budget allows on a caller with a small stack.

use deco_formats::chat_template::{ChatMessage, ChatTemplate, render_fuel};

/// The threads of this process, from `/proc/self/task`.
#[cfg(target_os = "linux")]
fn os_threads() -> usize {
    std::fs::read_dir("/proc/self/task").expect("list /proc/self/task").count()
}

/// Waits (up to 10 s) until the kernel lists `want` threads: a joined thread can stay in
/// `/proc/self/task` for a moment after `pthread_join` returns (the kernel clears the thread id
/// the join waits on before it unlinks the task).
#[cfg(target_os = "linux")]
fn os_threads_settle(want: usize) -> usize {
    let start = std::time::Instant::now();
    loop {
        let n = os_threads();
        if n == want || start.elapsed() > std::time::Duration::from_secs(10) {
            return n;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

#[test]
fn renders_start_no_thread_and_survive_deep_nesting_on_a_small_stack() {
    let good = ChatTemplate::new("{% for m in messages %}{{ m.content }}{% endfor %}").expect("compile");
    let failing = ChatTemplate::new("{{ raise_exception('refused') }}").expect("compile");
    let messages = [ChatMessage::new("user", "Hi")];
    #[cfg(target_os = "linux")]
    let before = os_threads();

    for round in 0..50 {
        assert_eq!(good.render(&messages, false, "", "").expect("render"), "Hi", "round {round}");
        let err = failing.render(&messages, false, "", "").expect_err("raise_exception fails the render");
        assert!(err.to_string().contains("refused"), "round {round}: {err}");
        #[cfg(target_os = "linux")]
        assert_eq!(os_threads(), before, "round {round}: a render left a thread behind");
    }

    // The deepest list nesting the budget allows, rendered (and dropped, which recurses once
    // per level) from a thread with a 256 KiB stack. The message makes the budget ~1.05 M
    // fuel, about 150,000 levels at ~7 fuel per level.
    let long = "x".repeat(1_000_000);
    let big = [ChatMessage::new("user", long.as_str())];
    let fuel = render_fuel(&big, &serde_json::Value::Null);
    assert!(fuel > 1_000_000, "{fuel}");
    let deep = ChatTemplate::new(
        "{% set ns = namespace(l=[]) %}{% for j in range(100) %}{% for i in range(100000) %}{% set ns.l = [ns.l] %}{% endfor %}{% endfor %}",
    )
    .expect("compile");
    let err = std::thread::scope(|scope| {
        std::thread::Builder::new()
            .stack_size(256 << 10)
            .spawn_scoped(scope, || deep.render(&big, false, "", ""))
            .expect("spawn")
            .join()
            .expect("no panic, no stack overflow")
    })
    .expect_err("the loop runs out of fuel");
    assert!(err.to_string().contains("fuel"), "{err}");
    // Within the budget the same nesting renders: 20,000 levels, printed to depth 500.
    let t = ChatTemplate::new(
        "{% set ns = namespace(l=[]) %}{% for i in range(20000) %}{% set ns.l = [ns.l] %}{% endfor %}{{ ns.l }}",
    )
    .expect("compile");
    let out = std::thread::scope(|scope| {
        std::thread::Builder::new()
            .stack_size(256 << 10)
            .spawn_scoped(scope, || t.render(&big, false, "", ""))
            .expect("spawn")
            .join()
            .expect("no panic, no stack overflow")
    })
    .expect("20,000 levels fit the budget");
    assert!(out.starts_with(&"[".repeat(500)) && out.contains("..."), "{}", &out[..600.min(out.len())]);

    // Renders from many callers at once: every thread the test started is gone afterwards, and
    // no render started one.
    std::thread::scope(|scope| {
        for _ in 0..32 {
            scope.spawn(|| {
                for _ in 0..5 {
                    assert_eq!(good.render(&messages, false, "", "").expect("render"), "Hi");
                }
            });
        }
    });
    #[cfg(target_os = "linux")]
    assert_eq!(os_threads_settle(before), before, "threads left after the concurrent renders");
}
