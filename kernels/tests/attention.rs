//! `paged_decode_attention` against a naive f64 softmax attention written here, over ragged
//! batches, block sizes 1..=16 (partially filled last blocks, shuffled block tables, blocks
//! shared by several sequences), GQA ratios 1/3/4, head_dim 64 and odd sizes, lengths 1..=300,
//! scalar and AVX2; plus the error cases.

use deco_kernels::Error;
use deco_kernels::attention::{AttnShape, KvElement, SeqKv, paged_decode_attention, paged_decode_attention_with};
use half::f16;
use deco_kernels::quant::Isa;
use proptest::prelude::*;

/// SplitMix64 (the test needs no `rand` dependency).
struct StdRng(u64);

impl StdRng {
    fn seed_from_u64(seed: u64) -> Self {
        Self(seed)
    }
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `r` (`f32` half-open or `usize` half-open).
    fn random_range<T: FromUnit>(&mut self, r: std::ops::Range<T>) -> T {
        T::from_unit((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64, r)
    }
    fn random_bool(&mut self, p: f64) -> bool {
        ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64) < p
    }
}

trait FromUnit: Sized {
    fn from_unit(u: f64, r: std::ops::Range<Self>) -> Self;
}

impl FromUnit for f32 {
    fn from_unit(u: f64, r: std::ops::Range<f32>) -> f32 {
        (r.start as f64 + u * (r.end - r.start) as f64) as f32
    }
}

impl FromUnit for usize {
    fn from_unit(u: f64, r: std::ops::Range<usize>) -> usize {
        (r.start + (u * (r.end - r.start) as f64) as usize).min(r.end - 1)
    }
}

fn shuffle<T>(v: &mut [T], rng: &mut StdRng) {
    for i in (1..v.len()).rev() {
        let j = rng.random_range(0..i + 1);
        v.swap(i, j);
    }
}

/// Naive attention of one query row over `len` positions, f64: returns (out, Σ_p p_p |v_p|) per
/// element of head `h`.
fn reference<E: KvElement>(q: &[f32], s: &SeqKv<'_, E>, shape: AttnShape, h: usize) -> (Vec<f64>, Vec<f64>) {
    let AttnShape { n_heads, kv_heads, head_dim: d } = shape;
    let j = h / (n_heads / kv_heads);
    let row = kv_heads * d;
    let at = |p: usize| (s.block_table[p / s.block_size] as usize * s.block_size + p % s.block_size) * row + j * d;
    let scores: Vec<f64> = (0..s.len)
        .map(|p| {
            let o = at(p);
            (0..d).map(|i| q[i] as f64 * s.k[o + i].to_f32() as f64).sum::<f64>() / (d as f64).sqrt()
        })
        .collect();
    let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = scores.iter().map(|x| (x - mx).exp()).collect();
    let z: f64 = e.iter().sum();
    let mut out = vec![0.0; d];
    let mut mag = vec![0.0; d];
    for (p, ep) in e.iter().enumerate() {
        let o = at(p);
        for i in 0..d {
            out[i] += ep / z * s.v[o + i].to_f32() as f64;
            mag[i] += ep / z * (s.v[o + i].to_f32() as f64).abs();
        }
    }
    (out, mag)
}

