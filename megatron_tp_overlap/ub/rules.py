"""TE 2.20's rules for ``ub_cfgs`` (``transformer_engine/pytorch/module/base.py::initialize_ub``),
checked on the CPU before any GPU work, all at once, each problem naming key, value and rule.

Some rules are stricter than TE where TE would accept a config that fails later or silently does
something else (a knob the method ignores is a warning, not an error).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from megatron_tp_overlap.errors import ConfigError, Problem
from megatron_tp_overlap.ub.config import (
    AG_GEMMS,
    AG_RS_PAIRS,
    BULK_DGRAD_GEMMS,
    BULK_WGRAD_GEMMS,
    EXTERNAL_GEMMS,
    RS_GEMMS,
    UbConfig,
    parse_yaml,
    read_text,
    te_default,
)

MAX_CGA_SIZE = 4
# SMs per GPU as torch reports them (multi_processor_count), for checks made away from the GPU (SXM parts)
GPU_SM_COUNTS = {"h100": 132, "h200": 132, "b200": 148}
MAX_SM_COUNT = 160  # the most of any GPU so far (B300): a num_sm above it fits no GPU, whichever runs it


@dataclass(frozen=True)
class ValidationContext:
    """What the rules depend on. ``sm_count=None`` skips the upper bound of ``num_sm``, ``tokens=None`` (sequence x
    micro-batch / CP, the userbuffers' rows) that of ``num_splits``."""

    fp8: bool = False
    sm_count: int | None = None
    tp_size: int | None = None
    tokens: int | None = None


def allowed_methods(name: str) -> tuple[str, ...]:
    if name in AG_GEMMS:
        return ("ring_exchange",)  # TE rejects pipeline for AG; bulk has no split AG kernel
    if name in RS_GEMMS:
        return ("ring_exchange", "pipeline")
    if name in BULK_DGRAD_GEMMS:
        return ("bulk", "ring_exchange", "pipeline")  # non-bulk: dgrad GEMM -> reduce-scatter
    if name in BULK_WGRAD_GEMMS:
        return ("bulk",)
    if name in EXTERNAL_GEMMS:
        return ("external",)
    raise KeyError(name)


_ROLE = {
    **{n: "an all-gather GEMM" for n in AG_GEMMS},
    **{n: "a reduce-scatter GEMM" for n in RS_GEMMS},
    **{n: "a bulk all-gather (or, non-bulk, reduce-scatter) dgrad GEMM" for n in BULK_DGRAD_GEMMS},
    **{n: "a bulk reduce-scatter wgrad GEMM" for n in BULK_WGRAD_GEMMS},
    **{n: f"a wgrad GEMM that reuses {d}'s all-gather" for n, d in EXTERNAL_GEMMS.items()},
}


def check(
    cfg: UbConfig,
    ctx: ValidationContext = ValidationContext(),
    source: str | None = None,
    lines: Mapping[str, int] | None = None,
) -> list[str]:
    """Raise :class:`ConfigError` listing every broken rule; return warnings (ignored knobs)."""
    lines = lines or {}
    problems: list[Problem] = []
    notes: list[str] = []
    tp = ctx.tp_size or 2

    def where(key: str) -> str | None:
        line = lines.get(key)
        return f"{source}:{line}" if source and line else source

    def bad(key: str, value, rule: str) -> None:
        problems.append(Problem(key, value, rule, where(key)))

    for name, c in cfg.items():
        method = c.method or te_default(name, tp).method
        if c.method is not None and c.method not in allowed_methods(name):
            rule = f"{name} is {_ROLE[name]}: allowed methods are {', '.join(allowed_methods(name))}"
            if c.method == "pipeline":
                rule = f"`pipeline` only overlaps reduce-scatter GEMMs; {rule}"
            if c.method == "external":
                rule = f"`external` only applies to proj_wgrad/fc2_wgrad; {rule}"
            bad(f"{name}.method", c.method, rule)
        if c.num_sm is not None and c.num_sm < 1:
            bad(f"{name}.num_sm", c.num_sm, "must be >= 1")
        if c.num_sm is not None and ctx.sm_count is not None and c.num_sm > ctx.sm_count:
            bad(f"{name}.num_sm", c.num_sm, f"must be <= the GPU's SM count ({ctx.sm_count})")
        elif c.num_sm is not None and c.num_sm > MAX_SM_COUNT:
            bad(f"{name}.num_sm", c.num_sm, f"must be <= {MAX_SM_COUNT}, the most SMs of any GPU")
        if c.cga_size is not None and not 1 <= c.cga_size <= MAX_CGA_SIZE:
            bad(f"{name}.cga_size", c.cga_size, f"must be in 1..{MAX_CGA_SIZE}")
        if c.num_splits is not None and c.num_splits < 1:
            bad(f"{name}.num_splits", c.num_splits, "must be >= 1")
        elif c.num_splits is not None and ctx.tokens and c.num_splits > ctx.tokens // tp:
            # a pipelined GEMM splits its [tokens, hidden] output into num_splits chunks, each reduce-scattered over
            # the TP ranks: a chunk needs at least one row per rank
            bad(
                f"{name}.num_splits", c.num_splits, f"must be <= tokens / TP = {ctx.tokens} / {tp} = {ctx.tokens // tp}"
            )
        if c.is_reduce_scatter is not None:
            expected = name in RS_GEMMS or name in BULK_WGRAD_GEMMS or cfg.dgrad_is_reduce_scatter(name)
            if c.is_reduce_scatter != expected:
                bad(
                    f"{name}.is_reduce_scatter",
                    c.is_reduce_scatter,
                    f"TE derives it from the GEMM and method; for {name} with method {method} it is {expected}",
                )
        if c.atomic_gemm:
            if not ctx.fp8:
                bad(f"{name}.atomic_gemm", True, "atomic GEMM overlap is supported only with FP8")
            if method in ("bulk", "external"):
                bad(f"{name}.atomic_gemm", True, f"atomic GEMM does not apply to `{method}` overlap")
        # Knobs the method ignores: accepted by TE, so a warning, not an error.
        ignored = []
        if method != "pipeline":
            ignored += [k for k in ("num_splits", "pipeline_rs_overlap_first_gemm") if getattr(c, k) is not None]
        if method != "ring_exchange":
            ignored += [k for k in ("aggregate", "use_ce") if getattr(c, k) is not None]
        if ignored:
            notes.append(f"{name}: {', '.join(ignored)} ignored by TE for method {method}")

    # A non-bulk qkv_dgrad/fc1_dgrad already reduce-scatters: TE forbids an entry for its wgrad.
    for dgrad in BULK_DGRAD_GEMMS:
        wgrad = dgrad.replace("dgrad", "wgrad")
        if cfg.dgrad_is_reduce_scatter(dgrad) and wgrad in cfg:
            bad(
                wgrad,
                cfg.get(wgrad).to_dict(),  # type: ignore[union-attr]
                f"no entry allowed when {dgrad} uses non-bulk method `{cfg.method(dgrad)}` (its reduce-scatter replaces the wgrad overlap)",
            )

    # `external` wgrad rides on the matching dgrad's ring-exchange all-gather.
    for wgrad, dgrad in EXTERNAL_GEMMS.items():
        if cfg.method(wgrad, tp) == "external" and cfg.method(dgrad, tp) != "ring_exchange":
            bad(
                f"{dgrad}.method",
                cfg.method(dgrad, tp),
                f"{wgrad} uses `external`, which needs ring_exchange on {dgrad}",
            )

    # Atomic GEMM + ring_exchange shuffles chunks in the AG GEMM that the paired RS GEMM un-shuffles.
    for ag, rs in AG_RS_PAIRS.items():

        def atomic_ring(n: str) -> bool:
            c = cfg.get(n)
            return bool(c and c.atomic_gemm) and cfg.method(n, tp) == "ring_exchange"

        if atomic_ring(ag) != atomic_ring(rs):
            on, off = (ag, rs) if atomic_ring(ag) else (rs, ag)
            bad(
                f"{off}.atomic_gemm",
                bool(cfg.get(off) and cfg.get(off).atomic_gemm),  # type: ignore[union-attr]
                f"{on} uses atomic_gemm with ring_exchange, so its pair {off} must too (TE shuffles/un-shuffles GEMM chunks across the pair)",
            )

    if problems:
        raise ConfigError(problems, source)
    return notes


def validate(cfg: UbConfig, ctx: ValidationContext = ValidationContext(), source: str | None = None) -> UbConfig:
    """:func:`check`, emitting its notes as warnings; returns ``cfg`` for chaining."""
    for note in check(cfg, ctx, source):
        warnings.warn(note, stacklevel=2)
    return cfg


def validate_text(
    text: str, ctx: ValidationContext = ValidationContext(), source: str = "<string>"
) -> tuple[UbConfig, list[str]]:
    """Parse and check YAML text: structural and semantic problems, with file and line."""
    cfg, lines = parse_yaml(text, source)
    return cfg, check(cfg, ctx, source, lines)


def load_and_validate(path: str | Path, ctx: ValidationContext = ValidationContext()) -> tuple[UbConfig, list[str]]:
    """Read and check a Megatron ``--tp-comm-overlap-cfg`` YAML; returns (config, warnings)."""
    return validate_text(read_text(path), ctx, str(path))
