//! The chat-template render threads' lifecycle, in a process of its own (this file holds one
//! test, so no other test renders while the threads are counted).
//!
//! A render thread that is not put back in the pool must have ended when the render returns:
//! one left to end on its own was still running its thread-local destructors while the caller
//! went on, and LeakSanitizer, checking between two fuzzing inputs, reported glibc's node for
//! those destructors as leaked (`chat_template` fuzzing, seventh session).

use deco_formats::chat_template::{ChatMessage, ChatTemplate, MAX_IDLE_RENDER_THREADS};

/// Threads of this process named as the render threads are, from `/proc/self/task/*/comm`.
#[cfg(target_os = "linux")]
fn render_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("list /proc/self/task")
        .filter_map(|entry| std::fs::read_to_string(entry.ok()?.path().join("comm")).ok())
        .filter(|name| name.trim_end() == "chat-template")
        .count()
}

#[cfg(target_os = "linux")]
#[test]
fn a_render_thread_that_is_not_reused_has_ended_when_the_render_returns() {
    let good = ChatTemplate::new("{% for m in messages %}{{ m.content }}{% endfor %}").expect("compile");
    let failing = ChatTemplate::new("{{ raise_exception('refused') }}").expect("compile");
    let messages = [ChatMessage::new("user", "Hi")];
    assert_eq!(render_threads(), 0, "no render has run yet");

    for round in 0..50 {
        // A successful render leaves its thread idle in the pool.
        assert_eq!(good.render(&messages, false, "", "").expect("render"), "Hi");
        assert_eq!(render_threads(), 1, "round {round}: one idle thread after a successful render");
        // A failed render takes that thread, which ends; it must be gone at once.
        let err = failing.render(&messages, false, "", "").expect_err("raise_exception fails the render");
        assert!(err.to_string().contains("refused"), "{err}");
        assert_eq!(render_threads(), 0, "round {round}: the thread of a failed render has ended");
    }

    // Renders from many callers at once: at most MAX_IDLE_RENDER_THREADS stay, and the others
    // have ended by the time their renders return.
    std::thread::scope(|scope| {
        for _ in 0..4 * MAX_IDLE_RENDER_THREADS {
            scope.spawn(|| {
                for _ in 0..5 {
                    assert_eq!(good.render(&messages, false, "", "").expect("render"), "Hi");
                }
            });
        }
    });
    let left = render_threads();
    assert!((1..=MAX_IDLE_RENDER_THREADS).contains(&left), "{left} render threads after the concurrent renders");
}
