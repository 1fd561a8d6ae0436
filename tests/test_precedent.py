"""What a trial follows: ``trial_precedent.record`` sets a trial right after some work against the trial right after
it (benchmarks/studies/trial_precedent.py, run on real steps by search_on_real_steps.py)."""

import importlib.util
import json
import statistics
import sys
from pathlib import Path

import pytest

from megatron_tp_overlap.engine.search import Measurement

STUDIES = Path(__file__).resolve().parents[1] / "benchmarks" / "studies"
sys.path.insert(0, str(STUDIES))
spec = importlib.util.spec_from_file_location("trial_precedent", STUDIES / "trial_precedent.py")
tp = sys.modules["trial_precedent"] = importlib.util.module_from_spec(spec)  # its dataclass looks itself up
spec.loader.exec_module(tp)


class _Fake:
    """RealSteps' interface: a slot reads 0.3 ms more in the trial right after ``hot`` work, 1 ms otherwise."""

    def __init__(self) -> None:
        self.hot, self.live, self.calls = False, None, 0

    def start(self, world) -> None:
        self.world = world

    def __call__(self, config, steps: int, warmup: int) -> Measurement:
        ms, self.hot, self.calls = 1.3 if self.hot else 1.0, False, self.calls + 1
        return Measurement({"qkv.fwd": [ms] * steps, "fc1.bwd": [2.0] * steps}, [50.0] * steps, 0.0, steps + warmup)


def test_record_sets_the_trial_right_after_each_work_against_the_next_and_rotates_the_order():
    fake = _Fake()
    hot = lambda ms: setattr(fake, "hot", True)  # noqa: E731
    works = {"none": tp.WorkKind(lambda ms: None), "python": tp.WorkKind(hot)}
    pairs = tp.record(fake, 3, 20.0, steps=4, works=works)
    assert [p["kind"] for p in pairs] == ["none", "python", "python", "none", "none", "python"] and fake.calls == 12
    got = tp.summarize(pairs)
    assert got["qkv.fwd"]["python"][0] == pytest.approx(0.3) and got["qkv.fwd"]["none"] == [0.0, 0.0]
    assert got["fc1.bwd"] == {"none": [0.0, 0.0], "python": [0.0, 0.0]}
    # a settle trial takes the work's effect (here: the fake's one hot trial); without a switch the trials continue
    fake = _Fake()
    pairs = tp.record(
        fake, 2, 20.0, steps=4, works={"settled": tp.WorkKind(hot, settle=True), "still": tp.WorkKind(hot, False)}
    )
    assert tp.summarize(pairs)["qkv.fwd"] == {"settled": [0.0, 0.0], "still": [pytest.approx(0.3), 0.0]}
    assert fake.calls == 2 * (1 + 2) + 2 * (1 + 2)  # a settle trial, or a warm trial before the work, and the pair
    # the kinds with work pooled (``none``, the control, left out), against the trials' own spread (ms)
    fake = _Fake()
    pairs = tp.record(
        fake,
        4,
        20.0,
        steps=4,
        works={"none": tp.WorkKind(lambda ms: None), "python": tp.WorkKind(lambda ms: setattr(fake, "hot", True))},
    )
    spread = statistics.pstdev([1.3, 1.0] * 4 + [1.0, 1.0] * 4)  # qkv.fwd: 1.3 after each python work, else 1.0
    assert tp.pooled_lines(pairs) == [
        f"qkv.fwd: after work (pooled, 4 pairs) +0.300 +- 0.000 ms; trials {spread:.2f} ms apart"
    ]
    assert tp.pooled_lines([p for p in pairs if p["kind"] == "none"]) == []
    lines = tp.summary_lines(got)
    assert (
        lines[0] == "| slot | after none, ms | after python, ms |"
        and "| qkv.fwd | +0.0000 +- 0.0000 | +0.3000" in lines[2]
    )


