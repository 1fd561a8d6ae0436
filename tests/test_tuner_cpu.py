"""The Autotuner end to end on CPU: fake TE modules that advance a synthetic clock per the live config (exact,
known times), and (for rank agreement) 2 processes over gloo."""

import json
import os

import fakes
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_tp_overlap.engine import switcher as ub_runtime
from megatron_tp_overlap.engine.numerics import Fingerprint
from megatron_tp_overlap.engine.report import write_report
from megatron_tp_overlap.engine.search import SearchOptions
from megatron_tp_overlap.engine.space import TuningConfig
from megatron_tp_overlap.engine.tuner import Autotuner
from megatron_tp_overlap.errors import ConfigError
from megatron_tp_overlap.ub.config import GemmOverlapConfig, UbConfig


def make_tuner(layers=1, scale=3.0, **kw):
    model = fakes.fake_model(layers=layers, scale=scale)
    x = torch.randn(4, 8, requires_grad=True)

    def step():
        model(x).sum().backward()

    fp = Fingerprint()

    def fingerprint():
        model.zero_grad(set_to_none=True)
        y = model(x)
        y.sum().backward()
        return fp([y, *(p.grad for p in model.parameters())])

    kw.setdefault("options", SearchOptions(max_seconds=120, max_steps=5000))
    return Autotuner(
        model,
        step,
        fakes.fake_init_args(),
        event_factory=fakes.SimEvent,
        timing_device="cpu",
        clock=fakes.CLOCK.seconds,
        sleep=fakes.CLOCK.sleep,
        verify_fn=fingerprint,
        log=lambda *a: None,
        **kw,
    ), model


def test_autotuner_finds_the_designed_optimum_and_leaves_it_applied(fake_te, tmp_path):
    tuner, model = make_tuner()
    res = tuner.tune()
    best = res.best
    # fakes.gemm_cost_ms: aggregate ring_exchange is best for AG GEMMs (0.4 vs 0.6 ms), num_sm=8 for
    # bulk/pipeline (0.3 ms), 4 splits for pipeline; the synthetic clock makes every time exact.
    from megatron_tp_overlap.engine.space import apply, build_space

    space = build_space(tuner.topology, tuner.ctx, [UbConfig()])
    for g, opts in space.items():
        best_cost = min(fakes.gemm_cost_ms(g, apply(TuningConfig(), o, tuner.topology).ub, o.enabled) for o in opts)
        assert fakes.gemm_cost_ms(g, best.ub, g not in best.disabled) == pytest.approx(best_cost), (g, best.ub.get(g))
    assert not best.disabled
    assert res.search.best_name == "autotuned"
    assert fake_te.cfg == best.ub  # the winner is live
    assert res.switches == tuner.switcher.reinits >= 10
    rep = res.report
    assert {"meta", "decision", "trials", "summary", "per_gemm_choices", "contenders"} <= set(rep)
    assert rep["trials"][0]["phase"] == "baseline" and any(t["phase"] == "confirm" for t in rep["trials"])
    assert "step" in res.summary and "reference ms" in res.summary
    write_report(tmp_path / "r.json", rep)
    assert json.loads((tmp_path / "r.json").read_text())["decision"]["chosen"] == "autotuned"


def test_bad_reference_config_fails_before_any_step(fake_te):
    bad = UbConfig().with_entry("qkv_fprop", GemmOverlapConfig(method="pipeline"))
    with pytest.raises(ConfigError, match="qkv_fprop.method"):
        make_tuner(reference=bad)
    assert fake_te.calls == []


