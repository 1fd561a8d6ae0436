"""tools.winners: which choices of the space won where, read from tuning reports."""

import json
import lzma

from megatron_tp_overlap.tools.research import winners


def report(chosen, ub_cfgs=None, off=(), fp8=False, space=None, contenders=(), per_gemm=None, verified=None):
    r = {
        "meta": {"tp_size": 2, "fp8": fp8, "shape": [4096, 5120], "space": space or {}},
        "decision": {"chosen": chosen, "config": {"label": chosen, "ub_cfgs": ub_cfgs or {}, "overlap_off": list(off)}},
        "contenders": [{"name": n} for n in contenders],
        "per_gemm_choices": per_gemm or {},
    }
    if verified is not None:
        r["in_run_verification"] = {"reverted": verified == "reverted"}
    return r


def test_labels_and_configs_name_their_choices():
    assert winners.label_choices("pipeline sm=16 cga=2 splits=4 margin pipeline_rs_overlap_first_gemm") == {
        "knob set_sm_margin",
        "knob pipeline_rs_overlap_first_gemm",
    }
    assert winners.label_choices("ring_exchange agg no_ce") == {"knob aggregate", "knob use_ce"}
    assert winners.label_choices("bulk sm=4 cga=2") == set() and winners.label_choices("no overlap") == {"one GEMM off"}
    cfg = {"ub_cfgs": {"fc2_fprop": {"method": "pipeline", "set_sm_margin": True, "fp8_buf": True}}, "overlap_off": []}
    assert winners.config_choices(cfg, "autotuned", fp8=True) == {"knob set_sm_margin", "knob fp8_buf"}
    assert winners.config_choices(cfg, "preset x", fp8=False) == {"knob set_sm_margin"}  # TE ignores fp8_buf in bf16
    off = {"ub_cfgs": {}, "overlap_off": ["qkv_dgrad", "fc1_dgrad"]}
    assert winners.config_choices(off, "autotuned, bulk dgrad off") == {"bulk dgrad off"}
    assert winners.config_choices({"overlap_off": ["qkv_wgrad"]}, "autotuned") == {"one GEMM off"}
    assert winners.config_choices({"overlap_off": ["qkv_wgrad"]}, "no overlap") == {"no overlap"}


def test_tables_count_what_was_measured_accepted_chosen_and_kept(tmp_path, capsys):
    space = {"proj_dgrad": ["TE default", "ring_exchange agg no_ce"], "fc2_fprop": ["pipeline sm=16 margin"]}
    runs = {
        "a/x.report.json": report(
            "autotuned, bulk dgrad off",
            {"fc2_fprop": {"method": "pipeline", "set_sm_margin": True}},
            ["qkv_dgrad", "fc1_dgrad"],
            space=space,
            contenders=["autotuned", "no overlap", "autotuned, bulk dgrad off"],
            per_gemm={"fc2_fprop": {"option": "pipeline sm=16 margin", "accepted": True}},
            verified="kept",
        ),
        "b/y_report.json": report("reference", space=space, contenders=["autotuned", "no overlap"]),
        "b/z_report.json": report("no overlap", off=["qkv_fprop"], contenders=["no overlap"], verified="reverted"),
        "b/not_a_report.json": {"rows": []},
    }
    for name, r in runs.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(json.dumps(r))
    (tmp_path / "b" / "broken_report.json").write_text("{")
    xz = tmp_path / "b" / "z_report.json.xz"  # results folders keep the larger reports compressed
    xz.write_bytes(lzma.compress((tmp_path / "b" / "z_report.json").read_bytes()))
    (tmp_path / "b" / "z_report.json").unlink()
    (tmp_path / "b" / "broken_report.json.xz").write_bytes(b"not xz")
    found = winners.collect([tmp_path])
    assert len(found) == 3
    rows = {r.split(" | ")[0][2:]: r.split(" | ")[1:] for r in winners.choice_table(found)[2:]}
    assert rows["knob set_sm_margin"][:4] == ["2", "1", "1", "1 |"]  # measured in a and b, accepted and kept in a
    assert rows["knob use_ce"][:3] == ["2", "0", "0"]
    assert rows["bulk dgrad off"] == ["1", "0", "1", "1 |"]
    assert rows["no overlap"] == ["3", "0", "1", "0 |"]  # chosen once, sent back by the run
    winners.main([str(tmp_path)])
    out = capsys.readouterr().out
    assert out.startswith("3 tuning reports") and "| a/x.report.json | 2 | bf16 | 4096x5120 | autotuned, bulk" in out
