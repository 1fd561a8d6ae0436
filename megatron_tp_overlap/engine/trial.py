"""What a search measures and decides: measurements, trials, contenders, results, and the search options."""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache, cached_property
from typing import Any

from megatron_tp_overlap.engine import paired
from megatron_tp_overlap.engine.options import STRATEGIES, TuneOptions
from megatron_tp_overlap.engine.space import TuningConfig

MAX_PASSES = 5  # SearchOptions.passes at most (engine/passes.py names each)


@dataclass
class Measurement:
    """Times of ``steps`` consecutive steps of one config, max over ranks. Units: ms, s."""

    slot_ms: dict[str, list[float]]  # slot -> one value per step (summed over layers)
    step_ms: list[float]
    elapsed_s: float  # agreed wall clock since tuning started, after this measurement
    steps_run: int  # steps actually executed, warmup included
    wall_s: float = 0.0  # this trial's own wall seconds (switch, warm-up, steps), max over ranks; 0: not known


class TrialFailed(RuntimeError):
    """A config raised (or gave a bad result) on some rank; all ranks raise it together."""


class FailureTally:
    """This rank's trial failures by error text: the first of each is logged, repeats are counted for the decision's
    line (on 2 x H100 one broken switch printed 96 identical lines, and the decision's line did not say that most
    trials had failed)."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()

    def clear(self) -> None:
        self.counts.clear()

    def log(self, line: str, log: Callable[[str], Any]) -> None:
        why = line.split(": ", 1)[-1]
        self.counts[why] += 1
        if self.counts[why] == 1:
            log(line + " (repeats of this error are counted, not printed)")

    def note(self, trials: Sequence[Trial]) -> str:
        """'; N of M trials failed, ...' for the decision's line ("" when none failed; N agreed over the ranks)."""
        failed = sum(1 for t in trials if t.error)
        if not failed:
            return ""
        out = f"; {failed} of {len(trials)} trials failed"
        if self.counts:
            why, n = self.counts.most_common(1)[0]
            out += f", {n} of them on this rank with: {why[:300]}"
        return out


Evaluate = Callable[[TuningConfig, int, int], Measurement]  # (config, steps, warmup) -> Measurement
Verify = Callable[[TuningConfig], "str | None"]  # None when the config computes the right numbers


@dataclass(frozen=True)
class Work:
    """What the budget is spent on: steps (warm-ups included), trials that switch config and trials that continue
    the config of the trial before (no switch, but a device sync and the search's own work)."""

    steps: int = 0
    switches: int = 0
    continuing: int = 0

    def __add__(self, other: Work) -> Work:
        return Work(self.steps + other.steps, self.switches + other.switches, self.continuing + other.continuing)


