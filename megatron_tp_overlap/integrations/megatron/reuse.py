"""Reusing a config tuned before for the same run key: rank 0 reads the cache, every rank gets its answer, and the
config must pass the numerics check in this run before it is applied."""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_tp_overlap.engine.space import TuningConfig
from megatron_tp_overlap.integrations.megatron.outputs import _write_yaml
from megatron_tp_overlap.ub.config import UbConfig

if TYPE_CHECKING:
    from megatron_tp_overlap.integrations.megatron.steps import MegatronSteps

TAG = "[tp-overlap-autotune]"
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"
TUNED_HERE: set[str] = set()  # digests of the keys tuned in this process


def _reuse(
    cache: Any, key: Any, reference: UbConfig, output: Path, log: Callable[..., None], check: Callable
) -> tuple[TuningConfig, Any] | None:
    """The cached config for ``key``, applied after it passed the numerics check (``check``), and the switcher that
    applied it; rank 0 reads the cache and every rank gets its answer. None: nothing cached, or it failed the
    check (the starting config is live again)."""
    import torch

    found = [_get(cache, key, log) if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(found, src=0)
    if found[0] is None:
        return None
    config = TuningConfig(found[0].ub, found[0].disabled, "reused")
    bad, switcher = check(config)
    if bad:
        log(
            f"{TAG} WARNING the cached config ({cache.root}) fails the numerics check in this run ({bad}): tuning again"
        )
        switcher.apply(TuningConfig(reference, frozenset(), "reference"))
        switcher.close()  # tuning again makes a switcher of its own
        return None
    if torch.distributed.get_rank() == 0:
        _write_yaml(output, config, {"reused_from": str(cache.root), **found[0].meta.get("tuned", {})}, log)
    log(
        f"{TAG} reusing the config tuned {found[0].meta.get('date', '')} for this GPU, shape, dtype and TE version "
        f"({cache.root}), numerics checked in this run: tuning skipped; wrote {output}"
    )
    return config, switcher


def _get(cache: Any, key: Any, log: Callable[..., None]) -> Any:
    """Rank 0's read of the cache, which never raises: the other ranks wait for its answer in a broadcast."""
    try:
        found = cache.get(key)
    except OSError as e:  # another account's cache this one may not read, a broken mount
        log(f"{TAG} WARNING cannot read the tuned-config cache {cache.root} ({e.strerror or e}): tuning")
        return None
    if found is None:
        log(f"{TAG} no config tuned before for this GPU, shape, dtype and TE version in {cache.root}: tuning")
    return found


def relaunched(digest: str) -> str | None:
    """Why this launch follows one that tuned the same shape (then it reuses), or None: torchrun and the
    fault-tolerance launcher of nvidia-resiliency-ext count relaunches in ``TORCHELASTIC_RESTART_COUNT``; an
    in-process restart (nvidia-resiliency-ext's ``inprocess``) calls tuning again in the same process."""
    n = os.environ.get(RESTART_ENV, "")
    if n.isdigit() and int(n) > 0:
        return f"relaunched ({RESTART_ENV}={n})"
    return "restarted in this process" if digest in TUNED_HERE else None


def _check(
    tuner: Any, steps: MegatronSteps, trial_context: Callable[[], ContextManager], config: TuningConfig
) -> tuple[str | None, Any]:
    """The numerics check of ``config`` against no overlap (what tuning checks every candidate with); ``config`` is
    live afterwards. (why it failed or None, the switcher)."""
    try:
        with trial_context():
            with tuner.agreeing():
                bad = tuner.verify(config)
        if not bad:
            tuner.switcher.apply(config)
    finally:
        steps.zero()
        steps.snapshot.restore()
    return bad, tuner.switcher
