"""The incumbent's trials around a racing trial ("brackets"), by position (engine/racing.py).

``pts`` are the incumbent's trials as (position, level, measured steps), sorted by position, and ``pos`` holds their
positions: the trials on either side of a position are found by bisection (these run per trial of every option in
every racing round).
"""

from __future__ import annotations

import bisect

Pts = list[tuple[float, float, int]]
JUMP = 0.1  # a change of the incumbent's level between two of its trials beyond which the trials between are unknown
JUMP_SDS = 3.0  # ... or this many standard deviations of the difference two trials' own levels give (jump_for)


def ref_var(pts: Pts, pos: list[float], position: float) -> float:
    """The variance of the incumbent's level interpolated at ``position``, in units of one sample's:
    ``w^2 / n0 + (1 - w)^2 / n1`` for the weights and sample counts of the trials on either side."""
    i = bisect.bisect_right(pos, position)  # pts[:i] at or before ``position``, pts[i:] after it
    if i == 0 or i == len(pts):
        return 1 / max(1, pts[i - 1 if i else 0][2])
    (p0, _, n0), (p1, _, n1) = pts[i - 1], pts[i]
    w = (p1 - position) / (p1 - p0) if p1 > p0 else 0.5
    return w * w / max(1, n0) + (1 - w) * (1 - w) / max(1, n1)


def jumped(pts: Pts, pos: list[float], position: float, jump: float = JUMP) -> bool:
    """Whether the incumbent trials on either side of ``position`` differ by more than ``jump`` of its level: a
    sudden change (+25% for a stretch) between them leaves every re-measurement in between compared with a level the
    incumbent never had (on 40 simulated seeds the worst kept 42% of the gain); such a trial's samples are left out,
    and the option, less measured, runs again in the next round. (An adaptive threshold, from the brackets' own
    spread, did not help on simulated host-bound steps: benchmarks/results/2026-11-25_cpu/decision_sim/.) ``jump``:
    the racing raises it where the incumbent's own trials sit far apart (:func:`jump_for`)."""
    i0, i1 = bisect.bisect_left(pos, position), bisect.bisect_right(pos, position)  # strictly before / after
    if i0 == 0 or i1 == len(pts):
        return False
    before, after = pts[i0 - 1][1], pts[i1][1]
    return abs(after - before) > jump * max(after, before)


def jump_for(tau: float, level: float) -> float:
    """The jump threshold for slots at ``level`` ms whose trials sit ``tau`` ms apart: ``JUMP``, or ``JUMP_SDS``
    standard deviations of two trials' difference (relative) where that is larger. On real Gemma-like FP8 steps
    proj.fwd's trials sat 22% apart (H100, seed 21360): two brackets then differ by over 10% three times in four, and
    the fixed threshold left most of its trials and looks out (decision_sim hostfwd seed 6: 1 of 5 looks at the true
    leader counted; 33 of 200 seeds below 80%, 13 with this threshold)."""
    return max(JUMP, JUMP_SDS * 2**0.5 * tau / level) if level > 0 else JUMP
