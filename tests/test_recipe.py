"""The recipe of a tuned config (flags to add and drop, config fields) and the per-kind switches in the search."""

import fakes
import pytest
from test_tuner_cpu import make_tuner

from megatron_tp_overlap.engine.space import SpaceSpec
from megatron_tp_overlap.integrations.megatron.flags import KIND_SWITCHES, recipe, switch_sets
from megatron_tp_overlap.ub.config import GEMM_NAMES, UbConfig, parse_ub_cfgs

ALL = frozenset(GEMM_NAMES)


def test_a_yaml_only_config():
    r = recipe(UbConfig(), frozenset(), ALL, "t.yaml")
    assert r.add == ["--tp-comm-overlap", "--tp-comm-overlap-cfg", "t.yaml"] and r.drop == [] and r.problem is None
    assert r.fields == {"tp_comm_overlap": True, "tp_comm_overlap_cfg": "t.yaml"}


def test_no_overlap_drops_the_flags():
    r = recipe(UbConfig(), ALL, ALL, "t.yaml")
    assert r.add == [] and r.drop == ["--tp-comm-overlap", "--tp-comm-overlap-cfg"]
    assert r.fields == {"tp_comm_overlap": False} and r.line() == "and drop --tp-comm-overlap --tp-comm-overlap-cfg"


@pytest.mark.parametrize("name", list(KIND_SWITCHES))
def test_each_kind_switch_is_a_flag_and_a_field(name):
    k = KIND_SWITCHES[name]
    r = recipe(UbConfig(), k.gemms, ALL, "t.yaml")
    assert r.add[-1] == k.flag and r.fields[k.field] is False and r.problem is None
    assert k.flag.startswith("--no-") and k.flag[5:].replace("-", "_") == k.field  # Megatron's store_false naming


def test_a_single_gemm_off_has_no_flag_and_says_so():
    r = recipe(UbConfig(), frozenset({"qkv_wgrad"}), ALL, "t.yaml")
    assert "qkv_wgrad alone" in r.problem and not any(f.startswith("--no-") for f in r.add)


def test_rs_dgrad_mode_keeps_bulk_dgrad_out_and_adds_its_flag():
    assert "bulk dgrad" not in switch_sets(rs_dgrad=True) and "bulk dgrad" in switch_sets(rs_dgrad=False)
    rs = parse_ub_cfgs({g: {"method": "ring_exchange"} for g in ("qkv_dgrad", "fc1_dgrad")})
    r = recipe(rs, frozenset(), ALL, "t.yaml")
    assert "--tp-comm-overlap-rs-dgrad" in r.add and r.fields["tp_comm_overlap_rs_dgrad"] is True


def test_the_search_switches_a_whole_kind_off_where_every_option_of_it_loses_to_none(fake_te):
    """Every AG overlap option costs more than no overlap (a GEMM too small to hide its all-gather): the per-GEMM
    search cannot say "off" (no YAML key), the per-kind switch can (--no-tp-comm-overlap-ag)."""
    ag = KIND_SWITCHES["AG overlap"].gemms
    for g in ag:
        for method in ("ring_exchange", "pipeline", "bulk"):
            for sm in (None, 1, 2, 4, 8, 16, 24, 32):
                fakes.PENALTY_MS[(g, method, sm)] = 3.0
    try:
        tuner, _ = make_tuner(space_spec=SpaceSpec(include_off=False), switch_sets=switch_sets(rs_dgrad=False))
        res = tuner.tune()
    finally:
        fakes.PENALTY_MS.clear()
    assert res.search.best_name.endswith("AG overlap off"), res.search.reason
    assert ag & tuner.topology.active <= res.best.disabled and not (res.best.disabled - ag)
    assert fake_te.cfg == res.best.ub  # live, with the AG modules' flags off
    r = recipe(res.best.ub, res.best.disabled, frozenset(tuner.topology.active), "t.yaml")
    assert "--no-tp-comm-overlap-ag" in r.add and r.problem is None


def test_no_overlap_can_win_as_a_whole(fake_te):
    for g in GEMM_NAMES:
        for method in ("ring_exchange", "pipeline", "bulk"):
            for sm in (None, 1, 2, 4, 8, 16, 24, 32):
                fakes.PENALTY_MS[(g, method, sm)] = 3.0
    try:
        tuner, _ = make_tuner(space_spec=SpaceSpec(include_off=False))
        res = tuner.tune()
    finally:
        fakes.PENALTY_MS.clear()
    assert res.search.best_name == "no overlap" and res.best.disabled == tuner.topology.active
