#!/usr/bin/env python3
"""Tests of `deco serve` with the official `openai` Python client (pip install "openai>=1.40").

Usage: python3 tests/python/client_test.py --base-url http://127.0.0.1:PORT/v1 --golden PATH

Checks, each against an independent value:
- greedy completions equal the float64 numpy reference's greedy continuation (golden file);
- streamed text equals the non-streamed text of the same request, usage chunk counts tokens;
- chat completions go through the chat template (prompt_tokens equals the golden chat prompt);
- n, logprobs (greedy token is the top alternative; probabilities sum <= 1), stop strings;
- a seeded sampled request gives the same text alone and inside a batch of 16 concurrent ones;
- HTTP 400 with an OpenAI error body (naming the field) for unknown or unsupported fields and
  message roles;
- HTTP 400 with an OpenAI error body for unknown model, bad JSON, out-of-range params, prompt
  over the context, a json_schema without a schema, `tools` for SmolLM2 (its chat template
  renders no tools: refused, never ignored; tool calls are tested on Qwen2.5 in
  tool_client_test.py) and `tool_choice` without tools;
- response_format json_schema (strict) through the client: the content parses and validates
  against the schema (checked in this script), streamed equals non-streamed;
- usage.prompt_tokens_details.cached_tokens: 0 for a new chat prompt, the prefix cache's full
  blocks (block size 16, at least one token left to compute) for the same prompt again;
- 200 mixed requests with client-side cancellations leave every KV block free;
- /metrics parsed by the official Prometheus client's parser (pip install prometheus_client):
  vLLM's metric names and types, histograms consistent, vLLM counters equal deco's.
Exits 0 when all pass, 1 on the first failure, 2 when `openai` or `prometheus_client` is not
installed.
"""

import argparse
import concurrent.futures as cf
import json
import sys
import time
import urllib.error
import urllib.request

try:
    import openai
    from openai import OpenAI
except ImportError:
    print("FAIL: the `openai` Python package is not installed; run `pip install \"openai>=1.40\"`", file=sys.stderr)
    sys.exit(2)
try:
    from prometheus_client.parser import text_string_to_metric_families
except ImportError:
    print("FAIL: the `prometheus_client` Python package is not installed; run `pip install prometheus_client`", file=sys.stderr)
    sys.exit(2)

BLOCK_SIZE = 16  # the server's KV block size in crates/deco-serve/tests/serve_openai.rs


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


def metrics(root):
    with urllib.request.urlopen(root + "/metrics", timeout=10) as r:
        out = {}
        for line in r.read().decode().splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
        return out


def metric_families(root):
    with urllib.request.urlopen(root + "/metrics", timeout=10) as r:
        return {f.name: f for f in text_string_to_metric_families(r.read().decode())}


