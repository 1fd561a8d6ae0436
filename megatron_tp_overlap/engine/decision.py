"""The final decision: a selection round over the combined config, no overlap, TE's default and the closest preset
(the reference bracketing them), then the reference against the selected one in ABBA quadruples until the paired
interval decides (``engine.paired``). A mixin of :class:`~engine.search.Searcher`."""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Callable

from megatron_tp_overlap.engine import paired, rest_scaling
from megatron_tp_overlap.engine.floors import capped
from megatron_tp_overlap.engine.space import TuningConfig, is_valid
from megatron_tp_overlap.engine.trial import Contender, SearchResult, Trial, TrialFailed, Work


def noise_hint(half_width_ms: float, quads: int, ref_ms: float, seconds: float, gain: float = 0.01) -> str:
    """What the final decision would need to see a gain of ``gain`` of a step at the noise it met: its interval
    narrows as 1/sqrt(quadruples). "" when its interval was already that narrow. (On 2 x H100 the dense TP=2 runs
    met +-6.6-14.5% of a step after 9-10 quadruples, against +-0.8% on one GPU: benchmarks/results/2026-11-25_h100x2/.)
    """
    if quads <= 0 or not math.isfinite(half_width_ms) or half_width_ms <= gain * ref_ms:
        return ""
    need = math.ceil(quads * (half_width_ms / (gain * ref_ms)) ** 2)
    return (
        f"; this run's steps are noisy (+-{100 * half_width_ms / ref_ms:.1f}% of a step after {quads} quadruples): "
        f"a gain of {100 * gain:g}% of a step would need about {need} quadruples (~{need * seconds / quads:.0f} s)"
    )


