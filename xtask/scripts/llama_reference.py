#!/usr/bin/env python3
"""Independent references for deco's tests, rebuilt from the llama-cpp-python sdist when the
local mirror `../shared` is absent (used by `cargo xtask fetch`; see docs/data.md).

Nothing here shares code with deco: tokenization is llama.cpp's own (libllama built from the
sdist's vendored sources, driven by xtask/scripts/llama_tokenize.cpp), dequantization is
llama.cpp's gguf-py (from the same sdist), and the forward pass is a float64 numpy transcription
of llama.cpp's Llama graph (RMSNorm, adjacent-pair RoPE on GGUF's permuted Q/K, GQA, SwiGLU,
tied output embedding).

Subcommands:

  build   --sdist TARGZ --work DIR
          unpack vendor/llama.cpp, build the static libllama with cmake + ninja (from the
          venv's `cmake` and `ninja` packages) and link the tokenizer tool; prints its path.
          Reuses DIR when it already holds the tool.
  bench-build --sdist TARGZ --work DIR --isa {avx2,native}
          unpack vendor/llama.cpp and build llama.cpp's own `llama-bench` with cmake + ninja,
          the way llama.cpp users build it (OpenMP as the compiler offers it), into
          DIR/llama-bench-ISA/: `native` is llama.cpp's default (-march=native: AVX-512 where
          the CPU has it), `avx2` is GGML_NATIVE=OFF (SSE4.2, AVX, AVX2, BMI2, FMA, F16C; no
          AVX-512). Prints the binary's path; reuses it when it is there.
  cases   --tool T --model GGUF --texts JSON --out DIR
          tokenizer-tests/smollm2-cases.json: each text with and without special-token parsing.
  golden  --tool T --model GGUF --gguf-py DIR --wiki TXT --out DIR
          golden/smollm2-135m-instruct.{json,safetensors}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SDIST_ROOT = "llama_cpp_python-0.3.36/vendor/llama.cpp"

# --------------------------------------------------------------------------------------------
# build


def unpack_llama_cpp(sdist: str, work: Path) -> Path:
    """Unpacks the sdist's vendored llama.cpp into `work/src` (once) and returns that path."""
    work.mkdir(parents=True, exist_ok=True)
    src = work / "src"
    if not (src / "CMakeLists.txt").is_file():
        tmp = Path(tempfile.mkdtemp(dir=work))
        with tarfile.open(sdist, "r:gz") as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(SDIST_ROOT + "/")
                       and not m.name.startswith((SDIST_ROOT + "/models/", SDIST_ROOT + "/tools/ui/"))
                       and m.name != SDIST_ROOT + "/.git"]  # a submodule link to a repository we lack
            tar.extractall(tmp, members=members, filter="data")
        if src.exists():
            shutil.rmtree(src)
        os.replace(tmp / SDIST_ROOT, src)
        shutil.rmtree(tmp, ignore_errors=True)
    return src


