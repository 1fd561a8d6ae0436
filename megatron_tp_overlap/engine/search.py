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

import statistics
from collections.abc import Callable

from megatron_tp_overlap.engine.space import Option, TuningConfig, apply, is_valid
from megatron_tp_overlap.engine.stats import pooled_sigma, rotated, significant_gain
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
    ):
        self.topo, self.space, self.evaluate, self.ctx, self.opt = (
            topo,
            space,
            evaluate,
            ctx,
            options or SearchOptions(),
        )
        self.verify = verify
        self.verified: dict[TuningConfig, str | None] = {}
        self.progress = progress
        self.trials: list[Trial] = []
        self.steps_run = 0
        self.elapsed_s = 0.0
        self.budget_hit = False
        self.planned_trials = 0

    def _verify(self, config: TuningConfig) -> str | None:
        if self.verify is None:
            return None
        if config not in self.verified:
            self.verified[config] = self.verify(config)
        return self.verified[config]

    # -- budget ---------------------------------------------------------------------------------
    def _can_afford(self, steps: int, reserve_steps: int = 0, reserve_s: float = 0.0) -> bool:
        n = self.steps_run + steps + self.opt.warmup_steps + reserve_steps
        per_step = self.elapsed_s / self.steps_run if self.steps_run else 0.0
        ok = (
            n <= self.opt.max_steps
            and self.elapsed_s + per_step * (steps + self.opt.warmup_steps) + reserve_s <= self.opt.max_seconds
        )
        if not ok:
            self.budget_hit = True
        return ok

    def _run(self, phase: str, config: TuningConfig, tested: dict[str, str], steps: int) -> Trial:
        t = Trial(len(self.trials), phase, config, tested)
        try:
            m = self.evaluate(config, steps, self.opt.warmup_steps)
        except TrialFailed as e:
            t.error = str(e)
            self.steps_run += steps + self.opt.warmup_steps
        else:
            self.steps_run += m.steps_run
            self.elapsed_s = m.elapsed_s
            t.slot_ms = {s: statistics.median(v) for s, v in m.slot_ms.items() if v}
            t.step_samples = list(m.step_ms)
            t.step_ms = statistics.median(m.step_ms) if m.step_ms else None
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
        samples: dict[Option, list[float]],
        reserve: int,
    ) -> None:
        queue = list(options)
        retry_alone: list[Option] = []
        while queue:
            if not self._can_afford(steps, reserve_steps=reserve):
                return
            config, taken = self._pack(incumbent, queue)
            if not taken:
                return
            t = self._run(phase, config, {k: f"{o.gemm}: {o.label}" for k, o in taken.items()}, steps)
            if t.error:
                if len(taken) > 1:  # find the culprit: retry each option on its own
                    retry_alone += list(taken.values())
                continue
            per_slot = self._slot_samples[config]
            for opt in taken.values():
                score = self._score({s: per_slot[s][-steps:] for s in per_slot}, self._slots_of(opt))
                if score is not None:
                    samples.setdefault(opt, []).extend(score)
        for opt in retry_alone:
            if not self._can_afford(steps, reserve_steps=reserve):
                return
            config = apply(incumbent, opt, self.topo)
            t = self._run(phase, config, {",".join(sorted(self._slots_of(opt))): f"{opt.gemm}: {opt.label}"}, steps)
            if not t.error:
                per_slot = self._slot_samples[config]
                score = self._score({s: per_slot[s][-steps:] for s in per_slot}, self._slots_of(opt))
                if score is not None:
                    samples.setdefault(opt, []).extend(score)

    def _incumbent_scores(self, incumbent: TuningConfig, opt: Option) -> list[float]:
        return self._score(self._slot_samples.get(incumbent, {}), self._slots_of(opt)) or []

    def coordinate(self, reference: TuningConfig, baselines: dict[str, TuningConfig]) -> SearchResult:
        self._slot_samples: dict[TuningConfig, dict[str, list[float]]] = {}
        o = self.opt
        contenders = {"reference": reference, **baselines}
        confirm_cost = (len(contenders) + 1) * o.confirm_rounds * (o.confirm_steps + o.warmup_steps)
        incumbent = reference
        options = [
            opt for g, opts in self.space.items() for opt in opts if apply(incumbent, opt, self.topo) != incumbent
        ]
        per_slot = [sum(1 for x in options if self.topo.slot_of(x.gemm) == s) for s in self.topo.slots()]
        gemms_per_slot = max((len(g) for g in self.topo.slots().values()), default=1)
        self.planned_trials = (
            2 + max(per_slot, default=0) + o.keep * gemms_per_slot + o.confirm_rounds * (len(contenders) + 1)
        )  # an estimate, for progress bars

        # 1. incumbent, then screening: every option once.
        self._run("baseline", incumbent, {"*": "incumbent"}, o.screen_steps * 2)
        samples: dict[Option, list[float]] = {}
        self._measure_options("screen", incumbent, options, o.screen_steps, samples, confirm_cost)

        # 2. successive halving: the best `keep` per GEMM (by screening) that look better than the
        #    incumbent are measured again; the decision uses only these fresh samples, so picking the
        #    luckiest of many noisy screenings (the winner's curse) does not decide by itself.
        self._run("baseline", incumbent, {"*": "incumbent"}, o.halving_steps)
        survivors: list[Option] = []
        for gemm in self.space:
            ranked = sorted((opt for opt in samples if opt.gemm == gemm), key=lambda x: statistics.median(samples[x]))
            for opt in ranked[: o.keep]:
                inc = self._incumbent_scores(incumbent, opt)
                if inc and statistics.median(samples[opt]) < statistics.median(inc):
                    survivors.append(opt)
        fresh: dict[Option, list[float]] = {}
        self._measure_options("halving", incumbent, survivors, o.halving_steps, fresh, confirm_cost)

        # 3. per GEMM: the best survivor, kept if it beats the incumbent by more than the noise.
        groups = [v for v in {**samples, **fresh}.values()] + [
            v for d in self._slot_samples.values() for v in d.values()
        ]
        sigma = pooled_sigma(groups)
        choices: dict[str, dict] = {}
        accepted_opts: dict[str, Option] = {}
        combined = incumbent
        for gemm in self.space:
            cands = [opt for opt in fresh if opt.gemm == gemm]
            if not cands:
                continue
            best = min(cands, key=lambda x: statistics.median(fresh[x]))
            inc = self._incumbent_scores(incumbent, best)
            if not inc:
                continue
            gain, thr = significant_gain(inc, fresh[best], sigma, o.z, o.rel_floor)
            accepted = gain > thr
            choices[gemm] = {
                "option": best.label,
                "gain_ms": round(gain, 4),
                "noise_ms": round(thr, 4),
                "accepted": accepted,
                "slot": ",".join(sorted(self._slots_of(best))),
                "samples": len(fresh[best]),
            }
            if accepted:
                trial = apply(combined, best, self.topo)
                if is_valid(trial, self.ctx):
                    combined = trial
                    accepted_opts[gemm] = best
                else:
                    choices[gemm]["accepted"] = False
                    choices[gemm]["note"] = "conflicts with an earlier choice"
        # 4. numerics: a config must compute what the no-overlap reference computes.
        if combined != incumbent and self._verify(combined):
            for gemm, opt in list(accepted_opts.items()):
                bad = self._verify(apply(incumbent, opt, self.topo))
                if bad:
                    choices[gemm].update(accepted=False, note=f"rejected by the numerics check: {bad}")
                    del accepted_opts[gemm]
            combined = incumbent
            for opt in accepted_opts.values():
                combined = apply(combined, opt, self.topo)
            if combined != incumbent and self._verify(combined):
                combined = incumbent
        combined = TuningConfig(combined.ub, combined.disabled, "autotuned")
        return self._confirm(combined, contenders, choices)

    def _confirm(self, tuned: TuningConfig, baselines: dict[str, TuningConfig], choices: dict) -> SearchResult:
        o = self.opt
        cont: list[Contender] = [Contender(n, c) for n, c in baselines.items()]
        if all(tuned != c.config for c in cont):
            cont.insert(0, Contender(tuned.label or "autotuned", tuned))
        for r in range(o.confirm_rounds):  # interleaved, so drift hits every contender alike
            # rotated each round, so no contender is always measured right after the same one (a
            # config switch can leave state behind that changes the next config's step time)
            for c in rotated(cont, r):
                if not self._can_afford(o.confirm_steps) and c.samples:
                    continue
                t = self._run("confirm", c.config, {"*": c.name}, o.confirm_steps)
                c.samples.extend(t.step_samples)
        measured = [c for c in cont if c.samples and c.name not in self.report_only]
        if not measured:
            raise TrialFailed("no config could be measured (every trial failed)")
        sigma = pooled_sigma([t.step_samples for t in self.trials if t.phase == "confirm" and t.step_samples])
        ref = next((c for c in measured if c.name == "reference"), measured[0])
        # The reference stays unless another config beats it, and every other config, beyond the noise.
        winner, reason, noise = ref, "no config beat the reference by more than the noise", 0.0
        rejected = []
        while True:
            best = min(measured, key=lambda c: c.median)
            bad = None if best is ref else self._verify(best.config)
            if not bad:
                break
            rejected.append(f"{best.name} rejected by the numerics check ({bad})")
            measured.remove(best)
        if best is not ref:
            gain, thr = significant_gain(ref.samples, best.samples, sigma, o.z, o.rel_floor)
            noise = thr
            if gain > thr:
                winner = best
                reason = f"{best.name} beats the reference by {gain:.3f} ms/step (noise threshold {thr:.3f} ms)"
            else:
                reason = f"best was {best.name}, {gain:.3f} ms/step faster than the reference: within noise ({thr:.3f} ms), keeping the reference"
        if rejected:
            reason += "; " + "; ".join(rejected)
        return SearchResult(
            best=TuningConfig(winner.config.ub, winner.config.disabled, winner.name),
            best_name=winner.name,
            reason=reason,
            trials=self.trials,
            contenders=cont,
            choices=choices,
            noise_ms=noise,
            steps_run=self.steps_run,
            elapsed_s=self.elapsed_s,
            budget_hit=self.budget_hit,
        )

    report_only: frozenset[str] = frozenset()  # contenders measured for the report but never chosen

    def run(self, reference: TuningConfig, baselines: dict[str, TuningConfig]) -> SearchResult:
        from megatron_tp_overlap.engine import exhaustive

        if self.opt.strategy == "exhaustive":
            return exhaustive.exhaustive(self, reference, baselines)
        if self.opt.strategy == "slot_exhaustive":
            return exhaustive.slot_exhaustive(self, reference, baselines)
        return self.coordinate(reference, baselines)
