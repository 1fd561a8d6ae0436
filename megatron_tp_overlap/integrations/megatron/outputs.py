"""What tuning leaves behind on rank 0, each written atomically and none fatal: the YAML for --tp-comm-overlap-cfg,
the report beside it, the recipe (flags and config fields that reproduce the config), the cache entry, TensorBoard
scalars; and the bitwise check that tuning left the training state as it was (tests, benchmarks)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_tp_overlap.engine.space import TuningConfig
from megatron_tp_overlap.integrations.megatron.flags import Recipe, recipe

if TYPE_CHECKING:
    from megatron_tp_overlap.integrations.megatron.steps import MegatronSteps
    from megatron_tp_overlap.integrations.megatron.tuning import Tuned

TAG = "[tp-overlap-autotune]"


def _active(model: list) -> frozenset[str]:
    """The GEMMs the model's TE modules overlap, as built (the run's flags decide)."""
    from megatron_tp_overlap.engine.topology import build_topology, find_overlap_modules

    try:
        return frozenset(build_topology(find_overlap_modules(model)).active)
    except ValueError:  # no overlap module on this rank (a pipeline stage)
        return frozenset()


def _recipe(config: TuningConfig, active: frozenset[str], output: Path, tp: int) -> Recipe:
    return recipe(config.ub, config.disabled, active, output, tp=tp)


def recipe_path(yaml_path: Path) -> Path:
    return yaml_path.with_suffix(".recipe.txt")


def _write_recipe(yaml_path: Path, r: Recipe, log: Callable) -> None:
    """``<output minus .yaml>.recipe.txt``: the flags line to paste, and the config fields for Megatron-Bridge / NeMo."""
    from megatron_tp_overlap.atomic import atomic_write_text

    lines = [
        "# Megatron-LM flags (add; drop where it says so):",
        r.line(),
        "# megatron-core TransformerConfig / Megatron-Bridge model config fields:",
        *(f"{k} = {v!r}" for k, v in r.fields.items()),
    ]
    if r.problem:
        lines.append(f"# cannot be fully reproduced: {r.problem}")
    lines += [
        "# NeMo 2 (from megatron_tp_overlap.ub.layer_cfg import load_layer_cfg):",
        r.nemo_line(),
    ]
    if r.nemo_problem:
        lines.append(f"# NeMo's TransformerLayerTPOverlapCfg cannot hold this config: {r.nemo_problem}")
    try:
        atomic_write_text(recipe_path(yaml_path), "\n".join(lines) + "\n")
    except OSError as e:
        log(f"{TAG} WARNING could not write {recipe_path(yaml_path)} ({_why(e)}); the recipe is: {r.line()}")


def _why(e: OSError) -> str:
    """An OSError without its path (the line names the path): ``No space left on device``."""
    return e.strerror or str(e)


def _key_meta(key: Any) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(key)


def _update_report(yaml_path: Path, extra: dict[str, Any], log: Callable) -> None:
    import json

    from megatron_tp_overlap.engine.report import write_report

    path = yaml_path.with_suffix(".report.json")
    try:
        report = json.loads(path.read_text()) if path.exists() else {}
        write_report(path, {**report, **extra})
    except (OSError, ValueError) as e:
        log(f"{TAG} WARNING could not update {path} ({_why(e) if isinstance(e, OSError) else e})")


def _write_yaml(path: Path, config: TuningConfig, meta: dict[str, Any], log: Callable[..., None]) -> bool:
    from megatron_tp_overlap.atomic import atomic_write_text
    from megatron_tp_overlap.engine.report import yaml_header
    from megatron_tp_overlap.ub.config import dumps_yaml

    text = dumps_yaml(config.ub, yaml_header(config.ub, meta))
    try:
        atomic_write_text(path, text, backup=True)
        return True
    except OSError as e:  # a full or read-only disk: the run keeps training with the config live in memory
        log(
            f"{TAG} WARNING could not write {path} ({_why(e)}): it is as it was; this run trains on with the "
            f"{config.label} config in memory: {config.describe()}"
        )
        return False


def _write_outputs(tuned: Tuned, key: Any, cache: Any, wall_s: float, log: Callable[..., None]) -> None:
    """Rank 0: the YAML, the report beside it, the cache entry (each atomic; a failure is one line naming the path,
    not fatal); a SIGTERM meanwhile lands after the last of them (``atomic.signals_deferred``)."""
    import torch

    from megatron_tp_overlap.atomic import signals_deferred

    if torch.distributed.get_rank() != 0:
        return
    with signals_deferred():
        tuned.yaml_written = _write_all(tuned, key, cache, wall_s, log)


def _write_all(tuned: Tuned, key: Any, cache: Any, wall_s: float, log: Callable[..., None]) -> bool:
    import datetime
    import time
    from dataclasses import asdict

    from megatron_tp_overlap.engine.report import write_report

    res, out = tuned.result, tuned.yaml_path
    meta = {**asdict(key), "wall_s": round(wall_s, 2), "chosen": tuned.config.label}
    ok = _write_yaml(out, tuned.config, meta, log)
    # a failed tuning's report says so: a report of an earlier run beside this YAML would name another config
    report = res.report if res is not None else failed_report(tuned.notes, wall_s)
    try:
        write_report(
            out.with_suffix(".report.json"),
            {
                **report,
                "tuning_key": asdict(key),
                "coverage": tuned.coverage,
                "recipe": tuned.recipe.to_dict(),
                "notes": tuned.notes,
            }
            | ({"starting_config": tuned.starting_config} if tuned.starting_config else {}),
        )
    except OSError as e:
        log(f"{TAG} WARNING could not write {out.with_suffix('.report.json')} ({_why(e)}); the summary is in the log")
    if res is not None:
        try:
            cache.put(
                key,
                tuned.config.ub,
                tuned.config.disabled,
                {
                    "date": datetime.date.today().isoformat(),
                    "time": time.time(),  # a relaunch reuses it (integrations.megatron.reuse)
                    "tuned": {"chosen": tuned.config.label},
                },
            )
        except OSError as e:
            log(f"{TAG} WARNING could not write the cache entry in {cache.root} ({_why(e)}): a later run tunes again")
    if ok:
        _write_recipe(out, tuned.recipe, log)
        log(f"{TAG} wrote {out} ({tuned.config.label}; {wall_s:.1f} s); reproduce with: {tuned.recipe.line()}")
        if tuned.recipe.problem:
            log(f"{TAG} WARNING the tuned config cannot be fully reproduced from flags: {tuned.recipe.problem}")
    return ok


def failed_report(notes: list[str], wall_s: float) -> dict[str, Any]:
    """The report of a tuning that found nothing to choose (every trial failed, or the layout cannot be tuned): the
    run trains on with its starting config, and the report (read by people and tools like an engine report) says
    why."""
    reason = "; ".join(notes) or "tuning failed: training with the starting config"
    return {"decision": {"chosen": "reference", "reason": reason}, "summary": reason, "meta": {"wall_s": wall_s}}


def _state_check(model: list, optimizer: Any, steps: MegatronSteps) -> Any:
    from megatron_tp_overlap.integrations.megatron.state import StateCheck

    return StateCheck(model, optimizer, replays=steps.data.replays)


def _verdict(check: Any, log: Callable[..., None]) -> dict[str, Any]:
    """The state check's verdict over every rank, logged and for the report."""
    import torch

    bad, covered = check.mismatches(), check.kinds_checked()
    if bad:
        print(f"{TAG} rank {torch.distributed.get_rank()}: training state CHANGED by tuning: {bad}", flush=True)
    n_bad = torch.tensor([float(len(bad))], device="cuda")
    torch.distributed.all_reduce(n_bad, op=torch.distributed.ReduceOp.MAX)
    bad = bad or (["(on another rank)"] if n_bad.item() else [])
    log(
        f"{TAG} training state after tuning: "
        + (
            f"bitwise identical ({', '.join(f'{v} {k}' for k, v in covered.items())}, RNG CPU/CUDA/TP tracker)"
            if not bad
            else f"CHANGED: {bad[:8]}"
        )
    )
    return {
        "result": "bitwise identical on every rank" if not bad else "CHANGED",
        "changed_rank0": bad,
        "checked_rank0": covered,
    }


def _tensorboard(res: Any) -> None:
    """Tuning results into Megatron's TensorBoard writer, on the rank that has one (the last)."""
    if res is None:
        return
    try:
        from megatron.training import get_tensorboard_writer
    except ImportError:  # Megatron-Bridge and NeMo run without megatron.training's globals
        return
    writer = get_tensorboard_writer()
    if writer is None:
        return
    for c in res.search.contenders:
        if c.samples:
            writer.add_scalar(f"tp-overlap-autotune/step-ms/{c.name}", c.median, 0)
    writer.add_scalar("tp-overlap-autotune/tuning-seconds", res.wall_s, 0)
    writer.add_text("tp-overlap-autotune/summary", f"<pre>{res.summary}</pre>", 0)
    writer.flush()
