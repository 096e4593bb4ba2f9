#!/usr/bin/env bash
# One prepared device call (docs/gpu.md): the GPU rows not measured yet, each shape under its own
# time cap inside one deadline, every JSON written to $OUT as it goes (a cap loses only the rows
# after it). Carry the wheels the machine lacks in .gpu/whl (docs/gpu.md, "Carrying what the GPU
# machine lacks"); run from the repository root:  BUDGET_S=560 bash benchmarks/gpu_call.sh
# Seen on an H200: building SD3.5-M's shape and generating its batch takes about 40 s, Qwen-Image's
# (20 B) over 100 s; a trainer row with --profile about 2-3 steps' time more.
set -u
OUT=${OUT:-benchmarks/results/gpu/next}; mkdir -p "$OUT"
START=$(date +%s); DEADLINE=$((START + ${BUDGET_S:-560}))
if [ -d .gpu/whl ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export HF_HUB_OFFLINE=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
run() {  # run NAME CAP_S ARGS...: benchmarks/gpu.py under min(CAP_S, time left)
  local name=$1 cap=$2; shift 2
  local left=$((DEADLINE - $(date +%s)))
  [ $left -lt 40 ] && { echo "== $name: skipped, ${left}s left" >> "$OUT/log.txt"; return; }
  [ $cap -gt $left ] && cap=$left
  echo "== $name (cap ${cap}s): $*" >> "$OUT/log.txt"
  local t0=$(date +%s)
  timeout -k 5 $cap python3 benchmarks/gpu.py "$@" --out "$OUT/$name.json" >> "$OUT/log.txt" 2>&1
  echo "== $name: exit $? after $(( $(date +%s) - t0 ))s" >> "$OUT/log.txt"
}
run qwen_train 180 --shape qwen_image --train-only --prompts 1 --group-size 4 --train-rows 4,1c --repeats 1
run wan22_ti2v_5b 120 --shape wan22_ti2v_5b --skip-full --skip-embedded --skip-fused --prompts 1 --group-size 4 --repeats 1 --train-rows 4,1c
run wan22_a14b 170 --shape wan22_a14b --skip-full --skip-embedded --skip-fused --prompts 1 --group-size 2 --frames 17 --repeats 1 --train-rows 1c
run flux_train 90 --shape flux_dev --train-only --train-rows 8 --repeats 1 --profile
echo "== total $(( $(date +%s) - START ))s" >> "$OUT/log.txt"
