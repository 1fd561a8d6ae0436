"""Megatron-Bridge integration, on CPU: Bridge's modules (which need TE to import) are replaced by
stand-ins with the same names and signatures (megatron.bridge 0.6: ``training.comm_overlap.
CommOverlapConfig``, ``training.pretrain.train``, ``training.utils.train_utils.prepare_forward_step_func``)."""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
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


# ---- benchmarks/bridge_autotune.py: the MoE model and the one-GPU state-identity runs (Bridge stood in for) ----


def _bridge_autotune():
    from benchmark_module import load_benchmark

    return load_benchmark("bridge_autotune")


def _recording(name):
    """A stand-in for a Bridge config dataclass: keeps its keyword arguments."""
    return type(name, (SimpleNamespace,), {})


@pytest.fixture
def bridge_configs(bridge, monkeypatch):
    """Bridge 0.6's config classes and megatron-core's decoder block spec, as stand-ins that keep their arguments."""
    gpt = types.ModuleType("megatron.bridge.models.gpt_provider")
    gpt.GPTModelProvider = _recording("GPTModelProvider")
    config = types.ModuleType("megatron.bridge.training.config")
    for n in (
        "CheckpointConfig",
        "ConfigContainer",
        "DistributedDataParallelConfig",
        "LoggerConfig",
        "MockGPTDatasetConfig",
        "OptimizerConfig",
        "RNGConfig",
        "SchedulerConfig",
        "TrainingConfig",
    ):
        setattr(config, n, _recording(n))
    tok = types.ModuleType("megatron.bridge.training.tokenizers.config")
    tok.TokenizerConfig = _recording("TokenizerConfig")
    specs = types.ModuleType("megatron.core.models.gpt.gpt_layer_specs")

    def get_gpt_decoder_block_spec(config, use_transformer_engine, normalization=None, qk_l2_norm=False, vp_stage=None):
        return ("block spec", config, use_transformer_engine, vp_stage)

    specs.get_gpt_decoder_block_spec = get_gpt_decoder_block_spec
    mods = {
        "megatron.bridge.models": types.ModuleType("megatron.bridge.models"),
        "megatron.bridge.models.gpt_provider": gpt,
        "megatron.bridge.training.config": config,
        "megatron.bridge.training.tokenizers": types.ModuleType("megatron.bridge.training.tokenizers"),
        "megatron.bridge.training.tokenizers.config": tok,
        "megatron.core": types.ModuleType("megatron.core"),
        "megatron.core.models": types.ModuleType("megatron.core.models"),
        "megatron.core.models.gpt": types.ModuleType("megatron.core.models.gpt"),
        "megatron.core.models.gpt.gpt_layer_specs": specs,
    }
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return specs


def _moe_case_fields() -> dict:
    """The Megatron-LM case moe_tp2's model, as megatron-core TransformerConfig fields (Megatron-LM's flag names:
    --num-experts is num_moe_experts, --moe-x-y is moe_x_y; --moe-layer-freq is a Python expression)."""
    import shlex

    from benchmark_module import load_benchmark

    words = shlex.split(load_benchmark("suite").load_cases()["moe_tp2"]["command"])
    extra = shlex.split(next(w.split("=", 1)[1] for w in words if w.startswith("--extra=")))
    out, i = {}, 0
    while i < len(extra):
        name = extra[i][2:].replace("-", "_")
        name = {"num_experts": "num_moe_experts"}.get(name, name)
        if i + 1 < len(extra) and not extra[i + 1].startswith("--"):
            v = extra[i + 1]
            out[name] = eval(v) if name == "moe_layer_freq" else type_of(v)
            i += 2
        else:
            out[name], i = True, i + 1
    shape = {"--hidden": "hidden_size", "--ffn": "ffn_hidden_size", "--heads": "num_attention_heads"}
    shape["--kv-groups"] = "num_query_groups"
    out.update({f: int(words[words.index(flag) + 1]) for flag, f in shape.items()})
    return out


def type_of(v: str):
    for t in (int, float):
        try:
            return t(v)
        except ValueError:
            pass
    return v


