//! Property tests of the paged KV cache and its block pool: random sequences of new sequences
//! (with prefix-cache lookups), appends, forks (copy-on-write), truncations and removals never
//! leak or double-free blocks, keep reference counts equal to the block-table references, and
//! always return exactly the keys/values a plain per-sequence vector holds.

use std::collections::HashMap;

use burn::tensor::{Device, Tensor, TensorData};
use deco_model::KvCache;
use deco_serve::{CacheShape, PagedKvCache};
use proptest::prelude::*;

const LAYERS: usize = 2;
const HEADS: usize = 1;
const DIM: usize = 2;

/// Key value of position `p` given all tokens up to it (like a real model: depends on the whole
/// prefix), so that prefix-cache reuse is only correct if the prefix really matches.
fn key_of(prefix: &[u32], layer: usize) -> [f32; DIM] {
    let mut h: u64 = 1469598103934665603;
    for &t in prefix {
        h = (h ^ u64::from(t)).wrapping_mul(1099511628211);
    }
    let a = (h % 10007) as f32 / 10007.0 + layer as f32;
    [a, -a * 0.5 + prefix.len() as f32]
}

#[derive(Debug, Clone)]
enum Op {
    New(Vec<u32>),
    Append(usize, Vec<u32>),
    Fork(usize),
    Truncate(usize, usize),
    Remove(usize),
}

fn op() -> impl Strategy<Value = Op> {
    let toks = |n| proptest::collection::vec(0u32..3, 1..n);
    prop_oneof![
        toks(10).prop_map(Op::New),
        (any::<usize>(), toks(6)).prop_map(|(s, t)| Op::Append(s, t)),
        any::<usize>().prop_map(Op::Fork),
        (any::<usize>(), any::<usize>()).prop_map(|(s, l)| Op::Truncate(s, l)),
        any::<usize>().prop_map(Op::Remove),
    ]
}

fn append(cache: &mut PagedKvCache, dev: &Device, seq: u64, all: &[u32], new: &[u32]) -> Result<bool, TestCaseError> {
    let start = cache.seq_len(seq);
    if cache.reserve(seq, start + new.len()).is_err() {
        return Ok(false);
    }
    cache.record_tokens(seq, new);
    for layer in 0..LAYERS {
        let mut k = Vec::new();
        for i in 0..new.len() {
            k.extend(key_of(&all[..start + i + 1], layer));
        }
        let v: Vec<f32> = k.iter().map(|x| -x).collect();
        let n = new.len();
        let kt = Tensor::from_data(TensorData::new(k, [n, HEADS, DIM]), dev);
        let vt = Tensor::from_data(TensorData::new(v, [n, HEADS, DIM]), dev);
        let (ka, va) = cache.append(layer, seq, kt, vt).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let ka: Vec<f32> = ka.try_into_vec_as::<f32>().map_err(|e| TestCaseError::fail(format!("{e:?}")))?;
        let va: Vec<f32> = va.try_into_vec_as::<f32>().map_err(|e| TestCaseError::fail(format!("{e:?}")))?;
        let mut want = Vec::new();
        for p in 0..start + n {
            want.extend(key_of(&all[..p + 1], layer));
        }
        prop_assert_eq!(&ka, &want, "keys of seq {} layer {}", seq, layer);
        prop_assert_eq!(va, want.iter().map(|x| -x).collect::<Vec<_>>());
    }
    cache.advance(seq, new.len());
    Ok(true)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, .. ProptestConfig::default() })]
    #[test]
    fn random_ops_never_leak_and_keep_data(block_size in 1usize..5, num_blocks in 4usize..16, ops in proptest::collection::vec(op(), 1..40)) {
        let dev = Device::default();
        let shape = CacheShape { n_layers: LAYERS, kv_heads: HEADS, head_dim: DIM, block_size, num_blocks };
        let mut cache = PagedKvCache::new(shape, &dev).map_err(|e| TestCaseError::fail(e.to_string()))?;
        // Reference: the committed tokens of each live sequence.
        let mut seqs: HashMap<u64, Vec<u32>> = HashMap::new();
        let mut next = 1u64;
        let pick = |seqs: &HashMap<u64, Vec<u32>>, i: usize| -> Option<u64> {
            let mut ids: Vec<u64> = seqs.keys().copied().collect();
            ids.sort_unstable();
            (!ids.is_empty()).then(|| ids[i % ids.len()])
        };
        for op in ops {
            match op {
                Op::New(prompt) => {
                    let id = next;
                    next += 1;
                    let cached = cache.attach_prefix(id, &prompt).map_err(|e| TestCaseError::fail(e.to_string()))?;
                    prop_assert!(cached < prompt.len() && cached % block_size == 0);
                    if append(&mut cache, &dev, id, &prompt, &prompt[cached..])? {
                        seqs.insert(id, prompt);
                    } else {
                        cache.free_seq(id).map_err(|e| TestCaseError::fail(e.to_string()))?;
                    }
                }
                Op::Append(i, toks) => {
                    if let Some(id) = pick(&seqs, i) {
                        let mut all = seqs[&id].clone();
                        all.extend(&toks);
                        if append(&mut cache, &dev, id, &all, &toks)? {
                            seqs.insert(id, all);
                        }
                    }
                }
                Op::Fork(i) => {
                    if let Some(id) = pick(&seqs, i) {
                        let child = next;
                        next += 1;
                        cache.fork(id, child).map_err(|e| TestCaseError::fail(e.to_string()))?;
                        let toks = seqs[&id].clone();
                        seqs.insert(child, toks);
                    }
                }
                Op::Truncate(i, l) => {
                    if let Some(id) = pick(&seqs, i) {
                        let len = l % (seqs[&id].len() + 1);
                        cache.truncate(id, len).map_err(|e| TestCaseError::fail(e.to_string()))?;
                        if let Some(t) = seqs.get_mut(&id) {
                            t.truncate(len);
                        }
                    }
                }
                Op::Remove(i) => {
                    if let Some(id) = pick(&seqs, i) {
                        cache.remove(id);
                        seqs.remove(&id);
                    }
                }
            }
            cache.check_consistency().map_err(|e| TestCaseError::fail(e.to_string()))?;
            for (id, toks) in &seqs {
                prop_assert_eq!(cache.seq_len(*id), toks.len());
                prop_assert_eq!(cache.block_table(*id).len(), toks.len().div_ceil(block_size));
            }
            let distinct: std::collections::HashSet<u32> = seqs.keys().flat_map(|id| cache.block_table(*id).to_vec()).collect();
            prop_assert_eq!(cache.pool().num_used(), distinct.len());
        }
        let ids: Vec<u64> = seqs.keys().copied().collect();
        for id in ids {
            cache.remove(id);
        }
        prop_assert_eq!(cache.pool().num_used(), 0);
        prop_assert_eq!(cache.pool().num_free(), num_blocks);
        cache.check_consistency().map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
}
