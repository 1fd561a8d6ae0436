"""Fault injection for reliability tests (off unless MEGATRON_TP_OVERLAP_FAULTS is set).

    MEGATRON_TP_OVERLAP_FAULTS="step:fc2_fprop: pipeline,init:#3,nan:qkv_dgrad,timeout:#5"

Each item is ``kind:match``; ``kind`` is one of ``init`` (raise before switching to the config),
``ubinit`` (raise inside TE's ``initialize_ub``, when it creates its second communicator: the first
one's bootstrap collectives have run, the peers wait in the second's), ``step`` (raise after a trial
step), ``midstep`` (raise inside a trial step, before the last overlap module's forward: the peers
go on into the step's later collectives), ``nan`` (the trial's timings come out NaN), ``timeout``
(the trial runs past the trial timeout); ``match`` is ``#N`` (trial N, 0-based) or a substring of
the config's description. ``rank=R/`` before an item restricts it to one rank, e.g.
``rank=1/step:#2``. Faults on one rank are what ``engine.lockstep`` exists for.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

KINDS = ("init", "ubinit", "step", "midstep", "nan", "timeout")
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


@contextlib.contextmanager
def inside_initialize_ub(fire: bool, at: int = 2) -> Iterator[None]:
    """While active (``fire``), TE's communicator constructors raise at the ``at``-th construction."""
    if not fire:
        yield
        return
    from megatron_tp_overlap.engine import switcher

    tex = switcher._te_base().tex
    originals = {n: getattr(tex, n) for n in ("CommOverlap", "CommOverlapP2P") if hasattr(tex, n)}
    made = [0]

    def counting(cls: Any) -> Any:
        def construct(*args: Any, **kwargs: Any) -> Any:
            made[0] += 1
            if made[0] == at:
                raise InjectedFault(f"injected fault inside initialize_ub (communicator {at})")
            return cls(*args, **kwargs)

        return construct

    for n, cls in originals.items():
        setattr(tex, n, counting(cls))
    try:
        yield
    finally:
        for n, cls in originals.items():
            setattr(tex, n, cls)


@contextlib.contextmanager
def mid_step(module: Any) -> Iterator[None]:
    """While active (``module`` not None), ``module``'s next forward raises before it runs."""
    if module is None:
        yield
        return

    def fail(*_: Any) -> None:
        raise InjectedFault("injected fault inside a trial step")

    handle = module.register_forward_pre_hook(fail)
    try:
        yield
    finally:
        handle.remove()
