//! A paged KV cache (PagedAttention, Kwon et al. 2023) implementing [`deco_model::KvCache`].
//!
//! # Layout
//! Keys and values of every layer live in one host buffer each,
//! `[num_blocks, block_size, kv_heads, head_dim]` of f32, or of f16 with
//! [`KvCacheDtype::F16`] (vLLM's block layout without the x-packing; llama.cpp's default KV
//! type is f16 too: half the memory and half the bytes a decode step reads). A sequence owns a
//! *block table*: `table[i]` is the block holding its positions
//! `i * block_size .. (i + 1) * block_size`. Position `p` of a sequence is at
//! `(table[p / block_size], p % block_size)`. A paged-attention kernel can read keys and values
//! directly from the buffers given [`PagedKvCache::block_table`] and the sequence length
//! ([`KvCache::host_view`]).
//!
//! On a GPU device (features `wgpu` / `cuda` of deco-model) the same blocks live in device
//! memory instead, one `[num_blocks · block_size, kv_heads · head_dim]` tensor per layer and
//! for keys and values: writes are slice assignments into the blocks, copy-on-write copies a
//! block on the device, prefill chunks gather their rows with one `select`, and decode tokens
//! are attended in place by the CubeCL paged decode kernel ([`KvCache::device_view`]). The block
//! pool, tables and prefix cache stay on the host; no key or value crosses the bus.
//!
//! # Attention paths
//! - Decode (one new token per sequence, CPU model): the model writes the new keys/values with
//!   [`KvCache::append_host`] and calls `deco_kernels::attention::paged_decode_attention` once
//!   per layer for the whole batch on [`KvCache::host_view`]s (these buffers plus the block
//!   table): no gather copy.
//! - Prefill chunks (several new tokens): [`KvCache::append`] writes the new keys/values into
//!   the sequence's blocks and returns them *gathered* into contiguous
//!   `[len, kv_heads, head_dim]` tensors for `deco_kernels::ops::causal_gqa_attention` (one copy
//!   of the sequence's cache per layer).
//!
//! # Sharing
//! - **Prefix caching**: when token ids are recorded ([`PagedKvCache::record_tokens`]), every
//!   block that becomes full is registered in the pool under its [`PrefixKey`] chain. A new
//!   sequence calls [`PagedKvCache::attach_prefix`] to reuse the longest cached run of full
//!   blocks of its prompt.
//! - **Copy-on-write**: [`PagedKvCache::fork`] shares every block of a sequence (one more
//!   reference each). Before a write into a block with more than one reference, the block is
//!   copied (all layers) into a fresh block. A cached block with a single owner is written in
//!   place after leaving the prefix cache.

use std::collections::HashMap;
use std::ops::Range;

use burn::tensor::{Device, Tensor, TensorData};
use deco_model::kv_cache::SeqKv;
use deco_model::{HostKv, KvCache, SeqId};
use half::f16;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};

use crate::block_pool::{BlockId, BlockPool, PrefixKey};
use crate::{Error, Result};

/// Geometry of a paged cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheShape {
    /// Decoder layers.
    pub n_layers: usize,
    /// Key/value heads per layer.
    pub kv_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
    /// Tokens per block (vLLM default 16).
    pub block_size: usize,
    /// Blocks in the pool.
    pub num_blocks: usize,
}

impl CacheShape {
    /// Bytes of key and value storage per block over all layers: `2 * n_layers * block_size *
    /// kv_heads * head_dim * dtype.bytes()`.
    pub fn bytes_per_block(&self, dtype: KvCacheDtype) -> usize {
        2 * self.n_layers * self.block_size * self.kv_heads * self.head_dim * dtype.bytes()
    }
}

/// Element type of the cached keys and values (vLLM's `--kv-cache-dtype`, llama.cpp's
/// `--cache-type-k` / `--cache-type-v`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KvCacheDtype {
    /// f32: the keys and values exactly as the model computed them (the default).
    #[default]
    F32,
    /// IEEE binary16, rounded to nearest even on write: half the memory and half the bytes a
    /// decode step reads. The attention kernel widens them exactly, so attention is the f32
    /// computation on the rounded keys and values. A key or value beyond f16's range (±65504)
    /// is refused with an error (llama.cpp's f16 cache would store an infinity). Host (CPU)
    /// cache only.
    F16,
}

