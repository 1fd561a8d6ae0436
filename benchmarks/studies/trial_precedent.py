"""Does a trial right after the search's own work read a slot apart from a trial right after another trial?

    python benchmarks/studies/trial_precedent.py DIR_OR_JSON [...]

Reads the ``miss_trace`` of every ``search_on_real_steps.json`` under the paths (every trial of a seed that left a gain
or named a false winner, in the slots concerned; with ``--trace SLOT ...``, ``trace``: those slots in every search) and sets each trial's level, its median ms less the delay put in for
its config, against the mean level of the incumbent's brackets of the same length in that search and slot, in units
of the slot's spread of levels (the standard deviation over its trials of 4 steps or more). The search compares an
option with those brackets, so a level apart from them is read as a gain or a loss the option does not have.

What a trial follows: ``work`` where the search ran its own bookkeeping between them (the rounds' and the looks'
judging). Since the forty-fourth session the trace holds the host
milliseconds between the two trials (``gap_ms``); a trial follows work when its gap is at least ``--work-ms``. Older
traces say it by their order: a trial after a bracket that closed a call of the search's (fewer than ``bracket_every``
trials since the bracket before) follows work; a bracket after exactly ``bracket_every`` trials is taken to be inline,
so a call that ended there counts as ``trial`` (that dilutes ``work``, never the other way).

Which work does it? ``search_on_real_steps.py --precedent ROUNDS`` (:func:`record`, on real steps) runs, per round and
in turn, each kind of :data:`WORKS` (``--precedent-work-ms`` long) and then two trials of the same config, each after a
switch: the first right after the work, the second right after the first (as a later look and its bracket ran).
:func:`summarize` gives, per slot and kind, the first less the second (ms, mean +- se): ``none`` is the control.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from real_steps_bar import load_or_say, options_changed  # the study's own (this folder is on sys.path)

from megatron_tp_overlap.engine.search import SearchOptions

WORK_MS = 2.0  # a gap this long or longer (ms) follows the search's work
PHASES = {("halving", 4): "racing (4 steps)", ("recheck", 8): "looks (8 steps)"}


def _python(ms: float) -> None:  # the search's kind of work: small objects, sorting, statistics on lists
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        rows = [(i % 7, [float(i)] * 4, {"k": i}) for i in range(2000)]
        statistics.median(sorted(r[1][0] for r in rows))


def _numpy(ms: float) -> None:  # array work (the racing's pooled spreads)
    import numpy as np

    end, a = time.perf_counter() + ms / 1000, np.arange(20000, dtype=float)
    while time.perf_counter() < end:
        np.sort(a * 1.0001).std()


@dataclasses.dataclass(frozen=True)
class WorkKind:
    """One kind of what runs before a pair of trials: ``run(ms)``; ``switch``: each trial after a switch (as a look and
    its bracket; False: the trials continue the config, as the final decision's first block after its judging);
    ``settle``: one unrecorded 1-step trial after the work first (would a short trial absorb it?); ``order``: the
    pair's configs, ``r`` the reference and ``o`` another that costs the same (a look's: every forward GEMM's first
    option; "or" runs as a look and then its bracket)."""

    run: Callable[[float], None]
    switch: bool = True
    settle: bool = False
    order: str = "rr"


WORKS: dict[str, WorkKind] = {
    "none": WorkKind(lambda ms: None),
    "sleep": WorkKind(lambda ms: time.sleep(ms / 1000)),  # the same gap, no work
    "python": WorkKind(_python),
    "numpy": WorkKind(_numpy),
    "python, settled": WorkKind(_python, settle=True),
    "none, no switch": WorkKind(lambda ms: None, switch=False),
    "python, no switch": WorkKind(_python, switch=False),
    # on 2 x H200 a look read the forwards apart from the brackets on both sides of it, where every config cost the
    # same: is it the configs' order? Not away from a search (233 pairs, results/2026-11-30_h200x2g/ pr2)
    "other-first": WorkKind(_python, order="or"),  # after python work
    "other-second": WorkKind(_python, order="ro"),
}


def record(real, rounds: int, work_ms: float, steps: int = 8, works: dict[str, WorkKind] | None = None) -> list[dict]:
    """``rounds`` rounds on ``real`` (search_on_real_steps.RealSteps, an equal world, no cost put in): per kind of
    ``works`` (in turn, the order rotating by round), the work, then two trials of ``steps`` measured steps (1 warm-up
    after a switch, none without). Per pair: the kind and each trial's per-slot median ms."""
    import random

    from megatron_tp_overlap.engine.space import TuningConfig, apply, build_space
    from megatron_tp_overlap.tools.research import decision_sim as sim
    from megatron_tp_overlap.ub.config import UbConfig

    works = works or WORKS
    ref = TuningConfig(UbConfig(), frozenset(), "reference")
    space = build_space(sim.TOPO, sim.CTX, [UbConfig()])
    other = ref
    for gemm in (g for g in space if g.endswith("_fprop")):
        other = apply(other, next(o for o in space[gemm] if o.enabled and o.cfg), sim.TOPO)
    config = {"r": ref, "o": other}
    real.start(sim.make_world(space, 0.0, random.Random(0)))
    out, kinds = [], list(works)
    for r in range(rounds):
        for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
            w = works[kind]
            real.live = None if w.switch else ref  # "no switch": the config is already live
            if not w.switch:
                real(ref, 1, 1)  # ... and warm: its last steps ran right before the work
            w.run(work_ms)
            if w.settle:
                real.live = None
                real(ref, 1, 0)
            pair = []
            for c in w.order:
                if w.switch:
                    real.live = None  # a switch before each trial, as between a look and its bracket
                m = real(config[c], steps, 1 if w.switch else 0)
                pair.append({s: statistics.median(v) for s, v in m.slot_ms.items() if v})
            out.append({"kind": kind, "after_work": pair[0], "after_trial": pair[1]})
            print(f"[precedent] {json.dumps(out[-1])}", flush=True)  # a call cut short keeps its pairs in the log
    return out