def test_the_moe_provider_is_the_megatron_lm_moe_case_through_the_providers_fields(bridge_configs, tmp_path):
    ba = _bridge_autotune()
    a = ba.parser().parse_args(["--moe", "--tp", "2", "--seq", "4096", "--out", str(tmp_path)])
    cfg = ba.build_config(a)
    m = vars(cfg.model)
    want = _moe_case_fields()
    assert {k: m.get(k) for k in want} == want  # every MoE field and the shape, as in the Megatron-LM case
    assert m["num_moe_experts"] == 32 and m["moe_layer_freq"] == [0, 1, 1, 1] and m["kv_channels"] == 128
    assert (m["tensor_model_parallel_size"], m["sequence_parallel"], m["seq_length"]) == (2, True, 4096)
    spec = m["transformer_layer_spec"]  # the block spec follows moe_layer_freq (the first layer dense)
    assert spec.func is bridge_configs.get_gpt_decoder_block_spec and spec.keywords == {"use_transformer_engine": True}
    assert type(cfg.comm_overlap).__name__ == "AutotuneCommOverlapConfig"

    dense = vars(ba.build_config(ba.parser().parse_args(["--tp", "2", "--out", str(tmp_path)])).model)
    assert "num_moe_experts" not in dense and "transformer_layer_spec" not in dense
    assert (dense["hidden_size"], dense["num_query_groups"]) == (4096, 8)
    one = ba.build_config(ba.parser().parse_args(["--moe", "--tp", "1", "--out", str(tmp_path)]))
    assert one.comm_overlap is None and one.model.sequence_parallel is False  # TP=1: no userbuffers, no SP


def _rows(n: int, loss=lambda i: 10.0 / i, moe=lambda i: ["0.5", "0.25"]) -> list[dict]:
    return [{"iteration": i, "lm loss": repr(loss(i)), "moe": {"load_balancing_loss": moe(i)}} for i in range(1, n + 1)]


def _write_runs(tmp_path, **iterations):
    from benchmark_module import load_benchmark

    study = load_benchmark("trials_leave_state")
    for name, rows in iterations.items():
        if rows is not None:
            study.run_file(tmp_path, name.replace("_", " ")).write_text(json.dumps({"iterations": rows}) + "\n")
    names = [n.replace("_", " ") for n in iterations]
    return study.compare(study.read_runs(tmp_path, names), 20)


def test_the_state_runs_are_compared_bitwise_from_their_files(tmp_path):
    ba = _bridge_autotune()
    same = _write_runs(tmp_path, no_trials=_rows(20), no_trials_again=_rows(20), trials=_rows(20))
    assert ba.state_verdict(same, 20) == [
        "first 20 losses, trials vs no trials: bitwise equal",
        "first 20 losses, control (no trials twice): bitwise equal",
    ]
    # one ulp in iteration 7's loss is a difference; past the 20 compared, nothing counts
    ulp = _rows(25, loss=lambda i: math.nextafter(10.0 / i, 0.0) if i in (7, 22) else 10.0 / i)
    diff = _write_runs(tmp_path, no_trials=_rows(25), no_trials_again=_rows(25), trials=ulp)
    assert ba.state_verdict(diff, 20)[0] == "first 20 losses, trials vs no trials: differ from iteration 7"
    late = _rows(25, loss=lambda i: 0.0 if i == 22 else 10.0 / i)
    assert ba.state_verdict(_write_runs(tmp_path, no_trials=_rows(25), trials=late), 20) == [
        "first 20 losses, trials vs no trials: bitwise equal"  # no control run: no control line
    ]
    # the MoE metrics count too
    moe = _rows(20, moe=lambda i: ["0.5", "0.125"] if i == 3 else ["0.5", "0.25"])
    lines = ba.state_verdict(_write_runs(tmp_path, no_trials=_rows(20), no_trials_again=moe, trials=_rows(20)), 20)
    assert lines[1] == "first 20 losses, control (no trials twice): differ from iteration 3"
    # a run that died wrote no file (or too few iterations): not compared, never "equal"
    (tmp_path / "trials.json").unlink()
    dead = _write_runs(tmp_path, no_trials=_rows(20), trials=None)
    assert ba.state_verdict(dead, 20)[0].endswith("not compared (a run logged fewer than 20 iterations)")


def test_a_state_run_gets_its_file_and_trial_count_before_the_overrides(tmp_path):
    ba = _bridge_autotune()
    argv = ["--state-identity", "--moe", "--tp", "1", "--trials", "30", "--out", str(tmp_path), "--", "train.x=1"]
    child = ba.child_args(argv, tmp_path / "no_trials.json", 0)
    a = ba.parser().parse_args(child)
    assert "--state-identity" not in child and a.trials == 0 and a.state_run == str(tmp_path / "no_trials.json")
    assert a.moe and a.tp == 1 and a.overrides == ["train.x=1"]
    assert ba.parser().parse_args(ba.child_args(argv[:-2], tmp_path / "t.json", 30)).trials == 30


