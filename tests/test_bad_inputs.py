"""The catalog of bad inputs: YAML files, Hydra overrides, Megatron flags, launch settings,
files on disk. Each must give a specific error naming the key and the rule before any GPU work (or,
where noted, a warning and a safe fallback), and must leave what the user had untouched."""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from megatron_tp_overlap.app.config import check_overrides, validate
from megatron_tp_overlap.errors import ConfigError
from megatron_tp_overlap.integrations.megatron import check_arguments
from megatron_tp_overlap.ub.rules import ValidationContext, validate_text

CTX = ValidationContext(sm_count=132, tp_size=4)
# A path under a regular file: no folder can be made there, whoever runs the tests (root included).
UNWRITABLE = os.path.join(__file__, "out")  # under a file: never creatable, nothing left behind


def yaml_error(text: str, ctx: ValidationContext = CTX) -> str:
    try:
        validate_text(text, ctx, source="ub.yaml")
    except ConfigError as e:
        return str(e)
    return ""


def hydra_error(*overrides: str, world: int = 4) -> str:
    problems = check_overrides(list(overrides))
    if problems:
        return "\n".join(problems)
    from megatron_tp_overlap.app.train import compose

    try:
        cfg = compose(list(overrides))
    except Exception as e:  # noqa: BLE001 - Hydra's own type errors
        return f"{e} {getattr(e, '__cause__', '')}"
    return "\n".join(validate(cfg, world))


def megatron_error(te_available: bool = True, **kw) -> str:
    base = dict(
        tp_comm_overlap_autotune=True,
        tp_comm_overlap=True,
        sequence_parallel=True,
        tensor_model_parallel_size=2,
        seq_length=4096,
        micro_batch_size=1,
        hidden_size=4096,
        ffn_hidden_size=14336,
        num_attention_heads=32,
        bf16=True,
        decoder_seq_length=None,
        transformer_impl="transformer_engine",
        tp_comm_overlap_cfg=None,
        tp_comm_overlap_autotune_output=str(Path(tempfile.gettempdir()) / "tpo-bad-inputs" / "x.yaml"),
        save=None,
        tp_comm_overlap_autotune_steps=400,
        tp_comm_overlap_autotune_seconds=60.0,
        fp8=None,
    )
    base.update(kw)
    return "\n".join(check_arguments(argparse.Namespace(**base), te_available))


