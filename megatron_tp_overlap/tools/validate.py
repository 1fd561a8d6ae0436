"""``megatron-tp-overlap validate``: a ``--tp-comm-overlap-cfg`` YAML checked by exactly the rules the run applies to
it (:mod:`ub.rules` with the run's TP size, userbuffers rows, GPU SM count and dtype), given what the run knows: as
flags, or as the Megatron-LM argument line itself. Checks that need something not given are named, not skipped
silently."""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass, field
from typing import Optional

from megatron_tp_overlap.errors import ConfigError
from megatron_tp_overlap.ub.rules import GPU_SM_COUNTS, MAX_SM_COUNT, ValidationContext

DTYPES = ("bf16", "fp8", "fp16")
# our flag -> the Megatron-LM flag the same value comes from in --megatron-args
MEGATRON_FLAGS = {
    "tp": "--tensor-model-parallel-size",
    "seq_length": "--seq-length",
    "micro_batch_size": "--micro-batch-size",
    "hidden_size": "--hidden-size",
    "cp": "--context-parallel-size",
}


@dataclass
class RunFacts:
    """What the run knows that the rules depend on (None: not given)."""

    tp: Optional[int] = None
    seq_length: Optional[int] = None
    micro_batch_size: Optional[int] = None
    hidden_size: Optional[int] = None
    cp: Optional[int] = None
    dtype: str = "bf16"
    sm_count: Optional[int] = None
    gpu: Optional[str] = None
    problems: list[str] = field(default_factory=list)

    @property
    def tokens(self) -> Optional[int]:
        """Rows of the userbuffers: sequence x micro-batch / context parallel (Megatron's ``initialize_ub``)."""
        if self.seq_length is None or self.micro_batch_size is None:
            return None
        return self.seq_length * self.micro_batch_size // (self.cp or 1)

    def context(self) -> ValidationContext:
        return ValidationContext(fp8=self.dtype == "fp8", sm_count=self.sm_count, tp_size=self.tp, tokens=self.tokens)

    def unchecked(self) -> list[str]:
        """The checks the run makes that these facts cannot."""
        out = []
        if self.tp is None:
            out.append("TE's default method of each GEMM not given one, and num_splits, at the run's TP size (--tp)")
        if self.tokens is None:
            out.append("num_splits against the tokens per rank (--seq-length and --micro-batch-size)")
        if self.sm_count is None:
            out.append(f"num_sm against the GPU's SM count (--gpu; checked only against {MAX_SM_COUNT}, any GPU's)")
        return out


def _megatron_facts(line: str) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    for dest, flag in MEGATRON_FLAGS.items():
        p.add_argument(flag, dest=dest, type=int, default=None)
    p.add_argument("--fp8-format", default=None)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--fp16", action="store_true")
    try:
        ns, _ = p.parse_known_args(shlex.split(line))
    except (argparse.ArgumentError, ValueError) as e:
        return argparse.Namespace(), [f"--megatron-args: {e}"]
    return ns, []


def facts_from_args(a: argparse.Namespace) -> RunFacts:
    """The facts the flags give, with what ``--megatron-args`` adds; a flag and the line disagreeing is a problem."""
    f = RunFacts(dtype="fp8" if a.fp8 else a.dtype)
    if a.fp8 and a.dtype not in ("bf16", "fp8"):
        f.problems.append(f"--fp8 and --dtype {a.dtype}: give one")
    line = argparse.Namespace()
    if a.megatron_args:
        line, problems = _megatron_facts(a.megatron_args)
        f.problems += problems
    for dest, flag in MEGATRON_FLAGS.items():
        mine, theirs = getattr(a, dest), getattr(line, dest, None)
        if mine is not None and theirs is not None and mine != theirs:
            f.problems.append(f"--{dest.replace('_', '-')} {mine} and --megatron-args {flag} {theirs}: give one")
        setattr(f, dest, mine if mine is not None else theirs)
    if getattr(line, "fp8_format", None) or getattr(line, "fp16", False):
        f.dtype = "fp8" if line.fp8_format else "fp16"
    for dest, flag in MEGATRON_FLAGS.items():
        v = getattr(f, dest)
        if v is not None and v < 1:
            f.problems.append(f"{flag} = {v}: must be >= 1")
    if f.tp == 1:
        f.problems.append("--tp = 1: TP overlap needs a tensor-parallel size >= 2 (there is no TP communication)")
    if f.dtype == "fp16":
        f.problems.append(
            "--dtype fp16: TE's userbuffers reduce-scatter adds in bf16 on Ampere and newer, so the run refuses "
            "fp16 with TP overlap; use bf16"
        )
    if f.tp and f.seq_length and f.seq_length % f.tp:
        f.problems.append(f"--seq-length {f.seq_length}: must be divisible by TP = {f.tp} (sequence parallel)")
    _sm_facts(a, f)
    return f


