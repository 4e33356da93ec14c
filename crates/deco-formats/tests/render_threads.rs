//! The chat-template render threads' lifecycle, in a process of its own (this file holds one
//! test, so no other test renders while the threads are counted).
//!
//! A render thread that is not put back in the pool must have been joined when the render
//! returns: one left to end on its own was still running its thread-local destructors while the
//! caller went on, and LeakSanitizer, checking between two fuzzing inputs, reported glibc's node
//! for those destructors as leaked (`chat_template` fuzzing, seventh session).

use std::time::{Duration, Instant};

use deco_formats::chat_template::{ChatMessage, ChatTemplate, MAX_IDLE_RENDER_THREADS, live_render_threads};

/// Threads of this process named as the render threads are, from `/proc/self/task/*/comm`.
#[cfg(target_os = "linux")]
fn os_render_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("list /proc/self/task")
        .filter_map(|entry| std::fs::read_to_string(entry.ok()?.path().join("comm")).ok())
        .filter(|name| name.trim_end() == "chat-template")
        .count()
}

/// Waits (up to 10 s) until the kernel lists `want` render threads: a joined thread can stay
/// in `/proc/self/task` for a moment after `pthread_join` returns (the kernel clears the
/// thread id the join waits on before it unlinks the task).
#[cfg(target_os = "linux")]
fn os_render_threads_settle(want: usize) -> usize {
    let start = Instant::now();
    loop {
        let n = os_render_threads();
        if n == want || start.elapsed() > Duration::from_secs(10) {
            return n;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn a_render_thread_that_is_not_reused_is_joined_before_the_render_returns() {
    let good = ChatTemplate::new("{% for m in messages %}{{ m.content }}{% endfor %}").expect("compile");
    let failing = ChatTemplate::new("{{ raise_exception('refused') }}").expect("compile");
    let messages = [ChatMessage::new("user", "Hi")];
    assert_eq!(live_render_threads(), 0, "no render has run yet");

    for round in 0..50 {
        // A successful render leaves its thread idle in the pool.
        assert_eq!(good.render(&messages, false, "", "").expect("render"), "Hi");
        assert_eq!(live_render_threads(), 1, "round {round}: one idle thread after a successful render");
        // A failed render takes that thread, which ends: joined before the render returns.
        let err = failing.render(&messages, false, "", "").expect_err("raise_exception fails the render");
        assert!(err.to_string().contains("refused"), "{err}");
        assert_eq!(live_render_threads(), 0, "round {round}: the thread of a failed render was joined");
    }
    #[cfg(target_os = "linux")]
    assert_eq!(os_render_threads_settle(0), 0, "the kernel still lists render threads");

    // Renders from many callers at once: at most MAX_IDLE_RENDER_THREADS stay, and the others
    // were joined by the time their renders returned.
    std::thread::scope(|scope| {
        for _ in 0..4 * MAX_IDLE_RENDER_THREADS {
            scope.spawn(|| {
                for _ in 0..5 {
                    assert_eq!(good.render(&messages, false, "", "").expect("render"), "Hi");
                }
            });
        }
    });
    let left = live_render_threads();
    assert!((1..=MAX_IDLE_RENDER_THREADS).contains(&left), "{left} render threads after the concurrent renders");
    #[cfg(target_os = "linux")]
    assert_eq!(os_render_threads_settle(left), left, "the kernel lists another number of render threads");
}
