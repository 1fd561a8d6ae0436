#!/usr/bin/env bash
# Issue 6's remaining acceptance runs, then re-runs of what changed since the last GPU runs. One 4-GPU host,
# ~5 minutes (311 s on 2026-11-21):
#   source .device/env.sh && bash .device/setup.sh && bash benchmarks/gpu/bench_seed_bf16.sh
# 1. the seed shapes in bf16 (they ran in fp16 on 2026-11-21, where TE's userbuffers reduce-scatter is wrong by
#    design), at TP=4 (all GPUs) and TP=2 (GPUs 0,1 alone), every backend;
# 2. the TE knob lists on Flux's reduce-scatter shape at TP=4 (pipeline: num_sm x num_splits x cga_size);
# 3. `sweep` (Llama-3-8B): the Megatron flags in every YAML, interleaved comparison of equal configs;
# 4. the main job at TP=2 with a short budget: our scalars in Megatron's TensorBoard events.
set -u
O=${OUT:-/tmp/out}; R=$O/r; mkdir -p "$R"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
for tp in 4 2; do
  devs=$([ $tp = 4 ] && echo 0,1,2,3 || echo 0,1)
  el "seed shapes bf16 TP=$tp"
  CUDA_VISIBLE_DEVICES=$devs timeout 100 megatron-tp-overlap bench ag 1024 12288 49152 --dtype bfloat16 --iters 10 \
      --out "$R/seed_ag_tp$tp" > "$R/seed_ag_tp$tp.log" 2>&1; echo "ag tp=$tp rc=$?"
  CUDA_VISIBLE_DEVICES=$devs timeout 100 megatron-tp-overlap bench rs 1024 49152 12288 --dtype bfloat16 --iters 10 \
      --out "$R/seed_rs_tp$tp" > "$R/seed_rs_tp$tp.log" 2>&1; echo "rs tp=$tp rc=$?"
done
el "knob lists, RS Flux shape TP=4"
timeout 120 megatron-tp-overlap bench rs 4096 12288 49152 --dtype bfloat16 --iters 10 --num-sm 8,16,32 \
    --num-splits 2,4,8 --cga-size 1,2 --out "$R/knobs_rs_tp4" > "$R/knobs_rs_tp4.log" 2>&1; echo "knobs rc=$?"
el "sweep Llama-3-8B"
timeout 170 megatron-tp-overlap sweep --model meta-llama/Meta-Llama-3-8B --max-tp-size 4 --max-token-len 8192 \
    --operators qkv proj fc1 fc2 --layers 2 --budget-s 20 --out "$R/sweep_llama3_8b" > "$R/sweep.log" 2>&1; echo "sweep rc=$?"
el "main job TP=2, TensorBoard"
CUDA_VISIBLE_DEVICES=0,1 timeout 120 torchrun --nproc-per-node=2 -m megatron_tp_overlap.train output.root="$R/runs" \
    output.name=tb tp_overlap.cache_dir="$R/cache" tp_overlap.budget_s=20 training.train_iters=10 \
    > "$R/train_tb.log" 2>&1; echo "train rc=$?"
python3 - "$R/runs/tb" > "$R/tensorboard_tags.txt" 2>&1 <<'PY'
import sys, glob
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
for f in sorted(glob.glob(sys.argv[1] + "/**/events.out.tfevents*", recursive=True)):
    ea = EventAccumulator(f, size_guidance={"scalars": 0, "tensors": 0}); ea.Reload()
    tags = ea.Tags()
    ours = [t for t in tags.get("scalars", []) if t.startswith("tp-overlap-autotune")]
    print(f, "scalars:", len(tags.get("scalars", [])), "ours:", len(ours), "text:", [t for t in tags.get("tensors", []) if "tp-overlap" in t])
    for t in ours: print("  ", t, [round(e.value, 3) for e in ea.Scalars(t)])
PY
el done
for f in "$R"/seed_*.log "$R"/knobs_rs_tp4.log; do echo "== $f"; grep "^|" "$f" | cut -c1-150; done
grep -h "^|" "$R/sweep.log" | tail -8; cat "$R/tensorboard_tags.txt" | head -20
tar czf "$O/session4.tgz" -C "$R" --exclude='*.pt' --exclude='checkpoints' .
ls -la "$O"
