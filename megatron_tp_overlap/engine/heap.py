"""The Python heap during tuning and the in-run verification: every userbuffers switch collects garbage (an old
autograd graph holding a communicator must die first), and a collection over a whole Megatron-LM process's heap costs
~0.34 s (H200, per switch in real training: benchmarks/results/2026-11-23_h200x1/verify_noise/). The objects that
exist before are frozen out of those collections; none of them can hold a communicator of a config tried after."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def frozen() -> Iterator[None]:
    """Inside the block, collections skip the objects that exist at its start (``gc.freeze``); garbage from before
    goes first. Nothing is done when the heap is frozen already (by the framework, or an enclosing block): its
    ``gc.unfreeze`` is not ours to call."""
    if gc.get_freeze_count():
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
