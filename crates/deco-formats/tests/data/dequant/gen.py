#!/usr/bin/env python3
"""Generate the reference vectors for crates/deco-formats/tests/dequant.rs.

Independent reference: llama.cpp's gguf-py (`pip install gguf numpy`, written with gguf 0.19.0,
numpy 2.4), whose `gguf.quants.dequantize` / `gguf.quants.quantize` are numpy re-implementations
of ggml-quants.c. Types gguf-py cannot dequantize (F64, Q8_K) get a plain numpy reference here.

Run from anywhere:  python3 gen.py [path/to/SmolLM2-135M-Instruct.Q4_1.gguf]
Output (next to this script):
  <TYPE>.bin   raw block bytes (a few blocks)
  <TYPE>.f32   expected dequantized values, little-endian f32
  quant_<TYPE>.in.f32 / quant_<TYPE>.bytes   quantizer input and expected gguf-py output
  model_<tensor>.bin / .f32   first 4 blocks of a real SmolLM2 tensor and their dequantization
  model.json   the gguf-py type table, tensor offsets in the model file plus whole-tensor statistics of the dequantization
"""

import importlib.metadata
import json
import os
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES

HERE = os.path.dirname(os.path.abspath(__file__))
rng = np.random.default_rng(20240611)


def write(name: str, arr: np.ndarray) -> None:
    with open(os.path.join(HERE, name), "wb") as f:
        f.write(np.ascontiguousarray(arr).tobytes())


def finite_f16(n: int) -> np.ndarray:
    """n finite f16 scale values: mostly normal magnitudes, a subnormal, a negative, a zero."""
    v = (rng.standard_normal(n) * 0.05).astype(np.float16)
    if n > 0:
        v[0] = np.float16(2.0 ** -20)  # f16 subnormal
    if n > 1:
        v[1] = np.float16(-0.0123)
    if n > 2:
        v[2] = np.float16(0.0)
    if n > 3:
        v[3] = np.float16(1024.0)  # large scale
    return v


# byte offsets of the f16 scale fields inside one block (ggml-common.h struct layouts)
F16_FIELDS = {
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q8_0: [0],
    T.Q2_K: [80, 82],  # scales[16], qs[64], d, dmin
    T.Q3_K: [108],  # hmask[32], qs[64], scales[12], d
    T.Q4_K: [0, 2],  # d, dmin, scales[12], qs[128]
    T.Q5_K: [0, 2],  # d, dmin, scales[12], qh[32], qs[128]
    T.Q6_K: [208],  # ql[128], qh[64], scales[16], d
}

N_BLOCKS = {T.Q4_0: 64, T.Q4_1: 64, T.Q5_0: 64, T.Q5_1: 64, T.Q8_0: 64,
            T.Q2_K: 8, T.Q3_K: 8, T.Q4_K: 8, T.Q5_K: 8, T.Q6_K: 8}


def random_blocks(qt: T) -> np.ndarray:
    bs, ts = GGML_QUANT_SIZES[qt]
    n = N_BLOCKS[qt]
    blocks = rng.integers(0, 256, size=(n, ts), dtype=np.uint8)
    for off in F16_FIELDS[qt]:
        blocks[:, off:off + 2] = finite_f16(n).view(np.uint8).reshape(n, 2)
    return blocks


