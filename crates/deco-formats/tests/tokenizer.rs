//! Tokenizer tests against llama.cpp's own test vectors (`shared/tokenizer-tests`: the
//! `ggml-vocab-*.gguf` vocabularies with `.inp`/`.out` produced by llama.cpp's
//! `test-tokenizer-0`) and against ids llama.cpp produced with the SmolLM2 GGUF
//! (`smollm2-cases.json`).

use std::path::{Path, PathBuf};

use deco_formats::Error;
use deco_formats::gguf::GgufFile;
use deco_formats::tokenizer::Tokenizer;

mod common;
use common::asset;

fn vocab_path(name: &str) -> PathBuf {
    asset(&format!("tokenizer-tests/ggml-vocab-{name}.gguf"))
}

fn smollm2_path() -> PathBuf {
    common::smollm2_gguf()
}

fn load_gguf(path: &Path) -> Tokenizer {
    let gguf = GgufFile::open(path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    Tokenizer::from_gguf(&gguf).unwrap_or_else(|e| panic!("tokenizer of {}: {e}", path.display()))
}

/// Reads `.inp`/`.out` exactly like llama.cpp's `tests/test-tokenizer-0.cpp` (`read_tests`):
/// inputs are separated by `"\n__ggml_vocab_test__\n"`, outputs are one line of
/// space-separated ids per case.
fn read_cases(name: &str) -> Vec<(String, Vec<u32>)> {
    let inp_path = asset(&format!("tokenizer-tests/ggml-vocab-{name}.gguf.inp"));
    let out_path = asset(&format!("tokenizer-tests/ggml-vocab-{name}.gguf.out"));
    let raw = std::fs::read_to_string(&inp_path).expect("read .inp");
    let out = std::fs::read_to_string(&out_path).expect("read .out");
    let sep = "\n__ggml_vocab_test__\n";
    let mut inputs = Vec::new();
    let mut pos = 0;
    while pos < raw.len() {
        match raw[pos..].find(sep) {
            None => {
                inputs.push(raw[pos..].to_owned());
                break;
            }
            Some(next) => {
                inputs.push(raw[pos..pos + next].to_owned());
                pos += next + sep.len();
            }
        }
    }
    let outputs: Vec<Vec<u32>> =
        out.lines().map(|l| l.split_whitespace().map(|t| t.parse().expect("token id")).collect()).collect();
    assert_eq!(inputs.len(), outputs.len(), "{name}: .inp and .out have different numbers of cases");
    inputs.into_iter().zip(outputs).collect()
}

/// Tokenizes every case as `test-tokenizer-0` does (`add_special = false`,
/// `parse_special = false`); returns (passed, total) and prints the failures.
fn run_vocab(name: &str) -> (usize, usize) {
    let tok = load_gguf(&vocab_path(name));
    let cases = read_cases(name);
    let mut passed = 0;
    for (text, expected) in &cases {
        let got = tok.encode_with(text, false, false).expect("encode");
        if &got == expected {
            passed += 1;
        } else {
            eprintln!("{name}: {text:?}\n  expected {expected:?}\n  got      {got:?}");
        }
    }
    eprintln!("{name}: {passed}/{} cases exact", cases.len());
    (passed, cases.len())
}

// Every vocabulary of llama.cpp's `models/` folder (llama-cpp-python 0.3.36 sdist) whose
// tokenizer model and pre-tokenizer deco implements, one test each. Not tested, because deco
// refuses them with an error naming the field: bert-bge (`bert` WordPiece) and gemma-4
// (`gemma4`); aquila, baichuan, gpt-neox and nomic-bert-moe come without test vectors.
macro_rules! llama_cpp_vectors {
    ($($test:ident => $name:literal),* $(,)?) => {$(
        #[test]
        fn $test() {
            let (passed, total) = run_vocab($name);
            assert_eq!(passed, total);
        }
    )*};
}

llama_cpp_vectors! {
    llama_cpp_vectors_gpt2 => "gpt-2",
    llama_cpp_vectors_qwen2 => "qwen2",
    llama_cpp_vectors_llama_bpe => "llama-bpe",
    llama_cpp_vectors_starcoder => "starcoder",
    llama_cpp_vectors_llama_spm => "llama-spm",
    llama_cpp_vectors_command_r => "command-r",
    llama_cpp_vectors_deepseek_coder => "deepseek-coder",
    llama_cpp_vectors_falcon => "falcon",
    llama_cpp_vectors_mpt => "mpt",
    llama_cpp_vectors_refact => "refact",
    llama_cpp_vectors_phi_3 => "phi-3",
    llama_cpp_vectors_deepseek_llm => "deepseek-llm",
    llama_cpp_vectors_qwen35 => "qwen35",
}

/// The vocabularies deco does not implement are refused with an error naming what is missing.
#[test]
fn unsupported_llama_cpp_vocabularies_are_refused_by_name() {
    for (name, field) in [("bert-bge", "bert"), ("gemma-4", "gemma4")] {
        let path = vocab_path(name);
        let gguf = GgufFile::open(&path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
        let msg = match Tokenizer::from_gguf(&gguf) {
            Ok(_) => panic!("{name}: expected deco to refuse this vocabulary"),
            Err(e) => e.to_string(),
        };
        assert!(msg.contains(field), "{name}: {msg}");
    }
}

#[derive(serde::Deserialize)]
struct SmolCase {
    text: String,
    ids_no_special: Vec<u32>,
    ids_parse_special: Vec<u32>,
}

fn smollm2_cases() -> Vec<SmolCase> {
    let path = asset("tokenizer-tests/smollm2-cases.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("read smollm2-cases.json")).expect("parse")
}

#[test]
fn smollm2_cases_both_modes() {
    let tok = load_gguf(&smollm2_path());
    let cases = smollm2_cases();
    let (mut ok_plain, mut ok_special) = (0, 0);
    for c in &cases {
        // SmolLM2 has add_bos_token = false, so `encode` adds nothing.
        let plain = tok.encode(&c.text, false).expect("encode");
        let special = tok.encode(&c.text, true).expect("encode");
        if plain == c.ids_no_special {
            ok_plain += 1;
        } else {
            eprintln!("no_special {:?}\n  expected {:?}\n  got      {plain:?}", c.text, c.ids_no_special);
        }
        if special == c.ids_parse_special {
            ok_special += 1;
        } else {
            eprintln!("parse_special {:?}\n  expected {:?}\n  got      {special:?}", c.text, c.ids_parse_special);
        }
    }
    eprintln!("smollm2: no_special {ok_plain}/{n}, parse_special {ok_special}/{n} exact", n = cases.len());
    assert_eq!(ok_plain, cases.len());
    assert_eq!(ok_special, cases.len());
}

#[test]
fn smollm2_metadata() {
    let tok = load_gguf(&smollm2_path());
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(tok.bos_token_id(), Some(1));
    assert_eq!(tok.eos_token_id(), Some(2));
    assert_eq!(tok.pad_token_id(), Some(2));
    assert!(!tok.add_bos());
    assert!(!tok.add_eos());
    assert_eq!(tok.bos_token().as_deref(), Some("<|im_start|>"));
    assert_eq!(tok.eos_token().as_deref(), Some("<|im_end|>"));
    // llama.cpp's EOG set for this vocabulary: <|endoftext|>, <|im_end|>, and <reponame> (FIM repo).
    assert_eq!(tok.eos_token_ids(), &[0, 2, 4]);
    assert!(tok.is_eos(0) && tok.is_eos(2));
    assert!(!tok.is_eos(1) && !tok.is_eos(198));
    assert!(tok.chat_template().is_some_and(|t| t.contains("<|im_start|>")));
    // Pieces are bytes: " Hello" is one token whose piece is b" Hello".
    let ids = tok.encode(" Hello", false).expect("encode");
    assert_eq!(ids.len(), 1);
    assert_eq!(tok.token_to_piece(ids[0]).expect("piece"), b" Hello");
    assert_eq!(tok.token_to_piece(1).expect("piece"), b"<|im_start|>");
    assert!(tok.token_to_piece(49152).is_err());
}

#[test]
fn llama_bpe_adds_bos() {
    let tok = load_gguf(&vocab_path("llama-bpe"));
    assert!(tok.add_bos());
    assert_eq!(tok.bos_token_id(), Some(128000));
    let with = tok.encode("Hello world", false).expect("encode");
    let without = tok.encode_with("Hello world", false, false).expect("encode");
    assert_eq!(with[0], 128000);
    assert_eq!(&with[1..], &without[..]);
    assert!(tok.is_eos(128001) && tok.is_eos(128009));
}

fn all_texts() -> Vec<String> {
    let mut texts: Vec<String> = read_cases("gpt-2").into_iter().map(|(t, _)| t).collect();
    texts.extend(smollm2_cases().into_iter().map(|c| c.text));
    texts
}

#[test]
fn decode_inverts_encode() {
    for path in
        [smollm2_path(), vocab_path("qwen2"), vocab_path("llama-bpe"), vocab_path("gpt-2"), vocab_path("llama-spm")]
    {
        let tok = load_gguf(&path);
        for text in all_texts() {
            for parse_special in [false, true] {
                let ids = tok.encode_with(&text, false, parse_special).expect("encode");
                assert_eq!(tok.decode(&ids, false).expect("decode"), text, "{}", path.display());
            }
        }
    }
}

#[test]
fn decode_skip_special() {
    let tok = load_gguf(&smollm2_path());
    let ids = tok.encode("<|im_start|>user\nHi<|im_end|>", true).expect("encode");
    assert_eq!(ids.first(), Some(&1));
    assert_eq!(tok.decode(&ids, true).expect("decode"), "user\nHi");
    assert_eq!(tok.decode(&ids, false).expect("decode"), "<|im_start|>user\nHi<|im_end|>");
    let err = tok.decode(&[5, 1_000_000], false).expect_err("out of range");
    assert!(err.to_string().contains("1000000"), "{err}");
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("deco-tokenizer-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn save_hf_round_trip_gives_identical_ids() {
    let texts = all_texts();
    for (name, path) in [
        ("smollm2", smollm2_path()),
        ("llama-bpe", vocab_path("llama-bpe")),
        ("qwen2", vocab_path("qwen2")),
        ("llama-spm", vocab_path("llama-spm")),
    ] {
        let a = load_gguf(&path);
        let dir = temp_dir(name);
        a.save_hf(&dir).expect("save_hf");
        let b = Tokenizer::from_hf_dir(&dir).expect("from_hf_dir");
        assert_eq!(a.vocab_size(), b.vocab_size(), "{name}");
        assert_eq!(a.bos_token_id(), b.bos_token_id(), "{name}");
        assert_eq!(a.eos_token_id(), b.eos_token_id(), "{name}");
        assert_eq!(a.pad_token_id(), b.pad_token_id(), "{name}");
        assert_eq!(a.add_bos(), b.add_bos(), "{name}");
        assert_eq!(a.add_eos(), b.add_eos(), "{name}");
        assert_eq!(a.eos_token_ids(), b.eos_token_ids(), "{name}");
        assert_eq!(a.chat_template(), b.chat_template(), "{name}");
        for text in &texts {
            for parse_special in [false, true] {
                let ia = a.encode(text, parse_special).expect("encode");
                let ib = b.encode(text, parse_special).expect("encode");
                assert_eq!(ia, ib, "{name}: {text:?} parse_special={parse_special}");
                assert_eq!(a.decode(&ia, false).expect("decode"), b.decode(&ib, false).expect("decode"));
            }
        }
        // transformers would read add_bos_token from tokenizer_config.json; the post-processor in
        // tokenizer.json agrees with it.
        let enc = b.inner().encode("Hi", true).expect("encode");
        assert_eq!(enc.get_ids().first() == a.bos_token_id().as_ref(), a.add_bos(), "{name}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn from_hf_dir_reads_generation_config_and_template_list() {
    let a = load_gguf(&smollm2_path());
    let dir = temp_dir("genconfig");
    a.save_hf(&dir).expect("save_hf");
    // A named template list (transformers' multi-template form) and generation_config eos ids.
    let cfg_path = dir.join("tokenizer_config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).expect("read")).expect("json");
    cfg["chat_template"] = serde_json::json!([
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "default template"}
    ]);
    std::fs::write(&cfg_path, cfg.to_string()).expect("write");
    std::fs::write(dir.join("generation_config.json"), r#"{"eos_token_id": [2, 7]}"#).expect("write");
    let b = Tokenizer::from_hf_dir(&dir).expect("from_hf_dir");
    assert_eq!(b.chat_template(), Some("default template"));
    assert_eq!(b.eos_token_ids(), &[0, 2, 4, 7]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn from_hf_dir_errors_name_the_file() {
    let dir = temp_dir("missing");
    let err = Tokenizer::from_hf_dir(&dir).expect_err("missing dir");
    assert!(matches!(err, Error::Io { .. }));
    assert!(err.to_string().contains("tokenizer.json"), "{err}");

    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::write(dir.join("tokenizer.json"), "{ not json").expect("write");
    let err = Tokenizer::from_hf_dir(&dir).expect_err("bad json");
    assert!(err.to_string().contains("tokenizer.json"), "{err}");

    load_gguf(&smollm2_path()).save_hf(&dir).expect("save_hf");
    // Found by the hf_tokenizer fuzz target: a syntax error inside the `decoder` value made
    // the `tokenizers` crate panic (`expect("Helper")`) instead of returning an error.
    // So did a string escape that is not a Unicode scalar value (a lone surrogate).
    let good = std::fs::read_to_string(dir.join("tokenizer.json")).expect("read");
    let at = good.find("\"decoder\":").expect("a decoder field");
    for bad_value in ["{\"type\": tru}", "{\"type\": \"\\ud800\"}"] {
        let broken = format!("{}\"decoder\": {bad_value}, \"x\":{}", &good[..at], &good[at + "\"decoder\":".len()..]);
        std::fs::write(dir.join("tokenizer.json"), broken).expect("write");
        let err = Tokenizer::from_hf_dir(&dir).expect_err("invalid decoder value");
        assert!(err.to_string().contains("tokenizer.json"), "{bad_value}: {err}");
    }
    load_gguf(&smollm2_path()).save_hf(&dir).expect("save_hf");
    std::fs::write(dir.join("tokenizer_config.json"), "[1, 2").expect("write");
    let err = Tokenizer::from_hf_dir(&dir).expect_err("bad config");
    assert!(err.to_string().contains("tokenizer_config.json"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn stream_decoder_matches_full_decode() {
    let texts = [
        "emoji 🦀🔥 and accents café naïve",
        "🚀 (normal) 😶\u{200d}🌫️ (multiple emojis concatenated) ✅",
        "我想在apple工作1314151天～",
        "нещо на Български",
        "កាន់តែពិសេសអាចខលចេញ",
        "<|im_start|>user\n日本語のテキスト<|im_end|>\n",
        "plain ascii text",
    ];
    for path in [smollm2_path(), vocab_path("qwen2"), vocab_path("llama-spm")] {
        let tok = load_gguf(&path);
        for text in texts {
            for skip_special in [false, true] {
                let ids = tok.encode_with(text, false, true).expect("encode");
                let full = tok.decode(&ids, skip_special).expect("decode");
                let mut stream = tok.stream_decoder(skip_special);
                let mut out = String::new();
                for &id in &ids {
                    let piece = stream.step(id).expect("step");
                    assert!(!piece.contains('\u{FFFD}'), "{}: partial character emitted for {text:?}", path.display());
                    out.push_str(&piece);
                }
                out.push_str(&stream.flush().expect("flush"));
                assert_eq!(out, full, "{}: {text:?}", path.display());
            }
        }
    }
}

#[test]
fn stream_decoder_holds_split_characters() {
    let tok = load_gguf(&smollm2_path());
    // "🦀" is four bytes; byte-level BPE on SmolLM2 splits it into several tokens.
    let ids = tok.encode_with("🦀", false, false).expect("encode");
    assert!(ids.len() > 1, "{ids:?}");
    let mut stream = tok.stream_decoder(false);
    let pieces: Vec<String> = ids.iter().map(|&id| stream.step(id).expect("step")).collect();
    assert!(pieces[..pieces.len() - 1].iter().all(String::is_empty), "{pieces:?}");
    assert_eq!(pieces.last().map(String::as_str), Some("🦀"));
    // An incomplete character at the end comes out of flush as U+FFFD.
    let mut stream = tok.stream_decoder(false);
    assert_eq!(stream.step(ids[0]).expect("step"), "");
    assert_eq!(stream.flush().expect("flush"), "\u{FFFD}");
}

/// Writes a minimal vocabulary-only GGUF (v3, no tensors) with the given string metadata and a
/// two-token vocabulary.
fn write_vocab_gguf(path: &Path, strings: &[(&str, &str)]) {
    fn s(out: &mut Vec<u8>, v: &str) {
        out.extend_from_slice(&(v.len() as u64).to_le_bytes());
        out.extend_from_slice(v.as_bytes());
    }
    let mut out = Vec::new();
    out.extend_from_slice(b"GGUF");
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&0u64.to_le_bytes());
    out.extend_from_slice(&(strings.len() as u64 + 2).to_le_bytes());
    for (k, v) in strings {
        s(&mut out, k);
        out.extend_from_slice(&8u32.to_le_bytes());
        s(&mut out, v);
    }
    for key in ["tokenizer.ggml.tokens", "tokenizer.ggml.merges"] {
        s(&mut out, key);
        out.extend_from_slice(&9u32.to_le_bytes());
        out.extend_from_slice(&8u32.to_le_bytes());
        let items: &[&str] = if key.ends_with("tokens") { &["a", "b", "ab"] } else { &["a b"] };
        out.extend_from_slice(&(items.len() as u64).to_le_bytes());
        for item in items {
            s(&mut out, item);
        }
    }
    std::fs::write(path, out).expect("write gguf");
}

#[test]
fn unsupported_gguf_tokenizers_are_clear_errors() {
    let dir = temp_dir("bad-gguf");
    std::fs::create_dir_all(&dir).expect("mkdir");

    let p = dir.join("bert.gguf");
    write_vocab_gguf(&p, &[("tokenizer.ggml.model", "bert")]);
    let err = Tokenizer::from_gguf(&GgufFile::open(&p).expect("open")).expect_err("bert");
    let msg = err.to_string();
    assert!(msg.contains("bert.gguf") && msg.contains("tokenizer.ggml.model") && msg.contains("bert"), "{msg}");

    let p = dir.join("pre.gguf");
    write_vocab_gguf(&p, &[("tokenizer.ggml.model", "gpt2"), ("tokenizer.ggml.pre", "no-such-pre")]);
    let err = Tokenizer::from_gguf(&GgufFile::open(&p).expect("open")).expect_err("pre");
    let msg = err.to_string();
    assert!(msg.contains("tokenizer.ggml.pre") && msg.contains("no-such-pre"), "{msg}");

    // A well-formed tiny vocabulary works: "ab" merges into one token.
    let p = dir.join("ok.gguf");
    write_vocab_gguf(&p, &[("tokenizer.ggml.model", "gpt2"), ("tokenizer.ggml.pre", "gpt-2")]);
    let tok = Tokenizer::from_gguf(&GgufFile::open(&p).expect("open")).expect("tiny vocab");
    assert_eq!(tok.encode("ab", false).expect("encode"), vec![2]);
    assert_eq!(tok.decode(&[2, 0], false).expect("decode"), "aba");

    // No tokenizer at all.
    let p = dir.join("none.gguf");
    write_vocab_gguf(&p, &[]);
    let err = Tokenizer::from_gguf(&GgufFile::open(&p).expect("open")).expect_err("no model key");
    assert!(err.to_string().contains("tokenizer.ggml.model"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn tokenizer_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
    assert_send_sync::<deco_formats::chat_template::ChatTemplate>();
}
