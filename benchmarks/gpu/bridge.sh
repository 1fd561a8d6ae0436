#!/usr/bin/env bash
# Megatron-Bridge 0.6.2 with the autotune comm-overlap config, TP=2 on GPUs 0,1 (issue 11). Needs the machine set up by
# .device/setup.sh (TE, megatron-core) and Bridge's wheels staged in .bridge/wheels (see README, "Megatron-Bridge"):
#   bash benchmarks/gpu/bridge.sh
set -u
export CUDA_DEVICE_MAX_CONNECTIONS=1 UB_SKIPMC=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 NVTE_FRAMEWORK=pytorch
O=${OUT:-/tmp/out}; R=$O/r; mkdir -p "$R"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
python3 -c "import transformer_engine.pytorch, megatron.core" 2>/dev/null || { echo "TE/megatron-core missing: run .device/setup.sh first"; exit 3; }
python3 -m pip install -q --no-index --no-deps .bridge/wheels/*.whl 2>&1 | grep -vi warning
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | grep -vi warning
python3 -c "import megatron.bridge, megatron.bridge.training.pretrain; print('megatron-bridge', megatron.bridge.__version__)" 2>&1 | tail -3
for run in ${RUNS:-auto default}; do
  el "Bridge TP=2: $run"
  extra=""; [ $run = default ] && extra="--no-autotune"
  CUDA_VISIBLE_DEVICES=0,1 timeout 200 torchrun --nproc-per-node=2 --master-port 29511 benchmarks/bridge_autotune.py --tp 2 \
      --layers 4 --seq 8192 --iters 15 $extra --out "$R/$run" -- comm_overlap.tp_comm_overlap_autotune_seconds=20 \
      > "$R/bridge_$run.log" 2>&1; echo "rc=$?"
done
el done
for run in ${RUNS:-auto default}; do echo "== $run"; grep -h "Traceback\|Error\|bridge run:\|tp-overlap-autotune\]" "$R/bridge_$run.log" | head -12
  grep -h "iteration *[0-9]*/" "$R/bridge_$run.log" | tail -3; done
tar czf "$O/bridge.tgz" -C "$R" .
