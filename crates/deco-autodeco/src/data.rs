//! Training data for the heads: chat-formatted question/answer pairs with the loss on the answer
//! tokens, and the frozen base model's final hidden states on them.
//!
//! The base is frozen, so its hidden states are computed once per token ([`collect_tokens`]) and
//! the heads train on them; the logits are recomputed per batch through the LM head
//! (`[n, H] · [H, V]`), since full logits for every token do not fit in memory
//! (`tokens × 49,152 × 4` bytes).

use std::path::Path;

use deco_formats::chat_template::{ChatMessage, ChatTemplate};
use deco_formats::tokenizer::Tokenizer;
use deco_model::host::to_host;
use deco_model::{DenseKvCache, Llama, LogitsWanted, SeqInput};
use serde::Deserialize;

use crate::error::{Error, Result, io_err};

/// One line of `gsm_train.jsonl` / `gsm_eval.jsonl`.
#[derive(Debug, Clone, Deserialize)]
pub struct GsmItem {
    /// The problem.
    pub question: String,
    /// The worked answer, ending in `#### N`.
    pub answer: String,
    /// The final number `N` (as text).
    #[serde(default)]
    pub r#final: Option<String>,
}

/// Reads a JSONL file of [`GsmItem`]s.
///
/// # Errors
/// [`Error::Io`] if unreadable, [`Error::Data`] naming the line for invalid JSON.
pub fn read_gsm_jsonl(path: &Path) -> Result<Vec<GsmItem>> {
    let text = std::fs::read_to_string(path).map_err(io_err(path))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| serde_json::from_str(l).map_err(|e| Error::Data(format!("{}:{}: {e}", path.display(), i + 1))))
        .collect()
}

/// Removes GSM8K's calculator annotations `<<expr=value>>` from a worked answer.
pub fn strip_calculator(answer: &str) -> String {
    let mut out = String::with_capacity(answer.len());
    let mut rest = answer;
    while let Some(start) = rest.find("<<") {
        out.push_str(&rest[..start]);
        match rest[start..].find(">>") {
            Some(end) => rest = &rest[start + end + 2..],
            None => {
                rest = &rest[start..];
                break;
            }
        }
    }
    out.push_str(rest);
    out
}

/// A tokenized chat example: the rendered prompt (user turn + generation prompt) and the answer
/// tokens that follow it (the assistant's text and the template's end-of-turn).
#[derive(Debug, Clone, PartialEq)]
pub struct ChatExample {
    /// Prompt ids.
    pub prompt: Vec<u32>,
    /// Answer ids (the loss positions).
    pub answer: Vec<u32>,
}

/// Renders `question` as a user turn with the model's chat template and returns the prompt text
/// (generation prompt added), as `deco generate --chat` does.
///
/// # Errors
/// Template errors.
pub fn chat_prompt(tok: &Tokenizer, template: &ChatTemplate, system: Option<&str>, question: &str) -> Result<String> {
    let mut messages = Vec::new();
    if let Some(s) = system {
        messages.push(ChatMessage::new("system", s));
    }
    messages.push(ChatMessage::new("user", question));
    Ok(template.render(&messages, true, &tok.bos_token().unwrap_or_default(), &tok.eos_token().unwrap_or_default())?)
}

/// Tokenizes a question/answer pair: the full conversation is rendered and tokenized, and the
/// answer ids are what follows the prompt's ids.
///
/// # Errors
/// Template / tokenizer errors; [`Error::Data`] if the full conversation does not start with the
/// prompt's tokens (a template that rewrites earlier turns).
pub fn chat_example(tok: &Tokenizer, template: &ChatTemplate, question: &str, answer: &str) -> Result<ChatExample> {
    let bos = tok.bos_token().unwrap_or_default();
    let eos = tok.eos_token().unwrap_or_default();
    let prompt_text = chat_prompt(tok, template, None, question)?;
    let full_text = template.render(
        &[ChatMessage::new("user", question), ChatMessage::new("assistant", answer)],
        false,
        &bos,
        &eos,
    )?;
    let prompt = tok.encode(&prompt_text, true)?;
    let full = tok.encode(&full_text, true)?;
    if full.len() <= prompt.len() || full[..prompt.len()] != prompt[..] {
        return Err(Error::Data("the rendered conversation does not extend the rendered prompt".into()));
    }
    // Drop a trailing newline after the end-of-turn token: it is not predicted at generation.
    let mut answer_ids = full[prompt.len()..].to_vec();
    if let Some(eot) = answer_ids.iter().rposition(|&t| tok.is_eos(t)) {
        answer_ids.truncate(eot + 1);
    }
    Ok(ChatExample { prompt, answer: answer_ids })
}

/// Per-token training inputs computed once with the frozen base.
#[derive(Debug, Clone, Default)]
pub struct TokenPool {
    /// Hidden size `H`.
    pub hidden_size: usize,
    /// `[n, H]` final hidden states (after the last norm) at the positions that predict the labels.
    pub hidden: Vec<f32>,
    /// `[n]` the next token (label).
    pub labels: Vec<u32>,
    /// `[n]` the base's argmax at that position.
    pub argmax: Vec<u32>,
    /// `[n]` index of the example each position comes from.
    pub example: Vec<u32>,
}

impl TokenPool {
    /// Number of positions.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Fraction of positions where the base's argmax is the label.
    pub fn argmax_accuracy(&self) -> f64 {
        self.argmax.iter().zip(&self.labels).filter(|(a, b)| a == b).count() as f64 / self.len().max(1) as f64
    }
}

/// Runs the frozen base over each example (prompt + answer, one forward each) and keeps, for
/// every answer token, the hidden state of the position that predicts it, the label and the
/// base's argmax. Examples longer than the model's context are skipped. `progress` is called
/// after each example with `(done, total)`.
///
/// # Errors
/// Model errors; [`Error::Data`] if no example yields a position.
pub fn collect_tokens(model: &Llama, examples: &[ChatExample], progress: &mut dyn FnMut(usize, usize)) -> Result<TokenPool> {
    let h = model.config.hidden_size;
    let vocab = model.config.vocab_size;
    let mut pool = TokenPool { hidden_size: h, ..Default::default() };
    for (ei, ex) in examples.iter().enumerate() {
        let ids: Vec<u32> = ex.prompt.iter().chain(&ex.answer).copied().collect();
        if ids.len() > model.max_context() || ex.answer.is_empty() {
            progress(ei + 1, examples.len());
            continue;
        }
        let mut cache = DenseKvCache::new(model.num_layers());
        let out = model.forward(&[SeqInput { seq: 0, tokens: &ids, tree: None }], &mut cache, LogitsWanted::All)?;
        let first = ex.prompt.len() - 1; // position predicting answer[0]
        let rows = ex.answer.len();
        let hid = to_host(out.hidden.slice([first..first + rows, 0..h]))?;
        let logits = to_host(out.logits.slice([first..first + rows, 0..vocab]))?;
        pool.hidden.extend_from_slice(&hid);
        for (r, &y) in ex.answer.iter().enumerate() {
            let row = &logits[r * vocab..(r + 1) * vocab];
            let am = row.iter().enumerate().fold((0usize, f32::NEG_INFINITY), |b, (i, &v)| if v > b.1 { (i, v) } else { b }).0;
            pool.labels.push(y);
            pool.argmax.push(am as u32);
            pool.example.push(ei as u32);
        }
        progress(ei + 1, examples.len());
    }
    if pool.is_empty() {
        return Err(Error::Data("no answer tokens in the training examples".into()));
    }
    Ok(pool)
}
