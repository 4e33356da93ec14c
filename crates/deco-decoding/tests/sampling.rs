//! The sampler: goodness of fit (chi-square), seeded determinism, batch independence, greedy
//! rule, logprobs, errors.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

mod common;

use deco_decoding::{
    DecodingError, LogitsProcessorList, ProcessContext, Sampler, SamplerOrder, SamplingParams, TopK,
};

const NINF: f32 = f32::NEG_INFINITY;

/// A fixed 8-token row (arbitrary values).
const LOGITS: [f32; 8] = [1.2, 2.5, 0.3, 2.0, -0.7, 1.9, 0.0, 2.6];

/// Chi-square threshold: with a fixed seed the test is deterministic; a correct sampler gives a
/// p-value that is uniform over seeds, so a threshold of 1e-3 fails a correct sampler for 1 seed
/// in 1000, while a wrong distribution (see the negative controls) gives p ~ 0.
const P_THRESHOLD: f64 = 1e-3;
const DRAWS: usize = 20_000;

fn params(json: &str) -> SamplingParams {
    SamplingParams::from_json_str(json).expect("valid params")
}

fn counts(sampler: &mut Sampler, logits: &[f32], draws: usize) -> Vec<u64> {
    let ctx = ProcessContext::default();
    let mut c = vec![0u64; logits.len()];
    for _ in 0..draws {
        let mut l = logits.to_vec();
        let out = sampler.sample(&ctx, &mut l).expect("sample");
        c[out.token as usize] += 1;
    }
    c
}

/// Independent expected distribution: softmax(l / T) restricted to `keep`, renormalized.
fn expected(logits: &[f32], t: f64, keep: &[usize]) -> Vec<f64> {
    let w: Vec<f64> = (0..logits.len())
        .map(|i| {
            if keep.contains(&i) {
                (f64::from(logits[i]) / t).exp()
            } else {
                0.0
            }
        })
        .collect();
    let s: f64 = w.iter().sum();
    w.iter().map(|x| x / s).collect()
}

