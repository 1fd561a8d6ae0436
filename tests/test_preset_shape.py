"""A starting preset written for another shape than the run's: what NeMo's preset names say, recognising a preset by
name or content, the one line at tuning start and the report field (issue 48, item 4)."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from megatron_tp_overlap.integrations.megatron.run_shape import RunShape
from megatron_tp_overlap.ub.config import dumps_yaml, load_yaml
from megatron_tp_overlap.ub.layer_cfg import reference_config
from megatron_tp_overlap.ub.preset_shape import (
    Shape,
    announce,
    gpu_model,
    parse_preset_name,
    preset_named_in,
    presets_equal_to,
    run_shape,
    starting_config,
    starting_line,
)
from megatron_tp_overlap.ub.presets import NEMO_PRESETS, PRESETS

BF16_70B = "userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192"
FP8_H8192 = ("userbuffers_fp8_h100_h8192_tp4_mbs1_seqlen8192", "userbuffers_fp8_b200_h8192_tp2_mbs1_seqlen8192")


def rebuilt_name(s: Shape) -> str:
    """The name NeMo would give a preset written for ``s`` (the parser's inverse)."""
    cp = f"_cp{s.cp}" if s.cp != 1 else ""
    lora = "_lora" if s.lora else ""
    return f"userbuffers_{s.dtype}_{s.gpu.lower()}_h{s.hidden}_tp{s.tp}{cp}_mbs{s.micro_batch}_seqlen{s.seq}{lora}"


def gpt(**kw) -> RunShape:
    base = dict(tp=4, seq_length=8192, micro_batch_size=1, hidden=8192, ffn=28672, heads=64, kv_groups=8)
    return RunShape(**{**base, "kv_channels": 128, "gated_mlp": True, "fp8": None, "bf16": True, **kw})


def test_every_nemo_preset_name_parses_into_what_it_says():
    assert len(NEMO_PRESETS) == 19
    for name in NEMO_PRESETS:
        s = parse_preset_name(name)
        assert None not in (s.gpu, s.dtype, s.hidden, s.tp, s.cp, s.micro_batch, s.seq), name
        assert rebuilt_name(s) == name  # every token landed in its own field (GPU h100 is no hidden size)
    s = parse_preset_name("userbuffers_bf16_h100_h16384_tp8_cp2_mbs1_seqlen8192")
    assert (s.gpu, s.dtype, s.hidden, s.tp, s.cp, s.micro_batch, s.seq, s.tokens) == (
        "H100",
        "bf16",
        16384,
        8,
        2,
        1,
        8192,
        4096,
    )
    assert parse_preset_name("userbuffers_fp8_h100_h8192_tp2_mbs1_seqlen4096_lora").lora
    assert parse_preset_name("te_default") is None
    short = parse_preset_name("userbuffers_bf16_h8192_tp4")  # a name that does not carry a field: it stays unknown
    assert (short.gpu, short.hidden, short.tp, short.seq, short.cp) == (None, 8192, 4, None, None)


@pytest.mark.parametrize(
    "device, model",
    [
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA B200", "B200"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA H100 PCIe", "H100"),
        ("NVIDIA GeForce RTX 4090", "GeForce RTX 4090"),
    ],
)
def test_gpu_model_from_the_device_name(device, model):
    assert gpu_model(device) == model


def test_a_preset_written_for_another_shape_gets_one_line_saying_what_for():
    run = run_shape(gpt(tp=2, hidden=4096, seq_length=16384), "NVIDIA H200")
    line = starting_line(PRESETS[BF16_70B], BF16_70B, run)
    assert line == (
        f"[tp-overlap-autotune] the starting config is NeMo's preset {BF16_70B}, written for H100, bf16, hidden 8192, "
        "TP 4, micro-batch 1, seq 8192; this run: H200, hidden 4096, TP 2, seq 16384 (the search starts from it; "
        "the tuned config is for this run)"
    )
    # Llama-3-70B's recipe: this preset at CP 2 (the buffers hold half the tokens) and at 16k, TP 8, CP 2 on an H100
    cp2 = starting_line(PRESETS[BF16_70B], BF16_70B, run_shape(gpt(cp=2), "NVIDIA H100 80GB HBM3"))
    assert cp2.endswith(
        "this run: CP 2, 4096 tokens a micro-batch against the preset's 8192 (the search starts "
        "from it; the tuned config is for this run)"
    )
    at16k = starting_line(PRESETS[BF16_70B], BF16_70B, run_shape(gpt(tp=8, cp=2, seq_length=16384), "NVIDIA H100"))
    assert "this run: TP 8 (" in at16k  # 16384 / CP 2 = the preset's 8192 tokens: only TP differs
    fp8_run = starting_line(PRESETS[BF16_70B], None, run_shape(gpt(fp8="hybrid"), "NVIDIA H100 80GB HBM3"))
    assert "this run: fp8 (" in fp8_run


