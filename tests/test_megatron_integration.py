"""CPU tests of the Megatron integration's pure parts; parsing through Megatron's own parser runs
where ``megatron.training`` imports (Python >= 3.12 with megatron-core; skipped on CI's 3.11)."""

import argparse
import contextlib
import itertools
import sys
from pathlib import Path

import pytest
import torch

from megatron_tp_overlap.integrations.megatron import (
    ReplayIterator,
    StateSnapshot,
    add_arguments,
    attach_replay,
    check_arguments,
    output_path,
)
from megatron_tp_overlap.integrations.megatron.run_shape import RunShape


def ns(**kw):
    base = dict(
        tp_comm_overlap_autotune=True,
        tp_comm_overlap=True,
        sequence_parallel=True,
        tensor_model_parallel_size=2,
        seq_length=8192,
        micro_batch_size=1,
        hidden_size=4096,
        ffn_hidden_size=14336,
        num_attention_heads=32,
        group_query_attention=True,
        num_query_groups=8,
        swiglu=True,
        bf16=True,
        decoder_seq_length=None,
        transformer_impl="transformer_engine",
        tp_comm_overlap_cfg=None,
        tp_comm_overlap_autotune_output=None,
        save=None,
        tp_comm_overlap_autotune_steps=400,
        tp_comm_overlap_autotune_seconds=60.0,
        fp8=None,
    )
    base.update(kw)
    return argparse.Namespace(**base)


def test_flags_parse_with_defaults():
    p = add_arguments(argparse.ArgumentParser())
    a = p.parse_args(["--tp-comm-overlap-autotune", "--tp-comm-overlap-autotune-seconds", "30"])
    assert a.tp_comm_overlap_autotune and a.tp_comm_overlap_autotune_seconds == 30.0
    assert a.tp_comm_overlap_autotune_strategy == "coordinate" and a.tp_comm_overlap_autotune_steps == 0
    with pytest.raises(SystemExit):
        p.parse_args(["--tp-comm-overlap-autotune-strategy", "random"])


def test_good_combination_has_no_problems(tmp_path):
    assert check_arguments(ns(tp_comm_overlap_autotune_output=str(tmp_path / "x.yaml"))) == []
    assert check_arguments(ns(tp_comm_overlap_autotune=False, tp_comm_overlap=False)) == []


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(tp_comm_overlap=False), "needs --tp-comm-overlap"),
        (dict(sequence_parallel=False), "needs --sequence-parallel"),
        (dict(tensor_model_parallel_size=1), "needs --tensor-model-parallel-size >= 2 (got 1)"),
        (dict(transformer_impl="local"), "Transformer Engine"),
        (dict(fp16=True, bf16=False), "fp16 overlap gives wrong sums"),
        (dict(tp_comm_overlap_autotune_steps=-1), "--tp-comm-overlap-autotune-steps = -1: must be"),
        (dict(tp_comm_overlap_autotune_seconds=-1.0), "--tp-comm-overlap-autotune-seconds = -1.0: must be"),
        (dict(tp_comm_overlap_autotune_seconds=float("nan")), "-seconds = nan: must be a finite number"),
        (dict(tp_comm_overlap_autotune_trial_timeout=0.0), "-trial-timeout = 0.0"),
        (dict(tp_comm_overlap_autotune_rtol=5.0), "--tp-comm-overlap-autotune-rtol = 5.0: must be <= 0.5"),
        (dict(tp_comm_overlap_autotune_strategy="coord"), "did you mean 'coordinate'"),
    ],
)
def test_bad_combinations_are_named(kw, needle, tmp_path):
    probs = check_arguments(ns(tp_comm_overlap_autotune_output=str(tmp_path / "x.yaml"), **kw))
    assert any(needle in p for p in probs), probs


def test_missing_te_is_named(tmp_path):
    assert any(
        "Transformer Engine" in p
        for p in check_arguments(ns(tp_comm_overlap_autotune_output=str(tmp_path / "y.yaml")), te_available=False)
    )


