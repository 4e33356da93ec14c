//! Property tests: for random rows and histories, each processor keeps exactly the set its
//! rule defines, touches only what it should, renormalizes correctly and never yields NaN.
//!
//! The expected sets are computed here from the rule's definition (sorting, counting, brute
//! force), not by calling the crate's helpers.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

mod common;

use std::collections::HashMap;

use deco_decoding::{
    BadWordsIds, EpsilonCutoff, EtaCutoff, FrequencyPenalty, LogitsProcessor, LogitsProcessorList,
    MinP, NoRepeatNGram, PresencePenalty, ProcessContext, RepetitionPenalty, SamplerOrder,
    SamplingParams, Temperature, TopK, TopP, TypicalP,
};
use proptest::prelude::*;

const NINF: f32 = f32::NEG_INFINITY;

/// Rows of 1..48 logits: continuous values, small integers (to force ties) and some -inf,
/// with at least one entry that is not -inf.
fn row() -> impl Strategy<Value = Vec<f32>> {
    prop::collection::vec(
        prop_oneof![
            6 => -15.0f32..15.0,
            3 => (-3i32..=3).prop_map(|x| x as f32),
            1 => Just(NINF),
        ],
        1..48,
    )
    .prop_filter("at least one finite logit", |v| {
        v.iter().any(|x| x.is_finite())
    })
}

fn apply(p: &dyn LogitsProcessor, ctx: &ProcessContext<'_>, l: &[f32]) -> Vec<f32> {
    let mut out = l.to_vec();
    p.process(ctx, &mut out).expect("process");
    out
}

/// Common checks of a filter: no NaN; survivors unchanged; removed are -inf; at least one
/// survivor; the kept distribution is the original one restricted and renormalized.
fn check_filter(before: &[f32], after: &[f32]) -> Result<Vec<bool>, TestCaseError> {
    prop_assert_eq!(before.len(), after.len());
    let mut keep = vec![false; before.len()];
    for i in 0..before.len() {
        prop_assert!(!after[i].is_nan());
        if after[i] > NINF {
            prop_assert_eq!(after[i], before[i], "survivor {} changed", i);
            keep[i] = true;
        } else {
            prop_assert_eq!(after[i], NINF);
        }
    }
    prop_assert!(keep.iter().any(|&k| k), "no token survived");
    let p = common::probs(before);
    let q = common::probs(after);
    let mass: f64 = (0..p.len()).filter(|&i| keep[i]).map(|i| p[i]).sum();
    prop_assert!((q.iter().sum::<f64>() - 1.0).abs() < 1e-9);
    for i in 0..p.len() {
        let expect = if keep[i] { p[i] / mass } else { 0.0 };
        prop_assert!(
            (q[i] - expect).abs() < 1e-9,
            "token {}: {} vs {}",
            i,
            q[i],
            expect
        );
    }
    Ok(keep)
}

/// Candidates (not -inf) in order: larger logit first, then lower id.
fn ranked(l: &[f32]) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..l.len()).filter(|&i| l[i] > NINF).collect();
    idx.sort_by(|&a, &b| l[b].partial_cmp(&l[a]).unwrap().then(a.cmp(&b)));
    idx
}

