#!/usr/bin/env python3
"""Aggregate decode throughput of `deco serve` with N concurrent streams (device check).

  device_streams.py PORT N MAX_TOKENS PROMPT_FILE

Starts N streaming /v1/completions requests at once (greedy, ignore_eos, max_tokens, usage in
the last chunk), each from its own thread over plain HTTP/1.1 (standard library only), and
prints one JSON line: streams, completion tokens, wall seconds from the first request to the
last token, aggregate tok/s, and the median time to first token.
"""
import http.client
import json
import statistics
import sys
import threading
import time


def one(port, body, out, i, t0):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        out[i] = {"error": f"HTTP {resp.status}: {resp.read()[:200]!r}"}
        return
    first = None
    tokens = 0
    for raw in resp:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if first is None and ev.get("choices"):
            first = time.perf_counter() - t0
        if ev.get("usage"):
            tokens = ev["usage"]["completion_tokens"]
    out[i] = {"tokens": tokens, "ttft": first, "end": time.perf_counter() - t0}


def main():
    if len(sys.argv) != 5:
        raise SystemExit(__doc__)
    port, n, max_tokens = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    prompt = open(sys.argv[4], encoding="utf-8").read()
    out = [None] * n
    t0 = time.perf_counter()
    threads = []
    for i in range(n):
        body = {
            "model": "deco",
            "prompt": prompt + f" ({i})",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        t = threading.Thread(target=one, args=(port, body, out, i, t0))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    errors = [o["error"] for o in out if o is None or "error" in o]
    if errors:
        raise SystemExit(f"{len(errors)} of {n} streams failed: {errors[:3]}")
    tokens = sum(o["tokens"] for o in out)
    wall = max(o["end"] for o in out)
    print(json.dumps({
        "streams": n,
        "completion_tokens": tokens,
        "wall_s": round(wall, 3),
        "tok_s": round(tokens / wall, 2),
        "ttft_median_s": round(statistics.median(o["ttft"] for o in out), 3),
    }))


if __name__ == "__main__":
    main()
