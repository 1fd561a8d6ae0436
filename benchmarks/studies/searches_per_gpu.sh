#!/usr/bin/env bash
# One-GPU searches side by side, one per GPU of a multi-GPU machine (each its own process and master port), so a
# 2-GPU lease runs two of search_on_real_steps.py's one-GPU studies at once:
#   SEARCH_ARGS="--shape ... --seq 4096 --gain-pct 1.0 3.0" \
#     bash benchmarks/studies/searches_per_gpu.sh OUT MINUTES "NAME|FIRST_SEED|MEGATRON ARGS" ...
# Spec i runs on GPU i; logs in OUT/NAME.log, results in OUT/NAME/.
set -u
out=$1 minutes=$2
shift 2
mkdir -p "$out"
gpu=0
for spec in "$@"; do
  IFS='|' read -r name seed extra <<<"$spec"
  # shellcheck disable=SC2086 # SEARCH_ARGS is a list of arguments
  CUDA_VISIBLE_DEVICES=$gpu PET_MASTER_PORT=$((29600 + 10 * gpu)) python3 benchmarks/studies/search_on_real_steps.py \
    --script .device/megatron-lm/pretrain_gpt.py $SEARCH_ARGS --extra="$extra" --first-seed "$seed" \
    --minutes "$minutes" --out "$out/$name" >"$out/$name.log" 2>&1 &
  gpu=$((gpu + 1))
done
wait
for spec in "$@"; do
  name=${spec%%|*}
  echo "== $name"
  tail -n 4 "$out/$name.log"
done
