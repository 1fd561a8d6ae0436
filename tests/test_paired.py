"""ABBA blocks and the signed-rank interval of the final decision and the in-run verification."""

import json
import math
import random
import statistics
from pathlib import Path

import pytest

from megatron_tp_overlap.engine import paired
from megatron_tp_overlap.engine.trial import SearchOptions
from megatron_tp_overlap.tools.research import decision_sim


def test_abba_order_and_its_runs():
    assert paired.abba(2) == [0, 1, 1, 0, 0, 1, 1, 0]
    assert paired.runs(paired.abba(2)) == [(0, 1), (1, 2), (0, 2), (1, 2), (0, 1)]  # one switch per run


def test_quadruple_gains_cancel_a_linear_drift_exactly():
    order = paired.abba(3)
    blocks = [(10.0 if w == paired.A else 9.0) + 0.7 * i for i, w in enumerate(order)]
    assert paired.quad_gains(blocks, order) == pytest.approx([1.0, 1.0, 1.0])
    assert paired.quad_gains(blocks[:7], order) == pytest.approx([1.0])  # incomplete quadruples are left out


def test_signed_rank_distribution_is_exact():
    assert paired._signed_rank_cdf(3) == pytest.approx([1 / 8, 2 / 8, 3 / 8, 5 / 8, 6 / 8, 7 / 8, 1.0])


