"""Installation into Megatron-LM: it has no callback registry, so :func:`install` patches three module
attributes (idempotent):

- ``megatron.training.arguments.parse_args``: chains our flags into Megatron's own parser (whatever
  ``extra_args_provider`` the script passes) and rejects bad combinations before any GPU work;
- ``megatron.training.training.train``: tunes (:func:`~integrations.megatron.tuning.tune`) after model and
  optimizer setup and before the first iteration, then calls the original ``train``;
- ``megatron.core.datasets.utils.compile_helpers``: skips ``make`` when the compiled dataset helpers are
  importable (a pip-installed megatron-core ships them but not the Makefile).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

from megatron_tp_overlap.errors import refuse
from megatron_tp_overlap.integrations.megatron.flags import (
    add_arguments,
    check_arguments,
    options_from_args,
    output_path,
    reference_from_args,
)
from megatron_tp_overlap.integrations.megatron.graphs import Capture
from megatron_tp_overlap.integrations.megatron.recompute import Recompute
from megatron_tp_overlap.integrations.megatron.run_shape import RunShape
from megatron_tp_overlap.integrations.megatron.tuning import hand_over, tune
from megatron_tp_overlap.ub.preset_shape import preset_named_in

CHECK_STATE_ENV = "MEGATRON_TP_OVERLAP_CHECK_STATE"  # 1: verify bitwise that tuning left the training state as it was


_installed = False


def _helpers_importable() -> bool:
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401

        return True
    except ImportError:
        return False


def guarded_compile_helpers(original: Callable[[], None]) -> Callable[[], None]:
    """``compile_helpers`` that skips ``make`` when the compiled dataset helpers already import."""

    def compile_helpers() -> None:
        if _helpers_importable():  # pip wheel: compiled, no Makefile
            return
        original()

    return compile_helpers


DETERMINISTIC_ENV = "MEGATRON_TP_OVERLAP_DETERMINISTIC"


def deterministic_with_overlap() -> None:
    """What Megatron's ``--deterministic-mode`` sets up, for runs with ``--tp-comm-overlap`` (which that
    flag refuses): the NCCL/cuBLAS/TE environment for deterministic kernels and
    ``torch.use_deterministic_algorithms`` (warn-only). Must run before the first NCCL/cuBLAS/TE call.
    Enabled by MEGATRON_TP_OVERLAP_DETERMINISTIC=1 (bitwise run-to-run comparisons)."""
    import torch

    try:
        from megatron.training.determinism import apply_determinism_env

        apply_determinism_env(os.environ)
    except ImportError:  # older Megatron: the same defaults
        for k, v in {
            "NCCL_ALGO": "Ring",
            "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
            "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        }.items():
            os.environ.setdefault(k, v)
    torch.use_deterministic_algorithms(True, warn_only=True)


class IterationLog:
    """Per training iteration, one JSON line per rank: wall time and the exact losses (``repr`` of the floats),
    for step-time plots and bitwise loss comparisons between runs. Written through Megatron's ``training_log``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def wrap(self, original: Callable) -> Callable:
        def training_log(loss_dict, total_loss_dict, learning_rate, iteration, *rest, **kw):
            if loss_dict:
                vals = {k: float(v.item() if hasattr(v, "item") else v) for k, v in loss_dict.items()}
                row = {"iteration": iteration, "t": time.time(), **{k: repr(v) for k, v in vals.items()}}
                with open(f"{self.path}.rank{int(os.environ.get('RANK', 0))}", "a") as f:
                    f.write(json.dumps(row) + "\n")
            return original(loss_dict, total_loss_dict, learning_rate, iteration, *rest, **kw)

        return training_log


def _te_available() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        return False
    return True


def _parse_args_with_flags(original_parse: Callable) -> Callable:
    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        def provider(parser):
            parser = extra_args_provider(parser) if extra_args_provider is not None else parser
            return add_arguments(parser)

        args = original_parse(provider, ignore_unknown_args)
        problems = check_arguments(args, _te_available())
        if problems:
            refuse("megatron-tp-overlap: cannot autotune with these flags:\n" + "\n".join(f"  - {p}" for p in problems))
        return args

    return parse_args


@contextlib.contextmanager
def _fatal_checks_paused(args: Any) -> Iterator[None]:
    """Megatron's NaN/spike checks end the job; during trials the numerics guard rejects such a candidate instead."""
    keys = ("check_for_nan_in_loss_and_grad", "check_for_spiky_loss")
    saved = {k: getattr(args, k, False) for k in keys}
    try:
        for k in keys:
            setattr(args, k, False)
        yield
    finally:
        for k, v in saved.items():
            setattr(args, k, v)


