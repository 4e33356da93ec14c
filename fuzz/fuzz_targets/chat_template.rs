//! Chat templates as found in GGUF metadata and tokenizer_config.json: compile, then render a
//! conversation with tools, as `deco generate --chat` and `deco serve` do. Hostile templates
//! (deep recursion, huge loops) must end in an error within the render budget.
#![no_main]

use deco_formats::chat_template::{ChatMessage, ChatTemplate};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(src) = std::str::from_utf8(data) else { return };
    let Ok(t) = ChatTemplate::new(src) else { return };
    let messages = [
        ChatMessage::new("system", "You are terse."),
        ChatMessage::new("user", "What is 2+2?"),
        ChatMessage::new("assistant", "4"),
        ChatMessage::new("user", "And 3+3?"),
    ];
    let tools = serde_json::json!({"tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}}]});
    let _ = t.render(&messages, true, "<s>", "</s>");
    let _ = t.render_with(&messages, false, "<s>", "</s>", &tools);
});
