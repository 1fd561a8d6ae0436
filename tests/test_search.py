"""Search logic on synthetic timing functions (no sleeping: a cost model plus seeded noise)."""

import math
import random
import re

import fakes
import pytest
from budgets import at_60

from megatron_tp_overlap.engine.search import (
    Measurement,
    Searcher,
    SearchOptions,
    TrialFailed,
)
from megatron_tp_overlap.engine.space import TuningConfig, all_off, apply, build_space, is_valid
from megatron_tp_overlap.engine.stats import pooled_sigma
from megatron_tp_overlap.engine.topology import build_topology, find_overlap_modules
from megatron_tp_overlap.engine.trial import Contender
from megatron_tp_overlap.tools.research import decision_sim as sim
from megatron_tp_overlap.tools.research.decision_sim import Clocked
from megatron_tp_overlap.ub.config import UbConfig
from megatron_tp_overlap.ub.rules import ValidationContext

CTX = ValidationContext(sm_count=132, tp_size=2)


def cost(gemm, config):
    return fakes.gemm_cost_ms(gemm, config.ub, gemm not in config.disabled)


class Synthetic:
    """evaluate(): slot time = sum of its GEMMs' costs + noise; a synthetic clock."""

    def __init__(self, topo, cost=cost, noise=0.01, seed=0, s_per_step=0.05, fail=lambda c: False):
        self.topo, self.cost, self.noise, self.rng = topo, cost, noise, random.Random(seed)
        self.t, self.s_per_step, self.fail, self.calls = 0.0, s_per_step, fail, 0

    def __call__(self, config, steps, warmup):
        self.calls += 1
        self.t += (steps + warmup) * self.s_per_step
        if self.fail(config):
            raise TrialFailed("synthetic failure")
        slot = {
            s: [sum(self.cost(g, config) for g in gs) + self.rng.gauss(0, self.noise) for _ in range(steps)]
            for s, gs in self.topo.slots().items()
        }
        step = [5.0 + sum(v[i] for v in slot.values()) for i in range(steps)]
        return Measurement(slot, step, self.t, steps + warmup)


def setup(layers=2):
    topo = build_topology(find_overlap_modules(fakes.fake_model(layers=layers)))
    space = build_space(topo, CTX, [UbConfig()])
    ref = TuningConfig(UbConfig(), frozenset(), "reference")
    return topo, space, ref, {"no overlap": all_off(topo, ref)}


def best_possible(topo, space):
    return {g: min(cost(g, apply(TuningConfig(), o, topo)) for o in opts) for g, opts in space.items()}


def test_coordinate_finds_the_optimum_in_few_trials():
    topo, space, ref, base = setup()
    ev = Synthetic(topo)
    res = Searcher(topo, space, ev, CTX, SearchOptions(max_steps=10_000, max_seconds=1e9)).run(ref, base)
    want = best_possible(topo, space)
    got = {g: cost(g, res.best) for g in space}
    assert got == pytest.approx(want, abs=1e-9)
    assert res.best_name == "autotuned" and "beats the reference" in res.reason
    n_options = sum(len(v) for v in space.values())
    assert len([t for t in res.trials if t.phase == "screen"]) < n_options / 2  # slots share trials


def test_exhaustive_finds_the_same_optimum_on_a_small_space():
    topo, space, ref, base = setup(layers=1)
    small = {g: space[g][:3] for g in ("fc2_fprop", "qkv_dgrad")}
    res = Searcher(
        topo,
        small,
        Synthetic(topo, noise=0.0),
        CTX,
        SearchOptions(strategy="exhaustive", max_steps=10_000, max_seconds=1e9),
    ).run(ref, base)
    exp = best_possible(topo, small)
    assert {g: cost(g, res.best) for g in small} == pytest.approx(exp)
    # 3 options per GEMM, one of them the reference's own setting: 3 x 3 distinct configs.
    assert sum(t.phase == "exhaustive" for t in res.trials) == 9


def test_exhaustive_refuses_a_huge_space():
    topo, space, ref, base = setup()
    with pytest.raises(ValueError, match="max_exhaustive"):
        Searcher(topo, space, Synthetic(topo), CTX, SearchOptions(strategy="exhaustive", max_exhaustive=100)).run(
            ref, base
        )


def test_step_budget_is_respected():
    topo, space, ref, base = setup()
    res = Searcher(topo, space, Synthetic(topo), CTX, SearchOptions(max_steps=80, max_seconds=1e9)).run(ref, base)
    assert res.steps_run <= 80 and res.budget_hit


def test_time_budget_is_respected():
    topo, space, ref, base = setup()
    res = Searcher(
        topo, space, Synthetic(topo, s_per_step=0.1), CTX, SearchOptions(max_steps=10_000, max_seconds=12)
    ).run(ref, base)
    assert res.elapsed_s <= 12 and res.budget_hit
    assert any(t.phase == "select" for t in res.trials)  # the decision is reserved, not skipped


