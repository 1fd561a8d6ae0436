"""The overlap coverage of a megatron-core model (:mod:`engine.coverage`) in Megatron's words: its module names, and
what megatron-core itself switched off while building the model."""

from __future__ import annotations

from typing import Any

from megatron_tp_overlap.engine.coverage import Coverage, coverage
from megatron_tp_overlap.engine.topology import SHARED_EXPERT_PATH, SHARED_PREFIX

# megatron-core's TE linears by attribute name (gpt_layer_specs.py); MLA's and MTP's keep their own names
ROLES = {"linear_qkv": "qkv", "linear_proj": "proj", "linear_fc1": "fc1", "linear_fc2": "fc2"}
# a shared expert's TE linears get only ub_overlap_ag / ub_overlap_rs from megatron-core's TELinear: column fc1
# overlaps its forward all-gather, row fc2 its forward reduce-scatter and its backward all-gather
SHARED_EXPERT_GEMMS = {
    SHARED_PREFIX + "fc1": frozenset({"fc1_fprop"}),
    SHARED_PREFIX + "fc2": frozenset({"fc2_fprop", "fc2_dgrad", "fc2_wgrad"}),
}


def role_of(path: str) -> str:
    """``decoder.layers.3.mlp.shared_experts.linear_fc1`` -> ``shared_fc1``; MLA's ``linear_q_down_proj`` as is."""
    last = path.rsplit(".", 1)[-1]
    role = ROLES.get(last, last)
    return SHARED_PREFIX + role if SHARED_EXPERT_PATH in path and role in ("fc1", "fc2") else role


def megatron_notes(config: Any, asked_overlap: bool) -> list[str]:
    """What megatron-core left off that the user asked for, from the model's ``TransformerConfig`` after building."""
    notes = []
    if asked_overlap and config is not None and not getattr(config, "tp_comm_overlap", True):
        notes.append(
            "megatron-core switched TP overlap off while building the model: a TE linear with a userbuffers name "
            "other than qkv/proj/fc1/fc2 (MLA's or MTP's projections) turns tp_comm_overlap off on the config the "
            "layers share (megatron/core/extensions/transformer_engine.py), so every layer built after it runs "
            "without overlap"
        )
    if getattr(config, "moe_shared_expert_overlap", False):
        notes.append(
            "shared experts run beside the token dispatcher (--moe-shared-expert-overlap), without userbuffers"
        )
    return notes


def model_coverage(model: list, asked_overlap: bool = True, recompute: Any = None) -> Coverage:
    """The coverage of Megatron's model chunks, with megatron-core's own switches named, and (``recompute``: the
    run's :class:`~integrations.megatron.recompute.Recompute`) the forwards that run once without overlap."""
    from megatron_tp_overlap.engine.topology import find_overlap_modules
    from megatron_tp_overlap.integrations.megatron.recompute import describe_no_grad, no_grad_forward_gemms

    extra_notes: tuple[str, ...] = ()
    if recompute is not None:
        modules = find_overlap_modules(model)
        moe = any(m.shared_expert for m in modules) or any(
            "GroupedLinear" in {c.__name__ for c in type(x).__mro__} for chunk in model for x in chunk.modules()
        )
        dense = any(m.name in ("fc1", "mlp") and not m.shared_expert for m in modules)
        note = describe_no_grad(no_grad_forward_gemms(modules, recompute, dense, moe))
        extra_notes = (note,) if note else ()
    config = None
    try:
        from megatron.core.utils import get_model_config

        config = get_model_config(model[0])
    except (ImportError, AttributeError, IndexError):  # CPU tests, or a model that is not megatron-core's
        config = getattr(model[0], "config", None) if model else None
    return coverage(model, role_of, [*megatron_notes(config, asked_overlap), *extra_notes])
