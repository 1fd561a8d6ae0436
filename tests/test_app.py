"""The Hydra app's config: composition of every group, overrides, validation, run-dir agreement."""
import os
import sys

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_tp_overlap.app_config import check_overrides, group_choices, validate
from megatron_tp_overlap.cache import CacheKey, TunedConfigCache
from megatron_tp_overlap.presets import get_preset
from megatron_tp_overlap.train import agree_run_dir, compose, overlap_flags


def test_default_config():
    cfg = compose()
    assert cfg.model.name == "gpt_small" and cfg.parallel.tp is None and cfg.tp_overlap.mode == "autotune"
    assert cfg.training.precision == "bf16" and cfg.output.root == "runs"
    assert validate(cfg, world_size=2) == [] and validate(cfg, world_size=4) == []


@pytest.mark.parametrize("group", ["model", "parallel", "training", "tp_overlap", "output"])
def test_every_choice_of_every_group_composes(group):
    choices = group_choices(group)
    assert choices
    for choice in choices:
        extra = ["tp_overlap.file=x.yaml"] if (group, choice) == ("tp_overlap", "file") else []
        cfg = compose([f"{group}={choice}", *extra])
        assert cfg[group] is not None


def test_model_shapes():
    assert {"gpt_small", "llama3_8b", "llama3_70b", "qwen3_8b", "gpt3_20b"} <= set(group_choices("model"))
    c = compose(["model=llama3_70b"])
    assert (c.model.hidden_size, c.model.ffn_hidden_size, c.model.num_attention_heads, c.model.num_query_groups) == (8192, 28672, 64, 8)


def test_the_readme_override_example():
    cfg = compose(["model=llama3_8b", "model.num_layers=4", "parallel.tp=4", "tp_overlap.budget_s=30"])
    assert (cfg.model.name, cfg.model.num_layers, cfg.parallel.tp, cfg.tp_overlap.budget_s) == ("llama3_8b", 4, 4, 30.0)
    assert check_overrides(["model=llama3_8b", "model.num_layers=4", "parallel.tp=4", "tp_overlap.budget_s=30"]) == []


def test_typos_are_rejected_with_the_valid_keys():
    (p,) = check_overrides(["tp_overlap.budget_iter=5"])
    assert "tp_overlap.budget_iter" in p and "budget_s" in p and "budget_steps" in p
    (p,) = check_overrides(["model=llama3_9b"])
    assert "llama3_8b" in p and "gpt_small" in p
    (p,) = check_overrides(["trainig.seq_length=4"])
    assert "training" in p
    (p,) = check_overrides(["model.num_layers.x=4"])
    assert "is a value" in p
    from hydra.errors import ConfigCompositionException
    with pytest.raises(ConfigCompositionException):
        compose(["tp_overlap.budget_iter=5"])  # the schema rejects it too
    with pytest.raises(Exception):
        compose(["training.train_iters=many"])  # and wrong types


def test_main_exits_with_the_message(monkeypatch, capsys):
    from megatron_tp_overlap import train
    monkeypatch.setattr(sys, "argv", ["train", "tp_overlap.budget_iter=5"])
    with pytest.raises(SystemExit) as e:
        train.main()
    assert e.value.code == 2 and "budget_steps" in capsys.readouterr().err


@pytest.mark.parametrize("overrides, world, needle", [
    (["parallel.tp=3"], 3, "divisible by parallel.tp = 3"),
    (["parallel.tp=1"], 1, "needs parallel.tp >= 2"),
    (["parallel.sequence_parallel=false"], 2, "sequence_parallel=true"),
    (["parallel.tp=4"], 2, "must divide the number of processes"),
    (["tp_overlap=preset", "tp_overlap.preset=userbuffers_nope"], 2, "unknown; valid"),
    (["tp_overlap=file", "tp_overlap.file=/nonexistent.yaml"], 2, "cannot read"),
    (["training.precision=fp16"], 2, "bf16 or fp8"),
    (["parallel.tp=2", "training.global_batch_size=3"], 4, "multiple of micro_batch_size"),
    (["training.seq_length=4095"], 2, "seq_length = 4095"),
    (["parallel.pp=3"], 6, "num_layers = 4: must be divisible by parallel.pp = 3"),
    (["tp_overlap.budget_s=0"], 2, "budget_s = 0"),
])
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
    mp.start_processes(_rank, args=(str(tmp_path / "init"), str(tmp_path / "runs"), str(tmp_path)), nprocs=3,
                       join=True, start_method="spawn")
    paths = {(tmp_path / f"r{r}").read_text() for r in range(3)}
    assert len(paths) == 1 and os.path.isdir(paths.pop())
    assert len(list((tmp_path / "runs").iterdir())) == 1


def test_overlap_flags_per_mode_and_cache(tmp_path):
    flags, _ = overlap_flags(compose(["tp_overlap=off"]), tmp_path, None)
    assert flags == []
    flags, _ = overlap_flags(compose(["tp_overlap=te_default"]), tmp_path, None)
    assert flags == ["--tp-comm-overlap"]
    flags, _ = overlap_flags(compose(["tp_overlap=preset"]), tmp_path, None)
    assert flags[1] == "--tp-comm-overlap-cfg" and "userbuffers_bf16_h100" in flags[2]
    flags, what = overlap_flags(compose(), tmp_path, None)
    assert "--tp-comm-overlap-autotune" in flags and "tuning" in what
    cache = TunedConfigCache(tmp_path / "cache")
    key = CacheKey("NVIDIA H200", 2, 4096, 2048, 8192, 16, "bf16", "2.20.2")
    cache.put(key, get_preset("userbuffers_bf16_h100_h6144_tp2_mbs2_seqlen2048"), {"date": "2026-11-21"})
    flags, what = overlap_flags(compose(), tmp_path, cache.get(key))
    assert "--tp-comm-overlap-autotune" not in flags and "tuning skipped" in what
    assert (tmp_path / "tp_comm_overlap_tuned.yaml").exists()
    flags, _ = overlap_flags(compose(["tp_overlap.force=true"]), tmp_path, cache.get(key))
    assert "--tp-comm-overlap-autotune" in flags
