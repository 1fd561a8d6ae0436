"""Ranks that tune together stay in lockstep, and none is left waiting on a rank that failed.

Every agreement of a tuning (the end of each trial phase and step, each numerics check, each switch's barriers) is
a collective over a host-side gloo group of the tuning's ranks. It never syncs the GPU and never shares a
communicator with the training step, so it cannot be paired with a step's collective by a rank that left the step.

Each agreement point starts with a one-number check (MAX of "I failed"). A rank whose work raises posts why in the
c10d store and goes to exactly one check; its peers meet it at their next agreement point, learn of the failure
there (:class:`PeerFailed`, raised on every rank at the same point) and every rank fails that trial together:
tuning goes on. If a peer cannot reach an agreement point because it is blocked in a collective that the failed
rank will never join (an exception on one rank mid-step, or inside ``initialize_ub``), a watcher thread on each
rank sees the posted failure and

1. runs the current phase's recovery once, if it has one (the switcher aborts its own bootstrap groups, which
   unblocks a rank waiting inside ``initialize_ub``: tuning goes on);
2. otherwise, or if that did not help within ``grace_s``, prints the same line on every rank and ends the process
   with :data:`EXIT_CODE`: the step's collectives cannot complete, and waiting would only hang the job until
   NCCL's timeout. Nothing has been written by then (results are written after tuning).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from megatron_tp_overlap.engine.measure import agree_max

EXIT_CODE = 70  # os.EX_SOFTWARE: an internal error ended the job (a rank failed inside collectives)
# How long a rank that is not blocked may take to reach the next agreement after a peer failed: one step at most.
# Far above any tuned step, far below NCCL's timeout (Megatron: 10 min).
GRACE_S = 60.0
POLL_S = 0.5  # store reads per second per rank while tuning: 2 (a 1000-rank job: 2000/s on rank 0's store)

_instances = itertools.count()  # every rank creates its Lockstep objects in the same order: same key prefix


class PeerFailed(RuntimeError):
    """A rank's work failed; raised on every rank of the tuning at the same agreement point."""


