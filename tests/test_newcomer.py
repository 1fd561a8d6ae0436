"""What a newcomer meets first (issue 51): docs that name only paths that exist, dependencies that are declared, the
main job's dry run, the version, the plugin's flags in ``run --help`` without Megatron, errors printed once, and
huggingface_hub's own offline semantics."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from megatron_tp_overlap.engine.options import TuneOptions

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# named in the docs, not in this repository, on purpose
ELSEWHERE = {
    "pretrain_gpt.py": "Megatron-LM's training script",
    "./tp_comm_overlap_tuned.yaml": "written by a run",
    "runs/": "the main job's output.root, made by a run",
    "tensorboard/": "made in a run directory",
}


def named_paths(doc: Path) -> list[str]:
    """Link targets, and backticked words that look like a path (a ``/`` in them, or a .py/.md file)."""
    text = doc.read_text()
    links = [u.split("#")[0] for u in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in u]
    ticks = [
        w
        for w in re.findall(r"`([^`\s]+)`", text)
        if not w.startswith(("-", "~", "$")) and not re.search(r"[<>{}*=()\[\]:,|]", w)
        if "/" in w or w.endswith((".py", ".md"))
    ]
    return [p for p in links + ticks if p and p not in ELSEWHERE]


def test_every_path_the_docs_name_exists():
    missing = []
    for doc in DOCS:
        for p in named_paths(doc):
            # from the repository root, the document's folder, or (module paths such as engine/space.py) the package
            bases = [ROOT, doc.parent, ROOT / "megatron_tp_overlap"]
            if not (Path(p).exists() if p.startswith("/") else any((b / p).exists() for b in bases)):
                missing.append(f"{doc.relative_to(ROOT)}: {p}")
            elif not p.startswith("/") and not any((b / p).resolve().is_relative_to(ROOT) for b in bases):
                missing.append(f"{doc.relative_to(ROOT)}: {p} (outside the repository)")
    assert missing == []


def test_every_package_the_code_imports_is_declared_or_optional():
    imported = set()
    for f in (ROOT / "megatron_tp_overlap").rglob("*.py"):
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, ast.Import):
                imported |= {a.name.split(".")[0] for a in n.names}
            elif isinstance(n, ast.ImportFrom) and n.level == 0:
                imported.add(n.module.split(".")[0])
    setup = (ROOT / "setup.py").read_text()
    declared = {
        re.split(r"[<>=\[ ]", d)[0].lower().replace("-", "_") for d in re.findall(r'"([A-Za-z][^"]*?)>=', setup)
    }
    names = {"yaml": "pyyaml", "hydra": "hydra_core"}
    optional = {"megatron", "transformer_engine", "nemo", "flux", "megatron_tp_overlap"}  # GPU extras, or ourselves
    undeclared = {
        m for m in imported - set(sys.stdlib_module_names) - optional if names.get(m, m).lower() not in declared
    }
    assert undeclared == set()


def test_library_plots_leave_pyplot_and_the_backend_alone():
    code = {f: f.read_text() for f in (ROOT / "megatron_tp_overlap").rglob("*.py")}
    uses = re.compile(r"import matplotlib\.pyplot|from matplotlib import pyplot|matplotlib\.use\(")
    assert [str(f) for f, t in code.items() if uses.search(t)] == []


def _dry(*overrides: str, world: int = 2, gpu: str | None = None) -> tuple[list[str], list[str]]:
    from megatron_tp_overlap.app.dry_run import dry_run
    from megatron_tp_overlap.app.train import compose

    return dry_run(compose(list(overrides)), world, "test", gpu)


def test_dry_run_resolves_model_hf_and_prints_what_the_launch_will_do(tmp_path):
    from megatron_tp_overlap.app.config import ModelConfig
    from megatron_tp_overlap.models import load_model_dims

    problems, lines = _dry("model.hf=Qwen/Qwen3-4B", "model.num_layers=4", f"output.root={tmp_path}", gpu="h100")
    text = "\n".join(lines)
    d = load_model_dims("Qwen/Qwen3-4B")
    assert problems == []
    assert f"hidden_size: {d.hidden}" in text and f"ffn_hidden_size: {d.ffn}" in text and "null" not in text
    assert f"num_layers: 4 (given; the model's: {d.layers})" in text
    for f in ModelConfig.__dataclass_fields__:  # every dimension field, including ones added later
        assert f in ("name", "hf") or f"  {f}: " in text, f
    assert f"userbuffers: [4096, {d.hidden}]" in text and "H100 (132 SMs)" in text
    assert re.search(r"search: slots qkv\.fwd\(1\), .*; \d+ options over 10 GEMMs", text)
    assert f"budget: {TuneOptions.seconds:g} s" in text and f"run directory: {tmp_path}/<timestamp" in text
    assert "tp_comm_overlap_tuned.yaml" in text and "cache: " in text


def test_the_dry_run_of_an_moe_model_lists_the_slots_megatron_builds(tmp_path):
    """Mixtral has no dense layer and no shared expert: only attention overlaps. The MoE preset (a dense first
    layer, a shared expert) adds fc1/fc2 and the shared experts' own slots."""
    text = "\n".join(_dry("model.hf=mistralai/Mixtral-8x7B-v0.1", "model.num_layers=2", f"output.root={tmp_path}")[1])
    assert re.search(
        r"search: slots qkv\.fwd\(1\), qkv\.bwd\(2\), proj\.fwd\(1\), proj\.bwd\(2\); \d+ options over 5 GEMMs", text
    )
    text = "\n".join(_dry("model=moe_small", f"output.root={tmp_path}")[1])
    assert "shared_fc1.fwd(1), shared_fc1.bwd(0), shared_fc2.fwd(1), shared_fc2.bwd(2)" in text and "fc1.bwd(2)" in text


