//! Transformer building blocks as burn tensor compositions.
//!
//! Each function documents its shapes and its reference (the transformers module it reproduces).
//! These are the reference implementations that fused kernels are tested against.

use burn::backend::Flex;
use burn::tensor::activation::{silu, softmax};
use burn::tensor::{Bool, Device, Int, Tensor, TensorData};

use crate::error::{Error, Result};

/// RMSNorm (Zhang & Sennrich 2019), as transformers' `LlamaRMSNorm`:
/// `weight * x / sqrt(mean(x^2) + eps)`, computed in f32.
///
/// # Shapes
/// - `x`: `[tokens, hidden]`
/// - `weight`: `[hidden]`
/// - output: `[tokens, hidden]`
pub fn rms_norm(x: Tensor<2>, weight: &Tensor<1>, eps: f64) -> Tensor<2> {
    let variance = x.clone().square().mean_dim(1); // [tokens, 1]
    let inv = variance.add_scalar(eps).sqrt().recip();
    x.mul(inv).mul(weight.clone().unsqueeze_dim::<2>(0))
}

/// [`rms_norm`] of host rows, one pass per row: `out = (x · inv) · weight` with
/// `inv = 1 / sqrt(Σ x² / hidden + eps)`, each step rounded to f32 as in the tensor composition;
/// the sum of squares is taken over 8 interleaved f32 partial sums, added in a fixed order (the
/// same bits whatever the instruction set the compiler picks, but not the same bits as the
/// tensor composition's own reduction order: the two differ by f32 rounding, ~1e-7 relative).
/// A row does not depend on the other rows (batch invariance). Long inputs are split over the
/// forward pass's thread team ([`crate::team::par_chunks_mut`]) by whole rows.
///
/// # Shapes
/// - `x`, `out`: `[tokens, hidden]` row-major
/// - `weight`: `[hidden]`
///
/// # Errors
/// [`Error::Length`] if `weight` is empty, `x` is not whole rows of `weight.len()` values, or
/// `out` differs from `x` in length. Nothing is written on error.
pub fn rms_norm_host(x: &[f32], weight: &[f32], eps: f64, out: &mut [f32]) -> Result<()> {
    let h = weight.len();
    if h == 0 || !x.len().is_multiple_of(h) {
        return Err(Error::Length { what: "rms_norm x (whole rows of the weight)", expected: x.len().next_multiple_of(h.max(1)), actual: x.len() });
    }
    if out.len() != x.len() {
        return Err(Error::Length { what: "rms_norm out", expected: x.len(), actual: out.len() });
    }
    let eps = eps as f32;
    let row = |xr: &[f32], or: &mut [f32]| {
        let mut acc = [0.0f32; 8];
        let mut chunks = xr.chunks_exact(8);
        for c in &mut chunks {
            for (a, v) in acc.iter_mut().zip(c) {
                *a += v * v;
            }
        }
        for (a, v) in acc.iter_mut().zip(chunks.remainder()) {
            *a += v * v;
        }
        let sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
        let inv = 1.0 / (sum / h as f32 + eps).sqrt();
        for ((o, &v), &w) in or.iter_mut().zip(xr).zip(weight) {
            *o = (v * inv) * w;
        }
    };
    // Below ~64K values the team's hand-off costs more than the rows.
    const PARALLEL_MIN: usize = 1 << 16;
    if x.len() >= PARALLEL_MIN {
        let rows_per_task = (PARALLEL_MIN / 4 / h).max(1);
        crate::team::par_chunks_mut(out, rows_per_task * h, |i, oc| {
            let xc = &x[i * rows_per_task * h..][..oc.len()];
            for (xr, or) in xc.chunks_exact(h).zip(oc.chunks_exact_mut(h)) {
                row(xr, or);
            }
        });
    } else {
        for (xr, or) in x.chunks_exact(h).zip(out.chunks_exact_mut(h)) {
            row(xr, or);
        }
    }
    Ok(())
}

/// SwiGLU feed-forward activation (Shazeer 2020): `silu(gate) * up`.
///
/// # Shapes
/// `gate`, `up` and the output: `[tokens, intermediate]`.
pub fn swiglu(gate: Tensor<2>, up: Tensor<2>) -> Tensor<2> {
    silu(gate).mul(up)
}

