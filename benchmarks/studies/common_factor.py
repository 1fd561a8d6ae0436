"""Does a slow stretch slow every part of a step alike? The question behind issue 46's hostbound worst seeds.

On simulated host-bound MoE steps (decision_sim's ``hostbound``) a stretch of slow steps multiplies every slot and the
rest of the step by one factor, and the racing, which compares an option's trial with the incumbent's other trials,
cannot cancel it (benchmarks/results/2026-11-25_cpu/decision_sim/, twentieth session). If real steps behave so, the
part of each step outside the overlapped slots (step minus slot sum), which no config changes, measures the factor:
dividing a slot's time by it would take the stretch out of the racing's samples (a control variate).

This measures it on real Megatron-LM steps: ``trials`` trials of ``steps`` steps each after a simulated switch,
alternating two configs of an equal world (no delay put in: the same GPU work), as the racing runs them. Per slot:
the spread of the trials' medians over the run's median, raw and divided by the rest's, and the share of the
trial-to-trial variance the rest explains. Run through ``search_on_real_steps.py --common-factor TRIALS`` (the same
model flags; ``--runs 0`` for this alone).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from megatron_tp_overlap.engine.stats import robust_sd


def summarize(trials: list[dict]) -> dict:
    """``trials``: [{"slots": {slot: [ms per step]}, "step": [ms per step]}]. Per slot, over trials (the unit the
    racing compares): the relative spread (robust sd, %) of the trial's median slot time, raw and divided by the
    trial's median rest of the step (step minus every slot), and ``explained``: 1 - var(divided) / var(raw)."""
    slots = sorted(trials[0]["slots"])
    rest = []
    for t in trials:
        n = len(t["step"])
        rest.append(statistics.median(t["step"][i] - sum(t["slots"][s][i] for s in slots) for i in range(n)))
    rest_mid = statistics.median(rest)
    out = {"trials": len(trials), "rest_ms": round(rest_mid, 3), "slots": {}}
    for s in slots:
        raw = [statistics.median(t["slots"][s]) for t in trials]
        mid = statistics.median(raw)
        rel_raw = [v / mid - 1 for v in raw]
        rel_div = [(v / r) / (mid / rest_mid) - 1 for v, r in zip(raw, rest)]
        var_raw, var_div = robust_sd(rel_raw) ** 2, robust_sd(rel_div) ** 2  # a few wild trials do not decide
        out["slots"][s] = {
            "ms": round(mid, 3),
            "spread_raw_pct": round(100 * var_raw**0.5, 3),
            "spread_divided_pct": round(100 * var_div**0.5, 3),
            "explained": round(1 - var_div / var_raw, 3) if var_raw > 0 else None,
        }
    return out


def line(summary: dict) -> str:
    per = ", ".join(
        f"{s} {v['spread_raw_pct']:.2f}% -> {v['spread_divided_pct']:.2f}%" for s, v in summary["slots"].items()
    )
    return (
        f"[common_factor] {summary['trials']} trials, rest of the step {summary['rest_ms']:.2f} ms; per slot, the "
        f"trials' spread raw -> divided by the rest: {per}"
    )


def record(real, trials: int, steps: int) -> list[dict]:
    """``trials`` trials of ``steps`` measured steps (1 warm-up) on ``real`` (search_on_real_steps.RealSteps),
    alternating the reference and another config of an equal world: a switch before each trial, no cost put in."""
    import random

    from megatron_tp_overlap.engine.space import TuningConfig, apply, build_space
    from megatron_tp_overlap.tools.research import decision_sim as sim
    from megatron_tp_overlap.ub.config import UbConfig

    space = build_space(sim.TOPO, sim.CTX, [UbConfig()])
    ref = TuningConfig(UbConfig(), frozenset(), "reference")
    other = apply(ref, next(o for o in space["fc2_fprop"] if apply(ref, o, sim.TOPO) != ref), sim.TOPO)
    real.start(sim.make_world(space, 0.0, random.Random(0)))
    out = []
    for i in range(trials):
        m = real(other if i % 2 else ref, steps, 1)
        out.append({"slots": {s: list(v) for s, v in m.slot_ms.items()}, "step": list(m.step_ms)})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description="Summarize the common-factor trials of a search_on_real_steps.json again")
    p.add_argument("json", type=Path, help="search_on_real_steps.json of a run with --common-factor TRIALS")
    a = p.parse_args()
    trials = json.loads(a.json.read_text())["common_factor"]["trials"]
    s = summarize(trials)
    print(line(s))
    print("| slot | ms per step | trials' spread raw, % | divided by the rest, % | variance explained |")
    print("|---|---|---|---|---|")
    for slot, v in s["slots"].items():
        print(f"| {slot} | {v['ms']} | {v['spread_raw_pct']} | {v['spread_divided_pct']} | {v['explained']} |")


if __name__ == "__main__":
    main()
