"""Ranks that tune together stay in lockstep, and none is left waiting on a rank that failed; at 16,000 ranks too.

Who: the tuning's ranks. In Megatron that is every rank: a trial step couples them all (TP collectives, pipeline
send/receive, the data-parallel gradient reduction of ``finalize_model_grads``), TE's ``initialize_ub`` bootstraps over
the world at every switch, and the run needs one config. So every agreement point spans the job.

How they agree (``engine.agreement``): the tuning's agreement points (the end of each trial phase and step, each
numerics check, each switch's barriers) are agreements over a tree of small gloo groups: blocks of one node's ranks,
their leaders in a tree of fan-out 8. A rank holds at most ``local_size - 1 + 2 * fanout`` connections, an agreement
takes ``2 * (1 + depth)`` hops (depth 4 at 16,000 ranks on 8-GPU nodes), and each point is one agreement: the
failure flag, the values and the failure's reason travel together. Where gloo groups are disabled (Megatron's
``--disable-gloo-process-groups``) one all-reduce over a dedicated NCCL communicator does it. Neither shares a
communicator with the training step, so a rank that left a step cannot pair an agreement with a peer's step
collective, and the tree never syncs the GPU.

A rank whose work raises posts why in the c10d store (two requests) and goes to exactly one agreement point; its
peers meet it at their next one, where the agreement tells every rank who failed and why (:class:`PeerFailed`,
raised everywhere at the same point) and every rank fails that trial together: tuning goes on. A peer that cannot
reach an agreement point because it is blocked in a collective the failed rank will never join (an exception on one
rank mid-step, or inside ``initialize_ub``) learns of the failure from its node: one rank per node (the relay) holds
one blocking store wait (no polling: the store answers when a failure is posted) and writes it to a node-local file
that the node's ranks read (:data:`POLL_S`, no network). Then the watcher thread on each rank

1. runs the current phase's recovery once, if it has one (the switcher aborts its own bootstrap groups, which
   unblocks a rank waiting inside ``initialize_ub``: tuning goes on);
2. otherwise, or if that did not help within ``grace_s``, prints the same line on every rank and ends the process
   with :data:`EXIT_CODE`: the step's collectives cannot complete, and waiting would only hang the job until
   NCCL's timeout. Nothing has been written by then (results are written after tuning).

Store traffic: a few requests per rank when a tuning starts (the groups' rendezvous, one host check), then none per
rank: per failure two from the failed rank and two per node, and one wait per node in flight.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import json
import os
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from megatron_tp_overlap.engine.agreement import (
    CAPACITY,
    FANOUT,
    NO_FAILURE,
    CollectiveTransport,
    Message,
    TreeTransport,
    default_local_size,
    failure_key,
)

EXIT_CODE = 70  # os.EX_SOFTWARE: an internal error ended the job (a rank failed inside collectives)
# How long a rank that is not blocked may take to reach the next agreement after a peer failed: one step at most.
# Far above any tuned step, far below NCCL's timeout (Megatron: 10 min).
GRACE_S = 60.0
POLL_S = 0.1  # the watcher reads its node's failure file this often (a local stat: no network, no store)
WAIT_S = 3600.0  # the relay's store wait is posted again after this (a timeout logs a c10d warning: keep it rare)
CLOSED = "closed"  # the relay's last message: the tuning is over
# Beyond this many ranks a trial agrees after its switch and at its end only, not between its steps: at 16,000 ranks
# the checks between steps would be ~45% of the agreements (the heaviest recorded tuning: 308 steps in 118 trials),
# and a rank failing between two steps (rare: failures happen inside steps) ends the job as one failing inside a step
# does, with one line on every rank (benchmarks/results/2026-11-24_cpu/agreement_scale/).
STEP_CHECKS_UP_TO = 1024

_instances = itertools.count()


class PeerFailed(RuntimeError):
    """A rank's work failed; raised on every rank of the tuning at the same agreement point. ``values``: what that
    agreement agreed on all the same (NaN where a rank brought nothing)."""

    values: list[float] = []


def _marker_dir() -> Path:
    shm = Path("/dev/shm")  # node-local memory: the ranks of one node see it, nothing else does
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class Relay:
    """A failure posted in the store reaches every rank of a node through one waiter per node and a local file.

    The file holds the first failure of the latest epoch that had one (``{"epoch", "why"}``) and ``"gone": true``
    once the store's host (rank 0) has ended."""

    def __init__(self, store: Any, prefix: str, path: Path, waiter: bool, closer: bool) -> None:
        self.store, self.prefix, self.path, self.waiter, self.closer = store, prefix, path, waiter, closer
        self.requests = 0  # store requests this rank made (the harness counts them)
        self._stop = threading.Event()
        self._seen: tuple[int, int] | None = None
        self._cached: dict[str, Any] | None = None
        self._thread: threading.Thread | None = None
        if waiter:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            self._thread = threading.Thread(target=self._wait, name="tp-overlap-relay", daemon=True)
            self._thread.start()

    def post(self, epoch: int, why: str) -> int:
        """Announce a failure in ``epoch``; returns its order (1 = the first of this tuning)."""
        n = int(self.store.add(f"{self.prefix}/alarms", 1))
        self.store.set(f"{self.prefix}/alarm/{n}", json.dumps({"epoch": epoch, "why": why}))
        self.requests += 2
        return n

    def read(self) -> dict[str, Any] | None:
        """What the node's file says (cached until the file changes)."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        if self._seen != (st.st_mtime_ns, st.st_size):
            try:
                self._cached = json.loads(self.path.read_text())
                self._seen = (st.st_mtime_ns, st.st_size)
            except (OSError, ValueError):  # replaced while reading: read it next time
                return self._cached
        return self._cached

    def _write(self, state: dict[str, Any]) -> None:
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.path)  # readers see the old file or the new one, never half of one

    def _wait(self) -> None:
        try:
            store = self.store.clone()  # its own connection: a wait must not hold the training's store client
        except Exception:  # noqa: BLE001 - a store without clone(): wait on the shared one
            store = self.store
        state: dict[str, Any] = {}
        k = 1
        while not self._stop.is_set():
            key = f"{self.prefix}/alarm/{k}"
            try:
                store.wait([key], datetime.timedelta(seconds=WAIT_S))
                msg = store.get(key).decode()
                self.requests += 2
            except Exception as e:  # noqa: BLE001 - a timeout (wait again), or the store's host has ended
                if "timeout" in str(e).lower() or "timed out" in str(e).lower():
                    continue
                if not self._stop.is_set():
                    self._write({**state, "gone": True})
                return
            if msg == CLOSED:
                return
            alarm = json.loads(msg)
            if state.get("epoch") != alarm["epoch"]:  # the first failure of an epoch is its cause
                state = {"epoch": alarm["epoch"], "why": alarm["why"]}
                self._write(state)
            k += 1

    def close(self) -> None:
        self._stop.set()
        if self.closer:  # wakes every node's waiter (they would otherwise wait out WAIT_S)
            with contextlib.suppress(Exception):
                n = int(self.store.add(f"{self.prefix}/alarms", 1))
                self.store.set(f"{self.prefix}/alarm/{n}", CLOSED)
                self.requests += 2
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


class Lockstep:
    """The agreements of one tuning over ``group`` (default: world). A no-op outside ``torch.distributed``.

    ``gloo=False``: no gloo group (one NCCL all-reduce per agreement); ``transport="collective"`` forces that design
    over gloo (tests). ``local_size`` / ``fanout``: the tree's blocks and branching (module docstring)."""

    def __init__(
        self,
        group: Any = None,
        grace_s: float = GRACE_S,
        exit: Callable[[int], Any] = os._exit,
        poll_s: float = POLL_S,
        enabled: bool = True,
        gloo: bool = True,
        transport: str = "tree",
        local_size: int | None = None,
        fanout: int = FANOUT,
    ) -> None:
        import torch.distributed as dist

        self.grace_s, self.poll_s, self._exit = grace_s, poll_s, exit
        self.epoch = 0  # agreement points passed; the same count on every rank
        self.failure = ""  # the last agreed failure: "rank R: Error: message"
        self.seconds = 0.0  # spent in agreements on this rank
        self.hops = 0  # messages on the last agreement's critical path (the tree's: 2 (1 + depth))
        self.enabled = enabled and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
        self._recover: tuple[int, Callable[[], Any]] | None = None  # (epoch, recovery) inside ``recoverable``
        self._stop = threading.Event()
        if not self.enabled:
            return
        self.rank = dist.get_rank()
        self.ranks = sorted(dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size()))
        local = local_size or default_local_size()
        self.store = dist.distributed_c10d._get_default_store()
        # only the members create it (a TP group's tuning must not wait for the other TP groups); every rank creates
        # its Lockstep objects in the same order, so the same name
        groups = dist.PrefixStore(f"tp-overlap-autotune/agree{next(_instances)}/{self.ranks[0]}/", self.store)
        if gloo and transport == "tree":
            self.transport: Any = TreeTransport(self.ranks, self.rank, groups, local, fanout)
        else:
            self.transport = CollectiveTransport(self.ranks, self.rank, groups, "gloo" if gloo else "nccl")
        # one random number agreed: names this tuning's keys and node files apart from any other job's or tuning's
        # (os.urandom: Python's global RNG is the run's, and tuning leaves the run's RNG states as they were)
        tag = int(self.transport.agree(Message([int.from_bytes(os.urandom(6), "big")])).values()[0])
        self.prefix = f"tp-overlap-autotune/lockstep/{tag:x}"
        me = self.ranks.index(self.rank)
        leader, host = self.ranks[me - me % local], socket.gethostname()
        self.store.set(f"{self.prefix}/host/{self.rank}", host)
        # a rank not on its block leader's host relays for itself (a layout that does not put blocks on nodes)
        same = leader == self.rank or self.store.get(f"{self.prefix}/host/{leader}").decode() == host
        relay = leader if same else self.rank
        path = _marker_dir() / f"tp-overlap-{tag:x}-{relay}"
        self.relay = Relay(self.store, self.prefix, path, waiter=relay == self.rank, closer=me == 0)
        self.relay.requests += 1 if leader == self.rank else 2
        self._thread = threading.Thread(target=self._watch, name="tp-overlap-lockstep", daemon=True)
        self._thread.start()

    @property
    def step_checks(self) -> bool:
        """Whether a trial agrees between its steps (:data:`STEP_CHECKS_UP_TO`)."""
        return not self.enabled or len(self.ranks) <= STEP_CHECKS_UP_TO

    def describe(self) -> str:
        return f"{self.transport.describe()} over {len(self.ranks)} ranks" if self.enabled else "none (one rank)"

    # --- agreement points -----------------------------------------------------------------------------------

    def check(self, failed: bool = False, why: str = "") -> None:
        """An agreement point: raises :class:`PeerFailed` on every rank when any rank arrived ``failed``."""
        self._agree((), failed, why)

    def agree_max(self, values: Sequence[float], failed: bool = False, why: str = "") -> list[float]:
        """An agreement point and the element-wise MAX of ``values`` over the ranks (NaN stays NaN), in one;
        ``failed``: this rank's work since the last point failed (as :meth:`check`)."""
        return self._agree(values, failed, why)

    def _agree(self, values: Sequence[float], failed: bool = False, why: str = "") -> list[float]:
        if not self.enabled:
            self.epoch += 1  # counted all the same: a tuning's agreement points are the same on one rank
            if failed:
                e = PeerFailed(f"rank 0: {why}")
                e.values = [float(v) for v in values]
                raise e
            return [float(v) for v in values]
        key = failure_key(self.relay.post(self.epoch, f"rank {self.rank}: {why}"), self.rank) if failed else NO_FAILURE
        out: list[float] = []
        for i in range(0, max(1, len(values)), CAPACITY):  # a failed rank brings one message: the others raise at it
            msg = Message(values[i : i + CAPACITY], key, f"rank {self.rank}: {why}" if failed else "")
            t0 = time.perf_counter()
            try:
                res = self.transport.agree(msg)
            except Exception:
                if failed or self._posted(self.epoch):  # a peer ended the job over this failure first
                    self._end(self.epoch)
                raise
            finally:
                self.seconds += time.perf_counter() - t0
            self.epoch += 1
            self.hops = res.hops
            out += res.values()
            if res.key != NO_FAILURE:
                more = res.failed_ranks - 1
                e = PeerFailed(res.why + (f" (then {more} more rank{'s' * (more > 1)} failed)" if more > 0 else ""))
                e.values = out
                raise e
        return out

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
        self._stop.set()
        self._thread.join()
        self.relay.close()
        self.transport.close()

    # --- the watcher ------------------------------------------------------------------------------------------

    def _posted(self, epoch: int) -> str | None:
        """The first failure posted in ``epoch``, as this node's relay saw it (None: none)."""
        state = self.relay.read()
        return state["why"] if state and state.get("epoch") == epoch else None

    def _end(self, epoch: int) -> None:
        """The same line on every rank, then the end of this process (see the module docstring)."""
        print(
            f"[tp-overlap-autotune] rank {self.rank}: ending the job: tuning failed on {self._posted(epoch) or 'a rank'}"
            ", and this rank cannot go on: a rank is blocked in a collective the failed rank will not join (inside "
            "the step), which cannot complete. Nothing was written; rerun without autotuning, or report this with "
            "the log.",
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
            state = self.relay.read() or {}
            if state.get("gone"):  # the store's host (rank 0) has ended: the job is over
                if not self._stop.is_set():
                    self._end(epoch)
                return
            if state.get("epoch") != epoch:
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
