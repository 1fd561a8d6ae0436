"""Exhaustive strategies (for benchmarks): every combination within each slot, or of every GEMM.

Functions of a :class:`~engine.search.Searcher`, whose trial runner, budget and confirmation they use.
"""

from __future__ import annotations

import itertools
import math
import statistics
from typing import TYPE_CHECKING

from megatron_tp_overlap.engine.trial import SearchOptions, SearchResult

if TYPE_CHECKING:  # the search runs these strategies; they only drive it
    from megatron_tp_overlap.engine.search import Searcher

from megatron_tp_overlap.engine.space import Option, TuningConfig, apply, is_valid

# The slot-exhaustive search that the tuner is held against (layer benchmark, decision simulator): 3 measured steps
# per round and no budget, so that it is a strong reference rather than a fast one.
BENCHMARK_EXHAUSTIVE = SearchOptions(strategy="slot_exhaustive", max_steps=100_000, max_seconds=1800, screen_steps=3)


def combinations(
    searcher: Searcher, reference: TuningConfig, option_lists: list[list[Option | None]]
) -> list[tuple[TuningConfig, tuple[Option, ...]]]:
    """Every distinct valid config from one choice per list (None: keep the reference's setting)."""
    seen: set[TuningConfig] = set()
    out = []
    for combo in itertools.product(*option_lists):
        c = reference
        for x in combo:
            if x is not None:
                c = apply(c, x, searcher.topo)
        if c not in seen and is_valid(c, searcher.ctx):
            seen.add(c)
            out.append((c, tuple(x for x in combo if x is not None)))
    return out


def slot_exhaustive(searcher: Searcher, reference: TuningConfig, baselines: dict[str, TuningConfig]) -> SearchResult:
    """Every valid combination of the options of the GEMMs of each slot, slots measured side by
    side (they run one after another), the best combination per slot combined and confirmed
    end-to-end. Exhaustive under the assumption the confirmation checks: slots add up."""
    searcher._slot_samples = {}
    o = searcher.opt
    combos: dict[str, list[tuple[Option, ...]]] = {}
    groups = searcher.topo.slot_groups()  # one slot each, but slots sharing a GEMM (shared experts) together
    for group, slots in groups.items():
        gemms = list(dict.fromkeys(g for s in slots for g in searcher.topo.slots()[s]))
        opts = [[None] + [x for x in searcher.space.get(g, []) if searcher._slots_of(x) <= set(slots)] for g in gemms]
        combos[group] = [opts for c, opts in combinations(searcher, reference, opts) if c != reference]
    total = sum(len(v) for v in combos.values())
    if total > o.max_exhaustive * 8:
        raise ValueError(
            f"slot-exhaustive search over {total} combinations exceeds max_exhaustive x 8; narrow the space"
        )
    searcher.planned_trials = (
        1 + max((len(v) for v in combos.values()), default=0) + 2 * (len(baselines) + 2) + 3 * o.min_quads
    )
    contenders = {"reference": reference, **baselines}
    searcher._run("baseline", reference, {"*": "incumbent"}, o.screen_steps * 2)
    scores: dict[tuple[str, tuple[Option, ...]], list[float]] = {}
    for r in range(max((len(v) for v in combos.values()), default=0)):
        if not searcher._can_afford(o.screen_steps, searcher._decision_reserve(len(contenders) + 1)):
            break
        config, tested = reference, {}
        for slot, found in combos.items():
            if r < len(found):
                for x in found[r]:
                    config = apply(config, x, searcher.topo)
                tested[slot] = "; ".join(f"{x.gemm}: {x.label}" for x in found[r])
        t = searcher._run("exhaustive", config, tested, o.screen_steps)
        if t.error:
            continue
        for slot in tested:
            vals = searcher._score(searcher._slot_samples[config], frozenset(groups[slot]))
            if vals:
                scores[(slot, combos[slot][r])] = vals[-o.screen_steps :]
    inc = searcher._slot_samples.get(reference, {})
    combined, choices = reference, {}
    for slot in combos:
        cands = [(k[1], v) for k, v in scores.items() if k[0] == slot]
        inc_vals = searcher._score(inc, frozenset(groups[slot]))
        if not cands or not inc_vals:
            continue
        best, vals = min(cands, key=lambda kv: statistics.median(kv[1]))
        gain = statistics.median(inc_vals) - statistics.median(vals)
        choices[slot] = {
            "option": "; ".join(f"{x.gemm}: {x.label}" for x in best),
            "gain_ms": round(gain, 4),
            "combinations": len(combos[slot]),
            "accepted": gain > 0,
        }
        if gain > 0:
            trial = combined
            for x in best:
                trial = apply(trial, x, searcher.topo)
            if is_valid(trial, searcher.ctx) and not searcher._verify(trial):
                combined = trial
            else:
                choices[slot]["accepted"] = False
    return searcher._confirm(TuningConfig(combined.ub, combined.disabled, "slot-exhaustive best"), contenders, choices)


def exhaustive(searcher: Searcher, reference: TuningConfig, baselines: dict[str, TuningConfig]) -> SearchResult:
    searcher._slot_samples = {}
    o = searcher.opt
    gemms = list(searcher.space)
    per_gemm = [[None] + list(searcher.space[g]) for g in gemms]  # None: keep the reference's setting
    total = math.prod(len(x) for x in per_gemm)
    if total > o.max_exhaustive * 8:
        raise ValueError(
            f"exhaustive search over {total} combinations exceeds max_exhaustive={o.max_exhaustive}; "
            "narrow the space (fewer GEMMs or grid values)"
        )
    configs = [c for c, _ in combinations(searcher, reference, per_gemm)]
    if len(configs) > o.max_exhaustive:
        raise ValueError(
            f"exhaustive search over {len(configs)} valid configs exceeds max_exhaustive={o.max_exhaustive}"
        )
    searcher.planned_trials = len(configs)
    best, best_t = reference, math.inf
    for i, c in enumerate(configs):
        if not searcher._can_afford(o.screen_steps, searcher._decision_reserve(len(baselines) + 2)):
            break
        t = searcher._run("exhaustive", c, {"*": f"combination {i}"}, o.screen_steps)
        if t.step_ms is not None and t.step_ms < best_t:
            best, best_t = c, t.step_ms
    contenders = {"reference": reference, **baselines}
    return searcher._confirm(TuningConfig(best.ub, best.disabled, "exhaustive best"), contenders, {})


# -- confirmation -----------------------------------------------------------------------------
