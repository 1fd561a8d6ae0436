"""Is a host-bound forward's step time a spread around a level, or a floor with stretches above it? (issue 46)

decision_sim's ``hostfwd`` and ``hostglm`` spread a noisy forward's trials and steps around its level (Gaussian). On
real FP8 steps the misses of issue 46 sit in such forwards. This reads the per-step slot times of
``search_on_real_steps.py --runs 0 --common-factor N`` runs (an equal world, racing-like trials) and, per run and
slot, splits the steps at 1.25x the slot's floor (the median of its fastest quarter of steps): the floor, the share of
steps above it ("slow"), how a slow step follows a slow or a fast one (a two-state chain), the slow steps over the
floor (quantiles), and the rest of the step (step minus every slot) in fast and in slow steps. These are the figures
``decision_sim``'s ``hostmax`` scenario is built on (tools/research/disturbances.py). A search's JSON gives the same
for the reference's own trials of each slot its ``miss_trace`` keeps; the last column is ``floor_cap``'s view: the
share of steps within 5% of the 10th percentile, beyond ``floors.FAR_OVER`` x it, and of trials with steps at
both.

    python benchmarks/studies/host_modes.py RUN_DIR/search_on_real_steps.json ... [--slots proj.fwd qkv.fwd]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from megatron_tp_overlap.engine.floors import FAR_OVER

SLOW_OVER_FLOOR = 1.25  # a step above this many times the slot's floor is a slow one
NEAR, FAR = 1.05, FAR_OVER  # floor_cap=0.05's top over the 10th-percentile step, and its "far above" (mixed: both)


def modes(trials: list[list[float]], rest: list[float]) -> dict:
    """One slot: ``trials``, its ms per step, trial by trial in run order; ``rest``, the rest of the step's ms per
    step (step minus every slot), in the same order."""
    seq = [v for t in trials for v in t]
    floor = statistics.median(sorted(seq)[: max(1, len(seq) // 4)])
    slow = [v > SLOW_OVER_FLOOR * floor for v in seq]
    pairs = list(zip(slow, slow[1:]))
    after_slow = [b for a, b in pairs if a]
    after_fast = [b for a, b in pairs if not a]
    over = sorted(v / floor for v, s in zip(seq, slow) if s)
    q10 = sorted(seq)[len(seq) // 10]
    multi = [t for t in trials if len(t) >= 2]

    def q(p: float) -> float:
        return over[int(p * (len(over) - 1))] if over else float("nan")

    return {
        "steps": len(seq),
        "floor_ms": round(floor, 4),
        "slow_share": round(sum(slow) / len(slow), 3),
        "p_slow_after_slow": round(sum(after_slow) / len(after_slow), 3) if after_slow else None,
        "p_slow_after_fast": round(sum(after_fast) / len(after_fast), 3) if after_fast else None,
        "slow_over_floor_q10_50_90": [round(q(0.1), 2), round(q(0.5), 2), round(q(0.9), 2)],
        "rest_ms_fast_slow": [
            round(statistics.median([r for r, s in zip(rest, slow) if not s]), 2),
            round(statistics.median([r for r, s in zip(rest, slow) if s]), 2) if any(slow) else None,
        ],
        # floor_cap's view: steps at its top, steps far above, trials with both
        "near_far_mixed": [
            round(sum(v <= NEAR * q10 for v in seq) / len(seq), 2),
            round(sum(v > FAR * q10 for v in seq) / len(seq), 2),
            round(sum(min(t) <= NEAR * q10 and max(t) > FAR * q10 for t in multi) / max(1, len(multi)), 2),
        ],
    }


def runs_of(path: Path, slots: list[str]) -> list[tuple[str, str, dict]]:
    """(run, slot, :func:`modes`) per slot of a ``--common-factor`` run's trials, or per traced slot of each search's
    ``miss_trace`` (the reference's own trials: baseline and brackets, whose rows keep their steps since 588e360)."""
    d = json.loads(path.read_text())
    out = []
    if "common_factor" in d:
        trials = d["common_factor"]["trials"]
        names = sorted(trials[0]["slots"])
        rest = [t["step"][i] - sum(t["slots"][n][i] for n in names) for t in trials for i in range(len(t["step"]))]
        out += [(path.parent.name, s, modes([t["slots"][s] for t in trials], rest)) for s in slots]
    for r in d.get("runs", []):
        for s, rows in (r.get("miss_trace") or {}).items():
            inc = [row for row in rows if row[0] in ("baseline", "bracket") and len(row) > 6 and row[5]]
            if s in slots and inc:
                out.append((f"seed {r['seed']}", s, modes([row[5] for row in inc], [x for row in inc for x in row[6]])))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("json", nargs="+", type=Path)
    p.add_argument("--slots", nargs="+", default=["proj.fwd", "qkv.fwd"])
    a = p.parse_args()
    print("| run | slot | steps | floor ms | slow share | P(slow after slow) | P(slow after fast) | slow / floor q10, "
          "q50, q90 | rest ms, fast / slow steps | at the top, far, mixed trials |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for f in a.json:
        for run, s, m in runs_of(f, a.slots):
            q = ", ".join(f"{x:.2f}" for x in m["slow_over_floor_q10_50_90"])
            r = " / ".join(str(x) for x in m["rest_ms_fast_slow"])
            nfm = ", ".join(f"{x:.2f}" for x in m["near_far_mixed"])
            print(
                f"| {run} | {s} | {m['steps']} | {m['floor_ms']:.3f} | {m['slow_share']:.2f} | "
                f"{m['p_slow_after_slow']} | {m['p_slow_after_fast']} | {q} | {r} | {nfm} |"
            )


if __name__ == "__main__":
    main()
