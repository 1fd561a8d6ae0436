"""The disturbances of decision_sim's scenarios (tools/research/decision_sim.py): what real trial steps show, per
step, laid over a simulated run's true costs."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

STEP_MS = 100.0  # reference step
SLOT_NOISE = 0.005  # relative GPU noise per slot and step
# "burst": a host-bound forward caught by a burst of slow steps for a whole trial, between trials that were not: per
# trial, each forward slot with probability 5% runs 30-100% slower (real Gemma-2-27B-like FP8 steps on one H100, seed
# 21304: proj.fwd at 0.92 ms in the one racing trial of an option truly 0.31 ms faster, between incumbent trials at
# 0.71 and 0.81 ms; results/2026-11-27_h100x4/); (probability, least, most)
BURST = (0.05, 0.3, 1.0)
# "trial_wide": real Command-R-like bf16 steps (results/2026-11-26_h200x4b/): slots sized as there (fc1.bwd ~24% of
# the step; the extra ms per slot come out of the step's rest, so a config's gain stays in ms), each slot's relative
# spread per step (1.1-1.3%, qkv.fwd 3%) and per trial (0.7%, qkv.fwd 2.5%); per slot: (extra ms, step, trial)
WIDE = {"qkv.fwd": (0.0, 0.03, 0.025), "fc1.fwd": (8.8, 0.0125, 0.007), "fc1.bwd": (17.5, 0.011, 0.007)}
WIDE |= {"fc2.fwd": (2.8, 0.012, 0.007), "fc2.bwd": (5.8, 0.011, 0.007)}
WIDE |= {s: (0.0, 0.012, 0.007) for s in ("qkv.bwd", "proj.fwd", "proj.bwd")}
# "hostrest": hostglm's forwards, each also following the rest of the step, which moves per trial and per step. Real
# L- and M-shaped FP8 steps on one H200 (results/2026-11-29_h200x1e/, qkv.fwd and proj.fwd of every trial of 4
# searches): the rest 6.5-10% apart between trials and 2-5% between steps; the forwards 1.8-5.6x the rest's relative
# change (3.4 median), between trials as between steps, and 4-16% apart on their own (hostglm's own levels). Per slot:
# its slope on the rest; (the rest's trial spread, its step spread)
REST_SLOPE = {"qkv.fwd": 3.0, "proj.fwd": 4.0, "fc2.fwd": 3.0, "fc1.fwd": 1.0}
REST_SPREAD = (0.08, 0.03)
# scenarios whose trials have levels of their own
OWN_LEVELS = ("trial", "trial_wide", "hostfwd", "hostglm", "hostmax", "hostrest", "hostbusy")
# "hostmax": forwards whose GPU waits on the host in stretches. Real Granite-3-8B-like FP8 steps on one H200 (six
# runs of 60 racing-like trials of an equal world, pinned or not, alone or 4 to a host; results/2026-11-28_h200x4e/):
# proj.fwd sits at its GPU time (0.29 ms +- 0.01) or, in 37% of the steps, at 1.4-2.7x it (the host's issue time),
# qkv.fwd then at 1.3-2.0x its own (10th-90th percentiles; modelled to 2.3); a slow step follows a slow one with
# probability 0.73, a fast one with 0.16, and the
# rest of the step is ~12% slower. A slot takes the longer of its GPU time and the host's, so a GPU gain shows only
# in the fast steps: 57-66% of a put-in delay, as real searches measured there.
HOST_MODES = (0.73, 0.16)  # P(slow | slow step before), P(slow | fast step before)
# "hostbusy": hostmax's host with other work beside the run: the two real runs with pytest on the same host
# (results/2026-11-28_h200x4e/ n2) were slow in 72-80% of the steps, a slow step after a slow one 0.80-0.90, after a
# fast one 0.44-0.51; here 0.90 and 0.44 (slow in 81%)
BUSY_MODES = (0.90, 0.44)
HOST_SLOW = {"proj.fwd": (1.4, 2.7), "qkv.fwd": (1.3, 2.3)}  # the host's issue time over the slot's fastest GPU time
# The rest of the step in a slow step, over a fast one's: one number for every slow step, or (intercept, slope, sd) on
# proj.fwd's issue ratio in that step (HOST_SLOW). In the real slow steps the rest follows how late the host is:
# 0.955-0.982 + 0.065-0.073 x proj.fwd's ratio to its fast median, residual sd 0.020-0.024 (n1 C_pin0, n2 D_free0/1;
# corr 0.74-0.93). hostbusy has n2's fit (BUSY_REST, since the fifty-third session; a constant 1.12 before, which the
# search's slopes could not take out: decision_sim README, fifty-second section); hostmax keeps the constant its table
# and tests were built on (at n1's fit, 0.982 0.073 0.022: 99.9% / 87.3%, no seed under 80%). HostModes carries it
SLOW_REST = 1.12
BUSY_REST = (0.98, 0.07, 0.02)
Rest = float | tuple[float, float, float]


class HostModes:
    """The host's state step by step (``hostmax``, ``hostbusy``): slow or fast, and in a slow step how far behind it
    issues. ``modes``: (P(slow | slow step before), P(slow | fast step before)); default ``HOST_MODES``. ``rest``: the
    rest of the step in a slow step (:meth:`rest_factor`); default ``SLOW_REST``."""

    def __init__(self, modes: tuple[float, float] | None = None, rest: Rest | None = None) -> None:
        self.modes, self.slow, self.u = modes or HOST_MODES, False, 0.0
        self.rest = SLOW_REST if rest is None else rest

    def rest_factor(self, u: float, rng: random.Random) -> float:
        """The rest's factor in a step at place ``u`` of the slow range (0: a fast step, 1.0; a constant ``rest``: no
        draw)."""
        if not u or isinstance(self.rest, float):
            return self.rest if u else 1.0
        a, b, sd = self.rest
        lo, hi = HOST_SLOW["proj.fwd"]
        return a + b * (lo + u * (hi - lo)) + rng.gauss(0, sd)

    def mean_rest(self) -> float:
        """The rest's factor averaged over the slow steps (``u`` uniform)."""
        if isinstance(self.rest, float):
            return self.rest
        a, b, _ = self.rest
        return a + b * sum(HOST_SLOW["proj.fwd"]) / 2

    def step(self, rng: random.Random, n: int = 1) -> float:
        """``n`` steps on; the last one's place in the slow range, (0, 1], all slots alike (0: the GPU is the bound)."""
        for _ in range(n):
            self.slow = rng.random() < self.modes[0 if self.slow else 1]
            self.u = max(1e-9, rng.random()) if self.slow else 0.0
        return self.u

    @property
    def slow_share(self) -> float:
        """The share of steps that are slow, in the long run (the chain's stationary state)."""
        return self.modes[1] / (1 - self.modes[0] + self.modes[1])

    @staticmethod
    def issue_ms(slot: str, fastest_ms: float, u: float) -> float:
        """When the host has issued ``slot`` (ms after its start) at place ``u`` of the slow range."""
        lo, hi = HOST_SLOW[slot]
        return fastest_ms * (lo + u * (hi - lo))

    def mean_ms(self, slot: str, gpu_ms: float, fastest_ms: float) -> float:
        """The slot's ms averaged over a long run: ``gpu_ms`` in a fast step, the later of it and the host's issue
        time (uniform over the slow range) in a slow one. A GPU gain in a host-bound slot shows only where the GPU is
        the bound, which is what the run gains from it."""
        lo, hi = (fastest_ms * x for x in HOST_SLOW[slot])
        v = gpu_ms
        slow = (lo + hi) / 2 if v <= lo else v if v >= hi else ((v - lo) * v + (hi - v) * (v + hi) / 2) / (hi - lo)
        return (1 - self.slow_share) * v + self.slow_share * slow


