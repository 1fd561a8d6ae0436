#!/usr/bin/env bash
# One device call of issue 46's real-step searches: set up, run search_on_real_steps.py under a hard limit on one or
# more GPUs at once (one search per GPU, each its own single-GPU run), score them, and keep everything under $OUT.
# Run on the GPU machine from the repository root:
#
#     LIM=seconds bash benchmarks/studies/real_steps_call.sh NAME "GPU|ARGS" ["GPU|ARGS" ...]
#
# e.g. LIM=520 bash benchmarks/studies/real_steps_call.sh sr17 "0|--shape hidden=4096,ffn=11008,heads=32,kv_groups=32 \
#      --first-seed 27600 --runs 2 --minutes 4.2". GPU g writes /tmp/NAME/gG/ and /tmp/NAME/gG.log. Needs .device/
# staged (../shared/device/prepare.sh) and Megatron-LM core_v0.19.0's pretrain_gpt.py, gpt_builders.py and
# model_provider.py in .device/megatron-lm/ (git show core_v0.19.0:FILE from a Megatron-LM clone). Slim copy for the
# repository: drop the logs' lines that start with two spaces (Megatron's arguments) and their
# "[search_on_real_steps] {" lines (the JSON repeats them), then tar | xz -9e.
# BESIDE="command": other work on the same host while the searches run, started over and over until they end (its
# output in /tmp/NAME/beside.log), e.g. BESIDE="CUDA_VISIBLE_DEVICES= python3 -m pytest -q -p no:cacheprovider tests"
# (results/2026-11-29_h200x2c/ sr46: on one GPU the whole step then waited on the host; decision_sim hostbusy models
# 2026-11-28_h200x4e's n2, whose forwards did).
# DEADLINE (default 575): seconds from this script's start by which the searches end, whatever LIM says, so that the
# scoring and the copy to $OUT fit in the device call's 600 s (sr47: a cold set-up plus LIM=545 passed 600, and the
# call came back empty).
set -uo pipefail
NAME=$1; shift
T_CALL=$(date +%s)
source .device/env.sh && bash .device/setup.sh || exit 1
LEFT=$(( ${DEADLINE:-575} - ($(date +%s) - T_CALL) ))
LIM=$(( LIM < LEFT ? LIM : LEFT ))
echo "set-up $(( $(date +%s) - T_CALL )) s; searches limited to $LIM s"
export PYTHONPATH=$PWD/.device/megatron-lm:${PYTHONPATH:-}
python3 -c "from megatron_tp_overlap.engine.search import SearchOptions; print(SearchOptions())"  # the defaults
t0=$(date +%s); PIDS=()
if [ -n "${BESIDE:-}" ]; then
  mkdir -p "/tmp/$NAME"
  setsid bash -c "while true; do $BESIDE || sleep 1; done" > "/tmp/$NAME/beside.log" 2>&1 &  # a failing one: not a busy loop
  BPID=$!
fi
for SPEC in "$@"; do
  GPU=${SPEC%%|*}; ARGS=${SPEC#*|}
  mkdir -p "/tmp/$NAME/g$GPU"
  # shellcheck disable=SC2086  # ARGS is a list of flags
  CUDA_VISIBLE_DEVICES=$GPU PET_MASTER_PORT=$((29600 + 10 * GPU)) timeout -k 5 "$LIM" python3 \
    benchmarks/studies/search_on_real_steps.py --script .device/megatron-lm/pretrain_gpt.py --seq 4096 \
    --gain-pct 0.5 3.0 $ARGS --out "/tmp/$NAME/g$GPU" > "/tmp/$NAME/g$GPU.log" 2>&1 &
  PIDS+=("$GPU:$!")
done
for P in "${PIDS[@]}"; do wait "${P#*:}"; echo "g${P%%:*} rc=$?"; done > "/tmp/$NAME/status.txt"  # 124: the limit cut it
echo "wall_s=$(( $(date +%s) - t0 ))" >> "/tmp/$NAME/status.txt"
if [ -n "${BESIDE:-}" ]; then
  kill -- -"$BPID" 2>/dev/null
  echo "beside: $(grep -c . "/tmp/$NAME/beside.log") lines of output" >> "/tmp/$NAME/status.txt"
fi
cat "/tmp/$NAME/status.txt"
python3 benchmarks/studies/real_steps_bar.py /tmp/"$NAME"/g*/ 2>&1 | tee "/tmp/$NAME/bar.md"
python3 benchmarks/studies/trial_precedent.py /tmp/"$NAME"/g*/ 2>&1 | tee "/tmp/$NAME/precedent.md"
python3 benchmarks/studies/look_neighbours.py /tmp/"$NAME"/g*/ 2>&1 | tee -a "/tmp/$NAME/precedent.md"
python3 benchmarks/studies/look_replay.py /tmp/"$NAME"/g*/ 2>&1 | tee -a "/tmp/$NAME/precedent.md"
# at most 8 files come back from $OUT (ht1 lost g1's JSON so): the folder as one tar, the tables beside it
tar -C /tmp -cf - "$NAME" | xz -1 > "$OUT/$NAME.tar.xz"
cp "/tmp/$NAME/status.txt" "/tmp/$NAME/bar.md" "/tmp/$NAME/precedent.md" "$OUT/"
for LOG in /tmp/"$NAME"/g*.log; do echo "== $LOG"; grep -v "^  \|\[search_on_real_steps\] {" "$LOG" | tail -25; done
cat "/tmp/$NAME/status.txt"  # again, last: the returned tail is the output's last 12,000 characters (sr46 lost these)
