//! Tiled causal attention with grouped-query heads for prefill, FlashAttention-2 style.
//!
//! Dao 2023, "FlashAttention-2", Algorithm 1 (forward pass): a cube owns a tile of `BQ` query
//! rows of one head, keeps them in shared memory, and streams the keys and values of the head's
//! key/value group through shared memory in tiles of `BK` positions. For each key tile it
//! computes the `BQ × BK` scores, applies the causal mask, updates the running row maximum `m`
//! and sum `l` (online softmax, Milakov & Gimelshein 2018), rescales the output accumulator by
//! `exp(m_old − m_new)` and adds `P · V`. The output is divided by `l` once at the end; no
//! `[seq, seq]` score matrix is ever materialized, only one `BQ × BK` tile.
//!
//! # Thread layout
//! `CUBE_DIM = (32, BQ)`: unit `(lane, i)` works on query row `i` of the tile. Lanes split the
//! keys of a tile for the scores and the exponentials, and the `head_dim` output columns
//! (`lane, lane + 32, ...`) for the accumulator, which stays in registers.
//!
//! Key tiles past the last position any row of the cube may see (`past + last row`) are
//! skipped, so a causal prefill does about half the work of the full square.

use burn::backend::Shape;
use burn::tensor::DType;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// Lanes per query row.
const LANES: u32 = 32;

/// Score of a masked position (WGSL has no infinity literal; `exp(MASKED − m)` is 0).
const MASKED: f32 = -1.0e30;

#[cube(launch)]
#[allow(clippy::too_many_arguments, unused_assignments)]
fn flash_attention_kernel(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &mut [f32],
    seq: u32,
    past: u32,
    heads: u32,
    kv_heads: u32,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] bq: usize,
    #[comptime] bk: usize,
) {
    let lane = UNIT_POS_X as usize;
    let i = UNIT_POS_Y as usize;
    let tid = i * 32 + lane;
    let threads = bq * 32;
    let h = CUBE_POS_Y as usize;
    let q0 = (CUBE_POS_X as usize) * bq;
    let t_len = seq as usize;
    let p0 = past as usize;
    let n_heads = heads as usize;
    let n_kv = kv_heads as usize;
    let kvh = h / (n_heads / n_kv);
    let kv_len = p0 + t_len;
    let t = q0 + i;

    let mut q_s = Shared::<[f32]>::new_slice(bq * head_dim);
    let mut k_s = Shared::<[f32]>::new_slice(bk * head_dim);
    let mut v_s = Shared::<[f32]>::new_slice(bk * head_dim);
    let mut s_s = Shared::<[f32]>::new_slice(bq * bk);
    let mut p_s = Shared::<[f32]>::new_slice(bq * bk);

    // The query tile (rows past the sequence are zeros; their outputs are dropped).
    let mut e = tid;
    while e < bq * head_dim {
        let row = q0 + e / head_dim;
        let mut val = 0.0f32;
        if row < t_len {
            val = q[(row * n_heads + h) * head_dim + e % head_dim];
        }
        q_s[e] = val;
        e += threads;
    }

    // Output columns of this lane: lane + 32 c.
    let dc = (head_dim + 31) / 32;
    let mut o = Array::<f32>::new(dc);
    #[unroll]
    for c in 0..dc {
        o[c] = 0.0f32;
    }
    // A `let mut` initialized with a const (or a negated literal, which the macro folds to one)
    // is a comptime variable that cannot take runtime values: start from a literal, then assign.
    let mut m = 0.0f32;
    m = MASKED;
    let mut l = 0.0f32;

    // Keys any row of this cube may attend to: 0 ..= past + last row.
    let last_row = if q0 + bq < t_len { q0 + bq } else { t_len };
    let n_keys = p0 + last_row;
    let n_tiles = (n_keys + bk - 1) / bk;

    for kt in 0..n_tiles {
        let k0 = kt * bk;
        sync_cube();
        let mut e2 = tid;
        while e2 < bk * head_dim {
            let pos = k0 + e2 / head_dim;
            let mut kv = 0.0f32;
            let mut vv = 0.0f32;
            if pos < kv_len {
                let at = (pos * n_kv + kvh) * head_dim + e2 % head_dim;
                kv = k[at];
                vv = v[at];
            }
            k_s[e2] = kv;
            v_s[e2] = vv;
            e2 += threads;
        }
        sync_cube();

        // Scores S = Q Kᵀ · scale with the causal mask: key k0 + j is visible to row t iff
        // k0 + j ≤ past + t (and inside the cache).
        let mut j = lane;
        while j < bk {
            let key = k0 + j;
            let mut s = 0.0f32;
            s = MASKED;
            if key < kv_len && key <= p0 + t {
                let mut dot = 0.0f32;
                for dd in 0..head_dim {
                    dot += q_s[i * head_dim + dd] * k_s[j * head_dim + dd];
                }
                s = dot * scale;
            }
            s_s[i * bk + j] = s;
            j += 32;
        }
        sync_cube();

        // Online softmax: new running max, P = exp(S − m_new).
        let mut tile_max = 0.0f32;
        tile_max = MASKED;
        for jj in 0..bk {
            tile_max = f32::max(tile_max, s_s[i * bk + jj]);
        }
        let m_new = f32::max(m, tile_max);
        let mut j2 = lane;
        while j2 < bk {
            let s = s_s[i * bk + j2];
            let mut p = 0.0f32;
            if s > MASKED {
                p = f32::exp(s - m_new);
            }
            p_s[i * bk + j2] = p;
            j2 += 32;
        }
        sync_cube();

        // Rescale and accumulate: l = α l + Σ P, O = α O + P V, α = exp(m_old − m_new).
        let alpha = f32::exp(m - m_new);
        let mut row_sum = 0.0f32;
        for jj in 0..bk {
            row_sum += p_s[i * bk + jj];
        }
        l = l * alpha + row_sum;
        #[unroll]
        for c in 0..dc {
            let d = lane + c * 32;
            if d < head_dim {
                let mut acc = o[c] * alpha;
                for jj in 0..bk {
                    acc += p_s[i * bk + jj] * v_s[jj * head_dim + d];
                }
                o[c] = acc;
            }
        }
        m = m_new;
    }

    if t < t_len {
        let inv = 1.0f32 / l;
        #[unroll]
        for c in 0..dc {
            let d = lane + c * 32;
            if d < head_dim {
                out[(t * n_heads + h) * head_dim + d] = o[c] * inv;
            }
        }
    }
}

