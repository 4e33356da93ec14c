//! Paged decode attention: one new query token per sequence, keys and values read through a
//! block table (Kwon et al. 2023, "PagedAttention", §4.1), online softmax over key tiles
//! (FlashAttention-2, as [`super::flash`]).
//!
//! A cube handles one (sequence, key/value head): its `g = heads / kv_heads` query heads are the
//! rows of the tile (`CUBE_DIM = (32, g)`), so each key/value row is loaded into shared memory
//! once for the whole group. Position `p` of sequence `s` is row `p % block_size` of block
//! `table[s][p / block_size]`.

use burn::backend::Shape;
use burn::tensor::DType;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// Key positions per shared-memory tile.
const BK: usize = 16;

/// Score of a key past the sequence (`exp(MASKED − m)` is 0).
const MASKED: f32 = -1.0e30;

#[cube(launch)]
#[allow(clippy::too_many_arguments, unused_assignments)]
fn paged_decode_kernel(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    tables: &[u32],
    lens: &[u32],
    out: &mut [f32],
    heads: u32,
    kv_heads: u32,
    block_size: u32,
    max_blocks: u32,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] group: usize,
    #[comptime] bk: usize,
) {
    let lane = UNIT_POS_X as usize;
    let i = UNIT_POS_Y as usize;
    let tid = i * 32 + lane;
    let threads = group * 32;
    let s = CUBE_POS_X as usize;
    let kvh = CUBE_POS_Y as usize;
    let n_heads = heads as usize;
    let n_kv = kv_heads as usize;
    let bs = block_size as usize;
    let len = lens[s] as usize;
    let h = kvh * group + i;
    let table = s * max_blocks as usize;

    let mut q_s = Shared::<[f32]>::new_slice(group * head_dim);
    let mut k_s = Shared::<[f32]>::new_slice(bk * head_dim);
    let mut v_s = Shared::<[f32]>::new_slice(bk * head_dim);
    let mut s_s = Shared::<[f32]>::new_slice(group * bk);
    let mut p_s = Shared::<[f32]>::new_slice(group * bk);

    let mut e = tid;
    while e < group * head_dim {
        q_s[e] = q[(s * n_heads + kvh * group) * head_dim + e];
        e += threads;
    }

    let dc = (head_dim + 31) / 32;
    let mut o = Array::<f32>::new(dc);
    #[unroll]
    for c in 0..dc {
        o[c] = 0.0f32;
    }
    let mut m = 0.0f32;
    m = MASKED;
    let mut l = 0.0f32;
    let n_tiles = (len + bk - 1) / bk;

    for kt in 0..n_tiles {
        let k0 = kt * bk;
        sync_cube();
        let mut e2 = tid;
        while e2 < bk * head_dim {
            let pos = k0 + e2 / head_dim;
            let mut kv = 0.0f32;
            let mut vv = 0.0f32;
            if pos < len {
                let block = tables[table + pos / bs] as usize;
                let at = ((block * bs + pos % bs) * n_kv + kvh) * head_dim + e2 % head_dim;
                kv = k[at];
                vv = v[at];
            }
            k_s[e2] = kv;
            v_s[e2] = vv;
            e2 += threads;
        }
        sync_cube();

        let mut j = lane;
        while j < bk {
            let mut sc = 0.0f32;
            sc = MASKED;
            if k0 + j < len {
                let mut dot = 0.0f32;
                for dd in 0..head_dim {
                    dot += q_s[i * head_dim + dd] * k_s[j * head_dim + dd];
                }
                sc = dot * scale;
            }
            s_s[i * bk + j] = sc;
            j += 32;
        }
        sync_cube();

        let mut tile_max = 0.0f32;
        tile_max = MASKED;
        for jj in 0..bk {
            tile_max = f32::max(tile_max, s_s[i * bk + jj]);
        }
        let m_new = f32::max(m, tile_max);
        let mut j2 = lane;
        while j2 < bk {
            let sc = s_s[i * bk + j2];
            let mut p = 0.0f32;
            if sc > MASKED {
                p = f32::exp(sc - m_new);
            }
            p_s[i * bk + j2] = p;
            j2 += 32;
        }
        sync_cube();

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

    let inv = 1.0f32 / l;
    #[unroll]
    for c in 0..dc {
        let d = lane + c * 32;
        if d < head_dim {
            out[(s * n_heads + h) * head_dim + d] = o[c] * inv;
        }
    }
}

/// Shared-memory bytes for a group of `group` heads.
pub(crate) fn shared_bytes(group: usize, head_dim: usize) -> usize {
    4 * (group * head_dim + 2 * BK * head_dim + 2 * group * BK)
}

/// Launches [`paged_decode_kernel`], or `None` if the group does not fit the device (more than
/// 32 query heads per kv head or too little shared memory; the caller then runs the CPU path).
/// `q: [seqs, heads, head_dim]`, caches `[num_blocks, block_size, kv_heads, head_dim]`,
/// `tables: [seqs, max_blocks]` u32, `lens: [seqs]` u32, all checked by the caller.
pub(crate) fn launch(
    q: CubeTensor,
    k: CubeTensor,
    v: CubeTensor,
    tables: CubeTensor,
    lens: CubeTensor,
    block_size: usize,
) -> Option<CubeTensor> {
    let dims = q.meta.shape().clone();
    let (seqs, heads, head_dim) = (dims[0], dims[1], dims[2]);
    let kv_heads = k.meta.shape()[2];
    let max_blocks = tables.meta.shape()[1];
    let group = heads / kv_heads;
    let props = q.client.properties();
    if group > 32 || shared_bytes(group, head_dim) > props.hardware.max_shared_memory_size {
        return None;
    }
    let q = into_contiguous(q);
    let (k, v) = (into_contiguous(k), into_contiguous(v));
    let (tables, lens) = (into_contiguous(tables), into_contiguous(lens));
    let out = empty_device_dtype(q.client.clone(), q.device.clone(), Shape::new([seqs, heads, head_dim]), DType::F32);
    if seqs == 0 {
        return Some(out);
    }
    paged_decode_kernel::launch(
        &q.client,
        CubeCount::Static(seqs as u32, kv_heads as u32, 1),
        CubeDim::new_2d(32, group as u32),
        q.clone().into_buffer_arg(),
        k.into_buffer_arg(),
        v.into_buffer_arg(),
        tables.into_buffer_arg(),
        lens.into_buffer_arg(),
        out.clone().into_buffer_arg(),
        heads as u32,
        kv_heads as u32,
        block_size as u32,
        max_blocks as u32,
        (1.0 / (head_dim as f64).sqrt()) as f32,
        head_dim,
        group,
        BK,
    );
    Some(out)
}
