"""NeMo 2 callback, on CPU: NeMo 2.7's modules are replaced by stand-ins with the same names and signatures
(``nemo.lightning.pytorch.callbacks.megatron_comm_overlap.MegatronCommOverlapCallback``, ``nemo.lightning.
megatron_parallel.MegatronStep`` / ``_ModuleStepFunction``): NeMo 2.7 does not import with megatron-core 0.19."""

from __future__ import annotations

import importlib
import sys
import types
from dataclasses import dataclass
from types import SimpleNamespace

import pytest


@dataclass
class _CommOverlapConfig:  # NeMo 2.7's, the fields the subclass reads
    tp_comm_overlap: bool = None
    tp_comm_overlap_cfg: object = None
    tp_comm_bootstrap_backend: str = None


class MegatronCommOverlapCallback:  # NeMo 2.7's constructor signature and the state it keeps
    def __init__(
        self,
        tp_comm_overlap=None,
        tp_comm_overlap_cfg=None,
        tp_comm_bootstrap_backend=None,
        overlap_p2p_comm=None,
        batch_p2p_comm=None,
        overlap_grad_reduce=None,
        overlap_param_gather=None,
        overlap_param_gather_with_optimizer_step=None,
        align_param_gather=None,
        bucket_size=None,
        defer_embedding_wgrad_compute=None,
        wgrad_deferral_limit=None,
    ):
        self.user_comm_overlap_cfg = _CommOverlapConfig(tp_comm_overlap, tp_comm_overlap_cfg, tp_comm_bootstrap_backend)
        self.overlap_grad_reduce = overlap_grad_reduce
        self.tp_comm_overlap_cfg = None
        self.tp_comm_bootstrap_backend = None
        self.setup_calls = []

    def setup(self, trainer, pl_module, stage):
        self.setup_calls.append(stage)
        if getattr(
            trainer, "te_missing", False
        ):  # NeMo: "Disabling tensor parallel communication overlap due to TE not detected."
            self.user_comm_overlap_cfg.tp_comm_overlap = False
            trainer.model.config.tp_comm_overlap = False
        self.tp_comm_overlap_cfg = self.user_comm_overlap_cfg.tp_comm_overlap_cfg
        self.tp_comm_bootstrap_backend = self.user_comm_overlap_cfg.tp_comm_bootstrap_backend


@pytest.fixture
def nemo(monkeypatch):
    names = [
        "nemo",
        "nemo.collections",
        "nemo.collections.llm",
        "nemo.lightning",
        "nemo.lightning.pytorch",
        "nemo.lightning.pytorch.callbacks",
        "nemo.lightning.pytorch.callbacks.megatron_comm_overlap",
        "nemo.lightning.megatron_parallel",
    ]
    mods = {n: types.ModuleType(n) for n in names}
    mods[
        "nemo.lightning.pytorch.callbacks.megatron_comm_overlap"
    ].MegatronCommOverlapCallback = MegatronCommOverlapCallback
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.delitem(sys.modules, "megatron_tp_overlap.integrations.nemo", raising=False)
    return SimpleNamespace(
        module=importlib.import_module("megatron_tp_overlap.integrations.nemo"),
        parallel=mods["nemo.lightning.megatron_parallel"],
    )


def gpt_config(**kw):  # the megatron-core TransformerConfig fields NeMo's GPT config carries
    c = dict(
        tp_comm_overlap=True,
        sequence_parallel=True,
        tensor_model_parallel_size=4,
        context_parallel_size=1,
        seq_length=8192,
        hidden_size=8192,
        ffn_hidden_size=28672,
        num_attention_heads=64,
        num_query_groups=8,
        fp8=None,
        fp16=False,
        bf16=True,
    )
    c.update(kw)
    return SimpleNamespace(**c)


def trainer(tmp_path, tp=4, sp=True, **cfg):
    strategy = SimpleNamespace(
        parallelism=SimpleNamespace(tensor_model_parallel_size=tp, sequence_parallel=sp), optimizers=["optimizer"]
    )
    model = SimpleNamespace(
        config=gpt_config(tensor_model_parallel_size=tp, **cfg), module="lightning module", chunks=["chunk0"]
    )
    return SimpleNamespace(strategy=strategy, model=model, default_root_dir=str(tmp_path))


