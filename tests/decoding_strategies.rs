//! Decoding strategies on the real SmolLM2-135M-Instruct model.

use std::sync::OnceLock;

use burn::tensor::Device;
use deco_decoding::SamplingParams;
use deco_formats::checkpoint::Checkpoint;
use deco_formats::tokenizer::Tokenizer;
use deco_generate::*;
use deco_model::Llama;
use deco_tests::smollm2_gguf;

fn model() -> &'static Llama {
    static M: OnceLock<Llama> = OnceLock::new();
    M.get_or_init(|| {
        let ckpt = Checkpoint::open(smollm2_gguf()).expect("open SmolLM2 GGUF");
        Llama::load(&ckpt, &Device::flex(), Some(1024)).expect("load SmolLM2")
    })
}

fn tokens(text: &str) -> Vec<u32> {
    let g = deco_formats::gguf::GgufFile::open(smollm2_gguf()).expect("gguf");
    Tokenizer::from_gguf(&g).expect("tokenizer").encode(text, true).expect("encode")
}

fn greedy(max_new: usize) -> SamplingParams {
    SamplingParams { temperature: Some(0.0), max_new_tokens: Some(max_new), seed: Some(0), ..Default::default() }
}


/// One request on the serving engine (the decode loop of `deco generate` and `deco serve`):
/// each choice's token ids (an end token not included) and cumulative log-probability, and the
/// engine's counters (forward passes, speculative draft tokens / accepted).
fn on_engine(prompt: &[u32], params: &SamplingParams, n: usize, strategy: Option<deco_serve::Strategy>, draft: Option<deco_serve::DraftModel>) -> (Vec<(Vec<u32>, f64)>, [u64; 3]) {
    let g = deco_formats::gguf::GgufFile::open(smollm2_gguf()).expect("gguf");
    let tok = std::sync::Arc::new(Tokenizer::from_gguf(&g).expect("tokenizer"));
    let config = deco_serve::EngineConfig { num_blocks: 256, ..Default::default() };
    let options = deco_serve::EngineOptions { draft, ..Default::default() };
    let (engine, join) = deco_serve::spawn_engine_opts(model().clone(), tok, config, options).expect("engine");
    let req = deco_serve::GenerateRequest { strategy, ..deco_serve::GenerateRequest::sample(prompt.to_vec(), params.clone(), n) };
    let (_, mut rx) = engine.submit(req).expect("submit");
    let mut out = vec![(Vec::new(), f64::NAN); n];
    let mut finished = 0;
    while finished < n {
        match rx.blocking_recv().expect("event") {
            deco_serve::EngineEvent::Delta { index, tokens, .. } => out[index].0.extend(tokens.iter().map(|t| t.id)),
            deco_serve::EngineEvent::Finished { index, cumulative_logprob, .. } => {
                out[index].1 = cumulative_logprob.unwrap_or(f64::NAN);
                finished += 1;
            }
            deco_serve::EngineEvent::Failed(e) => panic!("generation failed: {e}"),
        }
    }
    let load = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    let counters = [load(&engine.metrics.steps), load(&engine.metrics.spec_draft_tokens), load(&engine.metrics.spec_accepted_tokens)];
    drop((rx, engine));
    join.join().expect("engine thread");
    (out, counters)
}

/// Beam search on the engine.
fn beam_on_engine(prompt: &[u32], params: &SamplingParams, beam: BeamSearchParams) -> (Vec<(Vec<u32>, f64)>, u64) {
    let (out, c) = on_engine(prompt, params, beam.num_return_sequences, Some(deco_serve::Strategy::Beam(beam)), None);
    (out, c[0])
}

