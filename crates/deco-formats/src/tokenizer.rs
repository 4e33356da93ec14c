//! Tokenizers: GGUF vocabularies and Hugging Face `tokenizer.json`, on the `tokenizers` crate.
//!
//! [`Tokenizer`] wraps a [`tokenizers::Tokenizer`] and adds what a generator needs on top of it:
//! the BOS/EOS/PAD ids, whether BOS/EOS are added when encoding, the set of end-of-generation ids
//! and the chat template.
//!
//! # From GGUF
//!
//! [`Tokenizer::from_gguf`] rebuilds the tokenizer that llama.cpp would use for the file
//! (`src/llama-vocab.cpp`, `llama_vocab::impl::load` and `llm_tokenizer_bpe`):
//!
//! - `tokenizer.ggml.model == "gpt2"` (byte-level BPE): a BPE model over `tokenizer.ggml.tokens`
//!   and `tokenizer.ggml.merges`, no normalizer, a pre-tokenizer that applies llama.cpp's regexes
//!   for `tokenizer.ggml.pre` one after the other (each a `Split` with `Isolated` behaviour, the
//!   way `unicode_regex_split` keeps both matches and the text between them), then `ByteLevel`
//!   without its own regex; a `ByteLevel` decoder.
//! - `tokenizer.ggml.model == "llama"` (SentencePiece BPE): a BPE model with byte fallback whose
//!   merges are derived from `tokenizer.ggml.scores` the way transformers' `LlamaConverter`
//!   (`convert_slow_tokenizer.py`, `SentencePieceExtractor`) derives them; the normalizer replaces
//!   spaces with `▁` and prepends `▁` (llama.cpp `add_space_prefix`); the decoder undoes it.
//!
//! Token types (`tokenizer.ggml.token_type`, llama.cpp `llama_token_type`) decide what becomes an
//! added token: CONTROL and UNKNOWN tokens become *special* added tokens, USER_DEFINED tokens
//! become non-special added tokens. This reproduces llama.cpp's `tokenizer_st_partition`: with
//! `parse_special == false` control tokens are treated as plain text while user-defined tokens
//! are still split out, which is what `tokenizers` does with `encode_special_tokens == true`.
//!
//! # End of generation
//!
//! [`Tokenizer::is_eos`] answers for a set of ids built like llama.cpp's `special_eog_ids`: the
//! EOS id, the EOT/EOM ids when the metadata names them, every token whose text is one of the
//! end-of-turn markers llama.cpp recognises (`<|eot_id|>`, `<|im_end|>`, `<|endoftext|>`,
//! `<end_of_turn>`, ...) and the FIM pad/repo/file-separator tokens. For a Hugging Face
//! directory the same rule is applied, plus the ids of `generation_config.json`'s
//! `eos_token_id`. This is the set llama.cpp stops on, and a superset of what transformers'
//! `generation_config` usually lists (for SmolLM2: `<|endoftext|>`, `<|im_end|>`, `<reponame>`).
//!
//! # Known differences
//!
//! - llama.cpp's regexes run on its own Unicode tables; here they run on `fancy-regex`'s. They can
//!   disagree on code points assigned in recent Unicode versions.
//! - llama.cpp's `detokenize` can apply `clean_up_tokenization_spaces`; [`Tokenizer::decode`]
//!   never does (neither does the `tokenizers` crate).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::Path;
use std::sync::OnceLock;

use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::prepend::Prepend;
use tokenizers::normalizers::replace::Replace;
use tokenizers::normalizers::utils::Sequence as NormalizerSequence;
use tokenizers::pre_tokenizers::sequence::Sequence as PreTokenizerSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper, SplitDelimiterBehavior,
};

use crate::gguf::{GgufFile, MetadataValue};
use crate::{Error, Result};

/// llama.cpp `llama_token_type` values as stored in `tokenizer.ggml.token_type`.
mod token_type {
    pub const UNKNOWN: u64 = 2;
    pub const CONTROL: u64 = 3;
    pub const USER_DEFINED: u64 = 4;
}

/// The GPT-2 pre-tokenizer regex (llama.cpp `LLAMA_VOCAB_PRE_TYPE_GPT2`). llama.cpp runs it with
/// a hand-written matcher (`unicode_regex_split_custom_gpt2`) that also falls back to `\s+`,
/// which is the final alternative here (as in the `tokenizers` ByteLevel regex).
const RE_GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// The Llama 3 regex, as adapted by llama.cpp (`LLAMA_VOCAB_PRE_TYPE_LLAMA3`): the
/// case-insensitive contractions spelled out.
const RE_LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The Qwen2 regex (llama.cpp `LLAMA_VOCAB_PRE_TYPE_QWEN2`): like Llama 3 with single digits.
const RE_QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GPT-4o / Llama 4 regex as adapted by llama.cpp (`LLAMA_VOCAB_PRE_TYPE_GPT4O`).
const RE_GPT4O: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen3.5's regex as adapted by llama.cpp (`LLAMA_VOCAB_PRE_TYPE_QWEN35`): Qwen2's with letters
/// extended by combining marks (`\p{M}`).
const RE_QWEN35: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Tekken (Mistral Nemo) regex as adapted by llama.cpp (`LLAMA_VOCAB_PRE_TYPE_TEKKEN`).
const RE_TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// How llama.cpp pre-tokenizes and flags a byte-level BPE vocabulary with a given
/// `tokenizer.ggml.pre` (the `tokenizer_pre` switch in `llama_vocab::impl::load` and the
/// `regex_exprs` switch in `llm_tokenizer_bpe`).
struct PreTokenizerSpec {
    regexes: &'static [&'static str],
    /// `tokenizer_ignore_merges`: a pre-token that is itself in the vocabulary is not merged.
    ignore_merges: bool,
    /// Default of `add_bos` before `tokenizer.ggml.add_bos_token` overrides it.
    add_bos: bool,
}

