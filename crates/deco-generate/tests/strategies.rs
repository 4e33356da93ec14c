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

/// Plain greedy decoding on a fake model (the reference the strategies are compared with):
/// argmax of the processed logits until an EOS or `max_new_tokens`.
fn greedy_reference(lm: &mut FnLm, prompt: &[u32], params: &SamplingParams, eos: &[u32]) -> Vec<u32> {
    use deco_decoding::{LogitsProcessor, LogitsProcessorList, ProcessContext, SamplerOrder};
    let processors = LogitsProcessorList::from_params(params, SamplerOrder::HuggingFace).expect("processors");
    let mut ctx: Vec<u32> = prompt.to_vec();
    let mut out = Vec::new();
    while out.len() < params.max_new_tokens.expect("max_new_tokens") {
        lm.remove(0);
        let mut logits = lm.forward(&[(0, &ctx)], deco_model::LogitsWanted::Last, false).expect("forward").logits.remove(0);
        processors.process(&ProcessContext::new(prompt, &out, eos), &mut logits).expect("process");
        let t = math::argmax(&logits).expect("argmax") as u32;
        out.push(t);
        ctx.push(t);
        if eos.contains(&t) {
            break;
        }
    }
    lm.remove(0);
    out
}

/// What a step machine released, per choice, and the forward passes it took.
struct Driven {
    tokens: Vec<Vec<u32>>,
    finish: Vec<Option<deco_decoding::FinishReason>>,
    /// Streamed pieces of choice 0 (one per step that released tokens).
    pieces: Vec<Vec<u32>>,
    target_forwards: usize,
    draft_forwards: usize,
}

