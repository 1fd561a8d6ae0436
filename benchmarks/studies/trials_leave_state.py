"""Do the tuner's trial steps leave a run exactly as it would have been? The first iterations' losses of a run that
ran trial steps before its first iteration, against two runs that did not (one GPU, TP=1, Megatron-LM's own
``pretrain_gpt.py``), bitwise; for MoE models the router's aux losses and load-balancing metrics as well.

    python benchmarks/studies/trials_leave_state.py --script .device/megatron-lm/pretrain_gpt.py --iters 20 \\
        --extra='--num-experts 8 --moe-router-topk 2 ...' --out DIR

The trial steps are tuning's own: ``MegatronSteps`` (trial micro-batches read ahead from the run's iterator and
handed back, Megatron's ``forward_backward_func``, gradients zeroed, every module buffer and the MoE metrics put back
after each step, CUDA graphs kept from capturing), numerics fingerprints as the guard takes them, and at the end the
snapshot restored and the iterator released, in the order ``tune()`` runs them; ``StateCheck`` then compares
parameters, gradients, optimizer state, FP8 metadata, buffers, MoE metrics, RNG and data position bitwise. What
tuning adds on GPUs with TP (userbuffers switches) is not in it: that needs TP (the 2-GPU issue). Runs are
deterministic (``MEGATRON_TP_OVERLAP_DETERMINISTIC=1``: Megatron's determinism environment); the second run without
trials is the control: a difference there means the run itself is not reproducible, and then the comparison says
nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
RUNS = ("no trials", "no trials again", "trials")


def iteration_row(iteration: int, loss_dict: dict) -> dict:
    """One training iteration's exact losses (``repr`` of the floats) and the MoE metrics the training loop's log is
    about to report; call before that log, which clears them (Megatron-LM's ``training_log`` and Bridge's alike)."""
    from megatron_tp_overlap.integrations.megatron.state import moe_metrics_tracker

    tracker = moe_metrics_tracker()
    moe = {n: [repr(float(v)) for v in e.values.tolist()] for n, e in tracker.metrics.items()} if tracker else {}
    return {"iteration": iteration, **{k: repr(float(v)) for k, v in loss_dict.items()}, "moe": moe}


def run_trials(
    model: list,
    forward_step_func: Callable,
    optimizer: Any,
    data_iterator: Any,
    run: Any,
    trials: int,
    meta: dict,
    check_state: bool = True,
    switch: Optional[Callable[[], None]] = None,
    steps_per_switch: int = 3,
) -> tuple[Any, Any]:
    """``trials`` of tuning's own trial steps before the first iteration, in the order ``tune()`` runs them (``switch``:
    called before every ``steps_per_switch`` steps, e.g. a simulated userbuffers switch at TP=1); returns the data
    iterator the training loop must use and the ``StateCheck`` (None unless ``check_state``). ``meta`` gets the
    check's result and the trial micro-batches."""
    import torch

    from megatron_tp_overlap.integrations.megatron.outputs import _state_check
    from megatron_tp_overlap.integrations.megatron.tuning import MegatronSteps, hand_over

    steps = MegatronSteps(model, forward_step_func, optimizer, data_iterator, run)
    check = _state_check(model, optimizer, steps) if check_state else None
    steps.zero()
    for i in range(trials):
        if switch is not None and i % steps_per_switch == 0:
            switch()
        steps.step()
        if i in (0, trials - 1):  # the numerics guard's fingerprints
            steps.fingerprint()
    steps.zero()
    steps.snapshot.restore()
    torch.cuda.synchronize()
    if check is not None:
        meta["state_check_mismatches"], meta["state_check_covered"] = check.mismatches(), check.kinds_checked()
    meta["trial_microbatches"] = steps.n_mb
    holder = type("Tuned", (), {})()
    holder.data_iterator = steps.data.release()
    return hand_over(holder), check