/// The pre-tokenizer names this module knows, for error messages.
const KNOWN_PRE: &str = "default, llama3/llama-bpe (and llama-v3, falcon3, falcon-h1, pixtral, midm-2.0, lfm2), \
dbrx, smaug-bpe, falcon, starcoder, smollm, refact, command-r, codeshell, exaone, minerva-7b, \
gpt-2 (and phi-2, mpt, olmo, jais, jina-*, gigachat, roberta-bpe, ...), qwen2 (and deepseek-r1-qwen, \
stablelm2, megrez, hunyuan), qwen35, deepseek-llm, deepseek-coder, chatglm-bpe/glm4, tekken, gpt-4o/llama4, poro-chat, bloom, gpt3-finnish";

fn pre_tokenizer_spec(pre: &str) -> Option<PreTokenizerSpec> {
    let spec = |regexes: &'static [&'static str], ignore_merges: bool, add_bos: bool| PreTokenizerSpec {
        regexes,
        ignore_merges,
        add_bos,
    };
    Some(match pre {
        "default" => spec(&[r"[\p{P}\$\+<=>\^~\|]+", RE_GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"], false, false),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0" | "lfm2"
        | "jina-v5-nano" => spec(&[RE_LLAMA3], true, true),
        "dbrx" | "smaug-bpe" => spec(&[RE_LLAMA3], false, false),
        "chatglm-bpe" | "glm4" => spec(&[RE_LLAMA3], false, false),
        "falcon" => spec(
            &[
                r"[\p{P}\$\+<=>\^~\|`]+",
                r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
                r"[0-9][0-9][0-9]",
            ],
            false,
            false,
        ),
        "starcoder" | "refact" | "command-r" | "smollm" | "codeshell" | "exaone" | "minerva-7b" | "mellum2" => {
            spec(&[r"\p{N}", RE_GPT2], false, false)
        }
        "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de" | "a.x-4.0" | "mellum"
        | "modern-bert" | "mpt" | "olmo" | "jais" | "trillion" | "granite-docling" | "exaone4" | "jina-v1-en"
        | "jina-v2-code" | "roberta-bpe" => spec(&[RE_GPT2], false, false),
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "stablelm2" | "megrez" | "hunyuan" | "solar-open" => {
            spec(&[RE_QWEN2], false, false)
        }
        "deepseek-llm" => spec(&["[\r\n]", "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+", "\\s?[!-/:-~！-／：-～‘-‟　-。]+", "\\s+$", "[一-龥ࠀ-一가-퟿]+", "\\p{N}+"], false, false),
        "qwen35" => spec(&[RE_QWEN35], false, false),
        "deepseek-coder" => spec(&["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}"], false, false),
        "tekken" => spec(&[RE_TEKKEN], true, true),
        "gpt-4o" | "llama4" | "kanana2" | "talkie" => spec(&[RE_GPT4O], false, false),
        "poro-chat" | "bloom" | "gpt3-finnish" => spec(&[r" ?[^(\s|.,!?…。，、।۔،)]+"], false, false),
        _ => return None,
    })
}

/// Texts llama.cpp treats as end-of-generation tokens (`special_eog_ids` in `llama-vocab.cpp`).
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];
/// llama.cpp's automatic EOT detection texts.
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];
/// llama.cpp's FIM texts whose tokens are end-of-generation (pad, repo, file separator).
const FIM_PAD_TEXTS: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
const FIM_REP_TEXTS: &[&str] = &["<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"];
const FIM_SEP_TEXTS: &[&str] = &["<|file_sep|>"];
/// llama.cpp's other FIM texts (they are forced to CONTROL but do not end generation).
const FIM_OTHER_TEXTS: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
    "<|middle|>",
];

/// How token ids map back to bytes, for [`Tokenizer::token_to_piece`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PieceStyle {
    /// GPT-2 byte-level: every character of a vocabulary string stands for one byte.
    ByteLevel,
    /// SentencePiece: `▁` is a space, `<0xXX>` is a byte.
    SentencePiece,
    /// Anything else: ask the decoder.
    Decoder,
}

/// A tokenizer with the generation-related metadata of its model.
///
/// Build it with [`Tokenizer::from_gguf`] or [`Tokenizer::from_hf_dir`]; write it as a Hugging
/// Face tokenizer with [`Tokenizer::save_hf`].
#[derive(Clone)]
pub struct Tokenizer {
    /// Special-token text is parsed into special tokens (`parse_special == true`).
    inner: tokenizers::Tokenizer,
    /// The same tokenizer with `encode_special_tokens == true` (`parse_special == false`), built on
    /// first use.
    plain: OnceLock<tokenizers::Tokenizer>,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    pad_id: Option<u32>,
    unk_id: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    eos_ids: Vec<u32>,
    chat_template: Option<String>,
    piece_style: PieceStyle,
    /// Number of ids: one past the largest id of the model or the added vocabulary (cached:
    /// `tokenizers` recomputes it by building the whole vocabulary map).
    n_ids: usize,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos_id", &self.bos_id)
            .field("eos_id", &self.eos_id)
            .field("pad_id", &self.pad_id)
            .field("add_bos", &self.add_bos)
            .field("add_eos", &self.add_eos)
            .field("eos_ids", &self.eos_ids)
            .field("has_chat_template", &self.chat_template.is_some())
            .finish()
    }
}

fn tok_err(msg: impl std::fmt::Display) -> Error {
    Error::Tokenizer(msg.to_string())
}

fn meta_err(path: &Path, key: &str, msg: impl Into<String>) -> Error {
    Error::Metadata { path: path.to_path_buf(), key: key.to_string(), msg: msg.into() }
}

/// The GPT-2 `bytes_to_unicode` table, reversed: character -> byte.
fn byte_level_char_to_byte() -> &'static HashMap<char, u8> {
    static MAP: OnceLock<HashMap<char, u8>> = OnceLock::new();
    MAP.get_or_init(|| {
        let mut map = HashMap::with_capacity(256);
        let mut n = 0u32;
        for b in 0u32..256 {
            let printable = (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
            let c = if printable {
                b
            } else {
                n += 1;
                255 + n
            };
            if let (Some(ch), Ok(byte)) = (char::from_u32(c), u8::try_from(b)) {
                map.insert(ch, byte);
            }
        }
        map
    })
}