/// Test harness for step machines on fake models: applies the machine's operations to `target`
/// and `draft` (local sequence ids used as the models' ids) and feeds it the rows, one forward
/// per step, as the serving engine does with its paged caches (without other requests in the
/// batch). Also checks the protocol: one model fed per step, every choice finished once and
/// nothing released after, every sequence removed at the end.
fn drive(m: &mut dyn StepMachine, target: &mut FnLm, mut draft: Option<&mut FnLm>, prompt: &[u32]) -> Result<Driven> {
    use deco_model::LogitsWanted;
    use std::collections::BTreeSet;
    let n = m.num_choices();
    let mut out = Driven { tokens: vec![Vec::new(); n], finish: vec![None; n], pieces: Vec::new(), target_forwards: 1, draft_forwards: 0 };
    target.remove(0);
    if let Some(d) = draft.as_deref_mut() {
        d.remove(0);
    }
    let (want, want_hidden) = m.prompt_rows();
    let first = target.forward(&[(0, prompt)], LogitsWanted::All, want_hidden)?;
    let from = prompt.len() - want;
    let hidden = if want_hidden { first.hidden[from..].to_vec() } else { Vec::new() };
    let mut rows = vec![SeqRows { seq: 0, role: Role::Target, logits: first.logits[from..].to_vec(), hidden }];
    let (mut live, mut draft_live) = (BTreeSet::from([0u32]), BTreeSet::new());
    let mut pending_tree: Option<(u32, Vec<u32>)> = None;
    loop {
        let step = m.advance(rows)?;
        for c in &step.output {
            assert!(out.finish[c.index].is_none(), "choice {} released after its end", c.index);
            out.tokens[c.index].extend(&c.tokens);
            out.finish[c.index] = c.finish;
            if c.index == 0 && !c.tokens.is_empty() {
                out.pieces.push(c.tokens.clone());
            }
        }
        let (mut feeds, mut draft_feeds, mut tree_feeds) = (Vec::new(), Vec::new(), Vec::new());
        for op in step.ops {
            match op {
                Op::Fork { from, to } => {
                    assert!(live.contains(&from) && live.insert(to), "fork {from} -> {to}");
                    target.fork(u64::from(from), u64::from(to))?;
                }
                Op::Remove(seq) => {
                    assert!(live.remove(&seq), "remove {seq}");
                    target.remove(u64::from(seq));
                }
                Op::Truncate { seq, len } => target.truncate(u64::from(seq), len)?,
                Op::Feed { seq, tokens, rows, hidden } => feeds.push((seq, tokens, rows, hidden)),
                Op::FeedTree { seq, tokens, parents } => {
                    assert!(pending_tree.is_none(), "a tree fed before the last one was kept");
                    assert!(live.contains(&seq), "tree for unknown sequence {seq}");
                    tree_feeds.push((seq, tokens, parents));
                }
                Op::KeepTreePath { seq, path } => {
                    // The kept nodes' tokens are appended to the sequence (the fake model's
                    // "cache" is its token list), as the engine's compaction leaves them.
                    let (tseq, tokens) = pending_tree.take().expect("a path kept without a tree");
                    assert_eq!(tseq, seq);
                    assert!(path.first() == Some(&0) && path.windows(2).all(|w| w[0] < w[1]), "path {path:?}");
                    let kept: Vec<u32> = path.iter().map(|&i| tokens[i]).collect();
                    target.forward(&[(u64::from(seq), &kept)], LogitsWanted::Last, false)?;
                }
                Op::DraftFeed { seq, tokens } => {
                    draft_live.insert(seq);
                    draft_feeds.push((seq, tokens));
                }
                Op::DraftTruncate { seq, len } => draft.as_deref_mut().expect("a draft model").truncate(u64::from(seq), len)?,
                Op::DraftRemove(seq) => {
                    assert!(draft_live.remove(&seq), "draft remove {seq}");
                    draft.as_deref_mut().expect("a draft model").remove(u64::from(seq));
                }
            }
        }
        assert!(feeds.is_empty() || draft_feeds.is_empty(), "target and draft fed in one step");
        if let Some((seq, tokens, parents)) = tree_feeds.pop() {
            // Tree attention on a prefix model: node i's row is the model after the sequence
            // followed by the tokens of the node's path.
            assert!(feeds.is_empty() && draft_feeds.is_empty() && tree_feeds.is_empty(), "a tree fed with other work");
            assert!(parents.len() == tokens.len() && parents.iter().enumerate().all(|(i, p)| p.is_none_or(|p| p < i)), "parents {parents:?}");
            let mut r = SeqRows { seq, role: Role::Target, logits: Vec::new(), hidden: Vec::new() };
            for i in 0..tokens.len() {
                let mut path = vec![tokens[i]];
                let mut j = i;
                while let Some(p) = parents[j] {
                    path.push(tokens[p]);
                    j = p;
                }
                path.reverse();
                target.fork(u64::from(seq), 1_000_000)?;
                let o = target.forward(&[(1_000_000, &path)], LogitsWanted::Last, true)?;
                target.remove(1_000_000);
                r.logits.push(o.logits[0].clone());
                r.hidden.push(o.hidden[0].clone());
            }
            out.target_forwards += 1;
            pending_tree = Some((seq, tokens));
            rows = vec![r];
            continue;
        }
        if feeds.is_empty() && draft_feeds.is_empty() {
            assert!(live.is_empty() && draft_live.is_empty(), "sequences left: {live:?} / draft {draft_live:?}");
            assert!(out.finish.iter().all(Option::is_some), "a choice never finished");
            return Ok(out);
        }
        if !feeds.is_empty() {
            let inputs: Vec<(SeqId, &[u32])> = feeds.iter().map(|(s, t, _, _)| (u64::from(*s), t.as_slice())).collect();
            let any_hidden = feeds.iter().any(|f| f.3);
            let o = target.forward(&inputs, LogitsWanted::All, any_hidden)?;
            out.target_forwards += 1;
            rows = feeds
                .iter()
                .zip(&o.rows)
                .map(|((seq, _, want, hidden), r)| {
                    let keep = r.end - want..r.end;
                    let h = if *hidden { o.hidden[keep.clone()].to_vec() } else { Vec::new() };
                    SeqRows { seq: *seq, role: Role::Target, logits: o.logits[keep].to_vec(), hidden: h }
                })
                .collect();
        } else {
            let d = draft.as_deref_mut().expect("the machine fed a draft model");
            let inputs: Vec<(SeqId, &[u32])> = draft_feeds.iter().map(|(s, t)| (u64::from(*s), t.as_slice())).collect();
            let logits = d.forward(&inputs, LogitsWanted::Last, false)?.logits;
            out.draft_forwards += 1;
            rows = draft_feeds.iter().zip(logits).map(|((seq, _), l)| SeqRows { seq: *seq, role: Role::Draft, logits: vec![l], hidden: Vec::new() }).collect();
        }
    }
}

