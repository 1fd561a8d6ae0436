"""The interpreter's frame stack under a trial's steps.

CPython (3.11 on) keeps its frames in chunks of a per-thread data stack. A call that does not fit the chunk on top
maps a new one, and returning from the first frame in a chunk unmaps it at once. A training step calls the same
functions thousands of times; where its calls cross a chunk's end, every such call maps, faults in and unmaps a
chunk. Where that happens depends on how deep the caller already is, and the search calls its trials from different
depths (a racing round, a look, a bracket, the final decision). On 2 x H200 (real Megatron-LM FP8 steps, one search
per GPU) the search's trials took 94-225 minor faults per step, the same for every trial of a phase and apart
between looks and brackets (108 against 157 per step), and the same trials replayed after the search 8-12; a
look's forwards read 0.2-0.6 ms apart from its brackets' on the host and the GPU, in equal worlds
(benchmarks/results/2026-11-30_h200x2i/).

:func:`fresh_stack` runs a trial in a frame that takes ``RESERVE_KIB`` of stack: it cannot fit the chunk on top, so
it opens a chunk of its own (twice that size) and the trial's frames follow it there, at the same place for every
trial whatever the caller's depth, with room for about a thousand frames of a few hundred bytes each (Python's
default recursion limit is 1000)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

RESERVE_KIB = 256  # the frame's own stack: a chunk of 512 KiB, 256 of them left for the trial's frames
CHUNKED = sys.implementation.name == "cpython" and sys.version_info >= (3, 11)  # frames on a chunked data stack


def fresh_stack(fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)``, its frames at the start of a chunk of the data stack of their own (module docstring)."""
    return fn(*args, **kwargs)


if CHUNKED:  # an unused stack reserve is never touched; before 3.11 each call would allocate it as a frame object
    fresh_stack.__code__ = fresh_stack.__code__.replace(
        co_stacksize=fresh_stack.__code__.co_stacksize + RESERVE_KIB * 1024 // 8
    )
