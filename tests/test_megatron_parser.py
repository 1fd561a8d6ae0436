"""The recipe's flags in Megatron-LM's own argument parser (where megatron.training imports: the GPU machine's
stack; megatron-core 0.19 needs Python >= 3.12, so CPU CI skips this)."""

import sys

import pytest

pytest.importorskip("megatron.training.arguments")

from megatron_tp_overlap.integrations.megatron.flags import KIND_SWITCHES, add_arguments, recipe  # noqa: E402
from megatron_tp_overlap.ub.config import GEMM_NAMES, UbConfig, parse_ub_cfgs  # noqa: E402

ALL = frozenset(GEMM_NAMES)


def parse(flags, monkeypatch):
    from megatron.training.arguments import parse_args

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *flags])
    return parse_args(extra_args_provider=add_arguments)


@pytest.mark.parametrize("name", list(KIND_SWITCHES))
def test_each_kind_switch_flag_sets_its_transformer_config_field(name, monkeypatch):
    k = KIND_SWITCHES[name]
    r = recipe(UbConfig(), k.gemms, ALL, "t.yaml", tp=2)
    args = parse(r.add, monkeypatch)
    assert args.tp_comm_overlap and args.tp_comm_overlap_cfg == "t.yaml"
    for field, value in r.fields.items():
        assert getattr(args, field) == value, field
    others = [x for x in KIND_SWITCHES.values() if x is not k]
    assert all(getattr(args, x.field) is True for x in others)


def test_rs_dgrad_and_every_kind_off_together(monkeypatch):
    rs = parse_ub_cfgs({g: {"method": "ring_exchange"} for g in ("qkv_dgrad", "fc1_dgrad")})
    off = KIND_SWITCHES["RS overlap"].gemms | KIND_SWITCHES["bulk wgrad"].gemms
    r = recipe(rs, off, ALL - {"qkv_wgrad", "fc1_wgrad"} | off, "t.yaml", tp=2)
    args = parse(r.add, monkeypatch)
    assert args.tp_comm_overlap_rs_dgrad and not args.tp_comm_overlap_rs
    assert all(getattr(args, k) == v for k, v in r.fields.items())


def test_disable_gloo_process_groups_reaches_the_tuning(monkeypatch):
    """Megatron's own parser with --disable-gloo-process-groups and our flag: the tuning then creates no gloo group
    (its agreements: a dedicated NCCL communicator; tests/test_gpu_engine.py runs it on 2 GPUs)."""
    from megatron_tp_overlap.integrations.megatron.groups import gloo_groups_enabled

    args = parse(["--disable-gloo-process-groups"], monkeypatch)  # with our flags in the parser (parse())
    assert args.use_gloo_process_groups is False and not gloo_groups_enabled(args)  # core_v0.19's attribute
    assert gloo_groups_enabled(parse([], monkeypatch))
