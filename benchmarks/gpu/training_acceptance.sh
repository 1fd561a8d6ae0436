#!/usr/bin/env bash
# GPU acceptance of the Megatron integration (issue 3) and reliability (issue 9) on one 4-GPU host.
# Run on the device machine from the repo root:
#   source .device/env.sh && bash .device/setup.sh && bash benchmarks/gpu/training_acceptance.sh
# Two TP=2 jobs run side by side on GPUs 0,1 and 2,3 (correctness runs and TP=2 timings; the pairs share
# only the host), then the TP=4 runs use all four GPUs alone. Outputs under $OUT/r (tarred at the end).
set -u
R=${OUT:-/tmp/out}/r; mkdir -p "$R"
S=.megatron-lm/pretrain_gpt.py
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi -L > "$R/gpus.txt"; git rev-parse HEAD > "$R/commit.txt" 2>/dev/null; git status --short >> "$R/commit.txt"

el "phase 1: TP=2 Megatron runs (GPUs 0,1) | faults, FP8 state check, example (GPUs 2,3)"
( export CUDA_VISIBLE_DEVICES=0,1
  timeout 330 python3 benchmarks/megatron_autotune.py --script $S --gpus 2 --tp 2 --iters 20 --budget-s 40 \
      --deterministic --runs autotune,tuned_yaml,te_default,no_overlap --master-port 29500 --out "$R/megatron_tp2" \
      > "$R/megatron_tp2.log" 2>&1; echo "rc=$?" >> "$R/megatron_tp2.log" ) &
( export CUDA_VISIBLE_DEVICES=2,3
  MEGATRON_TP_OVERLAP_FAULTS="init:#2,step:#4,nan:#6,timeout:#8,rank=1/step:#10" \
  timeout 130 python3 benchmarks/megatron_autotune.py --script $S --gpus 2 --tp 2 --iters 8 --budget-s 40 \
      --deterministic --runs autotune --tag faults --master-port 29600 --out "$R/faults" \
      --extra "--tp-comm-overlap-autotune-trial-timeout 6" > "$R/faults.log" 2>&1; echo "rc=$?" >> "$R/faults.log"
  timeout 100 python3 benchmarks/megatron_autotune.py --script $S --gpus 2 --tp 2 --iters 8 --budget-s 25 --fp8 \
      --deterministic --runs autotune --tag fp8 --master-port 29600 --out "$R/fp8" > "$R/fp8.log" 2>&1
  echo "rc=$?" >> "$R/fp8.log"
  timeout 80 torchrun --nproc-per-node=2 --master-port=29600 examples/ln_mlp_with_overlap.py --check-numerics \
      --autotune --autotune-seconds 20 --benchmark > "$R/example_tp2_bf16.log" 2>&1; echo "rc=$?" >> "$R/example_tp2_bf16.log"
  timeout 50 torchrun --nproc-per-node=2 --master-port=29600 examples/ln_mlp_with_overlap.py --check-numerics --fp8 \
      > "$R/example_tp2_fp8.log" 2>&1; echo "rc=$?" >> "$R/example_tp2_fp8.log" ) &
wait
el "phase 2: TP=4 Megatron runs (all GPUs)"
LEFT=$(( 530 - ($(date +%s) - T0) ))
timeout $LEFT python3 benchmarks/megatron_autotune.py --script $S --gpus 4 --tp 4 --iters 20 --budget-s 40 \
    --deterministic --runs autotune,tuned_yaml,te_default,no_overlap --out "$R/megatron_tp4" > "$R/megatron_tp4.log" 2>&1
echo "rc=$?" >> "$R/megatron_tp4.log"
el "done"
tail -n 12 "$R"/megatron_tp2.log "$R"/megatron_tp4.log "$R"/faults.log "$R"/fp8.log
grep -h "PASSED\|FAILED\|^| \|rc=" "$R"/example_*.log
tar czf "${OUT:-/tmp/out}/training_acceptance.tgz" -C "$R" .
