"""benchmarks/studies/search_on_real_steps.py's pure parts: the delays it puts in reproduce the world's cost differences,
and a search's record is scored against the truth (a simulated run stands in for the real steps)."""

import importlib.util
import json
import os
import random
import statistics
import sys
from pathlib import Path

import pytest

from megatron_tp_overlap.engine.search import SearchOptions
from megatron_tp_overlap.engine.space import TuningConfig, all_off, apply, build_space
from megatron_tp_overlap.tools.research import decision_sim as sim
from megatron_tp_overlap.ub.config import UbConfig

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "studies" / "search_on_real_steps.py"
sys.path.insert(0, str(PATH.parent))
spec = importlib.util.spec_from_file_location("search_on_real_steps", PATH)
sr = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sr)

SPACE = build_space(sim.TOPO, sim.CTX, [UbConfig()])
REF = TuningConfig(UbConfig(), frozenset(), "reference")


def test_put_in_delays_differ_as_the_world_costs():
    """Per slot, the sleep is the excess of its GEMMs over their cheapest option; summed over slots, two configs
    differ by exactly what the world says, scaled to the real step."""
    rng = random.Random(3)
    for seed in range(20):
        world = sim.make_world(SPACE, 0.03, random.Random(seed))
        real = sr.RealSteps(None, [], sim.TOPO, None, 0.0, scale=2.5)
        real.start(world)
        configs = [REF, all_off(sim.TOPO, REF)]
        for _ in range(5):
            c = REF
            for g in rng.sample(sorted(SPACE), 4):
                c = apply(c, rng.choice(SPACE[g]), sim.TOPO)
            configs.append(c)
        configs.append(sim.best_config(world, SPACE, REF))
        for c in configs:
            put_in = sum(real.slot_excess_ms(c).values()) - sum(real.slot_excess_ms(REF).values())
            assert abs(put_in - 2.5 * (world.step_ms(c) - world.step_ms(REF))) < 1e-9
        assert min(sum(real.slot_excess_ms(c).values()) for c in configs) >= 0  # a sleep cannot be negative
        best = sum(real.slot_excess_ms(configs[-1]).values())  # not always 0: two fast options can exclude each other
        assert all(best <= sum(real.slot_excess_ms(c).values()) + 1e-9 for c in configs)


def test_an_moe_models_shared_experts_get_their_own_slots_and_the_delays_still_sum_to_the_world():
    """In an MoE model (a dense layer, MoE layers with a shared expert) the routed experts are left out, the shared
    experts' fc1/fc2 run the fc1/fc2 configs in slots of their own with only their AG/RS, and a GEMM's put-in excess
    is spread over the slots it runs in: the step's total is still the world's."""
    import torch

    from megatron_tp_overlap.engine.topology import build_topology

    class Chunk(torch.nn.Module):
        def __init__(self):
            super().__init__()
            names = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
            layer = (
                lambda *mlp: torch.nn.ModuleDict(  # noqa: E731
                    {
                        "self_attention": torch.nn.ModuleDict({n: torch.nn.Linear(2, 2) for n in names[:2]}),
                        "mlp": torch.nn.ModuleDict(dict(mlp)),
                    }
                )
            )
            two = lambda: torch.nn.ModuleDict({n: torch.nn.Linear(2, 2) for n in names[2:]})  # noqa: E731
            self.layers = torch.nn.ModuleList(
                [layer(*two().items())] + [layer(("experts", two()), ("shared_experts", two())) for _ in range(3)]
            )

    modules = sr.overlap_modules([Chunk()])
    assert sum(".experts." in m.path and "shared" not in m.path for m in modules) == 0
    topo = build_topology(modules)
    assert topo.active == sim.TOPO.active
    assert topo.slots()["shared_fc1.fwd"] == ("fc1_fprop",) and topo.slots()["shared_fc1.bwd"] == ()
    assert topo.slots()["fc1.bwd"] == ("fc1_dgrad", "fc1_wgrad")
    for seed in range(10):
        world = sim.make_world(SPACE, 0.03, random.Random(seed))
        real = sr.RealSteps(None, modules, topo, None, 0.0, scale=2.0)
        real.start(world)
        for c in (all_off(sim.TOPO, REF), sim.best_config(world, SPACE, REF)):
            put_in = sum(real.slot_excess_ms(c).values()) - sum(real.slot_excess_ms(REF).values())
            assert abs(put_in - 2.0 * (world.step_ms(c) - world.step_ms(REF))) < 1e-9


class SimulatedReal:
    """RealSteps' interface over the simulator's steps of ``scenario``."""

    topo, scale = sim.TOPO, 1.0

    def __init__(self, scenario: str = "iid", seed: int = 7):
        self.scenario, self.seed = scenario, seed

    slot_excess_ms = sr.RealSteps.slot_excess_ms  # the delays the real steps would put in

    def start(self, world) -> None:
        run = sim.SimulatedRun(world, self.scenario, random.Random(self.seed), 400)
        self.world, self.run, self.switches, self.live, self.gaps_ms, self.switched = world, run, 0, None, [], []

    def __call__(self, config, n, warmup):
        self.gaps_ms.append(float(len(self.gaps_ms)))  # a stand-in for the host ms before each call: its index
        self.switched.append(config != self.live)
        if config != self.live:
            self.live, self.switches = config, self.switches + 1
        return self.run(config, n, warmup)

    def measure_of(self, config, steps: int = 5) -> tuple[dict[str, float], float]:  # outside the search
        if getattr(self, "checks", (None,))[0] is not self.world:
            self.checks = (self.world, sim.SimulatedRun(self.world, self.scenario, random.Random(self.seed + 1), 400))
        m = self.checks[1](config, steps, 1)  # whole steps on their own noise, as RealSteps.measure_of
        return {s: statistics.fmean(v) for s, v in m.slot_ms.items() if v}, statistics.fmean(m.step_ms)

    step_ms_of, trial_of = sr.RealSteps.step_ms_of, sr.RealSteps.trial_of