impl KvCacheDtype {
    /// Bytes per cached value.
    pub fn bytes(self) -> usize {
        match self {
            KvCacheDtype::F32 => 4,
            KvCacheDtype::F16 => 2,
        }
    }

    /// The name in vLLM's `cache_dtype` metric label and deco's option: `float32`, `float16`.
    pub fn name(self) -> &'static str {
        match self {
            KvCacheDtype::F32 => "float32",
            KvCacheDtype::F16 => "float16",
        }
    }
}

impl std::str::FromStr for KvCacheDtype {
    type Err = Error;

    /// `f32` / `float32` / `auto` (the model's f32), `f16` / `float16` / `half`.
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "f32" | "float32" | "auto" => Ok(KvCacheDtype::F32),
            "f16" | "float16" | "half" => Ok(KvCacheDtype::F16),
            other => Err(Error::InvalidRequest(format!("KV cache dtype `{other}`: use f32 (auto) or f16"))),
        }
    }
}

/// One layer's key or value blocks on the host, in the cache's element type (f16 as its bits,
/// so that the pool is allocated zeroed, `calloc`, and its pages are committed on first write
/// as the f32 pool's are).
#[derive(Debug)]
enum KvBuf {
    F32(Vec<f32>),
    F16(Vec<u16>),
}

impl KvBuf {
    fn zeros(dtype: KvCacheDtype, n: usize) -> Self {
        match dtype {
            KvCacheDtype::F32 => KvBuf::F32(vec![0.0; n]),
            KvCacheDtype::F16 => KvBuf::F16(vec![0; n]),
        }
    }

    /// Stores `x` at element `off` (rounded to f16 for an f16 buffer). Returns the first finite
    /// value that f16 cannot hold (it became infinite), if any; the row is written either way.
    fn write(&mut self, off: usize, x: &[f32]) -> Option<f32> {
        match self {
            KvBuf::F32(b) => {
                b[off..off + x.len()].copy_from_slice(x);
                None
            }
            KvBuf::F16(b) => {
                let h: &mut [f16] = b[off..off + x.len()].reinterpret_cast_mut();
                h.convert_from_f32_slice(x);
                h.iter().zip(x).find(|(h, v)| h.is_infinite() && v.is_finite()).map(|(_, &v)| v)
            }
        }
    }

    /// Appends elements `r` to `out` as f32 (exact).
    fn read_into(&self, r: Range<usize>, out: &mut Vec<f32>) {
        match self {
            KvBuf::F32(b) => out.extend_from_slice(&b[r]),
            KvBuf::F16(b) => {
                let start = out.len();
                out.resize(start + r.len(), 0.0);
                b[r].reinterpret_cast::<f16>().convert_to_f32_slice(&mut out[start..]);
            }
        }
    }

    fn copy_within(&mut self, src: Range<usize>, dst: usize) {
        match self {
            KvBuf::F32(b) => b.copy_within(src, dst),
            KvBuf::F16(b) => b.copy_within(src, dst),
        }
    }
}

#[derive(Debug, Clone, Default)]
struct PagedSeq {
    table: Vec<BlockId>,
    /// Committed tokens.
    len: usize,
    /// Token ids of positions `0..tokens.len()` when recorded (for prefix hashing).
    tokens: Vec<u32>,
    /// Chain hash of each registered leading full block.
    hashes: Vec<u64>,
}

/// The paged KV cache. See the [module docs](self).
#[derive(Debug)]
pub struct PagedKvCache {
    shape: CacheShape,
    pool: BlockPool,
    /// Per layer, `[num_blocks, block_size, kv_heads, head_dim]` on the host (empty when the
    /// blocks live on the device).
    k: Vec<KvBuf>,
    v: Vec<KvBuf>,
    dtype: KvCacheDtype,
    /// Per layer, `[num_blocks · block_size, kv_heads · head_dim]` in device memory, on a GPU
    /// device (features `wgpu` / `cuda`); empty on the CPU.
    dk: Vec<Tensor<2>>,
    dv: Vec<Tensor<2>>,
    seqs: HashMap<SeqId, PagedSeq>,
    device: Device,
}

