"""Trial steps through Megatron's own pipeline schedule, on micro-batches read ahead from the run's iterator (handed
back to it), and the numerics fingerprint of one step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_tp_overlap.integrations.megatron.replay import ReadAhead
from megatron_tp_overlap.integrations.megatron.run_shape import RunShape


def trial_microbatches(
    run_microbatches: int, pipeline_size: int, model_chunks: int, asked: int = 0, group_size: int = 0
) -> int:
    """Micro-batches per trial step: ``asked`` (at most the run's), else the fewest Megatron's schedule takes: 1
    without pipeline parallelism, a full pipeline with it. With an interleaved (virtual) pipeline, one group of
    ``group_size`` micro-batches (Megatron's ``microbatch_group_size_per_vp_stage``, default the pipeline size): its
    schedule takes from one group up (megatron/core/pipeline_parallel/schedules.py), so a trial step costs a bounded
    number of micro-batches instead of the run's whole iteration. An ``asked`` count under an interleaved schedule
    is rounded to what the schedule takes (a whole number of groups, or a remainder of at least the pipeline)."""
    if model_chunks > 1:
        group = max(group_size or pipeline_size, pipeline_size, 1)
        n = min(max(asked, group) if asked > 0 else group, run_microbatches)
        if 0 < n % group < pipeline_size:
            n -= n % group
        return max(n, min(group, run_microbatches))
    if asked > 0:
        return min(asked, run_microbatches)
    return min(run_microbatches, max(1, pipeline_size))


class MegatronSteps:
    """Trial steps and numerics fingerprints through Megatron's pipeline schedule, on read-ahead batches.

    A trial step runs ``microbatches`` micro-batches (:func:`trial_microbatches`; 0: the fewest the schedule takes),
    the first ones of the run's first step (replayed to the main loop)."""

    def __init__(
        self,
        model: list,
        forward_step_func: Callable,
        optimizer: Any,
        data_iterator: Any,
        run: RunShape,
        microbatches: int = 0,
    ):
        from megatron.core import parallel_state
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.rerun_state_machine import get_rerun_state_machine

        from megatron_tp_overlap.engine.numerics import Fingerprint
        from megatron_tp_overlap.integrations.megatron.state import StateSnapshot

        self.model, self.forward_step_func, self.optimizer, self.run_shape = model, forward_step_func, optimizer, run
        from megatron.core.utils import get_model_config

        self.run_microbatches = get_num_microbatches()
        self.n_mb = trial_microbatches(
            self.run_microbatches,
            parallel_state.get_pipeline_model_parallel_world_size(),
            len(model),
            microbatches,
            getattr(get_model_config(model[0]), "microbatch_group_size_per_vp_stage", None) or 0,
        )
        self.data = ReadAhead(data_iterator, self.n_mb)
        self.fb = get_forward_backward_func()
        self.rerun = get_rerun_state_machine()
        self.snapshot = StateSnapshot.take(model)
        self.fp = Fingerprint()

    def _data(self) -> Any:
        from megatron.core.rerun_state_machine import RerunDataIterator

        its = [RerunDataIterator(iter(c)) if c is not None else None for c in self.data.batches]
        return its if self.data.is_list else its[0]

    def zero(self) -> None:
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    def _run(self) -> list:
        # Megatron's protocol (as train_step): loss validation is only legal inside this loop.
        from megatron_tp_overlap.integrations.megatron.graphs import trial_guard

        it, losses, r = self._data(), [], self.run_shape
        while self.rerun.should_run_forward_backward(it):
            with trial_guard(r, self.model):  # `local` CUDA graphs: a trial step never records nor captures
                losses = self.fb(
                    forward_step_func=self.forward_step_func,
                    data_iterator=it,
                    model=self.model,
                    num_microbatches=self.n_mb,
                    seq_length=r.seq_length,
                    micro_batch_size=r.micro_batch_size,
                    decoder_seq_length=r.decoder_seq_length,
                    forward_only=False,
                )
        return losses

    def step(self) -> None:
        self._run()
        self.zero()
        self.snapshot.restore_buffers()  # MoE routers' counters and expert bias: every trial routes alike

    def fingerprint(self) -> Any:
        import torch

        self.snapshot.restore()  # same dropout masks for every config: dropout is on by default in Megatron
        self.zero()
        losses = self._run()
        vals = [torch.stack([v[0] if v.dim() else v for d in losses for v in d.values()]).float()] if losses else [None]
        grads = [getattr(p, "main_grad", p.grad) for chunk in self.model for p in chunk.parameters() if p.requires_grad]
        f = self.fp(vals + grads)
        self.zero()
        return f