/// Optional GGUF token id: missing -> `default`; out of range -> `None` (llama.cpp warns and
/// keeps the default, which is itself disabled when out of range).
fn gguf_token_id(gguf: &GgufFile, key: &str, default: Option<u32>, n_vocab: usize) -> Option<u32> {
    let in_range = |id: u32| (id as usize) < n_vocab;
    let default = default.filter(|&id| in_range(id));
    match gguf.get(key).and_then(MetadataValue::as_u64) {
        Some(id) => match u32::try_from(id) {
            Ok(id) if in_range(id) => Some(id),
            _ => default,
        },
        None => default,
    }
}

impl Tokenizer {
    /// Builds the tokenizer of a GGUF file from its `tokenizer.ggml.*` metadata, reproducing
    /// llama.cpp's `llama_vocab` (see the module documentation).
    ///
    /// Special ids: `tokenizer.ggml.{bos,eos,padding,unknown}_token_id`, with llama.cpp's
    /// defaults when absent (BPE: BOS = EOS = 11; SentencePiece: BOS 1, EOS 2, UNK 0). `add_bos`:
    /// `tokenizer.ggml.add_bos_token`, defaulting as llama.cpp does (true for SentencePiece and the
    /// Llama 3 family of pre-tokenizers, false otherwise); `add_eos` likewise from
    /// `tokenizer.ggml.add_eos_token` (default false).
    ///
    /// # Errors
    /// [`Error::Metadata`] (naming the file and key) if a required key is missing or malformed,
    /// the tokenizer model or pre-tokenizer is not supported, or the vocabulary has duplicate
    /// tokens; [`Error::Tokenizer`] if the `tokenizers` crate rejects the result.
    pub fn from_gguf(gguf: &GgufFile) -> Result<Self> {
        let path = gguf.path();
        let model = gguf.get_str("tokenizer.ggml.model")?;
        let mut tokens: Vec<String> =
            gguf.get_str_array("tokenizer.ggml.tokens")?.into_iter().map(str::to_owned).collect();
        let n_vocab = tokens.len();
        if n_vocab == 0 {
            return Err(meta_err(path, "tokenizer.ggml.tokens", "empty vocabulary"));
        }
        if u32::try_from(n_vocab).is_err() {
            return Err(meta_err(path, "tokenizer.ggml.tokens", format!("{n_vocab} tokens is too many")));
        }
        // llama.cpp renames empty tokens so that every token has a distinct text.
        for (i, t) in tokens.iter_mut().enumerate() {
            if t.is_empty() {
                *t = format!("[EMPTY_{i}]");
            }
        }
        let mut vocab: HashMap<String, u32> = HashMap::with_capacity(n_vocab);
        for (i, t) in tokens.iter().enumerate() {
            let id = i as u32;
            if let Some(prev) = vocab.insert(t.clone(), id) {
                return Err(meta_err(
                    path,
                    "tokenizer.ggml.tokens",
                    format!("duplicate token {t:?} has ids {prev} and {id}"),
                ));
            }
        }

        let mut types: Vec<u64> = match gguf.get("tokenizer.ggml.token_type") {
            None => vec![1; n_vocab],
            Some(v) => {
                let arr =
                    v.as_array().ok_or_else(|| meta_err(path, "tokenizer.ggml.token_type", "expected an array"))?;
                if arr.len() < n_vocab {
                    return Err(meta_err(
                        path,
                        "tokenizer.ggml.token_type",
                        format!("{} entries for {n_vocab} tokens", arr.len()),
                    ));
                }
                arr[..n_vocab].iter().map(|v| v.as_u64().unwrap_or(0)).collect()
            }
        };

        let (is_spm, pre_spec) = match model {
            "gpt2" => {
                let pre = match gguf.get("tokenizer.ggml.pre") {
                    None => "default",
                    Some(v) => v.as_str().ok_or_else(|| meta_err(path, "tokenizer.ggml.pre", "expected a string"))?,
                };
                let spec = pre_tokenizer_spec(pre).ok_or_else(|| {
                    meta_err(
                        path,
                        "tokenizer.ggml.pre",
                        format!("unsupported pre-tokenizer `{pre}` (supported: {KNOWN_PRE})"),
                    )
                })?;
                (false, Some(spec))
            }
            "llama" => (true, None),
            other => {
                return Err(meta_err(
                    path,
                    "tokenizer.ggml.model",
                    format!("unsupported tokenizer model `{other}` (supported: gpt2, llama)"),
                ));
            }
        };

        // Special ids, with llama.cpp's defaults per vocabulary type.
        let (def_bos, def_eos, def_unk) = if is_spm { (Some(1), Some(2), Some(0)) } else { (Some(11), Some(11), None) };
        let bos_id = gguf_token_id(gguf, "tokenizer.ggml.bos_token_id", def_bos, n_vocab);
        let eos_id = gguf_token_id(gguf, "tokenizer.ggml.eos_token_id", def_eos, n_vocab);
        let unk_id = gguf_token_id(gguf, "tokenizer.ggml.unknown_token_id", def_unk, n_vocab);
        let pad_id = gguf_token_id(gguf, "tokenizer.ggml.padding_token_id", None, n_vocab);
        let mut eot_id = gguf_token_id(gguf, "tokenizer.ggml.eot_token_id", None, n_vocab);
        let eom_id = gguf_token_id(gguf, "tokenizer.ggml.eom_token_id", None, n_vocab);
        let mut fim_pad = gguf_token_id(gguf, "tokenizer.ggml.fim_pad_token_id", None, n_vocab);
        let mut fim_rep = gguf_token_id(gguf, "tokenizer.ggml.fim_rep_token_id", None, n_vocab);
        let mut fim_sep = gguf_token_id(gguf, "tokenizer.ggml.fim_sep_token_id", None, n_vocab);

        let default_add_bos = if is_spm { true } else { pre_spec.as_ref().is_some_and(|s| s.add_bos) };
        let add_bos =
            gguf.get("tokenizer.ggml.add_bos_token").and_then(MetadataValue::as_bool).unwrap_or(default_add_bos);
        let add_eos = gguf.get("tokenizer.ggml.add_eos_token").and_then(MetadataValue::as_bool).unwrap_or(false);
        if add_bos && bos_id.is_none() {
            return Err(meta_err(path, "tokenizer.ggml.add_bos_token", "is true, but there is no BOS token id"));
        }
        if add_eos && eos_id.is_none() {
            return Err(meta_err(path, "tokenizer.ggml.add_eos_token", "is true, but there is no EOS token id"));
        }

        // llama.cpp detects EOT/FIM/EOG tokens by their text and forces them to CONTROL.
        let find = |texts: &[&str]| texts.iter().filter_map(|t| vocab.get(*t).copied()).min();
        if eot_id.is_none() {
            eot_id = find(EOT_TEXTS);
        }
        if fim_pad.is_none() {
            fim_pad = find(FIM_PAD_TEXTS);
        }
        if fim_rep.is_none() {
            fim_rep = find(FIM_REP_TEXTS);
        }
        if fim_sep.is_none() {
            fim_sep = find(FIM_SEP_TEXTS);
        }
        let mut eog: BTreeSet<u32> = EOG_TEXTS.iter().filter_map(|t| vocab.get(*t).copied()).collect();
        eog.extend([fim_pad, fim_rep, fim_sep, eos_id, eot_id, eom_id].into_iter().flatten());
        let fim_other = FIM_OTHER_TEXTS.iter().filter_map(|t| vocab.get(*t).copied());
        for id in eog.iter().copied().chain(fim_other) {
            let ty = &mut types[id as usize];
            if *ty != token_type::CONTROL {
                *ty = token_type::CONTROL;
            }
        }
        let eos_ids: Vec<u32> = eog.into_iter().collect();

        let mut inner = if is_spm {
            Self::build_spm(gguf, &tokens, &vocab, unk_id)?
        } else {
            let spec = pre_spec.ok_or_else(|| tok_err("internal: missing pre-tokenizer"))?;
            Self::build_bpe(gguf, vocab, &spec)?
        };

        // Added tokens: CONTROL/UNKNOWN -> special, USER_DEFINED -> not special.
        let added: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter_map(|(t, &ty)| match ty {
                token_type::CONTROL | token_type::UNKNOWN => Some(AddedToken::from(t.clone(), true).normalized(false)),
                token_type::USER_DEFINED => Some(AddedToken::from(t.clone(), false).normalized(false)),
                _ => None,
            })
            .collect();
        inner.add_tokens(&added);

        let post = template_processor(&inner, bos_id.filter(|_| add_bos), eos_id.filter(|_| add_eos));
        inner.with_post_processor(post);

        let chat_template = match gguf.get("tokenizer.chat_template") {
            None => None,
            Some(v) => Some(
                v.as_str().ok_or_else(|| meta_err(path, "tokenizer.chat_template", "expected a string"))?.to_owned(),
            ),
        };

        Ok(Self {
            plain: OnceLock::new(),
            bos_id,
            eos_id,
            pad_id,
            unk_id,
            add_bos,
            add_eos,
            eos_ids,
            chat_template,
            piece_style: if is_spm { PieceStyle::SentencePiece } else { PieceStyle::ByteLevel },
            n_ids: count_ids(&inner),
            inner,
        })
    }

