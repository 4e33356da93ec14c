#!/usr/bin/env python3
"""A GGUF file's shape clone: the same header (metadata, tokenizer, tensor names, shapes, block
types and offsets) with random weights, for the device check of `cargo xtask device-check`.

The device machine cannot fetch the models and takes at most 64 MiB of files per call, so the
real files (98 MB, 1.1 GB) cannot travel; their headers (a few MB, the tokenizer included) can.
Speed, memory traffic and the agreement of the GPU and CPU paths on one model do not depend on
the weights' values; fidelity to the real weights is checked on the CPU by the golden tests.

  gguf_shape_clone.py header REAL.gguf OUT.header   # here: the bytes before the tensor data
  gguf_shape_clone.py fill OUT.header OUT.gguf      # there: header + random valid blocks

Random blocks: every byte uniform (quants, packed sub-block scales, high bits), then each f16
scale / min field set to a small power of two (2^-10 .. 2^-7), as in
crates/deco-model/tests/wgpu.rs; F32/F16 norms are 1, other F32/F16 tensors N(0, 0.02).
Needs numpy (fill only).
"""
import struct
import sys

# ggml type id -> (name, block bytes, weights per block, f16 field offsets)
TYPES = {
    0: ("F32", 4, 1, ()),
    1: ("F16", 2, 1, ()),
    2: ("Q4_0", 18, 32, (0,)),
    3: ("Q4_1", 20, 32, (0, 2)),
    6: ("Q5_0", 22, 32, (0,)),
    7: ("Q5_1", 24, 32, (0, 2)),
    8: ("Q8_0", 34, 32, (0,)),
    12: ("Q4_K", 144, 256, (0, 2)),
    13: ("Q5_K", 176, 256, (0, 2)),
    14: ("Q6_K", 210, 256, (208,)),
}

# Metadata value types: fixed sizes; 8 = string, 9 = array.
FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


class Reader:
    def __init__(self, buf):
        self.buf = buf
        self.pos = 0

    def take(self, fmt):
        v = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return v[0]

    def string(self):
        n = self.take("Q")
        s = self.buf[self.pos:self.pos + n].decode("utf-8", "replace")
        self.pos += n
        return s

    def value(self, ty):
        if ty in FIXED:
            v = self.buf[self.pos:self.pos + FIXED[ty]]
            self.pos += FIXED[ty]
            return v
        if ty == 8:
            return self.string()
        if ty == 9:
            et = self.take("I")
            n = self.take("Q")
            return [self.value(et) for _ in range(n)]
        raise SystemExit(f"unknown GGUF metadata type {ty}")


def parse(buf):
    """(tensors [(name, dims, type, offset)], data start, alignment)."""
    r = Reader(buf)
    if buf[:4] != b"GGUF":
        raise SystemExit("not a GGUF file")
    r.pos = 4
    version = r.take("I")
    if version != 3:
        raise SystemExit(f"GGUF version {version}, expected 3")
    n_tensors = r.take("Q")
    n_kv = r.take("Q")
    alignment = 32
    for _ in range(n_kv):
        key = r.string()
        ty = r.take("I")
        v = r.value(ty)
        if key == "general.alignment":
            alignment = struct.unpack("<I", v)[0]
    tensors = []
    for _ in range(n_tensors):
        name = r.string()
        nd = r.take("I")
        dims = [r.take("Q") for _ in range(nd)]
        ty = r.take("I")
        off = r.take("Q")
        tensors.append((name, dims, ty, off))
    start = (r.pos + alignment - 1) // alignment * alignment
    return tensors, start, alignment


def nbytes(dims, ty):
    if ty not in TYPES:
        raise SystemExit(f"ggml type {ty} has no shape-clone filler")
    _, bb, bl, _ = TYPES[ty]
    n = 1
    for d in dims:
        n *= d
    return n // bl * bb


def header(src, out):
    with open(src, "rb") as f:
        head = f.read(64 << 20)
    tensors, start, _ = parse(head)
    for name, dims, ty, _ in tensors:
        nbytes(dims, ty)  # every type must be fillable there
    with open(out, "wb") as f:
        f.write(head[:start])
    print(f"{out}: {start} header bytes, {len(tensors)} tensors")


def fill(src, out):
    import numpy as np

    with open(src, "rb") as f:
        head = f.read()
    tensors, start, alignment = parse(head)
    if start != len(head):
        raise SystemExit(f"{src}: {len(head)} bytes, the header ends at {start}")
    rng = np.random.default_rng(0)
    scales = np.array([0x1400, 0x1800, 0x1C00, 0x2000], dtype="<u2")  # 2^-10 .. 2^-7
    tensors = sorted(tensors, key=lambda t: t[3])
    with open(out + ".tmp", "wb") as f:
        f.write(head)
        pos = 0
        for name, dims, ty, off in tensors:
            if off < pos:
                raise SystemExit(f"{name}: overlapping tensor data")
            f.write(b"\0" * (off - pos))
            tname, bb, bl, f16s = TYPES[ty]
            n = nbytes(dims, ty)
            count = n // bb
            if tname in ("F32", "F16"):
                dt = "<f4" if tname == "F32" else "<f2"
                if name.endswith("norm.weight"):
                    a = np.ones(count, dtype=dt)
                else:
                    a = (rng.standard_normal(count) * 0.02).astype(dt)
                f.write(a.tobytes())
            else:
                a = np.frombuffer(rng.bytes(n), dtype=np.uint8).reshape(count, bb).copy()
                for o in f16s:
                    a[:, o:o + 2] = rng.choice(scales, count).view(np.uint8).reshape(count, 2)
                f.write(a.tobytes())
            pos = off + n
            pad = (-pos) % alignment
            f.write(b"\0" * pad)
            pos += pad
    import os

    os.replace(out + ".tmp", out)
    print(f"{out}: {start + pos} bytes, {len(tensors)} tensors of random weights")


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("header", "fill"):
        raise SystemExit(__doc__)
    (header if sys.argv[1] == "header" else fill)(sys.argv[2], sys.argv[3])