fn check<E: KvElement>(q: &[f32], shape: AttnShape, seqs: &[SeqKv<'_, E>], isa: Isa) -> Result<(), TestCaseError> {
    let d = shape.head_dim;
    let mut out = vec![f32::NAN; q.len()];
    paged_decode_attention_with(q, shape, seqs, &mut out, isa).map_err(|e| TestCaseError::fail(e.to_string()))?;
    for (si, s) in seqs.iter().enumerate() {
        for h in 0..shape.n_heads {
            let base = (si * shape.n_heads + h) * d;
            let (r, mag) = reference(&q[base..base + d], s, shape, h);
            for i in 0..d {
                let got = out[base + i] as f64;
                let tol = 1e-5 * mag[i] + 1e-30;
                prop_assert!(
                    (got - r[i]).abs() <= tol,
                    "{isa:?} seq {si} (len {}, bs {}) head {h} dim {i}: {got} vs {} (tol {tol:e})",
                    s.len,
                    s.block_size,
                    r[i]
                );
            }
        }
    }
    Ok(())
}

fn isas() -> Vec<Isa> {
    [Isa::Scalar, Isa::Avx2, Isa::Avx512].into_iter().filter(|i| i.is_available()).collect()
}

#[derive(Debug, Clone)]
struct Case {
    kv_heads: usize,
    ratio: usize,
    head_dim: usize,
    block_size: usize,
    lens: Vec<usize>,
    q_scale: f32,
    seed: u64,
}

fn case() -> impl Strategy<Value = Case> {
    (
        1usize..=3,
        prop::sample::select(vec![1usize, 3, 4]),
        prop::sample::select(vec![64usize, 1, 3, 7, 8, 16, 17, 33, 48, 63, 65, 80, 128, 192]),
        1usize..=16,
        prop::collection::vec(prop_oneof![1usize..=300, 1usize..=20, 200usize..=700], 1..=6),
        prop::sample::select(vec![0.1f32, 1.0, 3.0]),
        any::<u64>(),
    )
        .prop_map(|(kv_heads, ratio, head_dim, block_size, lens, q_scale, seed)| Case {
            kv_heads,
            ratio,
            head_dim,
            block_size,
            lens,
            q_scale,
            seed,
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 160, ..ProptestConfig::default() })]

    /// One shared paged storage; each sequence's blocks are a random subset of the pool in
    /// random order; the first two sequences may share their leading blocks (a fork).
    #[test]
    fn paged_matches_f64_reference(c in case()) {
        let mut rng = StdRng::seed_from_u64(c.seed);
        let shape = AttnShape { n_heads: c.kv_heads * c.ratio, kv_heads: c.kv_heads, head_dim: c.head_dim };
        let row = c.kv_heads * c.head_dim;
        let needed: usize = c.lens.iter().map(|l| l.div_ceil(c.block_size)).sum();
        let num_blocks = needed + rng.random_range(0..4);
        let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
        shuffle(&mut ids, &mut rng);
        let mut tables: Vec<Vec<u32>> = Vec::new();
        let mut next = 0;
        for (i, &len) in c.lens.iter().enumerate() {
            let nb = len.div_ceil(c.block_size);
            let mut t: Vec<u32> = ids[next..next + nb].to_vec();
            next += nb;
            if i == 1 && rng.random_bool(0.5) {
                // Share a prefix with sequence 0 (copy-on-write fork before divergence).
                let t0: Vec<u32> = tables[0].clone();
                let shared = t0.len().min(nb.saturating_sub(1));
                t[..shared].copy_from_slice(&t0[..shared]);
            }
            // Extra table entries past the last needed block must be ignored.
            if rng.random_bool(0.3) {
                t.push(ids[rng.random_range(0..ids.len())]);
            }
            tables.push(t);
        }
        let total = num_blocks * c.block_size * row;
        let k: Vec<f32> = (0..total).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let v: Vec<f32> = (0..total).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let seqs: Vec<SeqKv<'_>> = c.lens.iter().zip(&tables).map(|(&len, t)| SeqKv {
            k: &k, v: &v, block_table: t, block_size: c.block_size, len,
        }).collect();
        let q: Vec<f32> = (0..seqs.len() * shape.n_heads * c.head_dim)
            .map(|_| rng.random_range(-1.0f32..1.0) * c.q_scale)
            .collect();
        for isa in isas() {
            check(&q, shape, &seqs, isa)?;
        }
        // The same storage in f16: against the reference on the rounded values, and bit for bit
        // the f32 kernel's result on those values widened back to f32.
        let (k16, v16): (Vec<f16>, Vec<f16>) = (k.iter().map(|&x| f16::from_f32(x)).collect(), v.iter().map(|&x| f16::from_f32(x)).collect());
        let (kw, vw): (Vec<f32>, Vec<f32>) = (k16.iter().map(|x| x.to_f32()).collect(), v16.iter().map(|x| x.to_f32()).collect());
        let seqs16: Vec<SeqKv<'_, f16>> = seqs.iter().map(|s| SeqKv { k: &k16, v: &v16, block_table: s.block_table, block_size: s.block_size, len: s.len }).collect();
        let seqsw: Vec<SeqKv<'_>> = seqs.iter().map(|s| SeqKv { k: &kw, v: &vw, ..*s }).collect();
        for isa in isas() {
            check(&q, shape, &seqs16, isa)?;
            let (mut a, mut b) = (vec![f32::NAN; q.len()], vec![f32::NAN; q.len()]);
            paged_decode_attention_with(&q, shape, &seqs16, &mut a, isa).map_err(|e| TestCaseError::fail(e.to_string()))?;
            paged_decode_attention_with(&q, shape, &seqsw, &mut b, isa).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "{isa:?}: f16 storage differs from its f32 widening");
        }
    }

    /// Contiguous storage per sequence (the dense cache): `block_table = [0]`, `block_size = len`
    /// (or larger, storage longer than `len`).
    #[test]
    fn contiguous_matches_f64_reference(c in case()) {
        let mut rng = StdRng::seed_from_u64(c.seed);
        let shape = AttnShape { n_heads: c.kv_heads * c.ratio, kv_heads: c.kv_heads, head_dim: c.head_dim };
        let row = c.kv_heads * c.head_dim;
        let stores: Vec<(Vec<f32>, Vec<f32>, usize)> = c.lens.iter().map(|&len| {
            let cap = len + rng.random_range(0..3);
            let k = (0..cap * row).map(|_| rng.random_range(-1.0f32..1.0)).collect();
            let v = (0..cap * row).map(|_| rng.random_range(-1.0f32..1.0)).collect();
            (k, v, cap)
        }).collect();
        let seqs: Vec<SeqKv<'_>> = c.lens.iter().zip(&stores).map(|(&len, (k, v, cap))| SeqKv {
            k, v, block_table: &[0], block_size: *cap, len,
        }).collect();
        let q: Vec<f32> = (0..seqs.len() * shape.n_heads * c.head_dim)
            .map(|_| rng.random_range(-1.0f32..1.0) * c.q_scale)
            .collect();
        for isa in isas() {
            check(&q, shape, &seqs, isa)?;
        }
    }
}

