#!/usr/bin/env bash
# One prepared device call (docs/gpu.md): the GPU rows not measured yet (runs 10-11 measured the rest), each shape under its own
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
# image-conditioned, each against its diffusers pipeline given the same source image (FLOPs of one
# transformer forward counted on the meta device): Qwen-Image-Edit (a 1024 x 1024 source beside 512 px
# output: 120 TFLOP, 7.7x Qwen-Image's; ~220 s, the build of 20 B included), Wan2.2 I2V-A14B as
# T2V-A14B (~220 s; run 11's T2V-A14B row used 170 s before its trainer), TI2V-5B given a first frame.
# A row saves its JSON as it goes, the trainer last: a cap cuts that first.
run qwen_edit 240 --shape qwen_image_edit --skip-full --skip-embedded --skip-fused --prompts 1 --group-size 2 --repeats 1 --train-rows 1c
run wan22_i2v_a14b 220 --shape wan22_i2v_a14b --skip-full --skip-embedded --skip-fused --prompts 1 --group-size 2 --frames 17 --repeats 1 --train-rows 1c
run wan22_ti2v_image 120 --shape wan22_ti2v_5b_image --skip-full --skip-embedded --skip-fused --prompts 1 --group-size 2 --frames 17 --repeats 1 --train-rows 1c
# FLUX.1 Kontext's rollout ran 0.77x its pipeline with the adapters attached, 0.81x off (run 11): the
# folded rollout, with and without autocast, says how much of the gap is autocast's
run kontext_fused 170 --shape flux_kontext --skip-full --skip-embedded --prompts 1 --group-size 2 --repeats 1 --train-rows ""
# what the trainer rows left: SD3.5-M's step without autocast profiled in that setting (run 10's
# profile of it ran under autocast), then as runs train it (autocast) with its blocks compiled, the
# remedy for the elementwise kernels run 9 profiled (the first compile takes a minute or more);
# A14B's trainer on one expert; Flux above micro-batch 4
run sd35_compile 240 --shape sd35_medium --train-only --train-rows 16b,16k --repeats 2 --profile
run wan22_a14b_train 150 --shape wan22_a14b --train-only --prompts 1 --group-size 2 --frames 17 --repeats 1 --train-rows 1c
run flux_train 90 --shape flux_dev --train-only --train-rows 8 --repeats 1 --profile
echo "== total $(( $(date +%s) - START ))s" >> "$OUT/log.txt"
