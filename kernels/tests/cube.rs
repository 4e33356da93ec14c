//! The CubeCL kernels of `deco_kernels::cube` against independent references.
//!
//! Each test body runs once per device: on `wgpu` (the CubeCL kernel; Mesa lavapipe in CI) and
//! on `flex` (the reference path behind the same backend extension). Both are compared with an
//! f64 loop written here from the definition; the wgpu results are also compared with the burn
//! composition of `deco_kernels::ops` on flex (or the CPU kernels of `deco_kernels::quant`).
#![cfg(feature = "wgpu")]

use burn::tensor::{Device, Int, Tensor, TensorData};
use deco_kernels::{cube, ops};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

mod common;

fn wgpu() -> Device {
    Device::wgpu(Default::default())
}

fn devices() -> [(&'static str, Device); 2] {
    [("wgpu", wgpu()), ("flex", Device::flex())]
}

fn uniform(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

fn to_vec<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().try_to_vec::<f32>().expect("f32 tensor")
}

/// Asserts `|a_i − e_i| ≤ atol + rtol · |e_i|` for every element, naming the first failure.
fn assert_close(what: &str, actual: &[f32], expected: &[f64], atol: f64, rtol: f64) {
    assert_eq!(actual.len(), expected.len(), "{what}: length");
    for (i, (&a, &e)) in actual.iter().zip(expected).enumerate() {
        let err = (a as f64 - e).abs();
        assert!(err <= atol + rtol * e.abs(), "{what}: element {i}: got {a}, expected {e} (error {err:e})");
    }
}

// ---------------------------------------------------------------------------------------------
// RMSNorm

fn rms_norm_f64(x: &[f32], w: &[f32], hidden: usize, eps: f64) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(hidden) {
        let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / hidden as f64;
        let inv = 1.0 / (ms + eps).sqrt();
        out.extend(row.iter().zip(w).map(|(&v, &g)| v as f64 * inv * g as f64));
    }
    out
}

fn check_rms_norm(tokens: usize, hidden: usize, seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let x = uniform(&mut rng, tokens * hidden, 3.0);
    let w = uniform(&mut rng, hidden, 2.0);
    let eps = 1e-5;
    let expected = rms_norm_f64(&x, &w, hidden, eps);
    for (name, dev) in devices() {
        let xt = Tensor::<2>::from_data(TensorData::new(x.clone(), [tokens, hidden]), &dev);
        let wt = Tensor::<1>::from_data(TensorData::new(w.clone(), [hidden]), &dev);
        let out = to_vec(cube::rms_norm(xt, &wt, eps).expect("valid shapes"));
        assert_close(&format!("rms_norm {name} [{tokens}, {hidden}]"), &out, &expected, 1e-5, 1e-5);
    }
    // The kernel against the burn composition it replaces.
    let flex = Device::flex();
    let reference = to_vec(ops::rms_norm(
        Tensor::<2>::from_data(TensorData::new(x.clone(), [tokens, hidden]), &flex),
        &Tensor::<1>::from_data(TensorData::new(w.clone(), [hidden]), &flex),
        eps,
    ));
    let dev = wgpu();
    let out = to_vec(
        cube::rms_norm(
            Tensor::<2>::from_data(TensorData::new(x, [tokens, hidden]), &dev),
            &Tensor::<1>::from_data(TensorData::new(w, [hidden]), &dev),
            eps,
        )
        .expect("valid shapes"),
    );
    let reference: Vec<f64> = reference.iter().map(|&v| v as f64).collect();
    assert_close(&format!("rms_norm wgpu vs ops::rms_norm [{tokens}, {hidden}]"), &out, &reference, 1e-5, 1e-5);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]
    #[test]
    fn rms_norm_matches_reference(tokens in 1usize..=37, hidden in 1usize..=600, seed in any::<u64>()) {
        check_rms_norm(tokens, hidden, seed);
    }
}

#[test]
fn rms_norm_fixed_shapes() {
    // One row, a row shorter than the cube, a row spanning several strides, a SmolLM2 width.
    for (t, h) in [(1, 1), (3, 100), (2, 129), (5, 576)] {
        check_rms_norm(t, h, 7);
    }
}

