"""A search's looks replayed call by call with other configs (benchmarks/studies/look_replay.py)."""

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest

STUDIES = Path(__file__).resolve().parents[1] / "benchmarks" / "studies"
sys.path.insert(0, str(STUDIES))
import look_replay as lr  # noqa: E402  (the studies' folder first)


@dataclasses.dataclass
class _Trial:
    phase: str
    config: str
    step_samples: list = dataclasses.field(default_factory=lambda: [50.0] * 8)
    slot_ms: dict = dataclasses.field(default_factory=dict)
    error: str | None = None


@dataclasses.dataclass
class _Measurement:
    slot_ms: dict


class _Real:
    """RealSteps' interface: a call per trial that keeps its gap, switch and host ms; reads by config."""

    def __init__(self, reads: dict[str, dict[str, float]], host: bool = True):
        self.reads, self.host = reads, host
        self.gaps_ms, self.switched, self.host_ms, self.switches, self.live = [1.0], [True], [None], 7, None
        self.calls: list[tuple[str, int, int]] = []

    def __call__(self, config, n, warmup):
        self.calls.append((config, n, warmup))
        self.gaps_ms.append(0.0)
        self.switched.append(config != self.live)
        self.switches += config != self.live
        self.live = config
        ms = self.reads[config]
        self.host_ms.append({s: v + 1.0 for s, v in ms.items()} if self.host else None)
        return _Measurement({s: [v] * n for s, v in ms.items()})


def _search():
    """Racing, then two calls of looks (the second of two looks) closed by brackets of the incumbent ``I``."""
    trials = [
        _Trial("halving", "H", [50.0] * 4),
        _Trial("bracket", "I", [50.0] * 4),
        _Trial("recheck", "L1"),
        _Trial("bracket", "I"),
        _Trial("recheck", "L2"),
        _Trial("recheck", "L3", error="failed"),
        _Trial("recheck", "L4"),
        _Trial("bracket", "I"),
        _Trial("select", "S", [50.0] * 3),
    ]
    gaps = [20.0, 0.1, 15.0, 0.1, 12.0, 1.0, 1.0, 0.1, 9.0]
    return trials, gaps


def test_units_are_the_calls_of_looks_from_the_first_look_to_the_bracket_after_the_last():
    trials, gaps = _search()
    assert lr.units(trials, gaps) == [[2, 3], [4, 6, 7]]  # the failed look left out
    assert lr.units(trials[:2], gaps[:2]) == []


def test_plan_runs_the_incumbent_at_the_looks_or_swaps_them_with_their_bracket():
    trials, _ = _search()
    assert lr.plan(trials, [4, 6, 7], "same") == [(4, "L2"), (6, "L4"), (7, "I")]
    assert lr.plan(trials, [4, 6, 7], "incumbent") == [(4, "I"), (6, "I"), (7, "I")]
    assert lr.plan(trials, [4, 6, 7], "swap") == [(4, "I"), (6, "I"), (7, "L4")]
    assert lr.plan(trials, [4, 6], "swap") == [(4, "L2"), (6, "L4")]  # no bracket: the looks' own


def test_replay_alternates_the_variants_by_unit_and_leaves_the_search_as_it_was():
    trials, gaps = _search()
    reads = {c: {"qkv.fwd": 2.0, "proj.fwd": 1.0, "qkv.bwd": 5.0} for c in ("I", "L1", "L2", "L4")}
    real, work = _Real(reads), []
    out = lr.replay(real, trials, gaps, ("same", "incumbent"), warmup=1, work=work.append)
    assert [c for c, _, _ in real.calls] == ["L1", "I", "I", "I", "I", "I", "I", "L2", "L4", "I"]
    assert {(n, w) for _, n, w in real.calls} == {(8, 1)}
    assert work == [15.0, 0.1, 15.0, 0.1, 12.0, 1.0, 0.1, 12.0, 1.0, 0.1]  # the search's gap before each trial
    assert [(r["unit"], r["variant"], r["phase"]) for r in out[:2]] == [(0, "same", "recheck"), (0, "same", "bracket")]
    assert out[0]["slot_ms"] == {"qkv.fwd": 2.0, "proj.fwd": 1.0} and out[0]["host_ms"] == {
        "qkv.fwd": 3.0,
        "proj.fwd": 2.0,
    }
    assert (real.gaps_ms, real.switched, real.host_ms, real.switches) == ([1.0], [True], [None], 7)


