"""Errors raised before any GPU work: each names the key, the value and the rule."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Problem:
    """One violated rule. ``key`` is a dotted path such as ``qkv_fprop.num_sm``."""

    key: str
    value: Any
    rule: str
    where: str | None = None  # "file.yaml:12" when known

    def __str__(self) -> str:
        prefix = f"{self.where}: " if self.where else ""
        return f"{prefix}{self.key} = {self.value!r}: {self.rule}"


class ConfigError(ValueError):
    """A configuration was rejected. ``problems`` lists every violated rule, not just the first."""

    def __init__(self, problems: Sequence[Problem] | str, source: str | None = None):
        if isinstance(problems, str):
            problems = [Problem(key="<config>", value=None, rule=problems, where=source)]
        self.problems = list(problems)
        self.source = source
        head = f"invalid userbuffers config{f' in {source}' if source else ''}"
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{head} ({len(self.problems)} problem(s)):\n{lines}")


class StaleCommunicatorError(RuntimeError):
    """A userbuffers communicator of the previous config is still referenced at switch time.

    TE shares one static communicator between all CommOverlap objects and the first object
    destroyed tears it down: a late destruction would break the *next* config.
    """
