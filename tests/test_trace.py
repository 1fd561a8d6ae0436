"""Trace analysis on small Chrome traces built here: interval arithmetic and kernel classification."""

import gzip
import json

import pytest

from megatron_tp_overlap.tools.trace import analyze, classify, intersect, length, load, render, union


@pytest.mark.parametrize(
    "name, cls",
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
        ("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT", "gemm"),
        ("cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8>", "gemm"),
        ("void cublasLt::splitKreduce_kernel<32, 16, int, float>", "gemm"),
        ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "comm"),
        (
            "void userbuffers_fp16_sum_inplace_gpu_rr_rs<2>(int, int, int, int, int, int, void**, int, unsigned long)",
            "comm",
        ),
        ("Memcpy PtoP (Device -> Device)", "comm"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "other"),
        ("flash_fwd_kernel", "other"),
    ],
)
def test_classify(name, cls):
    assert classify(name) == cls


def test_interval_arithmetic():
    u = union([(5, 7), (0, 2), (1, 3), (8, 8), (6, 9)])
    assert u == [(0, 3), (5, 9)] and length(u) == 7
    assert intersect(u, union([(2, 6), (8.5, 20)])) == [(2, 3), (5, 6), (8.5, 9)]
    assert intersect([], u) == []


def k(name, ts, dur, stream, dev=0, cat="kernel"):
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "ts": ts,
        "dur": dur,
        "pid": dev,
        "tid": stream,
        "args": {"device": dev, "stream": stream},
    }


def trace():
    return {
        "traceEvents": [
            k("sm90_xmma_gemm_a", 0, 100, 7),
            k("sm90_xmma_gemm_b", 50, 100, 8),  # GEMM union 0-150
            k("userbuffers_rs", 120, 60, 20),  # comm 120-180: 30 us overlap
            k("Memcpy PtoP (Device -> Device)", 200, 10, 21, cat="gpu_memcpy"),  # comm 200-210, alone
            k("elementwise", 300, 5, 7),  # other
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 999, "pid": 1, "tid": 1},  # host: ignored
            k("ncclDevKernel_AllGather", 0, 40, 30, dev=1),
            k("nvjet_gemm", 20, 40, 31, dev=1),
        ]
    }


def test_analyze_per_device():
    r = analyze(trace())
    d0, d1 = r["0"], r["1"]
    assert (d0.gemm_ms, d0.comm_ms, d0.overlap_ms) == pytest.approx((0.150, 0.070, 0.030))
    assert d0.overlap_ratio == pytest.approx(0.030 / 0.070)
    assert d0.busy_ms == pytest.approx(0.195) and d0.kernels == {"gemm": 2, "comm": 2, "other": 1}
    assert d0.streams == pytest.approx({"20": 0.06, "21": 0.01, "7": 0.105, "8": 0.1})
    assert (d1.gemm_ms, d1.comm_ms, d1.overlap_ms) == pytest.approx((0.04, 0.04, 0.02))
    assert "| 0 | 0.150 | 0.070 | 0.030 | 0.43 |" in render(r)


def test_load_plain_gz_and_errors(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(json.dumps(trace()))
    assert analyze(load(p))["0"].gemm_ms == pytest.approx(0.15)
    gz = tmp_path / "t.json.gz"
    with gzip.open(gz, "wt") as f:
        json.dump(trace()["traceEvents"], f)  # bare-array form
    assert analyze(load(gz))["1"].overlap_ms == pytest.approx(0.02)
    bad = tmp_path / "bad.json"
    bad.write_text('{"traceEvents": [')
    with pytest.raises(ValueError, match="not a readable Chrome trace"):
        load(bad)
    other = tmp_path / "other.json"
    other.write_text("{}")
    with pytest.raises(ValueError, match="no traceEvents"):
        load(other)
