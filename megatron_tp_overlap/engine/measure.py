"""Per-module timing of training steps with CUDA events, and cross-rank agreement.

Forward: a forward pre-hook and a forward hook on every qkv/proj/fc1/fc2 TE module record events.
Backward: the forward hook finds the module's own autograd node (the TE ``torch.autograd.Function``
behind its output) and registers a pre-hook and a post-hook on it, so the whole backward of the
module (dgrad, wgrad and their overlapped communication) sits between two events. No tensor is
wrapped (no views, so in-place ops after the module still work) and nothing syncs the host inside
the step: events are read after the step.

Activation recompute: every forward of a module counts, the recomputed one too (it is part of the step as
configured), and each backward once. A reentrant checkpoint (Megatron's, TE's) runs its first forward under
no_grad (no node: no backward timed for it) and re-runs it in the checkpoint's own backward, outside any module's
backward. A non-reentrant one re-runs the forward inside the backward of the module that unpacks a saved tensor,
and may stop it early by raising: the forward hook is always called, and a module's backward excludes the forwards
that ran inside it.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from megatron_tp_overlap.engine.topology import OverlapModule


class HostEvent:
    """CPU stand-in for ``torch.cuda.Event(enable_timing=True)`` (tests, CPU runs)."""

    def __init__(self) -> None:
        self.t: float | None = None

    def record(self, stream: Any = None) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: HostEvent) -> float:
        assert self.t is not None and end.t is not None, "event not recorded"
        return (end.t - self.t) * 1e3


def cuda_event() -> Any:
    return torch.cuda.Event(enable_timing=True)


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        for o in out:
            t = _first_tensor(o)
            if t is not None:
                return t
    return None


def module_node(out: torch.Tensor, max_depth: int = 4) -> Any:
    """The custom autograd Function node that produced ``out`` (TE modules are one Function each).

    Walks through view/reshape nodes that a wrapper may add after the Function.
    """
    node = out.grad_fn
    frontier = [node] if node is not None else []
    for _ in range(max_depth):
        nxt = []
        for n in frontier:
            if isinstance(n, torch.autograd.function.BackwardCFunction):
                return n
            nxt += [f for f, _ in n.next_functions if f is not None]
        frontier = nxt
    return None


class SlotTimer:
    """Times the forward and the backward of every overlap module, per slot ("qkv.fwd", ...).

    Usage per step: ``begin_step()``, run forward+backward, ``end_step()``; after all steps of a
    trial, synchronize and call ``collect()``: per slot, one value per step (ms, summed over layers).
    """

    def __init__(self, modules: Sequence[OverlapModule], event_factory: Callable[[], Any] = cuda_event):
        self.modules = list(modules)
        self.event = event_factory
        self.handles: list[Any] = []
        self.steps: list[tuple[Any, Any, dict[str, list[tuple[Any, ...]]]]] = []
        self._cur: dict[str, list[tuple[Any, ...]]] | None = None
        self._step_start: Any = None
        self._open_bwd: list[list[tuple[Any, Any]]] = []  # per open backward window: the forwards that ran inside it
        self.enabled = True

    def __enter__(self) -> SlotTimer:
        self.attach()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    def attach(self) -> None:
        for m in self.modules:
            self.handles.append(m.module.register_forward_pre_hook(self._pre(m.slot_prefix)))
            # always_call: a recompute stopped early (non-reentrant checkpoint) raises out of a module's forward
            self.handles.append(m.module.register_forward_hook(self._post(m.slot_prefix), always_call=True))

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _pre(self, prefix: str) -> Callable:
        def hook(module: torch.nn.Module, args: Any) -> None:
            if self._cur is not None and self.enabled:
                ev = self.event()
                ev.record()
                module._tpo_fwd_start = ev  # type: ignore[attr-defined]

        return hook

    def _post(self, prefix: str) -> Callable:
        def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
            cur = self._cur
            if cur is None or not self.enabled:
                return
            end = self.event()
            end.record()
            start = module.__dict__.pop("_tpo_fwd_start", None)
            if start is not None:
                cur[f"{prefix}.fwd"].append((start, end))
                if self._open_bwd:  # a recompute inside a module's backward: not that backward's time
                    self._open_bwd[-1].append((start, end))
            t = _first_tensor(out)
            node = module_node(t) if t is not None and t.requires_grad else None
            if node is None:
                return
            pair: list[Any] = [None, None]
            inside: list[tuple[Any, Any]] = []

            def bwd_start(grad_outputs: Any) -> None:
                pair[0] = self.event()
                pair[0].record()
                self._open_bwd.append(inside)

            def bwd_end(grad_inputs: Any, grad_outputs: Any) -> None:
                pair[1] = self.event()
                pair[1].record()
                self._open_bwd[:] = [w for w in self._open_bwd if w is not inside]
                cur[f"{prefix}.bwd"].append((pair[0], pair[1], inside))

            node.register_prehook(bwd_start)
            node.register_hook(bwd_end)

        return hook

    def begin_step(self) -> None:
        self._cur = defaultdict(list)
        self._open_bwd.clear()
        self._step_start = self.event()
        self._step_start.record()

    def end_step(self) -> None:
        assert self._cur is not None, "end_step() without begin_step()"
        end = self.event()
        end.record()
        self.steps.append((self._step_start, end, self._cur))
        self._cur = None

    def collect(self, slots: Sequence[str]) -> tuple[dict[str, list[float]], list[float]]:
        """(slot -> ms per step, step ms). Call after synchronizing the device. Clears the steps."""
        per_slot: dict[str, list[float]] = {s: [] for s in slots}
        step_ms: list[float] = []
        for start, end, cur in self.steps:
            step_ms.append(start.elapsed_time(end))
            for s in slots:
                spans = [(w[0], w[1], w[2] if len(w) > 2 else ()) for w in cur.get(s, [])]
                done = [(a, b, inner) for a, b, inner in spans if a is not None and b is not None]
                per_slot[s].append(sum(_inner_ms(a, b, inner) for a, b, inner in done) if done else float("nan"))
        self.steps.clear()
        return per_slot, step_ms


def _inner_ms(start: Any, end: Any, inside: Sequence[tuple[Any, Any]]) -> float:
    """ms from ``start`` to ``end`` less the forwards that ran inside (a recompute within a backward)."""
    return start.elapsed_time(end) - sum(a.elapsed_time(b) for a, b in inside)


def agree_max(values: Sequence[float], group: Any = None, device: torch.device | str = "cpu") -> list[float]:
    """Element-wise MAX over the ranks of ``group`` (identity when torch.distributed is not up).

    NaN marks "not measured" and stays NaN. One collective per call: call it once per trial.
    """
    import torch.distributed as dist

    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        nan = torch.isnan(t)
        t = torch.where(nan, torch.full_like(t, float("inf")), t)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        t = torch.where(torch.isinf(t), torch.full_like(t, float("nan")), t)
    return t.tolist()


def median_cuda_ms(fn: Callable[[], Any], iters: int, warmup: int = 3, group: Any = None, reduce: bool = True) -> float:
    """Median ms of ``iters`` calls of ``fn`` (CUDA events, after ``warmup`` calls); the max over
    the ranks of ``group`` unless ``reduce=False`` (then this rank's).

    For benchmarks, not for trials (those time per slot with :class:`SlotTimer`).
    """
    for _ in range(warmup):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    med = statistics.median(s.elapsed_time(e) for s, e in ev)
    return agree_max([med], group, "cuda")[0] if reduce else med


def compare_configs(
    configs: dict[str, Any],
    apply: Callable[[Any], Any],
    step: Callable[[], Any],
    steps: int = 20,
    rounds: int = 5,
    group: Any = None,
    timer: Callable[..., float] | None = None,
) -> dict[str, dict[str, float]]:
    """Step time of each named config, measured in ``rounds`` interleaved rounds of ``steps`` steps
    (drift of clocks or neighbours hits every config alike; the order rotates each round so that no
    config always follows the same one); names whose configs are equal share one
    measurement, so a config is never reported faster than itself. Returns, per name, the median of
    the round medians and the spread (max - min) of the round medians, in ms (max over ranks)."""
    unique: list[Any] = []
    for c in configs.values():
        if c not in unique:
            unique.append(c)
    samples: list[list[float]] = [[] for _ in unique]
    for r in range(rounds):
        for i in [(j + r) % len(unique) for j in range(len(unique))]:  # rotated: no fixed predecessor
            apply(unique[i])
            samples[i].append((timer or median_cuda_ms)(step, steps, group=group))
    stats = [{"median": statistics.median(s), "spread": max(s) - min(s), "rounds": len(s)} for s in samples]
    return {name: dict(stats[unique.index(c)]) for name, c in configs.items()}