@pytest.mark.parametrize("trials", [0, 5])
def test_a_state_run_runs_the_trials_before_bridges_loop_and_logs_every_iteration(
    bridge, tmp_path, monkeypatch, trials
):
    """Inside one run: Bridge's train gets the iterator the trials hand back, every iteration's losses are written
    with Bridge's step count (its training_log has no iteration argument), the state check's verdict with them."""
    from benchmark_module import load_benchmark

    from megatron_tp_overlap.integrations.megatron import outputs

    ba = _bridge_autotune()
    study = load_benchmark("trials_leave_state")
    seen = {}

    def run_trials(model, fwd, optimizer, it, run, n, meta, check_state, switch):
        seen.update(fwd=fwd, it=it, tp=run.tp, n=n, check_state=check_state, switch=switch)
        meta["trial_microbatches"] = 1
        return "replayed", "check"

    monkeypatch.setattr(study, "run_trials", run_trials)
    monkeypatch.setitem(sys.modules, "trials_leave_state", study)
    monkeypatch.setattr(outputs, "_verdict", lambda check, log: {"result": f"verdict on {check}"})
    monkeypatch.setenv("MEGATRON_TP_OVERLAP_CHECK_STATE", "1")
    monkeypatch.delenv("MEGATRON_TP_OVERLAP_DETERMINISTIC", raising=False)
    train_mod = sys.modules["megatron.bridge.training.train"]
    logged = []
    train_mod.training_log = lambda loss_dict, *rest, **kw: logged.append(loss_dict)
    gpt_step = types.ModuleType("megatron.bridge.training.gpt_step")
    gpt_step.forward_step = "fwd"
    monkeypatch.setitem(sys.modules, "megatron.bridge.training.gpt_step", gpt_step)
    state = SimpleNamespace(cfg=container(tmp_path, None, tp=1, sequence_parallel=False), train_state=None)

    def pretrain(cfg, forward_step):  # Bridge's: setup, then train(); its loop counts a step, then logs it
        sys.modules["megatron.bridge.training.pretrain"].train(
            forward_step, ["model"], "opt", "sched", "it", None, state, "ckpt", "pg", callback_manager=None
        )
        for step in (1, 2, 3):
            state.train_state = SimpleNamespace(step=step)
            train_mod.training_log({"lm loss": 1.0 / step}, {}, 3e-4, None, 1.0)

    bridge.pretrain.pretrain = pretrain
    monkeypatch.setattr(ba, "build_config", lambda a: state.cfg)
    a = ba.parser().parse_args(["--moe", "--tp", "1", "--trials", str(trials), "--out", str(tmp_path)])
    ba.state_run(a, tmp_path / "run.json")

    out = json.loads((tmp_path / "run.json").read_text())
    assert [r["iteration"] for r in out["iterations"]] == [1, 2, 3] and len(logged) == 3
    assert out["iterations"][1]["lm loss"] == repr(0.5) and out["iterations"][1]["moe"] == {}
    assert bridge.calls["train"] == ("replayed" if trials else "it")  # Bridge's own train got the handed-back one
    if trials:
        assert seen["fwd"] == ("wrapped", "fwd") and seen["it"] == "it" and (seen["tp"], seen["n"]) == (1, 5)
        assert seen["check_state"] is True and callable(seen["switch"])
        assert out["state_check"] == {"result": "verdict on check"} and out["trials"] == 5
    else:
        assert not seen and "state_check" not in out


def test_the_bridge_moe_cases_install_bridge_first_and_parse_with_the_scripts_own_parser():
    import re
    import shlex

    from benchmark_module import load_benchmark

    ba, cases = _bridge_autotune(), load_benchmark("suite").load_cases()
    for name, gpus, tp in (("bridge_moe_state_1gpu", 1, 1), ("bridge_moe_tp2", 2, 2)):
        case = cases[name]
        assert case["gpus"] == gpus and case["command"].startswith("bash .bridge/install.sh && ")
        runs = [shlex.split(p.replace("'", " ")) for p in re.split(r"&&", case["command"]) if "bridge_autotune.py" in p]
        assert runs, name
        for words in runs:
            a = ba.parser().parse_args(words[words.index("benchmarks/bridge_autotune.py") + 1 :])
            assert a.moe and a.tp == tp and a.seq % tp == 0
            assert all(v % tp == 0 for v in (ba.MOE_SHAPE["num_query_groups"], ba.MOE["moe_ffn_hidden_size"]))
        if gpus == 1:
            assert a.state_identity and a.iters >= 20 and "MEGATRON_TP_OVERLAP_CHECK_STATE=1" in case["command"]
        else:
            assert [
                x.no_autotune
                for x in (ba.parser().parse_args(w[w.index("benchmarks/bridge_autotune.py") + 1 :]) for w in runs)
            ] == [False, True]
