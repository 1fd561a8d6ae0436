"""What a newcomer meets first (issue 51): docs that name only paths that exist, dependencies that are declared, the
main job's dry run, the version, the plugin's flags in ``run --help`` without Megatron, errors printed once, and
huggingface_hub's own offline semantics."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

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
    assert "budget: 60 s" in text and f"run directory: {tmp_path}/<timestamp" in text
    assert "tp_comm_overlap_tuned.yaml" in text and "cache: " in text


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
