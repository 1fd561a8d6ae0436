"""GPU tests (``pytest -m gpu`` on a machine with >= 2 GPUs, TE and torchrun); skipped elsewhere. They run at the TP
size of the machine: its GPU count rounded down to a power of two, at most 8 (2, 4 or 8 H200s: TP=2, 4, 8)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]


def _tp_size() -> int:
    """TP size of the machine (skips the test below 2 GPUs)."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        pytest.skip("needs 2 CUDA GPUs")
    return 1 << (min(n, 8).bit_length() - 1)


def test_engine_tunes_switches_and_matches_no_overlap(tmp_path):
    tp = _tp_size()
    pytest.importorskip("transformer_engine.pytorch")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={tp}",
        str(ROOT / "benchmarks/engine_tune.py"),
        "--layers",
        "2",
        "--seq",
        "4096",
        "--budget-s",
        "20",
        "--timing-steps",
        "5",
        "--timing-rounds",
        "1",
        "--extra-switches",
        "20",
        "--check-flags",
        "--out",
        str(tmp_path),
    ]
    subprocess.run(cmd, check=True, timeout=600, cwd=ROOT)
    d = json.loads((tmp_path / f"engine_tp{tp}.json").read_text())
    # each per-kind switch the search may choose really changes the kernels that run (torch profiler): fewer
    # userbuffers kernels, more NCCL ones than with every kind on
    k = d["flag_kernel_check"]
    assert "error" not in k, k["error"]  # the check's own failure, not a missing key
    on = k["all on (TE default)"]
    for name in ("AG overlap", "RS overlap", "bulk dgrad", "bulk wgrad"):
        off = k[f"kind off: {name}"]
        assert off["userbuffers"] + off["p2p_memcpy"] < on["userbuffers"] + on["p2p_memcpy"], (name, off, on)
        assert off["nccl"] > on["nccl"], (name, off, on)
    # "no overlap" as a whole contender: no userbuffers kernel or copy runs, NCCL carries every TP collective
    none = k["all off"]
    assert none["userbuffers"] == none["p2p_memcpy"] == 0 and none["nccl"] > on["nccl"], (none, on)
    # qkv/fc1 dgrad flipped live from bulk to GEMM + reduce-scatter: other communication kernels run
    flips = [n for n in k if n.startswith("dgrad flipped")]
    assert len(flips) == 2, sorted(k)
    for n in flips:
        assert k[n]["userbuffers"] > 0 and (k[n]["names"], k[n]["userbuffers"], k[n]["p2p_memcpy"]) != (
            on["names"],
            on["userbuffers"],
            on["p2p_memcpy"],
        ), (n, k[n], on)
    assert d["numerics"]["passed"], d["numerics"]["worst"]
    assert d["extra_switches"] >= 20 and d["tuning_switches"] >= 1
    assert d["stale_guard"]["refused"], "a switch with a graph whose backward has not run must be refused"
    assert d["stale_guard"]["numerics_after"]["dgrad_input"] <= d["numerics"]["rtol"]
    # a graph kept after its backward (a Megatron-LM MoE run at TP=2): its TE contexts let go, the switch goes on
    held = d["stale_guard"]["model_held"]
    assert held["switched"] and held["released"], held
    from megatron_tp_overlap.ub.rules import ValidationContext, load_and_validate

    load_and_validate(tmp_path / f"engine_tp{tp}_tuned.yaml", ValidationContext(tp_size=tp))


def test_agreements_without_gloo_over_nccl(tmp_path):
    """Megatron's --disable-gloo-process-groups: the tuning's agreements use a dedicated NCCL communicator, carry the
    failure and its reason, and no gloo group of ours exists (engine.lockstep, gloo=False)."""
    tp = _tp_size()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={tp}",
        str(ROOT / "tests/gpu_agreement_ranks.py"),
    ]
    subprocess.run([*cmd, str(tmp_path)], check=True, timeout=300, cwd=ROOT)
    for r in range(tp):
        d = json.loads((tmp_path / f"r{r}.json").read_text())
        assert d["kinds"] == ["nccl"] and d["gloo_groups"] == 0, d
        assert "NCCL all-reduce over a dedicated communicator (no gloo group)" in d["describe"]
        assert d["max"][:2] == [tp - 1, 0.0] and d["max"][2] != d["max"][2]  # NaN: not measured on rank 1
        assert d["ok"] is False and d["failure"].startswith("rank 1: ZeroDivisionError")
