"""Errors raised before any GPU work: each names the key, the value and the rule."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn


@dataclass(frozen=True)
class Problem:
    """One violated rule. ``key`` is a dotted path such as ``qkv_fprop.num_sm``."""

    key: str
    value: Any
    rule: str
    where: str | None = None  # "file.yaml:12" when known

    def __str__(self) -> str:
        prefix = f"{self.where}: " if self.where else ""
        if self.key.startswith("<") and self.value is None:  # about the file as a whole, e.g. its YAML syntax
            return f"{prefix}{self.rule}"
        return f"{prefix}{self.key} = {self.value!r}: {self.rule}"


def did_you_mean(value: Any, choices: Any, prefix: str = "") -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices`` to ``value``, or ``""`` when none is close."""
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {prefix + close[0]!r}?)" if close else ""


def refuse(message: str, code: int = 2) -> NoReturn:
    """End the process for a bad configuration: the message once (rank 0 under torchrun, or a single process), no
    traceback, and the same exit code on every rank."""
    import os
    import sys

    if os.environ.get("RANK", "0") == "0":
        print(message, file=sys.stderr, flush=True)
    raise SystemExit(code)


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
