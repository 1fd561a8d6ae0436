"""How far does a slot move with the rest of the step, and what does scaling by it leave of its trials' spread?

Over the ``trace`` (or ``miss_trace``) of ``search_on_real_steps.py`` JSONs that kept each step's rest (the step minus
every slot; ``--trace SLOT ...``), per search and traced slot: the slope the search fits (``rest_scaling.fit_betas``,
each step's relative change on the rest's within a trial, unclipped here), the same slope between the trials' means,
and the relative spread of the trials' medians (put-in delays taken out) unscaled, scaled at slope 1 (the cap until
issue 46's forty-seventh session), at the fitted slope capped at ``--cap`` and uncapped. The question it answered:
real L- and M-shaped FP8 forwards moved 1.8-5.6x the rest, so the cap of 1 left most of what they share with it
(``SearchOptions.rest_beta_max``; benchmarks/results/2026-11-25_cpu/decision_sim/, forty-seventh section). A second
table gives the rest itself per search: its trials' medians apart and its steps apart within a trial (relative sd),
what decision_sim ``hostrest`` draws (``disturbances.REST_SPREAD``).

    python benchmarks/studies/rest_slopes.py DIR_OR_JSON ... [--cap N]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from types import SimpleNamespace

from megatron_tp_overlap.engine import rest_scaling
from megatron_tp_overlap.engine.trial import SearchOptions


def trials_of(rows: list[list]) -> list[SimpleNamespace]:
    """A trace's rows as trials of one slot ("s"): its steps less the delay put in, and the rest's steps."""
    out = []
    for r in rows:
        steps, rest = r[5], r[6] if len(r) > 6 else []
        if len(steps) >= 2 and len(steps) == len(rest):
            out.append(SimpleNamespace(error=None, slot_samples={"s": [v - r[3] for v in steps]}, rest_samples=rest))
    return out


def spread(trials: list[SimpleNamespace], beta: float) -> float:
    """The relative spread (sd / median) of the trials' medians once each step is scaled at ``beta``."""
    norm = rest_scaling.norm_for(trials, {"s": beta}) if beta else None
    levels = [statistics.median(rest_scaling.scaled(t, norm)["s"]) for t in trials]
    return statistics.stdev(levels) / statistics.median(levels)


def trial_slope(trials: list[SimpleNamespace]) -> float:
    """The slope of the trials' relative mean levels on the rest's."""
    ys = [statistics.fmean(t.slot_samples["s"]) for t in trials]
    cs = [statistics.fmean(t.rest_samples) for t in trials]
    my, mc = statistics.median(ys), statistics.median(cs)
    return statistics.linear_regression([c / mc for c in cs], [y / my for y in ys]).slope


def rest_spreads(trials: list[SimpleNamespace]) -> tuple[float, float, float]:
    """The rest's median ms, its trials' medians apart (sd / median) and its steps apart within a trial (the median
    over trials of sd / median)."""
    levels = [statistics.median(t.rest_samples) for t in trials]
    within = statistics.median(statistics.stdev(t.rest_samples) / statistics.median(t.rest_samples) for t in trials)
    return statistics.median(levels), statistics.stdev(levels) / statistics.median(levels), within


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="+", help="search_on_real_steps.json files or folders holding them")
    p.add_argument("--cap", type=float, default=SearchOptions.rest_beta_max, help="the slope's cap (the search's)")
    a = p.parse_args()
    files = [
        f for x in map(Path, a.paths) for f in ([x] if x.is_file() else sorted(x.rglob("search_on_real_steps.json")))
    ]
    print(
        f"| search | slot | trials | slope, steps / trials | trials apart: unscaled / at 1 / at <= {a.cap:g} / fitted |"
    )
    print("|---|---|---|---|---|")
    rests = []
    for f in files:
        for run in json.loads(f.read_text())["runs"]:
            for i, (slot, rows) in enumerate((run.get("trace") or run.get("miss_trace") or {}).items()):
                trials = trials_of(rows)
                if len(trials) < 10:
                    continue
                if i == 0:  # every traced slot's rows carry the same trials' rest
                    rests.append((f"{run['seed']} {run.get('variant') or ''}", len(trials), *rest_spreads(trials)))
                b = rest_scaling.fit_betas(trials, most=100.0)["s"]
                ways = [spread(trials, x) for x in (0.0, 1.0, min(b, a.cap), b)]
                print(
                    f"| {run['seed']} {run.get('variant') or ''} | `{slot}` | {len(trials)} | {b:.1f} / "
                    f"{trial_slope(trials):.1f} | " + " / ".join(f"{100 * w:.1f}%" for w in ways) + " |"
                )
    print("\n| search | trials | the rest, ms | its trials apart | its steps apart |\n|---|---|---|---|---|")
    for name, n, ms, apart, steps in rests:
        print(f"| {name} | {n} | {ms:.2f} | {100 * apart:.1f}% | {100 * steps:.1f}% |")


if __name__ == "__main__":
    main()
