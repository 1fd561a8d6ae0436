"""The in-run verification (``engine.verify.InRunVerification``, unchanged) on real Megatron-LM training iterations,
on one GPU: does its interval hold zero between equal configs, and does it keep a config that is truly faster?

    python benchmarks/studies/verify_noise.py --script .device/megatron-lm/pretrain_gpt.py --out DIR

Megatron-LM's own ``pretrain_gpt.py`` trains (mock data, real optimizer steps, Megatron's own loop and logging);
after ``--warm`` iterations, verifications of at most ``--verify-iters`` measured iterations run one after another,
of the kinds ``--kinds`` lists:

- ``A/A``: "tuned" and "reference" cost the same: the verdict should be "not faster" (the run goes back);
- ``A/B -X%``: the reference's iterations carry an extra GPU delay of ``--gain-pct`` of an iteration
  (``torch.cuda._sleep`` enqueued after the iteration's last kernel, so the host waits for it: its length measured
  with CUDA events; at the start of an iteration the GPU waits for the host anyway and hid most of it), so the
  tuned config is truly X% faster: the verdict should be "keeping it".

A switch between the two does what a userbuffers switch does to the GPU besides the re-init (one
``gc.collect()``, a device sync, ``--idle-s`` seconds of host work with the GPU idle; TP=1, so no userbuffers).
Writes ``verify_noise.json`` after every verification and prints a table: per verification the interval in ms and
in % of an iteration, and the verdict. ``--analyze JSON...`` (no run) replays the earlier 96-iteration design on the
same iterations and gives the medians by position after a switch.
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

from megatron_tp_overlap.engine.options import TuneOptions

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # the studies, then the benchmarks they build on


class Finished(Exception):
    """Every verification is done."""


class Repeated:
    """Verifications one after another (``before``/``after`` around each training iteration, as the launcher's
    ``verifying`` calls them), after ``warm`` unmeasured iterations; ``done`` after the last one."""

    def __init__(self, make, kinds: list[str], warm: int):
        self.make, self.kinds, self.warm = make, kinds, warm
        self.current, self.results, self._seen = None, [], 0

    @property
    def done(self) -> bool:
        return len(self.results) == len(self.kinds)

    def before(self) -> None:
        if self._seen < self.warm or self.done:
            return
        if self.current is None:
            self.current = self.make(self.kinds[len(self.results)])
        self.current.before()

    def after(self) -> None:
        self._seen += 1
        if self.current is None:
            return
        verdict = self.current.after()
        if verdict is not None:
            self.results.append((self.kinds[len(self.results)], self.current, verdict))
            self.current = None


def replay(times_ms: list[float], iters: int) -> dict:
    """The fixed design of ``iters`` measured iterations (one look at its end, 95%) on the first measured iteration
    times of a longer verification, whose schedule begins the same way: what that design would have decided."""
    from megatron_tp_overlap.engine import paired
    from megatron_tp_overlap.engine.verify import design

    quads, block = design(iters)
    order = paired.abba(quads)
    t = times_ms[: len(order) * block]
    if len(t) < len(order) * block:
        return {}
    blocks = [statistics.median(t[i * block : (i + 1) * block]) for i in range(len(order))]
    iv = paired.gain_interval(paired.quad_gains(blocks, order))
    ref = statistics.median(x for i, x in enumerate(t) if order[i // block] == paired.A)
    return {"gain_ms": iv.estimate, "half_width_pct": 100 * iv.half_width / ref, "kept": iv.faster}


def by_position(iter_ms: list[float], warm: int, verifications: int, iters: int) -> dict[int, float]:
    """Median time of the measured iterations by their position after the last switch (1 = the first measured one),
    and under 0 of the iterations that made a switch (the settling ones: the switch's time is inside Megatron's), from
    every iteration's time of a run (Megatron's log) whose verifications all ran to their end."""
    from megatron_tp_overlap.engine import paired
    from megatron_tp_overlap.engine.verify import design, schedule

    quads, block = design(iters)
    plan = schedule(paired.abba(quads), block)
    pos: dict[int, list[float]] = {}
    for v in range(verifications):
        p = 0
        for i, (_, measured) in enumerate(plan):
            p = p + 1 if measured else 0
            if measured or i > 0:  # i = 0: the warm-up iteration, no switch before it
                pos.setdefault(p, []).append(iter_ms[warm + v * len(plan) + i])
    return {p: statistics.median(x) for p, x in sorted(pos.items())}


def analyze(paths: list[str]) -> None:
    """``--analyze``: per verification of these verify_noise.json files, what the 96-iteration design would have
    decided on the same iterations; for run 1's Megatron log times, the medians by position after a switch."""
    for path in paths:
        d = json.loads(Path(path).read_text())
        if "iter_ms" in d and "rows" not in d:  # every iteration's time of run 1 (12 verifications of 96)
            pos = by_position(d["iter_ms"], 20, 12, 96)
            steady = statistics.median(pos[p] for p in pos if p)
            print(path, "by position after a switch (ms):", {p: round(m, 1) for p, m in pos.items() if p})
            print(
                f"  the iteration with a switch: {pos[0]:.1f} ms, so a switch took {pos[0] - steady:.0f} ms "
                f"(run 1's simulated switch: gc.collect() + a device sync + 200 ms idle)"
            )
            continue
        for r in d["rows"]:
            old = replay(r.get("iter_ms", []), 96)
            print(
                f"{Path(path).name} | {r['kind']} | true {r['true_gain_ms']:.2f} | new {r['gain_ms']:+.3f} "
                f"[{r['ci_low_ms']}, {r['ci_high_ms']}] {r['level']:.0%} {'back' if r['reverted'] else 'kept'} | "
                + (
                    f"96: {old['gain_ms']:+.3f} +-{old['half_width_pct']:.2f}% {'kept' if old['kept'] else 'back'}"
                    if old
                    else "-"
                )
            )


