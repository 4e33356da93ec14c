//! CubeCL GPU kernels for the hot operations of a Llama decoder, as burn backend extensions.
//!
//! Compiled only with the `wgpu` or `cuda` feature. Each operation is one method of the backend
//! extension trait [`DecoKernelOps`] (burn 0.22's `#[backend_extension]`, the pattern of
//! `burn-signal`): on a CubeCL device (`Device::wgpu(..)`, `Device::cuda(..)`) the call runs the
//! `#[cube]` kernel of this module, compiled just in time for that runtime; on `Device::flex()`
//! it runs the reference (the burn composition of [`crate::ops`] or the CPU kernels of
//! [`crate::quant`]). Model code calls the checked free functions below, which take and
//! return ordinary `Tensor`s and validate shapes (no panics on bad shapes).
//!
//! | function | kernel | reference |
//! |---|---|---|
//! | [`rms_norm`] | one cube per row, shared-memory tree reduction | [`crate::ops::rms_norm`] |
//! | [`CubeRope::apply`] | one unit per element, rotate-half | [`crate::ops::RopeTable::apply`] |
//! | [`CubePackedMatrix::matmul`] | dequantize-in-registers dot products, 32 lanes per row | [`PackedMatrix::matmul`] |
//! | [`flash_attention`] | FlashAttention-2 tiles, online softmax, causal tile skipping | [`crate::ops::causal_gqa_attention`] |
//! | [`paged_decode_attention`] | one cube per (sequence, kv head), K/V through the block table | [`crate::attention::paged_decode_attention`] |
//!
//! All kernels take and return f32 (activations and accumulation in f32).
//!
//! # Tolerances (checked by `kernels/tests/cube.rs` on wgpu/lavapipe)
//! - RMSNorm: the sum of squares is reduced in a different order than burn's `mean_dim`;
//!   `|out − ref| ≤ 1e-5 · (1 + |ref|)`.
//! - RoPE: the same two products and one sum as the reference (a GPU may fuse them into an
//!   FMA); `|out − ref| ≤ 1e-6 · (1 + |ref|)`.
//! - Quantized matmul: the product of the exactly dequantized weights with the f32
//!   activations, summed in another order than the CPU kernel;
//!   `|y − ref| ≤ 1e-5 · Σ|w x| + 1e-6` per element (the bound of `tests/quant.rs`).
//! - Attention: online softmax in f32 (scores, exponentials and `P · V` in another order than
//!   the composition's matmul/softmax); `|out − ref| ≤ 2e-5 · (1 + |ref|)` against an f64 loop
//!   for inputs in `[-1, 1]`.
//!
//! # Sources
//! - Dao 2023, "FlashAttention-2: Faster Attention with Better Parallelism and Work
//!   Partitioning", Algorithm 1 (tiled forward pass with online softmax).
//! - Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with
//!   PagedAttention" (vLLM), §4.1: keys/values in fixed-size blocks addressed by a block table.
//! - ggml-common.h (llama.cpp): `block_q4_0`, `block_q4_1`, `block_q8_0` layouts; ggml-quants.c
//!   `dequantize_row_*` for the arithmetic.
//! - Zhang & Sennrich 2019 (RMSNorm); Su et al. 2021 (RoFormer, rotary embedding); Ainslie et al.
//!   2023 (grouped-query attention).

use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Backend, Cube, Flex, backend_extension};
use burn::tensor::{DType, Device, Int, Tensor, TensorData};

use crate::error::{Error, Result};
use crate::quant::{BlockType, PackedMatrix};

mod flash;
mod paged;
mod quant;
mod rms_norm;
mod rope;

/// The custom operations of deco as a burn backend extension.
///
/// Implemented for the CubeCL backend (every CubeCL runtime: wgpu, CUDA, ...) by the kernels of
/// this module and for `Flex` by the reference compositions. Call it through the checked free
/// functions of [`crate::cube`]; the trait methods assume valid shapes and f32 tensors.
#[backend_extension(Flex, Cube: cfg(any(feature = "wgpu", feature = "cuda")))]
pub trait DecoKernelOps: Backend {
    /// RMSNorm, see [`rms_norm`]. `x: [tokens, hidden]`, `weight: [hidden]`.
    fn rms_norm(x: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f64) -> FloatTensor<Self>;

