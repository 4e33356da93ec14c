//! The generation budget shared by the strategies.

use deco_decoding::SamplingParams;

use crate::error::{GenerateError, Result};

/// Default `max_new_tokens` when the request gives none (Hugging Face's default `max_length`).
pub const DEFAULT_MAX_NEW_TOKENS: usize = deco_decoding::HF_DEFAULT_MAX_LENGTH;

/// Checks the prompt against the model and returns how many tokens may be generated:
/// `min(max_new_tokens, max_context - prompt_len)`.
pub(crate) fn budget(max_context: usize, prompt: &[u32], params: &SamplingParams) -> Result<usize> {
    if prompt.is_empty() {
        return Err(GenerateError::InvalidInput("the prompt is empty".into()));
    }
    if prompt.len() >= max_context {
        return Err(GenerateError::InvalidInput(format!(
            "the prompt has {} tokens; the model's context is {max_context}",
            prompt.len()
        )));
    }
    let max_new = params.max_new_tokens.unwrap_or(DEFAULT_MAX_NEW_TOKENS);
    Ok(max_new.min(max_context - prompt.len()))
}