/// More than 64 query heads per kv head and a dominant late key
/// (the running max changes across tiles).
#[test]
fn wide_groups_and_late_max() {
    let mut rng = StdRng::seed_from_u64(7);
    let shape = AttnShape { n_heads: 130, kv_heads: 1, head_dim: 5 };
    let len = 100;
    let mut k: Vec<f32> = (0..len * 5).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let v: Vec<f32> = (0..len * 5).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    for x in &mut k[97 * 5..98 * 5] {
        *x *= 8.0;
    }
    let q: Vec<f32> = (0..130 * 5).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let table = [0u32];
    let seqs = [SeqKv { k: &k, v: &v, block_table: &table, block_size: len, len }];
    for isa in isas() {
        check(&q, shape, &seqs, isa).expect("matches");
    }
}

/// The split-K cut: chunks of at most `CHUNK` positions covering the sequence, one chunk up to
/// `CHUNK`, an even count beyond, no empty chunk below 65,000 positions.
#[test]
fn split_is_even_and_covers() {
    use deco_kernels::attention::{CHUNK, split};
    for len in (1..=4096).chain((4097..=70_000).step_by(97)) {
        let (n, size) = split(len);
        assert!(n >= 1 && (1..=CHUNK).contains(&size) && n * size >= len, "len {len}: {n} × {size}");
        assert!(len <= CHUNK || n.is_multiple_of(2), "len {len}: {n} chunks");
        assert!(len > CHUNK || n == 1, "len {len}: {n} chunks");
        assert!(len > 65_000 || (n - 1) * size < len, "len {len}: empty last chunk");
    }
}

/// A sequence gets the same bits alone, in a batch and on one thread as on the pool: the
/// split-K cut depends only on its length (lengths around the chunk boundaries, `CHUNK` = 256).
#[test]
fn batch_and_thread_invariant() {
    let mut rng = StdRng::seed_from_u64(11);
    let shape = AttnShape { n_heads: 9, kv_heads: 3, head_dim: 64 };
    let row = 3 * 64;
    let lens = [1usize, 31, 255, 256, 257, 700, 513, 40, 900, 512, 1025];
    let stores: Vec<(Vec<f32>, Vec<f32>)> = lens
        .iter()
        .map(|&len| {
            let k = (0..len * row).map(|_| rng.random_range(-1.0f32..1.0)).collect();
            let v = (0..len * row).map(|_| rng.random_range(-1.0f32..1.0)).collect();
            (k, v)
        })
        .collect();
    let seqs: Vec<SeqKv<'_>> = lens
        .iter()
        .zip(&stores)
        .map(|(&len, (k, v))| SeqKv { k, v, block_table: &[0], block_size: len, len })
        .collect();
    let n = 9 * 64;
    let q: Vec<f32> = (0..seqs.len() * n).map(|_| rng.random_range(-2.0f32..2.0)).collect();
    for isa in isas() {
        let mut batch = vec![0.0f32; q.len()];
        paged_decode_attention_with(&q, shape, &seqs, &mut batch, isa).expect("batch");
        let one_thread = rayon::ThreadPoolBuilder::new().num_threads(1).build().expect("pool");
        let mut serial = vec![0.0f32; q.len()];
        one_thread.install(|| paged_decode_attention_with(&q, shape, &seqs, &mut serial, isa)).expect("serial");
        for (i, s) in seqs.iter().enumerate() {
            let mut alone = vec![0.0f32; n];
            paged_decode_attention_with(&q[i * n..(i + 1) * n], shape, std::slice::from_ref(s), &mut alone, isa)
                .expect("alone");
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&alone), bits(&batch[i * n..(i + 1) * n]), "{isa:?} len {}: alone vs batch", s.len);
            assert_eq!(bits(&alone), bits(&serial[i * n..(i + 1) * n]), "{isa:?} len {}: pool vs one thread", s.len);
        }
    }
}

