"""NeMo 2 / Megatron-Bridge overlap dataclasses <-> UbConfig."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
from pathlib import Path

import pytest

from megatron_tp_overlap.errors import ConfigError
from megatron_tp_overlap.ub.config import GemmOverlapConfig, UbConfig, parse_ub_cfgs, te_default
from megatron_tp_overlap.ub.layer_cfg import (
    BulkOverlapCfg,
    LayerCfgClasses,
    PipelineOverlapCfg,
    RingExchangeOverlapCfg,
    TransformerLayerTPOverlapCfg,
    as_ub_cfgs,
    from_layer_cfg,
    to_layer_cfg,
)
from megatron_tp_overlap.ub.presets import PRESETS

MIRROR = LayerCfgClasses()


def bf16_h100_h8192_tp4():  # NeMo's userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192, written as NeMo writes it
    ring = RingExchangeOverlapCfg(aggregate=False)
    return TransformerLayerTPOverlapCfg(
        qkv_dgrad=BulkOverlapCfg(num_sm=4, cga_size=2, set_sm_margin=False),
        qkv_wgrad=BulkOverlapCfg(num_sm=24, cga_size=2, set_sm_margin=False),
        fc1_dgrad=BulkOverlapCfg(num_sm=2, cga_size=2, set_sm_margin=False),
        fc1_wgrad=BulkOverlapCfg(num_sm=4, cga_size=2, set_sm_margin=False),
        qkv_fprop=ring,
        proj_dgrad=ring,
        fc1_fprop=ring,
        fc2_dgrad=ring,
        proj_fprop=PipelineOverlapCfg(num_sm=24, cga_size=2, num_splits=4, set_sm_margin=True),
        fc2_fprop=PipelineOverlapCfg(num_sm=16, cga_size=2, num_splits=4, set_sm_margin=True),
    )


def test_from_nemo_reads_the_truthy_fp8_buf_default_as_te_does():
    ub = from_layer_cfg(bf16_h100_h8192_tp4())
    assert ub.get("fc2_fprop").fp8_buf is True  # (False,) is a non-empty tuple
    assert ub.get("qkv_fprop").fp8_buf is False
    assert ub == PRESETS["userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192"]


def test_none_fields_are_left_out_as_nemo_does():
    cfg = dataclasses.replace(bf16_h100_h8192_tp4(), fc1_wgrad=None, fc1_dgrad=PipelineOverlapCfg(16, 2, 4, True))
    assert "fc1_wgrad" not in as_ub_cfgs(cfg)
    assert from_layer_cfg(cfg).get("fc1_wgrad") is None


def test_round_trip_keeps_what_te_runs():
    for name, ub in PRESETS.items():
        back = from_layer_cfg(to_layer_cfg(ub, tp_size=4, classes=MIRROR))
        for g in ("qkv_fprop", "qkv_dgrad", "proj_fprop", "fc1_dgrad", "fc2_fprop"):
            if (ub.get(g) or back.get(g)) is None:
                continue
            want = (ub.get(g) or GemmOverlapConfig()).merged_over(te_default(g, 4))
            got = back.get(g).merged_over(te_default(g, 4))
            for knob in ("method", "num_sm", "cga_size", "set_sm_margin", "aggregate", "atomic_gemm"):
                assert getattr(got, knob) == getattr(want, knob), (name, g, knob)
            if want.method == "pipeline":
                assert got.num_splits == want.num_splits, (name, g)


def test_to_dataclass_writes_explicit_booleans_and_te_defaults():
    ub = parse_ub_cfgs({"fc2_fprop": {"method": "ring_exchange", "set_sm_margin": True}})
    cfg = to_layer_cfg(ub, tp_size=2, classes=MIRROR)
    assert isinstance(cfg.fc2_fprop, RingExchangeOverlapCfg) and cfg.fc2_fprop.set_sm_margin is True
    assert isinstance(cfg.proj_fprop, PipelineOverlapCfg) and cfg.proj_fprop.fp8_buf is False  # not (False,)
    assert cfg.proj_fprop.num_sm == 16 and cfg.proj_fprop.num_splits == 4  # TE's default for a RS GEMM
    assert isinstance(cfg.qkv_dgrad, BulkOverlapCfg) and cfg.qkv_dgrad.num_sm == 16


def test_a_reduce_scatter_dgrad_has_no_wgrad_field():
    ub = parse_ub_cfgs({"fc1_dgrad": {"method": "ring_exchange"}})
    cfg = to_layer_cfg(ub, tp_size=2, classes=MIRROR)
    assert cfg.fc1_wgrad is None and isinstance(cfg.qkv_wgrad, BulkOverlapCfg)


def test_gemms_the_dataclass_cannot_hold_are_refused():
    with pytest.raises(ConfigError, match="proj_wgrad"):
        to_layer_cfg(parse_ub_cfgs({"proj_wgrad": {"method": "external"}}), tp_size=2, classes=MIRROR)
    assert isinstance(to_layer_cfg(UbConfig(), 2, MIRROR), TransformerLayerTPOverlapCfg)


def _real_comm_overlap_source() -> Path | None:
    """Megatron-Bridge's comm_overlap.py where the wheel is installed (it does not import without TE)."""
    try:
        spec = importlib.util.find_spec("megatron.bridge")
    except ModuleNotFoundError:  # no megatron package at all
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / "training" / "comm_overlap.py"
    return p if p.exists() else None


def test_the_presets_match_megatron_bridges_own_definitions():
    """The real classes and presets, taken from Megatron-Bridge's source (its module needs TE to import)."""
    src = _real_comm_overlap_source()
    if src is None:
        pytest.skip("megatron-bridge is not installed here")
    tree = ast.parse(src.read_text())
    keep = [
        n
        for n in tree.body
        if (isinstance(n, ast.ClassDef) and n.name.endswith("OverlapCfg"))
        or (
            isinstance(n, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id.startswith("userbuffers_") for t in n.targets)
        )
    ]
    ns: dict = {}
    exec(
        compile(
            ast.Module(body=[ast.parse("from dataclasses import dataclass").body[0], *keep], type_ignores=[]),
            str(src),
            "exec",
        ),
        ns,
    )
    real = LayerCfgClasses(
        ns["TransformerLayerTPOverlapCfg"],
        ns["BulkOverlapCfg"],
        ns["RingExchangeOverlapCfg"],
        ns["PipelineOverlapCfg"],
        "Megatron-Bridge source",
    )
    names = [k for k in ns if k.startswith("userbuffers_")]
    assert len(names) >= 19
    for name in names:
        assert from_layer_cfg(ns[name], name) == PRESETS[name], name
    # and our dataclasses are accepted by the real classes, field for field
    made = to_layer_cfg(PRESETS["userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192"], 4, real)
    assert type(made).__name__ == "TransformerLayerTPOverlapCfg"
    assert from_layer_cfg(made) == from_layer_cfg(
        to_layer_cfg(PRESETS["userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192"], 4, MIRROR)
    )
