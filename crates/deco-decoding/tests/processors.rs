//! Exact results of every processor on small hand-made distributions.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

mod common;

use std::collections::BTreeMap;

use deco_decoding::{
    BadWordsIds, DecodingError, EpsilonCutoff, EtaCutoff, FrequencyPenalty, LogitBias,
    LogitsProcessor, MinNewTokens, MinP, NoRepeatNGram, PresencePenalty, ProcessContext,
    RepetitionPenalty, Temperature, TopK, TopP, TypicalP,
};

const NINF: f32 = f32::NEG_INFINITY;

fn run(p: &dyn LogitsProcessor, ctx: &ProcessContext<'_>, logits: &[f32]) -> Vec<f32> {
    let mut l = logits.to_vec();
    p.process(ctx, &mut l).expect("process");
    l
}

fn empty() -> ProcessContext<'static> {
    ProcessContext::default()
}

/// Indices that are not -inf.
fn kept(l: &[f32]) -> Vec<usize> {
    (0..l.len()).filter(|&i| l[i] > NINF).collect()
}

/// logits = ln p, for a distribution given by hand.
fn ln(p: &[f32]) -> Vec<f32> {
    p.iter().map(|x| x.ln()).collect()
}

#[test]
fn temperature_divides_and_zero_keeps_the_maxima() {
    let t = Temperature::new(0.5).unwrap();
    assert_eq!(run(&t, &empty(), &[1.0, 2.0, 3.0]), vec![2.0, 4.0, 6.0]);
    let t = Temperature::new(2.0).unwrap();
    assert_eq!(run(&t, &empty(), &[1.0, NINF, -3.0]), vec![0.5, NINF, -1.5]);
    let t0 = Temperature::new(0.0).unwrap();
    assert_eq!(run(&t0, &empty(), &[1.0, 2.0, 3.0]), vec![NINF, NINF, 3.0]);
    assert_eq!(run(&t0, &empty(), &[3.0, 1.0, 3.0]), vec![3.0, NINF, 3.0]);
    // 3 / 1e-38 = 3e38 still fits in f32: plain division.
    let small = Temperature::new(1e-38).unwrap();
    assert!(
        run(&small, &empty(), &[1.0, 3.0])
            .iter()
            .all(|x| x.is_finite())
    );
    // A temperature so small that l / T overflows: the row is shifted by its max first, so the
    // result is (l - 3) / 1e-39 = [-inf (overflow), 0] with no +inf or NaN.
    let tiny = Temperature::new(1e-39).unwrap();
    let out = run(&tiny, &empty(), &[1.0, 3.0]);
    assert_eq!(out, vec![NINF, 0.0]);
}

#[test]
fn top_k_keeps_the_k_largest_and_all_ties_at_the_boundary() {
    let l = [1.0, 4.0, 3.0, 4.0, 2.0];
    // k = 2: the two largest are both 4.0 -> {1, 3}
    assert_eq!(kept(&run(&TopK::new(2).unwrap(), &empty(), &l)), vec![1, 3]);
    // k = 3: third largest is 3.0 -> {1, 2, 3}; survivors are unchanged
    let out = run(&TopK::new(3).unwrap(), &empty(), &l);
    assert_eq!(out, vec![NINF, 4.0, 3.0, 4.0, NINF]);
    // tie at the boundary: [1, 2, 2, 2] with k = 2 -> k-th largest is 2 -> three tokens kept
    assert_eq!(
        kept(&run(
            &TopK::new(2).unwrap(),
            &empty(),
            &[1.0, 2.0, 2.0, 2.0]
        )),
        vec![1, 2, 3]
    );
    // k = 0 disables; k >= vocab is the identity
    assert_eq!(run(&TopK::new(0).unwrap(), &empty(), &l), l.to_vec());
    assert_eq!(run(&TopK::new(9).unwrap(), &empty(), &l), l.to_vec());
    // min_tokens_to_keep raises k: max(1, 3) = 3
    let tk = TopK::with_min_tokens_to_keep(1, 3).unwrap();
    assert_eq!(kept(&run(&tk, &empty(), &l)), vec![1, 2, 3]);
}

