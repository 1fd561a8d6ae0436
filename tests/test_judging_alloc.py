"""The search's own allocations between trials, per kind of gap (benchmarks/studies/judging_alloc.py, CPU)."""

import sys
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "studies"))
import judging_alloc as ja  # noqa: E402  (the studies' folder first)

from megatron_tp_overlap.engine import search  # noqa: E402
from megatron_tp_overlap.engine.search import SearchOptions  # noqa: E402


def test_each_gap_is_named_by_the_trials_on_its_sides_and_the_search_is_left_as_it_was():
    run = search.Searcher._run
    r, held = ja.gaps("iid", 1, options=SearchOptions(max_seconds=12))
    assert held > 0
    assert search.Searcher._run is run and not tracemalloc.is_tracing()
    assert r[("baseline", "screen")]["n"] == 1  # the first gap: after the baseline, before the screening
    assert {a for a, _ in r} >= {"baseline", "screen", "bracket"} and all(x["n"] >= 1 for x in r.values())
    assert all(0 <= x["peak_kb"][0] <= x["peak_kb"][1] for x in r.values())
    assert not any("judging_alloc" in line or "tracemalloc" in line for x in r.values() for line in x["grew_kb"])
    rows = ja.lines(r)
    assert rows[0].startswith("| gap (trial before -> after) |") and len(rows) == 2 + len(r)
    shown = [float(row.split("|")[3].split("/")[0]) for row in rows[2:]]  # the mean peak, most first
    assert shown == sorted(shown, reverse=True) and len(shown) == len(r)
