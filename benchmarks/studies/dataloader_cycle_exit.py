"""How long a multi-process DataLoader iterator takes to shut down when reference counting frees it, and when the
cyclic garbage collector does (it sits in a reference cycle, as it did behind tuning's objects: rank 0 of every tuned
2-GPU Megatron run exited ~10 s after rank 1). CPU only.

    python benchmarks/studies/dataloader_cycle_exit.py [--workers 2]
"""

from __future__ import annotations

import argparse
import gc
import time

import torch


class Numbers(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((4,), float(i))


def shutdown_seconds(workers: int, in_cycle: bool) -> float:
    it = iter(torch.utils.data.DataLoader(Numbers(), num_workers=workers))
    next(it)
    if in_cycle:
        holder: dict = {"it": it}
        holder["me"] = holder
        del holder
    t = time.perf_counter()
    del it  # the last plain reference
    if in_cycle:
        gc.collect()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, default=2)
    a = p.parse_args()
    print(f"| DataLoader iterator ({a.workers} workers) freed by | shutdown s |\n|---|---|")
    for in_cycle in (False, True):
        s = shutdown_seconds(a.workers, in_cycle)
        print(f"| {'the cyclic collector (in a reference cycle)' if in_cycle else 'reference counting'} | {s:.2f} |")


if __name__ == "__main__":
    main()
