//! Model file formats for deco.
//!
//! - [`gguf`]: the GGUF container (v2 and v3) of llama.cpp: metadata, tensor table, memory-mapped data.
//! - [`ggml`]: GGML tensor types and their block dequantization (F32 ... Q6_K).
//! - [`config`]: model hyper-parameters in Hugging Face terms, from GGUF metadata or `config.json`.
//! - [`checkpoint`]: tensors under transformers names from a GGUF file or a safetensors directory.
//! - [`hf_export`]: writing a Hugging Face directory (`deco convert`).
//! - [`quantized`]: GPTQ / AWQ / compressed-tensors packed linears (pack, unpack, dequantize on load).
//! - [`tokenizer`]: tokenizers built from GGUF metadata or loaded from `tokenizer.json`.
//! - [`chat_template`]: Hugging Face Jinja chat templates rendered with minijinja.
//! - [`atomic`]: crash-safe writes of output files and directories (temporary, fsync, rename).
//!
//! Errors are reported through [`Error`]; every error that concerns a file names it.

pub mod atomic;
pub mod chat_template;
pub mod checkpoint;
pub mod config;
pub mod error;
pub mod ggml;
pub mod gguf;
pub mod hf_export;
pub mod quantized;
pub mod tokenizer;

pub use error::{Error, Result};
