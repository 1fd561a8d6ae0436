#!/usr/bin/env bash
# The example after the "no overlap won" fix (TP=4 and TP=2, bf16, --autotune --benchmark), and the kernel bench at
# the GEMM shapes of a Llama-3-8B layer at TP=4, seq 8192 (which GEMMs can hide their communication). ~4 minutes:
#   source .device/env.sh && bash .device/setup.sh && bash benchmarks/gpu/example_and_layer_gemms.sh
set -u
O=${OUT:-/tmp/out}; R=$O/r; mkdir -p "$R"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
el "example TP=4 bf16 --check-numerics --autotune --benchmark"
timeout 100 torchrun --nproc-per-node=4 examples/ln_mlp_with_overlap.py --check-numerics --autotune --autotune-seconds 20 \
    --benchmark > "$R/example_tp4_bf16.log" 2>&1; echo "rc=$?"
el "example TP=2 bf16 --check-numerics --autotune --benchmark"
CUDA_VISIBLE_DEVICES=0,1 timeout 100 torchrun --nproc-per-node=2 examples/ln_mlp_with_overlap.py --check-numerics --autotune \
    --autotune-seconds 20 --benchmark > "$R/example_tp2_bf16.log" 2>&1; echo "rc=$?"
# Llama-3-8B layer, seq 8192, TP=4: qkv (N = 4096 + 2 x 1024), fc1 (N = 2 x 14336) all-gather into their GEMM;
# proj (K = 4096) and fc2 (K = 14336) reduce-scatter out of theirs.
for s in "ag 8192 6144 4096 qkv" "ag 8192 28672 4096 fc1" "rs 8192 4096 4096 proj" "rs 8192 4096 14336 fc2"; do
  set -- $s
  el "bench $1 $2 $3 $4 ($5)"
  timeout 90 megatron-tp-overlap bench $1 $2 $3 $4 --iters 20 --num-sm 8,16 --out "$R/bench_$5" > "$R/bench_$5.log" 2>&1; echo "rc=$?"
done
el done
grep -h "^|" "$R"/example_tp4_bf16.log "$R"/example_tp2_bf16.log
grep -h "PASSED\|FAILED" "$R"/example_tp*_bf16.log | sort | uniq -c | head
for f in "$R"/bench_*.log; do echo "== $f"; grep "^|" "$f" | head -20; done
tar czf "$O/example_layer_gemms.tgz" -C "$R" .
