//! Fused RMSNorm kernel: one cube per row, shared-memory tree reduction of `Σ x²`.

use burn::tensor::DType;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// Units per cube (a power of two: the tree reduction halves it).
const BLOCK: u32 = 128;

/// `out[r, i] = (x[r, i] · inv_r) · weight[i]`, `inv_r = 1 / sqrt(Σ_i x[r, i]² / hidden + eps)`.
///
/// Cube `r` handles row `r`; its `block` units stride over the row, write their partial sums
/// to shared memory and reduce them as a binary tree.
#[cube(launch)]
fn rms_norm_kernel(
    x: &[f32],
    weight: &[f32],
    out: &mut [f32],
    rows: u32,
    hidden: u32,
    eps: f32,
    #[comptime] block: u32,
) {
    // The whole cube leaves together (the row is per cube), before any barrier.
    if CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X >= rows {
        terminate!();
    }
    let row = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    let h = hidden as usize;
    let base = row * h;
    let unit = UNIT_POS_X as usize;
    // Runtime values (CUBE_DIM_X == block): a mutable local initialized from a comptime value
    // fails cubecl's IR verification.
    let step = CUBE_DIM_X as usize;
    let mut partial = Shared::<[f32]>::new_slice(block as usize);

    let mut acc = 0.0f32;
    let mut i = unit;
    while i < h {
        let v = x[base + i];
        acc += v * v;
        i += step;
    }
    partial[unit] = acc;
    sync_cube();

    let mut stride = step / 2;
    while stride > 0 {
        if unit < stride {
            let sum = partial[unit] + partial[unit + stride];
            partial[unit] = sum;
        }
        sync_cube();
        stride /= 2;
    }

    let mean = partial[0] / f32::cast_from(hidden);
    let inv = 1.0f32 / (mean + eps).sqrt();
    let mut j = unit;
    while j < h {
        out[base + j] = x[base + j] * inv * weight[j];
        j += step;
    }
}

/// Launches [`rms_norm_kernel`] on `x: [tokens, hidden]` and `weight: [hidden]` (f32, checked by
/// the caller).
pub(crate) fn launch(x: CubeTensor, weight: CubeTensor, eps: f64) -> CubeTensor {
    let x = into_contiguous(x);
    let weight = into_contiguous(weight);
    let dims = x.meta.shape().clone();
    let (tokens, hidden) = (dims[0], dims[1]);
    let out = empty_device_dtype(x.client.clone(), x.device.clone(), dims, DType::F32);
    if tokens == 0 || hidden == 0 {
        return out;
    }
    let (cx, cy) = super::grid_2d(&x.client, tokens);
    rms_norm_kernel::launch(
        &x.client,
        CubeCount::Static(cx, cy, 1),
        CubeDim::new_1d(BLOCK),
        x.clone().into_buffer_arg(),
        weight.into_buffer_arg(),
        out.clone().into_buffer_arg(),
        tokens as u32,
        hidden as u32,
        eps as f32,
        BLOCK,
    );
    out
}