def test_invalid_existing_cfg_is_reported_with_file_and_line(tmp_path):
    cfg = tmp_path / "ub.yaml"
    cfg.write_text("qkv_fprop:\n  method: pipeline\n")
    probs = check_arguments(ns(tp_comm_overlap_cfg=str(cfg)))
    assert any(f"{cfg}:2" in p and "qkv_fprop.method" in p for p in probs), probs


def test_unwritable_output_dir(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if not __import__("os").access(ro, __import__("os").W_OK):
            probs = check_arguments(ns(tp_comm_overlap_autotune_output=str(ro / "sub" / "t.yaml")))
            assert any("cannot write" in p for p in probs)
        else:
            pytest.skip("running as a user that can write anywhere (root)")
    finally:
        ro.chmod(0o700)


def test_output_path_defaults():
    assert output_path(ns(tp_comm_overlap_autotune_output="a/b.yaml")).as_posix() == "a/b.yaml"
    assert output_path(ns(tp_comm_overlap_cfg="cfgs/ub.yaml")).as_posix() == "cfgs/ub.tuned.yaml"
    assert output_path(ns(save="ckpt")).as_posix() == "ckpt/tp_comm_overlap_tuned.yaml"
    assert output_path(ns()).as_posix() == "tp_comm_overlap_tuned.yaml"


def test_run_shape_reads_every_dimension_that_keys_a_tuned_config():
    r = RunShape.from_args(ns(kv_channels=80, fp8="hybrid", context_parallel_size=2, tp_comm_overlap_rs_dgrad=True))
    k = r.key("NVIDIA H200", "2.20.2", "ref", "yaml_only")
    assert (k.tp, k.cp, k.tokens, k.hidden, k.ffn, k.heads, k.kv_groups, k.kv_channels) == (
        2,
        2,
        4096,
        4096,
        14336,
        32,
        8,
        80,
    )
    assert (k.gated_mlp, k.dtype, k.rs_dgrad) == (True, "fp8:hybrid/delayed", True)
    # what else changes the kernels or the bytes communicated (found by tests/test_reuse_key_args.py walking
    # Megatron's parser): the FP8 recipe, FP4, how many edge layers run in bf16, and quick-GeGLU's gated fc1
    keys = {
        RunShape.from_args(ns(fp8="hybrid", **kw)).key("g", "t", "r", "s").digest()
        for kw in (
            {},
            {"fp8_recipe": "mxfp8"},
            {"fp4": "e2m1"},
            {"first_last_layers_bf16": True, "num_layers_at_start_in_bf16": 1, "num_layers_at_end_in_bf16": 1},
            {"first_last_layers_bf16": True, "num_layers_at_start_in_bf16": 2, "num_layers_at_end_in_bf16": 1},
        )
    }
    assert len(keys) == 5
    assert RunShape.from_args(ns(swiglu=False, quick_geglu=True)).gated_mlp
    assert RunShape.from_args(ns(group_query_attention=False)).key("g", "t", "r", "s").kv_groups is None
    assert RunShape.from_args(ns()).kv_channels == 4096 // 32  # Megatron's default head size


def test_run_shape_from_a_transformer_config_matches_the_one_from_flags():
    from types import SimpleNamespace

    m = SimpleNamespace(
        tensor_model_parallel_size=2,
        seq_length=8192,
        hidden_size=4096,
        ffn_hidden_size=14336,
        num_attention_heads=32,
        num_query_groups=8,
        kv_channels=None,
        gated_linear_unit=True,
        fp8=None,
        bf16=True,
        sequence_parallel=True,
        tp_comm_overlap=True,
    )
    assert RunShape.from_transformer_config(m, micro_batch_size=1) == RunShape.from_args(ns())


def test_replay_gives_the_main_loop_the_same_batches_in_order():
    src = iter([{"tokens": i} for i in range(10)])
    main, r = attach_replay(src)
    trial = r.read_ahead(3)
    assert [b["tokens"] for b in trial] == [0, 1, 2]
    trial[0]["tokens"] = "mutated by get_batch"  # shallow copies: the main loop's batch is untouched
    assert r.read_ahead(3)[0]["tokens"] == 0
    assert [next(main)["tokens"] for _ in range(5)] == [0, 1, 2, 3, 4]


def test_tuning_hands_the_data_iterator_over_and_keeps_no_reference_to_it():
    """After tuning, nothing of it holds the run's data iterator: tuning's objects live on in reference cycles, and an
    iterator reachable from one is freed by the cyclic collector, late (a multi-process DataLoader iterator then
    waits for its workers' timeouts: rank 0 exited 10 s late on 2 H200s). With the collector off, the main loop's
    dropping its reference frees it; the read-ahead batches still come first."""
    import gc
    import weakref
    from types import SimpleNamespace

    from megatron_tp_overlap.integrations.megatron.replay import ReadAhead
    from megatron_tp_overlap.integrations.megatron.tuning import hand_over

    class Source:  # weak-referenceable, like a DataLoader iterator
        n = 0

        def __iter__(self):
            return self

        def __next__(self):
            self.n += 1
            return {"i": self.n}

    gc.disable()
    try:
        for as_list in (False, True):  # one iterator, or Megatron's list of them (virtual pipeline)
            src = Source()
            alive = weakref.ref(src)
            data = ReadAhead([src, None] if as_list else src, 2)
            assert [b["i"] for b in data.batches[0]] == [1, 2]
            tuned = SimpleNamespace(data_iterator=data.release())
            tuned.me, data.me = tuned, data  # as tuning's objects live on: in cycles
            main = hand_over(tuned)
            first = main[0] if as_list else main
            assert [next(first)["i"] for _ in range(3)] == [1, 2, 3]
            del src, first, main
            assert alive() is None, as_list
    finally:
        gc.enable()


def test_replay_keeps_a_rerun_data_iterator_in_place():
    class RerunDataIterator:  # same name as Megatron's: its type is checked by the rerun machine
        def __init__(self, it):
            self.iterable = it

        def __next__(self):
            return next(self.iterable)

    d = RerunDataIterator(itertools.count())
    main, r = attach_replay(d)
    assert main is d and isinstance(d.iterable, ReplayIterator)
    assert r.read_ahead(2) == [0, 1] and [next(d) for _ in range(3)] == [0, 1, 2]
    assert attach_replay(None) == (None, None)


def test_state_snapshot_restores_rng():
    import random

    import numpy as np

    m = torch.nn.Linear(2, 2)
    s = StateSnapshot.take([m])
    a = (random.random(), np.random.rand(), torch.rand(1).item())
    s.restore()
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == a


@pytest.mark.skipif(sys.version_info < (3, 12), reason="megatron-core >= 0.17 needs Python 3.12")
def test_flags_through_megatrons_parser(monkeypatch):
    pytest.importorskip("megatron.training.arguments")
    import megatron.training.arguments as margs

    from megatron_tp_overlap.integrations.megatron import launcher as integ

    monkeypatch.setattr(integ, "_installed", False)
    integ.install()
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "x",
            "--tensor-model-parallel-size",
            "2",
            "--tp-comm-overlap-autotune",
            "--num-layers",
            "2",
            "--hidden-size",
            "64",
            "--num-attention-heads",
            "4",
        ],
    )
    with pytest.raises(SystemExit, match="needs --tp-comm-overlap"):
        margs.parse_args()


