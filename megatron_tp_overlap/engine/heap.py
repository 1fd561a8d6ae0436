"""The Python heap during tuning and the in-run verification: every userbuffers switch collects garbage (an old
autograd graph holding a communicator must die first), and a collection over a whole Megatron-LM process's heap costs
~0.34 s (H200, per switch in real training: benchmarks/results/2026-11-23_h200x1/verify_noise/) and 0.47 s (H100,
725,703 tracked objects: benchmarks/results/2026-11-24_h100x1/switch_cost/). The objects that exist before are frozen
out of those collections; none of them can hold a communicator of a config tried after. One may hold the live
config's (an autograd context of a graph that the model keeps, Megatron-LM MoE at TP=2): the switch looks for it
among the frozen objects too (engine/held_graphs.release_from_contexts)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


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