def _train_after_tuning(original_train: Callable) -> Callable:
    import megatron.training.training as mtraining

    def train(forward_step_func, model, optimizer, opt_param_scheduler, train_data_iterator, *rest, **kw):
        from megatron.training import get_args

        args = get_args()
        verification = None
        if getattr(args, "tp_comm_overlap_autotune", False):
            tuned = tune(
                model,
                forward_step_func,
                optimizer,
                train_data_iterator,
                RunShape.from_args(args),
                options_from_args(args),
                reference_from_args(args),
                output_path(args),
                trial_context=lambda: _fatal_checks_paused(args),
                reference_name=preset_named_in(getattr(args, "tp_comm_overlap_cfg", None)),
                check_state=os.environ.get(CHECK_STATE_ENV) == "1",
                remaining_iters=args.train_iters - (getattr(args, "iteration", 0) or 0) if args.train_iters else None,
                capture=Capture.of(args, getattr(args, "iterations_to_skip", None) or ()),  # CUDA graphs, if any
                recompute=Recompute.of(args),
                distributed_timeout_s=_minutes(getattr(args, "distributed_timeout_minutes", None)),
            )
            train_data_iterator, verification = hand_over(tuned), tuned.verification
        with verifying(mtraining, "train_step", verification):
            return original_train(
                forward_step_func, model, optimizer, opt_param_scheduler, train_data_iterator, *rest, **kw
            )

    return train


def _minutes(m: Any) -> Optional[float]:
    """Seconds of a ``*_timeout_minutes`` setting (Megatron-LM's, Megatron-Bridge's), None where unset."""
    return float(m) * 60 if isinstance(m, (int, float)) and m > 0 else None


@contextlib.contextmanager
def verifying(module: Any, name: str, verification: Any) -> Iterator[None]:
    """``module.<name>`` (the framework's training-iteration function, looked up by the loop at each iteration)
    wrapped in ``verification.before()`` / ``after()`` until the verification is done; the original is back after.
    Nothing is wrapped when ``verification`` is None."""
    original = getattr(module, name, None)
    if verification is None:
        yield
        return
    if original is None:  # another version of the framework: train unverified rather than fail
        print(
            f"[tp-overlap-autotune] WARNING {module.__name__}.{name} not found: in-run verification skipped", flush=True
        )
        yield
        return

    def step(*args: Any, **kwargs: Any) -> Any:
        verification.before()
        out = original(*args, **kwargs)
        verification.after()
        if verification.done:
            setattr(module, name, original)
        return out

    setattr(module, name, step)
    try:
        yield
    finally:
        setattr(module, name, original)


def install(iteration_log: Optional[str | Path] = None) -> None:
    """Patch Megatron (idempotent). Call before ``parse_and_validate_args`` / ``pretrain``.

    ``iteration_log``: also write :class:`IterationLog` lines (``<path>.rank<N>``) for every training iteration.
    """
    global _installed
    if _installed:
        return
    import megatron.core.datasets.utils as ds_utils
    import megatron.training.arguments as margs
    import megatron.training.training as mtraining

    if os.environ.get(DETERMINISTIC_ENV) == "1":
        deterministic_with_overlap()
    margs.parse_args = _parse_args_with_flags(margs.parse_args)
    ds_utils.compile_helpers = guarded_compile_helpers(ds_utils.compile_helpers)
    mtraining.train = _train_after_tuning(mtraining.train)
    if iteration_log is not None:
        mtraining.training_log = IterationLog(iteration_log).wrap(mtraining.training_log)
    _installed = True


USAGE = """Run an unmodified Megatron-LM training script with the autotune plugin installed:

    torchrun --nproc-per-node=N -m megatron_tp_overlap.run [--iteration-log PATH] pretrain_gpt.py <Megatron args> \\
        --tp-comm-overlap --tp-comm-overlap-autotune

Check a launch without GPUs (megatron-core installed): Megatron's parser and validate_args at N processes, then what
tuning would do and write:

    python -m megatron_tp_overlap.run --dry-run --world-size N pretrain_gpt.py <Megatron args> ...

The script runs as ``__main__`` with its own folder first on ``sys.path`` (as ``python script.py`` would),
after :func:`install` patched Megatron."""


def help_text() -> str:
    """The usage and the plugin's flags, as Megatron's parser will show them (no Megatron import: readable anywhere)."""
    import argparse

    flags = add_arguments(
        argparse.ArgumentParser(prog="megatron_tp_overlap.run", add_help=False, usage=argparse.SUPPRESS)
    )
    return f"{USAGE}\n\n{flags.format_help().strip()}"


def run_script(argv: list[str]) -> None:
    """``-m megatron_tp_overlap.run``: install, then run the training script as ``__main__``."""
    import runpy
    import sys

    log = None
    if argv[:1] == ["--iteration-log"] and len(argv) >= 2:
        log, argv = argv[1], argv[2:]
    if argv[:1] == ["--version"]:
        from megatron_tp_overlap import __version__

        print(f"megatron-tp-overlap {__version__}")
        raise SystemExit(0)
    if not argv or argv[0] in ("-h", "--help"):
        print(help_text())
        raise SystemExit(0 if argv else 2)
    if argv[0] == "--dry-run":
        from megatron_tp_overlap.integrations.megatron.dry_run import dry_run

        raise SystemExit(dry_run(argv[1:]))
    script = argv[0]
    if not os.path.isfile(script):
        refuse(f"megatron_tp_overlap.run: training script not found: {script}")
    try:
        import megatron.training  # noqa: F401
    except ImportError as e:
        refuse(
            "megatron_tp_overlap.run needs Megatron-LM's megatron.training (megatron-core with Transformer Engine: "
            f"pip install -e '.[te]'); importing it failed: {e}"
        )
    install(iteration_log=log)
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