class FakeTracker:
    """Mimics Megatron's CudaRNGStatesTracker: set_states keeps the dict, fork replaces entries."""

    def __init__(self):
        self.states_ = {"model-parallel-rng": torch.tensor([1])}

    def get_states(self):
        return {k: v for k, v in self.states_.items()}

    def set_states(self, states):
        self.states_ = states

    def fork(self):
        self.states_["model-parallel-rng"] = self.states_["model-parallel-rng"] + 1


def test_state_snapshot_restores_the_tp_rng_tracker_every_time():
    tr = FakeTracker()
    s = StateSnapshot.take([], tracker=tr)
    for _ in range(3):  # restore, run a step (forks), restore again: always back to the saved state
        tr.fork()
        tr.fork()
        s.restore()
        assert tr.states_["model-parallel-rng"].item() == 1


def test_state_check_sees_every_kind_of_change():
    from megatron_tp_overlap.integrations.megatron import StateCheck

    model = [torch.nn.Linear(4, 4)]
    opt = torch.optim.Adam(model[0].parameters())
    model[0](torch.randn(2, 4)).sum().backward()
    opt.step()  # creates optimizer state
    tr = FakeTracker()
    check = StateCheck(model, opt, tracker=tr)
    assert check.mismatches() == []
    with torch.no_grad():
        model[0].weight[0, 0] += 1e-7
    opt.state[model[0].weight]["exp_avg"][0, 0] += 1.0
    model[0].bias.grad.zero_()
    torch.rand(1)
    tr.fork()
    bad = check.mismatches()
    assert {"param 0.weight", "grad 0.bias", "CPU RNG state", "TP RNG tracker 'model-parallel-rng'"} <= set(bad)
    assert any(b.startswith("optimizer state") for b in bad)


