//! Logits through the paged KV cache equal those through `DenseKvCache` (within 1e-4) on
//! SmolLM2-135M: batched ragged forwards with chunked prefill, copy-on-write forks, prefix-cache
//! reuse, and every block free at the end.

use burn::tensor::Device;
use deco_formats::checkpoint::Checkpoint;
use deco_model::{DenseKvCache, KvCache, Llama, LogitsWanted, SeqInput};
use deco_serve::{CacheShape, PagedKvCache};
use deco_tests::{argmax, max_abs_diff};

/// Logits of the last token after feeding `tokens` one forward at a time through a dense cache
/// (prompt at once, then each later token alone): the reference path of `deco generate`.
fn dense_last_logits(model: &Llama, prompt: &[u32], later: &[u32]) -> Vec<Vec<f32>> {
    let mut cache = DenseKvCache::new(model.num_layers());
    let mut out = Vec::new();
    let o = model.forward(&[SeqInput { seq: 0, tokens: prompt, tree: None }], &mut cache, LogitsWanted::Last).expect("dense prefill");
    out.push(o.logits_rows().expect("rows").remove(0));
    for t in later {
        let o = model.forward(&[SeqInput { seq: 0, tokens: std::slice::from_ref(t), tree: None }], &mut cache, LogitsWanted::Last).expect("dense decode");
        out.push(o.logits_rows().expect("rows").remove(0));
    }
    out
}

#[test]
fn paged_logits_equal_dense_logits() {
    let device = Device::default();
    let ckpt = Checkpoint::open(deco_tests::smollm2_gguf()).expect("open model");
    let model = Llama::load(&ckpt, &device, Some(512)).expect("load model");
    let cfg = &model.config;
    let shape = CacheShape { n_layers: model.num_layers(), kv_heads: cfg.num_key_value_heads, head_dim: cfg.head_dim, block_size: 4, num_blocks: 64 };
    let mut paged = PagedKvCache::new(shape, &device).expect("cache");

    let prompts: [&[u32]; 3] = [
        &[504, 3575, 282, 4649, 314],
        &[6403, 1980, 253, 655, 28, 665, 436, 253, 1838, 8085, 3365, 11026, 100, 617],
        &[2068, 325, 28, 355, 441, 288, 325, 28, 338, 314, 260, 1962, 42],
    ];
    // Chunked prefill: all three sequences advance together, at most 6 prompt tokens each per
    // step, so steps mix sequences at different positions.
    let mut done = [0usize; 3];
    let mut last_rows: [Vec<f32>; 3] = Default::default();
    while done.iter().zip(&prompts).any(|(d, p)| *d < p.len()) {
        let chunks: Vec<(usize, &[u32])> = (0..3)
            .filter(|&i| done[i] < prompts[i].len())
            .map(|i| (i, &prompts[i][done[i]..(done[i] + 6).min(prompts[i].len())]))
            .collect();
        for (i, c) in &chunks {
            paged.record_tokens(*i as u64, c);
        }
        let inputs: Vec<SeqInput<'_>> = chunks.iter().map(|(i, c)| SeqInput { seq: *i as u64, tokens: c, tree: None }).collect();
        let rows = model.forward(&inputs, &mut paged, LogitsWanted::Last).expect("paged forward").logits_rows().expect("rows");
        for ((i, c), row) in chunks.iter().zip(rows) {
            done[*i] += c.len();
            last_rows[*i] = row;
        }
    }
    // Greedy decode 4 steps, all three in one batch; compare every step with the dense path.
    let mut generated: [Vec<u32>; 3] = Default::default();
    let mut paged_rows: [Vec<Vec<f32>>; 3] = [vec![last_rows[0].clone()], vec![last_rows[1].clone()], vec![last_rows[2].clone()]];
    for _ in 0..4 {
        let next: Vec<u32> = (0..3).map(|i| argmax(paged_rows[i].last().expect("row"))).collect();
        for i in 0..3 {
            generated[i].push(next[i]);
        }
        let inputs: Vec<SeqInput<'_>> = (0..3).map(|i| SeqInput { seq: i as u64, tokens: std::slice::from_ref(&next[i]), tree: None }).collect();
        let rows = model.forward(&inputs, &mut paged, LogitsWanted::Last).expect("paged decode").logits_rows().expect("rows");
        for (i, row) in rows.into_iter().enumerate() {
            paged_rows[i].push(row);
        }
    }
    for i in 0..3 {
        let dense = dense_last_logits(&model, prompts[i], &generated[i]);
        for (step, (p, d)) in paged_rows[i].iter().zip(&dense).enumerate() {
            let diff = max_abs_diff(p, d);
            assert!(diff < 1e-4, "sequence {i} step {step}: paged vs dense max |diff| {diff}");
        }
    }
    paged.check_consistency().expect("consistent");

    // Copy-on-write fork: seq 10 shares seq 0's blocks (its last block is partial: 9 tokens in
    // blocks of 4), then both decode different tokens.
    paged.fork(0, 10).expect("fork");
    let shared_before = paged.pool().num_used();
    let (ta, tb) = (198u32, 216u32);
    let rows = model
        .forward(&[SeqInput { seq: 0, tokens: &[ta], tree: None }, SeqInput { seq: 10, tokens: &[tb], tree: None }], &mut paged, LogitsWanted::Last)
        .expect("fork decode")
        .logits_rows()
        .expect("rows");
    assert_eq!(paged.pool().num_used(), shared_before + 1, "exactly one block copied on write");
    let mut hist_a = generated[0].clone();
    hist_a.push(ta);
    let mut hist_b = generated[0].clone();
    hist_b.push(tb);
    let da = dense_last_logits(&model, prompts[0], &hist_a);
    let db = dense_last_logits(&model, prompts[0], &hist_b);
    assert!(max_abs_diff(&rows[0], da.last().expect("row")) < 1e-4, "fork parent differs from dense");
    assert!(max_abs_diff(&rows[1], db.last().expect("row")) < 1e-4, "fork child differs from dense");

    // Prefix cache: a new sequence with seq 1's prompt reuses its full blocks (14 tokens: 3
    // blocks of 4, the last token is always computed).
    let cached = paged.attach_prefix(20, prompts[1]).expect("attach");
    assert_eq!(cached, 12);
    paged.record_tokens(20, &prompts[1][cached..]);
    let rows = model
        .forward(&[SeqInput { seq: 20, tokens: &prompts[1][cached..], tree: None }], &mut paged, LogitsWanted::Last)
        .expect("prefix forward")
        .logits_rows()
        .expect("rows");
    let dense = dense_last_logits(&model, prompts[1], &[]);
    let diff = max_abs_diff(&rows[0], &dense[0]);
    assert!(diff < 1e-4, "prefix-cached logits differ from dense by {diff}");

    paged.check_consistency().expect("consistent");
    for s in [0, 1, 2, 10, 20] {
        paged.remove(s);
    }
    assert_eq!(paged.pool().num_used(), 0, "blocks leaked");
    assert_eq!(paged.seq_len(0), 0);
}
