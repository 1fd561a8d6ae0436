"""bench: arguments, shape checks, metrics arithmetic, report and plot (the kernels run on GPUs)."""

from pathlib import Path

import pytest

from megatron_tp_overlap.tools.bench import (
    Metrics,
    Row,
    backend_support,
    check_shape,
    flops_per_gpu,
    main,
    parse_args,
    plot_sweep,
    render,
)


def test_args():
    a = parse_args(
        [
            "ag",
            "1024",
            "12288",
            "49152",
            "--dtype",
            "float16",
            "--iters",
            "10",
            "--num-sm",
            "8,16",
            "--sweep-m",
            "1024,2048",
            "--backends",
            "nccl,te_ring",
        ]
    )
    assert (a.op, a.M, a.N, a.K, a.dtype, a.num_sm, a.sweep_m, a.backends) == (
        "ag",
        1024,
        12288,
        49152,
        "float16",
        [8, 16],
        [1024, 2048],
        ["nccl", "te_ring"],
    )
    for bad in (
        ["ag", "1", "2"],
        ["xx", "1", "2", "3"],
        ["rs", "8", "8", "8", "--backends", "nccl,magic"],
        ["rs", "8", "8", "8", "--iters", "0"],
        ["rs", "8", "8", "8", "--dtype", "int8"],
    ):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_shape_checks():
    assert check_shape("ag", 4096, 49152, 12288, 4) == []
    assert check_shape("rs", 4096, 12288, 49152, 4) == []
    assert any("needs >= 2 GPUs" in p for p in check_shape("ag", 8, 8, 8, 1))
    assert any("M = 1000" in p for p in check_shape("ag", 1000, 8, 8, 16))
    assert any("N = 12" in p for p in check_shape("ag", 16, 12, 8, 8))
    assert any("K = 12" in p for p in check_shape("rs", 16, 8, 12, 8))
    assert check_shape("ag", 16, 16, 12, 8) == []  # AG splits N, not K


def test_backend_support():
    assert "TE userbuffers" in backend_support("te_ring", "float32")
    assert backend_support("te_pipeline", "bfloat16") is None and backend_support("nccl", "float32") is None
    assert (
        "adds in bf16" in backend_support("te_ring", "float16", "rs")
        and backend_support("te_ring", "float16", "ag") is None
    )
    assert backend_support("nccl", "float16", "rs") is None


def test_metrics():
    m = Metrics.of(total_ms=1.2, gemm_ms=1.0, comm_ms=0.5, flops_per_gpu=2e12)
    assert m.exposed_ms == pytest.approx(0.2) and m.efficiency == pytest.approx(0.6)
    assert m.bound_ms == 1.0 and m.tflops == pytest.approx(2e12 / 1.2e-3 / 1e12)
    hidden = Metrics.of(0.9, 1.0, 0.5, 1.0)  # faster than GEMM alone: nothing exposed
    assert hidden.exposed_ms == 0.0 and hidden.efficiency == 1.0
    assert flops_per_gpu(4096, 49152, 12288, 4) == 2 * 4096 * 49152 * 12288 / 4


def test_render_and_plot(tmp_path):
    rows = [
        Row("nccl", "all_gather then matmul", Metrics.of(1.5, 1.0, 0.5, 1e12), 0.01, 1e-3, 0.02),
        Row("flux", "", None, None, None, None, "unavailable: flux does not import"),
    ]
    text = render(rows, "AG M=4096")
    assert "| nccl | all_gather then matmul | 1.500 | 1.000 | 0.500 | 0.500 | 0.00 |" in text and "unavailable" in text
    png = plot_sweep(
        {1024: rows, 2048: [Row("nccl", "x", Metrics.of(2.5, 2.0, 1.0, 1e12), 0.0, 0.0, 0.0)]}, tmp_path / "s.png", "t"
    )
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_without_gpus_the_command_says_so(capsys):
    assert main(["ag", "1024", "12288", "49152"]) == 2
    assert "needs >= 2 GPUs" in capsys.readouterr().err
    from megatron_tp_overlap.tools.cli import main as cli

    assert cli(["bench", "rs", "1024", "49152", "12288"]) == 2


def test_correctness_is_judged_per_dtype():
    good = Row("te_ring", "ring_exchange", Metrics.of(1.0, 0.9, 0.3, 1e12), 0.0, 2.4e-3, 0.01)
    wrong = Row("te_ring", "ring_exchange", Metrics.of(1.0, 0.9, 0.3, 1e12), 0.0, 4.1e-1, 3.0)  # seen on H200, fp16 RS
    assert good.correct("bfloat16") and good.correct("float16") and not good.correct("float32")
    assert wrong.correct("float16") is False and Row("flux", "", None, None, None, None).correct("float16") is None
    text = render([good, wrong], "RS", "float16")
    assert "correct (tol 0.01)" in text and "| yes |" in text and "| **NO** |" in text


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

# every benchmark's --help in one process (each in its own imported torch anew: ~1.4 s apiece)
_HELP_ALL = r"""
import contextlib, io, json, runpy, sys
bad = {}
for path in sys.argv[1:]:
    sys.argv, out = [path, "--help"], io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
        if "usage" not in out.getvalue():
            bad[path] = "returned without a usage"
    except SystemExit as e:
        if e.code not in (0, None) or "usage" not in out.getvalue():
            bad[path] = f"exit {e.code}: {out.getvalue()[-500:]}"
    except Exception as e:  # noqa: BLE001
        bad[path] = repr(e)
print(json.dumps(bad))
"""


def test_every_benchmark_prints_its_help():
    """argparse formats help with %: a bare % in a help text crashed --help of two benchmarks."""
    import json
    import subprocess
    import sys

    scripts = sorted(str(p) for p in BENCHMARKS.glob("**/*.py") if "results" not in p.relative_to(BENCHMARKS).parts)
    assert len(scripts) >= 17
    r = subprocess.run([sys.executable, "-c", _HELP_ALL, *scripts], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {}