def test_state_check_sees_fp8_metadata_and_data_position():
    from types import SimpleNamespace

    from megatron_tp_overlap.integrations.megatron import StateCheck

    lin = torch.nn.Linear(2, 2)
    lin.fp8_meta = {"scaling_fwd": SimpleNamespace(amax_history=torch.zeros(4, 3), scale=torch.ones(3))}
    model = [torch.nn.Sequential(lin)]
    r = ReplayIterator(
        iter([{"tokens": torch.arange(4)}, {"tokens": torch.arange(4) + 4}, {"tokens": torch.arange(4) + 8}])
    )
    r.read_ahead(2)
    check = StateCheck(model, torch.optim.SGD(lin.parameters(), lr=0.1), tracker=FakeTracker(), replays=[r, None])
    assert check.mismatches() == []
    assert check.kinds_checked()["fp8"] == 2 and check.kinds_checked()["read-ahead batches"] == 2
    r.read_ahead(2)[0]["tokens"] = torch.zeros(4)  # a shallow copy: replacing an entry leaves the buffer alone
    assert check.mismatches() == []
    lin.fp8_meta["scaling_fwd"].amax_history[0, 0] = 1.0
    next(r)  # the main loop would miss a batch
    assert check.mismatches() == ["data iterator position (read-ahead batches)", "fp8 0.0.scaling_fwd.amax_history"]


def test_deterministic_with_overlap_sets_megatrons_determinism(monkeypatch):
    from megatron_tp_overlap.integrations.megatron.launcher import deterministic_with_overlap

    for k in ("NCCL_ALGO", "NVTE_ALLOW_NONDETERMINISTIC_ALGO", "CUBLAS_WORKSPACE_CONFIG"):
        monkeypatch.delenv(k, raising=False)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        deterministic_with_overlap()
        assert torch.are_deterministic_algorithms_enabled()
        import os

        assert os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "0" and os.environ["NCCL_ALGO"] == "Ring"
    finally:
        torch.use_deterministic_algorithms(was)


def test_fp8_metadata_created_during_tuning_is_reset_to_fresh():
    from types import SimpleNamespace

    from megatron_tp_overlap.integrations.megatron import StateCheck

    lin = torch.nn.Linear(2, 2)
    model = [torch.nn.Sequential(lin)]
    snap = StateSnapshot.take(model, tracker=FakeTracker())
    check = StateCheck(model, torch.optim.SGD(lin.parameters(), lr=0.1), tracker=FakeTracker())
    # the first FP8 forward (a trial step) creates the metadata and records amaxes in it
    lin.fp8_meta = {"scaling_fwd": SimpleNamespace(amax_history=torch.full((4, 3), 2.0), scale=torch.full((3,), 0.5))}
    assert "fp8 0.0.scaling_fwd.amax_history" in check.mismatches()
    snap.restore()
    assert torch.all(lin.fp8_meta["scaling_fwd"].amax_history == 0) and torch.all(
        lin.fp8_meta["scaling_fwd"].scale == 1
    )
    assert check.mismatches() == []


