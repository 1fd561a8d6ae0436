"""PNG plots of a tuning report: per slot, the time of every option tried against the reference (TE
default or the user's config) and no overlap; and, when given, the step time across the run."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def slot_points(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per slot: options tried (label -> median ms over its trials), reference ms, no-overlap ms."""
    out: dict[str, dict[str, Any]] = {
        s: {"options": {}, "reference": [], "no overlap": []} for s in report["topology"]["slots"]
    }
    samples: dict[tuple[str, str], list[float]] = {}
    for t in report["trials"]:
        if t.get("error"):
            continue
        if t["phase"] in ("screen", "halving"):
            for slots, label in t["tested"].items():
                for s in slots.split(","):
                    if s in t["slot_ms"]:
                        samples.setdefault((s, label), []).append(t["slot_ms"][s])
        elif t["phase"] == "baseline" or (
            t["phase"] == "confirm" and t["tested"].get("*") in ("reference", "no overlap")
        ):
            which = "no overlap" if t["tested"].get("*") == "no overlap" else "reference"
            for s, v in t["slot_ms"].items():
                if s in out and v == v:
                    out[s][which].append(v)
    for (s, label), v in samples.items():
        out[s]["options"][label] = statistics.median(v)
    for s in out:
        for k in ("reference", "no overlap"):
            out[s][k] = statistics.median(out[s][k]) if out[s][k] else None
    return {s: v for s, v in out.items() if v["options"] or v["reference"] is not None}


def plot_report(
    report: dict[str, Any], path: str | Path, step_ms: Sequence[float] | None = None, title: str = "TP overlap autotune"
) -> Path:
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure registry in a library

    pts = slot_points(report)
    n = len(pts) + (1 if step_ms else 0)
    fig = Figure(figsize=(12, 2.8 * n))
    axes = fig.subplots(n, 1, squeeze=False)
    for ax, (slot, d) in zip(axes[:, 0], pts.items()):
        labels = sorted(d["options"], key=d["options"].get)
        ax.barh(range(len(labels)), [d["options"][x] for x in labels], color="tab:blue", label="option tried")
        ax.set_yticks(range(len(labels)), labels, fontsize=6)
        for k, color in (("reference", "tab:green"), ("no overlap", "tab:red")):
            if d[k] is not None:
                ax.axvline(d[k], color=color, linestyle="--", label=f"{k} {d[k]:.2f} ms")
        ax.set_title(f"{slot}: time per step (ms, all layers)", fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
    if step_ms:
        ax = axes[-1, 0]
        ax.plot(range(1, len(step_ms) + 1), step_ms, marker=".")
        ax.set_xlabel("iteration")
        ax.set_ylabel("step time (ms)")
        ax.set_title("step time across the run (after tuning)", fontsize=9)
    fig.suptitle(f"{title}: chosen {report['decision']['chosen']}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.985))  # room for the suptitle
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
