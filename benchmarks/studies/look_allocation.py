"""What would another allocation of the fresh looks after the racing take, in decision_sim's worlds?

    python benchmarks/studies/look_allocation.py --scenario hostglm --seeds 57 176 123 149 14 --allocation oracle

The search gives each GEMM's leader its looks, the later ones while its interval still reaches a gain worth a switch
(up to ``max_looks``). Then, in a GEMM with nothing accepted, its best raced runners-up look one after another
(``engine/looks.py``). On decision_sim's host scenarios the worst seeds leave parts of 0.15-0.32 ms there. This study
keeps the leaders' first 1-3 looks (the kept ones) and changes only what comes after, under the search's own
acceptance rule (``Looks._accepts``: gain beyond z standard errors, ``late_z`` more for a later look):

- ``defaults``: the search as it is.
- ``queue``: each GEMM with nothing accepted puts its leader and its best raced runners-up (``runners_up``, whose raced
  interval reaches a gain worth a switch) in one queue. Each round, the candidate with the highest upper bound looks:
  its looks' gain + z se, or its raced one before its first look. A candidate leaves when accepted, when its interval
  no longer reaches a gain worth a switch, or at ``max_looks``.
- ``oracle``: each GEMM the world made faster, with nothing accepted, looks only at its truly fastest option, until
  accepted, at ``max_looks`` or at the budget. No allocation of these looks can take more, so a seed the oracle leaves
  is out of reach of any look scheduler at this acceptance rule and budget.

Per allocation, over the table's gain and equal worlds of ``--seeds``, it prints one JSON line
(``place_whatif.summary``): realized mean and worst, the seeds under 80%, false winners, and the equal worlds and
searches that accepted a choice. A malformed value ends the run with one line and exit status 2. Results:
results/2026-11-25_cpu/decision_sim/, sixty-third section.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from contextlib import contextmanager

from noise_streams import parse_seeds  # the studies' own (this folder is on sys.path)
from place_whatif import summary
from search_on_real_steps import parse_variant

from megatron_tp_overlap.engine.looks import RECHECKS, Looks
from megatron_tp_overlap.engine.search import SearchOptions
from megatron_tp_overlap.tools.research import decision_sim as sim

ALLOCATIONS = ("defaults", "queue", "oracle")


def _kept_looks_only(look):
    """``Looks._look`` with its later looks cut to the kept ones (``RECHECKS``); notes each GEMM's leader."""

    def kept(self, incumbent, race, leaders, decision_cost, contenders):
        o = self.opt
        self.opt = dataclasses.replace(o, max_looks=min(o.max_looks, RECHECKS))
        try:
            out = look(self, incumbent, race, leaders, decision_cost, contenders)
        finally:
            self.opt = o
        self.leaders_looked = {x.gemm: x for x in out[0]}
        return out

    return kept


def _candidates(searcher, incumbent, race, raw_fresh, accepted, worlds) -> dict[str, list]:
    """Per GEMM with nothing accepted, what may look (``searcher``: the search, in its runners-up phase). ``worlds``:
    the oracle's truth (the world being searched)."""
    if worlds:
        fast = worlds[-1].fast  # (gemm, option label) -> its true ms
        best = {g: min((ms, lab) for (h, lab), ms in fast.items() if h == g)[1] for g, _ in fast}
        return {x.gemm: [x] for x in race.raw if x.gemm not in accepted and best.get(x.gemm) == x.label}
    o, worth = searcher.opt, searcher._worth(incumbent)
    bounds = {x: b for x, e in race.raw.items() if (b := searcher._gain_bounds(incumbent, x, e))}
    out = {}
    for gemm in dict.fromkeys(x.gemm for x in bounds):
        if gemm in accepted:
            continue
        mine = [
            x for x in bounds if x.gemm == gemm and x not in raw_fresh and bounds[x][0] + o.z * bounds[x][1] >= worth
        ]
        lead = searcher.leaders_looked.get(gemm)
        queue = ([lead] if lead is not None and raw_fresh.get(lead) else []) + sorted(mine, key=lambda x: -bounds[x][0])
        if queue := queue[: o.runners_up + (lead in queue)]:
            out[gemm] = queue
    return out