    /// Byte-level BPE (`tokenizer.ggml.model == "gpt2"`).
    fn build_bpe(
        gguf: &GgufFile,
        vocab: HashMap<String, u32>,
        spec: &PreTokenizerSpec,
    ) -> Result<tokenizers::Tokenizer> {
        let path = gguf.path();
        let merges_raw = gguf.get_str_array("tokenizer.ggml.merges")?;
        // llama.cpp splits each merge at the first space after the first byte and keeps the first
        // rank of a duplicated pair (`bpe_ranks.emplace`). Merges whose parts or result are not in
        // the vocabulary can never apply in llama.cpp; the `tokenizers` crate rejects them, so
        // they are dropped.
        let mut seen = HashSet::with_capacity(merges_raw.len());
        let mut merges = Vec::with_capacity(merges_raw.len());
        for (i, m) in merges_raw.iter().enumerate() {
            let Some(pos) = m.as_bytes().iter().skip(1).position(|&b| b == b' ').map(|p| p + 1) else {
                return Err(meta_err(path, "tokenizer.ggml.merges", format!("merge #{i} {m:?} has no space")));
            };
            let (a, b) = (&m[..pos], &m[pos + 1..]);
            if !vocab.contains_key(a) || !vocab.contains_key(b) || !vocab.contains_key(&format!("{a}{b}")) {
                continue;
            }
            if seen.insert((a, b)) {
                merges.push((a.to_owned(), b.to_owned()));
            }
        }
        let vocab: tokenizers::models::bpe::Vocab = vocab.into_iter().collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .ignore_merges(spec.ignore_merges)
            .build()
            .map_err(|e| tok_err(format!("{}: building BPE model: {e}", path.display())))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);

