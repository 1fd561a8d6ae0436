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

Faults that do not raise (a rank killed or hanging, the store gone) end the job so too, naming who (``engine.ending``).

Store traffic: a few requests per rank when a tuning starts (the groups' rendezvous, one host check, its pid; a
block leader reads its peers'), one when it ends, none per rank between: per failure two from the failed rank and two
per node, one wait per node in flight; a census (``engine.ending``) one per rank.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from megatron_tp_overlap.engine.agreement import (
    CAPACITY,
    FANOUT,
    NO_FAILURE,
    TIMEOUT,
    CollectiveTransport,
    Message,
    TreeTransport,
    default_local_size,
    failure_key,
)
from megatron_tp_overlap.engine.ending import CENSUS_S, Ending, dead, local_peers, start_time
from megatron_tp_overlap.engine.ending import EXIT_CODE as EXIT_CODE  # noqa: F401 - where callers look
from megatron_tp_overlap.engine.relay import Relay, _marker_dir

# How long a rank that is not blocked may take to reach the next agreement after a peer failed: one step at most.
# Far above any tuned step, far below NCCL's timeout (Megatron: 10 min).
GRACE_S = 60.0
POLL_S = 0.1  # the watcher reads its node's failure file this often (a local stat: no network, no store)
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


class Lockstep:
    """The agreements of one tuning over ``group`` (default: world). A no-op outside ``torch.distributed``.

    ``gloo=False``: no gloo group (one NCCL all-reduce per agreement); ``transport="collective"`` forces that design
    over gloo (tests). ``local_size`` / ``fanout``: the tree's blocks and branching (module docstring). ``bound_s``:
    the longest wait at an agreement point (``engine.ending.bound_s``; None: gloo's 30 minutes), described by
    ``bound_text``; ``census_s``: how long a census waits for answers (``engine.ending``)."""

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
        bound_s: float | None = None,
        bound_text: str = "",
        census_s: float = CENSUS_S,
    ) -> None:
        import torch.distributed as dist

        self.grace_s, self.poll_s, self._exit = grace_s, poll_s, exit
        self.bound_s = bound_s
        self._inside: tuple[int, float] | None = None  # (epoch, since) while the main thread is in an agreement
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
        # the watcher holds agreements to ``bound_s``; the groups' own timeout also bounds their creation, which a
        # loaded host may take seconds over
        timeout = datetime.timedelta(seconds=max(bound_s, 60.0)) if bound_s else TIMEOUT
        if gloo and transport == "tree":
            self.transport: Any = TreeTransport(self.ranks, self.rank, groups, local, fanout, timeout)
        else:
            self.transport = CollectiveTransport(self.ranks, self.rank, groups, "gloo" if gloo else "nccl", timeout)
        # one random number agreed: names this tuning's keys and node files apart from any other job's or tuning's
        # (os.urandom: Python's global RNG is the run's, and tuning leaves the run's RNG states as they were)
        tag = int(self.transport.agree(Message([int.from_bytes(os.urandom(6), "big")])).values()[0])
        self.prefix = f"tp-overlap-autotune/lockstep/{tag:x}"
        me = self.ranks.index(self.rank)
        leader, host = self.ranks[me - me % local], socket.gethostname()
        self.store.set(f"{self.prefix}/host/{self.rank}", host)
        self.store.multi_set(
            [f"{self.prefix}/{k}/{self.rank}" for k in ("pid", "start")], [str(os.getpid()), start_time()]
        )
        # a rank not on its block leader's host relays for itself (a layout that does not put blocks on nodes)
        same = leader == self.rank or self.store.get(f"{self.prefix}/host/{leader}").decode() == host
        relay = leader if same else self.rank
        path = _marker_dir() / f"tp-overlap-{tag:x}-{relay}"
        self.relay = Relay(self.store, self.prefix, path, waiter=relay == self.rank, closer=me == 0)
        self.relay.requests += 1 if leader == self.rank else 2
        text = bound_text or f"{bound_s or TIMEOUT.total_seconds():g} s"
        self.ending = Ending.create(self.store, self.prefix, self.rank, self.ranks, host, exit, self.relay.post_raw)
        self.ending.bound_text, self.ending.census_s = text, max(census_s, len(self.ranks) / 2000)
        block = [self.ranks[q] for q in self.transport.place.block] if hasattr(self.transport, "place") else []
        self._peers = local_peers(self.store, self.prefix, block[1:], host) if leader == self.rank else {}
        self._working = False  # inside attempt's work (a switch, a step): for a census's answer
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
        try:  # the store gone (its host ended) ends this rank here
            key = (
                failure_key(self.relay.post(self.epoch, f"rank {self.rank}: {why}"), self.rank)
                if failed
                else NO_FAILURE
            )
        except Exception:
            self.ending.gone()
            raise
        out: list[float] = []
        for i in range(0, max(1, len(values)), CAPACITY):  # a failed rank brings one message: the others raise at it
            msg = Message(values[i : i + CAPACITY], key, f"rank {self.rank}: {why}" if failed else "")
            t0 = time.perf_counter()
            self._inside = (self.epoch, time.monotonic())
            try:
                res = self.transport.agree(msg)
            except Exception as e:  # a peer ended the job (its line stands), closed its connection or did not come
                self.ending.lost(self.epoch, f"{type(e).__name__}: {e}")  # (the census names who)
                raise
            finally:
                self._inside = None
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
            self._working = True
            try:
                fn()
            finally:
                self._working = False
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
        with contextlib.suppress(Exception):  # its leader must not take its exit for a kill (a request per rank)
            self.store.set(f"{self.prefix}/closed/{self.rank}", "")
        self.relay.close()
        self.transport.close()

    # --- the watcher ------------------------------------------------------------------------------------------

    def _closed(self, rank: int) -> bool:
        try:
            return bool(self.store.check([f"{self.prefix}/closed/{rank}"]))
        except Exception:  # noqa: BLE001 - the store is gone: the watcher ends this rank over that
            return True

    def _posted(self, epoch: int) -> str | None:
        """The first failure posted in ``epoch``, as this node's relay saw it (None: none)."""
        state = self.relay.read()
        return state["why"] if state and state.get("epoch") == epoch else None

    def _end(self, epoch: int) -> None:
        """The same line on every rank, then the end of this process (see the module docstring)."""
        self.ending.end(
            f"tuning failed on {self._posted(epoch) or 'a rank'}, and the ranks cannot go on: a rank is blocked in a "
            "collective the failed rank will not join (inside the step), which cannot complete"
        )

    def _watch(self) -> None:
        seen: tuple[int, float] | None = None  # (epoch, when this rank first saw a failure posted in it)
        recovered = asked = False
        while not self._stop.wait(self.poll_s):
            epoch = self.epoch
            state = self.relay.read() or {}
            if state.get("verdict") and not self._stop.is_set():  # a line agreed (engine.ending): end with it
                self.ending.end(state["verdict"])
                return
            if "census" in state:  # answered once per census, from here: the main thread may be blocked
                at = self._inside is not None and self._inside[0] == epoch
                self.ending.answer(state["census"], epoch, at, self._working)
            inside = self._inside
            late = inside is not None and self.bound_s and time.monotonic() - inside[1] > self.bound_s + self.poll_s
            # a peer on this node killed: found now, not at the bound (one that ended its tuning has left a mark)
            gone = [r for r in dead(self._peers) if not self._closed(r)]
            if (late or gone) and not asked and not self.ending._once.locked():
                asked = True
                # a transport that does not raise at its timeout (NCCL's watchdog ends the process instead), a peer
                # killed inside a step: the census runs beside this thread, which goes on answering
                why = f"overdue: waited {self.bound_s:g} s" if late else f"rank {gone[0]}'s process ended"
                threading.Thread(target=self.ending.lost, args=(epoch, why, False), daemon=True).start()
            if state.get("gone"):  # the store's host has ended: the job is over
                if not self._stop.is_set():
                    self.ending.gone()
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
