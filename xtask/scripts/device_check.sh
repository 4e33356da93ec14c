#!/usr/bin/env bash
# The one-shot GPU check of deco (issue 13), prepared by `cargo xtask device-check` into
# device-check/ and run on the device machine from the repository root:
#
#   bash device-check/run.sh            (results under $OUT, else /tmp/deco-device-check)
#
# 1. the GPU (nvidia-smi) and its measured copy bandwidth (PyTorch device-to-device copy);
# 2. shape clones of SmolLM2-135M-Instruct Q4_1 and Qwen2.5-Coder-1.5B-Instruct Q4_K_M (real
#    header and tokenizer, random weights: xtask/scripts/gguf_shape_clone.py) written to /tmp;
# 3. per model: the CUDA path against the CPU path on the same weights (`deco eval kld
#    --device cuda --reference-device flex`: KL, top-1 agreement, both perplexities) on the
#    fidelity prompts (windows of 16 tokens) and on two 128-token windows of Wikipedia text;
# 4. per model: prefill and decode tok/s at batch 1 (`deco generate`, a 512-token prompt,
#    128 new tokens), then `deco serve --device cuda` with 16 and 64 concurrent streams;
# 5. summary.json: weight bytes per decoded token (every tensor but the token embedding, as
#    llama.cpp counts a token's reads) over the measured bandwidth = the decode limit, and the
#    fraction of it reached at batch 1.
# Budget: under 5 minutes on an H200 with the binary carried (no build there).
#
# Knobs (for a dry run on a CPU machine: DECO_DEVICE=flex MODELS=smollm2 STREAMS=4 REPEATS=1):
# DECO_DEVICE (cuda), MODELS ("smollm2 qwen1.5b"), STREAMS ("16 64"), REPEATS (3).
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-/tmp/deco-device-check}"
DEV="${DECO_DEVICE:-cuda}"
MODELS="${MODELS:-smollm2 qwen1.5b}"
STREAMS="${STREAMS:-16 64}"
REPEATS="${REPEATS:-3}"
mkdir -p "$OUT" /tmp/deco-models
DECO="$HERE/deco"
if [ -f "$HERE/deco.xz" ]; then
    # Carried compressed (the CUDA binary links LLVM statically).
    python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$HERE/deco.xz" /tmp/deco-bin
    DECO=/tmp/deco-bin
fi
chmod +x "$DECO"
say() { printf '\n==> [%s] %s\n' "$(date +%H:%M:%S)" "$*"; }
start=$(date +%s)
# cudarc loads libcuda / NVRTC at run time (the image's driver mount and CUDA toolkit). Its
# CUDA 12.8 bindings look for libnvrtc.so or libnvrtc.so.12; a CUDA 13 image may only have
# libnvrtc.so.13: link it as libnvrtc.so in a private folder. CUDA_PATH: where
# nvvm/libdevice/libdevice.10.bc lives (math functions).
mkdir -p /tmp/deco-cudalibs
export LD_LIBRARY_PATH="/tmp/deco-cudalibs:${LD_LIBRARY_PATH:-}:/usr/local/cuda/lib64:/usr/local/nvidia/lib64"
if ! ldconfig -p 2>/dev/null | grep -q 'libnvrtc.so '; then
    f=$(ls /usr/local/cuda/lib64/libnvrtc.so* /usr/local/cuda/targets/x86_64-linux/lib/libnvrtc.so* 2>/dev/null | grep -v builtins | head -1)
    [ -z "$f" ] && f=$(python3 -c "import glob, os, nvidia.cuda_nvrtc as m; print((sorted(glob.glob(os.path.join(list(m.__path__)[0], '**', 'libnvrtc.so*'), recursive=True)) + [''])[0])" 2>/dev/null)
    [ -n "$f" ] && ln -sf "$f" /tmp/deco-cudalibs/libnvrtc.so
fi
if [ -z "${CUDA_PATH:-}" ]; then
    d=$(ls -d /usr/local/cuda*/nvvm/libdevice 2>/dev/null | head -1)
    export CUDA_PATH="${d%/nvvm/libdevice}"
