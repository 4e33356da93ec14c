//! Fidelity of the SmolLM2-135M-Instruct forward pass against an independent float64 reference.
//!
//! The reference (`golden/smollm2-135m-instruct.{json,safetensors}`) is a numpy float64 forward
//! pass on the GGUF's weights dequantized by llama.cpp's gguf-py; it shares no code with deco.

use std::sync::OnceLock;

use burn::tensor::Device;
use deco_formats::checkpoint::Checkpoint;
use deco_model::{DenseKvCache, KvCache, Llama, LogitsWanted, SeqInput};
use deco_tests::{argmax, golden, ids, max_abs_diff, smollm2_gguf};

/// Max-abs logit error allowed against the float64 reference (issue: 2e-3).
const LOGIT_TOL: f32 = 2e-3;
/// Max-abs difference allowed between cached incremental and full-recompute logits.
const KV_TOL: f32 = 1e-4;
/// Greedy steps are compared up to the first whose reference top1-top2 margin is below this.
const MARGIN_CUTOFF: f64 = 0.05;

fn model() -> &'static Llama {
    static M: OnceLock<Llama> = OnceLock::new();
    M.get_or_init(|| {
        let ckpt = Checkpoint::open(smollm2_gguf()).expect("open SmolLM2 GGUF");
        Llama::load(&ckpt, &Device::flex(), Some(2048)).expect("load SmolLM2")
    })
}

#[test]
fn last_position_logits_match_float64_reference() {
    let g = golden();
    let m = model();
    let mut worst = 0.0f32;
    for p in &g.prompts {
        let i = p["index"].as_u64().expect("index");
        let tokens = ids(&p["ids"]);
        let mut cache = DenseKvCache::new(m.config.num_hidden_layers);
        let out = m.forward(&[SeqInput { seq: 0, tokens: &tokens, tree: None }], &mut cache, LogitsWanted::Last).expect("forward");
        let got = out.logits_rows().expect("logits").remove(0);
        let (shape, want) = &g.tensors[&format!("prompt{i}.last_logits")];
        assert_eq!(shape, &vec![m.config.vocab_size]);
        let err = max_abs_diff(&got, want);
        eprintln!("prompt {i}: {} tokens, max |logit - ref| = {err:.3e}", tokens.len());
        worst = worst.max(err);
        assert!(err <= LOGIT_TOL, "prompt {i}: max abs logit error {err} > {LOGIT_TOL}");
    }
    eprintln!("worst max-abs logit error over all prompts: {worst:.3e}");
}

#[test]
fn all_position_logits_match_float64_reference() {
    let g = golden();
    let m = model();
    let tokens = ids(&g.prompts[0]["ids"]);
    let mut cache = DenseKvCache::new(m.config.num_hidden_layers);
    let out = m.forward(&[SeqInput { seq: 0, tokens: &tokens, tree: None }], &mut cache, LogitsWanted::All).expect("forward");
    let rows = out.logits_rows().expect("logits");
    let (shape, want) = &g.tensors["prompt0.all_logits"];
    assert_eq!(shape, &vec![tokens.len(), m.config.vocab_size]);
    let v = m.config.vocab_size;
    for (pos, row) in rows.iter().enumerate() {
        let err = max_abs_diff(row, &want[pos * v..(pos + 1) * v]);
        eprintln!("prompt 0 position {pos}: max |logit - ref| = {err:.3e}");
        assert!(err <= LOGIT_TOL, "position {pos}: max abs logit error {err} > {LOGIT_TOL}");
    }
}

#[test]
fn kv_cache_incremental_equals_full_recompute() {
    let g = golden();
    let m = model();
    // A longer sequence: prompt 2 plus its reference continuation.
    let mut tokens = ids(&g.prompts[2]["ids"]);
    tokens.extend(ids(&g.prompts[2]["greedy_continuation_ids"]));
    let v = m.config.vocab_size;

    let mut full_cache = DenseKvCache::new(m.config.num_hidden_layers);
    let full = m
        .forward(&[SeqInput { seq: 7, tokens: &tokens, tree: None }], &mut full_cache, LogitsWanted::All)
        .expect("full forward")
        .logits_rows()
        .expect("logits");

    // Incremental: a 5-token chunk, then a 3-token chunk, then one token at a time.
    let mut cache = DenseKvCache::new(m.config.num_hidden_layers);
    let mut pos = 0;
    let mut worst = 0.0f32;
    for chunk in [5usize, 3].into_iter().chain(std::iter::repeat(1)) {
        if pos >= tokens.len() {
            break;
        }
        let end = (pos + chunk).min(tokens.len());
        let out = m
            .forward(&[SeqInput { seq: 7, tokens: &tokens[pos..end], tree: None }], &mut cache, LogitsWanted::All)
            .expect("incremental forward")
            .logits_rows()
            .expect("logits");
        for (j, row) in out.iter().enumerate() {
            assert_eq!(row.len(), v);
            let err = max_abs_diff(row, &full[pos + j]);
            worst = worst.max(err);
            assert!(err <= KV_TOL, "position {}: cached vs full logits differ by {err} > {KV_TOL}", pos + j);
        }
        pos = end;
        assert_eq!(cache.seq_len(7), pos);
    }
    eprintln!("{} positions, worst |incremental - full| = {worst:.3e}", tokens.len());
}