/// `t[start .. start + rows.len()] = rows` in place (`t` is taken out of its slot so that its
/// buffer has a single owner and burn writes into it instead of copying the whole pool).
fn assign_rows(t: &mut Tensor<2>, start: usize, rows: Tensor<2>) {
    let [n, w] = rows.dims();
    let placeholder = Tensor::empty([0, w], &t.device());
    let cur = std::mem::replace(t, placeholder);
    *t = cur.slice_assign([start..start + n, 0..w], rows);
}

fn model_err(e: Error) -> deco_model::Error {
    deco_model::Error::InvalidInput(e.to_string())
}

impl PagedKvCache {
    /// An empty f32 cache; storage for all blocks is allocated up front (zeroed pages are
    /// committed by the OS on first write).
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for a zero dimension or an oversized pool.
    pub fn new(shape: CacheShape, device: &Device) -> Result<Self> {
        Self::with_dtype(shape, KvCacheDtype::F32, device)
    }

    /// An empty cache of keys and values stored as `dtype`.
    ///
    /// # Errors
    /// As [`PagedKvCache::new`], and [`Error::InvalidRequest`] for [`KvCacheDtype::F16`] on a
    /// GPU device (its paged kernel reads f32 blocks).
    pub fn with_dtype(shape: CacheShape, dtype: KvCacheDtype, device: &Device) -> Result<Self> {
        if shape.block_size == 0 || shape.kv_heads == 0 || shape.head_dim == 0 || shape.n_layers == 0 {
            return Err(Error::InvalidRequest(format!("invalid cache shape {shape:?}")));
        }
        let on_device = deco_model::decoder::gpu_kernels(device);
        if on_device && dtype != KvCacheDtype::F32 {
            return Err(Error::InvalidRequest(format!(
                "a {} KV cache is for the CPU; on a GPU device the paged blocks are float32",
                dtype.name()
            )));
        }
        let per_layer = if on_device { 0 } else { shape.num_blocks * shape.block_size * shape.kv_heads * shape.head_dim };
        let rows = shape.num_blocks * shape.block_size;
        let tf = shape.kv_heads * shape.head_dim;
        let dev_layers = if on_device { shape.n_layers } else { 0 };
        Ok(Self {
            shape,
            pool: BlockPool::new(shape.num_blocks)?,
            k: (0..shape.n_layers).map(|_| KvBuf::zeros(dtype, per_layer)).collect(),
            v: (0..shape.n_layers).map(|_| KvBuf::zeros(dtype, per_layer)).collect(),
            dtype,
            dk: (0..dev_layers).map(|_| Tensor::zeros([rows, tf], device)).collect(),
            dv: (0..dev_layers).map(|_| Tensor::zeros([rows, tf], device)).collect(),
            seqs: HashMap::new(),
            device: device.clone(),
        })
    }

    /// Whether the blocks live in device memory (a GPU device, features `wgpu` / `cuda`): then
    /// [`KvCache::append_device`] / [`KvCache::device_view`] serve the model's paged decode
    /// kernel and the host storage is empty.
    pub fn on_device(&self) -> bool {
        !self.dk.is_empty()
    }

    /// Writes `k`, `v` (`[n, kv_heads · head_dim]` on the device) for positions `len .. len + n`
    /// of `seq` into the device blocks, one slice assignment per run of positions in a block.
    fn write_device(&mut self, layer: usize, seq: SeqId, k: Tensor<2>, v: Tensor<2>) -> Result<usize> {
        let bs = self.shape.block_size;
        let tf = self.token_floats();
        let [n, _] = k.dims();
        let s = self.seqs.get(&seq).ok_or(Error::UnknownSequence(seq))?;
        let (len, table) = (s.len, s.table.clone());
        if table.len() * bs < len + n {
            return Err(Error::InvalidRequest(format!("sequence {seq}: {n} new tokens not reserved")));
        }
        let mut t = 0;
        while t < n {
            let p = len + t;
            let run = (bs - p % bs).min(n - t);
            let row = table[p / bs] as usize * bs + p % bs;
            if run == n {
                assign_rows(&mut self.dk[layer], row, k.clone());
                assign_rows(&mut self.dv[layer], row, v.clone());
            } else {
                assign_rows(&mut self.dk[layer], row, k.clone().slice([t..t + run, 0..tf]));
                assign_rows(&mut self.dv[layer], row, v.clone().slice([t..t + run, 0..tf]));
            }
            t += run;
        }
        Ok(len + n)
    }

