//! Key/value caches for incremental decoding.

use std::collections::HashMap;

use burn::tensor::{Tensor, TensorData};
pub use deco_kernels::attention::SeqKv;
use half::f16;

use crate::{Error, Result};

/// Identifies one sequence in a batch (a request, a beam, a sample).
pub type SeqId = u64;

/// A sequence's keys and values of one layer in host memory, in the element type its cache
/// stores ([`KvCache::host_view`]): f32, or f16 (a paged cache built with an f16 dtype).
#[derive(Debug, Clone, Copy)]
pub enum HostKv<'a> {
    /// f32 keys and values.
    F32(SeqKv<'a, f32>),
    /// IEEE binary16 keys and values (widened exactly by the attention kernel).
    F16(SeqKv<'a, f16>),
}

impl HostKv<'_> {
    /// Positions the view covers.
    pub fn len(&self) -> usize {
        match self {
            HostKv::F32(s) => s.len,
            HostKv::F16(s) => s.len,
        }
    }

    /// The storage row of position `p` ([`SeqKv::physical_row`]).
    pub fn physical_row(&self, p: usize) -> usize {
        match self {
            HostKv::F32(s) => s.physical_row(p),
            HostKv::F16(s) => s.physical_row(p),
        }
    }

    /// Whether the view covers no position (never, for a view the caches return).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Storage of the attention keys and values of every layer for a set of sequences.
///
/// The model calls, for each forward over a sequence with `n` new tokens: [`KvCache::append`] once
/// per layer (in layer order), then [`KvCache::advance`] once. A paged implementation (PagedAttention,
/// Kwon et al. 2023) maps the same calls onto fixed-size blocks.
pub trait KvCache: Send {
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

    /// Keeps one path of a token tree (Medusa's accepted candidates, see
    /// [`crate::SeqInput::tree`]): moves cached position `start + rows[i]` to `start + i` for
    /// every layer and drops positions `start + rows.len() ..`. `rows` is strictly increasing
    /// (a root-to-node path in node order); `rows[i] >= i`, so no source is overwritten before
    /// it is read. O(rows · layers · kv_heads · head_dim).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a cache without the operation (the default), an unknown
    /// sequence, rows out of range or not increasing.
    fn keep_rows(&mut self, seq: SeqId, start: usize, rows: &[usize]) -> Result<()> {
        let _ = (seq, start, rows);
        Err(Error::InvalidInput("this KV cache cannot keep a path of a token tree".into()))
    }

    /// Whether the cache keeps (or can keep) its keys and values in host memory, so that
    /// [`KvCache::append_host`] and [`KvCache::host_view`] work (the model then uses the fused
    /// CPU decode attention `deco_kernels::attention::paged_decode_attention`). Default: `false`.
    fn supports_host_kv(&self) -> bool {
        false
    }

    /// Like [`KvCache::append`] with the new keys and values already on the host, without
    /// returning the cached ones (the caller reads them with [`KvCache::host_view`]).
    ///
    /// # Shapes
    /// `k`, `v`: `[new_tokens, kv_heads, head_dim]` row-major.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a cache without host storage (the default), a layer out of
    /// range or inconsistent shapes; a paged cache's allocation errors.
    fn append_host(&mut self, layer: usize, seq: SeqId, k: &[f32], v: &[f32], kv_heads: usize, head_dim: usize) -> Result<()> {
        let _ = (layer, seq, k, v, kv_heads, head_dim);
        Err(Error::InvalidInput("this KV cache has no host storage".into()))
    }

    /// The host storage of `seq` at `layer` for its first `len` positions (committed tokens plus
    /// the ones appended in the current forward), as the fused attention kernel reads it; `None`
    /// if the cache has no host storage for it (the default) or holds fewer than `len` positions.
    fn host_view(&self, layer: usize, seq: SeqId, len: usize) -> Option<HostKv<'_>> {
        let _ = (layer, seq, len);
        None
    }

    /// Whether the cache keeps its keys and values in paged blocks in the model's device memory,
    /// so that [`KvCache::append_device`] and [`KvCache::device_view`] work (the model then runs
    /// the CubeCL paged decode attention on a GPU device, and no key or value leaves the
    /// device). Default: `false`.
    fn supports_device_paged(&self) -> bool {
        false
    }

    /// Like [`KvCache::append`] without returning the cached keys and values (the caller reads
    /// them with [`KvCache::device_view`]).
    ///
    /// # Shapes
    /// `k`, `v`: `[new_tokens, kv_heads, head_dim]` on the cache's device.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a cache without device paged storage (the default); the
    /// cache's shape and allocation errors.
    fn append_device(&mut self, layer: usize, seq: SeqId, k: Tensor<3>, v: Tensor<3>) -> Result<()> {
        let _ = (layer, seq, k, v);
        Err(Error::InvalidInput("this KV cache has no device paged storage".into()))
    }

    /// The device storage of `layer` and the block table of `seq` covering its first `len`
    /// positions; `None` without device paged storage or for fewer than `len` positions.
    fn device_view(&self, layer: usize, seq: SeqId, len: usize) -> Option<DeviceKv<'_>> {
        let _ = (layer, seq, len);
        None
    }
}