def test_tuning_results_go_to_megatrons_tensorboard_writer(monkeypatch):
    import types
    from types import SimpleNamespace

    from megatron_tp_overlap.integrations.megatron.tuning import _tensorboard

    class Writer:
        def __init__(self):
            self.scalars, self.texts, self.flushed = {}, {}, False

        def add_scalar(self, tag, v, step):
            self.scalars[tag] = v

        def add_text(self, tag, v, step):
            self.texts[tag] = v

        def flush(self):
            self.flushed = True

    writer = Writer()
    fake = types.ModuleType("megatron.training")
    fake.get_tensorboard_writer = lambda: writer
    monkeypatch.setitem(sys.modules, "megatron.training", fake)
    if "megatron" not in sys.modules:
        monkeypatch.setitem(sys.modules, "megatron", types.ModuleType("megatron"))
    res = SimpleNamespace(
        wall_s=12.5,
        summary="table",
        search=SimpleNamespace(
            contenders=[
                SimpleNamespace(name="autotuned", median=10.0, samples=[10.0]),
                SimpleNamespace(name="skipped", median=None, samples=[]),
            ]
        ),
    )
    _tensorboard(res)
    assert writer.scalars == {"tp-overlap-autotune/step-ms/autotuned": 10.0, "tp-overlap-autotune/tuning-seconds": 12.5}
    assert "table" in writer.texts["tp-overlap-autotune/summary"] and writer.flushed
    fake.get_tensorboard_writer = lambda: None  # ranks without a writer: nothing to do
    _tensorboard(res)


def test_iteration_log_records_time_and_exact_losses_then_calls_megatrons(tmp_path, monkeypatch):
    import json

    from megatron_tp_overlap.integrations.megatron.launcher import IterationLog

    monkeypatch.setenv("RANK", "1")
    seen = []
    log = IterationLog(tmp_path / "it").wrap(lambda loss_dict, total, lr, it, *r, **kw: seen.append(it) or "ret")
    assert log({"lm loss": torch.tensor(0.1 + 0.2)}, {}, 1e-4, 7) == "ret" and seen == [7]
    log({}, {}, 1e-4, 8)  # Megatron's skipped iterations carry no losses: nothing to record
    (row,) = [json.loads(x) for x in (tmp_path / "it.rank1").read_text().splitlines()]
    assert row["iteration"] == 7 and float(row["lm loss"]) == float(torch.tensor(0.1 + 0.2).item()) and row["t"] > 0


def test_fatal_checks_are_paused_during_trials_and_restored():
    from megatron_tp_overlap.integrations.megatron.launcher import _fatal_checks_paused

    args = argparse.Namespace(check_for_nan_in_loss_and_grad=True, check_for_spiky_loss=True)
    with pytest.raises(RuntimeError), _fatal_checks_paused(args):
        assert not args.check_for_nan_in_loss_and_grad and not args.check_for_spiky_loss
        raise RuntimeError("a trial raised")
    assert args.check_for_nan_in_loss_and_grad and args.check_for_spiky_loss


def test_run_script_explains_itself_and_refuses_a_missing_script(capsys):
    from megatron_tp_overlap.integrations.megatron.launcher import run_script

    with pytest.raises(SystemExit) as e:
        run_script(["--help"])
    assert e.value.code == 0 and "--iteration-log" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        run_script(["--iteration-log", "x", "nope.py", "--tp-comm-overlap"])
    assert e.value.code == 2 and "training script not found: nope.py" in capsys.readouterr().err


def test_output_problems_name_a_directory_and_an_unwritable_place(tmp_path):
    from megatron_tp_overlap.integrations.megatron.flags import output_problems

    (p,) = output_problems(tmp_path, "--tp-comm-overlap-autotune-output")
    assert "is a directory" in p and str(tmp_path / "tp_comm_overlap_tuned.yaml") in p
    (p,) = output_problems(Path(__file__) / "x.yaml", "--tp-comm-overlap-autotune-output")
    assert "cannot write the tuned YAML there" in p and "is not a folder" in p
    assert output_problems(tmp_path / "new" / "x.yaml", "o") == []


