//! Strategy tests on fake models with hand-computable distributions.

use deco_decoding::{SamplingParams, math};
use deco_generate::*;

/// splitmix64: deterministic pseudo-random logits per prefix.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn hashed_logits(prefix: &[u32], vocab: usize, salt: u64) -> Vec<f32> {
    let mut h = salt;
    for &t in prefix {
        h = mix(h ^ u64::from(t));
    }
    (0..vocab).map(|v| ((mix(h ^ (v as u64 * 7919)) >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0).collect()
}

fn greedy_params(max_new: usize) -> SamplingParams {
    SamplingParams { temperature: Some(0.0), max_new_tokens: Some(max_new), seed: Some(1), ..Default::default() }
}

fn no_sink() -> impl FnMut(&[u32]) -> bool {
    |_: &[u32]| false
}

/// What a beam search released: its hypotheses, best first, and the forward passes it took.
struct BeamOut {
    sequences: Vec<BeamHypothesis>,
    forward_calls: usize,
}

/// Test harness for the [`BeamSearch`] step machine on a fake model: applies its operations to
/// `lm` (local sequence ids used as the model's ids) and feeds it the rows, one forward per
/// step, as the serving engine does with its paged cache (without other requests in the batch).
/// Also checks the protocol: every choice is released exactly once, finished, and nothing is
/// left in the model's cache.
fn beam_search(lm: &mut FnLm, prompt: &[u32], params: &SamplingParams, beam: &BeamSearchParams, eos: &[u32]) -> Result<BeamOut> {
    let mut m = BeamSearch::new(prompt, params, beam, eos, lm.max_context())?;
    let first = lm.forward(&[(0, prompt)], deco_model::LogitsWanted::Last, false)?.logits;
    let mut rows = vec![SeqRows { seq: 0, logits: first[0].clone() }];
    let mut forwards = 1;
    let mut live = std::collections::BTreeSet::from([0u32]);
    loop {
        let step = m.advance(rows)?;
        let mut feeds = Vec::new();
        for op in step.ops {
            match op {
                Op::Fork { from, to } => {
                    assert!(live.contains(&from) && live.insert(to), "fork {from} -> {to}");
                    lm.fork(u64::from(from), u64::from(to))?;
                }
                Op::Remove(seq) => {
                    assert!(live.remove(&seq), "remove {seq}");
                    lm.remove(u64::from(seq));
                }
                Op::Feed { seq, tokens } => feeds.push((seq, tokens)),
            }
        }
        if feeds.is_empty() {
            assert!(live.is_empty(), "sequences left: {live:?}");
            assert_eq!(step.output.len(), m.num_choices());
            for (i, c) in step.output.iter().enumerate() {
                assert_eq!(c.index, i);
                assert!(c.finish.is_some());
                assert_eq!(c.tokens, m.hypotheses()[i].tokens);
            }
            return Ok(BeamOut { sequences: m.hypotheses().to_vec(), forward_calls: forwards });
        }
        assert!(step.output.is_empty(), "beam search released output before its end");
        let inputs: Vec<(SeqId, &[u32])> = feeds.iter().map(|(s, t)| (u64::from(*s), t.as_slice())).collect();
        let logits = lm.forward(&inputs, deco_model::LogitsWanted::Last, false)?.logits;
        forwards += 1;
        rows = feeds.iter().zip(logits).map(|((seq, _), logits)| SeqRows { seq: *seq, logits }).collect();
    }
}

/// All complete sequences (ending in EOS, or of length `max_len`) with their sum of log-probs.
fn brute_force(vocab: usize, eos: u32, max_len: usize, prompt: &[u32], salt: u64) -> Vec<(Vec<u32>, f64)> {
    let mut out = Vec::new();
    let mut stack = vec![(Vec::<u32>::new(), 0.0f64)];
    while let Some((seq, s)) = stack.pop() {
        let ctx: Vec<u32> = prompt.iter().chain(&seq).copied().collect();
        let lp = math::log_softmax(&hashed_logits(&ctx, vocab, salt));
        for v in 0..vocab as u32 {
            let mut n = seq.clone();
            n.push(v);
            let ns = s + f64::from(lp[v as usize]);
            if v == eos || n.len() == max_len {
                out.push((n, ns));
            } else {
                stack.push((n, ns));
            }
        }
    }
    out
}

#[test]
fn beam_search_with_enough_beams_is_exhaustive() {
    let (vocab, eos, max_len) = (4usize, 3u32, 3usize);
    let prompt = [0u32, 1];
    for salt in [1u64, 2, 3] {
        for alpha in [0.0f32, 1.0, 2.0, -0.5] {
            let mut lm = FnLm::new(vocab, move |p| hashed_logits(p, vocab, salt));
            let beam = BeamSearchParams { num_beams: 64, length_penalty: alpha, early_stopping: EarlyStopping::Never, num_return_sequences: 3 };
            let out = beam_search(&mut lm, &prompt, &greedy_params(max_len), &beam, &[eos]).expect("beam");
            let mut all: Vec<(Vec<u32>, f64)> = brute_force(vocab, eos, max_len, &prompt, salt)
                .into_iter()
                .map(|(s, lp)| {
                    let sc = lp / (s.len() as f64).powf(f64::from(alpha));
                    (s, sc)
                })
                .collect();
            all.sort_by(|a, b| b.1.total_cmp(&a.1));
            assert_eq!(out.sequences.len(), 3);
            for (h, (s, sc)) in out.sequences.iter().zip(&all) {
                assert!((h.score - sc).abs() < 1e-4, "salt {salt} alpha {alpha}: {h:?} vs {s:?} {sc}");
            }
            assert_eq!(out.sequences[0].tokens, all[0].0);
        }
    }
}

#[test]
fn beam_search_beats_greedy_on_a_hand_made_trap() {
    // p(first) = [0.6, 0.4, 0]; after 0: [0.5, 0.5, 0]; after 1: [0.95, 0.05, 0]; token 2 = EOS never.
    let ln = |p: &[f32]| p.iter().map(|x| x.ln()).collect::<Vec<f32>>();
    let f = move |p: &[u32]| match p[1..] {
        [] => ln(&[0.6, 0.4, 0.0]),
        [0] => ln(&[0.5, 0.5, 0.0]),
        [1] => ln(&[0.95, 0.05, 0.0]),
        _ => ln(&[0.5, 0.5, 0.0]),
    };
    let mut lm = FnLm::new(3, f);
    let g = generate(&mut lm, &[2], &greedy_params(2), &[2], &mut no_sink()).expect("greedy");
    assert_eq!(g.tokens, vec![0, 0]);
    let beam = BeamSearchParams { num_beams: 2, length_penalty: 0.0, ..Default::default() };
    let out = beam_search(&mut lm, &[2], &greedy_params(2), &beam, &[2]).expect("beam");
    assert_eq!(out.sequences[0].tokens, vec![1, 0]);
    let expected = 0.4f64.ln() + 0.95f64.ln();
    assert!((out.sequences[0].sum_logprobs - expected).abs() < 1e-6);
    // With length_penalty 1 the score is the mean log-prob.
    let beam = BeamSearchParams { num_beams: 2, length_penalty: 1.0, ..Default::default() };
    let out = beam_search(&mut lm, &[2], &greedy_params(2), &beam, &[2]).expect("beam");
    assert!((out.sequences[0].score - expected / 2.0).abs() < 1e-6);
    // One forward for the prompt, one for the 2 beams after step 1 (none after the last step).
    assert_eq!(out.forward_calls, 2);
}

#[test]
fn beam_search_blocks_ngrams_inside_each_beam() {
    let mut lm = FnLm::new(6, |p| hashed_logits(p, 6, 9));
    let params = SamplingParams { no_repeat_ngram_size: Some(1), ..greedy_params(5) };
    let beam = BeamSearchParams { num_beams: 3, num_return_sequences: 3, length_penalty: 0.0, ..Default::default() };
    let out = beam_search(&mut lm, &[5], &params, &beam, &[]).expect("beam");
    for h in &out.sequences {
        let mut all = vec![5u32];
        all.extend(&h.tokens);
        let mut sorted = all.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), all.len(), "repeated unigram in {all:?}");
    }
}

