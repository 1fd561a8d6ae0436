"""Megatron-LM integration: ``--tp-comm-overlap-autotune`` (megatron-core 0.19; all Megatron-version
specific code lives in this module).

Megatron has no callback registry, so :func:`install` patches three module attributes:

- ``megatron.training.arguments.parse_args``: chains our flags into Megatron's own parser (whatever
  ``extra_args_provider`` the script passes) and rejects bad combinations before any GPU work;
- ``megatron.training.training.train``: runs :class:`TPOverlapAutotuneCallback` after model and
  optimizer setup and before the first iteration, then calls the original ``train``;
- ``megatron.core.datasets.utils.compile_helpers``: skips ``make`` when the compiled dataset
  helpers are importable (a pip-installed megatron-core ships them but not the Makefile).

Trial steps go through Megatron's own ``forward_backward_func`` on micro-batches read ahead from the
real training iterator and handed back to it (the main loop sees the same batches in the same
order); no optimizer step; gradients zeroed; RNG states (incl. the TP RNG tracker) and TE FP8
metadata restored; iteration, LR schedule and consumed samples are never touched.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import random
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from ..atomic import atomic_write_text, unwritable
from ..errors import ConfigError

if TYPE_CHECKING:
    from ..ub_config import UbConfig

FLAG = "--tp-comm-overlap-autotune"


# ---------------------------------------------------------------------------------------------
# Flags (pure: CPU-testable without Megatron)
# ---------------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron ``extra_args_provider``: the autotune flags."""
    g = parser.add_argument_group("tp-comm-overlap autotune (megatron-tp-overlap)")
    g.add_argument(FLAG, action="store_true",
                   help="Tune the userbuffers config (ub_cfgs) on the real model before the first iteration, "
                        "apply it, and write it as a --tp-comm-overlap-cfg YAML.")
    g.add_argument(f"{FLAG}-steps", type=int, default=AUTOTUNE_DEFAULTS["tp_comm_overlap_autotune_steps"], help="Budget: trial steps (warmups included).")
    g.add_argument(f"{FLAG}-seconds", type=float, default=AUTOTUNE_DEFAULTS["tp_comm_overlap_autotune_seconds"], help="Budget: wall seconds of tuning.")
    g.add_argument(f"{FLAG}-strategy", choices=["coordinate", "slot_exhaustive", "exhaustive"], default="coordinate")
    g.add_argument(f"{FLAG}-output", type=str, default=None,
                   help="Tuned YAML path (default: next to --tp-comm-overlap-cfg, else in --save, else ./).")
    g.add_argument(f"{FLAG}-reuse", action="store_true",
                   help="Reuse the YAML at the output path if it was tuned for the same GPU, TP, shape, dtype and TE version.")
    g.add_argument(f"{FLAG}-allow-off", action="store_true",
                   help="Also consider switching a GEMM's overlap off (a module flag the YAML cannot express).")
    g.add_argument(f"{FLAG}-rtol", type=float, default=AUTOTUNE_DEFAULTS["tp_comm_overlap_autotune_rtol"],
                   help="Numerics guard: relative error of loss/gradient fingerprints vs no overlap that a candidate may "
                        "always have; the bound is max(this, 3x the starting config's own error, capped at 0.5).")
    g.add_argument(f"{FLAG}-trial-timeout", type=float, default=AUTOTUNE_DEFAULTS["tp_comm_overlap_autotune_trial_timeout"],
                   help="Seconds: a candidate whose trial (warmup + timed steps) takes longer is rejected.")
    return parser


# The autotune options as Bridge's fields / NeMo's callback arguments name them (= the flags above).
AUTOTUNE_DEFAULTS: dict[str, Any] = {
    "tp_comm_overlap_autotune": True, "tp_comm_overlap_autotune_seconds": 60.0, "tp_comm_overlap_autotune_steps": 400,
    "tp_comm_overlap_autotune_strategy": "coordinate", "tp_comm_overlap_autotune_output": None,
    "tp_comm_overlap_autotune_reuse": False, "tp_comm_overlap_autotune_allow_off": False,
    "tp_comm_overlap_autotune_rtol": 2e-2, "tp_comm_overlap_autotune_trial_timeout": 120.0,
}


