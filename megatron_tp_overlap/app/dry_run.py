"""``python -m megatron_tp_overlap.train --dry-run [--world-size=N] [--gpu=h100] [overrides]``: the main job's launch
checked without GPUs. It validates what the launch validates (:func:`app.config.validate`, and the starting config
against the GPU's SM count as the tuner does), then prints the model's dimensions (resolved from ``model.hf``), the
userbuffers shape, the search's slots and the size of its space, the budget, and where every file will be written.
Exit 0 only when the real launch would pass validation; 2 otherwise, with the same lines."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Optional

from megatron_tp_overlap.app.config import ModelConfig, model_provenance, validate
from megatron_tp_overlap.engine.options import TUNED_YAML_NAME
from megatron_tp_overlap.errors import ConfigError
from megatron_tp_overlap.ub.config import UbConfig
from megatron_tp_overlap.ub.rules import GPU_SM_COUNTS, ValidationContext, check

FLAGS = ("--dry-run", "--world-size", "--gpu")  # ours, taken out of the command line before Hydra sees it


def split_flags(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """``({"--dry-run": "", "--world-size": "4"}, rest)`` from ``argv`` (``--flag=value`` or ``--flag value``)."""
    ours, rest, i = {}, [], 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if name in FLAGS:
            if not eq and name != "--dry-run" and i + 1 < len(argv):
                value, i = argv[i + 1], i + 1
            ours[name] = value
        else:
            rest.append(argv[i])
        i += 1
    return ours, rest


def flag_problems(ours: dict[str, str]) -> list[str]:
    p = []
    if ours and "--dry-run" not in ours:
        p.append(f"{', '.join(ours)}: only with --dry-run (a launch takes its world size and GPU from torchrun)")
    ws = ours.get("--world-size")
    if ws is not None and not (ws.isdigit() and int(ws) >= 1):
        p.append(f"--world-size = {ws!r}: must be an integer >= 1")
    gpu = ours.get("--gpu")
    if gpu is not None and gpu not in GPU_SM_COUNTS:
        p.append(f"--gpu = {gpu!r}: must be one of {', '.join(GPU_SM_COUNTS)}")
    return p


def world_size(cfg: Any, given: Optional[str]) -> tuple[Optional[int], str]:
    """The number of processes the launch would have, and where that number came from."""
    if given:
        return int(given), "--world-size"
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"]), "WORLD_SIZE"
    if cfg.parallel.tp is not None:
        return cfg.parallel.tp * cfg.parallel.pp, "parallel.tp x parallel.pp"
    import torch

    n = torch.cuda.device_count()
    return (n, "the local GPUs") if n else (None, "")


def reference(ov: Any) -> tuple[UbConfig, str]:
    """The config the run starts from (and uses without tuning), as :func:`app.train.overlap_flags` passes it."""
    from megatron_tp_overlap.ub.config import load_yaml
    from megatron_tp_overlap.ub.presets import get_preset

    if ov.preset is not None:
        return get_preset(ov.preset), f"preset {ov.preset}"
    if ov.file:
        return load_yaml(ov.file), str(ov.file)
    return UbConfig(), "TE's default ub_cfgs"


def topology_of(dims: dict[str, Any]) -> Any:
    """The overlap topology Megatron builds for the main job's GPT (qkv and fc1 column-, proj and fc2 row-parallel,
    every overlap on, dgrad bulk as the main job launches them). An MoE model: fc1/fc2 only where dense layers are
    (``moe_layer_freq``), a shared expert's fc1/fc2 in slots of their own with its AG/RS only; routed experts none."""
    from megatron_tp_overlap.engine.topology import Topology
    from megatron_tp_overlap.integrations.megatron.coverage import SHARED_EXPERT_GEMMS

    attention = {f"{m}_{p}" for m in ("qkv", "proj") for p in ("fprop", "dgrad", "wgrad")}
    mlp = {f"{m}_{p}" for m in ("fc1", "fc2") for p in ("fprop", "dgrad", "wgrad")}
    kinds = [("qkv", "column"), ("proj", "row")]
    freq = dims.get("moe_layer_freq")
    dense = not dims.get("num_experts") or (0 in freq if isinstance(freq, list) else (freq or 1) > 1)
    active, own = set(attention), []
    if dense:
        kinds += [("fc1", "column"), ("fc2", "row")]
        active |= mlp
    if dims.get("num_experts") and dims.get("moe_shared_expert_intermediate_size"):
        kinds += [("shared_fc1", "column"), ("shared_fc2", "row")]
        own = sorted(SHARED_EXPERT_GEMMS.items())
        active |= set().union(*SHARED_EXPERT_GEMMS.values())
    return Topology(kinds=tuple(kinds), active=frozenset(active), layers=0, prefix_active=tuple(own))


