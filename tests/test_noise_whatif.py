"""benchmarks/studies/noise_whatif.py: a decision_sim scenario's forwards moved to what real searches measured."""

import json
import random
import statistics
import sys

import pytest
from benchmark_module import BENCHMARKS, load_benchmark

from megatron_tp_overlap.engine.space import TuningConfig
from megatron_tp_overlap.tools.research import decision_sim as sim
from megatron_tp_overlap.tools.research import disturbances as dist
from megatron_tp_overlap.ub.config import UbConfig

sys.path.insert(0, str(BENCHMARKS / "studies"))  # the study imports search_on_real_steps from its folder
nw = load_benchmark("noise_whatif")


def test_a_whatif_moves_only_the_named_slots_and_the_rest_and_puts_everything_back():
    before = dict(sim.NOISE["hostrest"]), dict(dist.REST_SLOPE), dist.REST_SPREAD, dict(sim.HOSTS)
    with nw.moved("hostrest", {"proj.fwd": (0.085, 0.07)}, {"proj.fwd": 6.3, "qkv.fwd": 4.1}, (0.07, 0.022)):
        run = sim.SimulatedRun(sim.World({}), "hostrest", random.Random(0))
        assert run.wide["proj.fwd"] == (0.0, 0.085, 0.07) and run.trial_sd["proj.fwd"] == 0.07
        assert run.wide["qkv.fwd"] == before[0]["qkv.fwd"]  # not named: as the scenario has it
        assert run.slope == {"proj.fwd": 6.3, "qkv.fwd": 4.1} and dist.REST_SPREAD == (0.07, 0.022)
        assert run.modes is None  # hostrest has no host
        assert run.extra["proj.fwd"] == pytest.approx(
            1.2 - sim.GEMM_MS * len(sim.SLOTS["proj.fwd"])
        )  # its real size stays (FWD_FASTEST)
    assert (sim.NOISE["hostrest"], dist.REST_SLOPE, dist.REST_SPREAD, sim.HOSTS) == before
    for scenario in ("hostmax", "hostbusy"):  # each its own host, the other's as it was
        with nw.moved(scenario, {}, None, None, nw.host_with(scenario, (0.8, 0.5))):
            runs = {sc: sim.SimulatedRun(sim.World({}), sc, random.Random(0)) for sc in ("hostmax", "hostbusy")}
            assert runs[scenario].modes.modes == (0.8, 0.5)
            other = "hostbusy" if scenario == "hostmax" else "hostmax"
            assert runs[other].modes.modes == {"hostmax": dist.HOST_MODES, "hostbusy": dist.BUSY_MODES}[other]
        assert sim.HOSTS == before[3]
    with pytest.raises(ValueError, match="--host-modes: hostrest has no host modes"):
        nw.host_with("hostrest", (0.9, 0.44))


def slow_step_corr(scenario: str) -> float:
    """corr(rest of the step, proj.fwd) over the slow steps (proj.fwd over 1.3x its 10th percentile) of 60 reference
    trials of 4 steps, as measured on the real runs (n2: 0.88-0.93)."""
    run, rows = sim.SimulatedRun(sim.World({}), scenario, random.Random(1)), []
    for _ in range(60):
        m = run(TuningConfig(UbConfig(), frozenset(), "reference"), 4, 1)
        rows += [(m.step_ms[i] - sum(v[i] for v in m.slot_ms.values()), m.slot_ms["proj.fwd"][i]) for i in range(4)]
    p10 = sorted(p for _, p in rows)[len(rows) // 10]
    slow = [(r, p) for r, p in rows if p > 1.3 * p10]
    return statistics.correlation([r for r, _ in slow], [p for _, p in slow])


def test_the_busy_hosts_rest_follows_the_host_as_measured_and_a_whatif_moves_one_hosts_rest():
    """Real busy hosts' rest moves with the forwards' wait (n2's slow steps: 0.98 + 0.07 x proj.fwd's ratio, sd 0.02,
    corr 0.88-0.93), and so does hostbusy's (``disturbances.BUSY_REST``). hostmax keeps a constant 1.12 in every slow
    step, which tells nothing of how late the host was; ``--slow-rest`` moves it for one what-if, and puts it back."""
    assert slow_step_corr("hostbusy") > 0.6 and abs(slow_step_corr("hostmax")) < 0.2
    busy = sim.HOSTS["hostbusy"]()
    assert busy.rest == dist.BUSY_REST and busy.modes == dist.BUSY_MODES
    assert busy.mean_rest() == pytest.approx(0.98 + 0.07 * 2.05)  # proj.fwd's slow range: 1.4-2.7x
    with nw.moved("hostmax", {}, None, None, nw.host_with("hostmax", rest=(0.98, 0.07, 0.02))):
        assert sim.HOSTS["hostmax"]().modes == dist.HOST_MODES  # not named: as the scenario has it
        assert slow_step_corr("hostmax") > 0.6
    host = sim.HOSTS["hostmax"]()
    assert host.rest == dist.SLOW_REST == 1.12 and host.rest_factor(0.0, random.Random(0)) == 1.0


def test_real_searches_figures_are_read_per_search_and_a_bad_slot_spec_names_itself(tmp_path):
    slot = {"rest_scaled_by": 4.0, "trial_level_pct": 14.0, "step_spread_pct": 9.8}
    runs = [{"seed": 29500, "kind": "gain", "per_slot": {"proj.fwd": slot}}]
    (tmp_path / "g0").mkdir()
    (tmp_path / "g0" / "search_on_real_steps.json").write_text(json.dumps({"runs": runs}))
    got = nw.real([str(tmp_path)])
    assert got == [("29500 gain", {"proj.fwd": slot})]
    assert nw.medians([got[0][1], {"proj.fwd": slot | {"trial_level_pct": 16.0}}]) == {"proj.fwd": (4.0, 15.0, 9.8)}
    with pytest.raises(ValueError, match="proj.fwd=0.1: expected SLOT=X,X"):
        nw._pairs(["proj.fwd=0.1"], 2)


@pytest.mark.parametrize(
    "args,line",
    [
        (["--noise", "proj.fwd=0.1,x"], "proj.fwd=0.1,x: expected SLOT=X,X (numbers)"),
        (["--slopes", "prj.fwd=6"], "prj.fwd: not a slot"),
        (["--seeds", "0-x"], "invalid literal for int()"),
        (["--set", "rest_beta_max=0"], "--set 'rest_beta_max=0': rest_beta_max = 0.0: must be > 0"),
        (["--scenario", "hostglm", "--host-modes", "0.9", "0.44"], "--host-modes: hostglm has no host modes"),
        (["--scenario", "hostglm", "--slow-rest", "0.98", "0.07", "0.02"], "--slow-rest: hostglm has no host modes"),
        (
            ["--scenario", "hostbusy", "--slopes", "qkv.fwd=4"],
            "--slopes, --rest-spread: hostbusy's slots do not follow",
        ),
    ],
)
def test_a_bad_value_ends_the_study_with_one_line_and_exit_2_before_any_search(args, line, capsys):
    with pytest.raises(SystemExit) as e:
        nw.main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and ": error: " in err[-1] and line in err[-1]  # argparse's usage, then the one line
    nw.main(["--noise", "proj.fwd=0.1,0.1", "--slopes", "qkv.fwd=4"])  # slots that are there: no search, no error
