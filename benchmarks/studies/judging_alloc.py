"""How much memory does the search's own work between two trials allocate, per kind of gap? (CPU, no GPU)

    python benchmarks/studies/judging_alloc.py [--scenario hostglm] [--seed 3]

On 2 x H200 a look read the forwards apart from its brackets only inside a search: its trials replayed right after it,
with the same configs, order and gap lengths but generic Python work in the gaps, did not, and the search's steps
spent 3-4x the replay's system time (results/2026-11-30_h200x2h/). So what does the search do in its gaps that the
replay's work did not? One decision_sim search (the engine's own code, simulated steps) under ``tracemalloc``: per
gap, named by the trials on its two sides (``bracket -> recheck``: the judging before a call of looks), how many, the
peak of what was allocated in it above what was held at its start (KB; freed again by the next trial or not), and the
source lines whose held memory grew most across it (KB per gap, mean).
"""

from __future__ import annotations

import argparse
import collections
import os
import tracemalloc

from megatron_tp_overlap.engine import search
from megatron_tp_overlap.tools.research import decision_sim as sim


def _own(snapshot: tracemalloc.Snapshot) -> tracemalloc.Snapshot:
    """``snapshot`` without tracemalloc's and this study's own allocations."""
    return snapshot.filter_traces(
        [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, __file__)]
    )


def gaps(scenario: str, seed: int, gain: float = 0.0, options=None) -> tuple[dict[tuple[str, str], dict], float]:
    """One ``decision_sim`` search: per gap (previous trial's phase, next trial's phase) ``n``, ``peak_kb`` (mean,
    max) and ``grew_kb`` (source line -> KB per gap, its five largest); and the KB held after its last trial (the
    searcher's, less this study's snapshot)."""
    n: collections.Counter = collections.Counter()
    peaks: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    grew: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
    state: dict = {"prev": None}
    original = search.Searcher._run

    def traced(self, phase, config, tested, steps, warmup=None):
        if state["prev"] is not None:  # the gap since the last trial ended: the search's own work
            key = (state["prev"], phase)
            n[key] += 1
            peaks[key].append((tracemalloc.get_traced_memory()[1] - state["held"]) / 1024)
            for d in _own(tracemalloc.take_snapshot()).compare_to(state["snap"], "lineno")[:8]:
                if d.size_diff > 0:
                    grew[key][f"{os.path.basename(d.traceback[0].filename)}:{d.traceback[0].lineno}"] += d.size_diff
        t = original(self, phase, config, tested, steps, warmup)
        state["snap"] = None  # the last one freed first, then the new one counted in what is held
        state["searcher"] = tracemalloc.get_traced_memory()[0]  # without a snapshot of ours
        state.update(prev=phase, snap=_own(tracemalloc.take_snapshot()), held=tracemalloc.get_traced_memory()[0])
        tracemalloc.reset_peak()
        return t

    search.Searcher._run = traced
    tracemalloc.start(1)
    try:
        sim.run_once(scenario, gain, seed, options)
    finally:
        tracemalloc.stop()
        search.Searcher._run = original
    per_gap = {
        key: {
            "n": count,
            "peak_kb": [round(sum(peaks[key]) / count, 1), round(max(peaks[key]), 1)],
            "grew_kb": {line: round(v / count / 1024, 1) for line, v in grew[key].most_common(5)},
        }
        for key, count in n.items()
    }
    return per_gap, round(state["searcher"] / 1024, 1)


def lines(result: dict[tuple[str, str], dict]) -> list[str]:
    """Markdown, one row per kind of gap, the most first."""
    out = ["| gap (trial before -> after) | gaps | peak above held, KB (mean / max) | held memory grew most at, KB |"]
    out.append("|---|---|---|---|")
    for (a, b), r in sorted(result.items(), key=lambda kv: -kv[1]["peak_kb"][0]):
        grew = ", ".join(f"{line} {kb}" for line, kb in r["grew_kb"].items()) or "-"
        out.append(f"| {a} -> {b} | {r['n']} | {r['peak_kb'][0]:.0f} / {r['peak_kb'][1]:.0f} | {grew} |")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", default="hostglm", choices=sim.SCENARIOS)
    p.add_argument("--seed", type=int, default=3)
    a = p.parse_args()
    per_gap, held = gaps(a.scenario, a.seed)
    print("\n".join(lines(per_gap)) + f"\n\nheld after the last trial: {held:.0f} KB")


if __name__ == "__main__":
    main()
