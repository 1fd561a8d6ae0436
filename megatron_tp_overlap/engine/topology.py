"""Which TE modules of a model overlap which GEMMs, and the module flags that switch them.

TE reads a module's overlap flags (``ub_overlap_ag_fprop``, ``ub_bulk_dgrad``, ...) at every
forward, so "no overlap for this GEMM" is a flag flip between steps, no re-initialization. Modules
are recognised by their TE class names along the MRO (so Megatron's ``TELayerNormColumnParallelLinear``
etc. qualify) without importing TE or Megatron here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from megatron_tp_overlap.ub.config import EXTERNAL_GEMMS, GEMM_NAMES, UbConfig

# Flag attributes per TE module kind (TE 2.20).
COLUMN_FLAGS = ("ub_overlap_ag_fprop", "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad")
ROW_FLAGS = ("ub_overlap_rs_fprop", "ub_overlap_ag_dgrad")
MLP_FLAGS = ("ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad")
# Megatron's shared experts (an MoE layer's ``shared_experts.linear_fc1/linear_fc2``): TE linears named fc1/fc2, so they
# run the fc1/fc2 userbuffers configs (one config per name), but with their own N and only the AG/RS flags; they are
# timed in slots of their own ("shared_fc1.fwd", ...), and a config of fc1/fc2 is scored over every slot it runs in.
SHARED_EXPERT_PATH = "shared_expert"
SHARED_PREFIX = "shared_"
# The flags a module was built with, kept on the module at its first discovery: a tuning leaves the flags of the
# config it chose (a GEMM switched off, dgrad flipped to reduce-scatter), and a later tuning of the same model (a
# benchmark's repeat, a re-tune) must see the model as it was built, not a smaller space with another reference.
BUILT_FLAGS_ATTR = "_tp_overlap_built_flags"


def te_kind(module: torch.nn.Module) -> str | None:
    """ "column", "row" or "mlp" for a TE module that can use userbuffers; else None."""
    names = {c.__name__ for c in type(module).__mro__}
    if "LayerNormMLP" in names and hasattr(module, "ub_overlap_ag"):
        return "mlp"
    if ({"Linear", "LayerNormLinear"} & names) and hasattr(module, "ub_overlap_rs_fprop"):
        if getattr(module, "ub_name", None) is None:
            return None
        return "row" if getattr(module, "parallel_mode", None) == "row" else "column"
    return None


@dataclass
class OverlapModule:
    """One TE module that takes part in TP overlap, with the flags it was built with."""

    module: torch.nn.Module
    kind: str  # column | row | mlp
    name: str  # ub name: qkv/proj/fc1/fc2, or "mlp" for LayerNormMLP
    path: str  # dotted path in the model
    built_flags: dict[str, bool]

    @property
    def shared_expert(self) -> bool:
        return SHARED_EXPERT_PATH in self.path

    @property
    def slot_prefix(self) -> str:
        """The timed slots' prefix: the ub name, ``shared_<name>`` for an MoE layer's shared expert."""
        return SHARED_PREFIX + self.name if self.shared_expert else self.name

    def active_gemms(self) -> set[str]:
        """GEMMs this module overlaps with the flags it was built with."""
        f, n = self.built_flags, self.name
        out: set[str] = set()
        if self.kind == "column":
            if f["ub_overlap_ag_fprop"]:
                out.add(f"{n}_fprop")
            if f["ub_overlap_rs_dgrad"] or f["ub_bulk_dgrad"]:
                out.add(f"{n}_dgrad")
            if f["ub_bulk_wgrad"] and not f["ub_overlap_rs_dgrad"]:
                out.add(f"{n}_wgrad")
        elif self.kind == "row":
            if f["ub_overlap_rs_fprop"]:
                out.add(f"{n}_fprop")
            if f["ub_overlap_ag_dgrad"]:
                out |= {f"{n}_dgrad", f"{n}_wgrad"}
        else:
            if f["ub_overlap_ag"]:
                out |= {"fc1_fprop", "fc2_dgrad", "fc2_wgrad"}
            if f["ub_overlap_rs"]:
                out.add("fc2_fprop")
            if f["ub_overlap_rs_dgrad"] or f["ub_bulk_dgrad"]:
                out.add("fc1_dgrad")
            if f["ub_bulk_wgrad"] and not f["ub_overlap_rs_dgrad"]:
                out.add("fc1_wgrad")
        return out

    def flags_for(self, ub: UbConfig, enabled: set[str]) -> dict[str, bool]:
        """Module flags that run ``ub`` with overlap on exactly for ``enabled`` GEMMs."""

        def dgrad_flags(n: str) -> dict[str, bool]:
            on, rs = f"{n}_dgrad" in enabled, ub.dgrad_is_reduce_scatter(f"{n}_dgrad")
            return {
                "ub_overlap_rs_dgrad": on and rs,
                "ub_bulk_dgrad": on and not rs,
                "ub_bulk_wgrad": (f"{n}_wgrad" in enabled) and not rs,
            }

        if self.kind == "column":
            return {"ub_overlap_ag_fprop": f"{self.name}_fprop" in enabled, **dgrad_flags(self.name)}
        if self.kind == "row":
            return {
                "ub_overlap_rs_fprop": f"{self.name}_fprop" in enabled,
                "ub_overlap_ag_dgrad": f"{self.name}_dgrad" in enabled,
            }
        return {"ub_overlap_ag": "fc1_fprop" in enabled, "ub_overlap_rs": "fc2_fprop" in enabled, **dgrad_flags("fc1")}

    def set_flags(self, flags: dict[str, bool]) -> None:
        for k, v in flags.items():
            setattr(self.module, k, v)


@dataclass(frozen=True)
class Topology:
    """The overlap structure of a model: which GEMMs are active and how they group into timed slots.

    A *slot* is one timed region: the forward or the backward of one module kind (summed over layers).
    Modules run one after another, so every slot can try a different candidate in the same step.
    """

    kinds: tuple[tuple[str, str], ...]  # (slot prefix, kind), e.g. (("qkv","column"), ("proj","row"), ("mlp","mlp"))
    active: frozenset[str]
    layers: int
    # per slot prefix, the GEMMs its modules overlap, where they differ from ``active`` (shared experts overlap their
    # AG/RS only); a prefix not listed overlaps every active GEMM of its modules
    prefix_active: tuple[tuple[str, frozenset[str]], ...] = ()

    @property
    def fused_mlp(self) -> bool:
        return any(k == "mlp" for _, k in self.kinds)

    def slots(self) -> dict[str, tuple[str, ...]]:
        """``{"qkv.fwd": ("qkv_fprop",), "qkv.bwd": ("qkv_dgrad", "qkv_wgrad"), ...}`` (active GEMMs)."""
        return dict(self._slots)  # a copy: callers may change theirs

    # Computed once per topology (it is frozen): the search asks for slots per option and trial (rebuilding them each
    # time cost a simulated search several % of its time). Kept in the instance's __dict__, outside the fields.
    @cached_property
    def _slots(self) -> dict[str, tuple[str, ...]]:
        out: dict[str, tuple[str, ...]] = {}
        own = dict(self.prefix_active)
        for prefix, kind in self.kinds:
            name = prefix.removeprefix(SHARED_PREFIX)
            mods = ("fc1", "fc2") if kind == "mlp" else (name,)
            active = own.get(prefix, self.active)
            fwd = tuple(g for m in mods for g in (f"{m}_fprop",) if g in active)
            bwd = tuple(g for m in reversed(mods) for g in (f"{m}_dgrad", f"{m}_wgrad") if g in active)
            out[f"{prefix}.fwd"], out[f"{prefix}.bwd"] = fwd, bwd
        return out

    def slots_of(self, gemm: str) -> tuple[str, ...]:
        """Every slot whose time ``gemm``'s config changes (two where shared experts run the same config)."""
        found = self._slots_by_gemm.get(gemm)
        if not found:
            raise KeyError(f"{gemm} is not overlapped by any module of this model")
        return found

    @cached_property
    def _slots_by_gemm(self) -> dict[str, tuple[str, ...]]:
        """Per GEMM, the slots that time it, in slot order (once per topology, as :attr:`_slots`)."""
        out: dict[str, tuple[str, ...]] = {}
        for slot, gemms in self._slots.items():
            for g in gemms:
                out[g] = out.get(g, ()) + (slot,)
        return out

    def slot_of(self, gemm: str) -> str:
        """The first slot of :meth:`slots_of` (the only one in a dense model)."""
        return self.slots_of(gemm)[0]

    def slot_groups(self) -> dict[str, tuple[str, ...]]:
        """Slots that share a GEMM, merged: ``{"fc1.fwd+shared_fc1.fwd": ("fc1.fwd", "shared_fc1.fwd"), ...}``
        (one slot each in a dense model); an exhaustive search must try a GEMM's options over its whole group."""
        groups: list[list[str]] = []
        for slot, gemms in self.slots().items():
            joined = [g for g in groups if any(set(gemms) & set(self.slots()[s]) for s in g)]
            merged = [slot] + [s for g in joined for s in g]
            groups = [g for g in groups if g not in joined] + [merged]
        order = list(self.slots())
        return {"+".join(sorted(g, key=order.index)): tuple(sorted(g, key=order.index)) for g in groups}

    def coupled(self, gemm: str) -> frozenset[str]:
        """GEMMs whose overlap goes on/off together with ``gemm`` (they share one module flag)."""
        group = {gemm}
        for wgrad, dgrad in EXTERNAL_GEMMS.items():  # external wgrad rides on its dgrad's all-gather
            if gemm in (wgrad, dgrad):
                group |= {wgrad, dgrad}
        if self.fused_mlp and group & {"fc1_fprop", "fc2_dgrad", "fc2_wgrad"}:
            group |= {"fc1_fprop", "fc2_dgrad", "fc2_wgrad"}  # LayerNormMLP.ub_overlap_ag
        return frozenset(group & self.active)

    def tunable(self, gemm: str) -> bool:
        return gemm in self.active and gemm not in EXTERNAL_GEMMS


