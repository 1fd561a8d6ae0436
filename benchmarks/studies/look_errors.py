"""Are the fresh looks' standard errors right? Each look's error against the true gain, on decision_sim.

On real steps a leader's fresh looks scattered 0.67-0.88x the per-look standard error their threshold implies
(results/2026-11-26_h200x4b/), against 0.83-0.89 for independent looks: were the standard errors wide? Their scatter
cannot say, since a leader's looks share errors (the incumbent's brackets around them). decision_sim knows each
option's true gain, so here each look's error is measured against it: per look ``z = (look - true gain) / se``, with
``se`` the per-look standard error the GEMM's threshold implies (``noise_ms / z_opt * sqrt(looks)``), over every
leader of ``--seeds`` gain and as many equal worlds. ``median |z| / 0.6745`` is 1.0 when the standard errors are exact,
and the share of |z| > 2.5 is 1.2%: the median can be right while the tails are not, as where a slot's standard
error leaves out its trial level in some searches and counts it in others (``trial_effect.slot_taus`` reads 0 below
its gate: 70% of the slots' trial levels in ``trial_wide``, whose true level is 0.7% in every slot).

    python benchmarks/studies/look_errors.py --scenario trial_wide --seeds 60
"""

from __future__ import annotations

import argparse
import statistics
from multiprocessing import Pool

from megatron_tp_overlap.engine.search import SearchOptions
from megatron_tp_overlap.tools.research import decision_sim as sim


def look_errors(scenario: str, seed: int) -> list[tuple[str, float]]:
    """(slot, z) per fresh look of every leader, in the gain world and the equal world of table seed ``seed``."""
    out = []
    for gain, world_seed in ((sim.seed_gain(seed), sim.GAIN_SEED + seed), (0.0, sim.EQUAL_SEED + seed)):
        for c in sim.run_once(scenario, gain, world_seed).choices.values():
            se = c["noise_ms"] / SearchOptions.z * len(c["per_look_ms"]) ** 0.5
            out += [(c["slot"], (v - c["true_ms"]) / se) for v in c["per_look_ms"]]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scenario", default="trial_wide", choices=sim.SCENARIOS)
    p.add_argument("--seeds", type=int, default=60)
    a = p.parse_args()
    with Pool(2) as pool:
        rows = [r for out in pool.starmap(look_errors, [(a.scenario, s) for s in range(a.seeds)]) for r in out]
    by: dict[str, list[float]] = {}
    for slot, z in rows:
        by.setdefault(slot, []).append(z)
    print(f"| {a.scenario}: slot | looks | median abs z / 0.6745 (1.0: exact) | mean z | abs z > 2.5 (1.2%: exact) |")
    print("|---|---|---|---|---|")
    for slot, zs in sorted(by.items()) + [("all", [z for _, z in rows])]:
        tail = 100 * sum(abs(z) > 2.5 for z in zs) / len(zs)
        print(
            f"| {slot} | {len(zs)} | {statistics.median(map(abs, zs)) / 0.6745:.2f} | {statistics.mean(zs):+.2f} | "
            f"{tail:.1f}% |"
        )


if __name__ == "__main__":
    main()
