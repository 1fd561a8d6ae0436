"""What does a call's first trial reading a forward fast do to the search, and does a setting take it out?

    python benchmarks/studies/place_whatif.py --scenario iid --place proj.fwd=0.15 --seeds 0-99 --variants z=2.5 z=3.0

On 2 x H200 (results/2026-11-30_h200x2e/) the first 8-step trial of a call of the looks, right after the search's
judging, read a host-bound ``proj.fwd`` 0.30-0.52 ms (12-18%) faster than the trial after it, look or bracket alike;
every equal world brought a choice to the final decision, and one FP8 gain was lost to an equal choice accepted so.
decision_sim has no such effect. Here each call of looks (``Looks._looks_of``) marks the run, and the first trial of
8 steps or more that follows reads each ``--place`` slot that share of its level faster (the step by the same ms);
the marked trial is the call's first look (``balance_looks`` 1-4, since removed, put a bracket or a settle trial
there: results/2026-11-25_cpu/decision_sim/, fifty-seventh section). The effect was the frame stack's, not the
place's (results/2026-11-30_h200x2i/; engine/frames.py). Per variant, over the table's gain and equal worlds of
``--seeds``: realized mean and worst, the seeds under 80%, false winners, and the searches that accepted a choice not
truly faster (the final decision's to catch). A malformed value ends the run with one line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from contextlib import contextmanager

from noise_streams import parse_seeds  # the studies' own (this folder is on sys.path)
from noise_whatif import _pairs
from search_on_real_steps import parse_variant

from megatron_tp_overlap.engine.looks import Looks
from megatron_tp_overlap.engine.search import SearchOptions
from megatron_tp_overlap.tools.research import decision_sim as sim

FIRST_STEPS = 8  # the shortest trial that shows it: the looks' (the racing's 4-step trials did not)


@contextmanager
def placed(place: dict[str, float]):
    """decision_sim with a call of looks' first trial of ``FIRST_STEPS`` or more reading ``place``'s slots faster by
    that share of their level (:class:`~decision_sim.SimulatedRun`; the step by the same ms); put back on exit."""
    looks_of, call = Looks._looks_of, sim.SimulatedRun.__call__

    def marked(self, *a, **k):
        run = getattr(self.evaluate, "run", self.evaluate)  # decision_sim.Clocked wraps the run
        run.fresh = True
        return looks_of(self, *a, **k)

    def measured(self, config, steps, warmup):
        m, first = call(self, config, steps, warmup), getattr(self, "fresh", False)
        self.fresh = False  # any trial ends the call's first place
        if first and steps >= FIRST_STEPS:
            for s, rel in place.items():
                less = [v * rel for v in m.slot_ms[s]]
                m.slot_ms[s] = [v - d for v, d in zip(m.slot_ms[s], less)]
                m.step_ms = [v - d for v, d in zip(m.step_ms, less)]
        return m

    Looks._looks_of, sim.SimulatedRun.__call__ = marked, measured
    try:
        yield
    finally:
        Looks._looks_of, sim.SimulatedRun.__call__ = looks_of, call


def stray_choice(o: sim.Outcome) -> bool:
    """The search accepted a choice that is not truly faster (its true gain 0 or less: the final decision's to catch)."""
    return any(c.get("accepted") and c.get("true_ms", 0.0) <= 0 for c in o.choices.values())


def summary(scenario: str, seeds: list[int], options: SearchOptions) -> dict:
    """Realized mean / worst, seeds under 80%, false winners, equal worlds with a choice, searches with a stray one."""
    gains, equal, stray = [], [], []
    for s in seeds:
        for gain, seed, into in ((sim.seed_gain(s), sim.GAIN_SEED + s, gains), (0.0, sim.EQUAL_SEED + s, equal)):
            o = sim.run_once(scenario, gain, seed, options)
            into.append(o)
            stray.append(stray_choice(o))
    real = [o.realized for o in gains if not math.isnan(o.realized)]
    return {
        "realized_mean": round(statistics.mean(real), 4),
        "realized_min": round(min(real), 4),
        "below_80": sorted((round(o.realized, 3), s) for s, o in zip(seeds, gains) if o.realized < sim.LISTED_BELOW),
        "false_winners": [s for s, o in zip(seeds, equal) if o.false_winner],
        "equal_with_choice": sum(any(c.get("accepted") for c in o.choices.values()) for o in equal),
        "stray_choice_searches": sum(stray),
        "searches": 2 * len(seeds),
        "seconds_median": round(statistics.median(o.seconds for o in gains + equal), 1),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", default="iid", choices=sim.SCENARIOS)
    p.add_argument("--place", nargs="*", default=[], metavar="SLOT=REL", help="e.g. proj.fwd=0.15 (none: no effect)")
    p.add_argument("--seeds", nargs="+", default=["0-19"], metavar="S", help="table seeds, e.g. 0-99")
    p.add_argument("--variants", nargs="+", default=[""], metavar="KEY=VALUE[,...]", help="search options per variant")
    a = p.parse_args(argv)
    try:  # bad input: one line, exit 2 (argparse's own)
        place = {s: rel for s, (rel,) in _pairs(a.place, 1).items()}  # noise_whatif's SLOT=X items
        for s, rel in place.items():
            if s not in sim.SLOTS:
                raise ValueError(f"--place {s}: not a slot ({', '.join(sim.SLOTS)})")
            if not 0 <= rel < 1:
                raise ValueError(f"--place {s}={rel:g}: the share must be at least 0 and under 1")
        variants = {v or "defaults": SearchOptions(**parse_variant(v)) for v in a.variants}
        seeds = parse_seeds(a.seeds)
    except ValueError as e:
        p.error(str(e))
    with placed(place):
        for name, options in variants.items():
            print(
                json.dumps(
                    {"scenario": a.scenario, "place": place, "variant": name} | summary(a.scenario, seeds, options)
                )
            )


if __name__ == "__main__":
    main()
