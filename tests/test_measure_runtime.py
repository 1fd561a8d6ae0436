import gc
import math

import fakes
import pytest
import torch

from megatron_tp_overlap.atomic import atomic_write_text
from megatron_tp_overlap.engine import held_graphs
from megatron_tp_overlap.engine import switcher as ub_runtime
from megatron_tp_overlap.engine.measure import HostEvent, SlotTimer, agree_max, module_node
from megatron_tp_overlap.engine.numerics import Fingerprint, rel_diff
from megatron_tp_overlap.engine.space import TuningConfig
from megatron_tp_overlap.engine.topology import build_topology, find_overlap_modules
from megatron_tp_overlap.errors import StaleCommunicatorError
from megatron_tp_overlap.ub.config import GemmOverlapConfig, UbConfig


def test_slot_timer_times_forward_and_backward_of_every_module(fake_te):
    model = fakes.fake_model(layers=2, scale=1.0)
    mods = find_overlap_modules(model)
    slots = list(build_topology(mods).slots())
    x = torch.randn(4, 8, requires_grad=True)
    with SlotTimer(mods, fakes.SimEvent) as timer:
        for _ in range(3):
            timer.begin_step()
            model(x).sum().backward()
            timer.end_step()
        per_slot, step = timer.collect(slots)
    assert len(step) == 3 and all(s > 0 for s in step)
    for s in slots:
        assert len(per_slot[s]) == 3 and all(v > 0 for v in per_slot[s]), s
    # forward of qkv: 2 layers x 0.6 ms (TE default ring_exchange) on the synthetic clock, exactly
    assert per_slot["qkv.fwd"] == pytest.approx([1.2] * 3)
    # backward hooks wrap the module's own autograd node: its time is inside the interval (bulk sm=16: 0.46 ms)
    assert per_slot["qkv.bwd"] == pytest.approx([2 * (0.3 + 0.02 * 8) * 2] * 3)
    assert sum(per_slot[s][0] for s in slots) == pytest.approx(step[0])  # modules are all the step does
    assert not timer.handles  # detached on exit


def test_no_timing_outside_steps_and_missing_backward_is_nan(fake_te):
    model = fakes.fake_model(layers=1)
    mods = find_overlap_modules(model)
    with SlotTimer(mods, HostEvent) as timer:
        model(torch.randn(2, 8))  # outside a step: nothing recorded
        timer.begin_step()
        with torch.no_grad():
            model(torch.randn(2, 8))
        timer.end_step()
        per_slot, _ = timer.collect(["qkv.fwd", "qkv.bwd"])
    assert per_slot["qkv.fwd"][0] > 0 and math.isnan(per_slot["qkv.bwd"][0])


def test_module_node_sees_through_views():
    lin = fakes.LayerNormLinear(8, "qkv")
    y = lin(torch.randn(2, 8, requires_grad=True)).view(16)
    assert isinstance(module_node(y), torch.autograd.function.BackwardCFunction)


def test_agree_max_without_distributed_is_identity():
    assert agree_max([1.0, float("nan")])[0] == 1.0


def test_switcher_reinitializes_only_when_ub_cfgs_change(fake_te):
    model = fakes.fake_model(layers=2)
    mods = find_overlap_modules(model)
    sw = ub_runtime.UbSwitcher(fakes.fake_init_args(tp=4), mods)
    cfg = UbConfig().with_entry("fc2_fprop", GemmOverlapConfig(method="pipeline", num_sm=8))
    assert sw.apply(TuningConfig(cfg)) is True
    assert fake_te.calls[-1]["ub_cfgs"] == {"fc2_fprop": {"method": "pipeline", "num_sm": 8}}
    assert fake_te.calls[-1]["shape"] == [64, 8] and fake_te.calls[-1]["tp_size"] == 4
    assert fake_te.calls[-1]["bootstrap_backend"] == "nccl"
    assert sw.apply(TuningConfig(cfg, frozenset({"qkv_fprop"}))) is False  # flags only
    assert all(not m.module.ub_overlap_ag_fprop for m in mods if m.name == "qkv")
    assert all(m.module.ub_overlap_ag_fprop for m in mods if m.name == "fc1")
    sw.apply(TuningConfig(UbConfig()))
    assert sw.reinits == 2 and fake_te.destroys == 1
    assert sw.apply(TuningConfig(UbConfig()), force=True) is True  # new buffers for the same config
    assert sw.reinits == 3 and fake_te.destroys == 2
    sw.restore_built_flags()
    assert all(m.module.ub_overlap_ag_fprop for m in mods if m.name == "qkv")
    # each re-init's seconds by phase (the first had nothing to release); they add up to its total
    assert len(sw.reinit_phases) == 3 and set(sw.reinit_phases[0]) == set(ub_runtime.REINIT_PHASES)
    assert sw.reinit_phases[0]["destroy"] == 0.0 and sw.reinit_phases[0]["initialize"] > 0
    for ph, total in zip(sw.reinit_phases, sw.reinit_seconds):
        assert sum(ph.values()) == pytest.approx(total, abs=1e-3)
    med = ub_runtime.reinit_phase_medians(sw.reinit_phases)
    assert set(med) == set(ub_runtime.REINIT_PHASES) and ub_runtime.reinit_phase_medians([]) is None