        let mut pre: Vec<PreTokenizerWrapper> = Vec::with_capacity(spec.regexes.len() + 1);
        for re in spec.regexes {
            let split = Split::new(SplitPattern::Regex((*re).to_owned()), SplitDelimiterBehavior::Isolated, false)
                .map_err(|e| tok_err(format!("pre-tokenizer regex {re:?}: {e}")))?;
            pre.push(split.into());
        }
        pre.push(ByteLevel::new(false, false, false).into());
        inner.with_pre_tokenizer(Some(PreTokenizerSequence::new(pre)));
        inner.with_decoder(Some(ByteLevel::new(false, false, false)));
        Ok(inner)
    }

    /// SentencePiece BPE (`tokenizer.ggml.model == "llama"`), expressed the way transformers'
    /// `LlamaConverter` expresses it: BPE with byte fallback, merges ranked by the score of the
    /// merged piece (`SentencePieceExtractor.extract`), normalizer `Prepend("▁")` +
    /// `Replace(" ", "▁")` (llama.cpp `add_space_prefix` + `llama_escape_whitespace`).
    fn build_spm(
        gguf: &GgufFile,
        tokens: &[String],
        vocab: &HashMap<String, u32>,
        unk_id: Option<u32>,
    ) -> Result<tokenizers::Tokenizer> {
        let path = gguf.path();
        let scores: Vec<f64> = match gguf.get("tokenizer.ggml.scores") {
            None => vec![0.0; tokens.len()],
            Some(v) => {
                let arr = v.as_array().ok_or_else(|| meta_err(path, "tokenizer.ggml.scores", "expected an array"))?;
                if arr.len() < tokens.len() {
                    return Err(meta_err(
                        path,
                        "tokenizer.ggml.scores",
                        format!("{} entries for {} tokens", arr.len(), tokens.len()),
                    ));
                }
                arr[..tokens.len()].iter().map(|v| v.as_f64().unwrap_or(0.0)).collect()
            }
        };
        // For every piece, every split into two vocabulary pieces, ordered by the ids of the two
        // halves; then all merges stably sorted by the piece's score, highest first.
        let mut merges: Vec<(u32, u32, f64)> = Vec::new();
        for (id, piece) in tokens.iter().enumerate() {
            let mut local: Vec<(u32, u32)> = piece
                .char_indices()
                .skip(1)
                .filter_map(|(i, _)| Some((*vocab.get(&piece[..i])?, *vocab.get(&piece[i..])?)))
                .collect();
            local.sort_unstable();
            merges.extend(local.into_iter().map(|(l, r)| (l, r, scores[id])));
        }
        merges.sort_by(|a, b| b.2.total_cmp(&a.2));
        let merges: Vec<(String, String)> =
            merges.into_iter().map(|(l, r, _)| (tokens[l as usize].clone(), tokens[r as usize].clone())).collect();

        let vocab: tokenizers::models::bpe::Vocab = vocab.iter().map(|(k, v)| (k.clone(), *v)).collect();
        let mut builder = BPE::builder().vocab_and_merges(vocab, merges).byte_fallback(true).fuse_unk(true);
        if let Some(unk) = unk_id {
            builder = builder.unk_token(tokens[unk as usize].clone());
        }
        let bpe = builder.build().map_err(|e| tok_err(format!("{}: building BPE model: {e}", path.display())))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);

        let add_space_prefix =
            gguf.get("tokenizer.ggml.add_space_prefix").and_then(MetadataValue::as_bool).unwrap_or(true);
        let replace = Replace::new(" ", "▁").map_err(tok_err)?;
        let mut norm: Vec<NormalizerWrapper> = Vec::new();
        if add_space_prefix {
            norm.push(Prepend::new("▁".to_owned()).into());
        }
        norm.push(replace.into());
        inner.with_normalizer(Some(NormalizerSequence::new(norm)));
        let mut dec: Vec<DecoderWrapper> =
            vec![Replace::new("▁", " ").map_err(tok_err)?.into(), ByteFallback::new().into(), Fuse::new().into()];
        if add_space_prefix {
            dec.push(Strip::new(' ', 1, 0).into());
        }
        inner.with_decoder(Some(DecoderSequence::new(dec)));
        Ok(inner)
    }

    /// Loads a Hugging Face tokenizer directory: `tokenizer.json` (required),
    /// `tokenizer_config.json` (optional: `chat_template`, `bos_token`, `eos_token`,
    /// `pad_token`, `unk_token`, `add_bos_token`, `add_eos_token`), `chat_template.jinja` or
    /// `chat_template.json` (optional, newer transformers), `generation_config.json` (optional:
    /// `eos_token_id`, `bos_token_id`, `pad_token_id`).
    ///
    /// When `add_bos_token` is absent, BOS is added iff `tokenizer.json`'s post-processor adds it
    /// (what transformers' fast tokenizers do). The EOS set is described in the module
    /// documentation.
    ///
    /// # Errors
    /// [`Error::Io`] for unreadable files, [`Error::Invalid`] for malformed JSON (naming the file),
    /// [`Error::Tokenizer`] if `tokenizers` rejects `tokenizer.json`.
    pub fn from_hf_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let tok_path = dir.join("tokenizer.json");
        let bytes = std::fs::read(&tok_path).map_err(|e| Error::io(&tok_path, e))?;
        // JSON first: `tokenizers` 0.22 panics (`expect("Helper")` in its decoder
        // deserializer) when the `decoder` value is not valid JSON: a syntax error, or a string
        // escape that is not a Unicode scalar such as a lone surrogate (both found by fuzzing).
        // Parsing the whole file into a `Value` rejects both (`IgnoredAny` does not check
        // escapes).
        serde_json::from_slice::<serde_json::Value>(&bytes).map_err(|e| Error::Invalid { path: tok_path.clone(), format: "JSON", msg: e.to_string() })?;
        let inner =
            tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| tok_err(format!("{}: {e}", tok_path.display())))?;

        let config = read_json_opt(&dir.join("tokenizer_config.json"))?;
        let gen_config = read_json_opt(&dir.join("generation_config.json"))?;
        let cfg = |k: &str| config.as_ref().and_then(|c| c.get(k));
        let gcfg = |k: &str| gen_config.as_ref().and_then(|c| c.get(k));

        let token_id = |key: &str, gen_key: &str| -> Option<u32> {
            cfg(key)
                .and_then(token_content)
                .and_then(|t| inner.token_to_id(&t))
                .or_else(|| gcfg(gen_key).and_then(first_id))
        };
        let bos_id = token_id("bos_token", "bos_token_id");
        let eos_id = token_id("eos_token", "eos_token_id");
        let pad_id = token_id("pad_token", "pad_token_id");
        let unk_id = cfg("unk_token").and_then(token_content).and_then(|t| inner.token_to_id(&t));

        let (post_bos, post_eos) = post_processor_adds(&inner, bos_id, eos_id);
        let add_bos = cfg("add_bos_token").and_then(serde_json::Value::as_bool).unwrap_or(post_bos);
        let add_eos = cfg("add_eos_token").and_then(serde_json::Value::as_bool).unwrap_or(post_eos);

        let mut chat_template = match cfg("chat_template") {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            // A list of named templates: use "default" (transformers' choice without a name).
            Some(serde_json::Value::Array(list)) => list.iter().find_map(|t| {
                (t.get("name")?.as_str()? == "default").then(|| t.get("template")?.as_str().map(str::to_owned))?
            }),
            _ => None,
        };
        if chat_template.is_none() {
            let jinja = dir.join("chat_template.jinja");
            if jinja.is_file() {
                chat_template = Some(std::fs::read_to_string(&jinja).map_err(|e| Error::io(&jinja, e))?);
            } else if let Some(v) = read_json_opt(&dir.join("chat_template.json"))? {
                chat_template = v.get("chat_template").and_then(|s| s.as_str()).map(str::to_owned);
            }
        }

        // EOS set: EOS, generation_config's eos ids, and llama.cpp's text-based EOG rule.
        let mut eog: BTreeSet<u32> = BTreeSet::new();
        eog.extend(eos_id);
        if let Some(v) = gcfg("eos_token_id") {
            match v {
                serde_json::Value::Array(a) => eog.extend(a.iter().filter_map(json_u32)),
                other => eog.extend(json_u32(other)),
            }
        }
        let vocab_lookup = |t: &&str| inner.token_to_id(t);
        eog.extend(EOG_TEXTS.iter().filter_map(vocab_lookup));
        eog.extend(EOT_TEXTS.iter().filter_map(vocab_lookup));
        for texts in [FIM_PAD_TEXTS, FIM_REP_TEXTS, FIM_SEP_TEXTS] {
            eog.extend(texts.iter().filter_map(vocab_lookup).min());
        }

        let piece_style = detect_piece_style(&inner);
        Ok(Self {
            n_ids: count_ids(&inner),
            inner,
            plain: OnceLock::new(),
            bos_id,
            eos_id,
            pad_id,
            unk_id,
            add_bos,
            add_eos,
            eos_ids: eog.into_iter().collect(),
            chat_template,
            piece_style,
        })
    }

    /// Writes `tokenizer.json` and `tokenizer_config.json` (with `chat_template`, `bos_token`,
    /// `eos_token`, `pad_token`, `unk_token`, `add_bos_token`, `add_eos_token`) into `dir`,
    /// creating it if needed. Each file is written to a temporary file in `dir` and renamed, so a
    /// reader never sees a half-written file.
    ///
    /// The EOS set is not written; [`Tokenizer::eos_token_ids`] is what belongs in
    /// `generation_config.json`'s `eos_token_id`.
    ///
    /// # Errors
    /// [`Error::Io`] naming the file; [`Error::Tokenizer`] if serialization fails.
    pub fn save_hf(&self, dir: impl AsRef<Path>) -> Result<()> {
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let json = self.inner.to_string(true).map_err(|e| tok_err(format!("serializing tokenizer.json: {e}")))?;
        write_atomic(&dir.join("tokenizer.json"), json.as_bytes())?;

        let text = |id: Option<u32>| -> serde_json::Value {
            id.and_then(|id| self.inner.id_to_token(id)).map_or(serde_json::Value::Null, serde_json::Value::String)
        };
        let mut config = serde_json::Map::new();
        config.insert("add_bos_token".into(), self.add_bos.into());
        config.insert("add_eos_token".into(), self.add_eos.into());
        config.insert("bos_token".into(), text(self.bos_id));
        config.insert("eos_token".into(), text(self.eos_id));
        config.insert("pad_token".into(), text(self.pad_id));
        config.insert("unk_token".into(), text(self.unk_id));
        config.insert("clean_up_tokenization_spaces".into(), false.into());
        config.insert("model_max_length".into(), serde_json::Value::from(1_000_000_000_000_000_000u64));
        config.insert("tokenizer_class".into(), "PreTrainedTokenizerFast".into());
        if let Some(t) = &self.chat_template {
            config.insert("chat_template".into(), t.clone().into());
        }
        let config = serde_json::to_string_pretty(&serde_json::Value::Object(config))
            .map_err(|e| tok_err(format!("serializing tokenizer_config.json: {e}")))?;
        write_atomic(&dir.join("tokenizer_config.json"), config.as_bytes())
    }

    /// Encodes `text`, adding BOS/EOS as the model asks ([`Tokenizer::add_bos`],
    /// [`Tokenizer::add_eos`]). With `parse_special == false`, the text of control tokens (e.g.
    /// `<|im_start|>`) is tokenized as plain text, as llama.cpp's `parse_special = false`;
    /// user-defined tokens are matched either way.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] if the `tokenizers` crate fails.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>> {
        self.encode_with(text, true, parse_special)
    }

    /// Encodes `text` like llama.cpp's `llama_tokenize(text, add_special, parse_special)`:
    /// `add_special` adds BOS/EOS when the model asks for them.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] if the `tokenizers` crate fails.
    pub fn encode_with(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<u32>> {
        let tok = if parse_special { &self.inner } else { self.plain() };
        let enc = tok.encode_fast(text, false).map_err(|e| tok_err(format!("encoding: {e}")))?;
        let ids = enc.get_ids();
        let mut out = Vec::with_capacity(ids.len() + 2);
        if add_special && self.add_bos {
            out.extend(self.bos_id);
        }
        out.extend_from_slice(ids);
        if add_special && self.add_eos {
            out.extend(self.eos_id);
        }
        Ok(out)
    }

    fn plain(&self) -> &tokenizers::Tokenizer {
        self.plain.get_or_init(|| {
            let mut t = self.inner.clone();
            t.set_encode_special_tokens(true);
            t
        })
    }

    /// Decodes ids to text (invalid UTF-8 becomes U+FFFD). With `skip_special`, special tokens
    /// (control tokens from GGUF, `special` added tokens from `tokenizer.json`) produce no text.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] if an id is outside the vocabulary or decoding fails.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        let n = self.vocab_size();
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= n) {
            return Err(tok_err(format!("token id {bad} is outside the vocabulary (size {n})")));
        }
        self.inner.decode(ids, skip_special).map_err(|e| tok_err(format!("decoding: {e}")))
    }

    /// The bytes a token stands for (llama.cpp `llama_token_to_piece` with `special = true`):
    /// the byte-level or SentencePiece decoding of a normal token, the raw text of an added
    /// token. Bytes, not a `String`, since one token can hold part of a UTF-8 character.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] if `id` is outside the vocabulary.
    pub fn token_to_piece(&self, id: u32) -> Result<Vec<u8>> {
        let text = self
            .inner
            .id_to_token(id)
            .ok_or_else(|| tok_err(format!("token id {id} is outside the vocabulary (size {})", self.vocab_size())))?;
        if self.inner.get_added_vocabulary().simple_id_to_token(id).is_some() {
            return Ok(text.into_bytes());
        }
        Ok(match self.piece_style {
            PieceStyle::ByteLevel => {
                let map = byte_level_char_to_byte();
                text.chars()
                    .map(|c| map.get(&c).copied())
                    .collect::<Option<Vec<u8>>>()
                    .unwrap_or_else(|| text.into_bytes())
            }
            PieceStyle::SentencePiece => {
                if text.len() == 6
                    && text.starts_with("<0x")
                    && text.ends_with('>')
                    && let Some(Ok(byte)) = text.get(3..5).map(|h| u8::from_str_radix(h, 16))
                {
                    return Ok(vec![byte]);
                }
                text.replace('▁', " ").into_bytes()
            }
            PieceStyle::Decoder => self.inner.decode(&[id], false).map_err(tok_err)?.into_bytes(),
        })
    }

    /// The vocabulary string of a token (e.g. `Ġthe`), if `id` is in the vocabulary.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The id of a vocabulary string, if any.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Number of token ids (the model vocabulary plus added tokens beyond it).
    pub fn vocab_size(&self) -> usize {
        self.n_ids
    }

    /// Whether `id` ends generation (see the module documentation for the set).
    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_ids.binary_search(&id).is_ok()
    }

    /// All end-of-generation ids, sorted.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// The BOS id, if the model has one.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// The EOS id, if the model has one.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_id
    }

    /// The padding id, if the model has one.
    pub fn pad_token_id(&self) -> Option<u32> {
        self.pad_id
    }

    /// The BOS token text (for chat templates).
    pub fn bos_token(&self) -> Option<String> {
        self.bos_id.and_then(|id| self.inner.id_to_token(id))
    }

    /// The EOS token text (for chat templates).
    pub fn eos_token(&self) -> Option<String> {
        self.eos_id.and_then(|id| self.inner.id_to_token(id))
    }

    /// Whether [`Tokenizer::encode`] prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Whether [`Tokenizer::encode`] appends EOS.
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }

    /// The model's Jinja chat template, if it has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// The wrapped `tokenizers` tokenizer (special-token text parsed as special tokens).
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// A streaming decoder over this tokenizer (see [`StreamDecoder`]).
    pub fn stream_decoder(&self, skip_special: bool) -> StreamDecoder<'_> {
        StreamDecoder { tokenizer: self, skip_special, ids: Vec::new(), prefix: String::new(), prefix_index: 0 }
    }
}