def summarize(pairs: list[dict]) -> dict[str, dict[str, list[float]]]:
    """Per slot and kind: [mean, se] of the trial right after the work less the trial right after it (ms)."""
    out: dict[str, dict[str, list[float]]] = defaultdict(dict)
    for kind in dict.fromkeys(p["kind"] for p in pairs):
        mine = [p for p in pairs if p["kind"] == kind]
        for s in mine[0]["after_work"]:
            d = [p["after_work"][s] - p["after_trial"][s] for p in mine]
            se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else math.nan
            out[s][kind] = [round(statistics.fmean(d), 4), round(se, 4)]
    return dict(out)


def pooled_lines(pairs: list[dict]) -> list[str]:
    """Per forward slot: every kind with work (not ``none...``) and one config pooled, the first trial less the second
    (ms, mean +- se), against the spread of the trials themselves (their standard deviation, ms)."""
    same = lambda k: k not in WORKS or WORKS[k].order == "rr"  # noqa: E731  (pairs of one config only)
    work = [p for p in pairs if not p["kind"].startswith("none") and same(p["kind"])]
    out = []
    for s in (s for s in pairs[0]["after_work"] if s.endswith("fwd")) if work else ():
        d = [p["after_work"][s] - p["after_trial"][s] for p in work]
        spread = statistics.pstdev([v for p in pairs for v in (p["after_work"][s], p["after_trial"][s])])
        se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else math.nan
        out.append(
            f"{s}: after work (pooled, {len(d)} pairs) {statistics.fmean(d):+.3f} +- {se:.3f} ms; trials {spread:.2f} ms apart"
        )
    return out


def summary_lines(summary: dict[str, dict[str, list[float]]]) -> list[str]:
    kinds = list(next(iter(summary.values()), {}))
    lines = ["| slot | " + " | ".join(f"after {k}, ms" for k in kinds) + " |", "|---|" + "---|" * len(kinds)]
    for s, v in summary.items():
        lines.append(f"| {s} | " + " | ".join(f"{v[k][0]:+.4f} +- {v[k][1]:.4f}" for k in kinds) + " |")
    return lines


def traces(run: dict) -> dict[str, list[list]]:
    """A run's traced slots: ``trace`` (``--trace``: every search) over ``miss_trace`` (misses, false winners)."""
    return {**(run.get("miss_trace") or {}), **(run.get("trace") or {})}


def with_forward_sum(traced: dict[str, list[list]]) -> dict[str, list[list]]:
    """``traced`` and, where two or more forward slots were traced trial for trial (the same phases at the same
    positions), their sum as one more trace named by them (``qkv+proj.fwd``): per trial the median of the per-step
    sums, the delays put in summed. In host-bound forwards the wait for the host moves between the forward slots
    (results/2026-11-30_h200x2f/: first looks at equal leaders read ``proj.fwd`` fast and ``fc1.fwd`` slow); what a
    forward option truly changes shows in their sum as well."""
    fwd = sorted(s for s in traced if s.endswith(".fwd") and "+" not in s)
    rows = [traced[s] for s in fwd]
    if len(fwd) < 2 or any(len(r) != len(rows[0]) or [x[:2] for x in r] != [x[:2] for x in rows[0]] for r in rows):
        return traced
    summed = []
    for trial in zip(*rows):
        steps = [sum(v) for v in zip(*(x[5] for x in trial))]
        first = trial[0]  # its phase, position, delays in every slot, rest of the step, gap (the same for all)
        summed.append([*first[:2], statistics.median(steps), sum(x[3] for x in trial), first[4], steps, *first[6:]])
    return {**traced, "+".join(s.removesuffix(".fwd") for s in fwd) + ".fwd": summed}


