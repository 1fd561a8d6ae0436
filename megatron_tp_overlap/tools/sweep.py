"""``megatron-tp-overlap sweep``: which TP size, with which overlap config, for a model's real shapes.

Runs :mod:`layer_bench` under torchrun at TP = 1, 2, 4, ... (up to ``--max-tp-size`` and the local
GPUs), then ranks TP sizes by measured step time (TP=1 is the baseline, see :mod:`scaling`) and
writes ``tuning_report.json``, ``summary.txt``, ``optimal_tp_comm_overlap_cfg_tp{N}.yaml`` per TP
size, ``optimal_tp_comm_overlap_cfg.yaml`` for the recommended one, and ``tp_scaling.png``.
The overlap ratio (from ``--profile`` traces) is reported as explanation only.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from megatron_tp_overlap.atomic import atomic_write_text
from megatron_tp_overlap.integrations.megatron.flags import flags_for
from megatron_tp_overlap.model_features import dense_only
from megatron_tp_overlap.models import ModelDims
from megatron_tp_overlap.tools.scaling import scaling_report
from megatron_tp_overlap.ub.config import dumps_yaml, parse_ub_cfgs


def argument_problems(max_tp: int, tol: float) -> list[str]:
    """Problems with the sweep's numbers, checked before anything needs a GPU."""
    p = []
    if max_tp < 1 or max_tp & (max_tp - 1):
        p.append(f"--max-tp-size = {max_tp}: must be a power of two (the sweep runs TP = 1, 2, 4, ...)")
    if not (math.isfinite(tol) and tol >= 0):
        p.append(f"--tol = {tol}: must be a finite number >= 0 (the slowdown allowed against ideal scaling)")
    return p


def plan_tp_sizes(d: ModelDims, max_tp: int, gpus: int, tokens: int) -> list[int]:
    """TP sizes to run (powers of two); a clear error when none fits, or for an MoE model."""
    dense_only(d, "sweep")
    if gpus < 1:
        raise ValueError("sweep needs CUDA GPUs on this machine")
    if argument_problems(max_tp, 0.0):
        raise ValueError("; ".join(argument_problems(max_tp, 0.0)))
    sizes, tp = [], 1
    while tp <= min(max_tp, gpus):
        bad = [
            f"{n} ({v})"
            for n, v in (("heads", d.heads), ("KV heads", d.kv_heads), ("ffn", d.ffn), ("tokens", tokens))
            if v % tp
        ]
        if bad:
            break
        sizes.append(tp)
        tp *= 2
    if max_tp > gpus:
        print(f"note: --max-tp-size {max_tp} > {gpus} local GPUs: sweeping up to TP={sizes[-1]}", file=sys.stderr)
    return sizes


def tp_step_ms(result: dict[str, Any]) -> float:
    """The time a TP size is ranked by: the tuned config's step, or no overlap at TP=1."""
    t = result["step_ms"]
    return t.get("tuned", t.get("no overlap"))


def te_default_note(tp: int, result: dict[str, Any]) -> str | None:
    """A line when TE's default measured faster than the tuned config: only possible when the search had to
    leave it out (its bulk qkv/fc1 dgrad is outside ``--dgrad-mode reduce-scatter``)."""
    t = result["step_ms"]
    te, tuned = t.get("TE default"), t.get("tuned")
    if te is None or tuned is None or te >= tuned:
        return None
    why = (
        "it runs qkv/fc1 dgrad as bulk all-gathers, outside --dgrad-mode reduce-scatter: sweep with "
        "--dgrad-mode bulk for this TP size"
        if result.get("dgrad_mode") == "reduce-scatter"
        else "within the measurement's noise"
    )
    return f"TP={tp}: TE default measured faster than the tuned config ({te:.3f} vs {tuned:.3f} ms): {why}"


