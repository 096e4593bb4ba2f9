#!/usr/bin/env bash
# One prepared device call (docs/gpu.md): the GPU rows not measured yet (runs 10-13 measured the rest), each shape under its own
# time cap inside one deadline, every JSON written to $OUT as it goes (a cap loses only the rows
# after it). Carry the wheels the machine lacks in .gpu/whl (docs/gpu.md, "Carrying what the GPU
# machine lacks"); run from the repository root:  BUDGET_S=560 bash benchmarks/gpu_call.sh
# ROWS="name ..." runs only those rows, in this file's order (the image-conditioned families first:
# a call whose earlier rows use their caps leaves the later ones to the next).
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
  [ -n "${ROWS:-}" ] && [[ " $ROWS " != *" $name "* ]] && return
  local left=$((DEADLINE - $(date +%s)))
  [ $left -lt 40 ] && { echo "== $name: skipped, ${left}s left" >> "$OUT/log.txt"; return; }
  [ $cap -gt $left ] && cap=$left
  echo "== $name (cap ${cap}s): $*" >> "$OUT/log.txt"
  local t0=$(date +%s)
  timeout -k 5 $cap python3 benchmarks/gpu.py "$@" --out "$OUT/$name.json" >> "$OUT/log.txt" 2>&1
  echo "== $name: exit $? after $(( $(date +%s) - t0 ))s" >> "$OUT/log.txt"
}
# Runs 12-13 measured Qwen-Image-Edit (rollout 0.59x its pipeline), TI2V-5B with a first frame, SD3.5-M
# compiled (blocks past dynamo's recompile limit ran eager) and Flux at micro-batch 8. Left, in the order
# users would ask: the edit rollouts again after the changes that followed run 12 (Qwen-Image-Edit's build
# of 20 B and its pipeline take ~130 s); Kontext's folded rollout, with and without autocast (its speeds
# are saved before the trainer's three comparison steps, which a cap may cut); SD3.5-M compiled with the
# recompile limit raised (trainer.compile), and its rollout compiled (rollout.compile); Wan2.2 I2V-A14B as T2V-A14B (~220 s) and A14B's trainer on one expert.
run qwen_edit 200 --shape qwen_image_edit --skip-full --skip-embedded --skip-fused --prompts 1 --group-size 2 --repeats 1 --train-rows ""
run kontext_fused 200 --shape flux_kontext --skip-full --skip-embedded --prompts 1 --group-size 2 --repeats 1 --train-rows ""
run sd35_compile 150 --shape sd35_medium --train-only --train-rows 16k --repeats 2 --profile
run sd35_rollout_compile 150 --shape sd35_medium --skip-full --skip-embedded --skip-fused --repeats 2 --train-rows "" --rollout-compile
# a reward model on the rollout's GPU: PickScore's CLIP ViT-H/14 (random weights) scoring a rollout worker's groups,
# reward.overlap on and off (the worker as a rollout actor runs it, without Ray, which does not fit in a call's upload)
run sd35_reward 200 --shape sd35_medium --prompts 1 --group-size 8 --repeats 2 --reward-model clip_h --reward-groups 4
run wan22_i2v_a14b 220 --shape wan22_i2v_a14b --skip-full --skip-embedded --skip-fused --prompts 1 --group-size 2 --frames 17 --repeats 1 --train-rows 1c
run wan22_a14b_train 150 --shape wan22_a14b --train-only --prompts 1 --group-size 2 --frames 17 --repeats 1 --train-rows 1c
echo "== total $(( $(date +%s) - START ))s" >> "$OUT/log.txt"
