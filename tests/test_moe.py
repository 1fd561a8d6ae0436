"""Mixture-of-experts models: shared experts tuned in slots of their own, routed experts named as not overlapping,
the overlap coverage line (MLA-like models too), every module buffer and the MoE metrics restored, the MoE layout in
the reuse key."""

from types import SimpleNamespace

import fakes
import pytest
import torch

from megatron_tp_overlap.engine.coverage import coverage
from megatron_tp_overlap.engine.search import SearchOptions
from megatron_tp_overlap.engine.topology import build_topology, find_overlap_modules
from megatron_tp_overlap.integrations.megatron import state
from megatron_tp_overlap.integrations.megatron.coverage import model_coverage
from megatron_tp_overlap.integrations.megatron.run_shape import RunShape
from megatron_tp_overlap.integrations.megatron.state import StateCheck, StateSnapshot


def test_shared_experts_are_slots_of_their_own_and_share_fc1_fc2_configs():
    """A shared expert runs the fc1/fc2 userbuffers configs (one per name) with only its AG/RS overlapped: its own
    slots hold just those GEMMs, and a fc1/fc2 option is scored over every slot it runs in."""
    topo = build_topology(find_overlap_modules(fakes.fake_moe_model(dense=1, moe=2)))
    slots = topo.slots()
    assert slots["shared_fc1.fwd"] == ("fc1_fprop",) and slots["shared_fc1.bwd"] == ()
    assert slots["shared_fc2.fwd"] == ("fc2_fprop",) and slots["shared_fc2.bwd"] == ("fc2_dgrad", "fc2_wgrad")
    assert slots["fc1.bwd"] == ("fc1_dgrad", "fc1_wgrad")  # the dense layer's
    assert topo.slots_of("fc1_fprop") == ("fc1.fwd", "shared_fc1.fwd") and topo.slots_of("qkv_fprop") == ("qkv.fwd",)
    groups = topo.slot_groups()
    assert groups["fc2.bwd+shared_fc2.bwd"] == ("fc2.bwd", "shared_fc2.bwd") and groups["qkv.fwd"] == ("qkv.fwd",)
    # MoE layers only: the shared expert is the only fc1/fc2
    only = build_topology(find_overlap_modules(fakes.fake_moe_model(dense=0, moe=2)))
    assert only.slots_of("fc1_fprop") == ("shared_fc1.fwd",) and "fc1.fwd" not in only.slots()


@pytest.mark.parametrize("strategy", ["coordinate", "slot_exhaustive"])
def test_the_tuner_tunes_attention_dense_layers_and_shared_experts_of_an_moe_model(fake_te, strategy):
    """On the fakes' known costs the search takes the optimum of every GEMM, the shared experts' slots timed."""
    from megatron_tp_overlap.engine.space import TuningConfig, apply, build_space
    from megatron_tp_overlap.engine.tuner import Autotuner
    from megatron_tp_overlap.ub.config import UbConfig

    model, x = fakes.fake_moe_model(dense=1, moe=1, scale=3.0), torch.randn(4, 8, requires_grad=True)
    tuner = Autotuner(
        model,
        lambda: model(x).sum().backward(),
        fakes.fake_init_args(),
        event_factory=fakes.SimEvent,
        timing_device="cpu",
        clock=fakes.CLOCK.seconds,
        sleep=fakes.CLOCK.sleep,
        log=lambda *a: None,
        options=SearchOptions(strategy=strategy, max_seconds=25, max_steps=5000),
    )
    res = tuner.tune()
    assert {"shared_fc1.fwd", "shared_fc2.fwd", "shared_fc2.bwd"} <= set(res.report["topology"]["slots"])
    trial = next(t for t in res.search.trials if t.phase == "baseline")
    assert trial.slot_ms["shared_fc1.fwd"] > 0 and trial.slot_ms["shared_fc2.bwd"] > 0
    space = build_space(tuner.topology, tuner.ctx, [UbConfig()])
    for g in ("fc1_fprop", "fc2_fprop", "qkv_fprop"):
        best = min(fakes.gemm_cost_ms(g, apply(TuningConfig(), o, tuner.topology).ub, o.enabled) for o in space[g])
        assert fakes.gemm_cost_ms(g, res.best.ub, g not in res.best.disabled) == pytest.approx(best), g


def test_the_coverage_line_names_routed_experts_and_shared_experts():
    cov = coverage(fakes.fake_moe_model(dense=1, moe=2))
    assert cov.overlapped == {"qkv": 3, "proj": 3, "fc1": 1, "fc2": 1, "shared_fc1": 2, "shared_fc2": 2}
    assert cov.gemms["shared_fc1"] == ["fc1_fprop"] and cov.gemms["fc1"] == ["fc1_fprop", "fc1_dgrad", "fc1_wgrad"]
    n, why = cov.not_overlapped["routed-expert GEMMs"]
    assert n == 2 and "GroupedLinear" in why and "token dispatcher" in why
    line = cov.line()
    assert "shared_fc1 2 (fprop)" in line and "routed-expert GEMMs 2" in line
    assert cov.to_dict()["overlapped_modules"]["shared_fc2"] == 2