#[test]
fn top_k_sampling_fits_the_truncated_renormalized_distribution() {
    // top_k = 3 keeps the three largest logits: 2.6 (id 7), 2.5 (id 1), 2.0 (id 3)
    let mut s = Sampler::new(&params(r#"{"temperature": 0.8, "top_k": 3, "seed": 1}"#)).unwrap();
    let c = counts(&mut s, &LOGITS, DRAWS);
    let exp = expected(&LOGITS, 0.8, &[1, 3, 7]);
    let (stat, df, p) = common::chi_square(&c, &exp);
    assert_eq!(df, 2);
    assert!(p > P_THRESHOLD, "chi2 = {stat}, p = {p}, counts = {c:?}");
    // negative control: the same counts do not fit the untruncated distribution
    let full = expected(&LOGITS, 0.8, &(0..8).collect::<Vec<_>>());
    assert!(common::chi_square(&c, &full).2 < 1e-12);
}

#[test]
fn top_p_sampling_fits_the_nucleus() {
    // softmax(LOGITS), sorted: id 7 (.2934), 1 (.2655), 3 (.1610), 5 (.1457), 0 (.0724),
    // 2 (.0294), 6 (.0218), 4 (.0108); mass before each: 0, .2934, .5589, .7199, .8656, ...
    // top_p = 0.8 keeps {7, 1, 3, 5} (id 5 is the crossing token; before id 0 is .8656 >= .8).
    let mut s = Sampler::new(&params(r#"{"top_p": 0.8, "seed": 7}"#)).unwrap();
    let c = counts(&mut s, &LOGITS, DRAWS);
    let exp = expected(&LOGITS, 1.0, &[1, 3, 5, 7]);
    let (stat, df, p) = common::chi_square(&c, &exp);
    assert_eq!(df, 3);
    assert!(p > P_THRESHOLD, "chi2 = {stat}, p = {p}, counts = {c:?}");
    // negative control: a nucleus without the crossing token does not fit
    let wrong = expected(&LOGITS, 1.0, &[1, 3, 7]);
    assert_eq!(common::chi_square(&c, &wrong).2, 0.0);
    // top_p = 0.7: before id 5 is .7199 >= .7, so id 5 is out
    let mut s = Sampler::new(&params(r#"{"top_p": 0.7, "seed": 8}"#)).unwrap();
    let c = counts(&mut s, &LOGITS, DRAWS);
    let (stat, _, p) = common::chi_square(&c, &expected(&LOGITS, 1.0, &[1, 3, 7]));
    assert!(p > P_THRESHOLD, "chi2 = {stat}, p = {p}, counts = {c:?}");
}

#[test]
fn plain_sampling_fits_softmax_with_temperature() {
    let mut s = Sampler::new(&params(r#"{"temperature": 1.5, "seed": 12345}"#)).unwrap();
    let c = counts(&mut s, &LOGITS, DRAWS);
    let exp = expected(&LOGITS, 1.5, &(0..8).collect::<Vec<_>>());
    let (stat, df, p) = common::chi_square(&c, &exp);
    assert_eq!(df, 7);
    assert!(p > P_THRESHOLD, "chi2 = {stat}, p = {p}, counts = {c:?}");
    // negative control: temperature 1.0 instead of 1.5 is rejected
    let t1 = expected(&LOGITS, 1.0, &(0..8).collect::<Vec<_>>());
    assert!(common::chi_square(&c, &t1).2 < 1e-6);
}

#[test]
fn llama_cpp_order_applies_temperature_after_truncation() {
    // llama.cpp order: top_p = 0.8 on the untempered row keeps {7, 1, 3, 5} (see above), then
    // temperature 2.0 flattens only these four.
    // Hugging Face order tempers first: softmax(LOGITS / 2) sorted 7, 1, 3, 5, 0, 2, ... with
    // mass before each 0, .2139, .4174, .5759, .7266, .8329 -> keeps {7, 1, 3, 5, 0}.
    let p = params(r#"{"temperature": 2.0, "top_p": 0.8, "seed": 99}"#);
    let mut s = Sampler::with_order(&p, SamplerOrder::LlamaCpp).unwrap();
    assert_eq!(s.processors().names(), vec!["top_p", "temperature"]);
    let c = counts(&mut s, &LOGITS, DRAWS);
    let exp = expected(&LOGITS, 2.0, &[1, 3, 5, 7]);
    let (stat, _, pv) = common::chi_square(&c, &exp);
    assert!(pv > P_THRESHOLD, "chi2 = {stat}, p = {pv}, counts = {c:?}");
    assert_eq!(
        common::chi_square(&c, &expected(&LOGITS, 2.0, &[0, 1, 3, 5, 7])).2,
        0.0
    );

    let mut hf = Sampler::new(&p).unwrap();
    assert_eq!(hf.processors().names(), vec!["temperature", "top_p"]);
    let c = counts(&mut hf, &LOGITS, DRAWS);
    let (stat, _, pv) = common::chi_square(&c, &expected(&LOGITS, 2.0, &[0, 1, 3, 5, 7]));
    assert!(pv > P_THRESHOLD, "chi2 = {stat}, p = {pv}, counts = {c:?}");
}

#[test]
fn sample_weights_fits_its_weights() {
    let mut s = Sampler::new(&params(r#"{"seed": 3}"#)).unwrap();
    let w = [0.0f32, 3.0, 1.0, 0.0, 4.0];
    let mut c = vec![0u64; w.len()];
    for _ in 0..DRAWS {
        c[s.sample_weights(&w).unwrap() as usize] += 1;
    }
    let exp: Vec<f64> = w.iter().map(|&x| f64::from(x) / 8.0).collect();
    let (stat, df, p) = common::chi_square(&c, &exp);
    assert_eq!(df, 2);
    assert!(p > P_THRESHOLD, "chi2 = {stat}, p = {p}, counts = {c:?}");
    assert!(s.sample_weights(&[0.0, 0.0]).is_err());
    assert!(s.sample_weights(&[1.0, -1.0]).is_err());
    assert!(s.sample_weights(&[]).is_err());
}

/// A deterministic stream of varying rows.
fn row(step: usize) -> Vec<f32> {
    (0..32)
        .map(|i| (((i * 7 + step * 13) % 17) as f32) * 0.3 - 2.0)
        .collect()
}

fn run_steps(s: &mut Sampler, steps: usize) -> Vec<u32> {
    let mut out = Vec::new();
    for step in 0..steps {
        let ctx = ProcessContext::new(&[1, 2, 3], &out, &[0]);
        let mut l = row(step);
        let t = s.sample(&ctx, &mut l).unwrap().token;
        out.push(t);
    }
    out
}

#[test]
fn same_seed_same_tokens_different_seed_different_tokens() {
    let p = |seed: u64| {
        params(&format!(
            r#"{{"temperature": 1.3, "top_k": 20, "repetition_penalty": 1.2, "seed": {seed}}}"#
        ))
    };
    let a = run_steps(&mut Sampler::new(&p(42)).unwrap(), 200);
    let b = run_steps(&mut Sampler::new(&p(42)).unwrap(), 200);
    let c = run_steps(&mut Sampler::new(&p(43)).unwrap(), 200);
    assert_eq!(a, b);
    assert_ne!(a, c);
    // the draws are not all the same token (the test would be vacuous otherwise)
    assert!(a.iter().collect::<std::collections::HashSet<_>>().len() > 5);
    assert_eq!(Sampler::new(&p(42)).unwrap().seed(), 42);
}

#[test]
fn a_sequence_tokens_do_not_depend_on_other_samplers_in_the_batch() {
    let pa = params(r#"{"temperature": 1.0, "top_p": 0.95, "seed": 2024}"#);
    let pb = params(r#"{"temperature": 0.7, "seed": 2024}"#);
    let alone = run_steps(&mut Sampler::new(&pa).unwrap(), 100);

    // interleave: between A's steps, B samples 0..=3 times (same seed as A on purpose)
    let mut a = Sampler::new(&pa).unwrap();
    let mut b = Sampler::new(&pb).unwrap();
    let mut a_out = Vec::new();
    let mut b_out = Vec::new();
    for step in 0..100 {
        for _ in 0..(step % 4) {
            let ctx = ProcessContext::new(&[9], &b_out, &[0]);
            let mut l = row(step + 1000);
            b_out.push(b.sample(&ctx, &mut l).unwrap().token);
        }
        let ctx = ProcessContext::new(&[1, 2, 3], &a_out, &[0]);
        let mut l = row(step);
        a_out.push(a.sample(&ctx, &mut l).unwrap().token);
    }
    assert_eq!(alone, a_out);
}

#[test]
fn greedy_takes_the_argmax_with_lowest_id_on_ties() {
    for json in [
        r#"{"temperature": 0.0}"#,
        r#"{"do_sample": false, "temperature": 0.7, "top_k": 1}"#,
    ] {
        let mut s = Sampler::new(&params(json)).unwrap();
        assert!(s.is_greedy());
        let ctx = ProcessContext::default();
        let mut l = vec![1.0, 3.0, 3.0, 2.0];
        assert_eq!(s.sample(&ctx, &mut l).unwrap().token, 1);
        let mut l = LOGITS.to_vec();
        assert_eq!(s.sample(&ctx, &mut l).unwrap().token, 7);
    }
    // greedy still applies the history processors: repetition penalty moves the argmax
    let mut s = Sampler::new(&params(r#"{"temperature": 0, "repetition_penalty": 2.0}"#)).unwrap();
    let ctx = ProcessContext::new(&[7], &[], &[]);
    let mut l = LOGITS.to_vec();
    // 2.6 / 2 = 1.3 < 2.5 -> token 1
    assert_eq!(s.sample(&ctx, &mut l).unwrap().token, 1);
    // and leaves out the warpers
    assert_eq!(s.processors().names(), vec!["repetition_penalty"]);
}

#[test]
fn logprobs_processed_and_raw() {
    // logits ln[0.4, 0.3, 0.2, 0.1]; top_k = 2 -> processed = ln[4/7, 3/7, 0, 0]
    let l0: Vec<f32> = [0.4f32, 0.3, 0.2, 0.1].iter().map(|x| x.ln()).collect();
    let mut s = Sampler::new(&params(r#"{"top_k": 2, "seed": 5, "logprobs": 3}"#)).unwrap();
    let mut l = l0.clone();
    let out = s.sample(&ProcessContext::default(), &mut l).unwrap();
    assert!(out.token == 0 || out.token == 1);
    let lp = out.logprobs.expect("requested");
    let (pp, raw) = if out.token == 0 {
        (4.0f32 / 7.0, 0.4f32)
    } else {
        (3.0 / 7.0, 0.3)
    };
    assert!((out.logprob - pp.ln()).abs() < 1e-5);
    assert!((lp.raw_logprob - raw.ln()).abs() < 1e-5);
    // processed top list: only the 2 surviving tokens (the -inf ones are not listed)
    let top: Vec<u32> = lp.top_logprobs.iter().map(|t| t.token).collect();
    assert_eq!(top, vec![0, 1]);
    assert!((lp.top_logprobs[1].logprob - (3.0f32 / 7.0).ln()).abs() < 1e-5);
    // raw top list: 3 entries of the model distribution
    let raw_top: Vec<(u32, f32)> = lp
        .raw_top_logprobs
        .iter()
        .map(|t| (t.token, t.logprob))
        .collect();
    assert_eq!(raw_top.len(), 3);
    for (k, (tok, lpv)) in raw_top.iter().enumerate() {
        assert_eq!(*tok, k as u32);
        assert!((lpv - [0.4f32, 0.3, 0.2][k].ln()).abs() < 1e-5);
    }
    // without the request there is no list, but the processed logprob is still there
    let mut s = Sampler::new(&params(r#"{"top_k": 2, "seed": 5}"#)).unwrap();
    let mut l = l0.clone();
    let out = s.sample(&ProcessContext::default(), &mut l).unwrap();
    assert!(out.logprobs.is_none() && out.logprob.is_finite());
}

/// A greedy sampler told to skip the chosen token's logprob picks the same token (the first
/// maximum, after the processors) with a NaN logprob; with `logprobs` requested, or sampling,
/// the setting is ignored and the logprob is the processed one.
#[test]
fn greedy_without_chosen_logprob() {
    let rows: [&[f32]; 4] = [&[0.1, 3.0, 3.0, -1.0], &[f32::NEG_INFINITY, -2.0, -2.5], &[5.0], &[-1.0, 0.0, -0.0, 0.0]];
    for row in rows {
        for extra in ["", r#", "repetition_penalty": 1.3"#] {
            let p = params(&format!(r#"{{"temperature": 0{extra}}}"#));
            let ctx = ProcessContext::new(&[0], &[], &[]);
            let (mut a, mut b) = (Sampler::new(&p).unwrap(), Sampler::new(&p).unwrap());
            b.set_chosen_logprob(false);
            let (mut la, mut lb) = (row.to_vec(), row.to_vec());
            let (oa, ob) = (a.sample(&ctx, &mut la).unwrap(), b.sample(&ctx, &mut lb).unwrap());
            assert_eq!(oa.token, ob.token, "{row:?}{extra}");
            assert!(oa.logprob.is_finite() && ob.logprob.is_nan() && ob.logprobs.is_none());
        }
    }
    let mut all_neg = Sampler::new(&params(r#"{"temperature": 0}"#)).unwrap();
    all_neg.set_chosen_logprob(false);
    assert!(all_neg.sample(&ProcessContext::default(), &mut [f32::NEG_INFINITY; 3]).is_err());
    for p in [r#"{"temperature": 0, "logprobs": 2}"#, r#"{"temperature": 0.7, "seed": 3}"#] {
        let mut s = Sampler::new(&params(p)).unwrap();
        s.set_chosen_logprob(false);
        let out = s.sample(&ProcessContext::default(), &mut [0.0f32, 1.0, 2.0]).unwrap();
        assert!(out.logprob.is_finite(), "{p}: the logprob is still computed");
    }
}

#[test]
fn bad_rows_are_errors() {
    let mut s = Sampler::new(&params(r#"{"seed": 1}"#)).unwrap();
    let ctx = ProcessContext::default();
    assert!(matches!(
        s.sample(&ctx, &mut []),
        Err(DecodingError::EmptyLogits)
    ));
    assert!(matches!(
        s.sample(&ctx, &mut [0.0, f32::NAN]),
        Err(DecodingError::NonFiniteLogit { index: 1, .. })
    ));
    assert!(matches!(
        s.sample(&ctx, &mut [f32::INFINITY, 0.0]),
        Err(DecodingError::NonFiniteLogit { index: 0, .. })
    ));
    assert!(matches!(
        s.sample(&ctx, &mut [NINF, NINF]),
        Err(DecodingError::NoValidToken)
    ));
    // banning every token through bad_words_ids
    let mut s = Sampler::new(&params(r#"{"bad_words_ids": [[0], [1]], "seed": 1}"#)).unwrap();
    assert!(matches!(
        s.sample(&ctx, &mut [1.0, 2.0]),
        Err(DecodingError::NoValidToken)
    ));
    // -inf entries are fine as long as one token remains
    let mut s = Sampler::new(&params(r#"{"seed": 1}"#)).unwrap();
    assert_eq!(s.sample(&ctx, &mut [NINF, 0.0, NINF]).unwrap().token, 1);
}

#[test]
fn hand_built_processor_lists_work_with_from_processors() {
    let mut list = LogitsProcessorList::new();
    list.push(TopK::new(1).unwrap());
    let mut s = Sampler::from_processors(list, false, Some(0), None).unwrap();
    for _ in 0..20 {
        let mut l = LOGITS.to_vec();
        assert_eq!(
            s.sample(&ProcessContext::default(), &mut l).unwrap().token,
            7
        );
    }
    assert!(Sampler::from_processors(LogitsProcessorList::new(), false, None, Some(21)).is_err());
}

#[test]
fn samplers_can_move_between_threads() {
    fn assert_send<T: Send>() {}
    assert_send::<Sampler>();
    assert_send::<LogitsProcessorList>();
    // and actually run on another thread
    let p = params(r#"{"temperature": 0.9, "seed": 11}"#);
    let here = run_steps(&mut Sampler::new(&p).unwrap(), 20);
    let mut s = Sampler::new(&p).unwrap();
    let there = std::thread::spawn(move || run_steps(&mut s, 20))
        .join()
        .unwrap();
    assert_eq!(here, there);
}
