//! Key/value caches for incremental decoding.

use std::collections::HashMap;

use burn::tensor::Tensor;

use crate::{Error, Result};

/// Identifies one sequence in a batch (a request, a beam, a sample).
pub type SeqId = u64;

/// Storage of the attention keys and values of every layer for a set of sequences.
///
/// The model calls, for each forward over a sequence with `n` new tokens: [`KvCache::append`] once
/// per layer (in layer order), then [`KvCache::advance`] once. A paged implementation (PagedAttention,
/// Kwon et al. 2023) maps the same calls onto fixed-size blocks.
pub trait KvCache {
    /// Number of tokens of `seq` already cached (0 for an unknown sequence).
    fn seq_len(&self, seq: SeqId) -> usize;

    /// Stores the new keys and values of `seq` at `layer` and returns all of them, cached ones
    /// first.
    ///
    /// # Shapes
    /// - `k`, `v`: `[new_tokens, kv_heads, head_dim]`
    /// - returned: `[seq_len(seq) + new_tokens, kv_heads, head_dim]` each
    fn append(&mut self, layer: usize, seq: SeqId, k: Tensor<3>, v: Tensor<3>) -> Result<(Tensor<3>, Tensor<3>)>;

    /// Marks `n` appended tokens of `seq` as committed (after the last layer).
    fn advance(&mut self, seq: SeqId, n: usize);

    /// Drops cached positions `len..` of `seq` (speculative decoding rollback).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] if `len` exceeds the cached length.
    fn truncate(&mut self, seq: SeqId, len: usize) -> Result<()>;

    /// Frees everything cached for `seq`.
    fn remove(&mut self, seq: SeqId);
}

#[derive(Debug, Default)]
struct SeqCache {
    len: usize,
    layers: Vec<Option<(Tensor<3>, Tensor<3>)>>,
}

/// A contiguous per-sequence cache: each layer's keys and values are one tensor grown by
/// concatenation. Simple and exact; memory is `2 * layers * tokens * kv_heads * head_dim * 4` bytes
/// per sequence.
#[derive(Debug)]
pub struct DenseKvCache {
    n_layers: usize,
    seqs: HashMap<SeqId, SeqCache>,
}

impl DenseKvCache {
    /// An empty cache for a model with `n_layers` layers.
    pub fn new(n_layers: usize) -> Self {
        Self { n_layers, seqs: HashMap::new() }
    }

    /// Copies the cache of `from` into a new sequence `to` (beam search, `n > 1` sampling).
    /// Tensors are reference-counted by burn, so this copies no data until one side appends.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] if `from` is unknown.
    pub fn fork(&mut self, from: SeqId, to: SeqId) -> Result<()> {
        let src = self.seqs.get(&from).ok_or_else(|| Error::InvalidInput(format!("unknown sequence {from}")))?;
        let copy = SeqCache { len: src.len, layers: src.layers.clone() };
        self.seqs.insert(to, copy);
        Ok(())
    }
}

impl KvCache for DenseKvCache {
    fn seq_len(&self, seq: SeqId) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.len)
    }

    fn append(&mut self, layer: usize, seq: SeqId, k: Tensor<3>, v: Tensor<3>) -> Result<(Tensor<3>, Tensor<3>)> {
        if layer >= self.n_layers {
            return Err(Error::InvalidInput(format!("layer {layer} out of range ({} layers)", self.n_layers)));
        }
        let n_layers = self.n_layers;
        let s = self.seqs.entry(seq).or_insert_with(|| SeqCache { len: 0, layers: vec![None; n_layers] });
        let merged = match s.layers[layer].take() {
            None => (k, v),
            Some((ck, cv)) => {
                // Entries past `len` are uncommitted leftovers (a truncate without rollback); drop them.
                let [cached, kvh, hd] = ck.dims();
                let (ck, cv) = if cached > s.len {
                    (ck.slice([0..s.len, 0..kvh, 0..hd]), cv.slice([0..s.len, 0..kvh, 0..hd]))
                } else {
                    (ck, cv)
                };
                (Tensor::cat(vec![ck, k], 0), Tensor::cat(vec![cv, v], 0))
            }
        };
        s.layers[layer] = Some(merged.clone());
        Ok(merged)
    }

    fn advance(&mut self, seq: SeqId, n: usize) {
        if let Some(s) = self.seqs.get_mut(&seq) {
            s.len += n;
        }
    }

    fn truncate(&mut self, seq: SeqId, len: usize) -> Result<()> {
        let s = self.seqs.get_mut(&seq).ok_or_else(|| Error::InvalidInput(format!("unknown sequence {seq}")))?;
        if len > s.len {
            return Err(Error::InvalidInput(format!("cannot truncate sequence {seq} of {} tokens to {len}", s.len)));
        }
        s.len = len;
        if len == 0 {
            s.layers.iter_mut().for_each(|l| *l = None);
            return Ok(());
        }
        for (ck, cv) in s.layers.iter_mut().flatten() {
            let [_, kvh, hd] = ck.dims();
            *ck = ck.clone().slice([0..len, 0..kvh, 0..hd]);
            *cv = cv.clone().slice([0..len, 0..kvh, 0..hd]);
        }
        Ok(())
    }

    fn remove(&mut self, seq: SeqId) {
        self.seqs.remove(&seq);
    }
}