def test_a_search_the_budget_cut_short_says_so_and_what_it_left_out():
    """On real H200 steps of ~290 ms the default budget ended screening early and the result read "no config was
    faster than the reference": the reason and the report must say the search was cut short, and by how much."""
    topo, space, ref, base = setup()
    short = Searcher(
        topo, space, Synthetic(topo, s_per_step=0.1), CTX, SearchOptions(max_steps=10_000, max_seconds=6)
    ).run(ref, base)
    n = sum(1 for opts in space.values() for opt in opts if apply(ref, opt, topo) != ref)
    assert short.cut_short and f"of {n} options screened" in short.cut_short and short.cut_short in short.reason
    counts = re.findall(r"(\d+) of (\d+) (?:options screened|re-measured)", short.cut_short)
    assert len(counts) == 2 and any(int(done) < int(of) for done, of in counts)
    full = Searcher(topo, space, Synthetic(topo), CTX, SearchOptions(max_steps=10_000, max_seconds=1e9)).run(ref, base)
    assert full.cut_short is None and "budget ran out" not in full.reason


def test_the_budget_prices_steps_and_switches_apart_so_that_short_trial_steps_hold_the_whole_search():
    """Priced at screening's seconds per step (its 3-step trials each switch), the decision's reserve (half of its
    trials continue a config) was about twice its real cost: on real H200 steps of 75 ms the 60 s budget ended the
    halving at ~21 s in 5 of 13 searches (three of them with 3.4-3.7% to gain). Priced per step, per switch and per
    continuing trial, the whole search fits, finds the gains, and the budget still holds."""
    space = build_space(sim.TOPO, sim.CTX, [UbConfig()])
    ref = TuningConfig(UbConfig(), frozenset(), "reference")
    for seed in range(4):
        world = sim.make_world(space, 0.03, random.Random(seed))
        run = Clocked(sim.SimulatedRun(world, "iid", random.Random(seed), 400))
        res = Searcher(sim.TOPO, space, run, sim.CTX, at_60()).run(ref, {"no overlap": all_off(sim.TOPO, ref)})
        assert res.cut_short is None and res.elapsed_s <= 60, (seed, res.reason)
        assert world.step_ms(res.best) < world.step_ms(ref), (seed, res.reason)
    tight = Clocked(sim.SimulatedRun(world, "iid", random.Random(0), 400))
    res = Searcher(sim.TOPO, space, tight, sim.CTX, SearchOptions(max_seconds=25)).run(
        ref, {"no overlap": all_off(sim.TOPO, ref)}
    )
    assert res.elapsed_s <= 25 and res.budget_hit  # a hard cap all the same


def test_the_first_trials_one_off_costs_do_not_price_every_switch():
    """On 2 H200s in Megatron the first trial (switch, warm-up, 4 steps of ~40 ms) took 5.7 s and later switches
    0.6 s: priced at the first trial's overhead, the decision's reserve took the whole 60 s budget and the search
    ended after that one trial, "0 of 76 options screened". A switch is priced by the switches after the first."""
    space = build_space(sim.TOPO, sim.CTX, [UbConfig()])
    ref = TuningConfig(UbConfig(), frozenset(), "reference")
    for seed in range(3):
        world = sim.make_world(space, 0.03, random.Random(seed))
        run = Clocked(sim.SimulatedRun(world, "iid", random.Random(seed), 400), step_s=0.04, switch_s=0.6, first_s=5)
        res = Searcher(sim.TOPO, space, run, sim.CTX, at_60()).run(ref, {"no overlap": all_off(sim.TOPO, ref)})
        assert res.cut_short is None and res.elapsed_s <= 60, (seed, res.reason)
        assert world.step_ms(res.best) < world.step_ms(ref), (seed, res.reason)
    short = Clocked(sim.SimulatedRun(world, "iid", random.Random(0), 400), step_s=0.04, switch_s=0.6, first_s=5)
    res = Searcher(sim.TOPO, space, short, sim.CTX, SearchOptions(max_seconds=20)).run(
        ref, {"no overlap": all_off(sim.TOPO, ref)}
    )
    assert res.elapsed_s <= 20 and res.budget_hit and any(t.phase == "select" for t in res.trials)


def test_a_slow_first_trial_prices_no_switch_before_a_later_one_is_measured():
    """2 H200s (engine_tune with a 20 s budget; Megatron-LM with 30 s on a cold machine): the first trial took 4.9-7 s
    and the next did not re-initialize userbuffers; priced at the first trial's overhead, screening's reserved switches
    took the whole budget and the search ended after 2 trials, "0 of 89 options screened". Until a switch after the
    first is measured none is priced (the next trial measures one: at most one trial beyond the budget)."""
    from megatron_tp_overlap.engine.trial import Work

    space = build_space(sim.TOPO, sim.CTX, [UbConfig()])
    s = Searcher(sim.TOPO, space, lambda *a: None, sim.CTX, SearchOptions(max_seconds=20))
    s._spent = [(7, True, 4.9, 13.0), (3, False, 0.2, 13.0)]  # (steps, switched, seconds, ms per step)
    s.elapsed_s, s.steps_run = 5.1, 10
    step_s, switch_s, _ = s._rates()
    assert step_s == pytest.approx(0.013) and switch_s == 0.0
    assert s._can_afford(3, Work(6, 2))  # screening goes on
    s._spent.append((3, True, 0.25, 13.0))
    assert s._rates()[1] == pytest.approx(0.25 - 3 * 0.013)  # then the measured switch prices the rest