def raw_post(root, path, body):
    req = urllib.request.Request(root + path, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--golden", required=True)
    args = ap.parse_args()
    base = args.base_url.rstrip("/")
    root = base[: -len("/v1")] if base.endswith("/v1") else base
    golden = json.load(open(args.golden))
    client = OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    print(f"openai {openai.__version__}, model {model}")
    t0 = time.time()

    # 1. Greedy completion == reference greedy continuation (prefix before the first near-tie).
    for p in golden["prompts"][:3:2]:
        margins = p["greedy_top1_minus_top2_margins"]
        k = next((i for i, m in enumerate(margins) if m < 0.1), len(margins))
        k = min(k, 8)
        r = client.completions.create(model=model, prompt=p["ids"], max_tokens=k, temperature=0)
        want = "".join(p["greedy_continuation_token_texts"][:k])
        check(r.choices[0].text == want, f"greedy completion {r.choices[0].text!r} != reference {want!r}")
        check(r.usage.completion_tokens == k and r.usage.prompt_tokens == len(p["ids"]), f"usage {r.usage}")
        check(r.choices[0].finish_reason == "length", "finish_reason should be length")
    print("ok completion (matches float64 reference)")

    # 2. Streaming equals non-streaming; usage chunk.
    p0 = golden["prompts"][0]
    chunks = list(client.completions.create(model=model, prompt=p0["text"], max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    want = "".join(p0["greedy_continuation_token_texts"][:8])
    check(text == want, f"streamed {text!r} != {want!r}")
    check(chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8, "final usage chunk missing")
    check(chunks[-2].choices[0].finish_reason == "length", "finish chunk missing")
    print("ok streaming")

    # 3. Chat through the template: the golden chat prompt has the same ids.
    p1 = golden["prompts"][1]
    msgs = [{"role": "user", "content": "What is the largest planet in the solar system?"}]
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=5, temperature=0)
    check(r.usage.prompt_tokens == len(p1["ids"]), f"chat prompt {r.usage.prompt_tokens} tokens, template gives {len(p1['ids'])}")
    want = "".join(p1["greedy_continuation_token_texts"][:5])
    check(r.choices[0].message.content == want, f"chat {r.choices[0].message.content!r} != {want!r}")
    s = list(client.chat.completions.create(model=model, messages=msgs, max_tokens=5, temperature=0, stream=True))
    check("".join(c.choices[0].delta.content or "" for c in s if c.choices) == want, "streamed chat differs")
    check(s[0].choices[0].delta.role == "assistant", "first chat chunk has no role")
    print("ok chat")

    # 3b. Prefix cache: the first chat request above found nothing cached; the same prompt
    # again finds its full blocks.
    details = r.usage.prompt_tokens_details
    check(details is not None and details.cached_tokens == 0, f"first chat: cached_tokens {details}")
    again = client.chat.completions.create(model=model, messages=msgs, max_tokens=2, temperature=0)
    want_cached = (len(p1["ids"]) - 1) // BLOCK_SIZE * BLOCK_SIZE
    check(again.usage.prompt_tokens_details.cached_tokens == want_cached,
          f"repeated chat: cached_tokens {again.usage.prompt_tokens_details} != {want_cached}")
    print(f"ok cached_tokens ({want_cached} of {len(p1['ids'])} prompt tokens on the repeat)")

    # 4. n, seed.
    kw = dict(model=model, prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=1234, n=3)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    check(sorted(c.index for c in a.choices) == [0, 1, 2], "n=3 should give indices 0,1,2")
    check([c.text for c in a.choices] == [c.text for c in b.choices], "seeded n=3 not reproducible")
    check(len({c.text for c in a.choices}) > 1, "n=3 samples are all identical")
    check(a.usage.completion_tokens == sum(1 for _ in a.choices) * 8 or a.usage.completion_tokens <= 24, "usage")
    print("ok n + seed")

    # 5. logprobs: greedy token is the most likely alternative; alternatives are sorted, sum p <= 1.
    r = client.completions.create(model=model, prompt=p0["ids"], max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    check(len(lp.tokens) == 4 and len(lp.token_logprobs) == 4, "logprobs length")
    for tok, tlp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        vals = sorted(top.values(), reverse=True)
        check(len(top) <= 3 and abs(vals[0] - tlp) < 1e-5, f"greedy token {tok!r} logprob {tlp} != top {vals[0]}")
        check(sum(2.718281828 ** v for v in vals) <= 1.0 + 1e-4 and tlp <= 0, "probabilities exceed 1")
    check(abs(lp.token_logprobs[0] - (-0.2581)) < 0.05, f"first token logprob {lp.token_logprobs[0]} far from reference")
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    check(len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content), "chat logprobs shape")
    check(all(abs(c.logprob - c.top_logprobs[0].logprob) < 1e-5 for c in content), "chat greedy logprob != top")
    print("ok logprobs")

    # 6. stop: text ends right before the stop string.
    full = "".join(p0["greedy_continuation_token_texts"][:8])  # " Paris.\n\nThe answer is:"
    r = client.completions.create(model=model, prompt=p0["ids"], max_tokens=8, temperature=0, stop=["answer"])
    check(r.choices[0].text == full[: full.index("answer")], f"stop: {r.choices[0].text!r}")
    check(r.choices[0].finish_reason == "stop", "stop finish_reason")
    r = client.completions.create(model=model, prompt=p0["ids"], max_tokens=8, temperature=0, stop="\n")
    check(r.choices[0].text == " Paris.", f"stop newline: {r.choices[0].text!r}")
    print("ok stop")

    # 7. Same seeded request alone and inside a batch of 16 concurrent requests.
    seeded = dict(model=model, prompt="The best thing about the ocean is", max_tokens=12, temperature=0.9, top_p=0.95, seed=42)
    alone = client.completions.create(**seeded).choices[0].text
    others = [dict(model=model, prompt=f"Story number {i}: a", max_tokens=6 + i % 9, temperature=1.0, seed=i) for i in range(15)]
    with cf.ThreadPoolExecutor(16) as ex:
        futs = [ex.submit(client.completions.create, **o) for o in others[:7]]
        mine = ex.submit(client.completions.create, **seeded)
        futs += [ex.submit(client.completions.create, **o) for o in others[7:]]
        batched = mine.result().choices[0].text
        for f in futs:
            f.result()
    check(alone == batched, f"seeded text differs alone {alone!r} vs batched {batched!r}")
    print("ok seed in batch of 16")

    # 8. Errors: 400 with OpenAI body.
    for kwargs, what in [
        (dict(model="no-such-model", prompt="x", max_tokens=2), "unknown model"),
        (dict(model=model, prompt="x", max_tokens=2, top_p=3.0), "top_p out of range"),
        (dict(model=model, prompt="x", max_tokens=2, temperature=-1), "negative temperature"),
        (dict(model=model, prompt="x", max_tokens=10**6), "prompt + max_tokens over the context"),
    ]:
        try:
            client.completions.create(**kwargs)
            raise AssertionError(f"{what}: expected HTTP 400")
        except openai.BadRequestError as e:
            check(e.status_code == 400 and isinstance(e.body, dict) and "message" in e.body, f"{what}: body {e.body}")
    # What deco cannot honour for this model is refused, never ignored.
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}
    for kwargs, param, needle in [
        (dict(tools=[tool]), "tools", "does not render tools"),
        (dict(tool_choice="required"), "tool_choice", "only allowed when tools are given"),
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format", "json_schema.schema"),
        # A field deco does not implement is named, never ignored (a vLLM extension deco lacks,
        # a misspelling).
        (dict(extra_body={"guided_choice": ["yes", "no"]}), "guided_choice", "unsupported request field"),
        (dict(extra_body={"temprature": 0.5}), "temprature", "unsupported request field"),
        (dict(messages=[{"role": "narrator", "content": "hi"}]), "messages", "role `narrator`"),
    ]:
        try:
            kwargs = {"messages": msgs, **kwargs}
            client.chat.completions.create(model=model, max_tokens=2, **kwargs)
            raise AssertionError(f"{param}: expected HTTP 400")
        except openai.BadRequestError as e:
            check(e.status_code == 400 and e.body.get("param") == param and needle in e.body["message"], f"{param}: body {e.body}")
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=2, response_format={"type": "text"}, tools=[], tool_choice="none")
    check(r.choices[0].finish_reason == "length", "response_format text / empty tools must be accepted")

    # Structured output through the client's own response_format: the content parses and
    # validates (checked here, not by the server's grammar engine).
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 10**8}},
              "required": ["city", "population"], "additionalProperties": False}
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name a city and its population."}],
                                       max_tokens=80, temperature=0,
                                       response_format={"type": "json_schema", "json_schema": {"name": "city", "strict": True, "schema": schema}})
    out = json.loads(r.choices[0].message.content)
    check(r.choices[0].finish_reason == "stop" and sorted(out) == ["city", "population"], f"json_schema output {out}")
    check(isinstance(out["city"], str) and len(out["city"]) <= 16 and isinstance(out["population"], int)
          and 0 <= out["population"] <= 10**8, f"json_schema output violates the schema: {out}")
    chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name a city and its population."}],
                                                 max_tokens=80, temperature=0, stream=True,
                                                 response_format={"type": "json_schema", "json_schema": {"name": "city", "strict": True, "schema": schema}}))
    check("".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content, "streamed json_schema differs")
    print(f"ok structured output {json.dumps(out)}")
    status, body = raw_post(root, "/v1/completions", b"{not json")
    check(status == 400 and body["error"]["type"] == "invalid_request_error", f"bad JSON: {status} {body}")
    status, body = raw_post(root, "/v1/chat/completions", b'{"messages": "nope"}')
    check(status == 400 and "error" in body, f"bad messages: {status} {body}")
    print("ok errors")

    # 9. 200 mixed requests with cancellations (the serving issue's count); afterwards no KV
    # block is in use.
    n_mixed = 200
    def job(i):
        c = OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=300)
        kind = i % 5
        if kind == 0:  # stream, read two chunks, disconnect
            st = c.completions.create(model=model, prompt=f"Count to ten: {i}", max_tokens=40, stream=True, seed=i)
            for j, _ in enumerate(st):
                if j == 1:
                    break
            st.close()
            return "cancelled-stream"
        if kind == 1:  # time out client-side while queued or running
            try:
                OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=0.05).completions.create(
                    model=model, prompt="Tell me a long story", max_tokens=60)
            except openai.APITimeoutError:
                return "cancelled-timeout"
            return "finished"
        if kind == 2:
            r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": f"Say {i}"}], max_tokens=4, seed=i)
            return r.choices[0].finish_reason
        if kind == 3:
            r = c.completions.create(model=model, prompt=[504, 3575, 282], max_tokens=3, n=2, temperature=0.8, seed=i)
            return r.choices[1].finish_reason
        r = c.completions.create(model=model, prompt="Hello", max_tokens=3, stream=False, temperature=0)
        return r.choices[0].finish_reason

    with cf.ThreadPoolExecutor(10) as ex:
        results = list(ex.map(job, range(n_mixed)))
    check(all(r in ("stop", "length", "cancelled-stream", "cancelled-timeout", "finished") for r in results), str(results))
    deadline = time.time() + 60
    while True:
        m = metrics(root)
        if m["deco_kv_blocks_used"] == 0 and m["deco_num_requests_pending"] == 0:
            break
        check(time.time() < deadline, f"KV blocks still used after mixed load: {m}")
        time.sleep(0.2)
    check(m["deco_kv_blocks_free"] == m["deco_kv_blocks_total"], f"free != total: {m}")
    check(m["deco_requests_cancelled_total"] >= n_mixed // 5, f"expected cancellations to be counted: {m}")
    check(len(results) == n_mixed, f"{len(results)} results")
    print(f"ok {n_mixed} mixed requests with cancellations, all {int(m['deco_kv_blocks_total'])} blocks free "
          f"({int(m['deco_requests_cancelled_total'])} cancelled)")

    # 10. vLLM's metric names, read by Prometheus' own parser (the parser strips `_total` from
    # counter family names, as prometheus_client does).
    fams = metric_families(root)
    want_types = {
        "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge", "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter", "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter", "vllm:num_preemptions": "counter",
        "vllm:request_success": "counter", "vllm:time_to_first_token_seconds": "histogram",
        "vllm:time_per_output_token_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:cache_config_info": "gauge",
    }
    for name, kind in want_types.items():
        check(name in fams and fams[name].type == kind, f"{name}: {fams.get(name) and fams[name].type} != {kind}")
        for smp in fams[name].samples:
            check(smp.labels.get("model_name") == model and smp.labels.get("engine") == "0", f"{name} labels {smp.labels}")
    val = lambda name, suffix="_total", **lab: next(x.value for x in fams[name].samples
                                                  if x.name == name + suffix and all(x.labels.get(k) == v for k, v in lab.items()))
    check(val("vllm:generation_tokens") == m["deco_generation_tokens_total"], "vllm vs deco generation tokens")
    check(val("vllm:request_success", finished_reason="abort") == m["deco_requests_cancelled_total"], "abort count")
    check(val("vllm:prefix_cache_hits") >= want_cached and val("vllm:prefix_cache_hits") <= val("vllm:prefix_cache_queries"), "prefix cache hits")
    check(val("vllm:kv_cache_usage_perc", "") == 0.0, "KV usage after the load should be 0")
    check(val("vllm:num_preemptions") == m["deco_preemptions_total"], "preemptions")
    info = fams["vllm:cache_config_info"].samples[0].labels
    check(info["block_size"] == str(BLOCK_SIZE) and info["num_gpu_blocks"] == str(int(m["deco_kv_blocks_total"])), f"cache_config_info {info}")
    counts = {}
    for name in ["vllm:time_to_first_token_seconds", "vllm:time_per_output_token_seconds", "vllm:e2e_request_latency_seconds"]:
        buckets = sorted(((float(x.labels["le"]), x.value) for x in fams[name].samples if x.name == name + "_bucket"))
        check(len(buckets) > 10 and buckets[-1][0] == float("inf"), f"{name} buckets {buckets}")
        check(all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:])), f"{name} not cumulative")
        counts[name] = val(name, "_count")
        check(buckets[-1][1] == counts[name] and counts[name] > 0 and val(name, "_sum") > 0, f"{name}: +Inf {buckets[-1]} count {counts[name]}")
    check(counts["vllm:time_to_first_token_seconds"] >= counts["vllm:e2e_request_latency_seconds"], "fewer first tokens than finished requests")
    print(f"ok vLLM metrics ({int(counts['vllm:e2e_request_latency_seconds'])} requests, "
          f"{int(counts['vllm:time_per_output_token_seconds'])} token intervals, {int(val('vllm:prefix_cache_hits'))} cached prompt tokens)")
    print(f"ALL OK in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print(f"FAIL: {e}", file=sys.stderr)
        sys.exit(1)
