"""Search over the candidate space, given a function that runs trial steps and times them.

Pure logic (no CUDA, no torch.distributed): the caller's ``evaluate`` runs ``steps`` steps of a
:class:`~space.TuningConfig` and returns per-slot and per-step times that every rank already
agrees on, so every rank takes the same decisions here.

``coordinate`` (default): modules run one after another, so one trial step measures a different
option in every slot (forward / backward of qkv, proj, fc1, fc2) at once. Screening tries every
option once; racing rounds (engine/racing.py) re-measure every option, the best-screened first, until
what is left cannot beat the incumbent by a gain worth a switch or the budget ends them; each GEMM's
leader is re-checked afresh and kept if it beats the incumbent by more than the noise; the kept ones are
combined, and the combination is confirmed end-to-end against the baselines (engine/decision.py).

``exhaustive``: every combination of the same options, end-to-end (for benchmarks).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from megatron_tp_overlap.engine import exhaustive, passes
from megatron_tp_overlap.engine.budget import Budget
from megatron_tp_overlap.engine.decision import FinalDecision
from megatron_tp_overlap.engine.frames import fresh_stack
from megatron_tp_overlap.engine.looks import Looks
from megatron_tp_overlap.engine.racing import Racing
from megatron_tp_overlap.engine.space import Option, TuningConfig, apply, is_valid
from megatron_tp_overlap.engine.topology import Topology
from megatron_tp_overlap.engine.trial import (  # noqa: F401
    Contender,
    Evaluate,
    Measurement,
    SearchOptions,
    SearchResult,
    Trial,
    TrialFailed,
    Verify,
    Work,
    slot_order,
)
from megatron_tp_overlap.ub.rules import ValidationContext


class Searcher(Racing, Looks, FinalDecision, Budget):
    def __init__(
        self,
        topo: Topology,
        space: dict[str, list[Option]],
        evaluate: Evaluate,
        ctx: ValidationContext,
        options: SearchOptions | None = None,
        progress: Callable[[Trial, Searcher], None] | None = None,
        verify: Verify | None = None,
        elapsed: Callable[[], float] | None = None,
        log: Callable[[str], None] | None = None,
    ):
        self.topo, self.space, self.evaluate, self.ctx, self.opt = (
            topo,
            space,
            evaluate,
            ctx,
            options or SearchOptions(),
        )
        self.verify = verify
        self.log = log or (lambda line: None)  # rank 0's log (the tuner's); the search's own lines
        self.search_end = ""  # why the search's re-measurement ended (engine/racing.py)
        self.coverage_report: dict[str, dict] = {}  # per slot: what was tried and left
        self._slots_cache: dict[Option, frozenset[str]] = {}
        self.runners: set[Option] = set()  # runners-up given fresh looks (engine/looks.py): judged as later looks
        self._cache: dict[tuple, object] = {}  # incumbent trials and tracks, keyed by the trials run so far
        self.elapsed = elapsed  # the agreed wall seconds so far, when work outside trials (numerics) took time
        self.verified: dict[TuningConfig, str | None] = {}
        self.progress = progress
        self.trials: list[Trial] = []
        self.steps_run = 0
        self.elapsed_s = 0.0
        self.budget_hit = False
        self.limit_hit: str | None = None  # the bound that first stopped a trial: "time" or "step"
        self.cut_short: str | None = None  # what the budget left unmeasured in the search, when it did
        self.planned_trials = 0
        self.block_steps = self.opt.block_steps  # of the final decision (plan_decision may shrink it)
        self._spent: list[tuple[int, bool, float, float]] = []  # per trial: steps, switched, seconds, median step ms
        self._live: TuningConfig | None = None  # the config of the last trial
        self._outside: list[tuple[float, float]] = []  # per trial: (seconds on the agreed clock, its own wall time)
        self._reserve: Work | None = None  # for the final decision, once planned (_decision_reserve)
        self._slot_samples: dict[TuningConfig, dict[str, list[float]]] = {}  # config -> slot -> every sample

    def _verify(self, config: TuningConfig) -> str | None:
        if self.verify is None:
            return None
        if config not in self.verified:
            self.verified[config] = self.verify(config)
            # the check switched configs: the next trial switches too, even to the last trial's config. Counted as
            # continuing it, that switch priced every continuing block of the decision as a switch; at ~0.9 s per
            # switch the reserved decision then no longer fit and no candidate was measured (GPT-3 20B layers on 2
            # H200s ended so at 41 s of 60; tests/test_search.py reproduces it at that price)
            self._live = None
            if self.elapsed is not None:
                self.elapsed_s = max(self.elapsed_s, self.elapsed())
        return self.verified[config]

    def _run(
        self, phase: str, config: TuningConfig, tested: dict[str, str], steps: int, warmup: int | None = None
    ) -> Trial:
        warmup = self.opt.warmup_steps if warmup is None else warmup
        t = Trial(len(self.trials), phase, config, tested, position=float(self.steps_run + warmup))
        before, switched = self.elapsed_s, config != self._live
        self._live = config
        try:
            m = fresh_stack(self.evaluate, config, steps, warmup)  # at one place of the frame stack, whoever calls
        except TrialFailed as e:
            t.error = str(e)
            self.steps_run += steps + warmup
            if self.elapsed is not None:  # a failed trial spends the budget too (and a timed-out one, a lot of it)
                self.elapsed_s = max(self.elapsed_s, self.elapsed())
                self._spent.append((steps + warmup, switched, self.elapsed_s - before, 0.0))
                t.seconds = self._spent[-1][2]
            self._live = None  # what is live after a failure is not known
        else:
            self.steps_run += m.steps_run
            self.elapsed_s = m.elapsed_s
            ms = statistics.median(m.step_ms) if m.step_ms else 0.0
            # the first trial's clock also holds what ran before it (e.g. the numerics calibration): its own wall
            first = not self._spent
            self._spent.append((m.steps_run, switched, m.wall_s if first else m.elapsed_s - before, ms))
            if m.wall_s > 0 and not first:
                self._outside.append((m.elapsed_s - before, m.wall_s))
            t.slot_samples = {s: list(v) for s, v in m.slot_ms.items() if v and all(x == x for x in v)}
            t.slot_ms = {s: statistics.median(v) for s, v in m.slot_ms.items() if v}
            t.step_samples = list(m.step_ms)
            t.step_ms = statistics.median(m.step_ms) if m.step_ms else None
            t.seconds = self._spent[-1][2]
            self._slot_samples.setdefault(config, {})
            for s, v in m.slot_ms.items():
                self._slot_samples[config].setdefault(s, []).extend(v)
        self.trials.append(t)
        if self.progress:
            self.progress(t, self)
        return t

    # -- coordinate search ------------------------------------------------------------------------
    def _slots_of(self, opt: Option) -> frozenset[str]:
        if (slots := self._slots_cache.get(opt)) is None:
            slots = self._slots_cache[opt] = frozenset(
                s for g in (self.topo.coupled(opt.gemm) or {opt.gemm}) for s in self.topo.slots_of(g)
            )
        return slots

    def _valid(self, config: TuningConfig) -> bool:
        key = ("valid", config)
        if key not in self._cache:
            self._cache[key] = is_valid(config, self.ctx)
        return self._cache[key]

    def _score(self, samples: dict[str, list[float]], slots: frozenset[str]) -> list[float] | None:
        """Per-step sum over ``slots``; None when a slot was not timed."""
        cols = [samples.get(s) for s in slot_order(slots)]
        if any(not c for c in cols):
            return None
        return list(cols[0]) if len(cols) == 1 else [sum(x) for x in zip(*cols)]  # type: ignore[arg-type]

    def _pack(
        self, incumbent: TuningConfig, queue: list[Option], fill: list[Option] | None = None
    ) -> tuple[TuningConfig, dict[str, Option]]:
        """Greedily put options of disjoint slots into one config; taken options leave ``queue``. ``fill``: options
        that may run again where a slot is left free (those no longer queued, in order; one taken goes last)."""
        config, used, taken, queued = incumbent, set(), {}, set(queue)
        for opt in list(queue) + [x for x in fill or [] if x not in queued]:
            slots = self._slots_of(opt)
            if slots & used:
                continue
            trial = apply(config, opt, self.topo)
            if not self._valid(trial):
                alone = apply(incumbent, opt, self.topo)
                if not self._valid(alone) and opt in queued:
                    queue.remove(opt)  # cannot run on this incumbent at all
                continue
            config, used = trial, used | slots
            taken[",".join(sorted(slots))] = opt
            if opt in queued:
                queue.remove(opt)
            elif fill is not None:
                fill.remove(opt)
                fill.append(opt)
        return config, taken

    def _measure_options(
        self,
        phase: str,
        incumbent: TuningConfig,
        options: list[Option],
        steps: int,
        raw: dict[Option, list[tuple[Trial, list[float]]]],
        reserve: Callable[[], Work],
        fill: bool = False,
    ) -> int:
        """Measure ``options`` packed into trials of ``steps`` steps; the incumbent runs again (same steps)
        after every ``bracket_every`` trials and once at the end, so that each option is compared with the
        incumbent at the same moment (:meth:`_relative`). ``raw``: option -> [(trial, per-step score)]. ``fill``: a
        slot whose options all ran measures them again while the fullest slot's still run (a round takes as many
        trials as the fullest slot has options: qkv.fwd's 5 options measured once in proj.fwd's 20 trials).
        Returns how many options the budget left untried."""
        o = self.opt
        queue = list(options)
        fillers = list(options) if fill else None
        retry_alone: list[Option] = []
        since = 0
        bracket_cost = steps + o.warmup_steps

        def record(t: Trial, taken: list[Option]) -> None:
            for opt in taken:
                score = self._score(self._scaled(t, None), self._slots_of(opt))  # floor_cap's steps
                if score is not None:
                    raw.setdefault(opt, []).append((t, score))

        def run(config: TuningConfig, tested: dict[str, str]) -> Trial:
            nonlocal since
            t = self._run(phase, config, tested, steps)
            since += 1
            if since >= o.bracket_every:
                self._run("bracket", incumbent, {"*": "incumbent"}, steps)
                since = 0
            return t

        untried = 0
        while queue:
            if not self._can_afford(steps, reserve() + Work(2 * bracket_cost, 2)):
                untried = len(queue)
                break
            config, taken = self._pack(incumbent, queue, fillers)
            if not taken:
                break
            t = run(config, {k: f"{x.gemm}: {x.label}" for k, x in taken.items()})
            if t.error:
                if len(taken) > 1:  # find the culprit: retry each option on its own
                    retry_alone += list(taken.values())
                continue
            record(t, list(taken.values()))
        for i, opt in enumerate(retry_alone):
            if not self._can_afford(steps, reserve() + Work(2 * bracket_cost, 2)):
                untried += len(retry_alone) - i
                break
            t = run(
                apply(incumbent, opt, self.topo), {",".join(sorted(self._slots_of(opt))): f"{opt.gemm}: {opt.label}"}
            )
            if not t.error:
                record(t, [opt])
        if since:
            self._run("bracket", incumbent, {"*": "incumbent"}, steps)
        return untried

    def coordinate(self, reference: TuningConfig, baselines: dict[str, TuningConfig]) -> SearchResult:
        self._slot_samples = {}
        o = self.opt
        contenders, incumbent = {self.reference_name: reference, **baselines}, reference
        options = [
            opt for g, opts in self.space.items() for opt in opts if apply(incumbent, opt, self.topo) != incumbent
        ]
        per_slot = [sum(1 for x in options if self.topo.slot_of(x.gemm) == s) for s in self.topo.slots()]
        gemms_per_slot = max((len(g) for g in self.topo.slots().values()), default=1)
        screens = 2 * max(per_slot, default=0) + 2 * gemms_per_slot  # screening, a round of racing, the re-check
        self.planned_trials = (
            2 + screens + screens // o.bracket_every + 2 * (len(contenders) + 1) + 3 * o.min_quads
        )  # an estimate, for progress bars

        # 1. incumbent, then screening: every option once, the incumbent bracketing every few trials.
        #    Every option is compared with the incumbent: when it cannot be measured (twice, so that one
        #    transient failure is not the end), nothing can be decided and tuning stops here.
        for _ in range(2):
            first = self._run("baseline", incumbent, {"*": "incumbent"}, o.screen_steps * 2)
            if not first.error:
                break
        else:
            raise TrialFailed(f"the reference config could not be measured ({first.error})")

        def decision_cost() -> Work:
            return self._decision_reserve(len(contenders) + 1)

        raw: dict[Option, list[tuple[Trial, list[float]]]] = {}
        unscreened = self._measure_options("screen", incumbent, options, o.screen_steps, raw, decision_cost)
        samples = {opt: v for opt, e in raw.items() if (v := self._relative(incumbent, opt, e))}

        # 2. racing (engine/racing.py): every screened option re-measured in rounds, the best-screened of each GEMM
        #    first, until what is left cannot beat the incumbent by a gain worth a switch or the budget (keeping the
        #    re-check and the final decision) ends it; then each GEMM's leader is re-measured afresh, and only these
        #    fresh samples decide, so that picking the luckiest of many estimates (the winner's curse) does not.
        race = self._race(incumbent, options, samples, decision_cost, len(contenders) + 1)
        self.search_end = race.ended
        if race.ended.startswith("[tp-overlap-autotune]"):
            self.log(race.ended)
        leaders = self._settle(incumbent, race)
        survivors, raw_fresh, unhalved = self._look(incumbent, race, leaders, decision_cost, len(contenders) + 1)
        # 3. per GEMM: the best survivor, kept if it beats the incumbent (at the same moment) beyond the noise; judged
        #    as its looks end (the runners-up's trials move the pooled spreads and trial levels: on decision_sim
        #    trial_wide seed 102 a leader's threshold went from 0.243 to 0.422 ms after them, and a true 0.346 ms left)
        choices, best_of = self._choose(incumbent, survivors, raw_fresh)
        accepted = {g for g, c in choices.items() if c["accepted"]}
        took_so_far = {g: best_of[g][0] for g in accepted}
        runners, took = self._runners_up(incumbent, race, raw_fresh, took_so_far, decision_cost, len(contenders) + 1)
        survivors += runners
        for g, (c, best) in took.items():
            choices[g], best_of[g] = c | {"runner_up": True}, best
        self._ride_along(incumbent, choices, best_of, raw_fresh)
        self._note_cut_short(len(options), unscreened, samples, race, survivors, unhalved)
        self.coverage_report = self.coverage(options, race, set(survivors) & set(raw_fresh))
        taus = self._taus(incumbent) if o.trial_noise else {}
        for s, r in self.coverage_report.items():  # the share of the rest's slowdown taken out (engine/rest_scaling.py)
            r["rest_scaled_by"] = self._betas().get(s, 0.0)
            r["trial_level_pct"] = round(100 * taus.get(s, 0.0), 3)  # counted in the racing (engine/trial_effect.py)
            r["step_spread_pct"] = round(100 * self._sigma(s), 3)  # its own (MIN_SLOT_PAIRS or more), else pooled
            r["se_spread_pct"] = round(100 * self._se_sigma(incumbent, s), 3)  # what its standard errors used
            r["floor_top_ms"] = self._floor_tops().get(s, 0.0)  # its steps counted at most this (floor_cap; 0: not)
            r["runners_up"] = sorted(f"{x.gemm}: {x.label}" for x in runners if s in self._slots_of(x))
        # 4. the accepted choices in one config, largest gain first: where two cannot go together (a
        #    ring-exchange dgrad rules out a bulk wgrad of the same module) the smaller gives way, not whichever
        #    GEMM comes first. Numerics: the config must compute what the no-overlap reference computes; a choice
        #    that fails on its own leaves, and one it had kept out comes back.
        order = sorted((g for g in best_of if choices[g]["accepted"]), key=lambda g: -best_of[g][1])
        bad: dict[str, str] = {}
        while True:
            combined, taken, blocked = self._combine(incumbent, [(g, best_of[g][0]) for g in order if g not in bad])
            if combined == incumbent or not self._verify(combined):
                break
            new_bad = {g: why for g, opt in taken.items() if (why := self._verify(apply(incumbent, opt, self.topo)))}
            bad.update(new_bad)
            if not new_bad:  # each choice passes alone, not together
                combined, taken, blocked = incumbent, {}, {}
                break
        for g in order:
            if g in bad:
                choices[g].update(accepted=False, note=f"rejected by the numerics check: {bad[g]}")
            elif g in blocked:
                choices[g].update(
                    accepted=False, note=f"cannot go with the choices of larger gain ({', '.join(blocked[g])})"
                )
            elif g not in taken:
                choices[g].update(accepted=False, note="every choice passes the numerics check alone, not together")
        combined = TuningConfig(combined.ub, combined.disabled, self.tuned_name)
        return self._confirm(combined, contenders, choices)

    def _choose(
        self, incumbent: TuningConfig, survivors: list[Option], raw_fresh: dict[Option, list]
    ) -> tuple[dict[str, dict], dict[str, tuple[Option, float]]]:
        """Per GEMM with fresh looks in ``raw_fresh``: its choice (the accepted one of the largest gain, else the best
        of the looks; the report's entry) and (option, gain in ms)."""
        per_look = {opt: self._relative_trials(incumbent, opt, e) for opt, e in raw_fresh.items()}
        fresh = {opt: v for opt, p in per_look.items() if (v := [x for diffs, _ in p for x in diffs])}
        choices: dict[str, dict] = {}
        best_of: dict[str, tuple[Option, float]] = {}
        for gemm in self.space:
            cands = [opt for opt in fresh if opt.gemm == gemm]
            if not cands:
                continue
            looks = lambda x: len(raw_fresh[x]) if x in survivors else 1  # noqa: E731
            bounds = {x: self._look_bounds(incumbent, x, raw_fresh[x]) for x in cands}
            thr = {x: self._threshold(incumbent, x, bounds[x][1], looks(x)) for x in cands}
            ok = [x for x in cands if bounds[x][0] > thr[x]]
            best = max(ok, key=lambda x: bounds[x][0]) if ok else min(cands, key=lambda x: statistics.median(fresh[x]))
            choices[gemm] = {
                "option": best.label,
                "gain_ms": round(bounds[best][0], 4),
                "noise_ms": round(thr[best], 4),
                "accepted": bounds[best][0] > thr[best],
                "slot": ",".join(sorted(self._slots_of(best))),
                "samples": len(fresh[best]),
                # each fresh trial's own gain (ms): how far apart the looks were (a level each trial shares)
                "per_look_ms": [round(-statistics.median(d), 4) for d, _ in per_look[best] if d],
            }
            best_of[gemm] = best, bounds[best][0]
        return choices, best_of

    def _combine(
        self, incumbent: TuningConfig, ordered: list[tuple[str, Option]]
    ) -> tuple[TuningConfig, dict[str, Option], dict[str, list[str]]]:
        """``ordered`` options applied one by one where the result is valid and keeps every option taken before
        (a reduce-scatter dgrad drops its module's wgrad entry; "no overlap" switches coupled GEMMs off): (config,
        gemm -> option taken, gemm -> the taken GEMMs it could not go with)."""
        config, taken, blocked = incumbent, {}, {}
        for gemm, opt in ordered:
            trial = apply(config, opt, self.topo)
            if is_valid(trial, self.ctx) and all(apply(trial, t, self.topo) == trial for t in taken.values()):
                config, taken[gemm] = trial, opt
            else:
                blocked[gemm] = list(taken)
        return config, taken, blocked

    # -- final decision: a selection round, then the reference against the selected config in ABBA blocks ----
    report_only: frozenset[str] = frozenset()  # contenders measured for the report but never chosen
    # the final decision's two sides, and what the log calls the search (later passes name theirs: engine/passes.py)
    reference_name, tuned_name, search_name = "reference", "autotuned", "search"
    switch_sets: dict[str, frozenset[str]] = {}  # noqa: RUF012 - named GEMM sets a user can switch off as a whole

    def run(self, reference: TuningConfig, baselines: dict[str, TuningConfig]) -> SearchResult:
        if self.opt.strategy == "exhaustive":
            return exhaustive.exhaustive(self, reference, baselines)
        if self.opt.strategy == "slot_exhaustive":
            return exhaustive.slot_exhaustive(self, reference, baselines)
        return passes.search_on(self, self.coordinate(reference, baselines))
