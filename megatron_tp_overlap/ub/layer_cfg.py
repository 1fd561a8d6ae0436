"""Conversion between NeMo 2 / Megatron-Bridge overlap dataclasses and :class:`UbConfig`.

NeMo 2 (``nemo/collections/llm/recipes/tp_overlap_configs/userbuffers.py``) and Megatron-Bridge
(``megatron/bridge/training/comm_overlap.py``) describe a layer's userbuffers config as a
``TransformerLayerTPOverlapCfg`` with ten fields (qkv/proj/fc1/fc2 fprop and dgrad, qkv/fc1 wgrad),
each a ``BulkOverlapCfg``, ``RingExchangeOverlapCfg`` or ``PipelineOverlapCfg`` (or None). Both hand
``asdict(cfg)`` without the None fields to TE's ``initialize_ub``. Two things follow:

- What TE runs is that dict, so :func:`from_layer_cfg` converts exactly it, including NeMo's
  ``PipelineOverlapCfg.fp8_buf`` default ``(False,)``: a non-empty tuple, which TE reads as *true*.
- The other way, :func:`to_layer_cfg` writes every knob explicitly (plain booleans) and fills the
  GEMMs the config leaves to TE with TE's own defaults, so the dataclass means what the YAML means.

Nothing here imports NeMo or Megatron-Bridge: pass their classes (``classes=``) or let
:func:`framework_classes` find them; without either, :class:`LayerCfgClasses` mirrors their fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_tp_overlap.errors import ConfigError, Problem
from megatron_tp_overlap.ub.config import (
    BOOL_KNOBS,
    GemmOverlapConfig,
    UbConfig,
    load_yaml,
    parse_ub_cfgs,
    te_default,
)

LAYER_FIELDS = (
    "qkv_dgrad",
    "qkv_wgrad",
    "fc1_dgrad",
    "fc1_wgrad",
    "qkv_fprop",
    "proj_dgrad",
    "fc1_fprop",
    "fc2_dgrad",
    "proj_fprop",
    "fc2_fprop",
)


# The frameworks' classes, field for field (for tests and for users without NeMo/Bridge installed).
@dataclass
class BulkOverlapCfg:
    num_sm: int
    cga_size: int
    set_sm_margin: bool
    method: str = "bulk"


@dataclass
class RingExchangeOverlapCfg:
    aggregate: bool = False
    method: str = "ring_exchange"
    num_sm: int = 1
    cga_size: int = 1
    set_sm_margin: bool = False
    fp8_buf: bool = False
    atomic_gemm: bool = False


@dataclass
class PipelineOverlapCfg:
    num_sm: int
    cga_size: int
    num_splits: int
    set_sm_margin: bool
    fp8_buf: bool = (False,)  # type: ignore[assignment]  # as in NeMo/Bridge: truthy
    atomic_gemm: bool = False
    method: str = "pipeline"


@dataclass
class TransformerLayerTPOverlapCfg:
    qkv_dgrad: Any
    qkv_wgrad: Any
    fc1_dgrad: Any
    fc1_wgrad: Any
    qkv_fprop: Any
    proj_dgrad: Any
    fc1_fprop: Any
    fc2_dgrad: Any
    proj_fprop: Any
    fc2_fprop: Any


@dataclass(frozen=True)
class LayerCfgClasses:
    """The four classes of one framework (NeMo 2 or Megatron-Bridge, or the mirrors above)."""

    layer: type = TransformerLayerTPOverlapCfg
    bulk: type = BulkOverlapCfg
    ring: type = RingExchangeOverlapCfg
    pipeline: type = PipelineOverlapCfg
    source: str = field(default="megatron_tp_overlap mirror", compare=False)


def framework_classes(prefer: str = "Megatron-Bridge") -> LayerCfgClasses:
    """The framework's classes (``prefer`` first, "Megatron-Bridge" or "NeMo 2"; the other if that one does
    not import), else the mirrors."""
    frameworks = [
        ("megatron.bridge.training.comm_overlap", "Megatron-Bridge"),
        ("nemo.collections.llm.recipes.tp_overlap_configs.userbuffers", "NeMo 2"),
    ]
    for mod_name, source in sorted(frameworks, key=lambda f: f[1] != prefer):
        try:
            mod = __import__(mod_name, fromlist=["TransformerLayerTPOverlapCfg"])
            return LayerCfgClasses(
                mod.TransformerLayerTPOverlapCfg,
                mod.BulkOverlapCfg,
                mod.RingExchangeOverlapCfg,
                mod.PipelineOverlapCfg,
                source,
            )
        except Exception:  # noqa: BLE001 - not installed, or its imports fail (e.g. no TE on a CPU machine)
            continue
    return LayerCfgClasses()


def as_ub_cfgs(cfg: Any) -> dict[str, Any]:
    """The dict NeMo/Bridge hand to ``initialize_ub``: ``asdict(cfg)`` without None fields."""
    raw = cfg if isinstance(cfg, dict) else dataclasses.asdict(cfg)
    return {k: v for k, v in raw.items() if v is not None}


def from_layer_cfg(cfg: Any, source: str = "TransformerLayerTPOverlapCfg") -> UbConfig:
    """A NeMo/Bridge ``TransformerLayerTPOverlapCfg`` (or its ``asdict``) as the :class:`UbConfig` TE runs.

    Knob values are taken as TE takes them: a tuple ``fp8_buf=(False,)`` is true.
    """
    raw = as_ub_cfgs(cfg)
    te_view = {
        g: (
            {k: (bool(v) if k in BOOL_KNOBS and isinstance(v, tuple) else v) for k, v in e.items()}
            if isinstance(e, dict)
            else e
        )
        for g, e in raw.items()
    }
    return parse_ub_cfgs(te_view, source)


def to_layer_cfg(ub: UbConfig, tp_size: int, classes: LayerCfgClasses | None = None) -> Any:
    """``ub`` as a ``TransformerLayerTPOverlapCfg`` of ``classes`` (default :func:`framework_classes`).

    GEMMs that ``ub`` leaves to TE get TE's default for ``tp_size`` written out; a wgrad whose dgrad
    is a reduce-scatter (TE forbids its entry) is None, as in NeMo's LoRA presets.
    """
    classes = classes or framework_classes()
    extra = [g for g, _ in ub.entries if g not in LAYER_FIELDS]
    if extra:
        raise ConfigError(
            [
                Problem(
                    g,
                    "(entry)",
                    f"TransformerLayerTPOverlapCfg has no field for this GEMM (fields: {', '.join(LAYER_FIELDS)})",
                )
                for g in extra
            ]
        )
    out = {}
    for g in LAYER_FIELDS:
        wgrad_of = g.replace("wgrad", "dgrad") if g.endswith("wgrad") else None
        if wgrad_of and ub.dgrad_is_reduce_scatter(wgrad_of):
            out[g] = None
            continue
        out[g] = _entry(g, (ub.get(g) or GemmOverlapConfig()).merged_over(te_default(g, tp_size)), classes)
    return classes.layer(**out)


def _entry(gemm: str, c: GemmOverlapConfig, classes: LayerCfgClasses) -> Any:
    b = lambda v: bool(v) if v is not None else False  # noqa: E731 - explicit booleans, never the (False,) default
    if c.method == "bulk":
        return classes.bulk(num_sm=c.num_sm, cga_size=c.cga_size, set_sm_margin=b(c.set_sm_margin))
    if c.method == "ring_exchange":
        return classes.ring(
            aggregate=b(c.aggregate),
            num_sm=c.num_sm,
            cga_size=c.cga_size,
            set_sm_margin=b(c.set_sm_margin),
            fp8_buf=b(c.fp8_buf),
            atomic_gemm=b(c.atomic_gemm),
        )
    if c.method == "pipeline":
        return classes.pipeline(
            num_sm=c.num_sm,
            cga_size=c.cga_size,
            num_splits=c.num_splits,
            set_sm_margin=b(c.set_sm_margin),
            fp8_buf=b(c.fp8_buf),
            atomic_gemm=b(c.atomic_gemm),
        )
    raise ConfigError([Problem(f"{gemm}.method", c.method, "NeMo/Megatron-Bridge have no dataclass for this method")])


def load_layer_cfg(path: str | Path, tp_size: int, prefer: str = "NeMo 2") -> Any:
    """A tuned YAML (``--tp-comm-overlap-cfg``) as the ``TransformerLayerTPOverlapCfg`` that NeMo 2's
    ``MegatronCommOverlapCallback(tp_comm_overlap_cfg=...)`` takes (the tuning's recipe names this call)."""
    return to_layer_cfg(load_yaml(path), tp_size, framework_classes(prefer))


def reference_config(cfg: Any) -> UbConfig:
    """A run's ``tp_comm_overlap_cfg`` before tuning, as NeMo/Bridge hold it: a YAML path, a
    ``TransformerLayerTPOverlapCfg`` (or its ``asdict``), or None (TE's defaults)."""
    if cfg is None:
        return UbConfig()
    if isinstance(cfg, (str, Path)):
        return load_yaml(cfg)
    return from_layer_cfg(cfg)
