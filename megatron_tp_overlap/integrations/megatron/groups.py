"""Whether the job has gloo process groups: in jobs of thousands of GPUs users turn them off (Megatron-LM's
``--disable-gloo-process-groups``, Megatron-Bridge's ``dist.use_gloo_process_groups=False``), and then tuning must
not create one either (``engine.lockstep`` agrees over a dedicated NCCL communicator instead)."""

from __future__ import annotations

from typing import Any


def gloo_groups_enabled(args: Any = None) -> bool:
    """False when Megatron's ``args`` say ``--disable-gloo-process-groups`` (``use_gloo_process_groups=False`` since
    Megatron-LM core_v0.19; ``disable_gloo_process_groups`` before), or when megatron-core's model-parallel state was
    initialized without gloo groups (``initialize_model_parallel(create_gloo_process_groups=False)``, which
    Megatron-LM, Megatron-Bridge and NeMo all call): its data-parallel gloo group is then None."""
    if args is not None and (
        getattr(args, "use_gloo_process_groups", True) is False or getattr(args, "disable_gloo_process_groups", False)
    ):
        return False
    try:
        from megatron.core import parallel_state as ps
    except ImportError:
        return True
    if not ps.model_parallel_is_initialized() or not hasattr(ps, "_DATA_PARALLEL_GROUP_GLOO"):
        return True
    return ps._DATA_PARALLEL_GROUP_GLOO is not None