#[test]
fn rms_norm_rejects_bad_shapes() {
    let dev = wgpu();
    let x = Tensor::<2>::zeros([2, 8], &dev);
    let w = Tensor::<1>::ones([7], &dev);
    assert!(cube::rms_norm(x, &w, 1e-5).is_err());
}

// ---------------------------------------------------------------------------------------------
// RoPE

fn rope_f64(x: &[f32], pos: &[i64], heads: usize, head_dim: usize, inv_freq: &[f64]) -> Vec<f64> {
    let half = head_dim / 2;
    let mut out = vec![0.0; x.len()];
    for (t, &p) in pos.iter().enumerate() {
        for h in 0..heads {
            let base = (t * heads + h) * head_dim;
            for i in 0..head_dim {
                // The table values are rounded to f32 once, as in RopeTable.
                let a = p as f64 * inv_freq[i % half];
                let (c, s) = (a.cos() as f32 as f64, a.sin() as f32 as f64);
                let rot = if i < half { -(x[base + i + half] as f64) } else { x[base + i - half] as f64 };
                out[base + i] = x[base + i] as f64 * c + rot * s;
            }
        }
    }
    out
}

fn check_rope(tokens: usize, heads: usize, head_dim: usize, max_pos: usize, seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let x = uniform(&mut rng, tokens * heads * head_dim, 2.0);
    let pos: Vec<i64> = (0..tokens).map(|_| rng.random_range(0..max_pos as i64)).collect();
    let inv_freq = ops::rope_inv_freq(head_dim, 10_000.0);
    let expected = rope_f64(&x, &pos, heads, head_dim, &inv_freq);
    let shape = [tokens, heads, head_dim];
    for (name, dev) in devices() {
        let rope = cube::CubeRope::new(&inv_freq, max_pos, &dev);
        let xt = Tensor::<3>::from_data(TensorData::new(x.clone(), shape), &dev);
        let pt = Tensor::<1, Int>::from_data(TensorData::new(pos.clone(), [tokens]), &dev);
        let out = to_vec(rope.apply(xt, &pt).expect("valid shapes"));
        assert_close(&format!("rope {name} {shape:?}"), &out, &expected, 1e-6, 1e-6);
    }
    let flex = Device::flex();
    let table = ops::RopeTable::new(&inv_freq, max_pos, &flex);
    let reference = to_vec(table.apply(
        Tensor::<3>::from_data(TensorData::new(x.clone(), shape), &flex),
        &Tensor::<1, Int>::from_data(TensorData::new(pos.clone(), [tokens]), &flex),
    ));
    let dev = wgpu();
    let out = to_vec(
        cube::CubeRope::new(&inv_freq, max_pos, &dev)
            .apply(
                Tensor::<3>::from_data(TensorData::new(x, shape), &dev),
                &Tensor::<1, Int>::from_data(TensorData::new(pos, [tokens]), &dev),
            )
            .expect("valid shapes"),
    );
    let reference: Vec<f64> = reference.iter().map(|&v| v as f64).collect();
    assert_close(&format!("rope wgpu vs RopeTable::apply {shape:?}"), &out, &reference, 1e-6, 1e-6);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]
    #[test]
    fn rope_matches_reference(
        tokens in 1usize..=37,
        heads in prop::sample::select(vec![1usize, 3, 4, 9]),
        head_dim in prop::sample::select(vec![2usize, 8, 64, 128]),
        max_pos in 1usize..=200,
        seed in any::<u64>(),
    ) {
        check_rope(tokens, heads, head_dim, max_pos, seed);
    }
}

#[test]
fn rope_rejects_bad_shapes() {
    let dev = wgpu();
    let rope = cube::CubeRope::new(&ops::rope_inv_freq(64, 10_000.0), 16, &dev);
    let x = Tensor::<3>::zeros([3, 2, 32], &dev);
    let pos = Tensor::<1, Int>::arange(0..3, &dev);
    assert!(rope.apply(x, &pos).is_err(), "head_dim mismatch");
    let x = Tensor::<3>::zeros([3, 2, 64], &dev);
    let pos = Tensor::<1, Int>::arange(0..2, &dev);
    assert!(rope.apply(x, &pos).is_err(), "positions length mismatch");
}

