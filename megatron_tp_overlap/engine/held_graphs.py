"""Autograd contexts that outlive their step, and the communicators they hold.

A step's graph is freed when its last tensor goes. Something may keep one of its tensors (or its nodes) until the
next step: in a Megatron-LM MoE run at TP=2, every qkv's LayerNormLinear context and the dense layer's fc1 context
outlived the step. After the backward such a graph holds no saved activations, but TE's contexts in it still hold
the userbuffers communicators that the step ran with: ``destroy_ub`` would leave them to tear down the next config's
shared communicator (``docs/switch.md``), so the switcher refused every switch. What kept that graph is unknown: no
module attribute and no tensor on the heap reached it (``benchmarks/results/2026-11-25_h100x2/nineteenth/``). A
context whose backward has run is never read again, so the switch lets go of its communicators instead, whoever
keeps it.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable
from typing import Any

import torch


def _backward_ran(ctx: Any) -> bool:
    """Whether a custom Function's context has been through its backward: its saved tensors are freed then (and
    reading them raises). A context that saved nothing cannot tell, and counts as not run."""
    try:
        _ = ctx.saved_tensors
    except RuntimeError:
        return True
    return False


def release_from_contexts(communicators: Iterable[Any], frozen: bool = False) -> list[str]:
    """Drop the references to ``communicators`` that autograd contexts hold after their backward has run (set to
    None). Such a context lives on only because something keeps its graph, and nothing reads it again; contexts
    of a graph whose backward has not run are left alone (the switch is then refused). Two walks of the heap's
    referrers, whatever the number of communicators and contexts. ``frozen``: also the objects that
    ``gc.freeze`` set aside (the referrer walks skip them): a context alive when the heap was frozen (the in-run
    verification freezes it at its first iteration) is found only so; they are frozen again afterwards, with the
    objects made since (garbage among them waits for the unfreeze at the block's end, engine/heap.py).

    Returns:
        ``"Context.attribute"`` of each reference dropped.
    """
    if frozen:
        if not gc.get_freeze_count():
            return []  # nothing set aside: the plain walk has seen every object
        gc.unfreeze()
        try:
            return release_from_contexts(communicators)
        finally:
            gc.freeze()
    comms = list(communicators)
    ids = {id(c) for c in comms}
    dicts = [r for r in gc.get_referrers(*comms) if isinstance(r, dict)] if comms else []
    dict_ids = {id(d) for d in dicts}
    dropped = []
    for owner in gc.get_referrers(*dicts) if dicts else ():
        attrs = getattr(owner, "__dict__", None)
        if id(attrs) in dict_ids and issubclass(type(owner), torch._C._FunctionBase) and _backward_ran(owner):
            for key, value in list(attrs.items()):
                if id(value) in ids:
                    attrs[key] = None
                    dropped.append(f"{type(owner).__name__}.{key}")
    return dropped


def holder_name(referrer: Any) -> str:
    """A referrer's type; for an object's ``__dict__``, the object's type too (e.g. ``dict of _LinearBackward``: an
    autograd context that a kept graph holds)."""
    if isinstance(referrer, dict):
        for owner in gc.get_referrers(referrer):
            if getattr(owner, "__dict__", None) is referrer:
                return f"dict of {type(owner).__name__}"
    return type(referrer).__name__