def test_a_search_is_scored_against_the_truth():
    gain = sr.one_search(SimulatedReal(), 1001, 0.04)
    assert gain["kind"] == "gain" and 3.9 < gain["available_gain_pct"] <= 4.0 + 1e-9
    assert gain["realized"] > 0.8 and gain["excess_pct"] < 0 and not gain["false_winner"]
    assert gain["chosen"] != "reference" and gain["true_gain_of_decided_ms"] > 0
    assert gain["switches"] > 10 and gain["steps"] > 50
    # the gain as whole steps show it, before and after the search: the put-in one, within the steps' noise
    assert gain["gain_put_in_ms"] == round(gain["available_gain_pct"], 3)  # % of the simulator's 100 ms step, scale 1
    assert len(gain["gain_on_steps_ms"]) == 2
    assert all(abs(g - gain["gain_put_in_ms"]) < 0.5 for g in gain["gain_on_steps_ms"])
    # per slot, the delay the best config takes out of the reference's: together the world's gain
    assert abs(sum(b for b, _ in gain["slot_gain_ms"].values()) - gain["gain_put_in_ms"]) < 1e-3
    # per slot what the racing measured, as counts, and the runners-up that had fresh looks, by name
    assert all(isinstance(r["runners_up"], list) and isinstance(r["options"], int) for r in gain["per_slot"].values())
    equal = sr.one_search(SimulatedReal(), 5001, 0.0)
    assert equal["kind"] == "equal" and equal["realized"] is None and equal["available_gain_pct"] == 0
    assert equal["false_winner"] == (equal["chosen"] != "reference") and equal["gain_on_steps_ms"] == []
    blocks = gain["confirm_blocks"]
    assert [b[0] for b in blocks[:4]] == ["reference", "autotuned", "autotuned", "reference"]
    assert [b[1] for b in blocks[:8]] == [1, 1, 0, 1, 0, 1, 0, 1]  # after a switch / continuing its config
    assert all(b[3] > 0 for b in blocks)  # the rest of the step, for the rest guard
    assert set(gain["decision_rest_adjusted"]) == {"gain_ms", "ci_low_ms", "ci_high_ms", "n"}
    assert sr.gap_effect_ms([["a", 1, 10.0], ["a", 0, 9.0], ["b", 1, 12.0], ["b", 0, 11.5], ["b", 1, 12.0]]) == -0.75
    s = sr.summarize([gain, equal])
    assert s["runs_with_gain"] == 1 and s["equal_runs"] == 1 and s["realized_min"] == gain["realized"]
    assert s["worst_excess_pct"] == max(gain["excess_pct"], equal["excess_pct"])


def test_a_preset_world_scores_the_preset_and_each_variant_runs_on_the_same_world():
    """--preset: a preset-like contender between the reference and the best (its true distance to the best is in the
    record); --variants: the same seed and world under each variant of the search options, told apart in the table."""
    variants = ("select_passes=1", "select_passes=3,max_steps=400")
    recs = [sr.one_search(SimulatedReal(), 1003, 0.04, preset=True, variant=v) for v in variants]
    assert [(r["variant"], r["select_passes"], r["max_steps"]) for r in recs] == [
        (variants[0], 1, SearchOptions().max_steps),
        (variants[1], 3, 400),
    ]
    assert all(r["preset_excess_pct"] is not None and r["preset_excess_pct"] > 0 for r in recs)
    assert recs[0]["preset_excess_pct"] == recs[1]["preset_excess_pct"]  # one world
    assert recs[0]["available_gain_pct"] == recs[1]["available_gain_pct"]
    for r in recs:  # every final contender's true distance to the best config; the reference's is the whole gain
        behind = r["contenders_behind_best_pct"]
        assert behind["preset"] == r["preset_excess_pct"] and behind["reference"] == r["available_gain_pct"]
        assert min(behind.values()) >= 0
    assert all("preset" in {b[0] for b in r["confirm_blocks"]} or r["chosen"] != "preset" for r in recs)
    plain = sr.one_search(SimulatedReal(), 1003, 0.04)
    assert plain["preset_excess_pct"] is None and plain["select_passes"] == SearchOptions().select_passes
    assert plain["variant"] == "defaults"
    result = {
        "runs": recs,
        "step_ms": 100.0,
        "probe": {"no overlap_ms": 1.0, "reference_ms": 1.0, "true_difference_ms": 0.0},
    }
    text = sr.table(result)
    assert f"{variants[0]}: seeds" in text and f"{variants[1]}: seeds" in text
    old = dict(recs[0], select_passes=1)  # a run of an earlier tree: no variant recorded
    del old["variant"]
    assert sr.variant_of(old) == "select_passes=1"


@pytest.mark.parametrize(
    "bad", ["max_step=400", "max_steps=many", "max_steps=-1", "select_passes", "max_looks=2.5", "later_look_least=2.0"]
)
def test_a_bad_variant_is_refused_with_its_key(bad):
    with pytest.raises(ValueError, match="max_step|select_passes|max_looks|later_look_least"):
        sr.parse_variant(bad)


def test_a_variant_takes_each_fields_type():
    assert sr.parse_variant("max_seconds=120,later_look_least=0,max_looks=20") == {
        "max_seconds": 120.0,
        "later_look_least": 0.0,
        "max_looks": 20,
    }
    assert isinstance(sr.parse_variant("max_looks=20")["max_looks"], int)


@pytest.mark.parametrize(
    ("flag", "rule"),
    [(["--common-factor", "4"], "at least 8 trials"), (["--common-factor-steps", "-1"], "at least 2"),
     (["--common-factor-steps", "1"], "at least 2"), (["--variants", "max_step=400"], "numeric SearchOptions field"),
     (["--variants", "later_look_least=2"], "must be in [0, 1]"), (["--repeat", "0"], "at least 1"),
     (["--precedent", "-1"], "0 (not run) or more"), (["--precedent-work-ms", "0"], "more than 0 ms"),
     (["--trace", "qkv.fwd", "attn.fwd"], "attn.fwd: not a slot"),
     (["--precedent-kinds", "python", "other"], "'other': not a kind")],
)  # fmt: skip
def test_a_bad_study_size_or_variant_gets_one_line_and_exit_2_before_any_gpu_work(flag, rule, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(PATH), "--script", "pretrain_gpt.py", *flag])
    monkeypatch.setattr(sr.subprocess, "run", lambda *a, **k: pytest.fail("a GPU job started"))
    with pytest.raises(SystemExit) as e:
        sr.main()
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith(flag[0]) and rule in err[0]


def test_a_tp1_megatron_gpt_is_seen_with_the_simulators_slots():
    """At TP=1 no module has userbuffers flags: the benchmark names Megatron's linears by path and counts every GEMM
    as overlapped, so the real model has the simulator's 12 GEMMs in its 8 slots (the GPU run asserts the same)."""
    import torch

    from megatron_tp_overlap.engine.topology import build_topology

    def layer():
        attn = torch.nn.Module()
        attn.linear_qkv, attn.linear_proj = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        mlp = torch.nn.Module()
        mlp.linear_fc1, mlp.linear_fc2 = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        m = torch.nn.Module()
        m.self_attention, m.mlp, m.other = attn, mlp, torch.nn.Linear(2, 2)
        return m

    chunk = torch.nn.Sequential(layer(), layer(), layer())
    modules = sr.overlap_modules([chunk])
    assert len(modules) == 12 and {m.name for m in modules} == {"qkv", "proj", "fc1", "fc2"}
    topo = build_topology(modules)
    assert topo.slots() == sim.TOPO.slots() and topo.active == sim.TOPO.active and topo.layers == 3


def test_the_common_factor_study_tells_a_stretch_that_slows_the_whole_step_from_noise_in_one_slot():
    """``common_factor.py`` (run by ``--common-factor``) on simulated steps: where a stretch slows every part of a step
    alike (hostbound) dividing by the step's unchanged rest removes most of each slot's trial-to-trial spread; where
    the noise is each slot's own (iid) it removes none of it."""
    import common_factor as cf

    explained = {}
    for scenario in ("hostbound", "iid"):
        s = cf.summarize(cf.record(SimulatedReal(scenario, 11), 120, 4))
        assert s["trials"] == 120 and set(s["slots"]) == set(sim.SLOTS)
        explained[scenario] = [v["explained"] for v in s["slots"].values()]
    assert min(explained["hostbound"]) > 0.75, explained
    assert max(abs(e) for e in explained["iid"]) < 0.3, explained
    assert cf.line(s).startswith("[common_factor] 120 trials, rest of the step ")