    /// Checks a layer index and `[n, kv_heads, head_dim]` keys/values; returns `n`.
    fn check_kv(&self, layer: usize, k: &Tensor<3>, v: &Tensor<3>) -> deco_model::Result<usize> {
        let CacheShape { n_layers, kv_heads, head_dim, .. } = self.shape;
        if layer >= n_layers {
            return Err(deco_model::Error::InvalidInput(format!("layer {layer} out of range ({n_layers} layers)")));
        }
        let [n, kh, hd] = k.dims();
        if kh != kv_heads || hd != head_dim || v.dims() != [n, kh, hd] {
            return Err(deco_model::Error::InvalidInput(format!(
                "paged cache expects [tokens, {kv_heads}, {head_dim}] keys/values, got {:?} / {:?}",
                k.dims(),
                v.dims()
            )));
        }
        Ok(n)
    }

    /// The geometry.
    pub fn shape(&self) -> CacheShape {
        self.shape
    }

    /// The element type of the cached keys and values.
    pub fn dtype(&self) -> KvCacheDtype {
        self.dtype
    }

    /// The block pool (counts, prefix-cache size).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Sequences holding blocks.
    pub fn num_seqs(&self) -> usize {
        self.seqs.len()
    }

    /// The block table of `seq` (empty for an unknown sequence).
    pub fn block_table(&self, seq: SeqId) -> &[BlockId] {
        self.seqs.get(&seq).map_or(&[], |s| s.table.as_slice())
    }


    fn token_floats(&self) -> usize {
        self.shape.kv_heads * self.shape.head_dim
    }

    fn block_floats(&self) -> usize {
        self.shape.block_size * self.token_floats()
    }

    /// Blocks that [`reserve`](Self::reserve) would take from the pool to let `seq` hold
    /// `total_len` tokens: missing blocks plus one copy-on-write of the shared block where the
    /// next write lands.
    pub fn blocks_needed(&self, seq: SeqId, total_len: usize) -> usize {
        let bs = self.shape.block_size;
        let want = total_len.div_ceil(bs);
        match self.seqs.get(&seq) {
            None => want,
            Some(s) => {
                let missing = want.saturating_sub(s.table.len());
                let cow = usize::from(
                    total_len > s.len && !s.len.is_multiple_of(bs) && self.pool.ref_count(s.table[s.len / bs]) > 1,
                );
                missing + cow
            }
        }
    }

    /// Makes `seq` (created if unknown) able to hold `total_len` tokens: allocates missing blocks
    /// and performs the copy-on-write of a shared partially filled last block. All or nothing.
    ///
    /// # Errors
    /// [`Error::OutOfBlocks`] when the pool cannot supply [`blocks_needed`](Self::blocks_needed)
    /// blocks; nothing is changed then.
    pub fn reserve(&mut self, seq: SeqId, total_len: usize) -> Result<()> {
        let needed = self.blocks_needed(seq, total_len);
        if needed > self.pool.num_free() {
            return Err(Error::OutOfBlocks { needed, free: self.pool.num_free() });
        }
        let bs = self.shape.block_size;
        let s = self.seqs.entry(seq).or_default();
        let mut table = std::mem::take(&mut s.table);
        let len = s.len;
        let result = (|| {
            if total_len > len && !len.is_multiple_of(bs) {
                self.make_writable(&mut table, len / bs)?;
            }
            while table.len() < total_len.div_ceil(bs) {
                table.push(self.pool.allocate()?);
            }
            Ok(())
        })();
        if let Some(s) = self.seqs.get_mut(&seq) {
            s.table = table;
        }
        result
    }