def test_switcher_refuses_while_an_old_communicator_is_referenced(fake_te):
    sw = ub_runtime.UbSwitcher(fakes.fake_init_args(), find_overlap_modules(fakes.fake_model(layers=1)))
    sw.apply(TuningConfig(UbConfig()))
    held = fake_te._ub_communicators["qkv_fprop"]  # e.g. an autograd ctx of the last step
    with pytest.raises(StaleCommunicatorError, match="still referenced"):
        sw.apply(TuningConfig(UbConfig().with_entry("fc2_fprop", GemmOverlapConfig(method="ring_exchange"))))
    assert fake_te.destroys == 0  # nothing was torn down
    del held
    sw.apply(TuningConfig(UbConfig().with_entry("fc2_fprop", GemmOverlapConfig(method="ring_exchange"))))
    assert fake_te.destroys == 1


def test_capture_initialize_ub(fake_te):
    with ub_runtime.capture_initialize_ub() as calls:
        fake_te.initialize_ub(shape=[128, 16], tp_size=2, ub_cfgs={}, bootstrap_backend="gloo")
    assert calls and calls[0].shape == [128, 16] and calls[0].bootstrap_backend == "gloo"
    assert fake_te.initialize_ub.__name__ == "initialize_ub"  # restored


def test_fingerprint_detects_wrong_numbers():
    fp = Fingerprint()
    a = torch.randn(64, 32)
    assert rel_diff(fp([a]), fp([a])) == 0.0
    assert rel_diff(fp([a + 1e-3 * torch.randn(64, 32)]), fp([a])) < 5e-3
    assert rel_diff(fp([a[torch.randperm(64)]]), fp([a])) > 0.2
    assert rel_diff(fp([-a]), fp([a])) > 0.2
    assert rel_diff(fp([a * float("nan")]), fp([a])) == math.inf
    assert rel_diff(fp([a, None]), fp([a])) == math.inf


def test_atomic_write_backs_up_and_never_leaves_half_a_file(tmp_path, monkeypatch):
    p = tmp_path / "out" / "tuned.yaml"
    assert atomic_write_text(p, "a: 1\n") is None
    bak = atomic_write_text(p, "a: 2\n", backup=True)
    assert p.read_text() == "a: 2\n" and bak.read_text() == "a: 1\n"
    import os

    def boom(*a):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        atomic_write_text(p, "a: 3\n")
    assert p.read_text() == "a: 2\n"
    assert sorted(x.name for x in p.parent.iterdir()) == ["tuned.yaml", "tuned.yaml.bak"]