def test_dry_run_checks_what_the_tuner_checks_with_the_gpu(tmp_path):
    yaml = tmp_path / "ub.yaml"
    yaml.write_text("fc2_fprop:\n  method: pipeline\n  num_sm: 140\n")  # fits a B200 (148 SMs), not an H100 (132)
    from megatron_tp_overlap.app.dry_run import dry_run
    from megatron_tp_overlap.app.train import compose

    cfg = compose(["tp_overlap=file", f"tp_overlap.file={yaml}", f"output.root={tmp_path}"])
    assert dry_run(cfg, 2, "test", "b200")[0] == []
    (problem,) = dry_run(cfg, 2, "test", "h100")[0]
    assert "fc2_fprop.num_sm = 140" in problem and "SM count (132)" in problem
    assert "give --world-size" in dry_run(cfg, None, "", None)[0][0]


def test_dry_run_exit_codes(monkeypatch, tmp_path, capsys):
    from megatron_tp_overlap.app.train import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for argv, code in (
        (["--dry-run", "--world-size=2", f"output.root={tmp_path}"], 0),
        (["--dry-run", "parallel.tp=3", "tp_overlap.seconds=-5"], 2),
    ):
        monkeypatch.setattr(sys, "argv", ["train", *argv])
        with pytest.raises(SystemExit) as e:
            main()
        assert e.value.code == code, capsys.readouterr()
    assert not (tmp_path / "runs").exists() and list(tmp_path.iterdir()) == []  # a dry run writes nothing


def test_a_bad_override_prints_once_on_rank_0_only(monkeypatch, capsys):
    from megatron_tp_overlap.app.train import main

    for rank, printed in (("0", True), ("1", False)):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setattr(sys, "argv", ["train", "parallel.tp=abc"])
        with pytest.raises(SystemExit) as e:
            main()
        err = capsys.readouterr().err
        assert e.value.code == 2 and ("parallel.tp = 'abc'" in err) == printed and err.count("\n") == printed


def test_version_in_every_entry_point(monkeypatch, capsys):
    from megatron_tp_overlap import __version__
    from megatron_tp_overlap.app.train import main as train
    from megatron_tp_overlap.integrations.megatron.launcher import run_script
    from megatron_tp_overlap.tools.cli import main as cli

    assert cli(["--version"]) == 0
    monkeypatch.setattr(sys, "argv", ["train", "--version"])
    for call in (train, lambda: run_script(["--version"])):
        with pytest.raises(SystemExit) as e:
            call()
        assert e.value.code == 0
    assert capsys.readouterr().out.count(__version__) == 3