    /// Ensures `table[idx]` may be written: copy-on-write when shared, leave the prefix cache
    /// when cached.
    fn make_writable(&mut self, table: &mut [BlockId], idx: usize) -> Result<()> {
        let b = table[idx];
        if self.pool.ref_count(b) > 1 {
            let nb = self.pool.allocate()?;
            if self.on_device() {
                let (bs, tf) = (self.shape.block_size, self.token_floats());
                let (src, dst) = (b as usize * bs, nb as usize * bs);
                for t in self.dk.iter_mut().chain(self.dv.iter_mut()) {
                    // A fresh buffer (not a view of `t`), so that `t` stays the single owner
                    // of its own buffer and is written in place.
                    let block = t.clone().slice([src..src + bs, 0..tf]).add_scalar(0.0);
                    assign_rows(t, dst, block);
                }
            } else {
                let n = self.block_floats();
                let (src, dst) = (b as usize * n, nb as usize * n);
                for l in 0..self.shape.n_layers {
                    self.k[l].copy_within(src..src + n, dst);
                    self.v[l].copy_within(src..src + n, dst);
                }
            }
            self.pool.free(b)?;
            table[idx] = nb;
        } else if self.pool.is_cached(b) {
            self.pool.unregister(b);
        }
        Ok(())
    }

    /// Records the token ids of the positions about to be computed for `seq` (call before the
    /// forward that appends them). Enables prefix-cache registration of the blocks they fill.
    /// Ids beyond the committed length are replaced.
    pub fn record_tokens(&mut self, seq: SeqId, tokens: &[u32]) {
        let s = self.seqs.entry(seq).or_default();
        if s.tokens.len() == s.len {
            s.tokens.extend_from_slice(tokens);
        } else if s.tokens.len() > s.len {
            s.tokens.truncate(s.len);
            s.tokens.extend_from_slice(tokens);
        }
        // Fewer ids than committed tokens: the sequence was not recorded from the start; leave it.
    }

    /// Records the token ids of positions already computed but not recorded (a token tree's
    /// kept path after [`KvCache::keep_rows`]: the tree's nodes are not recorded, so that no
    /// block of tree keys enters the prefix cache) and registers the blocks they complete. Does
    /// nothing unless `tokens` covers exactly the unrecorded computed positions.
    pub fn record_computed(&mut self, seq: SeqId, tokens: &[u32]) {
        let Some(s) = self.seqs.get_mut(&seq) else { return };
        if s.tokens.len() + tokens.len() == s.len {
            s.tokens.extend_from_slice(tokens);
            self.register_full_blocks(seq);
        }
    }

    /// Reuses the longest run of cached full blocks of `prompt` for the new sequence `seq`,
    /// leaving at least one prompt token to compute (its logits are needed). Returns the number
    /// of cached tokens (a multiple of the block size), now committed for `seq`.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] if `seq` already holds tokens.
    pub fn attach_prefix(&mut self, seq: SeqId, prompt: &[u32]) -> Result<usize> {
        if self.seq_len(seq) > 0 {
            return Err(Error::InvalidRequest(format!("sequence {seq} already has cached tokens")));
        }
        let bs = self.shape.block_size;
        let max_blocks = prompt.len().saturating_sub(1) / bs;
        let mut parent = 0u64;
        let mut table = Vec::new();
        let mut hashes = Vec::new();
        for i in 0..max_blocks {
            let key = PrefixKey::new(parent, &prompt[i * bs..(i + 1) * bs]);
            let Some(b) = self.pool.lookup(&key) else { break };
            self.pool.incref(b)?;
            parent = key.chain_hash();
            table.push(b);
            hashes.push(parent);
        }
        let len = table.len() * bs;
        self.seqs.insert(seq, PagedSeq { table, len, tokens: prompt[..len].to_vec(), hashes });
        Ok(len)
    }

    fn register_full_blocks(&mut self, seq: SeqId) {
        let bs = self.shape.block_size;
        let Some(s) = self.seqs.get_mut(&seq) else { return };
        let full = s.len.min(s.tokens.len()) / bs;
        while s.hashes.len() < full {
            let i = s.hashes.len();
            let parent = if i == 0 { 0 } else { s.hashes[i - 1] };
            let key = PrefixKey::new(parent, &s.tokens[i * bs..(i + 1) * bs]);
            s.hashes.push(key.chain_hash());
            self.pool.register(s.table[i], key);
        }
    }

