"""``tune()``: the one entry point that tunes a live megatron-core model, for Megatron-LM's flag, Megatron-Bridge,
NeMo and the main job alike.

Trial steps go through Megatron's own ``forward_backward_func`` on micro-batches read ahead from the real
training iterator and handed back to it (the main loop sees the same batches in the same order); no optimizer
step; gradients zeroed; RNG states (incl. the TP RNG tracker) and TE FP8 metadata restored; iteration, LR
schedule and consumed samples are never touched.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from megatron_tp_overlap.engine.options import TuneOptions
from megatron_tp_overlap.engine.space import TuningConfig
from megatron_tp_overlap.integrations.megatron.flags import Recipe, switch_sets
from megatron_tp_overlap.integrations.megatron.in_run import TAG, _verification  # noqa: F401 - tests reach it here
from megatron_tp_overlap.integrations.megatron.outputs import (  # noqa: F401 - tests and tools reach them here
    _active,
    _key_meta,
    _recipe,
    _state_check,
    _tensorboard,
    _update_report,
    _verdict,
    _write_outputs,
    _write_recipe,
    _write_yaml,
    failed_report,
    recipe_path,
)
from megatron_tp_overlap.integrations.megatron.reuse import TUNED_HERE, _check, _reuse, relaunched  # noqa: F401
from megatron_tp_overlap.integrations.megatron.run_shape import RunShape
from megatron_tp_overlap.integrations.megatron.steps import MegatronSteps, trial_microbatches  # noqa: F401
from megatron_tp_overlap.ub.config import UbConfig


@dataclass
class Tuned:
    """What tuning left behind: the live config, the data iterator the main loop must use, and the files."""

    config: TuningConfig
    data_iterator: Any
    yaml_path: Path
    recipe: Recipe  # what reproduces ``config`` in a fresh run (YAML, flags to add and drop, config fields)
    result: Any = None  # engine TuneResult; None when a cached config was reused or tuning fell back
    reused: bool = False
    notes: list[str] = field(default_factory=list)
    verification: Any = None  # engine.verify.InRunVerification the training loop drives; None: nothing to verify
    active: frozenset[str] = frozenset()  # the GEMMs the run overlaps as its flags built it (for every recipe)
    coverage: dict = field(default_factory=dict)  # engine.coverage.Coverage.to_dict(): what runs with userbuffers
    on_recipe: list[Callable[[Recipe], Any]] = field(default_factory=list)  # told when the recipe changes (every rank)
    starting_config: Optional[dict] = None  # the NeMo preset(s) the starting config is, what for (report field)
    yaml_written: bool = True  # False: the disk refused the YAML (rank 0); the config is live in memory only


def hand_over(tuned: Any) -> Any:
    """``tuned.data_iterator`` for the main loop; ``tuned`` forgets it. Tuning's objects outlive it in reference
    cycles (the in-run verification's callback holds ``tuned``): an iterator reachable only from one is shut down by
    the cyclic garbage collector, late and slowly (:class:`~integrations.megatron.replay.ReadAhead`)."""
    it, tuned.data_iterator = tuned.data_iterator, None
    return it


def tune(
    model: list,
    forward_step_func: Callable,
    optimizer: Any,
    data_iterator: Any,
    run: RunShape,
    options: TuneOptions,
    reference: UbConfig,
    output: Path,
    *,
    trial_context: Callable[[], ContextManager] = contextlib.nullcontext,
    check_state: bool = False,
    log: Optional[Callable[..., None]] = None,
    remaining_iters: Optional[int] = None,
    capture: Any = None,
    recompute: Any = None,
    reference_name: Optional[str] = None,
    distributed_timeout_s: Optional[float] = None,
) -> Tuned:
    """Tune the userbuffers config of the live ``model`` (Megatron's model chunks, userbuffers initialized with
    ``reference``) before the first iteration; the chosen config is left applied and written to ``output``
    (YAML, ``.report.json`` beside it) and to the cache.

    ``trial_context``: entered around the trial steps (e.g. to pause the framework's fatal NaN checks: the
    numerics guard rejects such a candidate instead). ``check_state``: verify bitwise that tuning left the
    training state untouched (slow; for tests and benchmarks). ``remaining_iters``: training iterations the run
    has left (None: unknown); the in-run verification is shortened to end within them. ``capture``: when the run
    captures CUDA graphs (:class:`~integrations.megatron.graphs.Capture`); the verification ends before it.
    ``recompute``: the run's :class:`~integrations.megatron.recompute.Recompute` (for the coverage line).
    ``reference_name``: the preset ``reference`` was written from, when known (else it is recognised by content).
    ``distributed_timeout_s``: the run's own (Megatron's ``--distributed-timeout-minutes``): no agreement of the
    tuning waits longer.
    """
    import torch
    import transformer_engine

    from megatron_tp_overlap.engine.cache import TunedConfigCache, config_digest
    from megatron_tp_overlap.engine.tuner import rank0_print
    from megatron_tp_overlap.integrations.megatron.coverage import model_coverage
    from megatron_tp_overlap.ub.preset_shape import announce

    log = log or rank0_print
    covered = model_coverage(model, run.tp_comm_overlap, recompute)
    log(f"{TAG} {covered.line()}")
    starting = announce(reference, reference_name, run, torch.cuda.get_device_name(), log)  # preset for another shape?
    # as built, before any switch: a live config with a kind switched off also clears the modules' flags, and a
    # recipe read from them then left out the flag that switches it off (2 H200s: "bulk dgrad off" won, and the
    # recipe's fresh run overlapped qkv/fc1 dgrad again)
    active = _active(model)
    key = run.key(
        torch.cuda.get_device_name(),
        transformer_engine.__version__,
        config_digest(reference),
        ("allow_off" if options.allow_off else "yaml_only")
        + "+kind_switches+no_overlap+overlapped:"
        + ",".join(sorted(active))  # flags like --no-tp-comm-bulk-wgrad change what is overlapped
        + (f"+recompute:{run.recompute}" if run.recompute else ""),  # a recompute re-runs forwards: other costs
    )
    cache = TunedConfigCache(options.cache_dir)
    init = run.init_args()
    steps = MegatronSteps(model, forward_step_func, optimizer, data_iterator, run, options.microbatches)
    again = relaunched(key.digest())
    if again and not options.reuse:
        log(f"{TAG} {again}: reusing the config tuned for this shape before, after its numerics check in this run")
    if options.reuse or again:

        def check(config: TuningConfig) -> tuple[str | None, Any]:
            tuner = _make_tuner(model, steps, init, run, options, reference, log, timeout_s=distributed_timeout_s)
            return _check(tuner, steps, trial_context, config)

        found = _reuse(cache, key, reference, output, log, check)
        if found is not None:
            reused, switcher = found
            tuned = Tuned(
                reused,
                steps.data.release(),
                output,
                _recipe(reused, active, output, run.tp),
                reused=True,
                active=active,
                coverage=covered.to_dict(),
            )
            tuned.verification = _verification(
                tuned, reference, switcher, options, key, cache, log, remaining_iters, capture=capture
            )
            if tuned.verification is None:
                switcher.close()
            return tuned

    state_check = _state_check(model, optimizer, steps) if check_state else None
    t0 = time.perf_counter()
    failure: list[str] = []
    result, switcher = _search(
        model, steps, init, run, options, reference, trial_context, log, failure, distributed_timeout_s
    )
    tuned = Tuned(
        result.best if result else TuningConfig(reference, frozenset(), "reference"),
        steps.data.release(),
        output,
        Recipe(str(output), [], [], {}),
        result,
        active=active,
        coverage=covered.to_dict(),
        starting_config=starting,
    )
    if result is None:
        tuned.notes.append(f"tuning failed ({'; '.join(failure) or 'no result'}): training with the starting config")
    else:
        log(result.summary)
        if state_check is not None:
            result.report["state_check"] = _verdict(state_check, log)
    tuned.recipe = _recipe(tuned.config, active, output, run.tp)  # the search kept to this run's dgrad mode
    _write_outputs(tuned, key, cache, time.perf_counter() - t0, log)
    written = [tuned.yaml_written]  # rank 0's disk decides for every rank's config (Bridge names the YAML)
    torch.distributed.broadcast_object_list(written, src=0)
    tuned.yaml_written = written[0]
    TUNED_HERE.add(key.digest())
    _tensorboard(result)
    undecided = result.search.undecided if result is not None else None
    tuned.verification = _verification(
        tuned, reference, switcher, options, key, cache, log, remaining_iters, undecided=undecided, capture=capture
    )
    if tuned.verification is None and switcher is not None:
        switcher.close()
    torch.distributed.barrier()
    return tuned


def _search(
    model: list,
    steps: MegatronSteps,
    init: Any,
    run: RunShape,
    options: TuneOptions,
    reference: UbConfig,
    trial_context: Callable[[], ContextManager],
    log: Callable[..., None],
    failure: Optional[list[str]] = None,
    timeout_s: Optional[float] = None,
) -> tuple[Any, Any]:
    """The engine's search on Megatron's trial steps, and the switcher that applied its configs; (None, None) when
    every trial failed or the layout cannot be tuned (all ranks agree on that; why goes to ``failure``)."""
    import torch

    from megatron_tp_overlap.engine.progress import TuningProgress
    from megatron_tp_overlap.engine.search import TrialFailed
    from megatron_tp_overlap.engine.topology import TopologyMismatch

    progress = TuningProgress(enabled=torch.distributed.get_rank() == 0)
    tuner = _make_tuner(model, steps, init, run, options, reference, log, progress.update, timeout_s)
    steps.zero()
    signals: list[int] = []
    try:
        with trial_context(), progress, interrupt_on_sigterm(signals):
            return tuner.tune(), tuner.switcher
    except TopologyMismatch as e:  # before any trial, on every rank: the starting config is still live
        log(f"{TAG} WARNING cannot tune this layout: {e}; training with the starting config")
        if failure is not None:
            failure.append(f"cannot tune this layout: {e}")
        return None, None
    except TrialFailed as e:  # raised on every rank together: the run trains on with its own config
        log(f"{TAG} WARNING tuning failed ({e}); training with the starting config")
        if failure is not None:
            failure.append(str(e))
        tuner.switcher.apply(TuningConfig(reference, frozenset(), "reference"))
        tuner.switcher.close()
        return None, None
    except BaseException as e:  # after the two above: a clause is chosen in order, and this one re-raises
        # Ctrl-C, or SIGTERM from torchrun / the scheduler (whose other handlers, e.g. a DataLoader's, may replace
        # the KeyboardInterrupt on the way out)
        if isinstance(e, KeyboardInterrupt) or signals:
            log(
                f"{TAG} tuning interrupted: nothing written (an existing YAML, report and cache entry are as they were)"
            )
        raise
    finally:
        steps.zero()
        steps.snapshot.restore()


def _make_tuner(
    model: list,
    steps: MegatronSteps,
    init: Any,
    run: RunShape,
    options: TuneOptions,
    reference: UbConfig,
    log: Callable[..., None],
    progress: Any = None,
    timeout_s: Optional[float] = None,
) -> Any:
    from megatron_tp_overlap.engine.search import SearchOptions
    from megatron_tp_overlap.engine.space import SpaceSpec
    from megatron_tp_overlap.engine.tuner import Autotuner
    from megatron_tp_overlap.integrations.megatron.groups import gloo_groups_enabled

    # Megatron builds every qkv/fc1 layer with bulk dgrad, or with GEMM+reduce-scatter dgrad under
    # --tp-comm-overlap-rs-dgrad; the YAML cannot change that, so the search keeps to the run's mode
    # (else the tuned YAML would not reproduce the tuned run).
    spec = SpaceSpec(include_off=options.allow_off, include_rs_dgrad=run.rs_dgrad, include_bulk_dgrad=not run.rs_dgrad)
    return Autotuner(
        model,
        steps.step,
        init,
        reference=reference,
        options=SearchOptions(strategy=options.strategy, max_steps=options.steps, max_seconds=options.seconds),
        space_spec=spec,
        verify_fn=steps.fingerprint,
        verify_rtol=options.rtol,
        allow_overlap_off=options.allow_off,
        log=log,
        progress=progress,
        trial_timeout_s=options.trial_timeout,
        switch_sets=switch_sets(run.rs_dgrad),
        gloo=gloo_groups_enabled(),
        distributed_timeout_s=timeout_s,
    )


@contextlib.contextmanager
def interrupt_on_sigterm(seen: list[int] | None = None) -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt inside the block (as Ctrl-C does), so tuning stops where Python can clean up
    (temporary files, a message) instead of dying mid-write; ``seen`` records the signal; the previous handler is
    back afterwards."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        if seen is not None:
            seen.append(signum)
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


__all__ = ["MegatronSteps", "Tuned", "tune"]
