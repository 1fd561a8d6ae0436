"""Import a benchmark program (``benchmarks/<name>.py`` or ``benchmarks/studies/<name>.py``) as a module in tests."""

import importlib.util
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str):
    path = next(p for p in (BENCHMARKS / f"{name}.py", BENCHMARKS / "studies" / f"{name}.py") if p.exists())
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
