"""The training state around tuning: a snapshot of what trial steps may change (RNG states incl. Megatron's TP
tracker, TE FP8 metadata, every module buffer, Megatron's MoE metrics tracker) restored afterwards, and a bitwise
check that tuning left parameters, gradients, optimizer state, FP8 metadata, buffers, MoE metrics, RNG and data
position as it found them.

Module buffers hold what an MoE router accumulates in a forward/backward outside parameters and optimizer: its
``local_tokens_per_expert`` and ``expert_bias`` (aux-loss-free balancing, moved by ``finalize_model_grads`` where the
framework set that hook before tuning, as Megatron-Bridge does), ``global_tokens_per_expert`` / ``ga_steps`` (global
aux loss), the quantile-balancing accumulators. They are put back after every trial step, so that no trial routes
tokens differently from another, and the run's first iteration sees them as a run without tuning would."""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_tp_overlap.integrations.megatron.replay import ReplayIterator


@dataclass
class StateSnapshot:
    python: Any
    numpy: Any
    torch_cpu: Any
    torch_cuda: Any
    tp_tracker: Any
    fp8_meta: list[tuple[Any, str, Any]]

    tracker: Any = None  # the RNG tracker object (Megatron's CudaRNGStatesTracker)
    models: Sequence[Any] = ()
    buffers: list[tuple[Any, Any]] = field(default_factory=list)  # (live buffer, its value before tuning)
    moe_metrics: Optional[dict[str, Any]] = None  # Megatron's MoE metrics tracker: name -> values before tuning

    @staticmethod
    def _megatron_tracker() -> Any:
        try:
            from megatron.core import tensor_parallel

            return tensor_parallel.get_cuda_rng_tracker()
        except Exception:  # noqa: BLE001 - no Megatron (CPU tests) or no tracker
            return None

    @staticmethod
    def _clone(states: dict) -> dict:
        # Megatron's set_states() keeps the dict it is given and later forks replace its entries:
        # handing it our own dict would let the "saved" state advance. Always hand over copies.
        return {k: (v.clone() if hasattr(v, "clone") else copy.deepcopy(v)) for k, v in states.items()}

    @staticmethod
    def take(models: Sequence[Any], tracker: Any = None) -> StateSnapshot:
        import numpy as np
        import torch

        tracker = tracker if tracker is not None else StateSnapshot._megatron_tracker()
        tracker_states = StateSnapshot._clone(tracker.get_states()) if tracker is not None else None
        fp8 = []
        for m in models:
            for mod in m.modules():
                meta = getattr(mod, "fp8_meta", None)
                if isinstance(meta, dict):
                    for k in ("scaling_fwd", "scaling_bwd"):
                        if k in meta:
                            fp8.append(
                                (
                                    mod,
                                    k,
                                    {
                                        a: getattr(meta[k], a).clone()
                                        for a in ("amax_history", "scale")
                                        if hasattr(meta[k], a)
                                    },
                                )
                            )
        return StateSnapshot(
            random.getstate(),
            np.random.get_state(),
            torch.get_rng_state(),
            torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            tracker_states,
            fp8,
            tracker,
            list(models),
            [(b, b.detach().clone()) for b in module_buffers(models)],
            _moe_metrics_values(),
        )

    def restore_buffers(self) -> None:
        """Every module buffer and the MoE metrics as they were (after each trial step: cheap, a few small copies)."""
        for live, saved in self.buffers:
            live.copy_(saved)
        restore_moe_metrics(self.moe_metrics)

    def restore(self) -> None:
        import numpy as np
        import torch

        self.restore_buffers()
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        torch.set_rng_state(self.torch_cpu)
        if self.torch_cuda is not None:
            torch.cuda.set_rng_state_all(self.torch_cuda)
        if self.tp_tracker is not None and self.tracker is not None:
            self.tracker.set_states(self._clone(self.tp_tracker))
        for mod, k, saved in self.fp8_meta:
            for a, v in saved.items():
                getattr(mod.fp8_meta[k], a).copy_(v)
        # FP8 metadata created during tuning (TE makes it at a module's first FP8 forward, and
        # tuning runs before the first iteration): back to what TE creates, amax history 0, scale 1.
        saved_keys = {(id(mod), k) for mod, k, _ in self.fp8_meta}
        for m in self.models:
            for mod in m.modules():
                meta = getattr(mod, "fp8_meta", None)
                if not isinstance(meta, dict):
                    continue
                for k in ("scaling_fwd", "scaling_bwd"):
                    if k in meta and (id(mod), k) not in saved_keys:
                        reset_fp8_state(meta[k])


