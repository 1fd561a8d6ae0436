"""Fault injection: every kind is caught at the trial boundary, recorded, and tuning goes on with the
best valid config; with the fault on one rank only, both ranks still take the same decisions."""

import json
import os

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
    mp.start_processes(_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    r0, r1 = (json.loads((tmp_path / f"r{r}.json").read_text()) for r in (0, 1))
    assert r0 == r1 and r0["errors"]  # rank 0 also saw the failure (agreed), same decisions
