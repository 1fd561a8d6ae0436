"""Every command README.md shows parses: the main job's overrides compose and validate, the Megatron-LM flags go
through our parser, every CLI subcommand through its own, the benchmark suite's cases exist. The README cannot drift
from the code unnoticed."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def readme_commands() -> list[str]:
    """Every command line in the README's bash blocks (continuations joined, comments and placeholders dropped)."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    lines = [line.split("  #")[0].strip() for b in blocks for line in b.replace("\\\n", " ").splitlines()]
    return [line for line in lines if line]


def test_the_readme_shows_each_kind_of_command():
    kinds = {
        k
        for c in readme_commands()
        for k in ("megatron_tp_overlap.train", "megatron_tp_overlap.run", "megatron-tp-overlap ", "benchmarks/suite.py")
        if k in c
    }
    assert len(kinds) == 4, kinds


@pytest.mark.parametrize("command", readme_commands())
def test_every_readme_command_parses(command):
    cmd = command.split("&&")[-1].strip()
    if cmd.startswith("pip install") or " pytest " in f" {cmd} ":
        return
    words = shlex.split(re.sub(r"\$\([^)]*\)", "2", cmd))  # $(...) -> a number
    if "megatron_tp_overlap.train" in words:
        from megatron_tp_overlap.app.config import check_overrides, validate
        from megatron_tp_overlap.app.dry_run import split_flags
        from megatron_tp_overlap.app.train import compose

        ours, overrides = split_flags(words[words.index("megatron_tp_overlap.train") + 1 :])  # --dry-run's flags
        nproc = ours.get("--world-size") or next(
            w.split("=")[1] for w in shlex.split(cmd) if w.startswith("--nproc-per-node=")
        )
        assert check_overrides(overrides) == []
        # $(nvidia-smi -L | wc -l): the GPUs of the user's node, 2, 4 or 8
        for n in (2, 4, 8) if nproc.startswith("$(") else (int(nproc),):
            assert validate(compose(overrides), n) == [], n
    elif "megatron_tp_overlap.run" in words:
        from megatron_tp_overlap.integrations.megatron.flags import add_arguments

        ours = [w for w in words if w.startswith("--tp-comm-overlap-autotune")]
        assert ours and add_arguments(argparse.ArgumentParser()).parse_known_args(ours)[1] == []
    elif words[0] == "megatron-tp-overlap":
        argv = [w for w in words[1:] if not w.startswith("[")]  # [--fp8], [NAME]: optional parts
        if argv[0] == "bench":
            from megatron_tp_overlap.tools.bench import parse_args

            parse_args(argv[1:])
        else:
            from megatron_tp_overlap.tools.cli import build_parser

            build_parser().parse_args(argv)
    elif "benchmarks/suite.py" in cmd:
        import yaml

        cases = yaml.safe_load((ROOT / "benchmarks" / "cases.yaml").read_text())
        names = words[words.index("--cases") + 1].split(",")
        assert set(names) <= set(cases), set(names) - set(cases)
    else:
        pytest.fail(f"README command of an unknown kind: {cmd}")