def args_from_transformer_config(m: Any, micro_batch_size: int, options: dict[str, Any], reference_yaml: str | None,
                                 save: str | None, bootstrap_backend: str | None = None) -> argparse.Namespace:
    """The Megatron-LM argument names this module reads, from a megatron-core ``TransformerConfig``-like
    model config (Megatron-Bridge's provider, NeMo's GPT config) and the autotune options."""
    kv = getattr(m, "num_query_groups", None)
    return argparse.Namespace(
        tp_comm_overlap=bool(getattr(m, "tp_comm_overlap", False)), sequence_parallel=bool(m.sequence_parallel),
        tensor_model_parallel_size=m.tensor_model_parallel_size, context_parallel_size=getattr(m, "context_parallel_size", 1),
        transformer_impl="transformer_engine", seq_length=m.seq_length, decoder_seq_length=None,
        decoder_tp_comm_overlap=False, micro_batch_size=micro_batch_size, hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size, num_attention_heads=m.num_attention_heads, num_query_groups=kv,
        group_query_attention=kv is not None and kv != m.num_attention_heads,
        fp8=getattr(m, "fp8", None), fp16=bool(getattr(m, "fp16", False)), bf16=bool(getattr(m, "bf16", False)),
        first_last_layers_bf16=bool(getattr(m, "first_last_layers_bf16", False)),
        num_layers_at_start_in_bf16=getattr(m, "num_layers_at_start_in_bf16", 0) or 0,
        num_layers_at_end_in_bf16=getattr(m, "num_layers_at_end_in_bf16", 0) or 0,
        tp_comm_bootstrap_backend=bootstrap_backend or getattr(m, "tp_comm_bootstrap_backend", None) or "nccl",
        tp_comm_overlap_rs_dgrad=bool(getattr(m, "tp_comm_overlap_rs_dgrad", False)),
        tp_comm_overlap_cfg=reference_yaml, save=save, **{**AUTOTUNE_DEFAULTS, **options})


def check_arguments(args: argparse.Namespace, te_available: bool = True) -> list[str]:
    """Problems with the flag combination (empty when fine). Checked before any GPU work."""
    if not getattr(args, "tp_comm_overlap_autotune", False):
        return []
    p = []
    if not getattr(args, "tp_comm_overlap", False):
        p.append(f"{FLAG} needs --tp-comm-overlap (it tunes TE's userbuffers overlap)")
    if not getattr(args, "sequence_parallel", False):
        p.append(f"{FLAG} needs --sequence-parallel (userbuffers overlap the sequence-parallel all-gather/reduce-scatter)")
    tp = getattr(args, "tensor_model_parallel_size", 1)
    if tp < 2:
        p.append(f"{FLAG} needs --tensor-model-parallel-size >= 2 (got {tp}): there is no TP communication to overlap")
    if getattr(args, "transformer_impl", "transformer_engine") != "transformer_engine" or not te_available:
        p.append(f"{FLAG} needs Transformer Engine (pip install transformer-engine[pytorch]) and --transformer-impl transformer_engine")
    if getattr(args, "fp16", False):
        p.append(f"{FLAG} with --fp16: TE's userbuffers reduce-scatter adds in bf16 on Ampere and newer "
                 "(transformer_engine/common/comm_gemm_overlap/userbuffers/userbuffers.cu), so fp16 overlap gives wrong "
                 "sums; use --bf16")
    p += option_problems(lambda k: getattr(args, f"tp_comm_overlap_autotune_{k}", None),
                         lambda k: f"{FLAG}-{k.replace('_', '-')}")
    cfg = getattr(args, "tp_comm_overlap_cfg", None)
    if cfg:
        from ..validation import ValidationContext, load_and_validate
        try:
            load_and_validate(cfg, ValidationContext(fp8=bool(getattr(args, "fp8", None)), tp_size=max(tp, 2)))
        except ConfigError as e:
            p.append(f"--tp-comm-overlap-cfg: {e}")
    why = unwritable(output_path(args).parent)
    if why:
        p.append(f"{FLAG}-output: cannot write the tuned YAML there ({why})")
    return p