def test_takes_nemos_arguments_plus_the_autotune_options(nemo):
    import dataclasses

    from megatron_tp_overlap.engine.options import TuneOptions, option_fields

    cb = nemo.module.AutotuneCommOverlapCallback(
        tp_comm_overlap=True, overlap_grad_reduce=True, tp_comm_overlap_autotune_seconds=30
    )
    assert isinstance(cb, MegatronCommOverlapCallback) and cb.overlap_grad_reduce is True
    assert cb.autotune and cb.options == dataclasses.replace(TuneOptions(), seconds=30)
    every = {f"tp_comm_overlap_autotune_{f.name}": f.default for f in option_fields()}  # each option is accepted
    assert nemo.module.AutotuneCommOverlapCallback(tp_comm_overlap=True, **every).options == TuneOptions()
    with pytest.raises(TypeError, match="did you mean 'tp_comm_overlap_autotune_seconds'"):  # not swallowed
        nemo.module.AutotuneCommOverlapCallback(tp_comm_overlap=True, tp_comm_overlap_autotune_secs=30)


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(), "tp_comm_overlap_autotune needs tp_comm_overlap=True"),
        (
            dict(tp_comm_overlap=True, tp_comm_overlap_autotune_steps=-1),
            "tp_comm_overlap_autotune_steps = -1: must be >= 0",
        ),
        (dict(tp_comm_overlap=True, tp_comm_overlap_autotune_rtol=0), "tp_comm_overlap_autotune_rtol = 0: must be a"),
        (dict(tp_comm_overlap=True, tp_comm_overlap_autotune_strategy="grid"), "must be one of coordinate"),
    ],
)
def test_bad_arguments_are_refused_when_the_callback_is_made(nemo, kw, needle):
    with pytest.raises(ValueError, match=needle):
        nemo.module.AutotuneCommOverlapCallback(**kw)
    nemo.module.AutotuneCommOverlapCallback(**{**kw, "tp_comm_overlap_autotune": False})  # plain NeMo callback: fine


@pytest.mark.parametrize(
    "tp, sp, needle",
    [
        (1, True, r"tensor_model_parallel_size=1\): tp_comm_overlap_autotune needs >= 2"),
        (2, False, r"sequence_parallel=False\): tp_comm_overlap_autotune needs"),
    ],
)
def test_setup_refuses_a_run_nemo_would_silently_run_without_overlap(nemo, tmp_path, tp, sp, needle):
    cb = nemo.module.AutotuneCommOverlapCallback(tp_comm_overlap=True)
    with pytest.raises(ValueError, match=needle):
        cb.setup(trainer(tmp_path, tp=tp, sp=sp), None, "fit")
    assert cb.setup_calls == []  # refused before NeMo touched the model config
    cb.setup(trainer(tmp_path, tp=tp, sp=sp), None, "validate")  # not training: nothing to tune
    ok = nemo.module.AutotuneCommOverlapCallback(tp_comm_overlap=True)
    ok.setup(trainer(tmp_path), None, "fit")
    assert ok.setup_calls == ["fit"]
    no_te = trainer(tmp_path)
    no_te.te_missing = True
    with pytest.raises(ValueError, match="NeMo switched tensor-parallel overlap off"):
        nemo.module.AutotuneCommOverlapCallback(tp_comm_overlap=True).setup(no_te, None, "fit")