def search_lines(ov: Any, ctx: ValidationContext, ref: UbConfig, dims: Optional[dict[str, Any]] = None) -> list[str]:
    """The slots and the size of the search space the run will search (:func:`topology_of` the model)."""
    from megatron_tp_overlap.engine.space import SpaceSpec, build_space
    from megatron_tp_overlap.ub.presets import PRESETS

    topo = topology_of(dims or {})
    spec = SpaceSpec(include_off=ov.allow_off, include_rs_dgrad=False, include_bulk_dgrad=True)
    space = build_space(topo, ctx, [ref, UbConfig(), *PRESETS.values()], spec)
    slots = ", ".join(f"{s}({len(g)})" for s, g in topo.slots().items())
    n = sum(len(v) for v in space.values())
    budget = (f"{ov.steps} steps / " if ov.steps else "") + f"{ov.seconds:g} s"
    lines = [
        f"search: slots {slots}; {n} options over {len(space)} GEMMs; strategy {ov.strategy}",
        f"budget: {budget} of trial steps (trial timeout {ov.trial_timeout:g} s), then up to {ov.verify_iters} "
        "iterations of in-run verification"
        + ("" if ov.verify_iters else " (off)")
        + ("; a config tuned before for this shape is reused" if ov.reuse else ""),
    ]
    if ctx.sm_count is None:
        lines.append(
            "not checked: num_sm against the GPU's SM count (--gpu=h100|h200|b200; the run drops such options)"
        )
    return lines


def file_lines(cfg: Any, run_dir: Path) -> list[str]:
    ov = cfg.tp_overlap
    lines = [
        f"run directory: {run_dir} (config.yaml, model.json, log.rank<N>.txt, iterations.rank<N>, tensorboard/)",
    ]
    if ov.mode != "off" and ov.preset is not None:
        lines.append(f"  the preset as YAML: {run_dir / (ov.preset + '.yaml')}")
    if ov.mode == "autotune":
        from megatron_tp_overlap.engine.cache import default_cache_dir

        out = Path(ov.output) if ov.output else run_dir / TUNED_YAML_NAME
        lines += [
            f"  tuned YAML: {out}",
            f"  beside it: {out.with_suffix('.report.json').name}, {out.with_suffix('.recipe.txt').name}; "
            f"plot: {run_dir / 'tp_overlap.png'}",
            f"  cache: {Path(ov.cache_dir).expanduser() if ov.cache_dir else default_cache_dir()}",
        ]
    return lines


def dry_run(cfg: Any, world: Optional[int], world_from: str, gpu: Optional[str]) -> tuple[list[str], list[str]]:
    """(problems, lines): what the launch would refuse, and what it would do."""
    if world is None:
        return ["the dry run cannot count the GPUs here: give --world-size=N (or parallel.tp=N)"], []
    problems = validate(cfg, world)
    if problems:
        return problems, []
    ov, tr, par = cfg.tp_overlap, cfg.training, cfg.parallel
    tp = par.tp if par.tp is not None else world
    sm = GPU_SM_COUNTS[gpu] if gpu else None
    fp8 = tr.precision == "fp8"
    tokens = tr.seq_length * tr.micro_batch_size
    lines = [f"processes: {world} ({world_from}); TP {tp}, PP {par.pp}, DP {world // (tp * par.pp)}"]
    model = model_provenance(cfg.model)
    lines.append(f"model {model['hf'] or model['dims']['name']} (dimensions from {model['source']}):")
    for f in dataclasses.fields(ModelConfig):  # every field, so fields added to ModelConfig show up here too
        if f.name in ("name", "hf"):
            continue
        v = model["dims"][f.name]
        note = f" (given; the model's: {model['overridden'][f.name]['model']})" if f.name in model["overridden"] else ""
        lines.append(f"  {f.name}: {v}{note}")
    lines.append(
        f"training: sequence {tr.seq_length}, micro-batch {tr.micro_batch_size}, global batch "
        f"{tr.global_batch_size}, {tr.train_iters} iterations, {tr.precision}"
    )
    if ov.mode == "off":
        lines.append("tp_overlap: off (sequence parallelism over NCCL): no userbuffers, nothing to tune")
    else:
        ref, given = reference(ov)
        ctx = ValidationContext(fp8=fp8, sm_count=sm, tp_size=tp, tokens=tokens)
        try:
            check(ref, ctx, given)  # what the tuner checks first, with the GPU's SM count
        except ConfigError as e:
            return [f"tp_overlap ({given}): {e}"], lines
        hidden = model["dims"]["hidden_size"]
        lines.append(
            f"userbuffers: [{tokens}, {hidden}] (sequence x micro-batch, hidden), {tr.precision}, TP {tp}"
            + (f", {gpu.upper()} ({sm} SMs)" if gpu else "")
        )
        lines.append(f"tp_overlap: {ov.mode}, starting from {given}")
        if ov.mode == "autotune":
            lines += search_lines(ov, ctx, ref, model["dims"])
    name = cfg.output.name or "<timestamp at launch, YYYYmmdd-HHMMSS>"
    lines += file_lines(cfg, Path(cfg.output.root).resolve() / name)
    return [], lines