    /// Shares all of `from`'s blocks with a new sequence `to` (n > 1 sampling, beam search);
    /// the first write into a shared block copies it. O(blocks of `from`).
    ///
    /// # Errors
    /// [`Error::UnknownSequence`] for an unknown `from`; [`Error::InvalidRequest`] if `to`
    /// exists.
    pub fn fork(&mut self, from: SeqId, to: SeqId) -> Result<()> {
        if self.seqs.contains_key(&to) {
            return Err(Error::InvalidRequest(format!("sequence {to} already exists")));
        }
        let src = self.seqs.get(&from).ok_or(Error::UnknownSequence(from))?.clone();
        for &b in &src.table {
            self.pool.incref(b)?;
        }
        self.seqs.insert(to, src);
        Ok(())
    }

    /// Frees every block of `seq` (tail first, so its last blocks are evicted first).
    ///
    /// # Errors
    /// A pool invariant violation (double free), which would be a bug.
    pub fn free_seq(&mut self, seq: SeqId) -> Result<()> {
        if let Some(s) = self.seqs.remove(&seq) {
            for &b in s.table.iter().rev() {
                self.pool.free(b)?;
            }
        }
        Ok(())
    }

    /// Reference count each block should have, from the block tables (for tests).
    pub fn expected_ref_counts(&self) -> HashMap<BlockId, u32> {
        let mut m = HashMap::new();
        for s in self.seqs.values() {
            for &b in &s.table {
                *m.entry(b).or_insert(0) += 1;
            }
        }
        m
    }

    /// Checks that the pool's reference counts equal the block tables' references and the pool's
    /// own invariants hold.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] naming the first mismatch.
    pub fn check_consistency(&self) -> Result<()> {
        self.pool.check_invariants()?;
        let expected = self.expected_ref_counts();
        for b in 0..self.shape.num_blocks as BlockId {
            let e = expected.get(&b).copied().unwrap_or(0);
            if self.pool.ref_count(b) != e {
                return Err(Error::InvalidRequest(format!(
                    "block {b}: ref count {} but {e} table references",
                    self.pool.ref_count(b)
                )));
            }
        }
        Ok(())
    }

    /// Writes `n` new tokens' keys/values of `seq` at `layer` after its committed positions
    /// (the blocks must be reserved). Returns the total length.
    fn write(&mut self, layer: usize, seq: SeqId, k: &[f32], v: &[f32], n: usize) -> Result<usize> {
        let bs = self.shape.block_size;
        let tf = self.token_floats();
        let s = self.seqs.get(&seq).ok_or(Error::UnknownSequence(seq))?;
        let (len, table) = (s.len, &s.table);
        if table.len() * bs < len + n {
            return Err(Error::InvalidRequest(format!("sequence {seq}: {n} new tokens not reserved")));
        }
        let (kl, vl) = (&mut self.k[layer], &mut self.v[layer]);
        for t in 0..n {
            let p = len + t;
            let off = (table[p / bs] as usize * bs + p % bs) * tf;
            if let Some(x) = kl.write(off, &k[t * tf..(t + 1) * tf]).or(vl.write(off, &v[t * tf..(t + 1) * tf])) {
                return Err(Error::InvalidRequest(format!(
                    "layer {layer}: a key or value of {x} is beyond the range of the f16 KV cache (±65504); use --kv-cache-dtype f32"
                )));
            }
        }
        Ok(len + n)
    }

    fn write_and_gather(&mut self, layer: usize, seq: SeqId, k: &[f32], v: &[f32], n: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        let bs = self.shape.block_size;
        let tf = self.token_floats();
        let total = self.write(layer, seq, k, v, n)?;
        let table = &self.seqs[&seq].table;
        let (kl, vl) = (&self.k[layer], &self.v[layer]);
        let mut ko = Vec::with_capacity(total * tf);
        let mut vo = Vec::with_capacity(total * tf);
        for (i, &b) in table.iter().enumerate().take(total.div_ceil(bs)) {
            let rows = bs.min(total - i * bs);
            let off = b as usize * bs * tf;
            kl.read_into(off..off + rows * tf, &mut ko);
            vl.read_into(off..off + rows * tf, &mut vo);
        }
        Ok((ko, vo))
    }
}


