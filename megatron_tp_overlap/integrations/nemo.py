"""NeMo 2 (Lightning): NeMo's ``MegatronCommOverlapCallback`` plus one-switch autotune.

    from megatron_tp_overlap.integrations.nemo import AutotuneCommOverlapCallback
    trainer = nl.Trainer(strategy=nl.MegatronStrategy(tensor_model_parallel_size=4, sequence_parallel=True),
                         callbacks=[AutotuneCommOverlapCallback(tp_comm_overlap=True,
                                                                tp_comm_overlap_autotune_seconds=60)])

It takes every argument of NeMo's callback (``tp_comm_overlap_cfg`` is the preset to start from, a
``TransformerLayerTPOverlapCfg``) plus the autotune options, named as Bridge's fields and the Megatron-LM
flags (``tp_comm_overlap_autotune_seconds`` = ``--tp-comm-overlap-autotune-seconds``). NeMo's own callback
configures the model and initializes userbuffers in ``on_fit_start``, before the first step; this one then
tunes inside the first training step: it reads that step's micro-batches ahead from the step's data
iterator, runs the trial steps through NeMo's own Megatron forward step (``MegatronParallel.
wrapped_forward_step`` with the module's training data/forward/loss steps) using the Megatron-LM
integration's machinery (:class:`~megatron_tp_overlap.integrations.megatron.TPOverlapAutotuneCallback`:
no optimizer step, gradients zeroed, RNG and FP8 state restored), and hands the step the same batches.
The tuned config is applied, written as a YAML plus report, and kept as this callback's
``tp_comm_overlap_cfg``.

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

from . import megatron as mlm
from .megatron import AUTOTUNE_DEFAULTS


def megatron_args(model_cfg: Any, micro_batch_size: int, options: dict[str, Any], reference_yaml: str | None,
                  save: str | None, bootstrap_backend: str | None) -> Any:
    """The Megatron-LM argument names the tuning callback reads, from NeMo's model config
    (a megatron-core ``TransformerConfig``) and the callback's options."""
    return mlm.args_from_transformer_config(model_cfg, micro_batch_size, options, reference_yaml, save,
                                            bootstrap_backend=bootstrap_backend)