def rng_tracker_values(states: dict) -> dict:
    """An RNG tracker's states as tensors to compare: Megatron's tracker keeps tensors, TE's (``--te-rng-tracker``,
    which CUDA graphs need) keeps ``torch.Generator`` objects, graph-safe ones advanced in place."""
    import torch

    def value(v: Any) -> Any:
        if isinstance(v, torch.Generator):
            return v.get_state().clone()
        return v.clone() if hasattr(v, "clone") else v

    return {k: value(v) for k, v in states.items()}


def module_buffers(models: Sequence[Any]) -> list[Any]:
    """Every registered buffer of the model chunks, once each (a buffer shared by two modules counts once)."""
    import torch

    seen, out = set(), []
    for m in models:
        for b in torch.nn.Module.buffers(m):  # megatron-core's DDP wrapper has a ``buffers`` list of its own
            if b is not None and id(b) not in seen:
                seen.add(id(b))
                out.append(b)
    return out


def moe_metrics_tracker() -> Any:
    """Megatron's MoE metrics tracker (megatron-core >= 0.16: router aux losses and load-balancing metrics, recorded
    in every forward and reported and cleared by the training loop's log); None without Megatron."""
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:
        return None
    return get_moe_metrics_tracker()


def _moe_metrics_values() -> Optional[dict[str, Any]]:
    tracker = moe_metrics_tracker()
    if tracker is None:
        return None
    return {name: entry.values.detach().clone() for name, entry in tracker.metrics.items()}


def restore_moe_metrics(saved: Optional[dict[str, Any]]) -> None:
    """The tracker's metrics as in ``saved``: values copied back, entries that trial steps created dropped (the
    first iteration creates them again, as in a run without tuning)."""
    tracker = moe_metrics_tracker()
    if tracker is None or saved is None:
        return
    metrics = tracker.metrics
    for name in [n for n in metrics if n not in saved]:
        del metrics[name]
    for name, values in saved.items():
        if name in metrics:
            metrics[name].values.copy_(values)


def reset_fp8_state(state: Any) -> None:
    """A TE delayed-scaling recipe state as TE creates it (``DelayedScalingRecipeState.__init__``)."""
    if hasattr(state, "amax_history"):
        state.amax_history.zero_()
    if hasattr(state, "scale"):
        state.scale.fill_(1.0)


def _optimizer_tensors(optimizer: Any) -> list[Any]:
    """Every state tensor of a (Megatron-wrapped, possibly chained) optimizer, in a fixed order."""
    import torch

    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for groups_attr in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups"):
            for group in getattr(opt, groups_attr, None) or []:
                out += [t for t in group if isinstance(t, torch.Tensor)]
        inner = getattr(opt, "optimizer", opt)
        for st in getattr(inner, "state", {}).values():
            out += [v for _, v in sorted(st.items()) if isinstance(v, torch.Tensor)]
    return out


