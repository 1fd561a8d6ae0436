"""A look against the brackets on both sides of it (benchmarks/studies/look_neighbours.py, on search traces)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "studies"))
import look_neighbours as ln  # noqa: E402  (the studies' folder first)


def _row(phase: str, pos: int, ms: float, delay: float = 0.0, n: int = 8, gap: float = 0.1) -> list:
    """A trace row (phase, position, median ms, delay put in, delays, steps, rest of the step, gap ms)."""
    return [phase, pos, ms, delay, [], [ms] * n, [50.0] * n, gap]


def test_a_look_is_set_against_the_nearest_bracket_after_it_and_before_it():
    """Calls of looks closed by a bracket, as at the defaults: the looks read 0.5 ms below the bracket before them
    (the last call's) and 0.7 and 0.3 below the one after; a second look in a call shares its brackets; a delay put in
    is taken out of the level; the racing's 4-step trials count nothing."""
    rows = [
        _row("bracket", 0, 1.0),
        _row("recheck", 9, 0.5, gap=10.0),
        _row("bracket", 18, 1.5, delay=0.3),  # level 1.2
        _row("halving", 27, 9.0, n=4, gap=5.0),
        _row("recheck", 32, 0.7, gap=10.0),
        _row("recheck", 41, 0.9, delay=0.2, gap=1.0),  # level 0.7
        _row("bracket", 50, 1.0),
    ]
    after, before = ln.look_less_brackets(rows)
    assert after == pytest.approx([-0.7, -0.3, -0.3])
    assert before == pytest.approx([-0.5, -0.5, -0.5])


def test_lines_give_each_forward_slot_both_sides_and_the_final_decisions_reading():
    """One line per forward slot with two looks or more on each side (the backward slot and a trace of one look
    are left out); the final decision's candidate blocks less its reference blocks in the same slot."""
    rows = [
        _row("bracket", 0, 1.0),
        _row("recheck", 9, 0.6, gap=10.0),
        _row("bracket", 18, 1.0),
        _row("recheck", 27, 0.8, gap=10.0),
        _row("bracket", 36, 1.2),
        _row("confirm", 45, 2.0, n=3),
        _row("confirm", 49, 2.5, n=3),
        _row("confirm", 53, 2.7, n=3),
        _row("confirm", 57, 2.0, n=3),
    ]
    blocks = [
        ["autotuned", 1, 20.0, 21.0],
        ["reference", 1, 20.0, 21.0],
        ["reference", 0, 20, 21],
        ["autotuned", 1, 20, 21],
    ]
    run = {"seed": 3, "trace": {"proj.fwd": rows, "proj.bwd": rows, "qkv.fwd": rows[:3]}, "confirm_blocks": blocks}
    assert ln.lines([run]) == [
        "seed 3 (defaults) proj.fwd: looks less the bracket next -0.400 +- 0.000 (n=2), "
        "before -0.300 +- 0.100 (n=2) ms; final decision -0.600 ms"
    ]
    assert ln.final_less_reference({"confirm_blocks": blocks[:3]}, rows) is None  # blocks and rows do not pair up


def test_the_racings_trials_are_set_against_brackets_of_their_length_where_no_slot_has_a_delay():
    """A racing trial with a delay put in any slot (``no overlap``) is left out; the looks' brackets do not count."""
    rows = [
        _row("bracket", 0, 1.0, n=4),
        _row("halving", 5, 1.2, n=4),
        [*_row("halving", 10, 3.0, n=4)[:4], [0.0, 1.7], *_row("halving", 10, 3.0, n=4)[5:]],  # costs 1.7 ms elsewhere
        _row("bracket", 15, 1.1, n=4),
        _row("bracket", 20, 5.0),  # 8 steps: a look's
    ]
    assert ln.look_less_brackets(rows, "halving") == (pytest.approx([0.1]), pytest.approx([0.2]))


def test_with_host_trace_a_line_also_sets_the_looks_host_ms_against_the_brackets():
    """Rows with a 10th field (``--host-trace``): the host ms of the slot's module calls per step, looks against
    brackets as their levels are; a forward sum's trace (``proj+qkv.fwd``) gets no host part."""
    rows = [  # each row: after a switch (9th field), then its host ms per step
        [*_row("bracket", 0, 1.0), True, 2.0],
        [*_row("recheck", 9, 0.5, gap=10.0), True, 2.5],
        [*_row("bracket", 18, 1.0), True, 2.0],
        [*_row("recheck", 27, 0.5, gap=10.0), True, 2.9],
        [*_row("bracket", 36, 1.0), True, 2.1],
    ]
    (line,) = ln.lines([{"seed": 5, "trace": {"qkv.fwd": rows}}])
    assert line.endswith("; on the host: next +0.650 +- 0.150 (n=2), before +0.700 +- 0.200 (n=2)")
    two = ln.lines([{"seed": 5, "trace": {"qkv.fwd": rows, "proj.fwd": rows}}])
    assert len(two) == 3 and "on the host" not in two[2] and two[2].startswith("seed 5 (defaults) proj+qkv.fwd")


def test_split_lines_give_how_each_kind_of_trial_splits_the_attention_forward():
    """qkv.fwd less proj.fwd, trial for trial: looks after the judging (a gap of 2 ms or more) and after a look
    apart, the looks' brackets, the racing's trials without a delay (one with a delay left out), the final decision's
    blocks; the 1-step screening counts nowhere."""
    kinds = [("screen", 1, 9.0), ("halving", 4, 0.1), ("halving", 4, 0.3), ("bracket", 8, 0.1), ("recheck", 8, 20.0)]
    kinds += [("recheck", 8, 1.0), ("bracket", 8, 0.1), ("confirm", 3, 0.1)]
    qkv = [_row(k, i, 3.0, n=n, gap=g) for i, (k, n, g) in enumerate(kinds)]
    proj = [
        _row(k, i, ms, n=n, gap=g) for i, ((k, n, g), ms) in enumerate(zip(kinds, [9, 3.1, 9, 3.0, 2.0, 1.5, 3.2, 2.9]))
    ]
    qkv[2][4] = proj[2][4] = [1.7]  # a delay put in: left out
    (line,) = ln.split_lines([{"seed": 2, "trace": {"qkv.fwd": qkv, "proj.fwd": proj}}])
    assert line == (
        "seed 2 (defaults) qkv.fwd less proj.fwd, ms: looks after the judging +1.00 (n=1); looks after a look +1.50 "
        "(n=1); brackets -0.10 (n=2); racing's trials -0.10 (n=1); final decision's blocks +0.10 (n=1)"
    )
