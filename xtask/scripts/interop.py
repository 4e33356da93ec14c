#!/usr/bin/env python3
"""The interop tier's Python side (`cargo xtask interop`, docs/formats.md "Interop"): today's
loaders read deco's exports unchanged.

  ppl  --model DIR --text FILE --seqlen N [--dtype float32] [--lora ADAPTER_DIR]
       loads DIR with transformers' AutoModelForCausalLM (GPTQ / AWQ through gptqmodel,
       compressed-tensors through compressed-tensors), on the CPU, tokenizes FILE with DIR's
       own tokenizer (AutoTokenizer, no special tokens), and prints the perplexity over
       non-overlapping windows of N tokens, each
       scored on its N-1 next-token predictions: the protocol of `deco eval ppl`. Prints
       one JSON line {"ppl", "tokens_scored", "windows", "quant_linear", "versions"}.
       With --lora, the PEFT LoRA adapter directory is loaded on top with
       `peft.PeftModel.from_pretrained` (not merged) after checking that every tensor of its
       adapter_model.safetensors landed in the model under PEFT's own name (PEFT only warns
       about keys it cannot place); adds "lora_tensors" to the JSON.

  build-quantize --sdist TARGZ --work DIR
       unpacks llama.cpp from the llama-cpp-python sdist (vendor/llama.cpp) and builds its
       `llama-quantize` tool with cmake + ninja (portable code, no OpenMP, no curl); prints the
       tool's path. Built once: the tool is kept in DIR.

Needs the interop venv (transformers 5, gptqmodel, compressed-tensors, torch), which
`cargo xtask interop` installs.
"""
import argparse
import json
import math
import sys
from pathlib import Path



def cmd_ppl(args: argparse.Namespace) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, device_map="cpu", dtype=dtype)
    model.eval()
    lora_tensors = None
    if args.lora:
        from peft import PeftModel, get_peft_model_state_dict
        from safetensors.torch import load_file

        model = PeftModel.from_pretrained(model, args.lora)
        model.eval()
        saved = load_file(str(Path(args.lora) / "adapter_model.safetensors"))
        placed = get_peft_model_state_dict(model)
        missing = sorted(set(saved) - set(placed))
        if missing:
            sys.exit(f"error: PEFT did not place {len(missing)} adapter tensors, e.g. {missing[:3]}")
        for k, v in saved.items():
            if not torch.equal(placed[k].to(v.dtype), v):
                sys.exit(f"error: PEFT's {k} differs from the file")
        lora_tensors = len(saved)
    # The layer classes that run the quantized linears (gptqmodel's kernels, compressed-tensors'
    # compressed linear), so the report says which loader path was exercised.
    kinds = sorted({type(m).__module__ + "." + type(m).__name__ for m in model.modules()
                    if type(m).__module__.split(".")[0] in ("gptqmodel", "compressed_tensors", "optimum")
                    or "quant" in type(m).__name__.lower()})
    text = open(args.text, encoding="utf-8").read()
    ids = AutoTokenizer.from_pretrained(args.model)(text, add_special_tokens=False)["input_ids"]
    n = args.seqlen
    windows = len(ids) // n
    if args.max_windows:
        windows = min(windows, args.max_windows)
    if windows == 0:
        sys.exit(f"error: {len(ids)} tokens make no window of {n}")
    nll, count = 0.0, 0
    with torch.no_grad():
        for w in range(windows):
            x = torch.tensor([ids[w * n:(w + 1) * n]])
            logits = model(input_ids=x).logits[0].double()
            lp = torch.log_softmax(logits[:-1], dim=-1)
            tgt = x[0, 1:]
            nll -= lp.gather(1, tgt[:, None]).sum().item()
            count += n - 1
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    for pkg in ("gptqmodel", "compressed_tensors", "peft"):
        try:
            versions[pkg] = __import__(pkg).__version__
        except Exception:  # noqa: BLE001 - a missing optional loader is reported, not fatal
            pass
    print(json.dumps({"ppl": math.exp(nll / count), "tokens_scored": count, "windows": windows,
                      "quant_linear": kinds, "versions": versions, "lora_tensors": lora_tensors}))


def cmd_build_quantize(args: argparse.Namespace) -> None:
    work = Path(args.work)
    build = work / "build"
    tool = build / "bin" / "llama-quantize"
    if tool.is_file():
        print(tool)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from llama_reference import cmake_build, unpack_llama_cpp

    src = unpack_llama_cpp(args.sdist, work)
    cmake_build(src, build, "llama-quantize", with_tools=True)
    if not tool.is_file():
        sys.exit(f"error: the llama.cpp build did not produce {tool}")
    print(tool)


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("ppl")
    p.add_argument("--model", required=True)
    p.add_argument("--text", required=True)
    p.add_argument("--seqlen", type=int, default=256)
    p.add_argument("--max-windows", type=int, default=0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--lora", default=None)
    b = sub.add_parser("build-quantize")
    b.add_argument("--sdist", required=True)
    b.add_argument("--work", required=True)
    args = ap.parse_args()
    {"ppl": cmd_ppl, "build-quantize": cmd_build_quantize}[args.cmd](args)


if __name__ == "__main__":
    main()