def cmake_build(src: Path, build: Path, target: str, with_tools: bool) -> None:
    """Configures llama.cpp in `build` with the venv's cmake + ninja (static, portable code: no
    -march=native, no OpenMP, no curl / OpenSSL; common/ and tools/ only `with_tools`) and
    builds `target`."""
    bindir = Path(sys.executable).parent
    cmake, ninja = bindir / "cmake", bindir / "ninja"
    on = "ON" if with_tools else "OFF"
    subprocess.run([str(cmake), "-S", str(src), "-B", str(build), "-G", "Ninja",
                    f"-DCMAKE_MAKE_PROGRAM={ninja}", "-DCMAKE_BUILD_TYPE=Release",
                    "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=OFF", "-DGGML_OPENMP=OFF",
                    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", f"-DLLAMA_BUILD_COMMON={on}",
                    f"-DLLAMA_BUILD_TOOLS={on}", "-DLLAMA_BUILD_EXAMPLES=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF"],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run([str(cmake), "--build", str(build), "--target", target, "-j", str(os.cpu_count() or 2)],
                   check=True, stdout=subprocess.DEVNULL if with_tools else None)


def cmd_build(args: argparse.Namespace) -> None:
    work = Path(args.work)
    tool = work / "llama_tokenize"
    source = HERE / "llama_tokenize.cpp"
    stamp = work / "tool.source"
    if tool.is_file() and stamp.is_file() and stamp.read_bytes() == source.read_bytes():
        print(tool)
        return
    src = unpack_llama_cpp(args.sdist, work)
    build = work / "build"
    # Only the library: no common/, tools, tests or server.
    cmake_build(src, build, "llama", with_tools=False)
    libs = [build / "src/libllama.a", build / "ggml/src/libggml.a",
            build / "ggml/src/libggml-cpu.a", build / "ggml/src/libggml-base.a"]
    for lib in libs:
        if not lib.is_file():
            sys.exit(f"error: the llama.cpp build did not produce {lib}")
    tmp_tool = tool.with_name(tool.name + ".part")
    subprocess.run(["c++", "-O2", "-std=c++17", "-I", str(src / "include"), "-I", str(src / "ggml/include"),
                    str(source), "-o", str(tmp_tool), *map(str, libs), "-lpthread", "-ldl", "-lm"],
                   check=True)
    os.replace(tmp_tool, tool)
    stamp.write_bytes(source.read_bytes())
    print(tool)


def cmd_bench_build(args: argparse.Namespace) -> None:
    work = Path(args.work)
    out = work / f"llama-bench-{args.isa}"
    binary = out / "bin" / "llama-bench"
    native = "ON" if args.isa == "native" else "OFF"
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", f"-DGGML_NATIVE={native}",
             "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_COMMON=ON",
             "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TESTS=OFF",
             "-DLLAMA_BUILD_SERVER=OFF"]
    if native == "ON" and os.environ.get("DECO_LLAMA_NO_AMX") == "1":
        # ggml's AMX matmul (compiled in by -march=native on CPUs with AMX) dies with SIGSEGV in
        # ggml_backend_amx_mul_mat on some VMs (seen on a 2-core Sapphire Rapids guest,
        # 2026-12-06); explicit -mno-amx-* override -march=native's AMX in GCC. Say so when
        # quoting figures from such a build.
        amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        flags += [f"-DCMAKE_C_FLAGS={amx}", f"-DCMAKE_CXX_FLAGS={amx}"]
    # Written after a complete build only, with the flags it was configured with.
    stamp = out / "llama-bench.built"
    if binary.is_file() and stamp.is_file() and stamp.read_text() == "\n".join(flags) + "\n":
        print(binary)
        return
    src = unpack_llama_cpp(args.sdist, work)
    bindir = Path(sys.executable).parent
    cmake, ninja = bindir / "cmake", bindir / "ninja"
    subprocess.run([str(cmake), "-S", str(src), "-B", str(out), "-G", "Ninja",
                    f"-DCMAKE_MAKE_PROGRAM={ninja}", *flags],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run([str(cmake), "--build", str(out), "--target", "llama-bench", "-j", str(os.cpu_count() or 2)],
                   check=True, stdout=subprocess.DEVNULL)
    if not binary.is_file():
        sys.exit(f"error: the llama.cpp build did not produce {binary}")
    stamp.write_text("\n".join(flags) + "\n")
    print(binary)


# --------------------------------------------------------------------------------------------
# tokenization through the tool


def tokenize(tool: str, model: str, texts: list[str]) -> list[tuple[list[int], list[int]]]:
    """(ids without special-token parsing, ids with it) per text, no BOS, by llama.cpp."""
    with tempfile.TemporaryDirectory() as d:
        cases, out = Path(d) / "cases", Path(d) / "out"
        with open(cases, "wb") as f:
            for t in texts:
                b = t.encode("utf-8")
                f.write(b"%d\n" % len(b) + b + b"\n")
        subprocess.run([tool, model, str(cases), str(out)], check=True)
        lines = out.read_text().split("\n")
    if len(lines) != 2 * len(texts) + 1 or lines[-1] != "":
        sys.exit(f"error: {tool} wrote {len(lines) - 1} lines for {len(texts)} texts")
    ids = [[int(x) for x in line.split()] for line in lines[:-1]]
    return [(ids[2 * i], ids[2 * i + 1]) for i in range(len(texts))]


def write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def cmd_cases(args: argparse.Namespace) -> None:
    texts = json.loads(Path(args.texts).read_text(encoding="utf-8"))
    rows = [{"text": t, "ids_no_special": a, "ids_parse_special": b}
            for t, (a, b) in zip(texts, tokenize(args.tool, args.model, texts))]
    out = Path(args.out) / "tokenizer-tests" / "smollm2-cases.json"
    write_atomic(out, json.dumps(rows, indent=0, ensure_ascii=False).encode("utf-8"))
    print(f"cases: {len(rows)} texts -> {out}")


# --------------------------------------------------------------------------------------------
# golden: float64 forward

PROMPTS = [  # (text, greedy steps, all positions wanted)
    ("The capital of France is", 24, True),
    ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
     "<|im_start|>user\nWhat is the largest planet in the solar system?<|im_end|>\n<|im_start|>assistant\n", 24, False),
    ("Once upon a time, there was a little robot named Bolt who", 24, False),
    ('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n', 24, False),
    ("To be, or not to be, that is the question:", 16, False),
]
PPL_CHARS, PPL_SEQLEN, PPL_WINDOWS = 20000, 256, 4


def byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's `bytes_to_unicode` (openai/gpt-2 src/encoder.py): byte-level BPE
    token text -> bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class Model:
    """SmolLM2 (llama arch) in float64 on gguf-py-dequantized weights, llama.cpp semantics."""

    def __init__(self, path: str):
        import numpy as np
        from gguf import GGUFReader
        from gguf.quants import dequantize

        self.np = np
        r = GGUFReader(path)

        def field(name):
            f = r.fields[name]
            return f.contents()

        arch = field("general.architecture")
        if arch != "llama":
            sys.exit(f"error: {path}: architecture {arch!r}, this reference implements llama")
        self.n_layer = int(field("llama.block_count"))
        self.n_head = int(field("llama.attention.head_count"))
        self.n_kv = int(field("llama.attention.head_count_kv"))
        self.eps = float(field("llama.attention.layer_norm_rms_epsilon"))
        self.base = float(field("llama.rope.freq_base"))
        self.vocab = [str(t) for t in field("tokenizer.ggml.tokens")]
        self.w = {}
        for t in r.tensors:
            shape = [int(x) for x in reversed(t.shape)]  # numpy order: [ne1, ne0]
            self.w[t.name] = dequantize(t.data, t.tensor_type).astype(np.float64).reshape(shape)
        self.dim = self.w["token_embd.weight"].shape[1]
        self.head_dim = self.dim // self.n_head
        half = self.head_dim // 2
        self.inv_freq = self.base ** (-np.arange(half, dtype=np.float64) * 2.0 / self.head_dim)
        self.output = self.w.get("output.weight", self.w["token_embd.weight"])

    def rms(self, x, w):
        np = self.np
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * w

    def rope(self, x, pos):
        """llama.cpp's normal RoPE: rotates adjacent pairs (x[2i], x[2i+1]) by pos * theta_i.
        x: [T, heads, head_dim]; pos: [T]."""
        np = self.np
        ang = pos[:, None].astype(np.float64) * self.inv_freq[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * c - x1 * s
        out[..., 1::2] = x0 * s + x1 * c
        return out

    def forward(self, ids, cache):
        """Logits [T, vocab] of the new tokens `ids`; `cache` (list of (K, V) per layer, each
        [past, kv_heads, head_dim]) is extended in place."""
        np = self.np
        T, H, KV, D = len(ids), self.n_head, self.n_kv, self.head_dim
        past = cache[0][0].shape[0] if cache else 0
        pos = np.arange(past, past + T)
        x = self.w["token_embd.weight"][np.asarray(ids)]
        for i in range(self.n_layer):
            p = f"blk.{i}."
            h = self.rms(x, self.w[p + "attn_norm.weight"])
            q = (h @ self.w[p + "attn_q.weight"].T).reshape(T, H, D)
            k = (h @ self.w[p + "attn_k.weight"].T).reshape(T, KV, D)
            v = (h @ self.w[p + "attn_v.weight"].T).reshape(T, KV, D)
            q, k = self.rope(q, pos), self.rope(k, pos)
            if len(cache) <= i:
                cache.append((k, v))
            else:
                cache[i] = (np.concatenate([cache[i][0], k]), np.concatenate([cache[i][1], v]))
            K, V = cache[i]
            S = K.shape[0]
            rep = H // KV  # query head h reads kv head h // rep
            Kr, Vr = np.repeat(K, rep, axis=1), np.repeat(V, rep, axis=1)
            s = np.einsum("thd,shd->hts", q, Kr) / np.sqrt(D)
            mask = np.arange(S)[None, :] > pos[:, None]
            s = np.where(mask[None], -np.inf, s)
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            a = np.einsum("hts,shd->thd", s, Vr).reshape(T, H * D)
            x = x + a @ self.w[p + "attn_output.weight"].T
            h = self.rms(x, self.w[p + "ffn_norm.weight"])
            g = h @ self.w[p + "ffn_gate.weight"].T
            u = h @ self.w[p + "ffn_up.weight"].T
            x = x + (g / (1.0 + np.exp(-g)) * u) @ self.w[p + "ffn_down.weight"].T
        return self.rms(x, self.w["output_norm.weight"]) @ self.output.T


def cmd_golden(args: argparse.Namespace) -> None:
    sys.path.insert(0, args.gguf_py)
    import numpy as np

    model = Model(args.model)
    dec = byte_decoder()

    def piece(t: int) -> bytes:
        text = model.vocab[t]
        if all(ch in dec for ch in text):
            return bytes(dec[ch] for ch in text)
        return text.encode("utf-8")  # special tokens are stored as plain text

    wiki = Path(args.wiki).read_text(encoding="utf-8")[:PPL_CHARS]
    toks = tokenize(args.tool, args.model, [p[0] for p in PROMPTS] + [wiki])
    tensors = {}
    prompts = []
    for i, ((text, steps, all_pos), (_, ids)) in enumerate(zip(PROMPTS, toks)):
        cache: list = []
        logits = model.forward(ids, cache)
        last = logits[-1]
        if all_pos:
            tensors[f"prompt{i}.all_logits"] = logits.astype(np.float32)
        tensors[f"prompt{i}.last_logits"] = last.astype(np.float32)
        top = np.argsort(-last, kind="stable")[:10]
        cont, margins, row = [], [], last
        for _ in range(steps):
            order = np.argsort(-row, kind="stable")
            t = int(order[0])
            cont.append(t)
            margins.append(round(float(row[order[0]] - row[order[1]]), 5))
            row = model.forward([t], cache)[-1]
        prompts.append({
            "index": i,
            "text": text,
            "ids": ids,
            "greedy_continuation_ids": cont,
            "top10": [[int(t), model.vocab[t], float(last[t])] for t in top],
            "has_all_positions": all_pos,
            "greedy_continuation_text": b"".join(piece(t) for t in cont).decode("utf-8", errors="replace"),
            "greedy_top1_minus_top2_margins": margins,
            "greedy_continuation_token_texts": [piece(t).decode("utf-8", errors="replace") for t in cont],
        })
        print(f"golden: prompt {i}: {len(ids)} tokens, {steps} greedy steps", flush=True)

    wiki_ids = toks[-1][1]
    nll, scored = 0.0, 0
    for w in range(PPL_WINDOWS):
        win = wiki_ids[w * PPL_SEQLEN:(w + 1) * PPL_SEQLEN]
        if len(win) < PPL_SEQLEN:
            sys.exit(f"error: {args.wiki}: fewer than {PPL_WINDOWS} windows of {PPL_SEQLEN} tokens")
        lg = model.forward(win, [])[:-1]
        m = lg.max(-1, keepdims=True)
        lse = (m[:, 0] + np.log(np.exp(lg - m).sum(-1)))
        nll += float((lse - lg[np.arange(len(win) - 1), win[1:]]).sum())
        scored += len(win) - 1
    ppl = float(np.exp(nll / scored))
    print(f"golden: perplexity {ppl:.6f} over {scored} tokens", flush=True)

    doc = {
        "model": Path(args.model).name,
        "arch": "llama",
        "dtype_of_reference": "float64 forward on gguf-py dequantized weights",
        "prompts": prompts,
        "perplexity": {
            "text_file": Path(args.wiki).name,
            "chars_used": PPL_CHARS,
            "seqlen": PPL_SEQLEN,
            "windows": PPL_WINDOWS,
            "tokens_scored": scored,
            "ppl": ppl,
            "protocol": f"tokenize first {PPL_CHARS} chars without BOS; non-overlapping windows of seqlen; each "
                        "window scored independently on its seqlen-1 next-token predictions; ppl = exp(total NLL / "
                        "tokens scored)",
        },
        "tokenization": "llama.cpp llama-tokenize, no BOS added, special tokens parsed",
        "tolerance_hint": "reference is float64; an f32 implementation on the same dequantized weights should agree "
                          "to ~1e-3 absolute on logits of magnitude ~30",
    }
    out = Path(args.out) / "golden"
    write_atomic(out / "smollm2-135m-instruct.json", json.dumps(doc, indent=1, ensure_ascii=False).encode("utf-8"))
    write_atomic(out / "smollm2-135m-instruct.safetensors", safetensors_bytes(tensors))
    print(f"golden -> {out}")


def safetensors_bytes(tensors: dict) -> bytes:
    """The safetensors layout (huggingface/safetensors README "Format"): u64 header length, JSON
    header (dtype, shape, data_offsets), then the little-endian data; f32 only."""
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        b = tensors[name].astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return len(h).to_bytes(8, "little") + h + b"".join(blobs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("build")
    s.add_argument("--sdist", required=True)
    s.add_argument("--work", required=True)
    s = sub.add_parser("bench-build")
    s.add_argument("--sdist", required=True)
    s.add_argument("--work", required=True)
    s.add_argument("--isa", required=True, choices=["avx2", "native"])
    s = sub.add_parser("cases")
    s.add_argument("--tool", required=True)
    s.add_argument("--model", required=True)
    s.add_argument("--texts", required=True)
    s.add_argument("--out", required=True)
    s = sub.add_parser("golden")
    s.add_argument("--tool", required=True)
    s.add_argument("--model", required=True)
    s.add_argument("--gguf-py", required=True)
    s.add_argument("--wiki", required=True)
    s.add_argument("--out", required=True)
    args = p.parse_args()
    {"build": cmd_build, "bench-build": cmd_bench_build, "cases": cmd_cases,
     "golden": cmd_golden}[args.cmd](args)


if __name__ == "__main__":
    main()