fi
{ echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"; echo "CUDA_PATH=$CUDA_PATH"; ls -l /tmp/deco-cudalibs; ldconfig -p 2>/dev/null | grep -E 'libcuda\.|libnvrtc'; ls "$CUDA_PATH/nvvm/libdevice" 2>/dev/null; } > "$OUT/cuda-env.txt" 2>&1

say "GPU"
if command -v nvidia-smi >/dev/null 2>&1; then
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.memory --format=csv | tee "$OUT/gpu.csv"
python3 - <<'EOF' | tee "$OUT/bandwidth.json"
import json, torch
n = 1 << 30  # 4 GiB of f32
a = torch.empty(n, device="cuda"); b = torch.empty_like(a)
for _ in range(3): b.copy_(a)
torch.cuda.synchronize()
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
s.record()
for _ in range(10): b.copy_(a)
e.record(); torch.cuda.synchronize()
sec = s.elapsed_time(e) / 1e3 / 10
print(json.dumps({"copy_bytes_read_plus_written": 8 * n, "seconds": sec, "gb_s": 8 * n / sec / 1e9, "device": torch.cuda.get_device_name()}))
EOF
else
    echo "no nvidia-smi: no GPU here (a dry run?)"
fi

for m in $MODELS; do
    say "$m: shape clone"
    python3 "$HERE/gguf_shape_clone.py" fill "$HERE/$m.header" "/tmp/deco-models/$m.gguf" || exit 1
    M="/tmp/deco-models/$m.gguf"
    say "$m: CUDA vs CPU on the same weights"
    timeout 120 "$DECO" eval kld --model "$M" --device "$DEV" --reference "$M" --reference-device flex \
        --text "$HERE/fidelity.txt" --seqlen 16 --max-windows 8 2>&1 | tee "$OUT/$m.kld-fidelity.txt"
    timeout 120 "$DECO" eval kld --model "$M" --device "$DEV" --reference "$M" --reference-device flex \
        --text "$HERE/wiki.txt" --seqlen 128 --max-windows 2 2>&1 | tee "$OUT/$m.kld.txt"
    say "$m: batch 1, 512-token prompt, 128 new tokens"
    for _ in $(seq 1 "$REPEATS"); do
        timeout 120 "$DECO" generate --model "$M" --device "$DEV" --prompt "$(cat "$HERE/prompt512.txt")" \
            --ignore-eos --max-new-tokens 128 --temperature 0 2>&1 >/dev/null | grep '^\[stats\]' | tee -a "$OUT/$m.batch1.txt"
    done
    say "$m: deco serve --device cuda, 16 and 64 streams"
    "$DECO" serve --model "$M" --device "$DEV" --port 8431 --served-model-name deco --kv-cache-mib 8192 \
        >"$OUT/$m.serve.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 120); do
        curl -sf http://127.0.0.1:8431/v1/models >/dev/null 2>&1 && break
        sleep 1
    done
    for n in $STREAMS; do
        timeout 150 python3 "$HERE/device_streams.py" 8431 "$n" 128 "$HERE/prompt128.txt" | tee -a "$OUT/$m.streams.jsonl"
    done
    kill "$pid"; wait "$pid" 2>/dev/null
done

say "summary"
MODELS="$MODELS" python3 - "$HERE" "$OUT" <<'EOF' | tee "$OUT/summary.json"
import json, os, statistics, sys
sys.path.insert(0, sys.argv[1])
import gguf_shape_clone as g
here, out = sys.argv[1:3]
try:
    bw = json.load(open(f"{out}/bandwidth.json"))["gb_s"] * 1e9
except Exception:
    bw = None  # no GPU: a dry run
res = {"bandwidth_gb_s": bw / 1e9 if bw else None}
for m in os.environ.get("MODELS", "smollm2 qwen1.5b").split():
    head = open(f"{here}/{m}.header", "rb").read()
    tensors, _, _ = g.parse(head)
    # The token embedding is read one row per token; a tied head reads it whole.
    tied = not any(n == "output.weight" for n, *_ in tensors)
    per_token = sum(g.nbytes(d, t) for name, d, t, _ in tensors if name != "token_embd.weight" or tied)
    r = {"weight_bytes_per_token": per_token, "limit_tok_s": bw / per_token if bw else None}
    try:
        stats = [dict(kv.split("=") for kv in l.split()[1:]) for l in open(f"{out}/{m}.batch1.txt")]
        r["prefill_tok_s"] = statistics.median(float(s["prompt_tok_s"]) for s in stats)
        r["decode_tok_s"] = statistics.median(float(s["decode_tok_s"]) for s in stats)
        r["fraction_of_limit"] = r["decode_tok_s"] / r["limit_tok_s"] if r["limit_tok_s"] else None
    except Exception as e:
        r["batch1_error"] = str(e)
    try:
        r["streams"] = [json.loads(l) for l in open(f"{out}/{m}.streams.jsonl")]
    except Exception as e:
        r["streams_error"] = str(e)
    res[m] = r
print(json.dumps(res, indent=1))
EOF
say "device check done in $(( $(date +%s) - start )) s"