/// What a beam search released: its hypotheses, best first, and the forward passes it took.
struct BeamOut {
    sequences: Vec<BeamHypothesis>,
    forward_calls: usize,
}

/// A [`BeamSearch`] driven by [`drive`]; its released choices are its hypotheses.
fn beam_search(lm: &mut FnLm, prompt: &[u32], params: &SamplingParams, beam: &BeamSearchParams, eos: &[u32]) -> Result<BeamOut> {
    let mut m = BeamSearch::new(prompt, params, beam, eos, lm.max_context())?;
    let d = drive(&mut m, lm, None, prompt)?;
    assert_eq!(d.tokens.len(), m.hypotheses().len());
    for (t, h) in d.tokens.iter().zip(m.hypotheses()) {
        assert_eq!(t, &h.tokens);
    }
    assert!(d.pieces.len() <= 1, "beam search streamed before its end");
    Ok(BeamOut { sequences: m.hypotheses().to_vec(), forward_calls: d.target_forwards })
}

/// Contrastive search on a fake model: the generated tokens.
fn contrastive_search(lm: &mut FnLm, prompt: &[u32], params: &SamplingParams, penalty_alpha: f32, eos: &[u32]) -> Result<Vec<u32>> {
    let mut m = ContrastiveSearch::new(prompt, params, penalty_alpha, eos, lm.max_context())?;
    let d = drive(&mut m, lm, None, prompt)?;
    assert_eq!(d.pieces.concat(), d.tokens[0], "contrastive search streams each token");
    Ok(d.tokens[0].clone())
}

/// Speculative decoding on fake models: the tokens, the streamed pieces, the finish and the
/// counters.
fn speculative(target: &mut FnLm, draft: Option<&mut FnLm>, prompt: &[u32], params: &SamplingParams, gamma: usize, eos: &[u32]) -> Result<(Driven, SpeculativeStats)> {
    let source = if draft.is_some() { DraftSource::Model } else { DraftSource::PromptLookup(PromptLookupDrafter::default()) };
    let mut m = Speculative::new(prompt, params, source, gamma, eos, target.max_context())?;
    let d = drive(&mut m, target, draft, prompt)?;
    assert_eq!(m.stats().target_forward_calls, d.target_forwards);
    Ok((d, m.stats()))
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
    assert_eq!(greedy_reference(&mut lm, &[2], &greedy_params(2), &[2]), vec![0, 0]);
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
    let mut drafted = 0;
    for salt in 1..6u64 {
        let vocab = 7;
        let target_fn = move |p: &[u32]| hashed_logits(p, vocab, salt);
        let mut target = FnLm::new(vocab, target_fn);
        let params = greedy_params(40);
        let plain = greedy_reference(&mut target, &[1, 2, 3], &params, &[6]);
        // Draft: the target with noise, so it is often but not always right.
        let draft = FnLm::new(vocab, move |p: &[u32]| {
            let a = hashed_logits(p, vocab, salt);
            let b = hashed_logits(p, vocab, salt + 100);
            a.iter().zip(&b).map(|(x, y)| x + 0.7 * y).collect()
        });
        let mut draft = draft;
        let (spec, stats) = speculative(&mut target, Some(&mut draft), &[1, 2, 3], &params, 4, &[6]).expect("spec");
        assert_eq!(spec.tokens[0], plain, "salt {salt}");
        assert_eq!(spec.pieces.concat(), plain);
        let ended = if plain.last() == Some(&6) { deco_decoding::FinishReason::EosToken } else { deco_decoding::FinishReason::Length };
        assert_eq!(spec.finish[0], Some(ended));
        assert!(stats.accepted <= stats.drafted);
        assert_eq!(spec.draft_forwards > 0, stats.drafted > 0);
        drafted += stats.drafted;
        let (spec, _) = speculative(&mut target, None, &[1, 2, 3], &params, 3, &[6]).expect("lookup");
        assert_eq!(spec.tokens[0], plain, "lookup salt {salt}");
        // Hugging Face's heuristic γ schedule changes the rounds, never the tokens.
        let mut m = Speculative::new(&[1, 2, 3], &params, DraftSource::Model, 1, &[6], target.max_context()).expect("spec").with_schedule(DraftSchedule::Heuristic);
        let d = drive(&mut m, &mut target, Some(&mut draft), &[1, 2, 3]).expect("heuristic");
        assert_eq!(d.tokens[0], plain, "heuristic salt {salt}");
    }
    assert!(drafted > 0, "no draft token in any run");
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
    let (out, stats) = match draft_q {
        Some(q) => {
            let ql: Vec<f32> = q.iter().map(|x| x.ln()).collect();
            let mut d = FnLm::new(vocab, move |_| ql.clone());
            speculative(&mut target, Some(&mut d), &prompt, params, 3, &[])
        }
        None => speculative(&mut target, None, &prompt, params, 3, &[]),
    }
    .expect("spec");
    assert_eq!(out.tokens[0].len(), n);
    let mut counts = vec![0usize; vocab];
    for &t in &out.tokens[0] {
        counts[t as usize] += 1;
    }
    (counts, stats)
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
    let g = contrastive_search(&mut make(), &[0], &params, 0.5, &[]).expect("cs");
    assert_eq!(g, vec![2, 1, 0]);
    // penalty_alpha = 0 is greedy.
    let g = contrastive_search(&mut make(), &[0], &params, 0.0, &[]).expect("cs");
    assert_eq!(g, vec![0, 0, 0]);
    assert!(contrastive_search(&mut make(), &[0], &params, 1.5, &[]).is_err());
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
    let mut m = ContrastiveDecoding::new(&[0], &greedy_params(2), &cd, &[], expert.max_context()).expect("cd");
    let g = drive(&mut m, &mut expert, Some(&mut amateur), &[0]).expect("cd");
    assert_eq!(g.tokens[0], vec![1, 1]);
    assert_eq!(g.draft_forwards, 2, "one amateur forward per token");
    assert!(ContrastiveDecoding::new(&[0], &greedy_params(2), &ContrastiveDecodingParams { alpha: 2.0, ..cd }, &[], 64).is_err());
}


