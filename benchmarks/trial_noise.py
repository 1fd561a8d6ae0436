"""Where the noise of tuning's trial steps comes from, on one GPU: Megatron-LM's own ``pretrain_gpt.py`` with the
tuner's trial step (``MegatronSteps.step``: Megatron's forward_backward_func on read-ahead micro-batches, no
optimizer step), in the pattern tuning runs it, and per step what might explain a slow one.

    python benchmarks/trial_noise.py --script .device/megatron-lm/pretrain_gpt.py --out DIR

Two phases on the same model, after 10 warm steps:

- ``trials``: ``--trials`` times a simulated switch (one ``gc.collect()``, a device sync and ``--idle-s`` of host
  work with the GPU idle, as a userbuffers re-init leaves it; no userbuffers: TP=1) then 4 steps (the warm-up and
  the 3 timed steps of a screening trial), with ``gc.freeze()`` as during tuning;
- ``steady``: as many steps back to back, nothing in between.

Per step: GPU time (CUDA events, ms), host wall time, Python GC runs by generation, the SM clock and power (NVML)
read right after the step, and the CUDA allocator's device allocations. Writes ``trial_noise.json`` and prints
the step time by position since the switch, against the steady phase.
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
sys.path.insert(0, str(HERE))
STEPS_PER_TRIAL = 4  # 1 warm-up + 3 timed: a screening trial


def _nvml():
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(int(os.environ.get("LOCAL_RANK", "0")))
        return lambda: (
            pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
            pynvml.nvmlDeviceGetPowerUsage(h) / 1e3,
        )
    except Exception:  # noqa: BLE001 - no NVML: clocks not recorded
        return lambda: (None, None)


def profile(steps, trials: int, idle_s: float) -> dict:
    import torch

    read = _nvml()
    gc_runs = [0, 0, 0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_runs[info["generation"]] += 1

    gc.callbacks.append(on_gc)

    def one(phase: str, position: int) -> dict:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        runs, allocs = list(gc_runs), torch.cuda.memory_stats().get("num_device_alloc", 0)
        t = time.perf_counter()
        start.record()
        steps.step()
        end.record()
        end.synchronize()
        wall = 1e3 * (time.perf_counter() - t)
        clock, power = read()
        return {
            "phase": phase,
            "position": position,
            "gpu_ms": start.elapsed_time(end),
            "wall_ms": wall,
            "gc_runs": [a - b for a, b in zip(gc_runs, runs)],
            "sm_clock_mhz": clock,
            "power_w": power,
            "device_allocs": torch.cuda.memory_stats().get("num_device_alloc", 0) - allocs,
        }

    for _ in range(10):
        steps.step()
    torch.cuda.synchronize()
    gc.collect()
    gc.freeze()  # as tuning does
    records = []
    for _ in range(trials):
        gc.collect()
        torch.cuda.synchronize()
        time.sleep(idle_s)  # the re-init's host work; the GPU idles
        records += [one("trials", p) for p in range(STEPS_PER_TRIAL)]
    records += [one("steady", i % STEPS_PER_TRIAL) for i in range(trials * STEPS_PER_TRIAL)]
    gc.unfreeze()
    gc.callbacks.remove(on_gc)
    return {"records": records, "idle_s": idle_s}


def summarize(records: list[dict]) -> dict:
    """Median GPU ms (and its spread, p90 - p10) by position since the switch, the steady phase as one group;
    how many steps ran a GC of each generation; mean SM clock by position."""

    def stats(xs: list[float]) -> dict:
        xs = sorted(xs)
        q = lambda f: xs[min(len(xs) - 1, int(f * len(xs)))]  # noqa: E731
        return {
            "median": round(statistics.median(xs), 2),
            "p10_p90": [round(q(0.1), 2), round(q(0.9), 2)],
            "n": len(xs),
        }

    out: dict = {"by_position": {}, "steady": stats([r["gpu_ms"] for r in records if r["phase"] == "steady"])}
    for p in range(STEPS_PER_TRIAL):
        rs = [r for r in records if r["phase"] == "trials" and r["position"] == p]
        clocks = [r["sm_clock_mhz"] for r in rs if r["sm_clock_mhz"] is not None]
        out["by_position"][p + 1] = {
            **stats([r["gpu_ms"] for r in rs]),
            "wall_median": round(statistics.median(r["wall_ms"] for r in rs), 2),
            "sm_clock_mhz_mean": round(statistics.mean(clocks)) if clocks else None,
        }
    for phase in ("trials", "steady"):
        rs = [r for r in records if r["phase"] == phase]
        out[f"{phase}_steps_with_gc"] = [sum(1 for r in rs if r["gc_runs"][g]) for g in range(3)]
        out[f"{phase}_steps_with_device_allocs"] = sum(1 for r in rs if r["device_allocs"])
    return out


def inner(out: Path, trials: int, idle_s: float, argv: list[str]) -> None:
    import megatron.training.training as training
    from megatron.training import get_args

    from megatron_tp_overlap.integrations.megatron.launcher import run_script
    from megatron_tp_overlap.integrations.megatron.run_shape import RunShape
    from megatron_tp_overlap.integrations.megatron.tuning import MegatronSteps

    def train(forward_step_func, model, optimizer, scheduler, data_iterator, *rest, **kw):
        steps = MegatronSteps(model, forward_step_func, optimizer, data_iterator, RunShape.from_args(get_args()))
        result = profile(steps, trials, idle_s)
        if int(os.environ.get("RANK", "0")) == 0:
            out.mkdir(parents=True, exist_ok=True)
            (out / "trial_noise.json").write_text(json.dumps(result, indent=1) + "\n")
        return 0, 0  # (iteration, flops): no training; pretrain() carries on to its end

    training.train = train
    run_script(argv)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--script", help="Megatron-LM's pretrain_gpt.py (core_v0.19.0)")
    p.add_argument("--trials", type=int, default=40)
    p.add_argument("--idle-s", type=float, default=0.2, help="host seconds per simulated switch (a re-init: ~0.2)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    a, rest = p.parse_known_args()
    out = Path(a.out)
    if a.inner:
        inner(out, a.trials, a.idle_s, rest)
        return
    from megatron_autotune import model_args

    margs = argparse.Namespace(
        tp=1, pp=1, layers=4, hidden=4096, ffn=14336, heads=32, kv_groups=8, seq=a.seq, global_batch=4, iters=10
    )
    args = [x for x in model_args(margs) if x != "--sequence-parallel"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", __file__, "--inner", "--out", str(out)]
    cmd += ["--trials", str(a.trials), "--idle-s", str(a.idle_s), a.script, *args]
    print(" ".join(cmd), flush=True)
    rc = subprocess.run(cmd).returncode
    run = json.loads((out / "trial_noise.json").read_text())
    s = summarize(run["records"])
    (out / "trial_noise_summary.json").write_text(json.dumps(s, indent=1) + "\n")
    print(json.dumps(s, indent=1))
    print("\n| steps | GPU ms median | p10-p90 | wall ms median | SM clock MHz |\n|---|---|---|---|---|")
    for pos, v in s["by_position"].items():
        print(
            f"| trial step {pos} after a switch | {v['median']} | {v['p10_p90']} | {v['wall_median']} | "
            f"{v['sm_clock_mhz_mean']} |"
        )
    print(f"| steady, back to back | {s['steady']['median']} | {s['steady']['p10_p90']} | - | - |")
    sys.exit(rc)


if __name__ == "__main__":
    main()
