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
from .megatron import AUTOTUNE_DEFAULTS

_installed = False


@dataclass(kw_only=True)
class AutotuneCommOverlapConfig(CommOverlapConfig):
    """Bridge's ``CommOverlapConfig`` plus the autotune options (same meaning as the Megatron-LM flags
    ``--tp-comm-overlap-autotune-*``)."""

    tp_comm_overlap_autotune: bool = AUTOTUNE_DEFAULTS["tp_comm_overlap_autotune"]
    tp_comm_overlap_autotune_seconds: float = AUTOTUNE_DEFAULTS["tp_comm_overlap_autotune_seconds"]
    tp_comm_overlap_autotune_steps: int = AUTOTUNE_DEFAULTS["tp_comm_overlap_autotune_steps"]
    tp_comm_overlap_autotune_strategy: str = AUTOTUNE_DEFAULTS["tp_comm_overlap_autotune_strategy"]
    tp_comm_overlap_autotune_output: Optional[str] = AUTOTUNE_DEFAULTS["tp_comm_overlap_autotune_output"]
    tp_comm_overlap_autotune_reuse: bool = AUTOTUNE_DEFAULTS["tp_comm_overlap_autotune_reuse"]
    tp_comm_overlap_autotune_allow_off: bool = AUTOTUNE_DEFAULTS["tp_comm_overlap_autotune_allow_off"]
    tp_comm_overlap_autotune_rtol: float = AUTOTUNE_DEFAULTS["tp_comm_overlap_autotune_rtol"]
    tp_comm_overlap_autotune_trial_timeout: float = AUTOTUNE_DEFAULTS["tp_comm_overlap_autotune_trial_timeout"]

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
    options = {f.name: getattr(overlap, f.name) for f in dataclasses.fields(AutotuneCommOverlapConfig)
               if f.name.startswith("tp_comm_overlap_autotune")}
    return mlm.args_from_transformer_config(cfg.model, cfg.train.micro_batch_size, options, reference_yaml,
                                            getattr(getattr(cfg, "checkpoint", None), "save", None))


def reference_yaml(model_cfg: Any, out: Path) -> str | None:
    """The config the run would use without tuning, as a YAML path (see :func:`layer_cfg.reference_yaml`)."""
    from .layer_cfg import reference_yaml as write_reference
    return write_reference(getattr(model_cfg, "tp_comm_overlap_cfg", None), out)


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
    import megatron.bridge.training.initialize as bridge_initialize
    import megatron.bridge.training.pretrain as bridge_pretrain

    # Bridge imports compile_helpers by name: the same guard as for Megatron-LM (pip wheel: no Makefile)
    bridge_initialize.compile_helpers = mlm.guarded_compile_helpers(bridge_initialize.compile_helpers)
    original = bridge_pretrain.train

    def train(forward_step_func, model, optimizer, scheduler, train_data_iterator, valid_data_iterator, global_state,
              *rest, **kw):
        train_data_iterator = tune_before_training(global_state, forward_step_func, model, optimizer, train_data_iterator)
        return original(forward_step_func, model, optimizer, scheduler, train_data_iterator, valid_data_iterator,
                        global_state, *rest, **kw)

    bridge_pretrain.train = train
    _installed = True