#[test]
fn errors_and_empty_batch() {
    let shape = AttnShape { n_heads: 4, kv_heads: 2, head_dim: 8 };
    let k = vec![0.0f32; 3 * 2 * 2 * 8]; // 3 blocks of 2 positions
    let table = [0u32, 2];
    let ok = SeqKv { k: &k, v: &k, block_table: &table, block_size: 2, len: 3 };
    let q = vec![0.0f32; 4 * 8];
    let mut out = vec![0.0f32; 4 * 8];
    paged_decode_attention(&q, shape, &[ok], &mut out).expect("valid");
    // Uniform weights over zero values.
    assert!(out.iter().all(|&x| x == 0.0));

    let mut out = vec![1.0f32; 4 * 8];
    let bad = |s: SeqKv<'_>, shape: AttnShape, out: &mut [f32]| paged_decode_attention(&q, shape, &[s], out);
    assert!(matches!(bad(SeqKv { len: 0, ..ok }, shape, &mut out), Err(Error::Incompatible(_))));
    assert!(matches!(bad(SeqKv { block_size: 0, ..ok }, shape, &mut out), Err(Error::Incompatible(_))));
    assert!(matches!(bad(SeqKv { len: 5, ..ok }, shape, &mut out), Err(Error::Incompatible(_))), "short table");
    let far = [0u32, 3];
    assert!(matches!(bad(SeqKv { block_table: &far, ..ok }, shape, &mut out), Err(Error::Incompatible(_))), "block 3 of 3");
    let short_v = &k[..k.len() - 1];
    assert!(matches!(bad(SeqKv { v: short_v, ..ok }, shape, &mut out), Err(Error::Incompatible(_))));
    let odd = AttnShape { n_heads: 3, ..shape };
    assert!(matches!(bad(ok, odd, &mut out), Err(Error::Incompatible(_))));
    assert!(matches!(bad(ok, shape, &mut out[1..]), Err(Error::Length { .. })));
    assert!(out.iter().all(|&x| x == 1.0), "nothing written on error");
    assert!(matches!(paged_decode_attention(&q[1..], shape, &[ok], &mut out), Err(Error::Length { .. })));
    // Partially used last block: position 2 is row 0 of block 2, rows past it are never read.
    let mut k2 = vec![0.0f32; 2 * 2 * 2 * 8 + 2 * 8];
    k2[..8].fill(1.0);
    let s2 = SeqKv { k: &k2, v: &k2, block_table: &[0, 1], block_size: 2, len: 3 };
    paged_decode_attention(&q, shape, &[s2], &mut out).expect("last block partially in storage");
    paged_decode_attention::<f32>(&[], shape, &[], &mut []).expect("empty batch");
}

/// A call whose partial results exceed the kernel's buffer bound (a long prefill: many queries
/// over long prefixes of one cache) runs in groups, with the same bits as each query alone.
#[test]
fn grouped_long_prefill_equals_single_queries() {
    let mut rng = StdRng::seed_from_u64(5);
    let shape = AttnShape { n_heads: 8, kv_heads: 8, head_dim: 8 };
    let (len, row) = (2000usize, 64usize);
    let k: Vec<f32> = (0..len * row).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let v: Vec<f32> = (0..len * row).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let table = [0u32];
    // 300 queries over prefixes of 1,700 .. 2,000 positions: 300 × 8 chunks × 8 kv heads =
    // 19,200 partials.
    let seqs: Vec<SeqKv<'_>> =
        (0..300).map(|i| SeqKv { k: &k, v: &v, block_table: &table, block_size: len, len: len - 299 + i }).collect();
    let n = 64;
    let q: Vec<f32> = (0..seqs.len() * n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let mut all = vec![0.0f32; q.len()];
    paged_decode_attention(&q, shape, &seqs, &mut all).expect("batch");
    for i in [0usize, 1, 150, 298, 299] {
        let mut one = vec![0.0f32; n];
        paged_decode_attention(&q[i * n..(i + 1) * n], shape, &seqs[i..i + 1], &mut one).expect("alone");
        let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&one), bits(&all[i * n..(i + 1) * n]), "query {i}");
    }
}