#[test]
fn beam_search_rejects_bad_parameters() {
    let mut lm = FnLm::new(3, |p| hashed_logits(p, 3, 1));
    let bad = BeamSearchParams { num_beams: 2, num_return_sequences: 3, ..Default::default() };
    assert!(beam_search(&mut lm, &[0], &greedy_params(2), &bad, &[]).is_err());
    let bad = BeamSearchParams { num_beams: 0, ..Default::default() };
    assert!(beam_search(&mut lm, &[0], &greedy_params(2), &bad, &[]).is_err());
    assert!(beam_search(&mut lm, &[], &greedy_params(2), &BeamSearchParams::default(), &[]).is_err());
}

#[test]
fn speculative_greedy_equals_greedy() {
    for salt in 1..6u64 {
        let vocab = 7;
        let target_fn = move |p: &[u32]| hashed_logits(p, vocab, salt);
        let mut target = FnLm::new(vocab, target_fn);
        let params = greedy_params(40);
        let plain = generate(&mut target, &[1, 2, 3], &params, &[6], &mut no_sink()).expect("greedy");
        // Draft: the target with noise, so it is often but not always right.
        let draft = FnLm::new(vocab, move |p: &[u32]| {
            let a = hashed_logits(p, vocab, salt);
            let b = hashed_logits(p, vocab, salt + 100);
            a.iter().zip(&b).map(|(x, y)| x + 0.7 * y).collect()
        });
        let mut drafter = ModelDrafter::new(draft, 5).expect("drafter");
        let mut streamed = Vec::new();
        let spec = speculative_generate(&mut target, &mut drafter, &[1, 2, 3], &params, 4, &[6], &mut |t: &[u32]| {
            streamed.extend_from_slice(t);
            false
        })
        .expect("spec");
        assert_eq!(spec.generation.tokens, plain.tokens, "salt {salt}");
        assert_eq!(streamed, plain.tokens);
        assert_eq!(spec.generation.finish_reason, plain.finish_reason);
        assert!(spec.stats.accepted <= spec.stats.drafted);
        let mut lookup = PromptLookupDrafter::default();
        let spec = speculative_generate(&mut target, &mut lookup, &[1, 2, 3], &params, 3, &[6], &mut no_sink()).expect("lookup");
        assert_eq!(spec.generation.tokens, plain.tokens, "lookup salt {salt}");
    }
}

