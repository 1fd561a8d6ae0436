# CPU, the project venv: python benchmarks/results/2026-11-25_h100x2/nineteenth/release_cost.py
# What letting go of spent contexts costs: afae6d6 (one referrer walk per communicator and per holding dict) against
# 108bee1 (two walks), 8 communicators, 5 spent contexts holding 2 of them, on a heap of ~170k tracked objects.
import gc
import time

import torch

from megatron_tp_overlap.engine.held_graphs import release_from_contexts


class Comm:
    pass


class F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ub):
        ctx.ub_obj_gradout = ub
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2, None


def old_release(comms):  # afae6d6: one referrer walk per communicator and per dict
    dropped = []
    for comm in comms:
        for ref in gc.get_referrers(comm):
            if not isinstance(ref, dict):
                continue
            for owner in gc.get_referrers(ref):
                if getattr(owner, "__dict__", None) is ref and issubclass(type(owner), torch._C._FunctionBase):
                    for k, v in list(ref.items()):
                        if v is comm:
                            ref[k] = None
                            dropped.append(k)
    return dropped


heap = [{"i": i} for i in range(int(1.5e6))]  # young objects, as a run's unfrozen heap
for fn in (old_release, release_from_contexts):
    comms = [Comm() for _ in range(8)]
    te = {f"c{i}": c for i, c in enumerate(comms)}
    x = torch.randn(4, requires_grad=True)
    keep = [F.apply(x, comms[0]) for _ in range(4)] + [F.apply(x, comms[1])]
    sum(k.sum() for k in keep).backward()
    t = time.perf_counter()
    n = len(fn(list(te.values())))
    dt = time.perf_counter() - t
    print(f"{fn.__name__}: {n} references dropped in {dt * 1e3:.0f} ms (heap {len(gc.get_objects())} tracked objects)")
