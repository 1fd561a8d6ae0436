"""The NeMo callback against NeMo 2.7's real classes, where NeMo imports (skipped otherwise, e.g. in CI: NeMo 2.7
needs megatron-core <= 0.16 and lightning <= 2.4). Run on a CPU machine with nemo_toolkit 2.7.3, megatron-core 0.16,
lightning 2.4: no GPU, no TE, so NeMo's TE check and the CUDA capability query are patched as on a GPU node."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest

pytest.importorskip("nemo.collections.llm", exc_type=ImportError)


@pytest.fixture
def real(monkeypatch):
    import nemo.lightning.pytorch.callbacks.megatron_comm_overlap as nco
    import torch
    from nemo import lightning as nl
    from nemo.collections import llm
    from nemo.collections.llm.recipes.tp_overlap_configs import userbuffers
    from nemo.utils import AppState

    from megatron_tp_overlap.integrations.nemo import AutotuneCommOverlapCallback

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    AppState().tensor_model_parallel_size, AppState().context_parallel_size = (
        4,
        1,
    )  # what MegatronStrategy's launch sets

    def trainer(tp=4, sp=True):
        cfg = llm.Llama3Config8B(seq_length=8192, apply_rope_fusion=False)
        return SimpleNamespace(
            strategy=nl.MegatronStrategy(tensor_model_parallel_size=tp, sequence_parallel=sp),
            model=SimpleNamespace(config=cfg, optim=SimpleNamespace()),
        )

    return SimpleNamespace(
        nco=nco,
        cls=AutotuneCommOverlapCallback,
        trainer=trainer,
        preset=userbuffers.userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192,
    )


def test_is_nemos_callback_and_refuses_bad_arguments(real):
    cb = real.cls(
        tp_comm_overlap=True,
        tp_comm_overlap_cfg=real.preset,
        overlap_grad_reduce=True,
        tp_comm_overlap_autotune_seconds=30,
    )
    assert (
        isinstance(cb, real.nco.MegatronCommOverlapCallback)
        and cb.autotune_options["tp_comm_overlap_autotune_seconds"] == 30
    )
    with pytest.raises(ValueError, match="needs tp_comm_overlap=True"):
        real.cls(tp_comm_overlap=False)


def test_nemos_setup_runs_under_ours(real, monkeypatch):
    monkeypatch.setattr(real.nco, "HAVE_TE", True)  # as on a GPU node
    cb = real.cls(tp_comm_overlap=True, tp_comm_overlap_cfg=real.preset)
    t = real.trainer()
    cb.setup(t, None, "fit")
    assert t.model.config.tp_comm_overlap is True and cb.need_tp_overlap_ub_init
    assert type(cb.tp_comm_overlap_cfg).__name__ == "TransformerLayerTPOverlapCfg"
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size=1\).*\n.*sequence_parallel=False"):
        real.cls(tp_comm_overlap=True).setup(real.trainer(tp=1, sp=False), None, "fit")


def test_without_te_nemo_switches_overlap_off_and_we_say_so(real, monkeypatch):
    monkeypatch.setattr(real.nco, "HAVE_TE", False)
    with pytest.raises(ValueError, match="NeMo switched tensor-parallel overlap off"):
        real.cls(tp_comm_overlap=True).setup(real.trainer(), None, "fit")


def test_nemo_presets_convert_both_ways_with_nemos_classes(real):
    from megatron_tp_overlap.ub.layer_cfg import as_ub_cfgs, framework_classes, from_layer_cfg, to_layer_cfg
    from megatron_tp_overlap.ub.presets import PRESETS

    ours = from_layer_cfg(as_ub_cfgs(real.preset))
    assert ours == PRESETS["userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192"]
    classes = framework_classes("NeMo 2")
    back = to_layer_cfg(ours, 4, classes)
    assert classes.source == "NeMo 2" and type(back) is type(real.preset)
    assert from_layer_cfg(as_ub_cfgs(back)) == ours


def test_the_nemo_internals_tune_calls_exist_with_these_signatures(real):
    from nemo.lightning.megatron_parallel import MegatronParallel, MegatronStep, _ModuleStepFunction

    assert list(inspect.signature(MegatronParallel.wrapped_forward_step).parameters) == [
        "self",
        "forward_step",
        "loss_reduction",
        "data_step",
        "context",
    ]
    assert {
        "pipeline",
        "data",
        "forward_step_func",
        "forward_only",
        "micro_batch_size",
        "seq_length",
        "num_microbatches",
    } <= set(inspect.signature(MegatronStep.infer).parameters)
    for f in ("from_forward_step", "from_loss_reduction", "from_data_step"):
        assert list(inspect.signature(getattr(_ModuleStepFunction, f)).parameters) == ["module", "step_type"]