def _rank_main(rank: int, world: int, init_file: str, out_dir: str, layout: str = "tp") -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    te = fakes.FakeTE()
    fakes.STATE = te
    ub_runtime._te_base = lambda: te
    torch.manual_seed(0)
    if (
        world == 4
    ):  # TP=2 x DP=2 (or x PP=2) as Megatron lays it out; trials agree over WORLD (every rank runs every trial)
        tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        assert dist.get_world_size(tp_groups[rank // 2]) == 2 and dist.get_world_size(dp_groups[rank % 2]) == 2
    # TP=2 x PP=2 with unequal stages: the first stage holds 3 layers, the second 1 (same module kinds); the slower
    # stage sets the step, so the second stage's penalty must outweigh the first stage's 3 layers to count
    unequal = layout == "tp_pp_unequal"
    layers = (3 if rank < 2 else 1) if unequal else 1
    if rank == world - 1:  # this rank alone (the last; in the second DP replica or pipeline stage at 4) would
        for g in ("qkv_dgrad", "qkv_wgrad", "fc1_dgrad", "fc1_wgrad"):  # prefer another num_sm
            fakes.PENALTY_MS[(g, "bulk", 8)] = 2.0 if unequal else 0.6
    tuner, _ = make_tuner(layers=layers, scale=2.0, options=SearchOptions(max_seconds=60, max_steps=3000))
    res = tuner.tune()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(
            {
                "best": res.best.to_dict(),
                "trials": len(res.search.trials),
                "choices": {g: c["option"] for g, c in res.search.choices.items()},
            },
            f,
        )
    dist.destroy_process_group()


@pytest.mark.parametrize("world,layout", [(4, "tp"), (4, "tp_pp_unequal")])
def test_ranks_agree_over_gloo(tmp_path, world, layout):
    """TP=2 x DP=2 (a TP=2 group within it), TP=2 x PP=2 with unequal stages: one rank's slower option is seen by every rank; every rank
    takes the same decisions."""
    mp.start_processes(
        _rank_main,
        args=(world, str(tmp_path / "init"), str(tmp_path), layout),
        nprocs=world,
        join=True,
        start_method="fork",
    )
    r0, *others = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world))
    assert all(r == r0 for r in others)
    # MAX over ranks: the last rank's penalty on num_sm=8 is seen by all, so none picks it
    for g in ("qkv_dgrad", "fc1_dgrad"):
        assert r0["best"]["ub_cfgs"].get(g, {}).get("num_sm") != 8


def alternating(fp, factor):
    """``fp`` scaled by 1 and ``factor`` on alternate calls: a step that does not reproduce itself."""
    calls = []

    def f():
        calls.append(1)
        return fp() * (factor if len(calls) % 2 else 1.0)

    return f


def test_numerics_guard_turns_itself_off_when_the_step_is_not_reproducible(fake_te):
    tuner, model = make_tuner()
    tuner.verify_fn = alternating(tuner.verify_fn, 2.0)  # like dropout with a fresh RNG each call
    res = tuner.tune()
    assert "numerics guard off" in res.report["meta"]["numerics_guard"]
    assert res.search.best_name == "autotuned"  # not every option rejected


def test_numerics_guard_follows_a_small_run_to_run_spread(fake_te):
    """Non-deterministic kernels: two identical steps 1.3% apart (Megatron-Bridge on H200 without
    deterministic mode). The guard stays on with 3 x that bound, and still rejects an O(1) error."""
    tuner, _ = make_tuner()
    base = alternating(tuner.verify_fn, 1.013)

    def fingerprint():
        f = base()
        cur = tuner.switcher.current
        return f * 2.0 if cur is not None and WRONG in cur.describe() else f

    tuner.verify_fn = fingerprint
    res = tuner.tune()
    num = res.report["meta"]["numerics_rel_error"]
    assert 0.005 < num["no overlap (repeat)"] < 0.03
    assert res.report["meta"]["numerics_guard"].startswith("on")
    assert tuner.tolerance() >= 3 * num["no overlap (repeat)"]
    phases = res.report["meta"]["reinit_phases_s_median"]  # where a switch's seconds go, in every report
    # every phase present; their sizes are wall-clock seconds of this machine, which a test does not judge
    assert set(phases) == {"collect", "sync", "barrier", "destroy", "initialize"} and min(phases.values()) >= 0
    assert WRONG not in res.best.describe()


def test_numerics_guard_floor_is_recorded_when_reproducible(fake_te):
    tuner, _ = make_tuner()
    res = tuner.tune()
    assert res.report["meta"]["numerics_guard"].startswith("on")
    assert res.report["meta"]["numerics_rel_error"]["no overlap (repeat)"] == 0.0
    # what the space leaves out is in the report, with why; none of it was searched
    assert "fp8_buf" in res.report["meta"]["left_out_of_space"]
    assert not any("fp8_buf" in label for labels in res.report["meta"]["space"].values() for label in labels)


WRONG = "fc2_fprop: pipeline sm=8 cga=2 splits=4"  # the designed optimum of fakes.gemm_cost_ms


def test_numerics_guard_is_calibrated_by_the_reference_configs_own_deviation(fake_te):
    """Every userbuffers config rounds differently from no overlap (here 4%, as a deep model on H200
    shows); only a config that computes something else (here 100%) is rejected."""
    torch.manual_seed(0)  # the fake model's weights: the fingerprint's measure of a 4% scale depends on them
    tuner, _ = make_tuner()
    base = tuner.verify_fn

    def fingerprint():
        f = base()
        cur = tuner.switcher.current
        if cur is None or cur.disabled >= set(tuner.topology.active):
            return f  # no overlap: the reference
        return f * (2.0 if WRONG in cur.describe() else 1.04)

    tuner.verify_fn = fingerprint
    res = tuner.tune()
    num = res.report["meta"]["numerics_rel_error"]
    dev = num["reference config"]
    assert 0.03 < dev < 0.08  # a 4% scale as the fingerprint measures it
    assert tuner.tolerance() == pytest.approx(3 * dev) and f"{3 * dev:.3g}" in res.report["meta"]["numerics_guard"]
    assert WRONG not in res.best.describe()
    assert any(WRONG in k and v > 3 * dev for k, v in num.items())
    assert res.search.best_name == "autotuned"  # the 4% configs were accepted (a fixed 2% bound rejects them all)


