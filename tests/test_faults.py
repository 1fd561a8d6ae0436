"""Fault injection: every kind is caught at the trial boundary, recorded, and tuning goes on with the
best valid config; with the fault on one rank only, both ranks still take the same decisions."""

import json
import math
import os
import sys
import time

import fakes
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from test_tuner_cpu import make_tuner

from megatron_tp_overlap.engine import faults
from megatron_tp_overlap.engine import switcher as ub_runtime
from megatron_tp_overlap.engine.search import SearchOptions

WINNER = "fc2_fprop: pipeline sm=8 cga=2 splits=4"  # the designed optimum of fakes.gemm_cost_ms


def test_parse():
    fs = faults.parse("step:#3, rank=1/init:fc2_fprop, nan:x,timeout:y")
    assert fs[0] == faults.Fault("step", "#3") and fs[1] == faults.Fault("init", "fc2_fprop", 1)
    assert fs[0].hits("step", 3, "anything", 0) and not fs[0].hits("step", 2, "anything", 0)
    assert fs[1].hits("init", 0, "fc2_fprop: pipeline", 1) and not fs[1].hits("init", 0, "fc2_fprop: pipeline", 0)
    with pytest.raises(ValueError, match="MEGATRON_TP_OVERLAP_FAULTS"):
        faults.parse("explode:#1")
    assert faults.parse("") == [] and faults.parse(None) == []


@pytest.mark.parametrize(
    "kind, reason", [("init", "raised"), ("step", "raised"), ("nan", "non-finite"), ("timeout", "trial timeout")]
)
def test_each_fault_is_survived_and_reported(fake_te, kind, reason):
    tuner, _ = make_tuner(faults=faults.parse(f"{kind}:{WINNER}"), trial_timeout_s=1.0)
    res = tuner.tune()
    failed = [t for t in res.report["trials"] if t["error"]]
    assert failed and all(reason in t["error"] for t in failed)
    assert WINNER not in res.best.describe()  # never measured, so never chosen
    assert res.search.best_name == "autotuned"  # the other GEMMs were still tuned
    assert fake_te.cfg == res.best.ub