// ---------------------------------------------------------------------------------------------
// Quantized matmul

use common::ggml_type;
use deco_formats::ggml;
use deco_kernels::quant::{BlockType, PackedMatrix};

const TYPES: [BlockType; 3] = [BlockType::Q8_0, BlockType::Q4_0, BlockType::Q4_1];

fn quantize(ty: BlockType, w: &[f32]) -> Vec<u8> {
    common::ggml_quantize(ty, w).expect("TYPES holds only types with a ggml quantizer")
}

/// Checks the packed matmul on every device against the f64 product of the weights as ggml's
/// scalar `dequantize_row_*` (deco-formats) decodes them, with `|y − ref| ≤ 1e-5 · Σ|w x| + 1e-6`;
/// on wgpu also against the CPU kernel `PackedMatrix::matmul` with the same bound.
fn check_quant(ty: BlockType, packed: Vec<u8>, rows: usize, cols: usize, n: usize, seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let x = uniform(&mut rng, n * cols, 2.0);
    let wd = ggml::dequantize(ggml_type(ty), &packed, rows * cols).expect("dequantize");
    let mut expected = vec![0.0f64; n * rows];
    let mut bound = vec![0.0f64; n * rows];
    for t in 0..n {
        for r in 0..rows {
            let (mut s, mut a) = (0.0f64, 0.0f64);
            for k in 0..cols {
                let p = wd[r * cols + k] as f64 * x[t * cols + k] as f64;
                s += p;
                a += p.abs();
            }
            expected[t * rows + r] = s;
            bound[t * rows + r] = 1e-5 * a + 1e-6;
        }
    }
    let m = PackedMatrix::new(ty, rows, cols, packed).expect("packed");
    let mut cpu = vec![0.0f32; n * rows];
    m.matmul(&x, n, &mut cpu).expect("cpu matmul");
    for (name, dev) in devices() {
        let w = cube::CubePackedMatrix::upload(&m, &dev);
        let xt = Tensor::<2>::from_data(TensorData::new(x.clone(), [n, cols]), &dev);
        let y = to_vec(w.matmul(xt).expect("valid shapes"));
        assert_eq!(y.len(), n * rows);
        for i in 0..y.len() {
            let err = (y[i] as f64 - expected[i]).abs();
            assert!(
                err <= bound[i],
                "{ty:?} {name} [{rows}x{cols}] n={n} element {i}: got {}, expected {} (error {err:e}, bound {:e})",
                y[i],
                expected[i],
                bound[i]
            );
            if name == "wgpu" {
                let err = (y[i] as f64 - cpu[i] as f64).abs();
                assert!(err <= 2.0 * bound[i], "{ty:?} wgpu vs PackedMatrix::matmul element {i}: {} vs {}", y[i], cpu[i]);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 10, ..ProptestConfig::default() })]
    #[test]
    fn quant_matmul_matches_reference(
        ty in prop::sample::select(TYPES.to_vec()),
        rows in 1usize..=70,
        blocks in 1usize..=32,
        n in 1usize..=37,
        seed in any::<u64>(),
    ) {
        let cols = blocks * 32;
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed);
        // A per-row offset so that Q4_1's min matters.
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| rng.random_range(-0.5f32..0.5) + if (i / cols) % 3 == 0 { 0.4 } else { 0.0 })
            .collect();
        check_quant(ty, quantize(ty, &w), rows, cols, n, seed);
    }
}

/// Every packed type, with ggml's quantizer where deco-formats has one.
const ALL_TYPES: [BlockType; 6] = [BlockType::Q8_0, BlockType::Q4_0, BlockType::Q4_1, BlockType::Q5_0, BlockType::Q4_K, BlockType::Q6_K];

/// Byte offsets of the f16 fields (scale, and min where there is one) in a block of `ty`.
fn f16_fields(ty: BlockType) -> &'static [usize] {
    match ty {
        BlockType::Q4_1 | BlockType::Q4_K => &[0, 2],
        BlockType::Q6_K => &[208],
        BlockType::Q4_0 | BlockType::Q5_0 | BlockType::Q8_0 => &[0],
    }
}

