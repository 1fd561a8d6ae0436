"""What the search can afford: seconds per step, per switch and per continuing trial from the agreed clock, and
the final decision's reserve, and what the budget left out of what it must not. A mixin of
:class:`~engine.search.Searcher` (its state: ``opt``, ``elapsed_s``, ``steps_run``, ``_spent``, ``_outside``,
``_reserve``)."""

from __future__ import annotations

import bisect
import statistics
from typing import TYPE_CHECKING

from megatron_tp_overlap.engine.trial import Work

if TYPE_CHECKING:
    from megatron_tp_overlap.engine.racing import Race
    from megatron_tp_overlap.engine.space import Option


class Budget:
    """Pricing of the search's work (mixin)."""

    def _can_afford(self, steps: int, reserve: Work | None = None) -> bool:
        """Whether a trial of ``steps`` (+ warm-up, after a switch) fits, keeping ``reserve`` for later phases and
        one switch for the final config. Seconds are measured (:meth:`_rates`): the budget is a hard cap on the
        trials."""
        ok, steps_ok = self._fit(steps, reserve)
        if not ok:
            self.budget_hit = True
            self.limit_hit = self.limit_hit or ("time" if steps_ok else "step")
        return ok

    def _fits(self, steps: int, reserve: Work | None = None) -> bool:
        """:meth:`_can_afford` without recording a budget hit: will the next such trial run?"""
        return self._fit(steps, reserve)[0]

    def _fit(self, steps: int, reserve: Work | None) -> tuple[bool, bool]:
        need = Work(steps + self.opt.warmup_steps, 1) + (reserve or Work()) + Work(0, 1)
        steps_ok = need.steps <= self.opt.steps_left(self.steps_run)
        return steps_ok and self.elapsed_s + self._seconds(need) <= self.opt.max_seconds, steps_ok

    def _raise_hint(self) -> str:
        """What to raise when the budget stopped the search: the bound that ran out."""
        return "raise the step limit" if self.limit_hit == "step" else "raise the time budget"

    def _seconds(self, w: Work) -> float:
        step_s, switch_s, continuing_s = self._rates()
        return w.steps * step_s + w.switches * switch_s + w.continuing * continuing_s

    def _rates(self) -> tuple[float, float, float]:
        """Seconds per step, per trial that switches config and per trial that continues one (beyond its steps),
        from the agreed clock: a trial spends its steps at their measured time (their GPU time, or their wall time
        where trials of two lengths show more: :func:`wall_per_step`), and a switch (re-init, sync, the idle GPU
        after it) plus the search's own work between trials. Priced at screening's seconds per step
        instead (its 3-step trials each switch), the final decision (half of its trials continue a config) cost
        twice its real time and the budget ended the search early on real H200 steps of 75 ms."""
        key = ("rates", len(self._spent), self.elapsed_s, self.steps_run)
        if key not in self._cache:
            self._cache[key] = self._measured_rates()
        return self._cache[key]

    def _measured_rates(self) -> tuple[float, float, float]:
        tally = self._cache.setdefault(("rate_tally",), RateTally())
        for i in range(tally.done, len(self._spent)):
            tally.add(i, *self._spent[i])
        if not tally.ms:
            per_step = self.elapsed_s / self.steps_run if self.steps_run else 0.0
            return per_step, 0.0, 0.0
        step_s = sorted_median(tally.ms) / 1000  # a failed trial (ms 0) has its seconds
        # a step can cost more wall time than its GPU time (the host's part of a step: Qwen3-MoE-like steps on one
        # H100); switching trials of different lengths tell it: their seconds' slope in the steps
        step_s = max(step_s, slope_of(tally.by_len) or 0.0)
        # the first trial's switch also holds one-off costs (on 2 H200s in Megatron: 5.7 s against 0.6 s later; 4.9 s
        # in engine_tune): it prices no switch. Until a later switch is measured a switch is priced at nothing, so the
        # next trial (which switches) measures it: priced at the first trial's, 4 switches of screening's reserve took
        # a 20-30 s budget and the search stopped after 2 trials (2 H200s, 2026-11-24); at most one trial beyond
        switch_s = tally.rest_mean(True, step_s)
        # a continuing trial, before any ran: the search's own work between trials, at most a switch trial's
        outside = [max(0.0, sec - wall) for sec, wall in self._outside]
        continuing_s = (
            tally.rest_mean(False, step_s) if tally.rest[False] else min(switch_s, statistics.fmean(outside or [0.0]))
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

    def _note_cut_short(
        self,
        n_options: int,
        unscreened: int,
        samples: dict[Option, list[float]],
        race: Race,
        rechecks: list,
        missed: int,
    ) -> None:
        """Says what the budget left out of what it must not: every option screened, the best-screened of each GEMM
        re-measured, each leader re-checked (the rest of the racing is what the budget allows)."""
        firsts = {
            min((x for x in samples if x.gemm == g), key=lambda x: statistics.median(samples[x]))
            for g in {x.gemm for x in samples}
        }
        missed += sum(x not in race.raw for x in firsts)
        if not (unscreened or missed):
            return
        per_trial = statistics.fmean(sec for *_, sec, _ in self._spent[1:] or self._spent) if self._spent else 0.0
        self.cut_short = (
            f"the budget ran out during the search: {n_options - unscreened} of {n_options} options "
            f"screened, {len(firsts) + len(rechecks) - missed} of {len(firsts) + len(rechecks)} re-measured"
            + (
                f" (at {per_trial:.2f} s per trial the whole search needs about "
                f"{self.planned_trials * per_trial:.0f} s: {self._raise_hint()}, or shorten the trial steps)"
                if per_trial > 0
                else ""
            )
        )


class RateTally:
    """The trials as :meth:`Budget._measured_rates` reads them, each added once (the rates are asked for again after
    every trial, and reading every trial each time cost about 5% of a simulated search's CPU): the timed trials' step
    ms in order, the switching ones' seconds per length, and each kind's (steps, seconds) after the first trial."""

    def __init__(self) -> None:
        self.done = 0
        self.ms: list[float] = []  # sorted: every timed trial's median step ms (> 0)
        self.by_len: dict[int, list[float]] = {}  # switching trials after the first, with step ms: steps -> seconds
        self.rest: dict[bool, list[tuple[int, float]]] = {True: [], False: []}  # after the first: (steps, seconds)
        self._means: dict[bool, tuple[float, int, float]] = {}  # per kind: (step s, trials, mean) of the last asked

    def add(self, i: int, steps: int, switched: bool, sec: float, ms: float) -> None:
        self.done = i + 1
        if sec <= 0:  # not timed
            return
        if ms > 0:
            bisect.insort(self.ms, ms)
            if switched and i > 0:
                self.by_len.setdefault(steps, []).append(sec)
        if i > 0:
            self.rest[switched].append((steps, sec))

    def rest_mean(self, switched: bool, step_s: float) -> float:
        """The mean seconds beyond ``step_s`` per step of the trials of that kind (0 without any)."""
        rows = self.rest[switched]
        got = self._means.get(switched)
        if got is None or got[:2] != (step_s, len(rows)):
            got = step_s, len(rows), statistics.mean([max(0.0, sec - n * step_s) for n, sec in rows] or [0.0])
            self._means[switched] = got
        return got[2]


def sorted_median(v: list[float]) -> float:
    """``statistics.median`` of ``v``, already sorted."""
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


def wall_per_step(trials: list[tuple[int, float]]) -> float | None:
    """Seconds per step from ``trials`` [(steps, seconds)] that all switch config: the least-squares slope through
    each length's median seconds (a trial held up by a GC or the host moves its length's median, not the slope);
    None unless two lengths have two trials each."""
    by_len: dict[int, list[float]] = {}
    for n, sec in trials:
        by_len.setdefault(n, []).append(sec)
    return slope_of(by_len)


def slope_of(by_len: dict[int, list[float]]) -> float | None:
    """:func:`wall_per_step` of its trials' seconds per length."""
    pts = [(n, statistics.median(v)) for n, v in by_len.items() if len(v) >= 2]
    if len(pts) < 2:
        return None
    mn = statistics.fmean(n for n, _ in pts)
    ms = statistics.fmean(sec for _, sec in pts)
    return sum((n - mn) * (sec - ms) for n, sec in pts) / sum((n - mn) ** 2 for n, _ in pts)
