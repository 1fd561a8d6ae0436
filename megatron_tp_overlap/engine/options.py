"""The autotune options: the one place where each option, its type, default and meaning is written.

Every way in is generated from :class:`TuneOptions`: the Megatron-LM flags
(``--tp-comm-overlap-autotune-<name>``, :mod:`integrations.megatron.flags`), the Megatron-Bridge config
fields and the NeMo callback arguments (``tp_comm_overlap_autotune_<name>``), and the Hydra group
``tp_overlap`` of the main job (its dataclass extends this one).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_tp_overlap.errors import did_you_mean

STRATEGIES = ("coordinate", "slot_exhaustive", "exhaustive")
TUNED_YAML_NAME = "tp_comm_overlap_tuned.yaml"  # default output file name, in the run's output folder
PREFIX = "tp_comm_overlap_autotune"  # Megatron/Bridge/NeMo name of the switch; options are PREFIX_<name>


def _opt(default: Any, help: str, **meta: Any) -> Any:
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class TuneOptions:
    """What a user may set about tuning. Units: seconds, steps."""

    seconds: float = _opt(
        180.0,
        "Budget: wall seconds of tuning (a hard cap, the trial in flight included). A search ends early once nothing "
        "left can pay for a switch; one whose noisy slots leave a GEMM undecided spends the rest on its runners-up "
        "(medians of 114-116 s on real H200 steps of two shapes).",
    )
    steps: int = _opt(
        0,
        "Budget: trial steps, warm-ups included. 0: no step limit, the seconds alone cap tuning (a step limit bound "
        "before the seconds where trial steps are short: 387 of 400 steps at 40-54 s of 60 on 2 H200s, decisions "
        "left unresolved).",
        min=0,
    )
    strategy: str = _opt("coordinate", "Search strategy.", choices=STRATEGIES)
    output: Optional[str] = _opt(
        None,
        "Tuned YAML path (default: next to --tp-comm-overlap-cfg, else in the checkpoint folder, else ./"
        f"{TUNED_YAML_NAME}); the report is written beside it.",
    )
    reuse: bool = _opt(False, "Reuse a config tuned before for the same GPU, shape, dtype and TE version (the cache).")
    cache_dir: Optional[str] = _opt(
        None, "Tuned-config cache (default: $MEGATRON_TP_OVERLAP_CACHE or ~/.cache/megatron_tp_overlap)."
    )
    allow_off: bool = _opt(
        False, "Also consider switching a GEMM's overlap off (a module flag the YAML cannot express)."
    )
    rtol: float = _opt(
        2e-2,
        "Numerics guard: relative error of loss/gradient fingerprints vs no overlap that a candidate may always "
        "have; the bound is max(this, 3x the starting config's own error), at most 0.5.",
        max=0.5,
    )
    trial_timeout: float = _opt(120.0, "Seconds: a candidate whose trial takes longer is rejected.")
    microbatches: int = _opt(
        0,
        "Micro-batches per trial step (at most the run's own). 0: the fewest the pipeline schedule takes: 1 without "
        "pipeline parallelism, the pipeline size with it, all of them with an interleaved schedule. The overlapped "
        "GEMMs run the same per micro-batch, and shorter trial steps let the budget hold the whole search.",
        min=0,
    )
    verify_iters: int = _opt(
        384,
        "Most measured training iterations after tuning that alternate the tuned config and the starting one (ABBA "
        "in blocks of 4 iterations; the first iteration after each switch runs unmeasured) to measure the gain in "
        "this run with its interval; it stops as soon as the interval decides (from 96 on). If the tuned config is "
        "not faster beyond the interval, the run goes back to the starting config and rewrites the YAML. 0: off.",
        min=0,
    )

    def problems(self, name: Callable[[str], str] = lambda k: k) -> list[str]:
        """Every broken rule, each naming the option as the user typed it (``name(field)``)."""
        p = []
        for f in dataclasses.fields(self):
            v, n = getattr(self, f.name), name(f.name)
            numeric = f.type in ("float", "int")
            if f.metadata.get("choices") and v not in f.metadata["choices"]:
                p.append(
                    f"{n} = {v!r}: must be one of {', '.join(f.metadata['choices'])}{did_you_mean(v, f.metadata['choices'])}"
                )
            elif numeric and (isinstance(v, bool) or not isinstance(v, (int, float))):
                p.append(f"{n} = {v!r}: must be a number")
            elif f.type == "int" and v < f.metadata.get("min", 1):
                p.append(f"{n} = {v}: must be >= {f.metadata.get('min', 1)}")
            elif f.type == "float" and not (math.isfinite(v) and v > 0):
                p.append(f"{n} = {v}: must be a finite number > 0")
            elif "max" in f.metadata and v > f.metadata["max"]:
                p.append(f"{n} = {v}: must be <= {f.metadata['max']}")
        return p

    @classmethod
    def from_prefixed(cls, values: Mapping[str, Any], prefix: str = PREFIX) -> TuneOptions:
        """Options from ``{prefix_<name>: value}`` (Bridge fields, NeMo arguments); other keys are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(
            **{
                k[len(prefix) + 1 :]: v
                for k, v in values.items()
                if k[len(prefix) + 1 :] in names and k.startswith(prefix + "_")
            }
        )

    def prefixed(self, prefix: str = PREFIX) -> dict[str, Any]:
        return {f"{prefix}_{k}": v for k, v in dataclasses.asdict(self).items()}


def option_fields() -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(TuneOptions)


def unknown_prefixed(keys: Any, prefix: str = PREFIX) -> list[str]:
    """Problems for keys that start with ``prefix_`` but name no option (a typo would be silently ignored)."""
    names = [f.name for f in option_fields()]
    out = []
    for k in keys:
        if k.startswith(prefix + "_") and k[len(prefix) + 1 :] not in names:
            out.append(
                f"{k}: unknown autotune option{did_you_mean(k[len(prefix) + 1 :], names, prefix + '_')}; "
                f"valid: {', '.join(prefix + '_' + n for n in names)}"
            )
    return out