@dataclass(frozen=True)
class SearchOptions:
    strategy: str = TuneOptions.strategy  # one of STRATEGIES
    max_steps: int = TuneOptions.steps  # trial steps in all, warmups and confirmation included; 0: no limit
    max_seconds: float = TuneOptions.seconds
    # Screening is a coarse pass (one measured step per option, at the same position after a switch as the
    # incumbent's brackets); halving re-measures each GEMM's best with 4 steps, and the final ABBA decision guards the
    # result. On 8 simulated disturbances x 200 seeds this is within 0.9% of the slot-exhaustive search in every
    # seed with 50% of its steps (2 steps, keep 2, brackets every 3: within 0.56%, 65% of its steps);
    # benchmarks/results/2026-11-23_cpu/decision_sim.md
    screen_steps: int = 1  # measured steps per screening trial
    warmup_steps: int = 1  # after each switch
    keep: int = 1  # options per GEMM that survive screening
    halving_steps: int = 4  # measured steps per trial of the racing rounds (engine/racing.py)
    race_samples: int = 24  # an option measured this often settles (options of equal cost never separate)
    # ... but a GEMM's leader whose interval (z standard errors) is still wider than a gain worth a switch races on to
    # this many: decision_sim trial_wide seed 49 (69.0 -> 100%: its leader had settled at 24 samples with the search
    # stopped early); with ``late_z`` (without it trial_wide named 2.0% false winners)
    wide_leader_samples: int = 96
    # racing trials (moments) before an option its screening put ahead beyond the noise can be ruled out: on real
    # Gemma-like FP8 steps on H100 one 4-step trial at a slow moment read a proj_fprop truly 0.31 ms faster as 0.22 ms
    # slower, its screening had seen it, and the racing stopped with the gain left (seeds 21304, 21314;
    # benchmarks/results/2026-11-27_h100x4/)
    settle_trials: int = 2
    recheck_steps: int = 8  # fresh steps of each GEMM's leader, the only ones that accept it
    bracket_every: int = 4  # the incumbent runs again after this many trials (drift is interpolated between)
    block_steps: int = 3  # measured steps per block of the final decision (block value: their median); fewer
    # when the decision would take more than half the budget
    min_quads: int = paired.MIN_PAIRS  # ABBA quadruples before the first look (the fewest for a 95% interval)
    # ... and at most this many, while the budget lasts: on decision_sim hostmax (forwards that wait on the host in
    # stretches) 24 left true 0.7-1.5% gains within the noise with 83 s of 180 unspent (seeds 1, 43, 167, 176); 32-48
    # decided them
    max_quads: int = 64
    # searches at most this many passes, each from the config the last one took, while the budget holds one
    # (engine/passes.py): a search that takes a config often ends with most of the budget unspent, and decision_sim
    # hostmax seed 143 had ruled out a true 1.28 ms proj_fprop on two unlucky racing trials (at 76 s of 180). 1: one
    passes: int = 2
    # The selection round measures each contender once (one block): ~1% of a step apart is within its noise, and on
    # H200 a preset 1.1-1.5% behind the best config won it in 3 of 12 layer-level tunings. The contenders ahead of the
    # reference (the ``runoff`` best) run again until each has ``select_passes`` blocks, budget permitting.
    select_passes: int = 3
    runoff: int = 3
    level: float = 0.95  # confidence of the final decision's interval
    # ... and of its whole-step interval, whose "slower" keeps the reference: at 0.95, a step whose rest moves 8%
    # between trials kept it against a true gain by chance (decision_sim hostrest 139; real FP8 steps: +-2-4%)
    step_level: float = 0.99
    # 1: the final decision sums only the slots whose GEMMs the two configs run differently (the rest only add
    # noise: on real MoE steps the forwards vary 9-27% between trials, each on its own); the whole-step interval
    # still guards
    changed_slots: int = 1
    # 1: the racing rounds scale each slot's steps by the share of the rest of the step's slowdown that the slot
    # follows, fitted per slot (engine/rest_scaling.py; 0 where it moves on its own)
    rest_norm: int = 1
    # ... each slot's slope on the rest at most this: on real L/M-shaped FP8 steps on one H200 host-bound forwards
    # moved 1.8-5.6x the rest's relative change, between steps and between trials alike (1 until issue 46's
    # forty-seventh session)
    rest_beta_max: float = 4.0
    # ... and at most this for a slot at a floor with stretches above it (engine/floors.py: a host that switches
    # between two states, not a line; decision_sim hostmax 49 at 8 took 56.4% of its gain, at 4 all of it), so that
    # rest_beta_max can go above it for the slots that do move as a line (GLM-4-9B-like FP8 proj.fwd: 5.9-6.7x)
    floor_beta_max: float = 4.0
    # 1: the final decision's slots are scaled so too (the betas and the reference's rest level as fitted before it,
    # the same for both configs, so an equal pair stays exchangeable); the whole step and the rest guard unscaled
    decision_rest_norm: int = 1
    # 1: the racing's standard errors add the level that a trial's steps share (engine/trial_effect.py): on real
    # dense steps 17 of 24 equal-world searches accepted a choice without it (simulated iid steps: 19 of 200)
    trial_noise: int = 1
    # ... and a slot with this many differences between consecutive incumbent trials is tested for that level on its
    # own, not only in the test pooled over slots (a median over slots: one noisy forward among steady slots never
    # passed it; real Granite-3-8B-like FP8 steps: no level counted where proj.fwd's trials differed 8-18x what its
    # steps give; decision_sim hostmax: false winners 1.5 -> 0%). 0: the pooled test only
    trial_own_diffs: int = 30
    # 1: a slot with no trial level counted (and no floor) has at least its own steps' spread in the standard errors,
    # not only the spread pooled over slots, a median that steady slots set (decision_sim hostbusy 43: an equal-or-
    # slower qkv_fprop read 0.50 ms faster at 1.4% where qkv.fwd's own was 8.7%; real L/M FP8 forwards 1.8-14x)
    slot_spread: int = 1
    # 1: in a racing round a slot whose options all ran measures them again while the fullest slot's still run
    fill_slots: int = 1
    # fresh looks at a GEMM's leader at most: the first looks.RECHECKS are kept in the budget, later ones take its rest
    # (real Command-R-like steps: a true 0.23 ms measured 0.17 ms against 0.226 needed in two, 7 s of 60 unspent); a
    # look errs by 0.24-0.28 ms in fc1.bwd on trial-level steps, so a 0.3 ms gain needs about 8, and 0.3-0.5 ms in a
    # forward whose trials sit 22% apart (decision_sim hostfwd seed 14: a true 0.30 ms took 20 looks at 180 s and was
    # still 0.198 ms against 0.292 needed; with 40 it was taken; issue 46)
    max_looks: int = 40
    # ... and a look after the third only for a leader ahead by this share of its threshold (0: any leader ahead by a
    # quarter of a gain worth a switch). At 120 s, 0 took decision_sim trial_wide's worst seed from 55.6 to 69.0%; at
    # 60 s no setting helped. Real Command-R-like bf16 steps on H100, the same worlds: 60 s and 0.5 took 7 of 8 gains in
    # full (worst 75.5%), 120 s and 0 all 8 (results/2026-11-26_h100x4b/)
    later_look_least: float = 0.0
    # 1: a leader's standard error from its fresh looks is at least their own spread (sd / sqrt(looks), from two on):
    # on real GLM-4-9B-like FP8 steps (H200) proj_fprop looks of +0.035, +0.352 and -0.014 ms read 0.098 ms against a
    # 0.009 ms threshold, since the pooled step spread leaves out a noisy forward's own (results/2026-11-28_h200x4b/)
    look_spread: int = 1
    # 1: a leader looks again (budget and max_looks permitting) while its interval still reaches a gain worth a switch
    # (the issue's stop rule), not only while it is ahead: the same steps' truly faster proj_fprop read -0.073 ms
    # against a 0.290 ms threshold after 3 looks and was left, at 61 s of 180
    later_reach: int = 1
    # runners-up per GEMM given fresh looks with the budget left when none of its looked-at options is accepted
    # (engine/looks.py ``_runners_up``; 0: none): in a noisy forward the luckiest of many equal options leads the racing
    runners_up: int = 3
    # 1: the runners-up look against the reference with the choices accepted so far in it, not the reference alone:
    # on real Granite-3-8B-like FP8 steps (H200) the true 0.14 ms proj_fprop of world 22500 showed 0.04 +- 0.02 ms in
    # trials against the reference, 0.10 +- 0.01 against configs with the world's backward gains in, and its 11-40
    # looks per search as a runner-up, all against the reference, never took it (results/2026-11-28_h200x4c/). On GPU
    # it did not take 22500 either, and left 24200's true proj_fprop (53.1%; results/2026-11-28_h200x4d/)
    rebase_runners_up: int = 0
    # 1: a GEMM's runners-up look in turn, not one after another: with ``rebase_runners_up`` on decision_sim hostglm
    # seed 149 a truly equal first runner-up read +0.06 to +0.27 ms and kept the rest of the budget for 28 looks, and
    # the true option, third in line, had none (the third idea: a runoff among the best few). On 200 seeds it
    # took hostglm 176 (75.9 -> 100%) and named 1.5% false winners on trial_wide (0.5% one after another)
    runners_up_in_turn: int = 0
    # > 0: a slot whose steps sit at a floor with stretches well above it (a forward whose GPU waits on the host in
    # stretches) counts each step at most its floor x (1 + floor_cap): in the racing and the looks the reference's
    # 10th-percentile step, in the final decision the slower of the two configs' fastest steps in each quadruple
    # (engine/floors.py); a GPU gain shows only at the floor (0: off; the step never capped)
    floor_cap: float = 0.05
    # the final decision's quadruple gains are clipped at their median +- this many robust standard deviations
    # (paired.clipped; 0: not clipped): a stretch of slow steps in a few blocks left real 1.2-2.3% gains undecided
    clip_sds: float = 4.0
    # 1: the final decision also needs the candidate faster once the rest of the step (the same kernels whatever the
    # config) is taken out of the quadruples' gains (paired.rest_adjusted); 0: the slot times alone. Both real-step
    # false winners (26301, 27401: +0.11-0.12 ms read) had the rest 1.3-1.7 ms faster in the candidate's blocks; no
    # put-in gain of 9 was lost (tests/test_rest_guard.py); decision_sim hostbound 185 keeps the reference
    rest_guard: int = 1
    # per-GEMM gains must exceed z standard errors: 2.5, since up to 12 GEMMs' leaders are re-checked, an inconclusive
    # one twice (at 2.0, 31 of 100 equal simulated worlds accepted a choice, at 2.5, 13; issue 46)
    z: float = 2.5
    # ... and this much more from a leader's fourth look on: the later looks test again and again (decision_sim
    # trial_wide equal seed 178: fc1_dgrad crossed 2.5 on its 11th look)
    late_z: float = 0.5
    rel_floor: float = 0.002  # ... and this fraction of the time
    # > 0: once a choice is accepted (the config changes anyway), a GEMM whose looked-at best is ahead of the incumbent
    # by this many standard errors of its looks and by a quarter of a gain worth a switch, under its threshold, goes
    # along with it; the final decision tests the whole config (decision_sim hostfwd seed 176: a true 0.153 ms
    # proj_fprop read 0.114 +- 0.06 ms in 40 looks against 0.180 needed, beside two accepted backward gains: 75.9 ->
    # 100%). At 1.0 without the quarter 122 truly equal leaders rode along in 160 gain worlds, at 1.5 10. 0 (off, the
    # default since the forty-fifth session): over decision_sim's hostglm and hostfwd worlds under 4 streams of noise
    # (1600 searches, benchmarks/studies/noise_streams.py) it changed two outcomes, 176 75.9 -> 100% and hostglm 139
    # 100 -> 0% (an equal proj_fprop rode along with a 0.507 ms fc1_wgrad, and the final decision over both slots kept
    # the reference); on real steps both riders were truly equal (27401, 27500: results/2026-11-29_h200x1c/)
    ride_along_z: float = 0.0
    max_exhaustive: int = 512

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy = {self.strategy!r}: must be one of {', '.join(STRATEGIES)}")
        if self.max_steps < 0:
            raise ValueError(f"max_steps = {self.max_steps}: must be >= 0 (0: no step limit)")
        for k in (
            "screen_steps",
            "keep",
            "halving_steps",
            "race_samples",
            "wide_leader_samples",
            "settle_trials",
            "recheck_steps",
            "bracket_every",
            "block_steps",
            "select_passes",
            "runoff",
            "max_looks",
        ):
            if getattr(self, k) < 1:
                raise ValueError(f"{k} = {getattr(self, k)}: must be >= 1")
        if not 1 <= self.passes <= MAX_PASSES:
            raise ValueError(f"passes = {self.passes}: must be in [1, {MAX_PASSES}]")
        for k in ("late_z", "ride_along_z"):
            if getattr(self, k) < 0:
                raise ValueError(f"{k} = {getattr(self, k)}: must be >= 0")
        if self.max_seconds <= 0:
            raise ValueError(f"max_seconds = {self.max_seconds}: must be > 0")
        if not paired.MIN_PAIRS <= self.min_quads <= self.max_quads:
            raise ValueError(
                f"min_quads = {self.min_quads}: must be >= {paired.MIN_PAIRS} and <= max_quads = {self.max_quads}"
            )
        for k in ("level", "step_level"):
            if not 0.5 <= getattr(self, k) < 1:
                raise ValueError(f"{k} = {getattr(self, k)}: must be in [0.5, 1)")
        if not 0 <= self.later_look_least <= 1:
            raise ValueError(
                f"later_look_least = {self.later_look_least}: must be in [0, 1] (a share of the threshold)"
            )
        if self.runners_up < 0:
            raise ValueError(f"runners_up = {self.runners_up}: must be >= 0 (0: none)")
        for k in (
            "changed_slots",
            "rest_norm",
            "decision_rest_norm",
            "trial_noise",
            "slot_spread",
            "fill_slots",
            "look_spread",
            "later_reach",
            "rebase_runners_up",
            "runners_up_in_turn",
            "rest_guard",
        ):
            if getattr(self, k) not in (0, 1):
                raise ValueError(f"{k} = {getattr(self, k)}: must be 0 or 1")
        if self.trial_own_diffs < 0:
            raise ValueError(f"trial_own_diffs = {self.trial_own_diffs}: must be >= 0 (0: the pooled test only)")
        for k in ("rest_beta_max", "floor_beta_max"):
            if getattr(self, k) <= 0:
                raise ValueError(f"{k} = {getattr(self, k)}: must be > 0 (rest_norm=0 turns the scaling off)")
        if self.floor_cap < 0:
            raise ValueError(f"floor_cap = {self.floor_cap}: must be >= 0 (0: steps are not capped)")
        if self.clip_sds < 0:
            raise ValueError(f"clip_sds = {self.clip_sds}: must be >= 0 (0: the quadruples' gains are not clipped)")

    def steps_left(self, steps_run: int) -> float:
        """Trial steps the step limit still allows (infinite without one)."""
        return self.max_steps - steps_run if self.max_steps else math.inf

    def budget_text(self) -> str:
        """The budget as a user set it: '60 s', or '400 steps / 60 s' with a step limit."""
        return (f"{self.max_steps} steps / " if self.max_steps else "") + f"{self.max_seconds:g} s"

    def decision_work(self, contenders: int, block_steps: int | None = None) -> Work:
        """What the final decision needs at least: a selection round over ``contenders`` (the reference bracketing
        them; a switch per trial) and ``min_quads`` ABBA quadruples of ``block_steps``-step blocks (per quadruple
        two blocks after a switch, two continuing their config)."""
        b = block_steps or self.block_steps
        trials = contenders + 1 + math.ceil(contenders / self.bracket_every)
        select = Work(trials * (b + self.warmup_steps), trials, 0)
        return select + self.quads_work(self.min_quads, b)

    def quads_work(self, quads: int, block_steps: int) -> Work:
        return Work(quads * (4 * block_steps + 2 * self.warmup_steps), 2 * quads, 2 * quads)


