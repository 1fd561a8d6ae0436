"""CUDA graphs and activation recompute in a Megatron run (CPU): each mode's capture point, the in-run verification
bounded before it, the guard that keeps trial steps from capturing `local` graphs (on a stand-in with the
attribute names of megatron/core/transformer/cuda_graphs.py), and recompute's cost in the per-module timing."""

from __future__ import annotations

import argparse
import types
from enum import Enum

import fakes
import pytest
import torch
import torch.utils.checkpoint as checkpoint

from megatron_tp_overlap.engine.measure import SlotTimer
from megatron_tp_overlap.engine.topology import find_overlap_modules
from megatron_tp_overlap.engine.verify import span
from megatron_tp_overlap.integrations.megatron import graphs
from megatron_tp_overlap.integrations.megatron.graphs import Capture, no_local_capture, te_steps_before_capture
from megatron_tp_overlap.integrations.megatron.recompute import Recompute, describe_no_grad, no_grad_forward_gemms


class Scope(Enum):  # as megatron.core.transformer.enums.CudaGraphScope
    attn = 1
    full_iteration = 2


@pytest.mark.parametrize(
    "cfg, mode, eager",
    [
        (dict(cuda_graph_impl="none"), None, None),
        (dict(cuda_graph_impl="local"), "local", 0),  # captures at the end of the run's first forward_backward
        (dict(enable_cuda_graph=True), "local", 0),
        (dict(cuda_graph_impl="transformer_engine", cuda_graph_warmup_steps=5), "transformer_engine", 5),
        (dict(external_cuda_graph=True), "transformer_engine", 3),  # TransformerConfig's default warmup
        (dict(cuda_graph_impl="transformer_engine", cuda_graph_warmup_steps=0), "transformer_engine", 0),
        (dict(cuda_graph_impl="full_iteration", cuda_graph_warmup_steps=2), "full_iteration", 2),
        (dict(cuda_graph_impl="local", cuda_graph_scope=[Scope.full_iteration]), "full_iteration", 3),  # older spelling
        (dict(cuda_graph_impl="local", cuda_graph_modules=[Scope.attn]), "local", 0),
    ],
)
def test_each_mode_captures_after_the_iterations_megatrons_loop_runs_eagerly(cfg, mode, eager):
    cap = Capture.of(types.SimpleNamespace(**cfg))
    assert (cap.mode, cap.eager_iters) == (mode, eager) if mode else cap is None


def test_skipped_iterations_move_the_te_capture_as_each_loop_does():
    # Megatron-LM: the capture check comes first; a skip at the start moves start_iteration
    assert te_steps_before_capture(3, {1}) == 3  # iteration 1 skipped at the start: 3 steps still run before
    assert te_steps_before_capture(3, {3}) == 2  # a skip inside the warmup brings the capture one step earlier
    # Megatron-Bridge: the skip comes first and never moves the start; a skip can jump past the capture
    assert te_steps_before_capture(3, {3}, skip_moves_start=False) == 2
    assert te_steps_before_capture(3, {4}, skip_moves_start=False, limit=50) == 50
    assert Capture.of(argparse.Namespace(cuda_graph_impl="transformer_engine", cuda_graph_warmup_steps=3), {3}) == (
        Capture("transformer_engine", 2, "before training iteration 3 (--cuda-graph-warmup-steps 3)")
    )


def _verification(capture, remaining=None, verify_iters=384):
    from types import SimpleNamespace

    from test_cache import KEY

    from megatron_tp_overlap.engine.options import TuneOptions
    from megatron_tp_overlap.engine.space import TuningConfig
    from megatron_tp_overlap.integrations.megatron import tuning as mt
    from megatron_tp_overlap.integrations.megatron.flags import Recipe
    from megatron_tp_overlap.ub.config import GemmOverlapConfig, UbConfig

    ref = TuningConfig(UbConfig(), frozenset(), "reference")
    cand = TuningConfig(UbConfig().with_entry("fc2_fprop", GemmOverlapConfig(method="pipeline", num_sm=8)), label="x")
    tuned = mt.Tuned(cand, None, None, Recipe("x.yaml", [], [], {}))
    applied, logs = [], []
    switcher = SimpleNamespace(apply=applied.append, close=lambda: None)
    opts = TuneOptions(verify_iters=verify_iters)
    v = mt._verification(tuned, ref.ub, switcher, opts, KEY, None, logs.append, remaining, capture=capture)
    return v, tuned, applied, logs


