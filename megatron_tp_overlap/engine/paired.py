"""Paired comparisons that drift cannot fool: ABBA blocks and a distribution-free confidence interval.

Two configs A (the reference) and B (a candidate) run in blocks ordered A B B A, A B B A, ... Within one
quadruple a linear drift of the step time (clocks, temperature, a neighbour job) adds the same to
``A1 + A2`` as to ``B1 + B2``, so the quadruple's difference ``(A1 + A2 - B1 - B2) / 2`` keeps only the
gain and noise; quadruples are independent of each other. Their median gain and its confidence interval
come from the Wilcoxon signed-rank test (Hodges-Lehmann estimate over Walsh averages): no normality is
assumed, and a quadruple hit by a sudden change (a +25% stretch that starts inside it) or a periodic slow
step moves the estimate by one rank, not by its size. The final decision clips the quadruples' gains at their median
first (:func:`clipped`), so that such a quadruple cannot hold the interval's bound either.

Used twice: by the search's final decision (trial blocks) and by the in-run verification (real
iterations, :mod:`engine.verify`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from megatron_tp_overlap.engine.stats import robust_sd

A, B = 0, 1
QUAD = (A, B, B, A)
MIN_PAIRS = 6  # the fewest pairs (quadruples) whose signed-rank test can give a 95% interval
# A sequential decision looks after every quadruple; every look before the last one is at this level. Looking at 95%
# after each of quadruples 6..24 names an equal config faster in 8-9% of decisions (exact signed-rank intervals, both
# on normal noise and on the block values of MoE steps on one H100, benchmarks/results/2026-11-25_h100x1/); with the
# interim looks at 99% and the last at 95%, 3.4-3.7%.
INTERIM_LEVEL = 0.99
# ... and past quadruple ``DENSE_LOOKS`` it looks only after every ``SPARSE_EVERY``-th (and at its last): a decision run
# on to 64 quadruples with a look after each named an equal config faster on decision_sim hostmax (equal seed 83, at
# its 50th), where 24 looks had not
DENSE_LOOKS, SPARSE_EVERY = 24, 8


def abba(quads: int) -> list[int]:
    """Block order for ``quads`` quadruples: A B B A A B B A ... (A = 0, B = 1)."""
    return [x for _ in range(quads) for x in QUAD]


def runs(order: Sequence[int]) -> list[tuple[int, int]]:
    """``order`` as runs of equal blocks: [(config, blocks)], e.g. A B B A A B B A -> A1 B2 A2 B2 A1 (one switch
    per run)."""
    out: list[tuple[int, int]] = []
    for x in order:
        if out and out[-1][0] == x:
            out[-1] = (x, out[-1][1] + 1)
        else:
            out.append((x, 1))
    return out


def quad_gains(blocks: Sequence[float], order: Sequence[int]) -> list[float]:
    """Per complete quadruple, ``mean(A) - mean(B)`` (positive: B is faster) of the block values ``blocks`` run in
    ``order`` (:func:`abba`)."""
    out = []
    for q in range(len(blocks) // 4):
        a = [blocks[4 * q + i] for i in range(4) if order[4 * q + i] == A]
        b = [blocks[4 * q + i] for i in range(4) if order[4 * q + i] == B]
        out.append(sum(a) / len(a) - sum(b) / len(b))
    return out


def clipped(gains: Sequence[float], sds: float) -> list[float]:
    """``gains`` with each one beyond their median +- ``sds`` robust standard deviations (1.4826 x the median absolute
    deviation) set to that bound; unchanged with ``sds`` 0 or fewer than ``MIN_PAIRS`` gains.

    Why: the signed-rank test ranks each quadruple by its distance from zero, so a quadruple hit by a stretch of slow
    steps (the host busy for a few steps) gets the top rank whichever config it hit, and its Walsh averages pull the
    interval's bound. On one H100 under `transformer_engine` CUDA graphs a candidate 2.3% faster won 11 of 13
    quadruples; two such stretches in its own blocks (+25% each) kept the interval at -0.050 to +1.096 ms, and the
    gain was not taken (benchmarks/results/2026-11-25_h100x2/twentieth/). Clipped at the median, such a quadruple
    counts as a small loss, not the largest one; a config slower in most quadruples stays slower. The bound is
    symmetric about the median, so equal configs stay equal in distribution."""
    if sds <= 0 or len(gains) < MIN_PAIRS:
        return list(gains)
    mid, sd = statistics.median(gains), robust_sd(gains)
    if sd <= 0:
        return list(gains)
    return [min(max(g, mid - sds * sd), mid + sds * sd) for g in gains]


@lru_cache(maxsize=128)
def _signed_rank_cdf(n: int) -> tuple[float, ...]:
    """P(T <= t), t = 0 .. n(n+1)/2, of the Wilcoxon signed-rank statistic of ``n`` samples under H0."""
    m = n * (n + 1) // 2
    counts = [1] + [0] * m
    for r in range(1, n + 1):
        for t in range(m, r - 1, -1):
            counts[t] += counts[t - r]
    total, acc, cdf = 2**n, 0, []
    for c in counts:
        acc += c
        cdf.append(acc / total)
    return tuple(cdf)


@dataclass(frozen=True)
class Interval:
    """A gain (ms; positive: the candidate is faster) and its ``level`` confidence interval."""

    estimate: float
    low: float
    high: float
    n: int  # independent pairs (quadruples)
    level: float

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2 if math.isfinite(self.high - self.low) else math.inf

    @property
    def faster(self) -> bool:
        """The candidate is faster beyond the interval."""
        return self.low > 0

    @property
    def slower(self) -> bool:
        return self.high < 0

    def describe(self, unit: str = "ms", ref: float | None = None, sign: float = 1.0) -> str:
        """The estimate and both bounds (the interval is not symmetric: on 2 H200s "+9.792 +- 9.809" was printed
        for [+0.149, +19.768], which excludes zero). ``ref``: also in % of it; ``sign`` -1: as a change of time."""
        lo, hi = sorted((sign * self.low, sign * self.high))
        pct = (
            f" ({100 * sign * self.estimate / ref:+.2f}%, CI {100 * lo / ref:+.2f}% to {100 * hi / ref:+.2f}%)"
            if ref
            else ""
        )
        return f"{sign * self.estimate:+.3f} {unit} ({self.level:.0%} CI {lo:+.3f} to {hi:+.3f}, n={self.n}){pct}"

    def to_dict(self) -> dict[str, float | int]:
        r = lambda v: round(v, 4) if math.isfinite(v) else None  # noqa: E731
        return {"gain_ms": r(self.estimate), "ci_low_ms": r(self.low), "ci_high_ms": r(self.high), "n": self.n}


def gain_interval(gains: Sequence[float], level: float = 0.95) -> Interval:
    """Hodges-Lehmann estimate of the median of ``gains`` with its distribution-free ``level`` confidence
    interval (Wilcoxon signed-rank, exact). Infinite bounds while there are too few pairs for ``level``
    (6 pairs give a 95% interval, 8 give 99%)."""
    n = len(gains)
    if n == 0:
        return Interval(0.0, -math.inf, math.inf, 0, level)
    walsh = sorted((gains[i] + gains[j]) / 2 for i in range(n) for j in range(i, n))
    est = statistics.median(walsh)
    cdf = _signed_rank_cdf(n)
    alpha = (1 - level) / 2
    k = 0  # the interval is [walsh[k], walsh[M-1-k]] with P(T <= k-1) <= alpha
    while k < len(cdf) and cdf[k] <= alpha:
        k += 1
    if k == 0:
        return Interval(est, -math.inf, math.inf, n, level)
    return Interval(est, walsh[k - 1], walsh[len(walsh) - k], n, level)


def rest_adjusted(gains: Sequence[float], rest: Sequence[float]) -> list[float]:
    """Quadruple ``gains`` less what the rest of the step's quadruple gains ``rest`` (the same quadruples; the step
    minus every timed slot, the same kernels whatever the config) explain: ``g - beta r``, ``beta`` their least-squares
    slope. Equal configs have no rest gain but by chance; where a stretch of fast steps (the machine, not the config)
    fell on one config's blocks it moved the slots and the rest together, and the adjusted gains keep only the part
    the rest does not share. ``gains`` unchanged with fewer than ``MIN_PAIRS`` quadruples or a constant rest."""
    if len(gains) < MIN_PAIRS or len(rest) != len(gains):
        return list(gains)
    try:
        beta = statistics.linear_regression(rest, gains).slope
    except statistics.StatisticsError:  # a constant rest explains nothing
        return list(gains)
    return [g - beta * r for g, r in zip(gains, rest)]


def looks_after(quads: int) -> bool:
    """Whether a sequential decision looks after its ``quads``-th quadruple (its last one aside, where it always does)."""
    return quads <= DENSE_LOOKS or quads % SPARSE_EVERY == 0


def look(gains: Sequence[float], level: float, last: bool, sds: float) -> Interval:
    """The interval at one look of a sequential decision over quadruple ``gains``: clipped (:func:`clipped`), at
    ``level`` on the last look and at least ``INTERIM_LEVEL`` before it."""
    return gain_interval(clipped(gains, sds), level if last else max(level, INTERIM_LEVEL))
