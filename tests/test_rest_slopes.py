"""Host-bound forwards move several times the rest of the step (issue 46, forty-seventh session): the racing's slopes
on the rest go up to ``rest_beta_max``, and the final decision scales its slots by them (``decision_rest_norm``)."""

import random
import statistics

import pytest
from budgets import BEFORE_47

from megatron_tp_overlap.engine import rest_scaling
from megatron_tp_overlap.engine.search import SearchOptions
from megatron_tp_overlap.engine.trial import Trial
from megatron_tp_overlap.tools.research import decision_sim as sim


def _trials(slope: float, apart: float = 0.08, n: int = 30) -> list[Trial]:
    """``n`` trials of 4 steps: the rest ~60 ms moving ``apart`` between trials and 3% between steps, qkv.fwd ~2 ms
    moving ``slope`` x the rest's relative change and 2% on its own, fc1.bwd 10 ms on its own."""
    rng, out = random.Random(5), []
    for i in range(n):
        level = rng.gauss(0, apart)
        c = [level + rng.gauss(0, 0.03) for _ in range(4)]
        slots = {
            "qkv.fwd": [2.0 * (1 + slope * x) * (1 + rng.gauss(0, 0.02)) for x in c],
            "fc1.bwd": [10.0 * (1 + rng.gauss(0, 0.01)) for _ in c],
        }
        steps = [60.0 * (1 + x) + a + b for x, a, b in zip(c, slots["qkv.fwd"], slots["fc1.bwd"])]
        out.append(Trial(i, "halving", None, {}, step_samples=steps, position=float(i), slot_samples=slots))
    return out


def test_a_forward_that_moves_3x_the_rest_is_scaled_by_3_and_its_trials_fall_together():
    """Real L- and M-shaped FP8 steps on one H200: qkv.fwd and proj.fwd moved 1.8-5.6x the rest's relative change
    (benchmarks/results/2026-11-25_cpu/decision_sim/, forty-seventh section). Clipped at 1 (before) such a slot keeps
    most of what it shares with the rest: its trials' levels 20% apart (29% unscaled); fitted (3.4, each step relative to
    its trial's median) 4%."""
    trials = _trials(3.0)
    assert rest_scaling.fit_betas(trials, 1.0) == {"qkv.fwd": 1.0, "fc1.bwd": 0.0}
    assert rest_scaling.fit_betas(trials, 4.0) == {"qkv.fwd": 3.4, "fc1.bwd": 0.0}  # relative to each trial's median
    assert rest_scaling.fit_betas(_trials(6.0, apart=0.03), 4.0)["qkv.fwd"] == 4.0  # at most rest_beta_max

    def spread(most: float) -> float:  # of the trials' median qkv.fwd, relative
        norm = rest_scaling.norm_for(trials, rest_scaling.fit_betas(trials, most))
        levels = [statistics.median(rest_scaling.scaled(t, norm)["qkv.fwd"]) for t in trials]
        return statistics.stdev(levels) / statistics.median(levels)

    assert round(spread(1.0), 2) == 0.20 and round(spread(4.0), 2) == 0.04  # unscaled: 0.29
    with pytest.raises(ValueError, match="rest_beta_max = 0.0: must be > 0"):
        SearchOptions(rest_beta_max=0.0)
    with pytest.raises(ValueError, match="decision_rest_norm = 2: must be 0 or 1"):
        SearchOptions(decision_rest_norm=2)


def test_hostrest_takes_the_gains_the_clipped_slopes_and_the_unscaled_decision_left():
    """decision_sim hostrest (hostglm's forwards moving 3-4x the rest): seed 1 took nothing with slopes clipped at 1
    (its looks never accepted the forwards' gains) and takes all with today's; seed 21's looks accepted all three true
    options with today's slopes, but the unscaled final decision read +0.83 ms within +-1.4 ms and kept the
    reference (0%); scaled, it takes them (+1.26 ms, +0.65 to +1.77)."""
    gain = sim.seed_gain

    def realized(seed: int, **options) -> float:
        return round(sim.run_once("hostrest", gain(seed), sim.GAIN_SEED + seed, SearchOptions(**options)).realized, 3)

    assert (realized(1, **BEFORE_47), realized(1)) == (0.0, 1.0)
    assert (realized(21, decision_rest_norm=0), realized(21)) == (0.0, 1.0)