def _rank(rank, init, out):
    import datetime

    import torch

    # A hang (a rank left waiting in a collective) becomes an error after 60 s instead of 30 min.
    dist.init_process_group(
        "gloo", init_method=f"file://{init}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    te = fakes.FakeTE()
    fakes.STATE = te
    ub_runtime._te_base = lambda: te
    tuner, _ = make_tuner(
        faults=faults.parse(f"rank=1/step:{WINNER}"), options=SearchOptions(max_seconds=60, max_steps=3000)
    )
    local_step = tuner.step_fn

    def step():  # like a TP step: the ranks meet in collectives inside every step
        local_step()
        dist.all_reduce(torch.ones(1))

    tuner.step_fn = step
    res = tuner.tune()
    with open(os.path.join(out, f"r{rank}.json"), "w") as f:
        json.dump({"best": res.best.to_dict(), "errors": [t["error"] for t in res.report["trials"] if t["error"]]}, f)
    dist.destroy_process_group()


def test_a_fault_on_one_rank_keeps_ranks_in_lockstep(tmp_path):
    mp.start_processes(_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True, start_method="fork")
    r0, r1 = (json.loads((tmp_path / f"r{r}.json").read_text()) for r in (0, 1))
    assert r0 == r1 and r0["errors"]  # rank 0 also saw the failure (agreed), same decisions


def test_lockstep_alone_agrees_with_itself():
    from megatron_tp_overlap.engine.lockstep import Lockstep, PeerFailed

    ls = Lockstep()
    assert not ls.enabled and ls.agree_max([1.0, math.nan])[0] == 1.0
    assert ls.attempt(lambda: None) and not ls.attempt(lambda: 1 / 0)
    with pytest.raises(PeerFailed, match="rank 0: why"):
        ls.check(True, "why")


def _faulty_rank(rank, world, kind, init, out):
    """One rank of a TP-like job whose step runs a collective after the model; ``kind`` fires on rank 1 only."""
    import datetime

    import torch

    err = open(os.path.join(out, f"r{rank}.err"), "w", buffering=1)
    os.dup2(err.fileno(), 2)
    sys.stderr = err  # a forked rank keeps the test runner's sys.stderr object, which fd 2 alone does not redirect
    dist.init_process_group(
        "gloo", init_method=f"file://{init}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    te = fakes.FakeTE()
    fakes.STATE = te
    ub_runtime._te_base = lambda: te
    tuner, _ = make_tuner(
        # ubinit once (trial 3, a switch), as the test says: each failure holds the peers for the gloo bootstrap
        # timeout (1 s here), and the designed winner's every trial failed it 2-3 times more (the suite's time)
        faults=faults.parse(f"rank=1/{kind}:{'#3' if kind == 'ubinit' else WINNER}"),
        options=SearchOptions(max_seconds=60, max_steps=3000),
    )
    tuner.peer_grace_s = 2.0
    local_step = tuner.step_fn

    def step():
        local_step()
        dist.all_reduce(torch.ones(1))

    tuner.step_fn = step
    res = tuner.tune()
    groups = [g for g in te.bootstrap_groups if g is not None]
    own = list(tuner.switcher._bootstrap.values())
    alive = lambda: sum(g in dist.distributed_c10d._world.pg_map for g in own)  # noqa: E731
    own_alive = alive()
    tuner.switcher.close()  # what the integrations do once no switch is to come
    with open(os.path.join(out, f"r{rank}.json"), "w") as f:
        json.dump(
            {
                "best": res.best.to_dict(),
                "errors": [t["error"] for t in res.report["trials"] if t["error"]],
                "inits": len(groups),
                "groups": len({id(g) for g in groups}),
                "own_alive": [own_alive, alive()],
            },
            f,
        )
    dist.destroy_process_group()


def _run_ranks(tmp_path, world, kind, timeout_s):
    ctx = mp.get_context("fork")
    procs = [
        ctx.Process(target=_faulty_rank, args=(r, world, kind, str(tmp_path / "init"), str(tmp_path)))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        p.kill()
    assert not hung, f"ranks {hung} still running after {timeout_s} s"
    return [p.exitcode for p in procs]


@pytest.mark.parametrize("world", [4])  # 2 ranks: the same paths, fewer blocked peers (the suite must stay fast)
def test_a_failure_inside_initialize_ub_on_one_rank_fails_that_trial_on_every_rank_and_tuning_goes_on(tmp_path, world):
    """Rank 1 raises between two communicators of initialize_ub while its peers wait in the second one's
    collective: the switcher's bootstrap groups are aborted, every rank fails that trial, and all finish alike."""
    codes = _run_ranks(tmp_path, world, "ubinit", timeout_s=240)
    assert codes == [0] * world
    results = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(world)]
    assert all(r["best"] == results[0]["best"] for r in results)
    # every rank names the rank that failed and why, not just "failed somewhere"
    assert all(
        any("rank 1: InjectedFault: injected fault inside initialize_ub" in e for e in r["errors"]) for r in results
    )
    # TE's per-call bootstrap group is created once per failure-free stretch, not once per switch
    assert all(r["groups"] < r["inits"] for r in results)
    # and the switcher's close() destroys the ones it kept (left to the exit, they delayed it on 2 H200s)
    assert all(r["own_alive"] == [1, 0] for r in results), [r["own_alive"] for r in results]


@pytest.mark.parametrize("world", [4])  # 2 ranks: the same paths, fewer blocked peers (the suite must stay fast)
def test_a_failure_mid_step_on_one_rank_ends_every_rank_with_the_same_line_instead_of_hanging(tmp_path, world):
    """Rank 1 raises inside a step (its peers go on into the step's collective, which cannot complete): within the
    grace period every rank prints the same line and exits with lockstep.EXIT_CODE; nothing hangs."""
    from megatron_tp_overlap.engine.lockstep import EXIT_CODE

    codes = _run_ranks(tmp_path, world, "midstep", timeout_s=120)
    assert codes == [EXIT_CODE] * world
    lines = [
        [ln for ln in (tmp_path / f"r{r}.err").read_text().splitlines() if "ending the job" in ln] for r in range(world)
    ]
    assert all(len(ls) == 1 for ls in lines), lines
    # the same cause on every rank (a rank may add its own echo of a peer's exit, e.g. "connection closed")
    assert all(
        "ending the job: tuning failed on rank 1: InjectedFault: injected fault inside a trial step" in ls[0]
        for ls in lines
    )
    assert not list(tmp_path.glob("r*.json"))  # no rank went on as if nothing happened


def test_a_repeated_trial_error_is_printed_once_and_counted_in_the_decision_line(fake_te):
    """On 2 x H100 one broken switch printed the same 'trial failed' line 96 times, and the decision's line did not
    say that most trials had failed: the first one is printed, the rest are counted in the decision's line."""
    tuner, _ = make_tuner(faults=faults.parse("step:fc2_fprop"))
    lines: list[str] = []
    tuner.log = lambda *a: lines.append(" ".join(map(str, a)))
    res = tuner.tune()
    failed = [t for t in res.search.trials if t.error]
    printed = [x for x in lines if "trial failed on this rank" in x]
    assert len(failed) > 1 and len(printed) == 1 and "InjectedFault" in printed[0], printed
    note = f"; {len(failed)} of {len(res.search.trials)} trials failed, {len(failed)} of them on this rank with: "
    assert note + "InjectedFault: injected fault during a trial step" in res.search.reason, res.search.reason
    assert tuner._failures.note([]) == ""


def test_when_every_option_fails_the_early_stop_line_says_so_instead_of_every_option_settled(fake_te):
    """As on 2 x H100 with MoE (every switch refused): the search stopped early 'every option is settled', which read
    as if every option had been measured."""
    tuner, _ = make_tuner(
        faults=faults.parse("step:_")
    )  # every option's description has a GEMM name, the reference not
    lines: list[str] = []
    tuner.log = lambda *a: lines.append(" ".join(map(str, a)))
    res = tuner.tune()
    stop = [x for x in lines if "search stops early" in x]  # one pass: it kept the reference
    assert res.search.best_name == "reference" and len(stop) == 1, lines
    failed = sum(1 for t in res.search.trials if t.error and t.phase in ("screen", "bracket", "halving", "recheck"))
    assert failed > 0 and stop[0].endswith(f"; {failed} trials of options failed and measured nothing"), stop
