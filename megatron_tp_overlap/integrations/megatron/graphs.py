"""CUDA graphs in a Megatron run: when each of Megatron's three modes captures, so that tuning and the in-run
verification's switches end before it, and a guard that keeps trial steps from capturing.

Graphs replay the userbuffers of the config live at capture: after it no config may change. As in Megatron-LM
``core_v0.19.0`` and Megatron-Bridge 0.6 (their training loops):

- ``local`` (``CudaGraphManager``): the first ``forward_backward_func`` call records every graphed layer eagerly and
  captures at its end (pipeline_parallel/schedules.py: ``if config.cuda_graph_impl == "local": create_cudagraphs()``),
  i.e. in the run's first iteration. Trial steps call that function too: they run under :func:`no_local_capture`.
- ``transformer_engine`` (``TECudaGraphHelper``, TE's ``make_graphed_callables``): ``train()`` captures before the
  iteration where ``iteration - start_iteration == cuda_graph_warmup_steps``.
- ``full_iteration`` (``FullCudaGraphWrapper``, made inside ``train()`` around ``forward_backward_func``): captures
  when its own count of training calls reaches ``cuda_graph_warmup_steps``; trial steps call the unwrapped function.

Tuning runs before ``train()``, so before every capture; the in-run verification gets the iterations before it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any, Optional

MODES = ("local", "transformer_engine", "full_iteration")
DEFAULT_WARMUP = 3  # TransformerConfig.cuda_graph_warmup_steps


def _names(value: Any) -> set[str]:
    """Scope names from strings or enum members (``cuda_graph_modules`` / the deprecated ``cuda_graph_scope``)."""
    if value is None:
        return set()
    items = value if isinstance(value, (list, tuple, set)) else [value]
    return {str(getattr(v, "name", v)).rsplit(".", 1)[-1] for v in items}


def graph_mode(c: Any) -> Optional[str]:
    """The run's CUDA graph mode from Megatron's arguments or a ``TransformerConfig`` (None: no graphs). Older
    spellings count: ``--enable-cuda-graph`` (local), ``--external-cuda-graph`` (transformer_engine) and a ``local``
    impl with the ``full_iteration`` scope (what Megatron-Bridge's ``is_full_iteration_cuda_graph`` reads)."""
    impl = getattr(c, "cuda_graph_impl", "none") or "none"
    if impl == "none":
        impl = (
            "local"
            if getattr(c, "enable_cuda_graph", False)
            else "transformer_engine"
            if getattr(c, "external_cuda_graph", False)
            else "none"
        )
    scopes = _names(getattr(c, "cuda_graph_modules", None)) | _names(getattr(c, "cuda_graph_scope", None))
    if impl == "local" and "full_iteration" in scopes:
        return "full_iteration"
    return impl if impl != "none" else None


def warmup_steps(c: Any) -> int:
    w = getattr(c, "cuda_graph_warmup_steps", None)
    return DEFAULT_WARMUP if w is None else int(w)


def te_steps_before_capture(
    warmup: int, skips: Collection[int] = (), skip_moves_start: bool = True, limit: int = 1 << 30
) -> int:
    """Training steps ``train()`` runs before TE's capture, counted from its start. Megatron-LM checks the capture
    before a skipped iteration (``--iterations-to-skip``) and a skip at the start moves ``start_iteration``;
    Megatron-Bridge skips first and never moves it (then a skip can jump past the capture: ``limit`` stops)."""
    it, start, n = 0, 0, 0
    while n < limit:
        if skip_moves_start and it - start == warmup:
            break
        if it + 1 in skips:
            start += 1 if skip_moves_start and it == start else 0
            it += 1
            continue
        if not skip_moves_start and it - start == warmup:
            break
        n, it = n + 1, it + 1
    return n


@dataclass(frozen=True)
class Capture:
    """When the run captures its graphs: after ``eager_iters`` training iterations of this ``train()`` call."""

    mode: str
    eager_iters: int
    when: str  # for the log

    @staticmethod
    def of(c: Any, skips: Collection[int] = (), bridge: bool = False) -> Optional[Capture]:
        """From Megatron's arguments or a ``TransformerConfig`` (``bridge``: Megatron-Bridge's loop); None without
        graphs."""
        mode = graph_mode(c)
        if mode is None:
            return None
        w = warmup_steps(c)
        if mode == "local":
            return Capture(mode, 0, "at the end of its first forward_backward_func call (its first iteration)")
        if mode == "full_iteration":
            return Capture(mode, w, f"in training iteration {w + 1} (--cuda-graph-warmup-steps {w})")
        n = te_steps_before_capture(w, set(skips or ()), skip_moves_start=not bridge)
        return Capture(mode, n, f"before training iteration {n + 1} (--cuda-graph-warmup-steps {w})")

    def room(self, remaining: Optional[int]) -> int:
        """Training iterations the in-run verification may span: those before the capture (and left in the run)."""
        return self.eager_iters if remaining is None else min(remaining, self.eager_iters)

    def line(self, needed: int, verify_iters: int, fitted: int) -> str:
        """The one log line when the verification does not fit before the capture (skipped or shortened)."""
        head = f"[tp-overlap-autotune] CUDA graphs (--cuda-graph-impl {self.mode}) capture {self.when}"
        if fitted == 0:
            return (
                f"{head}, after which the config may not change: in-run verification skipped (its shortest takes "
                f"{needed} iterations, {self.eager_iters} run before the capture)"
            )
        return (
            f"{head}: in-run verification shortened to {fitted} of {verify_iters} measured iterations, to end before it"
        )


def refusal(mode: Optional[str], recompute_flag: Optional[str]) -> Optional[str]:
    """What Megatron itself refuses among CUDA graphs with recompute (quoted), else None."""
    if mode in ("local", "transformer_engine") and (recompute_flag or "").startswith("--recompute-granularity full"):
        return (
            f"--cuda-graph-impl {mode} with {recompute_flag}: Megatron-LM refuses it itself (TransformerConfig: "
            '"full recompute is only supported with full iteration CUDA graph."); use --cuda-graph-impl full_iteration '
            "or selective recompute"
        )
    return None


class GraphsAlreadyCaptured(RuntimeError):
    pass


@contextlib.contextmanager
def no_local_capture(model: Any = (), cg: Any = None) -> Iterator[None]:
    """Around trial steps under ``--cuda-graph-impl local``: every ``CudaGraphManager`` runs its module eagerly (as
    Megatron's own fallback for a module it does not graph), so nothing is recorded and the schedule's
    ``create_cudagraphs()`` finds nothing to capture. Megatron's saved-tensor observer (enabled when the managers
    were built, for the run's recording pass; ``create_cudagraphs()`` removes it even when nothing was recorded) is
    off inside and back after; anything recorded inside is dropped. The run then records and captures in its first
    iteration, with the config live then, as it would have without trials. ``cg``: Megatron's
    ``megatron.core.transformer.cuda_graphs`` (tests pass a stand-in); ``model``: the model chunks."""
    if cg is None:
        import megatron.core.transformer.cuda_graphs as cg
    record, manager = cg._CudagraphGlobalRecord, cg.CudaGraphManager
    if record.cudagraph_created:
        raise GraphsAlreadyCaptured(
            "CUDA graphs (--cuda-graph-impl local) were already captured before tuning: configs cannot change under them"
        )
    observing = record._saved_tensors_observer is not None
    saved = (list(record.cudagraph_record), list(record.cudagraph_inference_record))
    managers = [m for chunk in model for m in chunk.modules() if isinstance(m, manager)]
    runners = [(m, list(m.cudagraph_runners)) for m in managers]
    had_call = "__call__" in vars(manager)
    original = vars(manager).get("__call__")

    def eager(self: Any, megatron_module: Any, args: Any, kwargs: Any, cache_key: Any = None) -> Any:
        if self.func is not None:
            return self.func(*args, **kwargs)
        return super(cg.MegatronModule, megatron_module).__call__(*args, **kwargs)

    record._disable_saved_tensors_observer()
    manager.__call__ = eager
    try:
        yield
    finally:
        if had_call:
            manager.__call__ = original
        else:
            del manager.__call__
        record.cudagraph_record, record.cudagraph_inference_record = saved
        for m, r in runners:
            m.cudagraph_runners = r
        if observing:
            record._enable_saved_tensors_observer()


def trial_guard(run: Any, model: Any, cg: Any = None) -> contextlib.AbstractContextManager:
    """The context trial steps run in: :func:`no_local_capture` under ``local`` graphs, else nothing."""
    return no_local_capture(model, cg) if getattr(run, "cuda_graphs", None) == "local" else contextlib.nullcontext()
