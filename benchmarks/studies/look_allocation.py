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

``--reads GEMM --streams N`` (one seed) asks instead how the search itself reads the world's true option of ``GEMM``
when the oracle looks at it with acceptance turned off, so that every stream of noise looks until ``max_looks`` or
the budget: :func:`oracle_reads` (sixty-fourth section)::

    python benchmarks/studies/look_allocation.py --scenario hostglm --seeds 57 --reads fc2_fprop --streams 200
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
from contextlib import contextmanager

from noise_streams import parse_seeds, true_gains  # the studies' own (this folder is on sys.path)
from place_whatif import summary
from search_on_real_steps import parse_variant

from megatron_tp_overlap.engine.looks import RECHECKS, Looks
from megatron_tp_overlap.engine.search import SearchOptions
from megatron_tp_overlap.tools.research import decision_sim as sim

ALLOCATIONS = ("defaults", "queue", "oracle")
TAKE_Z = 2.576  # a part missed in at most 1 of 200 streams: its mean read at most this many sd below its truth


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


def oracle_reads(scenario: str, seed: int, gemm: str, streams: int, options: SearchOptions) -> dict:
    """Table seed ``seed``'s world searched under ``streams`` streams of noise (stream 0: the table's draw, on another
    path than the table's search, since nothing is accepted), the oracle
    looking at ``gemm``'s true option with acceptance off. Per stream, that option's per-look gains as the search reads
    them (``Racing._relative_trials``: a look's median against the incumbent's level interpolated from its brackets)
    and its ``Looks._look_bounds`` standard error. Over the streams with ``max_looks`` looks counted: how the n-look
    mean spreads against what one stream's own looks say (sd / sqrt(n)) and the se the search reports, the
    correlation of neighbouring looks, how many means are under a gain worth a switch, and the steps one look costs
    (the looks phase's steps over its looks; less where a call looks at several GEMMs' options between the same
    brackets) and when the looks began (seconds into the search, median). Then how many looks at the part alone a test at ``z`` standard errors
    with no floor would need to take it in 199 of 200 streams, one look spreading as the means say: ((2.576 + z)
    x sd / part)^2. ms throughout."""
    per_stream: list[tuple[list[float], float]] = []
    phase: list[tuple[int, int]] = []  # (looks, steps) of each looks phase
    calls: list[int] = []
    before_looks: list[float] = []  # per stream: the seconds its search had spent when its first looks phase began
    with allocated("oracle"):
        runners_up, accepts, call = Looks._runners_up, Looks._accepts, sim.SimulatedRun.__call__

        def counted(self, config, steps, warmup):
            calls.append(steps + warmup)
            return call(self, config, steps, warmup)

        def read(self, incumbent, race, raw_fresh, accepted, decision_cost, contenders):
            before, steps = sum(map(len, raw_fresh.values())), sum(calls)
            if len(before_looks) == k:
                before_looks.append(0.1 * steps)
            out = runners_up(self, incumbent, race, raw_fresh, accepted, decision_cost, contenders)
            phase.append((sum(map(len, raw_fresh.values())) - before, sum(calls) - steps))
            mine = [(x, e) for x, e in raw_fresh.items() if x.gemm == gemm and e]
            if mine:
                x, e = max(mine, key=lambda t: len(t[1]))
                gains = [-statistics.median(d) for d, _ in self._relative_trials(incumbent, x, e) if d]
                per_stream.append((gains, self._look_bounds(incumbent, x, e)[1]))
            return out

        Looks._runners_up, Looks._accepts, sim.SimulatedRun.__call__ = read, lambda *a, **k: False, counted
        try:
            base = sim.GAIN_SEED + seed
            for k in range(streams):
                n0, calls[:] = len(per_stream), []
                sim.run_once(scenario, sim.seed_gain(seed), base, options, noise=1000 * base + k if k else None)
                if len(per_stream) > n0:  # a second pass looks again: the stream's longest line of looks counts
                    per_stream[n0:] = [max(per_stream[n0:], key=lambda t: len(t[0]))]
                else:
                    per_stream.append(([], math.nan))
                if len(before_looks) == k:  # a stream whose search never reached its looks
                    before_looks.append(math.nan)
        finally:
            Looks._runners_up, Looks._accepts, sim.SimulatedRun.__call__ = runners_up, accepts, call
    full = [(g, se) for g, se in per_stream if len(g) >= options.max_looks]
    if len(full) < 2:
        raise ValueError(f"{len(full)} of {streams} streams looked {options.max_looks} times: too few to spread")
    means = [statistics.mean(g) for g, _ in full]
    lag1 = [
        sum((a - m) * (b - m) for a, b in zip(g, g[1:])) / (len(g) - 1) / statistics.pvariance(g)
        for (g, _), m in zip(full, means)
    ]
    worth, part = options.rel_floor * sim.STEP_MS, true_gains(seed)[gemm]
    look_sd = statistics.stdev(means) * math.sqrt(options.max_looks)  # one look's share of the n-look mean's spread
    looks = math.ceil(((TAKE_Z + options.z) * look_sd / part) ** 2)
    steps_per_look = sum(s for _, s in phase) / max(1, sum(n for n, _ in phase))
    return {
        "part_ms": round(part, 4),
        "streams": streams,
        "streams_with_max_looks": len(full),
        "stream_0": [len(per_stream[0][0]), round(statistics.mean(per_stream[0][0]), 4) if per_stream[0][0] else None],
        "mean_of_means": round(statistics.mean(means), 4),
        "sd_of_means": round(statistics.stdev(means), 4),
        "lowest_means": [round(m, 4) for m in sorted(means)[:4]],
        "own_sd_over_sqrt_n": round(statistics.median(statistics.stdev(g) / math.sqrt(len(g)) for g, _ in full), 4),
        "reported_se": round(statistics.median(se for _, se in full), 4),
        "lag1_correlation": round(statistics.mean(lag1), 3),
        "means_under_worth": sum(m < worth for m in means),
        "steps_per_look": round(steps_per_look, 1),
        "seconds_before_looks": round(statistics.median(x for x in before_looks if not math.isnan(x)), 1),
        # looks at the part alone that a z-standard-error test (no floor) needs to take it in 199 of 200 streams, and
        # their seconds at decision_sim's 0.1 s a step, a look of one option being its trial and a bracket
        "looks_for_199_of_200": looks,
        "seconds_of_those_looks": round(0.1 * looks * 2 * (options.recheck_steps + options.warmup_steps), 1),
    }


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
    p.add_argument("--reads", metavar="GEMM", help="the oracle's reads of GEMM's true option (oracle_reads), one seed")
    p.add_argument("--streams", type=int, default=200, help="--reads: streams of noise (stream 0: the table's)")
    a = p.parse_args(argv)
    try:  # bad input: one line, exit 2 (argparse's own)
        options, seeds = SearchOptions(**parse_variant(a.set)), parse_seeds(a.seeds)
    except (TypeError, ValueError) as e:
        p.error(str(e))
    if a.reads:
        gemms = sorted({g for gs in sim.SLOTS.values() for g in gs})
        if len(seeds) != 1 or a.streams < 2 or a.reads not in gemms:
            p.error(f"--reads {a.reads} --seeds {' '.join(a.seeds)} --streams {a.streams}: one seed, at least 2 "
                    f"streams, and a GEMM of {', '.join(gemms)}")  # fmt: skip
        if a.reads not in (fast := true_gains(seeds[0])):
            p.error(f"--reads {a.reads}: seed {seeds[0]}'s world made only {', '.join(fast)} faster")
        try:
            r = oracle_reads(a.scenario, seeds[0], a.reads, a.streams, options)
        except ValueError as e:
            p.error(f"--reads {a.reads} --streams {a.streams}: {e}")
        print(json.dumps({"scenario": a.scenario, "seed": seeds[0], "gemm": a.reads} | r))
        return
    for kind in a.allocation:
        with allocated(kind):
            print(json.dumps({"scenario": a.scenario, "allocation": kind} | summary(a.scenario, seeds, options)))


if __name__ == "__main__":
    main()