def test_compare_configs_interleaves_rounds_and_never_times_a_config_against_itself():
    from megatron_tp_overlap.engine.measure import compare_configs
    from megatron_tp_overlap.engine.space import TuningConfig
    from megatron_tp_overlap.ub.config import GemmOverlapConfig, UbConfig

    a = TuningConfig(UbConfig(), frozenset(), "TE default")
    b = TuningConfig(UbConfig().with_entry("fc2_fprop", GemmOverlapConfig(method="ring_exchange")), frozenset(), "x")
    order, clock = [], iter(range(100))
    live = {}

    def apply(c):
        live["c"] = c

    def timer(step, steps, group=None):
        order.append(live["c"])
        return float(next(clock))  # a drifting clock: later rounds are slower

    st = compare_configs(
        {"TE default": a, "tuned": TuningConfig(UbConfig(), frozenset(), "reference"), "x": b},
        apply,
        lambda: None,
        steps=3,
        rounds=4,
        timer=timer,
    )
    assert order == [a, b, b, a] * 2  # interleaved and rotated, and the duplicate is measured once
    assert st["tuned"] == st["TE default"] and st["TE default"]["rounds"] == 4
    # clock 0..7: a got 0, 3, 4, 7; b got 1, 2, 5, 6
    assert st["TE default"]["median"] == 3.5 and st["x"]["median"] == 3.5 and st["x"]["spread"] == 5.0


def _write_many(path: str, who: int) -> None:
    from megatron_tp_overlap.atomic import atomic_write_text
    from megatron_tp_overlap.ub.config import GemmOverlapConfig, UbConfig, dumps_yaml

    for i in range(25):
        cfg = UbConfig().with_entry("fc2_fprop", GemmOverlapConfig(method="pipeline", num_sm=1 + who, num_splits=1 + i))
        atomic_write_text(path, dumps_yaml(cfg, header=f"writer {who} round {i}\n" + "x" * 4000), backup=True)


def test_concurrent_writers_of_one_output_yaml_leave_a_valid_file(tmp_path):
    import multiprocessing as mp

    from megatron_tp_overlap.ub.config import load_yaml

    path = tmp_path / "tuned.yaml"
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_write_many, args=(str(path), w)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for f in (path, path.with_name(path.name + ".bak")):
        assert load_yaml(f).get("fc2_fprop").method == "pipeline"  # whole files only, never half of one
    assert not [f for f in tmp_path.iterdir() if f.name not in ("tuned.yaml", "tuned.yaml.bak")]  # no temp files left


def test_step_and_fingerprint_leave_no_gradients_and_repeat_exactly():
    """The trial step/fingerprint pair the layer benchmarks and engine_tune share (CPU, a tiny model)."""
    import torch

    from megatron_tp_overlap.tools.layer_bench import step_and_fingerprint

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    x = torch.randn(4, 8, requires_grad=True)
    dy = torch.randn(4, 8)
    step, fingerprint = step_and_fingerprint(model, x, dy)
    a = fingerprint()
    assert x.grad is None and all(p.grad is None for p in model.parameters())
    step()  # accumulates gradients; the fingerprint must not depend on them
    b = fingerprint()
    assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    with torch.no_grad():
        model[0].weight.add_(1e-2)
    assert not torch.equal(torch.as_tensor(a), torch.as_tensor(fingerprint()))


def test_fp8_fingerprints_start_from_the_same_scales_whatever_the_steps_between_did():
    """Delayed scaling: a step's FP8 scale comes from the steps before it. A fingerprint taken after other steps must
    still equal the first one (configs are compared at the same scales); a changed weight must still show."""
    import contextlib
    from types import SimpleNamespace

    import torch

    from megatron_tp_overlap.tools.layer_bench import step_and_fingerprint

    class DelayedScaled(torch.nn.Linear):
        """Output scaled by the previous step's amax, as a quantized GEMM's rounding depends on it."""

        def __init__(self) -> None:
            super().__init__(8, 8)
            self.fp8_meta = {"scaling_fwd": SimpleNamespace(amax_history=torch.zeros(1, 1), scale=torch.ones(1))}

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            state = self.fp8_meta["scaling_fwd"]
            y = super().forward(x) * state.scale.clone()
            with torch.no_grad():
                state.amax_history.fill_(float(y.abs().max()))
                state.scale.fill_(1.0 / (1.0 + float(state.amax_history.max())))
            return y

    torch.manual_seed(0)
    model = torch.nn.Sequential(DelayedScaled())
    x = torch.randn(4, 8, requires_grad=True)
    dy = torch.randn(4, 8)
    step, fingerprint = step_and_fingerprint(model, x, dy, autocast=contextlib.nullcontext)
    a = fingerprint()
    for _ in range(3):
        step()
    assert torch.equal(torch.as_tensor(a), torch.as_tensor(fingerprint()))
    with torch.no_grad():
        model[0].weight.add_(1e-2)
    assert not torch.equal(torch.as_tensor(a), torch.as_tensor(fingerprint()))
    # without autocast (bf16) nothing is restored: the same model's fingerprint follows its scale
    _, plain = step_and_fingerprint(model, x, dy)
    b = plain()
    step()
    assert not torch.equal(torch.as_tensor(b), torch.as_tensor(plain()))


