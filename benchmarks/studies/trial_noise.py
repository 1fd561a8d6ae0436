"""Where the noise of tuning's trial steps comes from, on one GPU: Megatron-LM's own ``pretrain_gpt.py`` with the
tuner's trial step (``MegatronSteps.step``: Megatron's forward_backward_func on read-ahead micro-batches, no
optimizer step), in the pattern tuning runs it, and per step what might explain a slow one.

    python benchmarks/studies/trial_noise.py --script .device/megatron-lm/pretrain_gpt.py --out DIR

Two phases on the same model, after 10 warm steps:

- ``trials``: ``--trials`` times a simulated switch (one ``gc.collect()``, a device sync and ``--idle-s`` of host
  work with the GPU idle, as a userbuffers re-init leaves it; no userbuffers: TP=1) then 4 steps (the warm-up and
  the 3 timed steps of a screening trial), with ``gc.freeze()`` as during tuning;
- ``steady``: as many steps back to back, nothing in between.

Per step: GPU time (CUDA events, ms), host wall time, Python GC runs by generation, the SM clock and power (NVML)
read right after the step, and the CUDA allocator's device allocations. Writes ``trial_noise.json`` and prints
the step time by position since the switch, against the steady phase.

``--abba-repeats N`` then calibrates the tuner's final decision on these steps: the search's own ABBA procedure
(``Searcher.abba``, ``min_quads`` quadruples of ``block_steps``-step blocks, a simulated switch between runs) on
two configs that cost the same (A/A: the interval should hold zero) and on a candidate made slower by a known GPU
delay (``--delay-pct`` of a step, ``torch.cuda._sleep`` inside its steps, its length measured with CUDA events),
N times each, interleaved: the interval's half-width in % of a step and how often each is decided.
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
STEPS_PER_TRIAL = 4  # 1 warm-up + 3 timed: a screening trial when measured (screening now times 2)


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
        simulated_switch(idle_s)
        records += [one("trials", p) for p in range(STEPS_PER_TRIAL)]
    records += [one("steady", i % STEPS_PER_TRIAL) for i in range(trials * STEPS_PER_TRIAL)]
    gc.unfreeze()
    gc.callbacks.remove(on_gc)
    return {"records": records, "idle_s": idle_s}


SWITCH_IDLE_S = 0.2  # a re-init's host seconds at TP=2 after the heap freeze (~0.2): the one-GPU benchmarks' default


def simulated_switch(idle_s: float, busy: bool = False) -> None:
    """What a userbuffers switch does besides the re-init (one ``gc.collect()``, a device sync), and the re-init's
    ``idle_s`` seconds with the GPU idle: the switch of the one-GPU benchmarks (TP=1, no userbuffers). The host sleeps
    through them, or with ``busy`` spins, as a re-init's host work keeps a core busy (on 2 x H200 a host-bound forward
    read slower in the second trial of a call of looks than in its first: results/2026-11-30_h200x2f/; spinning
    changed nothing there: results/2026-11-30_h200x2g/)."""
    import torch

    gc.collect()
    torch.cuda.synchronize()
    if not busy:
        time.sleep(idle_s)
        return
    end = time.perf_counter() + idle_s
    while time.perf_counter() < end:
        pass


def gpu_ms(fn) -> float:
    """GPU milliseconds of what ``fn`` enqueues (CUDA events; waits for it)."""
    import torch

    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def sleep_ms_per_cycle() -> float:
    """GPU milliseconds per cycle of ``torch.cuda._sleep``, the known delay the benchmarks add (median of 5)."""
    import torch

    cycles = 10_000_000
    return statistics.median(gpu_ms(lambda: torch.cuda._sleep(cycles)) for _ in range(5)) / cycles


def abba_calibration(steps, repeats: int, idle_s: float, delay_pct: float, block_steps: int = 3) -> list[dict]:
    """The search's ABBA decision between equal configs and against a known slowdown (see the module docstring)."""
    import torch

    from megatron_tp_overlap.engine.search import Measurement, Searcher, SearchOptions
    from megatron_tp_overlap.engine.space import TuningConfig
    from megatron_tp_overlap.engine.trial import Contender
    from megatron_tp_overlap.ub.config import GemmOverlapConfig, UbConfig

    step_ms = statistics.median(gpu_ms(steps.step) for _ in range(5))
    per_cycle = sleep_ms_per_cycle()
    delay_cycles = int(delay_pct / 100 * step_ms / per_cycle)
    ref = TuningConfig(UbConfig(), frozenset(), "reference")
    same = TuningConfig(
        UbConfig().with_entry("fc2_fprop", GemmOverlapConfig(method="pipeline", num_sm=8)), label="same"
    )
    slower = TuningConfig(
        UbConfig().with_entry("fc2_fprop", GemmOverlapConfig(method="pipeline", num_sm=4)), label="slower"
    )
    live, t0 = [None], time.perf_counter()

    def evaluate(config, n: int, warmup: int) -> Measurement:
        t = time.perf_counter()
        if config != live[0]:
            simulated_switch(idle_s)
            live[0] = config
        extra = (lambda: torch.cuda._sleep(delay_cycles)) if config == slower else (lambda: None)
        for _ in range(warmup):
            extra()
            steps.step()
        ms = [gpu_ms(lambda: (extra(), steps.step())) for _ in range(n)]
        return Measurement({"step": ms}, ms, time.perf_counter() - t0, n + warmup, time.perf_counter() - t)

    out = []
    opts = SearchOptions(max_steps=10**6, max_seconds=1e9, max_quads=6, block_steps=block_steps)  # 6: the first look
    for r in range(repeats):
        for kind, cand in (("A/A", same), (f"A/B +{delay_pct:g}%", slower)):
            s = Searcher(None, {}, evaluate, None, opts)
            d = s.abba(Contender("reference", ref), Contender(kind, cand))
            iv = d["slot_interval"]
            out.append(
                {
                    "repeat": r,
                    "kind": kind,
                    "true_gain_ms": 0.0 if cand == same else -delay_cycles * per_cycle,
                    "estimate_ms": iv.estimate,
                    "half_width_ms": iv.half_width,
                    "half_width_pct": d["noise_pct_of_step"],
                    "decided": "faster" if iv.faster else "slower" if iv.slower else "within the interval",
                    "reference_step_ms": d["reference_step_ms"],
                    "quadruples": d["quadruples"],
                }
            )
    return out


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


