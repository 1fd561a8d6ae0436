"""How often the in-run verification keeps a config that is truly faster, on simulated training iterations.

The iteration time follows what one H200 showed in Megatron-LM (benchmarks/results/2026-11-23_h200x1/trial_noise/):
the power limit moves the clocks with a period of about 4.5 iterations (+-1.5%, a random phase per run) and 0.5%
independent noise on top; a switch between configs costs time outside the iterations. The verification
(:class:`~engine.verify.InRunVerification`, unchanged) runs on it for a true gain of the tuned config (% of an
iteration; negative: it is slower) and is scored by what it keeps:

- kept: the share of runs that keep the tuned config (want: high for a real gain, 0 for a loss);
- interval: the median half-width of its 95% interval, in % of an iteration.

``python -m megatron_tp_overlap.tools.verify_sim --iters 24 96 --gains -1 0 0.5 1 2`` prints the table.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics

from megatron_tp_overlap.engine.space import TuningConfig
from megatron_tp_overlap.engine.verify import InRunVerification, design, span
from megatron_tp_overlap.ub.config import GemmOverlapConfig, UbConfig

REF = TuningConfig(UbConfig(), frozenset(), "reference")
TUNED = TuningConfig(
    UbConfig().with_entry("fc2_fprop", GemmOverlapConfig(method="pipeline", num_sm=8)), label="autotuned"
)
ITER_MS = 235.0
PERIOD, AMPLITUDE, NOISE = 4.5, 0.015, 0.005  # iterations, relative, relative (sd)


def verdict(gain_pct: float, iters: int, seed: int):
    """One verification of ``iters`` measured iterations where the tuned config is ``gain_pct`` % faster."""
    rng = random.Random(seed)
    phase = rng.uniform(0, 2 * math.pi)
    state = {"now": 0.0, "live": TUNED, "i": 0}

    def apply(c: TuningConfig) -> None:
        state["live"] = c
        state["now"] += 0.2  # a switch: outside the iterations' times

    v = InRunVerification(TUNED, REF, iters, apply=apply, clock=lambda: state["now"], log=lambda *a: None)
    for _ in range(span(iters)):
        v.before()
        ms = ITER_MS * (1 - gain_pct / 100 if state["live"] == TUNED else 1.0)
        ms *= 1 + AMPLITUDE * math.sin(2 * math.pi * state["i"] / PERIOD + phase)
        state["now"] += (ms + rng.gauss(0, NOISE * ITER_MS)) / 1e3
        state["i"] += 1
        v.after()
    return v.verdict


def evaluate(iters: int, gain_pct: float, seeds: int) -> dict[str, float]:
    vs = [verdict(gain_pct, iters, s) for s in range(seeds)]
    return {
        "kept": sum(not v.reverted for v in vs) / seeds,
        "interval_pct": statistics.median(100 * v.interval.half_width / ITER_MS for v in vs),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, nargs="+", default=[24, 48, 96], help="measured iterations (verify_iters)")
    p.add_argument("--gains", type=float, nargs="+", default=[-1.0, 0.0, 0.5, 1.0, 2.0], help="% of an iteration")
    p.add_argument("--seeds", type=int, default=200)
    a = p.parse_args(argv)
    print(f"{'verify_iters':>12} {'blocks':>10} {'iterations':>10} {'true gain':>9} {'kept':>6} {'+- (95%)':>9}")
    for n in a.iters:
        quads, block = design(n)
        for g in a.gains:
            r = evaluate(n, g, a.seeds)
            print(
                f"{n:12} {f'{quads}x4x{block}':>10} {span(n):10} {g:8.1f}% {100 * r['kept']:5.0f}% "
                f"{r['interval_pct']:8.2f}%"
            )


if __name__ == "__main__":
    main()