def main() -> None:
    manifest = {"gguf_version": importlib.metadata.version("gguf"), "numpy_version": np.__version__}

    # --- the type table (ids, elements per block, bytes per block) as gguf-py knows it
    manifest["types"] = [[qt.name, int(qt), *GGML_QUANT_SIZES[qt]] for qt in T]

    # --- block quant types: random bytes with finite f16 scales, gguf-py dequantization
    for qt in F16_FIELDS:
        blocks = random_blocks(qt)
        expected = gguf.quants.dequantize(blocks, qt).astype(np.float32).reshape(-1)
        assert np.all(np.isfinite(expected)), qt.name
        write(f"{qt.name}.bin", blocks)
        write(f"{qt.name}.f32", expected.astype("<f4"))

    # --- F32: identity
    f32 = (rng.standard_normal(256) * 10).astype("<f4")
    f32[:4] = [0.0, -0.0, np.inf, -np.inf]
    write("F32.bin", f32)
    write("F32.f32", gguf.quants.dequantize(f32.view(np.uint8), T.F32).astype("<f4"))

    # --- F16: random finite values plus specials (subnormals, +-0, +-inf, max)
    f16 = rng.integers(0, 0x10000, size=512, dtype=np.uint16)
    f16 = np.where((f16 & 0x7C00) == 0x7C00, f16 & 0x83FF, f16).astype(np.uint16)  # drop inf/NaN
    f16[:8] = [0x0000, 0x8000, 0x0001, 0x83FF, 0x7C00, 0xFC00, 0x7BFF, 0x3C00]
    write("F16.bin", f16.astype("<u2"))
    write("F16.f32", gguf.quants.dequantize(f16.astype("<u2").view(np.uint8), T.F16).astype("<f4"))

    # --- BF16: random bit patterns except NaN
    bf = rng.integers(0, 0x10000, size=512, dtype=np.uint16)
    bf = np.where(((bf & 0x7F80) == 0x7F80) & ((bf & 0x7F) != 0), bf & 0xFF7F, bf).astype(np.uint16)
    bf[:4] = [0x0000, 0x8000, 0x7F80, 0x0001]
    write("BF16.bin", bf.astype("<u2"))
    write("BF16.f32", gguf.quants.dequantize(bf.astype("<u2").view(np.uint8), T.BF16).astype("<f4"))

    # --- F64 (gguf-py has no dequantizer): numpy cast to f32, round to nearest even
    f64 = (rng.standard_normal(128) * 1e3).astype("<f8")
    f64[:3] = [1.0 + 2.0 ** -30, 1e300, -1e-300]  # rounding, overflow to inf, underflow to -0
    write("F64.bin", f64)
    with np.errstate(over="ignore"):
        write("F64.f32", f64.astype("<f4"))

    # --- Q8_K (gguf-py has no dequantizer): block {f32 d; i8 qs[256]; i16 bsums[16]}, y = d*q
    n = 4
    d = (rng.standard_normal(n) * 0.01).astype("<f4")
    qs = rng.integers(-128, 128, size=(n, 256)).astype(np.int8)
    bsums = qs.reshape(n, 16, 16).astype(np.int16).sum(axis=-1).astype("<i2")
    q8k = np.concatenate([d.view(np.uint8).reshape(n, 4), qs.view(np.uint8), bsums.view(np.uint8).reshape(n, 32)], axis=1)
    assert q8k.shape == (n, 292)
    write("Q8_K.bin", q8k)
    write("Q8_K.f32", (d.reshape(n, 1) * qs.astype(np.float32)).astype("<f4").reshape(-1))

    # --- quantizers: gguf-py quantize (bit-exact with ggml's quantize_row_*_ref)
    for qt in (T.Q8_0, T.Q4_0, T.Q4_1):
        nb = 16
        scales = np.exp(rng.uniform(-8, 4, size=(nb, 1)))
        x = (rng.standard_normal((nb, 32)) * scales).astype(np.float32)
        x[0] = 0.0  # all-zero block: d = 0 path
        x[1] = 1.5  # constant block (Q4_1: max == min)
        x[2] = np.arange(-16, 16, dtype=np.float32) + 0.5  # rounding ties
        x[2, 0] = 127.0 if qt == T.Q8_0 else -8.0
        x[3] = -x[3]
        x[4, 7] = 1e4  # one outlier
        q = gguf.quants.quantize(x, qt)
        # round trip through gguf-py must agree with its dequantizer (sanity of the vectors)
        assert q.shape == (nb, GGML_QUANT_SIZES[qt][1])
        write(f"quant_{qt.name}.in.f32", x.astype("<f4").reshape(-1))
        write(f"quant_{qt.name}.bytes", q.reshape(-1))

    # --- real model: first 4 blocks of two tensors + whole-tensor statistics
    model = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "../../../../../../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    reader = gguf.GGUFReader(model)
    tensors = {}
    for t in reader.tensors:
        if t.name not in ("blk.0.attn_q.weight", "token_embd.weight"):
            continue
        qt = T(t.tensor_type)
        bs, ts = GGML_QUANT_SIZES[qt]
        raw = np.asarray(t.data).reshape(-1).view(np.uint8)
        with open(model, "rb") as f:
            f.seek(int(t.data_offset))
            assert f.read(64) == raw[:64].tobytes(), "data_offset is not an absolute file offset"
        n_el = int(np.prod(t.shape))
        full = gguf.quants.dequantize(raw, qt).reshape(-1).astype(np.float64)
        assert full.size == n_el
        head = raw[:4 * ts]
        stem = "model_" + t.name.replace(".", "_")
        write(stem + ".bin", head)
        write(stem + ".f32", gguf.quants.dequantize(head, qt).astype("<f4").reshape(-1))
        idx = np.sort(rng.choice(n_el, size=64, replace=False))
        tensors[t.name] = {
            "type": qt.name,
            "offset": int(t.data_offset),
            "n_elements": n_el,
            "n_bytes": int(t.n_bytes),
            "head_blocks": 4,
            "stem": stem,
            "sum": float(full.sum()),
            "sum_sq": float((full * full).sum()),
            "max_abs": float(np.abs(full).max()),
            "sample_index": [int(i) for i in idx],
            "sample_value": [float(np.float32(full[i])) for i in idx],
        }
    manifest["model_file"] = os.path.basename(model)
    manifest["model_size"] = os.path.getsize(model)
    manifest["tensors"] = tensors
    with open(os.path.join(HERE, "model.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