def test_the_trial_level_study_finds_a_level_each_trial_shares_and_a_slow_step_at_one_position():
    """``trial_level.py`` on simulated 16-step trials (``--common-factor 120 --common-factor-steps 16``): the level that
    ``trial_wide`` gives each trial's fc1.bwd (0.7%) and qkv.fwd (2.5%) reads so over 2 to 16 steps, iid steps read
    none, and ``position``'s slow step after each switch shows at its position."""
    import common_factor as cf
    import trial_level as tl

    wide = tl.summarize(cf.record(SimulatedReal("trial_wide", 11), 120, 16))
    assert (wide["trials"], wide["steps"]) == (120, 16)
    assert all(0.6 < v < 0.9 for v in wide["slots"]["fc1.bwd"]["level_pct"].values()), wide["slots"]["fc1.bwd"]
    assert all(2.0 < v < 2.8 for v in wide["slots"]["qkv.fwd"]["level_pct"].values()), wide["slots"]["qkv.fwd"]
    assert wide["slots"]["fc1.bwd"]["halves_corr"] > 0.4  # a constant level: the two halves move together
    iid = tl.summarize(cf.record(SimulatedReal("iid", 11), 120, 16))
    # iid: 2% per step, no level; each slot's estimate from 118 differences scatters (up to ~0.6% here), its median not
    assert statistics.median(r["level_pct"][8] for r in iid["slots"].values()) < 0.2, iid["slots"]
    assert statistics.median(r["level_pct"][8] for r in wide["slots"].values()) > 0.6
    pos = tl.summarize(cf.record(SimulatedReal("position", 11), 120, 16))["by_position_pct"]
    assert pos.index(max(pos)) == 1 and max(pos) > 4  # the 3rd step after a switch, the 2nd measured
    assert max(abs(v) for v in wide["by_position_pct"]) < 0.5
    assert tl.table(wide).startswith("| slot | ms per step | step spread, % | level over 2 steps, %")