/// Precomputed rotary position embedding tables (Su et al. 2021, "RoFormer", eq. 34) in the
/// rotate-half layout of transformers' `LlamaRotaryEmbedding` / `apply_rotary_pos_emb`.
///
/// The inverse frequencies `θ^(-2i/d)` (after optional scaling) and the angles are computed in
/// f64 and rounded once to f32.
#[derive(Debug, Clone)]
pub struct RopeTable {
    /// `[max_positions, head_dim]`: cos of the angle, first half repeated in the second half.
    cos: Tensor<2>,
    /// `[max_positions, head_dim]`: sin, same layout.
    sin: Tensor<2>,
    head_dim: usize,
    max_positions: usize,
}

impl RopeTable {
    /// Builds the tables from inverse frequencies `inv_freq` (length `head_dim / 2`).
    ///
    /// Use [`rope_inv_freq`] for the standard frequencies.
    pub fn new(inv_freq: &[f64], max_positions: usize, device: &Device) -> Self {
        let half = inv_freq.len();
        let head_dim = 2 * half;
        let mut cos = Vec::with_capacity(max_positions * head_dim);
        let mut sin = Vec::with_capacity(max_positions * head_dim);
        for p in 0..max_positions {
            for _ in 0..2 {
                for &f in inv_freq {
                    let a = p as f64 * f;
                    cos.push(a.cos() as f32);
                    sin.push(a.sin() as f32);
                }
            }
        }
        let shape = [max_positions, head_dim];
        Self {
            cos: Tensor::from_data(TensorData::new(cos, shape), device),
            sin: Tensor::from_data(TensorData::new(sin, shape), device),
            head_dim,
            max_positions,
        }
    }

    /// Largest position + 1 the table covers.
    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// Rotates `x` by the angles of `positions`.
    ///
    /// # Shapes
    /// - `x`: `[tokens, heads, head_dim]`
    /// - `positions`: `[tokens]`, each `< max_positions` (the caller checks)
    /// - output: `[tokens, heads, head_dim]`
    pub fn apply(&self, x: Tensor<3>, positions: &Tensor<1, Int>) -> Tensor<3> {
        rope_with_tables(x, &self.cos, &self.sin, positions)
    }

    /// [`RopeTable::apply`] on a host buffer, in place: the same products and sum
    /// (`x · cos + rotate_half(x) · sin`, each product rounded, then the sum), so the bits equal
    /// the tensor composition's. One pass over `x` instead of ten tensor operations (select,
    /// slices, negation, concatenation, products, sum), each allocating its output, which cost
    /// ~4 % of a SmolLM2 decode step on the calling thread of the forward pass while the other
    /// threads waited.
    ///
    /// # Shapes
    /// - `x`: `[tokens, heads, head_dim]` row-major, `tokens = positions.len()`
    ///
    /// Returns `Ok(false)` and leaves `x` untouched when the tables are not host (CPU `Flex`)
    /// tensors; the caller then uses [`RopeTable::apply`].
    ///
    /// # Errors
    /// [`Error::Length`] if `x` is not `positions.len() · heads · head_dim` values;
    /// [`Error::Incompatible`] for a position at or beyond [`RopeTable::max_positions`]. Nothing
    /// is written on error.
    pub fn apply_host(&self, x: &mut [f32], heads: usize, positions: &[usize]) -> Result<bool> {
        let d = self.head_dim;
        let n = positions.len() * heads * d;
        if x.len() != n {
            return Err(Error::Length { what: "rope x", expected: n, actual: x.len() });
        }
        if let Some(&p) = positions.iter().find(|&&p| p >= self.max_positions) {
            return Err(Error::Incompatible(format!("rope position {p} beyond the table's {} positions", self.max_positions)));
        }
        let (Ok(cos), Ok(sin)) = (self.cos.clone().try_into_primitive::<Flex>(), self.sin.clone().try_into_primitive::<Flex>())
        else {
            return Ok(false);
        };
        let (Some(cos), Some(sin)) = (cos.as_slice::<f32>(), sin.as_slice::<f32>()) else {
            return Ok(false);
        };
        let half = d / 2;
        if heads == 0 || d == 0 {
            return Ok(true);
        }
        // Blocks of tokens in parallel (each value is rotated on its own: the same bits).
        const TOKENS: usize = 256;
        crate::team::par_chunks_mut(x, TOKENS * heads * d, |ci, block| {
            for (rows, &p) in block.chunks_mut(heads * d).zip(&positions[ci * TOKENS..]) {
                let (c, s) = (&cos[p * d..(p + 1) * d], &sin[p * d..(p + 1) * d]);
                for h in rows.chunks_mut(d) {
                    let (x1, x2) = h.split_at_mut(half);
                    for i in 0..half {
                        let (a, b) = (x1[i], x2[i]);
                        // rotate_half(x) = [-x2, x1]
                        x1[i] = a * c[i] + (-b) * s[i];
                        x2[i] = b * c[half + i] + a * s[half + i];
                    }
                }
            }
        });
        Ok(true)
    }