def test_the_rest_slopes_study_reads_a_trace_as_the_search_fits_it(tmp_path, capsys, monkeypatch):
    """``benchmarks/studies/rest_slopes.py`` over a search's ``trace`` rows (phase, position, median, put-in delay,
    every slot's delays, the slot's steps, the rest's steps): the steps less the delay, the search's own slope fit;
    and the rest's own spreads, between trials and between steps."""
    import json
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "benchmarks" / "studies"))
    import rest_slopes

    trials = _trials(3.0)
    rows = [
        ["halving", t.index, 0.0, 0.5, [0.5], [v + 0.5 for v in t.slot_samples["qkv.fwd"]], t.rest_samples]
        for t in trials
    ]
    (tmp_path / "search_on_real_steps.json").write_text(json.dumps({"runs": [{"seed": 7, "trace": {"qkv.fwd": rows}}]}))
    monkeypatch.setattr(sys, "argv", ["rest_slopes.py", str(tmp_path)])
    rest_slopes.main()
    out = capsys.readouterr().out
    assert "| 7  | `qkv.fwd` | 30 | 3.4 / 3.0 | 28.6% / 20.4% / 3.8% / 3.8% |" in out
    # the rest itself, drawn 8% apart between trials and 3% between steps (as hostrest): 30 trials of 4 steps read so
    assert "| 7  | 30 | 59.98 | 9.2% | 2.7% |" in out


def test_a_whole_step_slower_by_chance_no_longer_keeps_the_reference_at_99():
    """decision_sim hostrest seed 139: the true 0.507 ms ``fc1_wgrad`` accepted and the scaled decision +0.51 ms
    beyond the noise, but the whole step, whose rest moves 8% between trials, read -8.3 ms (95% CI -11.9 to -4.0): at
    ``step_level`` 0.95 that kept the reference (0%); at 0.99 (-13.5 to +0.35) the gain is taken."""
    gain = sim.seed_gain(139)
    at = {
        x: sim.run_once("hostrest", gain, sim.GAIN_SEED + 139, SearchOptions(step_level=x)).realized
        for x in (0.95, 0.99)
    }
    assert at == {0.95: 0.0, 0.99: 1.0}
    with pytest.raises(ValueError, match=r"step_level = 1.0: must be in \[0.5, 1\)"):
        SearchOptions(step_level=1.0)


def test_the_step_spread_kept_per_slot_and_slope_is_the_one_from_every_trial_at_the_last_slopes():
    """The racing keeps each slot's step differences per slope on the rest and adds only new trials' (engine/racing.py,
    the forty-eighth session's speed-up): after a `hostrest` search whose slopes moved as its trials came in, the
    spread is :func:`stats.pooled_sigma` over every trial's samples scaled at the last slopes, to the last bit."""
    from megatron_tp_overlap.engine import stats
    from megatron_tp_overlap.engine.search import Searcher
    from megatron_tp_overlap.engine.space import TuningConfig, build_space
    from megatron_tp_overlap.ub.config import UbConfig

    rng = random.Random(sim.GAIN_SEED + 1)
    space = build_space(sim.TOPO, sim.CTX, [UbConfig()])
    world = sim.make_world(space, sim.seed_gain(1), rng)
    s = Searcher(sim.TOPO, space, sim.SimulatedRun(world, "hostrest", rng), sim.CTX, SearchOptions(max_seconds=60))
    s.run(TuningConfig(UbConfig(), frozenset(), "reference"), {})
    kept = {k[1:] for k in s._cache if k[0] == "sigma_acc"}  # (slot, slope) pairs the search kept differences for
    assert len(kept) > len({slot for slot, _ in kept})  # a slope moved during the search
    betas = s._betas()
    groups = []
    for t in s.trials:
        for slot in t.slot_samples:
            v = rest_scaling.own_scaled(t, slot, betas.get(slot, 0.0))
            if v and (m := statistics.median(v)) > 0:
                groups.append([x / m for x in v])
    assert s._sigma() == stats.pooled_sigma(groups, positional=True) > 0


