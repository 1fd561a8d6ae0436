"""The candidate space: per GEMM, the overlap options worth a trial.

Seeded by priors (TE's defaults, the NeMo/Megatron-Bridge presets, the user's config) plus a small
grid around them, and "no overlap for this GEMM" where a module flag allows it. Every option is
checked with the validation rules, so the search never proposes a config TE would reject.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from dataclasses import dataclass, field

from megatron_tp_overlap.engine.topology import Topology
from megatron_tp_overlap.errors import ConfigError
from megatron_tp_overlap.ub.config import (
    AG_GEMMS,
    BULK_DGRAD_GEMMS,
    BULK_WGRAD_GEMMS,
    GEMM_NAMES,
    RS_GEMMS,
    GemmOverlapConfig,
    UbConfig,
    cached_hash,
    te_default,
)
from megatron_tp_overlap.ub.rules import ValidationContext, check


@cached_hash
@dataclass(frozen=True)
class TuningConfig:
    """What one trial runs: a ``ub_cfgs`` plus the GEMMs whose overlap is switched off."""

    ub: UbConfig = UbConfig()
    disabled: frozenset[str] = frozenset()
    label: str = field(default="", compare=False)

    def describe(self) -> str:
        off = f"; overlap off: {', '.join(sorted(self.disabled))}" if self.disabled else ""
        return f"{self.ub.describe()}{off}"

    def to_dict(self) -> dict:
        return {"label": self.label, "ub_cfgs": self.ub.to_dict(), "overlap_off": sorted(self.disabled)}


@cached_hash
@dataclass(frozen=True)
class Option:
    """One way to run one GEMM: a config entry (``None``: TE's default) or overlap off."""

    gemm: str
    cfg: GemmOverlapConfig | None = None
    enabled: bool = True

    @property
    def label(self) -> str:
        if not self.enabled:
            return "no overlap"
        return self.cfg.describe() if self.cfg is not None else "TE default"


def apply(config: TuningConfig, option: Option, topo: Topology) -> TuningConfig:
    """``config`` with ``option`` applied to its GEMM (and the GEMMs coupled to it)."""
    group = topo.coupled(option.gemm) or frozenset({option.gemm})
    if not option.enabled:
        return TuningConfig(config.ub, config.disabled | group)
    ub = config.ub.with_entry(option.gemm, option.cfg)
    if option.gemm in BULK_DGRAD_GEMMS and ub.dgrad_is_reduce_scatter(option.gemm):
        ub = ub.with_entry(option.gemm.replace("dgrad", "wgrad"), None)  # TE forbids the wgrad entry
    return TuningConfig(ub, config.disabled - group)


def is_valid(config: TuningConfig, ctx: ValidationContext) -> bool:
    return _ub_valid(config.ub, ctx)


# The rules depend on the ub config and the context alone (both frozen): remembered across searches, which try the
# same configs over and over (a simulated search spent an eighth of its time re-validating them). A search validates
# ~700 configs; 65536 of them kept ~450k objects alive in a long process, where every gc.collect (each switch's, the
# frozen heap's) went over them: 0.5 s instead of 0.25 s per collection in one pytest process
@functools.lru_cache(maxsize=1 << 12)
def _ub_valid(ub: UbConfig, ctx: ValidationContext) -> bool:
    try:
        check(ub, ctx)
    except ConfigError:
        return False
    return True


def effective_key(option: Option, ctx: ValidationContext) -> tuple:
    """Options that TE would run identically compare equal (defaults filled, ignored knobs dropped)."""
    if not option.enabled:
        return (option.gemm, "off")
    full = (option.cfg or GemmOverlapConfig()).merged_over(te_default(option.gemm, ctx.tp_size or 2)).to_dict()
    full.pop("is_reduce_scatter", None)
    if not ctx.fp8:
        full.pop("fp8_buf", None)
        full.pop("atomic_gemm", None)
    if full["method"] != "pipeline":
        full.pop("num_splits", None)
        full.pop("pipeline_rs_overlap_first_gemm", None)
    if full["method"] != "ring_exchange":
        full.pop("aggregate", None)
        full.pop("use_ce", None)
    if full["method"] in ("ring_exchange", "external"):
        full.pop("num_sm", None)  # the copy engine drives ring_exchange (use_ce defaults to true)
        full.pop("cga_size", None)
    return (option.gemm, tuple(sorted(full.items())))


@dataclass(frozen=True)
class SpaceSpec:
    """The grid around the priors. Defaults follow the ranges NeMo's presets use on H100/B200."""

    pipeline_num_sm: tuple[int, ...] = (4, 8, 16, 24, 32)
    pipeline_num_splits: tuple[int, ...] = (2, 4, 8)
    bulk_num_sm: tuple[int, ...] = (2, 4, 8, 16, 24, 32)
    include_off: bool = True  # "no overlap for this GEMM"
    include_rs_dgrad: bool = True  # qkv/fc1 dgrad as GEMM -> reduce-scatter instead of bulk
    # False where the modules' construction flags fix bulk vs reduce-scatter dgrad and the result
    # must be a YAML alone (Megatron: --tp-comm-overlap-rs-dgrad decides it for every layer).
    include_bulk_dgrad: bool = True
    # TE knobs the YAML carries beyond method/num_sm/splits/cga/margin/aggregate: SM-driven ring copies
    # (use_ce=False) and the first pipelined reduce-scatter chunk overlapped (pipeline_rs_overlap_first_gemm);
    # what stays out is in LEFT_OUT
    include_knobs: bool = True


# Choices the YAML can carry that the default space leaves out, and why (in every tuning report). A user's starting
# config may still hold them: it is a contender like any other, and the numerics check guards it.
LEFT_OUT: dict[str, str] = {
    "fp8_buf": "an FP8 buffer for a pipelined reduce-scatter needs an FP8 GEMM output, which TE's layers do not "
    "produce: on 2 H200s (TE 2.20, FP8 delayed scaling) every such trial failed ('split_overlap_rs: Unsupported "
    "dtype BFloat16') and the FP8 preset that sets it deviated from no overlap by a relative error of 0.30 (the "
    "numerics check's fingerprint, tolerance 0.02); it never won in a Megatron-LM run",
}


# ``--dgrad-mode`` of the sweep and the layer bench -> (include_rs_dgrad, include_bulk_dgrad). Megatron-LM runs
# qkv and fc1 dgrad in one mode for the whole model, so "any" can choose a mix only TE itself can run.
DGRAD_MODES: dict[str, tuple[bool, bool]] = {
    "any": (True, True),
    "bulk": (False, True),
    "reduce-scatter": (True, False),
}


def space_spec_for_dgrad_mode(mode: str) -> SpaceSpec:
    """The search space that keeps qkv/fc1 dgrad to ``mode`` (a key of :data:`DGRAD_MODES`)."""
    if mode not in DGRAD_MODES:
        raise ValueError(f"dgrad mode must be one of {', '.join(DGRAD_MODES)}, got {mode!r}")
    rs, bulk = DGRAD_MODES[mode]
    return SpaceSpec(include_rs_dgrad=rs, include_bulk_dgrad=bulk)


def allows_dgrad_mode(spec: SpaceSpec, ub: UbConfig, gemm: str) -> bool:
    """Whether ``ub`` runs ``gemm`` (qkv_dgrad / fc1_dgrad) in a dgrad mode ``spec`` allows."""
    if gemm not in BULK_DGRAD_GEMMS:
        return True
    return spec.include_rs_dgrad if ub.dgrad_is_reduce_scatter(gemm) else spec.include_bulk_dgrad


def _grid(gemm: str, spec: SpaceSpec) -> list[GemmOverlapConfig]:
    G = GemmOverlapConfig
    if gemm in AG_GEMMS:
        knobs = [G(method="ring_exchange", use_ce=False), G(method="ring_exchange", aggregate=True, use_ce=False)]
        return [
            G(method="ring_exchange", aggregate=False),
            G(method="ring_exchange", aggregate=True),
            G(method="ring_exchange", set_sm_margin=True),
        ] + (knobs if spec.include_knobs else [])
    if gemm in RS_GEMMS:
        pipe = [
            G(method="pipeline", num_sm=s, num_splits=k, cga_size=2, set_sm_margin=True)
            for s in spec.pipeline_num_sm
            for k in spec.pipeline_num_splits
        ]
        knobs = [
            G(method="pipeline", num_sm=s, num_splits=4, cga_size=2, set_sm_margin=True, **kw)
            for s in (16, 24)
            for kw in ({"pipeline_rs_overlap_first_gemm": True},)
        ]
        return (
            pipe
            + (knobs if spec.include_knobs else [])
            + [
                G(method="ring_exchange", set_sm_margin=True),
                G(method="ring_exchange", set_sm_margin=False),
                G(method="ring_exchange", aggregate=True, set_sm_margin=True),
            ]
        )
    if gemm in BULK_DGRAD_GEMMS:
        out = [G(method="bulk", num_sm=s, cga_size=2, set_sm_margin=False) for s in spec.bulk_num_sm if s <= 24]
        if spec.include_rs_dgrad:
            # ring_exchange only: pipeline reduce-scatter dgrad switched in at run time computes wrong input
            # gradients on TE 2.20.2 (rel. error 1.2-2.8 at TP=2 and TP=4, benchmarks/results/engine_* and
            # sweep_dgrad_mode_*); a preset that has it still enters as a prior, behind the numerics guard.
            out += [G(method="ring_exchange", set_sm_margin=True)]
        return out
    if gemm in BULK_WGRAD_GEMMS:
        return [G(method="bulk", num_sm=s, cga_size=2, set_sm_margin=False) for s in spec.bulk_num_sm]
    return []  # external wgrads: nothing to choose


def build_space(
    topo: Topology, ctx: ValidationContext, priors: Iterable[UbConfig] = (), spec: SpaceSpec = SpaceSpec()
) -> dict[str, list[Option]]:
    """``{gemm: [Option, ...]}`` for every tunable GEMM of ``topo``; priors first, then the grid."""
    priors = list(priors)
    space: dict[str, list[Option]] = {}
    for gemm in (g for g in topo.active if topo.tunable(g)):
        seen: set[tuple] = set()
        opts: list[Option] = []
        candidates = [Option(gemm, p.get(gemm)) for p in priors] + [Option(gemm, c) for c in _grid(gemm, spec)]
        if spec.include_off:
            candidates.append(Option(gemm, enabled=False))
        for opt in candidates:
            if opt.cfg is not None and not ctx.fp8:  # FP8-only knobs are noise in a bf16 config
                opt = Option(gemm, dataclasses.replace(opt.cfg, fp8_buf=None, atomic_gemm=None))
            cfg = opt.cfg
            if cfg is not None and ctx.sm_count is not None and (cfg.num_sm or 0) > ctx.sm_count:
                continue
            probe = apply(TuningConfig(), opt, topo)
            if not is_valid(probe, ctx):
                continue
            if opt.enabled and not allows_dgrad_mode(spec, probe.ub, gemm):
                continue
            key = effective_key(opt, ctx)
            if key not in seen:
                seen.add(key)
                opts.append(opt)
        space[gemm] = opts
    return {g: space[g] for g in GEMM_NAMES if g in space}


def all_off(topo: Topology, base: TuningConfig, label: str = "no overlap") -> TuningConfig:
    """``base`` with every GEMM's overlap switched off (sequence parallelism over NCCL)."""
    return TuningConfig(base.ub, frozenset(topo.active), label)