def option_problems(value: Callable[[str], Any], name: Callable[[str], str]) -> list[str]:
    """The autotune options' own rules (budgets, tolerance, timeout, strategy), for every way in:
    ``value(k)`` reads option ``k`` (e.g. ``"steps"``; None: not given), ``name(k)`` is what the user typed."""
    from ..search import STRATEGIES
    p = []
    steps = value("steps")
    if steps is not None and steps < 1:
        p.append(f"{name('steps')} = {steps}: must be >= 1")
    for k in ("seconds", "rtol", "trial_timeout"):
        v = value(k)
        if v is not None and not v > 0:
            p.append(f"{name(k)} = {v}: must be > 0")
    strategy = value("strategy")
    if strategy is not None and strategy not in STRATEGIES:
        p.append(f"{name('strategy')} = {strategy!r}: must be one of {', '.join(STRATEGIES)}")
    return p


def flags_for(ub: UbConfig, yaml_path: str | Path) -> tuple[list[str], str | None]:
    """Megatron-LM flags that reproduce ``ub`` (written at ``yaml_path``), and why they cannot (or None).

    Megatron builds every qkv/fc1 layer with bulk dgrad overlap, or with GEMM + reduce-scatter dgrad under
    ``--tp-comm-overlap-rs-dgrad``: one mode for both, which the YAML alone cannot switch.
    """
    flags = ["--tp-comm-overlap", "--tp-comm-overlap-cfg", str(yaml_path)]
    rs = {g: ub.dgrad_is_reduce_scatter(g) for g in ("qkv_dgrad", "fc1_dgrad")}
    if all(rs.values()):
        flags.append("--tp-comm-overlap-rs-dgrad")
    elif any(rs.values()):
        mixed = ", ".join(f"{g} {'reduce-scatter' if v else 'bulk'}" for g, v in rs.items())
        return flags, (f"{mixed}: Megatron-LM runs qkv and fc1 dgrad in one mode (--tp-comm-overlap-rs-dgrad or not); "
                       "this config needs both modes")
    return flags, None


def output_path(args: argparse.Namespace) -> Path:
    explicit = getattr(args, "tp_comm_overlap_autotune_output", None)
    if explicit:
        return Path(explicit)
    cfg = getattr(args, "tp_comm_overlap_cfg", None)
    if cfg:
        return Path(cfg).with_name(Path(cfg).stem + ".tuned.yaml")
    if getattr(args, "save", None):
        return Path(args.save) / "tp_comm_overlap_tuned.yaml"
    return Path("tp_comm_overlap_tuned.yaml")


def tuning_key(args: argparse.Namespace, gpu: str, te_version: str) -> dict[str, Any]:
    """What a tuned config depends on; a reused config must match it exactly."""
    return {"gpu": gpu, "tp": args.tensor_model_parallel_size, "cp": getattr(args, "context_parallel_size", 1),
            "seq_length": args.seq_length, "micro_batch_size": args.micro_batch_size, "hidden": args.hidden_size,
            "ffn": args.ffn_hidden_size, "heads": args.num_attention_heads,
            "kv_groups": getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", False) else None,
            "dtype": "fp8" if getattr(args, "fp8", None) else ("bf16" if getattr(args, "bf16", False) else "fp16/fp32"),
            "te": te_version}


# ---------------------------------------------------------------------------------------------
# Data replay: read micro-batches ahead for trial steps, hand the same ones to the main loop
# ---------------------------------------------------------------------------------------------

class ReplayIterator:
    """Wraps an iterator; :meth:`read_ahead` buffers items that ``next()`` later returns first."""

    def __init__(self, it: Iterator[Any]):
        self._it, self._buf = it, deque()

    def read_ahead(self, n: int) -> list[Any]:
        while len(self._buf) < n:
            self._buf.append(next(self._it))
        # Shallow copies: Megatron's get_batch replaces dict entries (tensor.cuda()) in place.
        return [copy.copy(b) for b in list(self._buf)[:n]]

    def __iter__(self) -> "ReplayIterator":
        return self

    def __next__(self) -> Any:
        return self._buf.popleft() if self._buf else next(self._it)

    def __getattr__(self, name: str) -> Any:  # e.g. state_dict of the wrapped iterator
        return getattr(self._it, name)


