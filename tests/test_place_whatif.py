"""benchmarks/studies/place_whatif.py: a call of looks' first trial reads a forward fast (as on 2 x H200), in the
simulator."""

import random
import sys

import pytest
from benchmark_module import BENCHMARKS, load_benchmark

from megatron_tp_overlap.engine.looks import Looks
from megatron_tp_overlap.engine.search import SearchOptions
from megatron_tp_overlap.engine.space import TuningConfig
from megatron_tp_overlap.tools.research import decision_sim as sim
from megatron_tp_overlap.ub.config import UbConfig

sys.path.insert(0, str(BENCHMARKS / "studies"))  # the study imports its neighbours from its folder
pw = load_benchmark("place_whatif")


def _trial(run: sim.SimulatedRun, steps: int) -> dict[str, list[float]]:
    return run(TuningConfig(UbConfig(), frozenset(), "reference"), steps, 1).slot_ms


def test_only_the_first_long_trial_after_a_call_of_looks_reads_the_slot_fast_and_all_is_put_back():
    world = sim.make_world(sim.build_space(sim.TOPO, sim.CTX, [UbConfig()]), 0.0, random.Random(0))
    plain = sim.SimulatedRun(world, "iid", random.Random(1))
    want = [_trial(plain, 8), _trial(plain, 8), _trial(plain, 4), _trial(plain, 8)]
    with pw.placed({"proj.fwd": 0.2}):
        placed = sim.SimulatedRun(world, "iid", random.Random(1))
        placed.fresh = True  # as Looks._looks_of marks it
        first, second = _trial(placed, 8), _trial(placed, 8)
        placed.fresh = True
        short, after_short = _trial(placed, 4), _trial(placed, 8)  # a 4-step trial ends the first place unmoved
    assert first["proj.fwd"] == pytest.approx([0.8 * v for v in want[0]["proj.fwd"]])
    assert first["qkv.fwd"] == want[0]["qkv.fwd"] and second == want[1] and short == want[2] and after_short == want[3]
    assert Looks._looks_of.__name__ == "_looks_of" and sim.SimulatedRun.__call__.__name__ == "__call__"


def test_on_the_simulator_the_effect_brings_equal_choices():
    """iid seeds 0-1 with proj.fwd read 15% fast in a call's first look: every equal world accepts a choice (for the
    final decision to catch); without the effect none does."""
    with pw.placed({"proj.fwd": 0.15}):
        placed = pw.summary("iid", [0, 1], SearchOptions())
    clean = pw.summary("iid", [0, 1], SearchOptions())
    assert (placed["equal_with_choice"], clean["equal_with_choice"]) == (2, 0)
    assert placed["realized_min"] == 1.0 and not placed["false_winners"]


def test_a_bad_place_is_one_line_and_exit_2(capsys):
    for bad, says in (
        ("attn.fwd=0.1", "--place attn.fwd: not a slot"),
        ("proj.fwd=1.5", "--place proj.fwd=1.5: the share must be at least 0 and under 1"),
        ("proj.fwd=x", "proj.fwd=x: expected SLOT=X (numbers)"),
    ):
        with pytest.raises(SystemExit) as e:
            pw.main(["--place", bad])
        assert e.value.code == 2 and says in capsys.readouterr().err.strip().splitlines()[-1]
