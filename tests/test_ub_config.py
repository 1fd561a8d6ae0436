import pytest
import yaml

from megatron_tp_overlap.errors import ConfigError
from megatron_tp_overlap.ub.config import (
    GEMM_NAMES,
    GemmOverlapConfig,
    UbConfig,
    dumps_yaml,
    load_yaml,
    loads_yaml,
    parse_ub_cfgs,
    te_default,
)
from megatron_tp_overlap.ub.presets import NEMO_PRESETS, PRESETS, closest_preset, get_preset


def test_twelve_gemm_names():
    assert len(GEMM_NAMES) == 12 and len(set(GEMM_NAMES)) == 12
    assert {"qkv_fprop", "fc1_wgrad", "proj_wgrad", "fc2_dgrad"} <= set(GEMM_NAMES)


@pytest.mark.parametrize("name", list(PRESETS))
def test_yaml_round_trip_of_every_preset(name, tmp_path):
    cfg = PRESETS[name]
    text = dumps_yaml(cfg, header=f"preset {name}\nsecond line")
    # What Megatron does with --tp-comm-overlap-cfg: yaml.safe_load, handed to initialize_ub as is.
    megatron_view = yaml.safe_load(text) or {}
    assert megatron_view == cfg.to_dict()
    assert all(isinstance(v, dict) for v in megatron_view.values())
    p = tmp_path / "cfg.yaml"
    p.write_text(text)
    assert load_yaml(p) == cfg


def test_nemo_presets_are_all_there():
    assert len(NEMO_PRESETS) == 19
    p = get_preset("userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192")
    assert p.get("qkv_dgrad") == GemmOverlapConfig(method="bulk", num_sm=4, cga_size=2, set_sm_margin=False)
    assert p.get("proj_fprop").num_sm == 24 and p.get("proj_fprop").method == "pipeline"
    # NeMo's PipelineOverlapCfg.fp8_buf default (False,) is truthy: what TE sees is True.
    assert p.get("fc2_fprop").fp8_buf is True
    lora = get_preset("userbuffers_fp8_h100_h8192_tp2_mbs1_seqlen4096_lora")
    assert "fc1_wgrad" not in lora and lora.get("fc1_dgrad").method == "pipeline"


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ConfigError) as e:
        get_preset("userbuffers_bf16_h100_nope")
    assert "userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192" in str(e.value)


def test_closest_preset():
    assert closest_preset(8192, 4, fp8=False) == "userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192"
    assert closest_preset(6144, 2, fp8=True) == "userbuffers_fp8_h100_h6144_tp2_mbs2_seqlen2048"


def test_te_defaults_match_initialize_ub():
    ring = te_default("qkv_fprop", 4)
    assert (ring.method, ring.num_sm, ring.cga_size, ring.num_splits, ring.set_sm_margin) == (
        "ring_exchange",
        1,
        1,
        4,
        False,
    )
    pipe = te_default("fc2_fprop", 4)
    assert (pipe.method, pipe.num_sm, pipe.cga_size, pipe.num_splits, pipe.set_sm_margin) == (
        "pipeline",
        16,
        2,
        4,
        True,
    )
    assert te_default("qkv_wgrad", 2).method == "bulk" and te_default("fc2_wgrad", 2).method == "external"
    assert UbConfig().method("fc1_dgrad") == "bulk"


def test_only_set_keys_are_dumped_and_ints_coerce_to_bool():
    cfg = loads_yaml("fc1_fprop: {method: ring_exchange, aggregate: 1}\n")
    assert cfg.get("fc1_fprop") == GemmOverlapConfig(method="ring_exchange", aggregate=True)
    assert cfg.to_dict() == {"fc1_fprop": {"method": "ring_exchange", "aggregate": True}}
    assert loads_yaml("") == UbConfig() and loads_yaml("{}") == UbConfig()


