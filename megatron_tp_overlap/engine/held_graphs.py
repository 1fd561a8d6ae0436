"""Autograd contexts that outlive their step, and the communicators they hold.

A step's graph is freed when its last tensor goes. Something may keep one of its tensors (or its nodes) until the
next step: in a Megatron-LM MoE run at TP=2, every qkv's LayerNormLinear context and the dense layer's fc1 context
outlived the step. After the backward such a graph holds no saved activations, but TE's contexts in it still hold
the userbuffers communicators that the step ran with: ``destroy_ub`` would leave them to tear down the next config's
shared communicator (``docs/switch.md``), so the switcher refused every switch. What kept that graph is unknown: no
module attribute and no tensor on the heap reached it (``benchmarks/results/2026-11-25_h100x2/nineteenth/``). A
context whose backward has run is never read again, so the switch lets go of its communicators instead, whoever
keeps it.

The other way round, a graph whose backward has not run: with TE 2.20 its contexts hold no communicator (the backward
fetches them by name, ``get_ub``), so no reference check can see it, and its backward would run with the next
config's communicators and flags fixed at its forward. :class:`PendingBackwards` sees it from the modules' side.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from megatron_tp_overlap.engine.heap import thawed

_FREED = "already been freed"  # autograd's message for saved tensors that a backward released


def _backward_ran(ctx: Any) -> bool:
    """Whether a custom Function's context has been through its backward: its saved tensors are freed then, and
    reading them raises autograd's "already been freed" error. Any other error (a saved tensor written in place
    since, as TE's saved views of a userbuffer can be) says nothing about the backward: counts as not run, as does a
    context that saved nothing. On 2 H200s counting every error as run let a switch go on under a pending graph."""
    try:
        _ = ctx.saved_tensors
    except RuntimeError as e:
        return _FREED in str(e)
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
        with thawed():
            return release_from_contexts(communicators)
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


def _tensors(output: Any) -> Iterable[torch.Tensor]:
    """The tensors of a module's output: a tensor, or a tuple/list of them and other things (TE's ``return_bias``)."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for o in output:
            yield from _tensors(o)


def _function_node(node: Any, depth: int = 3) -> Any:
    """The custom-Function node (TE's context) that made an output: the output's own node, or one a few ops below it
    (TE adds an unfused bias after its Function, ``gemm_bias_unfused_add``); None without one."""
    if node is None or isinstance(node, torch.autograd.function.BackwardCFunction):
        return node
    for child, _ in node.next_functions if depth > 0 else ():
        found = _function_node(child, depth - 1)
        if found is not None:
            return found
    return None


class PendingBackwards:
    """The autograd contexts of the overlapped modules' forwards whose backward has not begun, held weakly.

    A forward hook on each module records the custom-Function node of its output (TE's ``_LinearBackward`` and the
    like) and a pre-hook on that node forgets it when its backward begins; a graph that is dropped goes by itself.
    Forwards without grad (a checkpoint's first forward, evaluation) make no graph and are not recorded. Nothing
    reads the saved tensors: an activation-offloading unpack hook would run.
    """

    def __init__(self, modules: Iterable[torch.nn.Module]):
        self._contexts: weakref.WeakSet[Any] = weakref.WeakSet()
        self._handles = [m.register_forward_hook(self._record) for m in modules]

    def _record(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        for t in _tensors(output):
            node = _function_node(t.grad_fn)
            if node is not None and node not in self._contexts:
                self._contexts.add(node)
                node.register_prehook(self._forget(weakref.ref(node)))

    def _forget(self, ref: weakref.ref) -> Any:
        """The node's pre-hook: its backward begins. A weak reference, or the hook would keep its own node alive."""
        return lambda grads: self._contexts.discard(ref())

    def pending(self) -> list[str]:
        """Type names of the recorded contexts still alive whose backward has not begun."""
        return sorted({type(c).__name__ for c in list(self._contexts)})

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles, self._contexts = [], weakref.WeakSet()