def test_tunes_inside_the_first_training_step_only(nemo, tmp_path, monkeypatch):
    cb = nemo.module.AutotuneCommOverlapCallback(tp_comm_overlap=True)
    t = trainer(tmp_path)
    seen = []
    t.strategy.training_step = lambda it, *a, **kw: seen.append((it, a, kw)) or "loss"
    monkeypatch.setattr(cb, "tune", lambda tr, it: ["read ahead", it])
    cb.on_train_start(t, None)
    assert t.strategy.training_step("it1", 7, k=1) == "loss" and seen[-1] == (["read ahead", "it1"], (7,), {"k": 1})
    assert t.strategy.training_step("it2") == "loss" and seen[-1] == ("it2", (), {})  # second step: untouched
    off = nemo.module.AutotuneCommOverlapCallback(tp_comm_overlap=True, tp_comm_overlap_autotune=False)
    t2 = trainer(tmp_path)
    t2.strategy.training_step = step = lambda it: it
    off.on_train_start(t2, None)
    assert t2.strategy.training_step is step


def test_tune_runs_the_megatron_machinery_through_nemos_forward_step(nemo, tmp_path, monkeypatch):
    from megatron_tp_overlap.integrations.megatron import tuning
    from megatron_tp_overlap.ub.config import parse_ub_cfgs

    calc = types.ModuleType("megatron.core.num_microbatches_calculator")
    calc.get_micro_batch_size, calc.get_num_microbatches = (lambda: 1), (lambda: 4)
    if "megatron" not in sys.modules:
        monkeypatch.setitem(sys.modules, "megatron", types.ModuleType("megatron"))
        monkeypatch.setitem(sys.modules, "megatron.core", types.ModuleType("megatron.core"))
    monkeypatch.setitem(sys.modules, "megatron.core.num_microbatches_calculator", calc)

    class ModuleStepFunction:
        @staticmethod
        def from_forward_step(module, step_type):
            return ("forward", module, step_type)

        from_data_step = staticmethod(lambda module, step_type: None)  # the module has none: NeMo's default
        from_loss_reduction = staticmethod(lambda module, step_type: ("loss", module, step_type))

    class MegatronStep:
        @classmethod
        def infer(
            cls,
            pipeline,
            data,
            forward_step_func,
            forward_only,
            micro_batch_size=None,
            seq_length=None,
            num_microbatches=None,
            step_i=None,
        ):
            return ("step", forward_only, micro_batch_size, seq_length, num_microbatches)

    nemo.parallel.MegatronStep, nemo.parallel._ModuleStepFunction = MegatronStep, ModuleStepFunction
    seen = {}

    def fake_tune(model, fwd, optimizer, it, run, options, reference, output, **kw):
        seen.update(fwd=fwd, model=model, optimizer=optimizer, run=run, reference=reference, output=output)
        ub = parse_ub_cfgs({"fc2_fprop": {"method": "ring_exchange"}})
        return SimpleNamespace(config=SimpleNamespace(ub=ub), data_iterator=["replayed", it], on_recipe=[])

    class MegatronParallel(list):  # a ModuleList of model chunks with NeMo's step plumbing
        config, module, data_step = gpt_config(), "lightning module", "default data step"

        def wrapped_forward_step(self, forward_step, loss_reduction, data_step, context):
            seen["parts"] = (forward_step, loss_reduction, data_step)
            seen["context"] = context
            return "megatron-style forward_step_func"

    monkeypatch.setattr(tuning, "tune", fake_tune)
    cb = nemo.module.AutotuneCommOverlapCallback(tp_comm_overlap=True, tp_comm_bootstrap_backend="mpi")
    t = trainer(tmp_path)
    t.model = MegatronParallel(["chunk0", "chunk1"])
    cb.setup(t, None, "fit")
    cb.tp_comm_overlap_cfg = {
        "proj_fprop": {
            "method": "ring_exchange",
            "num_sm": 1,
            "cga_size": 1,
            "set_sm_margin": False,
            "atomic_gemm": False,
            "aggregate": False,
            "fp8_buf": (False,),
        }
    }  # asdict after ub init
    it = cb.tune(t, "dataloader_iter")
    assert it == ["replayed", "dataloader_iter"]
    assert seen["fwd"] == "megatron-style forward_step_func" and seen["model"] == ["chunk0", "chunk1"]
    assert seen["optimizer"] == "optimizer" and seen["context"]["step"] == ("step", False, 1, 8192, 4)
    assert seen["parts"] == (
        ("forward", "lightning module", "training"),
        ("loss", "lightning module", "training"),
        "default data step",
    )
    run = seen["run"]
    assert run.problems() == [] and run.bootstrap_backend == "mpi" and run.micro_batch_size == 1 and run.tp == 4
    assert seen["output"] == tmp_path / "tp_comm_overlap_tuned.yaml"
    ref = seen["reference"]  # the preset it started from, as TE ran it: fp8_buf=(False,) is true
    assert ref.get("proj_fprop").method == "ring_exchange" and ref.get("proj_fprop").fp8_buf is True
    assert type(cb.tp_comm_overlap_cfg).__name__ == "TransformerLayerTPOverlapCfg"  # NeMo's own class when it imports
    assert cb.tp_comm_overlap_cfg.fc2_fprop.method == "ring_exchange" and it == ["replayed", "dataloader_iter"]
    assert cb.tuned.data_iterator is None  # handed over: the callback keeps no reference to the run's data
    assert cb.user_comm_overlap_cfg.tp_comm_overlap_cfg is cb.tp_comm_overlap_cfg  # what a later stage's setup copies
    assert len(cb.tuned.on_recipe) == 1  # and it follows the in-run verification's verdict


