"""Fault injection for reliability tests (off unless MEGATRON_TP_OVERLAP_FAULTS is set).

    MEGATRON_TP_OVERLAP_FAULTS="step:fc2_fprop: pipeline,init:#3,nan:qkv_dgrad,timeout:#5"

Each item is ``kind:match``; ``kind`` is one of ``init`` (raise while switching to the config),
``step`` (raise during a trial step), ``nan`` (the trial's timings come out NaN), ``timeout`` (the
trial runs past the trial timeout); ``match`` is ``#N`` (trial N, 0-based) or a substring of the
config's description. ``rank=R/`` before an item restricts it to one rank, e.g. ``rank=1/step:#2``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

KINDS = ("init", "step", "nan", "timeout")
ENV = "MEGATRON_TP_OVERLAP_FAULTS"


class InjectedFault(RuntimeError):
    pass


@dataclass(frozen=True)
class Fault:
    kind: str
    match: str
    rank: int | None = None

    def hits(self, kind: str, trial: int, description: str, rank: int) -> bool:
        if kind != self.kind or (self.rank is not None and self.rank != rank):
            return False
        return self.match == f"#{trial}" if self.match.startswith("#") else self.match in description


def parse(spec: str | None) -> list[Fault]:
    faults = []
    for item in (spec or "").split(","):
        item = item.strip()
        if not item:
            continue
        rank = None
        if item.startswith("rank="):
            r, item = item[5:].split("/", 1)
            rank = int(r)
        kind, _, match = item.partition(":")
        if kind not in KINDS or not match:
            raise ValueError(f"{ENV}: bad item {item!r}: expected kind:match with kind in {', '.join(KINDS)}")
        faults.append(Fault(kind, match, rank))
    return faults


def from_env() -> list[Fault]:
    return parse(os.environ.get(ENV))