/// Prefill and decode attention are the same fused kernel (a prefill token is a decode query
/// over the first `past + j + 1` positions) and the packed matmul is batch-invariant, so a
/// token's logits do not depend on how the sequence was cut into forwards: bit for bit.
#[test]
fn incremental_logits_equal_full_recompute_bit_for_bit() {
    let g = golden();
    let m = model();
    let mut tokens = ids(&g.prompts[2]["ids"]);
    tokens.extend(ids(&g.prompts[2]["greedy_continuation_ids"]));
    let logits = |chunks: &[usize]| {
        let mut cache = DenseKvCache::new(m.config.num_hidden_layers);
        let (mut rows, mut pos) = (Vec::new(), 0);
        for &c in chunks.iter().chain(std::iter::repeat(&1)) {
            if pos >= tokens.len() {
                break;
            }
            let end = (pos + c).min(tokens.len());
            let out = m
                .forward(&[SeqInput { seq: 3, tokens: &tokens[pos..end], tree: None }], &mut cache, LogitsWanted::All)
                .expect("forward")
                .logits_rows()
                .expect("logits");
            rows.extend(out.into_iter().map(|r| r.iter().map(|x| x.to_bits()).collect::<Vec<_>>()));
            pos = end;
        }
        rows
    };
    let full = logits(&[tokens.len()]);
    for cut in [&[5usize, 3][..], &[1], &[17, 2, 9]] {
        let inc = logits(cut);
        assert_eq!(inc.len(), full.len());
        for (p, (a, b)) in inc.iter().zip(&full).enumerate() {
            assert!(a == b, "chunks {cut:?}: position {p} differs from the full forward");
        }
    }
}

#[test]
fn batched_ragged_forward_equals_single_sequence_forward() {
    let g = golden();
    let m = model();
    let a = ids(&g.prompts[0]["ids"]);
    let b = ids(&g.prompts[3]["ids"]);
    let mut cache = DenseKvCache::new(m.config.num_hidden_layers);
    // Give sequence 2 some history first so the batch mixes positions.
    m.forward(&[SeqInput { seq: 2, tokens: &b[..4], tree: None }], &mut cache, LogitsWanted::Last).expect("warm-up");
    let out = m
        .forward(
            &[SeqInput { seq: 1, tokens: &a, tree: None }, SeqInput { seq: 2, tokens: &b[4..], tree: None }],
            &mut cache,
            LogitsWanted::Last,
        )
        .expect("batched forward")
        .logits_rows()
        .expect("logits");
    for (k, tokens) in [(0usize, &a), (1, &b)] {
        let mut c = DenseKvCache::new(m.config.num_hidden_layers);
        let single = m
            .forward(&[SeqInput { seq: 9, tokens, tree: None }], &mut c, LogitsWanted::Last)
            .expect("single forward")
            .logits_rows()
            .expect("logits")
            .remove(0);
        let err = max_abs_diff(&out[k], &single);
        assert!(err <= KV_TOL, "batch row {k}: differs from single-sequence forward by {err}");
    }
}

#[test]
fn greedy_continuation_matches_reference_until_first_near_tie() {
    let g = golden();
    let m = model();
    for p in &g.prompts {
        let i = p["index"].as_u64().expect("index");
        let prompt = ids(&p["ids"]);
        let want = ids(&p["greedy_continuation_ids"]);
        let margins: Vec<f64> =
            p["greedy_top1_minus_top2_margins"].as_array().expect("margins").iter().map(|x| x.as_f64().expect("margin")).collect();
        // Steps 0..=k where k is the first near-tie: step k's argmax may flip in f32, the earlier ones may not.
        let checked = margins.iter().position(|&mg| mg < MARGIN_CUTOFF).unwrap_or(want.len());
        let mut cache = DenseKvCache::new(m.config.num_hidden_layers);
        let mut next = prompt.clone();
        let mut got = Vec::new();
        for _ in 0..checked {
            let logits = m
                .forward(&[SeqInput { seq: 0, tokens: &next, tree: None }], &mut cache, LogitsWanted::Last)
                .expect("forward")
                .logits_rows()
                .expect("logits")
                .remove(0);
            let t = argmax(&logits);
            got.push(t);
            next = vec![t];
        }
        eprintln!("prompt {i}: {checked} greedy steps compared (first margin < {MARGIN_CUTOFF} at step {checked})");
        assert_eq!(got, want[..checked], "prompt {i}: greedy continuation differs");
    }
}
