"""How the final decision's block size and block value trade against its resolution, on real Megatron-LM trial steps
(one GPU, TP=1, switches simulated).

    python benchmarks/studies/decision_blocks.py --script .device/megatron-lm/pretrain_gpt.py --out DIR

The search's final decision (``Searcher.abba``) runs ABBA quadruples of ``block_steps``-step blocks, every block a
trial of its own (a switch and a warm-up step when the config changes, a device sync and host work when it
continues), and takes each block's median. Within a fixed time a longer block gives fewer quadruples but pays the
switches less often; a mean uses every step where a median spends some. Which is narrower depends on the noise of
real steps (clocks after a switch, the power limit's oscillation, slow steps), so it is measured, not modelled:
``--quads`` quadruples of ``--block`` steps on two configs that are the same (A/A; the tuner's own 1-micro-batch
trial step, Megatron's forward_backward_func on read-ahead micro-batches), every step's GPU time (CUDA events) and
every block's wall time recorded. The analysis replays the decision on them for each smaller block size ``b`` (the
first ``b`` steps of each block: the same positions after a switch or a sync gap as a ``b``-step block has) and each
block value: a decision of ``--decision-s`` seconds (a block's wall time less its unused steps) gets as many
quadruples as fit, the sequence is cut into consecutive such decisions, and each one's 95% interval (Wilcoxon
signed-rank, the search's own) gives the half-width; an interval that excludes zero is a false decision.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # the studies, then the benchmarks they build on
BLOCK_VALUES = {"median": statistics.median, "mean": statistics.fmean}


def collect(steps, quads: int, block: int, idle_s: float, minutes: float) -> dict:
    """A/A ABBA blocks of ``block`` timed steps on the real trial step (at most ``minutes``, whole quadruples)."""
    import torch
    from trial_noise import simulated_switch

    from megatron_tp_overlap.engine import heap, paired

    for _ in range(10):
        steps.step()
    torch.cuda.synchronize()
    blocks, prev, t_start = [], None, time.perf_counter()
    with heap.frozen():  # as tuning does
        for i, which in enumerate(paired.abba(quads)):
            if i % 4 == 0 and time.perf_counter() - t_start > 60 * minutes:
                break
            t0 = time.perf_counter()
            switched = which != prev
            if switched:
                simulated_switch(idle_s)
                steps.step()  # the warm-up step after a switch
            events = [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(block)
            ]
            for a, b in events:
                a.record()
                steps.step()
                b.record()
            torch.cuda.synchronize()  # a trial ends with a device sync
            blocks.append(
                {
                    "config": which,
                    "after_switch": switched,
                    "gpu_ms": [round(a.elapsed_time(b), 4) for a, b in events],
                    "wall_s": round(time.perf_counter() - t0, 4),
                }
            )
            prev = which
    return {"block": block, "idle_s": idle_s, "blocks": blocks}


def analyze(study: dict, sizes: list[int], decision_s: float, level: float = 0.95) -> list[dict]:
    """Per (block size, block value): quadruples a ``decision_s`` decision holds, how many such decisions the data
    hold, their median and worst 95% half-width (ms and % of a step) and how many excluded zero (false decisions:
    the configs are the same)."""
    from megatron_tp_overlap.engine import paired

    blocks = study["blocks"]
    n = len(blocks) // 4 * 4
    blocks, order = blocks[:n], [b["config"] for b in blocks[:n]]
    step_ms = statistics.median(x for b in blocks for x in b["gpu_ms"])
    rows = []
    for size in sizes:
        if not 1 <= size <= study["block"]:
            raise ValueError(f"block size {size}: must be between 1 and the measured block, {study['block']}")
        unused_s = (study["block"] - size) * step_ms / 1000
        quad_s = statistics.fmean(
            sum(max(0.0, b["wall_s"] - unused_s) for b in blocks[q : q + 4]) for q in range(0, n, 4)
        )
        per = max(paired.MIN_PAIRS, int(decision_s / quad_s))
        for value, fn in BLOCK_VALUES.items():
            vals = [fn(b["gpu_ms"][:size]) for b in blocks]
            widths, false = [], 0
            for start in range(0, n - 4 * per + 1, 4 * per):
                iv = paired.gain_interval(
                    paired.quad_gains(vals[start : start + 4 * per], order[start : start + 4 * per]), level
                )
                widths.append(iv.half_width)
                false += iv.faster or iv.slower
            rows.append(
                {
                    "block_steps": size,
                    "block_value": value,
                    "quad_s": round(quad_s, 3),
                    "quads_per_decision": per,
                    "decisions": len(widths),
                    "half_width_ms_median": round(statistics.median(widths), 4) if widths else None,
                    "half_width_pct_median": round(100 * statistics.median(widths) / step_ms, 3) if widths else None,
                    "half_width_pct_worst": round(100 * max(widths) / step_ms, 3) if widths else None,
                    "false_decisions": false,
                }
            )
    return rows


def table(rows: list[dict], step_ms: float, decision_s: float) -> str:
    out = [
        f"decisions of {decision_s:g} s on A/A blocks (step {step_ms:.1f} ms):",
        "| block steps | block value | s per quadruple | quadruples per decision | decisions | 95% half-width, median "
        "(% of step) | worst % | false decisions |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['block_steps']} | {r['block_value']} | {r['quad_s']} | {r['quads_per_decision']} | {r['decisions']} | "
            f"{r['half_width_ms_median']} ms ({r['half_width_pct_median']}%) | {r['half_width_pct_worst']} | "
            f"{r['false_decisions']} |"
        )
    return "\n".join(out)


def inner(out: Path, quads: int, block: int, idle_s: float, minutes: float, argv: list[str]) -> None:
    from megatron_autotune import on_trial_steps

    on_trial_steps(argv, out / "decision_blocks.json", lambda steps: collect(steps, quads, block, idle_s, minutes))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--script", help="Megatron-LM's pretrain_gpt.py (core_v0.19.0)")
    p.add_argument("--quads", type=int, default=200, help="ABBA quadruples at most")
    p.add_argument("--block", type=int, default=12, help="timed steps per block (the largest size analyzed)")
    p.add_argument("--sizes", type=int, nargs="+", default=[3, 6, 12], help="block sizes to replay")
    p.add_argument("--decision-s", type=float, default=30.0, help="seconds of one decision (the search's: ~25-35)")
    p.add_argument("--idle-s", type=float, default=0.35, help="host seconds per simulated switch (TP=2: ~0.33-0.41)")
    p.add_argument("--minutes", type=float, default=6.0, help="stop collecting after this many minutes")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--shape", default="", help="model keys of benchmarks/megatron_autotune.MODEL, e.g. hidden=5120")
    p.add_argument("--analyze", help="a decision_blocks.json to analyze again (no GPU)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    a, rest = p.parse_known_args()
    out = Path(a.out)
    if a.inner:
        inner(out, a.quads, a.block, a.idle_s, a.minutes, rest)
        return
    if max(a.sizes) > a.block:
        p.error(f"--sizes {max(a.sizes)}: must be <= --block {a.block}")
    rc = 0
    if not a.analyze:
        from megatron_autotune import one_gpu_args, parse_model_shape

        shape = parse_model_shape(a.shape)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", __file__, "--inner"]
        cmd += ["--out", str(out), "--quads", str(a.quads), "--block", str(a.block), "--idle-s", str(a.idle_s)]
        cmd += ["--minutes", str(a.minutes), a.script, *one_gpu_args(a.seq, 10, **shape)]
        print(" ".join(cmd), flush=True)
        rc = subprocess.run(cmd).returncode
    study = json.loads(Path(a.analyze or out / "decision_blocks.json").read_text())
    rows = analyze(study, a.sizes, a.decision_s)
    step_ms = statistics.median(x for b in study["blocks"] for x in b["gpu_ms"])
    text = table(rows, step_ms, a.decision_s)
    if not a.analyze:
        (out / "decision_blocks.md").write_text(text + "\n")
    print(
        f"{len(study['blocks']) // 4} quadruples of {study['block']}-step blocks, idle {study['idle_s']} s per switch"
    )
    print(text)
    sys.exit(rc)


if __name__ == "__main__":
    main()