def test_numerics_tolerance_is_capped():
    t = Autotuner.__new__(Autotuner)
    t.verify_rtol, t.numerics = 2e-2, {"reference config": 0.9}
    assert t.tolerance() == Autotuner.MAX_TOLERANCE
    t.numerics = {}
    assert t.tolerance() == 2e-2
    t.numerics = {"no overlap (repeat)": 0.013, "reference config": 0.004}
    assert t.tolerance() == pytest.approx(0.039)


def test_the_closest_preset_is_a_whole_config_contender(fake_te):
    from megatron_tp_overlap.engine.space import SpaceSpec

    tuner, _ = make_tuner()
    pri = tuner._whole_config_priors()
    assert len(pri) == 1
    ((name, cfg),) = pri.items()
    assert name.startswith("preset userbuffers_") and len(cfg.ub)
    res = tuner.tune()
    assert any(c.name == name and c.samples for c in res.search.contenders)  # measured in the confirmation
    # a preset the run could not reproduce (dgrad mode fixed by the run's flags) is left out
    rs_dgrad = any(cfg.ub.dgrad_is_reduce_scatter(g) for g in ("qkv_dgrad", "fc1_dgrad"))
    spec = SpaceSpec(include_rs_dgrad=not rs_dgrad, include_bulk_dgrad=rs_dgrad)
    assert make_tuner(space_spec=spec)[0]._whole_config_priors() == {}
    assert make_tuner(gemms={"fc2_fprop"})[0]._whole_config_priors() == {}


def test_a_reference_outside_the_dgrad_mode_is_moved_into_it(fake_te):
    """TE's default runs qkv/fc1 dgrad as bulk all-gathers; a reduce-scatter dgrad search (Megatron's
    --tp-comm-overlap-rs-dgrad, `sweep --dgrad-mode reduce-scatter`) must not return it, even unbeaten."""
    from megatron_tp_overlap.engine.space import SpaceSpec

    logs = []
    tuner, _ = make_tuner(
        space_spec=SpaceSpec(include_bulk_dgrad=False, include_off=False),
        allow_overlap_off=False,
        options=SearchOptions(max_seconds=60, max_steps=300),
    )
    tuner.log = logs.append
    active = [g for g in ("qkv_dgrad", "fc1_dgrad") if g in tuner.topology.active]
    assert active
    res = tuner.tune()
    for g in active:
        assert res.best.ub.dgrad_is_reduce_scatter(g) and g not in res.best.disabled, (g, res.best.ub.get(g))
    assert any("in a mode this search excludes" in m for m in logs)
    te_default = next(c for c in res.search.contenders if c.name == "TE default")
    assert te_default.samples and res.search.best_name != "TE default"  # timed for the report, never chosen
    # a reference already in the mode is left as it is
    bulk_only = make_tuner(space_spec=SpaceSpec(include_rs_dgrad=False))[0]
    assert bulk_only.in_dgrad_mode(UbConfig(), {}) == UbConfig()
    # a GEMM this tuner does not tune (gemms=...) keeps the reference's setting, without a warning
    quiet = []
    rs_subset = make_tuner(space_spec=SpaceSpec(include_bulk_dgrad=False), gemms={"fc2_fprop"})[0]
    rs_subset.log = quiet.append
    assert rs_subset.in_dgrad_mode(UbConfig(), {}) == UbConfig() and not quiet


def test_the_moved_reference_must_pass_the_numerics_check(fake_te):
    """The first reduce-scatter qkv_dgrad option computes wrong gradients (as TE 2.20's pipeline dgrad did
    on H200): the starting point skips it for the next one that matches no overlap."""
    from megatron_tp_overlap.engine.space import SpaceSpec, build_space

    logs = []
    spec = SpaceSpec(include_bulk_dgrad=False, include_off=False)
    tuner, _ = make_tuner(space_spec=spec, allow_overlap_off=False)
    tuner.log = logs.append
    from megatron_tp_overlap.ub.config import parse_ub_cfgs

    prior = parse_ub_cfgs({"qkv_dgrad": {"method": "pipeline", "num_sm": 16, "num_splits": 4, "cga_size": 2}})
    space = build_space(tuner.topology, tuner.ctx, [prior], spec)  # a preset's pipeline dgrad, then the grid
    first, second = [o for o in space["qkv_dgrad"] if o.enabled][:2]
    assert first.cfg.method == "pipeline" and second.cfg.method == "ring_exchange"
    good_fp = tuner.verify_fn

    def fingerprint():
        fp = good_fp()
        live = fake_te.cfg.get("qkv_dgrad")
        return fp * 3.0 if live is not None and live == first.cfg else fp

    tuner.verify_fn = fingerprint
    moved = tuner.in_dgrad_mode(UbConfig(), space)
    assert moved.get("qkv_dgrad") == second.cfg and moved.dgrad_is_reduce_scatter("qkv_dgrad")
    assert any(f"qkv_dgrad: {first.label} left out as the starting point" in m for m in logs)
    assert tuner.numerics["reference config"] < 0.1  # calibrated on the given reference, not the wrong one