def test_the_in_run_verification_ends_before_the_capture_or_says_in_one_line_why_it_is_skipped(monkeypatch):
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 0)
    for cap in (Capture.of(argparse.Namespace(cuda_graph_impl="local")), Capture("transformer_engine", 3, "soon")):
        v, tuned, applied, logs = _verification(cap)
        assert v is None and applied == [] and len(logs) == 1, logs  # nothing switched, one line
        assert f"--cuda-graph-impl {cap.mode}" in logs[0] and "in-run verification skipped" in logs[0]
        assert f"shortest takes {span(1)} iterations, {cap.eager_iters} run before the capture" in logs[0]
        assert "capture before it ends" in tuned.notes[-1]

    cap = Capture("full_iteration", 60, "in training iteration 61 (--cuda-graph-warmup-steps 60)")
    v, _, applied, logs = _verification(cap, remaining=1000)
    assert v is not None and len(v.plan) <= 60 and "shortened to" in logs[0] and "iteration 61" in logs[0]
    v.sync, v.agree, ticks = (lambda: None), (lambda t: list(t)), iter(range(10**6))
    v.clock = lambda: float(next(ticks))
    switched_at = []
    v.apply, v.on_verdict = (lambda c: switched_at.append(v._i)), (lambda verdict: None)
    for _ in range(cap.eager_iters):  # the run's eager iterations: the verdict and every switch come within them
        v.before()
        v.after()
    assert v.done and max(switched_at) < cap.eager_iters
    # room enough before the capture: the verification runs as without graphs
    v, _, _, logs = _verification(Capture("transformer_engine", 1000, "later"), verify_iters=96)
    assert v is not None and v.iters == 96 and not any("CUDA graphs" in m for m in logs)


class _Record:  # megatron.core.transformer.cuda_graphs._CudagraphGlobalRecord
    cudagraph_created = False
    cudagraph_record: list = []
    cudagraph_inference_record: list = []
    _saved_tensors_observer = None

    @classmethod
    def _enable_saved_tensors_observer(cls):
        if cls.cudagraph_created or cls._saved_tensors_observer is not None:
            return
        cls._saved_tensors_observer = ("original", "observing")

    @classmethod
    def _disable_saved_tensors_observer(cls):
        cls._saved_tensors_observer = None

    @classmethod
    def create_cudagraphs(cls):  # records -> graphs, then the observer goes (even with nothing recorded)
        try:
            if cls.cudagraph_created or not cls.cudagraph_record:
                return
            cls.captured = [r for r in cls.cudagraph_record]
            cls.cudagraph_created, cls.cudagraph_record = True, []
        finally:
            cls._disable_saved_tensors_observer()


