"""Are the fresh looks' standard errors right? Each look's error against the true gain, on decision_sim.

On real steps a leader's fresh looks scattered 0.67-0.88x the per-look standard error their threshold implies
(results/2026-11-26_h200x4b/), against 0.83-0.89 for independent looks: were the standard errors wide? Their scatter
cannot say, since a leader's looks share errors (the incumbent's brackets around them). decision_sim knows each
option's true gain, so here each look's error is measured against it: per look ``z = (look - true gain) / se``, with
``se`` the per-look standard error the GEMM's threshold implies (``noise_ms / z_opt * sqrt(looks)``), over every
leader of ``--seeds`` gain and as many equal worlds. ``median |z| / 0.6745`` is 1.0 when the standard errors are exact,
and the share of |z| > 2.5 is 1.2%: the median can be right while the tails are not, as where a slot's standard
error leaves out its trial level in some searches and counts it in others (``trial_effect.slot_taus`` reads 0 below
its gate: in ``trial_wide`` 70-78% of the searches leave out a slot's true 0.7%, 13% qkv.fwd's 2.5%).

Besides, per slot, the share of searches whose standard errors counted no trial level there, and (``--max-looks 1``)
how many leaders of the equal worlds one fresh look accepted (the z = 2.5 test: 0.6% of them when exact).

    python benchmarks/studies/look_errors.py --scenario trial_wide --seeds 60 [--max-looks 1]
"""

from __future__ import annotations

import argparse
import statistics
from multiprocessing import Pool

from megatron_tp_overlap.engine.search import Searcher, SearchOptions
from megatron_tp_overlap.tools.research import decision_sim as sim

_levels: list[dict[str, float]] = []  # per search, each slot's trial_level_pct (the report's)


class _Recording(Searcher):
    def run(self, reference, baselines):
        res = super().run(reference, baselines)
        _levels.append({s: r.get("trial_level_pct", 0.0) for s, r in self.coverage_report.items()})
        return res


def look_errors(scenario: str, seed: int, max_looks: int) -> tuple[list, list, tuple[int, int]]:
    """Per fresh look of every leader, in the gain world and the equal world of table seed ``seed``: (slot, z); per
    search, each slot's counted trial level; (equal-world leaders accepted, leaders)."""
    out, accepted = [], (0, 0)
    sim.Searcher, _levels[:] = _Recording, []
    options = SearchOptions(max_looks=max_looks)
    for gain, world_seed in ((sim.seed_gain(seed), sim.GAIN_SEED + seed), (0.0, sim.EQUAL_SEED + seed)):
        choices = sim.run_once(scenario, gain, world_seed, options).choices.values()
        for c in choices:
            se = c["noise_ms"] / SearchOptions.z * len(c["per_look_ms"]) ** 0.5
            out += [(c["slot"], (v - c["true_ms"]) / se) for v in c["per_look_ms"]]
        if gain == 0.0:
            accepted = (sum(c["accepted"] for c in choices), len(choices))
    return out, list(_levels), accepted


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scenario", default="trial_wide", choices=sim.SCENARIOS)
    p.add_argument("--seeds", type=int, default=60)
    p.add_argument("--max-looks", type=int, default=SearchOptions.max_looks, help="fresh looks at a leader, at most")
    a = p.parse_args()
    if a.max_looks < 1:
        p.error(f"--max-looks {a.max_looks}: must be at least 1")
    with Pool(2) as pool:
        res = pool.starmap(look_errors, [(a.scenario, s, a.max_looks) for s in range(a.seeds)])
    rows = [r for out, _, _ in res for r in out]
    levels = [lv for _, lvs, _ in res for lv in lvs]
    by: dict[str, list[float]] = {}
    for slot, z in rows:
        by.setdefault(slot, []).append(z)
    print(
        f"| {a.scenario}: slot | looks | median abs z / 0.6745 (1.0: exact) | mean z | abs z > 2.5 (1.2%: exact) | "
        "searches counting no trial level |"
    )
    print("|---|---|---|---|---|---|")
    for slot, zs in sorted(by.items()) + [("all", [z for _, z in rows])]:
        tail = 100 * sum(abs(z) > 2.5 for z in zs) / len(zs)
        mine = [lv[slot] for lv in levels if slot in lv] if slot != "all" else [v for lv in levels for v in lv.values()]
        none = 100 * sum(v == 0 for v in mine) / len(mine) if mine else float("nan")
        print(
            f"| {slot} | {len(zs)} | {statistics.median(map(abs, zs)) / 0.6745:.2f} | {statistics.mean(zs):+.2f} | "
            f"{tail:.1f}% | {none:.0f}% |"
        )
    acc, n = sum(x for _, _, (x, _) in res), sum(y for _, _, (_, y) in res)
    worlds = sum(x > 0 for _, _, (x, _) in res)
    print(
        f"equal worlds: {acc} of {n} leaders accepted ({100 * acc / max(1, n):.1f}%; max_looks={a.max_looks}), in "
        f"{worlds} of {a.seeds} worlds"
    )


if __name__ == "__main__":
    main()
