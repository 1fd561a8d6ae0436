"""Does a config's step time depend on what ran before it? (under torchrun)

    torchrun --nproc-per-node=4 benchmarks/studies/predecessor_effect.py --case llama3_8b --layers 2 --out DIR

On H200 (2026-11-21) one config measured twice in the same interleaved rounds came out 3-5% apart
(`benchmarks/results/overlap_vs_baselines_h200x4_2026-11-21.md`): once right after "no overlap" (same
userbuffers, overlap flags flipped back on) and once right after a userbuffers re-initialization.
This measures the target config T (TE default) after each kind of predecessor, in interleaved rounds:

- ``same``: T after T (no switch at all),
- ``flags``: T after no overlap (the module flags flipped off and on; no re-initialization),
- ``reinit``: T after another config P (the closest NeMo preset: destroy_ub + initialize_ub twice),
- ``reinit_same``: T after a forced re-initialization of T itself (new buffers, same config).

Writes ``predecessor_effect_tp{N}.json`` and prints a table (median and spread of the round medians).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

ORDERS = ("same", "flags", "reinit", "reinit_same")


def plan(rounds: int) -> list[tuple[str, str]]:
    """(order, what runs before the timed T) for each timed measurement, interleaved over rounds."""
    before = {"same": "T", "flags": "off", "reinit": "P", "reinit_same": "T (re-initialized)"}
    return [(o, before[o]) for _ in range(rounds) for o in ORDERS]


def summarize(samples: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {
        o: {"median": statistics.median(v), "spread": max(v) - min(v), "rounds": len(v)}
        for o, v in samples.items()
        if v
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", default="llama3_8b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=30, help="timed steps per measurement")
    p.add_argument("--pre-steps", type=int, default=10, help="steps of the predecessor before each measurement")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    a = p.parse_args()

    import sys

    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from overlap_vs_baselines import CASES

    from megatron_tp_overlap.engine.measure import median_cuda_ms
    from megatron_tp_overlap.engine.space import TuningConfig, all_off
    from megatron_tp_overlap.engine.switcher import UbSwitcher
    from megatron_tp_overlap.engine.topology import build_topology, find_overlap_modules
    from megatron_tp_overlap.models import load_model_dims
    from megatron_tp_overlap.tools.layer_bench import build_stack
    from megatron_tp_overlap.ub.config import UbConfig
    from megatron_tp_overlap.ub.presets import closest_preset, get_preset

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    model_name, seq, mbs = CASES[a.case]
    d = load_model_dims(model_name)
    stack = build_stack(d, a.layers, seq, mbs, overlap=True)
    mods = find_overlap_modules(stack.model)
    T = TuningConfig(UbConfig(), frozenset(), "TE default")
    P = TuningConfig(get_preset(closest_preset(d.hidden, dist.get_world_size(), False)), frozenset(), "preset")
    OFF = all_off(build_topology(mods), T)
    sw = UbSwitcher(stack.init, mods, barrier=dist.barrier, current=T)

    def run(n: int) -> None:
        for _ in range(n):
            stack.step()

    samples: dict[str, list[float]] = {o: [] for o in ORDERS}
    for order, _ in plan(a.rounds):
        if order == "same":
            sw.apply(T)
            run(a.pre_steps)
        elif order == "flags":
            sw.apply(OFF)
            run(a.pre_steps)
            sw.apply(T)
        elif order == "reinit":
            sw.apply(P)
            run(a.pre_steps)
            sw.apply(T)
        else:
            sw.apply(T, force=True)  # new buffers for the same config
        samples[order].append(median_cuda_ms(stack.step, a.steps, warmup=0))  # no warmup: the effect is the point
    result = {
        "case": a.case,
        "tp": dist.get_world_size(),
        "gpu": torch.cuda.get_device_name(),
        "steps": a.steps,
        "pre_steps": a.pre_steps,
        "rounds": a.rounds,
        "samples_ms": samples,
        "summary": summarize(samples),
    }
    if dist.get_rank() == 0:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"predecessor_effect_tp{result['tp']}.json").write_text(json.dumps(result, indent=1))
        print(f"| T = TE default, {a.case}, TP={result['tp']} | before T | median ms | spread ms |\n|---|---|---|---|")
        for order, before in plan(1):
            s = result["summary"][order]
            print(f"| {order} | {before} | {s['median']:.3f} | {s['spread']:.3f} |")
    del sw
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
