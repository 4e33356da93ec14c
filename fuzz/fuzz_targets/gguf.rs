//! GGUF: header, metadata, tensor table and data offsets, then everything deco derives from a
//! parsed file (model config, tokenizer, chat template, tensor byte ranges, dequantization of
//! small tensors). Any input must give `Ok` or an `Err`, never a panic, abort or hang.
#![no_main]

use deco_formats::chat_template::{ChatMessage, ChatTemplate};
use deco_formats::config::ModelConfig;
use deco_formats::gguf::GgufFile;
use deco_formats::tokenizer::Tokenizer;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(g) = GgufFile::from_bytes("fuzz.gguf", data) else { return };
    let names: Vec<String> = g.tensors.iter().map(|t| t.name.clone()).collect();
    for n in &names {
        if let Ok((info, _)) = g.tensor_bytes(n) {
            if info.n_elements() <= 1 << 16 {
                let _ = g.dequantize(n);
            }
        }
    }
    let _ = ModelConfig::from_gguf(&g);
    if let Ok(tok) = Tokenizer::from_gguf(&g) {
        if let Ok(ids) = tok.encode_with("Hello <|im_start|> wörld 123", false, true) {
            let _ = tok.decode(&ids, false);
        }
    }
    if let Ok(src) = g.get_str("tokenizer.chat_template") {
        if let Ok(t) = ChatTemplate::new(src) {
            let _ = t.render(&[ChatMessage::new("user", "Hi")], true, "<s>", "</s>");
        }
    }
});
