"""Robust statistics of step-time samples (ms) for the search's decisions."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def robust_sd(xs: Sequence[float]) -> float:
    """1.4826 x the median absolute deviation from the median: the standard deviation of normal samples, which a
    few wild ones do not decide (0.0 without samples)."""
    if not xs:
        return 0.0
    mid = statistics.median(xs)
    return 1.4826 * statistics.median(abs(x - mid) for x in xs)


def sd_around_zero(xs: Sequence[float]) -> float:
    """1.4826 x the median absolute value: the standard deviation of normal samples that centre at zero (differences
    of repeats), which a few wild ones do not decide (0.0 without samples)."""
    return 1.4826 * statistics.median(abs(x) for x in xs) if xs else 0.0


def pooled_sigma(groups: Sequence[Sequence[float]], positional: bool = False) -> float:
    """Step-to-step spread pooled over groups of repeats of the same thing, from the differences of consecutive
    samples within each group: ``(x[i+1] - x[i]) / sqrt(2)`` has the samples' spread whatever the group size (residuals
    to each group's median understated it: 0.59 of it for groups of 3, 0.83-0.90 for 4-8), and a drift between groups
    does not enter. Their median absolute value (around zero: the differences of repeats centre there) x 1.4826.

    ``positional``: the groups are trials that each start right after a switch, and comparisons are made at equal
    positions, so a pattern that every trial shares by position (the clocks after an idle gap, a step that is always
    slow) is not noise: the median relative difference at each position among the groups of one length (>= 3 of
    them) is taken out first."""
    if not positional:
        return sd_around_zero([(b - a) / math.sqrt(2) for g in groups for a, b in zip(g, g[1:])])
    pairs = []  # ((group length, position), relative difference, difference, level)
    for g in groups:
        level = statistics.median(g) if g else 0.0
        if level > 0:
            pairs += [((len(g), i), (b - a) / level, b - a, level) for i, (a, b) in enumerate(zip(g, g[1:]))]
    return positional_sd(pairs)


def positional_sd(pairs: Sequence[tuple[tuple[int, int], float, float, float]]) -> float:
    """:func:`pooled_sigma` (positional) from its consecutive pairs ``((group length, position), relative difference,
    difference, level)``: the median relative difference at each position (>= 3 of them) is taken out first."""
    rel: dict[tuple[int, int], list[float]] = {}
    for k, r, _, _ in pairs:
        rel.setdefault(k, []).append(r)
    shared = {k: statistics.median(v) if len(v) >= 3 else 0.0 for k, v in rel.items()}
    return sd_around_zero([(d - shared[k] * level) / math.sqrt(2) for k, _, d, level in pairs])
