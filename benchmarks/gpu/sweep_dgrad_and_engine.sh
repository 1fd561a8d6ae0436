#!/usr/bin/env bash
# After `sweep --dgrad-mode` and the shared layer_bench.step_and_fingerprint (one 4-GPU host, ~6 minutes):
#   source .device/env.sh && bash .device/setup.sh && bash benchmarks/gpu/sweep_dgrad_and_engine.sh
# 1. sweep Llama-3-8B with --dgrad-mode bulk: a YAML one Megatron-LM run can use at every TP size;
# 2. the engine at TP=4 (benchmarks/engine_tune.py, 30 s budget); 3. the GPU tests on GPUs 0,1.
set -u
O=${OUT:-/tmp/out}; R=$O/r; mkdir -p "$R"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
el "sweep Llama-3-8B --dgrad-mode bulk"
timeout 200 megatron-tp-overlap sweep --model meta-llama/Meta-Llama-3-8B --max-tp-size 4 --max-token-len 8192 \
    --operators qkv proj fc1 fc2 --layers 2 --budget-s 20 --dgrad-mode bulk --out "$R/sweep_bulk" > "$R/sweep_bulk.log" 2>&1
echo "sweep rc=$?"
el "engine TP=4"
timeout 150 torchrun --nproc-per-node=4 benchmarks/engine_tune.py --budget-s 30 --check-flags --out "$R/engine_tp4" \
    > "$R/engine_tp4.log" 2>&1; echo "engine rc=$?"
el "pytest -m gpu"
CUDA_VISIBLE_DEVICES=0,1 timeout 150 python3 -m pytest -m gpu -q -x tests/ > "$R/pytest_gpu.log" 2>&1; echo "pytest rc=$?"
el done
grep -h "^|\|^TP=" "$R/sweep_bulk.log" | tail -8; grep -h "^|" "$R/engine_tp4.log" | tail -12; tail -3 "$R/pytest_gpu.log"
tar czf "$O/sweep_dgrad_and_engine.tgz" -C "$R" .