/// Speculative decoding on the engine: the tokens and `[target forwards, drafted, accepted]`.
fn speculative_on_engine(prompt: &[u32], params: &SamplingParams, gamma: usize, draft_layers: Option<usize>) -> (Vec<u32>, [u64; 3]) {
    let (source, draft) = match draft_layers {
        Some(k) => (DraftSource::Model, Some(deco_serve::DraftModel { model: model().clone(), num_layers: k })),
        None => (DraftSource::PromptLookup(PromptLookupDrafter::default()), None),
    };
    let strategy = deco_serve::Strategy::Speculative { num_speculative_tokens: gamma, source, schedule: DraftSchedule::Constant };
    let (mut out, c) = on_engine(prompt, params, 1, Some(strategy), draft);
    (out.remove(0).0, c)
}

/// Greedy (or sampled) decoding on the engine.
fn sample_on_engine(prompt: &[u32], params: &SamplingParams) -> Vec<u32> {
    on_engine(prompt, params, 1, None, None).0.remove(0).0
}

/// Beam search served by the engine: its best sequence scores at least greedy's, its second is
/// not better than its first, and its reported log-probability is the model's (re-scored with one
/// forward, independently of the engine's cache forks).
#[test]
fn beam_search_sequence_logprob_is_at_least_greedys() {
    let m = model();
    let prompt = tokens("The capital of France is");
    // EOS blocked for the 8 tokens, so both searches compare 8-token continuations.
    let params = SamplingParams { min_new_tokens: Some(8), ..greedy(8) };
    // Sum of log-probabilities of `tokens` after the prompt, from one forward over both.
    let rescore = |tokens: &[u32]| -> f64 {
        let full: Vec<u32> = prompt.iter().chain(tokens).copied().collect();
        let mut cache = deco_model::DenseKvCache::new(m.num_layers());
        let rows = m.forward(&[deco_model::SeqInput { seq: 0, tokens: &full, tree: None }], &mut cache, deco_model::LogitsWanted::All).expect("fwd").logits_rows().expect("rows");
        tokens.iter().enumerate().map(|(i, &t)| f64::from(deco_decoding::math::log_softmax(&rows[prompt.len() - 1 + i])[t as usize])).sum()
    };
    let greedy_lp = rescore(&sample_on_engine(&prompt, &params));
    let beam = BeamSearchParams { num_beams: 4, length_penalty: 0.0, early_stopping: EarlyStopping::Never, num_return_sequences: 2 };
    let (out, _) = beam_on_engine(&prompt, &params, beam);
    let (best, best_lp) = &out[0];
    assert_eq!(best.len(), 8);
    assert!(*best_lp >= greedy_lp - 1e-4, "beam {best_lp} < greedy {greedy_lp}");
    assert!(out[1].1 <= *best_lp);
    // The reported sum is the model's: re-score the beam's tokens with one forward.
    let rescored = rescore(best);
    assert!((rescored - best_lp).abs() < 1e-2, "{rescored} vs {best_lp}");
}

/// Speculative decoding on the engine, with the model's first 10 layers as the draft (the
/// engine's draft model and its own paged cache) and with prompt lookup, equals greedy decoding
/// token for token at T = 0.
#[test]
fn speculative_at_temperature_zero_equals_greedy() {
    let prompt = tokens("<|im_start|>user\nList the days of the week.<|im_end|>\n<|im_start|>assistant\n");
    let params = greedy(24);
    let g = sample_on_engine(&prompt, &params);
    let (spec, [_, drafted, accepted]) = speculative_on_engine(&prompt, &params, 4, Some(10));
    assert_eq!(spec, g);
    assert!(drafted > 0 && accepted <= drafted);
    let (spec, _) = speculative_on_engine(&prompt, &params, 4, None);
    assert_eq!(spec, g);
}