class StateCheck:
    """Bitwise check that tuning left the training state as it found it (MEGATRON_TP_OVERLAP_CHECK_STATE=1):
    parameters, gradient buffers, optimizer state tensors, TE FP8 metadata (amax history, scales),
    RNG states (CPU, CUDA, TP tracker) and the data iterators' position (the read-ahead batches the
    main loop gets first: same count, same tensors)."""

    def __init__(
        self, model: Sequence[Any], optimizer: Any, tracker: Any = None, replays: Sequence[ReplayIterator | None] = ()
    ):
        import torch

        self.model, self.optimizer, self.replays = model, optimizer, list(replays)
        self.tracker = tracker if tracker is not None else StateSnapshot._megatron_tracker()
        self.before = self._tensors()
        self.rng = (
            torch.get_rng_state(),
            torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            rng_tracker_values(self.tracker.get_states()) if self.tracker is not None else {},
        )
        self.data = self._data()

    def _data(self) -> list[list[Any]]:
        """Per iterator: the buffered batches, tensors cloned (what the main loop will read first)."""
        import torch

        def clone(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return x.detach().clone()
            if isinstance(x, dict):
                return {k: clone(v) for k, v in x.items()}
            if isinstance(x, (list, tuple)):
                return type(x)(clone(v) for v in x)
            return x

        return [[clone(b) for b in r._buf] if r is not None else [] for r in self.replays]

    @staticmethod
    def _same(a: Any, b: Any) -> bool:
        import torch

        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return (
                isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
            )
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(StateCheck._same(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            return len(a) == len(b) and all(StateCheck._same(x, y) for x, y in zip(a, b))
        return a == b

    def _tensors(self) -> dict[str, Any]:
        import torch

        out = {}
        for i, chunk in enumerate(self.model):
            for n, p in chunk.named_parameters():
                out[f"param {i}.{n}"] = p.detach().clone()
                g = getattr(p, "main_grad", None)
                g = g if g is not None else p.grad
                if g is not None:
                    out[f"grad {i}.{n}"] = g.detach().clone()
            for n, b in torch.nn.Module.named_buffers(chunk):
                if b is not None:
                    out[f"buffer {i}.{n}"] = b.detach().clone()
            for n, mod in chunk.named_modules():
                meta = getattr(mod, "fp8_meta", None)
                if not isinstance(meta, dict):
                    continue
                for k in ("scaling_fwd", "scaling_bwd"):
                    for a in ("amax_history", "scale"):
                        t = getattr(meta.get(k), a, None)
                        if isinstance(t, torch.Tensor):
                            out[f"fp8 {i}.{n}.{k}.{a}"] = t.detach().clone()
        for j, t in enumerate(_optimizer_tensors(self.optimizer)):
            out[f"optimizer state {j}"] = t.detach().clone()
        for name, values in (_moe_metrics_values() or {}).items():
            out[f"moe-metric {name}"] = values
        return out

    @staticmethod
    def _fresh_fp8(key: str, t: Any) -> bool:
        """FP8 metadata that did not exist before tuning must be as TE creates it."""
        import torch

        if not key.startswith("fp8 "):
            return False
        return bool(torch.all(t == 0)) if key.endswith(".amax_history") else bool(torch.all(t == 1))

    def kinds_checked(self) -> dict[str, int]:
        """How many tensors of each kind the check covers (for the report)."""
        counts: dict[str, int] = {}
        for k in self.before:
            kind = k.split(" ")[0] if not k.startswith("optimizer") else "optimizer state"
            kind = "MoE metric" if kind == "moe-metric" else kind
            counts[kind] = counts.get(kind, 0) + 1
        counts["read-ahead batches"] = sum(len(d) for d in self.data)
        return counts

    def mismatches(self) -> list[str]:
        import torch

        after = self._tensors()
        bad = [
            k
            for k in self.before.keys() | after.keys()
            if not (k not in self.before and self._fresh_fp8(k, after[k]))
            and (k not in self.before or k not in after or not torch.equal(self.before[k], after[k]))
        ]
        cpu, cuda, tr = self.rng
        if not torch.equal(cpu, torch.get_rng_state()):
            bad.append("CPU RNG state")
        if torch.cuda.is_available() and any(
            not torch.equal(a, b) for a, b in zip(cuda, torch.cuda.get_rng_state_all())
        ):
            bad.append("CUDA RNG state")
        if self.tracker is not None:
            now = rng_tracker_values(self.tracker.get_states())
            bad += [f"TP RNG tracker '{k}'" for k in tr if k not in now or not torch.equal(tr[k], now[k])]
        if not self._same(self.data, self._data()):
            bad.append("data iterator position (read-ahead batches)")
        return sorted(bad)