def model_roots(model: torch.nn.Module | Iterable[torch.nn.Module]) -> list[torch.nn.Module]:
    """One module or several (e.g. Megatron's model chunks), as a list."""
    return [model] if isinstance(model, torch.nn.Module) else list(model)


def find_overlap_modules(model: torch.nn.Module | Iterable[torch.nn.Module]) -> list[OverlapModule]:
    """Every TE module in ``model`` (one module or several, e.g. Megatron's model chunks) that uses userbuffers, with
    the flags it was built with (those read at its first discovery, whatever a tuning has set since)."""
    roots = model_roots(model)
    found: list[OverlapModule] = []
    for i, root in enumerate(roots):
        for path, m in root.named_modules():
            kind = te_kind(m)
            if kind is None:
                continue
            flags = getattr(m, BUILT_FLAGS_ATTR, None)
            if flags is None:
                names = {"column": COLUMN_FLAGS, "row": ROW_FLAGS, "mlp": MLP_FLAGS}[kind]
                flags = {k: bool(getattr(m, k)) for k in names}
                setattr(m, BUILT_FLAGS_ATTR, dict(flags))
            name = "mlp" if kind == "mlp" else str(m.ub_name)
            om = OverlapModule(m, kind, name, f"{i}.{path}" if len(roots) > 1 else path, flags)
            if om.active_gemms():
                found.append(om)
    return found