def test_the_bar_over_many_results_counts_seeds_per_dtype_and_says_what_is_not_met(tmp_path, capsys):
    """``real_steps_bar.py``: runs from several files are grouped by dtype (from the Megatron arguments) and variant;
    the worst seed, the false winners and the equal worlds that accepted a choice are counted, and the bar says which
    of its parts do not hold."""
    bar_path = PATH.parent / "real_steps_bar.py"
    spec = importlib.util.spec_from_file_location("real_steps_bar", bar_path)
    rb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rb)

    def run(seed, kind, realized=None, fw=False, accepted=(), seconds=50.0):
        return {"seed": seed, "variant": "", "kind": kind, "realized": realized, "false_winner": fw,
                "choices_accepted": list(accepted), "seconds": seconds}  # fmt: skip

    bf16 = [run(1, "gain", 1.0), run(2, "equal", accepted=["fc1_fprop"]), run(3, "gain", 0.755, seconds=58.0)]
    fp8 = [run(1, "gain", 1.0), run(2, "equal"), run(2, "equal", fw=True, accepted=["qkv_dgrad"], seconds=61.0)]
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "search_on_real_steps.json").write_text(json.dumps({"megatron_args": ["--bf16"], "runs": bf16}))
    (tmp_path / "b.json").write_text(json.dumps({"megatron_args": ["--fp8-format", "hybrid"], "runs": fp8}))
    rows = rb.bar(rb.load([str(tmp_path / "a"), str(tmp_path / "b.json")]), seeds=3, worst=0.8, budget_s=60.0)
    (fp, bf) = rows
    assert (bf["dtype"], bf["seeds"], bf["gains_in_full"], bf["worst_seed"]) == ("bf16", 3, 1, 3)
    assert bf["equal_accepted"] == 1 and bf["why"] == ["worst 75.5% < 80%"]
    assert (fp["dtype"], fp["seeds"], fp["searches"], fp["false_winners"], fp["equal"]) == ("FP8", 2, 3, 1, 2)
    assert fp["why"] == ["2 seeds < 3", "1 false winner"]  # median 50 s of 60: within the budget
    # a variant's own budget: 90 s medians are within max_seconds=120, beyond the 60 s default
    slow = [{**r, "variant": v, "seconds": 90.0} for r in bf16 for v in ("max_seconds=120,max_looks=20", "z=3")]
    rows = {r["variant"]: r["why"] for r in rb.bar([{**r, "dtype": "bf16"} for r in slow], 3, 0.7, budget_s=60.0)}
    assert rows == {"max_seconds=120,max_looks=20": [], "z=3": ["median 90.0 s > 60 s"]}
    # a variant at the defaults' values is the defaults' search; the rest of one names only what it changed
    kinds = ("rebase_runners_up=0", "defaults", "z=2.5,rest_norm=0")
    same = [{**r, "dtype": "bf16", "variant": v} for r in bf16 for v in kinds]
    assert [(r["variant"], r["searches"]) for r in rb.bar(same, 3, 0.7, 60.0)] == [("defaults", 6), ("rest_norm=0", 3)]
    # an option since removed stays as written (2026-11-29_h200x1e's even_brackets=1 searches)
    assert rb.options_changed({"variant": "even_brackets=1,rest_guard=1"}) == "even_brackets=1"
    # choices accepted where the world put no faster option in that GEMM, gain and equal worlds alike
    worlds = [(["fc1_fprop", "qkv_fprop"], ["fc1_fprop: ring_exchange"]), (["qkv_fprop"], []), ([], [])]
    runs = [{**run(s, "gain" if fast else "equal", accepted=acc), "world_fast": fast, "dtype": "FP8"}
            for s, (acc, fast) in enumerate(worlds)]  # fmt: skip
    assert rb.unfounded_lines(runs) == ["FP8, defaults: qkv_fprop 2 of 3"]
    assert rb.unfounded_lines(runs[2:]) == ["FP8, defaults: none"]
    # first looks in standard errors of one look: 0.5 ms at a threshold of 0.5 ms after one look is z = 2.5 (beyond
    # +2.5 only above it); after four looks the threshold holds z + late_z = 3 errors of sqrt(4) looks
    assert rb.look_zs({"per_look_ms": [0.5], "noise_ms": 0.5}) == [pytest.approx(2.5)]
    assert rb.look_zs({"per_look_ms": [0.3, 0, 0, -0.3], "noise_ms": 0.6}) == pytest.approx([0.75, 0, 0, -0.75])
    assert rb.look_zs({"per_look_ms": [], "noise_ms": 0.6}) == []
    looked = {"qkv_fprop": {"slot": "qkv.fwd", "per_look_ms": [0.6], "noise_ms": 0.5, "accepted": True},
              "fc1_fprop": {"slot": "fc1.fwd", "per_look_ms": [-0.6, 0.1], "noise_ms": 0.5, "accepted": False}}  # fmt: skip
    runs = [{**runs[0], "choices": looked}, {**runs[1], "choices": looked}]  # run 0 put a faster fc1_fprop in
    assert rb.look_lines(runs) == [
        "FP8, defaults, fc1.fwd: first looks 1, mean -2.12, 0 above +2.5, 0 below -2.5; later looks 1, mean +0.35, "
        "0 above +2.5, 0 below -2.5; accepted after one look 0, after more 0",
        "FP8, defaults, qkv.fwd: first looks 2, mean +3.00, 2 above +2.5, 0 below -2.5; later looks none; "
        "accepted after one look 2, after more 0",
    ]
    assert rb.main([str(tmp_path / "missing")]) == 2 and "no search_on_real_steps.json" in capsys.readouterr().err
    (tmp_path / "a.log").write_text("[suite] a: rc=0\n")  # a glob like r2/search46_* also gives the logs
    assert rb.main([str(tmp_path / "a"), str(tmp_path / "a.log")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(str(tmp_path / "a.log")) and "not a search_on_real_steps.json" in err[0]


def test_a_seed_that_leaves_its_gain_keeps_each_trial_of_the_slots_the_gain_was_in():
    """A miss's JSON shows every look at the slots of the world's faster GEMMs with the delay put in for it: here an
    8 s budget leaves seed 1001's proj_fprop gain although screening measured the fast option (no delay put in)."""
    missed = sr.one_search(SimulatedReal(), 1001, 0.04, variant="max_seconds=8")
    assert missed["realized"] == 0 and missed["world_fast"] == ["proj_fprop: pipeline sm=4 cga=2 splits=8 margin"]
    rows = missed["miss_trace"]["proj.fwd"]
    assert list(missed["miss_trace"]) == ["proj.fwd"] and len(rows) > 10
    assert {r[3] for r in rows if r[0] == "baseline"} == {4.0}  # the reference's put-in delay, scaled to its step
    fast = [r for r in rows if r[3] == 0.0]
    assert (
        fast
        and all(r[0] == "screen" for r in fast)
        and all(r[2] < min(b[2] for b in rows if b[3] == 4.0) for r in fast)
    )
    # measured at its size after the search: the 4 ms delay left shows whole in the slot (the simulator absorbs none)
    (shown,) = missed["miss_shown"].values()
    assert list(missed["miss_shown"]) == ["proj.fwd"] and abs(shown["in_slot_ms"] - 4.0) < 3 * shown["in_slot_se_ms"]
    # ... and in racing trials (each after a switch), in the frozen heap, against the reference's other delays
    for key in list(sr.MISS_CHECKS)[1:]:
        (trials,) = missed[key].values()
        assert abs(trials["in_slot_ms"] - 4.0) < 3 * trials["in_slot_se_ms"], key
    taken = sr.one_search(SimulatedReal(), 1001, 0.04)
    assert taken["miss_trace"] is None and all(taken[k] == {} for k in sr.MISS_CHECKS)  # nothing kept
    assert taken["trace"] is None
    # ``--trace``: the slots named keep every trial whatever the outcome, as a miss's do
    traced = sr.one_search(SimulatedReal(), 1001, 0.04, trace=("qkv.fwd", "proj.fwd"))
    assert traced["miss_trace"] is None and list(traced["trace"]) == ["qkv.fwd", "proj.fwd"]
    assert len(traced["trace"]["qkv.fwd"]) == len(traced["trace"]["proj.fwd"]) > 100
    # each row ends with the host gap before its trial and whether a switch came first: a bracket right after a
    # bracket of the same incumbent continues it, and the search's first trial switches
    rows = traced["trace"]["proj.fwd"]
    assert rows[0][8] is True and all(len(x) == 9 and isinstance(x[8], bool) for x in rows)
    assert any(not x[8] for x in rows) and all(x[8] for x in rows if x[0] in ("screen", "halving", "recheck"))
    spec = importlib.util.spec_from_file_location("real_steps_bar", PATH.parent / "real_steps_bar.py")
    rb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rb)
    (line,) = rb.miss_lines([{**missed, "dtype": "bf16"}])
    assert line.startswith(f"seed 1001 (bf16, max_seconds=8) proj.fwd: {len(fast)} trials with less put in"), line
    assert ("(mean " in line) == (len(fast) > 1), line  # the looks' mean, from two looks on
    looks = [x.split() for x in line.split("measured/put in ms: ")[1].split(", ")]
    assert all(p == "s" and float(x.split("/")[0]) < 0 and x.endswith("/-4.000") for p, x in looks), line
    trace = [["bracket", 0, 1.0, 0.2], ["recheck", 9, 0.9, 0.0], ["bracket", 18, 1.1, 0.2], ["recheck", 27, 0.9, 0.0]]
    (two,) = rb.miss_lines([{**missed, "dtype": "bf16", "miss_trace": {"proj.fwd": trace}}])
    assert "proj.fwd: 2 trials with less put in (mean -0.150 +- 0.050 of -0.200), measured/put in ms: r -0.100" in two


def test_slot_visibility_finds_a_slot_that_absorbs_most_of_its_delay_and_the_bar_scores_on_what_shows(tmp_path, capsys):
    """A slot whose own measurement shows 30% of a delay put in it (as GLM-4-9B-like FP8's qkv.fwd on one H200), the
    others all of it: ``slot_visibility`` finds it, and ``real_steps_bar`` scores a search that left the gain put in
    there on what the slots show, beside the bar on what was put in."""
    slots = ["qkv.fwd", "proj.fwd", "fc1.bwd"]
    shows = {"qkv.fwd": 0.3, "proj.fwd": 1.0, "fc1.bwd": 1.0}

    def measure(slot):  # per slot ms, step ms; the step shows twice what qkv.fwd shows of its delay, 60%
        extra = {s: (0.4 * shows[s] if s == slot else 0.0) for s in slots}
        return {s: 1.0 + extra[s] for s in slots}, 30.0 + 0.4 * min(1.0, 2 * shows.get(slot, 0.0))

    spec = importlib.util.spec_from_file_location("real_steps_bar", PATH.parent / "real_steps_bar.py")
    rb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rb)
    vis = sr.slot_visibility(measure, slots, 0.4, rounds=4)
    assert vis == {s: {"in_slot": shows[s], "on_step": min(1.0, 2 * shows[s])} for s in slots}
    run = {"seed": 7, "variant": "defaults", "kind": "gain", "realized": 0.5, "excess_pct": -1.0}
    run |= {"false_winner": False, "seconds": 60.0, "choices_accepted": []}
    left = run | {"slot_gain_ms": {"qkv.fwd": [0.3, 0.0], "proj.fwd": [0.3, 0.3]}}  # qkv_fprop's gain left
    (tmp_path / "r").mkdir()
    data = {"megatron_args": ["--fp8-format", "hybrid"], "slot_visibility": vis, "runs": [left]}
    (tmp_path / "r" / "search_on_real_steps.json").write_text(json.dumps(data))
    runs = rb.load([str(tmp_path)])
    assert round(rb.realized_as_shown(runs[0]), 4) == round(0.3 / (0.3 * 0.3 + 0.3), 4)  # 77%, not 50%
    assert rb.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "FP8, scored on what the slots show: 0 of 1 in full, worst 76.9% (7)" in out
    assert "slots showing under 80% of a delay: qkv.fwd 0.30" in out
    assert rb.realized_as_shown(run) is None and rb.shown_lines([{**run, "dtype": "bf16", "file": "x"}]) == []