def _compiled_from(path, source: str, name: str):
    """``name`` from ``source`` written at ``path`` and imported from there (its code objects carry that path)."""
    import importlib.util

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"compiled_{abs(hash(str(path)))}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, name)


FUSION = """
import torch
def scale(y):
    return y * 3
@torch.compile(backend="eager")
def bias_swiglu(x, b):
    return torch.nn.functional.silu(x + b) * scale(x)
"""
MODEL = """
import torch
class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
    def forward(self, x):
        return self.fc(x).relu()
"""


def test_a_switch_keeps_megatrons_compiled_fusions_but_not_other_compiled_code(fake_te, tmp_path):
    """TE's destroy_ub() resets torch.compile (the fake does too); Megatron's elementwise fusions cannot hold a
    userbuffers constant, so their compiled code survives a switch; a compiled module could, so it is reset."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list as entries

    torch.compiler.reset()
    fused = _compiled_from(tmp_path / "megatron/core/fusions/fused_bias_swiglu.py", FUSION, "bias_swiglu")
    x = torch.randn(4, 4, requires_grad=True)
    fused(x, torch.randn(4)).sum().backward()
    code = fused._torchdynamo_orig_callable.__code__
    assert entries(code) and ub_runtime.compiled_beyond_fusions() == []

    sw = ub_runtime.UbSwitcher(fakes.fake_init_args(), find_overlap_modules(fakes.fake_model(layers=1)))
    sw.apply(TuningConfig(UbConfig()))
    sw.apply(TuningConfig(UbConfig().with_entry("fc2_fprop", GemmOverlapConfig(method="pipeline", num_sm=8))))
    assert fake_te.destroys == 1 and sw.compiled_kept == 1 and entries(code)  # kept: no recompilation
    assert torch.compiler.reset is not None and torch.compiler.reset.__module__ == "torch.compiler"  # restored

    block = torch.compile(_compiled_from(tmp_path / "user/model.py", MODEL, "Block")(), backend="eager")
    block(x).sum().backward()
    assert [f.rsplit("/", 1)[-1] for f in ub_runtime.compiled_beyond_fusions()] == ["model.py:forward"]
    sw.apply(TuningConfig(UbConfig()))
    assert fake_te.destroys == 2 and sw.compiled_kept == 1 and not entries(code)  # TE's reset ran
    torch.compiler.reset()


def test_a_failed_switch_cleans_up_without_resetting_megatrons_compiled_fusions(fake_te, tmp_path):
    """A switch whose initialize_ub raises destroys what it made; that destroy_ub (TE's resets torch.compile) keeps
    Megatron's fusions compiled as a switch's own does: on the old code it reset them, and in a process that had never
    imported torch._dynamo the reset imported it after tuning froze the heap (every later collection walked it)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list as entries

    from megatron_tp_overlap.engine import faults

    torch.compiler.reset()
    fused = _compiled_from(tmp_path / "megatron/core/fusions/fused_bias_swiglu.py", FUSION, "bias_swiglu")
    fused(torch.randn(4, 4, requires_grad=True), torch.randn(4)).sum().backward()
    code = fused._torchdynamo_orig_callable.__code__
    sw = ub_runtime.UbSwitcher(fakes.fake_init_args(), find_overlap_modules(fakes.fake_model(layers=1)))
    sw.apply(TuningConfig(UbConfig()))
    with pytest.raises(faults.InjectedFault), faults.inside_initialize_ub(True):
        sw.apply(TuningConfig(UbConfig().with_entry("fc2_fprop", GemmOverlapConfig(method="pipeline", num_sm=8))))
    assert fake_te.destroys == 2 and entries(code)  # the switch's destroy and the failed init's: neither reset it
    torch.compiler.reset()


def test_fusion_names_are_matched_exactly():
    f = ub_runtime._is_fusion
    assert f("/x/megatron/core/fusions/fused_bias_gelu.py", "bias_gelu")
    assert f("/x/megatron/core/transformer/torch_norm.py", "_norm")
    assert f("/x/megatron/core/transformer/torch_norm.py", "torch_dynamo_resume_in__norm_at_95")
    assert not f("/x/megatron/core/transformer/torch_norm.py", "forward")
    assert not f("/x/megatron/core/transformer/attention.py", "forward")
    assert not f("/x/mymegatron/core/fusions_extra/a.py", "g")


class _KeepsCommunicator(torch.autograd.Function):
    """As TE's linear Functions do: the autograd context holds the communicator the step ran with."""

    @staticmethod
    def forward(ctx, x, ub):
        ctx.ub_obj = ub
        ctx.save_for_backward(x)  # freed by its backward, as TE's are
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2, None


class _Dispatcher:  # not a module, as Megatron's MoE token dispatchers
    def __init__(self) -> None:
        self.probs = None


_KEPT_ELSEWHERE: dict = {}  # a module-level cache, as a library might keep


def test_a_refused_switch_names_the_holder_that_a_frozen_heap_set_aside(fake_te, thawed_heap):
    """The in-run verification freezes the heap (engine/heap.py), and the referrer walks skip frozen objects: a graph
    kept from before the freeze, whose backward has not run, holds the communicator. The refusal names its holder
    (it read 'held by: ?'), and the heap is frozen again after."""
    model = fakes.fake_model(layers=1)
    sw = ub_runtime.UbSwitcher(fakes.fake_init_args(), find_overlap_modules(model))
    sw.apply(TuningConfig(UbConfig()))
    x = torch.randn(4, requires_grad=True)
    pending = (_KeepsCommunicator.apply(x, fake_te._ub_communicators["qkv_fprop"]) + 0,)  # no backward
    gc.freeze()
    try:
        with pytest.raises(StaleCommunicatorError, match="held by: .*dict of _KeepsCommunicatorBackward"):
            sw.apply(TuningConfig(UbConfig().with_entry("fc2_fprop", GemmOverlapConfig(method="pipeline", num_sm=8))))
        assert gc.get_freeze_count() > 0 and fake_te.destroys == 0  # frozen again
    finally:
        gc.unfreeze()
    del pending


def test_a_spent_graph_that_outlives_its_step_lets_go_of_its_communicators(fake_te):
    """On 2 H100s a Megatron-LM MoE run refused every switch at TP=2 (StaleCommunicatorError, 'held by: dict of
    _LayerNormLinearBackward'): every qkv's context outlived the step, with a graph that neither module attributes
    nor any tensor on the heap reached. Wherever it is kept (here by the model's dispatcher, and in a tuple of a
    module-level dict), a context whose backward has run is never read again: the switch drops its communicator
    references and goes on; the kept tensors and their graphs are left to their holder."""
    model = fakes.fake_model(layers=1)
    model.token_dispatcher = _Dispatcher()
    sw = ub_runtime.UbSwitcher(fakes.fake_init_args(), find_overlap_modules(model))
    sw.apply(TuningConfig(UbConfig()))
    x = torch.randn(4, requires_grad=True)
    y = _KeepsCommunicator.apply(x, fake_te._ub_communicators["qkv_fprop"])
    model.token_dispatcher.probs = y.softmax(-1)  # kept until the next forward
    _KEPT_ELSEWHERE["probs"] = (y + 1,)  # no walk could replace in a tuple
    y.sum().backward()
    kept = model.token_dispatcher.probs.detach().clone()
    del y
    sw.apply(TuningConfig(UbConfig().with_entry("fc2_fprop", GemmOverlapConfig(method="ring_exchange"))))
    assert fake_te.destroys == 1
    assert sw.released == {"_KeepsCommunicatorBackward.ub_obj"}
    assert torch.equal(model.token_dispatcher.probs, kept) and model.token_dispatcher.probs.grad_fn is not None
    assert _KEPT_ELSEWHERE.pop("probs")[0].grad_fn is not None

    # a graph whose backward has not run keeps its communicators: the switch is refused and names the holder
    pending = (_KeepsCommunicator.apply(x, fake_te._ub_communicators["qkv_fprop"]) + 0,)  # no backward
    with pytest.raises(StaleCommunicatorError, match="dict of _KeepsCommunicatorBackward"):
        sw.apply(TuningConfig(UbConfig().with_entry("fc2_fprop", GemmOverlapConfig(method="pipeline", num_sm=8))))
    assert fake_te.destroys == 1
    del pending
    # nor when a tensor it saved was written in place since (reading it raises, but not autograd's "freed" error)
    saved = x * 1
    pending = (_KeepsCommunicator.apply(saved, fake_te._ub_communicators["qkv_fprop"]),)
    saved.add_(1)
    with pytest.raises(StaleCommunicatorError, match="dict of _KeepsCommunicatorBackward"):
        sw.apply(TuningConfig(UbConfig().with_entry("fc2_fprop", GemmOverlapConfig(method="pipeline", num_sm=8))))
    assert fake_te.destroys == 1
    del pending


def test_a_forward_whose_backward_has_not_run_refuses_the_switch(fake_te):
    """On 2 H200s with TE 2.20.2 a switch went on under a pending graph: its contexts hold no communicator (the
    backward fetches them by name), so the reference check saw nothing. The overlapped modules' forwards are
    recorded; the switch is refused until that backward has run, or the graph is dropped."""
    model = fakes.fake_model(layers=1)
    sw = ub_runtime.UbSwitcher(fakes.fake_init_args(), find_overlap_modules(model))
    sw.apply(TuningConfig(UbConfig()))
    x = torch.randn(4, 8, requires_grad=True)
    ring = TuningConfig(UbConfig().with_entry("fc2_fprop", GemmOverlapConfig(method="ring_exchange")))
    with torch.no_grad():
        model(x)  # no graph (a checkpoint's first forward, evaluation): nothing pending
    y = model(x)
    with pytest.raises(StaleCommunicatorError, match="backward has not run"):
        sw.apply(ring)
    assert fake_te.destroys == 0
    y.sum().backward()  # its graph stays alive (y), but its backward ran
    assert sw.apply(ring) and fake_te.destroys == 1
    z = model(x)
    del z  # dropped unrun
    assert sw.apply(TuningConfig(UbConfig())) and fake_te.destroys == 2
    # TE's unfused bias is added after its Function: the context is found a few ops below the output
    out = (_KeepsCommunicator.apply(x, None) + 1).view(-1)
    assert type(held_graphs._function_node(out.grad_fn)).__name__ == "_KeepsCommunicatorBackward"
    assert held_graphs._function_node((x * 2).grad_fn) is None
    sw.close()  # hooks gone: a later forward is no business of a closed switcher
    assert not any(m.module._forward_hooks for m in sw.modules)


def test_a_spent_context_alive_when_the_heap_was_frozen_lets_go_too(fake_te, thawed_heap):
    """The in-run verification freezes the heap at its first iteration (engine/heap.py), and the referrer walks skip
    frozen objects: a context kept alive from the iteration before would hold its communicator through every switch.
    The switch looks among the frozen objects too, when the rest left a reference."""
    model = fakes.fake_model(layers=1)
    sw = ub_runtime.UbSwitcher(fakes.fake_init_args(), find_overlap_modules(model))
    sw.apply(TuningConfig(UbConfig()))
    x = torch.randn(4, requires_grad=True)
    y = _KeepsCommunicator.apply(x, fake_te._ub_communicators["qkv_fprop"])
    _KEPT_ELSEWHERE["probs"] = (y.softmax(-1),)
    y.sum().backward()
    del y
    gc.freeze()
    try:
        sw.apply(TuningConfig(UbConfig().with_entry("fc2_fprop", GemmOverlapConfig(method="ring_exchange"))))
        assert gc.get_freeze_count() > 0  # frozen again
    finally:
        gc.unfreeze()
        _KEPT_ELSEWHERE.clear()
    assert fake_te.destroys == 1 and sw.released == {"_KeepsCommunicatorBackward.ub_obj"}
