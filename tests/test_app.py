"""The Hydra app's config: composition of every group, overrides, validation, run-dir agreement."""

import os
import sys

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_tp_overlap.app.config import check_overrides, group_choices, validate
from megatron_tp_overlap.app.train import agree_run_dir, compose, overlap_flags
from megatron_tp_overlap.engine.options import TuneOptions


def test_default_config():
    cfg = compose()
    assert cfg.model.name == "gpt_small" and cfg.parallel.tp is None and cfg.tp_overlap.mode == "autotune"
    assert cfg.training.precision == "bf16" and cfg.output.root == "runs"
    assert validate(cfg, world_size=2) == [] and validate(cfg, world_size=4) == []


@pytest.mark.parametrize("group", ["model", "tp_overlap"])
def test_every_choice_of_every_group_composes(group):
    choices = group_choices(group)
    assert choices
    for choice in choices:
        extra = {("tp_overlap", "file"): ["tp_overlap.file=x.yaml"], ("model", "hf"): ["model.hf=Qwen/Qwen3-4B"]}.get(
            (group, choice), []
        )
        cfg = compose([f"{group}={choice}", *extra])
        assert cfg[group] is not None


def test_model_groups_take_their_dimensions_from_the_shipped_configs():
    from megatron_tp_overlap.app.config import resolve_model

    assert {"gpt_small", "llama3_8b", "llama3_70b", "qwen3_8b", "gpt3_20b"} <= set(group_choices("model"))
    m = resolve_model(compose(["model=llama3_70b"]).model)
    assert (m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_query_groups, m.num_layers) == (
        8192,
        28672,
        64,
        8,
        80,
    )
    m = resolve_model(compose(["model=qwen3_8b", "model.num_layers=2"]).model)  # a given value wins
    assert (m.num_layers, m.kv_channels, m.swiglu) == (2, 128, True)


def test_the_readme_override_example():
    overrides = ["model=llama3_8b", "model.num_layers=4", "parallel.tp=4", "tp_overlap.seconds=30"]
    cfg = compose(overrides)
    assert (cfg.model.name, cfg.model.num_layers, cfg.parallel.tp, cfg.tp_overlap.seconds) == ("llama3_8b", 4, 4, 30.0)
    assert check_overrides(overrides) == [] and validate(cfg, 4) == []


def test_typos_are_rejected_with_the_valid_keys():
    (p,) = check_overrides(["tp_overlap.second=5"])
    assert "tp_overlap.second" in p and "did you mean 'seconds'" in p and "steps" in p
    (p,) = check_overrides(["model=llama3_9b"])
    assert "llama3_8b" in p and "gpt_small" in p
    (p,) = check_overrides(["trainig.seq_length=4"])
    assert "training" in p
    (p,) = check_overrides(["model.num_layers.x=4"])
    assert "is a value" in p
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        compose(["tp_overlap.second=5"])  # the schema rejects it too
    with pytest.raises(ConfigCompositionException):
        compose(["training.train_iters=many"])  # and wrong types


def test_main_exits_with_the_message(monkeypatch, capsys):
    from megatron_tp_overlap import train

    monkeypatch.setattr(sys, "argv", ["train", "tp_overlap.budget_s=5"])
    with pytest.raises(SystemExit) as e:
        train.main()
    assert e.value.code == 2 and "tp_overlap.budget_s" in capsys.readouterr().err


@pytest.mark.parametrize(
    "overrides, world, needle",
    [
        (["parallel.tp=3"], 3, "divisible by parallel.tp = 3"),
        (["parallel.tp=1"], 1, "needs parallel.tp >= 2"),
        (["parallel.sequence_parallel=false"], 2, "sequence_parallel=true"),
        (["parallel.tp=4"], 2, "must divide the number of processes"),
        (["tp_overlap=preset", "tp_overlap.preset=userbuffers_nope"], 2, "preset = 'userbuffers_nope': unknown"),
        (["tp_overlap=file", "tp_overlap.file=/nonexistent.yaml"], 2, "cannot read"),
        (["training.precision=fp16"], 2, "must be one of bf16, fp8"),
        (["parallel.tp=2", "training.global_batch_size=3"], 4, "multiple of micro_batch_size"),
        (["training.seq_length=4095"], 2, "seq_length = 4095"),
        (["parallel.pp=3"], 6, "num_layers = 4: must be divisible by parallel.pp = 3"),
        (["tp_overlap.seconds=0"], 2, "tp_overlap.seconds = 0.0: must be a finite number > 0"),
        (["tp_overlap.strategy=coord"], 2, "did you mean 'coordinate'"),
        (
            ["tp_overlap.preset=userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192", "tp_overlap.file=x.yaml"],
            2,
            "give one",
        ),
        (
            ["model.hf=Qwen/Qwen3-32B", "parallel.tp=3"],
            3,
            "model.num_attention_heads = 64: must be divisible by parallel.tp = 3",
        ),
        (["model.hidden_size=-2048"], 2, "model.hidden_size = -2048: must be an integer >= 1"),
        (["training.micro_batch_size=0"], 2, "training.micro_batch_size = 0: must be >= 1"),
    ],
)
def test_semantic_errors(overrides, world, needle):
    problems = validate(compose(overrides), world)
    assert any(needle in p for p in problems), problems


def test_off_mode_allows_tp1():
    assert validate(compose(["tp_overlap=off", "parallel.tp=1"]), 1) == []


def _rank(rank, init, root, out):
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=3)
    path = agree_run_dir(root, None)
    with open(os.path.join(out, f"r{rank}"), "w") as f:
        f.write(str(path))
    dist.destroy_process_group()