    /// The `[max_positions, head_dim]` cos and sin tables (for the fused kernels).
    #[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
    pub(crate) fn tables(&self) -> (&Tensor<2>, &Tensor<2>) {
        (&self.cos, &self.sin)
    }

    /// Rotary dimension (the tables' width).
    #[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
    pub(crate) fn head_dim(&self) -> usize {
        self.head_dim
    }
}

/// The rotate-half composition of [`RopeTable::apply`] on explicit tables: `x · cos +
/// rotate_half(x) · sin` with the rows of `positions`. Shapes as [`RopeTable::apply`]; `cos`,
/// `sin`: `[max_positions, head_dim]`.
pub(crate) fn rope_with_tables(x: Tensor<3>, cos: &Tensor<2>, sin: &Tensor<2>, positions: &Tensor<1, Int>) -> Tensor<3> {
    let cos = cos.clone().select(0, positions.clone()).unsqueeze_dim::<3>(1);
    let sin = sin.clone().select(0, positions.clone()).unsqueeze_dim::<3>(1);
    let [t, h, d] = x.dims();
    let half = d / 2;
    let x1 = x.clone().slice([0..t, 0..h, 0..half]);
    let x2 = x.clone().slice([0..t, 0..h, half..d]);
    let rotated = Tensor::cat(vec![x2.neg(), x1], 2);
    x.mul(cos).add(rotated.mul(sin))
}

/// Standard RoPE inverse frequencies `1 / theta^(2i / head_dim)`, `i = 0 .. head_dim/2`.
pub fn rope_inv_freq(head_dim: usize, theta: f64) -> Vec<f64> {
    (0..head_dim / 2).map(|i| 1.0 / theta.powf(2.0 * i as f64 / head_dim as f64)).collect()
}

/// Causal scaled-dot-product attention with grouped-query heads (Ainslie et al. 2023) for one
/// sequence whose first `past` positions are already in the key/value cache.
///
/// Query row `t` sits at absolute position `past + t` and attends to key positions
/// `0 ..= past + t`. Query head `h` uses key/value head `h / (heads / kv_heads)`, as transformers'
/// `repeat_kv`. Scores are scaled by `1 / sqrt(head_dim)`.
///
/// # Shapes
/// - `q`: `[tokens, heads, head_dim]`
/// - `k`, `v`: `[past + tokens, kv_heads, head_dim]`
/// - output: `[tokens, heads * head_dim]`
pub fn causal_gqa_attention(q: Tensor<3>, k: Tensor<3>, v: Tensor<3>, past: usize) -> Tensor<2> {
    let [t, _, _] = q.dims();
    let [s, _, _] = k.dims();
    let mask = (t > 1 || s != past + t).then(|| {
        let mut m = Vec::with_capacity(t * s);
        for row in 0..t {
            m.extend((0..s).map(|col| col > past + row));
        }
        m
    });
    masked_gqa_attention(q, k, v, mask)
}

