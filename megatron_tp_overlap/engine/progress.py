"""A progress bar for tuning (rank 0): trial i/n and the best step time seen so far."""

from __future__ import annotations

import math
from typing import Any


class TuningProgress:
    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._progress: Any = None
        self._task: Any = None
        self.best = math.inf

    def __enter__(self) -> TuningProgress:
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("[bold]tuning TP overlap"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.description}"),
                TimeElapsedColumn(),
            )
            self._progress.__enter__()
            self._task = self._progress.add_task("", total=None)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)

    def update(self, trial: Any, searcher: Any) -> None:
        """``Autotuner.progress`` callback: one call per finished trial."""
        if trial.step_ms is not None and trial.phase in ("baseline", "confirm", "exhaustive"):
            self.best = min(self.best, trial.step_ms)
        if self._progress is None:
            return
        done = len(searcher.trials)
        total = max(searcher.planned_trials, done) if searcher.planned_trials else None
        best = f"best {self.best:.2f} ms/step" if self.best < math.inf else ""
        self._progress.update(
            self._task,
            completed=done,
            total=total,
            description=f"{trial.phase:<9} {best}" + (f"  [failed: {trial.error[:40]}]" if trial.error else ""),
        )