def _sm_facts(a: argparse.Namespace, f: RunFacts) -> None:
    if a.gpu is not None and a.sm_count is not None:
        f.problems.append("--gpu and --sm-count: give one")
    if a.sm_count is not None:
        if a.sm_count > MAX_SM_COUNT:
            f.problems.append(f"--sm-count = {a.sm_count}: no GPU has more than {MAX_SM_COUNT} SMs")
        f.sm_count = a.sm_count
    elif a.gpu == "local":
        from megatron_tp_overlap.engine.tuner import device_sm_count

        f.sm_count, f.gpu = device_sm_count(), "the local GPU"
        if f.sm_count is None:
            f.problems.append(f"--gpu local: no CUDA GPU here; name one of {', '.join(GPU_SM_COUNTS)}")
    elif a.gpu is not None:
        f.sm_count, f.gpu = GPU_SM_COUNTS[a.gpu], a.gpu.upper()


def add_parser(sub: argparse._SubParsersAction, positive_int) -> None:
    v = sub.add_parser(
        "validate",
        help="check a --tp-comm-overlap-cfg YAML by the rules the run applies",
        description=__doc__,
        epilog="e.g.: megatron-tp-overlap validate ub.yaml --tp 4 --seq-length 8192 --micro-batch-size 1 --gpu h100",
    )
    v.add_argument("yaml", help="the YAML (Megatron's --tp-comm-overlap-cfg: GEMM name -> settings)")
    v.add_argument("--tp", type=positive_int, default=None, help="tensor-parallel size of the run (>= 2)")
    v.add_argument("--seq-length", type=positive_int, default=None, help="sequence length (Megatron --seq-length)")
    v.add_argument("--micro-batch-size", type=positive_int, default=None, help="micro-batch size")
    v.add_argument("--cp", type=positive_int, default=None, help="context-parallel size (default 1)")
    v.add_argument("--hidden-size", type=positive_int, default=None, help="hidden size (the userbuffers' width)")
    v.add_argument(
        "--megatron-args",
        default=None,
        metavar="LINE",
        help="the run's Megatron-LM arguments as one string: TP, sequence, micro-batch, hidden, CP and dtype are "
        "read from it (a flag given as well must agree)",
    )
    v.add_argument(
        "--gpu",
        choices=[*GPU_SM_COUNTS, "local"],
        default=None,
        help="the GPU the run uses, for num_sm's bound: "
        + ", ".join(f"{g} ({n} SMs)" for g, n in GPU_SM_COUNTS.items())
        + ", or local (this machine's)",
    )
    v.add_argument("--sm-count", type=positive_int, default=None, help="the GPU's SM count, instead of --gpu")
    v.add_argument("--dtype", choices=DTYPES, default="bf16", help="the run's precision (fp8: FP8-only knobs allowed)")
    v.add_argument("--fp8", action="store_true", help="same as --dtype fp8")
    v.set_defaults(fn=run)


def run(a: argparse.Namespace) -> int:
    from megatron_tp_overlap.ub.rules import load_and_validate

    f = facts_from_args(a)
    if f.problems:
        print("\n".join(f"validate: {p}" for p in f.problems), file=sys.stderr)
        return 2
    try:
        cfg, notes = load_and_validate(a.yaml, f.context())
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    for n in notes:
        print(f"warning: {n}")
    given = [f"TP {f.tp}" if f.tp else "", f"{f.tokens} tokens" if f.tokens else "", f.gpu or "", f.dtype]
    shape = f"; userbuffers [{f.tokens}, {f.hidden_size}]" if f.tokens and f.hidden_size else ""
    print(f"{a.yaml}: valid for {', '.join(g for g in given if g)}{shape} ({len(cfg)} GEMM entries: {cfg.describe()})")
    for u in f.unchecked():
        print(f"not checked: {u}")
    return 0
