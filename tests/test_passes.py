"""A second pass from the config the first took, while the budget holds one (engine/passes.py)."""

from __future__ import annotations

import pytest
from budgets import BEFORE_47

from megatron_tp_overlap.engine import passes
from megatron_tp_overlap.engine.racing import Racing
from megatron_tp_overlap.engine.search import Searcher, SearchOptions
from megatron_tp_overlap.engine.space import TuningConfig
from megatron_tp_overlap.engine.trial import MAX_PASSES, Contender, SearchResult, TrialFailed, Work
from megatron_tp_overlap.tools.research import decision_sim as sim
from megatron_tp_overlap.ub.config import GemmOverlapConfig, UbConfig


def test_a_second_pass_takes_the_option_two_unlucky_racing_trials_ruled_out():
    """decision_sim hostmax seed 143: the true 1.28 ms proj_fprop read 0.10 ms behind in its two racing trials (both in
    the host's slow stretches), an equal option was accepted in its place and the search ended at 76 s of 180 with
    79.0% of the gain as a run sees it (72.2% of its GPU time, the table's measure until the fiftieth session). The second pass measures every option afresh against that config and takes the rest; its choice
    names the pass. (Uncapped: with ``floor_cap`` the first pass accepts an equal ``qkv_fprop`` too, ending at 63 s.
    At the rest scaling of before the forty-seventh session, ``BEFORE_47``, and the pooled spread alone.)"""
    gain, world, old = sim.seed_gain(143), sim.GAIN_SEED + 143, {"floor_cap": 0.0, "slot_spread": 0, **BEFORE_47}
    one = sim.run_once("hostmax", gain, world, SearchOptions(passes=1, **old))
    two = sim.run_once("hostmax", gain, world, SearchOptions(**old))
    assert (round(one.realized, 3), round(one.seconds)) == (0.79, 76)
    assert two.realized == 1.0 and two.seconds <= SearchOptions().max_seconds and SearchOptions().passes == 2
    assert {g: c.get("pass") for g, c in two.choices.items() if c["accepted"]} == {
        "proj_fprop": 2,
        "fc1_fprop": None,
        "fc1_dgrad": None,
    }


def test_no_second_pass_after_a_pass_that_kept_the_reference(monkeypatch):
    """An equal hostmax world (83 ran its final decision to 64 quadruples and kept the reference): another pass from
    the reference would repeat the first and double the chances of a false winner, so none runs."""
    passes_from, coordinate = [], Searcher.coordinate
    monkeypatch.setattr(
        Searcher, "coordinate", lambda s, ref, base: passes_from.append(ref.label) or coordinate(s, ref, base)
    )
    out = sim.run_once("hostmax", 0.0, sim.EQUAL_SEED + 83)
    assert not out.false_winner and passes_from == ["reference"]


def result(best: str, reason: str, **fields) -> SearchResult:
    config = TuningConfig(UbConfig().with_entry("fc2_fprop", GemmOverlapConfig(method="pipeline", num_sm=len(best))))
    return SearchResult(
        best=TuningConfig(config.ub, config.disabled, best),
        best_name=best,
        reason=reason,
        trials=[],
        contenders=[Contender(best, config)],
        choices=fields.pop("choices", {}),
        noise_ms=0.1,
        steps_run=fields.pop("steps_run", 10),
        elapsed_s=fields.pop("elapsed_s", 1.0),
        budget_hit=False,
        decision=fields.pop("decision", {}),
        search_end=fields.pop("search_end", ""),
        coverage=fields.pop("coverage", {}),
        **fields,
    )


class Passes:
    """What :func:`passes.search_on` uses of a Searcher: ``coordinate`` answers from ``later`` (or raises it), and
    records the names each pass gave the decision's two sides."""

    reference_name, tuned_name, search_name = "reference", "autotuned", "search"

    def __init__(self, later: list, fits: bool = True, n: int = 2):
        self.opt, self.later, self.fits, self.calls = SearchOptions(passes=n), list(later), fits, []
        self.space, self.topo = {}, type("Topo", (), {"slots": staticmethod(dict)})()
        self.elapsed_s, self.steps_run, self.budget_hit, self.lines = 70.0, 700, False, []
        self.log = self.lines.append

    def _fits(self, steps, reserve) -> bool:
        return self.fits

    def _decision_reserve(self, contenders):
        return passes.Work()

    _round_work = Racing._round_work  # the racing round's pricing, as the Searcher has it

    def coordinate(self, incumbent, baselines):
        self.calls.append((incumbent.label, self.reference_name, self.tuned_name, self.search_name, baselines))
        r = self.later.pop(0)
        if isinstance(r, Exception):
            raise r
        return r