def test_a_numerics_check_between_trials_is_priced_as_the_switch_it_is():
    """The numerics check applies the config it checks, so the trial after it switches even when it runs the last
    trial's config. Counted as continuing that config, its switch (0.9 s, as GPT-3 20B layers on 2 H200s) priced every
    continuing block of the final decision, the reserved decision no longer fit, and the search ended "the budget ran
    out before any candidate was measured against the reference" at ~35-40 s of 60 (the H200 run: at 41 s)."""
    space = build_space(sim.TOPO, sim.CTX, [UbConfig()])
    ref = TuningConfig(UbConfig(), frozenset(), "reference")
    for seed in range(4):
        world = sim.make_world(space, 0.03, random.Random(seed))
        run = Clocked(sim.SimulatedRun(world, "iid", random.Random(seed), 400), step_s=0.02, switch_s=0.9)

        def verify(config, run=run):  # a switch to the checked config and one step, as Autotuner.verify
            run.t += run.switch_s + run.step_s
            run.live = config

        res = Searcher(sim.TOPO, space, run, sim.CTX, at_60(), verify=verify, elapsed=lambda run=run: run.t).run(
            ref, {"no overlap": all_off(sim.TOPO, ref)}
        )
        assert "before any candidate" not in res.reason and res.elapsed_s <= 60, (seed, res.reason)
        assert world.step_ms(res.best) < world.step_ms(ref), (seed, res.reason)
        assert any(t.phase == "confirm" for t in res.trials)


def test_gain_within_noise_is_rejected():
    topo, space, ref, base = setup()

    # Every option costs what TE's default costs, but one is 0.1% faster; noise is 5% of a slot.
    def flat(gemm, config):
        if gemm in config.disabled:
            return 1.0
        c = config.ub.get(gemm)
        return 0.999 if (c is not None and c.num_sm == 8) else 1.0

    res = Searcher(
        topo,
        space,
        Synthetic(topo, cost=flat, noise=0.05, seed=3),
        CTX,
        SearchOptions(max_steps=10_000, max_seconds=1e9),
    ).run(ref, base)
    assert res.best_name == "reference"
    # refused by the selection round (the reference measured around every contender) or the final interval
    assert "no config was faster" in res.reason or "within the noise" in res.reason, res.reason


def test_numerics_guard_rejects_a_fast_but_wrong_option():
    topo, space, ref, base = setup()
    wrong = lambda c: (
        c.ub.get("fc2_fprop") is not None
        and c.ub.get("fc2_fprop").num_sm == 8
        and c.ub.get("fc2_fprop").method == "pipeline"
    )  # noqa: E731
    s = Searcher(
        topo,
        space,
        Synthetic(topo),
        CTX,
        SearchOptions(max_steps=10_000, max_seconds=1e9),
        verify=lambda c: "rel. error 1.2" if wrong(c) else None,
    )
    res = s.run(ref, base)
    assert not wrong(res.best)
    assert "numerics" in res.choices["fc2_fprop"].get("note", "")
    assert res.best.ub.get("qkv_fprop") is not None  # the other choices survive


def _dgrad_vs_wgrad(gemm, config):
    """fc1: a ring-exchange dgrad saves 0.1 ms, a bulk wgrad on 8 SMs saves 0.5 ms; the two cannot go together
    (a reduce-scatter dgrad leaves no bulk wgrad). Every other choice costs what TE's default costs."""
    if gemm in config.disabled:
        return 1.0
    c = config.ub.get(gemm)
    if gemm == "fc1_dgrad" and c is not None and c.method == "ring_exchange":
        return 0.9
    if gemm == "fc1_wgrad" and c is not None and c.method == "bulk" and c.num_sm == 8:
        return 0.5
    return 1.0


def _search_dgrad_vs_wgrad(verify=None):
    topo, space, ref, base = setup()
    ring = next(o for o in space["fc1_dgrad"] if o.label.startswith("ring_exchange"))
    bulk8 = next(o for o in space["fc1_wgrad"] if o.label.startswith("bulk sm=8"))
    assert not is_valid(apply(apply(ref, ring, topo), bulk8, topo), CTX)  # the premise: they exclude each other
    opts = SearchOptions(max_steps=10_000, max_seconds=1e9)
    return Searcher(topo, space, Synthetic(topo, cost=_dgrad_vs_wgrad, noise=0.002), CTX, opts, verify=verify).run(
        ref, base
    )


def test_of_two_choices_that_cannot_go_together_the_larger_gain_is_kept():
    """fc1's dgrad comes before its wgrad in the space; the wgrad's 5x larger gain must still win."""
    res = _search_dgrad_vs_wgrad()
    wgrad = res.best.ub.get("fc1_wgrad")
    assert wgrad is not None and wgrad.num_sm == 8, res.choices
    assert (res.best.ub.get("fc1_dgrad") or UbConfig().get("fc1_dgrad") or wgrad).method != "ring_exchange"
    assert res.choices["fc1_dgrad"]["accepted"] is False
    assert "fc1_wgrad" in res.choices["fc1_dgrad"]["note"]


