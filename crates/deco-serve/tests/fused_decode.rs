//! The fused CPU decode attention (`Llama::set_fused_decode_attention(true)`, the default on
//! the CPU) gives the same logits as the burn reference path (`false`) within 1e-4 on
//! SmolLM2-135M for a ragged batch, through the dense and the paged cache: prefill, batched
//! greedy decode, a step mixing a prefill chunk with decodes, and a sequence joining with a
//! one-token prompt. The keys/values left in the caches agree as well.

use burn::tensor::Device;
use deco_formats::checkpoint::Checkpoint;
use deco_model::{DenseKvCache, KvCache, Llama, LogitsWanted, SeqInput};
use deco_serve::{CacheShape, PagedKvCache};
use deco_tests::{argmax, max_abs_diff};

const PROMPTS: [&[u32]; 4] = [
    &[504, 3575, 282, 4649, 314],
    &[6403, 1980, 253, 655, 28, 665, 436, 253, 1838, 8085, 3365, 11026, 100, 617],
    &[2068],
    &[2068, 325, 28, 355, 441, 288, 325, 28, 338, 314, 260, 1962, 42, 504, 3575, 282, 4649, 314, 6403, 1980, 253, 655, 28, 665],
];

/// One step: `(sequence, new tokens)`.
type Step = Vec<(u64, Vec<u32>)>;

/// Runs `steps` through `model` and `cache`, returning every step's last-token logits.
fn run(model: &Llama, cache: &mut dyn KvCache, steps: &[Step]) -> Vec<Vec<Vec<f32>>> {
    steps
        .iter()
        .map(|step| {
            let inputs: Vec<SeqInput<'_>> = step.iter().map(|(s, t)| SeqInput { seq: *s, tokens: t, tree: None }).collect();
            model.forward(&inputs, cache, LogitsWanted::Last).expect("forward").logits_rows().expect("rows")
        })
        .collect()
}

/// The step schedule: prefill of sequences 0, 1, 3 together; 5 batched greedy decode steps
/// (tokens chosen by the reference path); then sequence 2 joins with its one-token prompt while
/// sequence 1 gets a 3-token chunk and the others decode; then 2 more decode steps of all four.
fn schedule(reference: &Llama) -> Vec<Step> {
    let mut cache = DenseKvCache::new(reference.num_layers());
    let mut steps: Vec<Step> = vec![vec![(0, PROMPTS[0].to_vec()), (1, PROMPTS[1].to_vec()), (3, PROMPTS[3].to_vec())]];
    let mut last = run(reference, &mut cache, &steps[..1]).remove(0);
    let push = |step: Step, cache: &mut DenseKvCache, steps: &mut Vec<Step>| {
        let rows = run(reference, cache, std::slice::from_ref(&step)).remove(0);
        steps.push(step);
        rows
    };
    for _ in 0..5 {
        let step: Step = [0u64, 1, 3].iter().zip(&last).map(|(&s, r)| (s, vec![argmax(r)])).collect();
        last = push(step, &mut cache, &mut steps);
    }
    let mixed: Step = vec![(0, vec![argmax(&last[0])]), (1, vec![argmax(&last[1]), 28, 665]), (2, PROMPTS[2].to_vec()), (3, vec![argmax(&last[2])])];
    last = push(mixed, &mut cache, &mut steps);
    for _ in 0..2 {
        let step: Step = [0u64, 1, 2, 3].iter().zip(&last).map(|(&s, r)| (s, vec![argmax(r)])).collect();
        last = push(step, &mut cache, &mut steps);
    }
    steps
}

fn compare(what: &str, fused: &[Vec<Vec<f32>>], reference: &[Vec<Vec<f32>>]) {
    assert_eq!(fused.len(), reference.len());
    for (step, (f, r)) in fused.iter().zip(reference).enumerate() {
        assert_eq!(f.len(), r.len());
        for (row, (a, b)) in f.iter().zip(r).enumerate() {
            let d = max_abs_diff(a, b);
            assert!(d < 1e-4, "{what}: step {step} row {row}: fused vs reference max |diff| {d}");
        }
    }
}

