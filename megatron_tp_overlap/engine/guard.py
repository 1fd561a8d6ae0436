"""The numerics guard: a config is chosen only if it reproduces the no-overlap reference's outputs and gradients
(fingerprints) within 3x the deviation of the config the run would use anyway, or 3x the difference between two
identical no-overlap steps where kernels are not deterministic; and the starting point kept to the dgrad mode the
search allows. A mixin of :class:`~engine.tuner.Autotuner` (its state: ``switcher``, ``lockstep``, ``verify_fn``,
``numerics``, ``space_spec``, ``topology``)."""

from __future__ import annotations

import math

from megatron_tp_overlap.engine.numerics import rel_diff
from megatron_tp_overlap.engine.space import (
    Option,
    TuningConfig,
    all_off,
    allows_dgrad_mode,
    apply,
)
from megatron_tp_overlap.ub.config import BULK_DGRAD_GEMMS, UbConfig


class NumericsGuard:
    """Checks configs against no overlap (mixin)."""

    # Allowed deviation from no overlap, as a multiple of the reference config's own deviation: any
    # userbuffers path rounds differently from NCCL (reduction order, GEMM chunking), and in a deep
    # model that alone reaches several % (H200, TE 2.20: 3% at TP=4 for a 4-layer GPT, for every
    # config alike). A wrong result (e.g. a mis-switched reduce-scatter dgrad) is off by O(1).
    REFERENCE_DEVIATION_FACTOR = 3.0
    MAX_TOLERANCE = 0.5

    def tolerance(self) -> float:
        """The numerics guard's bound: max(verify_rtol, 3 x the reference config's deviation, 3 x the spread of
        two identical no-overlap steps), at most 0.5."""
        ref_dev = self.numerics.get("reference config", 0.0)
        floor = self.numerics.get("no overlap (repeat)", 0.0)
        f = self.REFERENCE_DEVIATION_FACTOR
        return min(max(self.verify_rtol, f * ref_dev, f * floor), max(self.verify_rtol, self.MAX_TOLERANCE))

    def _calibrate(self) -> None:
        """No-overlap fingerprint (twice: the step must be reproducible), then the reference config's."""
        self.switcher.apply(all_off(self.topology, TuningConfig(self.reference or UbConfig())))
        self._ref_fp = self.verify_fn()
        floor = self.lockstep.agree_max([rel_diff(self.verify_fn(), self._ref_fp)])[0]
        self.numerics["no overlap (repeat)"] = floor
        # Non-deterministic kernels (atomics in attention backward, Megatron without --deterministic-mode)
        # make two identical steps differ by ~1e-2 on H200; the bound follows that spread. Only a step
        # that cannot be told from a wrong config's O(1) error turns the guard off.
        if not math.isfinite(floor) or self.REFERENCE_DEVIATION_FACTOR * floor > self.MAX_TOLERANCE:
            self._guard_off = f"numerics guard off: two identical reference steps differ by {floor:.2e}"
            self.log(f"[tp-overlap-autotune] WARNING {self._guard_off}; make verify_fn deterministic (restore RNG)")
            return
        if floor > self.verify_rtol / 2:
            self.log(
                f"[tp-overlap-autotune] two identical no-overlap steps differ by {floor:.2e}: numerics bound "
                f"{self.REFERENCE_DEVIATION_FACTOR:g} x that"
            )
        self.switcher.apply(TuningConfig(self.reference or UbConfig(), frozenset(), "reference"))
        dev = self.lockstep.agree_max([rel_diff(self.verify_fn(), self._ref_fp)])[0]
        self.numerics["reference config"] = dev
        if not math.isfinite(dev) or dev > self.MAX_TOLERANCE:
            self.log(f"[tp-overlap-autotune] WARNING the reference config itself deviates from no overlap by {dev:.2e}")

    def verify(self, config: TuningConfig) -> str | None:
        """None if ``config`` reproduces the no-overlap fingerprint within :meth:`tolerance` on every rank."""
        if self.verify_fn is None:
            return None
        if self._ref_fp is None and not self.lockstep.attempt(self._calibrate, self.log):
            self._ref_fp = None  # calibrate again at the next check; until then nothing passes (agreed)
            return "the numerics calibration failed"
        if self._guard_off:
            return None
        measured: list[float] = []

        def check() -> None:
            self.switcher.apply(config)
            measured.append(rel_diff(self.verify_fn(), self._ref_fp))

        err = measured[0] if self.lockstep.attempt(check, self.log) else math.inf
        err, self._agreed_elapsed = self.lockstep.agree_max([err, self.clock() - self._t0])
        self.numerics[config.describe()] = err
        tol = self.tolerance()
        return None if err <= tol else f"rel. error {err:.2e} > {tol:.2g} vs no overlap"

    def _outside_dgrad_mode(self, ub: UbConfig) -> bool:
        """Whether ``ub`` runs an active qkv/fc1 dgrad in a mode ``space_spec`` excludes."""
        return any(not allows_dgrad_mode(self.space_spec, ub, g) for g in self.topology.active)

    def in_dgrad_mode(self, ub: UbConfig, space: dict[str, list[Option]]) -> UbConfig:
        """``ub`` with each active qkv/fc1 dgrad that runs in a mode ``space_spec`` excludes set to the first
        option of the space for it (priors first: a preset's setting) that passes the numerics check. E.g. TE's
        default (bulk dgrad) under a reduce-scatter dgrad search, which would otherwise stay in the result as
        the incumbent, unverified: the reference is never checked against itself."""
        cfg = TuningConfig(ub)
        for g in BULK_DGRAD_GEMMS:
            if g not in space or allows_dgrad_mode(self.space_spec, cfg.ub, g):  # not tuned here, or in the mode
                continue
            for opt in (o for o in space[g] if o.enabled):
                candidate = apply(cfg, opt, self.topology)
                # the new reference is this tuner's choice, not the user's: it must compute what no overlap does
                # (checked against the given reference's calibration: a wrong one must not widen the tolerance)
                why = self.verify(candidate) if self.verify_fn is not None else None
                if why is None:
                    cfg = candidate
                    break
                self.log(f"[tp-overlap-autotune] {g}: {opt.label} left out as the starting point: {why}")
            else:
                self.log(
                    f"[tp-overlap-autotune] WARNING no {g} setting in this dgrad mode passed the numerics "
                    "check; keeping the reference's"
                )
        return cfg.ub