def test_selective_recompute_of_the_attention_core_alone_is_accepted(tmp_path):
    out = str(tmp_path / "x.yaml")
    assert (
        check_arguments(
            ns(recompute_granularity="selective", recompute_modules=None, tp_comm_overlap_autotune_output=out)
        )
        == []
    )
    assert (
        check_arguments(
            ns(recompute_granularity="selective", recompute_modules=["core_attn"], tp_comm_overlap_autotune_output=out)
        )
        == []
    )


def test_sigterm_during_tuning_interrupts_like_ctrl_c_and_the_handler_comes_back():
    import os
    import signal

    from megatron_tp_overlap.integrations.megatron.tuning import interrupt_on_sigterm

    before, seen = signal.getsignal(signal.SIGTERM), []
    with pytest.raises(KeyboardInterrupt, match=f"signal {int(signal.SIGTERM)}"), interrupt_on_sigterm(seen):
        os.kill(os.getpid(), signal.SIGTERM)
    assert seen == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) == before


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs Linux /proc")
def test_an_output_nothing_can_be_created_in_is_refused_also_for_root(tmp_path):
    """os.access says yes to root for /proc; the check tries instead (issue 21: /proc/nope/tuned.yaml ran 71.7 s of
    tuning, then raised FileNotFoundError). A place that can be created is accepted and nothing is left behind."""
    from megatron_tp_overlap.integrations.megatron.flags import output_problems

    (p,) = output_problems(Path("/proc/nope/tuned.yaml"), "--tp-comm-overlap-autotune-output")
    assert "cannot write the tuned YAML there" in p and "cannot create /proc/nope" in p
    (p,) = output_problems(Path("/proc/tuned.yaml"), "o")
    assert "cannot create files in /proc" in p
    assert output_problems(tmp_path / "a" / "b" / "t.yaml", "o") == [] and list(tmp_path.iterdir()) == []
    assert output_problems(tmp_path / "t.yaml", "o") == [] and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", ["trial", "topology", "interrupt"])
def test_a_failed_tuning_trains_on_and_only_an_interrupt_ends_the_run(monkeypatch, kind):
    """``_search``: every trial failing or a topology mismatch falls back to the starting config (the run trains on);
    Ctrl-C still ends it. (The interrupt clause once came first and caught the failures too, ending the run.)"""
    import types

    import torch

    from megatron_tp_overlap.engine.search import TrialFailed
    from megatron_tp_overlap.engine.topology import TopologyMismatch
    from megatron_tp_overlap.integrations.megatron import tuning
    from megatron_tp_overlap.ub.config import UbConfig

    raised = {"trial": TrialFailed("every trial failed"), "topology": TopologyMismatch("ranks differ")}
    applied, lines, closed = [], [], []

    class Tuner:
        switcher = types.SimpleNamespace(apply=applied.append, close=lambda: closed.append(True))

        def tune(self):
            raise raised.get(kind) or KeyboardInterrupt()

    monkeypatch.setattr(tuning, "_make_tuner", lambda *a, **k: Tuner())
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a: 0)
    steps = types.SimpleNamespace(zero=lambda: None, snapshot=types.SimpleNamespace(restore=lambda: None))
    failure: list[str] = []
    search = lambda: tuning._search(  # noqa: E731
        None, steps, None, None, None, UbConfig(), contextlib.nullcontext, lines.append, failure
    )
    if kind == "interrupt":
        with pytest.raises(KeyboardInterrupt):
            search()
        assert "tuning interrupted" in lines[-1]
        return
    assert search() == (None, None)
    assert "training with the starting config" in lines[-1]
    assert [c.ub for c in applied] == ([UbConfig()] if kind == "trial" else [])
    assert closed == ([True] if kind == "trial" else [])  # its bootstrap groups go with its last switch
    assert failure == [{"trial": "every trial failed", "topology": "cannot tune this layout: ranks differ"}[kind]]


