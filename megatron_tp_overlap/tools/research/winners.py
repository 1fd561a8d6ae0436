"""Which choices of the search space won where: TE knobs, per-kind switches, "no overlap", read from tuning reports.

    python -m megatron_tp_overlap.tools.research.winners benchmarks/results [more folders or *.report.json ...]

For every tuning report (``*report*.json``, or ``*report*.json.xz`` as results folders keep the larger ones; any version
of this tool's report) it reads what the space offered
(``meta.space`` labels, the final decision's contenders), what the per-GEMM search accepted, what the run chose and
whether the in-run verification kept it. It prints two tables: per choice (in how many runs it was offered, accepted
for a GEMM, in the chosen config, kept by the run's own iterations) and per run. Pure: no GPU, no TE.
"""

from __future__ import annotations

import argparse
import json
import lzma
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_tp_overlap.engine.space import Option
from megatron_tp_overlap.integrations.megatron.flags import KIND_SWITCHES
from megatron_tp_overlap.ub.config import GEMM_NAMES, GemmOverlapConfig

# GemmOverlapConfig fields that are knobs (beyond method / num_sm / num_splits / cga_size) and the value that turns
# them on; their token in an option label is the one GemmOverlapConfig.describe writes
_KNOB_ON: dict[str, Any] = {
    "set_sm_margin": True,
    "aggregate": True,
    "use_ce": False,
    "pipeline_rs_overlap_first_gemm": True,
    "fp8_buf": True,
    "atomic_gemm": True,
}
KNOBS: dict[str, tuple[Any, str]] = {
    k: (on, GemmOverlapConfig(method="x", **{k: on}).describe().split()[1]) for k, on in _KNOB_ON.items()
}
KIND_SUFFIXES = tuple(f"{name} off" for name in KIND_SWITCHES)  # the final decision's "<best>, <kind> off"
NO_OVERLAP = Option(GEMM_NAMES[0], enabled=False).label  # the whole-config contender, and a per-GEMM option
PER_GEMM_OFF = "one GEMM off"  # the per-GEMM "no overlap" option (allow_off)
CHOICES = (*(f"knob {k}" for k in KNOBS), *KIND_SUFFIXES, NO_OVERLAP, PER_GEMM_OFF)


def label_choices(label: str) -> set[str]:
    """The choices in one option label (``pipeline sm=16 cga=2 splits=4 margin pipeline_rs_overlap_first_gemm``)."""
    if label == NO_OVERLAP:
        return {PER_GEMM_OFF}
    tokens = set(label.split())
    return {f"knob {k}" for k, (_, token) in KNOBS.items() if token in tokens}


FP8_ONLY = ("fp8_buf", "atomic_gemm")  # TE ignores them in a bf16 run (NeMo's bf16 presets carry fp8_buf)


def config_choices(config: dict[str, Any], name: str, fp8: bool = True) -> set[str]:
    """The choices in a chosen config (the report's ``decision.config``) named ``name``."""
    knobs = {k: v for k, v in KNOBS.items() if fp8 or k not in FP8_ONLY}
    out = {
        f"knob {k}" for c in (config.get("ub_cfgs") or {}).values() for k, (on, _) in knobs.items() if c.get(k) == on
    }
    if name == NO_OVERLAP:
        return {NO_OVERLAP}
    kinds = {s for s in KIND_SUFFIXES if name.endswith(s)}
    if config.get("overlap_off") and not kinds:
        kinds.add(PER_GEMM_OFF)
    return out | kinds


@dataclass
class RunChoices:
    """One tuning report, reduced to the choices it offered, accepted and kept."""

    path: str
    tp: int | None
    fp8: bool | None
    shape: list[int] | None
    chosen: str
    offered: set[str] = field(default_factory=set)
    accepted: set[str] = field(default_factory=set)  # accepted for a GEMM by the per-GEMM search
    in_chosen: set[str] = field(default_factory=set)
    verified: str = "-"  # "kept" / "reverted" by the in-run verification, "-" when it did not run


