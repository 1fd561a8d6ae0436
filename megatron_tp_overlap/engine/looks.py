"""Fresh looks at each GEMM's leader after the racing (a mixin of :class:`~engine.search.Searcher`).

Only fresh samples accept a leader, so that the luckiest of many raced estimates (the winner's curse) does not. The
first look always runs; a second and a third, kept in the budget, only while a leader is inconclusive; later ones (up
to ``SearchOptions.max_looks``) take what the budget has left once the final decision and what precedes it are kept,
and only for a leader ahead (at least ``later_look_least`` of the way to the noise; 0 by default: any share) and by a
quarter of a gain worth a switch, one the racing put ahead beyond the noise while fewer than three of its looks count,
or one whose interval still reaches a gain worth a switch (``later_reach``). A leader's standard error from its looks
is at least their own spread (``look_spread``). A GEMM with no looked-at option accepted then gives fresh looks to
its best raced runners-up with what the budget has left (``runners_up``). Once a choice is accepted, a leader ahead
within the noise can go along with it (``ride_along_z``; off by default). Every choice still goes through the final
decision.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING

from megatron_tp_overlap.engine.space import Option, TuningConfig
from megatron_tp_overlap.engine.trial import Work

if TYPE_CHECKING:
    from megatron_tp_overlap.engine.racing import Race, Raw

RECHECKS = 3  # fresh looks at a GEMM's leader kept in the budget (the 2nd and 3rd only while inconclusive)


class Looks:
    """The fresh looks at the leaders, their threshold and what they and later phases keep of the budget (mixin)."""

    def _looks_of(self, incumbent: TuningConfig, options: list[Option], raw: Raw, reserve: Callable[[], Work]) -> int:
        """One call of fresh looks at ``options`` (``Searcher._measure_options`` at ``recheck_steps``, a bracket
        closing it): how many the budget left untried. (The looks' lead over their brackets on real FP8 steps, which
        ordering a call's trials four ways did not take out, was the frame stack's: engine/frames.py.)"""
        return self._measure_options("recheck", incumbent, options, self.opt.recheck_steps, raw, reserve)

    def _look(
        self,
        incumbent: TuningConfig,
        race: Race,
        leaders: dict[str, tuple[Option, float, float]],
        decision_cost: Callable[[], Work],
        contenders: int,
    ) -> tuple[list[Option], Raw, int]:
        """Each GEMM's leader with a gain re-measured afresh: (the leaders re-checked, option -> its fresh
        [(trial, per-step score)], how many trials the budget left out of the looks it keeps)."""
        o = self.opt
        # a leader picked among several re-measured options is re-checked afresh; one re-measured alone (what the
        # budget allowed) was picked by screening, and its own samples are fresh
        raced = {g: sum(x.gemm == g for x in race.raw) for g in leaders}
        survivors = [opt for opt, gain, _ in leaders.values() if gain > 0 and raced[opt.gemm] > 1]
        raw_fresh = {opt: race.raw[opt] for opt, gain, _ in leaders.values() if gain > 0 and raced[opt.gemm] == 1}
        unhalved = self._looks_of(incumbent, survivors, raw_fresh, decision_cost)
        # a leader the re-check found ahead but within the noise is re-checked once more, and all its fresh samples
        # decide: 8 steps cannot tell 2.5% of a 6 ms slot at 2% noise (decision_sim iid seed 43 left 22% of its gain);
        # a third time where the racing rounds put it beyond the noise (locked seed 43: 0.127 +- 0.034 ms raced, 0.07
        # in 16 fresh steps against 0.086 needed, for a true 0.148); with the trials' own level counted
        # (``trial_noise``), a second where the racing put it beyond the noise but one fresh trial behind, within it or
        # beyond (real Command-R-like steps: fc1_dgrad, truly 0.23 ms faster, measured 0.18 ms slower and was left; a
        # trial at a slow moment reads a leader far behind: decision_sim burst seed 130), and a
        # third where its slots have a trial level (few fresh trials cannot tell then: decision_sim trial seed 149, a
        # true 0.144 ms measured 0.164 against 0.181 in two; a third look everywhere named a hostbound false winner)
        beyond = {x: self._beyond_noise(incumbent, x, race.raw.get(x, [])) for x in survivors}
        for look in range(2, min(RECHECKS, o.max_looks) + 1):
            again = [
                x
                for x in survivors
                if x in raw_fresh
                and self._inconclusive(incumbent, x, raw_fresh[x], beyond[x] and o.trial_noise)
                and (look == 2 or beyond[x] or o.trial_noise and self._opt_tau(incumbent, x) > 0)
            ]
            unhalved += self._looks_of(incumbent, again, raw_fresh, decision_cost)
        # what the budget has left (the later phases kept) goes to leaders still ahead within the noise, at least
        # ``later_look_least`` of the way to it, up to ``max_looks`` looks (real Command-R-like steps: 17104's
        # fc1_wgrad, 0.36 ms in its fourth)
        hit, kept = (self.budget_hit, self.limit_hit), lambda: self._kept(decision_cost(), contenders, 0)
        switch = self._worth(incumbent)
        worth = switch / 4  # a quarter of a gain worth a switch: not 0.02 ms of 100

        def short(x: Option) -> bool:  # raced beyond the noise, with fewer than RECHECKS looks that count (one whose
            # incumbent jumped around it is left out: decision_sim burst seed 192's third, so -1.37 and +0.75 decided)
            return (
                beyond[x] and bool(o.trial_noise) and len(self._relative_trials(incumbent, x, raw_fresh[x])) < RECHECKS
            )

        def later(x: Option) -> bool:  # a short leader looks again, whatever its looks' gain (decision_sim burst seed
            # 29: the one look that counted caught a burst, 0.02 of a raced 0.84 ms, and the quarter gate held it back);
            # so does one whose interval still reaches a gain worth a switch (``later_reach``)
            s, e = short(x), raw_fresh[x]
            return (
                self._inconclusive(incumbent, x, e, s, 0 if s else o.later_look_least, 0 if s else worth)
                or bool(o.later_reach)
                and self._reaches(incumbent, x, e, switch)
            )

        for _ in range(RECHECKS, o.max_looks):
            again = [x for x in survivors if x in raw_fresh and later(x)]
            if not again or self._looks_of(incumbent, again, raw_fresh, kept):
                break
        self.budget_hit, self.limit_hit = hit  # these looks end at the reserve by design
        return survivors, raw_fresh, unhalved

    def _runners_up(
        self,
        incumbent: TuningConfig,
        race: Race,
        raw_fresh: Raw,
        accepted: dict[str, Option],
        decision_cost: Callable[[], Work],
        contenders: int,
    ) -> tuple[list[Option], dict[str, tuple[dict, tuple[Option, float]]]]:
        """Fresh looks at the runners-up of each GEMM with no choice ``accepted`` yet, with what the budget has left once
        the final decision and what precedes it are kept: at most ``runners_up`` per GEMM, the best raced first and
        only while its raced interval reaches a gain worth a switch. In a noisy forward the luckiest of many equal
        options can lead the racing (decision_sim hostglm seed 149: a true 0.316 ms ``proj_fprop`` raced 4th of 20, at
        24 samples each; real GLM-4-9B-like FP8 steps: 22420, 22424, 22440). A runner-up looks until accepted (its
        threshold is that of a later look: ``late_z`` more, since it is one more test), until its interval no longer
        reaches a gain worth a switch, or ``max_looks``; then the GEMM's next. The GEMMs run side by side. Returns the
        runners-up looked at, and per GEMM the accepted one's choice (``Searcher._choose``, judged as it was
        accepted). ``accepted``: GEMM -> its choice accepted so far; with ``rebase_runners_up`` the looks are against
        the incumbent with these in (a host-bound slot can show more of a delay where other slots run faster)."""
        o, worth = self.opt, self._worth(incumbent)
        bounds = {x: b for x, e in race.raw.items() if (b := self._gain_bounds(incumbent, x, e))}
        queue: dict[str, list[Option]] = {}
        for gemm in dict.fromkeys(x.gemm for x in bounds):
            if gemm in accepted:
                continue
            mine = [
                x
                for x in bounds
                if x.gemm == gemm and x not in raw_fresh and bounds[x][0] + o.z * bounds[x][1] >= worth
            ]
            queue[gemm] = sorted(mine, key=lambda x: -bounds[x][0])[: o.runners_up]
        against = self._combine(incumbent, list(accepted.items()))[0] if o.rebase_runners_up else incumbent
        runners: list[Option] = []
        took: dict[str, tuple[dict, tuple[Option, float]]] = {}
        hit, kept = (self.budget_hit, self.limit_hit), lambda: self._kept(decision_cost(), contenders, 0)
        if against != incumbent and queue and self._can_afford(o.recheck_steps, kept()):
            self._run("bracket", against, {"*": "incumbent"}, o.recheck_steps)  # the new incumbent's first level
        turn = dict.fromkeys(queue, 0)
        while True:
            batch = []
            for gemm in list(queue):
                for x in [x for x in queue[gemm] if x in runners]:  # those looked at so far
                    e = raw_fresh.get(x, [])  # none where its trials failed
                    if e and self._accepts(against, x, e):
                        choice, best = self._choose(against, runners, {x: e})
                        took[gemm] = choice[gemm], best[gemm]
                        del queue[gemm]  # this GEMM has its choice
                        break
                    if not (e and len(e) < o.max_looks and self._reaches(against, x, e, worth)):
                        queue[gemm].remove(x)  # it looks no more
                else:
                    if not queue[gemm]:
                        del queue[gemm]
                        continue
                    # the first in line looks until it is done, or (``runners_up_in_turn``) each looks in turn
                    x = queue[gemm][turn[gemm] % len(queue[gemm]) if o.runners_up_in_turn else 0]
                    turn[gemm] += 1
                    if x not in runners:
                        self.runners.add(x)
                        runners.append(x)
                    batch.append(x)
            if not batch or self._looks_of(against, batch, raw_fresh, kept):
                break
        self.budget_hit, self.limit_hit = hit  # these looks end at the reserve by design
        if runners:
            self.log(
                f"[tp-overlap-autotune] {len(runners)} runners-up of {len({x.gemm for x in runners})} GEMMs whose "
                f"leaders were not accepted had fresh looks"
                + (
                    f" (against the reference with {len(accepted)} accepted choice(s) in)"
                    if against != incumbent
                    else ""
                )
                + f", to {self.elapsed_s:.1f} s: "
                + (", ".join(f"{g}: {c['option']} accepted" for g, (c, _) in took.items()) or "none accepted")
            )
        return runners, took

    def _ride_along(
        self,
        incumbent: TuningConfig,
        choices: dict[str, dict],
        best_of: dict[str, tuple[Option, float]],
        raw_fresh: Raw,
    ) -> list[str]:
        """Once a choice is accepted, each GEMM whose looked-at best is ahead of the incumbent by ``ride_along_z``
        standard errors of its looks and by a quarter of a gain worth a switch, but under its threshold, is accepted
        with it (``rides_along``): the config changes anyway, and a part too small to pay for a switch alone can still
        add to one. Only fresh looks count (not the racing's luckiest estimate), and the final decision tests the whole
        config. Returns those GEMMs."""
        z = self.opt.ride_along_z
        if not z or not any(c["accepted"] for c in choices.values()):
            return []
        riders, least = {}, self._worth(incumbent) / 4  # a quarter of a gain worth a switch: not 0.02 ms of 100
        for g, c in choices.items():
            x = best_of[g][0]
            b = None if c["accepted"] or x not in raw_fresh else self._look_bounds(incumbent, x, raw_fresh[x])
            if b and b[0] > max(z * b[1], least) and b[1] > 0:  # 0: one look, one sample (no spread to tell by)
                riders[g] = f"+{b[0]:.3f} ms, {b[0] / b[1]:.1f} standard errors"  # as its looks and the rest end
                c.update(accepted=True, rides_along=True, note=f"ahead within the noise ({riders[g]})")
        if riders:
            self.log(
                f"[tp-overlap-autotune] {len(riders)} GEMM(s) ahead within the noise go along with the accepted "
                "choices: " + ", ".join(f"{g} ({r})" for g, r in riders.items())
            )
        return list(riders)

    def _accepts(self, incumbent: TuningConfig, opt: Option, entries: list) -> bool:
        """Whether fresh ``entries`` accept ``opt``: its gain beyond :meth:`_threshold` after that many looks."""
        g, se, _ = self._look_bounds(incumbent, opt, entries) or (0.0, 0.0, 0)
        return g > self._threshold(incumbent, opt, se, len(entries))

    def _kept(self, decision: Work, contenders: int, rechecks: int) -> Work:
        """What later phases keep of the budget: the final decision (``decision``; nothing while not priced yet), the
        numerics check, the selection round's runoff and ``rechecks`` fresh looks at the leaders."""
        if decision == Work():
            return Work()
        o, b = self.opt, self.block_steps
        runoff = (o.select_passes - 1) * (min(o.runoff, contenders) + 1)
        w = decision + Work(runoff * (b + o.warmup_steps), runoff)
        w = w + (Work(2 * (1 + o.warmup_steps), 2) if self.verify else Work())
        for _ in range(rechecks):
            w = w + self.recheck_work()
        return w

    def _inconclusive(
        self,
        incumbent: TuningConfig,
        opt: Option,
        entries: list,
        raced: bool = False,
        least: float = 0.0,
        above: float = 0.0,
    ) -> bool:
        """Whether ``entries`` put ``opt`` ahead of the incumbent (by at least ``least`` of the noise and ``above``
        ms) but not beyond the noise (:meth:`_threshold`), or behind at all where ``raced`` (the racing put it
        beyond the noise; one trial can share a slow level, or catch a burst of slow steps)."""
        g, se, _ = self._look_bounds(incumbent, opt, entries) or (0.0, 0.0, 0)
        thr = self._threshold(incumbent, opt, se, len(entries))
        return max(0.0, least * thr, above) < g <= thr or raced and g <= 0

    def _reaches(self, incumbent: TuningConfig, opt: Option, entries: list, worth: float) -> bool:
        """Whether ``entries`` leave ``opt`` not accepted (:meth:`_threshold`) while its gain + z standard errors
        still reaches ``worth`` ms (a gain worth a switch): what is left could still pay."""
        g, se, _ = self._look_bounds(incumbent, opt, entries) or (0.0, 0.0, 0)
        return g <= self._threshold(incumbent, opt, se, len(entries)) and g + self.opt.z * se >= worth

    def _look_bounds(self, incumbent: TuningConfig, opt: Option, entries: list) -> tuple[float, float, int] | None:
        """:meth:`_gain_bounds` of a leader's fresh looks, with a standard error at least their own spread (the sd
        of the per-look gains over sqrt(looks), from two looks on; ``look_spread``)."""
        b = self._gain_bounds(incumbent, opt, entries)
        if b is None or not self.opt.look_spread:
            return b
        per = [-statistics.median(d) for d, _ in self._relative_trials(incumbent, opt, entries) if d]
        return b if len(per) < 2 else (b[0], max(b[1], statistics.stdev(per) / math.sqrt(len(per))), b[2])

    def _beyond_noise(self, incumbent: TuningConfig, opt: Option, entries: list) -> bool:
        b = self._gain_bounds(incumbent, opt, entries) if entries else None
        return b is not None and b[0] - self.opt.z * b[1] > 0

    def _threshold(self, incumbent: TuningConfig, opt: Option, se: float, looks: int = 1) -> float:
        """The gain a re-checked leader must beat after ``looks`` fresh looks: z standard errors (``late_z`` more from
        the fourth look on, and for a runner-up), and a gain worth a switch."""
        z = self.opt.z + (self.opt.late_z if looks > RECHECKS or opt in self.runners else 0.0)
        return max(z * se, self.opt.rel_floor * self._incumbent_level(incumbent, opt))

    def recheck_work(self) -> Work:
        """The fresh re-measurement of each GEMM's leader: a leading bracket, a trial per GEMM of the fullest
        slot, and their brackets."""
        if ("recheck_work",) not in self._cache:
            self._cache[("recheck_work",)] = self._recheck_work()
        return self._cache[("recheck_work",)]

    def _recheck_work(self) -> Work:
        per_slot = max((len(g) for g in self.topo.slots().values()), default=1)
        trials = 1 + per_slot + math.ceil(per_slot / self.opt.bracket_every)
        return Work(trials * (self.opt.recheck_steps + self.opt.warmup_steps), trials)