def test_with_entry_and_ordering():
    cfg = (
        UbConfig()
        .with_entry("fc2_fprop", GemmOverlapConfig(method="pipeline"))
        .with_entry("qkv_fprop", GemmOverlapConfig())
    )
    assert list(cfg) == ["qkv_fprop", "fc2_fprop"]
    assert "fc2_fprop" not in cfg.with_entry("fc2_fprop", None)
    assert hash(cfg) == hash(UbConfig.of(dict(cfg.items())))


@pytest.mark.parametrize(
    "text, key, rule",
    [
        ("qkv_fprp: {method: ring_exchange}\n", "qkv_fprp", "unknown GEMM name"),
        ("qkv_fprop: {method: ring_exchange, num_sms: 4}\n", "qkv_fprop.num_sms", "unknown key"),
        ("qkv_fprop: {method: ring}\n", "qkv_fprop.method", "method must be one of"),
        ("fc2_fprop: {method: pipeline, num_sm: '8'}\n", "fc2_fprop.num_sm", "must be an integer"),
        ("fc2_fprop: {method: pipeline, num_sm: 8.5}\n", "fc2_fprop.num_sm", "must be an integer"),
        (
            "fc2_fprop: {method: pipeline, set_sm_margin: 'yes please'}\n",
            "fc2_fprop.set_sm_margin",
            "must be a boolean",
        ),
        ("fc2_fprop: {method: pipeline, aggregate: 2}\n", "fc2_fprop.aggregate", "must be a boolean"),
        ("fc2_fprop: {method: pipeline, fp8_buf: [false]}\n", "fc2_fprop.fp8_buf", "truthy"),
        ("fc2_fprop: pipeline\n", "fc2_fprop", "must be a mapping"),
        ("fc2_fprop:\n", "fc2_fprop", "must be a mapping"),
        ("- fc2_fprop\n", "<top level>", "must be a mapping"),
        ("fc2_fprop: {num_sm: true}\n", "fc2_fprop.num_sm", "must be an integer"),
    ],
)
def test_structural_errors_name_key_value_rule(text, key, rule, tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_yaml(p)
    probs = e.value.problems
    assert any(pr.key == key and rule in pr.rule for pr in probs), str(e.value)
    assert str(p) in str(e.value)


def test_errors_carry_the_line_number(tmp_path):
    p = tmp_path / "cfg.yaml"
    p.write_text("qkv_fprop:\n  method: ring_exchange\nfc2_fprop:\n  method: pipeline\n  cga_sise: 2\n")
    with pytest.raises(ConfigError) as e:
        load_yaml(p)
    assert f"{p}:5" in str(e.value) and "fc2_fprop.cga_sise" in str(e.value)


def test_malformed_yaml_names_file_and_line(tmp_path):
    p = tmp_path / "broken.yaml"
    p.write_text("qkv_fprop:\n  method: ring_exchange\n  num_sm: [1, 2\nfc2_fprop: {}\n")
    with pytest.raises(ConfigError) as e:
        load_yaml(p)
    msg = str(e.value)
    assert "malformed YAML" in msg and f"{p}:" in msg


def test_truncated_yaml_is_a_clear_error(tmp_path):
    p = tmp_path / "trunc.yaml"
    p.write_text('qkv_fprop:\n  method: "ring_exch')
    with pytest.raises(ConfigError, match="malformed YAML"):
        load_yaml(p)


def test_duplicate_keys_are_rejected():
    with pytest.raises(ConfigError, match="duplicate"):
        loads_yaml("fc2_fprop: {method: pipeline}\nfc2_fprop: {method: ring_exchange}\n")
    with pytest.raises(ConfigError, match="duplicate key"):
        loads_yaml("fc2_fprop:\n  num_sm: 4\n  num_sm: 8\n")


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_yaml(tmp_path / "nope.yaml")


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as e:
        parse_ub_cfgs({"foo": {}, "qkv_fprop": {"bar": 1, "num_sm": "x"}})
    assert len(e.value.problems) == 3


def test_describe():
    assert (
        GemmOverlapConfig(method="pipeline", num_sm=16, num_splits=4, cga_size=2, set_sm_margin=True).describe()
        == "pipeline sm=16 cga=2 splits=4 margin"
    )
    assert UbConfig().describe() == "TE defaults"
