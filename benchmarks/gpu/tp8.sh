#!/usr/bin/env bash
# Issue 10 (TP=8 on one 8-GPU node; needs nvidia-h200-x8), ~9 minutes:
#   source .device/env.sh && bash .device/setup.sh && bash benchmarks/gpu/tp8.sh
# 1. the performance benchmark, Llama-3-70B-like layers at seq 8192; 2. the Megatron training run with
# autotune vs the tuned YAML vs TE default (deterministic, bitwise loss comparison).
set -u
O=${OUT:-/tmp/out}; R=$O/r; mkdir -p "$R"
git rev-parse HEAD > "$O/commit.txt" 2>/dev/null
timeout 300 torchrun --nproc-per-node=8 benchmarks/overlap_vs_baselines.py --cases llama3_70b_seq8192 --layers 2 \
    --budget-s 45 --no-exhaustive --out "$R" > "$R/ovb_tp8.log" 2>&1
timeout 260 python3 benchmarks/megatron_autotune.py --script .megatron-lm/pretrain_gpt.py --gpus 8 --tp 8 --iters 20 \
    --budget-s 45 --deterministic --runs autotune,tuned_yaml,te_default --out "$R/megatron_tp8" > "$R/megatron_tp8.log" 2>&1
grep -h "^|" "$R/ovb_tp8.log" "$R/megatron_tp8.log" | tail -20
tar czf "$O/tp8.tgz" -C "$R" .
