"""Live switching of TE userbuffers configs inside one process.

``destroy_ub()`` then ``initialize_ub(candidate)`` with the shape, TP size, quantization modes and
bootstrap backend of the original initialization, plus the module flags for GEMMs whose overlap is
switched off.

The trap (see the device README): all CommOverlap objects share one static userbuffers
communicator and the *first* object destroyed tears it down. If anything still references an old
communicator after ``destroy_ub()`` (typically an autograd graph whose ctx holds ``ub_obj_*``),
it dies during the next config and destroys the new shared communicator. So before destroying we
collect garbage, synchronize, and check that TE's registry holds the only references; otherwise we
raise :class:`StaleCommunicatorError` naming the holders instead of corrupting the next config.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_tp_overlap.engine.heap import thawed
from megatron_tp_overlap.engine.held_graphs import PendingBackwards, holder_name, release_from_contexts
from megatron_tp_overlap.engine.space import TuningConfig
from megatron_tp_overlap.engine.topology import OverlapModule
from megatron_tp_overlap.errors import StaleCommunicatorError


@dataclass
class UbInitArgs:
    """The arguments of the original ``initialize_ub`` call, minus ``ub_cfgs``."""

    shape: list[int]
    tp_size: int
    quantization_modes: list[Any] | None = None
    dtype: Any = None
    bootstrap_backend: str | None = None
    use_fp8: bool = False
    with_cublasmp: bool = False
    ub_cfgs: Any = None  # what the user passed first (dict or list per quantization mode)

    def kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"shape": list(self.shape), "tp_size": self.tp_size}
        if self.quantization_modes is not None:
            kw["quantization_modes"] = list(self.quantization_modes)
        else:
            kw["use_fp8"] = self.use_fp8
        if self.dtype is not None:
            kw["dtype"] = self.dtype
        if self.bootstrap_backend is not None:
            kw["bootstrap_backend"] = self.bootstrap_backend
        if self.with_cublasmp:
            kw["with_cublasmp"] = True
        return kw

    @property
    def fp8(self) -> bool:
        if self.quantization_modes is not None:
            return any(getattr(m, "name", str(m)).upper().endswith("FP8") for m in self.quantization_modes)
        return self.use_fp8


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


# Functions whose compiled code may outlive a switch: Megatron's fused elementwise functions (compiled by
# megatron.core.jit.jit_fuser, i.e. torch.compile): they take tensors and never call a TE module, so none of their
# graphs can hold a userbuffers communicator's is_fp8_ubuf() baked in. (path suffix, function names; None: all)
ELEMENTWISE_FUSIONS: tuple[tuple[str, tuple[str, ...] | None], ...] = (
    ("megatron/core/fusions/", None),
    ("megatron/core/activations.py", None),
    ("megatron/core/transformer/utils.py", ("gelu_impl", "erf_gelu")),
    ("megatron/core/transformer/torch_norm.py", ("_norm",)),
    ("megatron/core/transformer/attention.py", ("_apply_output_gate",)),
)


def _is_fusion(filename: str, name: str) -> bool:
    path = filename.replace("\\", "/")
    for suffix, names in ELEMENTWISE_FUSIONS:
        where = path.endswith(suffix) if suffix.endswith(".py") else f"/{suffix}" in path
        if where and (
            names is None or any(name == n or name.startswith(f"torch_dynamo_resume_in_{n}_") for n in names)
        ):
            return True
    return False


def compiled_beyond_fusions() -> list[str]:
    """``file:function`` of each function torch.compile holds compiled code for, other than
    :data:`ELEMENTWISE_FUSIONS` (``["<unknown>"]`` when torch's internals cannot be read: then nothing is assumed)."""
    if "torch._dynamo" not in sys.modules:  # nothing was ever compiled (torch.compile imports it); importing it here,
        return []  # after tuning froze the heap, left its ~1 s of module objects in every switch's collection (116 ms)
    try:
        from torch._dynamo import convert_frame
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        codes = [c for ref in list(convert_frame.input_codes.seen) if (c := ref()) is not None]
        return sorted(
            f"{c.co_filename}:{c.co_name}"
            for c in codes
            if _debug_get_cache_entry_list(c) and not _is_fusion(c.co_filename, c.co_name)
        )
    except (ImportError, AttributeError, TypeError):  # a torch without these internals
        return ["<unknown>"]


@contextlib.contextmanager
def keeping_compiled_fusions() -> Iterator[bool]:
    """TE's ``destroy_ub()`` calls ``torch.compiler.reset()``, for graphs that traced TE's modules and baked a
    communicator's ``is_fp8_ubuf()``; it also throws away Megatron's compiled fusions, which then compile again in
    the next step (+0.24-0.29 s per switch on H200, benchmarks/results/2026-11-23_h200x1/compile_reset/). When
    nothing but those fusions is compiled, the reset is skipped inside this block. Yields whether it is."""
    if compiled_beyond_fusions():
        yield False
        return
    reset = torch.compiler.reset
    torch.compiler.reset = lambda: None
    try:
        yield True
    finally:
        torch.compiler.reset = reset


def _te_base() -> Any:
    from transformer_engine.pytorch.module import base  # TE's public module path used by Megatron

    return base


_captured: list[UbInitArgs] = []


@contextlib.contextmanager
def capture_initialize_ub() -> Iterator[list[UbInitArgs]]:
    """Record the arguments of every ``initialize_ub`` call made inside the block (by Megatron, NeMo, ...)."""
    base = _te_base()
    original = base.initialize_ub
    calls: list[UbInitArgs] = []

    def recording(
        shape,
        tp_size,
        use_fp8=False,
        quantization_modes=None,
        dtype=torch.bfloat16,
        ub_cfgs=None,
        bootstrap_backend=None,
        with_cublasmp=False,
    ):
        calls.append(
            UbInitArgs(
                list(shape), tp_size, quantization_modes, dtype, bootstrap_backend, use_fp8, with_cublasmp, ub_cfgs
            )
        )
        _captured.append(calls[-1])
        return original(
            shape=shape,
            tp_size=tp_size,
            use_fp8=use_fp8,
            quantization_modes=quantization_modes,
            dtype=dtype,
            ub_cfgs=ub_cfgs,
            bootstrap_backend=bootstrap_backend,
            with_cublasmp=with_cublasmp,
        )

    base.initialize_ub = recording
    try:
        yield calls
    finally:
        base.initialize_ub = original


def last_captured() -> UbInitArgs | None:
    return _captured[-1] if _captured else None


def stale_references(objects: Sequence[Any], expected: int) -> list[str]:
    """Describe objects with more than ``expected`` references (beyond this function's own)."""
    out = []
    for obj in objects:
        n = sys.getrefcount(obj) - 2  # the loop variable and getrefcount's argument
        if n > expected:
            with thawed():  # a holder that a frozen heap set aside (the in-run verification's) is named too
                holders = [holder_name(r) for r in gc.get_referrers(obj) if r is not objects]
            out.append(
                f"{type(obj).__name__} has {n} references (expected {expected}); held by: {', '.join(holders[:6]) or '?'}"
            )
    return out


# Where a re-init's seconds go (issue 19 asks <= 0.3 s at TP=2; 0.33-0.41 s measured inside Megatron-LM): the
# collection and the stale-reference check, device syncs, barriers, TE's destroy_ub and initialize_ub.
REINIT_PHASES = ("collect", "sync", "barrier", "destroy", "initialize")


def reinit_phase_medians(phases: Sequence[dict[str, float]]) -> dict[str, float] | None:
    """Per phase, the median seconds over re-inits (None without any)."""
    if not phases:
        return None
    return {p: round(statistics.median(ph[p] for ph in phases), 4) for p in REINIT_PHASES}


@dataclass
class UbSwitcher:
    """Applies :class:`TuningConfig` s to a live model: re-initializes userbuffers only when the
    ``ub_cfgs`` change, and always sets the module flags."""

    init_args: UbInitArgs
    modules: Sequence[OverlapModule]
    barrier: Callable[[], None] = lambda: None
    current: TuningConfig | None = None
    reinits: int = 0
    reinit_seconds: list[float] = field(default_factory=list)
    reinit_phases: list[dict[str, float]] = field(default_factory=list)  # per re-init: REINIT_PHASES -> seconds
    recoverable: Callable[[Callable[[], None]], Any] = lambda recover: contextlib.nullcontext()
    bootstrap_timeout_s: float | None = None  # gloo bootstrap groups: a collective waiting longer raises
    # False in jobs too large for every agreement (engine.lockstep.STEP_CHECKS_UP_TO): initialize_ub's own bootstrap
    # collectives keep ranks apart, and a rank failing in destroy_ub reaches peers blocked there through recoverable
    barrier_after_destroy: bool = True
    compiled_kept: int = 0  # switches that kept torch.compile's code (keeping_compiled_fusions)
    _bootstrap: dict[str, Any] = field(default_factory=dict)  # key of TE's new_group call -> the group
    # "Context.attribute" of every communicator reference let go by a context that outlived its step
    # (engine/held_graphs.py: a Megatron-LM MoE run at TP=2 kept every qkv's context)
    released: set[str] = field(default_factory=set)
    _pending: PendingBackwards | None = None  # from the first switch to close()

    @contextlib.contextmanager
    def _own_bootstrap_groups(self) -> Iterator[None]:
        """TE's ``initialize_ub`` creates a process group (and per-TP-domain subgroups) for its bootstrap on every
        call and never destroys them: each switch left one behind (and paid for creating it). Inside this switcher's
        re-inits the first call's groups are reused, and they are this switcher's to abort (:meth:`abort_bootstrap`).
        A gloo group cannot be aborted from outside while a collective waits in it (its connections close only when
        the last reference goes, and TE's frames hold one), so gloo groups get ``bootstrap_timeout_s``: a rank
        whose peer failed inside ``initialize_ub`` gets an error after that instead of waiting for ever."""
        import datetime

        import torch.distributed as dist

        originals = {"new_group": dist.new_group, "new_subgroups_by_enumeration": dist.new_subgroups_by_enumeration}

        def reused(name: str) -> Callable[..., Any]:
            def make(*args: Any, **kwargs: Any) -> Any:
                key = f"{name}{args!r}{sorted(kwargs.items())!r}"
                if self.bootstrap_timeout_s and kwargs.get("backend") == "gloo" and "timeout" not in kwargs:
                    kwargs["timeout"] = datetime.timedelta(seconds=self.bootstrap_timeout_s)
                if key not in self._bootstrap:
                    self._bootstrap[key] = originals[name](*args, **kwargs)
                return self._bootstrap[key]

            return make

        for name in originals:
            setattr(dist, name, reused(name))
        try:
            yield
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)

    def abort_bootstrap(self) -> None:
        """Abort the bootstrap groups: a rank blocked in one of their collectives (its peer failed inside
        ``initialize_ub``) gets an error instead of waiting for ever; the next re-init creates new ones."""
        self._drop_bootstrap(abort=True)

    def close(self) -> None:
        """Destroy the bootstrap groups once no switch is to come (every rank, at the same point): the live
        communicators no longer use them, and a process group left to the interpreter's exit is torn down there,
        late. The forward hooks of :class:`PendingBackwards` go too. A later switch makes both again."""
        self._drop_bootstrap(abort=False)
        if self._pending is not None:
            self._pending.remove()
            self._pending = None

    def _drop_bootstrap(self, abort: bool) -> None:
        import torch.distributed as dist

        groups, self._bootstrap = list(self._bootstrap.values()), {}
        for g in groups:
            for pg in g[1] if isinstance(g, tuple) else [g]:  # new_subgroups_by_enumeration: (mine, all)
                with contextlib.suppress(Exception):  # a group this rank is not a member of, or one already gone
                    if abort and dist.get_backend(pg) == "nccl":
                        dist.distributed_c10d._abort_process_group(pg)
                    else:  # gloo: its connections close when nothing else holds it; bootstrap_timeout_s bounds the rest
                        dist.destroy_process_group(pg)

    def _initialize(self, cfgs: Any) -> None:
        """``initialize_ub`` with the original arguments; if it raises, nothing of it stays behind (its partial
        registry, its bootstrap groups) and the peers waiting in its collectives are released."""
        base = _te_base()
        try:
            with self._own_bootstrap_groups(), self.recoverable(self.abort_bootstrap):
                base.initialize_ub(**self.init_args.kwargs(), ub_cfgs=cfgs)
        except BaseException:
            self.abort_bootstrap()
            if getattr(base, "_ub_communicators", None) is not None:
                with keeping_compiled_fusions():  # as a switch's own destroy: the fusions stay compiled
                    base.destroy_ub()
            self.current = None
            raise

    def _release(self, lap: Callable[[str], None] = lambda phase: None) -> None:
        """Drop every reference to the current communicators, then destroy them (``lap``: the phase just done)."""
        base = _te_base()
        gc.collect()
        lap("collect")
        _sync()
        lap("sync")
        pending = self._pending.pending() if self._pending is not None else []
        if pending:
            raise StaleCommunicatorError(
                "cannot switch userbuffers configs: a forward of the overlapped modules has a graph whose backward "
                f"has not run ({', '.join(pending[:3])}); it would run with the next config's communicators (run "
                "that backward, or drop the step's outputs/loss, first)"
            )
        comms = base._ub_communicators
        if comms:
            objs = list(comms.values())
            for frozen in (False, True):  # the frozen heap only where the rest did not do
                if any(sys.getrefcount(o) - 2 > 2 for o in objs):  # beyond TE's dict, our list, the loop's name
                    # a graph that outlived its step: its spent contexts let go
                    self.released.update(release_from_contexts(objs, frozen))
            stale = stale_references(objs, expected=2)  # TE's dict + our list
            del objs
            if stale:
                raise StaleCommunicatorError(
                    "cannot switch userbuffers configs: a communicator of the current config is still "
                    "referenced (drop the outputs/loss of the last step so its autograd graph is freed). "
                    + "; ".join(stale[:3])
                )
        lap("collect")  # the reference check walks the heap's referrers, as a collection does
        self.barrier()
        lap("barrier")
        with keeping_compiled_fusions() as kept:
            base.destroy_ub()  # the communicators were referenced by TE alone: freed here, no collection needed
        self.compiled_kept += kept
        lap("destroy")
        _sync()
        lap("sync")
        if self.barrier_after_destroy:
            self.barrier()
        lap("barrier")

    def apply(self, config: TuningConfig, force: bool = False, agreed_after: bool = False) -> bool:
        """Make ``config`` live. Returns True when userbuffers were re-initialized (always with ``force``).
        ``agreed_after``: the caller's next act is an agreement of every rank, which stands for the last barrier."""
        reinit = force or self.current is None or config.ub != self.current.ub
        if self._pending is None:
            self._pending = PendingBackwards(m.module for m in self.modules)
        if reinit:
            base = _te_base()
            t0 = time.perf_counter()
            phases, last = dict.fromkeys(REINIT_PHASES, 0.0), [t0]

            def lap(phase: str) -> None:
                now = time.perf_counter()
                phases[phase] += now - last[0]
                last[0] = now

            if base.is_ub_initialized():
                self._release(lap)
            cfgs = config.ub.to_dict()
            n_modes = len(self.init_args.quantization_modes or [None])
            self._initialize(cfgs if n_modes == 1 else [cfgs] * n_modes)
            lap("initialize")
            _sync()
            lap("sync")
            if not agreed_after:
                self.barrier()
            lap("barrier")
            self.reinits += 1
            self.reinit_seconds.append(time.perf_counter() - t0)
            self.reinit_phases.append(phases)
        enabled = {g for m in self.modules for g in m.active_gemms()} - set(config.disabled)
        for m in self.modules:
            m.set_flags(m.flags_for(config.ub, enabled & m.active_gemms()))
        self.current = config
        return reinit

    def restore_built_flags(self) -> None:
        for m in self.modules:
            m.set_flags(m.built_flags)