/// Heads of a fake model whose hidden state is its token prefix (as floats): head `k` proposes
/// the model's own greedy continuation `k + 1` tokens ahead at rank `ranks[k - 1]` (the other
/// ranks hold other tokens), or only wrong tokens for `None`.
#[derive(Debug)]
struct PrefixOracle {
    vocab: usize,
    salt: u64,
    ranks: Vec<Option<usize>>,
}

impl DraftHeads for PrefixOracle {
    fn num_heads(&self) -> usize {
        self.ranks.len()
    }

    fn head_logits(&self, hidden: &[f32]) -> Result<Vec<Vec<f32>>> {
        let mut ctx: Vec<u32> = hidden.iter().map(|&x| x as u32).collect();
        // Greedy continuation: the next token (the root), then one per head.
        let mut cont = Vec::new();
        for _ in 0..=self.ranks.len() {
            let t = math::argmax(&hashed_logits(&ctx, self.vocab, self.salt)).expect("argmax") as u32;
            cont.push(t);
            ctx.push(t);
        }
        Ok(self
            .ranks
            .iter()
            .enumerate()
            .map(|(k, rank)| {
                let target = cont[k + 1] as usize;
                let mut l = vec![0.0f32; self.vocab];
                let rank = rank.unwrap_or(self.vocab - 1);
                for r in 0..rank {
                    l[(target + 1 + r) % self.vocab] = 10.0 - r as f32;
                }
                l[target] = if rank < self.vocab - 1 { 10.0 - rank as f32 } else { -10.0 };
                l
            })
            .collect())
    }
}

fn prefix_lm(vocab: usize, salt: u64) -> FnLm {
    FnLm::new(vocab, move |p| hashed_logits(p, vocab, salt)).with_hidden(|p| p.iter().map(|&t| t as f32).collect())
}