def test_a_delay_left_is_measured_at_its_size_and_the_bar_scores_its_upper_end():
    """A host-bound slot absorbs a small delay whole (Granite-3-8B-like FP8's proj.fwd on H200): ``miss_shown``
    measures what the delay left shows at its size, and the bar weighs that slot by the upper end of what showed
    (mean + 2 standard errors), not by ``slot_visibility``'s share of a larger delay."""
    rng = random.Random(3)
    shows = {"proj.fwd": 0.0, "fc1.bwd": 0.25}  # ms of the delay left that each slot's measurement shows

    def measure(which):  # per slot ms, step ms, with noise; the chosen config keeps the delays
        extra = shows if which == "chosen" else dict.fromkeys(shows, 0.0)
        return {s: 1.0 + extra[s] + rng.gauss(0, 0.01) for s in shows}, 30.0 + sum(extra.values()) + rng.gauss(0, 0.1)

    m = sr.miss_shown(measure, list(shows), pairs=40)
    for s, x in shows.items():
        assert abs(m[s]["in_slot_ms"] - x) < 3 * m[s]["in_slot_se_ms"] and 0.0005 < m[s]["in_slot_se_ms"] < 0.004
    assert abs(m["proj.fwd"]["on_step_ms"] - 0.25) < 3 * m["proj.fwd"]["on_step_se_ms"]
    spec = importlib.util.spec_from_file_location("real_steps_bar", PATH.parent / "real_steps_bar.py")
    rb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rb)
    vis = {s: {"in_slot": 0.66, "on_step": 0.5} for s in ("proj.fwd", "qkv.bwd")}
    run = {"seed": 9, "dtype": "FP8", "slot_visibility": vis, "miss_shown": {"proj.fwd": m["proj.fwd"]}}
    run["slot_gain_ms"] = {"proj.fwd": [0.15, 0.0], "qkv.bwd": [0.3, 0.3]}
    up = (m["proj.fwd"]["in_slot_ms"] + 2 * m["proj.fwd"]["in_slot_se_ms"]) / 0.15
    assert rb.shown_share(run, "proj.fwd") == max(0.0, up) and rb.shown_share(run, "qkv.bwd") == 0.66
    assert rb.realized_as_shown(run) == 0.66 * 0.3 / (0.66 * 0.3 + max(0.0, up) * 0.15)
    assert rb.realized_as_shown({**run, "miss_shown": {}}) == 0.3 / 0.45  # without it: slot_visibility alike
    (line,) = rb.miss_shown_lines([run])
    assert line.startswith("seed 9 (FP8) proj.fwd: 0.150 ms left; shows ") and "ms in the slot" in line
    frozen = {"proj.fwd": {"in_slot_ms": 0.01, "in_slot_se_ms": 0.03}}
    (line,) = rb.miss_shown_lines([run | {"miss_in_trials_frozen": frozen}])
    assert line.endswith("on the step; frozen heap +0.010 +- 0.030"), line