def test_replay_stops_at_the_deadline_and_keeps_what_ran():
    trials, gaps = _search()
    reads = {c: {"qkv.fwd": 2.0, "proj.fwd": 1.0} for c in ("I", "L1", "L2", "L4")}
    assert lr.replay(_Real(reads), trials, gaps, ("same",), 1, deadline=-math.inf, work=lambda ms: None) == []


def test_summary_gives_each_variants_looks_less_their_bracket_per_unit():
    """The looks of unit 0 read qkv 1.0 over the bracket and proj 0.5 under it; of unit 1 (two looks) 0.6 and 0.2
    over (their mean); ``incumbent`` reads nothing apart; host ms where kept."""

    def rec(unit, phase, variant, q, p, host=True):
        ms = {"qkv.fwd": q, "proj.fwd": p}
        return {
            "unit": unit,
            "i": 0,
            "phase": phase,
            "variant": variant,
            "slot_ms": ms,
            "host_ms": ms if host else None,
        }

    records = [
        rec(0, "recheck", "same", 3.0, 1.5),
        rec(0, "bracket", "same", 2.0, 2.0),
        rec(1, "recheck", "same", 2.5, 2.1),
        rec(1, "recheck", "same", 2.7, 2.3),
        rec(1, "bracket", "same", 2.0, 2.0),
        rec(0, "recheck", "incumbent", 2.0, 2.0, host=False),
        rec(0, "bracket", "incumbent", 2.0, 2.0, host=False),
    ]
    s = lr.summarize(records)
    assert s["same"]["gpu:qkv.fwd"][:3:2] == [0.8, 2] and s["same"]["gpu:qkv.fwd"][1] == pytest.approx(0.2)
    assert s["same"]["gpu:proj.fwd"][0] == pytest.approx(-0.15)
    assert s["same"]["host:qkv-proj"][0] == pytest.approx(0.95)
    assert s["incumbent"]["gpu:qkv-proj"][::2] == [0.0, 1] and "host:qkv.fwd" not in s["incumbent"]
    lines = lr.table(s)
    assert lines[0] == "| looks less their bracket | same | incumbent |"
    assert "| host:qkv-proj ms | +0.950 +- 0.550 (2) | - |" in lines


def test_searched_gives_the_searchs_own_trials_of_those_units():
    trials, gaps = _search()
    for t in trials:
        t.slot_ms = {"qkv.fwd": 2.0, "proj.fwd": 1.0, "fc1.bwd": 3.0}
    out = lr.searched(trials, gaps, [None] * len(trials))
    assert [(r["unit"], r["i"], r["variant"]) for r in out] == [
        (0, 2, "search"),
        (0, 3, "search"),
        (1, 4, "search"),
        (1, 6, "search"),
        (1, 7, "search"),
    ]
    assert out[0]["slot_ms"] == {"qkv.fwd": 2.0, "proj.fwd": 1.0} and out[0]["host_ms"] is None