def precedents(rows: list[list], bracket_every: int, work_ms: float) -> list[str]:
    """Per row of one slot's trace, in the order the trials ran: "work" or "trial" (what ran right before it)."""
    out, since, closing = [], 0, False
    for x in rows:
        gap = x[7] if len(x) > 7 else None
        out.append(("work" if gap >= work_ms else "trial") if gap is not None else "work" if closing else "trial")
        if x[0] == "bracket":
            closing, since = 0 < since < bracket_every, 0
        else:
            closing, since = False, since + 1
    return out


def levels(rows: list[list], bracket_every: int, work_ms: float) -> dict[tuple[str, str], list[float]]:
    """(phase label, precedent) -> each trial's level against the same-length brackets, in units of the slot's
    spread; brackets apart (they are the reference)."""
    rows = sorted(rows, key=lambda x: x[1])
    level = [x[2] - x[3] for x in rows]
    spread = statistics.pstdev([v for x, v in zip(rows, level) if len(x[5]) >= 4]) if len(rows) > 1 else 0.0
    base: dict[int, list[float]] = defaultdict(list)
    for x, v in zip(rows, level):
        if x[0] == "bracket":
            base[len(x[5])].append(v)
    out: dict[tuple[str, str], list[float]] = defaultdict(list)
    for x, v, p in zip(rows, level, precedents(rows, bracket_every, work_ms)):
        label = PHASES.get((x[0], len(x[5])))
        if label and len(base[len(x[5])]) >= 4 and spread > 0:
            out[(label, p)].append((v - statistics.fmean(base[len(x[5])])) / spread)
    return out


def table(runs: list[dict], bracket_every: int, work_ms: float) -> list[str]:
    """The pooled table: per slot kind, phase and precedent, trials and their mean level (spread units) +- se."""
    pooled: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for r in runs:
        for slot, rows in traces(r).items():
            if rows and len(rows[0]) >= 6:  # the per-step samples (since the thirty-fourth session)
                for (label, p), v in levels(rows, bracket_every, work_ms).items():
                    pooled[("forward" if slot.endswith("fwd") else "backward", label, p)] += v
    lines = [
        "| slots | trials | after | n | level against the brackets, spread units (mean +- se) |",
        "|---|---|---|---|---|",
    ]
    for (kind, label, p), v in sorted(pooled.items()):
        se = statistics.stdev(v) / math.sqrt(len(v)) if len(v) > 1 else math.nan
        lines.append(f"| {kind} | {label} | {p} | {len(v)} | {statistics.fmean(v):+.3f} +- {se:.3f} |")
    return lines


def step_profile(runs: list[dict], bracket_every: int, work_ms: float) -> list[str]:
    """Forward slots' 8-step looks after the search's work and 8-step brackets, step by step: each step's level
    against the brackets' mean, in spread units (a transient would fade over the steps)."""
    cols: dict[str, list[list[float]]] = {
        "looks after work": [[] for _ in range(8)],
        "brackets": [[] for _ in range(8)],
    }
    for r in runs:
        for slot, rows in traces(r).items():
            if not slot.endswith("fwd") or not rows or len(rows[0]) < 6:
                continue
            rows = sorted(rows, key=lambda x: x[1])
            spread = statistics.pstdev([x[2] - x[3] for x in rows if len(x[5]) >= 4])
            b8 = [statistics.median(x[5]) - x[3] for x in rows if x[0] == "bracket" and len(x[5]) == 8]
            if len(b8) < 4 or not spread:
                continue
            for x, p in zip(rows, precedents(rows, bracket_every, work_ms)):
                kind = (
                    "brackets" if x[0] == "bracket" else "looks after work" if x[0] == "recheck" and p == "work" else ""
                )
                if kind and len(x[5]) == 8:
                    for i, v in enumerate(x[5]):
                        cols[kind][i].append((v - x[3] - statistics.fmean(b8)) / spread)
    return [
        f"{k}, steps 1-8: " + " ".join(f"{statistics.fmean(c):+.2f}" if c else "-" for c in v) for k, v in cols.items()
    ]


