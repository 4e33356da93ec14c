#!/usr/bin/env python3
"""Tool calls through `deco serve` with the official `openai` Python client, on
Qwen2.5-Coder-0.5B-Instruct (pip install "openai>=1.40" jsonschema).

Usage: python3 tests/python/tool_client_test.py --base-url http://127.0.0.1:PORT/v1

Every call's arguments are checked with `jsonschema` against the tool's `parameters` (an
independent validator, not the server's grammar engine):
- tool_choice auto (greedy): "What is the weather in Paris?" gives one get_weather call for
  Paris, finish_reason "tool_calls", content None; the streamed deltas assemble to the same call;
- tool_choice required: every call names a given tool and validates; with
  parallel_tool_calls=False exactly one call; n=3 sampled choices, streamed, each valid;
- a named function: exactly one call of that function, even when the question is about another;
- tool_choice none: no tool_calls, text content;
- a conversation with an assistant tool_calls message and a tool result is rendered and answered;
- malformed tools / tool_choice are HTTP 400 naming the field.
Exits 0 when all pass, 1 on the first failure, 2 when `openai` or `jsonschema` is missing.
"""

import argparse
import json
import sys

try:
    import openai
    from openai import OpenAI
except ImportError:
    print("FAIL: the `openai` Python package is not installed; run `pip install \"openai>=1.40\"`", file=sys.stderr)
    sys.exit(2)
try:
    import jsonschema
except ImportError:
    print("FAIL: the `jsonschema` Python package is not installed; run `pip install jsonschema`", file=sys.stderr)
    sys.exit(2)

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Get the current local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


def valid_call(name, arguments):
    """The call names a tool and its arguments (a JSON string) validate against its schema."""
    check(name in SCHEMAS, f"call of unknown function {name!r}")
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


def streamed(stream):
    """Assembles a streamed chat response per choice: content, tool calls, finish reason."""
    out = {}
    for chunk in stream:
        for c in chunk.choices:
            o = out.setdefault(c.index, {"content": "", "calls": {}, "finish": None})
            if c.delta.content:
                o["content"] += c.delta.content
            for tc in c.delta.tool_calls or []:
                call = o["calls"].setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                if tc.id:
                    call["id"] = tc.id
                if tc.function and tc.function.name:
                    call["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    call["arguments"] += tc.function.arguments
            if c.finish_reason:
                o["finish"] = c.finish_reason
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    args = ap.parse_args()
    client = OpenAI(base_url=args.base_url, api_key="unused", timeout=300, max_retries=0)
    model = client.models.list().data[0].id
    weather_q = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    both_q = [{"role": "user", "content": "What are the weather and the local time in Tokyo?"}]

    # auto, greedy: the model calls get_weather for Paris.
    r = client.chat.completions.create(model=model, messages=weather_q, tools=TOOLS, temperature=0, max_tokens=80)
    c = r.choices[0]
    check(c.finish_reason == "tool_calls", f"auto: finish_reason {c.finish_reason}, message {c.message}")
    check(c.message.content is None and c.message.tool_calls and len(c.message.tool_calls) == 1, f"auto: {c.message}")
    call = c.message.tool_calls[0]
    check(call.type == "function" and call.id, f"auto: {call}")
    a = valid_call(call.function.name, call.function.arguments)
    check(call.function.name == "get_weather" and a["city"] == "Paris", f"auto: {call}")
    print(f"ok auto: {call.function.name}({call.function.arguments})")
    s = streamed(client.chat.completions.create(model=model, messages=weather_q, tools=TOOLS, temperature=0, max_tokens=80, stream=True))
    check(s[0]["finish"] == "tool_calls" and s[0]["content"] == "", f"auto streamed: {s}")
    sc = s[0]["calls"]
    check(len(sc) == 1 and sc[0]["name"] == call.function.name and json.loads(sc[0]["arguments"]) == a and sc[0]["id"], f"auto streamed {sc} != {call}")
    print("ok auto streamed equals non-streamed")

    # required: parallel calls allowed; with parallel_tool_calls=False exactly one.
    r = client.chat.completions.create(model=model, messages=both_q, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=120)
    c = r.choices[0]
    check(c.finish_reason == "tool_calls" and c.message.tool_calls, f"required: {c}")
    names = [tc.function.name for tc in c.message.tool_calls]
    for tc in c.message.tool_calls:
        valid_call(tc.function.name, tc.function.arguments)
    check(len({tc.id for tc in c.message.tool_calls}) == len(names), f"required: call ids not unique {c.message.tool_calls}")
    print(f"ok required: {names}")
    r = client.chat.completions.create(model=model, messages=both_q, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                       temperature=0, max_tokens=120)
    c = r.choices[0]
    check(c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, f"required, parallel_tool_calls=False: {c}")
    valid_call(c.message.tool_calls[0].function.name, c.message.tool_calls[0].function.arguments)
    print("ok required, parallel_tool_calls=False: one call")
    s = streamed(client.chat.completions.create(model=model, messages=both_q, tools=TOOLS, tool_choice="required", n=3, temperature=1.0,
                                                seed=7, max_tokens=120, stream=True))
    check(sorted(s) == [0, 1, 2], f"required n=3: choices {sorted(s)}")
    for i, o in s.items():
        check(o["finish"] == "tool_calls" and o["calls"], f"required n=3 choice {i}: {o}")
        for call in o["calls"].values():
            valid_call(call["name"], call["arguments"])
    print("ok required, n=3 sampled and streamed: every call valid")

    # A named function, asked about something else: still exactly that call.
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model=model, messages=weather_q, tools=TOOLS, tool_choice=named, temperature=0, max_tokens=80)
    c = r.choices[0]
    check(c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1 and c.message.tool_calls[0].function.name == "get_time",
          f"named: {c}")
    valid_call("get_time", c.message.tool_calls[0].function.arguments)
    print(f"ok named: get_time({c.message.tool_calls[0].function.arguments})")

    # none: plain text.
    r = client.chat.completions.create(model=model, messages=weather_q, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=40)
    base_prompt = r.usage.prompt_tokens
    c = r.choices[0]
    check(not c.message.tool_calls and c.message.content and c.finish_reason in ("stop", "length"), f"none: {c}")
    print("ok none: text")

    # The call and its result go back to the model (rendered: the prompt grows by them; the
    # exact rendering is checked against Jinja2 in tool_calls.rs), which answers in text. (The
    # 0.5B model's answer is not judged: it tends to echo the JSON.)
    conv = weather_q + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature": 18, "sky": "cloudy"})},
    ]
    r = client.chat.completions.create(model=model, messages=conv, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=60)
    c = r.choices[0]
    check(not c.message.tool_calls and c.message.content, f"tool result: {c.message}")
    check(r.usage.prompt_tokens > base_prompt + 30, f"tool result: the call and result were not rendered ({r.usage}, {base_prompt})")
    print(f"ok tool result answered: {c.message.content[:80]!r}")

    # Malformed requests are 400s naming the field.
    for kwargs, param in [
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools"),
        (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
        (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
    ]:
        try:
            client.chat.completions.create(model=model, messages=weather_q, max_tokens=2, **kwargs)
            raise AssertionError(f"{param}: expected HTTP 400 for {kwargs}")
        except openai.BadRequestError as e:
            check(e.status_code == 400 and e.body.get("param") == param, f"{kwargs}: body {e.body}")
    print("ok malformed tool requests: 400")


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print(f"FAIL: {e}", file=sys.stderr)
        sys.exit(1)
    print("all tool-call checks passed")