def disturbance(
    scenario: str, span_steps: int, phase: float = 0.0
) -> Callable[[int, int, random.Random], tuple[float, float, float]]:
    """Per step (index since tuning began, index since the last switch): (factor on GPU time, extra host ms on
    the step, relative GPU noise per slot)."""

    slow = [False]  # hostbound: in a slow stretch

    def f(i: int, since: int, rng: random.Random) -> tuple[float, float, float]:
        if scenario == "hostbound":  # MoE steps (alltoall dispatcher): the GPU waits for the host inside the layers,
            # in stretches of a few steps, heavy tails both ways. Fitted to the final decisions on Qwen3-MoE-like steps
            # on one H100 (benchmarks/results/2026-11-25_h100x1/): ABBA quadruple gains spread 0.81% of a step (robust
            # sd; sd 1.09%, 5-95% -1.6 to +1.8%); here 0.85% (1.03%, -1.8 to +1.6%)
            slow[0] = rng.random() < (0.6 if slow[0] else 0.04)
            burst = rng.uniform(0.03, 0.15) if slow[0] else 0.0
            return 1 + burst + 0.022 * rng.gauss(0, 1) / max(0.25, abs(rng.gauss(0, 1))) ** 0.5, 0.0, 0.01
        if scenario == "iid":  # 2% GPU noise per slot and step
            return 1.0, 0.0, 0.02
        if scenario == "ramp":  # 0.03% faster per step (clocks, caches warming up): what is measured late looks fast
            return 1 - 3e-4 * i, 0.0, SLOT_NOISE
        if scenario == "jump":  # +25% for the middle third of the disturbed steps
            return (1.25 if span_steps / 3 <= i < 2 * span_steps / 3 else 1.0), 0.0, SLOT_NOISE
        if scenario == "periodic":  # every 7th step 15% slower (a GC, a logger, a data loader)
            return (1.15 if i % 7 == 3 else 1.0), 0.0, SLOT_NOISE
        if scenario == "position":  # after a switch: 1% slower per step (clocks settle), the 3rd step 8% slower
            return 1 + 0.01 * min(since, 4) + (0.08 if since == 2 else 0.0), 0.0, SLOT_NOISE
        if scenario == "jitter":  # 2% host jitter on the step; a host-bound GPU waits inside the layers too
            return 1.0, rng.gauss(0, 0.02 * STEP_MS), 0.02
        if scenario == "power":  # the power limit moving the clocks: +-1.5% with a period of 4.5 steps (H200, measured)
            return 1 + 0.015 * math.sin(2 * math.pi * i / 4.5 + phase), 0.0, SLOT_NOISE
        if scenario == "locked":  # the same oscillation restarting in phase after every switch's idle gap, 1.3% noise
            # (real Megatron-LM iterations on H200: the 3rd-4th step after a switch ~3% slower than the 1st-2nd)
            return 1 + 0.017 * math.sin(2 * math.pi * (since - 1.5) / 4), 0.0, 0.013
        if scenario == "burst":  # 2% GPU noise per slot and step; SimulatedRun adds each trial's bursts (BURST)
            return 1.0, 0.0, 0.02
        if scenario not in OWN_LEVELS:  # their trials' own levels (and noise): SimulatedRun's
            raise ValueError(f"unknown scenario {scenario!r}")
        return 1.0, 0.0, SLOT_NOISE

    return f