def test_no_line_when_the_run_is_what_the_preset_was_written_for():
    for name in NEMO_PRESETS:
        s = parse_preset_name(name)
        run = gpt(
            tp=s.tp,
            cp=s.cp,
            hidden=s.hidden,
            micro_batch_size=s.micro_batch,
            seq_length=s.seq,
            fp8="hybrid" if s.dtype == "fp8" else None,
        )
        assert starting_line(PRESETS[name], name, run_shape(run, f"NVIDIA {s.gpu}")) is None, name
        assert starting_line(PRESETS[name], None, run_shape(run, f"NVIDIA {s.gpu}")) is None, name  # by content
    # the same tokens a micro-batch as the preset (micro-batch 2 x seq 4096): the buffers are the preset's
    assert (
        starting_line(PRESETS[BF16_70B], BF16_70B, run_shape(gpt(micro_batch_size=2, seq_length=4096), "H100")) is None
    )
    # TE's defaults and a YAML of one's own are no preset: nothing to say
    assert starting_config(PRESETS["te_default"], "te_default", run_shape(gpt(tp=2), "NVIDIA H200")) is None
    own = PRESETS[BF16_70B].with_entry("qkv_dgrad", None)
    assert starting_config(own, BF16_70B, run_shape(gpt(tp=2), "NVIDIA H200")) is None  # an edited copy of it


def test_a_preset_is_recognised_by_content_as_bridge_and_nemo_hand_it_over():
    from test_layer_cfg import bf16_h100_h8192_tp4  # NeMo's dataclass, written as NeMo writes it

    run = run_shape(gpt(tp=2), "NVIDIA H200")
    for given in (bf16_h100_h8192_tp4(), dataclasses.asdict(bf16_h100_h8192_tp4())):  # a recipe's; after ub init
        s = starting_config(reference_config(given), None, run)
        assert s.presets == (BF16_70B,) and s.by == "content" and s.mismatch == ("gpu", "tp")


def test_presets_sharing_one_content_are_all_named_unless_the_name_says_which():
    assert presets_equal_to(PRESETS[FP8_H8192[0]]) == list(FP8_H8192)
    run = run_shape(gpt(tp=8, hidden=4096, fp8="hybrid"), "NVIDIA H200")
    line = starting_line(PRESETS[FP8_H8192[0]], None, run)
    assert f"equal to NeMo's presets {FP8_H8192[0]} (written for H100, fp8," in line
    assert f"and {FP8_H8192[1]} (written for B200, fp8," in line and "this run: H200, fp8, hidden 4096, TP 8" in line
    # the run is what one of them was written for: no line
    assert starting_line(PRESETS[FP8_H8192[0]], None, run_shape(gpt(tp=2, fp8="hybrid"), "NVIDIA B200")) is None
    named = starting_config(PRESETS[FP8_H8192[0]], FP8_H8192[1], run)
    assert named.presets == (FP8_H8192[1],) and named.by == "name"


def test_a_preset_yaml_says_which_preset_it_is(tmp_path, capsys):
    from megatron_tp_overlap.app.train import compose, overlap_flags
    from megatron_tp_overlap.tools.cli import main

    assert main(["preset", FP8_H8192[1]]) == 0
    p = tmp_path / "cli.yaml"
    p.write_text(capsys.readouterr().out)
    assert preset_named_in(p) == FP8_H8192[1] and load_yaml(p) == PRESETS[FP8_H8192[1]]
    assert "# NeMo's, written for B200, fp8, hidden 8192, TP 2, micro-batch 1, seq 8192" in p.read_text()
    flags, _ = overlap_flags(compose([f"tp_overlap.preset={FP8_H8192[1]}"]), tmp_path)  # the main job's
    assert preset_named_in(flags[2]) == FP8_H8192[1]
    tuned = tmp_path / "tuned.yaml"
    tuned.write_text(dumps_yaml(PRESETS[BF16_70B], header="Tuned by megatron-tp-overlap\nchosen: reference"))
    assert preset_named_in(tuned) is None and preset_named_in(tmp_path / "missing.yaml") is None
    assert preset_named_in(PRESETS[BF16_70B]) is None


def test_tuning_start_logs_the_line_once_and_the_report_records_it(tmp_path, monkeypatch):
    from test_cache import KEY

    from megatron_tp_overlap.engine.space import TuningConfig
    from megatron_tp_overlap.integrations.megatron import tuning as mt

    logged: list[str] = []
    field = announce(PRESETS[BF16_70B], None, gpt(tp=2), "NVIDIA H200", logged.append)
    assert len(logged) == 1 and logged[0] == field["line"] and field["mismatch"] == ["gpu", "tp"]
    assert field["written_for"][BF16_70B]["tp"] == 4 and field["run"]["tp"] == 2
    assert announce(PRESETS[BF16_70B], None, gpt(), "NVIDIA H100 80GB HBM3", logged.append)["line"] is None
    assert announce(PRESETS["te_default"], None, gpt(), "NVIDIA H100", logged.append) is None and len(logged) == 1

    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 0)
    out = tmp_path / "tuned.yaml"
    ref = TuningConfig(PRESETS[BF16_70B], frozenset(), "reference")
    tuned = mt.Tuned(ref, None, out, mt._recipe(ref, frozenset({"fc2_fprop"}), out, 2), starting_config=field)
    mt._write_outputs(tuned, KEY, SimpleNamespace(put=lambda *a: None), 1.0, print)
    assert json.loads(out.with_suffix(".report.json").read_text())["starting_config"] == field