    /// Rotate-half RoPE, see [`CubeRope::apply`]. `x: [tokens, heads, head_dim]`,
    /// `cos`, `sin`: `[max_positions, head_dim]`, `positions: [tokens]`.
    fn rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        positions: IntTensor<Self>,
    ) -> FloatTensor<Self>;

    /// `y[n, rows] = x[n, cols] · Wᵀ` on packed GGUF blocks, see [`CubePackedMatrix::matmul`].
    /// `x: [n, cols]`, `words`: the packed bytes of `W` as little-endian u32 words (dtype u32).
    fn quant_matmul(
        x: FloatTensor<Self>,
        words: IntTensor<Self>,
        ty: BlockType,
        rows: usize,
        cols: usize,
    ) -> FloatTensor<Self>;

    /// Causal GQA attention of a prefill, see [`flash_attention`]. `q: [tokens, heads, head_dim]`,
    /// `k`, `v`: `[past + tokens, kv_heads, head_dim]`; output `[tokens, heads · head_dim]`.
    fn flash_attention(q: FloatTensor<Self>, k: FloatTensor<Self>, v: FloatTensor<Self>, past: usize) -> FloatTensor<Self>;

    /// Paged decode attention, see [`paged_decode_attention`]. `q: [seqs, heads, head_dim]`,
    /// caches `[num_blocks, block_size, kv_heads, head_dim]`, `tables: [seqs, max_blocks]` and
    /// `lens: [seqs]` (u32); output `[seqs, heads, head_dim]`.
    fn paged_decode_attention(
        q: FloatTensor<Self>,
        k_cache: FloatTensor<Self>,
        v_cache: FloatTensor<Self>,
        tables: IntTensor<Self>,
        lens: IntTensor<Self>,
    ) -> FloatTensor<Self>;
}

impl DecoKernelOps for Cube {
    fn rms_norm(x: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
        rms_norm::launch(x, weight, eps)
    }

    fn rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        positions: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        rope::launch(x, cos, sin, positions)
    }

    fn quant_matmul(
        x: FloatTensor<Self>,
        words: IntTensor<Self>,
        ty: BlockType,
        rows: usize,
        cols: usize,
    ) -> FloatTensor<Self> {
        quant::launch(x, words, ty, rows, cols)
    }

    fn flash_attention(q: FloatTensor<Self>, k: FloatTensor<Self>, v: FloatTensor<Self>, past: usize) -> FloatTensor<Self> {
        let (q2, k2, v2) = (q.clone(), k.clone(), v.clone());
        flash::launch(q, k, v, past).unwrap_or_else(|| {
            // No tiling fits the device's shared memory (a very large head_dim): the burn
            // composition on the same device.
            let q = Tensor::<3>::from_primitive::<Cube>(q2);
            let k = Tensor::<3>::from_primitive::<Cube>(k2);
            let v = Tensor::<3>::from_primitive::<Cube>(v2);
            crate::ops::causal_gqa_attention(q, k, v, past)
                .try_into_primitive::<Cube>()
                .expect("a composition of Cube tensors stays on Cube")
        })
    }

    fn paged_decode_attention(
        q: FloatTensor<Self>,
        k_cache: FloatTensor<Self>,
        v_cache: FloatTensor<Self>,
        tables: IntTensor<Self>,
        lens: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        let block_size = k_cache.meta.shape()[1];
        let copies = (q.clone(), k_cache.clone(), v_cache.clone(), tables.clone(), lens.clone());
        paged::launch(q, k_cache, v_cache, tables, lens, block_size).unwrap_or_else(|| {
            // The group does not fit one cube: the CPU kernel on host copies.
            let (q, k, v, t, l) = copies;
            paged_cpu(
                Tensor::from_primitive::<Cube>(q),
                Tensor::from_primitive::<Cube>(k),
                Tensor::from_primitive::<Cube>(v),
                Tensor::from_primitive::<Cube>(t),
                Tensor::from_primitive::<Cube>(l),
            )
            .try_into_primitive::<Cube>()
            .expect("uploaded to the Cube device")
        })
    }
}