#[test]
fn top_p_keeps_the_minimal_prefix_including_the_crossing_token() {
    // p = [0.5, 0.3, 0.15, 0.05]; mass before each rank: 0, 0.5, 0.8, 0.95
    let l = ln(&[0.5, 0.3, 0.15, 0.05]);
    let case = |p: f32| kept(&run(&TopP::new(p).unwrap(), &empty(), &l));
    assert_eq!(case(0.0), vec![0]); // greedy
    assert_eq!(case(0.45), vec![0]); // token 0 alone crosses 0.45
    assert_eq!(case(0.55), vec![0, 1]); // 0.5 < 0.55 -> token 1 is the crossing token
    assert_eq!(case(0.75), vec![0, 1]); // HF: ascending cumsum [.05,.2,.5,1] <= .25 removed
    assert_eq!(case(0.85), vec![0, 1, 2]);
    assert_eq!(case(0.97), vec![0, 1, 2, 3]);
    assert_eq!(case(1.0), vec![0, 1, 2, 3]);
    // the order is by probability, not by id
    let shuffled = ln(&[0.05, 0.3, 0.5, 0.15]);
    assert_eq!(
        kept(&run(&TopP::new(0.75).unwrap(), &empty(), &shuffled)),
        vec![1, 2]
    );
    // min_tokens_to_keep = 3 overrides p = 0
    let tp = TopP::with_min_tokens_to_keep(0.0, 3).unwrap();
    assert_eq!(kept(&run(&tp, &empty(), &l)), vec![0, 1, 2]);
    // mass before equal to top_p up to rounding has reached it (Hugging Face keeps {0.5, 0.3}:
    // its ascending f32 cumsum 0.1 + 0.1 = 0.19999999 <= 1 - 0.8 removes both 0.1 tokens)
    assert_eq!(kept(&run(&TopP::new(0.8).unwrap(), &empty(), &ln(&[0.3, 0.1, 0.1, 0.5]))), vec![0, 3]);
    assert_eq!(kept(&run(&TopP::new(0.5).unwrap(), &empty(), &ln(&[0.3, 0.1, 0.1, 0.5]))), vec![3]);
    assert_eq!(kept(&run(&TopP::new(0.81).unwrap(), &empty(), &ln(&[0.3, 0.1, 0.1, 0.5]))), vec![0, 1, 3]);
    // ties: [0, 0, 0, 0] (uniform): p = 0.3 -> crossing at rank 1 -> the two lowest ids
    assert_eq!(
        kept(&run(&TopP::new(0.3).unwrap(), &empty(), &[0.0; 4])),
        vec![0, 1]
    );
}

#[test]
fn min_p_scales_with_the_top_probability() {
    // p = [0.5, 0.3, 0.15, 0.05]; threshold = min_p * 0.5
    let l = ln(&[0.5, 0.3, 0.15, 0.05]);
    let case = |m: f32| kept(&run(&MinP::new(m).unwrap(), &empty(), &l));
    assert_eq!(case(0.2), vec![0, 1, 2]); // threshold 0.1
    assert_eq!(case(0.5), vec![0, 1]); // threshold 0.25
    assert_eq!(case(1.0), vec![0]);
    assert_eq!(case(0.0), vec![0, 1, 2, 3]);
    let mp = MinP::with_min_tokens_to_keep(1.0, 2).unwrap();
    assert_eq!(kept(&run(&mp, &empty(), &l)), vec![0, 1]);
}

#[test]
fn typical_p_by_hand() {
    // p = [1/2, 1/4, 1/8, 1/8]: H = 1.75 ln2; surprisal = [1, 2, 3, 3] ln2;
    // |surprisal - H| = [0.75, 0.25, 1.25, 1.25] ln2 -> typicality order 1, 0, {2, 3}
    // cumulative mass in that order: 0.25, 0.75, 0.875, 1.0
    let l = ln(&[0.5, 0.25, 0.125, 0.125]);
    let case = |m: f32| kept(&run(&TypicalP::new(m).unwrap(), &empty(), &l));
    assert_eq!(case(0.2), vec![1]); // the most probable token is NOT the most typical
    assert_eq!(case(0.5), vec![0, 1]);
    assert_eq!(case(0.8), vec![0, 1, 2, 3]); // crossing at token 2, its tie 3 is kept too
    assert_eq!(case(1.0), vec![0, 1, 2, 3]);
}

#[test]
fn epsilon_cutoff_by_hand() {
    let l = ln(&[0.5, 0.3, 0.15, 0.05]);
    let case = |e: f32| kept(&run(&EpsilonCutoff::new(e).unwrap(), &empty(), &l));
    assert_eq!(case(0.1), vec![0, 1, 2]);
    assert_eq!(case(0.2), vec![0, 1]);
    assert_eq!(case(0.6), vec![0]); // every p < 0.6: the best token survives (min_tokens_to_keep)
    assert_eq!(case(0.0), vec![0, 1, 2, 3]);
}

