#!/usr/bin/env python3
"""Renders a tool-calling conversation through a GGUF model's chat template with Jinja2, the
way transformers' `apply_chat_template(messages, tools=tools, add_generation_prompt=True)` does
(`transformers/utils/chat_template_utils.py`: sandboxed environment, trim_blocks, lstrip_blocks,
loopcontrols, `tojson` as `json.dumps(ensure_ascii=False)`, assistant `arguments` as objects).

The output is the golden file of crates/deco-serve/tests/tool_calls.rs, an independent reference
for deco's minijinja rendering:

    python3 tests/python/render_tool_prompt.py MODEL.gguf REQUEST.json > GOLDEN.txt

REQUEST.json is an OpenAI chat request (`messages`, `tools`); as vLLM does, each assistant
`tool_calls[].function.arguments` JSON string is parsed before rendering.
Needs `pip install gguf jinja2`.
"""
import json
import sys

import gguf
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


def main() -> None:
    model, request = sys.argv[1], sys.argv[2]
    reader = gguf.GGUFReader(model)
    field = reader.fields["tokenizer.chat_template"]
    source = bytes(field.parts[field.data[0]]).decode()
    req = json.load(open(request, encoding="utf-8"))
    messages = []
    for m in req["messages"]:
        m = dict(m)
        if m.get("content") is None:
            m["content"] = ""
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                c = json.loads(json.dumps(c))
                c["function"]["arguments"] = json.loads(c["function"]["arguments"])
                calls.append(c)
            m["tool_calls"] = calls
        messages.append(m)

    def raise_exception(msg):
        raise ValueError(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
    env.globals["raise_exception"] = raise_exception
    text = env.from_string(source).render(
        messages=messages, tools=req["tools"], add_generation_prompt=True, bos_token="", eos_token=""
    )
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
