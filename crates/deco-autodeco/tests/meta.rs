//! The meta-instruction ranking stage on a synthetic pool whose instruction variants differ
//! along a hidden direction: the stage must learn the order on questions it never saw, keep the
//! predictions without an instruction near stage one's, and [`measure`] must agree with an
//! independent recount from [`HostHeads::predict`].

use burn::tensor::{Device, Tensor, TensorData};
use deco_autodeco::heads::{AutoDecoConfig, AutoDecoHeads, HostHeads};
use deco_autodeco::meta::{MetaConfig, MetaPrompt, measure, train_meta};
use deco_autodeco::train::FrozenHead;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const H: usize = 16;
const V: usize = 48;
const ROWS: usize = 4;

fn normal(rng: &mut ChaCha8Rng) -> f32 {
    // Box–Muller.
    let u: f32 = rng.random_range(1e-6..1.0);
    let v: f32 = rng.random_range(0.0..1.0);
    (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
}

/// `n` questions: `none` rows are random, `low` = none − d, `high` = none + d (two phrasings each,
/// scaled by 0.8 and 1.2), for a fixed direction `d`.
fn pool(rng: &mut ChaCha8Rng, n: usize, d: &[f32]) -> Vec<MetaPrompt> {
    (0..n)
        .map(|item| {
            let none: Vec<f32> = (0..ROWS * H).map(|_| normal(rng)).collect();
            let shift = |s: f32| -> Vec<f32> { none.iter().enumerate().map(|(i, &x)| x + s * d[i % H]).collect() };
            MetaPrompt { item, rows: ROWS, low: vec![(0, shift(-0.8)), (1, shift(-1.2))], high: vec![(0, shift(0.8)), (1, shift(1.2))], none }
        })
        .collect()
}

fn setup() -> (HostHeads, FrozenHead, Vec<MetaPrompt>, Vec<MetaPrompt>) {
    let device = Device::flex();
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let d: Vec<f32> = (0..H).map(|_| normal(&mut rng)).collect();
    let w: Vec<f32> = (0..H * V).map(|_| normal(&mut rng)).collect();
    let head = FrozenHead { weight: Tensor::<2>::from_data(TensorData::new(w, [H, V]), &device), device: device.clone() };
    let cfg = AutoDecoConfig { head_hidden_size: 32, ..AutoDecoConfig::new(H, V) };
    device.seed(5);
    let stage_one = AutoDecoHeads::init(&cfg, &device).expect("init").to_host(&cfg).expect("host");
    let train = pool(&mut rng, 64, &d);
    let held = pool(&mut rng, 24, &d);
    (stage_one, head, train, held)
}

/// Mean T of each block of a question, recomputed from `predict` (independent of `measure`).
fn mean_t(heads: &HostHeads, head: &FrozenHead, block: &[f32]) -> f64 {
    let z = head.logits(block, ROWS).expect("logits");
    (0..ROWS).map(|r| f64::from(heads.predict(&block[r * H..(r + 1) * H], &z[r * V..(r + 1) * V]).expect("predict").temperature)).sum::<f64>() / ROWS as f64
}

#[test]
fn ranking_stage_learns_the_order_on_unseen_questions() {
    let (stage_one, head, train, held) = setup();
    let logits = |h: &[f32], n: usize| head.logits(h, n);
    let (before, _) = measure(&stage_one, &held, &logits).expect("measure");
    let mc = MetaConfig { steps: 300, batch_size: 16, learning_rate: 3e-3, ..MetaConfig::default() };
    let (after_heads, log) = train_meta(&stage_one, &train, &head, &mc, &mut |_| {}).expect("train");
    // Without the top-p head (margin_p 0) the stage orders T too.
    let t_only = MetaConfig { margin_p: 0.0, ..mc.clone() };
    let (t_heads, t_log) = train_meta(&stage_one, &train, &head, &t_only, &mut |_| {}).expect("train T only");
    assert!(t_log.iter().all(|r| r.rank_p.is_nan()));
    let (t_rep, _) = measure(&t_heads, &held, &|h: &[f32], n: usize| head.logits(h, n)).expect("measure");
    assert!(t_rep.frac_t_order >= 0.95, "{t_rep:?}");
    assert_eq!(log.len(), 300);
    let (after, trace) = measure(&after_heads, &held, &logits).expect("measure");
    // Random heads do not order the variants; the trained ones do, by the margin's size.
    assert!(before.frac_t_order < 0.9, "before: {before:?}");
    assert!(after.frac_t_order >= 0.95, "after: {after:?}");
    assert!(after.delta_t_low <= -0.1 && after.delta_t_high >= 0.1, "after: {after:?}");
    let first = log.iter().take(20).map(|r| r.rank_t).sum::<f64>();
    let last = log.iter().rev().take(20).map(|r| r.rank_t).sum::<f64>();
    assert!(last < 0.5 * first, "ranking loss {first} -> {last}");
    // The anchor keeps the no-instruction predictions near stage one's.
    let drift = held.iter().map(|q| (mean_t(&after_heads, &head, &q.none) - mean_t(&stage_one, &head, &q.none)).abs()).sum::<f64>() / held.len() as f64;
    assert!(drift < 0.1, "mean |T_none - T_none stage one| = {drift}");
    // `measure` against a recount: mean ΔT and the order fraction.
    let (mut dl, mut order, mut pairs) = (0.0, 0usize, 0usize);
    for q in &held {
        let tn = mean_t(&after_heads, &head, &q.none);
        let tl: Vec<f64> = q.low.iter().map(|(_, b)| mean_t(&after_heads, &head, b)).collect();
        let th: Vec<f64> = q.high.iter().map(|(_, b)| mean_t(&after_heads, &head, b)).collect();
        dl += tl.iter().map(|t| t - tn).sum::<f64>();
        for a in &tl {
            for b in &th {
                order += usize::from(*a < tn && tn < *b);
                pairs += 1;
            }
        }
    }
    assert!((after.delta_t_low - dl / (2 * held.len()) as f64).abs() < 1e-9);
    assert!((after.frac_t_order - order as f64 / pairs as f64).abs() < 1e-12);
    assert_eq!(after.questions, held.len());
    // The trace is the first question's per-position predictions.
    assert_eq!(trace.iter().map(Vec::len).collect::<Vec<_>>(), vec![ROWS; 3]);
    assert!((trace[0].iter().map(|&(t, _)| f64::from(t)).sum::<f64>() / ROWS as f64 - mean_t(&after_heads, &head, &held[0].none)).abs() < 1e-6);
}

#[test]
fn bad_inputs_are_refused_with_the_reason() {
    let (stage_one, head, mut train, _) = setup();
    let bad = MetaConfig { margin_t: -0.1, ..MetaConfig::default() };
    let e = train_meta(&stage_one, &train, &head, &bad, &mut |_| {}).expect_err("negative margin");
    assert!(e.to_string().contains("margin_t"), "{e}");
    let bad = MetaConfig { positions_per_question: 0, ..MetaConfig::default() };
    let e = train_meta(&stage_one, &train, &head, &bad, &mut |_| {}).expect_err("no positions");
    assert!(e.to_string().contains("positions_per_question"), "{e}");
    let e = train_meta(&stage_one, &[], &head, &MetaConfig::default(), &mut |_| {}).expect_err("empty pool");
    assert!(e.to_string().contains("no questions"), "{e}");
    train[3].none.pop();
    let e = train_meta(&stage_one, &train, &head, &MetaConfig::default(), &mut |_| {}).expect_err("short hidden");
    assert!(e.to_string().contains("question 3"), "{e}");
    let logits = |h: &[f32], n: usize| head.logits(h, n);
    assert!(measure(&stage_one, &train[3..4], &logits).is_err());
}

#[test]
fn pool_cache_round_trips_and_checks_its_key() {
    let (_, _, train, held) = setup();
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("pools.bin");
    deco_autodeco::meta::save_pools(&path, "model=a", H, &[&train, &held]).expect("save");
    let back = deco_autodeco::meta::load_pools(&path, "model=a", H).expect("load").expect("same key");
    assert_eq!(back.len(), 2);
    for (a, b) in back.iter().zip([&train, &held]) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b.iter()) {
            assert_eq!((x.item, x.rows, &x.none, &x.low, &x.high), (y.item, y.rows, &y.none, &y.low, &y.high));
        }
    }
    assert!(deco_autodeco::meta::load_pools(&path, "model=b", H).expect("other key").is_none());
    assert!(deco_autodeco::meta::load_pools(&path, "model=a", H + 1).expect("other size").is_none());
    assert!(deco_autodeco::meta::load_pools(&dir.path().join("missing"), "model=a", H).expect("missing").is_none());
    let bytes = std::fs::read(&path).expect("read");
    std::fs::write(&path, &bytes[..bytes.len() - 3]).expect("truncate");
    let e = deco_autodeco::meta::load_pools(&path, "model=a", H).expect_err("truncated");
    assert!(e.to_string().contains("truncated"), "{e}");
}