def test_a_choice_kept_out_by_one_the_numerics_check_rejects_comes_back():
    """The larger gain (bulk wgrad on 8 SMs) computes wrong numbers: the ring-exchange dgrad it had kept out is taken."""

    def verify(c):
        w = c.ub.get("fc1_wgrad")
        return "rel. error 0.3" if w is not None and w.method == "bulk" and w.num_sm == 8 else None

    res = _search_dgrad_vs_wgrad(verify)
    assert res.best.ub.get("fc1_dgrad") is not None and res.best.ub.get("fc1_dgrad").method == "ring_exchange"
    assert "numerics" in res.choices["fc1_wgrad"]["note"] and res.choices["fc1_dgrad"]["accepted"]


def test_failing_trials_are_isolated_and_skipped():
    topo, space, ref, base = setup()
    bad = lambda c: c.ub.get("qkv_dgrad") is not None and c.ub.get("qkv_dgrad").num_sm == 8  # noqa: E731
    res = Searcher(topo, space, Synthetic(topo, fail=bad), CTX, SearchOptions(max_steps=10_000, max_seconds=1e9)).run(
        ref, base
    )
    assert any(t.error for t in res.trials)
    assert not bad(res.best) and res.best_name == "autotuned"


def test_noise_statistics():
    assert pooled_sigma([[1.0, 1.0, 1.0], [2.0, 2.0]]) == 0.0
    # pairs: a difference of 2 between repeats is a spread of 2 / sqrt(2) each, a drift between groups does not count
    assert pooled_sigma([[1.0, 3.0], [5.0, 7.0]]) == pytest.approx(1.4826 * 2**0.5)


@pytest.mark.parametrize("size", [2, 3, 4, 8])
def test_pooled_sigma_is_unbiased_for_every_group_size(size):
    """Trials have 2-8 samples; the per-GEMM threshold scales with this estimate (residuals to each group's median
    gave 0.59 of the true sigma for groups of 3)."""
    import random
    import statistics

    rng = random.Random(size)
    est = [pooled_sigma([[rng.gauss(0, 1) for _ in range(size)] for _ in range(40)]) for _ in range(300)]
    assert statistics.mean(est) == pytest.approx(1.0, abs=0.06)
    # positional (the search's use): still unbiased without a pattern, with as few groups as a search has (24)
    est = [
        pooled_sigma([[10 + rng.gauss(0, 0.1) for _ in range(size)] for _ in range(24)], positional=True)
        for _ in range(300)
    ]
    assert statistics.mean(est) == pytest.approx(0.1, abs=0.008)


def test_the_vectorized_positional_spread_is_the_list_arithmetic_figure_for_figure():
    """``stats.positional_sd`` runs on numpy columns (the racing pools thousands of pairs again after every trial);
    it must give exactly what the list arithmetic gives (``statistics.median`` of each position's values, then of the
    absolute residuals), odd and even counts, positions with fewer than three values, ties."""
    import statistics

    from megatron_tp_overlap.engine import stats

    def by_lists(pairs):
        rel = {}
        for k, r, _, _ in pairs:
            rel.setdefault(k, []).append(r)
        shared = {k: statistics.median(v) if len(v) >= 3 else 0.0 for k, v in rel.items()}
        return stats.sd_around_zero([(d - shared[k] * level) / math.sqrt(2) for k, _, d, level in pairs])

    rng = random.Random(5)
    for n in [0, 1, 2, 3, 4, 7, 50, 301]:
        for _ in range(20):
            pairs = []
            for _ in range(n):
                k, level = (rng.choice([2, 5, 9]), rng.randrange(4)), rng.uniform(0.5, 3.0)
                d = round(rng.gauss(0, 0.1), rng.choice([2, 12]))  # rounded: ties
                pairs.append((k, d / level, d, level))
            assert stats.positional_sd(pairs) == by_lists(pairs), pairs


def test_a_pattern_every_trial_shares_by_position_is_not_counted_as_noise():
    """After each switch the 3rd step is 8% slower and the 4th 3% (clocks, a periodic task): comparisons are made at
    equal positions, so the per-GEMM threshold must not widen for it (it did: 0.32 ms thresholds for 0.1-0.3 ms gains
    on the simulated run's `position` disturbance, which realized 92% of the available gain instead of 99.9%)."""
    import random
    import statistics

    rng = random.Random(0)
    profile = (1.0, 1.0, 1.08, 1.03)
    est = []
    for _ in range(100):
        groups = [[lvl * p + rng.gauss(0, 0.1) for p in profile] for lvl in (rng.uniform(5, 15) for _ in range(24))]
        est.append((pooled_sigma(groups), pooled_sigma(groups, positional=True)))
    assert statistics.mean(e[1] for e in est) == pytest.approx(0.1, abs=0.01)
    assert statistics.mean(e[0] for e in est) > 0.3  # what the plain estimate takes for noise