def _slot_coupling():
    spec = importlib.util.spec_from_file_location("slot_coupling", PATH.parent / "slot_coupling.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_slot_coupling_recovers_a_slot_that_reads_the_other_slots_delays():
    """A slot that shows 60% of its own delay and reads 0.5 ms less per ms put in another slot (as a host-bound
    forward might, behind faster backwards), 0.05 ms above its brackets with nothing put in differently: the fit over
    the trials against their nearest brackets finds all three; a slot never put in differently is left out."""
    sc = _slot_coupling()
    slots = ["qkv.bwd", "proj.fwd", "fc1.fwd"]
    bracket = [0.2, 0.1, 0.0]
    rows = [["baseline", 0, 1.0, 0.1, bracket]]
    rng = random.Random(3)
    for i in range(1, 40):
        if i % 5 == 0:
            rows.append(["bracket", 10 * i, 1.0, 0.1, bracket])
            continue
        every = [bracket[0] + rng.choice([-0.2, 0.0, 0.3]), bracket[1] + rng.choice([-0.1, 0.0, 0.4]), 0.0]
        ms = 1.0 + 0.05 + 0.6 * (every[1] - bracket[1]) - 0.5 * (every[0] - bracket[0])
        rows.append(["halving", 10 * i, ms, every[1], every])
    f = sc.fit(rows, slots)
    assert f["trials"] == 32 and set(f["per_ms"]) == {"qkv.bwd", "proj.fwd"}
    assert f["constant"][0] == pytest.approx(0.05, abs=1e-4) and f["per_ms"]["proj.fwd"][0] == pytest.approx(0.6)
    assert f["per_ms"]["qkv.bwd"][0] == pytest.approx(-0.5) and f["per_ms"]["qkv.bwd"][1] < 1e-6  # exact: no residual
    (line,) = sc.lines([{"seed": 5, "dtype": "FP8", "slots": slots, "miss_trace": {"proj.fwd": rows}}])
    assert line.startswith("seed 5 (FP8, defaults) proj.fwd, 32 trials: +0.050 +- 0.000 ms against the brackets")
    assert "own delay 0.60 +- 0.00 shows; per ms put in elsewhere: qkv.bwd -0.50 +- 0.00" in line
    assert sc.fit([r[:4] for r in rows], slots) is None  # a trace of before this session: no 5th column


def test_slot_coupling_says_in_one_line_when_there_is_nothing_to_read(tmp_path, capsys):
    sc = _slot_coupling()
    assert sc.main([str(tmp_path / "missing")]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err == f"no search_on_real_steps.json under {tmp_path / 'missing'}"
    (tmp_path / "r2").mkdir()  # a result of before the fifth column: nothing to fit, said on stdout
    run = {"seed": 1, "kind": "gain", "miss_trace": {"proj.fwd": [["bracket", 0, 1.0, 0.1], ["recheck", 5, 0.9, 0.0]]}}
    (tmp_path / "r2" / "search_on_real_steps.json").write_text(json.dumps({"slots": {"proj.fwd": []}, "runs": [run]}))
    assert sc.main([str(tmp_path / "r2")]) == 0
    assert capsys.readouterr().out.strip() == "no search kept every slot's put-in delays in its trace"


def test_a_miss_trace_keeps_every_slots_delay_and_the_simulator_couples_no_slot():
    """Each traced trial keeps every slot's put-in delay, in the topology's order (the JSON's ``slots``); the
    simulator's slots show their own delay whole and read no other's (seed 1001's 8 s miss)."""
    sc = _slot_coupling()
    missed = sr.one_search(SimulatedReal(), 1001, 0.04, variant="max_seconds=8")
    slots = list(sim.TOPO.slots())
    rows = missed["miss_trace"]["proj.fwd"]
    assert all(len(r[4]) == len(slots) and r[4][slots.index("proj.fwd")] == r[3] for r in rows)
    # and its steps: the slot's (their median is the trial's) and the rest's, one per measured step
    assert all(abs(statistics.median(r[5]) - r[2]) < 1e-3 and len(r[6]) == len(r[5]) > 0 for r in rows)
    # ... and the host ms before the trial, the call's own (here its index: one per trial, in the order they ran)
    assert [r[7] for r in rows] == sorted({r[7] for r in rows}) and rows[0][7] == 0.0
    f = sc.fit(rows, slots)
    own, se = f["per_ms"]["proj.fwd"]
    assert abs(own - 1.0) < 3 * se and abs(f["constant"][0]) < 3 * f["constant"][1] + 1e-9
    (line,) = sc.lines([{**missed, "dtype": "bf16", "slots": slots}])
    assert line.startswith("seed 1001 (bf16, max_seconds=8) proj.fwd, ") and "elsewhere: none beyond 2 standard" in line


def test_host_modes_reads_a_floor_its_slow_share_and_how_slow_steps_follow_each_other(tmp_path):
    """``host_modes.modes`` on steps laid out by hand: 0.3 ms at the floor, 0.6 ms in stretches (a slow step after a
    slow one 3 times of 4, after a fast one 4 times of 15); a steady slot beside it has no slow step."""
    spec = importlib.util.spec_from_file_location("host_modes", PATH.parent / "host_modes.py")
    hm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hm)
    pattern = [0.3, 0.3, 0.3, 0.6, 0.6, 0.6, 0.6, 0.3]  # fast-fast x2, fast-slow, slow-slow x3, slow-fast, (fast-fast)
    trials = [{"slots": {"proj.fwd": pattern[:4], "fc1.bwd": [2.0] * 4}, "step": [20.0, 20.0, 20.0, 22.0]}]
    trials += [{"slots": {"proj.fwd": pattern[4:], "fc1.bwd": [2.0] * 4}, "step": [22.0, 22.0, 22.0, 20.0]}]
    path = tmp_path / "search_on_real_steps.json"
    path.write_text(json.dumps({"common_factor": {"trials": trials * 4}}))
    (_, _, m), (_, _, steady) = hm.runs_of(path, ["proj.fwd", "fc1.bwd"])
    assert m["floor_ms"] == 0.3 and m["slow_share"] == 0.5 and m["slow_over_floor_q10_50_90"] == [2.0, 2.0, 2.0]
    assert m["p_slow_after_slow"] == 0.75 and m["p_slow_after_fast"] == 0.267  # 4 of 15: the repeats join fast-fast
    assert m["rest_ms_fast_slow"] == [17.7, 19.4]  # the step minus both slots
    assert m["near_far_mixed"] == [0.5, 0.5, 1.0]  # every trial holds steps at 0.3 and at 0.6
    assert steady["slow_share"] == 0.0 and steady["near_far_mixed"] == [1.0, 0.0, 0.0]
    # a search's reference trials from its miss_trace rows (phase, position, ms, delay, every delay, steps, rest)
    rows = [["bracket", 5 * i, 0.3, 0.0, [0.0], t["slots"]["proj.fwd"], [17.7] * 4] for i, t in enumerate(trials * 4)]
    path.write_text(json.dumps({"runs": [{"seed": 7, "miss_trace": {"proj.fwd": rows + [["halving", 99, 0.3, 0.0]]}}]}))
    ((run, slot, traced),) = hm.runs_of(path, ["proj.fwd"])
    assert (run, slot, traced["slow_share"], traced["near_far_mixed"]) == ("seed 7", "proj.fwd", 0.5, [0.5, 0.5, 1.0])


def test_trial_reads_reads_each_trial_four_ways_against_the_incumbents_nearest_and_splits_by_the_rest():
    """``trial_reads.slot_reads`` on rows laid out by hand: the incumbent (0.2 ms put in) at 1.0 ms in short-rest
    steps and 2.0 in long-rest ones, a true option (nothing put in) 0.2 faster in the short-rest steps only, and an
    equal option (the incumbent's delay) that differs by noise; trials of fewer than 2 steps and the final decision's
    blocks are left out."""
    spec = importlib.util.spec_from_file_location("trial_reads", PATH.parent / "trial_reads.py")
    tr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tr)
    rest = [20.0, 20.0, 28.0, 28.0]
    inc = [["bracket", 10 * i, 1.5, 0.2, [0.2], [1.0, 1.0, 2.0, 2.0], rest] for i in range(4)]
    true = [["halving", 10 * i + 5, 1.4, 0.0, [0.0], [0.8, 0.8, 2.0, 2.0], rest] for i in range(2)]
    equal = [
        ["halving", 7, 1.55, 0.2, [0.2], [1.0, 1.1, 2.0, 2.2], rest],
        ["recheck", 17, 1.5, 0.2, [0.2], [1.0, 1.0, 2.0, 2.0], rest],
    ]
    final = [["confirm", 40, 3.0, 0.2, [0.2], [3.0, 3.0, 3.0, 3.0], rest]]  # a decision block: not an option's trial
    got = tr.slot_reads(inc + true + equal + final + [["screen", 30, 0.8, 0.0, [0.0], [0.8], [20.0]]])
    assert got["put_in_ms"] == -0.2 and got["rest_cut_ms"] == 24.0
    t = {k: [round(x, 6) for x in v] for k, v in got["diffs"]["true"].items()}
    # median 1.4 - 1.5; fastest and 25th percentile 0.8 - 1.0; capped at 1.05 x the 10th percentile (1.0)
    assert t == {"median": [-0.1] * 2, "fastest": [-0.2] * 2, "q25": [-0.2] * 2, "capped mean": [-0.1] * 2}
    assert [round(x, 6) for x in got["diffs"]["equal"]["median"]] == [0.05, 0.0]
    split = {k: statistics.median(v) for k, v in got["split"].items()}
    assert split == {
        ("incumbent", "short"): 1.0,
        ("incumbent", "long"): 2.0,
        ("true", "short"): 0.8,
        ("true", "long"): 2.0,
    }
    assert tr.slot_reads(inc) is None  # no trial with less put in


