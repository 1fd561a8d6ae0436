"""The rest of a step as a measure of a slowdown that a slot shares with it (the racing rounds, engine/racing.py).

The rest of a step (the step minus every timed slot) runs the same kernels whatever the config. Where a slot slows
down together with it (a stretch of slow steps that slows the whole step), dividing each step's slot time by
``1 + beta (rest / level - 1)`` takes that shared part out of the racing's samples; ``beta`` is fitted per slot on
every trial of the search (:func:`fit_betas`). Where a slot moves on its own it is left alone: on real steps on one
H200 the MoE backwards varied 0.1-0.3% between trials while the rest moved, and dividing them by the whole rest
widened that to 13-14% (benchmarks/results/2026-11-26_h200x2/), so one factor for every slot would hurt them. A
host-bound forward can move several times the rest: on real L- and M-shaped FP8 steps on one H200, qkv.fwd and
proj.fwd moved 1.8-5.6x its relative change, between steps and between trials alike, so ``beta`` goes up to
``rest_beta_max`` (4; 1 until issue 46's forty-seventh session). The final decision scales its slots by the betas and
the reference's rest level fitted before it (``decision_rest_norm``): one fixed scaling for both configs, so an equal
pair stays exchangeable; its whole-step interval and rest guard are not scaled.

decision_sim, 200 seeds, with ``changed_slots=1``: hostbound (a stretch slows every slot and the rest) mean 98.7 ->
100%, worst seed 57.2 -> 100%; the other 8 scenarios unchanged at 100%; false winners 0.0% in all 9
(benchmarks/results/2026-11-25_cpu/decision_sim/, twenty-first section).
"""

from __future__ import annotations

import statistics
from typing import Any

from megatron_tp_overlap.engine.floors import capped, floor_tops

R2_MIN = 0.25  # the share of a slot's step-to-step variance the rest must explain for the slot to be scaled
T_MIN = 3.0  # ... with a correlation this many standard errors from none (t = r sqrt((n - 2) / (1 - r^2)))
MIN_PAIRS = 8  # pairs of consecutive steps, at least
NO_TOPS: tuple[dict[str, float], tuple] = ({}, ())  # no floors (read only)


def terms(t: Any) -> dict[str, tuple[float, float, float, int]]:
    """Trial ``t``'s part of each slot's least-squares fit on the rest (:func:`betas_of`): per slot, over its
    consecutive steps, the sums of (slot's relative change x rest's), (rest's)^2 and (slot's)^2, and their count."""
    c = t.rest_samples
    if t.error or len(c) < 2 or (mc := statistics.median(c)) <= 0:
        return {}
    dc = [(y1 - y0) / mc for y0, y1 in zip(c, c[1:])]
    out = {}
    for s, v in t.slot_samples.items():
        if len(v) >= 2 and (mv := statistics.median(v)) > 0:
            dv = [(x1 - x0) / mv for x0, x1 in zip(v, v[1:])]
            out[s] = (
                sum(x * y for x, y in zip(dv, dc)),
                sum(y * y for y in dc[: len(dv)]),
                sum(x * x for x in dv),
                len(dv),
            )
    return out


def betas_of(sums: dict[str, tuple[float, float, float, int]], most: float) -> dict[str, float]:
    """Per slot, the slope of its relative step-to-step changes on the rest's (clipped to ``most``, rounded to 0.1), where
    scaling by it removes at least ``R2_MIN`` of their variance, beyond what chance gives (``T_MIN``); else 0 (a
    slope the noise alone gives, early in a search or where the slot moves on its own, would add the rest's noise)."""
    out = {}
    for s, (sxy, sxx, syy, n) in sums.items():
        r2 = sxy * sxy / (sxx * syy) if sxx > 0 and syy > 0 else 0.0
        fits = sxy > 0 and n >= MIN_PAIRS and r2 >= R2_MIN and r2 * (n - 2) >= T_MIN**2 * (1 - r2)
        out[s] = round(min(most, sxy / sxx), 1) if fits else 0.0
    return out


def add(sums: dict[str, tuple[float, float, float, int]], t: Any) -> None:
    """Add trial ``t``'s :func:`terms` to ``sums`` (in place)."""
    for s, new in terms(t).items():
        old = sums.get(s, (0.0, 0.0, 0.0, 0))
        sums[s] = tuple(a + b for a, b in zip(old, new))  # type: ignore[assignment]


def fit_betas(trials: list[Any], most: float) -> dict[str, float]:
    """Per slot, the share of the rest's relative step-to-step changes that the slot's follow, 0 to ``most``
    (:func:`betas_of` over every trial's consecutive steps)."""
    sums: dict[str, tuple[float, float, float, int]] = {}
    for t in trials:
        add(sums, t)
    return betas_of(sums, most)


Norm = tuple[float, dict[str, float]] | None  # the rest's level (ms) and each slot's beta; None: nothing scaled


def norm_for(incumbent_trials: list[Any], betas: dict[str, float]) -> Norm:
    """(the incumbent's median rest of the step in ms, ``betas``) for :func:`scaled`; None when no slot follows."""
    vals = [v for t in incumbent_trials for v in t.rest_samples]
    level = statistics.median(vals) if vals else 0.0
    return (level, betas) if level > 0 and any(betas.values()) else None


