"""The Python heap during tuning and the in-run verification: every userbuffers switch collects garbage (an old
autograd graph holding a communicator must die first), and a collection over a whole Megatron-LM process's heap costs
~0.34 s (H200, per switch in real training: benchmarks/results/2026-11-23_h200x1/verify_noise/) and 0.47 s (H100,
725,703 tracked objects: benchmarks/results/2026-11-24_h100x1/switch_cost/). The objects that exist before are frozen
out of those collections; none of them can hold a communicator of a config tried after. One may hold the live
config's (an autograd context of a graph that the model keeps, Megatron-LM MoE at TP=2): the switch looks for it
among the frozen objects too (engine/held_graphs.release_from_contexts). The steps in between are also kept from
mapping fresh memory (:func:`reserved`)."""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Iterator

# Kept from the small-object allocator's arenas while tuning: their free pools are the room a step's short-lived
# objects take instead of a fresh arena (reserved()). Resident memory, given back at the end.
RESERVE_MIB = 64
PIN_EVERY_KIB = 64  # one object kept per this much of the reserve: every arena (256 KiB, 1 MiB) keeps some


@contextlib.contextmanager
def frozen() -> Iterator[None]:
    """Inside the block, collections skip the objects that exist at its start (``gc.freeze``); garbage from before
    goes first. When objects were frozen before (by the framework, an import, or an enclosing block) the heap is
    frozen all the same: in Megatron-LM's process on an H100, 375 objects frozen before tuning had left 725,703 tracked
    and every switch's collection took 0.47 s. Only a freeze of ours alone is undone at the end (``gc.unfreeze``
    thaws every frozen object, theirs too); otherwise what was alive at the start stays frozen, as the framework's own
    objects were: the run's long-lived objects, which collections then skip."""
    ours_alone = not gc.get_freeze_count()
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        if ours_alone:
            gc.unfreeze()


@contextlib.contextmanager
def thawed() -> Iterator[None]:
    """Inside the block the referrer walks see the objects that ``gc.freeze`` set aside too; they are frozen again
    afterwards, with the objects made since (garbage among them waits for the next unfreeze)."""
    if not gc.get_freeze_count():
        yield
        return
    gc.unfreeze()
    try:
        yield
    finally:
        gc.freeze()


@contextlib.contextmanager
def reserved(mib: int | None = None) -> Iterator[None]:
    """Inside the block, a step's short-lived Python objects find free pools in arenas that stay mapped.

    CPython's small-object allocator maps a fresh arena (1 MiB, 256 KiB before 3.10) when no arena has a free pool
    and unmaps an arena once it is empty, keeping one. A search's own objects fill the arenas, so each training step
    mapped arenas for its temporaries and unmapped them at its end, page-faulting them in again the next step: on
    2 x H200 (real Megatron-LM FP8 steps) the search's trials took 94-220 minor faults per step and 0.8-1.4 ms of
    system time, the same trials replayed once the search had let go of its objects 8 and 0.1-0.6 ms, with glibc's
    trimming off or on (results/2026-11-30_h200x2i/). Where in a step those faults land moves with what the
    search allocated before the trial, and a look read its forwards 0.2-0.3 ms apart from its brackets on the host.
    Here ``mib`` MiB (None: ``RESERVE_MIB``) of 16-byte objects are made and one per ``PIN_EVERY_KIB`` KiB kept, so
    the arenas they filled stay mapped with most of their pools free. Without pymalloc (``PYTHONMALLOC=malloc``) it
    holds a few bytes."""
    size = sys.getsizeof(object())
    made = [object() for _ in range((RESERVE_MIB if mib is None else mib) * 2**20 // size)]
    pins = made[:: PIN_EVERY_KIB * 1024 // size]
    del made
    try:
        yield
    finally:
        del pins


@contextlib.contextmanager
def held(reserve_mib: int | None = None) -> Iterator[None]:
    """The heap as tuning and the in-run verification hold it: :func:`frozen` and :func:`reserved`."""
    with frozen(), reserved(reserve_mib):
        yield