def test_the_threshold_counts_the_incumbent_samples_that_actually_bracket_a_halving_trial():
    """A halving trial is compared with the incumbent trials of its own length only (4 steps: a 1-step screening
    bracket that caught a slow step biased every option after it), interpolated between the two around it: the
    variance of that level, in units of one sample's, is w^2 / 4 + (1 - w)^2 / 4 for its weights (not 1 / (4 + 4):
    a trial next to one bracket leans on that bracket alone; on equal simulated worlds the re-checked leaders beat
    the incumbent by 2 such understated standard errors in 10% of GEMMs, issue 46)."""
    from megatron_tp_overlap.engine.search import Trial

    topo, space, ref, base = setup()
    s = Searcher(topo, space, Synthetic(topo), CTX)
    opt = next(x for v in space.values() for x in v if apply(ref, x, topo) != ref)
    other = apply(ref, opt, topo)
    for i, (phase, config, n, pos) in enumerate(
        [
            ("baseline", ref, 2, 1),
            ("bracket", ref, 4, 4),
            ("bracket", ref, 1, 10),
            ("halving", other, 4, 12),
            ("bracket", ref, 4, 17),
        ]
    ):
        slots = {sl: [1.0] * n for sl in s._slots_of(opt)}
        s.trials.append(
            Trial(i, phase, config, {}, slot_ms={}, slot_samples=slots, step_samples=[1.0] * n, position=pos)
        )
    ((diffs, var),) = s._relative_trials(ref, opt, [(s.trials[3], [1.0] * 4)])
    w = (17 - 12) / (17 - 4)
    assert diffs == [0.0] * 4 and var == pytest.approx(w * w / 4 + (1 - w) ** 2 / 4)


def test_options_are_validated():
    with pytest.raises(ValueError, match="strategy"):
        SearchOptions(strategy="random")
    with pytest.raises(ValueError, match="max_steps"):
        SearchOptions(max_steps=-1)
    with pytest.raises(ValueError, match="changed_slots = 2: must be 0 or 1"):
        SearchOptions(changed_slots=2)
    with pytest.raises(ValueError, match=r"later_look_least = -0.5: must be in \[0, 1\]"):
        SearchOptions(later_look_least=-0.5)
    with pytest.raises(ValueError, match="late_z = -1: must be >= 0"):
        SearchOptions(late_z=-1)
    with pytest.raises(ValueError, match="wide_leader_samples = 0: must be >= 1"):
        SearchOptions(wide_leader_samples=0)
    assert SearchOptions(max_steps=0).steps_left(10**9) == float("inf")  # 0: no step limit


def test_slot_exhaustive_finds_the_optimum_and_costs_more_than_coordinate():
    topo, space, ref, base = setup()
    big = SearchOptions(max_steps=100_000, max_seconds=1e9, strategy="slot_exhaustive")
    ex = Searcher(topo, space, Synthetic(topo), CTX, big).run(ref, base)
    want = best_possible(topo, space)
    assert {g: cost(g, ex.best) for g in space} == pytest.approx(want, abs=1e-9)
    one = SearchOptions(max_steps=100_000, max_seconds=1e9, passes=1)
    co = Searcher(topo, space, Synthetic(topo), CTX, one).run(ref, base)
    # the cheap search is the point: slots share screening trials; what coordinate spends beyond (racing rounds, a
    # second pass) is the budget's rest, here until every option settled
    assert sum(t.phase == "screen" for t in co.trials) < sum(t.phase == "exhaustive" for t in ex.trials) / 2
    assert all(c["combinations"] >= 1 for c in ex.choices.values())


def test_slot_exhaustive_respects_the_budget():
    topo, space, ref, base = setup()
    res = Searcher(
        topo, space, Synthetic(topo), CTX, SearchOptions(strategy="slot_exhaustive", max_steps=150, max_seconds=1e9)
    ).run(ref, base)
    assert res.steps_run <= 150 and res.budget_hit


def test_a_candidate_ahead_but_within_the_interval_is_left_for_the_run_to_settle():
    """The decision keeps the reference unless the candidate is faster beyond the interval; when the candidate was
    ahead (estimate > 0) but not beyond it, the result names it as undecided (the in-run verification, with ~4x
    the resolution, can settle it); never when it was decided either way or measured behind."""
    from megatron_tp_overlap.ub.config import GemmOverlapConfig

    topo, space, ref, _ = setup()
    cand = TuningConfig(UbConfig().with_entry("fc2_fprop", GemmOverlapConfig(method="pipeline", num_sm=8)), label="x")

    def decide(delta, seed):
        ev = Synthetic(topo, cost=lambda g, c: 1.0 - (delta if c.ub == cand.ub and g == "fc2_fprop" else 0.0))
        ev.noise, ev.rng = 0.05, random.Random(seed)
        opts = SearchOptions(max_steps=10**6, max_seconds=1e9, max_quads=6)
        return Searcher(topo, space, ev, CTX, opts)._confirm(cand, {"reference": ref}, {})

    equal = [decide(0.0, s) for s in range(12)]
    within = [r for r in equal if r.best_name == "reference" and r.decision]
    ahead = [r for r in within if r.decision["slot_interval"]["gain_ms"] > 0]
    assert ahead and len(ahead) < len(within)  # both kinds occur among these seeds
    assert all((r.undecided is not None) == (r in ahead) for r in within)
    assert all(r.undecided.ub == cand.ub and r.undecided.label == "x" for r in ahead)
    faster, slower = decide(1.0, 0), decide(-1.0, 0)
    assert faster.best_name == "x" and faster.undecided is None
    assert slower.best_name == "reference" and slower.undecided is None


