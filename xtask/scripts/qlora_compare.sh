#!/bin/bash
# The attention vs MLP vs all-linear QLoRA comparison of docs/qlora.md, as it was run.
# Needs a release `deco` (DECO) and the model + data of `cargo xtask fetch` (DECO_CACHE).
# Sequential (one heavy job at a time); ~1.5 h on 2 cores. Results and logs in OUT.
set -eu
DECO=${DECO:-target/release/deco}
CACHE=${DECO_CACHE:-.cache}
OUT=${OUT:-$CACHE/qlora}
M=$CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf
DATA=$CACHE/data
STEPS=${STEPS:-40}
mkdir -p "$OUT/logs"
train() { # name r alpha modules
  [ -f "$OUT/$1/adapter_config.json" ] && return 0
  rm -rf "${OUT:?}/$1"
  "$DECO" lora train --model "$M" --quant nf4 --target-modules "$4" --r "$2" --alpha "$3" --dropout 0.05 \
    --steps "$STEPS" --batch-size 4 --seqlen 256 --lr 2e-4 --seed 0 --checkpoint-every 20 \
    --data "$DATA/gsm_train.jsonl" --out "$OUT/$1" > "$OUT/logs/train_$1.log" 2>&1
}
train attn 16 32 q_proj,k_proj,v_proj,o_proj
train mlp 16 32 gate_proj,up_proj,down_proj
train all 16 32 all-linear
train attn27 27 54 q_proj,k_proj,v_proj,o_proj   # attention with about the MLP's parameter count
[ -d "$OUT/nf4" ] || "$DECO" quantize --model "$M" --method nf4 --format fake --group-size 64 --out "$OUT/nf4" > "$OUT/logs/quantize_nf4.log" 2>&1
# label | model | adapter | --quant of `deco lora eval`
for run in "f32|$M||none" "nf4|$OUT/nf4||nf4" "nf4+attn|$OUT/nf4|$OUT/attn|nf4" "nf4+mlp|$OUT/nf4|$OUT/mlp|nf4" \
           "nf4+all|$OUT/nf4|$OUT/all|nf4" "nf4+attn27|$OUT/nf4|$OUT/attn27|nf4" "f32+all|$M|$OUT/all|none"; do
  IFS='|' read -r label model lora quant <<< "$run"
  la=(); [ -n "$lora" ] && la=(--lora "$lora")
  "$DECO" eval ppl --model "$model" "${la[@]}" --text "$DATA/wiki_test.txt" --seqlen 256 --max-windows 4 --max-chars 20000 > "$OUT/logs/ppl_$label.log" 2>&1
  "$DECO" lora eval --model "$M" --quant "$quant" "${la[@]}" --data "$DATA/gsm_eval.jsonl" --limit 50 --batch-size 4 --seqlen 512 > "$OUT/logs/loss_$label.log" 2>&1
  "$DECO" autodeco eval --model "$model" "${la[@]}" --data "$DATA/gsm_eval.jsonl" --temperature 0 --limit 50 --max-new-tokens 200 --batch 25 \
    --label "$label" --outputs "$OUT/logs/gsm_$label.jsonl" > "$OUT/logs/gsm_$label.log" 2>&1
  echo "$label: $(grep -h 'ppl=' "$OUT/logs/ppl_$label.log") $(grep -h 'answer_loss=' "$OUT/logs/loss_$label.log") $(grep -o '"pass@1":[0-9.]*' "$OUT/logs/gsm_$label.log")"
done