/// Max |diff| between two caches' keys/values of `seq` over all layers (via host views).
fn cache_diff(a: &dyn KvCache, b: &dyn KvCache, layers: usize, seq: u64) -> f32 {
    let len = a.seq_len(seq);
    assert_eq!(len, b.seq_len(seq));
    let mut worst = 0.0f32;
    for l in 0..layers {
        let (x, y) = (a.host_view(l, seq, len).expect("view a"), b.host_view(l, seq, len).expect("view b"));
        for k in [true, false] {
            let (fx, fy) = (flat_paged(&x, k), flat_paged(&y, k));
            worst = worst.max(max_abs_diff(&fx, &fy));
        }
    }
    worst
}

/// The `len` rows of a host view in position order, as f32 (f16 values widened exactly).
fn flat_paged(s: &deco_model::HostKv<'_>, k: bool) -> Vec<f32> {
    fn rows<E: deco_kernels::attention::KvElement>(s: &deco_model::kv_cache::SeqKv<'_, E>, k: bool) -> Vec<f32> {
        // Row size from the model: SmolLM2 has 3 kv heads of 64.
        let row = 3 * 64;
        let src = if k { s.k } else { s.v };
        let mut out = Vec::with_capacity(s.len * row);
        for p in 0..s.len {
            let off = s.physical_row(p) * row;
            out.extend(src[off..off + row].iter().map(|x| x.to_f32()));
        }
        out
    }
    match s {
        deco_model::HostKv::F32(s) => rows(s, k),
        deco_model::HostKv::F16(s) => rows(s, k),
    }
}

/// SmolLM2 with the fused decode attention, the same model on the burn reference path, and
/// [`schedule`] (chosen by the reference path).
fn models() -> (Device, Llama, Llama, Vec<Step>) {
    let device = Device::default();
    let ckpt = Checkpoint::open(deco_tests::smollm2_gguf()).expect("open model");
    let fused = Llama::load(&ckpt, &device, Some(512)).expect("load model");
    let mut reference = fused.clone();
    reference.set_fused_decode_attention(false);
    let steps = schedule(&reference);
    (device, fused, reference, steps)
}

#[test]
fn fused_decode_logits_equal_reference_path() {
    let (device, fused, reference, steps) = models();
    let cfg = &fused.config;
    assert_eq!((cfg.num_key_value_heads, cfg.head_dim), (3, 64));
    let n_layers = fused.num_layers();

    // Dense cache.
    let mut dense_ref = DenseKvCache::new(n_layers);
    let mut dense_fused = DenseKvCache::new(n_layers);
    let want = run(&reference, &mut dense_ref, &steps);
    let got = run(&fused, &mut dense_fused, &steps);
    compare("dense", &got, &want);
    // The fused path really ran: its layers are host-resident; the reference ones are not.
    for seq in 0..4u64 {
        let len = dense_fused.seq_len(seq);
        assert!(dense_fused.host_view(0, seq, len).is_some(), "sequence {seq} went through the fused path");
        assert!(dense_ref.host_view(0, seq, len).is_none());
    }

    // Paged caches, block sizes 1, 4 (partially filled last blocks) and 16.
    for block_size in [1usize, 4, 16] {
        let shape = CacheShape { n_layers, kv_heads: 3, head_dim: 64, block_size, num_blocks: 256 / block_size.min(4) * 2 };
        let mut paged_ref = PagedKvCache::new(shape, &device).expect("cache");
        let mut paged_fused = PagedKvCache::new(shape, &device).expect("cache");
        let want_p = run(&reference, &mut paged_ref, &steps);
        let got_p = run(&fused, &mut paged_fused, &steps);
        compare(&format!("paged block {block_size}"), &got_p, &want_p);
        compare(&format!("paged block {block_size} vs dense reference"), &got_p, &want);
        for seq in 0..4u64 {
            let d = cache_diff(&paged_fused, &paged_ref, n_layers, seq);
            assert!(d < 1e-4, "paged block {block_size} sequence {seq}: cached K/V differ by {d}");
            let d = cache_diff(&paged_fused, &dense_fused, n_layers, seq);
            assert!(d < 1e-4, "paged block {block_size} vs dense sequence {seq}: cached K/V differ by {d}");
        }
        paged_fused.check_consistency().expect("consistent");
    }
}

