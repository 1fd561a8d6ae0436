"""The kernel bench's rows, metrics, table and plot (pure: no GPU)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# Relative L2 error against the fp32 reference that a correct kernel stays within (inputs rounded
# to the dtype, fp32 accumulation; K up to ~50k).
TOLERANCE = {"bfloat16": 2e-2, "float16": 1e-2, "float32": 1e-4}


@dataclass
class Metrics:
    total_ms: float
    gemm_ms: float
    comm_ms: float
    exposed_ms: float
    efficiency: float  # 1 - exposed / comm: 1 when the communication is fully hidden
    tflops: float  # per GPU
    bound_ms: float  # max(GEMM-only, comm-only): no overlap strategy can beat it

    @staticmethod
    def of(total_ms: float, gemm_ms: float, comm_ms: float, flops_per_gpu: float) -> Metrics:
        exposed = max(total_ms - gemm_ms, 0.0)
        eff = 1.0 - exposed / comm_ms if comm_ms > 0 else 0.0
        return Metrics(
            total_ms, gemm_ms, comm_ms, exposed, eff, flops_per_gpu / (total_ms * 1e-3) / 1e12, max(gemm_ms, comm_ms)
        )


def flops_per_gpu(M: int, N: int, K: int, tp: int) -> float:
    return 2.0 * M * N * K / tp


@dataclass
class Row:
    backend: str
    config: str
    metrics: Metrics | None
    rank_spread_ms: float | None
    rel_err: float | None
    max_abs: float | None
    note: str = ""

    def correct(self, dtype: str) -> bool | None:
        """Within :data:`TOLERANCE` of the fp32 reference (None: not run)."""
        return None if self.rel_err is None else self.rel_err <= TOLERANCE[dtype]

    def to_dict(self) -> dict[str, Any]:
        return {
            **{k: v for k, v in asdict(self).items() if k != "metrics"},
            "metrics": asdict(self.metrics) if self.metrics else None,
        }


def render(rows: list[Row], title: str, dtype: str = "bfloat16") -> str:
    head = [
        "backend",
        "config",
        "total ms",
        "GEMM ms",
        "comm ms",
        "exposed ms",
        "overlap eff.",
        "TFLOP/s",
        "bound ms",
        "rank spread ms",
        "rel. err",
        f"correct (tol {TOLERANCE[dtype]:g})",
        "note",
    ]
    body = []
    for r in rows:
        m = r.metrics
        f = lambda v, p=3: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
        body.append(
            [
                r.backend,
                r.config,
                f(m and m.total_ms),
                f(m and m.gemm_ms),
                f(m and m.comm_ms),
                f(m and m.exposed_ms),
                f(m and m.efficiency, 2),
                f(m and m.tflops, 1),
                f(m and m.bound_ms),
                f(r.rank_spread_ms),
                "-" if r.rel_err is None else f"{r.rel_err:.1e}",
                {None: "-", True: "yes", False: "**NO**"}[r.correct(dtype)],
                r.note,
            ]
        )
    lines = [f"### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(b) + " |" for b in body]
    return "\n".join(lines)


def plot_sweep(results: dict[int, list[Row]], path: Path, title: str) -> Path:
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure registry in a library

    series: dict[str, list[tuple[int, float]]] = {}
    for M, rows in sorted(results.items()):
        for r in rows:
            if r.metrics:
                series.setdefault(f"{r.backend} {r.config}".strip(), []).append((M, r.metrics.total_ms))
        bound = min((r.metrics.bound_ms for r in rows if r.metrics), default=None)
        if bound is not None:
            series.setdefault("bound max(GEMM, comm)", []).append((M, bound))
    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    for name, pts in series.items():
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            marker="o",
            linestyle="--" if name.startswith("bound") else "-",
            label=name,
        )
    ax.set_xlabel("M (tokens)")
    ax.set_ylabel("time (ms)")
    ax.set_xscale("log", base=2)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


# ---------------------------------------------------------------------------------------------
# GPU part (runs under torchrun)
# ---------------------------------------------------------------------------------------------
