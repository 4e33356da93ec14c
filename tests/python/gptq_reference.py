"""deco's GPTQ against an independent numpy (float64) port of IST-DASLab/gptq `fasterquant` and
`Quantizer.find_params` (incl. `mse=True`), on a real weight of the SmolLM2 GGUF (dequantized by
llama.cpp's gguf-py) and a Hessian of correlated inputs with a few large channels.

    pip install numpy gguf
    cargo build --release -p deco-quant --example gptq_raw
    python3 tests/python/gptq_reference.py MODEL.gguf TARGET_DIR/release/examples/gptq_raw

Prints, per configuration, the share of weights where both give the same value, and the
relative output error tr(D H D^T) / tr(W H W^T) of each (D = W - Q).
"""
import subprocess
import sys
import tempfile

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def find_params(x, bits, sym, mse, norm=2.4, grid=100, maxshrink=0.8):
    """Quantizer.find_params(weight=True, perchannel=True) on rows of x, float64."""
    maxq = 2**bits - 1
    xmin = np.minimum(x.min(1), 0)
    xmax = np.maximum(x.max(1), 0)
    if sym:
        xmax = np.maximum(np.abs(xmin), xmax)
        neg = xmin < 0
        xmin[neg] = -xmax[neg]
    zz = (xmin == 0) & (xmax == 0)
    xmin[zz], xmax[zz] = -1, 1
    scale = (xmax - xmin) / maxq
    zero = np.full_like(scale, (maxq + 1) / 2) if sym else np.round(-xmin / scale)
    scale = scale.astype(np.float32).astype(np.float64)
    if mse:
        best = np.full(x.shape[0], np.inf)
        for i in range(int(maxshrink * grid)):
            p = 1 - i / grid
            xmin1, xmax1 = p * xmin, p * xmax
            scale1 = ((xmax1 - xmin1) / maxq).astype(np.float32).astype(np.float64)
            zero1 = np.clip(np.round(-xmin1 / scale1), 0, maxq) if not sym else zero
            q = quantize(x, scale1[:, None], zero1[:, None], maxq)
            err = (np.abs(q - x) ** norm).sum(1)
            t = err < best
            best[t], scale[t], zero[t] = err[t], scale1[t], zero1[t]
    return scale[:, None], zero[:, None]


def quantize(x, scale, zero, maxq):
    q = np.clip(np.round(x / scale) + zero, 0, maxq)
    return (scale * (q - zero)).astype(np.float32).astype(np.float64)


def fasterquant(W, H, bits, groupsize, actorder, sym, mse, blocksize=128, percdamp=0.01):
    W = W.astype(np.float64).copy()
    H = H.copy()
    cols = W.shape[1]
    maxq = 2**bits - 1
    dead = np.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    if actorder:
        perm = np.argsort(-np.diag(H), kind="stable")
        W, H = W[:, perm], H[perm][:, perm]
    H[np.diag_indices(cols)] += percdamp * np.mean(np.diag(H))
    Hinv = np.linalg.cholesky(np.linalg.inv(H)).T  # upper U with U^T U = H^-1
    scale, zero = find_params(W, bits, sym, mse)
    Q = np.zeros_like(W)
    for i1 in range(0, cols, blocksize):
        i2 = min(i1 + blocksize, cols)
        W1, Err1, Hinv1 = W[:, i1:i2].copy(), np.zeros((W.shape[0], i2 - i1)), Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            if groupsize > 0 and (i1 + i) % groupsize == 0:
                scale, zero = find_params(W[:, i1 + i:i1 + i + groupsize], bits, sym, mse)
            w, d = W1[:, i], Hinv1[i, i]
            q = quantize(w[:, None], scale, zero, maxq).flatten()
            Q[:, i1 + i] = q
            e = (w - q) / d
            W1[:, i:] -= np.outer(e, Hinv1[i, i:])
            Err1[:, i] = e
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    if actorder:
        Q = Q[:, np.argsort(perm)]
    return Q


def main():
    model, exe = sys.argv[1], sys.argv[2]
    r = GGUFReader(model)
    t = next(t for t in r.tensors if t.name == "blk.5.ffn_down.weight")
    W = dequantize(t.data, t.tensor_type).reshape(int(t.shape[1]), int(t.shape[0])).astype(np.float32)
    rows, cols = W.shape
    rng = np.random.default_rng(0)
    n = 4096
    X = rng.standard_normal((n, cols)) @ (rng.standard_normal((cols, cols)) / np.sqrt(cols)) + 0.3 * rng.standard_normal((n, cols))
    X[:, :8] *= 20.0  # a few large channels, as real activations have
    H = 2 * X.T @ X / n
    tmp = tempfile.mkdtemp()
    W.tofile(f"{tmp}/w.f32")
    H.astype("<f8").tofile(f"{tmp}/h.f64")
    tr = lambda D: float(np.einsum("ij,jk,ik->", D, H, D))
    base = tr(W.astype(np.float64))
    for bits, group, actorder, mse, sym in [(4, 128, 1, 0, 0), (4, 128, 1, 2.4, 0), (4, 128, 0, 0, 1), (3, 128, 1, 2.4, 0)]:
        subprocess.run([exe, f"{tmp}/w.f32", f"{tmp}/h.f64", str(rows), str(cols), str(bits), str(group), str(actorder), str(mse), str(sym), f"{tmp}/q.f32"], check=True)
        qd = np.fromfile(f"{tmp}/q.f32", dtype="<f4").reshape(rows, cols).astype(np.float64)
        qr = fasterquant(W, H, bits, group, bool(actorder), bool(sym), mse > 0)
        same = float(np.mean(np.abs(qd - qr) <= 1e-6 * np.abs(qr).max()))
        ed, er = tr(W - qd) / base, tr(W - qr) / base
        print(f"bits={bits} group={group} desc_act={actorder} mse={mse} sym={sym}: same value {same:.4%}, "
              f"rel. output error deco {ed:.6f} reference {er:.6f} ({(ed / er - 1):+.3%})")


if __name__ == "__main__":
    main()
