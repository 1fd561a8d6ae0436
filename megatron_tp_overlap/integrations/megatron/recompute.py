"""Activation recompute in a Megatron run: which overlap GEMMs it re-runs, and which of them run a forward without
their overlap.

Megatron's checkpoints (``tensor_parallel.checkpoint``, TE's ``checkpoint`` under FP8) are reentrant: the first
forward of a checkpointed region runs under ``torch.no_grad()`` and the region runs again, with grad, inside the
backward. Trial steps run the run's own schedule, so both forwards are in a trial's cost
(:class:`~engine.measure.SlotTimer`). TE 2.x overlaps some forwards only with grad enabled:

- ``LayerNormLinear`` (Megatron's qkv and dense fc1): ``ub_overlap_ag_fprop and is_grad_enabled and not
  return_layernorm_output`` (module/layernorm_linear.py);
- ``LayerNormMLP``: ``ub_overlap_ag = ub_overlap_ag and is_grad_enabled ...`` and ``ub_overlap_rs = ub_overlap_rs
  and is_grad_enabled`` (module/layernorm_mlp.py);
- ``Linear`` (proj, fc2, a shared expert's fc1): no such condition.

So under recompute the no_grad forward of qkv/fc1 all-gathers without overlap (TE issue 2902), whatever the config.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Optional

ATTENTION = ("qkv", "proj")
MLP = ("fc1", "fc2")


@dataclass(frozen=True)
class Recompute:
    """Megatron's recompute settings (flags and ``TransformerConfig`` use the same names)."""

    granularity: Optional[str] = None  # None | "full" | "selective"
    method: Optional[str] = None  # "uniform" | "block" (full)
    num_layers: Optional[int] = None
    modules: tuple[str, ...] = ("core_attn",)  # selective: Megatron's default

    @staticmethod
    def of(c: Any) -> Recompute:
        return Recompute(
            getattr(c, "recompute_granularity", None),
            getattr(c, "recompute_method", None),
            getattr(c, "recompute_num_layers", None),
            tuple(getattr(c, "recompute_modules", None) or ("core_attn",)),
        )

    def reruns(self, dense: bool = True, moe: bool = False) -> frozenset[str]:
        """The userbuffers names (qkv/proj/fc1/fc2) whose modules run inside a checkpoint. ``full``: the whole layer
        (with ``block``, only the first ``num_layers`` layers of a stage). Selective ``mlp``: a dense layer's
        fc1/fc2 (Megatron ignores it in a MoE layer); ``moe`` and ``shared_experts``: the shared experts' fc1/fc2
        (the routed experts' GEMMs are not userbuffers GEMMs). ``dense`` / ``moe``: the model has dense / MoE
        layers. ``core_attn``, ``layernorm``, ``moe_act``,
        ``mla_up_proj``: none."""
        if self.granularity == "full":
            return frozenset(ATTENTION + MLP)
        if self.granularity != "selective":
            return frozenset()
        m = set(self.modules)
        mlp = ("mlp" in m and dense) or (moe and bool(m & {"moe", "shared_experts"}))
        return frozenset(MLP) if mlp else frozenset()

    def flag(self) -> Optional[str]:
        """The flags as Megatron-LM spells them, when recompute re-runs an overlap GEMM (else None)."""
        if self.granularity == "full":
            extra = f" --recompute-method {self.method}" if self.method else ""
            extra += f" --recompute-num-layers {self.num_layers}" if self.num_layers else ""
            return f"--recompute-granularity full{extra}"
        if self.granularity == "selective" and set(self.modules) & {"mlp", "moe", "shared_experts"}:
            return f"--recompute-modules {' '.join(sorted(self.modules))}"
        return None


def no_grad_fprop(module: Any, ub_name: str) -> frozenset[str]:
    """The forward GEMMs of one TE module that run without overlap when its forward runs under no_grad."""
    from megatron_tp_overlap.engine.coverage import te_class

    cls = te_class(module)
    if cls == "LayerNormMLP":
        return frozenset({"fc1_fprop", "fc2_fprop"})
    if cls == "LayerNormLinear" and getattr(module, "parallel_mode", "column") != "row":
        return frozenset({f"{ub_name}_fprop"})
    return frozenset()


def no_grad_forward_gemms(
    modules: Iterable[Any], recompute: Recompute, dense: bool = True, moe: bool = False
) -> frozenset[str]:
    """The overlap GEMMs whose forward runs once without overlap under this recompute (its no_grad first forward):
    qkv/fc1 all-gathers under ``LayerNormLinear``, fc1 and fc2 under ``LayerNormMLP``. ``modules``: the model's
    :class:`~engine.topology.OverlapModule` s (``.module``, ``.name``, ``.active_gemms()``); only the GEMMs they
    overlap count."""
    rerun = recompute.reruns(dense, moe)
    out: set[str] = set()
    for m in modules:
        names = MLP if m.name == "mlp" else (m.name,)
        if rerun & set(names):
            out |= no_grad_fprop(m.module, m.name) & m.active_gemms()
    return frozenset(out)


def describe_no_grad(gemms: Iterable[str]) -> str:
    """For a coverage line: e.g. "qkv_fprop, fc1_fprop: not overlapped in the no_grad first forward of a
    recompute (TE overlaps their all-gather only with grad enabled)"; empty when none."""
    g = sorted(gemms)
    if not g:
        return ""
    return (
        f"{', '.join(g)}: not overlapped in the no_grad first forward of activation recompute (TE overlaps them only "
        "with grad enabled); the recomputed forward overlaps them"
    )
