"""Sweep planning and outputs from synthetic per-TP results (the GPU part runs layer_bench)."""

import json

import pytest

from megatron_tp_overlap.models import ModelDims
from megatron_tp_overlap.tools.sweep import plan_tp_sizes, write_outputs
from megatron_tp_overlap.ub.config import load_yaml

pytest.importorskip("transformers")
D = ModelDims("x", 4096, 12288, 32, 8, 128, 36, 151936, True)


def test_plan():
    assert plan_tp_sizes(D, 4, 4, 8192) == [1, 2, 4]
    assert plan_tp_sizes(D, 8, 2, 8192) == [1, 2]
    assert plan_tp_sizes(ModelDims("y", 1024, 3072, 16, 2, 128, 2, 1, True), 8, 8, 8192) == [1, 2]  # 2 KV heads
    with pytest.raises(ValueError, match="needs CUDA GPUs"):
        plan_tp_sizes(D, 4, 0, 8192)


def result(tp, tuned, te_default=None, off=None):
    steps = {"no overlap": off if off is not None else tuned}
    if tp > 1:
        steps.update({"tuned": tuned, "TE default": te_default})
    chosen = {"ub_cfgs": {"fc2_fprop": {"method": "ring_exchange"}} if tp > 1 else {}, "overlap_off": []}
    return {"tp": tp, "model": "Qwen/Qwen3-8B", "step_ms": steps, "chosen": chosen}


def test_outputs(tmp_path):
    res = {1: result(1, 40.0), 2: result(2, 22.0, 23.0, 24.0), 4: result(4, 13.5, 14.0, 15.0)}
    rep = write_outputs(res, tmp_path, tol=0.2, overlap={2: {"0": 0.61}})
    # TP=2: 22.0 <= 40/2 x 1.2 = 24 (efficient); TP=4: 13.5 > 40/4 x 1.2 = 12 (not)
    assert rep["recommended_tp"] == 2
    assert [v["efficient"] for v in rep["verdicts"]] == [True, True, False]
    for f in (
        "tuning_report.json",
        "summary.txt",
        "tp_scaling.png",
        "optimal_tp_comm_overlap_cfg.yaml",
        "optimal_tp_comm_overlap_cfg_tp1.yaml",
        "optimal_tp_comm_overlap_cfg_tp2.yaml",
        "optimal_tp_comm_overlap_cfg_tp4.yaml",
    ):
        assert (tmp_path / f).exists(), f
    assert load_yaml(tmp_path / "optimal_tp_comm_overlap_cfg.yaml").get("fc2_fprop").method == "ring_exchange"
    assert len(load_yaml(tmp_path / "optimal_tp_comm_overlap_cfg_tp1.yaml")) == 0
    summary = (tmp_path / "summary.txt").read_text()
    assert "recommended TP = 2" in summary and "not efficient" in summary and "explanation only" in summary
    assert json.loads((tmp_path / "tuning_report.json").read_text())["overlap_from_traces"]["2"]["0"] == 0.61


def test_sweep_cli_errors_before_gpu_work(capsys):
    from megatron_tp_overlap.tools.cli import main

    assert main(["sweep", "--model", "acme/Nope-1B", "--out", "/tmp/x"]) == 2
    assert "the models shipped with this package" in capsys.readouterr().err


def test_sweep_keeps_to_the_gpus_it_was_given():
    from megatron_tp_overlap.tools.sweep import visible_devices

    assert visible_devices({"CUDA_VISIBLE_DEVICES": "2, 3"}) == ["2", "3"]
    assert visible_devices({"CUDA_VISIBLE_DEVICES": ""}) == []


def test_outputs_say_which_megatron_flags_reproduce_the_config(tmp_path):
    res = {1: result(1, 40.0), 2: result(2, 22.0, 23.0, 24.0)}
    res[2]["chosen"]["ub_cfgs"] = {
        "qkv_dgrad": {"method": "ring_exchange"},
        "fc1_dgrad": {"method": "bulk", "num_sm": 8},
    }
    write_outputs(res, tmp_path)
    header = (tmp_path / "optimal_tp_comm_overlap_cfg.yaml").read_text()
    assert "--tp-comm-overlap-cfg optimal_tp_comm_overlap_cfg.yaml" in header and "WARNING" in header
    summary = (tmp_path / "summary.txt").read_text()
    assert "needs both modes" in summary and "sweep with --dgrad-mode bulk or --dgrad-mode reduce-scatter" in summary


