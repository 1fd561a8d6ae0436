"""Megatron-Bridge: ``--tp-comm-overlap-autotune`` for Bridge recipes.

In a recipe, use :class:`AutotuneCommOverlapConfig` where Bridge takes its ``CommOverlapConfig``::

    from megatron_tp_overlap.integrations.bridge import AutotuneCommOverlapConfig
    cfg.comm_overlap = AutotuneCommOverlapConfig(tp_comm_overlap=True, tp_comm_overlap_autotune_seconds=120)

Its fields are Bridge's plus ``tp_comm_overlap_autotune`` and one ``tp_comm_overlap_autotune_<option>`` per
:class:`~engine.options.TuneOptions` field (generated from it), reachable by Bridge's Hydra-style overrides,
e.g. ``comm_overlap.tp_comm_overlap_autotune_seconds=30``. Before Bridge's training loop starts,
:func:`~integrations.megatron.tuning.tune` runs on the live model with micro-batches read ahead from the real
data iterator (the loop then gets the same batches). The winner is applied, written as a YAML (plus report),
and set as the run's ``tp_comm_overlap_cfg`` (model config: the YAML path; comm-overlap config: the
``TransformerLayerTPOverlapCfg``), so a saved run config reproduces it.

Written against Megatron-Bridge 0.6 (``megatron.bridge.training.pretrain``/``train``). Importing this module
imports Megatron-Bridge.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from megatron.bridge.training.comm_overlap import CommOverlapConfig

from megatron_tp_overlap.engine.options import PREFIX, TuneOptions, option_fields
from megatron_tp_overlap.integrations.megatron.flags import default_output, follow_fields, output_problems
from megatron_tp_overlap.integrations.megatron.graphs import Capture
from megatron_tp_overlap.integrations.megatron.launcher import _minutes, guarded_compile_helpers, verifying
from megatron_tp_overlap.integrations.megatron.recompute import Recompute
from megatron_tp_overlap.integrations.megatron.run_shape import RunShape
from megatron_tp_overlap.ub.layer_cfg import reference_config
from megatron_tp_overlap.ub.preset_shape import preset_named_in

_installed = False


class _AutotuneMethods:
    def __post_init__(self) -> None:
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
        install()

    @property
    def tune_options(self) -> TuneOptions:
        return TuneOptions.from_prefixed(vars(self))

    def problems(self) -> list[str]:
        """Bad option values (checked when Bridge finalizes its config, before any GPU work)."""
        if not getattr(self, PREFIX):
            return []
        p = [] if self.tp_comm_overlap else [f"comm_overlap.{PREFIX} needs comm_overlap.tp_comm_overlap=true"]
        return p + self.tune_options.problems(lambda k: f"comm_overlap.{PREFIX}_{k}")

    def finalize(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError(
                "megatron-tp-overlap: invalid autotune options:\n" + "\n".join(f"  - {x}" for x in problems)
            )
        super().finalize()  # type: ignore[misc]


AutotuneCommOverlapConfig = dataclasses.make_dataclass(
    "AutotuneCommOverlapConfig",
    [(PREFIX, bool, dataclasses.field(default=True))]
    + [(f"{PREFIX}_{f.name}", f.type, dataclasses.field(default=f.default)) for f in option_fields()],
    bases=(_AutotuneMethods, CommOverlapConfig),
    kw_only=True,
)
AutotuneCommOverlapConfig.__module__ = __name__
AutotuneCommOverlapConfig.__doc__ = (
    "Bridge's ``CommOverlapConfig`` plus the autotune options (the Megatron-LM flags "
    "``--tp-comm-overlap-autotune-*``, as fields)."
)


def tune_before_training(
    state: Any, forward_step_func: Any, model: list, optimizer: Any, train_data_iterator: Any
) -> Any:
    """Tune if the run's ``comm_overlap`` asks for it; returns the data iterator the loop must use and the in-run
    verification its ``train_step`` must drive (or None)."""
    overlap = getattr(state.cfg, "comm_overlap", None)
    if not isinstance(overlap, AutotuneCommOverlapConfig) or not getattr(overlap, PREFIX):
        return train_data_iterator, None
    from megatron.bridge.training.utils.train_utils import prepare_forward_step_func

    from megatron_tp_overlap.integrations.megatron.tuning import hand_over, tune

    options = overlap.tune_options
    run = RunShape.from_transformer_config(
        state.cfg.model, state.cfg.train.micro_batch_size, getattr(overlap, "tp_comm_bootstrap_backend", None)
    )
    out = default_output(options.output, None, getattr(getattr(state.cfg, "checkpoint", None), "save", None))
    problems = run.problems() + output_problems(out, f"comm_overlap.{PREFIX}_output")
    if problems:
        raise SystemExit(
            "megatron-tp-overlap: cannot autotune this Megatron-Bridge run:\n" + "\n".join(f"  - {p}" for p in problems)
        )
    tuned = tune(
        model,
        prepare_forward_step_func(forward_step_func, state),
        optimizer,
        train_data_iterator,
        run,
        options,
        reference_config(getattr(state.cfg.model, "tp_comm_overlap_cfg", None)),
        out,
        remaining_iters=_remaining_iters(state),
        # Bridge's loop captures as Megatron-LM's (train.py), skipped iterations aside
        capture=Capture.of(state.cfg.model, getattr(state.cfg.train, "iterations_to_skip", None) or (), bridge=True),
        recompute=Recompute.of(state.cfg.model),
        reference_name=preset_named_in(getattr(state.cfg.model, "tp_comm_overlap_cfg", None)),
        distributed_timeout_s=_minutes(getattr(getattr(state.cfg, "dist", None), "distributed_timeout_minutes", None)),
    )
    if getattr(tuned, "yaml_written", True):  # else the starting YAML stays: a saved config must name a file
        state.cfg.model.tp_comm_overlap_cfg = str(out)  # what the rest of the run (and a saved config) uses
    follow = follow_recipe(tuned, run.tp, state.cfg.model, overlap)
    follow(getattr(tuned, "recipe", None))
    if hasattr(tuned, "on_recipe"):
        tuned.on_recipe.append(follow)  # the in-run verification may change the config (either way)
    return hand_over(tuned), getattr(tuned, "verification", None)


def _remaining_iters(state: Any) -> int | None:
    """Training iterations the Bridge run has left (None when it counts samples, not iterations)."""
    total = getattr(getattr(state.cfg, "train", None), "train_iters", None)
    done = getattr(getattr(state, "train_state", None), "step", 0) or 0
    return total - done if isinstance(total, int) and total > 0 else None


def follow_recipe(tuned: Any, tp: int, model_cfg: Any, overlap: Any) -> Callable[[Any], None]:
    """Keeps the run's configs saying what its recipe says: the model config's kind-switch and dgrad-mode fields
    (:func:`~integrations.megatron.flags.follow_fields`), ``tp_comm_overlap`` of both configs (False when no
    overlap won) and the comm-overlap config's ``TransformerLayerTPOverlapCfg`` (of ``tuned.config``, which the
    in-run verification may change), so that a config saved with a checkpoint reproduces the tuned run."""
    from megatron_tp_overlap.ub.layer_cfg import framework_classes, to_layer_cfg

    fields = follow_fields(model_cfg)

    def apply(recipe: Any) -> None:
        if recipe is not None:
            fields(recipe)
            overlap.tp_comm_overlap = recipe.fields.get("tp_comm_overlap", True)
        try:
            overlap.tp_comm_overlap_cfg = to_layer_cfg(tuned.config.ub, tp, framework_classes())
        except ValueError:  # a GEMM the dataclass cannot hold: the model config's YAML path still says it all
            overlap.tp_comm_overlap_cfg = None

    return apply


def install() -> None:
    """Run the tuner before Bridge's training loop (idempotent): wraps the ``train`` that
    ``megatron.bridge.training.pretrain`` calls."""
    global _installed
    if _installed:
        return
    import megatron.bridge.training.initialize as bridge_initialize
    import megatron.bridge.training.pretrain as bridge_pretrain
    import megatron.bridge.training.train as bridge_train

    # Bridge imports compile_helpers by name: the same guard as for Megatron-LM (pip wheel: no Makefile)
    bridge_initialize.compile_helpers = guarded_compile_helpers(bridge_initialize.compile_helpers)
    original = bridge_pretrain.train

    def train(
        forward_step_func,
        model,
        optimizer,
        scheduler,
        train_data_iterator,
        valid_data_iterator,
        global_state,
        *rest,
        **kw,
    ):
        train_data_iterator, verification = tune_before_training(
            global_state, forward_step_func, model, optimizer, train_data_iterator
        )
        with verifying(bridge_train, "train_step", verification):
            return original(
                forward_step_func,
                model,
                optimizer,
                scheduler,
                train_data_iterator,
                valid_data_iterator,
                global_state,
                *rest,
                **kw,
            )

    bridge_pretrain.train = train
    _installed = True