class MLAAttention(torch.nn.Module):
    """MLA's projections (names megatron-core gives them), TE linears that TP shards but without userbuffers."""

    def __init__(self, hidden: int, overlap_proj: bool):
        super().__init__()
        self.linear_q_down_proj = fakes.ColumnLinear(hidden, "q_down_proj")
        self.linear_kv_down_proj = fakes.ColumnLinear(hidden, "kv_down_proj")
        for m in (self.linear_q_down_proj, self.linear_kv_down_proj):
            m.ub_name, m.tp_size = None, 2
        self.linear_proj = fakes.Linear(hidden, "proj")
        self.linear_proj.tp_size = 2
        if not overlap_proj:  # built after megatron-core switched tp_comm_overlap off on the shared config
            self.linear_proj.ub_name = None
            self.linear_proj.ub_overlap_rs_fprop = self.linear_proj.ub_overlap_ag_dgrad = False

    def forward(self, x):
        return self.linear_proj(self.linear_q_down_proj(x) + self.linear_kv_down_proj(x))


def test_the_coverage_line_of_an_mla_model_says_how_little_megatron_left_overlapped():
    """megatron-core turns tp_comm_overlap off on the shared config at the first userbuffers name TE does not know:
    in an MLA model only the first layer's proj overlaps. The line says so."""
    layers = torch.nn.ModuleList([MLAAttention(8, overlap_proj=True)] + [MLAAttention(8, False) for _ in range(3)])
    model = torch.nn.Module()
    model.decoder, model.config = layers, SimpleNamespace(tp_comm_overlap=False, moe_shared_expert_overlap=False)
    cov = model_coverage([model], asked_overlap=True)
    assert cov.overlapped == {"proj": 1}
    assert cov.not_overlapped["proj"] == (3, "built without userbuffers")
    assert cov.not_overlapped["linear_q_down_proj"][0] == 4 and cov.not_overlapped["linear_kv_down_proj"][0] == 4
    assert "switched TP overlap off while building the model" in cov.line()
    model.config.tp_comm_overlap = True  # a dense model: nothing to say
    assert not model_coverage([model]).notes


def _trial(model):
    model(torch.randn(4, 8)).sum().backward()
    model.zero_grad(set_to_none=True)


def test_trial_steps_leave_every_module_buffer_as_it_was():
    """A router counts tokens per expert in every forward and moves its expert bias: the snapshot puts every buffer
    back (after each trial step and at the end) and the state check sees a buffer that moved."""
    torch.manual_seed(0)
    model = fakes.fake_moe_model(dense=0, moe=2)
    model.buffers = [torch.zeros(3)]  # megatron-core's DDP wrapper keeps its gradient buffers under this name
    before = {n: b.clone() for n, b in model.named_buffers()}
    snap = StateSnapshot.take([model], tracker=None)
    check = StateCheck([model], None, tracker=None)  # no optimizer state to compare here
    _trial(model)
    assert any(not torch.equal(before[n], b) for n, b in model.named_buffers())  # the trial moved them
    assert any(k.startswith("buffer 0.") and "expert_bias" in k for k in check.mismatches())
    snap.restore_buffers()
    assert all(torch.equal(before[n], b) for n, b in model.named_buffers())
    _trial(model)
    snap.restore()
    assert check.mismatches() == [] and check.kinds_checked()["buffer"] == 4


class FakeMetricsTracker:
    """megatron-core's MoEMetricsTracker: ``metrics`` maps a name to an entry with per-layer ``values``."""

    def __init__(self):
        self.metrics = {}

    def record(self, name, value, layer):
        self.metrics.setdefault(name, SimpleNamespace(values=torch.zeros(2))).values[layer] += value


def test_moe_metrics_recorded_by_trial_steps_are_taken_back(monkeypatch):
    """Router aux losses recorded in trial forwards would be reported in the run's first iteration: restored to what
    they were, and entries that trials created dropped (the first iteration creates them again)."""
    tracker = FakeMetricsTracker()
    monkeypatch.setattr(state, "moe_metrics_tracker", lambda: tracker)
    tracker.record("load_balancing_loss", 0.5, 0)
    snap = StateSnapshot.take([], tracker=None)
    check = StateCheck([], None, tracker=None)
    tracker.record("load_balancing_loss", 0.25, 1)
    tracker.record("z_loss", 1.0, 0)
    assert set(check.mismatches()) == {"moe-metric load_balancing_loss", "moe-metric z_loss"}
    snap.restore()
    assert list(tracker.metrics) == ["load_balancing_loss"]
    assert tracker.metrics["load_balancing_loss"].values.tolist() == [0.5, 0.0] and check.mismatches() == []