def test_interval_needs_six_pairs_for_95_percent_and_is_the_walsh_range_then():
    assert math.isinf(paired.gain_interval([1.0] * 5).low)
    iv = paired.gain_interval([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    assert (iv.low, iv.estimate, iv.high) == (1.0, 3.5, 6.0) and iv.faster and not iv.slower
    assert paired.gain_interval([-x for x in range(1, 7)]).slower


def test_one_wild_quadruple_moves_the_estimate_by_a_rank_not_by_its_size():
    gains = [1.0, 1.1, 0.9, 1.05, 0.95, 1.0, 1.02, 0.98, 1.01, 0.99, 1.03, 0.97]
    wild = gains[:-1] + [-50.0]  # a +25% stretch that began inside one quadruple
    assert paired.gain_interval(wild).estimate == pytest.approx(paired.gain_interval(gains).estimate, abs=0.05)
    assert paired.gain_interval(wild).faster  # 12 quadruples: one wild one cannot flip the decision
    assert not paired.gain_interval(wild[:8]).slower  # 8: it widens the interval (no decision), never a wrong one


def test_interval_covers_zero_gain_at_its_level():
    rng = random.Random(7)
    false = sum(paired.gain_interval([rng.gauss(0, 1) for _ in range(8)]).faster for _ in range(4000))
    assert false / 4000 <= 0.025 + 0.006  # one-sided error of a 95% two-sided interval


# hostmax and hostbusy: test_racing.py (hostbusy's seed 1 takes none of a gain its run sees as 0.28% of a step); iid and
# locked: their 6 seeds below (seeds 0-1 ran in both until the forty-eighth session)
@pytest.mark.parametrize(
    "scenario", [s for s in decision_sim.SCENARIOS if s not in ("hostmax", "hostbusy", "iid", "locked")]
)
def test_decision_rule_on_two_simulated_runs_of_every_scenario(scenario):
    """The decision rule on simulated runs with known costs (not a timing test), seeds 0-1 of every scenario (10 before
    issue 46: its search spends the rest of the budget, each run costs over twice the CPU; 4 before the 120 s budget,
    3 before the forty-third session's rest guard tests, pytest's 90 s bound on a 2-core clone): these
    runs are deterministic, and in each the search takes all of the available gain (0.5-5% of the step) in every
    seed, is never slower than the reference, names no false winner where every config costs the same, and stays
    within its budget. The 200-seed table is the simulator's own (`python -m
    megatron_tp_overlap.tools.research.decision_sim --seeds 200`, benchmarks/results/2026-11-25_cpu/decision_sim/)."""
    r = decision_sim.evaluate_rule(2, (scenario,))[scenario]
    assert r["realized_mean"] >= 0.98, r
    assert r["realized_min"] == 1.0, r  # issue 46: every seed, not the mean (its bar: >= 80%)
    assert r["worst_excess_pct"] == 0.0, r
    assert r["false_winner_rate"] == 0.0, r
    assert r["seconds_max"] <= r["budget_s"], r


def test_the_table_names_the_seeds_below_80pct_and_the_false_winners(capsys):
    """The 200-seed table's worst figures come with their seeds, to rerun with ``--only-seeds`` (they were found with
    scripts outside the repository before): `hostfwd` 176 takes 75.9% without the ride-along, the default (a 0.153 ms
    `proj_fprop` part left within the noise; decision_sim README, thirty-first section), and its equal world names no
    winner (seed 3, which took all of its gain, ran beside it until the fifty-first session: pytest's 90 s bound)."""
    decision_sim.main(["--only-seeds", "176", "--scenarios", "hostfwd"])
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "hostfwd: seeds below 80%: 176 (75.9%); false winners: none", out
    assert out[1].split()[1:3] == ["75.9%", "75.9%"], out  # the mean and the worst


def test_the_table_gives_a_hosts_seeds_below_80pct_the_gain_a_run_of_them_sees(capsys, monkeypatch):
    """Under a host that hides part of a GPU gain (hostmax, hostbusy) the table scores each world by what a run of it
    gains, and says how large that is beside each seed it lists (`hostbusy` 87: 1.157% of a step in `qkv_fprop`,
    0.273% to a run whose host is slow in 81% of its steps, tests/test_racing.py; the search takes none of it). A
    scenario without a host lists its seeds as before. The searches are stand-ins here (the CI's time bound)."""

    def outcome(scenario, gain, seed, *args):  # seed 1087 (table seed 87) leaves its gain; 1003 takes all of it
        if gain == 0.0:
            return decision_sim.Outcome(math.nan, 0.0, False, 100)
        return decision_sim.Outcome(
            0.0 if seed == 1087 else 1.0, 0.0, False, 100, seen_pct=0.273 if seed == 1087 else 2.0
        )

    monkeypatch.setattr(decision_sim, "run_once", outcome)
    decision_sim.main(["--only-seeds", "3", "87", "--scenarios", "hostbusy", "iid"])
    out = capsys.readouterr().out.splitlines()
    assert out[-2:] == [
        "hostbusy: seeds below 80%: 87 (0.0% of 0.27% a run sees); false winners: none",
        "iid: seeds below 80%: 87 (0.0%); false winners: none",
    ], out


@pytest.mark.parametrize("scenario", ["iid", "locked"])
def test_the_tuner_lands_within_1pct_of_the_slot_exhaustive_search_within_its_budget(scenario):
    """Issue 19's layer-level bar on the simulated stack (not a timing test): on the same worlds as the slot-exhaustive
    search (as the layer benchmark runs it), the tuner's choice is never more than 1% slower, in every seed; two
    disturbances: 2% i.i.d. noise and the oscillation measured in real Megatron iterations. Issue 19 also asked for
    half of the exhaustive search's steps (169 of 336); issue 46 spends the rest of the budget where gain can
    still be found, so the bar on steps is the budget."""
    # 4 gain and 4 equal seeds (6 before the fifty-first session, 10 before the 120 s budget, 20 before issue 46:
    # pytest's 90 s bound)
    r = decision_sim.evaluate_rule(4, (scenario,), vs_exhaustive=True)[scenario]
    assert r["vs_exhaustive_beyond_1pct"] == 0, r
    assert r["seconds_max"] <= r["budget_s"], r
    # and the rule of the test above, on these 4 seeds
    assert r["realized_min"] == 1.0 and r["worst_excess_pct"] == 0.0 and r["false_winner_rate"] == 0.0, r


def test_an_interval_is_described_by_both_bounds_since_it_is_not_symmetric():
    """2 H200s: the in-run verification printed "-9.792 ms/iter (+-9.809, 99% CI)" for a gain in [+0.149, +19.768]
    and kept the config, which read as an interval holding zero. Both bounds are printed, as a change of time too."""
    iv = paired.Interval(9.792, 0.149, 19.768, 19, 0.99)
    assert iv.faster
    s = iv.describe("ms/iter", ref=423.9, sign=-1)
    assert s.startswith("-9.792 ms/iter (99% CI -19.768 to -0.149, n=19)") and "CI -4.66% to -0.04%" in s
    assert paired.Interval(2.0, -1.0, 3.0, 6, 0.95).describe() == "+2.000 ms (95% CI -1.000 to +3.000, n=6)"


def test_the_final_decision_looks_before_its_last_quadruple_only_at_the_interim_level():
    """The ABBA decision looks after every quadruple from the 6th to the 24th, then after every 8th. At 95% each time,
    on one H100 an equal world of a Qwen3-MoE-like model named a false winner at its 15th look (+1.09 ms, 95% CI
    +0.011 to +2.42), and on decision_sim's hostbound steps (fitted to that model's decisions) an equal candidate was
    named faster in 31 of 300 decisions (3 of the 60 below). Every look before the last is at paired.INTERIM_LEVEL,
    the last at the option's level while it comes by the 24th (the budget's end), at the interim level after it: 16
    of 300 (2 below) with at most 24 quadruples, 13 of 300 (2) with 64 and the sparse later looks. A look that finds
    the candidate faster by less than a gain worth a switch runs on (seed 3, at its 8th and 14th): with 64 it ends
    within the noise (1 below). (On the whole overlapped layers, ``changed_slots=0``: the default decides on the changed
    slots, next test.)"""
    from megatron_tp_overlap.engine.search import Searcher, SearchOptions
    from megatron_tp_overlap.engine.space import TuningConfig, apply, build_space
    from megatron_tp_overlap.engine.trial import Contender
    from megatron_tp_overlap.ub.config import UbConfig

    space = build_space(decision_sim.TOPO, decision_sim.CTX, [UbConfig()])
    ref = TuningConfig(UbConfig(), frozenset(), "reference")
    cand = apply(ref, next(o for o in space["fc2_fprop"] if apply(ref, o, decision_sim.TOPO) != ref), decision_sim.TOPO)
    named_by = {}
    for most, last_level in ((paired.DENSE_LOOKS, 0.95), (SearchOptions.max_quads, paired.INTERIM_LEVEL)):
        named, levels = 0, set()
        for seed in range(60):
            run = decision_sim.SimulatedRun(decision_sim.World({}), "hostbound", random.Random(seed))
            opts = SearchOptions(max_seconds=10**6, changed_slots=0, max_quads=most)
            d = Searcher(decision_sim.TOPO, space, run, decision_sim.CTX, opts).abba(
                Contender("reference", ref), Contender("candidate", cand)
            )
            named += d["slot_interval"].faster
            levels.add((d["quadruples"] == most, d["level"]))
            assert d["quadruples"] <= paired.DENSE_LOOKS or d["quadruples"] % paired.SPARSE_EVERY == 0
        named_by[most] = named
        assert levels <= {(False, paired.INTERIM_LEVEL), (True, last_level)}
    assert named_by == {paired.DENSE_LOOKS: 2, SearchOptions.max_quads: 1}, named_by


def test_a_gain_the_noise_hides_for_24_quadruples_is_decided_with_the_budget_left():
    """A candidate 0.25 ms faster in one slot, whose blocks share a level that spreads 0.5 ms (a forward that waits
    on the host in stretches: on decision_sim hostmax seeds 1, 43, 167 and 176 24 quadruples left true 0.7-1.5% gains
    within the noise with 83 s of a 180 s budget unspent). Over 24 seeds 24 quadruples decide it in 10, the default 64
    in 22; no equal candidate is named either way, and an equal decision ends once its interval cannot hold a gain
    worth a switch."""
    from megatron_tp_overlap.engine.search import Searcher
    from megatron_tp_overlap.engine.space import TuningConfig, apply, build_space
    from megatron_tp_overlap.engine.trial import Contender, Measurement
    from megatron_tp_overlap.ub.config import UbConfig

    topo = decision_sim.TOPO
    space = build_space(topo, decision_sim.CTX, [UbConfig()])
    ref = TuningConfig(UbConfig(), frozenset(), "reference")
    cand = apply(ref, next(o for o in space["fc2_fprop"] if apply(ref, o, topo) != ref), topo)

    def decide(seed: int, gain: float, most: int) -> tuple[str, int]:
        rng, clock = random.Random(seed), [0.0]

        def run(config, steps, warmup):
            clock[0] += 0.1 * (steps + warmup)
            level = 3.0 - gain * (config == cand) + rng.gauss(0, 0.5)  # what the block's steps share
            slots = {
                s: [(level if s == "fc2.fwd" else 3.0 * len(gs)) + rng.gauss(0, 0.005) for _ in range(steps)]
                for s, gs in topo.slots().items()
            }
            return Measurement(slots, [sum(v[i] for v in slots.values()) + 60 for i in range(steps)], clock[0], steps)

        opts = SearchOptions(max_seconds=10**6, max_quads=most)
        d = Searcher(topo, space, run, decision_sim.CTX, opts).abba(
            Contender("reference", ref), Contender("candidate", cand)
        )
        iv = d["slot_interval"]
        return "faster" if iv.faster else "slower" if iv.slower else "undecided", d["quadruples"]

    for most, taken in ((paired.DENSE_LOOKS, 10), (SearchOptions.max_quads, 22)):
        got = [decide(seed, 0.25, most) for seed in range(24)]
        assert sum(v == "faster" for v, _ in got) == taken and not any(v == "slower" for v, _ in got)
        equal = [decide(seed, 0.0, most) for seed in range(24)]
        assert all(v == "undecided" for v, _ in equal)
    assert max(q for _, q in equal) == SearchOptions.max_quads and min(q for _, q in equal) < paired.DENSE_LOOKS


def test_the_sparse_looks_past_the_dense_ones():
    assert [q for q in range(1, 65) if paired.looks_after(q)] == [*range(1, 25), 32, 40, 48, 56, 64]


def test_at_the_budgets_last_look_an_estimate_under_a_gain_worth_a_switch_is_handed_on_not_named():
    """The last look by the 24th quadruple is at 95%, every other at 99%. The table's equal worlds named there (hostrest
    7, hostfwd 131, hostbusy 76 and 162) read 0.14-0.23 ms of a 100-111 ms step, under or at a gain worth a switch
    (0.2%); its true gains decided there read 0.43-1.3 ms. Such a config now goes to the in-run verification instead of
    being named, and a true gain decided at that look is still taken (hostrest 21: 1.15-1.26 ms). Recorded before
    the fifty-fourth session's own spreads (``slot_spread=0``), with which 7 accepts no equal choice at all."""
    from megatron_tp_overlap.engine.search import SearchOptions

    before = SearchOptions(slot_spread=0)
    equal = decision_sim.run_once("hostrest", 0.0, decision_sim.EQUAL_SEED + 7, before)
    assert not equal.false_winner and equal.handed and equal.excess == 0.0
    gain = decision_sim.run_once("hostrest", decision_sim.seed_gain(21), decision_sim.GAIN_SEED + 21, before)
    assert gain.realized == 1.0 and not gain.handed


def test_a_look_that_finds_a_config_faster_by_less_than_a_gain_worth_a_switch_runs_on(monkeypatch):
    """trial_wide's equal world 99 was named at its 13th quadruple, a 99% look: +0.153 ms (99% CI +0.003 to +0.330) of
    a ~100 ms step, under a gain worth a switch (0.2 ms). Such a look now runs on instead of stopping, and the decision
    says which looks did; by the 23rd quadruple the interval holds zero, and the reference is kept."""
    from megatron_tp_overlap.engine.search import Searcher

    decisions, abba = [], Searcher.abba
    monkeypatch.setattr(Searcher, "abba", lambda self, *a: decisions.append(abba(self, *a)) or decisions[-1])
    o = decision_sim.run_once("trial_wide", 0.0, decision_sim.EQUAL_SEED + 99)
    assert not o.false_winner and o.excess == 0.0 and o.handed
    assert [(d["ran_on_under_worth"], d["quadruples"]) for d in decisions] == [([13], 23)]


def test_deciding_on_the_changed_slots_alone_narrows_the_interval_and_names_no_equal_config():
    """``changed_slots=1``: the ABBA sums only the slots whose GEMMs the two configs run differently. On hostbound
    steps (MoE: the GPU waits for the host inside every layer) the other slots add noise and no gain: over the 60
    equal worlds above the interval's median half-width falls from 0.41% to 0.12% of a step (0.41 / 0.115 over 300),
    and no equal config is named either way (3 of 300 against 18 of 300)."""
    from megatron_tp_overlap.engine.search import Searcher, SearchOptions
    from megatron_tp_overlap.engine.space import TuningConfig, apply, build_space
    from megatron_tp_overlap.engine.trial import Contender
    from megatron_tp_overlap.ub.config import UbConfig

    space = build_space(decision_sim.TOPO, decision_sim.CTX, [UbConfig()])
    ref = TuningConfig(UbConfig(), frozenset(), "reference")
    cand = apply(ref, next(o for o in space["fc2_fprop"] if apply(ref, o, decision_sim.TOPO) != ref), decision_sim.TOPO)
    widths = {0: [], 1: []}
    for seed in range(60):
        for changed in (0, 1):
            run = decision_sim.SimulatedRun(decision_sim.World({}), "hostbound", random.Random(seed))
            opts = SearchOptions(max_seconds=10**6, changed_slots=changed, max_quads=24)  # the widths at one length
            d = Searcher(decision_sim.TOPO, space, run, decision_sim.CTX, opts).abba(
                Contender("reference", ref), Contender("candidate", cand)
            )
            widths[changed].append(d["noise_pct_of_step"])
            if changed:
                assert d["decided_on"] == ["fc2.fwd"]
                assert not (d["slot_interval"].faster or d["slot_interval"].slower), seed
    assert statistics.median(widths[1]) < 0.35 * statistics.median(widths[0])


def _sequential(gains: list[float], sds: float) -> str:
    """The final decision's looks over recorded quadruple gains (as ``Searcher.abba``, without its budget):
    'faster', 'slower' or 'undecided'."""
    for q in range(paired.MIN_PAIRS, len(gains) + 1):
        iv = paired.look(gains[:q], 0.95, q == len(gains), sds)
        if iv.faster or iv.slower:
            return "faster" if iv.faster else "slower"
    return "undecided"


def test_a_stretch_of_slow_steps_in_a_few_blocks_no_longer_holds_back_a_real_gain():
    """The recorded blocks of 41 final decisions on real Megatron-LM steps (one H100 each, two side by side on a
    4-core host; full recompute, `local` and `transformer_engine` CUDA graphs). Three real gains of 1.2-2.3% were left
    undecided: a few blocks of slow steps (+25%) got the signed-rank test's top ranks. With the quadruples' gains
    clipped at their median +- 4 robust standard deviations, every real gain is taken and no equal config is named
    faster."""
    recorded = json.loads((Path(__file__).parent / "data" / "real_decision_blocks.json").read_text())["decisions"]
    before, after = {}, {}
    for d in recorded:
        order = [paired.A if w == "A" else paired.B for w, _ in d["blocks"]]
        gains = paired.quad_gains([v for _, v in d["blocks"]], order)
        before[d["seed"]] = _sequential(gains, 0.0)
        after[d["seed"]] = _sequential(gains, SearchOptions.clip_sds)
    real = {d["seed"] for d in recorded if d["true_gain_ms"] > 0}
    equal = {d["seed"] for d in recorded if d["true_gain_ms"] == 0}
    assert (len(real), len(equal)) == (22, 19)
    assert sorted(s for s in real if before[s] != "faster") == [14000, 15004, 15006]
    assert all(after[s] == "faster" for s in real)
    assert not any(after[s] == "faster" for s in equal)


def test_clipping_keeps_the_interval_s_error_on_equal_configs():
    """Clipping is symmetric about the median: on equal configs the sequential decision (looks at quadruples 6-24)
    names either config faster about as often as without it (normal noise, and one quadruple in ten hit by a stretch
    of slow steps either way)."""
    rng = random.Random(3)
    worlds = [
        [rng.gauss(0, 1) + (rng.choice((-6, 6)) if rng.random() < 0.1 else 0) for _ in range(24)] for _ in range(400)
    ]
    named = {sds: sum(_sequential(g, sds) != "undecided" for g in worlds) / len(worlds) for sds in (0.0, 4.0)}
    assert named[4.0] <= 0.08 and named[4.0] - named[0.0] <= 0.01, named


@pytest.mark.parametrize("lasting", [False, True])
def test_layers_faster_but_a_step_slower_run_the_quadruples_left_before_the_whole_step_vetoes(lasting):
    """The candidate's changed slot is 0.5 ms faster; its whole step is 2.5 ms slower in the first 8 quadruples (a slow
    stretch: on real H100 FP8 steps one kept the reference against a true 0.5% gain, seed 18604), and after them
    faster by its layers' gain (``lasting=False``) or still slower (``lasting=True``). The first look that can decide
    (8 quadruples give a 99% interval) sees the layers faster and the step slower; the decision then runs every quadruple the budget holds and decides on all of them:
    it takes the gain in the first world and still keeps the reference in the second."""
    from megatron_tp_overlap.engine.search import Searcher
    from megatron_tp_overlap.engine.space import TuningConfig, apply, build_space
    from megatron_tp_overlap.engine.trial import Contender, Measurement
    from megatron_tp_overlap.ub.config import UbConfig

    topo = decision_sim.TOPO
    space = build_space(topo, decision_sim.CTX, [UbConfig()])
    ref = TuningConfig(UbConfig(), frozenset(), "reference")
    cand = apply(ref, next(o for o in space["fc2_fprop"] if apply(ref, o, topo) != ref), topo)
    rng, clock, blocks = random.Random(0), [0.0], [0]

    def run(config, steps, warmup):
        clock[0] += 0.1 * (steps + warmup)
        mine = config == cand
        blocks[0] += mine
        slots = {
            s: [3.0 * len(gs) - 0.5 * (mine and s == "fc2.fwd") + rng.gauss(0, 0.005) for _ in range(steps)]
            for s, gs in topo.slots().items()
        }
        slow = 2.5 if mine and (lasting or blocks[0] <= 16) else 0.0  # 2 blocks per quadruple: 8 quadruples
        return Measurement(
            slots, [sum(v[i] for v in slots.values()) + 60 + slow for i in range(steps)], clock[0], steps
        )

    d = Searcher(topo, space, run, decision_sim.CTX, SearchOptions(max_seconds=10**6)).abba(
        Contender("reference", ref), Contender("candidate", cand)
    )
    assert d["split_at"] == 8 and d["quadruples"] == SearchOptions.max_quads
    assert d["slot_interval"].faster and d["step_interval"].slower == lasting