#[test]
fn eta_cutoff_by_hand() {
    // p = [0.5, 0.3, 0.15, 0.05]:
    // H = 0.5 ln2 + 0.3 ln(1/0.3) + 0.15 ln(1/0.15) + 0.05 ln 20
    //   = 0.346574 + 0.361192 + 0.284568 + 0.149787 = 1.142120
    // eta_cutoff 0.3: sqrt(0.3) exp(-H) = 0.547723 * 0.319140 = 0.174800 < 0.3 -> eta = 0.1748
    // eta_cutoff 0.1: sqrt(0.1) exp(-H) = 0.100920 > 0.1 -> eta = 0.1
    let l = ln(&[0.5, 0.3, 0.15, 0.05]);
    let h = 1.142_120_f64;
    assert!((EtaCutoff::new(0.3).unwrap().threshold(h) - 0.174_800).abs() < 1e-5);
    assert!((EtaCutoff::new(0.1).unwrap().threshold(h) - 0.1).abs() < 1e-7);
    let case = |e: f32| kept(&run(&EtaCutoff::new(e).unwrap(), &empty(), &l));
    assert_eq!(case(0.3), vec![0, 1]);
    assert_eq!(case(0.1), vec![0, 1, 2]);
    // uniform over 4: H = ln 4, eta(0.5) = min(0.5, 0.7071 / 4) = 0.1768 <= 0.25: all kept
    assert_eq!(
        kept(&run(&EtaCutoff::new(0.5).unwrap(), &empty(), &[0.0; 4])),
        vec![0, 1, 2, 3]
    );
}

#[test]
fn repetition_penalty_divides_positive_multiplies_negative_once_per_token() {
    let rp = RepetitionPenalty::new(2.0).unwrap();
    let ctx = ProcessContext::new(&[0, 1], &[0, 2, 0], &[]);
    // token 0 appears 3 times but is penalized once: 2 / 2 = 1; token 1: -2 * 2 = -4;
    // token 2: 0 stays 0; tokens 3, 4 untouched.
    assert_eq!(
        run(&rp, &ctx, &[2.0, -2.0, 0.0, 4.0, 1.0]),
        vec![1.0, -4.0, 0.0, 4.0, 1.0]
    );
    // a penalty < 1 encourages: 2 / 0.5 = 4, -2 * 0.5 = -1
    let enc = RepetitionPenalty::new(0.5).unwrap();
    assert_eq!(
        run(&enc, &ctx, &[2.0, -2.0, 0.0, 4.0, 1.0]),
        vec![4.0, -1.0, 0.0, 4.0, 1.0]
    );
    // -inf stays -inf
    assert_eq!(run(&rp, &ctx, &[NINF, 1.0, 1.0, 1.0, 1.0])[0], NINF);
}

#[test]
fn frequency_and_presence_penalties_follow_the_openai_formula() {
    // output [1, 1, 1, 2] (prompt [3] does not count): counts c1 = 3, c2 = 1
    let ctx = ProcessContext::new(&[3], &[1, 1, 1, 2], &[]);
    let l = [0.0f32; 4];
    // frequency 0.5: l1 -= 1.5, l2 -= 0.5
    assert_eq!(
        run(&FrequencyPenalty::new(0.5).unwrap(), &ctx, &l),
        vec![0.0, -1.5, -0.5, 0.0]
    );
    // presence 0.3: l1 -= 0.3, l2 -= 0.3
    assert_eq!(
        run(&PresencePenalty::new(0.3).unwrap(), &ctx, &l),
        vec![0.0, -0.3, -0.3, 0.0]
    );
    // negative frequency encourages
    assert_eq!(
        run(&FrequencyPenalty::new(-1.0).unwrap(), &ctx, &l),
        vec![0.0, 3.0, 1.0, 0.0]
    );
}