def _host_trials(n: int = 30) -> list[Trial]:
    """``n`` reference trials of 6 steps: a host that is slow in stretches (slow after slow 0.73, after fast 0.16, as
    decision_sim hostmax), the rest 12% longer then; proj.fwd at its 0.29 ms floor or 1.4-2.7x it when slow (two
    states), qkv.fwd moving 6x the rest's relative change (a line), the rest 3% apart between trials."""
    rng, out, slow = random.Random(7), [], False
    for i in range(n):
        level, slots, rest = rng.gauss(0, 0.03), {"qkv.fwd": [], "proj.fwd": []}, []
        for _ in range(6):
            slow = rng.random() < (0.73 if slow else 0.16)
            rest.append(level + rng.gauss(0, 0.02) + (0.12 if slow else 0.0))
            slots["qkv.fwd"].append(2.0 * (1 + 6.0 * rest[-1]) * (1 + rng.gauss(0, 0.01)))
            slots["proj.fwd"].append(0.29 * (rng.uniform(1.4, 2.7) if slow else 1 + rng.gauss(0, 0.01)))
        steps = [30.0 * (1 + r) + a + b for r, a, b in zip(rest, slots["qkv.fwd"], slots["proj.fwd"])]
        out.append(Trial(i, "halving", None, {}, step_samples=steps, position=float(i), slot_samples=slots))
    return out


class _Search(rest_scaling.RestScaling):
    def __init__(self, trials: list[Trial], opt: SearchOptions):
        self.trials, self.opt, self._cache = trials, opt, {}


def test_a_slot_at_a_floor_keeps_its_slope_at_floor_beta_max_while_a_line_goes_up_to_rest_beta_max():
    """A host that switches between two states (proj.fwd at its floor or far above it) fits a slope on the rest of
    6.3 here, yet scaling by it pushes the slow steps into the fast ones (decision_sim hostmax 49 took 56.4% of its
    gain at 8, all of it at 4); a slot that moves as a line with the rest (real GLM-4-9B-like FP8 proj.fwd: 5.9-6.7x,
    benchmarks/results/2026-11-29_h200x2/) has no floor and keeps its slope up to rest_beta_max."""
    trials = _host_trials()
    assert rest_scaling.fit_betas(trials, 100.0) == {"qkv.fwd": 5.0, "proj.fwd": 6.3}
    assert _Search(trials, SearchOptions())._floor_tops() == {"proj.fwd": 0.302}  # the two-state slot only

    def betas(**kw) -> dict[str, float]:
        return _Search(trials, SearchOptions(**kw))._betas()

    assert betas() == {"qkv.fwd": 4.0, "proj.fwd": 4.0}  # the defaults: 4 for both
    assert betas(rest_beta_max=8.0) == {"qkv.fwd": 5.0, "proj.fwd": 4.0}
    assert betas(rest_beta_max=8.0, floor_beta_max=8.0) == {"qkv.fwd": 5.0, "proj.fwd": 6.3}
    assert betas(rest_beta_max=8.0, floor_cap=0.0) == {"qkv.fwd": 5.0, "proj.fwd": 6.3}  # no floors looked for
    with pytest.raises(ValueError, match="floor_beta_max = 0.0: must be > 0"):
        SearchOptions(floor_beta_max=0.0)
