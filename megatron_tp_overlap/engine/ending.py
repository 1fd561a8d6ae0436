"""How a tuning that cannot go on ends: one line, the same on every rank, naming who, then exit 70.

The faults that do not raise (a rank killed or its node lost, a rank that hangs outside a step, the c10d store gone)
reach the other ranks as a closed connection, a wait that does not end, or a store that does not answer. A rank that
meets one does not name the peer it lost: that peer may only be the one that noticed first and ended. It asks:

- **census**: the first rank to ask (the store's counter says who) posts a census through the node relays
  (``engine.lockstep``); every live rank's watcher thread answers (one store request) with whether its main thread
  is inside the agreement point the asker waits at. After ``census_s`` (or once every rank answered), ranks that did
  not answer "stopped answering", ranks that answered from elsewhere "did not reach" the point;
- **verdict**: one store key, first writer wins (``compare_set``): the census's line, or the line of a rank ending
  over a failure inside a step. Every rank prints the verdict it reads, so all print the same line;
- **store gone**: a rank that cannot reach the store names the store's host (rank 0 without torchrun's agent, whose
  host was read when the tuning began) or the store's address. The store's host itself waits (at most ``census_s``)
  until every live rank has read the verdict before it exits, so that no rank is left with a store error instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

EXIT_CODE = 70  # os.EX_SOFTWARE: an internal error ended the job
CENSUS_S = 5.0  # how long a census waits for answers (live ranks answer within a poll of their watcher)
ADVICE = "nothing was written (the starting config, YAML, report and cache are as they were)"


def bound_s(trial_timeout_s: float, distributed_timeout_s: float | None) -> float:
    """How long any rank waits at an agreement point: the run's own distributed timeout (Megatron's
    ``--distributed-timeout-minutes``, Bridge's and NeMo's), or a bound from the trial timeout (a peer may be
    finishing a trial, or a switch), whichever is shorter."""
    tuning = 2 * trial_timeout_s + 60.0
    return min(tuning, distributed_timeout_s) if distributed_timeout_s else tuning


def bound_text(bound: float, trial_timeout_s: float | None, distributed_timeout_s: float | None) -> str:
    parts = [f"the run's distributed timeout {distributed_timeout_s:g} s"] if distributed_timeout_s else []
    parts += [f"twice the trial timeout {trial_timeout_s:g} s + 60 s"] if trial_timeout_s else []
    return f"{bound:g} s" + (
        f" ({' or '.join(parts)}, the shorter)" if len(parts) > 1 else f" ({parts[0]})" * bool(parts)
    )


def store_host() -> int | None:
    """The rank whose process hosts the job's c10d store: none under torchrun's agent (it hosts the store), else
    rank 0 (``init_process_group``'s ``env://`` and ``tcp://``)."""
    return None if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true" else 0


def _address(store: Any) -> str:
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    return f" ({host}:{port})" if host else ""


def local_peers(store: Any, prefix: str, members: list[int], host: str) -> dict[int, int]:
    """Process ids of ``members`` on this host that this rank can see (``/proc``): a block leader watches them, so
    that a rank killed (OOM killer, a crash) is found at once, not after the bound. A peer in another pid namespace
    (a container per rank) is left out: its pid here would be another process's."""
    out = {}
    for r in members:
        if store.get(f"{prefix}/host/{r}").decode() == host:
            pid = int(store.get(f"{prefix}/pid/{r}"))
            if _alive(pid) and _started_by(pid, store.get(f"{prefix}/start/{r}").decode()):
                out[r] = pid
    return out


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time() -> str:
    """This process's start (``/proc``): with the pid, names it apart from a later process given the same pid."""
    st = _stat(os.getpid())
    return st[19] if st else ""


def _started_by(pid: int, start: str) -> bool:
    st = _stat(pid)
    return st is not None and st[19] == start


def _alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")  # a zombie is dead: its parent has not reaped it yet


def dead(peers: dict[int, int]) -> list[int]:
    return [r for r, pid in peers.items() if not _alive(pid)]


def who(ranks: list[int], hosts: dict[int, str]) -> str:
    """``rank 6 (host X)``, ``ranks 4, 5 (host X), 9 (host Y)``."""
    by_host: dict[str, list[int]] = {}
    for r in sorted(ranks):
        by_host.setdefault(hosts.get(r, "?"), []).append(r)
    text = ", ".join(f"{', '.join(map(str, rs))} (host {h})" for h, rs in by_host.items())
    return f"rank{'s' * (len(ranks) > 1)} {text}"


@dataclass
class Ending:
    """One tuning's way to end (a :class:`~engine.lockstep.Lockstep` holds one per rank)."""

    store: Any  # the job's store, under the tuning's prefix
    rank: int
    ranks: list[int]
    exit: Callable[[int], Any]
    post: Callable[[dict[str, Any]], Any]  # an alarm every node's relay hears (lockstep.Relay.post_raw)
    bound_text: str = ""
    census_s: float = CENSUS_S
    host: int | None = None  # the rank hosting the store (None: outside the ranks)
    host_name: str = "?"
    address: str = ""
    ended: threading.Event = field(default_factory=threading.Event)
    _once: threading.Lock = field(default_factory=threading.Lock)
    _answered: set[int] = field(default_factory=set)

    @classmethod
    def create(
        cls, store: Any, prefix: str, rank: int, ranks: list[int], host: str, exit: Callable, post: Callable
    ) -> Ending:
        """Under ``prefix`` of the job's ``store``; ``host``: this rank's host name, set at ``prefix/host/<rank>``
        by every rank. The store's host's name is read now: when that rank is gone, so is the store."""
        import torch.distributed as dist

        at = store_host()
        at = at if at in ranks else None
        name = host if at in (None, rank) else store.get(f"{prefix}/host/{at}").decode()
        return cls(
            dist.PrefixStore(prefix, store),  # its keys: prefix + "/" + key
            rank,
            list(ranks),
            exit,
            post,
            host=at,
            host_name=name,
            address=_address(store),
        )

    # --- asking ------------------------------------------------------------------------------------------------

    def lost(self, epoch: int, reason: str, inside: bool = True) -> None:
        """This rank's agreement at ``epoch`` cannot complete (``reason``): find out who, end everywhere.
        ``inside``: called from the main thread, in the agreement (else the watcher answers for this rank)."""
        if not self._once.acquire(blocking=False):  # the other thread of this rank is ending it
            self.ended.wait()
            return
        try:
            if self.store.check(["verdict"]):
                return self._conclude(None)
            if int(self.store.add("census", 1)) != 1:  # another rank asks: wait for its verdict
                deadline = time.monotonic() + 2 * self.census_s + 10
                # polled, not a blocking wait: that would hold the store client the watcher answers through
                while not self.store.check(["verdict"]):
                    if inside and self.store.check(["asked"]):  # in ``epoch``: this rank's answer, if the watcher's
                        self.answer(int(self.store.get("asked")), epoch, inside=True)  # is not given (blocked)
                    if time.monotonic() > deadline:  # no verdict came (the asker ended too): what this rank saw
                        return self._conclude(f"the tuning's agreement failed on rank {self.rank}: {reason}")
                    time.sleep(0.05)
                return self._conclude(None)
            self.store.set("answers", "")
            self.store.set("asked", str(epoch))
            self.post({"census": epoch})
            line, alive = self._count(epoch, reason, inside)
        except Exception:  # noqa: BLE001 - the store is gone
            return self._conclude(None, gone=True)
        self._conclude(line, alive)

    def _count(self, epoch: int, reason: str, inside: bool) -> tuple[str, int]:
        n, deadline = len(self.ranks), time.monotonic() + self.census_s
        if inside:
            self.answer(epoch, epoch, inside=True)
        answers: dict[int, str] = {}  # a: at the point, w: in the trial's work (a step), e: elsewhere
        while len(answers) < n and time.monotonic() < deadline:
            time.sleep(0.05)
            for item in self.store.get("answers").decode().split(";"):
                if item:
                    r, state = item.split(":")
                    answers[int(r)] = state
        silent = [r for r in self.ranks if r not in answers]
        # where a rank was lost, the others' lateness is its consequence; where none, the ones outside the trial's
        # work are the ones its peers wait for (inside a step, in a collective with them)
        late = [r for r, a in answers.items() if a == "e"] or [r for r, a in answers.items() if a == "w"]
        hosts = self._hosts(silent + late)
        if silent:
            line = f"{who(silent, hosts)} stopped answering during tuning"
        elif late:
            timed = "timed out" in reason.lower() or "overdue" in reason
            line = f"{who(late, hosts)} did not reach the tuning's agreement point {epoch}" + (
                f" within {self.bound_text}" if timed else f" ({reason})"
            )
        else:
            line = f"the tuning's agreement failed on rank {self.rank}: {reason}"
        return line, n - len(silent)

    def _hosts(self, ranks: list[int]) -> dict[int, str]:
        if not ranks:
            return {}
        return dict(zip(ranks, (h.decode() for h in self.store.multi_get([f"host/{r}" for r in ranks]))))

    def answer(self, census: int, epoch: int, inside: bool, working: bool = False) -> None:
        """A census's question, answered from this rank's watcher (its main thread may be blocked anywhere)."""
        if census in self._answered:
            return
        self._answered.add(census)
        state = "a" if inside and epoch == census else "w" if working else "e"
        with contextlib.suppress(Exception):
            self.store.append("answers", f"{self.rank}:{state};")

    # --- ending ------------------------------------------------------------------------------------------------

    def end(self, line: str) -> None:
        """End this rank with ``line`` unless another line was agreed first (then that one)."""
        if not self._once.acquire(blocking=False):
            self.ended.wait()
            return
        self._conclude(line)

    def gone(self) -> None:
        """The store stopped answering (its host ended)."""
        if self._once.acquire(blocking=False):
            self._conclude(None, gone=True)

    def _gone_line(self) -> str:
        if self.host is not None:
            return (
                f"rank {self.host} (host {self.host_name}) stopped answering during tuning (it hosted the c10d store)"
            )
        return f"the c10d store{self.address} stopped answering during tuning"

    def _conclude(self, line: str | None, alive: int | None = None, gone: bool = False) -> None:
        final = line or self._gone_line()
        if not gone:
            try:
                if line is None:
                    final = json.loads(self.store.get("verdict"))["line"]
                else:
                    mine = json.dumps({"line": line, "alive": alive or len(self.ranks)})
                    won = self.store.compare_set("verdict", "", mine).decode()
                    final = json.loads(won)["line"]
                    if won == mine:
                        self.post({"verdict": final})
                self.store.add("read", 1)
                if self.rank == self.host:  # the others read the verdict from this process: wait for them
                    expected = json.loads(self.store.get("verdict"))["alive"]
                    deadline = time.monotonic() + self.census_s
                    while int(self.store.add("read", 0)) < expected and time.monotonic() < deadline:
                        time.sleep(0.02)
            except Exception:  # noqa: BLE001 - the store is gone: its host ended
                final = line or self._gone_line()
        print(f"[tp-overlap-autotune] ending the job: {final}; {ADVICE}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        self.ended.set()
        self.exit(EXIT_CODE)