/// The reference path: the burn compositions of [`crate::ops`] run on the Flex tensors.
impl DecoKernelOps for Flex {
    fn rms_norm(x: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
        let x = Tensor::<2>::from_primitive::<Flex>(x);
        let weight = Tensor::<1>::from_primitive::<Flex>(weight);
        into_flex(crate::ops::rms_norm(x, &weight, eps))
    }

    fn rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        positions: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        let x = Tensor::<3>::from_primitive::<Flex>(x);
        let cos = Tensor::<2>::from_primitive::<Flex>(cos);
        let sin = Tensor::<2>::from_primitive::<Flex>(sin);
        let positions = Tensor::<1, Int>::from_primitive::<Flex>(positions);
        into_flex(crate::ops::rope_with_tables(x, &cos, &sin, &positions))
    }

    /// Copies the words back to bytes and runs [`PackedMatrix::matmul`] (the CPU kernel).
    fn quant_matmul(
        x: FloatTensor<Self>,
        words: IntTensor<Self>,
        ty: BlockType,
        rows: usize,
        cols: usize,
    ) -> FloatTensor<Self> {
        let x = Tensor::<2>::from_primitive::<Flex>(x);
        let device = x.device();
        let [n, _] = x.dims();
        let words = Tensor::<1, Int>::from_primitive::<Flex>(words)
            .into_data()
            .try_into_vec::<u32>()
            .expect("the words are uploaded as u32");
        let nbytes = rows * (cols / ty.block_len()) * ty.block_bytes();
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).take(nbytes).collect();
        let m = PackedMatrix::new(ty, rows, cols, bytes).expect("shapes checked by CubePackedMatrix");
        let xs = x.into_data().try_into_vec::<f32>().expect("f32 checked by CubePackedMatrix");
        let mut y = vec![0.0f32; n * rows];
        // The exact f32-activation kernel, whatever `set_activation_precision` says.
        m.matmul_with(&xs, n, &mut y, crate::quant::Isa::detect()).expect("lengths checked by CubePackedMatrix");
        into_flex(Tensor::<2>::from_data(TensorData::new(y, [n, rows]), &device))
    }

    fn flash_attention(q: FloatTensor<Self>, k: FloatTensor<Self>, v: FloatTensor<Self>, past: usize) -> FloatTensor<Self> {
        let q = Tensor::<3>::from_primitive::<Flex>(q);
        let k = Tensor::<3>::from_primitive::<Flex>(k);
        let v = Tensor::<3>::from_primitive::<Flex>(v);
        into_flex(crate::ops::causal_gqa_attention(q, k, v, past))
    }

    /// Copies the tensors to host vectors and runs [`crate::attention::paged_decode_attention`].
    fn paged_decode_attention(
        q: FloatTensor<Self>,
        k_cache: FloatTensor<Self>,
        v_cache: FloatTensor<Self>,
        tables: IntTensor<Self>,
        lens: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        into_flex(paged_cpu(
            Tensor::from_primitive::<Flex>(q),
            Tensor::from_primitive::<Flex>(k_cache),
            Tensor::from_primitive::<Flex>(v_cache),
            Tensor::from_primitive::<Flex>(tables),
            Tensor::from_primitive::<Flex>(lens),
        ))
    }
}

