#!/usr/bin/env bash
# Issue 6's remaining acceptance runs: the seed shapes in bf16 (they ran in fp16 on 2026-11-21, where TE's
# userbuffers reduce-scatter is wrong by design), at TP=4 and TP=2, every backend. ~3 minutes on one 4-GPU host:
#   source .device/env.sh && bash .device/setup.sh && bash benchmarks/gpu/bench_seed_bf16.sh
set -u
O=${OUT:-/tmp/out}; R=$O/r; mkdir -p "$R"
for tp in 4 2; do
  devs=$([ $tp = 4 ] && echo 0,1,2,3 || echo 0,1)
  CUDA_VISIBLE_DEVICES=$devs timeout 120 megatron-tp-overlap bench ag 1024 12288 49152 --dtype bfloat16 --iters 10 \
      --out "$R/seed_ag_tp$tp" > "$R/seed_ag_tp$tp.log" 2>&1; echo "ag tp=$tp rc=$?"
  CUDA_VISIBLE_DEVICES=$devs timeout 120 megatron-tp-overlap bench rs 1024 49152 12288 --dtype bfloat16 --iters 10 \
      --out "$R/seed_rs_tp$tp" > "$R/seed_rs_tp$tp.log" 2>&1; echo "rs tp=$tp rc=$?"
done
for f in "$R"/seed_*.log; do echo "== $f"; grep "^|" "$f"; done
tar czf "$O/bench_seed_bf16.tgz" -C "$R" .
