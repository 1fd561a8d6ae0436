"""Would the search meet issue 46's bar if a decision_sim scenario's forwards moved as real steps measured them?

    python benchmarks/studies/noise_whatif.py --real DIR ...                      # what real searches measured
    python benchmarks/studies/noise_whatif.py --scenario hostrest --noise qkv.fwd=0.06,0.05 proj.fwd=0.085,0.07 \
        --slopes qkv.fwd=4.1 proj.fwd=6.3 fc2.fwd=1.8 fc1.fwd=0.6 --rest-spread 0.07 0.022 --calibrate 4
    python benchmarks/studies/noise_whatif.py ... --seeds 0-99                     # the table's rule on those worlds

The figures compared are the search's own, on both sides: per forward slot, ``per_slot``'s ``rest_scaled_by`` (the slope
it scaled by), ``trial_level_pct`` (the trials' level left after scaling) and ``step_spread_pct``, which
``search_on_real_steps.py`` keeps per search (``--real``) and ``Searcher.coverage_report`` gives in the simulator
(``--calibrate N``: seeds 0..N-1, a gain world and an equal one each). ``--noise SLOT=STEP,TRIAL``: the slot's relative
spread per step and per trial in the scenario (decision_sim ``NOISE``); ``--slopes SLOT=B``: how many times the rest's
relative change each slot follows, and ``--rest-spread TRIAL STEP``: how far the rest moves (``hostrest`` only:
``disturbances.REST_SLOPE``, ``REST_SPREAD``); ``--host-modes``: how often the host of ``hostmax`` or ``hostbusy`` is
slow (``disturbances.HOST_MODES``, ``BUSY_MODES``); ``--slow-rest A B SD``: the rest in their slow steps, ``A + B x``
proj.fwd's issue ratio + N(0, SD) (``disturbances.BUSY_REST``, hostbusy's; hostmax's a constant, ``SLOW_REST``, which
``--slow-rest 1.12 0 0`` gives in distribution); each refused for a scenario without a host.
``--seeds``: ``decision_sim.evaluate_rule`` on those table seeds (gain and equal worlds; ``57 123`` or inclusive
ranges ``0-99``, as ``noise_streams.py`` takes them), as its table prints them; two processes over halves give the
200-seed table. A malformed value ends the run with one line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from look_replay import FORWARDS  # the studies' own (this folder is on sys.path)
from noise_streams import parse_seeds
from search_on_real_steps import parse_variant

from megatron_tp_overlap.engine.search import SearchOptions
from megatron_tp_overlap.tools.research import decision_sim as sim
from megatron_tp_overlap.tools.research import disturbances as dist

FIELDS = ("rest_scaled_by", "trial_level_pct", "step_spread_pct")


@contextmanager
def moved(
    scenario: str, noise: dict[str, tuple[float, float]], slopes: dict[str, float] | None, spread=None, host=None
):
    """decision_sim with ``scenario``'s slots at ``noise`` (slot: (step, trial) relative spreads), the rest's slopes
    and spread, and its host (:func:`host_with`) replaced where given; everything put back on exit."""
    old = sim.NOISE.get(scenario), dict(dist.REST_SLOPE), dist.REST_SPREAD, dict(sim.HOSTS)
    base = sim.NOISE.get(scenario) or {s: (0.0, dist.SLOT_NOISE, 0.0) for s in sim.SLOTS}
    sim.NOISE[scenario] = base | {s: (base.get(s, (0.0,))[0], step, trial) for s, (step, trial) in noise.items()}
    if slopes is not None:
        dist.REST_SLOPE.clear()
        dist.REST_SLOPE.update(slopes)
    dist.REST_SPREAD = tuple(spread) if spread else dist.REST_SPREAD
    if host:  # the scenario's host, as each run starts it (decision_sim.HOSTS)
        sim.HOSTS[scenario] = host
    try:
        yield
    finally:
        if old[0] is None:
            sim.NOISE.pop(scenario)
        else:
            sim.NOISE[scenario] = old[0]
        dist.REST_SLOPE.clear()
        dist.REST_SLOPE.update(old[1])
        dist.REST_SPREAD = old[2]
        sim.HOSTS.clear()
        sim.HOSTS.update(old[3])


def require_host(scenario: str, flag: str) -> None:
    """ValueError naming ``flag`` for a scenario without host modes (only hostmax and hostbusy have a host to move)."""
    if scenario not in sim.HOSTS:
        raise ValueError(f"{flag}: {scenario} has no host modes ({', '.join(sim.HOSTS)} have)")


def host_with(
    scenario: str, modes: tuple[float, float] | None = None, rest: tuple[float, float, float] | None = None
) -> Callable[[], dist.HostModes]:
    """``scenario``'s host at ``modes`` (P(slow | slow step before), P(slow | fast step before)) and with ``rest`` in
    its slow steps (``disturbances.HostModes.rest_factor``), each as the scenario has it where not given, for :func:`moved`;
    ValueError naming the flag for a scenario without a host."""
    require_host(scenario, "--host-modes" if modes else "--slow-rest")
    now = sim.HOSTS[scenario]()
    return lambda: dist.HostModes(tuple(modes) if modes else now.modes, tuple(rest) if rest else now.rest)


def medians(reports: list[dict[str, dict]]) -> dict[str, tuple[float, ...]]:
    """Per forward slot, the median of each of ``FIELDS`` over the searches' per-slot reports."""
    return {
        s: tuple(statistics.median(r[s][f] for r in reports if s in r) for f in FIELDS)
        for s in FORWARDS
        if any(s in r for r in reports)
    }