/// [`crate::attention::paged_decode_attention`] on host copies of checked tensors; the result
/// is uploaded to the device of `q`.
fn paged_cpu(q: Tensor<3>, k: Tensor<4>, v: Tensor<4>, tables: Tensor<2, Int>, lens: Tensor<1, Int>) -> Tensor<3> {
    use crate::attention::{AttnShape, SeqKv};
    let device = q.device();
    let [seqs, n_heads, head_dim] = q.dims();
    let [_, block_size, kv_heads, _] = k.dims();
    let [_, max_blocks] = tables.dims();
    let host = |t: Tensor<4>| t.into_data().try_into_vec::<f32>().expect("f32 checked by paged_decode_attention");
    let (k, v) = (host(k), host(v));
    let qs = q.into_data().try_into_vec::<f32>().expect("f32 checked by paged_decode_attention");
    let tables = tables.into_data().try_into_vec::<u32>().expect("tables uploaded as u32");
    let lens = lens.into_data().try_into_vec::<u32>().expect("lens uploaded as u32");
    let seq_kv: Vec<SeqKv<'_>> = (0..seqs)
        .map(|i| SeqKv {
            k: &k,
            v: &v,
            block_table: &tables[i * max_blocks..(i + 1) * max_blocks],
            block_size,
            len: lens[i] as usize,
        })
        .collect();
    let mut out = vec![0.0f32; seqs * n_heads * head_dim];
    crate::attention::paged_decode_attention(&qs, AttnShape { n_heads, kv_heads, head_dim }, &seq_kv, &mut out)
        .expect("checked by paged_decode_attention");
    Tensor::from_data(TensorData::new(out, [seqs, n_heads, head_dim]), &device)
}

/// A Flex float tensor back to its primitive (the reference compositions keep the backend).
fn into_flex<const D: usize>(t: Tensor<D>) -> FloatTensor<Flex> {
    t.try_into_primitive::<Flex>().expect("a composition of Flex tensors stays on Flex")
}

/// `(x, y)` cube counts covering `cubes` cubes (the x dimension is limited to 65535 by wgpu).
pub(crate) fn grid_2d(client: &cubecl::client::Client, cubes: usize) -> (u32, u32) {
    let max = (client.properties().hardware.max_cube_count.0 as usize).clamp(1, 65_535);
    if cubes <= max { (cubes.max(1) as u32, 1) } else { (max as u32, cubes.div_ceil(max) as u32) }
}

fn check_f32<const D: usize, K>(what: &str, t: &Tensor<D, K>) -> Result<()>
where
    K: burn::tensor::kind::Basic,
{
    if t.dtype() != DType::F32 {
        return Err(Error::Incompatible(format!("{what}: dtype {:?}, the CubeCL kernels take f32", t.dtype())));
    }
    Ok(())
}

fn check_device(what: &str, a: &Device, b: &Device) -> Result<()> {
    if a != b {
        return Err(Error::Incompatible(format!("{what}: tensors on different devices ({a:?} vs {b:?})")));
    }
    Ok(())
}

/// Fused RMSNorm (Zhang & Sennrich 2019), `weight · x / sqrt(mean(x²) + eps)` per row, as
/// [`crate::ops::rms_norm`] computes it.
///
/// On a CubeCL device one cube of 128 units handles a row: the units stride over the row, and
/// their partial sums of squares are reduced in shared memory as a binary tree; the same cube
/// then writes the scaled row. One kernel launch replaces the five of the composition.
///
/// # Shapes
/// - `x`: `[tokens, hidden]`, f32
/// - `weight`: `[hidden]`, f32, same device
/// - output: `[tokens, hidden]`
///
/// # Errors
/// [`Error::Incompatible`] for a `weight` of another length, a dtype other than f32 or tensors
/// on different devices.
pub fn rms_norm(x: Tensor<2>, weight: &Tensor<1>, eps: f64) -> Result<Tensor<2>> {
    let [_, hidden] = x.dims();
    let [w] = weight.dims();
    if w != hidden {
        return Err(Error::Incompatible(format!("rms_norm: weight of {w} values for rows of {hidden}")));
    }
    check_f32("rms_norm x", &x)?;
    check_f32("rms_norm weight", weight)?;
    check_device("rms_norm", &x.device(), &weight.device())?;
    let out = <burn::backend::Dispatch as DecoKernelOps>::rms_norm(x.into_dispatch(), weight.clone().into_dispatch(), eps);
    Ok(Tensor::from_dispatch(out))
}