def test_an_undecided_config_is_verified_in_the_run_and_written_only_when_the_run_shows_the_gain(tmp_path, monkeypatch):
    """Tuning kept the reference because its best config was ahead but not beyond the interval its budget allowed:
    that config goes live and is verified on real iterations; the YAML (written with the reference) changes to it
    only when the verification keeps it, atomically, with the cache; when it does not, nothing is rewritten."""
    from types import SimpleNamespace

    from test_cache import KEY

    from megatron_tp_overlap.engine import paired
    from megatron_tp_overlap.engine.options import TuneOptions
    from megatron_tp_overlap.engine.space import TuningConfig
    from megatron_tp_overlap.engine.verify import Verdict
    from megatron_tp_overlap.integrations.megatron import tuning as mt
    from megatron_tp_overlap.integrations.megatron.flags import Recipe
    from megatron_tp_overlap.ub.config import GemmOverlapConfig, UbConfig, load_yaml

    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 0)
    ref = TuningConfig(UbConfig(), frozenset(), "reference")
    cand = TuningConfig(UbConfig().with_entry("fc2_fprop", GemmOverlapConfig(method="pipeline", num_sm=8)), label="x")
    opts = TuneOptions(verify_iters=96)

    def setup():
        out = tmp_path / "tuned.yaml"
        tuned = mt.Tuned(ref, None, out, Recipe(str(out), [], [], {}))
        assert mt._write_yaml(out, ref, mt._key_meta(KEY), print)  # as tune() wrote it
        applied, puts, logs = [], [], []
        cache = SimpleNamespace(put=lambda *a: puts.append(a))
        switcher = SimpleNamespace(apply=applied.append, close=lambda: applied.append("closed"))
        v = mt._verification(tuned, ref.ub, switcher, opts, KEY, cache, logs.append, None, cand)
        return tuned, v, applied, puts, logs

    assert (
        mt._verification(setup()[0], ref.ub, SimpleNamespace(apply=print), opts, KEY, None, print, None, None) is None
    )
    iv = paired.Interval(2.0, 1.0, 3.0, 12, 0.99)
    tuned, v, applied, puts, logs = setup()
    assert v.tuned == cand and v.reference == ref and applied == [cand]  # the undecided config runs first
    assert any("ahead of the starting config" in m for m in logs)
    v.on_verdict(Verdict(cand, iv, 200.0, 198.0, 120, "kept", reverted=False))
    assert applied == [cand, "closed"]  # no switch after the verdict: the switcher's bootstrap groups go
    assert tuned.config == cand and load_yaml(tuned.yaml_path) == cand.ub and puts[0][1] == cand.ub
    assert "the in-run verification measured the gain" in puts[0][3]["tuned"]["chosen"]
    assert tuned.yaml_path.with_suffix(".recipe.txt").exists()

    tuned, v, applied, puts, logs = setup()
    before = tuned.yaml_path.read_text()
    v.on_verdict(Verdict(ref, paired.Interval(0.1, -1.0, 1.2, 24, 0.95), 200.0, 200.0, 434, "back", reverted=True))
    assert tuned.config == ref and tuned.yaml_path.read_text() == before and puts == []  # nothing to rewrite

    # a config the search decided for, sent back by the run: the YAML goes back to the starting config
    out = tmp_path / "decided.yaml"
    tuned = mt.Tuned(cand, None, out, Recipe(str(out), [], [], {}))
    assert mt._write_yaml(out, cand, mt._key_meta(KEY), print)
    applied, puts = [], []
    cache = SimpleNamespace(put=lambda *a: puts.append(a))
    switcher = SimpleNamespace(apply=applied.append, close=lambda: None)
    v = mt._verification(tuned, ref.ub, switcher, opts, KEY, cache, print, None, None)
    assert v.tuned == cand and applied == []  # already live
    v.on_verdict(Verdict(ref, paired.Interval(0.1, -1.0, 1.2, 24, 0.95), 200.0, 200.0, 434, "back", reverted=True))
    assert tuned.config == ref and load_yaml(out) == ref.ub and "found no gain" in puts[0][3]["tuned"]["chosen"]