def test_the_callback_and_the_model_config_follow_the_recipe_and_its_revert(nemo, tmp_path):
    """AG overlap off wins: the model config and its __io__ copy (what a NeMo checkpoint saves) say so, the callback
    holds the tuned dataclass; the verification goes back: everything is back; no overlap wins: the callback's
    tp_comm_overlap is off (NeMo's setup copies it onto the model config for a later stage)."""
    from megatron_tp_overlap.integrations.megatron.flags import KIND_SWITCHES, recipe
    from megatron_tp_overlap.ub.config import GEMM_NAMES, UbConfig, parse_ub_cfgs

    switches = {k.field: True for k in KIND_SWITCHES.values()}
    model = SimpleNamespace(
        config=gpt_config(tp_comm_overlap_rs_dgrad=False, tp_comm_overlap_cfg="preset", **switches),
        __io__=SimpleNamespace(
            config=gpt_config(tp_comm_overlap_rs_dgrad=False, tp_comm_overlap_cfg="preset", **switches)
        ),
    )
    cb = nemo.module.AutotuneCommOverlapCallback(tp_comm_overlap=True)
    tuned_ub = parse_ub_cfgs({"fc2_fprop": {"method": "ring_exchange", "num_sm": 2}})
    cb.tuned = SimpleNamespace(config=SimpleNamespace(ub=tuned_ub))
    every, ag = frozenset(GEMM_NAMES), KIND_SWITCHES["AG overlap"].gemms
    follow = cb.follow_recipe(model, 4)
    follow(recipe(tuned_ub, ag, every, tmp_path / "t.yaml", tp=4))
    for c in (model.config, model.__io__.config):
        assert (c.tp_comm_overlap_ag, c.tp_comm_overlap_rs, c.tp_comm_overlap) == (False, True, True)
        assert c.tp_comm_overlap_cfg.fc2_fprop.num_sm == 2
    assert (
        cb.tp_comm_overlap_cfg.fc2_fprop.num_sm == 2
        and cb.user_comm_overlap_cfg.tp_comm_overlap_cfg.fc2_fprop.num_sm == 2
    )

    cb.tuned.config = SimpleNamespace(ub=UbConfig())  # the verification went back to the starting config
    follow(recipe(UbConfig(), frozenset(), every, tmp_path / "t.yaml", tp=4))
    assert model.config.tp_comm_overlap_ag is True and model.__io__.config.tp_comm_overlap_ag is True
    assert cb.tp_comm_overlap_cfg.fc2_fprop.num_sm != 2 and cb.user_comm_overlap_cfg.tp_comm_overlap is True

    follow(recipe(UbConfig(), every, every, tmp_path / "t.yaml", tp=4))  # no overlap at all
    assert cb.user_comm_overlap_cfg.tp_comm_overlap is False and model.config.tp_comm_overlap is False
    assert model.config.tp_comm_overlap_ag is True  # no kind switch needed: overlap is off as a whole
