"""Robust statistics of step-time samples (ms) for the search's decisions."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def robust_sigma(values: Sequence[float]) -> float:
    """Standard deviation estimated from the median absolute deviation (outlier-resistant)."""
    if len(values) < 2:
        return 0.0
    med = statistics.median(values)
    return 1.4826 * statistics.median(abs(v - med) for v in values)


def pooled_sigma(groups: Sequence[Sequence[float]]) -> float:
    """Step-to-step spread pooled over groups of repeats of the same thing (residuals to each median, scaled by
    sqrt(g / (g - 1)): residuals to a group's own centre understate the spread, by a third for pairs)."""
    resid = [(v - statistics.median(g)) * math.sqrt(len(g) / (len(g) - 1)) for g in groups if len(g) >= 2 for v in g]
    return robust_sigma(resid) if len(resid) >= 2 else 0.0
