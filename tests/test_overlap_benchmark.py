"""The benchmarks' pure parts: efficiency arithmetic, report and chart from a result, the realized-vs-exhaustive scaling."""

import json

import pytest
from benchmark_module import load_benchmark as _load

ob = _load("overlap_vs_baselines")


def test_efficiency():
    assert ob.efficiency(10.0, 8.0, 2.5) == 0.8
    assert ob.efficiency(10.0, 10.5, 2.0) == -0.25  # slower than no overlap
    assert ob.efficiency(10.0, 9.0, 0.0) == 0.0


def test_cases_match_the_issue():
    from megatron_tp_overlap.models import load_model_dims

    d = load_model_dims(ob.CASES["llama3_70b"][0])
    assert (d.hidden, d.ffn, d.heads, d.kv_heads) == (8192, 28672, 64, 8) and ob.CASES["llama3_70b"][1:] == (4096, 1)
    assert ob.CASES["gpt3_20b"][1:] == (2048, 2) and load_model_dims(ob.CASES["gpt3_20b"][0]).hidden == 6144


def test_targets_judge_every_repeat_and_name_the_worst():
    med = {"no overlap": 10.0, "TE default": 9.5, "preset p": 9.4, "autotuned #1": 9.0, "autotuned #2": 9.2}
    med["slot-exhaustive best"] = 9.05
    autos = [
        {"name": "autotuned #1", "steps": 100, "wall_s": 50.0},
        {"name": "autotuned #2", "steps": 160, "wall_s": 61.0},
    ]
    t = ob.targets(med, autos, {"steps": 300}, t_comm=2.0)
    first, second = t["repeats"]
    assert (
        first["within_1pct_of_exhaustive"] and first["tuning_steps_le_50pct_of_exhaustive"] and first["tuning_le_60s"]
    )
    assert not second["within_1pct_of_exhaustive"]  # 9.2 > 1.01 x 9.05
    assert not second["tuning_steps_le_50pct_of_exhaustive"] and not second["tuning_le_60s"]
    assert t["worst"] == "autotuned #2" and t["within_1pct_of_exhaustive"] is False
    assert second["vs_exhaustive_pct"] == 1.66 and second["vs_best_baseline_pct"] == -2.13
    assert ob.targets(med, autos[:1], None, 2.0)["within_1pct_of_exhaustive"] is None  # --no-exhaustive


