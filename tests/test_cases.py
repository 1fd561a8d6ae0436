"""Every GPU case of ``benchmarks/cases.yaml`` is ready to run as one command on its machine: its process counts
match the GPUs it names, every layer shape it names exists and splits over its TP size, its Megatron-LM shapes split
over the TP size, and its main-job overrides pass the app's own validation. A case that would die on the lent
machine at start-up costs a multi-GPU session; these checks cost nothing."""

import json
import re
import shlex
from pathlib import Path

import pytest
from benchmark_module import load_benchmark

suite, ovb, mega = (load_benchmark(n) for n in ("suite", "overlap_vs_baselines", "megatron_autotune"))
CASES = suite.load_cases()


def _segments(cmd: str, program: str) -> list[list[str]]:
    """The arguments of each invocation of ``program`` in a case's command (also inside ``bash -c '...'``)."""
    out = []
    for part in re.split(r"&&|;|\|", cmd):
        words = shlex.split(part.replace("'", " "))
        if program in words:
            out.append(words[words.index(program) + 1 :])
    return out


def _opt(words: list[str], name: str, default=None):
    return words[words.index(name) + 1] if name in words else default


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_gpu_case_is_ready_to_run_on_its_machine(name):
    case = CASES[name]
    gpus = case["gpus"]
    cmd = suite.command_of(case, Path("/out"), "/megatron-lm", gpus)
    nprocs = [int(n) for n in re.findall(r"--nproc-per-node=(\d+)", cmd)] + [
        int(n) for n in re.findall(r"--gpus (\d+)", cmd)
    ]
    assert all(n == gpus for n in nprocs), (name, gpus, nprocs)

    for words in _segments(cmd, "benchmarks/overlap_vs_baselines.py"):
        from megatron_tp_overlap.models import load_model_dims

        shapes = dict(ovb.parse_shape(s) for s in [w for i, w in enumerate(words) if words[i - 1] == "--shape"])
        for c in _opt(words, "--cases", ",".join(ovb.DEFAULT_CASES)).split(","):
            assert c in ovb.CASES or c in shapes, (name, c)
            d, seq, mbs = shapes[c] if c in shapes else (load_model_dims(ovb.CASES[c][0]), *ovb.CASES[c][1:])
            for what, v in (("heads", d.heads), ("kv heads", d.kv_heads), ("ffn", d.ffn), ("tokens", seq * mbs)):
                assert v % gpus == 0, (name, c, what, v, gpus)

    for words in _segments(cmd, "benchmarks/megatron_autotune.py"):
        tp = int(_opt(words, "--tp", 2))
        assert gpus % tp == 0, (name, tp)
        dims = {k: int(_opt(words, f"--{k.replace('_', '-')}", v)) for k, v in mega.MODEL.items()}
        for k in ("heads", "kv_groups", "ffn"):
            assert dims[k] % tp == 0, (name, k, dims[k], tp)
        assert int(_opt(words, "--seq", 8192)) % tp == 0

    for overrides in re.findall(r"-m megatron_tp_overlap\.train (.*?) 2>&1", cmd):
        from megatron_tp_overlap.app.config import check_overrides, validate
        from megatron_tp_overlap.app.train import compose

        words = [w for w in shlex.split(overrides) if "=" in w]
        assert check_overrides(words) == [], name
        assert validate(compose(words), gpus) == [], name


def test_every_multi_gpu_issue_has_its_cases():
    """TP=4 and TP=8 each have layer-level, Megatron-LM (bf16 and FP8) and main-job cases; `gpu_tests` runs at the
    machine's TP size (tests/test_gpu_engine.py)."""
    for gpus in (4, 8):
        cmds = [c["command"] for c in CASES.values() if c["gpus"] == gpus]
        assert any("overlap_vs_baselines.py" in c for c in cmds)
        assert any("megatron_autotune.py" in c and "--fp8" not in c for c in cmds)
        assert any("megatron_autotune.py" in c and "--fp8" in c for c in cmds)
        assert any("megatron_tp_overlap.train" in c for c in cmds)


def test_per_gpu_runs_one_gpu_cases_side_by_side_each_on_its_own_gpu_and_port(tmp_path, monkeypatch):
    """``suite.py --per-gpu`` on a 2-GPU node: the two one-GPU cases run at once (each waits for the other to have
    started, so neither passes alone), pinned to GPUs 0 and 1 with their own torchrun master ports; the 2-GPU case
    runs after them, unpinned. (Side by side on 2 x H100, two torchruns without their own port clashed on 29500.)"""
    wait_for = "for i in $(seq 100); do [ -f {out}/../{other} ] && break; sleep 0.1; done; [ -f {out}/../{other} ]"
    cases = {
        n: {
            "about": n,
            "gpus": 1,
            "timeout_s": 60,
            "command": f"touch {{out}}/../{n}.started; echo $CUDA_VISIBLE_DEVICES $PET_MASTER_PORT; "
            + wait_for.replace("{other}", f"{other}.started"),
            "report": [r"^\d"],
        }
        for n, other in (("a", "b"), ("b", "a"))
    }
    cases["both"] = {
        "about": "both",
        "gpus": 2,
        "timeout_s": 60,
        "command": "echo x${{CUDA_VISIBLE_DEVICES}}x",
        "report": ["x"],
    }
    monkeypatch.setattr(suite, "load_cases", lambda: cases)
    monkeypatch.setattr(suite, "device", lambda: ("2 x Fake GPU", 2))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    rc = suite.main(["suite.py", "--cases", "both,a,b", "--per-gpu", "--out", str(tmp_path)])
    assert rc == 0
    results = json.loads((tmp_path / "summary.json").read_text())
    assert [r["case"] for r in results] == ["a", "b", "both"]
    pinned = {r["lines"][0] for r in results[:2]}
    assert pinned == {f"{g} {29600 + 10 * g}" for g in (0, 1)}, pinned
    assert results[2]["lines"] == ["xx"] and "gpu" not in results[2]
    assert "Side by side, one per GPU: a (GPU" in (tmp_path / "README.md").read_text()


def test_side_by_side_cases_take_their_master_port_from_the_suite(monkeypatch, capsys):
    """``--per-gpu`` gives each one-GPU case its own torchrun master port through ``PET_MASTER_PORT``: no one-GPU
    case may fix one, and megatron_autotune.py (which passes torchrun a port of its own) takes it as its default."""
    fixed = [n for n, c in CASES.items() if c["gpus"] == 1 and "--master-port" in c["command"]]
    assert not fixed, fixed
    monkeypatch.setenv("PET_MASTER_PORT", "29610")
    monkeypatch.setattr("sys.argv", ["megatron_autotune.py", "--help"])
    with pytest.raises(SystemExit):
        mega.main()
    assert "default 29610" in " ".join(capsys.readouterr().out.split())
