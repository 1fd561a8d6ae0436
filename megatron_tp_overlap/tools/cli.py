"""``megatron-tp-overlap``: small offline commands.

megatron-tp-overlap validate ub.yaml [--tp 4 --seq-length 8192 --micro-batch-size 1 --gpu h100 --dtype bf16]
megatron-tp-overlap preset [NAME]          # list the presets, or print one as YAML
megatron-tp-overlap analyze TRACE.json [--json OUT]
megatron-tp-overlap bench ag|rs M N K [--dtype bfloat16] [--iters 10] [--sweep-m 1024,2048]
megatron-tp-overlap sweep --model Qwen/Qwen3-8B --max-tp-size 4 --max-token-len 8192 --operators qkv proj fc1 fc2
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from megatron_tp_overlap.engine.options import TuneOptions
from megatron_tp_overlap.engine.space import DGRAD_MODES
from megatron_tp_overlap.errors import ConfigError
from megatron_tp_overlap.tools import validate
from megatron_tp_overlap.ub.config import MODULES


def _preset(a: argparse.Namespace) -> int:
    from megatron_tp_overlap.ub.config import dumps_yaml
    from megatron_tp_overlap.ub.preset_shape import preset_header
    from megatron_tp_overlap.ub.presets import PRESETS, get_preset

    if not a.name:
        print("\n".join(PRESETS))
        return 0
    try:
        print(dumps_yaml(get_preset(a.name), header=preset_header(a.name)), end="")
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    return 0


def _analyze(a: argparse.Namespace) -> int:
    from megatron_tp_overlap.tools.trace import analyze, load, render

    if a.json:  # before the analysis: a bad output path is a bad input
        from megatron_tp_overlap.integrations.megatron.flags import output_problems

        for p in output_problems(Path(a.json), "--json"):
            print(f"analyze: {p.replace('the tuned YAML', 'the JSON')}", file=sys.stderr)
            return 2
    results = {}
    for path in a.traces:
        try:
            r = analyze(load(path))
        except ValueError as e:
            print(f"analyze: {path}: {e}" if str(path) not in str(e) else f"analyze: {e}", file=sys.stderr)
            return 2
        if not r:
            print(f"analyze: {path}: no GPU kernel events (a CPU-only trace, or an empty one)", file=sys.stderr)
            return 2
        print(f"{path}\n{render(r)}\n")
        results[path] = {dev: t.to_dict() for dev, t in r.items()}
    if a.json:
        from megatron_tp_overlap.atomic import atomic_write_text

        atomic_write_text(a.json, json.dumps(results, indent=1) + "\n")
    return 0


def _sweep(a: argparse.Namespace) -> int:
    from megatron_tp_overlap.atomic import unwritable
    from megatron_tp_overlap.models import load_model_dims
    from megatron_tp_overlap.tools.sweep import argument_problems, run_sweep

    # every argument before the GPU check: a bad one gets its own line on any machine (exit 2)
    problems = argument_problems(a.max_tp_size, a.tol)
    why = unwritable(a.out)
    if why:
        problems.append(f"--out {a.out}: cannot write there ({why})")
    if not problems:
        try:
            load_model_dims(a.model)
        except ValueError as e:
            problems.append(f"--model: {e}")
    if problems:
        print("\n".join(f"sweep: {p}" for p in problems), file=sys.stderr)
        return 2
    try:
        report = run_sweep(
            a.model,
            a.max_tp_size,
            a.max_token_len,
            a.operators,
            a.layers,
            Path(a.out),
            a.tol,
            a.profile,
            a.budget_s,
            a.dgrad_mode,
        )
    except ValueError as e:
        print(f"sweep: {e}", file=sys.stderr)
        return 1
    print((Path(a.out) / "summary.txt").read_text())
    return 0 if report else 1


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (argparse names the flag in its error)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v}: must be >= 1")
    return v


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"{v}: must be a finite number > 0")
    return v


def build_parser() -> argparse.ArgumentParser:
    """The command line of every subcommand but ``bench`` (which has its own parser)."""
    p = argparse.ArgumentParser(prog="megatron-tp-overlap", description=__doc__.split("\n\n")[0])
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("bench", help="AG+GEMM / GEMM+RS kernels: every overlap backend vs the bound (see bench --help)")
    validate.add_parser(sub, positive_int)
    pr = sub.add_parser("preset", help="list the presets, or print one as YAML")
    pr.add_argument("name", nargs="?")
    pr.set_defaults(fn=_preset)
    an = sub.add_parser("analyze", help="GEMM / communication / overlap time in torch-profiler Chrome traces")
    an.add_argument("traces", nargs="+")
    an.add_argument("--json", default=None, help="also write the figures as JSON")
    an.set_defaults(fn=_analyze)
    sw = sub.add_parser("sweep", help="tune and time a model's layers at TP = 1, 2, 4, ...; recommend a TP size")
    sw.add_argument("--model", required=True, help="e.g. Qwen/Qwen3-8B (shipped), or a local config directory")
    sw.add_argument("--max-tp-size", type=positive_int, default=8, help="largest TP size: a power of two")
    sw.add_argument(
        "--max-token-len", type=positive_int, default=8192, help="tokens per micro-batch (sequence x batch)"
    )
    sw.add_argument("--operators", nargs="+", default=list(MODULES), choices=MODULES)
    sw.add_argument("--layers", type=positive_int, default=2)
    sw.add_argument("--tol", type=float, default=0.2, help="TP=n is efficient if time <= time(1)/n x (1 + tol); >= 0")
    sw.add_argument("--budget-s", type=positive_float, default=TuneOptions.seconds, help="tuning budget per TP size, s")
    sw.add_argument("--profile", action="store_true", help="torch-profiler traces and overlap ratios")
    sw.add_argument(
        "--dgrad-mode",
        default="any",
        choices=list(DGRAD_MODES),
        help="qkv/fc1 dgrad overlap: 'any' may mix bulk and reduce-scatter, which one Megatron-LM run "
        "cannot (it sets both with --tp-comm-overlap-rs-dgrad); pick one for a YAML it can use",
    )
    sw.add_argument("--out", default="sweep_out")
    sw.set_defaults(fn=_sweep)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # its own parser; it starts torchrun itself when not under it
        from megatron_tp_overlap.tools.bench import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["--version"]:
        print(f"megatron-tp-overlap {version()}")
        return 0
    a = build_parser().parse_args(argv)
    return a.fn(a)


def version() -> str:
    from megatron_tp_overlap import __version__

    return __version__


if __name__ == "__main__":
    sys.exit(main())
