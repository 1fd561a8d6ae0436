"""Megatron-Bridge integration, on CPU: Bridge's modules (which need TE to import) are replaced by
stand-ins with the same names and signatures (megatron.bridge 0.6: ``training.comm_overlap.
CommOverlapConfig``, ``training.pretrain.train``, ``training.utils.train_utils.prepare_forward_step_func``)."""

from __future__ import annotations

import dataclasses
import importlib
import sys
import types
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import pytest


@dataclass(kw_only=True)
class CommOverlapConfig:  # the fields of Bridge 0.6's, enough for the subclass
    tp_comm_overlap: bool
    tp_comm_overlap_cfg: Optional[object] = None
    tp_comm_bootstrap_backend: Optional[str] = "nccl"

    def finalize(self):
        self.user_comm_overlap_cfg = {"tp_comm_overlap": self.tp_comm_overlap}


@pytest.fixture
def bridge(monkeypatch):
    calls = {}

    def train(
        forward_step_func,
        model,
        optimizer,
        scheduler,
        train_data_iterator,
        valid_data_iterator,
        global_state,
        *rest,
        **kw,
    ):
        calls["train"] = train_data_iterator
        return "trained"

    mods = {
        "megatron": types.ModuleType("megatron"),
        "megatron.bridge": types.ModuleType("megatron.bridge"),
        "megatron.bridge.training": types.ModuleType("megatron.bridge.training"),
        "megatron.bridge.training.comm_overlap": types.ModuleType("megatron.bridge.training.comm_overlap"),
        "megatron.bridge.training.pretrain": types.ModuleType("megatron.bridge.training.pretrain"),
        "megatron.bridge.training.train": types.ModuleType("megatron.bridge.training.train"),
        "megatron.bridge.training.initialize": types.ModuleType("megatron.bridge.training.initialize"),
        "megatron.bridge.training.utils": types.ModuleType("megatron.bridge.training.utils"),
        "megatron.bridge.training.utils.train_utils": types.ModuleType("megatron.bridge.training.utils.train_utils"),
    }
    mods["megatron.bridge.training.comm_overlap"].CommOverlapConfig = CommOverlapConfig
    mods["megatron.bridge.training.pretrain"].train = train
    mods["megatron.bridge.training.train"].train_step = lambda *a, **k: None
    mods["megatron.bridge.training.initialize"].compile_helpers = lambda: calls.update(make=True)
    mods["megatron.bridge.training.utils.train_utils"].prepare_forward_step_func = lambda f, state: ("wrapped", f)
    for name, mod in mods.items():
        if name == "megatron" and "megatron" in sys.modules:
            continue  # a real megatron-core (Python 3.12): keep it, add bridge below it
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.delitem(sys.modules, "megatron_tp_overlap.integrations.bridge", raising=False)
    b = importlib.import_module("megatron_tp_overlap.integrations.bridge")
    monkeypatch.setattr(b, "_installed", False)
    return SimpleNamespace(
        module=b,
        pretrain=mods["megatron.bridge.training.pretrain"],
        initialize=mods["megatron.bridge.training.initialize"],
        calls=calls,
    )


def container(tmp_path, overlap, tp=2, **model):
    m = dict(
        tp_comm_overlap=True,
        sequence_parallel=True,
        tensor_model_parallel_size=tp,
        context_parallel_size=1,
        seq_length=8192,
        hidden_size=4096,
        ffn_hidden_size=14336,
        num_attention_heads=32,
        num_query_groups=8,
        fp8=None,
        fp16=False,
        bf16=True,
        tp_comm_bootstrap_backend="nccl",
        tp_comm_overlap_rs_dgrad=False,
        tp_comm_overlap_cfg=None,
        tp_comm_overlap_ag=True,
        tp_comm_overlap_rs=True,
        tp_comm_bulk_dgrad=True,
        tp_comm_bulk_wgrad=True,
    )
    m.update(model)
    return SimpleNamespace(
        model=SimpleNamespace(**m),
        train=SimpleNamespace(micro_batch_size=1),
        checkpoint=SimpleNamespace(save=str(tmp_path)),
        comm_overlap=overlap,
    )


