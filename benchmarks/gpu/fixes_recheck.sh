#!/usr/bin/env bash
# Re-runs after the fixes for what training_acceptance.sh found (TP=2 tuned YAML crash, faults run
# hang, FP8 state check, example --fp8). Pairs of GPUs side by side; one tarball per pair.
#   source .device/env.sh && bash .device/setup.sh && bash benchmarks/gpu/fixes_recheck.sh
set -u
O=${OUT:-/tmp/out}; R=$O/r; mkdir -p "$R"
S=.megatron-lm/pretrain_gpt.py
git rev-parse HEAD > "$O/commit.txt" 2>/dev/null
( export CUDA_VISIBLE_DEVICES=0,1; mkdir -p "$R/a"
  timeout 110 python3 benchmarks/megatron_autotune.py --script $S --gpus 2 --tp 2 --iters 20 --budget-s 30 \
      --deterministic --runs autotune,tuned_yaml --master-port 29500 --out "$R/a/megatron_tp2" > "$R/a/megatron_tp2.log" 2>&1
  echo "rc=$?" >> "$R/a/megatron_tp2.log"
  timeout 40 torchrun --nproc-per-node=2 --master-port=29500 examples/ln_mlp_with_overlap.py --check-numerics --fp8 \
      > "$R/a/example_tp2_fp8.log" 2>&1; echo "rc=$?" >> "$R/a/example_tp2_fp8.log"
  tar czf "$O/pair_a.tgz" -C "$R/a" . ) &
( export CUDA_VISIBLE_DEVICES=2,3; mkdir -p "$R/b"
  MEGATRON_TP_OVERLAP_FAULTS="init:#2,step:#4,nan:#6,timeout:#8,rank=1/step:#10" \
  timeout 95 python3 benchmarks/megatron_autotune.py --script $S --gpus 2 --tp 2 --iters 6 --budget-s 30 \
      --deterministic --runs autotune --tag faults --master-port 29600 --out "$R/b/faults" \
      --extra "--tp-comm-overlap-autotune-trial-timeout 5" > "$R/b/faults.log" 2>&1; echo "rc=$?" >> "$R/b/faults.log"
  timeout 75 python3 benchmarks/megatron_autotune.py --script $S --gpus 2 --tp 2 --iters 6 --budget-s 15 --fp8 \
      --deterministic --runs autotune --tag fp8 --master-port 29600 --out "$R/b/fp8" > "$R/b/fp8.log" 2>&1
  echo "rc=$?" >> "$R/b/fp8.log"
  tar czf "$O/pair_b.tgz" -C "$R/b" . ) &
wait
tail -n 8 "$R"/a/megatron_tp2.log "$R"/b/faults.log "$R"/b/fp8.log
grep -h "PASSED\|FAILED\|rc=" "$R"/a/example_tp2_fp8.log
