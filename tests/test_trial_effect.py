"""The racing's standard errors with the level a trial's steps share (engine/trial_effect.py)."""

import math
import random
import statistics

import pytest
from budgets import at_60

from megatron_tp_overlap.engine import trial_effect
from megatron_tp_overlap.engine.search import Searcher
from megatron_tp_overlap.engine.space import TuningConfig, all_off, build_space
from megatron_tp_overlap.engine.trial import SearchOptions, Trial
from megatron_tp_overlap.tools.research import decision_sim as sim
from megatron_tp_overlap.ub.config import UbConfig


def trial(i: int, slots: dict[str, list[float]]) -> Trial:
    return Trial(i, "bracket", None, {}, step_samples=[50.0] * 4, position=4.0 * i, slot_samples=slots)


def test_a_level_each_trial_shares_is_measured_and_the_steps_own_spread_is_not_counted_twice():
    """Trials whose steps are alike but whose levels alternate 1% apart: tau is the robust spread of consecutive
    levels over sqrt(2); a slot that never moves between trials has none; with one step's spread (``sigma``) large
    enough to explain the differences, none either."""
    trials = [trial(i, {"fc1.fwd": [10.0 + 0.1 * (i % 2)] * 4, "fc1.bwd": [20.0] * 4}) for i in range(8)]
    taus = trial_effect.slot_taus([trials], sigma=0.0)
    up, down = 0.1 / 10.0, 0.1 / 10.1  # the relative differences, alternating
    mad = sorted([up] * 4 + [down] * 3)[3]  # median of 7 absolute differences
    assert taus["fc1.fwd"] == pytest.approx(1.4826 * mad / math.sqrt(2))
    assert taus["fc1.bwd"] == 0.0
    assert trial_effect.slot_taus([trials], sigma=0.05)["fc1.fwd"] == 0.0  # 2 x 0.05^2 / 4 > the differences'


def test_too_few_trials_or_two_configs_apart_give_no_trial_level():
    """Fewer than MIN_DIFFS consecutive differences count as none; and differences are only taken within one
    config's trials (two incumbents 10% apart are two configs, not a trial-level spread)."""
    few = [trial(i, {"qkv.fwd": [10.0 + 0.5 * (i % 2)] * 4}) for i in range(trial_effect.MIN_DIFFS)]
    assert trial_effect.slot_taus([few], sigma=0.0) == {"qkv.fwd": 0.0}
    a = [trial(i, {"qkv.fwd": [10.0] * 4}) for i in range(6)]
    b = [trial(6 + i, {"qkv.fwd": [11.0] * 4}) for i in range(6)]
    assert trial_effect.slot_taus([a, b], sigma=0.0) == {"qkv.fwd": 0.0}


def test_one_slot_with_a_trial_level_among_steady_ones_is_measured_once_it_has_enough_differences_of_its_own():
    """Seven slots whose trials differ as their steps say (units of about 1) and one whose trials sit 20% apart: the
    test pooled over slots (median) sees only the seven, so with few differences no slot counts a level; from
    ``trial_own_diffs`` on (30, the default) the one slot is tested alone (real Granite-3-8B-like FP8 steps, H200: proj.fwd's consecutive trials
    differed 8-18x what its steps give over 41-134 differences, and the search counted no trial level;
    results/2026-11-28_h200x4e/ call f2). A chance 3x in 30 differences of a level-free slot: under 0.1%."""
    rng = random.Random(7)
    steady = [f"s{k}" for k in range(7)]

    def trials(n: int) -> list[Trial]:
        out = []
        for i in range(n):
            slots = {s: [10.0 * (1 + 0.007 * rng.gauss(0, 1))] * 2 for s in steady}  # as sigma=1% steps give
            slots["proj.fwd"] = [10.0 * (1 + 0.2 * rng.gauss(0, 1))] * 2
            out.append(trial(i, slots))
        return out

    own = SearchOptions().trial_own_diffs
    few, many = trials(own - 5), trials(own + 1)
    assert set(trial_effect.slot_taus([few], 0.01, own_diffs=own).values()) == {0.0}
    assert set(trial_effect.slot_taus([many], 0.01, own_diffs=0).values()) == {0.0}  # the pooled test alone
    taus = trial_effect.slot_taus([many], 0.01, own_diffs=own)
    assert 0.1 < taus.pop("proj.fwd") < 0.3 and set(taus.values()) == {0.0}, taus


def test_the_trial_weight_counts_each_trial_by_its_share_and_the_incumbent_level_it_leans_on():
    # two trials of 4 steps, each halfway between two 4-step brackets (ref_var 0.5^2 / 4 + 0.5^2 / 4, in samples)
    assert trial_effect.trial_weight([(4, 8, 0.125), (4, 8, 0.125)]) == pytest.approx(2 * 0.25 * 1.5)
    # one trial right after its bracket (ref_var 1/4: the bracket's level alone) counts twice
    assert trial_effect.trial_weight([(4, 4, 0.25)]) == 2.0