def attach_replay(it: Any) -> tuple[Any, ReplayIterator | None]:
    """(iterator for the main loop, replay handle). Keeps Megatron's RerunDataIterator object in place
    (the rerun state machine checks its type) by wrapping its inner iterable instead."""
    if it is None:
        return None, None
    if type(it).__name__ == "RerunDataIterator" and hasattr(it, "iterable"):
        it.iterable = ReplayIterator(it.iterable)
        return it, it.iterable
    r = ReplayIterator(it)
    return r, r


# ---------------------------------------------------------------------------------------------
# Training-state snapshot (RNG, TE FP8 metadata)
# ---------------------------------------------------------------------------------------------

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
    def take(models: Sequence[Any], tracker: Any = None) -> "StateSnapshot":
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
                            fp8.append((mod, k, {a: getattr(meta[k], a).clone() for a in ("amax_history", "scale")
                                                 if hasattr(meta[k], a)}))
        return StateSnapshot(random.getstate(), np.random.get_state(), torch.get_rng_state(),
                             torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None, tracker_states, fp8,
                             tracker, list(models))

    def restore(self) -> None:
        import numpy as np
        import torch
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

    def __init__(self, model: Sequence[Any], optimizer: Any, tracker: Any = None,
                 replays: Sequence[ReplayIterator | None] = ()):
        import torch
        self.model, self.optimizer, self.replays = model, optimizer, list(replays)
        self.tracker = tracker if tracker is not None else StateSnapshot._megatron_tracker()
        self.before = self._tensors()
        self.rng = (torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
                    StateSnapshot._clone(self.tracker.get_states()) if self.tracker is not None else {})
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
            return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
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
            counts[kind] = counts.get(kind, 0) + 1
        counts["read-ahead batches"] = sum(len(d) for d in self.data)
        return counts

    def mismatches(self) -> list[str]:
        import torch
        after = self._tensors()
        bad = [k for k in self.before.keys() | after.keys()
               if not (k not in self.before and self._fresh_fp8(k, after[k]))
               and (k not in self.before or k not in after or not torch.equal(self.before[k], after[k]))]
        cpu, cuda, tr = self.rng
        if not torch.equal(cpu, torch.get_rng_state()):
            bad.append("CPU RNG state")
        if torch.cuda.is_available() and any(not torch.equal(a, b) for a, b in zip(cuda, torch.cuda.get_rng_state_all())):
            bad.append("CUDA RNG state")
        if self.tracker is not None:
            now = self.tracker.get_states()
            bad += [f"TP RNG tracker '{k}'" for k in tr if k not in now or not torch.equal(tr[k], now[k])]
        if not self._same(self.data, self._data()):
            bad.append("data iterator position (read-ahead batches)")
        return sorted(bad)


# ---------------------------------------------------------------------------------------------
# The callback
# ---------------------------------------------------------------------------------------------