#[test]
fn no_repeat_ngram_by_hand() {
    // n = 2, seq = [1, 2, 3, 1]: last token 1; bigrams (1,2), (2,3), (3,1) -> ban 2
    let ctx = ProcessContext::new(&[1, 2, 3], &[1], &[]);
    assert_eq!(NoRepeatNGram::new(2).unwrap().banned_tokens(&ctx), vec![2]);
    let out = run(&NoRepeatNGram::new(2).unwrap(), &ctx, &[0.0; 5]);
    assert_eq!(out, vec![0.0, 0.0, NINF, 0.0, 0.0]);
    // n = 3, seq = [1, 2, 3, 1, 2]: last two [1, 2]; trigram (1, 2, 3) -> ban 3
    let ctx = ProcessContext::new(&[1, 2, 3], &[1, 2], &[]);
    assert_eq!(NoRepeatNGram::new(3).unwrap().banned_tokens(&ctx), vec![3]);
    // n = 1 bans every token seen
    let ctx = ProcessContext::new(&[4], &[0], &[]);
    let out = run(&NoRepeatNGram::new(1).unwrap(), &ctx, &[0.0; 5]);
    assert_eq!(out, vec![NINF, 0.0, 0.0, 0.0, NINF]);
    // a history shorter than n bans nothing; n = 0 disables
    let ctx = ProcessContext::new(&[1], &[], &[]);
    assert!(
        NoRepeatNGram::new(2)
            .unwrap()
            .banned_tokens(&ctx)
            .is_empty()
    );
    let ctx = ProcessContext::new(&[1, 1], &[1], &[]);
    assert!(
        NoRepeatNGram::new(0)
            .unwrap()
            .banned_tokens(&ctx)
            .is_empty()
    );
}

#[test]
fn bad_words_single_and_multi_token_with_eos_exemption() {
    let bw = BadWordsIds::new(vec![vec![5], vec![1, 2], vec![3, 4, 6], vec![0]]).unwrap();
    // history ends with [3, 4]: ban 6 (completes [3, 4, 6]); 5 always; 0 is EOS -> exempt;
    // 2 not banned (history does not end with 1)
    let ctx = ProcessContext::new(&[9, 3], &[4], &[0]);
    let out = run(&bw, &ctx, &[0.0; 10]);
    assert_eq!(kept(&out), vec![0, 1, 2, 3, 4, 7, 8, 9]);
    // history ends with 1: ban 2 as well
    let ctx = ProcessContext::new(&[1], &[], &[0]);
    assert_eq!(
        kept(&run(&bw, &ctx, &[0.0; 10])),
        vec![0, 1, 3, 4, 6, 7, 8, 9]
    );
    // without EOS in the context, [0] is banned
    let ctx = ProcessContext::new(&[7], &[], &[]);
    assert_eq!(
        kept(&run(&bw, &ctx, &[0.0; 10])),
        vec![1, 2, 3, 4, 6, 7, 8, 9]
    );
}

#[test]
fn logit_bias_adds_and_bans() {
    let lb = LogitBias::new(BTreeMap::from([(1, 5.0), (2, NINF)])).unwrap();
    assert_eq!(run(&lb, &empty(), &[0.0, 0.0, 0.0]), vec![0.0, 5.0, NINF]);
    let mut l = vec![0.0; 2];
    let err = lb.process(&empty(), &mut l).unwrap_err();
    assert!(matches!(
        err,
        DecodingError::TokenOutOfRange {
            token: 2,
            vocab_size: 2,
            ..
        }
    ));
}

#[test]
fn min_new_tokens_blocks_eos_and_stop_ids_until_reached() {
    let m = MinNewTokens::new(3, vec![4]).unwrap();
    let ctx = ProcessContext::new(&[1], &[2, 2], &[0]);
    assert_eq!(run(&m, &ctx, &[1.0; 5]), vec![NINF, 1.0, 1.0, 1.0, NINF]);
    let ctx = ProcessContext::new(&[1], &[2, 2, 2], &[0]);
    assert_eq!(run(&m, &ctx, &[1.0; 5]), vec![1.0; 5]);
}

#[test]
fn history_ids_out_of_range_are_errors_not_panics() {
    let ctx = ProcessContext::new(&[7], &[], &[]);
    let mut l = vec![0.0; 3];
    let err = RepetitionPenalty::new(1.3)
        .unwrap()
        .process(&ctx, &mut l)
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "token id 7 in prompt_ids is out of range for a logits row of size 3"
    );
    let ctx = ProcessContext::new(&[], &[], &[9]);
    assert!(
        MinNewTokens::new(1, vec![])
            .unwrap()
            .process(&ctx, &mut l)
            .is_err()
    );
}