/// Raw random blocks: every byte random (quants, Q5_0's high bits, the k-quants' packed 6-bit
/// and int8 sub-block scales) except the f16 scales / mins, drawn from all finite f16 values
/// (zeros, subnormals, negatives, up to ±65504) to exercise the in-kernel f16 decoding. Rows of
/// 1 to 18 blocks (up to 4608 weights for the 256-weight k-quant super-blocks).
#[test]
fn quant_matmul_raw_blocks() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for ty in ALL_TYPES {
        for (rows, blocks, n) in [(1, 1, 1), (5, 3, 2), (9, 18, 5), (33, 7, 9)] {
            let cols = blocks * ty.block_len();
            let bb = ty.block_bytes();
            let mut bytes = vec![0u8; rows * blocks * bb];
            rng.fill(&mut bytes[..]);
            for blk in bytes.chunks_exact_mut(bb) {
                for &at in f16_fields(ty) {
                    let bits: u16 = loop {
                        let b: u16 = if rng.random_bool(0.2) { rng.random_range(0..0x0400) } else { rng.random() };
                        if (b >> 10) & 31 != 31 {
                            break b; // finite
                        }
                    };
                    blk[at..at + 2].copy_from_slice(&bits.to_le_bytes());
                }
            }
            check_quant(ty, bytes, rows, cols, n, rows as u64);
        }
    }
}

#[test]
fn quant_matmul_rejects_bad_shapes() {
    let dev = wgpu();
    let m = PackedMatrix::new(BlockType::Q8_0, 2, 64, vec![0; 2 * 2 * 34]).expect("packed");
    let w = cube::CubePackedMatrix::upload(&m, &dev);
    assert!(w.matmul(Tensor::<2>::zeros([3, 32], &dev)).is_err());
    assert!(w.matmul(Tensor::<2>::zeros([3, 64], &dev)).is_ok());
}

// ---------------------------------------------------------------------------------------------
// Causal GQA attention (prefill)

/// `out[t, h] = Σ_p softmax_p(q[t, h] · k[p, h/g] / sqrt(d)) v[p, h/g]`, `p = 0 ..= past + t`, in
/// f64.
#[allow(clippy::too_many_arguments)]
fn attention_f64(q: &[f32], k: &[f32], v: &[f32], t_len: usize, heads: usize, kvh: usize, d: usize, past: usize) -> Vec<f64> {
    let g = heads / kvh;
    let scale = 1.0 / (d as f64).sqrt();
    let mut out = vec![0.0; t_len * heads * d];
    for t in 0..t_len {
        for h in 0..heads {
            let j = h / g;
            let qh = &q[(t * heads + h) * d..][..d];
            let scores: Vec<f64> = (0..=past + t)
                .map(|p| {
                    let kp = &k[(p * kvh + j) * d..][..d];
                    qh.iter().zip(kp).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() * scale
                })
                .collect();
            let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
            let sum: f64 = w.iter().sum();
            for (p, wp) in w.iter().enumerate() {
                let vp = &v[(p * kvh + j) * d..][..d];
                for i in 0..d {
                    out[(t * heads + h) * d + i] += wp / sum * vp[i] as f64;
                }
            }
        }
    }
    out
}