def inner(out: Path, trials: int, argv: list[str]) -> None:
    import megatron.training.training as training
    from megatron.training import get_args

    from megatron_tp_overlap.integrations.megatron.launcher import run_script
    from megatron_tp_overlap.integrations.megatron.run_shape import RunShape

    original_train, original_log, rows, meta = training.train, training.training_log, [], {"trials": trials}

    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, *rest, **kw):
        rows.append(iteration_row(iteration, loss_dict))
        return original_log(loss_dict, total_loss_dict, learning_rate, iteration, *rest, **kw)

    def train(forward_step_func, model, optimizer, scheduler, data_iterator, *rest, **kw):
        if trials:
            run = RunShape.from_args(get_args())
            data_iterator, _ = run_trials(model, forward_step_func, optimizer, data_iterator, run, trials, meta)
        return original_train(forward_step_func, model, optimizer, scheduler, data_iterator, *rest, **kw)

    training.train, training.training_log = train, training_log
    try:
        run_script(argv)
    finally:
        if int(os.environ.get("RANK", "0")) == 0:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({**meta, "iterations": rows}) + "\n")


def run_file(out: Path, name: str) -> Path:
    """Where run ``name`` writes its iterations (``out/no_trials.json``, ...)."""
    return out / f"{name.replace(' ', '_')}.json"


def read_runs(out: Path, names: list[str]) -> dict[str, dict]:
    """Each run's file; a run that wrote none (it died before) has no iterations."""
    return {n: json.loads(f.read_text()) if (f := run_file(out, n)).exists() else {"iterations": []} for n in names}


def compare(runs: dict[str, dict], iters: int) -> dict:
    """Per run pair, the first iteration whose losses or MoE metrics differ (None: bitwise equal)."""

    def first_diff(a: list[dict], b: list[dict]) -> int | None:
        for x, y in zip(a[:iters], b[:iters]):
            if x != y:
                return x.get("iteration")
        return None if len(a) >= iters and len(b) >= iters else -1

    base = runs["no trials"]["iterations"]
    control = runs.get("no trials again")
    return {
        "control (no trials twice)": first_diff(base, control["iterations"]) if control else "not run",
        "trials vs no trials": first_diff(base, runs["trials"]["iterations"]),
        "iterations compared": min(iters, *(len(r["iterations"]) for r in runs.values())),
        "state check after trials": runs["trials"].get("state_check_mismatches"),
        "checked": runs["trials"].get("state_check_covered"),
    }


def main() -> None:
    from megatron_autotune import FP8_ARGS, one_gpu_args, parse_model_shape

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--script", help="Megatron-LM's pretrain_gpt.py (core_v0.19.0)")
    p.add_argument("--iters", type=int, default=20, help="training iterations compared")
    p.add_argument("--trials", type=int, default=30, help="trial steps before the first iteration")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--shape", default="", help="model keys of benchmarks/megatron_autotune.MODEL, e.g. hidden=3072")
    p.add_argument("--fp8", action="store_true", help="FP8 GEMMs (--fp8-format hybrid)")
    p.add_argument("--extra", default="", help="more Megatron-LM arguments, one string (MoE, recompute, graphs)")
    p.add_argument(
        "--no-control",
        action="store_true",
        help="skip the second run without trials (when the same command's control already ran: it costs a run)",
    )
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--inner", default=None, help=argparse.SUPPRESS)
    a, rest = p.parse_known_args()
    out = Path(a.out)
    if a.inner is not None:
        inner(Path(a.inner), a.trials, rest)
        return
    if a.iters < 1 or a.trials < 2:
        p.error("--iters must be >= 1 and --trials >= 2")
    args = one_gpu_args(a.seq, a.iters, **parse_model_shape(a.shape)) + (FP8_ARGS if a.fp8 else [])
    args += shlex.split(a.extra)
    env = {**os.environ, "MEGATRON_TP_OVERLAP_DETERMINISTIC": "1"}
    codes = {}
    for name in [r for r in RUNS if not (a.no_control and r == "no trials again")]:
        f = run_file(out, name)
        f.unlink(missing_ok=True)  # a file of an earlier call must not stand in for a run that dies
        trials = a.trials if name == "trials" else 0
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", __file__, "--inner", str(f)]
        cmd += ["--trials", str(trials), a.script, *args]
        print(" ".join(cmd), flush=True)
        codes[name] = subprocess.run(cmd, env=env).returncode
    runs = read_runs(out, list(codes))
    result = {"extra": a.extra, "shape": a.shape, "fp8": a.fp8, "exit_codes": codes, **compare(runs, a.iters)}
    result["first_losses"] = {n: [r.get("lm loss") for r in run["iterations"][:3]] for n, run in runs.items()}
    (out / "trials_leave_state.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"[trials_leave_state] {json.dumps(result)}", flush=True)
    sys.exit(max(codes.values()))


if __name__ == "__main__":
    main()