fn empty() -> ProcessContext<'static> {
    ProcessContext::default()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn top_k_keeps_exactly_the_values_at_least_the_kth(l in row(), k in 0usize..50) {
        let after = apply(&TopK::new(k).unwrap(), &empty(), &l);
        let keep = check_filter(&l, &after)?;
        let mut finite: Vec<f32> = l.iter().copied().filter(|x| *x > NINF).collect();
        finite.sort_by(|a, b| b.partial_cmp(a).unwrap());
        for i in 0..l.len() {
            let expect = l[i] > NINF && (k == 0 || k > finite.len() || l[i] >= finite[k - 1]);
            prop_assert_eq!(keep[i], expect, "token {} (k = {})", i, k);
        }
        if k > 0 {
            let n = keep.iter().filter(|&&x| x).count();
            prop_assert!(n >= k.min(finite.len()));
        }
    }

    #[test]
    fn top_p_keeps_the_minimal_prefix_reaching_p(l in row(), p in 0.0f32..=1.0) {
        let after = apply(&TopP::new(p).unwrap(), &empty(), &l);
        let keep = check_filter(&l, &after)?;
        let probs = common::probs(&l);
        let order = ranked(&l);
        let n = order.iter().take_while(|&&i| keep[i]).count();
        // a prefix of the (prob desc, id asc) order
        for (r, &i) in order.iter().enumerate() {
            prop_assert_eq!(keep[i], r < n, "not a prefix at rank {}", r);
        }
        let mass: f64 = order[..n].iter().map(|&i| probs[i]).sum();
        let before_last: f64 = order[..n - 1].iter().map(|&i| probs[i]).sum();
        let p = f64::from(p);
        // reaches p (or takes everything) ...
        prop_assert!(mass >= p - 1e-6 || n == order.len());
        // ... and is minimal: without its last token it has not reached p
        prop_assert!(n == 1 || before_last < p + 1e-6);
    }

    #[test]
    fn min_p_keeps_tokens_above_the_scaled_threshold(l in row(), m in 0.0f32..=1.0) {
        let after = apply(&MinP::new(m).unwrap(), &empty(), &l);
        let keep = check_filter(&l, &after)?;
        let probs = common::probs(&l);
        let pmax = probs.iter().copied().fold(0.0, f64::max);
        let thr = f64::from(m) * pmax;
        for i in 0..l.len() {
            if (probs[i] - thr).abs() <= 1e-6 * pmax {
                continue; // on the boundary within rounding
            }
            prop_assert_eq!(keep[i], l[i] > NINF && probs[i] >= thr, "token {}", i);
        }
    }

    #[test]
    fn typical_p_keeps_a_minimal_lower_set_of_surprisal_distance(l in row(), mass in 0.01f32..=1.0) {
        let after = apply(&TypicalP::new(mass).unwrap(), &empty(), &l);
        let keep = check_filter(&l, &after)?;
        let probs = common::probs(&l);
        let h: f64 = -probs.iter().filter(|&&p| p > 0.0).map(|&p| p * p.ln()).sum::<f64>();
        let dist: Vec<f64> = probs.iter().map(|&p| if p > 0.0 { (-p.ln() - h).abs() } else { f64::INFINITY }).collect();
        let kept_d: Vec<f64> = (0..l.len()).filter(|&i| keep[i]).map(|i| dist[i]).collect();
        let worst_kept = kept_d.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        // a lower set: every removed candidate is less typical than every kept one
        for i in 0..l.len() {
            if !keep[i] && l[i] > NINF {
                let best_kept = kept_d.iter().copied().fold(f64::INFINITY, f64::min);
                prop_assert!(dist[i] >= best_kept - 1e-9);
                prop_assert!(dist[i] >= worst_kept - 1e-9, "removed {} more typical than a kept token", i);
            }
        }
        // reaches the mass
        let kept_mass: f64 = (0..l.len()).filter(|&i| keep[i]).map(|i| probs[i]).sum();
        prop_assert!(kept_mass >= f64::from(mass) - 1e-6 || keep.iter().zip(&l).all(|(k, x)| *k || *x == NINF));
        // minimal: without the least typical level, the mass is below typical_p
        let inner: f64 = (0..l.len()).filter(|&i| keep[i] && dist[i] < worst_kept - 1e-9).map(|i| probs[i]).sum();
        prop_assert!(inner < f64::from(mass) + 1e-6);
    }

    #[test]
    fn epsilon_keeps_probabilities_at_least_epsilon_or_the_best(l in row(), e in 0.0f32..0.999) {
        let after = apply(&EpsilonCutoff::new(e).unwrap(), &empty(), &l);
        let keep = check_filter(&l, &after)?;
        let probs = common::probs(&l);
        let max = l.iter().copied().fold(NINF, f32::max);
        for i in 0..l.len() {
            if (probs[i] - f64::from(e)).abs() < 1e-7 { continue; }
            let expect = l[i] > NINF && (e == 0.0 || probs[i] >= f64::from(e) || l[i] == max);
            prop_assert_eq!(keep[i], expect, "token {}", i);
        }
    }

    #[test]
    fn eta_uses_the_entropy_dependent_threshold(l in row(), e in 0.0f32..0.999) {
        let after = apply(&EtaCutoff::new(e).unwrap(), &empty(), &l);
        let keep = check_filter(&l, &after)?;
        let probs = common::probs(&l);
        let h: f64 = -probs.iter().filter(|&&p| p > 0.0).map(|&p| p * p.ln()).sum::<f64>();
        let e64 = f64::from(e);
        let eta = e64.min(e64.sqrt() * (-h).exp());
        let max = l.iter().copied().fold(NINF, f32::max);
        for i in 0..l.len() {
            if (probs[i] - eta).abs() < 1e-7 { continue; }
            let expect = l[i] > NINF && (e == 0.0 || probs[i] >= eta || l[i] == max);
            prop_assert_eq!(keep[i], expect, "token {}", i);
        }
    }

    #[test]
    fn temperature_scales_log_odds_by_one_over_t(l in row(), t in 0.05f32..5.0) {
        let after = apply(&Temperature::new(t).unwrap(), &empty(), &l);
        prop_assert!(after.iter().all(|x| !x.is_nan() && *x != f32::INFINITY));
        let p = common::probs(&l);
        let q = common::probs(&after);
        prop_assert!((q.iter().sum::<f64>() - 1.0).abs() < 1e-9);
        // q_i ∝ p_i^(1/T)
        let z: f64 = p.iter().map(|&x| x.powf(1.0 / f64::from(t))).sum();
        for i in 0..l.len() {
            let expect = p[i].powf(1.0 / f64::from(t)) / z;
            prop_assert!((q[i] - expect).abs() < 1e-5, "{} vs {}", q[i], expect);
        }
    }

    #[test]
    fn repetition_penalty_touches_only_history_tokens(
        l in prop::collection::vec(-10.0f32..10.0, 16),
        prompt in prop::collection::vec(0u32..16, 0..10),
        output in prop::collection::vec(0u32..16, 0..10),
        penalty in 0.1f32..3.0,
    ) {
        let ctx = ProcessContext::new(&prompt, &output, &[]);
        let after = apply(&RepetitionPenalty::new(penalty).unwrap(), &ctx, &l);
        for i in 0..16u32 {
            let seen = prompt.contains(&i) || output.contains(&i);
            let x = l[i as usize];
            let expect = if !seen { x } else if x > 0.0 { x / penalty } else { x * penalty };
            prop_assert_eq!(after[i as usize], expect, "token {}", i);
        }
    }

    #[test]
    fn frequency_and_presence_touch_only_output_tokens(
        l in prop::collection::vec(-10.0f32..10.0, 16),
        prompt in prop::collection::vec(0u32..16, 0..10),
        output in prop::collection::vec(0u32..16, 0..20),
        freq in -2.0f32..2.0,
        pres in -2.0f32..2.0,
    ) {
        let ctx = ProcessContext::new(&prompt, &output, &[]);
        let mut list = LogitsProcessorList::new();
        list.push(FrequencyPenalty::new(freq).unwrap());
        list.push(PresencePenalty::new(pres).unwrap());
        let after = apply(&list, &ctx, &l);
        let mut count: HashMap<u32, u32> = HashMap::new();
        for &t in &output { *count.entry(t).or_default() += 1; }
        for i in 0..16u32 {
            let c = count.get(&i).copied().unwrap_or(0) as f32;
            let expect = l[i as usize] - c * freq - if c > 0.0 { pres } else { 0.0 };
            prop_assert!((after[i as usize] - expect).abs() < 1e-4, "token {}", i);
            if c == 0.0 { prop_assert_eq!(after[i as usize], l[i as usize]); }
        }
    }

    #[test]
    fn no_repeat_ngram_bans_exactly_the_tokens_that_repeat_an_ngram(
        prompt in prop::collection::vec(0u32..4, 0..12),
        output in prop::collection::vec(0u32..4, 0..12),
        n in 1usize..5,
    ) {
        let ctx = ProcessContext::new(&prompt, &output, &[]);
        let after = apply(&NoRepeatNGram::new(n).unwrap(), &ctx, &[0.0; 4]);
        let seq: Vec<u32> = prompt.iter().chain(&output).copied().collect();
        for t in 0..4u32 {
            // appending t repeats an n-gram iff the new last n-gram already occurred
            let mut ext = seq.clone();
            ext.push(t);
            let repeats = ext.len() > n && {
                let last = &ext[ext.len() - n..];
                ext[..ext.len() - 1].windows(n).any(|w| w == last)
            };
            prop_assert_eq!(after[t as usize] == NINF, repeats, "token {}", t);
        }
    }

    #[test]
    fn bad_words_ban_exactly_the_completing_tokens(
        prompt in prop::collection::vec(0u32..5, 0..8),
        output in prop::collection::vec(0u32..5, 0..8),
        words in prop::collection::vec(prop::collection::vec(0u32..5, 1..4), 1..4),
        eos in 0u32..5,
    ) {
        let eos_ids = [eos];
        let ctx = ProcessContext::new(&prompt, &output, &eos_ids);
        let after = apply(&BadWordsIds::new(words.clone()).unwrap(), &ctx, &[0.0; 5]);
        let seq: Vec<u32> = prompt.iter().chain(&output).copied().collect();
        for t in 0..5u32 {
            let mut ext = seq.clone();
            ext.push(t);
            let completes = words.iter().any(|w| {
                !(w.len() == 1 && w[0] == eos) && ext.ends_with(w)
            });
            prop_assert_eq!(after[t as usize] == NINF, completes, "token {}", t);
        }
    }

    #[test]
    fn chains_from_valid_params_never_produce_nan_and_keep_a_token(
        l in row(),
        temperature in prop::option::of(0.05f32..3.0),
        top_k in prop::option::of(0i64..60),
        top_p in prop::option::of(0.0f32..=1.0),
        min_p in prop::option::of(0.0f32..=1.0),
        typical_p in prop::option::of(0.01f32..=1.0),
        epsilon_cutoff in prop::option::of(0.0f32..0.99),
        eta_cutoff in prop::option::of(0.0f32..0.99),
        repetition_penalty in prop::option::of(0.5f32..2.0),
        frequency_penalty in prop::option::of(-2.0f32..=2.0),
        presence_penalty in prop::option::of(-2.0f32..=2.0),
        output in prop::collection::vec(0u32..48, 0..10),
        llama in any::<bool>(),
    ) {
        let params = SamplingParams {
            temperature, top_k, top_p, min_p, typical_p, epsilon_cutoff, eta_cutoff,
            repetition_penalty, frequency_penalty, presence_penalty,
            ..SamplingParams::default()
        };
        let order = if llama { SamplerOrder::LlamaCpp } else { SamplerOrder::HuggingFace };
        let list = LogitsProcessorList::from_params(&params, order).unwrap();
        let output: Vec<u32> = output.into_iter().filter(|&t| (t as usize) < l.len()).collect();
        let ctx = ProcessContext::new(&[], &output, &[]);
        let after = apply(&list, &ctx, &l);
        prop_assert!(after.iter().all(|x| !x.is_nan() && *x != f32::INFINITY));
        prop_assert!(after.iter().any(|x| *x > NINF));
        let q = common::probs(&after);
        prop_assert!((q.iter().sum::<f64>() - 1.0).abs() < 1e-9);
    }
}
