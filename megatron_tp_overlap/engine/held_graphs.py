"""Autograd graphs that a model keeps alive between steps, and what keeps them.

A step's graph is freed when its last tensor goes. Some models keep one of its tensors as an attribute until their
next forward: Megatron's MoE all-to-all token dispatcher keeps the last micro-batch's routing ``probs``, whose graph
reaches back through the router to every earlier layer. After the backward such a graph holds no saved activations,
but its nodes live on, and TE's autograd contexts among them hold the userbuffers communicators that the step ran
with: ``destroy_ub`` would leave them to tear down the next config's shared communicator (``docs/switch.md``), so
the switcher refuses to switch. Detaching the kept tensor frees the graph and changes nothing else:
the same storage and values, and nothing reads its graph after the backward.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable
from typing import Any

import torch


def _references(node: Any, ids: set[int]) -> bool:
    """Whether an autograd node's attributes (a custom Function's context), or those of an object among them (TE's
    backward-argument records), include one of the objects ``ids``."""
    for value in getattr(node, "__dict__", {}).values():
        if id(value) in ids or any(id(v) in ids for v in getattr(value, "__dict__", {}).values()):
            return True
    return False


def _graph_holds(tensor: torch.Tensor, ids: set[int], clean: set[int]) -> bool:
    """Whether ``tensor``'s autograd graph has a node that references one of the objects ``ids``. ``clean``: nodes
    known to reach none, shared between the walks of one switch (every MoE layer's kept probs reach back through all
    earlier layers: without it the walks would cost the square of the depth); a walk that finds none adds its nodes."""
    stack, seen = [tensor.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen or id(node) in clean:
            continue
        seen.add(id(node))
        if _references(node, ids):
            return True
        stack.extend(fn for fn, _ in node.next_functions)
    clean |= seen
    return False


def _plain_objects(owner: Any, depth: int = 2) -> Iterable[Any]:
    """The non-module objects an object keeps as attributes, and theirs, ``depth`` levels down (Megatron's MoE layer
    keeps a ``token_dispatcher``; the flex dispatcher keeps its tensors on a ``_comm_manager``)."""
    if depth == 0:
        return
    for value in vars(owner).values():
        if not isinstance(value, (torch.nn.Module, torch.Tensor, type)) and isinstance(
            getattr(value, "__dict__", None), dict
        ):
            yield value
            yield from _plain_objects(value, depth - 1)


def detach_held_graphs(models: Iterable[torch.nn.Module], communicators: Iterable[Any]) -> list[str]:
    """Replace every tensor that a module of ``models``, or a plain object one of them keeps as an attribute, holds
    between steps with an autograd graph reaching one of ``communicators`` (TE's live ones) by its detached self.
    Tensors whose graph holds no communicator are left as they are (a model may mean to keep those). Call between
    steps only (after the backward).

    Returns:
        ``"Class.attribute"`` of each tensor detached, for the report and the tests.
    """
    ids = {id(c) for c in communicators}
    detached, seen, clean = [], set(), set()
    if not ids:
        return detached
    for model in models:
        for module in model.modules():
            for owner in (module, *_plain_objects(module)):
                if id(owner) in seen:
                    continue
                seen.add(id(owner))
                for name, value in list(vars(owner).items()):
                    if (
                        isinstance(value, torch.Tensor)
                        and value.grad_fn is not None
                        and _graph_holds(value, ids, clean)
                    ):
                        object.__setattr__(owner, name, value.detach())
                        detached.append(f"{type(owner).__name__}.{name}")
    return detached


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
    of a graph whose backward has not run are left alone (the switch is then refused). This is the switch's last
    resort, after :func:`detach_held_graphs`: at TP=2 in a Megatron-LM MoE run every qkv's LayerNormLinear
    context stayed alive with a graph that no module attribute, nor any tensor on the heap, reached. Two walks of
    the heap's referrers, whatever the number of communicators and contexts. ``frozen``: also the objects that
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
