#!/usr/bin/env bash
# `sweep --dgrad-mode reduce-scatter` after the tuner moves a reference outside the dgrad mode into it, and
# layer_bench never choosing per-GEMM "no overlap" (no YAML form). One 4-GPU host, ~2.5 minutes:
#   source .device/env.sh && bash .device/setup.sh && bash benchmarks/gpu/sweep_rs_dgrad.sh
set -u
O=${OUT:-/tmp/out}; R=$O/r; mkdir -p "$R"
timeout 230 megatron-tp-overlap sweep --model meta-llama/Meta-Llama-3-8B --max-tp-size 4 --max-token-len 8192 \
    --operators qkv proj fc1 fc2 --layers 2 --budget-s 20 --dgrad-mode reduce-scatter --out "$R/sweep_rs" \
    > "$R/sweep_rs.log" 2>&1; echo "sweep rc=$?"
grep -h "tp-overlap-autotune\] the reference\|Traceback\|Error" "$R/sweep_rs.log" | head -5
tail -8 "$R/sweep_rs/summary.txt"; head -30 "$R/sweep_rs/optimal_tp_comm_overlap_cfg_tp2.yaml"
tar czf "$O/sweep_rs.tgz" -C "$R" .