def read_report(path: Path, report: dict[str, Any]) -> RunChoices | None:
    """None for a JSON that is not a tuning report."""
    decision, meta = report.get("decision"), report.get("meta")
    if not isinstance(decision, dict) or not isinstance(meta, dict) or "chosen" not in decision:
        return None
    offered = {c for labels in (meta.get("space") or {}).values() for lab in labels for c in label_choices(lab)}
    names = [c.get("name", "") for c in report.get("contenders") or [] if isinstance(c, dict)]
    offered |= {s for s in KIND_SUFFIXES if any(n.endswith(s) for n in names)} | (
        {NO_OVERLAP} if NO_OVERLAP in names else set()
    )
    accepted = {
        c
        for choice in (report.get("per_gemm_choices") or {}).values()
        if isinstance(choice, dict) and choice.get("accepted")
        for c in label_choices(choice.get("option", ""))
    }
    chosen = decision["chosen"]
    fp8 = meta.get("fp8")
    in_chosen = (
        config_choices(decision.get("config") or {}, chosen, fp8 is not False) if chosen != "reference" else set()
    )
    v = report.get("in_run_verification")
    verified = ("reverted" if v.get("reverted") else "kept") if isinstance(v, dict) else "-"
    return RunChoices(str(path), meta.get("tp_size"), fp8, meta.get("shape"), chosen, offered, accepted,
                      in_chosen, verified)  # fmt: skip


def collect(paths: list[Path]) -> list[RunChoices]:
    files: list[Path] = []
    for p in paths:
        files += sorted([*p.rglob("*report*.json"), *p.rglob("*report*.json.xz")]) if p.is_dir() else [p]
    runs = []
    for f in files:
        try:
            report = json.loads(lzma.decompress(f.read_bytes()) if f.suffix == ".xz" else f.read_text())
        except (OSError, ValueError, lzma.LZMAError):
            continue
        r = read_report(f, report) if isinstance(report, dict) else None
        if r is not None:
            runs.append(r)
    return runs


def choice_table(runs: list[RunChoices]) -> list[str]:
    """Markdown: per choice, in how many runs it was measured / accepted for a GEMM / chosen / kept in the run."""
    rows = ["| choice | runs measuring it | accepted for a GEMM | in the chosen config | kept by the in-run check |",
            "|---|---|---|---|---|"]  # fmt: skip
    for c in CHOICES:
        offered = [r for r in runs if c in r.offered or c in r.in_chosen]
        chosen = [r for r in runs if c in r.in_chosen]
        kept = sum(r.verified == "kept" for r in chosen)
        acc = sum(c in r.accepted for r in runs)
        rows.append(f"| {c} | {len(offered)} | {acc} | {len(chosen)} | {kept} |")
    return rows


def run_table(runs: list[RunChoices], root: Path | None = None) -> list[str]:
    rows = [
        "| report | TP | dtype | tokens x hidden | chosen | its choices | in-run check |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        p = Path(r.path)
        name = str(p.relative_to(root)) if root and p.is_relative_to(root) else r.path
        dtype = "-" if r.fp8 is None else ("fp8" if r.fp8 else "bf16")
        shape = "x".join(map(str, r.shape)) if r.shape else "-"
        rows.append(
            f"| {name} | {r.tp or '-'} | {dtype} | {shape} | {r.chosen} | {', '.join(sorted(r.in_chosen)) or '-'} | "
            f"{r.verified} |"
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="+", type=Path, help="folders (searched for *report*.json) or report files")
    a = p.parse_args(argv)
    runs = collect(a.paths)
    if not runs:
        raise SystemExit(f"no tuning report under {', '.join(map(str, a.paths))}")
    root = a.paths[0] if len(a.paths) == 1 and a.paths[0].is_dir() else None
    print(f"{len(runs)} tuning reports\n")
    print("\n".join(choice_table(runs)))
    print()
    print("\n".join(run_table(runs, root)))


if __name__ == "__main__":
    main()
