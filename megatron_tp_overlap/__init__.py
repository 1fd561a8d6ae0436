"""megatron-tp-overlap: autotune Transformer Engine's tensor-parallel comm/GEMM overlap (userbuffers)."""
from .errors import ConfigError, Problem, StaleCommunicatorError
from .presets import PRESETS, get_preset
from .search import SearchOptions
from .space import SpaceSpec, TuningConfig
from .ub_config import GEMM_NAMES, GemmOverlapConfig, UbConfig, dumps_yaml, load_yaml, loads_yaml, te_default
from .validation import ValidationContext, check, load_and_validate

__version__ = "0.1.0"

__all__ = [
    "ConfigError", "Problem", "StaleCommunicatorError", "PRESETS", "get_preset", "SearchOptions", "SpaceSpec",
    "TuningConfig", "GEMM_NAMES", "GemmOverlapConfig", "UbConfig", "dumps_yaml", "load_yaml", "loads_yaml",
    "te_default", "ValidationContext", "check", "load_and_validate", "__version__",
]