@pytest.mark.parametrize(
    "run_mb, pp, chunks, asked, group, expected",
    [
        (8, 1, 1, 0, 0, 1),  # no pipeline: one micro-batch
        (8, 4, 1, 0, 0, 4),  # 1F1B: a full pipeline
        (2, 4, 1, 0, 0, 2),  # never more than the run has
        (64, 4, 2, 0, 0, 4),  # interleaved: one micro-batch group (the pipeline size), not the run's 64
        (64, 4, 5, 0, 6, 6),  # interleaved with --microbatch-group-size-per-virtual-pipeline-stage 6
        (64, 2, 2, 3, 0, 2),  # asked 3 under VP: 1 left over a group of 2 would be a bubble the schedule refuses
        (64, 4, 2, 6, 4, 4),  # asked 6: a group of 4 and a remainder of 2 < PP 4 -> 4
        (64, 4, 2, 1, 4, 4),  # asked fewer than a group: one group
        (8, 1, 1, 3, 0, 3),  # asked
        (8, 1, 1, 20, 0, 8),  # asked, at most the run's
    ],
)
def test_trial_steps_run_the_fewest_micro_batches_the_schedule_takes(run_mb, pp, chunks, asked, group, expected):
    from megatron_tp_overlap.integrations.megatron.tuning import trial_microbatches

    assert trial_microbatches(run_mb, pp, chunks, asked, group) == expected


def test_a_failed_tuning_replaces_an_earlier_report_with_one_that_says_so(tmp_path, monkeypatch):
    """The YAML, report and recipe are one unit: when tuning found nothing (every trial failed), the YAML holds the
    starting config and the report beside it says why, instead of an earlier run's report naming another config.
    No cache entry is made."""
    import json
    from types import SimpleNamespace

    from test_cache import KEY

    from megatron_tp_overlap.engine.space import TuningConfig
    from megatron_tp_overlap.integrations.megatron import tuning as mt
    from megatron_tp_overlap.tools.research.winners import read_report
    from megatron_tp_overlap.ub.config import UbConfig

    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 0)
    out = tmp_path / "tuned.yaml"
    out.with_suffix(".report.json").write_text(json.dumps({"decision": {"chosen": "autotuned"}, "meta": {}}))
    ref = TuningConfig(UbConfig(), frozenset(), "reference")
    tuned = mt.Tuned(ref, None, out, mt._recipe(ref, frozenset({"fc2_fprop"}), out, 2))
    tuned.notes.append("tuning failed (every trial failed: timeout): training with the starting config")
    puts = []
    mt._write_outputs(tuned, KEY, SimpleNamespace(put=lambda *a: puts.append(a)), 12.5, print)
    report = json.loads(out.with_suffix(".report.json").read_text())
    assert report["decision"]["chosen"] == "reference" and "every trial failed: timeout" in report["decision"]["reason"]
    assert report["meta"]["wall_s"] == 12.5 and report["recipe"]["add_flags"] and puts == []
    assert read_report(out, report).chosen == "reference"  # the tools read it like any report


def test_recompute_and_every_cuda_graph_mode_are_tuned_not_refused(tmp_path):
    out = str(tmp_path / "x.yaml")
    for kw in (
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
        dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
        dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]),
        dict(cuda_graph_impl="local"),
        dict(cuda_graph_impl="transformer_engine", recompute_granularity="selective", recompute_modules=["mlp"]),
        dict(cuda_graph_impl="full_iteration", recompute_granularity="full", recompute_method="uniform"),
    ):
        assert check_arguments(ns(tp_comm_overlap_autotune_output=out, **kw)) == [], kw
    full = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    (p,) = check_arguments(ns(tp_comm_overlap_autotune_output=out, cuda_graph_impl="transformer_engine", **full))
    assert 'Megatron-LM refuses it itself (TransformerConfig: "full recompute is only supported' in p