def test_run_help_shows_the_plugins_flags_without_megatron(monkeypatch, capsys):
    from megatron_tp_overlap.engine.options import option_fields
    from megatron_tp_overlap.integrations.megatron.flags import flag_name
    from megatron_tp_overlap.integrations.megatron.launcher import run_script

    monkeypatch.setitem(sys.modules, "megatron", None)  # an import of it raises ImportError
    with pytest.raises(SystemExit) as e:
        run_script(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert all(flag_name(f.name) in out for f in option_fields()), out


def test_offline_mode_as_huggingface_hub_reads_it(monkeypatch):
    from megatron_tp_overlap.models import _hub_offline

    cases = [
        ({"HF_HUB_OFFLINE": "1"}, True),
        ({"HF_HUB_OFFLINE": "yes"}, True),
        ({"HF_HUB_OFFLINE": "no"}, False),
        ({"HF_HUB_OFFLINE": "off"}, False),
        ({"HF_HUB_OFFLINE": "FALSE"}, False),
        ({"TRANSFORMERS_OFFLINE": "1"}, True),
        ({}, False),
    ]
    for env, offline in cases:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert _hub_offline() == offline, env


def test_validate_says_what_it_could_not_check(tmp_path, capsys):
    from megatron_tp_overlap.tools.cli import main

    f = tmp_path / "ub.yaml"
    f.write_text("fc2_fprop:\n  method: pipeline\n  num_splits: 4\n")
    assert main(["validate", str(f)]) == 0
    out = capsys.readouterr().out
    assert "not checked: num_splits against the tokens" in out and "not checked: num_sm against the GPU" in out
    assert main(["validate", str(f), "--megatron-args", "--tensor-model-parallel-size 2 --seq-length 4096 "
                 "--micro-batch-size 1 --hidden-size 4096 --bf16", "--gpu", "h200"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "not checked" not in out and "userbuffers [4096, 4096]" in out and "H200" in out
    with pytest.raises(SystemExit):
        main(["validate", "--help"])
    helptext = capsys.readouterr().out
    for flag in ("--tp", "--seq-length", "--micro-batch-size", "--hidden-size", "--megatron-args", "--gpu", "--dtype"):
        assert re.search(rf"{flag}\b.*\n?\s+\S", helptext), flag


def _fake_megatron(monkeypatch, validate):
    """megatron.training.arguments / training and megatron.core.datasets.utils as install() patches them: a parser
    that takes the Megatron flags the test gives, and ``validate_args``."""
    import argparse
    import types

    from megatron_tp_overlap.integrations.megatron import launcher

    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        p = argparse.ArgumentParser()
        for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--seq-length"):
            p.add_argument(flag, type=int, default=1)
        for flag in ("--micro-batch-size", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads"):
            p.add_argument(flag, type=int, default=1)
        p.add_argument("--num-layers", type=int, default=2)
        for flag in ("--sequence-parallel", "--tp-comm-overlap", "--bf16"):
            p.add_argument(flag, action="store_true")
        p.add_argument("--tp-comm-overlap-cfg", default=None)
        p = extra_args_provider(p) if extra_args_provider else p
        args, _ = p.parse_known_args(sys.argv[1:])
        args.world_size, args.decoder_seq_length = int(__import__("os").environ.get("WORLD_SIZE", "1")), None
        return args

    arguments = types.SimpleNamespace(parse_args=parse_args, validate_args=validate)
    modules = {
        "megatron": types.ModuleType("megatron"),
        "megatron.training": types.ModuleType("megatron.training"),
        "megatron.training.arguments": arguments,
        "megatron.training.training": types.SimpleNamespace(train=lambda *a: None, training_log=None),
        "megatron.core": types.ModuleType("megatron.core"),
        "megatron.core.datasets": types.ModuleType("megatron.core.datasets"),
        "megatron.core.datasets.utils": types.SimpleNamespace(compile_helpers=lambda: None),
    }
    for name, mod in modules.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(launcher, "_installed", False)
    monkeypatch.setattr(launcher, "_te_available", lambda: True)


def test_the_launchers_dry_run_parses_and_validates_as_a_launch_and_says_what_tuning_would_do(
    monkeypatch, tmp_path, capsys
):
    from megatron_tp_overlap.integrations.megatron.launcher import run_script

    script = tmp_path / "pretrain_gpt.py"
    script.write_text("raise SystemExit('a dry run never runs the script')\n")
    flags = "--tensor-model-parallel-size 2 --seq-length 4096 --hidden-size 4096 --ffn-hidden-size 14336 "
    flags += "--num-attention-heads 32 --sequence-parallel --tp-comm-overlap --bf16 --tp-comm-overlap-autotune "
    flags += f"--tp-comm-overlap-autotune-output {tmp_path / 'ub.yaml'}"
    seen = []
    _fake_megatron(monkeypatch, lambda args, defaults: seen.append(args.world_size))
    with pytest.raises(SystemExit) as e:
        run_script(["--dry-run", "--world-size", "4", str(script), *flags.split()])
    out = capsys.readouterr().out
    assert e.value.code == 0 and seen == [4]
    assert "processes: 4; TP 2, PP 1, CP 1, DP 2" in out and "userbuffers: [4096, 4096]" in out
    assert f"tuned YAML: {tmp_path / 'ub.yaml'}" in out and not (tmp_path / "ub.yaml").exists()

    def refuses(args, defaults):
        raise AssertionError("num_attention_heads must be divisible by tensor_model_parallel_size")

    _fake_megatron(monkeypatch, refuses)
    with pytest.raises(SystemExit) as e:
        run_script(["--dry-run", str(script), *flags.split()])
    assert e.value.code == 2 and "validate_args refused these arguments: num_attention_heads" in capsys.readouterr().err
    _fake_megatron(monkeypatch, lambda args, defaults: None)
    with pytest.raises(SystemExit) as e:  # the plugin's own check, as a launch: no sequence parallelism
        run_script(["--dry-run", str(script), *flags.replace("--sequence-parallel ", "").split()])
    assert e.value.code == 2 and "needs --sequence-parallel" in capsys.readouterr().err
