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
