"""benchmarks/studies/look_allocation.py: other allocations of the fresh looks after the racing, in the simulator
(issue 46, sixty-third session)."""

import sys

import pytest
from benchmark_module import BENCHMARKS, load_benchmark

from megatron_tp_overlap.engine.looks import Looks
from megatron_tp_overlap.engine.search import SearchOptions
from megatron_tp_overlap.tools.research import decision_sim as sim

sys.path.insert(0, str(BENCHMARKS / "studies"))  # the study imports its neighbours from its folder
la = load_benchmark("look_allocation")


def _gain_world(scenario: str, seed: int) -> sim.Outcome:
    return sim.run_once(scenario, sim.seed_gain(seed), sim.GAIN_SEED + seed)


def test_the_oracle_looks_only_at_true_options_and_still_leaves_hostglm_57(monkeypatch):
    """hostglm seed 57's true fc2_fprop (0.219 ms) looks 40 times under the oracle and reads about nothing: no
    allocation of the looks takes it at this acceptance rule."""
    looked: list = []
    ride_along = Looks._ride_along

    def spy(self, incumbent, choices, best_of, raw_fresh):  # right after the runners-up: who looked beyond the kept
        looked.append({(x.gemm, x.label): len(e) for x, e in raw_fresh.items() if x in self.runners or len(e) > 3})
        return ride_along(self, incumbent, choices, best_of, raw_fresh)

    monkeypatch.setattr(Looks, "_ride_along", spy)
    with la.allocated("oracle"):
        o = _gain_world("hostglm", 57)
    assert o.realized == pytest.approx(0.6837, abs=1e-4)
    assert {g: c["accepted"] for g, c in o.choices.items() if c["true_ms"] > 0} == {
        "qkv_wgrad": True,
        "fc1_dgrad": True,
        "fc2_fprop": False,
    }
    # one option looked beyond the kept looks: the world's fc2_fprop (the racing's leader there), up to max_looks
    assert looked == [{("fc2_fprop", "pipeline sm=24 cga=2 splits=2 margin"): 40}]
    assert o.choices["fc2_fprop"]["true_ms"] == pytest.approx(0.2187, abs=1e-4)


def test_the_queue_takes_hostrest_149_that_the_defaults_leave_and_all_is_put_back():
    """hostrest 149's true proj_fprop (0.316 ms) raced behind; the defaults leave it (43.9%), one queue per GEMM
    takes it (it loses hostglm's 149 instead: the study's README section)."""
    methods = (Looks._look, Looks._runners_up, sim.make_world)
    assert _gain_world("hostrest", 149).realized == pytest.approx(0.4388, abs=1e-4)
    with la.allocated("queue"):
        assert _gain_world("hostrest", 149).realized == pytest.approx(0.8243, abs=1e-4)
    assert (Looks._look, Looks._runners_up, sim.make_world) == methods


def test_the_oracle_reads_hostglm_57s_true_option_over_streams_and_puts_everything_back():
    """With acceptance off, 57's true fc2_fprop looks 40 times in each of 3 streams of noise. The table's draw reads it
    at 0.022 ms of its 0.219 and another at 0.146, both under a gain worth a switch (0.2 ms): the study's
    sixty-fourth section, over 200 streams."""
    methods = (Looks._runners_up, Looks._accepts, sim.SimulatedRun.__call__, sim.make_world)
    r = la.oracle_reads("hostglm", 57, "fc2_fprop", 3, SearchOptions())
    assert (Looks._runners_up, Looks._accepts, sim.SimulatedRun.__call__, sim.make_world) == methods
    close = lambda got, want: got == pytest.approx(want, abs=1e-4)  # noqa: E731
    assert r["part_ms"] == 0.219 and r["streams_with_max_looks"] == 3 and r["stream_0"][0] == 40
    assert close(r["lowest_means"], [0.0224, 0.1455, 0.2842]) and r["means_under_worth"] == 2
    assert close([r["sd_of_means"], r["own_sd_over_sqrt_n"], r["reported_se"]], [0.131, 0.0423, 0.0513])
    assert close([r["steps_per_look"], r["seconds_before_looks"]], [18.0, 87.1])
    assert r["looks_for_199_of_200"] == 369 and close(r["seconds_of_those_looks"], 664.2)


def test_bad_input_is_one_line_and_exit_2(capsys):
    for argv, says in (
        (["--set", "no_such_option=1"], "no_such_option"),
        (["--seeds", "x"], "x"),
        (["--allocation", "greedy"], "invalid choice: 'greedy'"),
        (["--reads", "fc2_fprop"], "one seed"),
        (["--reads", "fc3_fprop", "--seeds", "57"], "a GEMM of"),
        (["--reads", "fc2_fprop", "--seeds", "57", "--streams", "1"], "at least 2"),
        (["--reads", "qkv_fprop", "--seeds", "57"], "made only fc2_fprop, qkv_wgrad, fc1_dgrad faster"),
    ):
        with pytest.raises(SystemExit) as e:
            la.main(argv)
        assert e.value.code == 2 and says in capsys.readouterr().err.strip().splitlines()[-1]