def write_outputs(
    results: dict[int, dict[str, Any]], out: Path, tol: float = 0.2, overlap: dict[int, Any] | None = None
) -> dict[str, Any]:
    """All sweep outputs from per-TP results (``layer_bench``'s tp{N}.json contents)."""
    times = {tp: tp_step_ms(r) for tp, r in results.items()}
    recommended, verdicts = scaling_report(times, tol)
    usage: dict[int, str] = {}
    for tp, r in results.items():
        cfg = parse_ub_cfgs(r.get("chosen", {}).get("ub_cfgs", {}))
        path = out / f"optimal_tp_comm_overlap_cfg_tp{tp}.yaml"
        note = "TP=1: no tensor-parallel communication, nothing to overlap" if tp == 1 else f"tuned at TP={tp}"
        if tp > 1:
            flags, problem = flags_for(cfg, path.name)
            usage[tp] = f"Megatron-LM: {' '.join(flags)}" + (
                f"  WARNING: {problem}; sweep with --dgrad-mode bulk or --dgrad-mode reduce-scatter for a config "
                "Megatron-LM can run"
                if problem
                else ""
            )
            note += f"\n{usage[tp]}"
        atomic_write_text(path, dumps_yaml(cfg, header=note))
    best = results[recommended]
    header = f"recommended TP size {recommended} (largest with scaling efficiency >= 1/(1+{tol:g}))"
    if recommended in usage:
        header += "\n" + usage[recommended].replace(
            f"optimal_tp_comm_overlap_cfg_tp{recommended}.yaml", "optimal_tp_comm_overlap_cfg.yaml"
        )
    atomic_write_text(
        out / "optimal_tp_comm_overlap_cfg.yaml",
        dumps_yaml(parse_ub_cfgs(best.get("chosen", {}).get("ub_cfgs", {})), header=header),
    )
    report = {
        "recommended_tp": recommended,
        "tol": tol,
        "verdicts": [v.__dict__ for v in verdicts],
        "per_tp": {str(k): v for k, v in results.items()},
        "overlap_from_traces": {str(k): v for k, v in (overlap or {}).items()},
    }
    atomic_write_text(out / "tuning_report.json", json.dumps(report, indent=1, default=str) + "\n")
    lines = [
        f"model {next(iter(results.values()))['model']}: recommended TP = {recommended}",
        "",
        "| TP | step ms (tuned) | ideal ms | scaling efficiency | TE default ms | no overlap ms | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for v in verdicts:
        s = results[v.tp]["step_ms"]
        fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
        lines.append(
            f"| {v.tp} | {v.time_ms:.3f} | {v.ideal_ms:.3f} | {v.efficiency:.0%} | {fmt(s.get('TE default'))} | "
            f"{fmt(s.get('no overlap'))} | {v.reason} |"
        )
    lines += ["", *(f"TP={tp}: {u}" for tp, u in sorted(usage.items()))]
    lines += [n for n in (te_default_note(tp, r) for tp, r in sorted(results.items())) if n]
    if overlap:
        lines += ["", "Overlap ratio (overlap / min(GEMM, comm), from traces; explanation only, not a score):"]
        lines += [f"  TP={tp}: {o}" for tp, o in sorted(overlap.items())]
    atomic_write_text(out / "summary.txt", "\n".join(lines) + "\n")
    _plot(times, verdicts, out / "tp_scaling.png")
    return report


def _plot(times: dict[int, float], verdicts: Any, path: Path) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure registry in a library

    tps = sorted(times)
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    ax.plot(tps, [times[t] for t in tps], marker="o", label="measured (tuned overlap)")
    ax.plot(tps, [v.ideal_ms for v in verdicts], linestyle="--", label="ideal: time(TP=1) / TP")
    ax.set_xscale("log", base=2)
    ax.set_xticks(tps, [str(t) for t in tps])
    ax.set_xlabel("TP size")
    ax.set_ylabel("step time (ms)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def visible_devices(env: dict) -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (all local ones if unset)."""
    given = env.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [d.strip() for d in given.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def run_sweep(
    model: str,
    max_tp: int,
    tokens: int,
    operators: list[str],
    layers: int,
    out: Path,
    tol: float,
    profile: bool,
    budget_s: float,
    dgrad_mode: str = "any",
) -> dict[str, Any]:
    import torch

    from megatron_tp_overlap.models import load_model_dims
    from megatron_tp_overlap.tools.trace import analyze, load

    d = load_model_dims(model)
    sizes = plan_tp_sizes(d, max_tp, torch.cuda.device_count(), tokens)
    out.mkdir(parents=True, exist_ok=True)
    results, overlap = {}, {}
    for tp in sizes:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={tp}",
            "-m",
            "megatron_tp_overlap.tools.layer_bench",
            "--model",
            model,
            "--layers",
            str(layers),
            "--tokens",
            str(tokens),
            "--operators",
            *operators,
            "--budget-s",
            str(budget_s),
            "--dgrad-mode",
            dgrad_mode,
            "--out",
            str(out),
        ] + (["--profile"] if profile and tp > 1 else [])
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(visible_devices(os.environ)[:tp])}
        print(f"[sweep] TP={tp}: {' '.join(cmd)}", flush=True)
        subprocess.run(cmd, env=env, check=True)
        results[tp] = json.loads((out / f"tp{tp}.json").read_text())
        trace = out / f"tp{tp}_trace.json"
        if trace.exists():
            overlap[tp] = {dev: round(t.overlap_ratio, 3) for dev, t in analyze(load(trace)).items()}
    return write_outputs(results, out, tol, overlap)