def example_error(argv: list[str], world: int = 4, multicast: bool = False, env: dict | None = None) -> str:
    spec = importlib.util.spec_from_file_location(
        "ln_mlp_example", Path(__file__).parents[1] / "examples" / "ln_mlp_with_overlap.py"
    )
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    env = {"UB_SKIPMC": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1"} if env is None else env
    try:
        return "\n".join(ex.check_launch(ex.parse_args(argv), world, multicast, env))
    except SystemExit:
        return "argparse refused"


def bench_error(op: str, M: int, N: int, K: int, tp: int) -> str:
    from megatron_tp_overlap.tools.bench import check_shape

    return "\n".join(check_shape(op, M, N, K, tp))


def file_error(content: bytes, name: str = "ub.yaml") -> str:
    """Validate a YAML file holding ``content`` (what --tp-comm-overlap-cfg, tp_overlap.file and --ub-cfg read)."""
    from megatron_tp_overlap.ub.rules import load_and_validate

    path = Path(tempfile.mkdtemp(prefix="tpo-bad-")) / name
    path.write_bytes(content)
    try:
        load_and_validate(path, CTX)
    except ConfigError as e:
        return str(e)
    finally:
        path.unlink()
        path.parent.rmdir()
    return ""


def cli_error(*argv: str, trace: object = None) -> str:
    """stderr of ``megatron-tp-overlap ARGV`` (argparse refusals included); ``trace``: a JSON document written
    to a temporary trace.json that ``{trace}`` in ARGV names."""
    import contextlib
    import io
    import json

    from megatron_tp_overlap.tools.cli import main

    tmp = Path(tempfile.mkdtemp(prefix="tpo-bad-"))
    (tmp / "trace.json").write_text(json.dumps(trace))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main([a.replace("{trace}", str(tmp / "trace.json")).replace("{tmp}", str(tmp)) for a in argv])
        except SystemExit as e:
            code = e.code
    (tmp / "trace.json").unlink()
    for f in tmp.iterdir():
        f.unlink() if f.is_file() else f.rmdir()
    tmp.rmdir()
    return err.getvalue() if code == 2 else ""  # bad input exits 2, in every tool


_FILES = tempfile.TemporaryDirectory(prefix="tpo-bad-")  # removed when the test process ends


def yaml_file(text: str, name: str = "ub.yaml") -> str:
    """A file holding ``text``, alone in a fresh folder under :data:`_FILES`."""
    path = Path(tempfile.mkdtemp(dir=_FILES.name)) / name
    path.write_text(text)
    return str(path)


def run_without_megatron() -> str:
    """``-m megatron_tp_overlap.run script.py`` where ``megatron.training`` does not import (CI has no Megatron)."""
    import contextlib
    import io
    import sys

    from megatron_tp_overlap.integrations.megatron.launcher import run_script

    err = io.StringIO()
    saved = sys.modules.get("megatron.training", False)
    sys.modules["megatron.training"] = None  # an import of it raises ImportError
    try:
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
            run_script([__file__, "--tp-comm-overlap"])
    finally:
        if saved is False:
            del sys.modules["megatron.training"]
        else:
            sys.modules["megatron.training"] = saved
    return err.getvalue()


def train_error(*argv: str, rank: str = "0") -> str:
    """stderr of ``python -m megatron_tp_overlap.train ARGV`` when it exits 2 without a traceback or Hydra's block
    (the project's format); stdout must then be empty (nothing else printed)."""
    import contextlib
    import io
    import sys

    from megatron_tp_overlap.app.train import main

    err, out, saved = io.StringIO(), io.StringIO(), sys.argv
    sys.argv = ["megatron_tp_overlap.train", *argv]
    env = pytest.MonkeyPatch()
    env.setenv("RANK", rank)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                main()
                code = 0
            except SystemExit as e:
                code = e.code
    finally:
        sys.argv = saved
        env.undo()
    text = err.getvalue()
    return text if code == 2 and "Traceback" not in text and "HYDRA_FULL_ERROR" not in text else ""


def one_line(text: str) -> str:
    """``text`` when it is one problem line (after the heading ``invalid config:``), else ""."""
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.endswith(":")]
    return text if len(lines) == 1 else ""


GOOD_EVENT = {
    "ph": "X",
    "cat": "kernel",
    "name": "nvjet_gemm",
    "pid": 0,
    "tid": 7,
    "ts": 1.0,
    "dur": 2.0,
    "args": {"device": 0, "stream": 7},
}