def accepted_in_equal_worlds(scenario: str, seeds: range, **options) -> list[int]:
    out = []
    space = build_space(sim.TOPO, sim.CTX, [UbConfig()])
    ref = TuningConfig(UbConfig(), frozenset(), "reference")
    for seed in seeds:
        rng = random.Random(seed)
        run = sim.SimulatedRun(sim.make_world(space, 0.0, rng), scenario, rng)
        res = Searcher(sim.TOPO, space, run, sim.CTX, at_60(**options)).run(ref, {"no overlap": all_off(sim.TOPO, ref)})
        assert res.best_name == "reference"
        out.append(sum(c["accepted"] for c in res.choices.values()))
    return out


def test_in_equal_worlds_whose_trials_move_apart_the_racing_no_longer_accepts_a_choice_in_each():
    """decision_sim's ``trial`` scenario (each trial's slots 0.5-1.5% apart, as on real dense steps on one H200):
    the per-step standard errors accepted choices in every equal world below; with the trials' own level counted,
    in few. The final decision kept the reference in each either way."""
    seeds = range(5000, 5006)
    before = accepted_in_equal_worlds("trial", seeds, trial_noise=0)
    after = accepted_in_equal_worlds("trial", seeds)
    assert all(before) and sum(after) < sum(before) / 3, (before, after)


def test_the_report_says_per_slot_which_trial_level_the_racing_counted():
    """The report's per-slot ``trial_level_pct``: on decision_sim ``trial`` steps the forwards' level (1.5% put in)
    is counted above the backwards' (0.5%); on iid steps none is."""
    from megatron_tp_overlap.engine.report import build_report

    space = build_space(sim.TOPO, sim.CTX, [UbConfig()])
    ref = TuningConfig(UbConfig(), frozenset(), "reference")
    levels = {}
    for scenario in ("trial", "iid"):
        rng = random.Random(5000)
        run = sim.SimulatedRun(sim.make_world(space, 0.0, rng), scenario, rng)
        res = Searcher(sim.TOPO, space, run, sim.CTX).run(ref, {"no overlap": all_off(sim.TOPO, ref)})
        per_slot = build_report(res, sim.TOPO, {})["search"]["per_slot"]
        levels[scenario] = {s: r["trial_level_pct"] for s, r in per_slot.items()}
    fwd = [v for s, v in levels["trial"].items() if s.endswith("fwd")]
    bwd = [v for s, v in levels["trial"].items() if s.endswith("bwd")]
    assert min(fwd) > max(bwd) and 1.0 < statistics.median(fwd) < 2.0, levels
    assert set(levels["iid"].values()) == {0.0}, levels


def test_decision_sims_trial_wide_is_sized_and_spread_as_the_real_command_r_like_steps_were():
    """``trial_wide`` (results/2026-11-26_h200x4b/): fc1.bwd ~24% of a 100 ms step, each slot's relative step spread
    as the search's own report measures it within 20% of the real reports' medians (qkv.fwd 3.0%, the rest 1.1-1.3%)."""
    from megatron_tp_overlap.engine.report import build_report

    space = build_space(sim.TOPO, sim.CTX, [UbConfig()])
    ref = TuningConfig(UbConfig(), frozenset(), "reference")
    rng = random.Random(5000)
    run = sim.SimulatedRun(sim.make_world(space, 0.0, rng), "trial_wide", rng)
    res = Searcher(sim.TOPO, space, run, sim.CTX).run(ref, {"no overlap": all_off(sim.TOPO, ref)})
    base = next(t for t in res.trials if t.phase == "baseline")
    assert 23.0 < statistics.median(base.slot_samples["fc1.bwd"]) < 24.0
    assert 98.0 < statistics.median(base.step_samples) < 102.0
    spread = {s: r["step_spread_pct"] for s, r in build_report(res, sim.TOPO, {})["search"]["per_slot"].items()}
    assert 2.4 < spread.pop("qkv.fwd") < 3.6 and all(0.8 < v < 1.5 for v in spread.values()), spread


@pytest.mark.parametrize("seed, alone", [(43, 0.78), (176, 0.709)])
def test_a_slot_left_free_in_a_racing_round_races_its_options_again_and_takes_the_gain_it_left(seed, alone):
    """decision_sim iid on the clock of real Command-R-like trials (0.082 s per step, 0.2 s per switch): a round takes
    as many trials as the fullest slot has options (20), and the two worst seeds left 0.63-0.67% gains' fc1/fc2 choice
    within the noise with fc1.bwd's 14 options raced once per round. With ``fill_slots=1`` (the default) they race
    again in the free trials, and the whole gain is taken (200 seeds: worst 70.9 -> 100%)."""
    gain, clock = random.Random(seed).uniform(0.005, 0.05), (0.082, 0.2, 0.0)
    before = sim.run_once("iid", gain, 1000 + seed, at_60(fill_slots=0), clock=clock)
    after = sim.run_once("iid", gain, 1000 + seed, at_60(), clock=clock)
    assert round(before.realized, 3) == alone and before.excess < 0
    assert after.realized == 1.0 and after.seconds <= 60