def inner(out: Path, a: argparse.Namespace, argv: list[str]) -> None:
    import megatron.training.training as training
    import torch
    from trial_noise import simulated_switch, sleep_ms_per_cycle

    from megatron_tp_overlap.engine.space import TuningConfig
    from megatron_tp_overlap.engine.verify import InRunVerification, span
    from megatron_tp_overlap.integrations.megatron.launcher import run_script, verifying
    from megatron_tp_overlap.ub.config import GemmOverlapConfig, UbConfig

    reference = TuningConfig(UbConfig(), frozenset(), "reference")
    tuned = TuningConfig(UbConfig().with_entry("fc2_fprop", GemmOverlapConfig(method="pipeline")), label="tuned")
    state = {"live": tuned, "delay_cycles": 0, "delayed": None, "iter_ms": None}
    original_step = training.train_step

    def train_step(*args, **kwargs):
        out = original_step(*args, **kwargs)
        if state["delayed"] is not None and state["live"] == state["delayed"]:
            torch.cuda._sleep(state["delay_cycles"])
        return out

    def switch(config: TuningConfig) -> None:
        simulated_switch(a.idle_s)
        state["live"] = config

    rows: list[dict] = []
    kinds = a.kinds.split(",")

    def make(kind: str) -> InRunVerification:
        if state["iter_ms"] is None:  # calibrate once, on the warm iterations' times
            state["per_cycle_ms"] = sleep_ms_per_cycle()
            state["iter_ms"] = statistics.median(warm_ms[-10:])
            state["delay_cycles"] = int(a.gain_pct / 100 * state["iter_ms"] / state["per_cycle_ms"])
        state["delayed"] = reference if kind == "A/B" else None
        if state["live"] != tuned:  # each verification starts on the tuned config, as after tuning
            switch(tuned)
        verification = InRunVerification(
            tuned,
            reference,
            a.verify_iters,
            apply=switch,
            sync=torch.cuda.synchronize,
            log=lambda *m: print(*m, flush=True),
            on_verdict=lambda v: record(kind, v, verification.times_ms),
        )
        return verification

    def record(kind: str, v, times: list[float]) -> None:
        true_ms = state["delay_cycles"] * state["per_cycle_ms"] if kind == "A/B" else 0.0
        rows.append(
            {
                "kind": kind if kind == "A/A" else f"A/B -{a.gain_pct:g}%",
                "true_gain_ms": round(true_ms, 3),
                **v.to_dict(),
                "half_width_ms": round(v.interval.half_width, 4),
                "half_width_pct": round(100 * v.interval.half_width / v.reference_ms, 3),
                "right": (not v.reverted) if kind == "A/B" else v.reverted,
                "iter_ms": [round(t, 2) for t in times],
            }
        )
        if int(os.environ.get("RANK", "0")) == 0:
            out.mkdir(parents=True, exist_ok=True)
            meta = {**vars(a), "iter_ms_warm": state["iter_ms"], "span": span(a.verify_iters)}
            (out / "verify_noise.json").write_text(json.dumps({"args": meta, "rows": rows}, indent=1) + "\n")

    warm_ms: list[float] = []

    rep = Repeated(make, kinds, a.warm)

    def timed_warm_step(*args, **kwargs):
        if rep.done:  # verifications stop early when they decide: the iterations planned for the longest are left
            raise Finished
        if len(warm_ms) >= a.warm:
            return train_step(*args, **kwargs)
        torch.cuda.synchronize()
        t = time.perf_counter()
        r = train_step(*args, **kwargs)
        torch.cuda.synchronize()
        warm_ms.append(1e3 * (time.perf_counter() - t))
        return r

    original_train = training.train

    def train(*args, **kwargs):
        training.train_step = timed_warm_step
        with verifying(training, "train_step", rep):
            try:
                return original_train(*args, **kwargs)
            except Finished:
                return 0, 0  # (iteration, flops): pretrain() carries on to its end

    training.train = train
    run_script(argv)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--script", help="Megatron-LM's pretrain_gpt.py (core_v0.19.0)")
    p.add_argument("--kinds", default="A/B,A/A,A/B,A/A", help="the verifications, in order: A/A or A/B")
    p.add_argument("--verify-iters", type=int, default=TuneOptions.verify_iters, help="most measured iterations each")
    p.add_argument("--gain-pct", type=float, default=1.0, help="the A/B reference's extra GPU time, %% of an iteration")
    p.add_argument("--idle-s", type=float, default=0.2, help="host seconds per simulated switch (a re-init: ~0.2)")
    p.add_argument("--warm", type=int, default=20)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument(
        "--shape", default="", help="model overrides, e.g. hidden=3584,ffn=18944,heads=28,kv_groups=4 (MODEL keys)"
    )
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--analyze", nargs="+", metavar="JSON", help="no run: replay the 96-iteration design on results")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    a, rest = p.parse_known_args()
    if a.analyze:
        analyze(a.analyze)
        return
    out = Path(a.out)
    if a.inner:
        inner(out, a, rest)
        return
    from megatron_autotune import one_gpu_args

    from megatron_tp_overlap.engine.verify import span

    shape = {k: int(v) for k, v in (kv.split("=") for kv in a.shape.split(",") if kv)}
    if set(a.kinds.split(",")) - {"A/A", "A/B"}:
        p.error(f"--kinds {a.kinds}: a comma-separated list of A/A and A/B")
    iters = a.warm + len(a.kinds.split(",")) * span(a.verify_iters) + 5
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", __file__, "--inner", "--out", str(out)]
    for k in ("kinds", "verify_iters", "gain_pct", "idle_s", "warm"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
    cmd += [a.script, *one_gpu_args(a.seq, iters, **shape)]
    print(" ".join(cmd), flush=True)
    rc = subprocess.run(cmd).returncode
    path = out / "verify_noise.json"
    rows = json.loads(path.read_text())["rows"] if path.exists() else []
    print(
        "\n| # | kind | true gain ms | estimate ms | +- ms | level | +- % of iter | iterations | ref iter ms | verdict | right |"
        "\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    for i, r in enumerate(rows):
        verdict = "went back" if r["reverted"] else "kept tuned"
        print(
            f"| {i} | {r['kind']} | {r['true_gain_ms']:.3f} | {r['gain_ms']:+.3f} | {r['half_width_ms']:.3f} | "
            f"{r['level']:.0%} | {r['half_width_pct']:.2f} | {r['iterations']} | {r['reference_iter_ms']:.1f} | {verdict} | "
            f"{'yes' if r['right'] else 'NO'} |"
        )
    sys.exit(rc)


if __name__ == "__main__":
    main()
