#!/usr/bin/env python3
"""llama.cpp side of `cargo xtask bench generate` (via llama-cpp-python).

Loads a GGUF with n_threads = n_threads_batch = --threads, builds a prompt of exactly
--prompt-tokens tokens (llama.cpp's own tokenizer, special tokens not parsed, BOS as the model
asks) from the start of --text, then for each repeat:
  * clears the KV cache,
  * prefill: one llama_decode of the whole prompt (n_batch = n_ubatch >= prompt), timed;
  * decode: --decode-tokens greedy steps (argmax of the last logits, then a 1-token
    llama_decode), timed together; EOS is ignored.
A warm-up run (not reported) precedes the measured ones. Prints one JSON object on stdout.

`--prompt-out FILE` writes the prompt text (UTF-8), so the other engine gets the same text.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time


def build_prompt(llm, text: str, n: int) -> tuple[str, list[int]]:
    """A prefix of `text` whose tokenization is exactly n tokens (BOS included if added)."""
    with_bos = llm.tokenize(b"x", add_bos=True, special=False)
    bos = 1 if len(with_bos) > len(llm.tokenize(b"x", add_bos=False, special=False)) else 0
    toks = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
    want = n - bos
    if len(toks) < want + 32:
        sys.exit(f"error: text too short for {n} prompt tokens")
    # Detokenize a prefix and check it round-trips to the same count; move the cut a little
    # when a token boundary does not survive re-tokenization.
    for k in sorted(range(want - 16, want + 17), key=lambda k: abs(k - want)):
        s = llm.detokenize(toks[:k]).decode("utf-8", errors="ignore")
        ids = llm.tokenize(s.encode("utf-8"), add_bos=True, special=False)
        if len(ids) == n:
            return s, ids
    sys.exit(f"error: could not find a prefix of exactly {n} tokens")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", required=True, help="UTF-8 text file the prompt is cut from")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--prompt-out")
    args = ap.parse_args()

    import numpy as np
    import llama_cpp
    from llama_cpp import Llama

    n, m = args.prompt_tokens, args.decode_tokens
    batch = max(512, n)
    t0 = time.perf_counter()
    llm = Llama(
        model_path=args.model,
        n_ctx=n + m + 16,
        n_batch=batch,
        n_ubatch=batch,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        logits_all=False,
        verbose=False,
    )
    load_s = time.perf_counter() - t0
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    prompt, ids = build_prompt(llm, text, n)
    if args.prompt_out:
        with open(args.prompt_out, "w", encoding="utf-8") as f:
            f.write(prompt)

    n_vocab = llm.n_vocab()
    ctx = llm._ctx.ctx  # raw llama_context*, to read the last logits without copying them all

    def argmax_last() -> int:
        ptr = llama_cpp.llama_get_logits_ith(ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(n_vocab,))))

    def run_once() -> dict:
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids)
        prefill = time.perf_counter() - t
        tok = argmax_last()
        generated = []
        t = time.perf_counter()
        for _ in range(m):
            generated.append(tok)
            llm.eval([tok])
            tok = argmax_last()
        decode = time.perf_counter() - t
        return {
            "prefill_s": prefill,
            "decode_s": decode,
            "prefill_tok_s": len(ids) / prefill,
            "decode_tok_s": m / decode,
            "first_tokens": generated[:8],
        }

    for _ in range(args.warmup):
        run_once()
    runs = [run_once() for _ in range(args.repeats)]
    print(json.dumps({
        "engine": "llama.cpp",
        "llama_cpp_python": llama_cpp.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
        "python": platform.python_version(),
        "threads": args.threads,
        "prompt_tokens": len(ids),
        "prompt_chars": len(prompt),
        "decode_tokens": m,
        "load_s": load_s,
        "cpu_count": os.cpu_count(),
        "runs": runs,
    }))


if __name__ == "__main__":
    main()