/// Pearson chi-square statistic of `counts` against probabilities `p`.
fn chi_square(counts: &[usize], p: &[f64]) -> f64 {
    let n: usize = counts.iter().sum();
    counts.iter().zip(p).map(|(&c, &pi)| {
        let e = pi * n as f64;
        (c as f64 - e).powi(2) / e
    }).sum()
}

fn spec_counts(target_p: Vec<f32>, draft_q: Option<Vec<f32>>, params: &SamplingParams, n: usize) -> (Vec<usize>, SpeculativeStats) {
    let vocab = target_p.len();
    let tl: Vec<f32> = target_p.iter().map(|x| x.ln()).collect();
    let mut target = FnLm::new(vocab, move |_| tl.clone());
    let prompt = [0u32, 1, 2, 0, 1];
    let out = match draft_q {
        Some(q) => {
            let ql: Vec<f32> = q.iter().map(|x| x.ln()).collect();
            let mut d = ModelDrafter::new(FnLm::new(vocab, move |_| ql.clone()), 77).expect("drafter");
            speculative_generate(&mut target, &mut d, &prompt, params, 3, &[], &mut no_sink())
        }
        None => speculative_generate(&mut target, &mut PromptLookupDrafter::default(), &prompt, params, 3, &[], &mut no_sink()),
    }
    .expect("spec");
    assert_eq!(out.generation.tokens.len(), n);
    let mut counts = vec![0usize; vocab];
    for &t in &out.generation.tokens {
        counts[t as usize] += 1;
    }
    (counts, out.stats)
}

