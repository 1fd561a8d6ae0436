"""Search over the candidate space, given a function that runs trial steps and times them.

Pure logic (no CUDA, no torch.distributed): the caller's ``evaluate`` runs ``steps`` steps of a
:class:`~space.TuningConfig` and returns per-slot and per-step times that every rank already
agrees on, so every rank takes the same decisions here.

``coordinate`` (default): modules run one after another, so one trial step measures a different
option in every slot (forward / backward of qkv, proj, fc1, fc2) at once. Screening tries every
option once; successive halving re-measures the best few per GEMM; per-GEMM winners that beat the
incumbent by more than the noise are combined; the combination is confirmed end-to-end against the
baselines, interleaved, and kept only if it wins by more than the noise.

``exhaustive``: every combination of the same options, end-to-end (for benchmarks).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

from megatron_tp_overlap.engine import paired
from megatron_tp_overlap.engine.space import Option, TuningConfig, apply, is_valid
from megatron_tp_overlap.engine.stats import pooled_sigma
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
)
from megatron_tp_overlap.ub.rules import ValidationContext


class Searcher:
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
    ):
        self.topo, self.space, self.evaluate, self.ctx, self.opt = (
            topo,
            space,
            evaluate,
            ctx,
            options or SearchOptions(),
        )
        self.verify = verify
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

    # -- budget ---------------------------------------------------------------------------------
    def _can_afford(self, steps: int, reserve: Work | None = None) -> bool:
        """Whether a trial of ``steps`` (+ warm-up, after a switch) fits, keeping ``reserve`` for later phases and
        one switch for the final config. Seconds are measured (:meth:`_rates`): the budget is a hard cap on the
        trials."""
        need = Work(steps + self.opt.warmup_steps, 1) + (reserve or Work()) + Work(0, 1)
        steps_ok = need.steps <= self.opt.steps_left(self.steps_run)
        ok = steps_ok and self.elapsed_s + self._seconds(need) <= self.opt.max_seconds
        if not ok:
            self.budget_hit = True
            self.limit_hit = self.limit_hit or ("time" if steps_ok else "step")
        return ok

    def _raise_hint(self) -> str:
        """What to raise when the budget stopped the search: the bound that ran out."""
        return "raise the step limit" if self.limit_hit == "step" else "raise the time budget"

    def _seconds(self, w: Work) -> float:
        step_s, switch_s, continuing_s = self._rates()
        return w.steps * step_s + w.switches * switch_s + w.continuing * continuing_s

    def _rates(self) -> tuple[float, float, float]:
        """Seconds per step, per trial that switches config and per trial that continues one (beyond its steps),
        from the agreed clock: a trial spends its steps at their measured time, and a switch (re-init, sync, the
        idle GPU after it) plus the search's own work between trials. Priced at screening's seconds per step
        instead (its 3-step trials each switch), the final decision (half of its trials continue a config) cost
        twice its real time and the budget ended the search early on real H200 steps of 75 ms."""
        timed = [(i, n, sw, sec, ms) for i, (n, sw, sec, ms) in enumerate(self._spent) if sec > 0]
        if not any(ms > 0 for *_, ms in timed):
            per_step = self.elapsed_s / self.steps_run if self.steps_run else 0.0
            return per_step, 0.0, 0.0
        step_s = statistics.median(ms for *_, ms in timed if ms > 0) / 1000  # a failed trial (ms 0) has its seconds
        rest = {
            sw: [max(0.0, sec - n * step_s) for i, n, s_, sec, _ in timed if s_ == sw and i > 0] for sw in (True, False)
        }
        # the first trial's switch also holds one-off costs (on 2 H200s in Megatron: 5.7 s against 0.6 s later):
        # it prices a switch only until another switch was measured (:meth:`_decision_reserve`)
        first = [max(0.0, sec - n * step_s) for i, n, _, sec, _ in timed if i == 0]
        switch_s = statistics.mean(rest[True] or first or [0.0])
        # a continuing trial, before any ran: the search's own work between trials, at most a switch trial's
        outside = [max(0.0, sec - wall) for sec, wall in self._outside]
        continuing_s = (
            statistics.mean(rest[False]) if rest[False] else min(switch_s, statistics.fmean(outside or [0.0]))
        )
        return step_s, switch_s, continuing_s

    def _switch_priced(self) -> bool:
        """Whether a switch after the first trial was measured (the first one's cost is no price for the rest)."""
        return any(sw and sec > 0 for _, sw, sec, _ in self._spent[1:])

    def _decision_reserve(self, contenders: int) -> Work:
        """What the search keeps for the final decision: nothing until a switch after the first trial has a
        measured price (the first screening trial runs to learn it), then :meth:`plan_decision`, planned once.
        Planned from the first trial alone, a reserve priced at its one-off costs took the whole 60 s budget on
        2 H200s in Megatron and the search screened nothing."""
        if self._reserve is None and self._switch_priced():
            self._reserve = self.plan_decision(contenders)
        return self._reserve or Work()

    def _run(
        self, phase: str, config: TuningConfig, tested: dict[str, str], steps: int, warmup: int | None = None
    ) -> Trial:
        warmup = self.opt.warmup_steps if warmup is None else warmup
        t = Trial(len(self.trials), phase, config, tested, position=float(self.steps_run + warmup))
        before, switched = self.elapsed_s, config != self._live
        self._live = config
        try:
            m = self.evaluate(config, steps, warmup)
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
        return frozenset(self.topo.slot_of(g) for g in (self.topo.coupled(opt.gemm) or {opt.gemm}))

    def _score(self, samples: dict[str, list[float]], slots: frozenset[str]) -> list[float] | None:
        """Per-step sum over ``slots``; None when a slot was not timed."""
        cols = [samples.get(s) for s in sorted(slots)]
        if any(not c for c in cols):
            return None
        n = min(len(c) for c in cols)  # type: ignore[arg-type]
        return [sum(c[i] for c in cols) for i in range(n)]  # type: ignore[index]

    def _pack(self, incumbent: TuningConfig, queue: list[Option]) -> tuple[TuningConfig, dict[str, Option]]:
        """Greedily put options of disjoint slots into one config; taken options leave ``queue``."""
        config, used, taken = incumbent, set(), {}
        for opt in list(queue):
            slots = self._slots_of(opt)
            if slots & used:
                continue
            trial = apply(config, opt, self.topo)
            if not is_valid(trial, self.ctx):
                alone = apply(incumbent, opt, self.topo)
                if not is_valid(alone, self.ctx):
                    queue.remove(opt)  # cannot run on this incumbent at all
                continue
            config, used = trial, used | slots
            taken[",".join(sorted(slots))] = opt
            queue.remove(opt)
        return config, taken

    def _measure_options(
        self,
        phase: str,
        incumbent: TuningConfig,
        options: list[Option],
        steps: int,
        raw: dict[Option, list[tuple[Trial, list[float]]]],
        reserve: Callable[[], Work],
    ) -> int:
        """Measure ``options`` packed into trials of ``steps`` steps; the incumbent runs again (same steps)
        after every ``bracket_every`` trials and once at the end, so that each option is compared with the
        incumbent at the same moment (:meth:`_relative`). ``raw``: option -> [(trial, per-step score)].
        Returns how many options the budget left untried."""
        o = self.opt
        queue = list(options)
        retry_alone: list[Option] = []
        since = 0
        bracket_cost = steps + o.warmup_steps

        def record(t: Trial, taken: list[Option]) -> None:
            for opt in taken:
                score = self._score(t.slot_samples, self._slots_of(opt))
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
            config, taken = self._pack(incumbent, queue)
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

    def _incumbent_trials(self, incumbent: TuningConfig) -> list[Trial]:
        return [t for t in self.trials if t.config == incumbent and t.phase in ("baseline", "bracket") and not t.error]

    def _relative(self, incumbent: TuningConfig, opt: Option, entries: list[tuple[Trial, list[float]]]) -> list[float]:
        """Per-step ms of ``opt``'s slots minus the incumbent's at the same moment (interpolated between the
        incumbent trials around it): negative is faster; drift between trials cancels."""
        slots = self._slots_of(opt)
        track = self._track(
            self._incumbent_trials(incumbent),
            lambda t: statistics.median(v) if (v := self._score(t.slot_samples, slots)) else None,
        )
        return [v - track(t.position) for t, score in entries for v in score if not math.isnan(track(t.position))]

    def _bracket_samples(self, incumbent: TuningConfig, trials: list[Trial]) -> int:
        """Samples of the incumbent trials just before and after ``trials`` (what :meth:`_relative` interpolates
        between; a screening bracket has fewer steps than a halving one), the fewest over ``trials``."""
        inc = sorted((t.position, len(t.step_samples)) for t in self._incumbent_trials(incumbent))
        counts = []
        for t in trials:
            before = [n for p, n in inc if p < t.position]
            after = [n for p, n in inc if p > t.position]
            counts.append((before[-1] if before else 0) + (after[0] if after else 0))
        return max(1, min(counts, default=1))

    def _incumbent_level(self, incumbent: TuningConfig, opt: Option) -> float:
        vals = [
            v
            for t in self._incumbent_trials(incumbent)
            for v in (self._score(t.slot_samples, self._slots_of(opt)) or [])
        ]
        return statistics.median(vals) if vals else 0.0

    def coordinate(self, reference: TuningConfig, baselines: dict[str, TuningConfig]) -> SearchResult:
        self._slot_samples = {}
        o = self.opt
        contenders = {"reference": reference, **baselines}
        incumbent = reference
        options = [
            opt for g, opts in self.space.items() for opt in opts if apply(incumbent, opt, self.topo) != incumbent
        ]
        per_slot = [sum(1 for x in options if self.topo.slot_of(x.gemm) == s) for s in self.topo.slots()]
        gemms_per_slot = max((len(g) for g in self.topo.slots().values()), default=1)
        screens = max(per_slot, default=0) + o.keep * gemms_per_slot
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
        samples = {opt: self._relative(incumbent, opt, e) for opt, e in raw.items()}

        # 2. successive halving: the best `keep` per GEMM (by screening) that look faster than the
        #    incumbent are measured again; the decision uses only these fresh samples, so picking the
        #    luckiest of many noisy screenings (the winner's curse) does not decide by itself.
        survivors: list[Option] = []
        for gemm in self.space:
            ranked = sorted(
                (opt for opt in samples if opt.gemm == gemm and samples[opt]),
                key=lambda x: statistics.median(samples[x]),
            )
            survivors += [opt for opt in ranked[: o.keep] if statistics.median(samples[opt]) < 0]
        raw_fresh: dict[Option, list[tuple[Trial, list[float]]]] = {}
        unhalved = self._measure_options("halving", incumbent, survivors, o.halving_steps, raw_fresh, decision_cost)
        if unscreened or unhalved:
            per_trial = statistics.fmean(sec for *_, sec, _ in self._spent[1:] or self._spent) if self._spent else 0.0
            self.cut_short = (
                f"the budget ran out during the search: {len(options) - unscreened} of {len(options)} options "
                f"screened, {len(survivors) - unhalved} of {len(survivors)} re-measured"
                + (
                    f" (at {per_trial:.2f} s per trial the whole search needs about "
                    f"{self.planned_trials * per_trial:.0f} s: {self._raise_hint()}, or shorten the trial steps)"
                    if per_trial > 0
                    else ""
                )
            )
        fresh = {opt: v for opt, e in raw_fresh.items() if (v := self._relative(incumbent, opt, e))}

        # 3. per GEMM: the best survivor, kept if it beats the incumbent (at the same moment) beyond the noise.
        sigma = pooled_sigma([v for t in self.trials for v in t.slot_samples.values()], positional=True)
        choices: dict[str, dict] = {}
        best_of: dict[str, tuple[Option, float]] = {}
        for gemm in self.space:
            cands = [opt for opt in fresh if opt.gemm == gemm]
            if not cands:
                continue
            best = min(cands, key=lambda x: statistics.median(fresh[x]))
            gain = -statistics.median(fresh[best])
            n_inc = self._bracket_samples(incumbent, [t for t, _ in raw_fresh[best]])
            thr = max(
                o.z * sigma * len(self._slots_of(best)) ** 0.5 * (1 / len(fresh[best]) + 1 / n_inc) ** 0.5,
                o.rel_floor * self._incumbent_level(incumbent, best),
            )
            choices[gemm] = {
                "option": best.label,
                "gain_ms": round(gain, 4),
                "noise_ms": round(thr, 4),
                "accepted": gain > thr,
                "slot": ",".join(sorted(self._slots_of(best))),
                "samples": len(fresh[best]),
            }
            best_of[gemm] = best, gain
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
        combined = TuningConfig(combined.ub, combined.disabled, "autotuned")
        return self._confirm(combined, contenders, choices)

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
    def _confirm(self, tuned: TuningConfig, baselines: dict[str, TuningConfig], choices: dict) -> SearchResult:
        o = self.opt
        cont: list[Contender] = [Contender(n, c) for n, c in baselines.items()]
        if all(tuned != c.config for c in cont):
            cont.insert(0, Contender(tuned.label or "autotuned", tuned))
        # the winner so far with a whole kind of overlap switched off (a flag the user can set, e.g. Megatron's
        # --no-tp-comm-overlap-ag): cheaper overlap can lose to none where the GEMM is too small to hide anything
        for name, gemms in self.switch_sets.items():
            off = frozenset(gemms & self.topo.active)
            v = TuningConfig(tuned.ub, tuned.disabled | off, f"{tuned.label or 'autotuned'}, {name} off")
            if off and not off <= tuned.disabled and all(v != c.config for c in cont) and is_valid(v, self.ctx):
                cont.append(Contender(v.label, v))
        ref = next((c for c in cont if c.name == "reference"), cont[0])
        others = [c for c in cont if c is not ref]
        # 1. selection: every contender once, the reference bracketing them (drift interpolated away)
        plan: list[Contender] = [ref]
        for i, c in enumerate(others):
            plan.append(c)
            if (i + 1) % o.bracket_every == 0 or i == len(others) - 1:
                plan.append(ref)
        self._select_trials(plan, ref)
        sel = self._selection(ref, others)
        # 1b. runoff: the contenders ahead of the reference again, in alternating order, until each has
        # select_passes blocks (one block cannot tell configs ~1% of a step apart)
        ahead = [c for c in others if sel.get(c.name, 0.0) < 0 and c.name not in self.report_only]
        ahead = sorted(ahead, key=lambda c: sel[c.name])[: o.runoff]
        for p in range(1, o.select_passes if len(ahead) > 1 else 1):
            order = ahead if p % 2 == 0 else ahead[::-1]
            if not self._select_trials([*order, ref], ref, stop_short=True):
                break
            sel = self._selection(ref, others)
        if not ref.samples:
            raise TrialFailed("the reference config could not be measured (every trial failed)")
        rejected: list[str] = []
        eligible = [c for c in others if c.name in sel and c.name not in self.report_only]
        winner, reason, decision = ref, "no config was faster than the reference in the selection round", {}
        undecided: TuningConfig | None = None
        if not sel and self.budget_hit:  # nothing to compare: say why, not "no config was faster"
            reason = (
                f"the budget ({self.opt.budget_text()}) ran out before any candidate was measured against the "
                f"reference ({self.steps_run} steps, {self.elapsed_s:.1f} s run): keeping the reference "
                f"({self._raise_hint()})"
            )
        while eligible:
            best = min(eligible, key=lambda c: sel[c.name])
            if sel[best.name] >= 0:
                break
            bad = self._verify(best.config)
            if bad:
                rejected.append(f"{best.name} rejected by the numerics check ({bad})")
                eligible.remove(best)
                continue
            # 2. the reference against the selected config, in ABBA quadruples, until the interval decides
            decision = self.abba(ref, best)
            slot, step = decision["slot_interval"], decision["step_interval"]
            ref_ms = decision["reference_step_ms"]
            if slot.faster and not step.slower:
                winner = best
                reason = (
                    f"{best.name} beats the reference by {slot.describe(ref=ref_ms)} per step in the overlapped "
                    f"layers; whole step {step.describe(ref=ref_ms)}"
                )
            elif slot.faster:
                reason = (
                    f"{best.name} is faster in the overlapped layers ({slot.describe(ref=ref_ms)}) but its whole step "
                    f"is slower ({step.describe(ref=ref_ms)}): keeping the reference"
                )
            elif decision["error"]:
                reason = f"{best.name} failed during the decision ({decision['error']}): keeping the reference"
            elif decision["quadruples"] < self.opt.min_quads:
                reason = (
                    f"best was {best.name}, but the budget left {decision['quadruples']} ABBA quadruples of the "
                    f"{self.opt.min_quads} a decision needs: keeping the reference ({self._raise_hint()})"
                )
            else:
                reason = (
                    f"best was {best.name}, {slot.describe(ref=ref_ms)} per step vs the reference: within the noise "
                    "(not faster beyond the interval), keeping the reference"
                )
                if slot.estimate > 0 and not step.slower:  # ahead, unresolved: real iterations can settle it
                    undecided = TuningConfig(best.config.ub, best.config.disabled, best.name)
            break
        if rejected:
            reason += "; " + "; ".join(rejected)
        if self.cut_short:
            reason += "; " + self.cut_short
        noise = decision["slot_interval"].half_width if decision else 0.0
        if decision:
            decision = {
                **{k: v for k, v in decision.items() if not k.endswith("interval")},
                "slot_interval": decision["slot_interval"].to_dict(),
                "step_interval": decision["step_interval"].to_dict(),
                "selection_gain_ms": {k: round(-v, 4) for k, v in sel.items()},
            }
        return SearchResult(
            best=TuningConfig(winner.config.ub, winner.config.disabled, winner.name),
            best_name=winner.name,
            reason=reason,
            trials=self.trials,
            contenders=cont,
            choices=choices,
            noise_ms=noise if math.isfinite(noise) else math.inf,
            steps_run=self.steps_run,
            elapsed_s=self.elapsed_s,
            budget_hit=self.budget_hit,
            decision=decision,
            undecided=undecided,
            cut_short=self.cut_short,
        )

    def _select_trials(self, plan: list[Contender], ref: Contender, stop_short: bool = False) -> bool:
        """One selection block per entry of ``plan`` while the budget keeps the decision's first quadruples;
        ``stop_short``: run none unless all fit (a runoff pass without its closing reference block tells nothing).
        False when the budget stopped it."""
        o = self.opt
        reserve = o.quads_work(o.min_quads, self.block_steps)
        if stop_short:  # the first block is _can_afford's own trial; the others go with the reserve
            rest = len(plan) - 1
            if not self._can_afford(self.block_steps, reserve + Work(rest * (self.block_steps + o.warmup_steps), rest)):
                return False
        for c in plan:
            if ref.samples and not self._can_afford(self.block_steps, reserve):
                if stop_short:
                    return False
                continue
            self._decision_trial(c, self.block_steps, "select")
        return True

    def _selection(self, ref: Contender, others: list[Contender]) -> dict[str, float]:
        """Per contender: the median over its selection blocks of its slot time minus the reference's at the same
        moment (ms; negative is faster); contenders not measured, or no reference measured, are left out."""
        track = self._track([t for t in self.trials if t.phase == "select" and t.tested.get("*") == ref.name])
        sel: dict[str, float] = {}
        for c in others:
            pts = [t for t in self.trials if t.phase == "select" and t.tested.get("*") == c.name and not t.error]
            vals = [v - track(t.position) for t in pts if (v := self._slot_sum(t)) is not None]
            if vals and not math.isnan(track(0.0)):  # the reference was measured
                sel[c.name] = statistics.median(vals)
        return sel

    def _track(
        self, trials: list[Trial], score: Callable[[Trial], float | None] | None = None
    ) -> Callable[[float], float]:
        """The incumbent's value at any position (steps since tuning began), linearly interpolated between the
        ``trials`` that measured it (nearest beyond the ends; NaN without any): what it would have measured
        at that moment, drift included."""
        score = score or self._slot_sum
        pts = sorted((t.position, v) for t in trials if not t.error and (v := score(t)) is not None)

        def at(p: float) -> float:
            if not pts:
                return math.nan
            if p <= pts[0][0]:
                return pts[0][1]
            for (p0, v0), (p1, v1) in zip(pts, pts[1:]):
                if p <= p1:
                    return v0 + (v1 - v0) * (p - p0) / (p1 - p0) if p1 > p0 else v1
            return pts[-1][1]

        return at

    def plan_decision(self, contenders: int) -> Work:
        """What to reserve for the final decision; call after the first trial (the cost of a step and of a switch
        is known). Blocks shrink from ``block_steps`` towards 1 step until the decision needs at most half of what
        is left of the budget."""
        o = self.opt

        def too_long(b: int) -> bool:
            w = o.decision_work(contenders, b)
            return w.steps > o.steps_left(self.steps_run) / 2 or self._seconds(w) > (o.max_seconds - self.elapsed_s) / 2

        self.block_steps = o.block_steps
        while self.block_steps > 1 and too_long(self.block_steps):
            self.block_steps -= 1
        return o.decision_work(contenders, self.block_steps)

    def _decision_trial(self, c: Contender, steps: int, phase: str) -> Trial:
        t = self._run(phase, c.config, {"*": c.name}, steps)
        c.samples.extend(t.step_samples)
        return t

    def _slot_sum(self, t: Trial) -> float | None:
        """Median over the trial's steps of the per-step sum over slots (ms): GPU time of the overlapped layers."""
        per = self._step_slot_sums(t)
        return statistics.median(per) if per else None

    def _step_slot_sums(self, t: Trial) -> list[float]:
        cols = list(t.slot_samples.values())
        if not cols:
            return []
        return [sum(c[i] for c in cols) for i in range(min(len(c) for c in cols))]

    def abba(self, ref: Contender, cand: Contender) -> dict:
        """ABBA quadruples of ``block_steps``-step blocks; from ``min_quads`` on, stop as soon as the slot-time
        interval excludes zero (either way) or cannot hold a gain of ``rel_floor`` of the step any more, or at
        the budget. Per quadruple the reference runs A1 then (after the candidate's two blocks) A2 and the next
        quadruple's A1 without a switch: each config has one block right after a switch and one after its own
        block, so effects of the position since a switch cancel too. Every block is a trial of its own: a trial
        ends with a device sync and host work (the GPU idles briefly), and a config's second block must follow
        that gap as its first follows a switch, for both configs alike (with B's two blocks in one trial, A's
        continuing block alone followed a gap: on real H200 steps the reference then measured 0.06-0.55% of a step
        faster than an equal candidate in 7 of 7 decisions, benchmarks/results/2026-11-23_h200x1/search_on_real_steps/)."""
        o, bs = self.opt, self.block_steps
        order: list[int] = []
        slot_blocks: list[float] = []
        step_blocks: list[float] = []
        quads, error = 0, None
        slot_iv = step_iv = paired.gain_interval([], o.level)
        rest_of_quad = Work(3 * bs + o.warmup_steps, 1, 2)  # after its first block
        while quads < o.max_quads and error is None and self._can_afford(bs, rest_of_quad):
            for which in paired.QUAD:
                c = cand if which == paired.B else ref
                continuing = bool(order) and order[-1] == which
                t = self._run("confirm", c.config, {"*": c.name}, bs, warmup=0 if continuing else None)
                if t.error:
                    error = t.error
                    break
                c.samples.extend(t.step_samples)
                slot_blocks.append(statistics.median(self._step_slot_sums(t) or t.step_samples))
                step_blocks.append(statistics.median(t.step_samples))
                order.append(which)
            else:
                quads += 1
            if quads >= o.min_quads and error is None:
                slot_iv = paired.gain_interval(paired.quad_gains(slot_blocks[: 4 * quads], order), o.level)
                step_iv = paired.gain_interval(paired.quad_gains(step_blocks[: 4 * quads], order), o.level)
                ref_ms = statistics.median(v for v, w in zip(step_blocks, order) if w == paired.A)
                if slot_iv.faster or slot_iv.slower or slot_iv.high < o.rel_floor * ref_ms:
                    break
        ref_blocks = [v for v, w in zip(step_blocks, order) if w == paired.A]
        ref_ms = statistics.median(ref_blocks) if ref_blocks else math.nan
        drift = (max(ref_blocks) - min(ref_blocks)) / ref_ms if ref_blocks else 0.0
        return {
            "candidate": cand.name,
            "quadruples": quads,
            "block_steps": bs,
            "level": o.level,
            "error": error,
            "slot_interval": slot_iv,
            "step_interval": step_iv,
            "reference_step_ms": ref_ms,
            "noise_pct_of_step": round(100 * slot_iv.half_width / ref_ms, 3)
            if ref_blocks and math.isfinite(slot_iv.half_width)
            else None,
            "reference_drift_pct": round(100 * drift, 2),
            "drift_note": (
                f"the reference's step time ranged {100 * drift:.1f}% over the decision: the ABBA order cancels a "
                "linear drift, and a sudden change moves one quadruple by one rank"
                if drift > 0.02
                else "no drift above 2% of a step seen"
            ),
        }

    report_only: frozenset[str] = frozenset()  # contenders measured for the report but never chosen
    switch_sets: dict[str, frozenset[str]] = {}  # noqa: RUF012 - named GEMM sets a user can switch off as a whole

    def run(self, reference: TuningConfig, baselines: dict[str, TuningConfig]) -> SearchResult:
        from megatron_tp_overlap.engine import exhaustive

        if self.opt.strategy == "exhaustive":
            return exhaustive.exhaustive(self, reference, baselines)
        if self.opt.strategy == "slot_exhaustive":
            return exhaustive.slot_exhaustive(self, reference, baselines)
        return self.coordinate(reference, baselines)