#[test]
fn constructors_reject_invalid_values_with_named_errors() {
    let msg = |e: DecodingError| e.to_string();
    assert_eq!(
        msg(TopP::new(1.5).unwrap_err()),
        "top_p must be in [0, 1], got 1.5"
    );
    assert_eq!(
        msg(Temperature::new(-0.1).unwrap_err()),
        "temperature must be a finite number >= 0, got -0.1"
    );
    assert!(Temperature::new(f32::NAN).is_err());
    assert!(Temperature::new(f32::INFINITY).is_err());
    assert!(TopP::new(-0.01).is_err());
    assert!(TopP::new(f32::NAN).is_err());
    assert!(MinP::new(1.01).is_err());
    assert!(TypicalP::new(0.0).is_err());
    assert!(TypicalP::new(1.2).is_err());
    assert!(EpsilonCutoff::new(1.0).is_err());
    assert!(EtaCutoff::new(-0.5).is_err());
    assert_eq!(
        msg(RepetitionPenalty::new(0.0).unwrap_err()),
        "repetition_penalty must be a finite number > 0, got 0"
    );
    assert!(RepetitionPenalty::new(-1.0).is_err());
    assert!(FrequencyPenalty::new(f32::NAN).is_err());
    assert!(PresencePenalty::new(f32::INFINITY).is_err());
    assert!(TopK::with_min_tokens_to_keep(5, 0).is_err());
    assert!(BadWordsIds::new(vec![]).is_err());
    assert!(BadWordsIds::new(vec![vec![1], vec![]]).is_err());
    assert!(LogitBias::new(BTreeMap::from([(0, f32::NAN)])).is_err());
    assert!(LogitBias::new(BTreeMap::from([(0, f32::INFINITY)])).is_err());
}

#[test]
fn all_neg_inf_rows_are_left_alone_by_warpers() {
    let row = [NINF; 3];
    let warpers: Vec<Box<dyn LogitsProcessor>> = vec![
        Box::new(Temperature::new(0.7).unwrap()),
        Box::new(Temperature::new(0.0).unwrap()),
        Box::new(TopK::new(1).unwrap()),
        Box::new(TopP::new(0.5).unwrap()),
        Box::new(MinP::new(0.5).unwrap()),
        Box::new(TypicalP::new(0.5).unwrap()),
        Box::new(EpsilonCutoff::new(0.5).unwrap()),
        Box::new(EtaCutoff::new(0.5).unwrap()),
    ];
    for w in &warpers {
        assert_eq!(
            run(w.as_ref(), &empty(), &row),
            row.to_vec(),
            "{}",
            w.name()
        );
    }
}

#[test]
fn renormalized_top_k_distribution_matches_hand_values() {
    // logits ln[0.4, 0.3, 0.2, 0.1], top_k = 2 -> [0.4, 0.3] / 0.7 = [4/7, 3/7]
    let out = run(&TopK::new(2).unwrap(), &empty(), &ln(&[0.4, 0.3, 0.2, 0.1]));
    let p = common::probs(&out);
    assert!((p[0] - 4.0 / 7.0).abs() < 1e-6 && (p[1] - 3.0 / 7.0).abs() < 1e-6);
    assert_eq!(&p[2..], &[0.0, 0.0]);
}

#[test]
fn top_p_on_a_large_flat_tail_matches_the_brute_force_nucleus() {
    // 10_000 tokens: 5 peaks and a long flat tail; p close to 1 forces the nucleus deep into
    // the tail (the candidate pruning must fall back to every token).
    let mut l = vec![0.0f32; 10_000];
    for (k, x) in l.iter_mut().enumerate() {
        *x = -((k % 97) as f32) * 0.05;
    }
    for k in 0..5 {
        l[k * 1000 + 3] = 9.0 - k as f32;
    }
    for p in [0.3f32, 0.9, 0.99, 0.999_9] {
        let out = run(&TopP::new(p).unwrap(), &empty(), &l);
        // brute force: full sort (value desc, id asc), keep while mass before < p
        let probs = common::probs(&l);
        let mut idx: Vec<usize> = (0..l.len()).collect();
        idx.sort_by(|&a, &b| l[b].partial_cmp(&l[a]).unwrap().then(a.cmp(&b)));
        let mut before = 0.0;
        let mut expect = vec![false; l.len()];
        for &i in &idx {
            if before >= f64::from(p) {
                break;
            }
            expect[i] = true;
            before += probs[i];
        }
        let got: Vec<bool> = out.iter().map(|x| *x > NINF).collect();
        let n = got.iter().filter(|&&k| k).count();
        assert_eq!(got, expect, "p = {p}: kept {n}");
    }
}
