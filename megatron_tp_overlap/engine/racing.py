"""Racing: after screening, the rest of the budget goes where gain can still be found. A mixin of
:class:`~engine.search.Searcher` (its trial runner, budget and per-option scoring).

One screened step per option ranks but cannot rule out: a slow step (a GC, the power limit's clocks) hides a
gain of a few % of a GEMM, and on 200 simulated seeds the old search (the best screened option per GEMM re-measured
once) left up to 89% of the available gain behind while two thirds of its budget went unused (issue 46). So every
option is re-measured in rounds of ``halving_steps``-step trials (the most promising first, the best-screened of
each GEMM before the rest), and after each round an option is *settled* when its optimistic gain (estimate + z
standard errors) cannot beat the incumbent or the leader of its GEMM; the unsettled run again. The rounds end at the
budget, when every option left has ``race_samples`` samples (equal options never separate), or early: when what the
unsettled options could still add, summed over GEMMs, is below a gain worth a switch (``rel_floor`` of the step).
Each GEMM's leader is then re-measured afresh (engine/looks.py) and only fresh samples accept it, so that the
luckiest of many estimates (the winner's curse) does not decide; the final ABBA decision still guards the result.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from megatron_tp_overlap.engine import brackets, rest_scaling, stats, trial_effect
from megatron_tp_overlap.engine.looks import RECHECKS
from megatron_tp_overlap.engine.space import Option, TuningConfig
from megatron_tp_overlap.engine.trial import Trial, Work

Raw = dict[Option, list[tuple[Trial, list[float]]]]
# a slot's own step spread (the report's) once it has this many step differences; fewer: the pooled one
MIN_SLOT_PAIRS = 40


@dataclass
class Race:
    """What the racing rounds know and left: per option its relative samples (ms, negative: faster than the
    incumbent), and the options still unsettled when the rounds ended."""

    screened: dict[Option, list[float]]
    raw: Raw = field(default_factory=dict)  # option -> [(trial, per-step score)] of the racing rounds
    rounds: int = 0
    # the options still open, in the search's order (a dict, not a set: a set's order follows string hashes, which
    # differ between processes, and every rank must pack the same trials)
    unsettled: dict[Option, None] = field(default_factory=dict)
    upside_ms: float = math.inf  # what the unsettled could still add over the leaders, summed over GEMMs
    ended: str = ""  # why the rounds ended, in one line


class Racing(rest_scaling.RestScaling):
    """The racing rounds and the per-slot account of what was tried and left (mixin); each option is scored against
    the incumbent at the same moment."""

    def _incumbent_trials(self, incumbent: TuningConfig, steps: int | None = None) -> list[Trial]:
        """The incumbent's own trials; ``steps``: those of that many measured steps when there are any (compared at
        the same positions after a switch: a 1-step screening bracket that caught a slow step biased every 4-step
        option after it by that step)."""
        key = (incumbent, steps, len(self.trials))
        if key not in self._cache:
            inc = [
                t for t in self.trials if t.phase in ("baseline", "bracket") and not t.error and t.config == incumbent
            ]
            same = [t for t in inc if len(t.step_samples) == steps]
            self._cache[key] = same or inc
        return self._cache[key]

    def _relative(self, incumbent: TuningConfig, opt: Option, entries: list[tuple[Trial, list[float]]]) -> list[float]:
        """Per-step ms of ``opt``'s slots minus the incumbent's at the same moment (interpolated between the
        incumbent trials around it): negative is faster; drift between trials cancels."""
        return [v for diffs, _ in self._relative_trials(incumbent, opt, entries) for v in diffs]

    def _relative_trials(
        self, incumbent: TuningConfig, opt: Option, entries: list[tuple[Trial, list[float]]]
    ) -> list[tuple[list[float], float]]:
        """Per trial of ``entries``: its relative samples (:meth:`_relative`) and the variance of the incumbent's
        interpolated level there, in units of one sample's: ``w^2 / n0 + (1 - w)^2 / n1`` for the weights and sample
        counts of the incumbent trials on either side (a trial right after a bracket leans on that bracket alone)."""
        # the same entries at the same trials give the same result (the racing and the looks ask again and again);
        # the entries are kept with it, so that no id in the key can be reused while it is cached
        key = ("relative", incumbent, self._slots_of(opt), tuple(id(x) for e in entries for x in e), len(self.trials))
        if key not in self._cache:
            self._cache[key] = self._relative_trials_now(incumbent, opt, entries), list(entries)
        return self._cache[key][0]

    def _relative_trials_now(
        self, incumbent: TuningConfig, opt: Option, entries: list[tuple[Trial, list[float]]]
    ) -> list[tuple[list[float], float]]:
        slots, out, norm, tau = self._slots_of(opt), [], self._rest_norm(incumbent), self._opt_tau(incumbent, opt)
        tracks: dict[int, tuple] = {}  # per step count: the shared cache is looked up once per call, not per trial
        jump = brackets.jump_for(tau * self.opt.trial_noise, self._incumbent_level(incumbent, opt))
        level = lambda x: statistics.median(v) if (v := self._score(self._scaled(x, norm), slots)) else None  # noqa: E731
        for t, score in entries:
            n = len(t.step_samples)
            if n not in tracks:
                key = ("track", incumbent, slots, n, len(self.trials))
                if key not in self._cache:
                    inc = self._incumbent_trials(incumbent, n)
                    pts = sorted((x.position, v, len(x.step_samples)) for x in inc if (v := level(x)) is not None)
                    self._cache[key] = (self._track(inc, level), pts, [p for p, _, _ in pts])
                tracks[n] = self._cache[key]
            track, pts, pos = tracks[n]
            if n > 1 and brackets.jumped(pts, pos, t.position, jump):
                continue  # the incumbent changed suddenly around this trial: what it did at that moment is unknown
            if norm:
                score = self._score(self._scaled(t, norm), slots) or score
            ref = track(t.position)
            if not math.isnan(ref):
                out.append(([v - ref for v in score], brackets.ref_var(pts, pos, t.position)))
        return out

    def _incumbent_level(self, incumbent: TuningConfig, opt: Option) -> float:  # its slots' median ms (cached)
        if (key := ("inc_level", incumbent, self._slots_of(opt), len(self.trials))) not in self._cache:
            got = (self._score(self._scaled(t, None), key[2]) for t in self._incumbent_trials(incumbent))
            vals = [v for x in got for v in (x or [])]
            self._cache[key] = statistics.median(vals) if vals else 0.0
        return self._cache[key]

    def _opt_sigma(self, incumbent: TuningConfig, opt: Option) -> float:
        """One step's spread of ``opt``'s slots (ms): each slot's :meth:`_se_sigma` times its level under the
        incumbent, slots independent."""
        key = ("opt_sigma", incumbent, self._slots_of(opt), len(self.trials))
        if key not in self._cache:
            sig = (self._se_sigma(incumbent, s) * self._slot_level(incumbent, s) for s in self._slots_of(opt))
            self._cache[key] = math.sqrt(sum(v * v for v in sig))
        return self._cache[key]

    def _se_sigma(self, incumbent: TuningConfig, slot: str) -> float:
        """The relative spread of one step that the standard errors give ``slot`` (the report's ``se_spread_pct``):
        the pooled one; with ``slot_spread``, at least the slot's own where no trial level counts for it (one fitted
        on the pooled spread takes in a noisier slot's excess) and no floor caps its steps."""
        pooled, o = self._sigma(), self.opt
        if not o.slot_spread or slot in self._floor_tops() or o.trial_noise and self._taus(incumbent).get(slot):
            return pooled
        return max(pooled, self._sigma(slot))

    def _opt_tau(self, incumbent: TuningConfig, opt: Option) -> float:
        """A trial's shared level spread of ``opt``'s slots (ms): each slot's ``tau`` (engine/trial_effect.py, over
        the trials of every incumbent so far) times its level under the incumbent, slots independent."""
        key = ("opt_tau", incumbent, self._slots_of(opt), len(self.trials))
        if key not in self._cache:
            taus, slots = self._taus(incumbent), self._slots_of(opt)
            self._cache[key] = math.sqrt(sum((taus.get(s, 0.0) * self._slot_level(incumbent, s)) ** 2 for s in slots))
        return self._cache[key]

    def _taus(self, incumbent: TuningConfig) -> dict[str, float]:
        """Per slot, the relative trial level (:func:`trial_effect.slot_taus`) over every incumbent's own trials."""
        key = ("taus", incumbent, len(self.trials))
        if key not in self._cache:
            norm, groups = self._rest_norm(incumbent), trial_effect.incumbent_runs(self.trials)
            # the differences change only with the groups' trials and the scaling (most new trials are racing's)
            at = (sum(map(len, groups)), norm and (norm[0], tuple(norm[1].items())), self._floor_tops_keyed()[1])
            if ("tau_diffs", at) not in self._cache:  # the last ones only (one asked for again is made again)
                self._cache.pop(self._cache.get(("tau_diffs_now",)), None)
                self._cache[("tau_diffs", at)] = trial_effect.slot_diffs(groups, lambda t: self._scaled(t, norm))
                self._cache[("tau_diffs_now",)] = ("tau_diffs", at)
            diffs = self._cache[("tau_diffs", at)]
            self._cache[key] = trial_effect.taus_of(diffs, self._sigma(), self.opt.trial_own_diffs)
        return self._cache[key]

    def _slot_level(self, incumbent: TuningConfig, slot: str) -> float:
        key = ("slot_level", incumbent, slot, len(self.trials))
        if key not in self._cache:
            vals = [v for t in self._incumbent_trials(incumbent) for v in self._scaled(t, None).get(slot, [])]
            self._cache[key] = statistics.median(vals) if vals else 0.0
        return self._cache[key]

    def _gain_bounds(
        self, incumbent: TuningConfig, opt: Option, entries: list[tuple[Trial, list[float]]]
    ) -> tuple[float, float, int] | None:
        """(gain estimate, its standard error, samples) from ``entries``; gain in ms, positive: faster. The estimate
        is the median of all relative samples (variance pi/2 of a mean's), each trial's shifted by the incumbent's
        interpolated level there (its variance weighted by the trial's share of the samples). With 3 trials or more,
        one whose median is over 4 standard errors slower than the median trial's is set aside: a burst of slow steps
        (one-sided; decision_sim burst seed 79: 3 of 5 trials, and the median of all samples put a 0.41 ms gain
        behind)."""
        per = self._relative_trials(incumbent, opt, entries)
        sig, tau = self._opt_sigma(incumbent, opt), self._opt_tau(incumbent, opt)
        if len(per) >= 3:  # a trial far slower than the option's others caught a burst of slow steps
            per = [x for x, far in zip(per, trial_effect.far_slower([d for d, _ in per], sig, tau)) if not far]
        rel = [v for diffs, _ in per for v in diffs]
        if not rel:
            return None
        n = len(rel)
        var = 1 / n + sum((len(d) / n) ** 2 * vr for d, vr in per)
        se2 = sig**2 * math.pi / 2 * var
        if self.opt.trial_noise:  # what each trial's steps share (engine/trial_effect.py)
            se2 += tau**2 * trial_effect.trial_weight((len(d), n, vr) for d, vr in per)
        return -statistics.median(rel), math.sqrt(se2), n

    def _split(self, incumbent: TuningConfig, opt: Option, race: Race) -> float | None:
        """:func:`trial_effect.split_gain` of ``opt``'s two counted racing trials, or of its one and its screening."""
        per = [d for d, _ in self._relative_trials(incumbent, opt, race.raw[opt])]
        per += [race.screened[opt]] if len(per) == 1 and race.screened.get(opt) else []
        return trial_effect.split_gain(per, self._opt_sigma(incumbent, opt), self._opt_tau(incumbent, opt))

    def _settle(self, incumbent: TuningConfig, race: Race) -> dict[str, tuple[Option, float, float]]:
        """Settles what the samples rule out; returns per GEMM its leader (option, gain, se). An option is settled
        when its gain + z se cannot beat the incumbent nor the leader's gain - z se; the leader, when nothing else
        of its GEMM is unsettled and it is beyond the noise either way. Only a re-measured option settles: one
        screened step, at one moment, can be a slow one; so can one racing trial, and an option its screening put
        ahead beyond the noise is ruled out only by ``settle_trials`` of them, and one whose two trials (or one and its
        screening) differ beyond the noise (:meth:`_split`) by a third."""
        z, worth = self.opt.z, self._worth(incumbent)
        bounds = {o: b for o, e in race.raw.items() if (b := self._gain_bounds(incumbent, o, e))}
        leaders: dict[str, tuple[Option, float, float]] = {}
        for o, (g, se, _) in bounds.items():
            if o.gemm not in leaders or g > leaders[o.gemm][1]:
                leaders[o.gemm] = (o, g, se)
        upside: dict[str, float] = {}

        def screened(o: Option) -> tuple[float, float]:  # its gain from its screened step, and z of that's errors
            s = race.screened.get(o)
            return (-statistics.median(s), z * self._opt_sigma(incumbent, o) * 2**0.5) if s else (math.inf, 0.0)

        split = {o: b for o in race.unsettled if o in bounds and (b := self._split(incumbent, o, race))}

        def doubted(o: Option) -> bool:  # screened ahead beyond the noise, raced < ``settle_trials`` times; or split
            g, e = screened(o)
            return g - e > 0 and len(race.raw.get(o, ())) < self.opt.settle_trials or o in split

        for o in list(race.unsettled):
            lead = leaders.get(o.gemm)
            if o not in bounds:
                ucb = sum(screened(o))
            else:
                g, se, n = bounds[o]
                ucb = g + z * se
                floor = 0.0 if lead is None or lead[0] == o else lead[1] - z * lead[2]
                wide = lead is not None and lead[0] == o and z * se > worth  # a leader that cannot tell yet
                cap = self.opt.wide_leader_samples if wide else self.opt.race_samples
                if n >= cap or ucb <= max(0.0, floor) and not doubted(o):
                    race.unsettled.pop(o, None)
                    continue
                if doubted(o):  # one trial at one moment cannot rule out what the screening saw beyond its noise
                    ucb = max(ucb, sum(screened(o)), split.get(o, -math.inf) + z * se)
            held = max(0.0, lead[1]) if lead else 0.0
            upside[o.gemm] = max(upside.get(o.gemm, 0.0), ucb - held)
        for gemm, (o, g, se) in leaders.items():  # a leader alone, beyond the noise either way, is settled
            alone = not any(x.gemm == gemm and x != o for x in race.unsettled)
            behind = g + z * se <= 0 and not doubted(o)
            if o in race.unsettled and alone and (g - z * se > 0 or behind):
                race.unsettled.pop(o, None)
                upside.pop(gemm, None)
        race.upside_ms = sum(upside.values())
        return leaders

    def _race(
        self,
        incumbent: TuningConfig,
        options: list[Option],
        screened: dict[Option, list[float]],
        decision: Callable[[], Work],
        contenders: int,
    ) -> Race:
        """The racing rounds. The best-screened ``keep`` of each GEMM are re-measured first, keeping only the final
        decision in reserve, as the search before racing did; every further measurement also keeps the numerics
        check, the leaders' re-check and the selection round's runoff in reserve."""
        o = self.opt
        race = Race(screened, unsettled=dict.fromkeys(x for x in options if x in screened))
        rank = {}
        for gemm in dict.fromkeys(x.gemm for x in race.unsettled):
            mine = sorted((x for x in race.unsettled if x.gemm == gemm), key=lambda x: statistics.median(screened[x]))
            rank.update({x: i for i, x in enumerate(mine)})

        def full() -> Work:
            return self._kept(decision(), contenders, RECHECKS)

        first = [x for x in race.unsettled if rank[x] < o.keep]
        untried = self._measure_options(
            "halving", incumbent, sorted(first, key=rank.get), o.halving_steps, race.raw, decision
        )
        worth = self._worth(incumbent)
        while not untried and race.unsettled:
            self._settle(incumbent, race)
            if race.upside_ms < worth:
                break
            # later the least measured first (the best-screened among equals)
            measured = lambda x: sum(len(s) for _, s in race.raw.get(x, []))  # noqa: E731
            queue = sorted(race.unsettled, key=lambda x: (measured(x), statistics.median(screened[x])))
            # these rounds end at the reserve by design (race.ended says so): the budget has not cut the search short
            hit = self.budget_hit, self.limit_hit
            untried = self._measure_options("halving", incumbent, queue, o.halving_steps, race.raw, full, o.fill_slots)
            self.budget_hit, self.limit_hit = hit
            race.rounds += 1
        self._settle(incumbent, race)
        if (untried or (race.unsettled and race.upside_ms >= worth)) and len(race.raw) <= len(first):
            # the reserve took what the screening left: slow steps and switches (Qwen3-MoE-like trials on one H100,
            # 0.14 s per step: 1.6 s of racing in a 60 s budget); say so, with what one round would need
            more, later = self._round_seconds(race), self.search_name != type(self).search_name  # a later pass
            lead = f"{self.search_name}, from the config of the {self.reference_name}: " if later else ""  # it stands
            race.ended = (
                f"[tp-overlap-autotune] {lead}the budget ({o.budget_text()}) left no time to race: {len(race.raw)} of "
                f"{len(screened)} screened options re-measured (the best-screened of each GEMM), "
                f"{len(race.unsettled)} left unsettled; one round over them needs about {more:.0f} s more "
                f"({self._rates()[0]:.2f} s per step, {self._rates()[1]:.2f} s per switch here): try a budget of about "
                f"{o.max_seconds + more:.0f} s"
            )
        elif untried or (race.unsettled and race.upside_ms >= worth):
            race.ended = (
                f"the budget ({o.budget_text()}) ended the re-measurement: {len(race.raw)} of {len(screened)} "
                f"screened options re-measured, {len(race.unsettled)} left unsettled"
            )
        elif race.unsettled:
            race.ended = (
                f"[tp-overlap-autotune] {self.search_name} stops early at {self.elapsed_s:.1f} s of "
                f"{o.max_seconds:g} s: the {len(race.unsettled)} options left cannot beat the incumbent by a gain "
                f"worth a switch (together at most {race.upside_ms:.3f} ms per step, under {100 * o.rel_floor:g}% of "
                f"a step = {worth:.3f} ms)"
            )
        else:
            race.ended = (
                f"[tp-overlap-autotune] {self.search_name} stops early at {self.elapsed_s:.1f} s of "
                f"{o.max_seconds:g} s: every option is settled (none left can beat the incumbent by a gain worth a "
                f"switch) after {race.rounds} rounds of re-measurement"
            )
        failed = sum(1 for t in self.trials if t.error and t.phase in ("screen", "bracket", "halving", "recheck"))
        if failed and " stops early at " in race.ended:
            # on 2 x H100 every MoE switch failed, and this line alone read as if every option had been measured
            race.ended += f"; {failed} trials of options failed and measured nothing"
        return race

    def _round_seconds(self, race: Race) -> float:
        """Seconds of one racing round over the unsettled options: a trial measures one option per slot, so as many
        trials as the fullest slot has options, and the incumbent's brackets."""
        per_slot: dict[str, int] = {}
        for x in race.unsettled:
            for s in self._slots_of(x):
                per_slot[s] = per_slot.get(s, 0) + 1
        return self._seconds(self._round_work(max(per_slot.values(), default=0)))

    def _round_work(self, options: int) -> Work:
        """One racing round over a slot's ``options``: a trial each (a switch each) and the incumbent's brackets."""
        trials = options + math.ceil(options / self.opt.bracket_every)
        return Work(trials * (self.opt.halving_steps + self.opt.warmup_steps), trials)

    def _sigma(self, slot: str | None = None) -> float:
        """The relative spread of one step of a slot (:func:`stats.pooled_sigma`, positional) over every trial's slot
        samples scaled to their median, pooled over the slots (what the standard errors use); with ``slot``, that
        slot's own once it has ``MIN_SLOT_PAIRS`` step differences (the report's ``step_spread_pct``). Each trial's
        differences are computed once per slot and slope on the rest (every round pools them all).

        Pooled, not per slot: on real Command-R- and Nemotron-like steps (H200) the slots' own spreads differ (median
        1.1-2.1% in bf16, qkv.fwd 2.1-3.0%; 0.4-1.3% in FP8, qkv.fwd 4.1%), but on 34 bf16 searches standard errors
        from each slot's own left the same gains the pooled one leaves (17004, 17104), and on decision_sim they moved
        a hostbound seed's final decision to undecided (seed 31: 100 -> 0%); results/2026-11-26_h200x4b/."""
        key = ("sigma", len(self.trials))
        if key not in self._cache:
            # per slot, the trials' differences so far at its slope on the rest, extended by the new trials only
            betas, seen, cols = self._betas(), self._cache.setdefault(("sigma_slots",), [0, {}]), {}
            for t in self.trials[seen[0] :]:
                seen[1].update(dict.fromkeys(t.slot_samples))
            seen[0] = len(self.trials)
            for s in seen[1]:
                acc = self._cache.setdefault(("sigma_acc", s, betas.get(s, 0.0)), [0, stats.PairColumns()])
                for t in self.trials[acc[0] :]:
                    rest_scaling.add_step_diffs(acc[1], t, s, betas.get(s, 0.0))
                acc[0] = len(self.trials)
                if acc[1].key:
                    cols[s] = acc[1].arrays()
            pooled = stats.positional_sd_columns(*(np.concatenate(x) for x in zip(*cols.values()))) if cols else 0.0
            # the columns of fewer trials are never asked for again (kept, every count held its own: 11.7 MB more)
            self._cache.pop(self._cache.get(("sigma_now",)), None)
            self._cache[key], self._cache[("sigma_now",)] = (pooled, cols), key
        pooled, cols = self._cache[key]
        if slot is None or len(cols[slot][0] if slot in cols else ()) < MIN_SLOT_PAIRS:
            return pooled
        if ("slot_sigma", slot, len(self.trials)) not in self._cache:
            self._cache[("slot_sigma", slot, len(self.trials))] = stats.positional_sd_columns(*cols[slot])
        return self._cache[("slot_sigma", slot, len(self.trials))]

    def _worth(self, incumbent: TuningConfig) -> float:  # a gain worth a switch (ms): rel_floor of the incumbent's step
        if (key := ("worth", incumbent, len(self.trials))) not in self._cache:
            vals = [v for t in self._incumbent_trials(incumbent) for v in t.step_samples]
            self._cache[key] = self.opt.rel_floor * statistics.median(vals) if vals else 0.0
        return self._cache[key]

    def coverage(self, options: list[Option], race: Race, rechecked: set[Option]) -> dict[str, dict]:
        """Per slot: how many options it has, how many were screened and re-measured (and how often), which leaders
        were re-checked afresh, and which options were left unsettled or never measured."""
        out: dict[str, dict] = {}
        for slot, gemms in self.topo.slots().items():
            mine = [x for x in options if x.gemm in gemms]
            if not mine:
                continue
            label = lambda x: f"{x.gemm}: {x.label}"  # noqa: E731
            out[slot] = {
                "options": len(mine),
                "screened": sum(x in race.screened for x in mine),
                "re_measured": sum(x in race.raw for x in mine),
                "re_measured_samples": sum(len(s) for x in mine for _, s in race.raw.get(x, [])),
                "rechecked": sorted(label(x) for x in mine if x in rechecked),
                "left_unsettled": sorted(label(x) for x in mine if x in race.unsettled and x in race.raw),
                "never_measured": sorted(label(x) for x in mine if x not in race.screened),
                "screened_only": sorted(label(x) for x in mine if x in race.screened and x not in race.raw),
            }
        return out