def init_args_from_megatron(args: argparse.Namespace):
    """The ``initialize_ub`` arguments Megatron used (mirrors ``_initialize_tp_communicators``)."""
    from transformer_engine.pytorch.module.base import UserBufferQuantizationMode as Q

    from ..ub_runtime import UbInitArgs, last_captured
    captured = last_captured()
    if captured is not None:
        return captured
    seq = args.decoder_seq_length if getattr(args, "decoder_tp_comm_overlap", False) else args.seq_length
    modes = [Q.FP8 if args.fp8 else Q.NONE]
    if args.fp8 is not None and getattr(args, "first_last_layers_bf16", False) and (
            getattr(args, "num_layers_at_start_in_bf16", 0) > 0 or getattr(args, "num_layers_at_end_in_bf16", 0) > 0):
        modes.append(Q.NONE)
    import torch
    return UbInitArgs(shape=[(seq * args.micro_batch_size) // args.context_parallel_size, args.hidden_size],
                      tp_size=args.tensor_model_parallel_size, quantization_modes=modes,
                      dtype=torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32,
                      bootstrap_backend=args.tp_comm_bootstrap_backend)


class TPOverlapAutotuneCallback:
    """Tunes the userbuffers config on the live Megatron model; called before the first iteration."""

    hooks: list[Callable[[Any, Path], None]] = []  # called with (TuneResult, yaml path) after tuning

    def __init__(self, args: argparse.Namespace, log: Callable[..., None] | None = None):
        self.args = args
        from ..tuner import rank0_print
        self.log = log or rank0_print
        self.result = None

    def __call__(self, forward_step_func: Callable, model: list, optimizer: Any, train_data_iterator: Any) -> Any:
        """Tune; returns the data iterator the main loop must use (same batches, same order)."""
        import torch
        import transformer_engine

        from megatron.core.num_microbatches_calculator import get_num_microbatches
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from ..numerics import Fingerprint
        from ..report import write_report, yaml_header
        from ..search import SearchOptions
        from ..space import SpaceSpec
        from ..tuner import Autotuner
        from ..ub_config import UbConfig, dumps_yaml, load_yaml

        args = self.args
        t0 = time.perf_counter()
        out = output_path(args)
        key = tuning_key(args, torch.cuda.get_device_name(), transformer_engine.__version__)
        init = init_args_from_megatron(args)
        reference = load_yaml(args.tp_comm_overlap_cfg) if args.tp_comm_overlap_cfg else UbConfig()

        if getattr(args, "tp_comm_overlap_autotune_reuse", False):
            reused = self._reusable(out, key)
            if reused is not None:
                from ..space import TuningConfig
                from ..topology import find_overlap_modules
                from ..ub_runtime import UbSwitcher
                UbSwitcher(init, find_overlap_modules(model), barrier=torch.distributed.barrier,
                           current=TuningConfig(reference)).apply(TuningConfig(reused, frozenset(), "reused"))
                self.log(f"[tp-overlap-autotune] reusing {out} (tuned for the same {', '.join(key)}): skipping tuning")
                return train_data_iterator

        iters = train_data_iterator if isinstance(train_data_iterator, list) else [train_data_iterator]
        pairs = [attach_replay(it) for it in iters]
        main_iters = [p[0] for p in pairs]
        n_mb = get_num_microbatches()
        cached = [r.read_ahead(n_mb) if r is not None else None for _, r in pairs]
        fb = get_forward_backward_func()
        snapshot = StateSnapshot.take(model)
        fp = Fingerprint()

        from megatron.core.rerun_state_machine import RerunDataIterator, get_rerun_state_machine
        rerun = get_rerun_state_machine()

        def data() -> Any:
            its = [RerunDataIterator(iter(c)) if c is not None else None for c in cached]
            return its if isinstance(train_data_iterator, list) else its[0]

        def zero() -> None:
            for chunk in model:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()

        def run() -> list:
            # Megatron's protocol (as train_step): loss validation is only legal inside this loop.
            it, losses = data(), []
            while rerun.should_run_forward_backward(it):
                losses = fb(forward_step_func=forward_step_func, data_iterator=it, model=model, num_microbatches=n_mb,
                            seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                            decoder_seq_length=args.decoder_seq_length, forward_only=False)
            return losses

        def step() -> None:
            run()
            zero()

        def fingerprint() -> torch.Tensor:
            snapshot.restore()  # same dropout masks for every config: dropout is on by default in Megatron
            zero()
            losses = run()
            vals = [torch.stack([v[0] if v.dim() else v for d in losses for v in d.values()]).float()] if losses else [None]
            grads = [getattr(p, "main_grad", p.grad) for chunk in model for p in chunk.parameters() if p.requires_grad]
            f = fp(vals + grads)
            zero()
            return f

        allow_off = getattr(args, "tp_comm_overlap_autotune_allow_off", False)
        opts = SearchOptions(strategy=args.tp_comm_overlap_autotune_strategy, max_steps=args.tp_comm_overlap_autotune_steps,
                             max_seconds=args.tp_comm_overlap_autotune_seconds)
        from ..progress import TuningProgress
        progress = TuningProgress(enabled=torch.distributed.get_rank() == 0)
        # Megatron builds every qkv/fc1 layer with bulk dgrad, or with GEMM+reduce-scatter dgrad under
        # --tp-comm-overlap-rs-dgrad; the YAML cannot change that, so the search keeps to the mode the
        # run was started with (else the tuned YAML would not reproduce the tuned run).
        rs_dgrad = bool(getattr(args, "tp_comm_overlap_rs_dgrad", False))
        spec = SpaceSpec(include_off=allow_off, include_rs_dgrad=rs_dgrad, include_bulk_dgrad=not rs_dgrad)
        tuner = Autotuner(model, step, init, reference=reference, options=opts, space_spec=spec,
                          verify_fn=fingerprint, verify_rtol=args.tp_comm_overlap_autotune_rtol, allow_overlap_off=allow_off,
                          log=self.log, progress=progress.update,
                          trial_timeout_s=args.tp_comm_overlap_autotune_trial_timeout)
        # Megatron's own NaN/spike checks are fatal; during trials our numerics guard rejects such a
        # candidate instead of ending the job.
        checks = {k: getattr(args, k, False) for k in ("check_for_nan_in_loss_and_grad", "check_for_spiky_loss")}
        zero()
        state_check = (StateCheck(model, optimizer, replays=[r for _, r in pairs])
                       if os.environ.get("MEGATRON_TP_OVERLAP_CHECK_STATE") == "1" else None)
        try:
            for k in checks:
                setattr(args, k, False)
            with progress:
                res = tuner.tune()
        finally:
            for k, v in checks.items():
                setattr(args, k, v)
            zero()
            snapshot.restore()
        self.result = res
        self.log(res.summary)
        if state_check is not None:
            bad = state_check.mismatches()
            covered = state_check.kinds_checked()
            if bad:
                print(f"[tp-overlap-autotune] rank {torch.distributed.get_rank()}: training state CHANGED by tuning: {bad}", flush=True)
            n_bad = torch.tensor([float(len(bad))], device="cuda")
            torch.distributed.all_reduce(n_bad, op=torch.distributed.ReduceOp.MAX)  # the verdict covers every rank
            bad = bad or (["(on another rank)"] if n_bad.item() else [])
            res.report["state_check"] = {"result": "bitwise identical on every rank" if not bad else "CHANGED",
                                         "changed_rank0": bad, "checked_rank0": covered}
            self.log("[tp-overlap-autotune] training state after tuning: "
                     + (f"bitwise identical ({', '.join(f'{v} {k}' for k, v in covered.items())}, RNG CPU/CUDA/TP tracker)"
                        if not bad else f"CHANGED: {bad[:8]}"))

        meta = {**key, "wall_s": round(time.perf_counter() - t0, 2), "chosen": res.best.label}
        flags, _ = flags_for(res.best.ub, out)  # the search kept to this run's dgrad mode: always expressible
        if torch.distributed.get_rank() == 0:
            atomic_write_text(out, dumps_yaml(res.best.ub, yaml_header(res.best.ub, meta)), backup=True)
            report = {**res.report, "tuning_key": key, "megatron_flags": flags}
            write_report(out.with_suffix(".report.json"), report)
            atomic_write_text(out.with_suffix(".key.json"), json.dumps(key, indent=1) + "\n")
        self._tensorboard(res)  # Megatron makes its writer on the last rank only: every rank asks
        for hook in self.hooks:
            hook(res, out)
        torch.distributed.barrier()
        self.log(f"[tp-overlap-autotune] wrote {out} ({res.best.label}; {res.wall_s:.1f} s, {res.switches} switches); "
                 f"reproduce with: {' '.join(flags)}")
        return main_iters if isinstance(train_data_iterator, list) else main_iters[0]

    @staticmethod
    def _tensorboard(res: Any) -> None:
        """Tuning results into Megatron's TensorBoard writer, on the rank that has one (the last)."""
        try:
            from megatron.training import get_tensorboard_writer
        except ImportError:  # Megatron-Bridge runs without megatron.training's globals
            return
        writer = get_tensorboard_writer()
        if writer is None:
            return
        for c in res.search.contenders:
            if c.samples:
                writer.add_scalar(f"tp-overlap-autotune/step-ms/{c.name}", c.median, 0)
        writer.add_scalar("tp-overlap-autotune/tuning-seconds", res.wall_s, 0)
        writer.add_text("tp-overlap-autotune/summary", f"<pre>{res.summary}</pre>", 0)
        writer.flush()

    @staticmethod
    def _reusable(out: Path, key: dict[str, Any]):
        from ..ub_config import load_yaml
        keyfile = out.with_suffix(".key.json")
        try:
            if out.exists() and keyfile.exists() and json.loads(keyfile.read_text()) == key:
                return load_yaml(out)
        except (OSError, ValueError, ConfigError):
            return None
        return None


# ---------------------------------------------------------------------------------------------
# Installation into Megatron
# ---------------------------------------------------------------------------------------------

_installed = False


def _helpers_importable() -> bool:
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
        return True
    except ImportError:
        return False


def guarded_compile_helpers(original: Callable[[], None]) -> Callable[[], None]:
    """``compile_helpers`` that skips ``make`` when the compiled dataset helpers already import."""
    def compile_helpers() -> None:
        if _helpers_importable():  # pip wheel: compiled, no Makefile
            return
        original()
    return compile_helpers


DETERMINISTIC_ENV = "MEGATRON_TP_OVERLAP_DETERMINISTIC"


def deterministic_with_overlap() -> None:
    """What Megatron's ``--deterministic-mode`` sets up, for runs with ``--tp-comm-overlap`` (which that
    flag refuses): the NCCL/cuBLAS/TE environment for deterministic kernels and
    ``torch.use_deterministic_algorithms`` (warn-only). Must run before the first NCCL/cuBLAS/TE call.
    Enabled by MEGATRON_TP_OVERLAP_DETERMINISTIC=1 (bitwise run-to-run comparisons)."""
    import torch
    try:
        from megatron.training.determinism import apply_determinism_env
        apply_determinism_env(os.environ)
    except ImportError:  # older Megatron: the same defaults
        for k, v in {"NCCL_ALGO": "Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
                     "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}.items():
            os.environ.setdefault(k, v)
    torch.use_deterministic_algorithms(True, warn_only=True)


def install() -> None:
    """Patch Megatron (idempotent). Call before ``parse_and_validate_args`` / ``pretrain``."""
    global _installed
    if _installed:
        return
    import megatron.core.datasets.utils as ds_utils
    import megatron.training.arguments as margs
    import megatron.training.training as mtraining

    if os.environ.get(DETERMINISTIC_ENV) == "1":
        deterministic_with_overlap()

    original_parse = margs.parse_args

    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        def provider(parser):
            parser = extra_args_provider(parser) if extra_args_provider is not None else parser
            return add_arguments(parser)
        args = original_parse(provider, ignore_unknown_args)
        try:
            import transformer_engine.pytorch  # noqa: F401
            te_ok = True
        except ImportError:
            te_ok = False
        problems = check_arguments(args, te_ok)
        if problems:
            raise SystemExit("megatron-tp-overlap: cannot autotune with these flags:\n" + "\n".join(f"  - {p}" for p in problems))
        return args

    margs.parse_args = parse_args

    ds_utils.compile_helpers = guarded_compile_helpers(ds_utils.compile_helpers)

    original_train = mtraining.train

    def train(forward_step_func, model, optimizer, opt_param_scheduler, train_data_iterator, *rest, **kw):
        from megatron.training import get_args
        args = get_args()
        if getattr(args, "tp_comm_overlap_autotune", False):
            train_data_iterator = TPOverlapAutotuneCallback(args)(forward_step_func, model, optimizer, train_data_iterator)
        return original_train(forward_step_func, model, optimizer, opt_param_scheduler, train_data_iterator, *rest, **kw)

    mtraining.train = train

    loss_log = os.environ.get("MEGATRON_TP_OVERLAP_LOSS_LOG")  # test-only: exact losses per iteration
    if loss_log:
        original_log = mtraining.training_log

        def training_log(loss_dict, total_loss_dict, learning_rate, iteration, *rest, **kw):
            if loss_dict:
                vals = {k: float(v.item() if hasattr(v, "item") else v) for k, v in loss_dict.items()}
                with open(f"{loss_log}.rank{int(os.environ.get('RANK', 0))}", "a") as f:
                    f.write(json.dumps({"iteration": iteration, "t": time.time(), **{k: repr(v) for k, v in vals.items()}}) + "\n")
            return original_log(loss_dict, total_loss_dict, learning_rate, iteration, *rest, **kw)

        mtraining.training_log = training_log
    _installed = True
