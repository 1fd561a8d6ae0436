"""Which GEMMs of a model really run with userbuffers: per slot, the modules that overlap and the GEMMs they overlap,
and what does not overlap, with why. Printed as one line at the start of tuning and kept in the report, so that a
user knows what a gain is a gain of (an MoE model's routed experts never overlap; an MLA model may overlap one
module in all). Modules are recognised by TE class names along the MRO, as in :mod:`engine.topology`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from megatron_tp_overlap.engine.topology import find_overlap_modules

GROUPED = "GroupedLinear"  # TE's grouped GEMM (routed experts): initialize_ub buffers cannot serve it
LINEARS = {"Linear", "LayerNormLinear", "LayerNormMLP"}
WHY_GROUPED = "TE GroupedLinear has no userbuffers overlap; their TP communication goes through the token dispatcher"
WHY_GROUPED_NO_TP = "TE GroupedLinear has no userbuffers overlap, and expert-TP size 1 leaves them no TP communication"
WHY_BUILT_OFF = "built without userbuffers"


def te_class(module: torch.nn.Module) -> str | None:
    """The TE class a module is (along the MRO): GroupedLinear, LayerNormMLP, LayerNormLinear, Linear; else None."""
    names = {c.__name__ for c in type(module).__mro__}
    if GROUPED in names:
        return GROUPED
    return next((n for n in ("LayerNormMLP", "LayerNormLinear", "Linear") if n in names), None)


def _tp_sharded(module: torch.nn.Module) -> bool:
    """A TE linear that TP shards (a column/row parallel one; not a replicated router or a TP=1 layer)."""
    return getattr(module, "parallel_mode", None) in ("column", "row") and (getattr(module, "tp_size", 2) or 1) > 1


@dataclass
class Coverage:
    """``overlapped``: slot prefix -> modules running userbuffers; ``gemms``: slot prefix -> the GEMMs they overlap;
    ``not_overlapped``: role -> (TP-sharded modules that do not overlap, why); ``notes``: what else the user must
    know (e.g. a forward that runs without overlap under activation recompute)."""

    overlapped: dict[str, int]
    gemms: dict[str, list[str]]
    not_overlapped: dict[str, tuple[int, str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        def short(gemms: list[str]) -> str:
            return "/".join(g.split("_", 1)[1] for g in gemms)

        on = ", ".join(f"{p} {n} ({short(self.gemms[p])})" for p, n in self.overlapped.items()) or "none"
        out = f"overlap coverage: userbuffers in {on}"
        if self.not_overlapped:
            out += "; not overlapped: " + ", ".join(f"{r} {n} ({why})" for r, (n, why) in self.not_overlapped.items())
        return out + "".join(f"; {n}" for n in self.notes)

    def to_dict(self) -> dict:
        return {
            "overlapped_modules": dict(self.overlapped),
            "overlapped_gemms": {p: list(g) for p, g in self.gemms.items()},
            "not_overlapped": {r: {"modules": n, "why": why} for r, (n, why) in self.not_overlapped.items()},
            "notes": list(self.notes),
            "line": self.line(),
        }


def coverage(
    model: torch.nn.Module | Iterable[torch.nn.Module],
    role_of: Callable[[str], str] | None = None,
    notes: Iterable[str] = (),
) -> Coverage:
    """The coverage of ``model`` (one module or the model chunks). ``role_of``: a TE linear's role from its dotted
    path, for the ones that do not overlap (default: the path's last part; a framework maps its own names)."""
    roots = [model] if isinstance(model, torch.nn.Module) else list(model)
    found = find_overlap_modules(roots)
    overlapping = {id(m.module) for m in found}
    counts, gemms = Counter(m.slot_prefix for m in found), {}
    for m in found:
        gemms.setdefault(m.slot_prefix, set()).update(m.active_gemms())
    role = role_of or (lambda path: path.rsplit(".", 1)[-1])
    off: Counter = Counter()
    why: dict[str, str] = {}
    for root in roots:
        for path, mod in root.named_modules():
            te = te_class(mod)
            if te is None or id(mod) in overlapping:
                continue
            if te == GROUPED:  # routed experts: named whether or not their expert-TP size shards them
                r = "routed-expert GEMMs"
                why[r] = WHY_GROUPED if _tp_sharded(mod) else WHY_GROUPED_NO_TP
            elif _tp_sharded(mod):
                r = role(path)
                why[r] = WHY_BUILT_OFF
            else:
                continue
            off[r] += 1
    order = {g: i for i, g in enumerate(("fprop", "dgrad", "wgrad"))}
    return Coverage(
        overlapped=dict(counts),
        gemms={p: sorted(g, key=lambda x: (x.split("_")[0], order[x.split("_", 1)[1]])) for p, g in gemms.items()},
        not_overlapped={r: (n, why[r]) for r, n in off.items()},
        notes=list(notes),
    )