def _fake_megatron_graphs():
    """A stand-in for megatron.core.transformer.cuda_graphs with its names: a graphed layer's __call__ goes to its
    CudaGraphManager, which records a runner and runs the layer eagerly in the first step; the schedule calls
    create_cudagraphs() at the end of forward_backward_func under `local`."""
    cg = types.SimpleNamespace()
    cg._CudagraphGlobalRecord = type("_CudagraphGlobalRecord", (_Record,), {"cudagraph_record": []})

    class MegatronModule(torch.nn.Module):
        pass

    class CudaGraphManager(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.func, self.cudagraph_runners = None, []
            cg._CudagraphGlobalRecord._enable_saved_tensors_observer()

        def __call__(self, megatron_module, args, kwargs, cache_key=None):
            if cg._CudagraphGlobalRecord.cudagraph_created:
                raise AssertionError("replay")
            runner = object()
            self.cudagraph_runners.append(runner)
            cg._CudagraphGlobalRecord.cudagraph_record.append((runner, "fwd"))
            return super(MegatronModule, megatron_module).__call__(*args, **kwargs)

    class Layer(MegatronModule):  # GraphableMegatronModule under `local`
        def __init__(self):
            super().__init__()
            self.block, self.cudagraph_manager = fakes.Block(8), CudaGraphManager()

        def forward(self, x):
            return self.block(x)

        def __call__(self, *args, **kwargs):
            return self.cudagraph_manager(self, args, kwargs)

    def forward_backward(model):
        model(torch.randn(4, 8, requires_grad=True)).sum().backward()
        cg._CudagraphGlobalRecord.create_cudagraphs()

    cg.MegatronModule, cg.CudaGraphManager, cg.Layer, cg.forward_backward = (
        MegatronModule,
        CudaGraphManager,
        Layer,
        forward_backward,
    )
    return cg


def test_trial_steps_under_local_graphs_never_record_nor_capture_and_the_run_captures_as_without_them(fake_te):
    def model_and_run(trials):
        cg = _fake_megatron_graphs()
        model = torch.nn.Sequential(cg.Layer(), cg.Layer())
        call = cg.CudaGraphManager.__call__
        timer = SlotTimer(find_overlap_modules(model), fakes.SimEvent)
        with timer:
            for _ in range(trials):
                timer.begin_step()
                with graphs.trial_guard(types.SimpleNamespace(cuda_graphs="local"), [model], cg):
                    cg.forward_backward(model)
                timer.end_step()
                assert not cg._CudagraphGlobalRecord.cudagraph_created  # nothing captured by a trial
            per_slot, _ = timer.collect(["qkv.fwd", "qkv.bwd"])
        assert all(v > 0 for v in per_slot["qkv.fwd"] + per_slot["qkv.bwd"])  # trials run and are timed eagerly
        assert cg.CudaGraphManager.__call__ is call and cg._CudagraphGlobalRecord._saved_tensors_observer
        cg.forward_backward(model)  # the run's first iteration: records and captures
        return cg, model

    cg, model = model_and_run(trials=3)
    base, base_model = model_and_run(trials=0)
    assert cg._CudagraphGlobalRecord.cudagraph_created and len(cg._CudagraphGlobalRecord.captured) == 2
    assert [len(m.cudagraph_manager.cudagraph_runners) for m in model] == [1, 1]
    assert len(base._CudagraphGlobalRecord.captured) == 2
    with pytest.raises(graphs.GraphsAlreadyCaptured), no_local_capture([model], cg):
        pass
    assert isinstance(
        graphs.trial_guard(types.SimpleNamespace(cuda_graphs="transformer_engine"), [model]),
        type(graphs.contextlib.nullcontext()),
    )


def test_recompute_counts_every_forward_where_it_runs_and_each_backward_once(fake_te):
    """Reentrant (Megatron's, TE's): the first forward under no_grad, the recomputed one in the checkpoint's
    backward. Non-reentrant: the recompute runs inside a module's backward and stops early by raising."""
    cost = {g: fakes.gemm_cost_ms(g, fakes.STATE.cfg, True) for g in ("qkv_fprop", "proj_fprop", "fc1_fprop")}
    cost["fc2_fprop"] = fakes.gemm_cost_ms("fc2_fprop", fakes.STATE.cfg, True)
    off = fakes.gemm_cost_ms("qkv_fprop", fakes.STATE.cfg, False)  # LayerNormLinear under no_grad: AG not overlapped

    def timed(step):
        block = fakes.Block(8)
        mods = find_overlap_modules(block)
        slots = [f"{m.slot_prefix}.{p}" for m in mods for p in ("fwd", "bwd")]
        with SlotTimer(mods, fakes.SimEvent) as timer:
            timer.begin_step()
            step(block, torch.randn(4, 8, requires_grad=True)).sum().backward()
            timer.end_step()
            per_slot, total = timer.collect(slots)
        assert sum(v[0] for v in per_slot.values()) == pytest.approx(total[0])  # every ms in exactly one slot
        return {k: v[0] for k, v in per_slot.items()}

    plain = timed(lambda b, x: b(x))
    for reentrant in (True, False):
        t = timed(lambda b, x, r=reentrant: checkpoint.checkpoint(b, x, use_reentrant=r))
        for name in ("qkv", "proj", "fc1", "fc2"):
            first = off if reentrant and name in ("qkv", "fc1") else cost[f"{name}_fprop"]
            assert t[f"{name}.fwd"] == pytest.approx(first + cost[f"{name}_fprop"]), (reentrant, name)
            assert t[f"{name}.bwd"] == pytest.approx(plain[f"{name}.bwd"]), (reentrant, name)


def test_which_gemms_a_recompute_runs_forward_without_overlap(fake_te):
    mods = find_overlap_modules(fakes.fake_model(layers=1))
    full = Recompute("full", "uniform", 1)
    assert no_grad_forward_gemms(mods, full) == {"qkv_fprop", "fc1_fprop"}  # LayerNormLinear; Linear overlaps
    assert no_grad_forward_gemms(mods, Recompute("selective", modules=("core_attn", "mlp"))) == {"fc1_fprop"}
    assert no_grad_forward_gemms(mods, Recompute("selective")) == set()  # core_attn: no overlap GEMM
    assert no_grad_forward_gemms(mods, Recompute("selective", modules=("mlp",)), dense=False, moe=True) == set()
    assert no_grad_forward_gemms(mods, Recompute("selective", modules=("shared_experts",)), moe=True) == {"fc1_fprop"}
    assert no_grad_forward_gemms(mods, Recompute()) == set()
    assert "qkv_fprop" in describe_no_grad({"qkv_fprop"}) and describe_no_grad(()) == ""
    assert full.flag() == "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
    assert Recompute("selective", modules=("core_attn",)).flag() is None