class FinalDecision:
    """The selection round and the ABBA decision (mixin)."""

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
        ref = next((c for c in cont if c.name == self.reference_name), cont[0])
        others = [c for c in cont if c is not ref]
        # 1. selection: every contender once, the reference bracketing them (drift interpolated away). Every block
        # follows a switch, as in the ABBA: a first reference block continuing the search's last bracket (the same
        # config) sits elsewhere after a switch than the contenders (decision_sim's position world: 24 of 24 equal
        # searches with a choice accepted went on to the ABBA), so a contender runs first
        plan: list[Contender] = [*others[:1], ref]
        for i, c in enumerate(others[1:], 1):
            plan.append(c)
            if i % o.bracket_every == 0 or i == len(others) - 1:
                plan.append(ref)
        self._select_trials(plan, ref)
        sel = self._selection(ref, others)
        # 1b. runoff: the contenders ahead of the reference again, in alternating order, until each has
        # select_passes blocks (one block cannot tell configs ~1% of a step apart)
        ahead = [c for c in others if sel.get(c.name, 0.0) < 0 and c.name not in self.report_only]
        ahead = sorted(ahead, key=lambda c: sel[c.name])[: o.runoff]
        # the tuned config behind in its one block, though the search found a gain beyond the noise in it, runs the
        # runoff too: one block cannot tell ~0.6% of a step (decision_sim iid seed 165 dropped a true 0.58 ms there)
        mine = next((c for c in others if c.config == tuned), None)
        behind = (
            mine is not None
            and sel.get(mine.name, -1.0) >= 0
            and mine.name not in self.report_only
            and any(c.get("accepted") for c in choices.values())
        )
        if behind:
            ahead = [*ahead[: o.runoff - 1], mine]
        for p in range(1, o.select_passes if len(ahead) > 1 or behind else 1):
            order = ahead if p % 2 == 0 else ahead[::-1]
            if not self._select_trials([*order, ref], ref, stop_short=True):
                break
            sel = self._selection(ref, others)
        if not ref.samples:
            raise TrialFailed("the reference config could not be measured (every trial failed)")
        rejected: list[str] = []
        eligible = [c for c in others if c.name in sel and c.name not in self.report_only]
        winner, reason, decision = ref, f"no config was faster than the {ref.name} in the selection round", {}
        undecided: TuningConfig | None = None
        if not sel and self.budget_hit:  # nothing to compare: say why, not "no config was faster"
            reason = (
                f"the budget ({self.opt.budget_text()}) ran out before any candidate was measured against the "
                f"{ref.name} ({self.steps_run} steps, {self.elapsed_s:.1f} s run): keeping the {ref.name} "
                f"({self._raise_hint()})"
            )
        while eligible:
            best = min(eligible, key=lambda c: sel[c.name])
            if sel[best.name] >= 0:
                # nothing ahead in a few selection blocks, but the tuned config's choices were each accepted on fresh
                # steps: the ABBA decides (decision_sim hostbound: 3 of 200 seeds with 0.7-1.3% gains, every true
                # option accepted, ended here at 42-45 s of 60)
                if not (mine in eligible and any(c.get("accepted") for c in choices.values())):
                    break
                best = mine
            bad = self._verify(best.config)
            if bad:
                rejected.append(f"{best.name} rejected by the numerics check ({bad})")
                eligible.remove(best)
                continue
            # 2. the reference against the selected config, in ABBA quadruples, until the interval decides
            decision = self.abba(ref, best)
            slot, step = decision["slot_interval"], decision["step_interval"]
            adjusted = decision["rest_adjusted_interval"]
            ref_ms = decision["reference_step_ms"]
            worth = o.rel_floor * ref_ms  # a gain worth a switch
            # at a last look below the interim level the estimate itself must be worth a switch (an earlier look runs
            # on, abba): decision_sim's equal worlds named there read 0.14-0.23 ms of a 100-111 ms step, its true gains
            # 0.43-1.3 ms (benchmarks/results/2026-11-25_cpu/decision_sim/, fifty-second and fifty-third sections)
            short = slot.level < paired.INTERIM_LEVEL and min(slot.estimate, adjusted.estimate) < worth
            if slot.faster and not adjusted.faster:
                reason = (
                    f"{best.name} is faster in the overlapped layers ({slot.describe(ref=ref_ms)}), but not once the "
                    f"rest of the step is taken out ({adjusted.describe(ref=ref_ms)}): its blocks met faster steps, "
                    f"keeping the {ref.name}"
                )
            elif slot.faster and not step.slower and slot.high >= worth and not short:
                winner = best
                reason = (
                    f"{best.name} beats the {ref.name} by {slot.describe(ref=ref_ms)} per step in the overlapped "
                    f"layers; whole step {step.describe(ref=ref_ms)}"
                ) + (f" (measured slower after {decision['split_at']} quadruples)" if decision["split_at"] else "")
            elif slot.faster and slot.high < worth:
                # faster, but surely by less than a gain worth a switch: decision_sim's position world named 2 such
                # winners in 200 equal worlds, 0.04-0.05 ms of a 100 ms step (all 6 quadruples ahead by chance)
                reason = (
                    f"{best.name} is faster in the overlapped layers ({slot.describe(ref=ref_ms)}) but by less than a "
                    f"gain worth a switch ({100 * o.rel_floor:g}% of a step): keeping the {ref.name}"
                )
            elif slot.faster and short and not step.slower:
                reason = (
                    f"{best.name} is faster in the overlapped layers at the budget's last look "
                    f"({slot.describe(ref=ref_ms)}), but by less than a gain worth a switch as estimated "
                    f"({100 * o.rel_floor:g}% of a step): keeping the {ref.name}"
                )
                undecided = TuningConfig(best.config.ub, best.config.disabled, best.name)  # real iterations can settle
            elif slot.faster:
                reason = (
                    f"{best.name} is faster in the overlapped layers ({slot.describe(ref=ref_ms)}) but its whole step "
                    f"is slower ({step.describe(ref=ref_ms)}; first seen after {decision['split_at']} quadruples, "
                    f"{decision['quadruples']} run): keeping the {ref.name}"
                )
            elif decision["error"]:
                reason = f"{best.name} failed during the decision ({decision['error']}): keeping the {ref.name}"
            elif decision["quadruples"] < self.opt.min_quads:
                reason = (
                    f"best was {best.name}, but the budget left {decision['quadruples']} ABBA quadruples of the "
                    f"{self.opt.min_quads} a decision needs: keeping the {ref.name} ({self._raise_hint()})"
                )
            else:
                reason = (
                    f"best was {best.name}, {slot.describe(ref=ref_ms)} per step vs the {ref.name}: within the noise "
                    f"(not faster beyond the interval), keeping the {ref.name}"
                ) + noise_hint(slot.half_width, decision["quadruples"], ref_ms, decision["seconds"])
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
                "rest_adjusted_interval": decision["rest_adjusted_interval"].to_dict(),
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
            search_end=self.search_end,
            coverage=self.coverage_report,
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
            if (c is not ref or ref.samples) and not self._can_afford(self.block_steps, reserve):
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
        pos = [p for p, _ in pts]

        def at(p: float) -> float:
            if not pts:
                return math.nan
            if p <= pts[0][0]:
                return pts[0][1]
            j = bisect.bisect_left(pos, p)  # the first point at or after ``p`` (found by bisection: called per trial)
            if j == len(pts):
                return pts[-1][1]
            (p0, v0), (p1, v1) = pts[j - 1], pts[j]
            return v0 + (v1 - v0) * (p - p0) / (p1 - p0) if p1 > p0 else v1

        return at

    def _decision_trial(self, c: Contender, steps: int, phase: str) -> Trial:
        t = self._run(phase, c.config, {"*": c.name}, steps)
        c.samples.extend(t.step_samples)
        return t

    def _slot_sum(self, t: Trial) -> float | None:
        """Median over the trial's steps of the per-step sum over slots (ms): GPU time of the overlapped layers."""
        per = self._step_slot_sums(t)
        return statistics.median(per) if per else None

    def _step_slot_sums(
        self,
        t: Trial,
        slots: frozenset[str] | None = None,
        tops: dict[str, float] | None = None,
        samples: dict[str, list[float]] | None = None,
    ) -> list[float]:
        per = t.slot_samples if samples is None else samples
        cols = [v for s, v in capped(per, tops or {}).items() if slots is None or s in slots]
        if not cols:
            return []
        return [sum(c[i] for c in cols) for i in range(min(len(c) for c in cols))]

    def _quad_blocks(
        self, blocks: list[Trial], order: list[int], slots: frozenset[str] | None, norm: rest_scaling.Norm = None
    ) -> list[float]:
        """One quadruple's block values (ms): the median over each block's steps of the sum over ``slots``, a slot at a
        floor (``_floor_tops``) counting each step at most the slower of the two configs' fastest steps in the
        quadruple x (1 + ``floor_cap``): the same bound for both, so that an equal pair stays exchangeable. ``norm``:
        each step's slots scaled by the rest first (``decision_rest_norm``; one fixed scaling for both configs)."""
        per = [rest_scaling.scaled(t, norm) for t in blocks]
        tops = {}
        for s in self._floor_tops():
            lows = [
                min(min(p.get(s) or [math.inf]) for p, w in zip(per, order) if w == x) for x in (paired.A, paired.B)
            ]
            if math.isfinite(top := max(lows)):
                tops[s] = top * (1 + self.opt.floor_cap)
        return [
            statistics.median(self._step_slot_sums(t, slots, tops, p) or t.step_samples) for t, p in zip(blocks, per)
        ]

    def _changed_slots(self, a: TuningConfig, b: TuningConfig) -> frozenset[str] | None:
        """The slots whose GEMMs ``a`` and ``b`` run differently (config entry or overlap off); None: all of them."""
        gemms = {g for g in self.topo.active if a.ub.get(g) != b.ub.get(g) or (g in a.disabled) != (g in b.disabled)}
        slots = frozenset(s for g in gemms for c in self.topo.coupled(g) | {g} for s in self.topo.slots_of(c))
        return slots or None

    def abba(self, ref: Contender, cand: Contender) -> dict:
        """ABBA quadruples of ``block_steps``-step blocks; from ``min_quads`` on, stop as soon as the slot-time interval
        excludes zero (either way) or cannot hold a gain of ``rel_floor`` of the step any more, or at ``max_quads`` or
        the budget; a look after each quadruple up to ``paired.DENSE_LOOKS``, then after every
        ``paired.SPARSE_EVERY``-th (:func:`paired.looks_after`), every look at ``paired.INTERIM_LEVEL`` but a last one
        by ``DENSE_LOOKS``, at ``level``. Per quadruple the reference runs A1 then
        (after the candidate's two blocks) A2 and the next quadruple's A1 without a switch: each config has one block
        right after a switch and one after its own block, so effects of the position since a switch cancel too. Every
        block is a trial of its own: a trial ends with a device sync and host work (the GPU idles briefly), and a
        config's second block must follow that gap as its first follows a switch, for both configs alike (with B's two
        blocks in one trial, A's continuing block alone followed a gap: on real H200 steps the reference then measured
        0.06-0.55% of a step faster than an equal candidate in 7 of 7 decisions,
        benchmarks/results/2026-11-23_h200x1/search_on_real_steps/). With ``rest_guard`` a look that finds the slots
        faster needs them faster once the rest of the step is taken out too (:func:`paired.rest_adjusted`), or runs on; so
        does one that finds them faster by less than a gain worth a switch as estimated (but its last)."""
        o, bs = self.opt, self.block_steps
        decided_on = self._changed_slots(ref.config, cand.config) if o.changed_slots else None
        # the racing's rest scaling, fitted before the decision and fixed through it, for both configs alike
        norm = self._rest_norm(ref.config) if o.decision_rest_norm else None
        order: list[int] = []
        slot_blocks: list[float] = []
        step_blocks: list[float] = []
        rest_blocks: list[float] = []  # the rest of each block's steps (step minus every slot), for ``rest_guard``
        blocks: list[Trial] = []
        quads, error, seconds, split = 0, None, 0.0, 0
        ran_on: list[int] = []  # the looks that found the slots faster by less than a gain worth a switch
        slot_iv = step_iv = adj_iv = paired.gain_interval([], o.level)
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
                seconds += t.seconds
                blocks.append(t)
                step_blocks.append(statistics.median(t.step_samples))
                rest_blocks.append(statistics.median(t.rest_samples) if t.rest_samples else math.nan)
                order.append(which)
            else:
                quads += 1
                slot_blocks += self._quad_blocks(blocks[-4:], order[-4:], decided_on, norm)
            if quads >= o.min_quads and error is None:
                # sequential: a look before the last one is at paired.INTERIM_LEVEL (at 95% after each quadruple, an
                # equal config wins 8-9% of decisions); the last look, at max_quads or the budget, at ``level`` if it
                # comes by paired.DENSE_LOOKS
                last = quads >= o.max_quads or not self._fits(bs, rest_of_quad)
                if not (last or paired.looks_after(quads)):
                    continue
                final = last and quads <= paired.DENSE_LOOKS  # past them every look is at the interim level
                gains = paired.quad_gains(slot_blocks[: 4 * quads], order)
                slot_iv = paired.look(gains, o.level, final, o.clip_sds)
                step_iv = paired.look(
                    paired.quad_gains(step_blocks[: 4 * quads], order), o.step_level, True, o.clip_sds
                )
                rest = paired.quad_gains(rest_blocks[: 4 * quads], order)
                adj_iv = slot_iv
                if o.rest_guard and slot_iv.faster and not any(map(math.isnan, rest)):
                    adj_iv = paired.look(paired.rest_adjusted(gains, rest), o.level, final, o.clip_sds)
                ref_ms = statistics.median(v for v, w in zip(step_blocks, order) if w == paired.A)
                # the layers faster but the whole step slower: the quadruples the budget has left settle which, all of
                # them (stopping at the first look where the step is no longer slower would favour the candidate). On
                # real H100 FP8 steps such a veto once kept the reference against a true 0.5% gain (seed 18604)
                split = split or (quads if slot_iv.faster and step_iv.slower else 0)
                if split and not last:
                    continue
                if slot_iv.faster and not adj_iv.faster and not last:
                    continue  # faster, but not once the rest of the step is taken out: more quadruples settle it
                worth = o.rel_floor * ref_ms
                if slot_iv.faster and min(slot_iv.estimate, adj_iv.estimate) < worth <= slot_iv.high and not last:
                    ran_on.append(quads)  # faster, but by less than a gain worth a switch as estimated: run on
                    continue
                if slot_iv.faster or slot_iv.slower or slot_iv.high < worth:
                    break
        ref_blocks = [v for v, w in zip(step_blocks, order) if w == paired.A]
        ref_ms = statistics.median(ref_blocks) if ref_blocks else math.nan
        drift = (max(ref_blocks) - min(ref_blocks)) / ref_ms if ref_blocks else 0.0
        return {
            "candidate": cand.name,
            "quadruples": quads,
            "seconds": round(seconds, 3),  # the decision's trials, switches included
            "block_steps": bs,
            "level": slot_iv.level,  # of the look that ended it
            "error": error,
            "slot_interval": slot_iv,
            "decided_on": sorted(decided_on) if decided_on else "every slot",
            "step_interval": step_iv,
            "rest_adjusted_interval": adj_iv,
            "split_at": split,  # the quadruple where the layers were faster and the step slower (0: never)
            "ran_on_under_worth": ran_on,
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