def test_the_config_is_bridges_own_plus_the_options(bridge):
    c = bridge.module.AutotuneCommOverlapConfig(tp_comm_overlap=True, tp_comm_overlap_autotune_seconds=30)
    assert isinstance(c, CommOverlapConfig) and c.tp_comm_overlap_autotune and c.tp_comm_overlap_autotune_seconds == 30
    names = {f.name for f in dataclasses.fields(c)}
    assert {"tp_comm_overlap", "tp_comm_overlap_cfg", "tp_comm_overlap_autotune_strategy"} <= names
    assert bridge.pretrain.train.__name__ == "train" and bridge.module._installed  # creating one installs the hook
    c.finalize()
    assert c.user_comm_overlap_cfg == {"tp_comm_overlap": True}  # Bridge's finalize still runs


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(tp_comm_overlap=False), "needs comm_overlap.tp_comm_overlap=true"),
        (dict(tp_comm_overlap=True, tp_comm_overlap_autotune_steps=-1), "tp_comm_overlap_autotune_steps = -1"),
        (dict(tp_comm_overlap=True, tp_comm_overlap_autotune_seconds=-5), "tp_comm_overlap_autotune_seconds = -5"),
        (dict(tp_comm_overlap=True, tp_comm_overlap_autotune_strategy="random"), "must be one of coordinate"),
    ],
)
def test_bad_options_are_refused_when_bridge_finalizes(bridge, kw, needle):
    c = bridge.module.AutotuneCommOverlapConfig(**kw)
    with pytest.raises(ValueError, match=needle):
        c.finalize()
    assert bridge.module.AutotuneCommOverlapConfig(**{**kw, "tp_comm_overlap_autotune": False}).problems() == []


def test_the_run_shape_comes_from_the_model_provider(bridge, tmp_path):
    from megatron_tp_overlap.integrations.megatron.run_shape import RunShape

    c = bridge.module.AutotuneCommOverlapConfig(tp_comm_overlap=True, tp_comm_overlap_autotune_seconds=30)
    cfg = container(tmp_path, c)
    run = RunShape.from_transformer_config(cfg.model, cfg.train.micro_batch_size)
    assert (run.tp, run.kv_groups, run.micro_batch_size, run.dtype) == (2, 8, 1, "bf16") and run.problems() == []
    assert c.tune_options.seconds == 30
    bad = container(tmp_path, c, tp=1, fp16=True, bf16=False, sequence_parallel=False).model
    text = "\n".join(RunShape.from_transformer_config(bad, 1).problems())
    assert "--tensor-model-parallel-size >= 2" in text and "--sequence-parallel" in text and "--fp16" in text


def test_the_runs_dataclass_config_is_the_reference(bridge, tmp_path):
    from megatron_tp_overlap.ub.config import UbConfig, dumps_yaml
    from megatron_tp_overlap.ub.layer_cfg import (
        BulkOverlapCfg,
        PipelineOverlapCfg,
        RingExchangeOverlapCfg,
        TransformerLayerTPOverlapCfg,
        as_ub_cfgs,
        reference_config,
    )
    from megatron_tp_overlap.ub.presets import PRESETS

    ring = RingExchangeOverlapCfg()
    layer = TransformerLayerTPOverlapCfg(
        BulkOverlapCfg(4, 2, False),
        BulkOverlapCfg(24, 2, False),
        BulkOverlapCfg(2, 2, False),
        BulkOverlapCfg(4, 2, False),
        ring,
        ring,
        ring,
        ring,
        PipelineOverlapCfg(24, 2, 4, True),
        PipelineOverlapCfg(16, 2, 4, True),
    )
    want = PRESETS["userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192"]
    assert reference_config(as_ub_cfgs(layer)) == want  # what CommOverlapConfig.setup leaves on the model config
    assert reference_config(layer) == want
    (tmp_path / "ub.yaml").write_text(dumps_yaml(want))
    assert reference_config(str(tmp_path / "ub.yaml")) == want and reference_config(None) == UbConfig()


def test_the_hook_tunes_then_hands_bridge_the_same_iterator_and_the_tuned_config(bridge, tmp_path, monkeypatch):

    from megatron_tp_overlap.integrations.megatron import tuning
    from megatron_tp_overlap.ub.config import UbConfig, parse_ub_cfgs

    seen = {}

    def fake_tune(model, fwd, optimizer, it, run, options, reference, output, **kw):
        seen.update(fwd=fwd, run=run, options=options, reference=reference, output=output, capture=kw.get("capture"))
        ub = parse_ub_cfgs({"fc2_fprop": {"method": "ring_exchange"}})
        return SimpleNamespace(config=SimpleNamespace(ub=ub), data_iterator=["replayed", it])

    monkeypatch.setattr(tuning, "tune", fake_tune)
    c = bridge.module.AutotuneCommOverlapConfig(tp_comm_overlap=True, tp_comm_overlap_autotune_steps=77)
    state = SimpleNamespace(cfg=container(tmp_path, c))
    out = bridge.pretrain.train(
        "fwd", ["model"], "opt", "sched", "it", None, state, "ckpt", "pg", callback_manager=None
    )
    assert out == "trained" and bridge.calls["train"] == ["replayed", "it"]
    assert seen["fwd"] == ("wrapped", "fwd") and seen["output"] == tmp_path / "tp_comm_overlap_tuned.yaml"
    assert seen["options"].steps == 77 and seen["run"].tp == 2 and seen["reference"] == UbConfig()
    assert seen["capture"] is None  # no CUDA graphs
    assert state.cfg.model.tp_comm_overlap_cfg == str(tmp_path / "tp_comm_overlap_tuned.yaml")
    assert (
        type(c.tp_comm_overlap_cfg).__name__ == "TransformerLayerTPOverlapCfg"
        and c.tp_comm_overlap_cfg.fc2_fprop.method == "ring_exchange"
    )
    # CUDA graphs: Bridge's loop captures TE graphs after cuda_graph_warmup_steps; the verification ends before
    graphed = SimpleNamespace(cfg=container(tmp_path, bridge.module.AutotuneCommOverlapConfig(tp_comm_overlap=True)))
    graphed.cfg.model.cuda_graph_impl, graphed.cfg.model.cuda_graph_warmup_steps = "transformer_engine", 50
    bridge.pretrain.train("fwd", ["model"], "opt", "sched", "it", None, graphed, "ckpt", "pg", callback_manager=None)
    assert (seen["run"].cuda_graphs, seen["capture"].mode, seen["capture"].eager_iters) == (
        "transformer_engine",
    ) * 2 + (50,)
    # a run without the autotune config is passed through untouched
    bridge.calls.clear()
    plain = SimpleNamespace(cfg=container(tmp_path, CommOverlapConfig(tp_comm_overlap=True)))
    assert (
        bridge.pretrain.train("fwd", [], None, None, "it", None, plain) == "trained" and bridge.calls["train"] == "it"
    )


