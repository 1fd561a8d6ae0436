"""A slot that sits at a floor with stretches well above it: a forward whose GPU waits on the host in stretches.

On real Granite-3-8B-like FP8 steps on H200 ``proj.fwd`` runs at its GPU time (0.29 ms +- 0.01) or, in 27-80% of the
steps, at 1.4-2.9x it, where the GPU waits for the host to issue the layer; the share depends on the machine and the
moment (benchmarks/studies/host_modes.py, benchmarks/results/2026-11-28_h200x4e/). A GPU gain shows only in the fast
steps, so counting such a slot's steps at most a little above its floor (``SearchOptions.floor_cap``)
keeps what a config changes and drops what the host adds. decision_sim ``hostmax``, 200 seeds: 98.6% mean, worst seed
0% uncapped; 100% and 100%, no false winner, with ``floor_cap=0.05`` (the default), and the other fourteen scenarios
figure for figure as uncapped (benchmarks/results/2026-11-25_cpu/decision_sim/, thirty-seventh to fortieth sections).
On real steps the floor was not found where most steps were slow (12-20% at it; there it changes nothing).
"""

from __future__ import annotations

import bisect

FLOOR_NEAR, FLOOR_FAR, FAR_OVER = 0.3, 0.15, 1.3  # a floor: this share of steps within the cap, this share beyond
FLOOR_MIXED, FLOOR_TRIALS = 0.15, 8  # ... and this share of the trials with steps at both, of this many at least


def floor_tops(trials: dict[str, list[list[float]]], cap: float) -> dict[str, float]:
    """Per slot whose steps (``trials``: the reference's so far, trial by trial) sit at a floor, with stretches well
    above it: at least ``FLOOR_NEAR`` of them within ``cap`` of its 10th percentile, ``FLOOR_FAR`` over ``FAR_OVER`` x
    it, and ``FLOOR_MIXED`` of ``FLOOR_TRIALS`` or more trials with steps at both (the host changes within a trial; a
    level each trial shares moves all its steps): that 10th percentile x (1 + ``cap``). A forward whose GPU waits on
    the host in stretches (real Granite-3-8B-like FP8 steps on H200: proj.fwd at its GPU time +- 3% or at 1.4-2.9x
    it) shows a GPU gain only at its floor; a spread around a level (decision_sim hostfwd) has no such floor."""
    out = {}
    for s, ts in trials.items():
        multi = [t for t in ts if len(t) >= 2]
        if len(multi) < FLOOR_TRIALS:
            continue
        v = sorted(x for t in ts for x in t)  # counted by bisection: the search finds the floors after each trial
        if (q := v[len(v) // 10]) <= 0:
            continue
        top = q * (1 + cap)
        near = bisect.bisect_right(v, top) / len(v)
        far = (len(v) - bisect.bisect_right(v, q * FAR_OVER)) / len(v)
        mixed = sum(min(t) <= top and max(t) > q * FAR_OVER for t in multi) / len(multi)
        if near >= FLOOR_NEAR and far >= FLOOR_FAR and mixed >= FLOOR_MIXED:
            out[s] = top
    return out


def capped(samples: dict[str, list[float]], tops: dict[str, float]) -> dict[str, list[float]]:
    """Per slot in ``tops``, one trial's steps at most ``tops[slot]`` (ms); the other slots' as they are."""
    if not tops:
        return samples
    return {s: [min(x, tops[s]) for x in v] if s in tops else v for s, v in samples.items()}