/// An f16 paged cache (`KvCacheDtype::F16`) holds exactly the f16 rounding of the keys and
/// values the f32 cache holds where their inputs agree (layer 0, whose keys depend on the
/// embeddings only); its logits stay within 0.05 of the f32 cache's, with the same greedy
/// tokens on this schedule, through the fused kernel (which widens the blocks in registers) and
/// through the burn path (which gathers them back to f32).
#[test]
fn f16_cache_rounds_keys_and_values_and_stays_close() {
    use deco_serve::KvCacheDtype;
    use half::f16;
    let (device, fused, reference, steps) = models();
    let n_layers = fused.num_layers();
    let shape = CacheShape { n_layers, kv_heads: 3, head_dim: 64, block_size: 4, num_blocks: 128 };
    let mut c32 = PagedKvCache::new(shape, &device).expect("cache");
    let mut c16 = PagedKvCache::with_dtype(shape, KvCacheDtype::F16, &device).expect("cache");
    let mut c16_ref = PagedKvCache::with_dtype(shape, KvCacheDtype::F16, &device).expect("cache");
    assert_eq!(c16.dtype(), KvCacheDtype::F16);
    let l32 = run(&fused, &mut c32, &steps);
    let l16 = run(&fused, &mut c16, &steps);
    let l16_ref = run(&reference, &mut c16_ref, &steps);
    // Tiny f32 differences between the two attention paths flip f16 roundings of later layers'
    // keys (one f16 step, ~1e-3 relative), so the paths agree to f16 precision, not to 1e-4.
    for (what, other) in [("f32 cache", &l32), ("f16 cache, burn path", &l16_ref)] {
        let mut worst = 0.0f32;
        for (a, b) in l16.iter().flatten().zip(other.iter().flatten()) {
            worst = worst.max(max_abs_diff(a, b));
            assert_eq!(argmax(a), argmax(b), "greedy token of the f16 cache differs from the {what}'s");
        }
        eprintln!("f16 cache (fused) vs {what}: max |logit diff| {worst}");
        assert!(worst < 0.05, "f16 cache vs {what}: a logit moved by {worst}");
    }
    for seq in 0..4u64 {
        let len = c32.seq_len(seq);
        let (Some(a @ deco_model::HostKv::F32(_)), Some(b @ deco_model::HostKv::F16(_))) = (c32.host_view(0, seq, len), c16.host_view(0, seq, len)) else {
            panic!("sequence {seq}: expected an f32 and an f16 view");
        };
        for k in [true, false] {
            let (x, y) = (flat_paged(&a, k), flat_paged(&b, k));
            assert_eq!(x.len(), y.len());
            // `y` is the stored f16 widened exactly, so narrowing it again gives the stored bits.
            for (i, (x, y)) in x.iter().zip(&y).enumerate() {
                assert_eq!(f16::from_f32(*x).to_bits(), f16::from_f32(*y).to_bits(), "sequence {seq} value {i} (position {}, keys {k})", i / 192);
            }
        }
    }
    c16.check_consistency().expect("consistent");
    // A key beyond f16's range is refused with a message, through both write paths; the
    // largest f16 is stored.
    let tiny = CacheShape { n_layers: 1, kv_heads: 1, head_dim: 2, block_size: 4, num_blocks: 4 };
    let mut c = PagedKvCache::with_dtype(tiny, KvCacheDtype::F16, &device).expect("cache");
    c.append_host(0, 9, &[65504.0, -1.0], &[0.5, 2.0], 1, 2).expect("in range");
    let err = c.append_host(0, 9, &[1.0, 70000.0], &[0.0, 0.0], 1, 2).expect_err("out of range");
    assert!(err.to_string().contains("f16") && err.to_string().contains("70000"), "{err}");
    let big = burn::tensor::Tensor::<3>::from_data(burn::tensor::TensorData::new(vec![0.0f32, -1e6], [1, 1, 2]), &device);
    assert!(c.append(0, 9, big.clone(), big).is_err(), "the burn path's write refuses it too");
    assert!("f16".parse::<KvCacheDtype>().is_ok_and(|d| d == KvCacheDtype::F16));
    let err = "int4".parse::<KvCacheDtype>().expect_err("unknown dtype");
    assert!(err.to_string().contains("int4"), "{err}");
}