def test_megatron_flags_for_a_config():
    from megatron_tp_overlap.integrations.megatron import flags_for
    from megatron_tp_overlap.ub.config import parse_ub_cfgs

    assert flags_for(parse_ub_cfgs({}), "t.yaml") == (["--tp-comm-overlap", "--tp-comm-overlap-cfg", "t.yaml"], None)
    both = parse_ub_cfgs({"qkv_dgrad": {"method": "ring_exchange"}, "fc1_dgrad": {"method": "pipeline"}})
    assert flags_for(both, "t.yaml")[0][-1] == "--tp-comm-overlap-rs-dgrad" and flags_for(both, "t.yaml")[1] is None
    flags, problem = flags_for(parse_ub_cfgs({"fc1_dgrad": {"method": "ring_exchange"}}), "t.yaml")
    assert (
        "--tp-comm-overlap-rs-dgrad" not in flags
        and "qkv_dgrad bulk" in problem
        and "fc1_dgrad reduce-scatter" in problem
    )


def test_sweep_passes_the_dgrad_mode_to_every_tp_size(tmp_path, monkeypatch):
    """The layer_bench commands the sweep starts, with a fake torchrun writing each TP size's result."""
    import subprocess

    import torch

    from megatron_tp_overlap.tools import sweep
    from megatron_tp_overlap.tools.cli import build_parser

    commands = []

    def fake_run(cmd, env, check):
        commands.append((cmd, env["CUDA_VISIBLE_DEVICES"]))
        tp = int(next(c for c in cmd if c.startswith("--nproc-per-node=")).split("=")[1])
        (tmp_path / f"tp{tp}.json").write_text(json.dumps(result(tp, 40.0 / tp, 40.0 / tp, 41.0 / tp)))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    a = build_parser().parse_args(
        ["sweep", "--model", "Qwen/Qwen3-8B", "--max-tp-size", "2", "--dgrad-mode", "bulk", "--out", str(tmp_path)]
    )
    sweep.run_sweep(
        a.model,
        a.max_tp_size,
        a.max_token_len,
        a.operators,
        a.layers,
        tmp_path,
        a.tol,
        a.profile,
        a.budget_s,
        a.dgrad_mode,
    )
    assert [c[1] for c in commands] == ["0", "0,1"]
    for cmd, _ in commands:
        assert cmd[cmd.index("--dgrad-mode") + 1] == "bulk" and "megatron_tp_overlap.tools.layer_bench" in cmd
    with pytest.raises(SystemExit):
        build_parser().parse_args(["sweep", "--model", "Qwen/Qwen3-8B", "--dgrad-mode", "rs"])


def test_layer_bench_takes_the_dgrad_mode():
    from megatron_tp_overlap.tools.layer_bench import parse_args

    assert parse_args(["--model", "m", "--out", "o"]).dgrad_mode == "any"
    assert parse_args(["--model", "m", "--out", "o", "--dgrad-mode", "reduce-scatter"]).dgrad_mode == "reduce-scatter"
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--out", "o", "--dgrad-mode", "both"])


def test_summary_says_when_te_default_outside_the_dgrad_mode_was_faster(tmp_path):
    res = {1: result(1, 40.0), 2: result(2, 22.0, 23.0, 24.0), 4: result(4, 13.4, 13.2, 13.8)}
    res[4]["dgrad_mode"] = "reduce-scatter"
    write_outputs(res, tmp_path)
    summary = (tmp_path / "summary.txt").read_text()
    assert "TP=4: TE default measured faster than the tuned config (13.200 vs 13.400 ms)" in summary
    assert "sweep with --dgrad-mode bulk" in summary and "TP=2: TE default measured" not in summary
