"""The recipe of a tuned config (flags to add and drop, config fields) and the per-kind switches in the search."""

import fakes
import pytest
from test_tuner_cpu import make_tuner

from megatron_tp_overlap.engine.space import SpaceSpec
from megatron_tp_overlap.integrations.megatron.flags import KIND_SWITCHES, recipe, switch_sets
from megatron_tp_overlap.ub.config import GEMM_NAMES, UbConfig, parse_ub_cfgs

ALL = frozenset(GEMM_NAMES)


def test_a_yaml_only_config():
    r = recipe(UbConfig(), frozenset(), ALL, "t.yaml", tp=2)
    assert r.add == ["--tp-comm-overlap", "--tp-comm-overlap-cfg", "t.yaml"] and r.drop == [] and r.problem is None
    assert r.fields == {"tp_comm_overlap": True, "tp_comm_overlap_cfg": "t.yaml"}


def test_no_overlap_drops_the_flags():
    r = recipe(UbConfig(), ALL, ALL, "t.yaml", tp=2)
    assert r.add == [] and r.drop == ["--tp-comm-overlap", "--tp-comm-overlap-cfg"]
    assert r.fields == {"tp_comm_overlap": False} and r.line() == "and drop --tp-comm-overlap --tp-comm-overlap-cfg"


@pytest.mark.parametrize("name", list(KIND_SWITCHES))
def test_each_kind_switch_is_a_flag_and_a_field(name):
    k = KIND_SWITCHES[name]
    r = recipe(UbConfig(), k.gemms, ALL, "t.yaml", tp=2)
    assert r.add[-1] == k.flag and r.fields[k.field] is False and r.problem is None
    assert k.flag.startswith("--no-") and k.flag[5:].replace("-", "_") == k.field  # Megatron's store_false naming


def test_a_single_gemm_off_has_no_flag_and_says_so():
    r = recipe(UbConfig(), frozenset({"qkv_wgrad"}), ALL, "t.yaml", tp=2)
    assert "qkv_wgrad alone" in r.problem and not any(f.startswith("--no-") for f in r.add)


def test_rs_dgrad_mode_keeps_bulk_dgrad_out_and_adds_its_flag():
    assert "bulk dgrad" not in switch_sets(rs_dgrad=True) and "bulk dgrad" in switch_sets(rs_dgrad=False)
    rs = parse_ub_cfgs({g: {"method": "ring_exchange"} for g in ("qkv_dgrad", "fc1_dgrad")})
    r = recipe(rs, frozenset(), ALL, "t.yaml", tp=2)
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
    r = recipe(res.best.ub, res.best.disabled, frozenset(tuner.topology.active), "t.yaml", tp=2)
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


def test_nemo_recipe_is_callback_arguments_that_load_the_yaml_and_model_fields(tmp_path):
    """NeMo's callback takes the config as a dataclass and sets tp_comm_overlap(_cfg) on the model config itself:
    the recipe's callback source, evaluated, gives the dataclass of the YAML; the kind switches are model fields."""
    from megatron_tp_overlap.ub.config import dumps_yaml
    from megatron_tp_overlap.ub.layer_cfg import from_layer_cfg, load_layer_cfg

    ub = parse_ub_cfgs({"fc2_fprop": {"method": "ring_exchange", "num_sm": 2}, "qkv_dgrad": {"method": "bulk"}})
    path = tmp_path / "t.yaml"
    path.write_text(dumps_yaml(ub))
    k = KIND_SWITCHES["bulk wgrad"]
    r = recipe(ub, k.gemms, ALL, path, tp=2)
    kwargs = {name: eval(src, {"load_layer_cfg": load_layer_cfg}) for name, src in r.nemo_callback().items()}
    assert kwargs["tp_comm_overlap"] is True
    back = from_layer_cfg(kwargs["tp_comm_overlap_cfg"])
    assert back.get("fc2_fprop").method == "ring_exchange" and back.get("fc2_fprop").num_sm == 2
    assert back.get("qkv_dgrad").method == "bulk"
    assert r.nemo_model_fields() == {k.field: False} and r.nemo_problem is None
    assert r.to_dict()["nemo"]["line"] == r.nemo_line() and k.field in r.nemo_line()

    off = recipe(ub, ALL, ALL, path, tp=2)  # no overlap at all: the callback's own switch
    assert off.nemo_callback() == {"tp_comm_overlap": "False"} and off.nemo_model_fields() == {}


def test_nemo_recipe_says_when_its_dataclass_cannot_hold_the_config():
    ub = parse_ub_cfgs({"proj_wgrad": {"method": "bulk"}})  # no field for it in TransformerLayerTPOverlapCfg
    r = recipe(ub, frozenset(), ALL, "t.yaml", tp=2)
    assert "proj_wgrad" in r.nemo_problem and r.to_dict()["nemo"]["problem"] == r.nemo_problem
    assert recipe(UbConfig(), frozenset(), ALL, "t.yaml", tp=2).nemo_problem is None


def test_the_recipe_follows_the_flags_the_run_was_built_with_not_the_live_ones(fake_te, tmp_path, monkeypatch):
    """A live config with a kind switched off clears that kind's module flags: a recipe read from the live modules
    left out the flag (2 H200s: "bulk dgrad off" won, and the recipe's fresh run overlapped qkv/fc1 dgrad again).
    tune() reads what the run overlaps once, as built, and every recipe (also the in-run verification's) uses it."""
    from types import SimpleNamespace

    import torch
    from test_cache import KEY

    from megatron_tp_overlap.engine import paired
    from megatron_tp_overlap.engine.options import TuneOptions
    from megatron_tp_overlap.engine.space import TuningConfig
    from megatron_tp_overlap.engine.switcher import UbSwitcher
    from megatron_tp_overlap.engine.topology import find_overlap_modules
    from megatron_tp_overlap.engine.verify import Verdict
    from megatron_tp_overlap.integrations.megatron import tuning as mt

    model = fakes.fake_model(layers=1)
    built = mt._active(model)
    off = KIND_SWITCHES["bulk dgrad"].gemms & built
    assert off
    switcher = UbSwitcher(fakes.fake_init_args(), find_overlap_modules(model))
    won = TuningConfig(UbConfig(), off, "autotuned, bulk dgrad off")
    switcher.apply(won)
    live = {(m.path, k): getattr(m.module, k) for m in switcher.modules for k in m.built_flags}
    assert live != {(m.path, k): v for m in switcher.modules for k, v in m.built_flags.items()}  # flags cleared
    assert mt._active(model) == built  # a later discovery still reads the flags the run was built with

    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 0)
    ref = TuningConfig(UbConfig(), frozenset(), "reference")
    out = tmp_path / "tuned.yaml"
    tuned = mt.Tuned(ref, None, out, mt._recipe(ref, built, out, 2), active=built)
    assert mt._write_yaml(out, ref, mt._key_meta(KEY), print)
    cache = SimpleNamespace(put=lambda *a: None)
    v = mt._verification(tuned, ref.ub, switcher, TuneOptions(verify_iters=96), KEY, cache, print, None, won)
    v.on_verdict(Verdict(won, paired.Interval(2.0, 1.0, 3.0, 12, 0.99), 200.0, 198.0, 120, "kept", reverted=False))
    assert "--no-tp-comm-bulk-dgrad" in tuned.recipe.add and tuned.recipe.fields["tp_comm_bulk_dgrad"] is False
    assert "--no-tp-comm-bulk-dgrad" in mt.recipe_path(out).read_text()
