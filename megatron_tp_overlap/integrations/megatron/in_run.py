"""The in-run verification of a tuned config, as :func:`~integrations.megatron.tuning.tune` sets it up: the run's
own iterations alternate it with the starting config until the interval decides; the YAML, recipe, report and cache
follow the config it keeps."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

from megatron_tp_overlap.engine.options import TuneOptions
from megatron_tp_overlap.engine.space import TuningConfig
from megatron_tp_overlap.integrations.megatron.outputs import (
    _key_meta,
    _recipe,
    _update_report,
    _write_recipe,
    _write_yaml,
)
from megatron_tp_overlap.ub.config import UbConfig

if TYPE_CHECKING:
    from megatron_tp_overlap.integrations.megatron.tuning import Tuned

TAG = "[tp-overlap-autotune]"


def _verification(
    tuned: Tuned,
    reference: UbConfig,
    switcher: Any,
    options: TuneOptions,
    key: Any,
    cache: Any,
    log: Callable,
    remaining: Optional[int] = None,
    undecided: Optional[TuningConfig] = None,
    capture: Any = None,
) -> Any:
    """The in-run verification of ``tuned`` against ``reference`` (None when off or when there is nothing to
    verify); its verdict goes into the report, and the YAML, recipe and cache follow the config it keeps (rank 0,
    atomically). ``undecided``: when tuning kept the reference because its best config was ahead but not beyond the
    interval its budget allowed, that config is verified instead: the YAML keeps the reference unless the run's
    own iterations show the gain. ``capture``: the run's CUDA graph capture; every switch ends before it."""
    import torch

    from megatron_tp_overlap.atomic import signals_deferred
    from megatron_tp_overlap.engine.measure import agree_max
    from megatron_tp_overlap.engine.verify import InRunVerification, fitting, span

    ref = TuningConfig(reference, frozenset(), "reference")
    candidate = tuned.config if tuned.config != ref else undecided
    if options.verify_iters <= 0 or switcher is None or candidate is None or candidate == ref:
        return None
    room = remaining if capture is None else capture.room(remaining)
    iters = fitting(options.verify_iters, room)
    if iters < options.verify_iters and room != remaining:  # the graph capture, not the run's end, bounds it
        log(capture.line(span(1), options.verify_iters, iters))
        if iters == 0:
            tuned.notes.append(f"in-run verification skipped: CUDA graphs ({capture.mode}) capture before it ends")
            return None
    if iters == 0:
        log(
            f"{TAG} in-run verification skipped: the run has {remaining} iterations left, the shortest verification "
            f"takes {span(1)}"
        )
        tuned.notes.append("in-run verification skipped: too few iterations left")
        return None
    if iters < options.verify_iters and room == remaining:
        log(f"{TAG} in-run verification shortened to {iters} measured iterations: the run has {remaining} left")

    def on_verdict(v: Any) -> None:
        switcher.close()  # its last switch is done (every rank is here)
        tuned.notes.append(v.message)
        changed = v.keep != tuned.config  # the YAML, recipe and cache hold tuned.config
        if changed:
            tuned.config = v.keep
            tuned.recipe = _recipe(v.keep, tuned.active, tuned.yaml_path, tuned.recipe.tp)
            for listener in tuned.on_recipe:
                listener(tuned.recipe)
        if torch.distributed.get_rank() != 0:
            return
        with signals_deferred():  # a SIGTERM lands after the files: none half-written, none of another config
            _written(v, changed)

    def _written(v: Any, changed: bool) -> None:
        _update_report(tuned.yaml_path, {"in_run_verification": v.to_dict()}, log)
        if not changed:
            return
        why = "found no gain" if v.reverted else "measured the gain"
        chosen = f"{'reference' if v.reverted else v.keep.label} (the in-run verification {why})"
        if _write_yaml(tuned.yaml_path, v.keep, {**_key_meta(key), "chosen": chosen}, log):
            _write_recipe(tuned.yaml_path, tuned.recipe, log)
            _update_report(tuned.yaml_path, {"recipe": tuned.recipe.to_dict()}, log)
            what = "the starting config" if v.reverted else f"the {v.keep.label} config"
            log(f"{TAG} rewrote {tuned.yaml_path} with {what}; reproduce with: {tuned.recipe.line()}")
        try:
            cache.put(key, v.keep.ub, v.keep.disabled, {"time": time.time(), "tuned": {"chosen": chosen}})
        except OSError as e:
            log(f"{TAG} WARNING could not update the cache entry in {cache.root} ({e.strerror or e})")

    if candidate != tuned.config:  # the search's best, ahead but unresolved: it runs first, as a tuned config does
        switcher.apply(candidate)
        log(
            f"{TAG} {candidate.label} was ahead of the starting config but not beyond the interval the tuning budget "
            "allows: the run's own iterations settle it (the YAML keeps the starting config unless they show the gain)"
        )

    log(
        f"{TAG} verifying in the run: up to the next {span(iters)} iterations alternate the "
        f"{candidate.label} config and the starting one (ABBA; it stops once the interval decides)"
    )
    return InRunVerification(
        candidate,
        ref,
        iters,
        apply=switcher.apply,
        agree=lambda v: agree_max(v, None, "cuda"),
        sync=torch.cuda.synchronize,
        on_verdict=on_verdict,
        log=log,
    )
