//! The scheduler with a token tree pending (Medusa's candidates, `Scheduler::set_tree`): the
//! tree is one chunk of its own, never split across steps and never merged with the tokens
//! before it; a sequence preempted with its tree pending recomputes the tokens before the tree
//! first (the prefix cache is only asked about them); keeping a path leaves its tokens computed;
//! the tree's keys never enter the prefix cache.

use burn::tensor::{Device, Tensor, TensorData};
use deco_model::KvCache;
use deco_serve::{CacheShape, PagedKvCache, Scheduler, SchedulerConfig};

fn cache(num_blocks: usize) -> PagedKvCache {
    PagedKvCache::new(CacheShape { n_layers: 1, kv_heads: 1, head_dim: 2, block_size: 4, num_blocks }, &Device::flex()).expect("cache")
}

/// Computes a chunk the way the engine does: records the tokens (not for a tree) and appends
/// keys `[position tag, token]` per new token.
fn compute(cache: &mut PagedKvCache, sched: &mut Scheduler, seq: u64, start: usize, tokens: &[u32], tree: bool) {
    if !tree {
        cache.record_tokens(seq, tokens);
    }
    let n = tokens.len();
    let vals: Vec<f32> = tokens.iter().enumerate().flat_map(|(i, &t)| [(start + i) as f32, t as f32]).collect();
    let k = Tensor::<3>::from_data(TensorData::new(vals, [n, 1, 2]), &Device::flex());
    cache.append(0, seq, k.clone(), k).expect("append");
    cache.advance(seq, n);
    sched.computed(seq, n);
}

#[test]
fn a_tree_is_one_chunk_and_keeping_a_path_compacts_it() {
    let mut c = cache(16);
    let mut s = Scheduler::new(SchedulerConfig { max_num_seqs: 4, max_num_batched_tokens: 6 });
    let prompt: Vec<u32> = (100..110).collect();
    s.add(1, prompt.clone());
    // Prefill in chunks of the budget.
    while s.get(1).is_none_or(|q| q.num_computed < prompt.len()) {
        let plan = s.schedule(&mut c);
        let ch = &plan.chunks[0];
        assert!(ch.tree.is_none());
        compute(&mut c, &mut s, 1, ch.start, &ch.tokens, false);
    }
    // A tree of 5 nodes (the engine refuses trees over the step budget).
    let nodes = [200u32, 201, 202, 203, 204];
    let parents = vec![None, Some(0), Some(0), Some(1), Some(2)];
    assert!(s.set_tree(1, &nodes, parents.clone()));
    assert!(!s.set_tree(1, &nodes, parents.clone()), "a second pending tree is refused");
    let plan = s.schedule(&mut c);
    assert_eq!(plan.chunks.len(), 1);
    let ch = &plan.chunks[0];
    assert_eq!((ch.start, ch.tokens.as_slice(), ch.tree.as_deref()), (10, &nodes[..], Some(&parents[..])));
    compute(&mut c, &mut s, 1, ch.start, &ch.tokens, true);
    // Keep root -> node 2 -> node 4.
    let (start, kept) = s.keep_tree_path(1, &[0, 2, 4]).expect("keep");
    assert_eq!((start, kept.as_slice()), (10, &[200u32, 202, 204][..]));
    c.keep_rows(1, start, &[0, 2, 4]).expect("keep rows");
    c.record_computed(1, &kept);
    let q = s.get(1).expect("seq");
    assert_eq!(q.tokens.len(), 13);
    assert_eq!(q.num_computed, 13);
    assert!(q.tree.is_none());
    assert_eq!(c.seq_len(1), 13);
    // The kept keys moved: position 11 holds node 2's key (written at position 12), position 12
    // node 4's (written at 14).
    let (k, _) = c.append(0, 1, Tensor::<3>::zeros([1, 1, 2], &Device::flex()), Tensor::<3>::zeros([1, 1, 2], &Device::flex())).expect("gather");
    let k = k.into_data().try_to_vec::<f32>().expect("f32");
    assert_eq!(&k[20..26], &[10.0, 200.0, 12.0, 202.0, 14.0, 204.0]);
    c.check_consistency().expect("consistent pool");
}

#[test]
fn a_tree_waits_for_budget_and_a_preempted_sequence_recomputes_before_it() {
    let mut c = cache(16);
    let mut s = Scheduler::new(SchedulerConfig { max_num_seqs: 4, max_num_batched_tokens: 8 });
    let prompt: Vec<u32> = (100..106).collect();
    s.add(1, prompt.clone());
    let plan = s.schedule(&mut c);
    compute(&mut c, &mut s, 1, 0, &plan.chunks[0].tokens, false);
    // With another sequence admitted in the same step, the tree (5 nodes) still goes whole.
    s.add(2, (300..307).collect());
    assert!(s.set_tree(1, &[1, 2, 3, 4, 5], vec![None, Some(0), Some(1), Some(1), Some(0)]));
    let plan = s.schedule(&mut c);
    for ch in &plan.chunks {
        if ch.seq == 1 {
            assert_eq!(ch.tokens.len(), 5, "the tree is scheduled whole or not at all");
        }
    }
    // Preempt sequence 1 by hand through its blocks: free and requeue as the scheduler does
    // when blocks run out, then check the next chunk stops at the tree's start.
    let _ = c.free_seq(1);
    let mut q = s.get(1).expect("seq").clone();
    s.remove(1, &mut c);
    q.num_computed = 0;
    let tree = q.tree.clone().expect("pending tree");
    s.add_running(q);
    let plan = s.schedule(&mut c);
    let ch = plan.chunks.iter().find(|ch| ch.seq == 1).expect("sequence 1 scheduled");
    assert!(ch.tree.is_none());
    assert!(ch.start + ch.tokens.len() <= tree.start, "a recompute chunk ran into the tree");
}