/// Tree attention (Medusa, Cai et al. 2024, §2.1.2 "tree attention"; SpecInfer, Miao et al.
/// 2024): scaled-dot-product attention with grouped-query heads for one sequence whose first
/// `past` positions are cached, followed by a token *tree* of `tokens` nodes given by their
/// parents: node `t` attends to every cached position `0 .. past` and to the nodes on its path
/// from the root (its ancestors and itself), never to its siblings or their subtrees.
/// `parents[t]` is the index of node `t`'s parent among this call's nodes (`< t`), or `None`
/// for a node that follows the cached prefix directly. A chain (`parents[t] = Some(t - 1)`,
/// `parents[0] = None`) is [`causal_gqa_attention`]. The caller places node `t` at position
/// `past + depth(t)` (RoPE), depth 0 for a root.
///
/// # Shapes
/// - `q`: `[tokens, heads, head_dim]`
/// - `k`, `v`: `[past + tokens, kv_heads, head_dim]`
/// - `parents`: `[tokens]`
/// - output: `[tokens, heads * head_dim]`
///
/// # Panics
/// If `parents.len() != tokens` or a parent does not precede its child (callers validate:
/// `deco_model::Llama::forward` returns an error for such a tree).
pub fn tree_gqa_attention(q: Tensor<3>, k: Tensor<3>, v: Tensor<3>, past: usize, parents: &[Option<usize>]) -> Tensor<2> {
    let [t, _, _] = q.dims();
    let [s, _, _] = k.dims();
    assert!(parents.len() == t && s == past + t, "tree of {} parents for {t} queries over {s} keys after {past}", parents.len());
    // Row `r` of `visible` marks the nodes on the path to node `r` (ancestors and itself).
    let mut visible = vec![false; t * t];
    for r in 0..t {
        visible[r * t + r] = true;
        if let Some(p) = parents[r] {
            assert!(p < r, "node {r} has parent {p}, which does not precede it");
            let (before, row) = visible.split_at_mut(r * t);
            row[..r].copy_from_slice(&before[p * t..p * t + r]);
        }
    }
    let mut mask = Vec::with_capacity(t * s);
    for r in 0..t {
        mask.extend(std::iter::repeat_n(false, past));
        mask.extend(visible[r * t..(r + 1) * t].iter().map(|&v| !v));
    }
    masked_gqa_attention(q, k, v, Some(mask))
}

