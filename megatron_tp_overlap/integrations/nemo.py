"""NeMo 2 (Lightning): NeMo's ``MegatronCommOverlapCallback`` plus one-switch autotune.

    from megatron_tp_overlap.integrations.nemo import AutotuneCommOverlapCallback
    trainer = nl.Trainer(strategy=nl.MegatronStrategy(tensor_model_parallel_size=4, sequence_parallel=True),
                         callbacks=[AutotuneCommOverlapCallback(tp_comm_overlap=True,
                                                                tp_comm_overlap_autotune_seconds=120)])

It takes every argument of NeMo's callback (``tp_comm_overlap_cfg`` is the preset to start from, a
``TransformerLayerTPOverlapCfg``) plus the autotune options, named as Bridge's fields and the Megatron-LM
flags (``tp_comm_overlap_autotune_seconds`` = ``--tp-comm-overlap-autotune-seconds``). NeMo's own callback
configures the model and initializes userbuffers in ``on_fit_start``, before the first step; this one then
tunes inside the first training step: it reads that step's micro-batches ahead from the step's data
iterator, runs the trial steps through NeMo's own Megatron forward step (``MegatronParallel.
wrapped_forward_step`` with the module's training data/forward/loss steps) using the Megatron-LM
integration's :func:`~integrations.megatron.tuning.tune` (no optimizer step, gradients zeroed, RNG and FP8
state restored), and hands the step the same batches.
The tuned config is applied and written as a YAML plus report and recipe; the callback's arguments and the model
config (with its ``__io__`` copy that a checkpoint saves) then say what the recipe says, and follow the in-run
verification's verdict.

Written against NeMo 2.7 (``nemo.lightning``), the last NeMo with the NeMo 2 LLM stack. NeMo 2.7 does not
import with megatron-core 0.19 (its GPT model imports
``megatron.core.inference.model_inference_wrappers.inference_wrapper_config``, gone in 0.19), so this
module has not run on a GPU: it is tested on CPU against stand-ins and against NeMo 2.7.3's real classes
(with megatron-core 0.16, `tests/test_nemo_real.py`); see the README.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import nemo.collections.llm  # noqa: F401  # first: NeMo's callback module imports recipes that import it back
from nemo.lightning.pytorch.callbacks.megatron_comm_overlap import MegatronCommOverlapCallback

from megatron_tp_overlap.engine.options import PREFIX, TuneOptions, unknown_prefixed
from megatron_tp_overlap.integrations.megatron.flags import default_output, output_problems
from megatron_tp_overlap.integrations.megatron.run_shape import RunShape


class AutotuneCommOverlapCallback(MegatronCommOverlapCallback):
    """NeMo's ``MegatronCommOverlapCallback`` that also tunes ``tp_comm_overlap_cfg`` in the first step.

    Takes NeMo's arguments plus ``tp_comm_overlap_autotune`` (default True) and one
    ``tp_comm_overlap_autotune_<option>`` per :class:`~engine.options.TuneOptions` field.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        ours = {k: kwargs.pop(k) for k in list(kwargs) if k == PREFIX or k.startswith(PREFIX + "_")}
        problems = unknown_prefixed(ours)
        if problems:
            raise TypeError("AutotuneCommOverlapCallback: " + "; ".join(problems))
        super().__init__(*args, **kwargs)
        self.autotune = bool(ours.pop(PREFIX, True))
        self.options = TuneOptions.from_prefixed(ours)
        problems = self.problems()
        if problems:
            raise ValueError(
                "megatron-tp-overlap: invalid AutotuneCommOverlapCallback arguments:\n"
                + "\n".join(f"  - {p}" for p in problems)
            )
        self.tuned = None  # integrations.megatron.tuning.Tuned, after the first step

    def problems(self) -> list[str]:
        """Bad arguments (checked when the callback is made, before any GPU work)."""
        if not self.autotune:
            return []
        p = [] if self.user_comm_overlap_cfg.tp_comm_overlap is True else [f"{PREFIX} needs tp_comm_overlap=True"]
        return p + self.options.problems(lambda k: f"{PREFIX}_{k}")

    # -- Lightning hooks -------------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        parallelism = trainer.strategy.parallelism
        if self.autotune and stage == "fit":  # NeMo would only warn and switch the overlap off
            p = []
            if parallelism.tensor_model_parallel_size < 2:
                p.append(
                    f"MegatronStrategy(tensor_model_parallel_size={parallelism.tensor_model_parallel_size}): "
                    f"{PREFIX} needs >= 2"
                )
            if not parallelism.sequence_parallel:
                p.append(f"MegatronStrategy(sequence_parallel=False): {PREFIX} needs sequence_parallel=True")
            p += output_problems(self.output_path(trainer), f"{PREFIX}_output")
            if p:
                raise ValueError("megatron-tp-overlap: cannot autotune this run:\n" + "\n".join(f"  - {x}" for x in p))
        super().setup(trainer, pl_module, stage)
        config = getattr(trainer.model, "config", None)
        if self.autotune and stage == "fit" and config is not None and not getattr(config, "tp_comm_overlap", False):
            raise ValueError(
                "megatron-tp-overlap: NeMo switched tensor-parallel overlap off for this run (its warning "
                f"says why, e.g. Transformer Engine not found); {PREFIX} needs it on"
            )

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Userbuffers are up (``on_fit_start``): tune inside the first training step."""
        if not self.autotune or not getattr(trainer.model.config, "tp_comm_overlap", False) or self.tuned is not None:
            return
        strategy = trainer.strategy
        original = strategy.training_step

        def training_step(dataloader_iter: Any, *args: Any, **kwargs: Any) -> Any:
            strategy.training_step = original  # the first step only
            return original(self.tune(trainer, dataloader_iter), *args, **kwargs)

        strategy.training_step = training_step

    def _verification(self) -> Any:
        v = getattr(self.tuned, "verification", None) if self.tuned is not None else None
        return v if v is not None and not v.done else None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """In-run verification: this iteration's config goes live (tuning itself runs inside the first one)."""
        if (v := self._verification()) is not None:
            v.before()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if (v := self._verification()) is not None:
            v.after()

    # -- tuning ----------------------------------------------------------------------------------
    def output_path(self, trainer: Any) -> Path:
        return default_output(self.options.output, None, getattr(trainer, "default_root_dir", None))

    def forward_step_func(self, trainer: Any, run: RunShape) -> Any:
        """NeMo's ``MegatronParallel._step`` + forward for a training step: the module's own step functions,
        else the defaults."""
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        from nemo.lightning.megatron_parallel import MegatronStep, _ModuleStepFunction

        mp = trainer.model
        context: dict[str, Any] = {}
        func = mp.wrapped_forward_step(
            forward_step=_ModuleStepFunction.from_forward_step(mp.module, "training") or mp.forward_step,
            loss_reduction=_ModuleStepFunction.from_loss_reduction(mp.module, "training") or mp.loss_reduction,
            data_step=_ModuleStepFunction.from_data_step(mp.module, "training") or mp.data_step,
            context=context,
        )
        context["step"] = MegatronStep.infer(
            mp,
            None,
            func,
            forward_only=False,
            micro_batch_size=run.micro_batch_size,
            seq_length=run.seq_length,
            num_microbatches=get_num_microbatches(),
        )
        return func

    def tune(self, trainer: Any, dataloader_iter: Any) -> Any:
        """Tune on the live model; returns the iterator the step must use (same micro-batches, same order)."""
        from megatron.core.num_microbatches_calculator import get_micro_batch_size

        from megatron_tp_overlap.integrations.megatron.tuning import hand_over, tune
        from megatron_tp_overlap.ub.layer_cfg import reference_config
        from megatron_tp_overlap.ub.preset_shape import preset_named_in

        mp = trainer.model  # MegatronParallel: the model chunks, NeMo's step functions
        run = RunShape.from_transformer_config(mp.config, get_micro_batch_size(), self.tp_comm_bootstrap_backend)
        problems = run.problems()
        if run.cuda_graphs:  # covered for Megatron-LM and Megatron-Bridge only (integrations/megatron/graphs.py)
            problems.append(
                f"CUDA graphs (cuda_graph_impl={run.cuda_graphs}) under NeMo 2 are not covered: when NeMo's loop "
                "captures is not derived, so tuning and the in-run verification could switch configs after it"
            )
        if problems:
            raise SystemExit(
                "megatron-tp-overlap: cannot autotune this NeMo run:\n" + "\n".join(f"  - {p}" for p in problems)
            )
        self.tuned = tune(
            list(mp),
            self.forward_step_func(trainer, run),
            trainer.strategy.optimizers[0],
            dataloader_iter,
            run,
            self.options,
            reference_config(self.tp_comm_overlap_cfg),
            self.output_path(trainer),
            remaining_iters=_remaining_iters(trainer),
            reference_name=preset_named_in(self.tp_comm_overlap_cfg),
            # Lightning's process-group timeout (MegatronStrategy(timeout=...)): no agreement waits longer
            distributed_timeout_s=getattr(getattr(trainer.strategy, "_timeout", None), "total_seconds", lambda: None)(),
        )
        follow = self.follow_recipe(mp, run.tp)
        follow(getattr(self.tuned, "recipe", None))
        if hasattr(self.tuned, "on_recipe"):
            self.tuned.on_recipe.append(follow)  # the in-run verification may change the config (either way)
        return hand_over(self.tuned)

    def follow_recipe(self, mp: Any, tp: int) -> Any:
        """Keeps NeMo's configs saying what the recipe says: the model config (and its ``__io__`` copy, which a
        checkpoint saves) gets the kind switches and the dgrad mode (:func:`~integrations.megatron.flags.
        follow_fields`), and ``tp_comm_overlap`` / ``tp_comm_overlap_cfg`` go where NeMo's callback keeps them
        (its arguments, which its ``setup`` copies onto the model config for a later stage, and the model config)."""
        from megatron_tp_overlap.integrations.megatron.flags import follow_fields
        from megatron_tp_overlap.ub.layer_cfg import framework_classes, to_layer_cfg

        io_config = getattr(getattr(mp, "__io__", None), "config", None)
        configs = [c for c in (mp.config, io_config) if c is not None]
        fields = follow_fields(*configs)

        def apply(recipe: Any) -> None:
            if recipe is not None:
                fields(recipe)
                self.user_comm_overlap_cfg.tp_comm_overlap = recipe.fields.get("tp_comm_overlap", True)
            try:
                layer = to_layer_cfg(self.tuned.config.ub, tp, framework_classes("NeMo 2"))
            except ValueError:  # a GEMM the dataclass cannot hold: the YAML and the report say it all
                return
            self.tp_comm_overlap_cfg = self.user_comm_overlap_cfg.tp_comm_overlap_cfg = layer
            for c in configs:
                if hasattr(c, "tp_comm_overlap_cfg"):
                    c.tp_comm_overlap_cfg = layer

        return apply


def _remaining_iters(trainer: Any) -> int | None:
    """Optimizer steps the Lightning trainer has left (None: no ``max_steps``, e.g. epochs or -1)."""
    total = getattr(trainer, "max_steps", -1)
    return total - (getattr(trainer, "global_step", 0) or 0) if isinstance(total, int) and total > 0 else None


__all__ = ["AutotuneCommOverlapCallback"]