def test_final_decision_runs_abba_quadruples_with_a_switch_per_run():
    topo, space, ref, base = setup()
    res = Searcher(topo, space, Synthetic(topo), CTX, SearchOptions(max_steps=10_000, max_seconds=1e9)).run(ref, base)
    confirm = [t for t in res.trials if t.phase == "confirm"]
    names = [t.tested["*"] for t in confirm]
    quads = res.decision["quadruples"]
    assert names == ["reference", "autotuned", "autotuned", "reference"] * quads  # A | B B | A per quadruple
    b = res.decision["block_steps"]
    assert [len(t.step_samples) for t in confirm] == [b] * 4 * quads  # a trial per block: each ends in a sync
    # B's second block and the first A of each quadruple after the first continue their config: no warm-up, no
    # switch (so both configs have a block after a switch and one after a sync gap)
    continuing = [i for i in range(1, 4 * quads) if names[i] == names[i - 1]]
    assert continuing == [i for q in range(quads) for i in (4 * q, 4 * q + 2) if i > 0]
    assert all(confirm[i].position == confirm[i - 1].position + b for i in continuing)
    assert all(confirm[i].position > confirm[i - 1].position + b for i in range(1, 4 * quads) if i not in continuing)
    # a clear gain: decided at the first look that can (before the last look a 99% interval: 8 pairs at least)
    assert res.decision["slot_interval"]["ci_low_ms"] > 0 and quads == 8


def test_final_decision_is_not_biased_by_the_sync_gap_that_ends_every_trial():
    """Every trial ends with a device sync and host work; on real H200 steps the step after such a gap runs faster
    (and much faster after a switch's idle re-init), then the clocks creep back. Two configs that cost the same
    must come out equal on average: each config's blocks must follow the same kinds of gaps (the old A | B B | A
    trials gave A's continuing block alone a gap: a bias of about -0.3% of a step, measured on real steps)."""
    topo, space, ref, base = setup()
    same = TuningConfig(UbConfig(), frozenset(), "same")

    class Gaps(Synthetic):
        def __init__(self, seed):
            super().__init__(topo, noise=0.0, seed=seed)
            self.live, self.since = None, 0

        def __call__(self, config, steps, warmup):
            switched = config != self.live
            self.live, self.since = config, 0 if switched else self.since
            boost = 0.03 if switched else 0.01  # a switch's idle gap, a trial's sync gap
            m = super().__call__(config, steps, warmup)
            for k in range(steps):
                pos = warmup + k
                f = (1 - boost * max(0.0, 1 - pos / (8 if switched else 3))) * (1 + self.rng.gauss(0, 0.005))
                for v in m.slot_ms.values():
                    v[k] *= f
            return m

    opts = SearchOptions(max_steps=10**6, max_seconds=1e9, min_quads=6, max_quads=6)
    estimates = []
    for seed in range(40):
        ev = Gaps(seed)
        ev.live = ref  # the selection round ends with the reference: the decision's first block is no switch
        s = Searcher(topo, space, ev, CTX, opts)
        estimates.append(s.abba(Contender("reference", ref), Contender("same", same))["slot_interval"].estimate)
    step = sum(sum(cost(g, ref) for g in gs) for gs in topo.slots().values())
    assert abs(sum(estimates) / len(estimates)) < 0.0005 * step  # A | B B | A trials: -0.0031 x, now +0.0003 x


def test_time_spent_before_the_first_trial_is_not_taken_for_a_per_step_cost():
    """Numerics calibration and the first switch (seconds) come before the first trial: trials report their own wall
    time, so a 60 s budget still screens instead of reserving everything for the decision."""
    topo, space, ref, base = setup()

    class Late(Synthetic):
        def __call__(self, config, steps, warmup):
            m = super().__call__(config, steps, warmup)
            m.elapsed_s += 6.0  # spent before the first trial
            m.wall_s = (steps + warmup) * self.s_per_step
            return m

    res = Searcher(topo, space, Late(topo, s_per_step=0.15), CTX, SearchOptions(max_seconds=60)).run(ref, base)
    assert sum(t.phase == "screen" for t in res.trials) >= 10 and res.decision["block_steps"] == 3
    assert res.elapsed_s <= 60


def test_a_reference_that_cannot_be_measured_ends_the_search_at_once():
    """Every trial failing (e.g. a trial timeout below one step) must not run the whole space: the reference
    is tried twice, then tuning stops with TrialFailed (the integrations train on with the starting config)."""
    topo, space, ref, base = setup()
    ev = Synthetic(topo, fail=lambda c: True)
    with pytest.raises(TrialFailed, match="reference config could not be measured .*synthetic failure"):
        Searcher(topo, space, ev, CTX, SearchOptions(max_steps=10_000, max_seconds=1e9)).run(ref, base)
    assert ev.calls == 2