/// Medusa at temperature 0 equals greedy decoding token for token, for heads that are right at
/// various ranks (several candidates accepted per forward through any tree node) or wrong, any
/// tree, EOS and the token budget; the accepted length follows the heads.
#[test]
fn medusa_greedy_equals_greedy_decoding() {
    let (vocab, eos) = (11usize, 10u32);
    let trees: Vec<Vec<Vec<usize>>> = vec![
        vec![vec![0]],
        vec![vec![0], vec![0, 0], vec![0, 0, 0]],
        vec![vec![0], vec![1], vec![0, 0], vec![1, 0], vec![1, 0, 0], vec![1, 1]],
        deco_generate::medusa::choices_up_to(deco_generate::medusa::SMALL_TREE, 3),
    ];
    for salt in 0..12u64 {
        for (ti, tree) in trees.iter().enumerate() {
            for ranks in [vec![Some(0), Some(0), Some(0)], vec![Some(1), Some(0), Some(1)], vec![None, None, None], vec![Some(0), None, Some(0)]] {
                let heads = std::sync::Arc::new(PrefixOracle { vocab, salt, ranks: ranks.clone() });
                let params = greedy_params(9 + salt as usize % 5);
                let prompt = [3u32, 1, 4, 1, 5];
                let mut lm = prefix_lm(vocab, salt);
                let want = greedy_reference(&mut lm, &prompt, &params, &[eos]);
                let tree = MedusaTree::new(tree, 3).expect("tree");
                let mut m = Medusa::new(&prompt, &params, heads, tree, TypicalAcceptance::default(), &[eos], usize::MAX).expect("medusa");
                let d = drive(&mut m, &mut lm, None, &prompt).expect("drive");
                assert_eq!(d.tokens[0], want, "salt {salt} tree {ti} ranks {ranks:?}");
                let st = m.stats();
                assert_eq!(st.rounds + 1, d.target_forwards, "one tree forward per round");
                if ranks == [Some(0), Some(0), Some(0)] && ti == 1 && want.len() >= 8 && !want[..want.len() - 1].contains(&eos) {
                    assert!(st.mean_accepted_length() > 3.0, "exact heads on a chain of 3: {}", st.mean_accepted_length());
                }
                if ranks[0].is_none() {
                    assert_eq!(st.accepted, 0, "wrong heads had candidates accepted");
                }
            }
        }
    }
}

/// With sampling, the first token and every bonus token come from the request's seeded
/// sampler: the same seed gives the same tokens; typical acceptance accepts a candidate only
/// above its threshold (a one-hot target accepts exactly its token).
#[test]
fn medusa_sampling_is_seeded_and_typical_acceptance_thresholds() {
    let vocab = 9usize;
    let heads = std::sync::Arc::new(PrefixOracle { vocab, salt: 3, ranks: vec![Some(0), Some(1)] });
    let params = SamplingParams { temperature: Some(0.7), max_new_tokens: Some(16), seed: Some(5), ..Default::default() };
    let run = || {
        let mut lm = prefix_lm(vocab, 3);
        let tree = MedusaTree::new(&deco_generate::medusa::choices_up_to(deco_generate::medusa::SMALL_TREE, 2), 2).expect("tree");
        let mut m = Medusa::new(&[1, 2], &params, heads.clone(), tree, TypicalAcceptance::default(), &[], usize::MAX).expect("medusa");
        drive(&mut m, &mut lm, None, &[1, 2]).expect("drive").tokens[0].clone()
    };
    let a = run();
    assert_eq!(a.len(), 16);
    assert_eq!(a, run());
    let acc = TypicalAcceptance::default();
    // Uniform over 9: entropy ln 9, threshold min(0.09, 0.3/9) = 0.0333: every token passes.
    assert!((acc.threshold(&[1.0 / 9.0; 9]) - 0.3 / 9.0).abs() < 1e-6);
    // One-hot: threshold min(0.09, 0.3) = 0.09.
    let mut one = vec![0.0; 9];
    one[4] = 1.0;
    assert!((acc.threshold(&one) - 0.09).abs() < 1e-6);
}

#[test]
fn medusa_trees_are_validated() {
    assert_eq!(MedusaTree::new(&[vec![0], vec![1], vec![0, 0]], 2).expect("tree").num_nodes(), 4);
    assert!(MedusaTree::new(&[vec![0, 0]], 2).is_err(), "missing parent path");
    assert!(MedusaTree::new(&[vec![0], vec![0]], 2).is_err(), "repeated path");
    assert!(MedusaTree::new(&[vec![]], 2).is_err(), "empty path");
    assert!(MedusaTree::new(&[vec![0], vec![0, 0], vec![0, 0, 0]], 2).is_err(), "deeper than the heads");
    // Sorted by depth then path, parents first, whatever the order given.
    let t = MedusaTree::new(&[vec![1, 0], vec![0, 0], vec![1], vec![0]], 2).expect("tree");
    assert_eq!(t.choices(), &[vec![0], vec![1], vec![0, 0], vec![1, 0]]);
    assert_eq!(t.depth(), 2);
}
