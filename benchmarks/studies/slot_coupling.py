"""Does a slot's own reading move with the delays put in the other slots? A fit over a search's own trials.

    python benchmarks/studies/slot_coupling.py DIR_OR_JSON [...]

A racing trial or a look measures a different option in every slot at once, and scores each slot against the
incumbent's trials (brackets) next to it. That attributes a slot's change to its own option only if the slot's
reading does not move with what the other slots run. On a host-bound forward it may: where the GPU waits for the
host, a delay elsewhere in the step changes how much of that wait lands in the slot. Granite-3-8B-like FP8's true
``proj_fprop`` of world 22500 on one H200 showed 0.10 ms of its 0.14 in racing trials next to the chosen config's
faster backwards, and 0.05 against the reference's (``../results/2026-11-28_h200x4c/``).

For each search that kept its trials (``miss_trace`` rows with every slot's put-in delay, since the thirty-fifth
session), per traced slot: every trial that is not a bracket, as its reading minus the nearest bracket's (ms), fitted
by least squares on the put-in delays' differences from that bracket, slot by slot (ms), and a constant (ms: what a
trial reads against its bracket with nothing put in differently). The coefficient of the slot's own delay is the
share of it that shows; any other's, the ms the slot reads per ms put in that other slot. Standard errors are the
ordinary ones; a column that never differs from the brackets is left out. A share of the slot's own delay that
depends on what the others run (an interaction) is not a coefficient here: the study's ABBA checks after a miss
measure that (``search_on_real_steps.MISS_CHECKS``).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from real_steps_bar import load_or_say  # this folder is on sys.path as a script's


def fit(rows: list[list], slots: list[str]) -> dict | None:
    """The least-squares fit of one slot's trials (``rows``: its ``miss_trace``) against their nearest brackets
    (module docstring): ``{"trials", "constant": [ms, se], "per_ms": {slot: [coefficient, se]}}``, or None with too
    few trials or no 5th column."""
    inc = [r for r in rows if r[0] in ("baseline", "bracket")]
    rest = [r for r in rows if r[0] not in ("baseline", "bracket")]
    if not inc or not rest or len(rest[0]) < 5:
        return None
    y, x = [], []
    for _, pos, ms, _, every, *_ in rest:
        near = min(inc, key=lambda b: abs(b[1] - pos))
        y.append(ms - near[2])
        x.append([a - b for a, b in zip(every, near[4])])
    cols = [j for j in range(len(slots)) if any(abs(row[j]) > 1e-9 for row in x)]
    if len(rest) <= len(cols) + 2:
        return None
    a = np.column_stack([np.ones(len(y))] + [np.array([row[j] for row in x]) for j in cols])
    coef, *_ = np.linalg.lstsq(a, np.array(y), rcond=None)
    resid = np.array(y) - a @ coef
    dof = len(y) - a.shape[1]
    cov = float(resid @ resid) / dof * np.linalg.pinv(a.T @ a)
    se = np.sqrt(np.clip(np.diag(cov), 0.0, None))
    r4 = lambda v: round(float(v), 4)  # noqa: E731
    return {
        "trials": len(y),
        "constant": [r4(coef[0]), r4(se[0])],
        "per_ms": {slots[j]: [r4(coef[i + 1]), r4(se[i + 1])] for i, j in enumerate(cols)},
    }


def lines(runs: list[dict], z: float = 2.0) -> list[str]:
    """One line per traced slot of each search: the constant, the slot's own share, and each other slot whose
    coefficient is beyond ``z`` standard errors."""
    out = []
    for r in runs:
        slots = r.get("slots")
        for slot, rows in (r.get("miss_trace") or {}).items():
            f = fit(rows, slots) if slots else None
            if f is None:
                continue
            own = f["per_ms"].get(slot)
            others = [
                f"{s} {c:+.2f} +- {e:.2f}"
                for s, (c, e) in f["per_ms"].items()
                if s != slot and abs(c) > max(z * e, 1e-6)
            ]
            out.append(
                f"seed {r['seed']} ({r['dtype']}, {r.get('variant') or 'defaults'}) {slot}, {f['trials']} trials: "
                f"{f['constant'][0]:+.3f} +- {f['constant'][1]:.3f} ms against the brackets; "
                + (f"own delay {own[0]:.2f} +- {own[1]:.2f} shows" if own else "own delay never differed")
                + "; per ms put in elsewhere: "
                + (", ".join(others) or f"none beyond {z:g} standard errors")
            )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="+", help="folders holding search_on_real_steps.json, or the files")
    a = p.parse_args(argv)
    if not (runs := load_or_say(a.paths)):
        return 2
    out = lines(runs)
    print("\n".join(out) if out else "no search kept every slot's put-in delays in its trace")
    return 0


if __name__ == "__main__":
    sys.exit(main())
