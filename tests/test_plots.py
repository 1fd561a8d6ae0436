import json
from pathlib import Path

from megatron_tp_overlap.tools.plots import plot_report, slot_points

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def report():
    return json.loads((RESULTS / "2026-11-21_h200x4" / "engine_tp4_tuning_report.json").read_text())


def test_slot_points_from_a_real_report():
    pts = slot_points(report())
    assert set(pts) == {"qkv.fwd", "qkv.bwd", "proj.fwd", "proj.bwd", "mlp.fwd", "mlp.bwd"}
    assert all(v["reference"] is not None and v["no overlap"] is not None for v in pts.values())
    assert len(pts["mlp.fwd"]["options"]) > 5


def test_plot_writes_a_png(tmp_path):
    out = plot_report(report(), tmp_path / "tuning.png", step_ms=[21.3, 21.2, 21.4])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
