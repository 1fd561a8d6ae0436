#!/usr/bin/env bash
# Follow-up runs for what changed after the 2026-11-21 GPU runs (one 4-GPU host, ~9 minutes):
#   source .device/env.sh && bash .device/setup.sh && bash benchmarks/gpu/followup.sh
# 1. the predecessor effect (3-5% on one config), 2. Megatron TP=4 with the calibrated numerics guard
# and the preset contender, 3. the example: FP8 at TP=4 and the interleaved --benchmark, 4. bench --sweep-m.
set -u
O=${OUT:-/tmp/out}; R=$O/r; mkdir -p "$R"
S=.megatron-lm/pretrain_gpt.py
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
git rev-parse HEAD > "$O/commit.txt" 2>/dev/null
el "predecessor effect (TP=4)"
timeout 120 torchrun --nproc-per-node=4 benchmarks/predecessor_effect.py --case llama3_8b --out "$R" > "$R/predecessor.log" 2>&1
el "Megatron TP=4: autotune, tuned YAML, TE default (deterministic)"
timeout 240 python3 benchmarks/megatron_autotune.py --script $S --gpus 4 --tp 4 --iters 20 --budget-s 45 --deterministic \
    --runs autotune,tuned_yaml,te_default --out "$R/megatron_tp4" > "$R/megatron_tp4.log" 2>&1
el "example: FP8 TP=4, bf16 TP=4 autotune + interleaved benchmark"
timeout 50 torchrun --nproc-per-node=4 examples/ln_mlp_with_overlap.py --check-numerics --fp8 > "$R/example_tp4_fp8.log" 2>&1
timeout 80 torchrun --nproc-per-node=4 examples/ln_mlp_with_overlap.py --check-numerics --autotune --autotune-seconds 20 \
    --benchmark > "$R/example_tp4_bf16.log" 2>&1
el "bench --sweep-m (TP=4)"
LEFT=$(( 540 - ($(date +%s) - T0) ))
timeout $(( LEFT > 10 ? LEFT : 5 )) megatron-tp-overlap bench ag 1024 49152 12288 --sweep-m 1024,2048,4096,8192 --iters 10 \
    --out "$R/bench_sweep" > "$R/bench_sweep.log" 2>&1
el done
grep -h "^|" "$R/predecessor.log" "$R/megatron_tp4.log" "$R/example_tp4_bf16.log" | head -30
grep -h "PASSED\|FAILED" "$R"/example_tp4_*.log | head -20
tar czf "$O/followup.tgz" -C "$R" .