class AutotuneCommOverlapCallback(MegatronCommOverlapCallback):
    """NeMo's ``MegatronCommOverlapCallback`` that also tunes ``tp_comm_overlap_cfg`` in the first step."""

    def __init__(self, *args: Any, tp_comm_overlap_autotune: bool = AUTOTUNE_DEFAULTS["tp_comm_overlap_autotune"],
                 tp_comm_overlap_autotune_seconds: float = AUTOTUNE_DEFAULTS["tp_comm_overlap_autotune_seconds"],
                 tp_comm_overlap_autotune_steps: int = AUTOTUNE_DEFAULTS["tp_comm_overlap_autotune_steps"],
                 tp_comm_overlap_autotune_strategy: str = AUTOTUNE_DEFAULTS["tp_comm_overlap_autotune_strategy"],
                 tp_comm_overlap_autotune_output: str | None = AUTOTUNE_DEFAULTS["tp_comm_overlap_autotune_output"],
                 tp_comm_overlap_autotune_reuse: bool = AUTOTUNE_DEFAULTS["tp_comm_overlap_autotune_reuse"],
                 tp_comm_overlap_autotune_allow_off: bool = AUTOTUNE_DEFAULTS["tp_comm_overlap_autotune_allow_off"],
                 tp_comm_overlap_autotune_rtol: float = AUTOTUNE_DEFAULTS["tp_comm_overlap_autotune_rtol"],
                 tp_comm_overlap_autotune_trial_timeout: float = AUTOTUNE_DEFAULTS["tp_comm_overlap_autotune_trial_timeout"],
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.autotune_options = {k: v for k, v in locals().items() if k.startswith("tp_comm_overlap_autotune")}
        problems = self.problems()
        if problems:
            raise ValueError("megatron-tp-overlap: invalid AutotuneCommOverlapCallback arguments:\n"
                             + "\n".join(f"  - {p}" for p in problems))
        self.result = None
        self.tuned_yaml: Path | None = None

    @property
    def autotune(self) -> bool:
        return bool(self.autotune_options["tp_comm_overlap_autotune"])

    def problems(self) -> list[str]:
        """Bad arguments (checked when the callback is made, before any GPU work)."""
        if not self.autotune:
            return []
        p = []
        if self.user_comm_overlap_cfg.tp_comm_overlap is not True:
            p.append("tp_comm_overlap_autotune needs tp_comm_overlap=True")
        return p + mlm.option_problems(lambda k: self.autotune_options[f"tp_comm_overlap_autotune_{k}"],
                                       lambda k: f"tp_comm_overlap_autotune_{k}")

    # -- Lightning hooks -------------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        parallelism = trainer.strategy.parallelism
        if self.autotune and stage == "fit":  # NeMo would only warn and switch the overlap off
            p = []
            if parallelism.tensor_model_parallel_size < 2:
                p.append(f"MegatronStrategy(tensor_model_parallel_size={parallelism.tensor_model_parallel_size}): "
                         "tp_comm_overlap_autotune needs >= 2")
            if not parallelism.sequence_parallel:
                p.append("MegatronStrategy(sequence_parallel=False): tp_comm_overlap_autotune needs sequence_parallel=True")
            if p:
                raise ValueError("megatron-tp-overlap: cannot autotune this run:\n" + "\n".join(f"  - {x}" for x in p))
        super().setup(trainer, pl_module, stage)
        config = getattr(trainer.model, "config", None)
        if self.autotune and stage == "fit" and config is not None and not getattr(config, "tp_comm_overlap", False):
            raise ValueError("megatron-tp-overlap: NeMo switched tensor-parallel overlap off for this run (its warning "
                             "says why, e.g. Transformer Engine not found); tp_comm_overlap_autotune needs it on")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Userbuffers are up (``on_fit_start``): tune inside the first training step."""
        if not self.autotune or not getattr(trainer.model.config, "tp_comm_overlap", False) or self.result is not None:
            return
        strategy = trainer.strategy
        original = strategy.training_step

        def training_step(dataloader_iter: Any, *args: Any, **kwargs: Any) -> Any:
            strategy.training_step = original  # the first step only
            return original(self.tune(trainer, dataloader_iter), *args, **kwargs)

        strategy.training_step = training_step

    # -- tuning ----------------------------------------------------------------------------------
    def output_path(self, trainer: Any) -> Path:
        explicit = self.autotune_options["tp_comm_overlap_autotune_output"]
        return Path(explicit) if explicit else Path(getattr(trainer, "default_root_dir", None) or ".") / "tp_comm_overlap_tuned.yaml"

    def tune(self, trainer: Any, dataloader_iter: Any) -> Any:
        """Tune on the live model; returns the iterator the step must use (same micro-batches, same order)."""
        import torch
        from megatron.core.num_microbatches_calculator import get_micro_batch_size, get_num_microbatches
        from nemo.lightning.megatron_parallel import MegatronStep, _ModuleStepFunction

        from .layer_cfg import framework_classes, reference_yaml, to_layer_cfg

        mp = trainer.model  # MegatronParallel: the model chunks, NeMo's step functions
        out = self.output_path(trainer)
        ref = reference_yaml(self.tp_comm_overlap_cfg, out) if torch.distributed.get_rank() == 0 else None
        holder = [ref]
        torch.distributed.broadcast_object_list(holder, src=0)
        args = megatron_args(mp.config, get_micro_batch_size(), self.autotune_options, holder[0],
                             str(out.parent), self.tp_comm_bootstrap_backend)
        args.tp_comm_overlap_autotune_output = str(out)
        problems = mlm.check_arguments(args)
        if problems:
            raise SystemExit("megatron-tp-overlap: cannot autotune this NeMo run:\n" + "\n".join(f"  - {p}" for p in problems))

        # MegatronParallel._step + forward for a training step: the module's own step functions, else the defaults
        context: dict[str, Any] = {}
        forward_step_func = mp.wrapped_forward_step(
            forward_step=_ModuleStepFunction.from_forward_step(mp.module, "training") or mp.forward_step,
            loss_reduction=_ModuleStepFunction.from_loss_reduction(mp.module, "training") or mp.loss_reduction,
            data_step=_ModuleStepFunction.from_data_step(mp.module, "training") or mp.data_step,
            context=context)
        context["step"] = MegatronStep.infer(mp, None, forward_step_func, forward_only=False,
                                             micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
                                             num_microbatches=get_num_microbatches())
        callback = mlm.TPOverlapAutotuneCallback(args)
        it = callback(forward_step_func, list(mp), trainer.strategy.optimizers[0], dataloader_iter)
        self.result = callback.result
        if self.result is not None:
            self.tuned_yaml = out
            try:  # what a later stage's userbuffers initialization (validation/test) uses
                self.tp_comm_overlap_cfg = to_layer_cfg(self.result.best.ub, args.tensor_model_parallel_size,
                                                        framework_classes("NeMo 2"))
            except ValueError:  # a GEMM the dataclass cannot hold: the YAML says it all
                pass
        return it


__all__ = ["AutotuneCommOverlapCallback", "megatron_args"]