def test_a_leader_whose_slots_have_a_trial_level_gets_a_third_fresh_look():
    """decision_sim ``trial`` seed 149 (0.82% gain): ``fc2_fprop``, truly 0.144 ms faster, measured 0.164 ms against
    the 0.181 ms needed in two fresh 8-step trials (each trial's forwards 1.5% apart) and was left (82.4% of the gain).
    Where the leader's slots have a measured trial level it gets a third look, and the whole gain is taken (200 seeds:
    worst 82.4 -> 100%; hostbound, where a third look everywhere named a false winner, unchanged)."""
    out = sim.run_once("trial", random.Random(149).uniform(0.005, 0.05), 1000 + 149, at_60())
    assert out.realized == 1.0 and out.excess < 0 and not out.handed


def test_decision_sims_hostfwd_is_spread_as_the_real_gemma_like_fp8_steps_were():
    """``hostfwd`` (results/2026-11-27_h100x2/, seed 21360: proj.fwd's trial level 21.9%, its step spread 9.7%, as the
    search reported them): the search's own report on it says the same within a third; the backwards share no level."""
    from megatron_tp_overlap.engine.report import build_report

    space = build_space(sim.TOPO, sim.CTX, [UbConfig()])
    ref = TuningConfig(UbConfig(), frozenset(), "reference")
    rng = random.Random(5000)
    run = sim.SimulatedRun(sim.make_world(space, 0.0, rng), "hostfwd", rng)
    res = Searcher(sim.TOPO, space, run, sim.CTX).run(ref, {"no overlap": all_off(sim.TOPO, ref)})
    per_slot = build_report(res, sim.TOPO, {})["search"]["per_slot"]
    assert (
        15.0 < per_slot["proj.fwd"]["trial_level_pct"] < 29.0 and 6.5 < per_slot["proj.fwd"]["step_spread_pct"] < 13.0
    )
    assert all(r["trial_level_pct"] == 0.0 for s, r in per_slot.items() if s.endswith("bwd")), per_slot


def test_two_trials_far_apart_leave_the_faster_ones_gain_and_a_far_slower_third_is_set_aside():
    """``split_gain``: two 4-step trials (0.1 ms a step) 2.2 ms apart are beyond 4 sd of a difference (0.35 ms): the
    faster one's gain; 0.1 ms apart, or one trial, are not. ``far_slower`` marks a trial over 4 of its sd slower
    than the median trial; one step's spread is its own (a median of one), more steps' pi/2 of a mean's."""
    fast = [-0.2] * 4
    assert trial_effect.split_gain([fast, [2.0] * 4], 0.1, 0.0) == 0.2
    assert trial_effect.split_gain([fast, [-0.1] * 4], 0.1, 0.0) is None
    assert trial_effect.split_gain([fast], 0.1, 0.0) is None
    assert trial_effect.trial_sd(0.1, 0.0, 1) == 0.1
    assert trial_effect.trial_sd(0.1, 0.2, 4) == pytest.approx((0.01 * math.pi / 8 + 0.04) ** 0.5)
    assert trial_effect.far_slower([[0.0] * 4, [0.1] * 4, [3.0] * 4, [-0.1] * 4], 0.1, 0.0) == [
        False,
        False,
        True,
        False,
    ]


def test_hostfwds_proj_fwd_is_the_real_ones_size():
    """``hostfwd``'s proj.fwd costs ``FWD_FASTEST`` ms at its fastest option and its excess more at a slower one (the
    real slot, 1.2% of the step, not the simulator's 3 ms GEMM), out of the step's rest."""
    space = build_space(sim.TOPO, sim.CTX, [UbConfig()])
    ref = TuningConfig(UbConfig(), frozenset(), "reference")
    rng = random.Random(sim.GAIN_SEED + 21)
    world = sim.make_world(space, sim.seed_gain(21), rng)
    excess = sim.GEMM_MS - world.fastest_ms("proj_fprop")
    assert 0.3 < excess < 0.5  # seed 21 puts 0.375 ms on a proj_fprop option
    run = sim.SimulatedRun(world, "hostfwd", rng)
    run(ref, 1, 0)
    assert run.costs[ref]["proj.fwd"] == pytest.approx(sim.FWD_FASTEST["proj.fwd"] + excess)
    assert run.costs[ref]["qkv.fwd"] == pytest.approx(world.gemm_ms("qkv_fprop", ref))
