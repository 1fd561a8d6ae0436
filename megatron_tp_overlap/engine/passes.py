"""Search again from the config a search took, while the budget holds another pass (``SearchOptions.passes``).

A search that takes a config often ends with most of its budget unspent: its racing stops once nothing left can beat
the incumbent by a gain worth a switch, and two unlucky racing trials can rule a true option out (decision_sim
``hostmax`` seed 143: a true 1.28 ms ``proj_fprop`` read 0.10 ms behind in two trials in the host's slow stretches,
and the search ended at 76 s of 180 with 72% of the gain). The next pass measures every option afresh against the
config taken, and its own final decision (the ABBA against that config) guards any change, as the first pass's
guarded the change from the reference. A pass follows only a pass that took a config: after one that kept the
reference, another would repeat it, and in a world of equal configs double the chances of a false winner.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from megatron_tp_overlap.engine.space import TuningConfig
from megatron_tp_overlap.engine.trial import MAX_PASSES, SearchResult, TrialFailed, Work

if TYPE_CHECKING:
    from megatron_tp_overlap.engine.search import Searcher

ORDINALS = ("first", "second", "third", "fourth", "fifth")[:MAX_PASSES]


def pass_name(n: int) -> str:
    """The config the ``n``-th pass (1-based) took, as later passes and the report name it."""
    return f"{ORDINALS[n - 1]} pass"


def room_for_pass(searcher: Searcher) -> bool:
    """Whether the budget holds a pass's first trials: the incumbent, one screening of the fullest slot's options and
    one racing round over them (each trial a switch; a bracket every ``bracket_every``), and the final decision's
    reserve. A pass the budget cuts short before it races decides nothing (real steps, seed 26500: a second pass began
    at 163.9 s of 180, with room for its screening alone, and re-measured none of its 70 options)."""
    o = searcher.opt
    fullest = max(
        (sum(len(searcher.space.get(g, ())) for g in gemms) for gemms in searcher.topo.slots().values()), default=0
    )
    screening = Work(fullest * (o.screen_steps + o.warmup_steps), fullest)
    return searcher._fits(2 * o.screen_steps, searcher._decision_reserve(2) + screening + searcher._round_work(fullest))


def search_on(searcher: Searcher, result: SearchResult) -> SearchResult:
    """``result`` (the first pass's), then passes from the config each took, while each takes one and the budget
    holds the next (:func:`room_for_pass`); the result of them all."""
    o = searcher.opt
    for n in range(2, o.passes + 1):
        if result.best_name == searcher.reference_name:
            break
        at = f"at {searcher.elapsed_s:.1f} s of {o.budget_text()}"
        if not room_for_pass(searcher):
            searcher.log(f"[tp-overlap-autotune] no {pass_name(n)}: {at} the rest of the budget cannot hold one")
            break
        searcher.log(f"[tp-overlap-autotune] {pass_name(n)} {at}: every option again, against the config taken")
        incumbent = TuningConfig(result.best.ub, result.best.disabled, pass_name(n - 1))
        searcher.reference_name, searcher.tuned_name = pass_name(n - 1), pass_name(n)
        searcher.search_name = pass_name(n)
        searcher.cut_short, searcher.runners = None, set()  # this pass's own
        try:
            later = searcher.coordinate(incumbent, {})
        except TrialFailed as e:  # the config taken could not be measured again: it stays
            reason = f"{result.reason}; a {ORDINALS[n - 1]} pass from it failed ({e})"
            spent = {k: getattr(searcher, k) for k in ("steps_run", "elapsed_s", "budget_hit")}
            result = dataclasses.replace(result, reason=reason, **spent)
            break
        finally:
            for k in ("reference_name", "tuned_name", "search_name"):
                setattr(searcher, k, getattr(type(searcher), k))
        took = later.best_name != incumbent.label
        result = merged(result, later, n)
        if not took:
            break
    return result


def merged(first: SearchResult, later: SearchResult, n: int) -> SearchResult:
    """``first`` with the ``n``-th pass ``later`` after it: its config where it took one, its choices and decision
    beside the first's (the report's per-GEMM choices name their pass), every trial and the whole budget spent."""
    took = later.best_name != pass_name(n - 1)  # its own config, or a variant of it (e.g. "second pass, ag off")
    names = {c.name for c in first.contenders}
    key = f"{ORDINALS[n - 1]}_pass"
    return SearchResult(
        best=later.best if took else first.best,
        best_name=later.best_name if took else first.best_name,
        reason=f"{first.reason}; then a {ORDINALS[n - 1]} pass from it: {later.reason}",
        trials=later.trials,
        contenders=first.contenders + [c for c in later.contenders if c.name not in names],
        choices=first.choices
        | ({g: c | {"pass": n} for g, c in later.choices.items() if c.get("accepted")} if took else {}),
        noise_ms=first.noise_ms,  # of the decision against the reference
        steps_run=later.steps_run,
        elapsed_s=later.elapsed_s,
        budget_hit=later.budget_hit,
        decision=first.decision | {key: later.decision | {"chosen": later.best_name}},
        undecided=first.undecided,
        cut_short=first.cut_short,
        search_end=f"{first.search_end}; {ORDINALS[n - 1]} pass: {later.search_end}",
        coverage={s: r | {key: later.coverage.get(s, {})} for s, r in first.coverage.items()},
    )
