"""TP scaling efficiency: which TP size to run, given measured step times per TP size.

TP=1 is the baseline. TP=n is *efficient* when time(n) <= time(1) / n x (1 + tol): n GPUs do the
work of one at least 1/(1 + tol) as well as perfect scaling. The recommendation is the largest
efficient TP size; every other size gets its reason.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScalingVerdict:
    tp: int
    time_ms: float
    ideal_ms: float  # time(1) / tp
    efficiency: float  # ideal / time
    efficient: bool
    reason: str


def scaling_report(times_ms: dict[int, float], tol: float = 0.2) -> tuple[int, list[ScalingVerdict]]:
    """(recommended TP size, a verdict per TP size). ``times_ms`` needs TP=1."""
    if 1 not in times_ms:
        raise ValueError("TP scaling needs the TP=1 time as its baseline")
    if tol < 0:
        raise ValueError(f"tol = {tol}: must be >= 0")
    base = times_ms[1]
    verdicts = []
    for tp in sorted(times_ms):
        t = times_ms[tp]
        ideal = base / tp
        eff = ideal / t if t > 0 else 0.0
        ok = t <= ideal * (1 + tol)
        if tp == 1:
            reason = "baseline"
        elif ok:
            reason = f"efficient: {t:.2f} ms <= {ideal:.2f} ms x {1 + tol:g} (scaling efficiency {eff:.0%})"
        else:
            reason = f"not efficient: {t:.2f} ms > {ideal:.2f} ms x {1 + tol:g} (scaling efficiency {eff:.0%})"
        verdicts.append(ScalingVerdict(tp, t, ideal, eff, ok, reason))
    recommended = max(v.tp for v in verdicts if v.efficient)
    return recommended, verdicts