fn check_attention(tokens: usize, heads: usize, kvh: usize, d: usize, past: usize, seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let s = past + tokens;
    let q = uniform(&mut rng, tokens * heads * d, 1.0);
    let k = uniform(&mut rng, s * kvh * d, 1.0);
    let v = uniform(&mut rng, s * kvh * d, 1.0);
    let expected = attention_f64(&q, &k, &v, tokens, heads, kvh, d, past);
    let tensors = |dev: &Device| {
        (
            Tensor::<3>::from_data(TensorData::new(q.clone(), [tokens, heads, d]), dev),
            Tensor::<3>::from_data(TensorData::new(k.clone(), [s, kvh, d]), dev),
            Tensor::<3>::from_data(TensorData::new(v.clone(), [s, kvh, d]), dev),
        )
    };
    let what = format!("tokens {tokens} heads {heads}/{kvh} d {d} past {past}");
    for (name, dev) in devices() {
        let (qt, kt, vt) = tensors(&dev);
        let out = to_vec(cube::flash_attention(qt, kt, vt, past).expect("valid shapes"));
        assert_close(&format!("attention {name} {what}"), &out, &expected, 2e-5, 2e-5);
    }
    let flex = Device::flex();
    let (qt, kt, vt) = tensors(&flex);
    let reference: Vec<f64> = to_vec(ops::causal_gqa_attention(qt, kt, vt, past)).iter().map(|&x| x as f64).collect();
    let (qt, kt, vt) = tensors(&wgpu());
    let out = to_vec(cube::flash_attention(qt, kt, vt, past).expect("valid shapes"));
    assert_close(&format!("attention wgpu vs ops::causal_gqa_attention {what}"), &out, &reference, 2e-5, 2e-5);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 10, ..ProptestConfig::default() })]
    #[test]
    fn flash_attention_matches_reference(
        tokens in 1usize..=37,
        (heads, kvh) in prop::sample::select(vec![(9usize, 3usize), (4, 1), (2, 2)]),
        past in 0usize..=70,
        seed in any::<u64>(),
    ) {
        check_attention(tokens, heads, kvh, 64, past, seed);
    }
}

#[test]
fn flash_attention_other_head_dims() {
    // head_dim not a multiple of 32 (lanes with no output column), one query row, a long past.
    for (tokens, heads, kvh, d, past) in [(5, 4, 2, 80, 3), (1, 3, 1, 32, 0), (1, 2, 1, 128, 100), (40, 2, 1, 16, 9)] {
        check_attention(tokens, heads, kvh, d, past, 3);
    }
}

#[test]
fn flash_attention_rejects_bad_shapes() {
    let dev = wgpu();
    let q = || Tensor::<3>::zeros([3, 4, 8], &dev);
    let kv = |s: usize, h: usize, d: usize| Tensor::<3>::zeros([s, h, d], &dev);
    assert!(cube::flash_attention(q(), kv(5, 2, 8), kv(5, 2, 8), 2).is_ok());
    assert!(cube::flash_attention(q(), kv(4, 2, 8), kv(4, 2, 8), 2).is_err(), "cache length");
    assert!(cube::flash_attention(q(), kv(5, 3, 8), kv(5, 3, 8), 2).is_err(), "kv_heads must divide heads");
    assert!(cube::flash_attention(q(), kv(5, 2, 8), kv(5, 2, 4), 2).is_err(), "k/v shapes differ");
    assert!(cube::flash_attention(q(), kv(5, 2, 4), kv(5, 2, 4), 2).is_err(), "head_dim differs");
}

// ---------------------------------------------------------------------------------------------
// Paged decode attention