def test_trial_precedent_sets_trials_after_the_searchs_work_against_those_after_a_trial():
    """A look right after the search's work (after a bracket that closed a call: fewer than ``bracket_every`` trials
    since the last) against one right after another trial, each against the same-length brackets; a trace's host
    gap, where it has one, decides instead of the order."""
    spec = importlib.util.spec_from_file_location("trial_precedent", PATH.parent / "trial_precedent.py")
    tp = sys.modules["trial_precedent"] = importlib.util.module_from_spec(spec)  # its dataclass looks itself up
    spec.loader.exec_module(tp)

    def row(phase: str, i: int, ms: float, gap: float | None = None) -> list:
        return [phase, 9 * i, ms, 0.1, [0.1], [ms] * 8, [20.0] * 8] + ([gap] if gap is not None else [])

    # a call of four looks (inline bracket), one more and its closing bracket; then looks one per call, each after
    # the search's work and closed by a bracket: the work's looks 0.3 ms slower than the others
    seq = [("recheck", 1.0)] * 4 + [("bracket", 1.0), ("recheck", 1.0), ("bracket", 1.0)]
    seq += [("recheck", 1.3), ("bracket", 1.0)] * 6
    rows = [row(p, i, ms) for i, (p, ms) in enumerate(seq)]
    assert tp.precedents(rows, 4, 2.0) == ["trial"] * 7 + ["work", "trial"] * 6
    spread = statistics.pstdev([x[2] - 0.1 for x in rows])
    got = tp.levels(rows, 4, 2.0)
    assert len(got[("looks (8 steps)", "trial")]) == 5 and len(got[("looks (8 steps)", "work")]) == 6
    assert statistics.fmean(got[("looks (8 steps)", "work")]) == pytest.approx(0.3 / spread)
    assert statistics.fmean(got[("looks (8 steps)", "trial")]) == pytest.approx(0.0, abs=1e-12)
    # the host gap decides where the trace has it: here every look is said to follow 5 ms of work
    gapped = [row(p, i, ms, 5.0 if p == "recheck" else 0.1) for i, (p, ms) in enumerate(seq)]
    assert tp.precedents(gapped, 4, 2.0) == ["work" if p == "recheck" else "trial" for p, _ in seq]
    work, brackets = tp.step_profile([{"miss_trace": {"qkv.fwd": rows}}], 4, 2.0)
    assert work == "looks after work, steps 1-8: " + " ".join([f"{0.3 / spread:+.2f}"] * 8)
    assert brackets == "brackets, steps 1-8: " + " ".join(["+0.00"] * 8)
    assert tp.traces({"miss_trace": {"qkv.fwd": [1]}, "trace": {"qkv.fwd": [2], "proj.fwd": [3]}}) == {
        "qkv.fwd": [2],
        "proj.fwd": [3],
    }  # a search's --trace rows, over its miss_trace's
    (trace,) = tp.per_trace([{"seed": 3, "miss_trace": {"qkv.fwd": rows, "fc1.bwd": rows}}])
    assert trace.startswith("seed 3 (defaults) qkv.fwd: looks less brackets +0.164 +- ")  # 6 of 11 looks 0.3 ms slower
    assert "closing" not in trace  # no bracket opened a call
    # balance_looks=1: calls alternate [look, bracket] and [bracket, look], each opened after 5 ms of the search's
    # work; the looks (1.3 and 1.0 ms) against the closing brackets (1.0) and the opening ones (1.2)
    calls = [("recheck", 1.3, 5.0), ("bracket", 1.0, 0.1), ("bracket", 1.2, 5.0), ("recheck", 1.0, 0.1)] * 3
    rows2 = [row(p, i, ms, gap) for i, (p, ms, gap) in enumerate(calls)]
    (trace,) = tp.per_trace([{"seed": 4, "variant": "balance_looks=1", "trace": {"qkv.fwd": rows2}}])
    assert trace.startswith("seed 4 (balance_looks=1) qkv.fwd: looks less brackets +0.050 +- ")
    assert "less the closing ones +0.150 +- " in trace and "less the opening ones -0.050 +- " in trace
    # the wait for the host moves between forward slots: looks read qkv.fwd 0.3 ms slow and fc1.fwd 0.3 ms fast, and
    # their sum (per step, the delays put in summed) reads nothing; traces not trial for trial are not summed
    fc1 = [row(p, i, ms, gap) for i, (p, ms, gap) in enumerate((p, 2.0 - ms, gap) for p, ms, gap in calls)]
    summed = tp.with_forward_sum({"qkv.fwd": rows2, "fc1.fwd": fc1, "fc1.bwd": rows})
    assert summed["fc1+qkv.fwd"][0] == ["recheck", 0, pytest.approx(2.0), 0.2, [0.1], [pytest.approx(2.0)] * 8,
                                        [20.0] * 8, 5.0]  # fmt: skip
    assert tp.with_forward_sum({"qkv.fwd": rows2, "fc1.fwd": fc1[1:]}).keys() == {"qkv.fwd", "fc1.fwd"}
    lines = tp.per_trace([{"seed": 5, "variant": "balance_looks=1", "trace": {"qkv.fwd": rows2, "fc1.fwd": fc1}}])
    assert [x.split(":")[0] for x in lines] == [f"seed 5 (balance_looks=1) {s}.fwd" for s in ("qkv", "fc1", "fc1+qkv")]
    assert "fc1+qkv.fwd: looks less brackets +0.000 +- 0.000 ms" in lines[2]
    # by place: in calls [look, bracket] and [bracket, look] (the bracket continuing the one before, no switch), the
    # looks 1.3 / 1.0 ms, the brackets 1.0 after a switch and 1.2 without one (less the 0.1 ms put in)
    (line,) = tp.places([{"seed": 6, "variant": "balance_looks=1", "trace": {"qkv.fwd": rows2}}])
    assert line == (
        "seed 6 (balance_looks=1) qkv.fwd, 8-step trials by place: bracket 1 no switch 1.100 (3); "
        "look 1 after a switch 1.200 (3); bracket 2 after a switch 0.900 (3); look 2 after a switch 0.900 (3)"
    )
    flagged = [x + [True] for x in rows2]  # a trace that says a switch came before every trial (as an accepted choice)
    (line,) = tp.places([{"seed": 6, "trace": {"qkv.fwd": flagged}}])
    assert "bracket 1 after a switch 1.100 (3)" in line and "no switch" not in line
    lines = tp.table([{"miss_trace": {"qkv.fwd": rows, "fc1.bwd": rows}}], 4, 2.0)
    assert (
        lines[2].startswith("| backward | looks (8 steps) | trial | 5 | ")
        and "| forward | looks (8 steps) | work | 6 |" in lines[5]
    )


def test_trace_takes_an_moe_models_shared_expert_slots(monkeypatch):
    """``--trace`` knows the dense slots and an MoE layer's shared experts' (topology.SHARED_PREFIX): it goes on to the
    GPU job, where a slot it does not know ends in one line before (the parametrized test above)."""

    class Started(Exception):
        pass

    def start(*a, **k):
        raise Started

    monkeypatch.setattr(sys, "argv", [str(PATH), "--script", "pretrain_gpt.py", "--trace", "shared_fc1.fwd", "qkv.fwd"])
    monkeypatch.setattr(sr.subprocess, "run", start)
    with pytest.raises(Started):
        sr.main()


