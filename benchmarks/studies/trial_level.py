"""Is a trial's level a constant of the trial, or slow step noise that longer trials average out? (issue 46)

The search's standard errors count a level that all steps of a trial share (``engine/trial_effect.py``): per slot, the
part of the incumbent's trial-to-trial spread that its steps' own spread does not explain. If that level is a constant
of the trial (where the switch left buffers, clocks after the idle gap), longer trials cannot shrink it: only more
trials can, and a gain of 1% of the largest slot needs more fresh looks than a 60 s budget holds. If it is slow step
noise (clocks drifting over a few steps), a look twice as long halves its share.

Input: ``search_on_real_steps.py --runs 0 --common-factor TRIALS --common-factor-steps 16``: trials alternating two
configs of an equal world, a switch before each. Per slot, from consecutive trials of the same config (a drift over
two trials cancels):

- ``step_pct``: one step's relative spread (``stats.pooled_sigma``: successive differences within trials);
- ``level_pct[L]``: the spread of a trial's mean over its first L steps beyond what ``step_pct`` explains,
  ``sqrt(var / 2 - step^2 / L)`` (0 where the steps explain it all). Flat in L: a constant of the trial;
  falling like 1 / sqrt(L): slow noise (16 steps reach the slow stretch after a switch on the slower models);
- ``halves_corr``: the correlation of the trial-to-trial changes of the mean of steps 0-3 and of steps 4-7: a
  constant level gives ``level^2 / (level^2 + step^2 / 4)``, noise slower than a step but faster than 4 gives ~0;
- ``by_position_pct``: every slot's time by position since the switch (1 warm-up before position 0).

    python benchmarks/studies/trial_level.py DIR/search_on_real_steps.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from megatron_tp_overlap.engine.stats import pooled_sigma, robust_sd

LENGTHS = (2, 4, 8, 16)


def summarize(trials: list[dict]) -> dict:
    """``trials``: [{"slots": {slot: [ms per step]}, ...}] alternating two configs (even, odd). Per slot: see the
    module's docstring; lengths longer than the trials are left out."""
    n_steps = min(len(t["step"]) for t in trials)
    out: dict = {"trials": len(trials), "steps": n_steps, "slots": {}}
    for s in sorted(trials[0]["slots"]):
        rel = []
        for parity in (0, 1):
            mine = [t["slots"][s][:n_steps] for t in trials[parity::2]]
            mid = statistics.median(v for x in mine for v in x)
            rel.append([[v / mid - 1 for v in x] for x in mine])
        step = pooled_sigma([x for group in rel for x in group])
        row = {"ms": round(statistics.median(trials[0]["slots"][s]), 3), "step_pct": round(100 * step, 3)}
        levels = {}
        for n in (L for L in LENGTHS if L <= n_steps):
            d = [statistics.fmean(b[:n]) - statistics.fmean(a[:n]) for group in rel for a, b in zip(group, group[1:])]
            var = robust_sd(d) ** 2 / 2
            levels[n] = round(100 * max(0.0, var - step * step / n) ** 0.5, 3)
        row["level_pct"] = levels
        if n_steps >= 8:  # the first 8 steps: the slow stretch after a switch comes later (see by_position_pct)
            da = [statistics.fmean(b[:4]) - statistics.fmean(a[:4]) for g in rel for a, b in zip(g, g[1:])]
            db = [statistics.fmean(b[4:8]) - statistics.fmean(a[4:8]) for g in rel for a, b in zip(g, g[1:])]
            row["halves_corr"] = round(statistics.correlation(da, db), 3)
        out["slots"][s] = row
    # every slot's time by position since the switch, over the median position: a slow stretch at one moment after
    # each switch (H200, H100: 14-19% in bf16 for ~3 steps, ~0.85 s after the idle gap) sits at the same position in every trial
    total = [[sum(t["slots"][s][i] for s in t["slots"]) for i in range(n_steps)] for t in trials]
    by_pos = [statistics.median(x[i] for x in total) for i in range(n_steps)]
    mid = statistics.median(by_pos)
    out["by_position_pct"] = [round(100 * (v / mid - 1), 1) for v in by_pos]
    return out


def table(summary: dict) -> str:
    lengths = [L for L in LENGTHS if L <= summary["steps"]]
    head = "| slot | ms per step | step spread, % | " + " | ".join(f"level over {L} steps, %" for L in lengths)
    rows = [head + " | halves' correlation |", "|---" * (len(lengths) + 4) + "|"]
    for s, r in summary["slots"].items():
        lv = " | ".join(str(r["level_pct"][L]) for L in lengths)
        rows.append(f"| {s} | {r['ms']} | {r['step_pct']} | {lv} | {r.get('halves_corr', '')} |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("json", type=Path, nargs="+", help="search_on_real_steps.json with common_factor trials")
    a = p.parse_args()
    for f in a.json:
        s = summarize(json.loads(f.read_text())["common_factor"]["trials"])
        print(f"{f}: {s['trials']} trials of {s['steps']} steps")
        print(table(s))
        print("every slot by position since the switch, % over the median:", s["by_position_pct"])


if __name__ == "__main__":
    main()
