#!/usr/bin/env python3
"""Decoding strategies served by `deco serve`, through the official `openai` Python client
(pip install "openai>=1.40").

Usage: python3 tests/python/strategy_client_test.py --base-url http://127.0.0.1:PORT/v1 \
           --model NAME --expected cases.json

`cases.json` lists requests with the texts `deco generate` printed for the same settings:
`[{"prompt": str, "max_tokens": int, "n": int, "extra_body": {...}, "texts": [str, ...],
"temperature": float (default 0), "seed": int (optional)}]`. With `--expect-speculation` the
server runs speculative decoding (`deco serve --speculative-model ...`): its vLLM counters
`spec_decode_num_draft_tokens` / `_accepted_tokens` must have moved.

Checks, each against an independent value:
- every case, sent with `extra_body` (the strategy's fields under Hugging Face's names) while
  sampled requests run concurrently in the same server (continuous batching), returns exactly
  the texts of `deco generate` (choice by choice);
- the same cases streamed assemble to the same texts;
- what a strategy cannot honour is refused with HTTP 400 naming the field.
Exits 0 when all pass, 1 on the first failure, 2 when `openai` is not installed.
"""

import argparse
import concurrent.futures as cf
import json
import sys

try:
    import openai
except ImportError:
    print("the openai package is not installed (pip install 'openai>=1.40')", file=sys.stderr)
    sys.exit(2)


def check(ok, what):
    if not ok:
        print(f"FAIL: {what}", file=sys.stderr)
        sys.exit(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--expected", required=True)
    ap.add_argument("--expect-speculation", action="store_true")
    ap.add_argument("--no-refusals", action="store_true", help="skip the beam-search refusal checks")
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key="none", max_retries=0, timeout=600)
    cases = json.load(open(args.expected, encoding="utf-8"))

    def served(case, stream=False):
        kw = dict(model=args.model, prompt=case["prompt"], max_tokens=case["max_tokens"], n=case["n"],
                  temperature=case.get("temperature", 0), extra_body=case["extra_body"])
        if "seed" in case:
            kw["seed"] = case["seed"]
        if not stream:
            r = client.completions.create(**kw)
            return [c.text for c in sorted(r.choices, key=lambda c: c.index)], [c.finish_reason for c in sorted(r.choices, key=lambda c: c.index)]
        texts = [""] * case["n"]
        finish = [None] * case["n"]
        for chunk in client.completions.create(stream=True, **kw):
            for c in chunk.choices:
                texts[c.index] += c.text or ""
                finish[c.index] = c.finish_reason or finish[c.index]
        return texts, finish

    def sampled(i):
        r = client.completions.create(model=args.model, prompt=f"Story {i}: once upon a time", max_tokens=24,
                                      temperature=0.8, seed=i)
        return r.choices[0].finish_reason

    # Strategy requests and sampled ones at once: they share the engine's batches.
    with cf.ThreadPoolExecutor(max_workers=12) as pool:
        futs = [pool.submit(served, c) for c in cases]
        futs += [pool.submit(served, c, True) for c in cases]
        others = [pool.submit(sampled, i) for i in range(6)]
        results = [f.result() for f in futs]
        check(all(o.result() in ("stop", "length") for o in others), "a concurrent sampled request failed")
    for k, (texts, finish) in enumerate(results):
        case = cases[k % len(cases)]
        how = "streamed" if k >= len(cases) else "non-streamed"
        check(texts == case["texts"], f"{how} {case['extra_body']}: served {texts!r}, deco generate {case['texts']!r}")
        check(all(f in ("stop", "length") for f in finish), f"{how} {case['extra_body']}: finish reasons {finish}")
    print(f"ok {len(cases)} strategy cases equal deco generate, streamed and not, beside sampled requests")
    if args.expect_speculation:
        import urllib.request
        root = args.base_url.rsplit("/v1", 1)[0]
        metrics = urllib.request.urlopen(root + "/metrics", timeout=30).read().decode()
        def counter(name):
            line = next(l for l in metrics.splitlines() if l.startswith(f"vllm:{name}_total{{"))
            return float(line.rsplit(" ", 1)[1])
        drafted, accepted = counter("spec_decode_num_draft_tokens"), counter("spec_decode_num_accepted_tokens")
        check(drafted > 0 and 0 <= accepted <= drafted, f"speculative counters drafted {drafted} accepted {accepted}")
        print(f"ok speculation ran: {int(accepted)} of {int(drafted)} draft tokens accepted")
    if args.no_refusals:
        return

    # What a strategy cannot honour is refused, naming the field.
    base = dict(model=args.model, prompt="Hello", max_tokens=4)
    for kw, param in [
        (dict(temperature=0.7, extra_body={"num_beams": 2}), "temperature"),
        (dict(n=3, temperature=0, extra_body={"num_beams": 2}), "n"),
        (dict(temperature=0, extra_body={"num_beams": 2}, stop=["\n"]), "stop"),
        (dict(temperature=0, extra_body={"length_penalty": 2.0}), "length_penalty"),
        (dict(temperature=0, extra_body={"num_beams": 2, "early_stopping": "sometimes"}), "early_stopping"),
        (dict(temperature=0, extra_body={"penalty_alpha": 0.6}), "top_k"),
        (dict(temperature=0, n=2, extra_body={"penalty_alpha": 0.6, "top_k": 4}), "n"),
        (dict(temperature=0.7, extra_body={"penalty_alpha": 0.6, "top_k": 4}), "temperature"),
        (dict(temperature=0, extra_body={"penalty_alpha": 0.6, "top_k": 4, "num_beams": 2}), "penalty_alpha"),
        (dict(temperature=1, extra_body={"autodeco": True}), "autodeco"),
        (dict(temperature=0, extra_body={"contrastive_decoding": {"alpha": 0.1}}), "contrastive_decoding"),
        (dict(temperature=0, extra_body={"early_exit": {"min_layers": 0}}), "early_exit"),
        (dict(temperature=0, extra_body={"early_exit": {"entropy": 1.0}}), "early_exit"),
    ]:
        try:
            client.completions.create(**base, **kw)
            check(False, f"{param}: expected HTTP 400")
        except openai.BadRequestError as e:
            check(e.status_code == 400 and e.body.get("param") == param, f"{param}: body {e.body}")
    print("ok strategy refusals")


if __name__ == "__main__":
    main()