/// Incremental detokenization for streaming generation.
///
/// Feed ids one at a time with [`StreamDecoder::step`]; each call returns the text that became
/// complete. Bytes of a multi-byte character split across tokens are held back until the
/// character is complete; [`StreamDecoder::flush`] returns whatever is still held at the end.
/// The concatenation of all returned pieces equals [`Tokenizer::decode`] of all ids.
///
/// The algorithm is that of `tokenizers`' `DecodeStream` (decode a short window of ids, emit
/// the part after the previously decoded prefix, hold while the window ends in U+FFFD), plus
/// `flush`.
#[derive(Debug)]
pub struct StreamDecoder<'a> {
    tokenizer: &'a Tokenizer,
    skip_special: bool,
    ids: Vec<u32>,
    prefix: String,
    prefix_index: usize,
}

impl StreamDecoder<'_> {
    /// Adds one id; returns the newly completed text (possibly empty).
    ///
    /// # Errors
    /// [`Error::Tokenizer`] if `id` is outside the vocabulary or decoding fails.
    pub fn step(&mut self, id: u32) -> Result<String> {
        if self.prefix.is_empty() && !self.ids.is_empty() {
            let new_prefix = self.tokenizer.decode(&self.ids, self.skip_special)?;
            if !new_prefix.ends_with('\u{FFFD}') {
                self.prefix = new_prefix;
                self.prefix_index = self.ids.len();
            }
        }
        self.ids.push(id);
        let text = match self.tokenizer.decode(&self.ids, self.skip_special) {
            Ok(t) => t,
            Err(e) => {
                self.ids.pop();
                return Err(e);
            }
        };
        if text.len() > self.prefix.len() && !text.ends_with('\u{FFFD}') {
            let Some(new_text) = text.strip_prefix(self.prefix.as_str()) else {
                return Err(tok_err(format!(
                    "stream decoding: text {text:?} does not extend the previous text {:?}",
                    self.prefix
                )));
            };
            let new_text = new_text.to_owned();
            let new_prefix_index = self.ids.len() - self.prefix_index;
            self.ids.drain(..self.prefix_index);
            self.prefix = self.tokenizer.decode(&self.ids, self.skip_special)?;
            self.prefix_index = new_prefix_index;
            Ok(new_text)
        } else {
            Ok(String::new())
        }
    }

    /// Returns the text still held back (an incomplete character decodes to U+FFFD) and resets.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] if decoding fails.
    pub fn flush(&mut self) -> Result<String> {
        let text = self.tokenizer.decode(&self.ids, self.skip_special)?;
        let rest = text.strip_prefix(self.prefix.as_str()).map_or(text.clone(), str::to_owned);
        let rest = if text.len() > self.prefix.len() { rest } else { String::new() };
        self.ids.clear();
        self.prefix.clear();
        self.prefix_index = 0;
        Ok(rest)
    }
}