/// Contrastive search on the engine (the candidates are forks of the sequence in the paged
/// cache, the prompt's hidden states come from its prefill): with `penalty_alpha` 0 it is greedy
/// decoding; with 0.6 it runs to the length limit.
#[test]
fn contrastive_search_with_zero_alpha_is_greedy() {
    let prompt = tokens("Once upon a time");
    let params = SamplingParams { top_k: Some(3), ..greedy(6) };
    let g = sample_on_engine(&prompt, &greedy(6));
    let cs = |alpha: f32| on_engine(&prompt, &params, 1, Some(deco_serve::Strategy::ContrastiveSearch { penalty_alpha: alpha }), None).0.remove(0).0;
    assert_eq!(cs(0.0), g);
    assert_eq!(cs(0.6).len(), 6);
}

fn time<T>(f: impl FnOnce() -> T) -> (T, f64) {
    let t = std::time::Instant::now();
    let r = f();
    (r, t.elapsed().as_secs_f64())
}

/// The measurement table of docs/decoding.md (several minutes on 2 cores):
/// `cargo test --release -p deco-tests --test decoding_strategies -- --ignored --nocapture bench_decoding`
#[test]
#[ignore = "benchmark; prints the docs/decoding.md tables"]
fn bench_decoding() {
    let m = model();
    let wiki = std::fs::read_to_string(deco_tests::asset("data/wiki_test.txt")).expect("wiki");
    let wiki_prompt: String = wiki.chars().take(800).collect();
    let prompts = [
        ("wiki-800c", tokens(&wiki_prompt)),
        ("chat-list", tokens("<|im_start|>user\nList the days of the week and the months of the year.<|im_end|>\n<|im_start|>assistant\n")),
        ("chat-code", tokens("<|im_start|>user\nWrite a Python function that returns the n-th Fibonacci number.<|im_end|>\n<|im_start|>assistant\n")),
    ];
    let max_new = 48;
    let params = greedy(max_new);
    println!("\n## speculative, T=0, max_new_tokens={max_new}, gamma=4\n");
    println!("| prompt | drafter | acceptance | tokens | target forwards | tok/s | speedup vs greedy |");
    println!("|---|---|---|---|---|---|---|");
    for (name, p) in &prompts {
        let (g, tg) = time(|| sample_on_engine(p, &params));
        let n = g.len() as f64;
        println!("| {name} | none (greedy) | - | {} | {} | {:.1} | 1.00 |", g.len(), g.len() + 1, n / tg);
        for (label, layers) in [("prompt lookup (ngram 2)".to_string(), None), ("self, first 8/30 layers".into(), Some(8)), ("self, first 16/30 layers".into(), Some(16)), ("self, first 24/30 layers".into(), Some(24))] {
            let ((s, [forwards, drafted, accepted]), ts) = time(|| speculative_on_engine(p, &params, 4, layers));
            assert_eq!(s, g, "{label} on {name} differs from greedy");
            let rate = if drafted == 0 { 0.0 } else { accepted as f64 / drafted as f64 };
            println!("| {name} | {label} | {rate:.3} | {} | {forwards} | {:.1} | {:.2} |", s.len(), n / ts, tg / ts);
        }
    }

    println!("\n## beam search cost, prompt wiki-800c, max_new_tokens=24, length_penalty=1\n");
    println!("| num_beams | time (s) | ms per step | best sum logprob |");
    println!("|---|---|---|---|");
    let bp = greedy(24);
    for nb in [1usize, 2, 4, 8] {
        let beam = BeamSearchParams { num_beams: nb, ..Default::default() };
        let ((out, steps), t) = time(|| beam_on_engine(&prompts[0].1, &bp, beam));
        let lp = out[0].1;
        println!("| {nb} | {t:.2} | {:.0} | {lp:.3} |", 1000.0 * t / steps as f64);
    }

    println!("\n## early exit, teacher-forced on the first 256 tokens of data/wiki_test.txt (no BOS)\n");
    let text: String = wiki.chars().take(4000).collect();
    let ids: Vec<u32> = tokens(&text).into_iter().take(257).collect();
    let mut cache = deco_model::DenseKvCache::new(m.num_layers());
    let full = m
        .forward(&[deco_model::SeqInput { seq: 0, tokens: &ids[..256], tree: None }], &mut cache, deco_model::LogitsWanted::All)
        .expect("full")
        .logits_rows()
        .expect("rows");
    let nll = |row: &[f32], t: u32| -f64::from(deco_decoding::math::log_softmax(row)[t as usize]);
    let full_ppl = (full.iter().enumerate().map(|(i, r)| nll(r, ids[i + 1])).sum::<f64>() / 256.0).exp();
    println!("full model: ppl {full_ppl:.3}\n");
    println!("| entropy threshold (nats) | min_layers / check_every | layers skipped | ppl | top-1 agreement with full | time (s) |");
    println!("|---|---|---|---|---|---|");
    for (thr, min_l, every) in [(0.25f32, 8usize, 4usize), (0.5, 8, 4), (1.0, 8, 4), (0.5, 16, 4), (1.0, 16, 4), (2.0, 20, 5)] {
        let cfg = deco_model::early_exit::EarlyExitConfig { entropy_threshold: thr, min_layers: min_l, check_every: every };
        let mut cache = deco_model::DenseKvCache::new(m.num_layers());
        let mut stats = deco_model::early_exit::EarlyExitStats::default();
        let (mut nll_sum, mut agree) = (0.0, 0usize);
        let (_, t) = time(|| {
            for i in 0..256 {
                let step = m.forward_early_exit(0, ids[i], &mut cache, &cfg).expect("ee");
                stats.record(&step, m.num_layers());
                nll_sum += nll(&step.logits, ids[i + 1]);
                let a = deco_decoding::math::argmax(&step.logits);
                if a == deco_decoding::math::argmax(&full[i]) {
                    agree += 1;
                }
            }
        });
        println!(
            "| {thr} | {min_l} / {every} | {:.3} | {:.3} | {:.3} | {t:.1} |",
            stats.skipped_fraction(),
            (nll_sum / 256.0).exp(),
            agree as f64 / 256.0
        );
    }
}