def test_passes_follow_a_pass_that_took_a_config_while_the_budget_holds_one():
    first = result("autotuned", "autotuned beats the reference", choices={"fc1_fprop": {"accepted": True}})
    kept = result("first pass", "no config was faster than the first pass in the selection round")
    s = Passes([kept])
    out = passes.search_on(s, first)
    assert s.calls == [("first pass", "first pass", "second pass", "second pass", {})]
    assert s.lines == [
        "[tp-overlap-autotune] second pass at 70.0 s of 180 s: every option again, against the config taken"
    ]
    assert (s.reference_name, s.tuned_name, s.search_name) == ("reference", "autotuned", "search")  # restored
    assert out.best is first.best and out.best_name == "autotuned"
    assert out.reason == f"{first.reason}; then a second pass from it: {kept.reason}"
    # none after a pass that kept the reference, none the budget cannot hold, none beyond ``passes``
    for searcher, res in ((Passes([kept]), result("reference", "kept")), (Passes([kept], fits=False), first)):
        assert passes.search_on(searcher, res) is res and not searcher.calls
    assert searcher.lines == [
        "[tp-overlap-autotune] no second pass: at 70.0 s of 180 s the rest of the budget cannot hold one"
    ]
    took = result("second pass", "second pass beats the first pass", choices={"proj_fprop": {"accepted": True}})
    s = Passes([took, kept], n=2)
    assert passes.search_on(s, first).best_name == "second pass" and len(s.calls) == 1
    s = Passes([took, result("second pass", "kept")], n=3)
    assert passes.search_on(s, first).best_name == "second pass" and [c[0] for c in s.calls] == [
        "first pass",
        "second pass",
    ]


def test_a_pass_needs_room_for_its_screening_and_one_racing_round():
    """Real steps, seed 26500: a second pass began at 163.9 s of 180 with room for its screening alone and re-measured
    none of its 70 options. The budget must hold the incumbent, one screening of the fullest slot (here fc1.bwd's 7
    options, each a trial with its warm-up), one racing round over them (7 trials and 2 brackets of 4 steps) and the
    final decision's reserve."""
    s, asked = Passes([]), []
    s.space = {"fc1_fprop": [None] * 5, "fc1_dgrad": [None] * 4, "fc1_wgrad": [None] * 3}
    s.topo = type(
        "Topo", (), {"slots": staticmethod(lambda: {"fc1.fwd": ("fc1_fprop",), "fc1.bwd": ("fc1_dgrad", "fc1_wgrad")})}
    )()
    s._fits = lambda steps, reserve: asked.append((steps, reserve)) or True
    assert passes.room_for_pass(s)
    w = s.opt.warmup_steps
    assert asked == [(2, Work(7 * (1 + w) + 9 * (4 + w), 7 + 9))]


def test_a_pass_that_fails_keeps_the_config_taken_and_says_so():
    first = result("autotuned", "autotuned beats the reference")
    s = Passes([TrialFailed("the reference config could not be measured (every trial failed)")])
    out = passes.search_on(s, first)
    assert out.best_name == "autotuned" and out.reason.endswith(
        "; a second pass from it failed (the reference config could not be measured (every trial failed))"
    )
    assert (out.steps_run, out.elapsed_s) == (700, 70.0)  # what the failed pass spent too
    assert (s.reference_name, s.tuned_name, s.search_name) == ("reference", "autotuned", "search")


def test_the_merged_result_keeps_the_first_decision_and_adds_each_pass_beside_it():
    first = result(
        "autotuned",
        "a",
        choices={"fc1_fprop": {"option": "x", "accepted": True}, "proj_fprop": {"option": "y", "accepted": False}},
        decision={"candidate": "autotuned", "quadruples": 8},
        search_end="stops early",
        coverage={"proj.fwd": {"screened": 20}},
    )
    later = result(
        "second pass",
        "b",
        choices={"proj_fprop": {"option": "z", "accepted": True}, "fc2_fprop": {"option": "w", "accepted": False}},
        decision={"candidate": "second pass", "quadruples": 12},
        search_end="budget",
        coverage={"proj.fwd": {"screened": 19}},
        steps_run=30,
        elapsed_s=9.0,
    )
    out = passes.merged(first, later, 2)
    assert (out.best, out.best_name, out.steps_run, out.elapsed_s) == (later.best, "second pass", 30, 9.0)
    assert out.choices == {
        "fc1_fprop": {"option": "x", "accepted": True},
        "proj_fprop": {"option": "z", "accepted": True, "pass": 2},
    }
    assert out.decision == {
        "candidate": "autotuned",
        "quadruples": 8,
        "second_pass": {"candidate": "second pass", "quadruples": 12, "chosen": "second pass"},
    }
    assert out.search_end == "stops early; second pass: budget" and out.noise_ms == first.noise_ms
    assert out.coverage == {"proj.fwd": {"screened": 20, "second_pass": {"screened": 19}}}
    assert [c.name for c in out.contenders] == ["autotuned", "second pass"]
    variant = passes.merged(first, result("second pass, ag off", "d"), 2)  # a switch set's variant won
    assert (variant.best_name, variant.best) == ("second pass, ag off", result("second pass, ag off", "d").best)
    # a pass that kept its reference changes no choice and no config
    kept = passes.merged(first, result("first pass", "c", choices=later.choices), 2)
    assert (kept.best, kept.choices) == (first.best, first.choices)


def test_passes_is_validated_and_each_has_a_name():
    with pytest.raises(ValueError, match=r"passes = 0: must be in \[1, 5\]"):
        SearchOptions(passes=0)
    assert [passes.pass_name(n) for n in range(1, MAX_PASSES + 1)][-1] == "fifth pass"
