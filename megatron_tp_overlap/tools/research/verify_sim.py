"""How often the in-run verification keeps a config that is truly faster, on simulated training iterations.

Two models of the iteration time, both measured on one H200 in Megatron-LM:

- ``locked`` (real training iterations, benchmarks/results/2026-11-23_h200x1/verify_noise/): after a switch's idle
  gap the power limit's clock oscillation restarts in phase: +-1.7% with a period of 4 iterations counted from the
  switch, 1.3% (sd) independent noise, and now and then a 0.3 s stall (a Python GC) over two iterations;
- ``free`` (back-to-back trial steps, ../trial_noise/): the oscillation runs on regardless of switches, a period of
  4.5 iterations with a random phase, +-1.5%, and 0.5% independent noise.

A switch costs time outside the iterations. The verification (:class:`~engine.verify.InRunVerification`,
unchanged) runs on it for a true gain of the tuned config (% of an iteration; negative: it is slower) and is scored
by what it keeps:

- kept: the share of runs that keep the tuned config (want: high for a real gain, 0 for a loss);
- interval: the median half-width of its interval, in % of an iteration; iterations: the median it spanned.

``python -m megatron_tp_overlap.tools.research.verify_sim --iters 96 384 --gains -1 0 0.5 1 2`` prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
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
NOISE_MODELS = {  # period (iterations), amplitude, independent noise (sd), stall probability per iteration
    "locked": (4.0, 0.017, 0.013, 0.002),
    "free": (4.5, 0.015, 0.005, 0.0),
}
STALL_MS = 300.0  # a Python GC of a Megatron process: split over two iterations


def verdict(gain_pct: float, iters: int, seed: int, noise: str = "locked"):
    """One verification of at most ``iters`` measured iterations where the tuned config is ``gain_pct`` % faster."""
    period, amplitude, sd, stall_p = NOISE_MODELS[noise]
    rng = random.Random(seed)
    phase = rng.uniform(0, 2 * math.pi)
    state = {"now": 0.0, "live": TUNED, "i": 0, "since": 0, "stall": 0.0}

    def apply(c: TuningConfig) -> None:
        state["live"], state["since"] = c, 0
        state["now"] += 0.2  # a switch: outside the iterations' times

    v = InRunVerification(
        TUNED,
        REF,
        iters,
        apply=apply,
        clock=lambda: state["now"],
        log=lambda *a: None,
        hold_heap=contextlib.nullcontext,  # no garbage collections to spare here
    )
    while not v.done:
        v.before()
        ms = ITER_MS * (1 - gain_pct / 100 if state["live"] == TUNED else 1.0)
        if noise == "locked":  # in phase after every switch: the 3rd-4th iteration after it slow, as measured
            ms *= 1 + amplitude * math.sin(2 * math.pi * (state["since"] - 1.5) / period)
        else:
            ms *= 1 + amplitude * math.sin(2 * math.pi * state["i"] / period + phase)
        ms += rng.gauss(0, sd * ITER_MS) + state["stall"]
        state["stall"] = 0.0
        if rng.random() < stall_p:
            ms, state["stall"] = ms + STALL_MS * 0.75, STALL_MS * 0.25
        state["now"] += ms / 1e3
        state["i"] += 1
        state["since"] += 1
        v.after()
    return v.verdict


def evaluate(iters: int, gain_pct: float, seeds: int, noise: str = "locked") -> dict[str, float]:
    vs = [verdict(gain_pct, iters, s, noise) for s in range(seeds)]
    return {
        "kept": sum(not v.reverted for v in vs) / seeds,
        "interval_pct": statistics.median(100 * v.interval.half_width / ITER_MS for v in vs),
        "iterations": statistics.median(v.iterations for v in vs),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, nargs="+", default=[96, 192, 384], help="most measured iterations")
    p.add_argument("--gains", type=float, nargs="+", default=[-1.0, 0.0, 0.5, 1.0, 2.0], help="% of an iteration")
    p.add_argument("--noise", nargs="+", default=list(NOISE_MODELS), choices=list(NOISE_MODELS))
    p.add_argument("--seeds", type=int, default=200)
    a = p.parse_args(argv)
    print(f"{'noise':>6} {'verify_iters':>12} {'most':>12} {'true gain':>9} {'kept':>6} {'+-':>7} {'iterations':>10}")
    for noise in a.noise:
        for n in a.iters:
            quads, block = design(n)
            for g in a.gains:
                r = evaluate(n, g, a.seeds, noise)
                print(
                    f"{noise:>6} {n:12} {f'{quads}x4x{block} ({span(n)})':>12} {g:8.1f}% {100 * r['kept']:5.0f}% "
                    f"{r['interval_pct']:6.2f}% {r['iterations']:10.0f}"
                )


if __name__ == "__main__":
    main()