/// Rotary position embedding tables and the fused rotate-half RoPE (Su et al. 2021,
/// "RoFormer", eq. 34; transformers' `apply_rotary_pos_emb`), as [`crate::ops::RopeTable`].
///
/// It holds a [`crate::ops::RopeTable`] (the same tables, built once the same way) and applies
/// them with one kernel launch.
#[derive(Debug, Clone)]
pub struct CubeRope {
    table: crate::ops::RopeTable,
}

impl CubeRope {
    /// Builds the tables from inverse frequencies `inv_freq` (length `head_dim / 2`, see
    /// [`crate::ops::rope_inv_freq`]) for positions `0 .. max_positions`.
    pub fn new(inv_freq: &[f64], max_positions: usize, device: &Device) -> Self {
        Self { table: crate::ops::RopeTable::new(inv_freq, max_positions, device) }
    }

    /// Largest position + 1 the tables cover.
    pub fn max_positions(&self) -> usize {
        self.table.max_positions()
    }

    /// Rotates `x` by the angles of `positions`: `x · cos + rotate_half(x) · sin`.
    ///
    /// On a CubeCL device one unit computes one output element (one launch instead of the
    /// composition's two gathers, two slices, a concatenation and three element-wise ops).
    /// Positions are not read back to the host: a position `≥ max_positions` yields zeros (the
    /// caller must keep positions in range, as for [`crate::ops::RopeTable::apply`]).
    ///
    /// # Shapes
    /// - `x`: `[tokens, heads, head_dim]`, f32, on the device of the tables
    /// - `positions`: `[tokens]`, any integer dtype
    /// - output: `[tokens, heads, head_dim]`
    ///
    /// # Errors
    /// [`Error::Incompatible`] for a `head_dim` other than the tables', a `positions` of another
    /// length, a dtype other than f32 or another device.
    pub fn apply(&self, x: Tensor<3>, positions: &Tensor<1, Int>) -> Result<Tensor<3>> {
        rope(&self.table, x, positions)
    }
}

/// The fused rotate-half RoPE of [`CubeRope::apply`] with the tables of a
/// [`crate::ops::RopeTable`] (the model's own table, so that the kernel and the composition
/// read the same cos/sin values).
///
/// # Shapes
/// - `x`: `[tokens, heads, head_dim]`, f32, on the device of the tables
/// - `positions`: `[tokens]`, any integer dtype
/// - output: `[tokens, heads, head_dim]`
///
/// # Errors
/// As [`CubeRope::apply`].
pub fn rope(table: &crate::ops::RopeTable, x: Tensor<3>, positions: &Tensor<1, Int>) -> Result<Tensor<3>> {
    let [t, _, d] = x.dims();
    let [p] = positions.dims();
    let (cos, sin) = table.tables();
    if d != table.head_dim() {
        return Err(Error::Incompatible(format!("rope: head_dim {d}, tables built for {}", table.head_dim())));
    }
    if p != t {
        return Err(Error::Incompatible(format!("rope: {p} positions for {t} tokens")));
    }
    check_f32("rope x", &x)?;
    check_device("rope", &x.device(), &cos.device())?;
    check_device("rope positions", &positions.device(), &cos.device())?;
    let out = <burn::backend::Dispatch as DecoKernelOps>::rope(
        x.into_dispatch(),
        cos.clone().into_dispatch(),
        sin.clone().into_dispatch(),
        positions.clone().into_dispatch(),
    );
    Ok(Tensor::from_dispatch(out))
}

