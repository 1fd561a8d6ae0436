import pytest

from megatron_tp_overlap.errors import ConfigError
from megatron_tp_overlap.ub.config import parse_ub_cfgs
from megatron_tp_overlap.ub.presets import PRESETS
from megatron_tp_overlap.ub.rules import ValidationContext, allowed_methods, check, load_and_validate, validate_text

H100 = ValidationContext(fp8=False, sm_count=132, tp_size=4)
FP8 = ValidationContext(fp8=True, sm_count=132, tp_size=4)


def problems(raw, ctx=H100):
    with pytest.raises(ConfigError) as e:
        check(parse_ub_cfgs(raw), ctx)
    return e.value.problems


def ok(raw, ctx=H100):
    return check(parse_ub_cfgs(raw), ctx)


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_are_valid(name):
    check(PRESETS[name], FP8 if "_fp8_" in name else H100)


@pytest.mark.parametrize("gemm", ["qkv_fprop", "fc1_fprop", "proj_dgrad", "fc2_dgrad", "qkv_wgrad", "fc1_wgrad"])
def test_pipeline_only_for_reduce_scatter_gemms(gemm):
    ps = problems({gemm: {"method": "pipeline"}})
    assert any(p.key == f"{gemm}.method" and p.value == "pipeline" and "reduce-scatter" in p.rule for p in ps)


@pytest.mark.parametrize("gemm", ["proj_fprop", "fc2_fprop", "qkv_dgrad", "fc1_dgrad"])
def test_pipeline_allowed_for_reduce_scatter_gemms(gemm):
    ok({gemm: {"method": "pipeline", "num_sm": 16, "num_splits": 4}})


def test_allowed_methods_cover_every_gemm():
    from megatron_tp_overlap.ub.config import GEMM_NAMES

    assert all(allowed_methods(g) for g in GEMM_NAMES)


def test_atomic_gemm_needs_fp8():
    ps = problems({"fc2_fprop": {"method": "pipeline", "atomic_gemm": True}})
    assert any(p.key == "fc2_fprop.atomic_gemm" and "FP8" in p.rule for p in ps)
    ok({"fc2_fprop": {"method": "pipeline", "atomic_gemm": True}}, FP8)


def test_atomic_ring_exchange_needs_both_gemms_of_the_pair():
    ps = problems({"qkv_fprop": {"method": "ring_exchange", "atomic_gemm": True}}, FP8)
    assert any(p.key == "proj_fprop.atomic_gemm" and "pair" in p.rule for p in ps)
    ps = problems({"fc2_fprop": {"method": "ring_exchange", "atomic_gemm": True}}, FP8)
    assert any(p.key == "fc1_fprop.atomic_gemm" for p in ps)
    ok(
        {
            "qkv_fprop": {"method": "ring_exchange", "atomic_gemm": True},
            "proj_fprop": {"method": "ring_exchange", "atomic_gemm": True},
        },
        FP8,
    )


def test_atomic_gemm_not_for_bulk():
    ps = problems({"qkv_dgrad": {"method": "bulk", "atomic_gemm": True}}, FP8)
    assert any("bulk" in p.rule for p in ps)


def test_external_only_for_proj_and_fc2_wgrad():
    (p,) = problems({"proj_fprop": {"method": "external"}})
    assert "external" in p.rule and p.key == "proj_fprop.method"
    ps = problems({"proj_wgrad": {"method": "ring_exchange"}})
    assert any(p.key == "proj_wgrad.method" for p in ps)
    ok({"proj_wgrad": {"method": "external"}, "fc2_wgrad": {"method": "external"}})


def test_external_needs_ring_exchange_on_matching_dgrad():
    ps = problems({"proj_dgrad": {"method": "bulk"}, "proj_wgrad": {"method": "external"}})
    assert any(p.key == "proj_dgrad.method" and "external" in p.rule and "ring_exchange" in p.rule for p in ps)


@pytest.mark.parametrize("dgrad", ["qkv_dgrad", "fc1_dgrad"])
def test_non_bulk_dgrad_forbids_its_wgrad_entry(dgrad):
    wgrad = dgrad.replace("dgrad", "wgrad")
    (p,) = problems({dgrad: {"method": "ring_exchange"}, wgrad: {"method": "bulk", "num_sm": 4}})
    assert p.key == wgrad and dgrad in p.rule
    ok({dgrad: {"method": "ring_exchange"}})
    ok({dgrad: {"method": "bulk"}, wgrad: {"method": "bulk", "num_sm": 4}})


@pytest.mark.parametrize(
    "knob, value, rule",
    [
        ("num_sm", 0, ">= 1"),
        ("num_sm", 133, "SM count (132)"),
        ("cga_size", 0, "1..4"),
        ("cga_size", 5, "1..4"),
        ("num_splits", 0, ">= 1"),
    ],
)
def test_integer_ranges(knob, value, rule):
    (p,) = problems({"fc2_fprop": {"method": "pipeline", knob: value}})
    assert p.key == f"fc2_fprop.{knob}" and p.value == value and rule in p.rule


def test_num_sm_without_sm_count_is_bounded_by_any_gpus():
    ok({"fc2_fprop": {"method": "pipeline", "num_sm": 150}}, ValidationContext())  # a B200 has 148, a B300 160
    (p,) = problems({"fc2_fprop": {"method": "pipeline", "num_sm": 200}}, ValidationContext())
    assert p.key == "fc2_fprop.num_sm" and "the most SMs of any GPU" in p.rule


def test_is_reduce_scatter_must_match():
    (p,) = problems({"qkv_fprop": {"is_reduce_scatter": True}})
    assert p.key == "qkv_fprop.is_reduce_scatter"
    ok({"fc2_fprop": {"is_reduce_scatter": True}, "qkv_dgrad": {"method": "pipeline", "is_reduce_scatter": True}})


def test_every_problem_reported_together():
    ps = problems(
        {"qkv_fprop": {"method": "pipeline"}, "fc2_fprop": {"method": "pipeline", "num_sm": 0, "cga_size": 9}}
    )
    assert len(ps) == 3


def test_ignored_knobs_are_warnings_not_errors():
    notes = ok(
        {
            "qkv_fprop": {"method": "ring_exchange", "num_splits": 4},
            "fc2_fprop": {"method": "pipeline", "aggregate": True},
        }
    )
    assert any("qkv_fprop" in n and "num_splits" in n for n in notes)
    assert any("fc2_fprop" in n and "aggregate" in n for n in notes)


def test_semantic_errors_name_file_and_line(tmp_path):
    p = tmp_path / "tuned.yaml"
    p.write_text("# comment\nqkv_fprop:\n  method: pipeline\n")
    with pytest.raises(ConfigError) as e:
        load_and_validate(p, H100)
    assert f"{p}:3" in str(e.value) and "qkv_fprop.method = 'pipeline'" in str(e.value)


def test_validate_text_returns_config_and_notes():
    cfg, notes = validate_text("fc2_fprop: {method: pipeline, num_sm: 8}\n", H100)
    assert cfg.get("fc2_fprop").num_sm == 8 and notes == []