def test_all_ranks_agree_on_one_run_dir(tmp_path):
    mp.start_processes(
        _rank,
        args=(str(tmp_path / "init"), str(tmp_path / "runs"), str(tmp_path)),
        nprocs=3,
        join=True,
        start_method="fork",
    )
    paths = {(tmp_path / f"r{r}").read_text() for r in range(3)}
    assert len(paths) == 1 and os.path.isdir(paths.pop())
    assert len(list((tmp_path / "runs").iterdir())) == 1


def test_overlap_flags_per_mode(tmp_path):
    assert overlap_flags(compose(["tp_overlap=off"]), tmp_path)[0] == []
    assert overlap_flags(compose(["tp_overlap=te_default"]), tmp_path)[0] == ["--tp-comm-overlap"]
    flags, _ = overlap_flags(compose(["tp_overlap=preset"]), tmp_path)
    assert flags[1] == "--tp-comm-overlap-cfg" and "userbuffers_bf16_h100" in flags[2]
    assert "--tp-comm-overlap-autotune" not in flags
    flags, what = overlap_flags(
        compose(["tp_overlap.preset=userbuffers_bf16_h100_h6144_tp2_mbs2_seqlen2048"]), tmp_path
    )
    assert "--tp-comm-overlap-autotune" in flags and "from preset userbuffers_bf16_h100_h6144" in what  # start point


def test_autotune_flags_parse_back_to_the_options_in_megatrons_parser(tmp_path):
    """The main job hands its options to Megatron as flags: every option survives the round trip."""
    import argparse

    from megatron_tp_overlap.integrations.megatron.flags import add_arguments, options_from_args

    overrides = [
        "tp_overlap.seconds=12.5",
        "tp_overlap.steps=33",
        "tp_overlap.strategy=slot_exhaustive",
        "tp_overlap.reuse=false",
        "tp_overlap.allow_off=true",
        "tp_overlap.rtol=0.05",
        "tp_overlap.trial_timeout=9",
        f"tp_overlap.cache_dir={tmp_path}",
    ]
    cfg = compose(overrides)
    flags, _ = overlap_flags(cfg, tmp_path)
    args = add_arguments(argparse.ArgumentParser()).parse_args(flags[1:])
    want = {f: cfg.tp_overlap[f] for f in TuneOptions.__dataclass_fields__}
    assert vars(options_from_args(args)) == {**want, "output": str(tmp_path / "tp_comm_overlap_tuned.yaml")}
    assert options_from_args(args) != TuneOptions()  # the test would pass vacuously on defaults


def test_the_run_records_which_model_the_dimensions_came_from(tmp_path):
    import json
    import shutil
    from pathlib import Path

    from megatron_tp_overlap.app.config import model_provenance
    from megatron_tp_overlap.app.train import model_line, summarize

    model = model_provenance(compose(["model.hf=Qwen/Qwen3-4B", "model.num_layers=2"]).model)
    assert model["hf"] == "Qwen/Qwen3-4B" and model["source"] == "shipped"
    assert model["overridden"] == {"num_layers": {"given": 2, "model": 36}} and model["dims"]["hidden_size"] == 2560
    line = model_line(model)
    assert "Qwen/Qwen3-4B (dimensions from shipped)" in line and "num_layers=2 (model: 36)" in line
    (tmp_path / "model.json").write_text(json.dumps(model))
    results = Path(__file__).parents[1] / "benchmarks" / "results" / "2026-11-21_h200x4"
    shutil.copy(results / "engine_tp4_tuning_report.json", tmp_path / "tuned.report.json")
    summarize(tmp_path, tmp_path / "tuned.yaml")
    assert json.loads((tmp_path / "tuned.report.json").read_text())["model"]["source"] == "shipped"
    assert (tmp_path / "tp_overlap.png").stat().st_size > 0


def test_the_last_line_names_the_in_run_verification_only_when_it_ran(tmp_path, capsys, monkeypatch):
    """The main job's last line: the median after the verification's iterations (and the one its switch back ran
    in) when it ran; when it did not (the tuning kept the reference), every iteration counts and none is called
    the verification's (the TP=2 main job printed "after the 1 iterations of the in-run verification" there)."""
    import json
    from pathlib import Path

    from megatron_tp_overlap.app.train import summarize
    from megatron_tp_overlap.tools import plots

    monkeypatch.setattr(plots, "plot_report", lambda data, path, step_ms: path)  # the plot has tests of its own
    results = Path(__file__).parents[1] / "benchmarks" / "results" / "2026-11-21_h200x4"
    (tmp_path / "model.json").write_text("{}")
    # ms between iterations: 100, 100, 100 (verification), 10 x 20 ms
    t, times = 0.0, []
    for ms in [100, 100, 100] + [20] * 10:
        times.append(t)
        t += ms / 1e3
    times.append(t)
    (tmp_path / "iterations.rank0").write_text("".join(json.dumps({"t": x}) + "\n" for x in times))
    for iterations, expected in [(0, None), (2, "after the 2 iterations of the in-run verification")]:
        report = json.loads((results / "engine_tp4_tuning_report.json").read_text())
        report["in_run_verification"] = {"iterations": iterations} if iterations else None
        (tmp_path / "tuned.report.json").write_text(json.dumps(report))
        summarize(tmp_path, tmp_path / "tuned.yaml")
        last = capsys.readouterr().out.strip().splitlines()[-1]
        assert ("in-run verification" in last) == bool(expected), last
        assert expected is None or expected in last
        assert "median time between iterations" in last and (" 20.0 ms" in last), last
