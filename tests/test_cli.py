import json

from test_trace import trace

from megatron_tp_overlap.tools.cli import main


def test_validate(tmp_path, capsys):
    good = tmp_path / "good.yaml"
    good.write_text("fc2_fprop: {method: pipeline, num_sm: 8, aggregate: true}\n")
    assert main(["validate", str(good), "--tp", "4"]) == 0
    out = capsys.readouterr().out
    assert "valid" in out and "warning: fc2_fprop: aggregate ignored" in out
    bad = tmp_path / "bad.yaml"
    bad.write_text("fc2_fprop: {method: pipeline, num_sm: 200}\n")
    assert main(["validate", str(bad), "--sm-count", "132"]) == 2  # bad input: exit 2, as everywhere
    assert "fc2_fprop.num_sm = 200" in capsys.readouterr().err


def test_preset(capsys):
    assert main(["preset"]) == 0 and "userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192" in capsys.readouterr().out
    assert main(["preset", "userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192"]) == 0
    assert "proj_fprop:" in capsys.readouterr().out
    assert main(["preset", "nope"]) == 2


def test_analyze(tmp_path, capsys):
    p = tmp_path / "trace.json"
    p.write_text(json.dumps(trace()))
    out = tmp_path / "r.json"
    assert main(["analyze", str(p), "--json", str(out)]) == 0
    assert "overlap" in capsys.readouterr().out
    assert json.loads(out.read_text())[str(p)]["0"]["overlap_ms"] == 0.03
    bad = tmp_path / "bad.json"
    bad.write_text("[")
    assert main(["analyze", str(bad)]) == 2
