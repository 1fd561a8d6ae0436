"""Where a switch's host seconds go besides TE's re-init, inside Megatron-LM's process on one GPU (TP=1).

    python benchmarks/studies/switch_cost.py --script .device/megatron-lm/pretrain_gpt.py --out DIR

A userbuffers switch collects garbage (``gc.collect()``: an old autograd graph holding a communicator must die
first), synchronizes the device, re-initializes (``--idle-s`` here: no userbuffers at TP=1) and the next trial starts
with a warm-up step. With the tuner's own 1-micro-batch trial step (``MegatronSteps.step``) this times, ``--repeats``
times each: one ``gc.collect()`` with the heap as Megatron leaves it and with it frozen (``engine.heap.frozen``, as
tuning runs), the device sync after it, and the wall and GPU time of a step right after ``--idle-s`` of idle against
one right after another step. It also counts the objects the collector tracks.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # the studies, then the benchmarks they build on


def measure(steps, repeats: int, idle_s: float) -> dict:
    import torch

    from megatron_tp_overlap.engine import heap

    def timed(fn) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    def step_times() -> tuple[float, float]:
        """(wall s, GPU ms) of one step, waited for."""
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        a.record()
        steps.step()
        b.record()
        b.synchronize()
        return time.perf_counter() - t, a.elapsed_time(b)

    def rounds() -> dict:
        out: dict = {"collect_s": [], "sync_s": [], "after_idle": [], "after_step": []}
        for _ in range(repeats):
            out["collect_s"].append(timed(gc.collect))
            out["sync_s"].append(timed(torch.cuda.synchronize))
            time.sleep(idle_s)
            out["after_idle"].append(step_times())
            out["after_step"].append(step_times())
        return out

    for _ in range(10):
        steps.step()
    torch.cuda.synchronize()
    result = {"idle_s": idle_s, "freeze_count_at_start": gc.get_freeze_count(), "tracked": len(gc.get_objects())}
    result["unfrozen"] = rounds()
    with heap.frozen():
        result["tracked_frozen"] = len(gc.get_objects())  # the collector's view: frozen objects are not in it
        result["frozen"] = rounds()
    return result


def summary(result: dict) -> str:
    rows = [
        f"objects tracked by the collector: {result['tracked']} (frozen: {result['tracked_frozen']}); "
        f"freeze count at start {result['freeze_count_at_start']}; idle {result['idle_s']} s",
        "| heap | gc.collect() s | device sync s | step after idle: wall s / GPU ms | step after a step: wall s / GPU ms |",
        "|---|---|---|---|---|",
    ]
    med = statistics.median
    for heap_state in ("unfrozen", "frozen"):
        r = result[heap_state]
        rows.append(
            f"| {heap_state} | {med(r['collect_s']):.4f} | {med(r['sync_s']):.4f} | "
            f"{med(w for w, _ in r['after_idle']):.4f} / {med(g for _, g in r['after_idle']):.2f} | "
            f"{med(w for w, _ in r['after_step']):.4f} / {med(g for _, g in r['after_step']):.2f} |"
        )
    return "\n".join(rows)


def inner(out: Path, repeats: int, idle_s: float, argv: list[str]) -> None:
    from megatron_autotune import on_trial_steps

    on_trial_steps(argv, out / "switch_cost.json", lambda steps: measure(steps, repeats, idle_s))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--script", help="Megatron-LM's pretrain_gpt.py (core_v0.19.0)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--idle-s", type=float, default=0.35, help="the re-init's host seconds (TP=2: ~0.33-0.41)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--shape", default="", help="model keys of benchmarks/megatron_autotune.MODEL, e.g. hidden=5120")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    a, rest = p.parse_known_args()
    out = Path(a.out)
    if a.inner:
        inner(out, a.repeats, a.idle_s, rest)
        return
    from megatron_autotune import one_gpu_args, parse_model_shape

    shape = parse_model_shape(a.shape)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", __file__, "--inner", "--out", str(out)]
    cmd += ["--repeats", str(a.repeats), "--idle-s", str(a.idle_s), a.script, *one_gpu_args(a.seq, 10, **shape)]
    print(" ".join(cmd), flush=True)
    rc = subprocess.run(cmd).returncode
    text = summary(json.loads((out / "switch_cost.json").read_text()))
    (out / "switch_cost.md").write_text(text + "\n")
    print(text)
    sys.exit(rc)


if __name__ == "__main__":
    main()
