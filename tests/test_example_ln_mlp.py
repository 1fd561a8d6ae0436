"""examples/ln_mlp_with_overlap.py: argument parsing and launch errors (CPU)."""

import importlib.util
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[1] / "examples" / "ln_mlp_with_overlap.py"
spec = importlib.util.spec_from_file_location("ln_mlp_with_overlap", PATH)
ex = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ex)
GOOD_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "UB_SKIPMC": "1"}


def test_flags_and_defaults():
    a = ex.parse_args(
        [
            "--num-iters",
            "3",
            "--fp8",
            "--num-replicas",
            "2",
            "--bootstrap-backend",
            "gloo",
            "--autotune",
            "--benchmark",
            "--check-numerics",
            "--verbose",
            "--mlp-expansion-factor",
            "2",
        ]
    )
    assert (a.num_iters, a.fp8, a.num_replicas, a.bootstrap_backend, a.mlp_expansion_factor) == (3, True, 2, "gloo", 2)
    d = ex.parse_args([])
    assert (d.batch_size, d.seq_length, d.num_heads, d.head_dim, d.seed, d.no_comm_overlap, d.ub_cfg) == (
        2,
        2048,
        32,
        128,
        1234,
        False,
        None,
    )


@pytest.mark.parametrize(
    "argv", [["--num-iters", "0"], ["--bootstrap-backend", "tcp"], ["--no-comm-overlap", "--autotune"]]
)
def test_bad_flags_exit(argv):
    with pytest.raises(SystemExit):
        ex.parse_args(argv)


def test_good_launch():
    assert ex.check_launch(ex.parse_args([]), 4, multicast=False, env=GOOD_ENV) == []
    assert ex.check_launch(ex.parse_args(["--num-replicas", "2"]), 4, multicast=False, env=GOOD_ENV) == []


@pytest.mark.parametrize(
    "argv, world, env, needle",
    [
        ([], 1, GOOD_ENV, "needs >= 2 GPUs per group"),
        (["--num-replicas", "2"], 2, GOOD_ENV, "needs >= 2 GPUs per group"),
        (["--num-replicas", "3"], 4, GOOD_ENV, "not divisible by --num-replicas 3"),
        ([], 4, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, "set UB_SKIPMC=1"),
        ([], 4, {"UB_SKIPMC": "1"}, "CUDA_DEVICE_MAX_CONNECTIONS=1"),
        (["--seq-length", "2050"], 4, GOOD_ENV, "divisible by the TP size 4"),
    ],
)
def test_launch_errors_say_what_to_change(argv, world, env, needle):
    problems = ex.check_launch(ex.parse_args(argv), world, multicast=False, env=env)
    assert any(needle in p for p in problems), problems


def test_no_overlap_needs_no_userbuffers_env():
    assert ex.check_launch(ex.parse_args(["--no-comm-overlap"]), 2, multicast=False, env={}) == []


def test_invalid_ub_cfg_is_reported(tmp_path):
    bad = tmp_path / "ub.yaml"
    bad.write_text("fc1_fprop:\n  method: pipeline\n")
    problems = ex.check_launch(ex.parse_args(["--ub-cfg", str(bad)]), 2, multicast=True, env=GOOD_ENV)
    assert any("--ub-cfg" in p and "fc1_fprop.method" in p and f"{bad}:2" in p for p in problems)