def build_topology(modules: list[OverlapModule]) -> Topology:
    if not modules:
        raise ValueError(
            "no Transformer Engine module with userbuffers overlap found in the model "
            "(build it after initialize_ub() with ub_overlap_* / ub_bulk_* flags, "
            "e.g. Megatron's --tp-comm-overlap or te.TransformerLayer(ub_tp_comm_overlap=True))"
        )
    kinds: dict[str, str] = {}
    counts: dict[str, int] = {}
    active: set[str] = set()
    own: dict[str, set[str]] = {}
    for m in modules:
        p = m.slot_prefix
        if kinds.setdefault(p, m.kind) != m.kind:
            raise ValueError(f"modules named {p!r} are of different kinds ({kinds[p]} and {m.kind})")
        counts[p] = counts.get(p, 0) + 1
        active |= m.active_gemms()
        own.setdefault(p, set()).update(m.active_gemms())
    order = {"qkv": 0, "proj": 1, "fc1": 2, "mlp": 2, "fc2": 3, "shared_fc1": 4, "shared_fc2": 5}
    ordered = tuple(sorted(kinds.items(), key=lambda kv: order.get(kv[0], 9)))
    ordered_active = frozenset(g for g in GEMM_NAMES if g in active)
    # listed only where a prefix overlaps less than its modules' GEMMs would at full flags (shared experts)
    differ = tuple((p, frozenset(g)) for p, g in sorted(own.items()) if p.startswith(SHARED_PREFIX))
    return Topology(kinds=ordered, active=ordered_active, layers=max(counts.values()), prefix_active=differ)


class TopologyMismatch(RuntimeError):
    """The ranks would search different topologies or spaces; raised on every rank together, before any trial."""


def agree_on_the_search(topology: Topology, space: dict, lockstep: Any, group: Any = None) -> None:
    """Every rank must search the same topology and space (each trial's collectives have its size): ranks
    holding different modules (a pipeline stage without some of them) are refused together, naming them."""
    import hashlib
    import json

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1):
        return
    what = {
        "kinds": topology.kinds,
        "active": sorted(topology.active),
        "space": {g: [o.label for o in opts] for g, opts in space.items()},
    }
    digest = int(hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:12], 16)  # exact in f64
    high, low = lockstep.agree_max([digest, -digest])  # one agreement: equal everywhere iff high == -low
    if high == -low:
        return
    # the ranks differ (the job stops here): gather who holds what, once, to say so
    digests: list[Any] = [None] * dist.get_world_size(group)
    kinds = ", ".join(f"{n}({k})" for n, k in topology.kinds) or "none"
    dist.all_gather_object(digests, (digest, kinds), group=group)
    if len({d for d, _ in digests}) > 1:
        by = {}
        for rank, (d, kinds) in enumerate(digests):
            by.setdefault((d, kinds), []).append(rank)
        groups = "; ".join(f"ranks {', '.join(map(str, r))}: modules {k}" for (_, k), r in by.items())
        raise TopologyMismatch(
            f"the ranks hold different TP-overlap modules or search spaces ({groups}); tune "
            "where every rank holds the same layer kinds (e.g. equal pipeline stages)"
        )
