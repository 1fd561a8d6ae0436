#!/usr/bin/env bash
# GPU acceptance of the Hydra main job (issue 4), the example (issue 5) and the kernel bench at TP=2
# (issue 6) on one 4-GPU host. Run on the device machine from the repo root:
#   source .device/env.sh && bash .device/setup.sh && bash benchmarks/gpu/app_and_example.sh
# Phase 1 runs two TP=2 jobs side by side (GPUs 0,1 and 2,3); phase 2 uses all four GPUs alone.
set -u
R=${OUT:-/tmp/out}/r; mkdir -p "$R"
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
git rev-parse HEAD > "$R/commit.txt" 2>/dev/null; git status --short >> "$R/commit.txt"
CACHE="$R/cache"

el "phase 1: main job TP=2 twice (GPUs 0,1) | bench TP=2 (GPUs 2,3)"
( export CUDA_VISIBLE_DEVICES=0,1
  for n in tp2_first tp2_second; do
    s=$(date +%s)
    timeout 200 torchrun --nproc-per-node=2 --master-port=29500 -m megatron_tp_overlap.train output.root="$R/runs" \
        output.name=$n tp_overlap.cache_dir="$CACHE" > "$R/train_$n.log" 2>&1
    echo "rc=$? wall_s=$(( $(date +%s) - s ))" >> "$R/train_$n.log"
  done ) &
( export CUDA_VISIBLE_DEVICES=2,3
  for spec in "ag 1024 12288 49152 --dtype float16" "rs 1024 49152 12288 --dtype float16" \
              "ag 4096 49152 12288 --dtype bfloat16" "rs 4096 12288 49152 --dtype bfloat16"; do
    tag=$(echo $spec | awk '{print $1"_"$2"_"$3"_"$4}')
    timeout 60 megatron-tp-overlap bench $spec --iters 10 --out "$R/bench_tp2/$tag" > "$R/bench_tp2_$tag.log" 2>&1
    echo "rc=$?" >> "$R/bench_tp2_$tag.log"
  done ) &
wait
el "phase 2: main job TP=4 twice + the override example (all GPUs)"
for n in tp4_first tp4_second; do
  s=$(date +%s)
  timeout 170 torchrun --nproc-per-node=4 -m megatron_tp_overlap.train output.root="$R/runs" output.name=$n \
      tp_overlap.cache_dir="$CACHE" > "$R/train_$n.log" 2>&1
  echo "rc=$? wall_s=$(( $(date +%s) - s ))" >> "$R/train_$n.log"
done
s=$(date +%s)
timeout 150 torchrun --nproc-per-node=4 -m megatron_tp_overlap.train model=llama3_8b model.num_layers=4 parallel.tp=4 \
    tp_overlap.budget_s=30 training.train_iters=20 output.root="$R/runs" output.name=tp4_llama3_8b \
    tp_overlap.cache_dir="$CACHE" > "$R/train_tp4_llama3_8b.log" 2>&1
echo "rc=$? wall_s=$(( $(date +%s) - s ))" >> "$R/train_tp4_llama3_8b.log"
el "phase 3: example at TP=4 and with 2 replicas"
LEFT=$(( 520 - ($(date +%s) - T0) ))
timeout $(( LEFT > 10 ? LEFT / 2 : 5 )) torchrun --nproc-per-node=4 examples/ln_mlp_with_overlap.py --num-replicas 2 \
    --check-numerics > "$R/example_replicas2.log" 2>&1; echo "rc=$?" >> "$R/example_replicas2.log"
LEFT=$(( 530 - ($(date +%s) - T0) ))
timeout $(( LEFT > 10 ? LEFT : 5 )) torchrun --nproc-per-node=4 examples/ln_mlp_with_overlap.py --check-numerics \
    --autotune --autotune-seconds 20 --benchmark > "$R/example_tp4_bf16.log" 2>&1; echo "rc=$?" >> "$R/example_tp4_bf16.log"
el "done"
grep -h "megatron-tp-overlap\]\|rc=" "$R"/train_*.log | grep -v "^\s*$" | tail -n 30
grep -h "PASSED\|FAILED\|^| \|rc=" "$R"/example_*.log "$R"/bench_tp2_*.log | head -n 60
tar czf "${OUT:-/tmp/out}/app_and_example.tgz" -C "$R" .
