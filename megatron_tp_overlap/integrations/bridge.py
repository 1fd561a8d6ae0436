"""Megatron-Bridge: ``--tp-comm-overlap-autotune`` for Bridge recipes.

In a recipe, use :class:`AutotuneCommOverlapConfig` where Bridge takes its ``CommOverlapConfig``::

    from megatron_tp_overlap.integrations.bridge import AutotuneCommOverlapConfig
    cfg.comm_overlap = AutotuneCommOverlapConfig(tp_comm_overlap=True, tp_comm_overlap_autotune_seconds=60)

Its fields are reachable by Bridge's Hydra-style overrides, e.g.
``comm_overlap.tp_comm_overlap_autotune_seconds=30`` or ``comm_overlap.tp_comm_overlap_autotune=false``.
Before Bridge's training loop starts, the tuner runs on the live model with micro-batches read ahead
from the real data iterator (the loop then gets the same batches), exactly as in the Megatron-LM
integration (:class:`~megatron_tp_overlap.integrations.megatron.TPOverlapAutotuneCallback`, which it
reuses through :func:`megatron_args`). The winner is applied, written as a YAML (plus report), and
set as the run's ``tp_comm_overlap_cfg`` (model config: the YAML path; comm-overlap config: the
``TransformerLayerTPOverlapCfg``), so a saved run config reproduces it.

Written against Megatron-Bridge 0.6 (``megatron.bridge.training.pretrain``/``train``). Importing this
module imports Megatron-Bridge.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from megatron.bridge.training.comm_overlap import CommOverlapConfig

from . import megatron as mlm

_installed = False


@dataclass(kw_only=True)
class AutotuneCommOverlapConfig(CommOverlapConfig):
    """Bridge's ``CommOverlapConfig`` plus the autotune options (same meaning as the Megatron-LM flags
    ``--tp-comm-overlap-autotune-*``)."""

    tp_comm_overlap_autotune: bool = True
    tp_comm_overlap_autotune_seconds: float = 60.0
    tp_comm_overlap_autotune_steps: int = 400
    tp_comm_overlap_autotune_strategy: str = "coordinate"
    tp_comm_overlap_autotune_output: Optional[str] = None
    tp_comm_overlap_autotune_reuse: bool = False
    tp_comm_overlap_autotune_allow_off: bool = False
    tp_comm_overlap_autotune_rtol: float = 2e-2
    tp_comm_overlap_autotune_trial_timeout: float = 120.0

    def __post_init__(self) -> None:
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
        install()

    def problems(self) -> list[str]:
        """Bad option values (checked when Bridge finalizes its config, before any GPU work)."""
        p = []
        if not self.tp_comm_overlap_autotune:
            return p
        if not self.tp_comm_overlap:
            p.append("comm_overlap.tp_comm_overlap_autotune needs comm_overlap.tp_comm_overlap=true")
        return p + mlm.option_problems(lambda k: getattr(self, f"tp_comm_overlap_autotune_{k}"),
                                       lambda k: f"comm_overlap.tp_comm_overlap_autotune_{k}")

    def finalize(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("megatron-tp-overlap: invalid autotune options:\n" + "\n".join(f"  - {x}" for x in problems))
        super().finalize()


def megatron_args(cfg: Any, overlap: AutotuneCommOverlapConfig, reference_yaml: str | None) -> argparse.Namespace:
    """The Megatron-LM argument names the tuning callback reads, from a Bridge ``ConfigContainer``."""
    m = cfg.model
    kv = getattr(m, "num_query_groups", None)
    save = getattr(getattr(cfg, "checkpoint", None), "save", None)
    return argparse.Namespace(
        tp_comm_overlap=bool(getattr(m, "tp_comm_overlap", False)), sequence_parallel=bool(m.sequence_parallel),
        tensor_model_parallel_size=m.tensor_model_parallel_size, context_parallel_size=getattr(m, "context_parallel_size", 1),
        transformer_impl="transformer_engine", seq_length=m.seq_length, decoder_seq_length=None,
        decoder_tp_comm_overlap=False, micro_batch_size=cfg.train.micro_batch_size, hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size, num_attention_heads=m.num_attention_heads, num_query_groups=kv,
        group_query_attention=kv is not None and kv != m.num_attention_heads,
        fp8=getattr(m, "fp8", None), fp16=bool(getattr(m, "fp16", False)), bf16=bool(getattr(m, "bf16", False)),
        first_last_layers_bf16=bool(getattr(m, "first_last_layers_bf16", False)),
        num_layers_at_start_in_bf16=getattr(m, "num_layers_at_start_in_bf16", 0) or 0,
        num_layers_at_end_in_bf16=getattr(m, "num_layers_at_end_in_bf16", 0) or 0,
        tp_comm_bootstrap_backend=getattr(m, "tp_comm_bootstrap_backend", None) or "nccl",
        tp_comm_overlap_rs_dgrad=bool(getattr(m, "tp_comm_overlap_rs_dgrad", False)),
        tp_comm_overlap_cfg=reference_yaml, save=save,
        **{f.name: getattr(overlap, f.name) for f in dataclasses.fields(AutotuneCommOverlapConfig)
           if f.name.startswith("tp_comm_overlap_autotune")})


def reference_yaml(model_cfg: Any, out: Path) -> str | None:
    """The config the run would use without tuning, as a YAML path: Bridge holds a path, a dict
    (``asdict`` of its dataclass) or None (TE defaults)."""
    ub = getattr(model_cfg, "tp_comm_overlap_cfg", None)
    if ub is None or isinstance(ub, (str, Path)):
        return str(ub) if ub is not None else None
    from ..atomic import atomic_write_text
    from ..ub_config import dumps_yaml
    from .layer_cfg import from_layer_cfg
    path = out.with_name(out.stem + ".reference.yaml")
    atomic_write_text(path, dumps_yaml(from_layer_cfg(ub), header="the run's tp_comm_overlap_cfg before tuning"))
    return str(path)


def tune_before_training(state: Any, forward_step_func: Any, model: list, optimizer: Any, train_data_iterator: Any) -> Any:
    """Tune if the run's ``comm_overlap`` asks for it; returns the data iterator the loop must use."""
    overlap = getattr(state.cfg, "comm_overlap", None)
    if not isinstance(overlap, AutotuneCommOverlapConfig) or not overlap.tp_comm_overlap_autotune:
        return train_data_iterator
    import torch
    from megatron.bridge.training.utils.train_utils import prepare_forward_step_func

    out = Path(overlap.tp_comm_overlap_autotune_output or Path(getattr(state.cfg.checkpoint, "save", None) or ".")
               / "tp_comm_overlap_tuned.yaml")
    ref = reference_yaml(state.cfg.model, out) if torch.distributed.get_rank() == 0 else None
    holder = [ref]
    torch.distributed.broadcast_object_list(holder, src=0)
    args = megatron_args(state.cfg, overlap, holder[0])
    args.tp_comm_overlap_autotune_output = str(out)
    problems = mlm.check_arguments(args)
    if problems:
        raise SystemExit("megatron-tp-overlap: cannot autotune this Megatron-Bridge run:\n" + "\n".join(f"  - {p}" for p in problems))
    callback = mlm.TPOverlapAutotuneCallback(args)
    it = callback(prepare_forward_step_func(forward_step_func, state), model, optimizer, train_data_iterator)
    if callback.result is not None:  # what the rest of the run (and a saved config) uses
        from .layer_cfg import framework_classes, to_layer_cfg
        state.cfg.model.tp_comm_overlap_cfg = str(out)
        try:
            overlap.tp_comm_overlap_cfg = to_layer_cfg(callback.result.best.ub, args.tensor_model_parallel_size,
                                                       framework_classes())
        except ValueError:  # a GEMM the dataclass cannot hold: the YAML path above still says it all
            overlap.tp_comm_overlap_cfg = None
    return it


def install() -> None:
    """Run the tuner before Bridge's training loop (idempotent): wraps the ``train`` that
    ``megatron.bridge.training.pretrain`` calls."""
    global _installed
    if _installed:
        return
    import megatron.bridge.training.pretrain as bridge_pretrain

    original = bridge_pretrain.train

    def train(forward_step_func, model, optimizer, scheduler, train_data_iterator, valid_data_iterator, global_state,
              *rest, **kw):
        train_data_iterator = tune_before_training(global_state, forward_step_func, model, optimizer, train_data_iterator)
        return original(forward_step_func, model, optimizer, scheduler, train_data_iterator, valid_data_iterator,
                        global_state, *rest, **kw)

    bridge_pretrain.train = train
    _installed = True
