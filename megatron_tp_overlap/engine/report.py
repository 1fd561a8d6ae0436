"""The tuning report: JSON with every trial, and a summary table (rank 0) in ms."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_tp_overlap.atomic import atomic_write_text
from megatron_tp_overlap.engine.search import SearchResult
from megatron_tp_overlap.engine.space import TuningConfig
from megatron_tp_overlap.engine.topology import Topology
from megatron_tp_overlap.ub.config import UbConfig


@dataclass
class SummaryRow:
    slot: str
    gemms: str
    chosen: str
    chosen_ms: float | None
    reference_ms: float | None
    no_overlap_ms: float | None


def gemm_setting(config: TuningConfig, gemm: str) -> str:
    if gemm in config.disabled:
        return "no overlap"
    c = config.ub.get(gemm)
    return c.describe() if c is not None else "TE default"


def slot_medians(result: SearchResult, contender: str) -> dict[str, float]:
    """Per-slot median (ms, summed over layers) over the confirmation trials of one contender."""
    samples: dict[str, list[float]] = {}
    for t in result.trials:
        if t.phase == "confirm" and t.tested.get("*") == contender:
            for s, v in t.slot_ms.items():
                if v == v:  # not NaN
                    samples.setdefault(s, []).append(v)
    return {s: statistics.median(v) for s, v in samples.items()}


def summary_rows(
    result: SearchResult, topo: Topology, reference: str = "reference", no_overlap: str = "no overlap"
) -> list[SummaryRow]:
    chosen = slot_medians(result, result.best_name)
    ref, off = slot_medians(result, reference), slot_medians(result, no_overlap)
    rows = []
    for slot, gemms in topo.slots().items():
        if not gemms:
            continue
        rows.append(
            SummaryRow(
                slot,
                ", ".join(gemms),
                "; ".join(f"{g}: {gemm_setting(result.best, g)}" for g in gemms),
                chosen.get(slot),
                ref.get(slot),
                off.get(slot),
            )
        )
    med = {c.name: c.median for c in result.contenders if c.samples}
    rows.append(
        SummaryRow("step", "all", result.best_name, med.get(result.best_name), med.get(reference), med.get(no_overlap))
    )
    return rows


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def render_summary(rows: list[SummaryRow], result: SearchResult, title: str = "TP overlap autotune") -> str:
    """A table as text (rich, a dependency)."""
    header = ["slot", "GEMMs: chosen setting", "chosen ms", "reference ms", "no overlap ms"]
    body = [[r.slot, r.chosen, _fmt(r.chosen_ms), _fmt(r.reference_ms), _fmt(r.no_overlap_ms)] for r in rows]
    caption = (
        f"{len(result.trials)} trials, {result.steps_run} steps, {result.elapsed_s:.1f} s; decision: {result.reason}"
    )
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, caption=caption)
    for h in header:
        table.add_column(h, justify="right" if "ms" in h else "left")
    for b in body:
        table.add_row(*b)
    console = Console(width=160, record=True, force_terminal=False)
    with console.capture() as cap:
        console.print(table)
    return cap.get()


def build_report(result: SearchResult, topo: Topology, meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "meta": meta,
        "topology": {"slots": topo.slots(), "active": sorted(topo.active), "layers": topo.layers},
        "decision": {
            "chosen": result.best_name,
            "reason": result.reason,
            "noise_ms": result.noise_ms,
            "config": result.best.to_dict(),
            "abba": result.decision,
            "undecided": None if result.undecided is None else result.undecided.label,
        },
        "per_gemm_choices": result.choices,
        "contenders": [
            {
                "name": c.name,
                "config": c.config.to_dict(),
                "median_ms": None if not c.samples else round(c.median, 4),
                "spread_ms": None if len(c.samples) < 2 else round(max(c.samples) - min(c.samples), 4),
                "samples_ms": [round(s, 4) for s in c.samples],
            }
            for c in result.contenders
        ],
        "summary": [r.__dict__ for r in summary_rows(result, topo)],
        "budget": {
            "steps_run": result.steps_run,
            "elapsed_s": round(result.elapsed_s, 3),
            "budget_hit": result.budget_hit,
            "cut_short": result.cut_short,
        },
        # per slot: options screened, re-measured, re-checked, and what the search left (engine/racing.py)
        "search": {"ended": result.search_end, "per_slot": result.coverage},
        "trials": [t.to_dict() for t in result.trials],
    }


def write_report(path: str | Path, report: dict[str, Any]) -> None:
    atomic_write_text(path, json.dumps(report, indent=1, default=str) + "\n")


def yaml_header(ub: UbConfig, meta: dict[str, Any]) -> str:
    lines = ["Tuned by megatron-tp-overlap: Megatron-LM --tp-comm-overlap-cfg (TE initialize_ub ub_cfgs)."]
    lines += [f"{k}: {v}" for k, v in meta.items()]
    return "\n".join(lines)