/// Grouped-query attention with an optional mask `[tokens, keys]` (row-major, `true` = hidden):
/// the body of [`causal_gqa_attention`] and [`tree_gqa_attention`].
fn masked_gqa_attention(q: Tensor<3>, k: Tensor<3>, v: Tensor<3>, mask: Option<Vec<bool>>) -> Tensor<2> {
    let [t, heads, d] = q.dims();
    let [s, kv_heads, _] = k.dims();
    let g = heads / kv_heads;
    // [t, kvh, g, d] -> [kvh, g, t, d] -> [kvh, g*t, d]
    let q = q.reshape([t, kv_heads, g, d]).permute([1, 2, 0, 3]).reshape([kv_heads, g * t, d]);
    let k = k.swap_dims(0, 1); // [kvh, s, d]
    let v = v.swap_dims(0, 1); // [kvh, s, d]
    let scale = 1.0 / (d as f64).sqrt();
    let mut scores = q.matmul(k.swap_dims(1, 2)).mul_scalar(scale); // [kvh, g*t, s]
    if let Some(m) = mask {
        let mut full = Vec::with_capacity(g * t * s);
        for _ in 0..g {
            full.extend_from_slice(&m);
        }
        let mask: Tensor<3, Bool> =
            Tensor::<3, Bool>::from_data(TensorData::new(full, [1, g * t, s]), &scores.device()).expand([kv_heads, g * t, s]);
        scores = scores.mask_fill(mask, f32::NEG_INFINITY);
    }
    let probs = softmax(scores, 2);
    let out = probs.matmul(v); // [kvh, g*t, d]
    out.reshape([kv_heads, g, t, d]).permute([2, 0, 1, 3]).reshape([t, heads * d])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The host RoPE gives the tensor composition's bits, for both head sizes of the supported
    /// models, several heads and scattered positions; bad lengths and positions are refused.
    #[test]
    fn apply_host_equals_apply() {
        let dev = Device::flex();
        for (d, heads, positions) in [(64usize, 9usize, vec![0usize, 5, 511, 37]), (128, 2, vec![1023, 0, 2]), (8, 1, vec![3])] {
            let table = RopeTable::new(&rope_inv_freq(d, 10_000.0), 1024, &dev);
            let n = positions.len();
            let mut state = 0x9E37_79B9u32;
            let x: Vec<f32> = (0..n * heads * d)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 17;
                    state ^= state << 5;
                    (state as f32 / u32::MAX as f32 - 0.5) * 8.0
                })
                .collect();
            let pos = Tensor::<1, Int>::from_data(TensorData::new(positions.iter().map(|&p| p as i64).collect(), [n]), &dev);
            let want: Vec<f32> =
                table.apply(Tensor::from_data(TensorData::new(x.clone(), [n, heads, d]), &dev), &pos).try_into_vec_as::<f32>().expect("f32");
            let mut got = x.clone();
            assert!(table.apply_host(&mut got, heads, &positions).expect("valid"));
            let same = want.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "head_dim {d}: host RoPE differs from the tensor composition");
            assert!(matches!(table.apply_host(&mut got[1..], heads, &positions), Err(Error::Length { .. })));
            let mut untouched = x.clone();
            let mut far = positions.clone();
            far[0] = 1024;
            assert!(matches!(table.apply_host(&mut untouched, heads, &far), Err(Error::Incompatible(_))));
            assert_eq!(untouched, x, "nothing written on error");
        }
    }

    /// The host RMSNorm against an f64 evaluation of the formula (relative error of a few f32
    /// roundings), against the tensor composition (f32 rounding apart), row by row the same
    /// bits alone as in a batch, on the team's parallel path too; bad lengths are refused.
    #[test]
    fn rms_norm_host_matches_f64_and_the_composition() {
        let dev = Device::flex();
        let mut state = 0x1234_5677u32;
        let mut rnd = move || {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            state as f32 / u32::MAX as f32 - 0.5
        };
        for (n, h) in [(1usize, 576usize), (3, 13), (200, 576), (2, 1536)] {
            let x: Vec<f32> = (0..n * h).map(|i| rnd() * if i % 7 == 0 { 40.0 } else { 2.0 }).collect();
            let w: Vec<f32> = (0..h).map(|_| 1.0 + rnd()).collect();
            let eps = 1e-5;
            let mut got = vec![0.0f32; n * h];
            rms_norm_host(&x, &w, eps, &mut got).expect("valid");
            let composed: Vec<f32> = rms_norm(Tensor::from_data(TensorData::new(x.clone(), [n, h]), &dev), &Tensor::from_data(TensorData::new(w.clone(), [h]), &dev), eps)
                .try_into_vec_as::<f32>()
                .expect("f32");
            for r in 0..n {
                let xr = &x[r * h..(r + 1) * h];
                let ms = xr.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / h as f64;
                let inv = 1.0 / (ms + eps).sqrt();
                for i in 0..h {
                    let want = f64::from(xr[i]) * inv * f64::from(w[i]);
                    let g = f64::from(got[r * h + i]);
                    assert!((g - want).abs() <= 4e-7 * want.abs() + 1e-30, "n {n} h {h} row {r} col {i}: {g} vs {want}");
                    let c = f64::from(composed[r * h + i]);
                    assert!((g - c).abs() <= 4e-7 * c.abs() + 1e-30, "vs composition: {g} vs {c}");
                }
                let mut alone = vec![0.0f32; h];
                rms_norm_host(xr, &w, eps, &mut alone).expect("valid");
                assert!(alone.iter().zip(&got[r * h..]).all(|(a, b)| a.to_bits() == b.to_bits()), "row {r} differs alone");
            }
        }
        let mut out = vec![0.0f32; 5];
        assert!(matches!(rms_norm_host(&[1.0; 5], &[1.0; 2], 1e-5, &mut out), Err(Error::Length { .. })));
        assert!(matches!(rms_norm_host(&[1.0; 4], &[1.0; 2], 1e-5, &mut out), Err(Error::Length { .. })));
        assert!(matches!(rms_norm_host(&[], &[], 1e-5, &mut []), Err(Error::Length { .. })));
    }
}