def _scheduled(worlds: list):
    """``Looks._runners_up`` as the ``queue`` (``worlds`` empty) or the ``oracle`` allocation."""

    def runners_up(self, incumbent, race, raw_fresh, accepted, decision_cost, contenders):
        o, worth = self.opt, self._worth(incumbent)
        raced = {x: b for x, e in race.raw.items() if (b := self._gain_bounds(incumbent, x, e))}
        queue = _candidates(self, incumbent, race, raw_fresh, accepted, worlds)
        leaders = set(self.leaders_looked.values())

        def upper(x) -> float:  # its looks' gain + z se, or its raced one before its first look
            b = self._look_bounds(incumbent, x, raw_fresh[x]) if raw_fresh.get(x) else raced.get(x)
            return b[0] + o.z * b[1] if b else -float("inf")

        runners, took = [], {}
        hit, kept = (self.budget_hit, self.limit_hit), lambda: self._kept(decision_cost(), contenders, 0)
        while True:
            batch = []
            for gemm in list(queue):
                for x in [x for x in queue[gemm] if x in runners or x in leaders]:  # those that have looked
                    e = raw_fresh.get(x, [])
                    if e and self._accepts(incumbent, x, e):
                        choice, best = self._choose(incumbent, runners + [x], {x: e})
                        took[gemm] = choice[gemm], best[gemm]
                        del queue[gemm]
                        break
                    if not e or len(e) >= o.max_looks or not (worlds or self._reaches(incumbent, x, e, worth)):
                        queue[gemm].remove(x)
                else:
                    if not queue[gemm]:
                        del queue[gemm]
                        continue
                    x = max(queue[gemm], key=upper)
                    if x not in leaders and x not in runners:
                        self.runners.add(x)
                        runners.append(x)
                    batch.append(x)
            if not batch or self._looks_of(incumbent, batch, raw_fresh, kept):
                break
        self.budget_hit, self.limit_hit = hit  # these looks end at the reserve by design
        return runners, took

    return runners_up


@contextmanager
def allocated(kind: str):
    """decision_sim's searches with the looks after the kept ones allocated as ``kind`` (:data:`ALLOCATIONS`); put
    back on exit."""
    look, runners_up, make_world = Looks._look, Looks._runners_up, sim.make_world
    worlds: list = []

    def recorded(*a, **k):  # the oracle's truth: the world each search runs on
        worlds.append(make_world(*a, **k))
        return worlds[-1]

    if kind != "defaults":
        Looks._look, Looks._runners_up = _kept_looks_only(look), _scheduled(worlds if kind == "oracle" else [])
        if kind == "oracle":
            sim.make_world = recorded
    try:
        yield
    finally:
        Looks._look, Looks._runners_up, sim.make_world = look, runners_up, make_world


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", default="hostglm", choices=sim.SCENARIOS)
    p.add_argument("--seeds", nargs="+", default=["57", "176", "123", "149", "14"], metavar="S", help="e.g. 0-99")
    p.add_argument("--allocation", nargs="+", default=list(ALLOCATIONS), choices=ALLOCATIONS)
    p.add_argument("--set", default="", metavar="KEY=VALUE[,...]", help="search options other than the defaults")
    a = p.parse_args(argv)
    try:  # bad input: one line, exit 2 (argparse's own)
        options, seeds = SearchOptions(**parse_variant(a.set)), parse_seeds(a.seeds)
    except (TypeError, ValueError) as e:
        p.error(str(e))
    for kind in a.allocation:
        with allocated(kind):
            print(json.dumps({"scenario": a.scenario, "allocation": kind} | summary(a.scenario, seeds, options)))


if __name__ == "__main__":
    main()
