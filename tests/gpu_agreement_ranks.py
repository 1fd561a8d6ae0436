"""Ranks for tests/test_gpu_engine.py::test_agreements_without_gloo_over_nccl (under torchrun, one GPU per rank): a
job without gloo groups agrees over a dedicated NCCL communicator and creates no gloo group of ours."""

import json
import os
import sys

import torch
import torch.distributed as dist

from megatron_tp_overlap.engine import agreement
from megatron_tp_overlap.engine.lockstep import Lockstep

rank = int(os.environ["RANK"])
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
kinds = []
real = agreement._backend
agreement._backend = lambda kind, *a: kinds.append(kind) or real(kind, *a)
ls = Lockstep(gloo=False)
out = {
    "describe": ls.describe(),
    "max": ls.agree_max([rank, -rank, float("nan") if rank == 1 else 1.0]),
    "ok": ls.attempt(lambda: 1 / 0 if rank == 1 else None),
    "failure": ls.failure,
    "kinds": kinds,
    "gloo_groups": sum(dist.get_backend(g) == "gloo" for g in dist.distributed_c10d._world.pg_map),
}
ls.close()
with open(os.path.join(sys.argv[1], f"r{rank}.json"), "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
