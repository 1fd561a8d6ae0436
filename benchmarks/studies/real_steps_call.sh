#!/usr/bin/env bash
# One device call of issue 46's real-step searches: set up, run search_on_real_steps.py under a hard limit, score it,
# and keep everything under $OUT. Run on the GPU machine from the repository root:
#
#     LIM=seconds bash benchmarks/studies/real_steps_call.sh NAME "GPU|ARGS"
#
# e.g. LIM=520 bash benchmarks/studies/real_steps_call.sh sr17 "0|--shape hidden=4096,ffn=11008,heads=32,kv_groups=32 \
#      --first-seed 27600 --runs 2 --minutes 4.2". Needs .device/ staged (../shared/device/prepare.sh) and Megatron-LM
# core_v0.19.0's pretrain_gpt.py, gpt_builders.py and model_provider.py in .device/megatron-lm/ (git show
# core_v0.19.0:FILE from a Megatron-LM clone). Slim copy for the repository: drop the log's lines that start with two
# spaces (Megatron's arguments) and its "[search_on_real_steps] {" lines (the JSON repeats them), then tar | xz -9e.
set -uo pipefail
NAME=$1; SPEC=$2; GPU=${SPEC%%|*}; ARGS=${SPEC#*|}
source .device/env.sh && bash .device/setup.sh || exit 1
export PYTHONPATH=$PWD/.device/megatron-lm:${PYTHONPATH:-}
python3 -c "from megatron_tp_overlap.engine.search import SearchOptions; print(SearchOptions())"  # the defaults
mkdir -p "/tmp/$NAME/g0"
t0=$(date +%s)
# shellcheck disable=SC2086  # ARGS is a list of flags
CUDA_VISIBLE_DEVICES=$GPU timeout -k 5 "$LIM" python3 benchmarks/studies/search_on_real_steps.py \
  --script .device/megatron-lm/pretrain_gpt.py --seq 4096 --gain-pct 0.5 3.0 $ARGS --out "/tmp/$NAME/g0" \
  > "/tmp/$NAME/g0.log" 2>&1
echo "rc=$? wall_s=$(( $(date +%s) - t0 ))"
python3 benchmarks/studies/real_steps_bar.py "/tmp/$NAME/g0/" 2>&1 | tee "/tmp/$NAME/bar.md"
python3 benchmarks/studies/trial_precedent.py "/tmp/$NAME/g0/" 2>&1 | tee "/tmp/$NAME/precedent.md"
cp -r "/tmp/$NAME" "$OUT/"
grep -v "^  \|\[search_on_real_steps\] {" "/tmp/$NAME/g0.log" | tail -25