def test_an_unknown_replay_variant_is_one_line_and_exit_2_before_any_gpu_work():
    r = subprocess.run(
        [sys.executable, str(STUDIES / "search_on_real_steps.py"), "--replay-looks", "same", "mirror"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "--replay-looks 'mirror': not a variant; variants are same, incumbent, swap"
    ]


def test_os_lines_give_the_threads_time_switches_and_cores_per_kind_of_trial():
    def rec(variant, phase, cores, user):
        os = {"cores": cores, "wall_ms": 50.0, "user_ms": user, "sys_ms": 2.0, "vcsw": 3, "ivcsw": 1}
        os["cpu_ms"] = {"qkv.fwd": 1.8, "proj.fwd": 1.4}
        host = {"qkv.fwd": 2.0, "proj.fwd": 1.5}
        return {"variant": variant, "phase": phase, "unit": 0, "i": 0, "slot_ms": {}, "host_ms": host, "os": os}

    lines = lr.os_lines([rec("search", "recheck", [3, 4], 40.0), rec("search", "recheck", [5, 5], 42.0)])
    assert lines == [
        "search looks (2): wall 50.00, user 41.00, sys 2.00 ms per step; switches 3.0 / 1.0; moved core 1; "
        "cores [3, 4, 5]; qkv.fwd cpu 1.80 of host 2.00; proj.fwd cpu 1.40 of host 1.50"
    ]
    assert lr.os_lines([rec("same", "bracket", [1, 1], 40.0) | {"os": None}]) == []
    faulted = rec("same", "bracket", [1, 1], 40.0)
    faulted["os"] |= {"faults": 120.0, "proc_faults": 300.0, "proc_sys_ms": 1.25}
    assert lr.os_lines([faulted])[0].endswith("; faults 120 per step (process: 300, system 1.25 ms)")
    faulted["os"]["faults_in"] = {"qkv.fwd": 10.0, "proj.fwd": 31.5, "fc1.fwd": 2.0, "fc2.fwd": 0.0}
    assert lr.os_lines([faulted])[0].endswith(
        "(process: 300, system 1.25 ms); in qkv.fwd 10, proj.fwd 32, fc1.fwd 2, fc2.fwd 0"
    )


def test_tsv_gives_one_line_per_trial_with_its_faults_host_and_gpu_ms_per_forward():
    os = {"faults": 110.5, "faults_in": {"qkv.fwd": 4.0, "proj.fwd": 41.0}}
    rec = {"unit": 2, "i": 17, "phase": "bracket", "variant": "search", "slot_ms": {"qkv.fwd": 1.5}, "os": os}
    lines = lr.tsv(
        [rec | {"host_ms": {"qkv.fwd": 2.0}}, rec | {"variant": "same", "os": None, "host_ms": None}], "g0 7"
    )
    assert lines[0].split("\t")[:7] == ["where", "unit", "i", "phase", "variant", "faults", "faults:qkv.fwd"]
    assert lines[1].split("\t") == ["g0 7", "2", "17", "bracket", "search", "110.5", "4.0", "41.0", "", ""] + [
        "2.0", "", "", "", "1.5", "", "", ""
    ]  # fmt: skip
    assert lines[2].split("\t")[4:] == ["same"] + [""] * 9 + ["1.5", "", "", ""]


def test_phase_faults_gives_each_phases_faults_per_step_range_and_median_system_ms():
    run = {
        "trace": {"qkv.fwd": [["screen"], ["halving"], ["halving"], ["recheck"], ["halving"]]},
        "trial_os": [
            {"faults": 128.0, "sys_ms": 0.1},
            {"faults": 132.0, "sys_ms": 1.0},
            {"faults": 136.4, "sys_ms": 1.2},
            None,  # not traced
            {"faults": 133.0, "sys_ms": 0.9},
        ],
    }
    assert lr.phase_faults(run) == "screen 128-128 (0.10 ms); halving 132-136 (1.00 ms)"
    assert lr.phase_faults({"trace": {}, "trial_os": None}) == ""


def test_bracket_levels_split_the_incumbents_brackets_by_the_call_they_close():
    rows = [["halving", 0, 2.0], ["bracket", 1, 1.5], ["recheck", 2, 1.0], ["bracket", 3, 1.2], ["screen", 4, 9.0]]
    rows += [["bracket", 5, 7.0], ["halving", 6, 2.0], ["bracket", 7, 1.7]]  # a bracket after screening: neither
    lines = lr.bracket_levels({"trace": {"proj.fwd": rows, "qkv.bwd": rows, "fc1.fwd": rows[:2]}})
    assert lines == ["proj.fwd brackets closing racing rounds 1.600 ms (2), calls of looks 1.200 (1): -0.400"]
    assert lr.bracket_levels({}) == []
