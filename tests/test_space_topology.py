import fakes
import pytest
import torch

from megatron_tp_overlap.engine.space import (
    Option,
    SpaceSpec,
    TuningConfig,
    all_off,
    apply,
    build_space,
    effective_key,
    is_valid,
)
from megatron_tp_overlap.engine.topology import build_topology, find_overlap_modules, te_kind
from megatron_tp_overlap.ub.config import GemmOverlapConfig, UbConfig
from megatron_tp_overlap.ub.rules import ValidationContext

CTX = ValidationContext(sm_count=132, tp_size=2)


class LayerNormMLP(torch.nn.Module):  # a fused fc1+fc2 module, like te.LayerNormMLP
    def __init__(self):
        super().__init__()
        self.ub_overlap_ag = self.ub_overlap_rs = self.ub_bulk_dgrad = self.ub_bulk_wgrad = True
        self.ub_overlap_rs_dgrad = False


def topo():
    return build_topology(find_overlap_modules(fakes.fake_model(layers=3)))


def test_discovery_and_slots():
    mods = find_overlap_modules(fakes.fake_model(layers=3))
    assert len(mods) == 12 and {m.kind for m in mods} == {"column", "row"}
    t = build_topology(mods)
    assert t.layers == 3 and not t.fused_mlp
    assert t.slots()["qkv.bwd"] == ("qkv_dgrad", "qkv_wgrad")
    assert t.slots()["proj.fwd"] == ("proj_fprop",)
    assert t.coupled("proj_dgrad") == {"proj_dgrad", "proj_wgrad"}
    assert not t.tunable("proj_wgrad") and t.tunable("proj_dgrad")


def test_fused_mlp_couples_fc1_fprop_with_fc2_dgrad():
    m = torch.nn.ModuleDict({"qkv": fakes.LayerNormLinear(8, "qkv"), "mlp": LayerNormMLP()})
    mods = find_overlap_modules(m)
    assert te_kind(m["mlp"]) == "mlp"
    t = build_topology(mods)
    assert t.fused_mlp and t.slots()["mlp.fwd"] == ("fc1_fprop", "fc2_fprop")
    assert t.coupled("fc1_fprop") == {"fc1_fprop", "fc2_dgrad", "fc2_wgrad"}
    mlp = next(x for x in mods if x.kind == "mlp")
    flags = mlp.flags_for(UbConfig(), mlp.active_gemms() - {"fc2_fprop"})
    assert flags == {
        "ub_overlap_ag": True,
        "ub_overlap_rs": False,
        "ub_overlap_rs_dgrad": False,
        "ub_bulk_dgrad": True,
        "ub_bulk_wgrad": True,
    }


def test_flags_follow_dgrad_mode():
    (qkv,) = [m for m in find_overlap_modules(fakes.fake_model(layers=1)) if m.name == "qkv"]
    rs = UbConfig().with_entry("qkv_dgrad", GemmOverlapConfig(method="ring_exchange"))
    assert qkv.flags_for(rs, qkv.active_gemms()) == {
        "ub_overlap_ag_fprop": True,
        "ub_overlap_rs_dgrad": True,
        "ub_bulk_dgrad": False,
        "ub_bulk_wgrad": False,
    }
    assert qkv.flags_for(UbConfig(), set())["ub_bulk_dgrad"] is False


def test_modules_without_overlap_are_ignored():
    lin = fakes.Linear(8, "proj")
    lin.ub_overlap_rs_fprop = lin.ub_overlap_ag_dgrad = False
    assert find_overlap_modules(torch.nn.Sequential(lin)) == []
    assert te_kind(torch.nn.Linear(2, 2)) is None


def test_space_is_valid_deduplicated_and_has_off():
    t = topo()
    space = build_space(t, CTX, [UbConfig()])
    assert set(space) == {g for g in t.active if t.tunable(g)}
    for gemm, opts in space.items():
        keys = [effective_key(o, CTX) for o in opts]
        assert len(keys) == len(set(keys)), gemm
        assert any(not o.enabled for o in opts)
        assert all(is_valid(apply(TuningConfig(), o, t), CTX) for o in opts)
    # TE default (no entry) and an explicit ring_exchange without aggregate are the same option.
    ring = [o for o in space["qkv_fprop"] if o.enabled]
    assert len(ring) == 5  # TE default, aggregate, margin, and the two SM-copy (use_ce=False) variants
    assert "proj_wgrad" not in space