def test_one_failed_reference_trial_is_retried():
    topo, space, ref, base = setup()
    calls = []

    def fail_first(c):
        calls.append(c)
        return len(calls) == 1

    res = Searcher(topo, space, Synthetic(topo, fail=fail_first), CTX, SearchOptions(max_steps=10_000)).run(ref, base)
    assert res.trials[0].error and not res.trials[1].error and res.trials[1].phase == "baseline"


def test_failed_trials_spend_the_time_budget():
    """Trials that fail after a long time (a trial timeout) count against the budget like any trial, also
    when nothing succeeds after them (no successful trial would carry the clock forward)."""
    topo, space, ref, base = setup()
    ev = Synthetic(topo, s_per_step=0.1)
    ok = ev.__call__

    def evaluate(config, steps, warmup):
        if ev.calls >= 1:  # everything after the first trial waits out a timeout and fails
            ev.calls += 1
            ev.t += 5.0
            raise TrialFailed("timed out")
        return ok(config, steps, warmup)

    opts = SearchOptions(max_steps=10_000, max_seconds=30)
    with pytest.raises(TrialFailed):  # the decision cannot measure the reference again
        Searcher(topo, space, evaluate, CTX, opts, elapsed=lambda: ev.t).run(ref, base)
    assert ev.t <= 30 + 5.0  # one trial past the cap at most


@pytest.mark.parametrize("max_steps", [1, 20])
def test_a_budget_too_small_to_compare_anything_says_so(max_steps):
    topo, space, ref, base = setup()
    res = Searcher(topo, space, Synthetic(topo), CTX, SearchOptions(max_steps=max_steps, max_seconds=1e9)).run(
        ref, base
    )
    assert res.best_name == "reference" and res.budget_hit
    assert "ran out before any candidate was measured" in res.reason and "raise the step limit" in res.reason
    assert f"({max_steps} steps / " in res.reason


def test_a_search_stopped_by_its_seconds_says_to_raise_the_time_budget():
    topo, space, ref, base = setup()
    res = Searcher(topo, space, Synthetic(topo, s_per_step=1.0), CTX, SearchOptions(max_seconds=2)).run(ref, base)
    assert res.budget_hit and "raise the time budget" in res.reason and "(2 s)" in res.reason


def test_short_trial_steps_spend_the_seconds_not_a_step_count():
    """With 15-45 ms trial steps a 400-step limit ended tunings at 40-54 s of the 60 s budget (2 H200s: 387 steps, the
    final decision unresolved, 'raise the time budget' the advice). By default only the seconds cap the search: when
    the budget stops it, the seconds are spent."""
    space = build_space(sim.TOPO, sim.CTX, [UbConfig()])
    ref = TuningConfig(UbConfig(), frozenset(), "reference")
    for seed in range(4):
        world = sim.make_world(space, 0.0, random.Random(seed))
        run = Clocked(
            sim.SimulatedRun(world, "jitter", random.Random(seed)), step_s=0.02, switch_s=0.25, outside_s=0.05
        )
        o = SearchOptions()
        res = Searcher(sim.TOPO, space, run, sim.CTX, o).run(ref, {"no overlap": all_off(sim.TOPO, ref)})
        assert res.elapsed_s <= o.max_seconds
        assert not res.budget_hit or res.elapsed_s > 0.8 * o.max_seconds, (seed, res.steps_run, res.reason)


def test_each_trial_reports_its_seconds_the_first_one_its_own_wall_time():
    """The report's trials say what each cost (on 2 H200s the first took 5.7 s, later ones ~1 s)."""
    space = build_space(sim.TOPO, sim.CTX, [UbConfig()])
    ref = TuningConfig(UbConfig(), frozenset(), "reference")
    world = sim.make_world(space, 0.03, random.Random(0))
    run = Clocked(sim.SimulatedRun(world, "iid", random.Random(0), 400), step_s=0.04, switch_s=0.6, first_s=5)
    res = Searcher(sim.TOPO, space, run, sim.CTX, at_60()).run(ref, {"no overlap": all_off(sim.TOPO, ref)})
    first, later = res.trials[0], res.trials[1:]
    steps = len(first.step_samples) + SearchOptions().warmup_steps
    assert first.to_dict()["seconds"] == pytest.approx(5 + 0.6 + steps * 0.04, abs=1e-3)  # its own wall
    assert all(0 < t.seconds < 2 for t in later) and sum(t.seconds for t in res.trials) <= res.elapsed_s + 1e-6