def test_a_simulated_switch_sleeps_or_spins_and_switch_busy_reaches_the_gpu_job(monkeypatch):
    """``--switch-busy``: the simulated switch spins through ``--idle-s`` (a re-init's host work keeps a core busy)
    instead of sleeping; on 2 x H200 a call of looks' second trial read a host-bound forward slow. Both after one
    ``gc.collect()`` and a device sync; a fake clock here, no time measured."""
    import trial_noise

    torch = pytest.importorskip("torch")
    calls, clock = [], [0.0]
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("sync"))
    monkeypatch.setattr(trial_noise.gc, "collect", lambda: calls.append("gc"))
    monkeypatch.setattr(trial_noise.time, "sleep", lambda s: calls.append(("sleep", s)))

    def tick() -> float:  # each read of the clock: 10 ms later
        clock[0] += 0.01
        return clock[0]

    monkeypatch.setattr(trial_noise.time, "perf_counter", tick)
    trial_noise.simulated_switch(0.2)
    assert calls == ["gc", "sync", ("sleep", 0.2)]
    calls.clear()
    trial_noise.simulated_switch(0.2, busy=True)
    assert calls == ["gc", "sync"] and clock[0] == pytest.approx(0.21)  # read until 0.2 s after its first read

    cmd = _gpu_job(monkeypatch, "--switch-busy")
    assert cmd[cmd.index("--idle-s") + 1] == "0.2" and "--switch-busy" in cmd


def _gpu_job(monkeypatch, *flags: str) -> list[str]:
    """The command ``main`` starts the GPU job with, given ``flags`` (it is not run)."""
    got = []

    class Started(Exception):
        pass

    def start(cmd, *a, **k):
        got.append(cmd)
        raise Started

    monkeypatch.setattr(sys, "argv", [str(PATH), "--script", "pretrain_gpt.py", *flags])
    monkeypatch.setattr(sr.subprocess, "run", start)
    with pytest.raises(Started):
        sr.main()
    return got[0]


def test_host_trace_and_precedent_kinds_reach_the_gpu_job(monkeypatch):
    assert "--host-trace" in _gpu_job(monkeypatch, "--host-trace")
    cmd = _gpu_job(monkeypatch, "--precedent", "2", "--precedent-kinds", "python", "other-first")
    assert cmd[cmd.index("--precedent-kinds") :][:3] == ["--precedent-kinds", "python", "other-first"]


def test_host_trace_keeps_each_forward_slots_host_ms_per_step_in_the_traced_rows(monkeypatch):
    """``--host-trace``: the put-in hooks time each forward module call on the host (pre-hook to forward hook; a fake
    clock here, 1 ms per read; no pre-hook without it), a call of RealSteps keeps them per measured step, and the
    trace rows carry them as a 10th field (forward slots only)."""
    torch = pytest.importorskip("torch")
    clock = [0.0]

    def tick() -> float:
        clock[0] += 0.001
        return clock[0]

    monkeypatch.setattr(sr.time, "perf_counter", tick)

    class Module:  # overlap_modules' items: a module and its slots' prefix
        def __init__(self, prefix: str) -> None:
            self.module, self.slot_prefix = torch.nn.Linear(2, 2), prefix

    plain = Module("qkv")
    sr.Delays([plain], 1, 1.0)
    assert not plain.module._forward_pre_hooks  # without --host-trace the study's forwards run as before
    mods = [Module("qkv"), Module("proj")]
    delays = sr.Delays(mods, 1, 1.0, host_trace=True)
    x = torch.ones(1, 2)
    mods[0].module(x)  # off: nothing kept
    delays.host = {}
    mods[0].module(x), mods[0].module(x), mods[1].module(x)
    assert delays.host == {"qkv.fwd": pytest.approx(0.002), "proj.fwd": pytest.approx(0.001)}

    class Traced(SimulatedReal):
        def start(self, world) -> None:
            super().start(world)
            self.host_ms = []

        def __call__(self, config, n, warmup):
            self.host_ms.append({"proj.fwd": float(len(self.host_ms))})  # a stand-in: the call's index
            return super().__call__(config, n, warmup)

    rec = sr.one_search(Traced(), 1001, 0.04, variant="max_seconds=8", trace=("proj.fwd", "proj.bwd"))
    fwd, bwd = rec["trace"]["proj.fwd"], rec["trace"]["proj.bwd"]
    assert [len(r) for r in fwd] == [10] * len(fwd) and [r[9] for r in fwd] == [float(i) for i in range(len(fwd))]
    assert {len(r) for r in bwd} == {9}


def test_a_call_of_real_steps_keeps_its_forward_host_ms_per_measured_step_only_with_host_trace(monkeypatch):
    import trial_noise

    class Steps:
        def step(self) -> None:  # a warm-up step: not counted
            if delays.host is not None:
                delays.host["qkv.fwd"] = 1.0

    class Delays:
        host = None

        def set(self, slot_ms) -> None:
            pass

    monkeypatch.setattr(trial_noise, "simulated_switch", lambda idle_s, busy=False: None)
    delays = Delays()
    for on, kept in ((True, {"qkv.fwd": 3.0}), (False, None)):
        delays.host_trace = on
        real = sr.RealSteps(Steps(), [], None, delays, 0.0, 1.0)
        monkeypatch.setattr(real, "slot_excess_ms", lambda config: {})

        def timed(n: int):  # the measured steps: 6 ms of host time and 7 faults in qkv.fwd in all
            if delays.host is not None:
                delays.host["qkv.fwd"], delays.faults["qkv.fwd"] = 0.006, 7
            return {}, [1.0] * n

        monkeypatch.setattr(real, "_timed", timed)
        real("config", 2, 1)
        assert real.host_ms == [kept] and delays.host is None
        # ... and the thread's core and counters over the measured steps, with the same switch
        assert (real.os_stats[0] or {}).keys() == (
            {"cores", "wall_ms", "user_ms", "sys_ms", "vcsw", "ivcsw", "faults", "proc_sys_ms", "proc_faults"}
            | {"cpu_ms", "faults_in"}
            if on
            else set()
        )
        if on:  # per measured step
            assert real.os_stats[0]["faults_in"] == {"qkv.fwd": 3.5}


def test_os_delta_gives_a_trials_cpu_time_and_switches_per_step_against_the_wall():
    before = {"core": 3, "user": 1.0, "sys": 0.5, "vcsw": 10, "ivcsw": 2}
    after = {"core": 7, "user": 1.012, "sys": 0.504, "vcsw": 14, "ivcsw": 5}
    assert sr.os_delta(before, after, 0.020, 4) == {
        "cores": [3, 7],
        "wall_ms": 5.0,
        "user_ms": 3.0,
        "sys_ms": 1.0,
        "vcsw": 4,
        "ivcsw": 3,
    }
    faulted = before | {"faults": 100, "proc_sys": 2.0, "proc_faults": 400}
    d = sr.os_delta(faulted, after | {"faults": 140, "proc_sys": 2.006, "proc_faults": 500}, 0.020, 4)
    assert (d["faults"], d["proc_sys_ms"], d["proc_faults"]) == (10.0, 1.5, 25.0)  # per step
    now = sr.thread_os()  # this thread's, on Linux
    assert now["core"] in os.sched_getaffinity(0) and now["user"] >= 0 and now["ivcsw"] >= 0
    assert now["proc_faults"] >= now["faults"] >= 0


def test_replay_looks_reaches_the_gpu_job(monkeypatch):
    cmd = _gpu_job(monkeypatch, "--replay-looks", "same", "swap")
    assert cmd[cmd.index("--replay-looks") :][:3] == ["--replay-looks", "same", "swap"]