def test_space_respects_sm_count_and_spec():
    t = topo()
    small = build_space(t, ValidationContext(sm_count=8, tp_size=2), [], SpaceSpec(include_off=False))
    assert all((o.cfg.num_sm or 0) <= 8 for opts in small.values() for o in opts if o.cfg)
    assert all(o.enabled for opts in small.values() for o in opts)


def test_presets_seed_the_space():
    t = topo()
    prior = UbConfig().with_entry(
        "fc2_fprop", GemmOverlapConfig(method="pipeline", num_sm=20, num_splits=3, cga_size=2, set_sm_margin=True)
    )
    space = build_space(t, CTX, [prior])
    assert space["fc2_fprop"][0].cfg.num_sm == 20


def test_apply_rs_dgrad_drops_wgrad_entry_and_off_is_coupled():
    t = topo()
    c = apply(
        TuningConfig(UbConfig().with_entry("qkv_wgrad", GemmOverlapConfig(method="bulk", num_sm=4))),
        Option("qkv_dgrad", GemmOverlapConfig(method="ring_exchange")),
        t,
    )
    assert "qkv_wgrad" not in c.ub and is_valid(c, CTX)
    off = apply(TuningConfig(), Option("proj_dgrad", enabled=False), t)
    assert off.disabled == {"proj_dgrad", "proj_wgrad"}
    back = apply(off, Option("proj_dgrad", None), t)
    assert back.disabled == frozenset()
    assert all_off(t, TuningConfig()).disabled == t.active


def test_dgrad_mode_can_be_fixed_by_the_run_flags():
    from megatron_tp_overlap.ub.presets import PRESETS

    t = topo()
    priors = [UbConfig(), *PRESETS.values()]  # some presets put qkv/fc1 dgrad on a reduce-scatter
    mixed = build_space(t, CTX, priors)
    rs = lambda o: o.enabled and apply(TuningConfig(), o, t).ub.dgrad_is_reduce_scatter(o.gemm)  # noqa: E731
    assert any(rs(o) for o in mixed["qkv_dgrad"]) and any(o.enabled and not rs(o) for o in mixed["qkv_dgrad"])
    bulk_only = build_space(t, CTX, priors, SpaceSpec(include_rs_dgrad=False))
    rs_only = build_space(t, CTX, priors, SpaceSpec(include_bulk_dgrad=False))
    for g in ("qkv_dgrad", "fc1_dgrad"):
        assert bulk_only[g] and not any(rs(o) for o in bulk_only[g])
        assert rs_only[g] and all(rs(o) for o in rs_only[g] if o.enabled)


def test_dgrad_mode_option_names_the_spaces_megatron_can_run():
    from megatron_tp_overlap.engine.space import DGRAD_MODES, space_spec_for_dgrad_mode

    assert space_spec_for_dgrad_mode("any") == SpaceSpec()
    bulk, rs = space_spec_for_dgrad_mode("bulk"), space_spec_for_dgrad_mode("reduce-scatter")
    assert (bulk.include_rs_dgrad, bulk.include_bulk_dgrad) == (False, True)
    assert (rs.include_rs_dgrad, rs.include_bulk_dgrad) == (True, False)
    with pytest.raises(ValueError, match="dgrad mode must be one of any, bulk, reduce-scatter"):
        space_spec_for_dgrad_mode("rs")
    assert set(DGRAD_MODES) == {"any", "bulk", "reduce-scatter"}


def test_the_space_tries_the_te_knobs_the_yaml_carries():
    from megatron_tp_overlap.engine.space import SpaceSpec, build_space
    from megatron_tp_overlap.engine.topology import build_topology, find_overlap_modules
    from megatron_tp_overlap.ub.rules import ValidationContext

    topo = build_topology(find_overlap_modules(fakes.fake_model(1)))
    for fp8 in (False, True):
        space = build_space(topo, ValidationContext(sm_count=132, tp_size=2, fp8=fp8), [UbConfig()])
        labels = {g: [o.label for o in opts] for g, opts in space.items()}
        assert any("no_ce" in x for x in labels["qkv_fprop"])
        assert any("pipeline_rs_overlap_first_gemm" in x for x in labels["proj_fprop"])
        assert not any("fp8_buf" in x for x in labels["fc2_fprop"])  # left out, with why (LEFT_OUT)
        off = build_space(
            topo, ValidationContext(sm_count=132, tp_size=2, fp8=fp8), [UbConfig()], SpaceSpec(include_knobs=False)
        )
        assert sum(map(len, off.values())) < sum(map(len, space.values()))