#[allow(clippy::too_many_arguments)]
fn check_paged(seq_lens: &[usize], block_size: usize, heads: usize, kvh: usize, d: usize, seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let b = seq_lens.len();
    let need: usize = seq_lens.iter().map(|l| l.div_ceil(block_size)).sum();
    let num_blocks = need + 3;
    // Each sequence gets distinct blocks in a shuffled order.
    let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, rng.random_range(0..=i));
    }
    let mut tables = Vec::new();
    let mut next = 0;
    for &len in seq_lens {
        let n = len.div_ceil(block_size);
        tables.push(ids[next..next + n].to_vec());
        next += n;
    }
    let row = kvh * d;
    let k = uniform(&mut rng, num_blocks * block_size * row, 1.0);
    let v = uniform(&mut rng, num_blocks * block_size * row, 1.0);
    let q = uniform(&mut rng, b * heads * d, 1.0);
    // f64 reference from the definition.
    let g = heads / kvh;
    let mut expected = vec![0.0f64; b * heads * d];
    for (s, &len) in seq_lens.iter().enumerate() {
        let off = |p: usize| (tables[s][p / block_size] as usize * block_size + p % block_size) * row;
        for h in 0..heads {
            let j = h / g;
            let qh = &q[(s * heads + h) * d..][..d];
            let sc: Vec<f64> = (0..len)
                .map(|p| qh.iter().zip(&k[off(p) + j * d..][..d]).map(|(&a, &c)| a as f64 * c as f64).sum::<f64>() / (d as f64).sqrt())
                .collect();
            let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = sc.iter().map(|x| (x - mx).exp()).collect();
            let sum: f64 = w.iter().sum();
            for (p, wp) in w.iter().enumerate() {
                for i in 0..d {
                    expected[(s * heads + h) * d + i] += wp / sum * v[off(p) + j * d + i] as f64;
                }
            }
        }
    }
    let seqs: Vec<cube::PagedSeq<'_>> =
        seq_lens.iter().zip(&tables).map(|(&len, t)| cube::PagedSeq { block_table: t, len }).collect();
    let what = format!("lens {seq_lens:?} block {block_size} heads {heads}/{kvh} d {d}");
    let cache_shape = [num_blocks, block_size, kvh, d];
    let mut outs = Vec::new();
    for (name, dev) in devices() {
        let out = to_vec(
            cube::paged_decode_attention(
                Tensor::<3>::from_data(TensorData::new(q.clone(), [b, heads, d]), &dev),
                Tensor::<4>::from_data(TensorData::new(k.clone(), cache_shape), &dev),
                Tensor::<4>::from_data(TensorData::new(v.clone(), cache_shape), &dev),
                &seqs,
            )
            .expect("valid shapes"),
        );
        assert_close(&format!("paged {name} {what}"), &out, &expected, 2e-5, 2e-5);
        outs.push(out);
    }
    // The CPU kernel of attention.rs, called directly.
    let seq_kv: Vec<deco_kernels::attention::SeqKv<'_>> = seq_lens
        .iter()
        .zip(&tables)
        .map(|(&len, t)| deco_kernels::attention::SeqKv { k: &k, v: &v, block_table: t, block_size, len })
        .collect();
    let mut cpu = vec![0.0f32; b * heads * d];
    deco_kernels::attention::paged_decode_attention(
        &q,
        deco_kernels::attention::AttnShape { n_heads: heads, kv_heads: kvh, head_dim: d },
        &seq_kv,
        &mut cpu,
    )
    .expect("cpu attention");
    let cpu: Vec<f64> = cpu.iter().map(|&x| x as f64).collect();
    assert_close(&format!("paged wgpu vs attention::paged_decode_attention {what}"), &outs[0], &cpu, 2e-5, 2e-5);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 10, ..ProptestConfig::default() })]
    #[test]
    fn paged_decode_matches_reference(
        seq_lens in prop::collection::vec(1usize..=150, 1..=5),
        block_size in prop::sample::select(vec![1usize, 4, 16]),
        (heads, kvh) in prop::sample::select(vec![(9usize, 3usize), (4, 1), (2, 2)]),
        seed in any::<u64>(),
    ) {
        check_paged(&seq_lens, block_size, heads, kvh, 64, seed);
    }
}

#[test]
fn paged_decode_other_head_dims() {
    check_paged(&[1, 17, 40], 8, 4, 2, 80, 1);
    check_paged(&[33], 32, 2, 1, 128, 2);
}

#[test]
fn paged_decode_rejects_bad_inputs() {
    let dev = wgpu();
    let q = || Tensor::<3>::zeros([1, 4, 8], &dev);
    let cache = || Tensor::<4>::zeros([3, 4, 2, 8], &dev);
    let seq = |t: &'static [u32], len| [cube::PagedSeq { block_table: t, len }];
    static TWO: [u32; 2] = [0, 2];
    static ONE: [u32; 1] = [0];
    static BAD: [u32; 2] = [0, 3];
    assert!(cube::paged_decode_attention(q(), cache(), cache(), &seq(&TWO, 8)).is_ok());
    assert!(cube::paged_decode_attention(q(), cache(), cache(), &seq(&ONE, 8)).is_err(), "table too short");
    assert!(cube::paged_decode_attention(q(), cache(), cache(), &seq(&BAD, 8)).is_err(), "block out of range");
    assert!(cube::paged_decode_attention(q(), cache(), cache(), &seq(&TWO, 0)).is_err(), "empty sequence");
    assert!(cube::paged_decode_attention(q(), cache(), cache(), &[]).is_err(), "q rows vs sequences");
}