def test_record_runs_another_config_that_costs_the_same_before_or_after_the_reference():
    """``order`` "or" runs a pair as a look and its bracket: another config (each forward GEMM's first option, no
    cost put in: the world is equal), then the reference; "ro" the other way round. A fake that reads the other
    config's ``qkv.fwd`` 0.4 ms fast gives the first trial less the second -0.4 and +0.4 ms."""

    class _ByConfig(_Fake):
        def __call__(self, config, steps: int, warmup: int) -> Measurement:
            self.configs = [*getattr(self, "configs", []), config]
            ms = 1.0 if config.label == "reference" else 0.6
            return Measurement({"qkv.fwd": [ms] * steps}, [50.0] * steps, 0.0, steps + warmup)

    fake = _ByConfig()
    works = {"or": tp.WorkKind(lambda ms: None, order="or"), "ro": tp.WorkKind(lambda ms: None, order="ro")}
    got = tp.summarize(tp.record(fake, 2, 20.0, steps=4, works=works))
    assert got["qkv.fwd"] == {"or": [pytest.approx(-0.4), 0.0], "ro": [pytest.approx(0.4), 0.0]}
    other = next(c for c in fake.configs if c.label != "reference")
    assert sorted(g for g, _ in other.ub.entries) == ["fc1_fprop", "fc2_fprop", "proj_fprop", "qkv_fprop"]
    assert fake.world.step_ms(other) == fake.world.step_ms(fake.configs[0])  # no cost put in


def test_decision_blocks_sets_the_first_reference_block_of_each_quadruple_against_its_last():
    """Quadruples A B B A of 3-step blocks; from the 7th the first follows the decision's judging: here 0.2 ms slower."""
    blocks = []
    for q in range(10):
        first = 10.2 if q >= 6 else 10.0
        blocks += [["reference", 0, first], ["autotuned", 1, 10.0], ["autotuned", 0, 10.0], ["reference", 1, 10.0]]
    ref = [b[2] for b in blocks if b[0] == "reference"]
    quiet, judged = tp.decision_blocks([{"confirm_blocks": blocks + [["first pass", 1, 9.0]]}])
    assert (
        quiet
        == "final decision, quadruples 2-6 (no judging before): first less last reference block +0.000 +- 0.000 spreads (n=5)"
    )
    spreads = f"{0.2 / statistics.pstdev(ref):+.3f}"
    assert (
        judged
        == f"final decision, quadruples 7+ (after judging): first less last reference block {spreads} +- 0.000 spreads (n=4)"
    )


def test_call_order_sets_a_calls_second_trial_against_its_first_by_length():
    """Rows as the trace keeps them (phase, position, median ms, delay put in, delays, steps, step ms, gap ms): two
    8-step calls whose second trial reads 0.4 and 0.6 ms slower, a delay of 0.3 ms taken out of a look; one 4-step call
    pair (too few for a line of its own); a trial after work with no second one counts nothing."""
    row = lambda phase, pos, ms, delay, n, gap: [phase, pos, ms, delay, [], [ms] * n, [50.0] * n, gap]  # noqa: E731
    rows = [
        row("recheck", 0, 2.0, 0.0, 8, 10.0),
        row("bracket", 9, 2.7, 0.3, 8, 0.1),  # level 2.4: +0.4
        row("recheck", 18, 2.1, 0.0, 8, 12.0),
        row("bracket", 27, 3.0, 0.3, 8, 0.1),  # level 2.7: +0.6
        row("halving", 36, 2.0, 0.0, 4, 5.0),
        row("halving", 41, 2.5, 0.0, 4, 1.0),  # 4 steps: one pair only
        row("recheck", 46, 2.0, 0.0, 8, 9.0),  # after work, then the search's work again
        row("recheck", 55, 5.0, 0.0, 8, 9.0),
    ]
    run = {"seed": 7, "trace": {"proj.fwd": rows, "proj.bwd": rows}}
    assert tp.call_order([run]) == [
        "seed 7 (defaults) proj.fwd: second trial less first, 8-step calls +0.500 +- 0.100 ms (n=2)"
    ]


def test_pairs_of_a_run_cut_short_are_read_from_its_log(tmp_path, capsys):
    """``--pairs LOG``: the ``[precedent]`` lines a run printed as each pair ended (its JSON was never written)."""
    pair = lambda a, b: {"kind": "other-first", "after_work": {"qkv.fwd": a}, "after_trial": {"qkv.fwd": b}}  # noqa: E731
    log = tmp_path / "g0.log"
    log.write_text("noise\n" + "".join(f"[precedent] {json.dumps(pair(a, 1.0))}\n" for a in (0.5, 0.7)) + "[prec")
    tp.main(["--pairs", str(log)])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("2 pairs") and out[3] == "| qkv.fwd | -0.4000 +- 0.1000 |"


def test_pairs_from_a_log_that_is_not_there_get_one_line_and_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        tp.main(["--pairs", str(tmp_path / "g9.log")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err == [f"--pairs {tmp_path / 'g9.log'}: no such log"]
