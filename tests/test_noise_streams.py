"""benchmarks/studies/noise_streams.py: decision_sim's worlds under other streams of noise (the world stays)."""

import importlib.util
import sys
from pathlib import Path

import pytest

STUDIES = Path(__file__).resolve().parents[1] / "benchmarks" / "studies"
sys.path.insert(0, str(STUDIES))
spec = importlib.util.spec_from_file_location("noise_streams", STUDIES / "noise_streams.py")
ns = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ns)


def test_seeds_are_listed_or_ranges():
    assert ns.parse_seeds(["57", "0-2", "9"]) == [57, 0, 1, 2, 9]


def test_stream_zero_is_the_tables_draw_and_another_stream_the_same_world_drawn_again():
    assert ns.one(("hostglm", 57, 0, False, {}))[:3] == (57, 0, pytest.approx(0.6837061235, abs=1e-9))  # the table's
    # world 139 (one 0.507 ms fc1_wgrad) under stream 3, where the ride-along sank it to 0% (tests/test_looks.py)
    assert ns.one(("hostglm", 139, 3, False, {}))[:3] == (139, 3, 1.0) and ns.true_gains(139) == {"fc1_wgrad": 0.507}
    # an equal world: one equal fc2_fprop choice accepted after one look, and passed by the final decision
    assert ns.one(("hostglm", 134, 3, True, {}))[3:] == (True, 1)


def test_summary_counts_misses_per_world_and_pools_them():
    rows = [(57, 1, 1.0, False, 2), (57, 0, 0.68, False, 1), (3, 0, 1.0, False, 1), (3, 1, 0.95, False, 1)]
    got = ns.summarize(rows, equal=False)
    assert got == {57: {"realized": [0.68, 1.0], "misses": 1}, 3: {"realized": [1.0, 0.95], "misses": 0}}
    out = ns.lines(got, False, {57: {"fc2_fprop": 0.219}})
    assert out[2] == "| 57 | 1 of 2 | 84.0% | fc2_fprop 0.219 | 68% 100% |" and len(out) == 4
    assert out[3] == "\n1 of 4 searches (25.0%) under 80%; 1 of 2 worlds with at least one"
    nan = float("nan")
    eq = ns.summarize([(5, 0, nan, True, 2), (5, 1, nan, False, 0), (6, 0, nan, False, 1), (6, 1, nan, False, 0)], True)
    assert eq == {5: {"false_winner": [True, False], "accepted": [2, 0], "misses": 1}} | {
        6: {"false_winner": [False, False], "accepted": [1, 0], "misses": 0}
    }
    out = ns.lines(eq, True)
    assert out[2] == "| 5 | 1 of 2 | x . |" and len(out) == 4
    assert out[3] == (
        "\n1 of 4 searches (25.0%) named a false winner; 1 of 2 worlds with at least one; 2 searches (50.0%) brought "
        "an equal choice to the final decision (3 choices), which named 50.0% of them"
    )


@pytest.mark.parametrize(
    "args, says",
    [
        (["--variants", "nope=1"], "--variants 'nope=1'"),
        (["--variants", "ride_along_z=-1"], "ride_along_z = -1.0: must be >= 0"),
        (["--seeds", "5-x"], "--seeds 5-x: "),
        (["--streams", "0"], "--streams 0 --jobs 1: each must be at least 1"),
    ],
)
def test_a_bad_input_gets_one_line_and_exit_2_before_any_search(args, says, capsys, monkeypatch):
    monkeypatch.setattr(ns, "one", lambda job: pytest.fail("searched"))
    with pytest.raises(SystemExit) as e:
        ns.main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and says in err[-1] and ": error: " in err[-1], err