// Critical value of chi-square at p = 0.001: 4 dof 18.47, 2 dof 13.82.
#[test]
fn speculative_sampling_follows_the_target_distribution() {
    let p = vec![0.4f32, 0.25, 0.15, 0.12, 0.08];
    let q = vec![0.1f32, 0.1, 0.5, 0.2, 0.1];
    let n = 6000;
    let params = SamplingParams { temperature: Some(1.0), max_new_tokens: Some(n), seed: Some(42), ..Default::default() };
    let (counts, stats) = spec_counts(p.clone(), Some(q.clone()), &params, n);
    let pf: Vec<f64> = p.iter().map(|&x| f64::from(x)).collect();
    let chi = chi_square(&counts, &pf);
    assert!(chi < 18.47, "chi2 {chi} counts {counts:?}");
    // Each draft token is accepted w.p. beta = sum_x min(p, q) (Leviathan et al. §3.1); with
    // gamma = 3 drafts per round and the round ending at the first rejection, the expected
    // accepted/drafted ratio is (beta + beta^2 + beta^3) / 3.
    let beta: f64 = p.iter().zip(&q).map(|(a, b)| f64::from(a.min(*b))).sum();
    let expected = (beta + beta * beta + beta.powi(3)) / 3.0;
    assert!((stats.acceptance_rate() - expected).abs() < 0.03, "acceptance {} vs {expected}", stats.acceptance_rate());
    // Against the draft distribution the counts must fail the test (the test can fail).
    let qf: Vec<f64> = q.iter().map(|&x| f64::from(x)).collect();
    assert!(chi_square(&counts, &qf) > 100.0);

    // top_k = 3 applied to both p and q: the output follows the truncated target.
    let params_k = SamplingParams { top_k: Some(3), ..params.clone() };
    let (counts, _) = spec_counts(p.clone(), Some(q.clone()), &params_k, n);
    assert_eq!(counts[3] + counts[4], 0);
    let z = 0.4 + 0.25 + 0.15;
    let chi = chi_square(&counts[..3], &[0.4 / z, 0.25 / z, 0.15 / z]);
    assert!(chi < 13.82, "top-k chi2 {chi} {counts:?}");

    // Deterministic drafts (prompt lookup, q one-hot) also leave the target distribution intact.
    let (counts, stats) = spec_counts(p.clone(), None, &params, n);
    let chi = chi_square(&counts, &pf);
    assert!(chi < 18.47, "lookup chi2 {chi} counts {counts:?}");
    assert!(stats.drafted > 0);
}

#[test]
fn accept_or_residual_by_hand() {
    let p = [0.5f32, 0.3, 0.2];
    let q = [0.25f32, 0.6, 0.15];
    // p/q at token 1 = 0.5: accept below, reject above.
    assert!(accept_or_residual(&p, Some(&q), 1, 0.49).is_ok());
    let r = accept_or_residual(&p, Some(&q), 1, 0.51).expect_err("rejected");
    let expected = [0.25f32, 0.0, 0.05];
    for (a, b) in r.iter().zip(expected) {
        assert!((a - b).abs() < 1e-6);
    }
    // Token 0 has p > q: always accepted.
    assert!(accept_or_residual(&p, Some(&q), 0, 0.999).is_ok());
    // One-hot draft: accepted w.p. p(x), residual is p without x.
    assert!(accept_or_residual(&p, None, 2, 0.19).is_ok());
    assert_eq!(accept_or_residual(&p, None, 2, 0.21).expect_err("rejected"), vec![0.5, 0.3, 0.0]);
}