def inner(
    out: Path,
    trials: int,
    idle_s: float,
    abba: int,
    delay_pct: float,
    block_steps: int,
    argv: list[str],
    trial_microbatches: int = 0,
) -> None:
    import megatron.training.training as training
    from megatron.training import get_args

    from megatron_tp_overlap.integrations.megatron.launcher import run_script
    from megatron_tp_overlap.integrations.megatron.run_shape import RunShape
    from megatron_tp_overlap.integrations.megatron.tuning import MegatronSteps

    def train(forward_step_func, model, optimizer, scheduler, data_iterator, *rest, **kw):
        steps = MegatronSteps(
            model, forward_step_func, optimizer, data_iterator, RunShape.from_args(get_args()), trial_microbatches
        )
        result = profile(steps, trials, idle_s)
        if abba:
            result["abba"] = abba_calibration(steps, abba, idle_s, delay_pct, block_steps)
        if int(os.environ.get("RANK", "0")) == 0:
            out.mkdir(parents=True, exist_ok=True)
            (out / "trial_noise.json").write_text(json.dumps(result, indent=1) + "\n")
        return 0, 0  # (iteration, flops): no training; pretrain() carries on to its end

    training.train = train
    run_script(argv)


def main() -> None:
    from megatron_autotune import add_trial_microbatches

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--script", help="Megatron-LM's pretrain_gpt.py (core_v0.19.0)")
    p.add_argument("--trials", type=int, default=40)
    p.add_argument("--idle-s", type=float, default=0.2, help="host seconds per simulated switch (a re-init: ~0.2)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--abba-repeats", type=int, default=0, help="ABBA decisions per kind (A/A, A/B) to calibrate")
    p.add_argument("--delay-pct", type=float, default=0.5, help="the A/B candidate's extra GPU time, %% of a step")
    p.add_argument("--block-steps", type=int, default=3, help="steps per ABBA block (the search's default: 3)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    add_trial_microbatches(p)
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    a, rest = p.parse_known_args()
    out = Path(a.out)
    if a.inner:
        inner(out, a.trials, a.idle_s, a.abba_repeats, a.delay_pct, a.block_steps, rest, a.trial_microbatches)
        return
    from megatron_autotune import one_gpu_args

    args = one_gpu_args(a.seq, 10)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", __file__, "--inner", "--out", str(out)]
    cmd += ["--trial-microbatches", str(a.trial_microbatches)]
    cmd += ["--trials", str(a.trials), "--idle-s", str(a.idle_s), "--abba-repeats", str(a.abba_repeats)]
    cmd += ["--delay-pct", str(a.delay_pct), "--block-steps", str(a.block_steps), a.script, *args]
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
    if run.get("abba"):
        print(
            "\n| decision | repeat | true gain ms | estimate ms | +- ms | +- % of step | decided |\n|---|---|---|---|---|---|---|"
        )
        for d in run["abba"]:
            print(
                f"| {d['kind']} | {d['repeat']} | {d['true_gain_ms']:+.3f} | {d['estimate_ms']:+.3f} | "
                f"{d['half_width_ms']:.3f} | {d['half_width_pct']} | {d['decided']} |"
            )
    sys.exit(rc)


if __name__ == "__main__":
    main()