/// A [`PackedMatrix`] uploaded to a device for [`CubePackedMatrix::matmul`].
///
/// `W: [rows, cols]` (`[out_features, in_features]`) stays in its GGUF blocks (Q8_0, Q4_0,
/// Q4_1, Q5_0, Q4_K or Q6_K, layouts in [`crate::quant::BlockType`], from ggml-common.h): the
/// bytes are stored as little-endian u32 words (dtype u32), zero-padded to a whole word, i.e.
/// 1.06 (Q8_0), 0.56 (Q4_0), 0.63 (Q4_1), 0.69 (Q5_0), 0.56 (Q4_K) or 0.82 (Q6_K) bytes per
/// weight on the device instead of 4.
#[derive(Debug, Clone)]
pub struct CubePackedMatrix {
    words: Tensor<1, Int>,
    ty: BlockType,
    rows: usize,
    cols: usize,
}

impl CubePackedMatrix {
    /// Most rows (output features) and most tokens one [`CubePackedMatrix::matmul`] takes (the
    /// cube-count limit of 65535 per grid dimension, 4 rows / 4 tokens per cube).
    pub const MAX_ROWS: usize = 65_535 * (if quant::ROWS < quant::TOKENS { quant::ROWS } else { quant::TOKENS }) as usize;

    /// Uploads the packed bytes of `m` to `device`.
    pub fn upload(m: &PackedMatrix, device: &Device) -> Self {
        let bytes = m.gguf_bytes();
        let words: Vec<u32> = bytes
            .chunks(4)
            .map(|c| {
                let mut w = [0u8; 4];
                w[..c.len()].copy_from_slice(c);
                u32::from_le_bytes(w)
            })
            .collect();
        let len = words.len();
        Self {
            words: Tensor::from_data(TensorData::new(words, [len]), (device, DType::U32)),
            ty: m.ty(),
            rows: m.rows(),
            cols: m.cols(),
        }
    }

    /// Block type.
    pub fn ty(&self) -> BlockType {
        self.ty
    }

    /// Rows (output features).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Row length (input features).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// `y[n, rows] = x[n, cols] · Wᵀ` with f32 activations and f32 accumulation.
    ///
    /// On a CubeCL device, a cube of 32 × 4 units computes 4 output rows for 4 tokens: each
    /// row's chunks of 32 weights (a block, or an eighth of a k-quant super-block) are split
    /// over 32 lanes, each lane decodes the f16 scales (and mins, and the 6-bit or int8
    /// sub-block scales of the k-quants) of its chunks with integer operations, dequantizes the
    /// weights in registers (as ggml's `dequantize_row_*`) and accumulates `w · x` for its 4
    /// tokens; the 32 partial sums are then reduced in shared memory. No f32 copy of `W` is
    /// made. On Flex, the words are copied back to bytes and multiplied by
    /// [`PackedMatrix::matmul`] (a reference path: it copies the weights on every call).
    ///
    /// # Shapes
    /// - `x`: `[n, cols]`, f32, on the device of the matrix
    /// - output: `[n, rows]`
    ///
    /// # Errors
    /// [`Error::Incompatible`] for a row length other than `cols`, a dtype other than f32,
    /// another device, or more than `65535 · 4` rows or tokens (the cube-count limit).
    pub fn matmul(&self, x: Tensor<2>) -> Result<Tensor<2>> {
        let [n, c] = x.dims();
        if c != self.cols {
            return Err(Error::Incompatible(format!("quant matmul: x rows of {c} values, W has {} columns", self.cols)));
        }
        let limit = CubePackedMatrix::MAX_ROWS;
        if self.rows > limit || n > limit {
            return Err(Error::Incompatible(format!(
                "quant matmul: {} rows x {n} tokens exceeds the cube grid ({limit} each)",
                self.rows
            )));
        }
        check_f32("quant matmul x", &x)?;
        check_device("quant matmul", &x.device(), &self.words.device())?;
        let out = <burn::backend::Dispatch as DecoKernelOps>::quant_matmul(
            x.into_dispatch(),
            self.words.clone().into_dispatch(),
            self.ty,
            self.rows,
            self.cols,
        );
        Ok(Tensor::from_dispatch(out))
    }
}

