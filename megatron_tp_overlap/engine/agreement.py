"""How the ranks of a tuning agree on a few numbers, at a cost that grows like log N.

An agreement combines one fixed-size :class:`Message` per rank (the element-wise MAX of some values, and the first
failure: who failed and why) and hands every rank the same result. Two transports:

- :class:`TreeTransport` (default): ranks in blocks of ``local_size`` (one node: ``LOCAL_WORLD_SIZE``), the first rank of
  each block its leader, the leaders in a ``fanout``-ary tree. One gloo group per block and one per internal leader (it
  and its child leaders), each created by its members only: a rank belongs to at most three groups and holds at most
  ``local_size - 1 + 2 * fanout`` connections, whatever N (a world-size gloo group holds N - 1 per rank, its creation
  reads N addresses per rank from the store, and its ring all-reduce takes 2(N - 1) hops). A message goes up each edge
  (combined on the way) and the result down each: 2(N - 1) messages, ``2 * (1 + depth)`` hops with
  ``depth = ceil(log_fanout(N / local_size))``.
- :class:`CollectiveTransport`: one all-reduce (MAX) over a dedicated communicator, for jobs without gloo groups
  (Megatron's ``--disable-gloo-process-groups``): NCCL's own trees carry it. The failure's reason, which a MAX cannot
  combine, is broadcast from the failed rank, only when one failed.

Both carry the failure inside the agreement, so no rank reads the store to learn it.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

CAPACITY = 256  # values per message; more are agreed in several rounds (a trial agrees slots x steps + steps + 3)
TEXT_BYTES = 512  # a failure's reason, cut to this length
FANOUT = 8  # child leaders per leader
NO_FAILURE = math.inf
TIMEOUT = datetime.timedelta(minutes=30)  # torch's default for gloo groups
_RANK_BITS = 24  # a failure's key: its order (the store's counter) above the rank: the smallest key came first
_HEADER = 4  # failure key, failed ranks, values used, hops (the longest chain of messages behind it)


def failure_key(order: int, rank: int) -> float:
    return float(order * 2**_RANK_BITS + rank)  # exact in float64 below 2**53


def key_rank(key: float) -> int:
    return int(key) % 2**_RANK_BITS


def default_local_size() -> int:
    """Ranks per node: torchrun's ``LOCAL_WORLD_SIZE``, else SLURM's tasks per node, else 8 (an HGX node). Only the
    speed depends on it being right: the relay checks hosts (``lockstep``)."""
    for var in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        v = os.environ.get(var, "").split("(")[0]
        if v.isdigit() and int(v) > 0:
            return int(v)
    return 8


@dataclass(frozen=True)
class Place:
    """One rank's place in the agreement tree; indices are positions in the tuning's sorted rank list."""

    block: list[int]  # positions of this rank's block (the leader first)
    children: list[int]  # positions of the child leaders (leaders only)
    parent: int | None  # position of the parent leader (leaders other than the root)
    depth: int  # leader-tree levels above the lowest leader: the agreement takes 2 * (1 + depth) hops

    @property
    def leader(self) -> int:
        return self.block[0]


def place(position: int, n: int, local_size: int, fanout: int = FANOUT) -> Place:
    """Where ``position`` of ``n`` ranks sits: blocks of ``local_size``; leader j's children are leaders
    ``fanout * j + 1 ... fanout * j + fanout`` (a heap), so leader 0 is the root."""
    if not (0 <= position < n) or local_size < 1 or fanout < 1:
        raise ValueError(f"place: position {position} of {n}, local_size {local_size}, fanout {fanout}")
    b = position // local_size
    block = list(range(b * local_size, min(n, (b + 1) * local_size)))
    leaders = math.ceil(n / local_size)
    depth, reach = 0, 1
    while reach < leaders:  # leaders within depth d of the root: 1 + f + ... + f**d
        depth += 1
        reach += fanout**depth
    if position != block[0]:
        return Place(block, [], None, depth)
    kids = [c * local_size for c in range(fanout * b + 1, min(leaders, fanout * b + fanout + 1))]
    return Place(block, kids, None if b == 0 else ((b - 1) // fanout) * local_size, depth)


def groups(n: int, local_size: int, fanout: int = FANOUT) -> list[list[int]]:
    """Every group of the tree (positions), in the one order all ranks create them in (no creation can wait on a
    rank that is creating another): the blocks, then each internal leader with its children. Singletons left out."""
    out = [place(p, n, local_size, fanout).block for p in range(0, n, local_size)]
    out += [[p, *place(p, n, local_size, fanout).children] for p in range(0, n, local_size)]
    return [g for g in out if len(g) > 1]


class Message:
    """What a rank brings to an agreement: values (MAX over ranks; NaN, 'not measured', stays NaN) and a failure.

    One float64 buffer (numpy, for cheap element access) with a torch view of the same memory (``t``, what the
    groups send): header, ``CAPACITY`` values, ``TEXT_BYTES`` of reason."""

    size = _HEADER + CAPACITY + TEXT_BYTES // 8

    def __init__(self, values: Sequence[float] = (), key: float = NO_FAILURE, why: str = "") -> None:
        if len(values) > CAPACITY:
            raise ValueError(f"{len(values)} values in one message (at most {CAPACITY})")
        self.a = np.full(self.size, np.nan)
        self.t = torch.from_numpy(self.a)
        self.a[:_HEADER] = (key, 0.0 if key == NO_FAILURE else 1.0, len(values), 0.0)
        self.a[_HEADER : _HEADER + len(values)] = values
        text = self._text()
        text[:] = 0
        raw = why.encode()[:TEXT_BYTES]
        text[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)

    @classmethod
    def empty(cls) -> Message:
        return cls()

    def _text(self) -> np.ndarray:
        return self.a[_HEADER + CAPACITY :].view(np.uint8)

    @property
    def key(self) -> float:
        return float(self.a[0])

    @property
    def failed_ranks(self) -> int:
        return int(self.a[1])

    @property
    def hops(self) -> int:
        """Messages on the longest path that made this result: the agreement's critical path (tree transport)."""
        return int(self.a[3])

    @property
    def why(self) -> str:
        return self._text().tobytes().rstrip(b"\0").decode(errors="replace")

    def values(self) -> list[float]:
        out = self.a[_HEADER : _HEADER + int(self.a[2])]
        return np.where(np.isinf(out), np.nan, out).tolist()  # inf: not measured (the collective transport's NaN)

    def combine(self, other: Message) -> None:
        """In place: MAX of the values (NaN wins), the failure that came first, failed ranks added."""
        a, b = self.a, other.a
        np.maximum(
            a[_HEADER : _HEADER + CAPACITY], b[_HEADER : _HEADER + CAPACITY], out=a[_HEADER : _HEADER + CAPACITY]
        )
        a[1] += b[1]
        a[2], a[3] = max(a[2], b[2]), max(a[3], b[3])
        if b[0] < a[0]:
            a[0] = b[0]
            a[_HEADER + CAPACITY :] = b[_HEADER + CAPACITY :]