def _args(**kw):
    from test_megatron_integration import ns  # the TP=2 GPT arguments the integration tests use

    return ns(**kw)


def test_an_moe_run_tunes_and_its_layout_keys_the_cache():
    moe = dict(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=1792, moe_shared_expert_intermediate_size=3584)
    run = RunShape.from_args(_args(**moe))
    assert run.problems() == []  # no refusal of MoE left: what cannot overlap is named by the coverage line
    key = run.key("H100", "2.20", "ref", "space")
    assert key.moe == "experts=8,topk=2,ffn=1792,shared=3584,shared_overlap=False"
    dense = RunShape.from_args(_args()).key("H100", "2.20", "ref", "space")
    assert dense.moe == "" and dense.digest() != key.digest()
    other = RunShape.from_args(_args(**{**moe, "moe_shared_expert_intermediate_size": 7168}))
    assert other.key("H100", "2.20", "ref", "space").digest() != key.digest()


def test_the_state_study_names_the_first_iteration_that_differs():
    """benchmarks/studies/trials_leave_state.py compares the runs' losses and MoE metrics bitwise, with a control."""
    from benchmark_module import load_benchmark

    study = load_benchmark("trials_leave_state")
    rows = [{"iteration": i, "lm loss": repr(1.0 / i), "moe": {"z": ["0.5"]}} for i in range(1, 21)]
    moved = [dict(r, moe={"z": ["0.25"]}) if r["iteration"] == 1 else r for r in rows]
    runs = {"no trials": {"iterations": rows}, "no trials again": {"iterations": list(rows)}}
    same = study.compare({**runs, "trials": {"iterations": rows, "state_check_mismatches": []}}, 20)
    assert same["trials vs no trials"] is None and same["control (no trials twice)"] is None
    assert study.compare({**runs, "trials": {"iterations": moved}}, 20)["trials vs no trials"] == 1
    assert study.compare({**runs, "trials": {"iterations": rows[:5]}}, 20)["trials vs no trials"] == -1


def test_the_coverage_line_names_the_no_grad_forward_of_activation_recompute():
    """Under full recompute the first forward runs under no_grad, where TE's LayerNormLinear does not overlap its
    all-gather (TE issue 2902): the line says which forwards run once without overlap."""
    from megatron_tp_overlap.integrations.megatron.recompute import Recompute

    model = fakes.fake_moe_model(dense=1, moe=1)
    line = model_coverage([model], recompute=Recompute("full", "uniform", 1)).line()
    assert "fc1_fprop, qkv_fprop: not overlapped in the no_grad first forward" in line
    assert "no_grad" not in model_coverage([model], recompute=Recompute()).line()


class GeneratorTracker:
    """Like TE's CudaRNGStatesTracker under --te-rng-tracker (what CUDA graphs need): states are torch.Generator
    objects that RNG use advances in place."""

    def __init__(self):
        g = torch.Generator()
        g.manual_seed(7)
        self.states_ = {"model-parallel-rng": g}

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self.states_ = states

    def fork(self):
        torch.rand(3, generator=self.states_["model-parallel-rng"])


def test_an_rng_tracker_of_generators_is_checked_and_restored():
    """TE's RNG tracker keeps Generator objects: the state check compares their states (it raised a TypeError on an
    H100 under --cuda-graph-impl local) and the snapshot restores them."""
    tracker = GeneratorTracker()
    snap = StateSnapshot.take([], tracker=tracker)
    check = StateCheck([], None, tracker=tracker)
    first = torch.rand(3, generator=tracker.states_["model-parallel-rng"]).tolist()
    tracker.fork()
    assert check.mismatches() == ["TP RNG tracker 'model-parallel-rng'"]
    snap.restore()
    assert check.mismatches() == []
    assert torch.rand(3, generator=tracker.states_["model-parallel-rng"]).tolist() == first


def test_a_bridge_moe_provider_is_tuned_with_the_same_key_as_the_flags():
    """Megatron-Bridge's MoE providers are TransformerConfigs with the same field names as Megatron-LM's flags."""
    moe = dict(moe_router_topk=2, moe_ffn_hidden_size=1792, moe_shared_expert_intermediate_size=3584)
    a = _args(num_experts=8, **moe)
    m = SimpleNamespace(
        **{k: v for k, v in vars(a).items() if k not in ("num_experts", "swiglu", "micro_batch_size")},
        num_moe_experts=8,
        gated_linear_unit=True,
    )
    bridge = RunShape.from_transformer_config(m, micro_batch_size=1)
    assert bridge.problems() == [] and bridge.moe == RunShape.from_args(a).moe
