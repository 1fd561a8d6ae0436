"""Robust statistics of step-time samples (ms) for the search's decisions."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import numpy as np


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
    return positional_sd_columns(*PairColumns.of(pairs).arrays())


class PairColumns:
    """:func:`positional_sd`'s pairs as columns that grow (the racing adds each new trial's pairs to them)."""

    def __init__(self) -> None:
        self.key: list[int] = []  # (group length, position) as one integer
        self.rel: list[float] = []
        self.diff: list[float] = []
        self.level: list[float] = []
        self._arrays: tuple[np.ndarray, ...] = ()  # the columns as arrays, as of their last length

    @classmethod
    def of(cls, pairs: Sequence[tuple[tuple[int, int], float, float, float]]) -> PairColumns:
        c = cls()
        for k, r, d, level in pairs:
            c.add(k, r, d, level)
        return c

    def add(self, k: tuple[int, int], r: float, d: float, level: float) -> None:
        self.key.append(k[0] << 32 | k[1])
        self.rel.append(r)
        self.diff.append(d)
        self.level.append(level)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The columns as arrays; pairs added since the last call are appended to them."""
        done = len(self._arrays[0]) if self._arrays else 0
        if not self._arrays or done != len(self.key):
            new = np.array(self.key[done:], np.int64), *(np.array(c[done:]) for c in (self.rel, self.diff, self.level))
            self._arrays = tuple(np.concatenate((a, b)) for a, b in zip(self._arrays, new)) if self._arrays else new
        return self._arrays  # type: ignore[return-value]


def positional_sd_columns(key: np.ndarray, rel: np.ndarray, diff: np.ndarray, level: np.ndarray) -> float:
    """:func:`positional_sd` of its pairs' columns, vectorized (thousands of pairs, pooled again after every trial),
    in the same arithmetic, so the same figures as ``statistics.median`` over lists."""
    n = len(key)
    if not n:
        return 0.0
    order = np.lexsort((rel, key))  # by position, then by value: each position's values sorted
    k, r = key[order], rel[order]
    starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
    counts = np.diff(np.r_[starts, n])
    shared = np.where(counts >= 3, _sorted_median(r, starts, counts), 0.0)
    per_pair = np.empty(n)
    per_pair[order] = np.repeat(shared, counts)
    res = np.sort(np.abs((diff - per_pair * level) / math.sqrt(2)))
    return 1.4826 * float(_sorted_median(res, np.zeros(1, np.int64), np.array([n]))[0])


def _sorted_median(x: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The median of each run ``x[start:start + count]`` of sorted values, as ``statistics.median`` computes it."""
    mid = starts + counts // 2
    return np.where(counts % 2 == 1, x[mid], (x[np.maximum(mid - 1, 0)] + x[mid]) / 2)