@pytest.mark.parametrize("importable, runs_make", [(True, False), (False, True)])
def test_bridge_skips_make_when_the_wheels_dataset_helpers_import(bridge, monkeypatch, importable, runs_make):
    """Bridge's initialize imports compile_helpers by name; a pip-installed megatron-core has the compiled
    helpers but no Makefile, so Bridge's own `make` fails (seen on the GPU image)."""
    from megatron_tp_overlap.integrations.megatron import launcher

    monkeypatch.setattr(launcher, "_helpers_importable", lambda: importable)
    bridge.module.install()
    bridge.initialize.compile_helpers()
    assert ("make" in bridge.calls) is runs_make


def test_bridge_fields_are_generated_from_the_options(bridge):
    from megatron_tp_overlap.engine.options import TuneOptions, option_fields

    c = bridge.module.AutotuneCommOverlapConfig(tp_comm_overlap=True)
    ours = {f.name: f.default for f in dataclasses.fields(c) if f.name.startswith("tp_comm_overlap_autotune_")}
    assert ours == {f"tp_comm_overlap_autotune_{f.name}": f.default for f in option_fields()}
    assert c.tp_comm_overlap_autotune is True and c.tune_options == TuneOptions()


def test_the_runs_configs_follow_the_recipe_and_its_revert(bridge, tmp_path, monkeypatch):
    """AG overlap off wins: the model config says so (a saved config reproduces the run); the in-run verification
    goes back to the starting config: the fields are back; no overlap wins: tp_comm_overlap is off in both configs."""
    from megatron_tp_overlap.integrations.megatron import tuning
    from megatron_tp_overlap.integrations.megatron.flags import recipe
    from megatron_tp_overlap.ub.config import UbConfig, parse_ub_cfgs

    active = frozenset({"qkv_fprop", "fc1_fprop", "proj_fprop", "fc2_fprop", "proj_dgrad", "fc2_dgrad"})
    ag = frozenset({"qkv_fprop", "fc1_fprop", "proj_dgrad", "fc2_dgrad"})
    tuned = SimpleNamespace(
        config=SimpleNamespace(ub=UbConfig()),
        data_iterator="it",
        recipe=recipe(UbConfig(), ag, active, tmp_path / "t.yaml", tp=2),
        on_recipe=[],
    )
    monkeypatch.setattr(tuning, "tune", lambda *a, **k: tuned)
    c = bridge.module.AutotuneCommOverlapConfig(tp_comm_overlap=True)
    state = SimpleNamespace(cfg=container(tmp_path, c))
    bridge.pretrain.train("fwd", ["model"], "opt", "sched", "it", None, state, "ckpt", "pg", callback_manager=None)
    m = state.cfg.model
    assert (m.tp_comm_overlap_ag, m.tp_comm_overlap_rs, m.tp_comm_overlap, c.tp_comm_overlap) == (
        False,
        True,
        True,
        True,
    )
    (follow,) = tuned.on_recipe
    tuned.config = SimpleNamespace(ub=parse_ub_cfgs({"fc2_fprop": {"method": "ring_exchange", "num_sm": 3}}))
    follow(recipe(tuned.config.ub, frozenset(), active, tmp_path / "t.yaml", tp=2))  # the verdict changed the config
    assert (m.tp_comm_overlap_ag, m.tp_comm_overlap_rs, m.tp_comm_overlap) == (True, True, True)
    assert c.tp_comm_overlap_cfg.fc2_fprop.num_sm == 3  # the comm-overlap config's dataclass follows it too
    follow(recipe(UbConfig(), active, active, tmp_path / "t.yaml", tp=2))  # no overlap at all
    assert m.tp_comm_overlap is False and c.tp_comm_overlap is False and m.tp_comm_overlap_ag is True
