//! Rotary position embedding kernel (rotate-half layout): one unit per output element.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::DType;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// Units per cube.
const BLOCK: u32 = 256;

/// `out[t, h, i] = x[t, h, i] · cos[p, i] + r[t, h, i] · sin[p, i]` with `p = positions[t]` and
/// `r = cat(−x[.., half..], x[.., ..half])` (transformers' `rotate_half`).
///
/// A position outside the table (`p ≥ max_positions`, which callers must prevent) writes 0
/// instead of reading out of bounds.
#[cube(launch)]
fn rope_kernel<I: Int>(
    x: &[f32],
    cos: &[f32],
    sin: &[f32],
    positions: &[I],
    out: &mut [f32],
    total: u32,
    heads: u32,
    head_dim: u32,
    max_positions: u32,
    #[define(I)] _int: ElemType,
) {
    let idx = ((CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) * CUBE_DIM_X + UNIT_POS_X) as usize;
    if idx >= total as usize {
        terminate!();
    }
    let d = head_dim as usize;
    let half = d / 2;
    let i = idx % d;
    let t = idx / (d * heads as usize);
    let p = u32::cast_from(positions[t]);
    if p >= max_positions {
        out[idx] = 0.0f32;
    } else {
        let row = p as usize * d;
        let rotated = if i < half { -x[idx + half] } else { x[idx - half] };
        out[idx] = x[idx] * cos[row + i] + rotated * sin[row + i];
    }
}

/// Launches [`rope_kernel`]: `x: [tokens, heads, head_dim]`, `cos`, `sin`:
/// `[max_positions, head_dim]`, `positions: [tokens]` (any integer dtype), all checked by the
/// caller.
pub(crate) fn launch(x: CubeTensor, cos: CubeTensor, sin: CubeTensor, positions: CubeTensor) -> CubeTensor {
    let x = into_contiguous(x);
    let cos = into_contiguous(cos);
    let sin = into_contiguous(sin);
    let positions = into_contiguous(positions);
    let dims = x.meta.shape().clone();
    let (heads, head_dim) = (dims[1], dims[2]);
    let max_positions = cos.meta.shape()[0];
    let total = dims.num_elements();
    let out = empty_device_dtype(x.client.clone(), x.device.clone(), dims, DType::F32);
    if total == 0 {
        return out;
    }
    let int_dtype = positions.dtype;
    let (cx, cy) = super::grid_2d(&x.client, total.div_ceil(BLOCK as usize));
    rope_kernel::launch(
        &x.client,
        CubeCount::Static(cx, cy, 1),
        CubeDim::new_1d(BLOCK),
        x.clone().into_buffer_arg(),
        cos.into_buffer_arg(),
        sin.into_buffer_arg(),
        positions.into_buffer_arg(),
        out.clone().into_buffer_arg(),
        total as u32,
        heads as u32,
        head_dim as u32,
        max_positions as u32,
        dtype_to_storage_type(int_dtype),
    );
    out
}
