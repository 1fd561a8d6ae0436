"""Hand-written ``ub_cfgs`` presets, as data, importable by name.

``te_default`` is the empty config (TE's built-in defaults, see :func:`ub_config.te_default`). The
``userbuffers_*`` presets are NeMo 2's (``nemo/collections/llm/recipes/tp_overlap_configs/
userbuffers.py``), which Megatron-Bridge ships unchanged in ``megatron/bridge/training/
comm_overlap.py``. They are given here as the dict NeMo hands to ``initialize_ub``: NeMo's
``PipelineOverlapCfg.fp8_buf`` defaults to the tuple ``(False,)``, which TE reads as *true*, so a
pipeline entry that leaves it at the default carries ``fp8_buf: true``.
"""

from __future__ import annotations

from typing import Any

from megatron_tp_overlap.errors import ConfigError, Problem, did_you_mean
from megatron_tp_overlap.ub.config import UbConfig, parse_ub_cfgs


def _bulk(num_sm: int, cga_size: int = 2, set_sm_margin: bool = False) -> dict[str, Any]:
    return dict(method="bulk", num_sm=num_sm, cga_size=cga_size, set_sm_margin=set_sm_margin)


def _ring(
    aggregate: bool = False, num_sm: int = 1, cga_size: int = 1, set_sm_margin: bool = False, fp8_buf: bool = False
) -> dict[str, Any]:
    return dict(
        method="ring_exchange",
        aggregate=aggregate,
        num_sm=num_sm,
        cga_size=cga_size,
        set_sm_margin=set_sm_margin,
        fp8_buf=fp8_buf,
        atomic_gemm=False,
    )


def _pipe(
    num_sm: int, num_splits: int = 4, cga_size: int = 2, set_sm_margin: bool = True, fp8_buf: bool = True
) -> dict[str, Any]:  # fp8_buf: NeMo's truthy default (False,)
    return dict(
        method="pipeline",
        num_sm=num_sm,
        cga_size=cga_size,
        num_splits=num_splits,
        set_sm_margin=set_sm_margin,
        fp8_buf=fp8_buf,
        atomic_gemm=False,
    )


def _layer(qkv_dgrad, qkv_wgrad, fc1_dgrad, fc1_wgrad, proj_fprop, fc2_fprop, ring=None, **ring_overrides) -> dict:
    ring = ring or _ring()
    d = dict(
        qkv_dgrad=qkv_dgrad,
        qkv_wgrad=qkv_wgrad,
        fc1_dgrad=fc1_dgrad,
        fc1_wgrad=fc1_wgrad,
        qkv_fprop=ring,
        proj_dgrad=ring,
        fc1_fprop=ring,
        fc2_dgrad=ring,
        proj_fprop=proj_fprop,
        fc2_fprop=fc2_fprop,
    )
    d.update(ring_overrides)
    return {k: v for k, v in d.items() if v is not None}  # NeMo skips None fields


_RS_RING = _ring(num_sm=1, set_sm_margin=True)