@pytest.mark.parametrize("options, passes", [({}, 3), ({"select_passes": 1}, 1), ({"max_steps": 70}, None)])
def test_contenders_ahead_of_the_reference_run_a_runoff_when_the_budget_allows(options, passes):
    """One selection block per contender cannot tell configs ~1% of a step apart (on H200 a preset 1.1-1.5% behind the
    best config won it in 3 of 12 tunings): the contenders ahead of the reference run again until each has
    select_passes blocks, in alternating order, the reference closing each pass; a runoff never breaks the budget."""
    space = sim.build_space(sim.TOPO, sim.CTX, [sim.UbConfig()])
    world = sim.make_world(space, 0.04, random.Random(3), fewest=2)
    ref = sim.TuningConfig(sim.UbConfig(), frozenset(), "reference")
    preset = sim.preset_of(world, space, ref)
    assert preset is not None and world.step_ms(sim.best_config(world, space, ref)) < world.step_ms(preset)
    o = SearchOptions(passes=1, **options)  # one final decision's selection round
    s = Searcher(sim.TOPO, space, sim.SimulatedRun(world, "iid", random.Random(3)), sim.CTX, o)
    s.run(ref, {"preset": preset})
    blocks = [t.tested["*"] for t in s.trials if t.phase == "select"]
    assert o.steps_left(s.steps_run) >= 0
    if passes is None:  # a tight budget: at most what fits, never a pass without its closing reference block
        assert blocks.count("preset") <= 3 and (not blocks or blocks[-1] == "reference")
        return
    assert blocks.count("preset") == blocks.count("autotuned") == passes
    # every block follows a switch (a first reference block continuing the search's last bracket sat elsewhere after
    # a switch than the contenders: issue 46), so the round opens with a contender
    i = next(k for k, t in enumerate(s.trials) if t.phase == "select")
    assert blocks[0] != "reference" and s.trials[i].config != s.trials[i - 1].config
    if passes > 1:
        runoff = blocks[len(blocks) - 3 * (passes - 1) :]  # each pass: the two contenders, the reference closing
        assert runoff[-1] == "reference" and runoff[:2] != runoff[3:5]  # order alternates, the reference closes


def test_a_step_is_priced_at_its_wall_time_when_trials_of_two_lengths_tell_it():
    """A step can cost more wall time than its GPU time (the host's part: Qwen3-MoE-like steps on one H100). Priced at
    its GPU time, what a 5-step trial costs beyond a 2-step one went into the price of a switch; the reserve then
    needed a correction at the screening's seconds per step, which took the whole budget on such steps. The slope of
    switching trials' seconds in their steps prices it; one length alone tells nothing."""
    from megatron_tp_overlap.engine.budget import wall_per_step

    assert wall_per_step([(2, 0.63), (2, 0.65), (5, 1.05), (5, 1.07)]) == pytest.approx(0.14)
    # one trial held up by 3 s (a GC, the host) moves its length's median, not the price of a step
    assert wall_per_step([(2, 0.63), (2, 0.64), (2, 0.65), (5, 1.05), (5, 1.06), (5, 4.07)]) == pytest.approx(0.14)
    assert wall_per_step([(2, 0.63), (2, 0.65), (5, 1.05)]) is None  # the second length once
    assert wall_per_step([(2, 0.63)] * 9) is None


def test_the_rates_read_trial_by_trial_are_the_rates_of_every_trial_read_at_once():
    """The search asks for its rates after every trial and reads each trial once (engine/budget.py ``RateTally``):
    the figures are those of all its trials read at once, to the bit, through untimed and failed trials (no seconds,
    no step ms), both kinds of trial and three lengths."""
    import random

    from megatron_tp_overlap.engine.budget import Budget

    class Spent(Budget):
        def __init__(self, spent):
            self._cache, self._spent, self._outside, self.elapsed_s, self.steps_run = {}, spent, [(0.3, 0.25)], 9.0, 90

    rng, grown = random.Random(5), Spent([])
    for i in range(120):
        sec = 0.0 if rng.random() < 0.1 else rng.uniform(0.2, 2.0)  # 0: untimed
        ms = 0.0 if rng.random() < 0.1 else rng.gauss(75.0, 3.0)  # 0: a failed trial
        grown._spent.append((rng.choice((2, 5, 9)), rng.random() < 0.7, sec, ms))
        assert grown._measured_rates() == Spent(list(grown._spent))._measured_rates(), i
    assert grown._measured_rates()[1] > 0  # the switches were priced


def test_a_decision_within_the_noise_says_what_seeing_a_1pct_gain_would_take():
    """+-8% of a step after 9 quadruples of 2 s: 1% needs 9 * 8^2 = 576 quadruples, 1152 s; none when already +-1%."""
    from megatron_tp_overlap.engine.decision import noise_hint

    line = noise_hint(8.0, 9, 100.0, 18.0)
    assert "+-8.0% of a step after 9 quadruples" in line and "about 576 quadruples (~1152 s)" in line
    assert noise_hint(1.0, 9, 100.0, 18.0) == "" and noise_hint(math.inf, 9, 100.0, 18.0) == ""

    def one_pct_at_8_sms(gemm, config):
        c = config.ub.get(gemm)
        return 0.99 if c is not None and c.num_sm == 8 else 1.0

    topo, space, ref, base = setup()
    res = Searcher(
        topo,
        space,
        Synthetic(topo, cost=one_pct_at_8_sms, noise=0.4, seed=20),  # steps +-40%: the interval stays wide
        CTX,
        at_60(max_steps=10_000, max_seconds=1e9),
    ).run(ref, base)
    assert res.best_name == "reference" and "within the noise" in res.reason, res.reason
    assert "steps are noisy (+-1.4% of a step after 64 quadruples): a gain of 1% of a step would need about 128" in (
        res.reason
    )