/// One layer's paged keys and values in device memory and one sequence's block table
/// ([`KvCache::device_view`]), as the CubeCL paged decode attention reads them.
#[derive(Debug, Clone)]
pub struct DeviceKv<'a> {
    /// Keys `[num_blocks, block_size, kv_heads, head_dim]`.
    pub k: Tensor<4>,
    /// Values, same shape.
    pub v: Tensor<4>,
    /// Block of each run of `block_size` positions of the sequence.
    pub block_table: &'a [u32],
    /// Positions covered (the tokens appended in the current forward included).
    pub len: usize,
}

/// One layer of one sequence in a [`DenseKvCache`].
#[allow(clippy::large_enum_variant)] // one per layer and sequence; boxing buys nothing
#[derive(Debug, Clone)]
enum LayerKv {
    /// Tensors on the device of the appended keys (any backend, autodiff included), grown by
    /// concatenation.
    Device(Tensor<3>, Tensor<3>),
    /// Host vectors `[tokens, kv_heads, head_dim]` grown in place; used once
    /// [`KvCache::append_host`] is called (the fused CPU decode path).
    Host { k: Vec<f32>, v: Vec<f32>, kv_heads: usize, head_dim: usize },
}

#[derive(Debug, Default)]
struct SeqCache {
    len: usize,
    layers: Vec<Option<LayerKv>>,
}

