//! Medusa decoding (Cai et al. 2024) on the real SmolLM2-135M-Instruct: tree attention against
//! causal forwards of each path, the kept path's keys and values, and the engine's Medusa machine
//! at temperature 0 against plain greedy decoding, token for token.

use std::sync::{Arc, OnceLock};

use burn::tensor::Device;
use deco_decoding::SamplingParams;
use deco_formats::checkpoint::Checkpoint;
use deco_formats::tokenizer::Tokenizer;
use deco_generate::{DraftHeads, MedusaTree, TypicalAcceptance};
use deco_model::{DenseKvCache, KvCache, Llama, LogitsWanted, SeqInput};
use deco_serve::{CacheShape, KvCacheDtype, PagedKvCache};
use deco_tests::smollm2_gguf;

fn model() -> &'static Llama {
    static M: OnceLock<Llama> = OnceLock::new();
    M.get_or_init(|| {
        let ckpt = Checkpoint::open(smollm2_gguf()).expect("open SmolLM2 GGUF");
        Llama::load(&ckpt, &Device::flex(), Some(1024)).expect("load SmolLM2")
    })
}

fn tokenizer() -> Arc<Tokenizer> {
    let g = deco_formats::gguf::GgufFile::open(smollm2_gguf()).expect("gguf");
    Arc::new(Tokenizer::from_gguf(&g).expect("tokenizer"))
}

fn paged(m: &Llama) -> PagedKvCache {
    paged_of(m, KvCacheDtype::F32)
}

fn paged_of(m: &Llama, dtype: KvCacheDtype) -> PagedKvCache {
    let c = &m.config;
    // Blocks of 4 tokens: the tree and the kept path cross block boundaries.
    let shape = CacheShape { n_layers: m.num_layers(), kv_heads: c.num_key_value_heads, head_dim: c.head_dim, block_size: 4, num_blocks: 64 };
    PagedKvCache::with_dtype(shape, dtype, m.device()).expect("cache")
}

/// Logits of the last token of `tokens`, by one causal forward from an empty cache.
fn causal_last(m: &Llama, tokens: &[u32]) -> Vec<f32> {
    let mut cache = DenseKvCache::new(m.num_layers());
    let out = m.forward(&[SeqInput { seq: 0, tokens, tree: None }], &mut cache, LogitsWanted::Last).expect("forward");
    out.logits_rows().expect("rows").remove(0)
}

