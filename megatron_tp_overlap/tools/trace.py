"""Torch-profiler Chrome traces: which GPU time was GEMM, which was TP communication, and how much of
the two ran at the same time.

Kernels are classified by name (GEMM: cutlass, cublas, nvjet, sm90_xmma, ...; communication:
userbuffers, nccl, peer-to-peer memcpy). Per device, the busy time of each class is the length of
the union of its intervals (concurrent kernels count once), and the overlap is the length of the
intersection of the GEMM and communication unions. Times in ms.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GEMM_PATTERNS = re.compile(r"gemm|cutlass|cublas|nvjet|sm\d+_xmma|wgmma|xmma_gemm|s\d+gemm|h\d+gemm|matmul", re.I)
COMM_PATTERNS = re.compile(
    r"userbuffers|kuserbuffers|nccl|memcpy ?(ptop|peer|p2p)|ncclDevKernel|allgather|reducescatter|reduce_scatter|all_gather",
    re.I,
)

Interval = tuple[float, float]  # (start, end) in microseconds


def classify(name: str) -> str:
    """ "comm", "gemm" or "other" for a kernel / memcpy name. Communication wins a tie
    (userbuffers' fused GEMM+RS kernels are named after the communication)."""
    if COMM_PATTERNS.search(name):
        return "comm"
    if GEMM_PATTERNS.search(name):
        return "gemm"
    return "other"


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, merged, disjoint intervals."""
    out: list[list[float]] = []
    for s, e in sorted(i for i in intervals if i[1] > i[0]):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def length(intervals: Iterable[Interval]) -> float:
    return sum(e - s for s, e in intervals)


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Intersection of two unions (each sorted and disjoint)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


@dataclass
class DeviceTimes:
    gemm_ms: float
    comm_ms: float
    overlap_ms: float  # GPU time with GEMM and communication running at once
    busy_ms: float  # any kernel
    streams: dict[str, float] = field(default_factory=dict)  # stream -> busy ms
    kernels: dict[str, int] = field(default_factory=dict)  # class -> count

    @property
    def overlap_ratio(self) -> float:
        """overlap / min(GEMM, comm): 1 when the shorter of the two is fully hidden. An explanation,
        not a score: a config with a high ratio can still be slower."""
        m = min(self.gemm_ms, self.comm_ms)
        return self.overlap_ms / m if m > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "gemm_ms": round(self.gemm_ms, 4),
            "comm_ms": round(self.comm_ms, 4),
            "overlap_ms": round(self.overlap_ms, 4),
            "overlap_ratio": round(self.overlap_ratio, 4),
            "busy_ms": round(self.busy_ms, 4),
            "streams_ms": {k: round(v, 4) for k, v in self.streams.items()},
            "kernels": self.kernels,
        }


def gpu_events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """Complete ("X") events that ran on a GPU: kernels and memcpys."""
    out = []
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X" or "dur" not in ev:
            continue
        cat = str(ev.get("cat", "")).lower()
        if cat in ("kernel", "gpu_memcpy", "gpu_memset") or cat.startswith("cuda_kernel"):
            out.append(ev)
    return out


def analyze(trace: dict[str, Any]) -> dict[str, DeviceTimes]:
    """Per device (the trace's pid of GPU events): GEMM / comm / overlap times."""
    by_dev: dict[str, dict[str, list[Interval]]] = defaultdict(lambda: defaultdict(list))
    streams: dict[str, dict[str, list[Interval]]] = defaultdict(lambda: defaultdict(list))
    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for ev in gpu_events(trace):
        dev = str(ev.get("args", {}).get("device", ev.get("pid")))
        try:
            iv = (float(ev["ts"]), float(ev["ts"]) + float(ev["dur"]))
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"a GPU event without a numeric ts/dur: {str(ev)[:120]}") from None
        cls = classify(str(ev.get("name", "")))
        by_dev[dev][cls].append(iv)
        by_dev[dev]["any"].append(iv)
        streams[dev][str(ev.get("args", {}).get("stream", ev.get("tid")))].append(iv)
        counts[dev][cls] += 1
    out = {}
    for dev, cls in by_dev.items():
        g, c = union(cls["gemm"]), union(cls["comm"])
        out[dev] = DeviceTimes(
            gemm_ms=length(g) / 1e3,
            comm_ms=length(c) / 1e3,
            overlap_ms=length(intersect(g, c)) / 1e3,
            busy_ms=length(union(cls["any"])) / 1e3,
            streams={s: length(union(v)) / 1e3 for s, v in sorted(streams[dev].items())},
            kernels=dict(counts[dev]),
        )
    return out


def load(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable Chrome trace JSON ({e})") from e
    if isinstance(data, list):  # the bare-array form of the format
        data = {"traceEvents": data}
    if not isinstance(data, dict) or "traceEvents" not in data:
        raise ValueError(f"{path}: no traceEvents: not a Chrome trace (torch.profiler export_chrome_trace)")
    return data


def render(result: dict[str, DeviceTimes]) -> str:
    lines = [
        "| device | GEMM ms | comm ms | overlap ms | overlap / min(GEMM, comm) | busy ms | streams |",
        "|---|---|---|---|---|---|---|",
    ]
    for dev, t in sorted(result.items()):
        lines.append(
            f"| {dev} | {t.gemm_ms:.3f} | {t.comm_ms:.3f} | {t.overlap_ms:.3f} | {t.overlap_ratio:.2f} | "
            f"{t.busy_ms:.3f} | {len(t.streams)} |"
        )
    return "\n".join(lines)
