"""megatron-tp-overlap: autotune Transformer Engine's tensor-parallel comm/GEMM overlap (userbuffers)."""

from megatron_tp_overlap.engine.options import TuneOptions
from megatron_tp_overlap.engine.search import SearchOptions
from megatron_tp_overlap.engine.space import SpaceSpec, TuningConfig
from megatron_tp_overlap.errors import ConfigError, Problem, StaleCommunicatorError
from megatron_tp_overlap.ub.config import (
    GEMM_NAMES,
    GemmOverlapConfig,
    UbConfig,
    dumps_yaml,
    load_yaml,
    loads_yaml,
    te_default,
)
from megatron_tp_overlap.ub.presets import PRESETS, get_preset
from megatron_tp_overlap.ub.rules import ValidationContext, check, load_and_validate

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "Problem",
    "StaleCommunicatorError",
    "PRESETS",
    "get_preset",
    "SearchOptions",
    "SpaceSpec",
    "TuneOptions",
    "TuningConfig",
    "GEMM_NAMES",
    "GemmOverlapConfig",
    "UbConfig",
    "dumps_yaml",
    "load_yaml",
    "loads_yaml",
    "te_default",
    "ValidationContext",
    "check",
    "load_and_validate",
    "__version__",
]