/// Node `i`'s path in a token tree of `parents`, root first, `i` last.
fn path_of(parents: &[Option<usize>], i: usize) -> Vec<usize> {
    let (mut path, mut n) = (vec![i], i);
    while let Some(p) = parents[n] {
        path.push(p);
        n = p;
    }
    path.reverse();
    path
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Every node of a tree computed in one forward has the logits of a causal forward of the
/// prompt followed by its path, bit for bit; after keeping a non-contiguous path, the next token's logits
/// are those of the causal sequence.
#[test]
fn tree_forward_equals_causal_forward_of_each_path() {
    let m = model();
    let tok = tokenizer();
    let prompt = tok.encode("The three primary colors are red, yellow and", true).expect("encode");
    let extra = tok.encode(" blue, and the three secondary colors are green, purple and orange.", false).expect("encode");
    let mut cache = paged(m);
    m.forward(&[SeqInput { seq: 7, tokens: &prompt, tree: None }], &mut cache, LogitsWanted::Last).expect("prefill");
    let nodes: Vec<u32> = extra[..7].to_vec();
    let parents = [None, Some(0), Some(0), Some(1), Some(2), Some(3), Some(3)];
    let out = m.forward(&[SeqInput { seq: 7, tokens: &nodes, tree: Some(&parents) }], &mut cache, LogitsWanted::All).expect("tree forward");
    let rows = out.logits_rows().expect("rows");
    for (i, row) in rows.iter().enumerate() {
        let mut seq = prompt.clone();
        seq.extend(path_of(&parents, i).iter().map(|&j| nodes[j]));
        let want = causal_last(m, &seq);
        // The fused CPU attention reads the path's rows in causal order and the packed matmul
        // is batch-invariant: the node's logits are the causal forward's, bit for bit.
        let d = max_diff(row, &want);
        assert!(row == &want, "node {i} (path {:?}): max logit difference {d}", path_of(&parents, i));
    }
    // Keep the path 0 -> 1 -> 3 -> 6 (nodes 2, 4, 5 dropped in between), then one more token.
    let keep = [0, 1, 3, 6];
    cache.keep_rows(7, prompt.len(), &keep).expect("keep path");
    assert_eq!(cache.seq_len(7), prompt.len() + keep.len());
    let next = [extra[7]];
    let out = m.forward(&[SeqInput { seq: 7, tokens: &next, tree: None }], &mut cache, LogitsWanted::Last).expect("continue");
    let mut seq = prompt.clone();
    seq.extend(keep.iter().map(|&j| nodes[j]));
    seq.push(extra[7]);
    let d = max_diff(&out.logits_rows().expect("rows")[0], &causal_last(m, &seq));
    assert!(d < 2e-3, "after keeping the path: max logit difference {d}");
    // A malformed tree is refused, not run.
    let bad = [None, Some(1)];
    let err = m.forward(&[SeqInput { seq: 8, tokens: &nodes[..2], tree: Some(&bad) }], &mut cache, LogitsWanted::All).expect_err("must be refused");
    assert!(err.to_string().contains("does not precede"), "{err}");
    assert!(cache.keep_rows(7, prompt.len(), &[1, 0]).is_err());
}

/// A tree batched with another sequence's causal chunk in one forward (as the serving engine
/// schedules them): both get, bit for bit, the logits of causal forwards of their own.
#[test]
fn tree_batched_with_a_causal_chunk_equals_separate_forwards() {
    let m = model();
    let tok = tokenizer();
    let prompt_a = tok.encode("The three primary colors are red, yellow and", true).expect("encode");
    let prompt_b = tok.encode("def fibonacci(n):", true).expect("encode");
    let nodes: Vec<u32> = tok.encode(" blue, and the three secondary colors", false).expect("encode")[..4].to_vec();
    let parents = [None, Some(0), Some(0), Some(1)];
    let chunk: Vec<u32> = tok.encode("\n    if n < 2:", false).expect("encode")[..3].to_vec();
    let mut cache = paged(m);
    m.forward(&[SeqInput { seq: 1, tokens: &prompt_a, tree: None }], &mut cache, LogitsWanted::Last).expect("prefill a");
    m.forward(&[SeqInput { seq: 2, tokens: &prompt_b, tree: None }], &mut cache, LogitsWanted::Last).expect("prefill b");
    let inputs = [SeqInput { seq: 1, tokens: &nodes, tree: Some(&parents) }, SeqInput { seq: 2, tokens: &chunk, tree: None }];
    let rows = m.forward(&inputs, &mut cache, LogitsWanted::All).expect("batched forward").logits_rows().expect("rows");
    assert_eq!(rows.len(), nodes.len() + chunk.len());
    for (i, row) in rows[..nodes.len()].iter().enumerate() {
        let mut seq = prompt_a.clone();
        seq.extend(path_of(&parents, i).iter().map(|&j| nodes[j]));
        let want = causal_last(m, &seq);
        assert!(row == &want, "tree node {i}: max logit difference {}", max_diff(row, &want));
    }
    for (j, row) in rows[nodes.len()..].iter().enumerate() {
        let mut seq = prompt_b.clone();
        seq.extend(&chunk[..=j]);
        let want = causal_last(m, &seq);
        assert!(row == &want, "chunk token {j}: max logit difference {}", max_diff(row, &want));
    }
}

/// With an f16 paged cache (`--kv-cache-dtype f16`) the tree's nodes read the rounded keys and
/// values of their paths: each node's logits equal, bit for bit, those of a causal forward of
/// the prompt and its path through an f16 cache.
#[test]
fn tree_forward_through_an_f16_cache_equals_causal_forward() {
    let m = model();
    let tok = tokenizer();
    let prompt = tok.encode("The three primary colors are red, yellow and", true).expect("encode");
    let nodes: Vec<u32> = tok.encode(" blue, and the three secondary colors", false).expect("encode")[..5].to_vec();
    let parents = [None, Some(0), Some(0), Some(2), Some(1)];
    let mut cache = paged_of(m, KvCacheDtype::F16);
    m.forward(&[SeqInput { seq: 3, tokens: &prompt, tree: None }], &mut cache, LogitsWanted::Last).expect("prefill");
    let rows = m
        .forward(&[SeqInput { seq: 3, tokens: &nodes, tree: Some(&parents) }], &mut cache, LogitsWanted::All)
        .expect("tree forward")
        .logits_rows()
        .expect("rows");
    for (i, row) in rows.iter().enumerate() {
        let mut seq = prompt.clone();
        seq.extend(path_of(&parents, i).iter().map(|&j| nodes[j]));
        let mut causal = paged_of(m, KvCacheDtype::F16);
        let want = m
            .forward(&[SeqInput { seq: 0, tokens: &seq, tree: None }], &mut causal, LogitsWanted::Last)
            .expect("causal")
            .logits_rows()
            .expect("rows")
            .remove(0);
        assert!(row == &want, "node {i}: max logit difference {}", max_diff(row, &want));
    }
}

/// Heads that know the greedy continuation: the hidden state they are given is matched to the
/// nearest final hidden state of a causal forward over `prompt ++ greedy output`, and head `k`
/// puts the true token `k + 1` positions ahead at rank `ranks[k - 1]` (decoys above it), or
/// only decoys when the rank is `None`.
#[derive(Debug)]
struct OracleHeads {
    seq: Vec<u32>,
    hidden: Vec<Vec<f32>>,
    vocab: usize,
    ranks: Vec<Option<usize>>,
}

impl DraftHeads for OracleHeads {
    fn num_heads(&self) -> usize {
        self.ranks.len()
    }

    fn head_logits(&self, h: &[f32]) -> deco_generate::Result<Vec<Vec<f32>>> {
        let dist = |r: &Vec<f32>| r.iter().zip(h).map(|(a, b)| (a - b) * (a - b)).sum::<f32>();
        let p = (0..self.hidden.len()).min_by(|&a, &b| dist(&self.hidden[a]).total_cmp(&dist(&self.hidden[b]))).unwrap_or(0);
        Ok(self
            .ranks
            .iter()
            .enumerate()
            .map(|(k, rank)| {
                let mut l = vec![0.0f32; self.vocab];
                let target = self.seq.get(p + 2 + k).copied().unwrap_or(0) as usize;
                let rank = rank.unwrap_or(8);
                for r in 0..rank {
                    l[(target + 1 + r) % self.vocab] = 10.0 - r as f32;
                }
                if rank < 8 {
                    l[target] = 10.0 - rank as f32;
                }
                l
            })
            .collect())
    }
}

/// One request on the engine: its tokens and `[forwards, drafted, accepted]`.
fn run(prompt: &[u32], params: &SamplingParams, medusa: Option<deco_serve::MedusaSetting>) -> (Vec<u32>, [u64; 3]) {
    let config = deco_serve::EngineConfig { num_blocks: 256, block_size: 4, ..Default::default() };
    let options = deco_serve::EngineOptions { medusa, ..Default::default() };
    let (engine, join) = deco_serve::spawn_engine_opts(model().clone(), tokenizer(), config, options).expect("engine");
    let (_, mut rx) = engine.submit(deco_serve::GenerateRequest::sample(prompt.to_vec(), params.clone(), 1)).expect("submit");
    let mut out = Vec::new();
    loop {
        match rx.blocking_recv().expect("event") {
            deco_serve::EngineEvent::Delta { tokens, .. } => out.extend(tokens.iter().map(|t| t.id)),
            deco_serve::EngineEvent::Finished { .. } => break,
            deco_serve::EngineEvent::Failed(e) => panic!("generation failed: {e}"),
        }
    }
    let load = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    let c = [load(&engine.metrics.steps), load(&engine.metrics.spec_draft_tokens), load(&engine.metrics.spec_accepted_tokens)];
    drop((rx, engine));
    join.join().expect("engine thread");
    (out, c)
}

fn greedy(n: usize) -> SamplingParams {
    SamplingParams { temperature: Some(0.0), max_new_tokens: Some(n), seed: Some(0), ignore_eos: Some(true), ..Default::default() }
}

/// At temperature 0 the Medusa machine's output is greedy decoding's, token for token, whatever
/// the heads propose: with heads that know the continuation (several tokens accepted per
/// forward through non-contiguous tree nodes, whose keys and values are compacted) and with
/// heads that are always wrong.
#[test]
fn medusa_at_temperature_zero_equals_greedy() {
    let m = model();
    let tok = tokenizer();
    let prompt = tok.encode("Once upon a time, in a small village by the sea, there lived", true).expect("encode");
    let params = greedy(40);
    let (reference, _) = run(&prompt, &params, None);
    assert!(reference.len() >= 20, "greedy gave {} tokens", reference.len());
    let mut seq = prompt.clone();
    seq.extend(&reference);
    let mut cache = DenseKvCache::new(m.num_layers());
    let out = m.forward(&[SeqInput { seq: 0, tokens: &seq, tree: None }], &mut cache, LogitsWanted::All).expect("forward");
    let hidden = deco_model::host::to_host_rows(out.hidden).expect("hidden");
    // Head 1's true token at rank 1 (node [1]), heads 2-4 at rank 0: the accepted path runs
    // through nodes 2, 4, 5, 6 of the tree below, skipping the others.
    let choices = vec![vec![0], vec![1], vec![0, 0], vec![1, 0], vec![1, 0, 0], vec![1, 0, 0, 0], vec![1, 0, 1]];
    for (ranks, min_mean) in [(vec![Some(1), Some(0), Some(0), Some(0)], 3.5), (vec![None, None, None, None], 0.0)] {
        let heads = OracleHeads { seq: seq.clone(), hidden: hidden.clone(), vocab: m.config.vocab_size, ranks: ranks.clone() };
        let setting = deco_serve::MedusaSetting {
            heads: Arc::new(heads),
            tree: MedusaTree::new(&choices, 4).expect("tree"),
            acceptance: TypicalAcceptance::default(),
        };
        let (got, [steps, _, accepted]) = run(&prompt, &params, Some(setting));
        assert_eq!(got, reference, "heads with ranks {ranks:?}");
        let rounds = steps - 1;
        let mean = (accepted + rounds) as f64 / rounds as f64;
        assert!(mean >= min_mean, "ranks {ranks:?}: mean accepted length {mean:.2} over {rounds} tree forwards");
        if min_mean == 0.0 {
            assert_eq!(accepted, 0, "wrong heads had candidates accepted");
        }
    }
}

/// Sampling with Medusa is reproducible under a seed, and a tree deeper than the heads or a
/// request for two choices is refused with a message.
#[test]
fn medusa_sampling_is_seeded_and_bad_settings_are_refused() {
    let m = model();
    let tok = tokenizer();
    let prompt = tok.encode("Once upon a time", true).expect("encode");
    let heads = || OracleHeads { seq: vec![], hidden: vec![vec![0.0; m.config.hidden_size]], vocab: m.config.vocab_size, ranks: vec![Some(0), Some(1)] };
    let setting = || deco_serve::MedusaSetting {
        heads: Arc::new(heads()),
        tree: MedusaTree::new(&deco_generate::medusa::choices_up_to(deco_generate::medusa::SMALL_TREE, 2), 2).expect("tree"),
        acceptance: TypicalAcceptance::default(),
    };
    let params = SamplingParams { temperature: Some(0.8), top_p: Some(0.9), max_new_tokens: Some(24), seed: Some(7), ..Default::default() };
    let (a, _) = run(&prompt, &params, Some(setting()));
    let (b, _) = run(&prompt, &params, Some(setting()));
    assert_eq!(a, b);
    assert!(!a.is_empty());

    let err = MedusaTree::new(&[vec![0], vec![0, 0, 0]], 2).expect_err("must be refused").to_string();
    assert!(err.contains("parent") || err.contains("heads"), "{err}");
    let err = MedusaTree::new(&[vec![0], vec![0, 0], vec![0, 0, 0]], 2).expect_err("must be refused").to_string();
    assert!(err.contains("needs 3 heads"), "{err}");

    let config = deco_serve::EngineConfig { num_blocks: 64, ..Default::default() };
    let options = deco_serve::EngineOptions { medusa: Some(setting()), ..Default::default() };
    let (engine, join) = deco_serve::spawn_engine_opts(m.clone(), tokenizer(), config, options).expect("engine");
    let req = deco_serve::GenerateRequest::with_strategy(prompt.clone(), params.clone(), 2, deco_serve::Strategy::Medusa);
    let err = engine.submit(req).expect_err("must be refused").to_string();
    assert!(err.contains("one choice"), "{err}");
    drop(engine);
    join.join().expect("engine thread");
}