def simulated(scenario: str, n: int, options: SearchOptions) -> list[dict[str, dict]]:
    """The per-slot reports of ``n`` gain and ``n`` equal searches (table seeds 0..n-1)."""
    got = []

    class Kept(sim.Searcher):
        def run(self, *a, **k):
            out = super().run(*a, **k)
            got.append(self.coverage_report)
            return out

    searcher, sim.Searcher = sim.Searcher, Kept
    try:
        for s in range(n):
            sim.run_once(scenario, sim.seed_gain(s), sim.GAIN_SEED + s, options)
            sim.run_once(scenario, 0.0, sim.EQUAL_SEED + s, options)
    finally:
        sim.Searcher = searcher
    return got


def real(paths: list[str]) -> list[tuple[str, dict[str, dict]]]:
    """(seed and kind, per-slot report) of every search in ``search_on_real_steps.json`` files or folders."""
    files = [
        f for x in map(Path, paths) for f in ([x] if x.is_file() else sorted(x.rglob("search_on_real_steps.json")))
    ]
    return [(f"{r['seed']} {r['kind']}", r["per_slot"]) for f in files for r in json.loads(f.read_text())["runs"]]


def _pairs(items: list[str], n: int) -> dict[str, tuple[float, ...]]:
    """``SLOT=X[,X...]`` items as {slot: n numbers}; ValueError naming the item otherwise."""
    out = {}
    for it in items:
        slot, _, vals = it.partition("=")
        try:
            out[slot] = tuple(float(v) for v in vals.split(","))
        except ValueError:
            out[slot] = ()
        if not slot or len(out[slot]) != n:
            raise ValueError(f"{it}: expected SLOT={','.join(['X'] * n)} (numbers)")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", default="hostrest", choices=sim.SCENARIOS)
    p.add_argument("--noise", nargs="*", default=[], metavar="SLOT=STEP,TRIAL")
    p.add_argument("--slopes", nargs="*", metavar="SLOT=B", help="the rest's slopes (hostrest); every slot not named 0")
    p.add_argument("--rest-spread", nargs=2, type=float, metavar=("TRIAL", "STEP"))
    p.add_argument(
        "--host-modes", nargs=2, type=float, metavar=("SLOW_AFTER_SLOW", "SLOW_AFTER_FAST"), help="hostmax, hostbusy"
    )
    p.add_argument(
        "--slow-rest",
        nargs=3,
        type=float,
        metavar=("A", "B", "SD"),
        help="the rest in a slow step: A + B x proj.fwd's issue ratio + N(0, SD) (hostmax, hostbusy)",
    )
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="search options (decision_sim's --set)")
    p.add_argument("--calibrate", type=int, default=0, metavar="N", help="print the search's own figures over N seeds")
    p.add_argument("--seeds", nargs="+", metavar="S", help="decision_sim's rule on these table seeds, e.g. 0-99")
    p.add_argument("--real", nargs="*", default=[], metavar="PATH", help="real searches' figures, per search")
    a = p.parse_args(argv)
    try:  # bad input: one line, exit 2 (argparse's own)
        options = SearchOptions(**parse_variant(",".join(a.set), flag="--set"))
        noise = _pairs(a.noise, 2)
        slopes = {s: b for s, (b,) in _pairs(a.slopes, 1).items()} if a.slopes is not None else None
        seeds = parse_seeds(a.seeds) if a.seeds else []
        host = host_with(a.scenario, a.host_modes, a.slow_rest) if a.host_modes or a.slow_rest else None
        if unknown := sorted((set(noise) | set(slopes or {})) - set(sim.SLOTS)):
            raise ValueError(f"{', '.join(unknown)}: not a slot ({', '.join(sim.SLOTS)})")
        if (a.slopes is not None or a.rest_spread) and a.scenario != "hostrest":
            raise ValueError(f"--slopes, --rest-spread: {a.scenario}'s slots do not follow the rest (hostrest's do)")
    except ValueError as e:
        p.error(str(e))
    for name, per_slot in real(a.real):
        print(name, " ".join(f"{s} " + "/".join(f"{per_slot[s][f]:.1f}" for f in FIELDS) for s in FORWARDS))
    with moved(a.scenario, noise, slopes, a.rest_spread, host):
        if a.calibrate:
            print(f"| {a.scenario} slot | slope | trial level % | step spread % |\n|---|---|---|---|")
            for s, v in medians(simulated(a.scenario, a.calibrate, options)).items():
                print(f"| `{s}` | " + " | ".join(f"{x:.1f}" for x in v) + " |")
        if seeds:
            print(json.dumps(sim.evaluate_rule(seeds, (a.scenario,), options)))


if __name__ == "__main__":
    main()
