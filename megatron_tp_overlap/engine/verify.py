"""The gain verified in the run itself: the first real training iterations alternate the tuned config and the
reference in ABBA order (:mod:`engine.paired`), on the real data and the real optimizer steps.

The framework calls :meth:`InRunVerification.before` and :meth:`~InRunVerification.after` around each of its
training iterations; both configs already passed the numerics check, so the run trains as it would have.
It is sequential: after every quadruple from the 6th on it looks at the interval (every rank on the same
iteration times, the max over ranks) and stops as soon as a 99% interval decides, or the planned quadruples are
done (then at 95%). The verdict: the realized gain per iteration with its interval, and the config the run keeps:
the tuned one only if it is faster beyond the interval, else the reference.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megatron_tp_overlap.engine import heap, paired
from megatron_tp_overlap.engine.space import TuningConfig
from megatron_tp_overlap.engine.trial import SearchOptions

WARM_ITERS = 1  # not measured: the first real iteration allocates the optimizer state
# Not measured either: the first iteration after each switch. It pays the switch's one-off costs and gets its
# idle gap's power headroom (H200: the first step after a switch ran 4.4% faster than one back to back,
# benchmarks/results/2026-11-23_h200x1/trial_noise/); and where TE's destroy_ub() still resets torch.compile (a
# compiled model, engine.switcher.keeping_compiled_fusions), compiled code compiles again in it (+0.20-0.29 s on a
# 0.23 s iteration, ../compile_reset/).
SETTLE_ITERS = 1


@dataclass
class Verdict:
    keep: TuningConfig  # the config the run trains on from now
    interval: paired.Interval  # gain of the tuned config per iteration (ms; positive: faster)
    reference_ms: float  # median iteration of the reference
    tuned_ms: float
    iterations: int  # training iterations the verification spanned (measured, warm and settling)
    message: str
    reverted: bool  # the run went back to the reference
    switch_s_median: float | None = None  # seconds per config switch between iterations (outside their times)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kept": self.keep.label,
            "reverted": self.reverted,
            "iterations": self.iterations,
            "reference_iter_ms": round(self.reference_ms, 3),
            "tuned_iter_ms": round(self.tuned_ms, 3),
            **self.interval.to_dict(),
            "level": self.interval.level,
            "switch_s_median": None if self.switch_s_median is None else round(self.switch_s_median, 3),
            "message": self.message,
        }


# Measured on real Megatron-LM iterations (one H200, benchmarks/results/2026-11-23_h200x1/verify_noise/): after a
# switch's idle gap the power limit's clock oscillation restarts in phase, iterations 3-4 and 7-8 after a switch
# running ~3% slower than 1-2 and 5-6 (a period of ~4 iterations, ~1 s); on top, 1.3% (sd) independent noise and
# rare stalls (a 0.3 s Python GC). Blocks of 4 iterations (their median) hold one whole period, so both configs see
# the same phases. 6 quadruples of them gave a 95% interval of +-0.5-5.7% (median ~1.1%) of an iteration there, 24
# +-0.30-0.34%: hence up to 24, stopping as soon as the interval decides.
BLOCK = 4  # iterations per block, when the run has room for 6 quadruples of them
FLOOR = SearchOptions.rel_floor  # a look stops (going back) once the interval excludes a gain of this share of an
# iteration: the gain the search, too, counts as too small to matter


def design(iters: int) -> tuple[int, int]:
    """(most quadruples, iterations per block) for at most ``iters`` measured iterations: blocks of ``BLOCK``
    iterations (fewer when ``iters`` has no room for 6 quadruples of them: at least 1), as many quadruples as
    ``iters`` fills (at least 6: a 95% interval)."""
    block = min(BLOCK, max(1, iters // (4 * paired.MIN_PAIRS)))
    return max(paired.MIN_PAIRS, math.ceil(iters / (4 * block))), block


def schedule(order: list[int], block: int = 1) -> list[tuple[int, bool]]:
    """(config, measured) per training iteration: ``WARM_ITERS`` on the tuned config (B), then ``order`` in blocks
    of ``block`` iterations with ``SETTLE_ITERS`` unmeasured iterations after every switch (A1 B2 A2 ... B2 A1: one
    switch per run)."""
    out, live = [(paired.B, False)] * WARM_ITERS, paired.B
    for x, n in paired.runs(order):
        if x != live:
            out += [(x, False)] * SETTLE_ITERS
            live = x
        out += [(x, True)] * (n * block)
    return out


def span(iters: int) -> int:
    """Training iterations the verification of at most ``iters`` measured iterations takes when it runs to its end,
    warm and settling included."""
    quads, block = design(iters)
    return len(schedule(paired.abba(quads), block))


def fitting(iters: int, remaining: int | None) -> int:
    """The most measured iterations, at most ``iters``, whose verification ends within ``remaining`` training
    iterations (None: unknown, ``iters``); 0 when not even the shortest one (6 quadruples of one iteration) fits."""
    if remaining is None or iters <= 0 or span(iters) <= remaining:
        return iters
    return next((n for n in range(iters - 1, 0, -1) if span(n) <= remaining), 0)


@dataclass
class InRunVerification:
    """ABBA over real iterations. ``apply`` switches the live config (the tuner's switcher); ``agree`` returns
    element-wise max over ranks; ``sync`` waits for the device; ``on_verdict`` acts on the result (rewrite
    the YAML, the report), called on every rank once."""

    tuned: TuningConfig
    reference: TuningConfig
    iters: int
    apply: Callable[[TuningConfig], Any]
    agree: Callable[[list[float]], list[float]] = lambda v: list(v)
    sync: Callable[[], None] = lambda: None
    clock: Callable[[], float] = time.perf_counter
    on_verdict: Callable[[Verdict], None] = lambda v: None
    log: Callable[..., None] = print
    reference_name: str = "the starting config"
    hold_heap: Callable[[], contextlib.AbstractContextManager] = heap.frozen  # from the first iteration to the verdict
    order: list[int] = field(init=False)
    times_ms: list[float] = field(init=False, default_factory=list)
    verdict: Verdict | None = field(init=False, default=None)
    switch_s: list[float] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        quads, self.block = design(self.iters)
        self.order = paired.abba(quads)
        self.plan = schedule(self.order, self.block)
        self._i = 0  # iterations seen
        self._t0 = 0.0
        self._live: TuningConfig | None = self.tuned
        self._heap = contextlib.ExitStack()  # switches collect garbage: the framework's objects stay out of it

    @property
    def done(self) -> bool:
        return self.verdict is not None

    def _config_at(self, i: int) -> TuningConfig:
        return self.tuned if self.plan[min(i, len(self.plan) - 1)][0] == paired.B else self.reference

    def before(self) -> None:
        """Before a training iteration: the config of this iteration goes live, the clock starts."""
        if self.done:
            return
        if self._i == 0:
            self._heap.enter_context(self.hold_heap())
        want = self._config_at(self._i)
        if want != self._live:
            t = self.clock()
            self.apply(want)
            self.switch_s.append(self.clock() - t)
            self._live = want
        self.sync()
        self._t0 = self.clock()

    def after(self) -> Verdict | None:
        """After a training iteration: its time is recorded; after each quadruple from the 6th on, a look at the
        interval, and when it decides (or after the last quadruple), the verdict (every rank)."""
        if self.done:
            return None
        self.sync()
        measured = self.plan[self._i][1]
        if measured:
            self.times_ms.append(1e3 * (self.clock() - self._t0))
        self._i += 1
        n, per_quad = len(self.times_ms), 4 * self.block
        if not measured or n % per_quad or n // per_quad < paired.MIN_PAIRS:
            return None
        verdict = self._decide(self.agree(self.times_ms), last=n == len(self.order) * self.block)
        if verdict is None:
            return None
        self.verdict = verdict
        self.verdict.switch_s_median = statistics.median(self.switch_s) if self.switch_s else None
        if self.verdict.keep != self._live:
            self.apply(self.verdict.keep)
            self._live = self.verdict.keep
        self._heap.close()
        self.log(self.verdict.message)
        self.on_verdict(self.verdict)
        return self.verdict

    def _decide(self, times: list[float], last: bool) -> Verdict | None:
        """The verdict on the quadruples so far, or None to go on: before the last quadruple only a 99% interval
        that excludes zero, or that excludes a gain of ``FLOOR`` of an iteration, ends the verification."""
        b = self.block
        order = self.order[: len(times) // b]
        blocks = [statistics.median(times[i * b : (i + 1) * b]) for i in range(len(order))]
        gains = paired.quad_gains(blocks, order)
        ref = statistics.median(t for i, t in enumerate(times) if order[i // b] == paired.A)
        tun = statistics.median(t for i, t in enumerate(times) if order[i // b] == paired.B)
        iv = paired.gain_interval(gains, 0.95 if last else paired.INTERIM_LEVEL)
        futile = iv.high < FLOOR * ref
        if not (last or iv.faster or iv.slower or futile):
            return None
        measured = (
            f"tuned config: {iv.describe('ms/iter', ref, sign=-1)} vs {self.reference_name}, measured in this run "
            f"({len(times)} iterations, ABBA in blocks of {b}"
            f"{'' if last else f', decided before the planned {len(self.order) * b}'}; {ref:.1f} vs {tun:.1f} ms median)"
        )
        if iv.faster:
            return Verdict(self.tuned, iv, ref, tun, self._i, f"[tp-overlap-autotune] {measured}: keeping it", False)
        why = (
            "slower"
            if iv.slower
            else f"not faster by {100 * FLOOR:g}% or more"
            if futile
            else "not faster beyond the interval"
        )
        return Verdict(
            TuningConfig(self.reference.ub, self.reference.disabled, "reference"),
            iv,
            ref,
            tun,
            self._i,
            f"[tp-overlap-autotune] {measured}: {why}, so the run goes back to {self.reference_name}",
            True,
        )