def _less(a: list[float], b: list[float]) -> str:
    """Mean of ``a`` less mean of ``b`` (ms), +- its standard error."""
    se = math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))
    return f"{statistics.fmean(a) - statistics.fmean(b):+.3f} +- {se:.3f} ms"


def per_trace(runs: list[dict], work_ms: float = WORK_MS) -> list[str]:
    """Per forward slot trace, and their sum (:func:`with_forward_sum`), with the search's variant: its 8-step looks'
    mean level less its 8-step brackets' (ms, +- se); where the trace has gaps and some brackets opened a call
    (``balance_looks``, since removed), also less those that closed one (the next trial followed the search's work)
    and less those that opened one."""
    out = []
    for r in runs:
        for slot, rows in with_forward_sum(traces(r)).items():
            rows = sorted(rows, key=lambda x: x[1])
            nxt = [y[7] if len(y) > 7 else None for y in rows[1:]] + [work_ms]  # the gap after each trial
            eight = [(x, g) for x, g in zip(rows, nxt) if len(x) > 5 and len(x[5]) == 8]
            looks = [x[2] - x[3] for x, _ in eight if x[0] == "recheck"]
            brackets = [x[2] - x[3] for x, _ in eight if x[0] == "bracket"]
            if not (slot.endswith("fwd") and len(looks) >= 4 and len(brackets) >= 4):
                continue
            line = f"seed {r.get('seed')} ({options_changed(r)}) {slot}: looks less brackets {_less(looks, brackets)}"
            gapped = [(x, g) for x, g in eight if x[0] == "bracket" and len(x) > 7 and g is not None]
            opening = [x[2] - x[3] for x, _ in gapped if x[7] >= work_ms]
            closing = [x[2] - x[3] for x, g in gapped if g >= work_ms and x[7] < work_ms]
            if len(opening) >= 2 and len(closing) >= 2:
                line += (
                    f"; less the closing ones {_less(looks, closing)}, less the opening ones {_less(looks, opening)}"
                )
            out.append(line)
    return out


def call_order(runs: list[dict], work_ms: float = WORK_MS) -> list[str]:
    """Per forward slot trace (with the search's variant): the second trial of a call less its first (ms, mean +- se),
    by trial length (8 steps: the looks' calls; 4: the racing's), look, option or bracket alike. The first follows
    the search's work (a gap of ``work_ms`` or more), the second follows it at once. On 2 x H200 the looks' second
    trials read a host-bound ``proj.fwd`` 0.30-0.52 ms slower (results/2026-11-30_h200x2e/)."""
    out = []
    for r in runs:
        for slot, rows in with_forward_sum(traces(r)).items():
            rows = sorted((x for x in rows if len(x) > 7), key=lambda x: x[1])
            pairs: dict[int, list[float]] = defaultdict(list)
            for a, b in zip(rows, rows[1:]):
                if a[7] >= work_ms > b[7] and len(a[5]) == len(b[5]) in (4, 8):
                    pairs[len(a[5])].append((b[2] - b[3]) - (a[2] - a[3]))
            got = [
                f"{n}-step calls {statistics.fmean(v):+.3f} +- {statistics.stdev(v) / math.sqrt(len(v)):.3f} ms (n={len(v)})"
                for n, v in sorted(pairs.items(), reverse=True)
                if len(v) > 1
            ]
            if slot.endswith("fwd") and got:
                out.append(
                    f"seed {r.get('seed')} ({options_changed(r)}) {slot}: second trial less first, " + "; ".join(got)
                )
    return out