def scaled(t: Any, norm: Norm) -> dict[str, list[float]]:
    """``t``'s per-slot samples, each step's over ``1 + beta (rest / level - 1)`` with its slot's beta (``norm``:
    the rest's ms that counts as no slowdown, and the betas); the samples themselves where nothing is scaled."""
    if not norm:
        return t.slot_samples
    level, betas = norm
    c = t.rest_samples if level > 0 and any(betas.values()) else []
    if not c:
        return t.slot_samples
    return {s: over_rest(v, c, level, b) if (b := betas.get(s, 0.0)) else v for s, v in t.slot_samples.items()}


def over_rest(v: list[float], rest: list[float], level: float, beta: float) -> list[float]:
    """One slot's per-step ms ``v`` over ``1 + beta (rest / level - 1)`` (at least 0.5), step by step."""
    return [x / max(0.5, 1 + beta * (y / level - 1)) for x, y in zip(v, rest)]


def own_scaled(t: Any, slot: str, beta: float) -> list[float]:
    """``slot``'s samples in ``t`` as :func:`scaled` gives them with ``beta``, relative to the trial's own median rest
    (for the step-to-step spread within a trial)."""
    v, c = t.slot_samples.get(slot, []), t.rest_samples
    if not (beta and c) or (level := statistics.median(c)) <= 0:
        return v
    return over_rest(v, c, level, beta)


def add_step_diffs(acc: Any, t: Any, slot: str, beta: float) -> None:
    """Add each consecutive pair of ``slot``'s samples in ``t``, scaled to their median, to ``acc``
    (:class:`stats.PairColumns`): (group length, position), relative difference, difference, level (what
    :func:`stats.pooled_sigma` computes per group, in its arithmetic); scaled by ``beta`` on the trial's own rest
    first (:func:`own_scaled`)."""
    v = own_scaled(t, slot, beta)
    if not v or (m := statistics.median(v)) <= 0:
        return
    g = [x / m for x in v]
    if (level := statistics.median(g)) > 0:
        for i, (a, b) in enumerate(zip(g, g[1:])):
            acc.add((len(g), i), (b - a) / level, b - a, level)


class RestScaling:
    """The search's side (mixin of engine/racing.py): the betas over every trial so far, each trial's terms added
    once; the incumbent's rest level; each trial's scaled samples, computed once per trial count."""

    def _rest_norm(self, incumbent: Any) -> tuple[float, dict[str, float]] | None:
        """:func:`norm_for` the incumbent's trials, for ``SearchOptions.rest_norm``; None when off."""
        if not self.opt.rest_norm:
            return None
        key = ("rest_norm", incumbent, len(self.trials))
        if key not in self._cache:
            self._cache[key] = norm_for(self._incumbent_trials(incumbent), self._betas())
        return self._cache[key]

    def _betas(self) -> dict[str, float]:
        """:func:`fit_betas` over every trial so far ({} when ``rest_norm`` is off), at most ``floor_beta_max`` for
        the slots at a floor so far (:meth:`_floor_tops`)."""
        if not self.opt.rest_norm:
            return {}
        done, sums, betas = self._cache.get(("beta_sums",), (0, {}, {}))
        if done < len(self.trials):
            for t in self.trials[done:]:
                add(sums, t)
            done, betas = len(self.trials), betas_of(sums, self.opt.rest_beta_max)
            if self.opt.floor_beta_max < self.opt.rest_beta_max:
                tops = self._floor_tops()
                betas = {s: min(b, self.opt.floor_beta_max) if s in tops else b for s, b in betas.items()}
            self._cache[("beta_sums",)] = (done, sums, betas)
        return betas

    def _scaled(self, t: Any, norm: tuple[float, dict[str, float]] | None) -> dict[str, list[float]]:
        """:func:`scaled`, then :func:`capped` at the floors so far (``floor_cap``), kept while both stay (the racing
        rounds score every trial again); ``t.slot_samples`` where neither applies."""
        tops, tops_key = self._floor_tops_keyed()
        if not norm and not tops:
            return t.slot_samples
        key = ("scaled", t.index, norm and (norm[0], tuple(norm[1].items())), tops_key)
        if (out := self._cache.get(key)) is None:
            out = self._cache[key] = capped(scaled(t, norm), tops)
        return out

    def _floor_tops(self) -> dict[str, float]:
        """:func:`floor_tops` of the reference's steps so far ({} when ``floor_cap`` is 0), rounded so that the
        trials' capped samples are computed again only when a floor moves."""
        return self._floor_tops_keyed()[0]

    def _floor_tops_keyed(self) -> tuple[dict[str, float], tuple]:
        """(:meth:`_floor_tops`, its items as a cache key), found again only when a trial of the reference's comes in
        (the trials are only ever appended); looked up for every trial the racing scores, so kept cheap."""
        if self.opt.floor_cap <= 0:
            return NO_TOPS
        got = self._cache.get(("floor_tops",))
        if got is not None and got[0] == len(self.trials):
            return got[2]
        done, per, keyed = got or (0, {}, NO_TOPS)
        ref, new = self.trials[0].config, False
        for t in self.trials[done:]:
            if t.config == ref and not t.error:
                for s, v in t.slot_samples.items():
                    per.setdefault(s, []).append(v)
                new = True
        if new:
            tops = {s: float(f"{v:.3g}") for s, v in sorted(floor_tops(per, self.opt.floor_cap).items())}
            keyed = (tops, tuple(tops.items()))
        self._cache[("floor_tops",)] = (len(self.trials), per, keyed)
        return keyed
