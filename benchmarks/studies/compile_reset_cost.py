"""What ``torch.compiler.reset()`` costs a Megatron-LM run: TE's ``destroy_ub()`` calls it on every userbuffers
switch, and Megatron compiles its fused activation / bias-dropout-add functions with ``torch.compile``
(``megatron.core.jit.jit_fuser``), so every switch throws their compiled code away.

    python benchmarks/studies/compile_reset_cost.py --script .device/megatron-lm/pretrain_gpt.py --out DIR

One process (no TP needed: the cost is in the compiled functions, not in userbuffers) runs Megatron-LM's own
``pretrain_gpt.py`` (mock data, bf16, GPT 4 layers h4096 ffn14336 32/8 heads seq 4096, SwiGLU) with each
``train_step`` timed (CUDA-synchronized, ms), and before the iterations in ``--reset-at`` what a switch does to
torch.compile: ``--destroy te`` TE's ``destroy_ub()`` as it is (it calls ``torch.compiler.reset()``), ``--destroy
switcher`` the same inside the switcher's ``keeping_compiled_fusions()``. Per iteration: wall ms, Dynamo graphs compiled during it, Python GC runs
(by generation) during it. Writes ``compile_reset_cost.json`` and prints a table: the iterations after a reset
against the median of the others.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # the studies, then the benchmarks they build on


def inner(out: Path, reset_at: set[int], destroy: str, argv: list[str]) -> None:
    import megatron.training.training as training
    import torch
    from torch._dynamo.utils import counters
    from transformer_engine.pytorch.module import base as te_base

    from megatron_tp_overlap.engine.switcher import compiled_beyond_fusions, keeping_compiled_fusions
    from megatron_tp_overlap.integrations.megatron.launcher import run_script

    records: list[dict] = []
    gc_runs = [0, 0, 0]
    gc.callbacks.append(
        lambda phase, info: (
            phase == "start" and gc_runs.__setitem__(info["generation"], gc_runs[info["generation"]] + 1)
        )
    )
    original = training.train_step

    def timed_train_step(*args, **kwargs):
        i = len(records)
        torch.cuda.synchronize()
        reset_ms = 0.0
        if i in reset_at:
            t = time.perf_counter()
            with keeping_compiled_fusions() if destroy == "switcher" else contextlib.nullcontext():
                te_base.destroy_ub()
            reset_ms = 1e3 * (time.perf_counter() - t)
        graphs, runs = counters["stats"]["unique_graphs"], list(gc_runs)
        t = time.perf_counter()
        result = original(*args, **kwargs)
        torch.cuda.synchronize()
        records.append(
            {
                "iteration": i,
                "ms": 1e3 * (time.perf_counter() - t),
                "reset_before": i in reset_at,
                "reset_ms": reset_ms,
                "graphs_compiled": counters["stats"]["unique_graphs"] - graphs,
                "gc_runs": [a - b for a, b in zip(gc_runs, runs)],
            }
        )
        return result

    training.train_step = timed_train_step
    try:
        run_script(argv)
    finally:
        if int(os.environ.get("RANK", "0")) == 0:
            from torch._dynamo import convert_frame
            from torch._dynamo.eval_frame import _debug_get_cache_entry_list

            codes = [c for r in convert_frame.input_codes.seen if (c := r()) is not None]
            compiled = sorted(f"{c.co_filename}:{c.co_name}" for c in codes if _debug_get_cache_entry_list(c))
            out.mkdir(parents=True, exist_ok=True)
            run = {
                "destroy": destroy,
                "iterations": records,
                "compiled": compiled,
                "beyond_fusions": compiled_beyond_fusions(),
            }
            (out / f"compile_reset_cost_{destroy}.json").write_text(json.dumps(run, indent=1) + "\n")


def summarize(records: list[dict], skip: int = 3) -> dict:
    """Iterations 1-3 after each reset vs the median of iterations that follow no reset within 3 (the first
    ``skip`` iterations of the run, which compile for the first time, left out)."""
    resets = [r["iteration"] for r in records if r["reset_before"]]
    near = {i + k for i in resets for k in range(3)}
    steady = [r["ms"] for r in records[skip:] if r["iteration"] not in near]
    base = statistics.median(steady) if steady else float("nan")
    after = {k: [records[i + k]["ms"] - base for i in resets if i + k < len(records)] for k in range(3)}
    return {
        "steady_ms_median": round(base, 2),
        "steady_ms_spread": round(max(steady) - min(steady), 2) if steady else None,
        "resets": len(resets),
        "reset_call_ms_median": round(statistics.median(r["reset_ms"] for r in records if r["reset_before"]), 2)
        if resets
        else None,
        "extra_ms_after_reset": {f"iteration +{k + 1}": [round(x, 1) for x in v] for k, v in after.items()},
        "graphs_compiled_after_reset": [records[i]["graphs_compiled"] for i in resets if i < len(records)],
        "graphs_compiled_first_iterations": [r["graphs_compiled"] for r in records[:skip]],
        "gc_runs_per_iteration_gen2": [r["gc_runs"][2] for r in records],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--script", help="Megatron-LM's pretrain_gpt.py (core_v0.19.0)")
    p.add_argument("--iters", type=int, default=32)
    p.add_argument("--reset-at", default="10,16,22,28", help="iterations (0-based) before which the reset runs")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--destroy", default="te,switcher", help="comma list of: te, switcher (one run each)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    a, rest = p.parse_known_args()
    out = Path(a.out)
    reset_at = {int(x) for x in a.reset_at.split(",") if x}
    if a.inner:
        inner(out, reset_at, a.destroy, rest)
        return
    from megatron_autotune import one_gpu_args

    args = one_gpu_args(a.seq, a.iters)
    rc = 0
    for destroy in a.destroy.split(","):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", __file__, "--inner"]
        cmd += ["--out", str(out), "--reset-at", a.reset_at, "--destroy", destroy, a.script, *args]
        print(" ".join(cmd), flush=True)
        rc = rc or subprocess.run(cmd).returncode
        run = json.loads((out / f"compile_reset_cost_{destroy}.json").read_text())
        s = summarize(run["iterations"])
        (out / f"compile_reset_cost_{destroy}_summary.json").write_text(json.dumps(s, indent=1) + "\n")
        print(f"--destroy {destroy}: compiled {run['compiled']}; beyond the fusions: {run['beyond_fusions']}")
        print(json.dumps({k: v for k, v in s.items() if k != "gc_runs_per_iteration_gen2"}, indent=1))
        print("\n| iteration | ms | switch before | graphs compiled | GC runs (gen 0/1/2) |\n|---|---|---|---|---|")
        for r in run["iterations"]:
            print(
                f"| {r['iteration']} | {r['ms']:.1f} | {'yes' if r['reset_before'] else ''} | {r['graphs_compiled']} "
                f"| {r['gc_runs']} |"
            )
    sys.exit(rc)


if __name__ == "__main__":
    main()
