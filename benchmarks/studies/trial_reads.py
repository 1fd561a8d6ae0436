"""What did a search's own trials read of a gain it left, and would another per-trial statistic have read it? (issue 46)

For each gain seed whose JSON keeps a ``miss_trace`` (``search_on_real_steps.py``; rows keep each step's slot and rest
ms since 588e360), per traced forward slot: each trial of a config with less delay put in than the incumbent's (the gain
left: "true") and each trial of another config with the incumbent's delay ("equal": the noise), both before the final
rounds (selection, decision), against the incumbent's own trial nearest in position, read four ways: the median of its
steps (what the racing scores), its fastest step, its 25th percentile, and the mean of its steps capped at 1.05x the
10th percentile of the incumbent's steps (``floor_cap``'s count). Printed: the true trials' mean +- se against the delay
put in, and the equal trials' sd. Then the steps split by the rest of the step (step minus every slot) at the midpoint
of its 10th and 90th percentiles: the true config's and the incumbent's median slot ms in short-rest and in long-rest
steps. A split on the rest conditions on something the config may move, so it describes the trials; it does not prove a
cause.

    python benchmarks/studies/trial_reads.py RUN_DIR/search_on_real_steps.json ...
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

CAP = 1.05  # floor_cap=0.05's top over the 10th-percentile step
FINAL = ("select", "confirm")  # the final rounds' blocks of whole configs, not an option's trials


def reads(steps: list[float], top: float) -> dict[str, float]:
    """One trial's steps (ms) four ways; ``top``: the cap of the capped mean."""
    s = sorted(steps)
    return {
        "median": statistics.median(s),
        "fastest": s[0],
        "q25": s[len(s) // 4],
        "capped mean": statistics.fmean(min(v, top) for v in s),
    }


def slot_reads(rows: list[list]) -> dict | None:
    """One slot's ``miss_trace`` rows: per statistic the true and the equal trials' differences from the incumbent's
    nearest trial (ms, negative: faster), the delay put in, and the rest split; None without both kinds of trial."""
    inc = [x for x in rows if x[0] in ("baseline", "bracket") and len(x) > 6 and len(x[5]) >= 2]
    if not inc:
        return None
    ref_put = statistics.median(x[3] for x in inc)
    steps = sorted(v for x in inc for v in x[5])
    top = CAP * steps[len(steps) // 10]
    diffs: dict[str, dict[str, list[float]]] = {"true": {}, "equal": {}}
    put, split = [], {}
    rests = sorted(v for x in rows if len(x) > 6 for v in x[6])
    cut = (rests[len(rests) // 10] + rests[-(len(rests) // 10) - 1]) / 2
    for x in rows:
        if len(x) <= 6 or len(x[5]) < 2 or x[0] in FINAL:
            continue
        kind = "incumbent" if x in inc else "true" if x[3] < ref_put - 1e-9 else "equal" if x[3] == ref_put else ""
        if kind in ("true", "incumbent"):
            for v, r in zip(x[5], x[6]):
                split.setdefault((kind, "short" if r < cut else "long"), []).append(v)
        if kind in ("true", "equal"):
            near = min(inc, key=lambda y: abs(y[1] - x[1]))
            mine, theirs = reads(x[5], top), reads(near[5], top)
            for k in mine:
                diffs[kind].setdefault(k, []).append(mine[k] - theirs[k])
            put += [x[3] - ref_put] if kind == "true" else []
    if not put or not diffs["equal"]:
        return None
    return {"put_in_ms": statistics.fmean(put), "diffs": diffs, "rest_cut_ms": cut, "split": split}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("json", nargs="+", type=Path)
    a = p.parse_args()
    for f in a.json:
        for r in json.loads(f.read_text()).get("runs", []):
            for slot, rows in (r.get("miss_trace") or {}).items():
                got = slot_reads(rows) if slot.endswith(".fwd") else None
                if got is None:
                    continue
                t, e = got["diffs"]["true"], got["diffs"]["equal"]
                print(f"\nseed {r['seed']} ({r['variant']}) {slot}: {got['put_in_ms']:+.3f} ms put in, "
                      f"{len(t['median'])} true trials, {len(e['median'])} equal")  # fmt: skip
                print("| statistic | true trials, mean +- se (ms) | equal trials, sd (ms) |\n|---|---|---|")
                for k in t:
                    se = statistics.stdev(t[k]) / len(t[k]) ** 0.5 if len(t[k]) > 1 else float("nan")
                    print(f"| {k} | {statistics.fmean(t[k]):+.3f} +- {se:.3f} | {statistics.stdev(e[k]):.3f} |")
                for half in ("short", "long"):
                    mine, inc = got["split"].get(("true", half), []), got["split"].get(("incumbent", half), [])
                    if mine and inc:
                        a, b = statistics.median(mine), statistics.median(inc)
                        print(
                            f"{half}-rest steps (rest {'<' if half == 'short' else '>='} {got['rest_cut_ms']:.1f} "
                            f"ms): true {a:.3f} ms ({len(mine)} steps), incumbent {b:.3f} ({len(inc)}), {a - b:+.3f}"
                        )


if __name__ == "__main__":
    main()