def test_slot_pairs_cover_every_collective_of_a_layer_with_the_gemm_that_hides_it():
    """Per layer 6 all-gathers and 4 reduce-scatters (as the comm-only time counts them), each paired with a GEMM of
    its own slot whose shapes follow the model at the TP size; te.LayerNormMLP's mlp slots are fc1 and fc2."""
    from megatron_tp_overlap.models import load_model_dims

    d = load_model_dims(ob.CASES["llama3_70b"][0])  # h8192, ffn 28672, 64 / 8 heads, head 128, SwiGLU
    pairs = ob.slot_pairs(d, tokens=8192, tp=8)
    per_module = [s for s in pairs if not s.startswith("mlp.")]
    kinds = [k for s in per_module for k, _ in pairs[s]]
    assert kinds.count("ag") == ob.AG_PER_LAYER and kinds.count("rs") == ob.RS_PER_LAYER
    assert pairs["qkv.fwd"] == [("ag", (8192, 8192, (64 + 16) * 128 // 8))]
    assert pairs["fc1.fwd"] == [("ag", (8192, 8192, 2 * 28672 // 8))] and pairs["fc2.fwd"] == [
        ("rs", (8192, 3584, 8192))
    ]
    assert pairs["mlp.bwd"] == pairs["fc2.bwd"] + pairs["fc1.bwd"]
    gpt = load_model_dims("gpt3/gpt3-175b")  # not gated: fc1 is ffn wide
    assert ob.slot_pairs(gpt, 2048, 8)["fc1.fwd"] == [("ag", (2048, 12288, gpt.ffn // 8))]


def test_slot_bound_and_hidden_shares():
    """The bound hides each collective at most for its own GEMM's time; a config's hidden share is its slot time
    saved against no overlap over the slot's communication; slots the tuning did not time are left out."""
    pairs = {"qkv.bwd": [("ag", (1, 2, 3)), ("rs", (3, 2, 1))], "proj.fwd": [("rs", (4, 4, 4))]}
    b = ob.slot_bounds(pairs, {(1, 2, 3): 0.5, (3, 2, 1): 3.0, (4, 4, 4): 0.25}, {"ag": 1.0, "rs": 2.0}, layers=2)
    assert b["qkv.bwd"] == {"comm_ms": 6.0, "bound_ms": 5.0, "bound_share": 5 / 6}
    assert b["proj.fwd"] == {"comm_ms": 4.0, "bound_ms": 0.5, "bound_share": 0.125}
    row = {"reference_ms": 9.0, "no_overlap_ms": 10.0}
    auto = [{"slot": "qkv.bwd", "chosen_ms": 7.0, **row}, {"slot": "step", "chosen_ms": 50.0, **row}]
    ex = [{"slot": "qkv.bwd", "chosen_ms": 6.4, **row}]
    rows = ob.hidden_shares(b, {"autotuned #2": auto, "slot-exhaustive best": ex})
    assert [r["slot"] for r in rows] == ["qkv.bwd"]
    assert rows[0]["hidden_share"] == {"TE default": 0.167, "autotuned #2": 0.5, "slot-exhaustive best": 0.6}


def test_render_and_plot(tmp_path):
    r = {
        "case": "llama3_8b",
        "tp": 4,
        "comm_only": {"total_ms": 2.0},
        "step_ms": {
            "no overlap": {"median": 10.0, "spread": 0.1, "efficiency": 0.0},
            "autotuned": {"median": 8.8, "spread": 0.1, "efficiency": 0.6},
        },
        "autotune": [
            {"name": "autotuned", "steps": 120, "wall_s": 41.0, "decision": "autotuned beats the\n reference"}
        ],
        "slot_exhaustive": {"steps": 300},
        "slots": [
            {
                "slot": "qkv.fwd",
                "comm_ms": 1.5,
                "bound_ms": 1.2,
                "bound_share": 0.8,
                "hidden_share": {"TE default": 0.4, "autotuned": 0.55, "slot-exhaustive best": None},
            }
        ],
    }
    r["targets"] = ob.targets({k: v["median"] for k, v in r["step_ms"].items()}, r["autotune"], None, 2.0)
    text = ob.render([r])
    assert "hidden: TE default / autotuned / slot-exhaustive best |" in text
    assert "| llama3_8b | qkv.fwd | 1.500 | 1.200 (0.80) | 0.40 / 0.55 / - |" in text
    assert "| llama3_8b | 4 | autotuned | 8.800 | 0.100 | 0.60 | 2.000 |" in text
    assert "| llama3_8b | autotuned | -12.00 | - | 120 (40% of 300) | 41.0 | autotuned beats the reference |" in text
    ob.plot([r], tmp_path / "b.png")
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"


def test_predecessor_effect_plan_interleaves_every_order():
    pe = _load("predecessor_effect")
    p = pe.plan(3)
    assert [o for o, _ in p] == list(pe.ORDERS) * 3 and dict(p)["flags"] == "off"
    s = pe.summarize({"same": [1.0, 3.0, 2.0], "flags": []})
    assert s == {"same": {"median": 2.0, "spread": 2.0, "rounds": 3}}


def test_compile_reset_summary_takes_the_iterations_after_each_switch_against_the_rest():
    cr = _load("compile_reset_cost")
    ms = [4000.0, 300.0, 230.0, 230.0, 232.0, 480.0, 231.0, 229.0, 230.0, 470.0, 228.0, 230.0]
    recs = [
        {"iteration": i, "ms": m, "reset_before": i in (5, 9), "reset_ms": 0.4, "graphs_compiled": 4 * (i in (0, 5, 9))}
        | {"gc_runs": [1, 0, 0]}
        for i, m in enumerate(ms)
    ]
    s = cr.summarize(recs)
    assert s["steady_ms_median"] == 230.0 and s["resets"] == 2
    assert s["extra_ms_after_reset"]["iteration +1"] == [250.0, 240.0]
    assert s["extra_ms_after_reset"]["iteration +2"] == [1.0, -2.0]
    assert s["graphs_compiled_after_reset"] == [4, 4] and s["graphs_compiled_first_iterations"] == [4, 0, 0]


def test_trial_noise_summary_groups_steps_by_position_since_the_switch():
    tn = _load("trial_noise")
    rec = lambda phase, pos, ms, gc=(0, 0, 0): {  # noqa: E731
        "phase": phase,
        "position": pos,
        "gpu_ms": ms,
        "wall_ms": ms + 0.1,
        "gc_runs": list(gc),
        "sm_clock_mhz": 1600,
        "power_w": 600.0,
        "device_allocs": 0,
    }
    recs = [rec("trials", p, 100.0 + p, (1, 0, 0) if p == 0 else (0, 0, 0)) for _ in range(5) for p in range(4)]
    recs += [rec("steady", i % 4, 105.0, (0, 1, 0) if i == 3 else (0, 0, 0)) for i in range(20)]
    s = tn.summarize(recs)
    assert [s["by_position"][p]["median"] for p in (1, 2, 3, 4)] == [100.0, 101.0, 102.0, 103.0]
    assert s["steady"]["median"] == 105.0 and s["steady"]["n"] == 20
    assert s["trials_steps_with_gc"] == [5, 0, 0] and s["steady_steps_with_gc"] == [0, 1, 0]


def test_realized_gain_is_judged_against_the_exhaustive_gain_scaled_to_the_run(tmp_path, capsys):
    rv = _load("realized_vs_exhaustive")
    case = {
        "case": "qwen14b_like",
        "tp": 2,
        "layers": 2,
        "seq": 4096,
        "mbs": 1,
        "dims": {"hidden": 5120, "ffn": 13824, "heads": 40, "kv_heads": 8},
        "step_ms": {"TE default": {"median": 20.0}, "slot-exhaustive best": {"median": 19.5}},
    }
    model = {"layers": 4, "seq": 4096, "micro_batch": 1, "micro_batches_per_iter": 4, "tp": 2, "pp": 1}
    model |= {"fp8": False, "dims": [5120, 13824, 40, 8]}
    assert rv.expected_gain_ms(case, model) == 0.5 * 2 * 4  # per step of 2 layers, 4 layers x 4 micro-batches
    verdict = {"reverted": False, "gain_ms": 3.5, "ci_low_ms": 1.0, "ci_high_ms": 5.0, "level": 0.99}
    verdict |= {"kept": "autotuned", "reference_iter_ms": 400.0}
    run = {"model": model, "tuning": {"in_run_verification": verdict}}
    row = rv.compare(run, case)
    assert row["ratio"] == 0.875 and row["met"]
    assert not rv.compare({**run, "tuning": {"in_run_verification": {**verdict, "reverted": True}}}, case)["met"]
    with pytest.raises(ValueError, match="seq 4096 vs the run's 8192"):
        rv.expected_gain_ms(case, {**model, "seq": 8192})
    (tmp_path / "layer.json").write_text(json.dumps([case]))
    (tmp_path / "megatron_q.json").write_text(json.dumps(run))
    rv.main(["--layer", str(tmp_path / "layer.json"), "--run", f"{tmp_path / 'megatron_q.json'}=qwen14b_like"])
    assert "| megatron_q | qwen14b_like | 3.5 [1.0, 5.0] 99% | 4.0 | 88% | yes |" in capsys.readouterr().out


def test_the_ranks_exits_are_read_from_each_ranks_process_group_warning():
    ma = _load("megatron_autotune")
    tail = "ProcessGroupNCCL.cpp:1575] Warning: WARNING: destroy_process_group() was not called before program exit"
    log = "\n".join(
        [
            "[rank0]:[W1123 19:42:13.007917770 ProcessGroupNCCL.cpp:5188] Guessing device ID based on global rank.",
            f"[rank1]:[W1123 19:45:01.689677666 {tail}",
            f"[rank0]:[W1123 19:45:11.807250959 {tail}",
        ]
    )
    assert ma.exit_skew_s(log) == 10.12
    assert ma.exit_skew_s(log.rsplit("\n", 1)[0]) is None  # one rank's exit: nothing to compare


def test_the_exit_trace_names_what_holds_an_object():
    et = _load("exit_trace")

    class Iterator:
        pass

    class Holder:
        pass

    it, h = Iterator(), Holder()
    h.data = it
    chains = et.holders(it, depth=2)
    assert all(c.startswith("Iterator") for c in chains) and any("Holder" in c for c in chains), chains


def test_the_kernel_check_covers_no_overlap_each_kind_and_the_dgrad_flipped_live(monkeypatch):
    """engine_tune's profiler check (run on 2 GPUs by tests/test_gpu_engine.py) profiles every toggle the search may
    choose: each GEMM and each kind off, "no overlap" as a whole, and qkv/fc1 dgrad flipped from bulk to GEMM +
    reduce-scatter; the live config is the reference again afterwards."""
    import fakes

    from megatron_tp_overlap.engine.space import TuningConfig, all_off
    from megatron_tp_overlap.engine.topology import build_topology, find_overlap_modules
    from megatron_tp_overlap.ub.config import UbConfig
    from megatron_tp_overlap.ub.rules import ValidationContext

    et = _load("engine_tune")
    topo = build_topology(find_overlap_modules(fakes.fake_model(layers=2)))
    reference = TuningConfig(UbConfig(), frozenset(), "TE default")
    applied = []
    sw = type("Sw", (), {"apply": lambda self, c: applied.append(c)})()
    monkeypatch.setattr(et, "kernel_counts", lambda step: {"config": applied[-1]})
    ctx = ValidationContext(sm_count=132, tp_size=2)
    out = et.flag_kernel_check(None, lambda: None, sw, topo, reference, all_off(topo, reference), ctx)
    assert out["all off"]["config"] == all_off(topo, reference) and applied[-1] == reference
    assert {"kind off: AG overlap", "kind off: RS overlap", "kind off: bulk dgrad", "kind off: bulk wgrad"} <= set(out)
    for g in ("qkv_dgrad", "fc1_dgrad"):
        cfg = out[f"dgrad flipped to GEMM+RS: {g}"]["config"]
        assert cfg.ub.dgrad_is_reduce_scatter(g) and not reference.ub.dgrad_is_reduce_scatter(g)
        assert not cfg.disabled


def test_decision_blocks_replays_the_decision_for_each_block_size_and_value(tmp_path):
    """The analysis of benchmarks/studies/decision_blocks.py: smaller blocks are the first steps of each measured block, a
    decision holds as many quadruples as its seconds pay for (a block's wall time less its unused steps), and the
    sequence is cut into consecutive decisions; a step 5x slower once per block moves a median less than a mean."""
    import random

    from megatron_tp_overlap.engine import paired

    db = _load("decision_blocks")
    rng, blocks, prev = random.Random(0), [], None
    for which in paired.abba(48):
        ms = [50 + rng.gauss(0, 0.5) for _ in range(6)]
        ms[rng.randrange(6)] *= 5  # one slow step per block, anywhere in it
        switched = which != prev
        blocks.append({"config": which, "after_switch": switched, "gpu_ms": ms, "wall_s": 0.3 * switched + 0.05 * 6})
        prev = which
    study = {"block": 6, "idle_s": 0.3, "blocks": blocks}
    rows = {(r["block_steps"], r["block_value"]): r for r in db.analyze(study, [2, 6], decision_s=12.0)}
    assert set(rows) == {(2, "median"), (2, "mean"), (6, "median"), (6, "mean")}
    six, two = rows[(6, "median")], rows[(2, "median")]
    assert six["quad_s"] == pytest.approx(2 * 0.3 + 4 * 6 * 0.05, rel=0.02)
    assert two["quad_s"] == pytest.approx(six["quad_s"] - 4 * 4 * 0.05, rel=0.05)  # 4 unused steps per block
    assert six["quads_per_decision"] == 6 and six["decisions"] == 8  # 12 s / 1.8 s -> 6; 48 quadruples
    assert (
        two["quads_per_decision"] == int(12.0 / two["quad_s"]) and two["decisions"] == 48 // two["quads_per_decision"]
    )
    assert rows[(6, "median")]["half_width_ms_median"] < rows[(6, "mean")]["half_width_ms_median"]
    assert all(r["false_decisions"] <= r["decisions"] for r in rows.values())
    assert "| 6 | median |" in db.table(list(rows.values()), 50.0, 12.0)
    with pytest.raises(ValueError, match="block size 7"):
        db.analyze(study, [7], decision_s=12.0)


def test_switch_cost_summary_gives_medians_per_heap_state():
    sc = _load("switch_cost")
    r = {"collect_s": [0.3, 0.4, 0.5], "sync_s": [0.0, 0.001, 0.0], "after_idle": [(0.06, 47.0)] * 3}
    r["after_step"] = [(0.05, 47.5)] * 3
    result = {"idle_s": 0.35, "freeze_count_at_start": 0, "tracked": 1000, "tracked_frozen": 10}
    text = sc.summary({**result, "unfrozen": r, "frozen": {**r, "collect_s": [0.01, 0.02, 0.03]}})
    assert "| unfrozen | 0.4000 | 0.0000 | 0.0600 / 47.00 | 0.0500 / 47.50 |" in text
    assert "| frozen | 0.0200 |" in text and "1000 (frozen: 10)" in text


def test_the_one_gpu_benchmarks_read_their_model_shape_once():
    ma = _load("megatron_autotune")
    assert ma.parse_model_shape("hidden=5120,ffn=17920") == {"hidden": 5120, "ffn": 17920}
    assert ma.parse_model_shape("") == {}
    with pytest.raises(ValueError, match="model shape keys"):
        ma.one_gpu_args(2048, 10, **ma.parse_model_shape("hiden=5120"))
