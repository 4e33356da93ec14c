//! `ops::tree_gqa_attention` (Medusa's tree attention) against a naive f64 attention written
//! here over each node's visible keys (the cached prefix, its ancestors and itself), on random
//! trees; and a chain equals `ops::causal_gqa_attention`.

use burn::tensor::{Device, Tensor, TensorData};
use deco_kernels::ops::{causal_gqa_attention, tree_gqa_attention};
use proptest::prelude::*;

fn tensor(v: &[f32], shape: [usize; 3]) -> Tensor<3> {
    Tensor::from_data(TensorData::new(v.to_vec(), shape), &Device::flex())
}

/// Nodes visible to node `i`: itself and its ancestors.
fn path(parents: &[Option<usize>], mut i: usize) -> Vec<usize> {
    let mut p = vec![i];
    while let Some(a) = parents[i] {
        p.push(a);
        i = a;
    }
    p
}

#[derive(Debug, Clone)]
struct Case {
    past: usize,
    parents: Vec<Option<usize>>,
    heads: usize,
    kv_heads: usize,
    dim: usize,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

fn case() -> impl Strategy<Value = Case> {
    (0usize..6, 1usize..10, prop_oneof![Just((2usize, 1usize)), Just((3, 3)), Just((4, 2))], prop_oneof![Just(4usize), Just(8)])
        .prop_flat_map(|(past, n, (heads, kv_heads), dim)| {
            let parents = (0..n).map(|i| if i == 0 { Just(None).boxed() } else { prop::option::weighted(0.9, 0..i).boxed() }).collect::<Vec<_>>();
            let s = past + n;
            (
                Just(past),
                parents,
                Just(heads),
                Just(kv_heads),
                Just(dim),
                prop::collection::vec(-2.0f32..2.0, n * heads * dim),
                prop::collection::vec(-2.0f32..2.0, s * kv_heads * dim),
                prop::collection::vec(-2.0f32..2.0, s * kv_heads * dim),
            )
        })
        .prop_map(|(past, parents, heads, kv_heads, dim, q, k, v)| Case { past, parents, heads, kv_heads, dim, q, k, v })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Every node's output is softmax attention over exactly the cached positions and its own
    /// path, within 1e-4 of f64.
    #[test]
    fn tree_attention_matches_f64_reference(c in case()) {
        let n = c.parents.len();
        let s = c.past + n;
        let (h, kvh, d) = (c.heads, c.kv_heads, c.dim);
        let out = tree_gqa_attention(tensor(&c.q, [n, h, d]), tensor(&c.k, [s, kvh, d]), tensor(&c.v, [s, kvh, d]), c.past, &c.parents);
        prop_assert_eq!(out.dims(), [n, h * d]);
        let got = out.into_data().try_to_vec::<f32>().expect("f32 tensor");
        for i in 0..n {
            let mut keys: Vec<usize> = (0..c.past).collect();
            keys.extend(path(&c.parents, i).into_iter().map(|j| c.past + j));
            for head in 0..h {
                let g = head / (h / kvh);
                let qrow = &c.q[(i * h + head) * d..][..d];
                let scores: Vec<f64> = keys
                    .iter()
                    .map(|&p| qrow.iter().zip(&c.k[(p * kvh + g) * d..][..d]).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum::<f64>() / (d as f64).sqrt())
                    .collect();
                let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = w.iter().sum();
                for e in 0..d {
                    let want: f64 = keys.iter().zip(&w).map(|(&p, &wp)| wp / z * f64::from(c.v[(p * kvh + g) * d + e])).sum();
                    let have = f64::from(got[i * h * d + head * d + e]);
                    prop_assert!((want - have).abs() < 1e-4, "node {} head {} elem {}: {} vs {}", i, head, e, have, want);
                }
            }
        }
    }
}

/// A chain (`parents[i] = i - 1`) is causal attention, bit for bit (same composition, same mask).
#[test]
fn chain_is_causal() {
    let (past, n, h, kvh, d): (usize, usize, usize, usize, usize) = (3, 5, 4, 2, 8);
    let s = past + n;
    let make = |len: usize, salt: u32| (0..len).map(|i| (((i as u32 * 2654435761) ^ salt) % 1000) as f32 / 250.0 - 2.0).collect::<Vec<f32>>();
    let (q, k, v) = (make(n * h * d, 1), make(s * kvh * d, 2), make(s * kvh * d, 3));
    let parents: Vec<Option<usize>> = (0..n).map(|i| i.checked_sub(1)).collect();
    let tree = tree_gqa_attention(tensor(&q, [n, h, d]), tensor(&k, [s, kvh, d]), tensor(&v, [s, kvh, d]), past, &parents);
    let causal = causal_gqa_attention(tensor(&q, [n, h, d]), tensor(&k, [s, kvh, d]), tensor(&v, [s, kvh, d]), past);
    assert_eq!(tree.into_data().try_to_vec::<f32>().expect("f32 tensor"), causal.into_data().try_to_vec::<f32>().expect("f32 tensor"));
}
