"""What a search measures and decides: measurements, trials, contenders, results, and the search options."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from megatron_tp_overlap.engine.options import STRATEGIES, TuneOptions
from megatron_tp_overlap.engine.space import TuningConfig


@dataclass
class Measurement:
    """Times of ``steps`` consecutive steps of one config, max over ranks. Units: ms, s."""

    slot_ms: dict[str, list[float]]  # slot -> one value per step (summed over layers)
    step_ms: list[float]
    elapsed_s: float  # agreed wall clock since tuning started, after this measurement
    steps_run: int  # steps actually executed, warmup included


class TrialFailed(RuntimeError):
    """A config raised (or gave a bad result) on some rank; all ranks raise it together."""


Evaluate = Callable[[TuningConfig, int, int], Measurement]  # (config, steps, warmup) -> Measurement
Verify = Callable[[TuningConfig], "str | None"]  # None when the config computes the right numbers


@dataclass(frozen=True)
class SearchOptions:
    strategy: str = TuneOptions.strategy  # one of STRATEGIES
    max_steps: int = TuneOptions.steps  # trial steps in all, warmups and confirmation included
    max_seconds: float = TuneOptions.seconds
    screen_steps: int = 2  # measured steps per screening trial
    warmup_steps: int = 1  # after each switch
    keep: int = 2  # options per GEMM that survive screening
    halving_steps: int = 4
    confirm_steps: int = 6
    confirm_rounds: int = 3
    z: float = 2.0  # gains must exceed z standard errors
    rel_floor: float = 0.002  # ... and this fraction of the time
    max_exhaustive: int = 512

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy = {self.strategy!r}: must be one of {', '.join(STRATEGIES)}")
        for k in ("max_steps", "screen_steps", "keep", "halving_steps", "confirm_steps", "confirm_rounds"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k} = {getattr(self, k)}: must be >= 1")
        if self.max_seconds <= 0:
            raise ValueError(f"max_seconds = {self.max_seconds}: must be > 0")


@dataclass
class Trial:
    index: int
    phase: str  # baseline | screen | halving | confirm | exhaustive
    config: TuningConfig
    tested: dict[str, str]  # slot -> option label tried in this trial ("incumbent" for baselines)
    slot_ms: dict[str, float] = field(default_factory=dict)  # median per slot
    step_ms: float | None = None  # median
    step_samples: list[float] = field(default_factory=list)
    error: str | None = None

    def to_dict(self) -> dict:
        return {
            "index": self.index,
            "phase": self.phase,
            "config": self.config.to_dict(),
            "tested": self.tested,
            "slot_ms": {k: round(v, 4) for k, v in self.slot_ms.items()},
            "step_ms": None if self.step_ms is None else round(self.step_ms, 4),
            "step_samples_ms": [round(s, 4) for s in self.step_samples],
            "error": self.error,
        }


@dataclass
class Contender:
    name: str
    config: TuningConfig
    samples: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples) if self.samples else math.inf


@dataclass
class SearchResult:
    best: TuningConfig
    best_name: str
    reason: str
    trials: list[Trial]
    contenders: list[Contender]
    choices: dict[str, dict]  # gemm -> {"option", "gain_ms", "noise_ms", "accepted"}
    noise_ms: float  # step-time noise threshold used for the final decision
    steps_run: int
    elapsed_s: float
    budget_hit: bool