/// Shared-memory bytes of a `(bq, bk)` tiling for `head_dim`.
fn shared_bytes(bq: usize, bk: usize, head_dim: usize) -> usize {
    4 * (bq * head_dim + 2 * bk * head_dim + 2 * bq * bk)
}

/// The largest tiling (query rows, key positions) that fits in `max_shared` bytes, if any.
pub(crate) fn tiling(head_dim: usize, max_shared: usize) -> Option<(usize, usize)> {
    [(8, 32), (8, 16), (4, 16), (4, 8), (2, 8), (1, 8)]
        .into_iter()
        .find(|&(bq, bk)| shared_bytes(bq, bk, head_dim) <= max_shared)
}

/// Launches [`flash_attention_kernel`], or returns `None` when no tiling fits the device's
/// shared memory (the caller then runs the composition). `q: [tokens, heads, head_dim]`,
/// `k`, `v`: `[past + tokens, kv_heads, head_dim]`, all checked by the caller. Returns
/// `[tokens, heads · head_dim]`.
pub(crate) fn launch(q: CubeTensor, k: CubeTensor, v: CubeTensor, past: usize) -> Option<CubeTensor> {
    let dims = q.meta.shape().clone();
    let (tokens, heads, head_dim) = (dims[0], dims[1], dims[2]);
    let kv_heads = k.meta.shape()[1];
    let max_shared = q.client.properties().hardware.max_shared_memory_size;
    let (bq, bk) = tiling(head_dim, max_shared)?;
    let q = into_contiguous(q);
    let k = into_contiguous(k);
    let v = into_contiguous(v);
    let out = empty_device_dtype(q.client.clone(), q.device.clone(), Shape::new([tokens, heads * head_dim]), DType::F32);
    if tokens == 0 || heads == 0 || head_dim == 0 {
        return Some(out);
    }
    let scale = (1.0 / (head_dim as f64).sqrt()) as f32;
    flash_attention_kernel::launch(
        &q.client,
        CubeCount::Static(tokens.div_ceil(bq) as u32, heads as u32, 1),
        CubeDim::new_2d(LANES, bq as u32),
        q.clone().into_buffer_arg(),
        k.into_buffer_arg(),
        v.into_buffer_arg(),
        out.clone().into_buffer_arg(),
        tokens as u32,
        past as u32,
        heads as u32,
        kv_heads as u32,
        scale,
        head_dim,
        bq,
        bk,
    );
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiling_fits_shared_memory() {
        // WebGPU's default 16 KiB and a 64 KiB device (lavapipe, most GPUs).
        assert_eq!(tiling(64, 16 * 1024), Some((8, 16)));
        assert_eq!(tiling(64, 64 * 1024), Some((8, 32)));
        assert_eq!(tiling(128, 16 * 1024), Some((4, 8)));
        for d in [16, 64, 80, 128, 256] {
            for smem in [16 * 1024, 32 * 1024, 48 * 1024] {
                if let Some((bq, bk)) = tiling(d, smem) {
                    assert!(shared_bytes(bq, bk, d) <= smem);
                }
            }
        }
        assert_eq!(tiling(4096, 16 * 1024), None);
    }
}