def _stage_main(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """4 ranks whose stages differ: ranks 0, 1 hold whole layers, rank 2 attention only, rank 3 no overlap module."""
    from megatron_tp_overlap.engine.topology import TopologyMismatch

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    te = fakes.FakeTE()
    fakes.STATE = te
    ub_runtime._te_base = lambda: te
    tuner, model = make_tuner()
    if rank >= 2:  # rank 3: e.g. an embedding-only pipeline stage
        stage = [fakes.LayerNormLinear(8, "qkv"), fakes.Linear(8, "proj")] if rank == 2 else [torch.nn.Linear(8, 8)]
        tuner = Autotuner(
            torch.nn.Sequential(*stage),
            lambda: None,
            fakes.fake_init_args(),
            event_factory=fakes.SimEvent,
            timing_device="cpu",
            clock=fakes.CLOCK.seconds,
            log=lambda *a: None,
        )
    try:
        tuner.tune()
        outcome = "tuned"
    except TopologyMismatch as e:
        outcome = str(e)
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(f"{outcome}\n{len(te.calls)}")
    dist.destroy_process_group()


def test_ranks_holding_different_modules_are_refused_together_before_any_trial(tmp_path):
    mp.start_processes(
        _stage_main, args=(4, str(tmp_path / "init"), str(tmp_path)), nprocs=4, join=True, start_method="fork"
    )
    outcomes = [(tmp_path / f"rank{r}.txt").read_text().split("\n") for r in range(4)]
    assert len({o[0] for o in outcomes}) == 1  # the same error on every rank
    message = outcomes[0][0]
    assert "ranks 0, 1: modules qkv(column), proj(row), fc1(column), fc2(row)" in message
    assert "ranks 2: modules qkv(column), proj(row)" in message and "ranks 3: modules none" in message
    assert all(o[1] == "0" for o in outcomes)  # no rank switched userbuffers configs: refused before any trial


@pytest.mark.parametrize("seconds", [0.3, 1.0, 3.0])
def test_the_time_budget_is_a_hard_cap_numerics_checks_and_the_final_switch_included(fake_te, seconds):
    tuner, _ = make_tuner(options=SearchOptions(max_seconds=seconds, max_steps=100_000))
    res = tuner.tune()
    step_s = max(t.step_ms for t in res.search.trials if t.step_ms) / 1e3
    assert res.wall_s <= seconds + step_s, (res.wall_s, step_s)


def test_a_second_tuning_of_the_same_model_sees_it_as_built_not_as_the_first_left_it(fake_te):
    """A tuning leaves its chosen flags on the modules (a GEMM off, qkv dgrad flipped to reduce-scatter, which also
    drops qkv wgrad's bulk overlap). A second tuner of the same model (a benchmark's repeat) once discovered those
    flags: a smaller space and a reference that was not the starting config. It must see the model as built."""
    from megatron_tp_overlap.engine.topology import find_overlap_modules

    first, model = make_tuner()
    built = {m.path: dict(m.built_flags) for m in first.modules}
    flipped = UbConfig().with_entry("qkv_dgrad", GemmOverlapConfig(method="ring_exchange"))
    first.switcher.apply(TuningConfig(flipped, frozenset({"fc1_dgrad"}), "left by a tuning"))
    assert {m.path: {k: getattr(m.module, k) for k in m.built_flags} for m in first.modules} != built

    again = find_overlap_modules(model)
    assert {m.path: m.built_flags for m in again} == built
    second = Autotuner(model, lambda: None, fakes.fake_init_args(), timing_device="cpu", log=lambda *a: None)
    assert second.topology == first.topology and {"qkv_wgrad", "fc1_dgrad"} <= second.topology.active
    second.switcher.apply(TuningConfig(UbConfig(), frozenset(), "reference"), force=True)
    assert {m.path: {k: getattr(m.module, k) for k in m.built_flags} for m in second.modules} == built