#[test]
fn prompt_lookup_by_hand() {
    let d = PromptLookupDrafter { max_matching_ngram_size: 2 };
    assert_eq!(d.lookup(&[1, 2, 3, 4, 1, 2], 3), vec![3, 4, 1]);
    assert_eq!(d.lookup(&[1, 2, 3, 4, 1, 2], 10), vec![3, 4, 1, 2]);
    // No 2-gram match: falls back to the unigram [4] -> [5].
    assert_eq!(d.lookup(&[4, 5, 9, 4], 2), vec![5, 9]);
    assert_eq!(d.lookup(&[7, 8, 9], 2), Vec::<u32>::new());
}

#[test]
fn contrastive_search_by_hand() {
    // p = [0.5, 0.35, 0.15] always; hidden state = embedding of the last token.
    let emb = |t: u32| match t {
        0 => vec![1.0f32, 0.0],
        1 => vec![0.6, 0.8],
        _ => vec![0.0, 1.0],
    };
    let make = move || {
        FnLm::new(3, |_| vec![0.5f32.ln(), 0.35f32.ln(), 0.15f32.ln()]).with_hidden(move |p| emb(*p.last().unwrap_or(&0)))
    };
    let params = SamplingParams { top_k: Some(3), ..greedy_params(3) };
    // Step 1 (context h0): scores .25-.5, .175-.3, .075-0 -> 2. Step 2 (h0, h2): -.25, .175-.4,
    // .075-.5 -> 1. Step 3 (h0, h2, h1): -.25, .175-.5, -.425 -> 0.
    let g = contrastive_search(&mut make(), &[0], &params, 0.5, &[], &mut no_sink()).expect("cs");
    assert_eq!(g.tokens, vec![2, 1, 0]);
    // penalty_alpha = 0 is greedy.
    let g = contrastive_search(&mut make(), &[0], &params, 0.0, &[], &mut no_sink()).expect("cs");
    assert_eq!(g.tokens, vec![0, 0, 0]);
    assert!(contrastive_search(&mut make(), &[0], &params, 1.5, &[], &mut no_sink()).is_err());
}

#[test]
fn contrastive_decoding_by_hand() {
    let ln = |p: &[f32]| p.iter().map(|x| x.ln()).collect::<Vec<f32>>();
    let e = ln(&[0.5, 0.3, 0.15, 0.05]);
    let a = ln(&[0.7, 0.1, 0.1, 0.1]);
    let s = contrastive_scores(&e, &a, 0.2, 1.0);
    let expected = [(0.5f32 / 0.7).ln(), 3f32.ln(), 1.5f32.ln()];
    for (x, y) in s.iter().zip(expected) {
        assert!((x - y).abs() < 1e-5, "{s:?}");
    }
    assert_eq!(s[3], f32::NEG_INFINITY);
    let (e2, a2) = (e.clone(), a.clone());
    let mut expert = FnLm::new(4, move |_| e2.clone());
    let mut amateur = FnLm::new(4, move |_| a2.clone());
    let cd = ContrastiveDecodingParams { alpha: 0.2, amateur_temperature: 1.0 };
    let g = contrastive_decoding(&mut expert, &mut amateur, &[0], &greedy_params(2), &cd, &[], &mut no_sink()).expect("cd");
    assert_eq!(g.tokens, vec![1, 1]);
}

#[test]
fn sink_stop_and_eos_end_generation() {
    let mut lm = FnLm::new(5, |p| hashed_logits(p, 5, 3));
    let mut n = 0;
    let g = generate(&mut lm, &[0], &greedy_params(50), &[], &mut |_: &[u32]| {
        n += 1;
        n == 4
    })
    .expect("gen");
    assert_eq!(g.tokens.len(), 4);
    assert_eq!(g.finish_reason, deco_decoding::FinishReason::Stop);
    // The first greedy token as EOS ends generation after one token.
    let first = math::argmax(&hashed_logits(&[0], 5, 3)).expect("argmax") as u32;
    let g = generate(&mut lm, &[0], &greedy_params(50), &[first], &mut no_sink()).expect("gen");
    assert_eq!(g.tokens, vec![first]);
    assert_eq!(g.finish_reason, deco_decoding::FinishReason::EosToken);
}