/// Causal scaled-dot-product attention with grouped-query heads for a prefill (or a chunk of
/// one) whose first `past` positions are already in the key/value cache, as
/// [`crate::ops::causal_gqa_attention`]: query row `t` sits at absolute position `past + t` and
/// attends to keys `0 ..= past + t`; query head `h` uses key/value head
/// `h / (heads / kv_heads)`; scores are scaled by `1 / sqrt(head_dim)`.
///
/// On a CubeCL device this is a FlashAttention-2 forward pass (Dao 2023, Algorithm 1): a cube
/// of `32 × 8` units owns 8 query rows of one head, streams the keys and values of its group
/// through shared memory in tiles of 32 positions, and keeps a running max / sum per row (online
/// softmax), so memory is `O(tokens · heads · head_dim)`: the `[tokens, past + tokens]` score
/// matrix is never materialized. Key tiles entirely in the causal future of a cube's rows are
/// skipped. Smaller tiles are used when the device has little shared memory; if even the
/// smallest does not fit (a very large `head_dim`), the composition runs instead.
///
/// # Shapes
/// - `q`: `[tokens, heads, head_dim]`, f32 (RoPE applied)
/// - `k`, `v`: `[past + tokens, kv_heads, head_dim]`, f32, same device
/// - output: `[tokens, heads * head_dim]`
///
/// # Errors
/// [`Error::Incompatible`] if `k`/`v` do not hold `past + tokens` positions, their shapes differ,
/// `kv_heads` is zero or does not divide `heads`, `head_dim` differs, a dtype is not f32, or the
/// tensors are on different devices.
pub fn flash_attention(q: Tensor<3>, k: Tensor<3>, v: Tensor<3>, past: usize) -> Result<Tensor<2>> {
    let [t, heads, d] = q.dims();
    let [s, kv_heads, dk] = k.dims();
    if v.dims() != k.dims() {
        return Err(Error::Incompatible(format!("attention: k {:?} and v {:?} differ", k.dims(), v.dims())));
    }
    if s != past + t {
        return Err(Error::Incompatible(format!("attention: {s} cached positions for past {past} + {t} tokens")));
    }
    if kv_heads == 0 || !heads.is_multiple_of(kv_heads) || dk != d {
        return Err(Error::Incompatible(format!(
            "attention: q heads {heads} x {d}, kv heads {kv_heads} x {dk} (need kv_heads | heads, equal head_dim)"
        )));
    }
    for (what, x) in [("attention q", &q), ("attention k", &k), ("attention v", &v)] {
        check_f32(what, x)?;
    }
    check_device("attention k", &q.device(), &k.device())?;
    check_device("attention v", &q.device(), &v.device())?;
    let out =
        <burn::backend::Dispatch as DecoKernelOps>::flash_attention(q.into_dispatch(), k.into_dispatch(), v.into_dispatch(), past);
    Ok(Tensor::from_dispatch(out))
}

/// One sequence of a [`paged_decode_attention`] call: its block table and length.
#[derive(Debug, Clone, Copy)]
pub struct PagedSeq<'a> {
    /// Block of each run of `block_size` positions; at least `len.div_ceil(block_size)` entries.
    pub block_table: &'a [u32],
    /// Positions to attend to, the new token included (≥ 1).
    pub len: usize,
}