CATALOG: list[tuple[str, Callable[[], str], tuple[str, ...]]] = [
    # --- userbuffers YAML (--tp-comm-overlap-cfg, tp_overlap.file, --ub-cfg) ---
    (
        "yaml: unknown GEMM",
        lambda: yaml_error("qkv_fwd:\n  method: bulk\n"),
        ("ub.yaml:1", "qkv_fwd", "unknown GEMM name"),
    ),
    (
        "yaml: unknown knob",
        lambda: yaml_error("qkv_fprop:\n  method: ring_exchange\n  num_sms: 4\n"),
        ("ub.yaml:3", "qkv_fprop.num_sms", "unknown key (did you mean 'num_sm'?)"),
    ),
    (
        "yaml: unknown method",
        lambda: yaml_error("qkv_fprop:\n  method: ring\n"),
        ("qkv_fprop.method", "must be one of"),
    ),
    (
        "yaml: pipeline on an all-gather GEMM",
        lambda: yaml_error("qkv_fprop:\n  method: pipeline\n"),
        ("qkv_fprop.method", "only overlaps reduce-scatter"),
    ),
    (
        "yaml: bulk on a reduce-scatter GEMM",
        lambda: yaml_error("fc2_fprop:\n  method: bulk\n"),
        ("fc2_fprop.method", "allowed methods"),
    ),
    (
        "yaml: num_sm not an integer",
        lambda: yaml_error("fc2_fprop:\n  method: pipeline\n  num_sm: many\n"),
        ("fc2_fprop.num_sm", "must be an integer"),
    ),
    (
        "yaml: num_sm < 1",
        lambda: yaml_error("fc2_fprop:\n  method: pipeline\n  num_sm: -1\n"),
        ("fc2_fprop.num_sm", ">= 1"),
    ),
    (
        "yaml: num_sm above the SM count",
        lambda: yaml_error("fc2_fprop:\n  method: pipeline\n  num_sm: 400\n"),
        ("fc2_fprop.num_sm = 400", "SM count (132)"),
    ),
    (
        "yaml: num_splits < 1",
        lambda: yaml_error("fc2_fprop:\n  method: pipeline\n  num_splits: 0\n"),
        ("fc2_fprop.num_splits", ">= 1"),
    ),
    (
        "yaml: atomic_gemm without FP8",
        lambda: yaml_error("fc2_fprop:\n  method: pipeline\n  atomic_gemm: true\n"),
        ("fc2_fprop.atomic_gemm", "only with FP8"),
    ),
    (
        "yaml: boolean knob given a word",
        lambda: yaml_error("qkv_fprop:\n  method: ring_exchange\n  aggregate: maybe\n"),
        ("qkv_fprop.aggregate", "boolean"),
    ),
    (
        "yaml: wgrad entry beside a reduce-scatter dgrad",
        lambda: yaml_error("qkv_dgrad:\n  method: ring_exchange\nqkv_wgrad:\n  method: bulk\n"),
        ("qkv_wgrad", "no entry allowed when qkv_dgrad"),
    ),
    (
        "yaml: truncated file",
        lambda: yaml_error("qkv_fprop:\n  method: [ring_exchange\n"),
        ("ub.yaml:2:11", "malformed YAML"),  # where the unclosed `[` starts, not where the parser gave up
    ),
    (
        "yaml: a list instead of a mapping",
        lambda: yaml_error("- qkv_fprop\n- fc1_fprop\n"),
        ("<top level>", "must be a mapping"),
    ),
    (
        "yaml: an entry that is not a mapping",
        lambda: yaml_error("qkv_fprop: ring_exchange\n"),
        ("qkv_fprop", "mapping of knob"),
    ),
    (
        "yaml: duplicate GEMM entry",
        lambda: yaml_error("qkv_fprop:\n  method: bulk\nqkv_fprop:\n  method: ring_exchange\n"),
        ("ub.yaml:3", "duplicate GEMM entry"),
    ),
    ("yaml: tab indentation", lambda: yaml_error("qkv_fprop:\n\tmethod: bulk\n"), ("ub.yaml:2", "malformed YAML")),
    # --- Hydra overrides of the main job ---
    (
        "hydra: typo in a key",
        lambda: hydra_error("tp_overlap.budget_iter=5"),
        ("tp_overlap.budget_iter", "valid keys of tp_overlap", "seconds"),
    ),
    ("hydra: unknown model", lambda: hydra_error("model=llama4"), ("model 'llama4'", "llama3_8b")),
    ("hydra: unknown tp_overlap mode", lambda: hydra_error("tp_overlap=fast"), ("tp_overlap 'fast'", "autotune")),
    ("hydra: wrong type", lambda: hydra_error("parallel.tp=abc"), ("parallel.tp",)),
    (
        "hydra: unsupported precision",
        lambda: hydra_error("training.precision=fp16"),
        ("training.precision", "must be one of bf16, fp8"),
    ),
    ("hydra: negative budget", lambda: hydra_error("tp_overlap.seconds=-3"), ("tp_overlap.seconds", "> 0")),
    (
        "hydra: TP does not divide the GPUs",
        lambda: hydra_error("parallel.tp=3"),
        ("parallel.tp x parallel.pp = 3", "divide"),
    ),
    ("hydra: TP=1 with overlap", lambda: hydra_error("parallel.tp=1"), ("parallel.tp >= 2", "tp_overlap=off")),
    (
        "hydra: no sequence parallelism",
        lambda: hydra_error("parallel.sequence_parallel=false"),
        ("sequence_parallel=true",),
    ),
    (
        "hydra: unknown NeMo preset",
        lambda: hydra_error("tp_overlap=preset", "tp_overlap.preset=nope"),
        ("tp_overlap.preset = 'nope'", "valid"),
    ),
    (
        "hydra: missing overlap file",
        lambda: hydra_error("tp_overlap=file", "tp_overlap.file=/nonexistent.yaml"),
        ("tp_overlap.file", "cannot read"),
    ),
    (
        "hydra: heads not divisible by TP",
        lambda: hydra_error("model.num_attention_heads=30"),
        ("model.num_attention_heads = 30", "divisible by parallel.tp"),
    ),
    (
        "hydra: batch not a multiple of micro-batch x DP",
        lambda: hydra_error("training.micro_batch_size=3"),
        ("training.global_batch_size", "multiple of micro_batch_size"),
    ),
    (
        "hydra: unwritable output folder",
        lambda: hydra_error(f"output.root={UNWRITABLE}"),
        ("output.root", "cannot write", "not a folder"),
    ),
    (
        "hydra: unwritable cache folder",
        lambda: hydra_error(f"tp_overlap.cache_dir={UNWRITABLE}"),
        ("tp_overlap.cache_dir", "cannot write"),
    ),
    # --- Megatron flags ---
    (
        "megatron: autotune without --tp-comm-overlap",
        lambda: megatron_error(tp_comm_overlap=False),
        ("needs --tp-comm-overlap",),
    ),
    (
        "megatron: no --sequence-parallel",
        lambda: megatron_error(sequence_parallel=False),
        ("needs --sequence-parallel",),
    ),
    ("megatron: TP=1", lambda: megatron_error(tensor_model_parallel_size=1), ("--tensor-model-parallel-size >= 2",)),
    ("megatron: Transformer Engine missing", lambda: megatron_error(te_available=False), ("needs Transformer Engine",)),
    (
        "megatron: local transformer implementation",
        lambda: megatron_error(transformer_impl="local"),
        ("--transformer-impl",),
    ),
    ("megatron: fp16 with overlap", lambda: megatron_error(fp16=True), ("--fp16", "adds in bf16", "use --bf16")),
    (
        "bench: TE reduce-scatter in fp16",
        lambda: (
            __import__("megatron_tp_overlap.tools.bench", fromlist=["x"]).backend_support("te_ring", "float16", "rs")
            or ""
        ),
        ("fp16 sums come out wrong",),
    ),
    (
        "megatron: negative step limit",
        lambda: megatron_error(tp_comm_overlap_autotune_steps=-1),
        ("-steps = -1", ">= 0"),
    ),
    (
        "megatron: unwritable output",
        lambda: megatron_error(tp_comm_overlap_autotune_output=f"{UNWRITABLE}/t.yaml"),
        ("-output", "cannot write"),
    ),
    # --- the example's launch ---
    (
        "example: one GPU per TP group",
        lambda: example_error(["--num-replicas", "4"]),
        ("tensor parallelism needs >= 2",),
    ),
    (
        "example: world not divisible by replicas",
        lambda: example_error(["--num-replicas", "3"]),
        ("not divisible by --num-replicas 3",),
    ),
    (
        "example: no multicast and no UB_SKIPMC",
        lambda: example_error([], env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"}),
        ("UB_SKIPMC=1",),
    ),
    # --- kernel bench shapes ---
    ("bench: a single GPU", lambda: bench_error("ag", 1024, 12288, 49152, 1), ("needs >= 2 GPUs",)),
    (
        "bench: M not divisible by TP",
        lambda: bench_error("ag", 1000, 12288, 49152, 3),
        ("M = 1000", "divisible by the TP size 3"),
    ),
    # --- YAML files on disk ---
    ("yaml: binary file", lambda: file_error(b"\xff\xfe\x00qkv"), ("ub.yaml", "not UTF-8 text")),
    ("yaml: GEMM name typo", lambda: yaml_error("qkv_fporp:\n  method: bulk\n"), ("did you mean 'qkv_fprop'",)),
    (
        "yaml: unclosed bracket on the last line",
        lambda: yaml_error("qkv_dgrad:\n  method: bulk\nfc1_fprop: [1, 2\n"),
        ("ub.yaml:3:12", "malformed YAML"),
    ),
    # --- Hydra main job: values that used to slip through ---
    (
        "hydra: zero heads",
        lambda: hydra_error("model.num_attention_heads=0"),
        ("model.num_attention_heads = 0", ">= 1"),
    ),
    ("hydra: zero micro-batch", lambda: hydra_error("training.micro_batch_size=0"), ("training.micro_batch_size = 0",)),
    ("hydra: negative sequence", lambda: hydra_error("training.seq_length=-4096"), ("training.seq_length = -4096",)),
    ("hydra: zero layers", lambda: hydra_error("model.num_layers=0"), ("model.num_layers = 0", ">= 1")),
    ("hydra: negative hidden", lambda: hydra_error("model.hidden_size=-2048"), ("model.hidden_size = -2048",)),
    ("hydra: zero ffn", lambda: hydra_error("model.ffn_hidden_size=0"), ("model.ffn_hidden_size = 0",)),
    ("hydra: zero vocab", lambda: hydra_error("model.vocab_size=0"), ("model.vocab_size = 0",)),
    (
        "hydra: zero global batch",
        lambda: hydra_error("training.global_batch_size=0"),
        ("training.global_batch_size = 0",),
    ),
    ("hydra: zero KV groups", lambda: hydra_error("model.num_query_groups=0"), ("model.num_query_groups = 0", ">= 1")),
    ("hydra: negative lr", lambda: hydra_error("training.lr=-1"), ("training.lr = -1.0", "> 0")),
    ("hydra: nan budget", lambda: hydra_error("tp_overlap.seconds=nan"), ("tp_overlap.seconds = nan", "finite")),
    ("hydra: inf budget", lambda: hydra_error("tp_overlap.seconds=inf"), ("tp_overlap.seconds = inf", "finite")),
    ("hydra: key typo", lambda: hydra_error("tp_overlap.secnds=5"), ("tp_overlap.secnds", "did you mean 'seconds'")),
    ("hydra: group typo", lambda: hydra_error("modle=llama3_8b"), ("'modle'", "did you mean 'model'")),
    ("hydra: model choice typo", lambda: hydra_error("model=llama3-8b"), ("did you mean 'llama3_8b'",)),
    (
        "hydra: preset typo",
        lambda: hydra_error("tp_overlap=preset", "tp_overlap.preset=userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen819"),
        ("tp_overlap.preset", "did you mean 'userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192'"),
    ),
    (
        "hydra: unknown HF model",
        lambda: hydra_error("model.hf=acme/Nope-7B"),
        ("model.hf = 'acme/Nope-7B'", "looked in"),
    ),
    (
        "hydra: preset and file together",
        lambda: hydra_error(
            "tp_overlap.preset=userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192", "tp_overlap.file=x.yaml"
        ),
        ("tp_overlap.preset and tp_overlap.file", "give one"),
    ),
    (
        "hydra: output is a directory",
        lambda: hydra_error(f"tp_overlap.output={tempfile.gettempdir()}"),
        ("is a directory",),
    ),
    ("hydra: rtol too large", lambda: hydra_error("tp_overlap.rtol=5"), ("tp_overlap.rtol = 5.0", "<= 0.5")),
    # --- Megatron-LM flags ---
    (
        "megatron: rtol too large",
        lambda: megatron_error(tp_comm_overlap_autotune_rtol=5.0),
        ("-rtol = 5.0: must be <= 0.5",),
    ),
    (
        "megatron: nan budget",
        lambda: megatron_error(tp_comm_overlap_autotune_seconds=float("nan")),
        ("-seconds = nan",),
    ),
    (
        "megatron: strategy typo",
        lambda: megatron_error(tp_comm_overlap_autotune_strategy="coordnate"),
        ("-strategy = 'coordnate'", "did you mean 'coordinate'"),
    ),
    (
        "megatron: output is a directory",
        lambda: megatron_error(tp_comm_overlap_autotune_output=tempfile.gettempdir()),
        ("--tp-comm-overlap-autotune-output", "is a directory"),
    ),
    (
        "megatron: --tp-comm-overlap-cfg is a directory",
        lambda: megatron_error(tp_comm_overlap_cfg=tempfile.gettempdir()),
        ("--tp-comm-overlap-cfg", "is a directory, not a YAML file"),
    ),
    (
        "megatron: num_splits beyond the tokens per rank",
        lambda: megatron_error(tp_comm_overlap_cfg=yaml_file("fc2_fprop:\n  method: pipeline\n  num_splits: 100000\n")),
        ("fc2_fprop.num_splits = 100000", "must be <= tokens / TP = 4096 / 2 = 2048"),
    ),
    ("megatron: -m megatron_tp_overlap.run without Megatron", lambda: run_without_megatron(), ("needs Megatron-LM",)),
    (
        "megatron: full recompute under per-layer CUDA graphs (Megatron's own refusal, quoted)",
        lambda: megatron_error(
            cuda_graph_impl="local", recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        ),
        ("--cuda-graph-impl local with --recompute-granularity full", "only supported with full iteration CUDA graph"),
    ),
    (
        "cli sweep: malformed local config.json",
        lambda: cli_error("sweep", "--model", str(Path(yaml_file("{bad", "config.json")).parent), "--out", "{tmp}"),
        ("config.json is not a readable model config",),
    ),
    # --- the example ---
    ("example: zero iterations", lambda: example_error(["--num-iters", "0"]), ("argparse refused",)),
    (
        "example: sequence not divisible by TP",
        lambda: example_error(["--seq-length", "2047"], world=2),
        ("--seq-length 2047", "divisible by the TP size 2"),
    ),
    # --- CLI subcommands ---
    ("cli validate: --tp 0", lambda: cli_error("validate", "x.yaml", "--tp", "0"), ("--tp", "must be >= 1")),
    ("cli validate: --tp -4", lambda: cli_error("validate", "x.yaml", "--tp", "-4"), ("--tp", "must be >= 1")),
    ("cli validate: --sm-count 0", lambda: cli_error("validate", "x.yaml", "--sm-count", "0"), ("--sm-count",)),
    ("cli validate: missing file", lambda: cli_error("validate", "/nonexistent/ub.yaml"), ("cannot read",)),
    ("cli preset: typo", lambda: cli_error("preset", "te_defualt"), ("unknown preset", "did you mean 'te_default'")),
    ("cli analyze: empty trace", lambda: cli_error("analyze", "{trace}", trace=[]), ("no GPU kernel events",)),
    (
        "cli analyze: event without ts",
        lambda: cli_error("analyze", "{trace}", trace=[{**GOOD_EVENT, "ts": "soon"}]),
        ("without a numeric ts/dur",),
    ),
    (
        "cli analyze: --json is a directory",
        lambda: cli_error("analyze", "{trace}", "--json", "{tmp}", trace=[GOOD_EVENT]),
        ("--json", "is a directory"),
    ),
    ("cli sweep: zero layers", lambda: cli_error("sweep", "--model", "Qwen/Qwen3-8B", "--layers", "0"), ("--layers",)),
    ("cli sweep: negative budget", lambda: cli_error("sweep", "--model", "x", "--budget-s", "-1"), ("--budget-s",)),
    (
        "cli sweep: unwritable --out",
        lambda: cli_error("sweep", "--model", "Qwen/Qwen3-8B", "--out", UNWRITABLE),
        ("--out", "cannot write there"),
    ),
    (
        "cli sweep: model name typo",
        lambda: cli_error("sweep", "--model", "qwen3-8b", "--out", "{tmp}"),
        ("did you mean 'Qwen/Qwen3-8B'",),
    ),
]


CATALOG += [
    # --- what a newcomer meets first (issue 51) ---
    (
        "train: wrong type, one line, exit 2",
        lambda: one_line(train_error("parallel.tp=abc")),
        ("parallel.tp = 'abc'", "must be an integer"),
    ),
    (
        "train: boolean given a word",
        lambda: train_error("parallel.sequence_parallel=maybe"),
        ("parallel.sequence_parallel = 'maybe'", "true or false"),
    ),
    ("train: empty number", lambda: train_error("training.seq_length="), ("training.seq_length = ''", "an integer")),
    (
        "train: --dry-run of a launch validation refuses",
        lambda: train_error("--dry-run", "parallel.tp=3", "tp_overlap.seconds=-5"),
        ("model.num_attention_heads = 16: must be divisible by parallel.tp = 3", "tp_overlap.seconds = -5.0"),
    ),
    ("train: --world-size without --dry-run", lambda: train_error("--world-size=4"), ("only with --dry-run",)),
    (
        "hydra: model.hf a JSON file that is not a config",
        lambda: one_line(hydra_error("model.hf=" + yaml_file('{"a": 1}', "x.json"))),
        ("is JSON but not a Hugging Face model config",),
    ),
    ("hydra: model.hf empty", lambda: one_line(hydra_error("model.hf=")), ("model.hf = ''", "empty")),
    (
        "hydra: model.hf a folder without config.json",
        lambda: one_line(hydra_error(f"model.hf={Path(yaml_file('', 'README')).parent}")),
        ("holds no config.json",),
    ),
    ("cli validate: --tp 1", lambda: cli_error("validate", "x.yaml", "--tp", "1"), ("--tp = 1", ">= 2")),
    (
        "cli validate: num_sm beyond any GPU",
        lambda: cli_error(
            "validate", yaml_file("fc2_fprop:\n  method: pipeline\n  num_sm: 100000000000000000000000\n")
        ),
        ("fc2_fprop.num_sm", "the most SMs of any GPU"),
    ),
    (
        "cli validate: --sm-count beyond any GPU",
        lambda: cli_error("validate", "x.yaml", "--sm-count", "1000"),
        ("--sm-count = 1000",),
    ),
    (
        "cli validate: num_splits against the run's tokens",
        lambda: cli_error(
            "validate",
            yaml_file("fc2_fprop:\n  method: pipeline\n  num_splits: 100000\n"),
            "--megatron-args",
            "--tensor-model-parallel-size 2 --seq-length 4096 --micro-batch-size 1 --bf16",
        ),
        ("fc2_fprop.num_splits = 100000", "tokens / TP = 4096 / 2 = 2048"),
    ),
    (
        "cli validate: a wrapped ub_cfgs",
        lambda: cli_error("validate", yaml_file("ub_cfgs:\n  qkv_fprop:\n    method: ring_exchange\n")),
        ("ub.yaml:1", "drop `ub_cfgs:`"),
    ),
    ("cli analyze: not JSON", lambda: cli_error("analyze", yaml_file("{bad", "t.json")), ("t.json",)),
    (
        "cli sweep: --max-tp-size 3",
        lambda: cli_error("sweep", "--model", "Qwen/Qwen3-8B", "--max-tp-size", "3", "--out", "{tmp}"),
        ("--max-tp-size = 3", "power of two"),
    ),
    (
        "cli sweep: --tol -1",
        lambda: cli_error("sweep", "--model", "Qwen/Qwen3-8B", "--tol", "-1", "--out", "{tmp}"),
        ("--tol = -1.0", ">= 0"),
    ),
    ("cli bench: ag 0 0 0 on any machine", lambda: cli_error("bench", "ag", "0", "0", "0"), ("M, N, K = 0, 0, 0",)),
]


def test_the_catalog_is_large_enough_and_the_readme_says_how_large():
    assert len(CATALOG) >= 60
    assert f"holds {len(CATALOG)} cases" in (Path(__file__).parents[1] / "README.md").read_text()


@pytest.mark.parametrize("name, produce, needles", CATALOG, ids=[c[0] for c in CATALOG])
def test_bad_input_is_refused_with_key_and_rule(name, produce, needles):
    message = produce()
    assert message, f"{name}: accepted"
    for n in needles:
        assert n in message, f"{name}: {n!r} not in {message!r}"


def test_a_refused_yaml_leaves_the_users_file_as_it_was(tmp_path):
    from megatron_tp_overlap.ub.rules import load_and_validate

    f = tmp_path / "ub.yaml"
    text = "fc2_fprop:\n  method: bulk\n"
    f.write_text(text)
    before = os.stat(f).st_mtime_ns
    with pytest.raises(ConfigError):
        load_and_validate(f, CTX)
    assert f.read_text() == text and os.stat(f).st_mtime_ns == before
