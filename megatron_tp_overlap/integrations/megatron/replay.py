"""Data replay for trial steps: micro-batches read ahead from the real training iterator, handed to the main
loop afterwards (it sees the same batches in the same order)."""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Iterator
from typing import Any


class ReplayIterator:
    """Wraps an iterator; :meth:`read_ahead` buffers items that ``next()`` later returns first."""

    def __init__(self, it: Iterator[Any]):
        self._it, self._buf = it, deque()

    def read_ahead(self, n: int) -> list[Any]:
        while len(self._buf) < n:
            self._buf.append(next(self._it))
        # Shallow copies: Megatron's get_batch replaces dict entries (tensor.cuda()) in place.
        return [copy.copy(b) for b in list(self._buf)[:n]]

    def __iter__(self) -> ReplayIterator:
        return self

    def __next__(self) -> Any:
        return self._buf.popleft() if self._buf else next(self._it)

    def __getattr__(self, name: str) -> Any:  # e.g. state_dict of the wrapped iterator
        return getattr(self._it, name)


def attach_replay(it: Any) -> tuple[Any, ReplayIterator | None]:
    """(iterator for the main loop, replay handle). Keeps Megatron's RerunDataIterator object in place
    (the rerun state machine checks its type) by wrapping its inner iterable instead."""
    if it is None:
        return None, None
    if type(it).__name__ == "RerunDataIterator" and hasattr(it, "iterable"):
        it.iterable = ReplayIterator(it.iterable)
        return it, it.iterable
    r = ReplayIterator(it)
    return r, r


class ReadAhead:
    """The run's data iterator (or Megatron's list of them, one per model chunk) with the first ``n`` micro-batches
    of each read ahead for trial steps; the main loop gets them first, in order (:attr:`data_iterator`).

    :meth:`release` hands the iterators over and forgets them. Tuning's objects live on in reference cycles after
    it (closures, the in-run verification), and an iterator reachable from one is freed by the cyclic garbage
    collector instead of when the main loop drops it: a multi-process DataLoader iterator shut down that way waits
    for each worker's status-check timeout (2 H200s: rank 0, the one that reads data, exited 10 s after rank 1 in
    every tuned Megatron run)."""

    def __init__(self, data_iterator: Any, n: int):
        self.is_list = isinstance(data_iterator, list)
        pairs = [attach_replay(it) for it in (data_iterator if self.is_list else [data_iterator])]
        self.main_iters = [p[0] for p in pairs]
        self.replays = [r for _, r in pairs]
        self.batches = [r.read_ahead(n) if r is not None else None for r in self.replays]  # shallow copies

    @property
    def data_iterator(self) -> Any:
        """The iterator(s) the main loop must use: the read-ahead batches come first."""
        return self.main_iters if self.is_list else self.main_iters[0]

    def release(self) -> Any:
        """:attr:`data_iterator`, after which this object holds no iterator (nor batch) of the run."""
        it = self.data_iterator
        self.main_iters, self.replays, self.batches = [None], [], []
        self.is_list = False
        return it