impl KvCache for PagedKvCache {
    fn seq_len(&self, seq: SeqId) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.len)
    }

    fn append(&mut self, layer: usize, seq: SeqId, k: Tensor<3>, v: Tensor<3>) -> deco_model::Result<(Tensor<3>, Tensor<3>)> {
        let CacheShape { kv_heads, head_dim, .. } = self.shape;
        let n = self.check_kv(layer, &k, &v)?;
        if layer == 0 {
            let len = self.seq_len(seq);
            self.reserve(seq, len + n).map_err(model_err)?;
        }
        if self.on_device() {
            // Write into the device blocks, then gather the sequence's rows on the device.
            let tf = self.token_floats();
            let bs = self.shape.block_size;
            let total = self.write_device(layer, seq, k.reshape([n, tf]), v.reshape([n, tf])).map_err(model_err)?;
            let table = &self.seqs[&seq].table;
            let idx: Vec<i64> = (0..total).map(|p| (table[p / bs] as usize * bs + p % bs) as i64).collect();
            let idx = Tensor::<1, burn::tensor::Int>::from_data(TensorData::new(idx, [total]), &self.device);
            let shape = [total, kv_heads, head_dim];
            return Ok((self.dk[layer].clone().select(0, idx.clone()).reshape(shape), self.dv[layer].clone().select(0, idx).reshape(shape)));
        }
        let (kh_data, vh_data) = (deco_model::host::to_host(k)?, deco_model::host::to_host(v)?);
        let (ko, vo) = self.write_and_gather(layer, seq, &kh_data, &vh_data, n).map_err(model_err)?;
        let total = ko.len() / self.token_floats();
        let shape = [total, kv_heads, head_dim];
        Ok((
            Tensor::from_data(TensorData::new(ko, shape), &self.device),
            Tensor::from_data(TensorData::new(vo, shape), &self.device),
        ))
    }

    fn advance(&mut self, seq: SeqId, n: usize) {
        if let Some(s) = self.seqs.get_mut(&seq) {
            s.len += n;
        }
        self.register_full_blocks(seq);
    }

    fn supports_host_kv(&self) -> bool {
        !self.on_device()
    }

    fn supports_device_paged(&self) -> bool {
        self.on_device()
    }

    fn append_device(&mut self, layer: usize, seq: SeqId, k: Tensor<3>, v: Tensor<3>) -> deco_model::Result<()> {
        if !self.on_device() {
            return Err(deco_model::Error::InvalidInput("this paged cache keeps its blocks on the host".into()));
        }
        let n = self.check_kv(layer, &k, &v)?;
        if layer == 0 {
            let len = self.seq_len(seq);
            self.reserve(seq, len + n).map_err(model_err)?;
        }
        let tf = self.token_floats();
        self.write_device(layer, seq, k.reshape([n, tf]), v.reshape([n, tf])).map_err(model_err)?;
        Ok(())
    }

    fn device_view(&self, layer: usize, seq: SeqId, len: usize) -> Option<deco_model::DeviceKv<'_>> {
        let s = self.seqs.get(&seq)?;
        let CacheShape { block_size: bs, num_blocks, kv_heads, head_dim, .. } = self.shape;
        if len == 0 || s.table.len() * bs < len {
            return None;
        }
        let shape = [num_blocks, bs, kv_heads, head_dim];
        Some(deco_model::DeviceKv {
            k: self.dk.get(layer)?.clone().reshape(shape),
            v: self.dv.get(layer)?.clone().reshape(shape),
            block_table: &s.table,
            len,
        })
    }

    fn append_host(
        &mut self,
        layer: usize,
        seq: SeqId,
        k: &[f32],
        v: &[f32],
        kv_heads: usize,
        head_dim: usize,
    ) -> deco_model::Result<()> {
        let CacheShape { n_layers, kv_heads: kvh, head_dim: hd, .. } = self.shape;
        if layer >= n_layers {
            return Err(deco_model::Error::InvalidInput(format!("layer {layer} out of range ({n_layers} layers)")));
        }
        if self.on_device() {
            return Err(deco_model::Error::InvalidInput("this paged cache keeps its blocks on the device".into()));
        }
        let tf = self.token_floats();
        if kv_heads != kvh || head_dim != hd || k.len() != v.len() || !k.len().is_multiple_of(tf) {
            return Err(deco_model::Error::InvalidInput(format!(
                "paged cache expects rows of [{kvh}, {hd}], got {} / {} values of [{kv_heads}, {head_dim}]",
                k.len(),
                v.len()
            )));
        }
        let n = k.len() / tf;
        if layer == 0 {
            let len = self.seq_len(seq);
            self.reserve(seq, len + n).map_err(model_err)?;
        }
        self.write(layer, seq, k, v, n).map_err(model_err)?;
        Ok(())
    }

    fn host_view(&self, layer: usize, seq: SeqId, len: usize) -> Option<HostKv<'_>> {
        if self.on_device() {
            return None;
        }
        let s = self.seqs.get(&seq)?;
        let bs = self.shape.block_size;
        if len == 0 || s.table.len() * bs < len {
            return None;
        }
        Some(match (self.k.get(layer)?, self.v.get(layer)?) {
            (KvBuf::F32(k), KvBuf::F32(v)) => HostKv::F32(SeqKv { k, v, block_table: &s.table, block_size: bs, len }),
            (KvBuf::F16(k), KvBuf::F16(v)) => {
                HostKv::F16(SeqKv { k: k.reinterpret_cast(), v: v.reinterpret_cast(), block_table: &s.table, block_size: bs, len })
            }
            _ => return None,
        })
    }

    fn truncate(&mut self, seq: SeqId, len: usize) -> deco_model::Result<()> {
        let bs = self.shape.block_size;
        let s = self.seqs.get_mut(&seq).ok_or_else(|| model_err(Error::UnknownSequence(seq)))?;
        if len > s.len {
            return Err(deco_model::Error::InvalidInput(format!(
                "cannot truncate sequence {seq} of {} tokens to {len}",
                s.len
            )));
        }
        s.len = len;
        s.tokens.truncate(len);
        s.hashes.truncate(len / bs);
        let keep = len.div_ceil(bs);
        let dropped: Vec<BlockId> = s.table.drain(keep..).collect();
        for b in dropped.into_iter().rev() {
            self.pool.free(b).map_err(model_err)?;
        }
        Ok(())
    }

    fn keep_rows(&mut self, seq: SeqId, start: usize, rows: &[usize]) -> deco_model::Result<()> {
        let (bs, tf) = (self.shape.block_size, self.token_floats());
        let s = self.seqs.get(&seq).ok_or_else(|| model_err(Error::UnknownSequence(seq)))?;
        let increasing = rows.windows(2).all(|w| w[0] < w[1]);
        if !increasing || rows.last().is_some_and(|&r| start + r >= s.len) {
            return Err(deco_model::Error::InvalidInput(format!(
                "cannot keep tree rows {rows:?} after position {start} of sequence {seq} ({} tokens)",
                s.len
            )));
        }
        // Slot (flat token index in the layer buffers) of position `p`.
        let slot = |p: usize| s.table[p / bs] as usize * bs + p % bs;
        let moves: Vec<(usize, usize)> = rows.iter().enumerate().filter(|&(i, &r)| r != i).map(|(i, &r)| (slot(start + r), slot(start + i))).collect();
        // The destinations lie in blocks this sequence wrote in the tree's forward (positions
        // `start ..`): exclusive to it (copy-on-write ran when they were reserved).
        if self.on_device() {
            for t in self.dk.iter_mut().chain(self.dv.iter_mut()) {
                for &(src, dst) in &moves {
                    let row = t.clone().slice([src..src + 1, 0..tf]).add_scalar(0.0);
                    assign_rows(t, dst, row);
                }
            }
        } else {
            for buf in self.k.iter_mut().chain(self.v.iter_mut()) {
                for &(src, dst) in &moves {
                    buf.copy_within(src * tf..(src + 1) * tf, dst * tf);
                }
            }
        }
        KvCache::truncate(self, seq, start + rows.len())
    }

    fn remove(&mut self, seq: SeqId) {
        // A double free here is a bookkeeping bug; the pool refused it, so nothing leaked.
        let _ = self.free_seq(seq);
    }
}