/// A post-processor adding BOS/EOS the way transformers' Llama fast tokenizer does, so that
/// Hugging Face users of a saved `tokenizer.json` get the same ids.
fn template_processor(
    inner: &tokenizers::Tokenizer,
    bos: Option<u32>,
    eos: Option<u32>,
) -> Option<PostProcessorWrapper> {
    if bos.is_none() && eos.is_none() {
        return None;
    }
    let mut specials = Vec::new();
    let mut single = Vec::new();
    let mut pair = Vec::new();
    let bos_text = bos.and_then(|id| inner.id_to_token(id).map(|t| (t, id)));
    let eos_text = eos.and_then(|id| inner.id_to_token(id).map(|t| (t, id)));
    // Template pieces starting with `$` would be read as sequences, and whitespace separates
    // pieces: such token texts cannot be expressed; skip the post-processor then.
    for (t, _) in bos_text.iter().chain(eos_text.iter()) {
        if t.starts_with('$') || t.contains(char::is_whitespace) {
            return None;
        }
    }
    if let Some((t, id)) = &bos_text {
        specials.push((t.clone(), *id));
        single.push(t.clone());
        pair.push(t.clone());
    }
    single.push("$A".to_owned());
    pair.push("$A".to_owned());
    if let Some((t, _)) = &eos_text {
        single.push(t.clone());
        pair.push(t.clone());
    }
    if let Some((t, _)) = &bos_text {
        pair.push(format!("{t}:1"));
    }
    pair.push("$B:1".to_owned());
    if let Some((t, id)) = &eos_text {
        pair.push(format!("{t}:1"));
        if !specials.iter().any(|(s, _)| s == t) {
            specials.push((t.clone(), *id));
        }
    }
    let tp = TemplateProcessing::builder()
        .try_single(single.join(" "))
        .ok()?
        .try_pair(pair.join(" "))
        .ok()?
        .special_tokens(specials)
        .build()
        .ok()?;
    Some(tp.into())
}