#[test]
fn early_exit_limits_match_full_and_truncated_forwards() {
    use deco_model::early_exit::EarlyExitConfig;
    use deco_model::{DenseKvCache, LogitsWanted, SeqInput};
    let m = model();
    let ids = tokens("The quick brown fox jumps over");
    let (last, head) = ids.split_last().expect("ids");
    let full_next = |num_layers: usize| {
        let mut c = DenseKvCache::new(num_layers);
        m.forward_partial(&[SeqInput { seq: 0, tokens: &ids, tree: None }], &mut c, LogitsWanted::Last, num_layers)
            .expect("fwd")
            .logits_rows()
            .expect("rows")
            .remove(0)
    };
    let max_diff = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
    // Threshold 0 never exits: the full model.
    let mut c = DenseKvCache::new(m.num_layers());
    m.forward(&[SeqInput { seq: 0, tokens: head, tree: None }], &mut c, LogitsWanted::Last).expect("prefill");
    let never = EarlyExitConfig { entropy_threshold: 0.0, min_layers: 8, check_every: 4 };
    let step = m.forward_early_exit(0, *last, &mut c, &never).expect("ee");
    assert_eq!(step.exit_layer, 30);
    assert!(max_diff(&step.logits, &full_next(30)) < 1e-3);
    // A huge threshold exits at min_layers: the first 8 layers + norm + head.
    let mut c = DenseKvCache::new(m.num_layers());
    m.forward(&[SeqInput { seq: 0, tokens: head, tree: None }], &mut c, LogitsWanted::Last).expect("prefill");
    let always = EarlyExitConfig { entropy_threshold: 1e9, min_layers: 8, check_every: 4 };
    let step = m.forward_early_exit(0, *last, &mut c, &always).expect("ee");
    assert_eq!(step.exit_layer, 8);
    assert!(max_diff(&step.logits, &full_next(8)) < 1e-3);
    // Every layer's cache got the token.
    assert_eq!(deco_model::KvCache::seq_len(&c, 0), ids.len());
}
