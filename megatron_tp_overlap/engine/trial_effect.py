"""What a trial's steps share: the racing's standard errors with trial-level noise (engine/racing.py).

The racing's per-step spread comes from consecutive steps *within* a trial, which cannot see a level that a whole
trial shares (host work and the GPU's clocks after the gap between trials). On real Command-R- and Nemotron-like
steps on one H200, 17 of 24 equal-world searches accepted at least one choice (the leaders' z = 2.5 test; on
simulated iid steps 19 of 200), and a true 0.23 ms gain measured -0.18 ms in one fresh 8-step look
(benchmarks/results/2026-11-26_h200x2b/): the estimates varied more than the per-step spread says. A level shared
by each trial's steps is the simplest cause that gives both; decision_sim's ``trial`` scenario puts one in.

So per slot the trial-level spread ``tau`` (relative to the slot's level) is measured on the incumbent's own trials,
which run the same config throughout: consecutive trials' mean levels differ by ``2 tau^2 + sigma^2 (1/n0 + 1/n1)``
(``sigma``: one step's relative spread). Each racing estimate's variance then adds ``tau^2`` per trial it uses,
weighted by that trial's share of the samples, for the option's trial and the incumbent's level there.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import Any

from megatron_tp_overlap.engine import stats

MIN_DIFFS = 5  # differences between consecutive incumbent trials, at least, before a slot's trial level counts
# the differences' variance must be this many times what the steps' own spread gives: from ~10 differences a robust
# variance is ~50% off, and a tau fitted to that alone (decision_sim iid and jitter, no trial level) held back true
# options (worst seed 100 -> 78%)
RATIO_MIN = 3.0
# ... and first, over every slot at once, the differences in units of what the steps give must spread this much more
# than the steps alone would (one test with many differences: a slot's own test, one of 8-12, passes by chance in
# about one search in ten)
POOLED_MIN = 2.0
# a racing trial this many standard deviations slower than an option's others caught a burst of slow steps: set aside
# among three or more, and of two that differ so much neither rules the option out (engine/racing.py)
OUTLIER_SDS = 4.0


def slot_taus(
    groups: Iterable[list[Any]], sigma: float, scaled=lambda t: t.slot_samples, own_diffs: int = 0
) -> dict[str, float]:
    """Per slot, the relative trial-level spread ``tau`` over ``groups`` (each one config's trials in time order,
    of 2 measured steps or more; differences are taken within a group); ``sigma``: one step's relative spread;
    ``scaled(t)``: the samples as the racing scores them. A robust estimate (median absolute consecutive difference);
    0 where the steps' own spread explains it or fewer than ``MIN_DIFFS`` differences exist. Where the test pooled
    over slots fails, a slot with ``own_diffs`` differences (> 0) is still tested alone (a chance 3x in 30: < 0.1%)."""
    return taus_of(slot_diffs(groups, scaled), sigma, own_diffs)


def slot_diffs(groups: Iterable[list[Any]], scaled=lambda t: t.slot_samples) -> dict[str, list[tuple[float, int, int]]]:
    """:func:`slot_taus`'s differences: per slot, (relative difference of consecutive trials' means, the steps of the
    first, of the second) within each group. They do not depend on the steps' spread, so the search keeps them while
    its trials add no group's trial (engine/racing.py)."""
    diffs: dict[str, list[tuple[float, int, int]]] = {}
    for trials in groups:
        prev: dict[str, tuple[float, int]] = {}
        for t in trials:
            for s, v in scaled(t).items():
                if len(v) < 2:
                    continue
                m = (statistics.fmean(v), len(v))
                if s in prev and prev[s][0] > 0:
                    diffs.setdefault(s, []).append(((m[0] - prev[s][0]) / prev[s][0], prev[s][1], m[1]))
                prev[s] = m
    return diffs


def taus_of(diffs: dict[str, list[tuple[float, int, int]]], sigma: float, own_diffs: int = 0) -> dict[str, float]:
    """:func:`slot_taus` from its :func:`slot_diffs`."""
    units = [
        r / (sigma * math.sqrt(1 / n0 + 1 / n1)) if sigma > 0 else math.inf for d in diffs.values() for r, n0, n1 in d
    ]
    pooled = bool(units) and stats.sd_around_zero(units) ** 2 >= POOLED_MIN
    out = {}
    for s, d in diffs.items():
        if len(d) < MIN_DIFFS or not pooled and not (own_diffs and len(d) >= own_diffs):
            out[s] = 0.0
            continue
        var = stats.sd_around_zero([r for r, _, _ in d]) ** 2
        steps = statistics.fmean(sigma * sigma * (1 / n0 + 1 / n1) for _, n0, n1 in d)
        out[s] = ((var - steps) / 2) ** 0.5 if var >= RATIO_MIN * steps else 0.0
    return out


def incumbent_runs(trials: Iterable[Any]) -> list[list[Any]]:
    """The search's own-config trials (baseline and brackets, 2 measured steps or more), per config in time order."""
    groups: dict[Any, list[Any]] = {}
    for t in trials:
        if t.phase in ("baseline", "bracket") and not t.error and len(t.step_samples) >= 2:
            groups.setdefault(t.config, []).append(t)
    return list(groups.values())


def trial_weight(shares: Iterable[tuple[int, int, float]]) -> float:
    """``sum_i (n_i / n)^2 (1 + c_i)`` over an estimate's trials (``(n_i, n, ref_var_i)``): the share of ``tau^2``
    in its variance. ``c_i = min(1, ref_var_i n_i)``: the incumbent's interpolated level there carries the trial
    levels of the one or two trials around it (``w^2 + (1 - w)^2`` when they have as many steps as this one)."""
    return sum((ni / n) ** 2 * (1 + min(1.0, vr * ni)) for ni, n, vr in shares)


def trial_sd(sigma: float, tau: float, steps: int) -> float:
    """One trial's spread (ms) as the racing scores it, the median of ``steps`` steps: the steps' own (``sigma`` ms
    each; a median's variance pi/2 of a mean's) and the level the trial's steps share (``tau`` ms)."""
    return math.sqrt(sigma * sigma * (math.pi / 2 if steps > 1 else 1.0) / steps + tau * tau)


def far_slower(trials: list[list[float]], sigma: float, tau: float) -> list[bool]:
    """Per trial (relative samples, ms): whether its median is over ``OUTLIER_SDS`` of its spread slower than the
    median trial's."""
    meds = [statistics.median(d) for d in trials]
    mid = statistics.median(meds)
    return [m - mid > OUTLIER_SDS * trial_sd(sigma, tau, len(d)) for m, d in zip(meds, trials)]


def split_gain(trials: list[list[float]], sigma: float, tau: float) -> float | None:
    """Two trials' relative samples (ms, negative: faster) whose medians differ beyond ``OUTLIER_SDS`` standard
    deviations of a difference: the faster one's gain (ms), since two cannot tell which caught a burst; else None.
    decision_sim burst seeds 57, 121 and 176: one of a truly faster option's first two trials (or its first and its
    screened step) read it 2.0-2.6 ms behind, and it was ruled out with its gain (44-76% of a seed's gain taken)."""
    if len(trials) != 2:
        return None
    meds = [statistics.median(d) for d in trials]
    sd = math.hypot(*(trial_sd(sigma, tau, len(d)) for d in trials))
    return -min(meds) if max(meds) - min(meds) > OUTLIER_SDS * sd else None