_RAW: dict[str, dict[str, Any]] = {
    "te_default": {},
    # Llama-3 70B class (h8192)
    "userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192": _layer(
        _bulk(4), _bulk(24), _bulk(2), _bulk(4), _pipe(24), _pipe(16)
    ),
    "userbuffers_fp8_h100_h8192_tp4_mbs1_seqlen8192": _layer(
        _bulk(4), _bulk(24), _bulk(2), _bulk(4), _RS_RING, _RS_RING
    ),
    "userbuffers_bf16_b200_h8192_tp2_mbs1_seqlen8192": _layer(
        _bulk(16), _bulk(24), _bulk(2), _bulk(4), _pipe(32), _pipe(16)
    ),
    "userbuffers_fp8_b200_h8192_tp2_mbs1_seqlen8192": _layer(
        _bulk(4), _bulk(24), _bulk(2), _bulk(4), _RS_RING, _RS_RING
    ),
    # Llama-3.1 405B (h16384)
    "userbuffers_bf16_h100_h16384_tp8_cp2_mbs1_seqlen8192": _layer(
        _bulk(2), _bulk(24), _bulk(2), _bulk(2), _pipe(24), _pipe(8)
    ),
    "userbuffers_fp8_h100_h16384_tp8_cp2_mbs1_seqlen8192": _layer(
        _bulk(2), _bulk(24), _bulk(2), _bulk(2), _RS_RING, _RS_RING
    ),
    "userbuffers_bf16_b200_h16384_tp4_cp2_mbs1_seqlen8192": _layer(
        _bulk(8), _bulk(24), _bulk(2), _bulk(2), _pipe(32), _pipe(8)
    ),
    "userbuffers_fp8_b200_h16384_tp4_cp2_mbs1_seqlen8192": _layer(
        _bulk(8), _bulk(32), _bulk(2), _bulk(8), _RS_RING, _RS_RING
    ),
    # LoRA: non-bulk fc1_dgrad (reduce-scatter), so no wgrad entries
    "userbuffers_fp8_h100_h8192_tp2_mbs1_seqlen4096_lora": _layer(
        _bulk(2),
        None,
        _pipe(16, fp8_buf=True),
        None,
        _ring(cga_size=2, set_sm_margin=True, fp8_buf=True),
        _ring(cga_size=2, set_sm_margin=True, fp8_buf=True),
        ring=_ring(set_sm_margin=True),
    ),
    "userbuffers_fp8_h100_h16384_tp4_mbs1_seqlen2048_lora": _layer(
        _bulk(2),
        None,
        _pipe(16, fp8_buf=True),
        None,
        _pipe(32, fp8_buf=True),
        _pipe(16, fp8_buf=True),
        ring=_ring(aggregate=True),
    ),
    # GPT-3 20B (h6144)
    "userbuffers_bf16_h100_h6144_tp2_mbs2_seqlen2048": _layer(
        _bulk(8), _bulk(16), _bulk(4), _bulk(16), _pipe(16), _pipe(24)
    ),
    "userbuffers_fp8_h100_h6144_tp2_mbs2_seqlen2048": _layer(
        _bulk(8), _bulk(16), _bulk(4), _bulk(16), _pipe(16, fp8_buf=True), _pipe(24, fp8_buf=True)
    ),
    # GPT-3 175B (h12288)
    "userbuffers_bf16_h100_h12288_tp4_mbs1_seqlen2048": _layer(
        _bulk(4), _bulk(4), _bulk(2), _bulk(4), _pipe(24), _RS_RING
    ),
    "userbuffers_fp8_h100_h12288_tp4_mbs1_seqlen2048": _layer(
        _bulk(4), _bulk(4), _bulk(2), _bulk(4), _RS_RING, _RS_RING
    ),
    "userbuffers_bf16_b200_h12288_tp4_mbs1_seqlen2048": _layer(
        _bulk(4), _bulk(16), _bulk(2), _bulk(8), _RS_RING, _RS_RING
    ),
    "userbuffers_fp8_b200_h12288_tp4_mbs1_seqlen2048": _layer(
        _bulk(4), _bulk(16), _bulk(2), _bulk(8), _RS_RING, _RS_RING
    ),
    # Nemotron-4 15B / 340B
    "userbuffers_bf16_b200_h6144_tp2_mbs1_seqlen4096": _layer(
        _bulk(8), _bulk(32), _bulk(2), _bulk(8), _RS_RING, _RS_RING
    ),
    "userbuffers_bf16_b200_h18432_tp8_mbs1_seqlen4096": _layer(
        _bulk(8), _bulk(32), _bulk(2), _bulk(8), _RS_RING, _pipe(24)
    ),
    "userbuffers_fp8_b200_h18432_tp8_mbs1_seqlen4096": _layer(
        _bulk(8), _bulk(32), _bulk(2), _bulk(8), _RS_RING, _RS_RING
    ),
}

PRESETS: dict[str, UbConfig] = {name: parse_ub_cfgs(raw, source=f"preset {name}") for name, raw in _RAW.items()}
NEMO_PRESETS = tuple(n for n in PRESETS if n.startswith("userbuffers_"))


def get_preset(name: str) -> UbConfig:
    """The preset called ``name``; a clear error listing the valid names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        rule = f"unknown preset{did_you_mean(name, PRESETS)}; list them with `megatron-tp-overlap preset`"
        raise ConfigError([Problem("preset", name, rule)]) from None


def closest_preset(hidden: int, tp_size: int, fp8: bool, gpu: str = "h100") -> str:
    """The NeMo preset whose (dtype, GPU, hidden, TP) is nearest: what a user would copy today."""
    dtype = "fp8" if fp8 else "bf16"
    gpu = "b200" if "b200" in gpu.lower() else "h100"

    def score(name: str) -> tuple:
        _, dt, dev, h, tp, *_ = name.split("_")  # userbuffers_bf16_h100_h8192_tp4_...
        return (dt != dtype, "lora" in name, dev != gpu, abs(int(h[1:]) - hidden), abs(int(tp[2:]) - tp_size))

    return min(NEMO_PRESETS, key=score)
