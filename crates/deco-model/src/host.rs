//! Host-side tensor helpers shared by the model, the quantizers and the trainers: device reads
//! and the row-major layout changes that weight loading needs.

use burn::tensor::{Device, Tensor};

use crate::{Error, Result};

/// Runs `f` (a forward pass, or any run of host kernel calls) on a worker of the current rayon
/// pool with the pool's other workers as a spinning team (`deco_kernels::team::with_team`), when
/// `device` is the CPU (`flex`) and the caller is outside the pool; otherwise runs `f` here (on
/// a pool worker the caller's team, if any, is used; a GPU device keeps its stream per thread).
/// Outside a team every parallel kernel call is a rayon fork-join that wakes the sleeping
/// workers (a futex wake-up, in a VM an inter-processor interrupt).
pub fn on_cpu_team<R: Send>(device: &Device, f: impl FnOnce() -> R + Send) -> R {
    if *device == Device::flex() && rayon::current_thread_index().is_none() {
        return rayon::scope(|_| deco_kernels::team::with_team(f));
    }
    f()
}

/// Copies a tensor of any rank to the host as f32, row-major (`[d0, d1, ..]` → `d0 · d1 · ..`
/// values).
///
/// # Errors
/// [`Error::TensorRead`] if the device read fails (or the tensor is not f32-convertible).
pub fn to_host<const D: usize>(t: Tensor<D>) -> Result<Vec<f32>> {
    t.try_into_vec_as::<f32>().map_err(|e| Error::TensorRead(format!("{e:?}")))
}

/// Runs `f` on a tensor's f32 values, row-major, borrowed in place when the tensor is a
/// contiguous f32 tensor of the CPU (`Flex`) device without autodiff; otherwise (another device,
/// an autodiff tensor, a strided view, another dtype) on a host copy ([`to_host`]).
///
/// `to_host` of a CPU tensor that is still shared (a clone held elsewhere, as the calibration
/// and prefill activations are) copies its buffer three times: out of the shared buffer, into a
/// buffer of the runtime's alignment, and into the `Vec`. For the 75-200 MB calibration
/// activations of GPTQ those copies were 40 % of the run's page faults.
///
/// # Errors
/// As [`to_host`] on the copying path.
pub fn with_host<const D: usize, R>(t: &Tensor<D>, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    if let Ok(p) = t.clone().try_into_primitive::<burn::backend::Flex>()
        && let Some(values) = p.as_slice::<f32>()
    {
        return Ok(f(values));
    }
    Ok(f(&to_host(t.clone())?))
}

/// Copies a `[rows, cols]` tensor to the host, one `Vec` per row: one copy, from the tensor's
/// buffer borrowed in place where [`with_host`] can (the logits of a 16-sequence decode step of
/// SmolLM2 are 3 MB, which the engine thread copied three times while the model's threads
/// waited).
///
/// # Errors
/// As [`to_host`].
pub fn to_host_rows(t: Tensor<2>) -> Result<Vec<Vec<f32>>> {
    let [_, cols] = t.dims();
    with_host(&t, |h| h.chunks(cols.max(1)).map(<[f32]>::to_vec).collect())
}

/// Transposes a row-major `[rows, cols]` buffer into `[cols, rows]` (blocked for cache reuse;
/// blocks of 32 output rows in parallel).
///
/// # Panics
/// Never for `data.len() == rows · cols`; shorter data panics on the index (callers check the
/// shape first).
pub fn transpose(data: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    use rayon::prelude::*;
    let mut out = vec![0.0f32; data.len()];
    const B: usize = 32;
    if rows == 0 || cols == 0 {
        return out;
    }
    // Blocks of B output rows (input columns) in parallel, each written by one task.
    out.par_chunks_mut(B * rows).enumerate().for_each(|(i, chunk)| {
        let c0 = i * B;
        let c1 = (c0 + B).min(cols);
        for r0 in (0..rows).step_by(B) {
            for r in r0..(r0 + B).min(rows) {
                for c in c0..c1 {
                    chunk[(c - c0) * rows + r] = data[r * cols + c];
                }
            }
        }
    });
    out
}

/// Fuses linear weights that read the same input (Q/K/V, gate/up) into one transposed matrix.
///
/// Each part is a transformers weight `[out_i, inner]` (row-major) with its `out_i`; the result
/// is `[inner, Σ out_i]` row-major, so `y = x @ fused` gives the parts' outputs side by side in
/// the order given (`deco_model::Llama`'s and the trainers' layout).
pub fn fuse_transposed(parts: &[(&[f32], usize)], inner: usize) -> Vec<f32> {
    let transposed: Vec<(Vec<f32>, usize)> = parts.iter().map(|&(w, out)| (transpose(w, out, inner), out)).collect();
    if transposed.len() == 1 {
        return transposed.into_iter().next().map(|t| t.0).unwrap_or_default();
    }
    let total: usize = parts.iter().map(|p| p.1).sum();
    let mut fused = Vec::with_capacity(inner * total);
    for r in 0..inner {
        for (t, cols) in &transposed {
            fused.extend_from_slice(&t[r * cols..(r + 1) * cols]);
        }
    }
    fused
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transpose_matches_the_definition() {
        for (rows, cols) in [(1, 1), (3, 5), (33, 70), (64, 1)] {
            let data: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
            let t = transpose(&data, rows, cols);
            for r in 0..rows {
                for c in 0..cols {
                    assert_eq!(t[c * rows + r], data[r * cols + c]);
                }
            }
        }
    }

    #[test]
    fn fused_columns_are_the_parts_side_by_side() {
        // Two weights [2, 3] and [1, 3]: fused [3, 3] has column j = row j of the stack.
        let a = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let b = [7.0, 8.0, 9.0];
        let f = fuse_transposed(&[(&a, 2), (&b, 1)], 3);
        assert_eq!(f, vec![1.0, 4.0, 7.0, 2.0, 5.0, 8.0, 3.0, 6.0, 9.0]);
        assert_eq!(fuse_transposed(&[(&a, 2)], 3), transpose(&a, 2, 3));
    }

    /// `with_host` sees the row-major values `to_host` copies out, for a tensor read in place
    /// (contiguous, shared with a clone, a row range at an offset) and for views it must copy
    /// (a transpose, a column slice); and the in-place read really borrows the storage.
    #[test]
    fn with_host_sees_what_to_host_copies() {
        use burn::tensor::{Device, TensorData};
        let device = Device::flex();
        let values: Vec<f32> = (0..6 * 5).map(|i| i as f32 * 0.5 - 3.0).collect();
        let t = Tensor::<2>::from_data(TensorData::new(values.clone(), [6, 5]), &device);
        let _shared = t.clone();
        let views = [t.clone(), t.clone().slice([2..5, 0..5]), t.clone().transpose(), t.clone().slice([0..6, 1..3]), t.clone() * 2.0];
        for (i, v) in views.into_iter().enumerate() {
            let want = to_host(v.clone()).expect("to_host");
            let got = with_host(&v, <[f32]>::to_vec).expect("with_host");
            assert_eq!(got, want, "view {i}");
        }
        // Two reads alive at once: copies would be two buffers.
        let same = with_host(&t, |x| with_host(&t, |y| x.as_ptr() == y.as_ptr())).expect("with_host").expect("with_host");
        assert!(same, "a contiguous CPU tensor is read in place, not copied");
        let tr = t.clone().transpose();
        let copied = with_host(&tr, |x| with_host(&tr, |y| x.as_ptr() != y.as_ptr())).expect("with_host").expect("with_host");
        assert!(copied, "a transposed view is copied");
    }
}