def places(runs: list[dict], work_ms: float = WORK_MS) -> list[str]:
    """Per forward slot trace (with the search's variant): the mean level (ms less the delay put in) of its 8-step
    trials by kind (look, bracket, settle), place in their call (a call opens after a gap of ``work_ms`` or more) and
    whether a switch came right before (none where an incumbent's trial follows one). On 2 x H200 at
    ``balance_looks=1`` the looks read ``proj.fwd`` alike in either place, and the brackets 0.6-0.7 ms apart: fast
    where no switch came before, slow after one (results/2026-11-30_h200x2f/)."""
    out = []
    for r in runs:
        for slot, rows in traces(r).items():
            rows = sorted((x for x in rows if len(x) > 7), key=lambda x: x[1])
            cells: dict[tuple[int, str, str], list[float]] = defaultdict(list)
            place, before = 0, None
            for x in rows:
                place = 1 if x[7] >= work_ms else place + 1
                # the trace says so since the fifty-eighth session; before, a trial of the incumbent after one of it
                # is taken to continue it (wrong only where a choice was accepted in between)
                incumbent = x[0] in ("bracket", "settle") and before in ("bracket", "settle")
                switched = x[8] if len(x) > 8 else not incumbent
                if len(x[5]) == 8 and x[0] in ("recheck", "bracket", "settle"):
                    kind = "look" if x[0] == "recheck" else x[0]
                    cells[(place, kind, "after a switch" if switched else "no switch")].append(x[2] - x[3])
                before = x[0]
            got = [
                f"{k} {p} {w} {statistics.fmean(v):.3f} ({len(v)})"
                for (p, k, w), v in sorted(cells.items())
                if len(v) > 1
            ]
            if slot.endswith("fwd") and got:
                out.append(
                    f"seed {r.get('seed')} ({options_changed(r)}) {slot}, 8-step trials by place: " + "; ".join(got)
                )
    return out


def decision_blocks(runs: list[dict]) -> list[str]:
    """The final decision (``confirm_blocks`` of its first two configs, quadruples A B B A): per quadruple, its first
    reference block less its last, in units of the reference blocks' spread. From the 7th quadruple on the first
    follows the decision's judging (it looks after each from the 6th) and continues the config without a switch."""
    out: dict[str, list[float]] = {"quadruples 2-6 (no judging before)": [], "quadruples 7+ (after judging)": []}
    for r in runs:
        blocks, names = [], []
        for b in r.get("confirm_blocks") or []:
            names += [b[0]] if b[0] not in names else []
            if len(names) > 2:
                break
            blocks.append(b)
        ref = [b[2] for b in blocks if b[0] == blocks[0][0]] if blocks else []
        spread = statistics.pstdev(ref) if len(ref) > 1 else 0.0
        for q in range(1, len(blocks) // 4):
            a0, a1 = blocks[4 * q], blocks[4 * q + 3]
            if spread and a0[0] == a1[0] == blocks[0][0]:
                out[list(out)[q >= 6]].append((a0[2] - a1[2]) / spread)
    return [
        f"final decision, {k}: first less last reference block {statistics.fmean(v):+.3f} +- "
        f"{statistics.stdev(v) / math.sqrt(len(v)):.3f} spreads (n={len(v)})"
        for k, v in out.items()
        if len(v) > 1
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("paths", nargs="*", help="search_on_real_steps.json files or folders holding them")
    p.add_argument("--work-ms", type=float, default=WORK_MS, help="a gap this long or longer follows the search's work")
    p.add_argument(
        "--pairs", nargs="+", default=[], metavar="LOG", help="--precedent's pairs from logs (a run cut short)"
    )
    a = p.parse_args(argv)
    if a.pairs:
        if missing := [f for f in a.pairs if not Path(f).is_file()]:
            print(f"--pairs {missing[0]}: no such log", file=sys.stderr)
            sys.exit(2)
        lines = [x for f in a.pairs for x in Path(f).read_text(errors="replace").splitlines()]
        pairs = [json.loads(x.split(" ", 1)[1]) for x in lines if x.startswith("[precedent] {")]
        print(f"{len(pairs)} pairs of trials, the first right after the work, the second right after it")
        print("\n".join(summary_lines(summarize(pairs)) + pooled_lines(pairs)))
        if not a.paths:
            return
    runs = load_or_say(a.paths)
    print("\n".join(table(runs, SearchOptions.bracket_every, a.work_ms)))
    if len(variants := dict.fromkeys(map(options_changed, runs))) > 1:
        for v in variants:  # each variant of the search on its own
            print(
                f"\n{v}:\n"
                + "\n".join(
                    table(
                        [r for r in runs if options_changed(r) == v],
                        SearchOptions.bracket_every,
                        a.work_ms,
                    )
                )
            )
    print("\n".join(step_profile(runs, SearchOptions.bracket_every, a.work_ms)))
    print("\n".join(call_order(runs, a.work_ms)))
    print("\n".join(places(runs, a.work_ms)))
    print("\n".join(per_trace(runs, a.work_ms)))
    print("\n".join(decision_blocks(runs)))
    for f in {r["file"] for r in runs}:  # and the runs of search_on_real_steps.py --precedent
        if pairs := json.loads(Path(f).read_text()).get("precedent"):
            print(f"\n{f}: {len(pairs)} pairs of trials, the first right after the work, the second right after it")
            print("\n".join(summary_lines(summarize(pairs)) + pooled_lines(pairs)))


if __name__ == "__main__":
    main()