/// Decode attention for a batch of sequences, one new query token each, reading keys and values
/// through each sequence's block table (Kwon et al. 2023, "PagedAttention", §4.1), with the
/// semantics of [`crate::attention::paged_decode_attention`]: for sequence `s`, query head `h`
/// and kv head `j = h / (heads / kv_heads)`,
/// `out[s, h] = Σ_p softmax_p(q[s, h] · k[p, j] / sqrt(head_dim)) · v[p, j]`, `p = 0 .. len`,
/// where position `p` is row `p % block_size` of block `block_table[p / block_size]`.
///
/// On a CubeCL device one cube handles one (sequence, kv head) with its `heads / kv_heads`
/// query heads as the rows of a FlashAttention-2 tile (online softmax over key tiles of 16
/// positions in shared memory), so each key/value row is read once per group. The block tables
/// and lengths are uploaded as u32 per call. On Flex (or when a group of more than 32 heads
/// does not fit a cube) the CPU kernel runs on host copies.
///
/// # Shapes
/// - `q`: `[seqs.len(), heads, head_dim]`, f32 (RoPE applied)
/// - `k_cache`, `v_cache`: `[num_blocks, block_size, kv_heads, head_dim]`, f32, same device
/// - output: `[seqs.len(), heads, head_dim]`
///
/// # Errors
/// [`Error::Incompatible`] for a zero dimension, `kv_heads` not dividing `heads`, different
/// `head_dim`s or cache shapes, a sequence with `len == 0`, a block table too short for `len`,
/// a block index `≥ num_blocks`, a dtype other than f32 or tensors on different devices;
/// [`Error::Length`] if `q` does not have one row per sequence.
pub fn paged_decode_attention(q: Tensor<3>, k_cache: Tensor<4>, v_cache: Tensor<4>, seqs: &[PagedSeq<'_>]) -> Result<Tensor<3>> {
    let [b, heads, d] = q.dims();
    let [num_blocks, block_size, kv_heads, dk] = k_cache.dims();
    if b != seqs.len() {
        return Err(Error::Length { what: "paged attention q rows", expected: seqs.len(), actual: b });
    }
    if v_cache.dims() != k_cache.dims() {
        return Err(Error::Incompatible(format!("paged attention: k {:?} and v {:?} caches differ", k_cache.dims(), v_cache.dims())));
    }
    if heads == 0 || kv_heads == 0 || d == 0 || block_size == 0 || !heads.is_multiple_of(kv_heads) || dk != d {
        return Err(Error::Incompatible(format!(
            "paged attention: q heads {heads} x {d}, cache blocks of {block_size} x {kv_heads} x {dk} (need non-zero, kv_heads | heads, equal head_dim)"
        )));
    }
    let max_blocks = seqs.iter().map(|s| s.len.div_ceil(block_size)).max().unwrap_or(0).max(1);
    let mut tables = vec![0u32; seqs.len() * max_blocks];
    let mut lens = Vec::with_capacity(seqs.len());
    for (i, s) in seqs.iter().enumerate() {
        let need = s.len.div_ceil(block_size);
        if s.len == 0 || s.block_table.len() < need || s.len > u32::MAX as usize {
            return Err(Error::Incompatible(format!(
                "paged attention: sequence {i} of len {} with a block table of {} entries (block size {block_size})",
                s.len,
                s.block_table.len()
            )));
        }
        if let Some(&bad) = s.block_table[..need].iter().find(|&&blk| blk as usize >= num_blocks) {
            return Err(Error::Incompatible(format!("paged attention: sequence {i} names block {bad} of {num_blocks}")));
        }
        tables[i * max_blocks..i * max_blocks + need].copy_from_slice(&s.block_table[..need]);
        lens.push(s.len as u32);
    }
    for (what, x) in [("paged attention k", &k_cache), ("paged attention v", &v_cache)] {
        check_f32(what, x)?;
    }
    check_f32("paged attention q", &q)?;
    let device = q.device();
    check_device("paged attention k", &device, &k_cache.device())?;
    check_device("paged attention v", &device, &v_cache.device())?;
    let tables = Tensor::<2, Int>::from_data(TensorData::new(tables, [seqs.len(), max_blocks]), (&device, DType::U32));
    let lens = Tensor::<1, Int>::from_data(TensorData::new(lens, [seqs.len()]), (&device, DType::U32));
    let out = <burn::backend::Dispatch as DecoKernelOps>::paged_decode_attention(
        q.into_dispatch(),
        k_cache.into_dispatch(),
        v_cache.into_dispatch(),
        tables.into_dispatch(),
        lens.into_dispatch(),
    );
    Ok(Tensor::from_dispatch(out))
}
