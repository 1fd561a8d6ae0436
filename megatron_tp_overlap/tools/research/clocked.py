"""decision_sim's simulated steps on a clock of real trials (tools/research/decision_sim.py)."""

from __future__ import annotations

from collections.abc import Callable

from megatron_tp_overlap.engine.search import Measurement
from megatron_tp_overlap.engine.space import TuningConfig
from megatron_tp_overlap.tools.research.disturbances import STEP_MS


class Clocked:
    """The simulated steps on a clock of real trials: ``step_s`` per step, ``switch_s`` per switch inside the trial's
    wall time, ``outside_s`` of the search's own work between trials, ``first_s`` of one-off costs in the first
    trial. The defaults are H200 trials (FP8, one micro-batch per trial step); ``--clock 0.14 0.3 0.05`` is the
    Qwen3-MoE-like model on one H100 (benchmarks/results/2026-11-25_h100x1/)."""

    def __init__(
        self,
        run: Callable[[TuningConfig, int, int], Measurement],  # decision_sim.SimulatedRun
        step_s: float = 0.075,
        switch_s: float = 0.5,
        outside_s: float = 0.2,
        first_s: float = 0.0,
    ):
        self.run, self.step_s, self.switch_s, self.outside_s = run, step_s, switch_s, outside_s
        self.t, self.live, self.first_s = 0.0, None, first_s

    def __call__(self, config, steps, warmup):
        m = self.run(config, steps, warmup)
        self.t += self.outside_s
        wall = (steps + warmup) * self.step_s + self.switch_s * (config != self.live) + self.first_s
        self.first_s = 0.0  # one-off costs of the first trial
        self.t, self.live = self.t + wall, config
        k = 1000 * self.step_s / STEP_MS  # GPU ms per step as the clock has them, slots and steps alike (the rest)
        slots = {s: [v * k for v in vs] for s, vs in m.slot_ms.items()}
        return Measurement(slots, [v * k for v in m.step_ms], self.t, m.steps_run, wall_s=wall)