/// A contiguous per-sequence cache: each layer's keys and values are one tensor grown by
/// concatenation. Simple and exact; memory is `2 * layers * tokens * kv_heads * head_dim * 4` bytes
/// per sequence.
///
/// Layers written through [`KvCache::append_host`] (the model's fused CPU decode path) switch to
/// host vectors grown in place (amortized O(new tokens) per append instead of a concatenation);
/// [`KvCache::append`] still works on them (it returns copies as tensors).
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
    /// Device tensors are reference-counted by burn, so those copy no data until one side
    /// appends; host layers (see the type docs) are copied here.
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
        let (stored, merged) = match s.layers[layer].take() {
            None => (LayerKv::Device(k.clone(), v.clone()), (k, v)),
            Some(LayerKv::Device(ck, cv)) => {
                // Entries past `len` are uncommitted leftovers (a truncate without rollback); drop them.
                let [cached, kvh, hd] = ck.dims();
                let (ck, cv) = if cached > s.len {
                    (ck.slice([0..s.len, 0..kvh, 0..hd]), cv.slice([0..s.len, 0..kvh, 0..hd]))
                } else {
                    (ck, cv)
                };
                let merged = (Tensor::cat(vec![ck, k], 0), Tensor::cat(vec![cv, v], 0));
                (LayerKv::Device(merged.0.clone(), merged.1.clone()), merged)
            }
            Some(LayerKv::Host { k: mut hk, v: mut hv, kv_heads, head_dim }) => {
                let [n, kh, hd] = k.dims();
                if kh != kv_heads || hd != head_dim || v.dims() != [n, kh, hd] {
                    s.layers[layer] = Some(LayerKv::Host { k: hk, v: hv, kv_heads, head_dim });
                    return Err(Error::InvalidInput(format!(
                        "cache holds [_, {kv_heads}, {head_dim}] keys/values, got {:?} / {:?}",
                        k.dims(),
                        v.dims()
                    )));
                }
                let device = k.device();
                let row = kv_heads * head_dim;
                hk.truncate(s.len * row);
                hv.truncate(s.len * row);
                hk.extend(crate::host::to_host(k)?);
                hv.extend(crate::host::to_host(v)?);
                let shape = [hk.len() / row, kv_heads, head_dim];
                let merged = (
                    Tensor::from_data(TensorData::new(hk.clone(), shape), &device),
                    Tensor::from_data(TensorData::new(hv.clone(), shape), &device),
                );
                (LayerKv::Host { k: hk, v: hv, kv_heads, head_dim }, merged)
            }
        };
        s.layers[layer] = Some(stored);
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
        for l in s.layers.iter_mut().flatten() {
            match l {
                LayerKv::Device(ck, cv) => {
                    let [cached, kvh, hd] = ck.dims();
                    let keep = len.min(cached);
                    *ck = ck.clone().slice([0..keep, 0..kvh, 0..hd]);
                    *cv = cv.clone().slice([0..keep, 0..kvh, 0..hd]);
                }
                LayerKv::Host { k, v, kv_heads, head_dim } => {
                    let keep = len * *kv_heads * *head_dim;
                    k.truncate(keep);
                    v.truncate(keep);
                }
            }
        }
        Ok(())
    }

    fn remove(&mut self, seq: SeqId) {
        self.seqs.remove(&seq);
    }

    fn supports_host_kv(&self) -> bool {
        true
    }

    fn append_host(&mut self, layer: usize, seq: SeqId, k: &[f32], v: &[f32], kv_heads: usize, head_dim: usize) -> Result<()> {
        if layer >= self.n_layers {
            return Err(Error::InvalidInput(format!("layer {layer} out of range ({} layers)", self.n_layers)));
        }
        let row = kv_heads * head_dim;
        if row == 0 || k.len() != v.len() || !k.len().is_multiple_of(row) {
            return Err(Error::InvalidInput(format!(
                "append_host: {} keys / {} values are not rows of [{kv_heads}, {head_dim}]",
                k.len(),
                v.len()
            )));
        }
        let n_layers = self.n_layers;
        let s = self.seqs.entry(seq).or_insert_with(|| SeqCache { len: 0, layers: vec![None; n_layers] });
        let (mut hk, mut hv) = match s.layers[layer].take() {
            None => (Vec::new(), Vec::new()),
            Some(LayerKv::Device(ck, cv)) => {
                let [cached, kvh, hd] = ck.dims();
                if kvh != kv_heads || hd != head_dim {
                    s.layers[layer] = Some(LayerKv::Device(ck, cv));
                    return Err(Error::InvalidInput(format!(
                        "cache holds [_, {kvh}, {hd}] keys/values, got rows of [{kv_heads}, {head_dim}]"
                    )));
                }
                let keep = s.len.min(cached);
                let (ck, cv) = (ck.slice([0..keep, 0..kvh, 0..hd]), cv.slice([0..keep, 0..kvh, 0..hd]));
                (crate::host::to_host(ck)?, crate::host::to_host(cv)?)
            }
            Some(LayerKv::Host { k, v, kv_heads: kh, head_dim: hd }) => {
                if kh != kv_heads || hd != head_dim {
                    s.layers[layer] = Some(LayerKv::Host { k, v, kv_heads: kh, head_dim: hd });
                    return Err(Error::InvalidInput(format!(
                        "cache holds [_, {kh}, {hd}] keys/values, got rows of [{kv_heads}, {head_dim}]"
                    )));
                }
                (k, v)
            }
        };
        // Entries past `len` are uncommitted leftovers; drop them.
        hk.truncate(s.len * row);
        hv.truncate(s.len * row);
        hk.extend_from_slice(k);
        hv.extend_from_slice(v);
        s.layers[layer] = Some(LayerKv::Host { k: hk, v: hv, kv_heads, head_dim });
        Ok(())
    }

    fn host_view(&self, layer: usize, seq: SeqId, len: usize) -> Option<HostKv<'_>> {
        match self.seqs.get(&seq)?.layers.get(layer)?.as_ref()? {
            LayerKv::Host { k, v, kv_heads, head_dim } => {
                let n = len * kv_heads * head_dim;
                (len > 0 && k.len() >= n).then(|| HostKv::F32(SeqKv { k: &k[..n], v: &v[..n], block_table: &[0], block_size: len, len }))
            }
            LayerKv::Device(..) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Tensor, TensorData};

    use super::{DenseKvCache, HostKv, KvCache};

    fn t(vals: &[f32]) -> Tensor<3> {
        Tensor::from_data(TensorData::new(vals.to_vec(), [vals.len() / 2, 1, 2]), &Device::flex())
    }

    fn host(t: Tensor<3>) -> Vec<f32> {
        t.try_into_vec_as::<f32>().expect("read")
    }

    /// Device-mode appends, a switch to host mode, uncommitted leftovers, truncation and fork
    /// keep the same contents as plain tensor appends.
    #[test]
    fn host_mode_matches_device_mode() {
        let mut c = DenseKvCache::new(1);
        c.append(0, 7, t(&[1., 2., 3., 4.]), t(&[5., 6., 7., 8.])).expect("append");
        c.advance(7, 2);
        assert!(c.host_view(0, 7, 2).is_none(), "device mode has no host view");
        c.append_host(0, 7, &[9., 10.], &[11., 12.], 1, 2).expect("host append");
        let Some(HostKv::F32(v)) = c.host_view(0, 7, 3) else { panic!("no f32 view") };
        assert_eq!((v.k, v.v, v.len), (&[1., 2., 3., 4., 9., 10.][..], &[5., 6., 7., 8., 11., 12.][..], 3));
        assert!(c.host_view(0, 7, 4).is_none(), "only 3 positions");
        // Not advanced: the next append replaces position 2.
        let (k, v) = c.append(0, 7, t(&[13., 14.]), t(&[15., 16.])).expect("append on host layer");
        assert_eq!(host(k), [1., 2., 3., 4., 13., 14.]);
        assert_eq!(host(v), [5., 6., 7., 8., 15., 16.]);
        c.advance(7, 1);
        c.fork(7, 8).expect("fork");
        c.truncate(7, 1).expect("truncate");
        c.append_host(0, 7, &[0., 0.], &[0., 0.], 1, 2).expect("host append");
        let f32_keys = |v: Option<HostKv<'_>>| match v {
            Some(HostKv::F32(s)) => s.k.to_vec(),
            other => panic!("expected an f32 view, got {other:?}"),
        };
        assert_eq!(f32_keys(c.host_view(0, 7, 2)), [1., 2., 0., 0.]);
        assert_eq!(f32_keys(c.host_view(0, 8, 3)), [1., 2., 3., 4., 13., 14.]);
        assert!(c.append_host(0, 7, &[0.; 3], &[0.; 3], 1, 2).is_err(), "ragged rows");
        assert!(c.append_host(0, 7, &[0.; 4], &[0.; 4], 2, 2).is_err(), "other kv_heads");
        assert!(c.append_host(1, 7, &[0.; 2], &[0.; 2], 1, 2).is_err(), "layer out of range");
    }
}