def device_for(backend: str) -> torch.device:
    """Where a group of ``backend`` takes its tensors (NCCL: this rank's GPU)."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _backend(kind: str, store: Any, members: Sequence[int], rank: int, timeout: datetime.timedelta) -> Any:
    """A process group of ``members`` (global ranks) created by them alone, under ``store`` (a prefix of its own):
    ``dist.new_group`` cannot do that for a subset of the ranks (with local synchronization it names a group after
    how many groups the calling process already has, which differs between ranks)."""
    import torch.distributed as dist

    r, n = list(members).index(rank), len(members)
    if kind == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, r, n, opts)
    return dist.ProcessGroupGloo(store, r, n, timeout)


def _release(pg: Any) -> None:
    """Close a group now (its connections, its communicator), not when the interpreter exits."""
    with contextlib.suppress(Exception):
        if hasattr(pg, "shutdown"):
            pg.shutdown()


class TreeTransport:
    """Agreements over a tree of small gloo groups (module docstring); create it on every rank of ``ranks``."""

    name = "gloo tree"

    def __init__(
        self,
        ranks: Sequence[int],
        rank: int,
        store: Any,
        local_size: int,
        fanout: int = FANOUT,
        timeout: datetime.timedelta = TIMEOUT,
    ) -> None:
        import torch.distributed as dist

        self.ranks, self.rank = list(ranks), rank
        n, self.me = len(self.ranks), self.ranks.index(rank)
        self.local_size, self.fanout = local_size, fanout
        self.place = place(self.me, n, local_size, fanout)
        self.groups: dict[tuple[int, ...], Any] = {}  # positions -> the group (its ranks are indices into the tuple)
        for g in groups(n, local_size, fanout):
            if self.me in g:
                name = "_".join(str(self.ranks[q]) for q in g)
                members = [self.ranks[q] for q in g]
                self.groups[tuple(g)] = _backend("gloo", dist.PrefixStore(f"{name}/", store), members, rank, timeout)
        p = self.place
        self.inbox = [(Message(), tuple(p.block), q) for q in p.block[1:]] if self.me == p.leader else []
        self.inbox += [(Message(), (self.me, *p.children), q) for q in p.children]
        self.sent = 0  # messages this rank sent (the harness counts them)

    def describe(self) -> str:
        return f"{self.name} (blocks of {self.local_size}, fan-out {self.fanout}, depth {self.place.depth})"

    def _send(self, msg: Message, g: tuple[int, ...], to: int) -> Any:
        self.sent += 1
        return self.groups[g].send([msg.t], g.index(to), 0)

    def _recv(self, msg: Message, g: tuple[int, ...], frm: int) -> Any:
        return self.groups[g].recv([msg.t], g.index(frm), 0)

    def agree(self, msg: Message) -> Message:
        p, me = self.place, self.me
        block = tuple(p.block)
        if me != p.leader:  # up to the leader, then its answer
            msg.a[3] += 1
            self._send(msg, block, p.leader).wait()
            self._recv(msg, block, p.leader).wait()
            return msg
        own = (me, *p.children)
        works = [self._recv(m, g, q) for m, g, q in self.inbox]
        for w in works:
            w.wait()
        for m, _, _ in self.inbox:
            msg.combine(m)
        if p.parent is not None:  # this leader is a child in its parent's group
            up = next(g for g in self.groups if g[0] == p.parent)
            msg.a[3] += 1
            self._send(msg, up, p.parent).wait()
            self._recv(msg, up, p.parent).wait()
        # down: child leaders first (the longer way), then the block
        msg.a[3] += 1
        works = [self._send(msg, own, q) for q in p.children] + [self._send(msg, block, q) for q in p.block[1:]]
        for w in works:
            w.wait()
        return msg

    def close(self) -> None:
        for pg in self.groups.values():
            _release(pg)
        self.groups = {}


class CollectiveTransport:
    """Agreements as one all-reduce over a dedicated group of ``backend`` (NCCL where gloo groups are off)."""

    def __init__(
        self, ranks: Sequence[int], rank: int, store: Any, backend: str, timeout: datetime.timedelta = TIMEOUT
    ) -> None:
        import torch.distributed as dist

        self.ranks, self.rank, self.backend = list(ranks), rank, backend
        self.device = device_for(backend)
        self.group = _backend(backend, dist.PrefixStore("all/", store), self.ranks, rank, timeout)
        self.name = f"{'NCCL' if backend == 'nccl' else backend} all-reduce"
        self.sent = 0

    def describe(self) -> str:
        return f"{self.name} over a dedicated communicator" + (" (no gloo group)" if self.backend == "nccl" else "")

    def agree(self, msg: Message) -> Message:
        import torch.distributed as dist

        n = int(msg.a[2])
        vals = msg.t[_HEADER : _HEADER + CAPACITY]
        t = torch.cat([-msg.t[:1], msg.t[2:3], torch.where(torch.isnan(vals), math.inf, vals)]).to(
            self.device
        )  # no hops: NCCL's
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self.group.allreduce([t], opts).wait()
        t = t.cpu()  # waits for the device where the group is NCCL's
        self.sent += 1
        key = -float(t[0])
        out = Message()
        out.a[_HEADER : _HEADER + CAPACITY] = t[2:].numpy()  # inf: not measured on some rank (Message.values)
        out.a[2] = max(float(t[1]), n)
        if key != NO_FAILURE:  # the reason, from the rank that failed first
            src = self.ranks.index(key_rank(key))
            mine = torch.from_numpy(msg._text().copy())
            text = (mine if key_rank(key) == self.rank else torch.zeros(TEXT_BYTES, dtype=torch.uint8)).to(self.device)
            b = dist.BroadcastOptions()
            b.rootRank, b.rootTensor = src, 0
            self.group.broadcast([text], b).wait()
            out.a[0], out.a[1] = key, 1.0
            out._text()[:] = text.cpu().numpy()
        return out

    def close(self) -> None:
        _release(self.group)