/// One past the largest token id of the model and the added vocabulary.
fn count_ids(inner: &tokenizers::Tokenizer) -> usize {
    let added = inner.get_added_vocabulary().get_vocab().values().map(|&id| id as usize + 1).max().unwrap_or(0);
    added.max(inner.get_vocab_size(false))
}

/// Whether `tokenizer.json`'s post-processor adds BOS at the start / EOS at the end.
fn post_processor_adds(inner: &tokenizers::Tokenizer, bos: Option<u32>, eos: Option<u32>) -> (bool, bool) {
    if inner.get_post_processor().is_none() {
        return (false, false);
    }
    let (Ok(with), Ok(without)) = (inner.encode_fast("a", true), inner.encode_fast("a", false)) else {
        return (false, false);
    };
    let (with, without) = (with.get_ids(), without.get_ids());
    if with.len() <= without.len() {
        return (false, false);
    }
    let adds_bos = bos.is_some_and(|b| with.first() == Some(&b) && without.first() != Some(&b));
    let adds_eos = eos.is_some_and(|e| with.last() == Some(&e) && without.last() != Some(&e));
    (adds_bos, adds_eos)
}

fn detect_piece_style(inner: &tokenizers::Tokenizer) -> PieceStyle {
    fn style(d: &DecoderWrapper) -> Option<PieceStyle> {
        match d {
            DecoderWrapper::ByteLevel(_) => Some(PieceStyle::ByteLevel),
            DecoderWrapper::ByteFallback(_) => Some(PieceStyle::SentencePiece),
            _ => None,
        }
    }
    match inner.get_decoder() {
        Some(DecoderWrapper::Sequence(seq)) => {
            // `Sequence` does not expose its decoders; go through its serialized form.
            let json = serde_json::to_value(seq).ok();
            let types: Vec<String> = json
                .as_ref()
                .and_then(|v| v.get("decoders"))
                .and_then(|d| d.as_array())
                .map(|a| a.iter().filter_map(|d| d.get("type")?.as_str().map(str::to_owned)).collect())
                .unwrap_or_default();
            if types.iter().any(|t| t == "ByteLevel") {
                PieceStyle::ByteLevel
            } else if types.iter().any(|t| t == "ByteFallback") {
                PieceStyle::SentencePiece
            } else {
                PieceStyle::Decoder
            }
        }
        Some(d) => style(d).unwrap_or(PieceStyle::Decoder),
        None => PieceStyle::Decoder,
    }
}

/// A token in `tokenizer_config.json`: a string or an `AddedToken` object with `content`.
fn token_content(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

fn json_u32(v: &serde_json::Value) -> Option<u32> {
    v.as_u64().and_then(|x| u32::try_from(x).ok())
}

/// An id or the first of a list of ids.
fn first_id(v: &serde_json::Value) -> Option<u32> {
    match v {
        serde_json::Value::Array(a) => a.first().and_then(json_u32),
        other => json_u32(other),
    }
}

fn read_json_opt(path: &Path) -> Result<Option<serde_json::Value>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map(Some).map_err(|e| Error::Invalid {
        path: path.to_path_buf(),
        format: "JSON",
        msg: e.to_string(),
    })
}

/// Writes `bytes` to `path` crash-safely ([`crate::atomic::write_file`]).
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    crate::atomic::write_file(path, bytes).map_err(|e| Error::io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_table_is_a_bijection() {
        let map = byte_level_char_to_byte();
        assert_eq!(map.len(), 256);
        assert_eq!(map.get(&'Ġ'), Some(&b' '));
        assert_eq!(map.get(&'Ċ'), Some(&b'\n'));
        assert_eq!(map.get(&'a'), Some(&b'a'));
        let bytes: HashSet<u8> = map.values().copied().collect();
        assert_eq!(bytes.len(), 256);
    }

    #[test]
    fn every_known_pre_tokenizer_regex_compiles() {
        for pre in [
            "default",
            "llama-bpe",
            "dbrx",
            "falcon",
            "starcoder",
            "smollm",
            "gpt-2",
            "qwen2",
            "deepseek-coder",
            "deepseek-llm",
            "qwen35",
            "tekken",
            "gpt-4o",
            "poro-chat",
            "chatglm-bpe",
        ] {
            let spec = pre_tokenizer_spec(pre).expect("known");
            for re in spec.regexes {
                assert!(
                    Split::new(SplitPattern::Regex((*re).to_owned()), SplitDelimiterBehavior::Isolated, false).is_ok(),
                    "{pre}: {re}"
                );
            }
        }
        assert!(pre_tokenizer_spec("no-such-pre").is_none());
    }
}