@dataclass
class Trial:
    index: int
    phase: str  # baseline | bracket | screen | halving | recheck | select | confirm | exhaustive
    config: TuningConfig
    tested: dict[str, str]  # slot -> option label tried in this trial ("incumbent" for baselines)
    slot_ms: dict[str, float] = field(default_factory=dict)  # median per slot
    step_ms: float | None = None  # median
    step_samples: list[float] = field(default_factory=list)
    error: str | None = None
    position: float = 0.0  # steps since tuning began, at the first measured step (drift is a function of it)
    slot_samples: dict[str, list[float]] = field(default_factory=dict)  # slot -> ms per measured step
    seconds: float = 0.0  # agreed clock since the trial before (switch, warm-up, steps, search's work); first: own wall

    @cached_property
    def rest_samples(self) -> list[float]:
        """Per measured step: the step minus all its slots (ms), what no config changes; [] when a slot was not timed
        in every step. Read once the trial is measured (the search sets the samples before it keeps the trial)."""
        cols = list(self.slot_samples.values())
        if not cols or any(len(c) < len(self.step_samples) for c in cols):
            return []
        return [s - sum(c[i] for c in cols) for i, s in enumerate(self.step_samples)]

    def to_dict(self) -> dict:
        return {
            "index": self.index,
            "phase": self.phase,
            "config": self.config.to_dict(),
            "tested": self.tested,
            "slot_ms": {k: round(v, 4) for k, v in self.slot_ms.items()},
            "step_ms": None if self.step_ms is None else round(self.step_ms, 4),
            "step_samples_ms": [round(s, 4) for s in self.step_samples],
            "position": self.position,
            "seconds": round(self.seconds, 3),
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
    noise_ms: float  # half-width of the final decision's interval (ms): the smallest gain it could accept
    steps_run: int
    elapsed_s: float
    budget_hit: bool
    decision: dict = field(default_factory=dict)  # the final ABBA comparison: intervals, quadruples, drift
    # the selected config when the decision ended with it ahead of the reference but not beyond the interval (the
    # budget's resolution): the run keeps the reference, and an in-run verification can settle it on real iterations
    undecided: TuningConfig | None = None
    cut_short: str | None = None  # what the budget left unmeasured in the search (None: it ran to the end)
    search_end: str = ""  # why the re-measurement rounds ended (the budget, or an early stop and why)
    coverage: dict[str, dict] = field(default_factory=dict)  # per slot: what was tried and what was left


@cache
def slot_order(slots: frozenset[str]) -> tuple[str, ...]:
    """``slots`` sorted, once per set (the search sums the same sets' per-step samples in this order again and again)."""
    return tuple(sorted(slots))
