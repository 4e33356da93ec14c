//! Hugging Face tokenizer directories: `tokenizer_config.json` and `tokenizer.json` loaded by
//! `Tokenizer::from_hf_dir` (special tokens, BOS/EOS rules, chat template field, the EOS set),
//! then encoding (special tokens parsed or not), decoding, and per-token pieces, including ids
//! beyond the vocabulary (must be errors, not panics). Input: a little-endian u16 length, that
//! many bytes of tokenizer_config.json, then tokenizer.json.
#![no_main]

use deco_formats::tokenizer::Tokenizer;
use libfuzzer_sys::fuzz_target;

const TEXT: &str = "Hello world! <|im_start|>user\n  12345 naïve café 🦊 <s></s> \t\r\n";

fuzz_target!(|data: &[u8]| {
    let Some((config, tok)) = deco_fuzz::split_pair(data) else { return };
    let d = deco_fuzz::scratch_dir("tok");
    deco_fuzz::write_pair(d, ("tokenizer_config.json", config), ("tokenizer.json", tok));
    let Ok(t) = Tokenizer::from_hf_dir(d) else { return };
    let vocab = t.vocab_size();
    for special in [true, false] {
        if let Ok(ids) = t.encode(TEXT, special) {
            assert!(ids.iter().all(|&i| (i as usize) < vocab.max(1) || t.id_to_token(i).is_some()));
            let _ = t.decode(&ids, false);
            let _ = t.decode(&ids, true);
        }
    }
    let _ = t.encode_with(TEXT, true, true);
    for id in (0..vocab.min(64) as u32).chain([vocab as u32, vocab as u32 + 7, u32::MAX]) {
        let _ = t.token_to_piece(id);
        let _ = t.decode(&[id], false);
        let _ = t.id_to_token(id);
    }
    let _ = (t.bos_token(), t.eos_token(), t.eos_token_ids(), t.chat_template());
});