class Lockstep:
    """The agreements of one tuning over ``group`` (default: world). A no-op outside ``torch.distributed``."""

    def __init__(
        self,
        group: Any = None,
        grace_s: float = GRACE_S,
        exit: Callable[[int], Any] = os._exit,
        poll_s: float = POLL_S,
        enabled: bool = True,
    ) -> None:
        import torch.distributed as dist

        self.grace_s, self.poll_s, self._exit = grace_s, poll_s, exit
        self.epoch = 0  # agreement points passed; the same count on every rank
        self.failure = ""  # the last agreed failure: "rank R: Error: message; ..."
        self.enabled = enabled and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
        self._recover: tuple[int, Callable[[], Any]] | None = None  # (epoch, recovery) inside ``recoverable``
        self._stop = threading.Event()
        if not self.enabled:
            return
        self.rank = dist.get_rank()
        self.ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        # only the members create it (a TP group's tuning must not wait for the other TP groups)
        self.ctl = dist.new_group(self.ranks, backend="gloo", use_local_synchronization=True)
        self.store = dist.distributed_c10d._get_default_store()
        self.prefix = f"tp-overlap-autotune/lockstep{next(_instances)}/{self.ranks[0]}"
        self._thread = threading.Thread(target=self._watch, name="tp-overlap-lockstep", daemon=True)
        self._thread.start()

    # --- agreement points -----------------------------------------------------------------------------------

    def check(self, failed: bool = False, why: str = "") -> None:
        """An agreement point: raises :class:`PeerFailed` on every rank when any rank arrived ``failed``."""
        if not self.enabled:
            if failed:
                raise PeerFailed(f"rank 0: {why}")
            return
        import torch.distributed as dist

        if failed:  # numbered in the order the ranks failed: the first is the cause, later ones its echoes
            n = self.store.add(f"{self.prefix}/{self.epoch}/failed", 1)
            self.store.set(f"{self.prefix}/{self.epoch}/{n}", f"rank {self.rank}: {why}")
        flag = torch.tensor([1.0 if failed else 0.0], dtype=torch.float64)
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.ctl)
        except Exception:
            if failed or self._posted(self.epoch):  # a peer ended the job over this failure first
                self._end(self.epoch)
            raise
        epoch, self.epoch = self.epoch, self.epoch + 1
        if flag.item() > 0:
            raise PeerFailed(self._why(epoch))

    def agree_max(self, values: Sequence[float]) -> list[float]:
        """A checked agreement point, then the element-wise MAX of ``values`` over the ranks (NaN stays NaN)."""
        self.check()
        return agree_max(values, self.ctl, "cpu") if self.enabled else [float(v) for v in values]

    def attempt(self, fn: Callable[[], Any], log: Callable[[str], Any] = lambda s: None) -> bool:
        """Run ``fn``, then an agreement point. True while every rank is fine; False on every rank when any failed."""
        try:
            fn()
            self.check()
            return True
        except PeerFailed as e:  # agreed inside fn or just now: the same on every rank
            self.failure = str(e)
        except Exception as e:  # noqa: BLE001 - the other ranks must hear about it
            why = f"{type(e).__name__}: {e}"
            log(f"[tp-overlap-autotune] trial failed on this rank: {why}")
            try:
                self.check(True, why)
            except PeerFailed as agreed:
                self.failure = str(agreed)
        return False

    @contextlib.contextmanager
    def recoverable(self, recover: Callable[[], Any]) -> Iterator[None]:
        """Inside the block, a peer's failure first runs ``recover`` (from the watcher thread)."""
        self._recover = (self.epoch, recover)
        try:
            yield
        finally:
            self._recover = None

    def close(self) -> None:
        if not self.enabled or self._stop.is_set():
            return
        import torch.distributed as dist

        self._stop.set()
        self._thread.join()
        dist.destroy_process_group(self.ctl)

    # --- the watcher ------------------------------------------------------------------------------------------

    def _posted(self, epoch: int) -> int:
        """How many ranks posted a failure in ``epoch`` (one store read)."""
        return int(self.store.add(f"{self.prefix}/{epoch}/failed", 0))

    def _why(self, epoch: int) -> str:
        parts = []
        try:
            for n in range(1, self._posted(epoch) + 1):
                key = f"{self.prefix}/{epoch}/{n}"
                if self.store.check([key]):  # set right after its number was taken
                    parts.append(self.store.get(key).decode(errors="replace"))
        except Exception:  # noqa: BLE001 - the store's host ended first
            parts.append("(the store is gone: its rank has ended)")
        return "; ".join(parts) or "a rank failed"

    def _end(self, epoch: int) -> None:
        """The same line on every rank, then the end of this process (see the module docstring)."""
        print(
            f"[tp-overlap-autotune] rank {self.rank}: ending the job: tuning failed on {self._why(epoch)}, and "
            "this rank cannot go on: a rank is blocked in a collective the failed rank will not join (inside the "
            "step), which cannot complete. Nothing was written; rerun without autotuning, or report this with the "
            "log.",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        self._exit(EXIT_CODE)

    def _watch(self) -> None:
        seen: tuple[int, float] | None = None  # (epoch, when this rank first saw a failure posted in it)
        recovered = False
        while not self._stop.wait(self.poll_s):
            epoch = self.epoch
            try:
                posted = self._posted(epoch)
            except Exception:  # noqa: BLE001 - the store's host (rank 0) has ended: the job is over
                if not self._stop.is_set():
                    self._end(epoch)
                return
            if not posted:
                seen = None
                continue
            now = time.monotonic()
            if seen is None or seen[0] != epoch:
                seen, recovered = (epoch, now), False
            recover = self._recover
            if recover is not None and recover[0] == epoch and not recovered:
                recovered = True
                with contextlib.suppress(Exception):
                    recover[1]()
                seen = (epoch, now)
                continue
            if now - seen[1] >= self.grace_s and self.epoch == epoch and not self._stop.is_set():
                self._end(epoch)
                return
