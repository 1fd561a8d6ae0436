"""The autotuner: find the fastest ``ub_cfgs`` for a live model in a few seconds of trial steps.

Framework-agnostic: it needs the model (to find its TE overlap modules), a callable that runs one
forward+backward step, and the arguments of the original ``initialize_ub`` call. The step callable
must not keep its outputs (a live autograd graph holds communicators of the current config).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_tp_overlap.engine import ending, heap
from megatron_tp_overlap.engine import faults as fault_injection
from megatron_tp_overlap.engine.faults import InjectedFault
from megatron_tp_overlap.engine.faults import from_env as faults_from_env
from megatron_tp_overlap.engine.guard import NumericsGuard
from megatron_tp_overlap.engine.lockstep import GRACE_S, Lockstep, PeerFailed
from megatron_tp_overlap.engine.measure import SlotTimer, cuda_event
from megatron_tp_overlap.engine.report import build_report, render_summary, summary_rows
from megatron_tp_overlap.engine.search import Measurement, Searcher, SearchOptions, SearchResult, Trial, TrialFailed
from megatron_tp_overlap.engine.space import (
    LEFT_OUT,
    SpaceSpec,
    TuningConfig,
    all_off,
    build_space,
    is_valid,
)
from megatron_tp_overlap.engine.switcher import UbInitArgs, UbSwitcher, reinit_phase_medians
from megatron_tp_overlap.engine.topology import (
    OverlapModule,
    Topology,
    agree_on_the_search,
    build_topology,
    find_overlap_modules,
)
from megatron_tp_overlap.engine.trial import FailureTally
from megatron_tp_overlap.ub.config import UbConfig
from megatron_tp_overlap.ub.presets import PRESETS
from megatron_tp_overlap.ub.rules import ValidationContext, check


def rank0_print(*args: Any) -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        print(*args, flush=True)


def device_sm_count() -> int | None:
    return (
        torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        if torch.cuda.is_available()
        else None
    )


@dataclass
class TuneResult:
    best: TuningConfig
    search: SearchResult
    topology: Topology
    report: dict[str, Any]
    summary: str
    switches: int
    wall_s: float


@dataclass
class Autotuner(NumericsGuard):
    """Tune the userbuffers config of ``model`` in-process; the winner is left applied.

    Args:
        model: the model (or its chunks) built with TE modules that use userbuffers.
        step_fn: runs one forward+backward step; returns nothing that holds the graph.
        init_args: the original ``initialize_ub`` arguments (see ``ub_runtime.capture_initialize_ub``).
        reference: the config the run would use without tuning (the user's; default: TE defaults).
        options: search strategy and budgets.
    """

    model: torch.nn.Module | Sequence[torch.nn.Module]
    step_fn: Callable[[], Any]
    init_args: UbInitArgs
    reference: UbConfig | None = None
    options: SearchOptions = field(default_factory=SearchOptions)
    space_spec: SpaceSpec = field(default_factory=SpaceSpec)
    priors: Iterable[UbConfig] | None = None  # default: TE defaults + NeMo presets
    group: Any = None  # process group whose ranks must agree (default: world)
    log: Callable[..., None] = rank0_print
    progress: Callable[[Trial, Searcher], None] | None = None
    event_factory: Callable[[], Any] = cuda_event
    timing_device: str = "cuda"
    verify_fn: Callable[[], torch.Tensor] | None = None  # fingerprint of one step (numerics.Fingerprint)
    verify_rtol: float = 2e-2  # bf16: relative L2 error against the no-overlap reference
    allow_overlap_off: bool = True  # per-GEMM "no overlap" options in the space (a module flag no YAML can say)
    no_overlap_eligible: bool = True  # False: "no overlap" (the whole config) is measured for the report only
    switch_sets: dict[str, frozenset[str]] = field(default_factory=dict)  # GEMM sets the user can switch off
    # as a whole (Megatron's per-kind flags): tried on the winner in the final decision
    trial_timeout_s: float = 120.0  # a trial slower than this is rejected (checked when it returns)
    faults: list = field(default_factory=lambda: faults_from_env())  # reliability tests only
    peer_grace_s: float = GRACE_S  # a rank blocked by a peer's failure ends the job after this (engine.lockstep)
    gloo: bool = True  # False: the ranks agree without any gloo group (Megatron's --disable-gloo-process-groups)
    distributed_timeout_s: float | None = None  # the run's own (Megatron's --distributed-timeout-minutes)
    gemms: set[str] | None = None  # tune only these GEMMs (others keep the reference's setting)
    clock: Callable[[], float] = time.perf_counter  # wall clock, s (tests drive a synthetic one)
    sleep: Callable[[float], None] = time.sleep

    def __post_init__(self) -> None:
        self.modules: list[OverlapModule] = find_overlap_modules(self.model)
        try:
            self.topology = build_topology(self.modules)
        except ValueError:
            if not self._distributed():
                raise
            # a rank without overlap modules (a pipeline stage) must still join the agreement, or the others wait
            self.topology = Topology(kinds=(), active=frozenset(), layers=0)
        self.ctx = ValidationContext(
            fp8=self.init_args.fp8,
            sm_count=device_sm_count(),
            tp_size=self.init_args.tp_size,
            tokens=self.init_args.shape[0],
        )
        ref = self.reference if self.reference is not None else UbConfig()
        check(ref, self.ctx, "reference config")  # bad input fails here, before any GPU work
        self.reference = ref
        self.switcher = UbSwitcher(
            self.init_args,
            self.modules,
            barrier=self._barrier,
            recoverable=lambda r: self.lockstep.recoverable(r),
        )
        self.lockstep = Lockstep(enabled=False)  # the tuning's own, for the duration of tune()
        self._t0 = 0.0
        self._ref_fp: torch.Tensor | None = None
        self._guard_off: str | None = None
        self._trial_index = 0
        self._failures = FailureTally()  # this rank's trial errors: the first printed, repeats counted
        self._agreed_elapsed = 0.0  # wall seconds since tuning began, max over ranks, at the last agreement
        self.numerics: dict[str, float] = {}

    def _barrier(self) -> None:
        """Inside tune(): an agreement point. After it (the switcher in the training run): a barrier."""
        import torch.distributed as dist

        if self.lockstep.enabled:
            self.lockstep.check()
        elif dist.is_available() and dist.is_initialized():
            dist.barrier(group=self.group)

    def _distributed(self) -> bool:
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1

    def _fault(self, kind: str, config: TuningConfig) -> bool:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        return any(f.hits(kind, self._trial_index, config.describe(), rank) for f in self.faults)

    # One trial: switch, warm up, time `steps` steps, agree with the other ranks.
    _FAILURES = {1: "raised", 2: "exceeded the trial timeout", 3: "gave non-finite timings"}

    def evaluate(self, config: TuningConfig, steps: int, warmup: int) -> Measurement:
        slots = list(self.topology.slots())
        error = 0.0
        per_slot: dict[str, list[float]] = {s: [math.nan] * steps for s in slots}
        step_ms = [math.nan] * steps
        timer = SlotTimer(self.modules, self.event_factory)
        t_trial = self.clock()
        self.lockstep.failure = ""

        def attempt(fn: Callable[[], Any]) -> bool:
            """Run ``fn``; True while every rank is fine. The ranks agree (on the host, engine.lockstep) after
            each phase and each step, so a rank that fails between steps never leaves the others waiting in
            the next step's collectives; one failing inside a step ends the job rather than hanging it."""
            nonlocal error
            ok = self.lockstep.attempt(fn, lambda line: self._failures.log(line, self.log))
            error = error if ok else 1.0
            return ok

        def switch() -> None:
            if self._fault("init", config):
                raise InjectedFault("injected fault while switching userbuffers config")
            with fault_injection.inside_initialize_ub(self._fault("ubinit", config)):
                self.switcher.apply(config, agreed_after=True)  # attempt() agrees right after

        def timed_step(i: int) -> None:
            timer.begin_step()
            with fault_injection.mid_step(
                self.modules[-1].module if i == 0 and self._fault("midstep", config) else None
            ):
                self.step_fn()
            timer.end_step()
            if i == 0 and self._fault("step", config):
                raise InjectedFault("injected fault during a trial step")
            if i == 0 and self._fault("timeout", config):
                self.sleep(self.trial_timeout_s)

        # The ranks agree after the switch and at the end of the trial, and between steps while the job is small
        # (engine.lockstep.STEP_CHECKS_UP_TO): there a rank failing between two steps fails the trial; beyond it, it
        # ends the job as a failure inside a step does. The last step's failure rides on the trial's agreement.
        failed_here = ""
        collected: dict[str, Any] = {}

        def unchecked(fn: Callable[[], Any]) -> bool:
            nonlocal failed_here, error
            try:
                fn()
                return True
            except Exception as e:  # noqa: BLE001 - the other ranks hear of it at the trial's agreement
                failed_here, error = f"{type(e).__name__}: {e}", 1.0
                self._failures.log(f"[tp-overlap-autotune] trial failed on this rank: {failed_here}", self.log)
                return False

        def in_order(fns: list[Callable[[], Any]], ends_trial: bool) -> bool:
            for n, fn in enumerate(fns):
                checked = self.lockstep.step_checks and not (ends_trial and n == len(fns) - 1)
                if not (attempt(fn) if checked else unchecked(fn)):
                    return False
            return True

        def last_step() -> None:
            timed_step(steps - 1)
            if self.timing_device == "cuda":
                torch.cuda.synchronize()
            collected["per_slot"], collected["step_ms"] = timer.collect(slots)

        ok = attempt(switch) and in_order([self.step_fn] * warmup, ends_trial=not steps)
        if ok and steps:
            with timer:
                ok = in_order([lambda i=i: timed_step(i) for i in range(steps - 1)] + [last_step], ends_trial=True)
        if ok and collected:
            per_slot, step_ms = collected["per_slot"], collected["step_ms"]
        if ok and self._fault("nan", config):
            step_ms = [math.nan] * steps
        if error == 0 and self.clock() - t_trial > self.trial_timeout_s:
            error = 2.0
        elif error == 0 and not all(math.isfinite(v) for v in step_ms):
            error = 3.0 if ok else error
        self._trial_index += 1
        now = self.clock()
        flat = [v for s in slots for v in per_slot[s]] + list(step_ms) + [now - t_trial, now - self._t0, error]
        try:
            agreed = self.lockstep.agree_max(flat, bool(failed_here), failed_here)
        except PeerFailed as e:  # a rank failed in the last step: every rank is here, and the clock is agreed
            self.lockstep.failure = str(e)
            agreed = list(e.values) + [math.nan] * (len(flat) - len(e.values))  # all of it unless it took rounds
            agreed[-3:] = [v if math.isfinite(v) else mine for v, mine in zip(agreed[-3:], flat[-3:])][:2] + [1.0]
        self._agreed_elapsed = agreed[-2]
        if agreed[-1] > 0:  # every rank raises together: nobody is left waiting in a collective
            why = self._FAILURES.get(int(agreed[-1]), "failed")
            where = (
                f"on {self.lockstep.failure}" if agreed[-1] == 1 and self.lockstep.failure else "on at least one rank"
            )
            raise TrialFailed(f"{why} {where}: {config.describe()}")
        n = len(slots) * steps
        return Measurement(
            slot_ms={s: agreed[i * steps : (i + 1) * steps] for i, s in enumerate(slots)},
            step_ms=agreed[n : n + steps],
            elapsed_s=agreed[-2],
            steps_run=steps + warmup,
            wall_s=agreed[-3],
        )

    def _whole_config_priors(self) -> dict[str, TuningConfig]:
        """The NeMo preset a user would copy for this shape, as a whole-config contender in the final
        confirmation: a per-GEMM search can miss a combination that wins as a whole, and the result
        should never be slower than a preset the tuner knew. Only when it is valid here and keeps to
        the dgrad mode the space allows (``space_spec``); not when tuning a subset of GEMMs."""
        if self.gemms is not None or self.priors is not None:
            return {}
        from megatron_tp_overlap.ub.presets import closest_preset

        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "h100"
        name = closest_preset(self.init_args.shape[-1], self.init_args.tp_size, self.init_args.fp8, gpu)
        cfg = TuningConfig(PRESETS[name], frozenset(), f"preset {name}")
        if cfg.ub == self.reference or not is_valid(cfg, self.ctx):
            return {}
        if self._outside_dgrad_mode(cfg.ub):
            return {}
        return {cfg.label: cfg}

    def tune(self) -> TuneResult:
        with heap.frozen(), self.agreeing():  # each switch's garbage collection skips the framework's objects
            return self._tune()

    @contextlib.contextmanager
    def agreeing(self) -> Iterator[None]:
        """The ranks' agreements (engine.lockstep) for trials and numerics checks run inside this block:
        :meth:`tune` opens it; open it around a lone :meth:`verify`."""
        bound = ending.bound_s(self.trial_timeout_s, self.distributed_timeout_s)
        text = ending.bound_text(bound, self.trial_timeout_s, self.distributed_timeout_s)
        self.lockstep = Lockstep(self.group, grace_s=self.peer_grace_s, gloo=self.gloo, bound_s=bound, bound_text=text)
        # bootstrap collectives take ms; half the grace leaves the watcher's wait after its recovery to spare
        self.switcher.bootstrap_timeout_s = self.peer_grace_s / 2
        self.switcher.barrier_after_destroy = self.lockstep.step_checks
        try:
            yield
        finally:
            self.lockstep.close()
            self.lockstep = Lockstep(enabled=False)
            self.switcher.bootstrap_timeout_s = None
            self.switcher.barrier_after_destroy = True

    def _tune(self) -> TuneResult:
        t0 = self.clock()
        self._failures.clear()
        self._t0 = t0
        priors = list(self.priors) if self.priors is not None else [UbConfig(), *PRESETS.values()]
        space = build_space(self.topology, self.ctx, [self.reference, *priors], self.space_spec)
        if self.gemms is not None:
            space = {g: v for g, v in space.items() if g in self.gemms}
        agree_on_the_search(self.topology, space, self.lockstep, self.group)
        given = self.reference
        self.reference = self.in_dgrad_mode(given, space)
        if self.reference != given:
            self.log(
                "[tp-overlap-autotune] the reference config runs qkv/fc1 dgrad in a mode this search excludes; "
                f"starting from: {self.reference.describe()}"
            )
        reference = TuningConfig(self.reference, frozenset(), "reference")
        baselines = {"no overlap": all_off(self.topology, reference)}
        if len(self.reference):
            baselines["TE default"] = TuningConfig(UbConfig(), frozenset(), "TE default")
        baselines.update(self._whole_config_priors())
        # measured for the report, never chosen: a config the run's dgrad mode cannot express
        outside_mode = {n for n, c in baselines.items() if self._outside_dgrad_mode(c.ub)}
        n_opts = sum(len(v) for v in space.values())
        self.log(
            f"[tp-overlap-autotune] {len(self.modules)} overlap modules, slots: "
            + ", ".join(f"{s}({len(g)})" for s, g in self.topology.slots().items())
            + f"; {n_opts} options over {len(space)} GEMMs; strategy={self.options.strategy}, "
            f"budget {self.options.budget_text()}; ranks agree by {self.lockstep.describe()}"
        )
        searcher = Searcher(
            self.topology,
            space,
            self.evaluate,
            self.ctx,
            self.options,
            self.progress,
            verify=self.verify if self.verify_fn is not None else None,
            elapsed=lambda: self._agreed_elapsed,
            log=self.log,
        )
        searcher.report_only = frozenset(outside_mode | (set() if self.no_overlap_eligible else {"no overlap"}))
        searcher.switch_sets = dict(self.switch_sets)
        result = searcher.run(reference, baselines)
        result.reason += self._failures.note(result.trials)
        self.switcher.apply(result.best)
        wall = self.clock() - t0
        meta = {
            "tp_size": self.init_args.tp_size,
            "shape": self.init_args.shape,
            "fp8": self.init_args.fp8,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "strategy": self.options.strategy,
            "switches": self.switcher.reinits,
            "reinit_s_median": sorted(self.switcher.reinit_seconds)[len(self.switcher.reinit_seconds) // 2]
            if self.switcher.reinit_seconds
            else None,
            "reinit_phases_s_median": reinit_phase_medians(self.switcher.reinit_phases),
            # communicator references let go by contexts that outlived their step (engine/held_graphs.py)
            "released_between_steps": sorted(self.switcher.released),
            "wall_s": round(wall, 3),
            # what the ranks' agreements cost this rank (engine.lockstep): at scale this is the part that grows
            "agreements": {
                "design": self.lockstep.describe(),
                "points": self.lockstep.epoch,
                "seconds": round(self.lockstep.seconds, 4),
            },
            "numerics_rel_error": self.numerics,
            "numerics_guard": self._guard_off or f"on (tolerance {self.tolerance():.3g})",
            "space": {g: [o.label for o in opts] for g, opts in space.items()},
            "left_out_of_space": LEFT_OUT,
        }
        report = build_report(result, self.topology, meta)
        summary = render_summary(summary_rows(result, self.topology), result)
        return TuneResult(result.best, result, self.topology, report, summary, self.switcher.reinits, wall)
