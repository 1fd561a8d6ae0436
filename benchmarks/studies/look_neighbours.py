"""Does a fresh look read a slot apart from the incumbent's bracket after it only, or from the one before it too?

    python benchmarks/studies/look_neighbours.py DIR_OR_JSON [...]

Reads the ``trace`` of every ``search_on_real_steps.json`` under the paths (``--trace SLOT ...``: every trial of those
slots) and gives, per forward slot and the traced forwards' sum: each look's level (its median ms less the delay put
in) less that of the nearest bracket after it (``next``: at the defaults the one closing its call) and before it
(``before``: the one that closed the call before, across the search's judging). A lead of place in the call (the
trial right after the judging reads apart) shows in ``next`` only, or with opposite signs; a lead of the looks
themselves shows in both alike. ``final``: where the final decision ran (``confirm_blocks``), its candidate's blocks
less the reference's in the same slot: the same configs, read in quadruples of short blocks instead. Last, the
racing's trials (4 steps, no delay put in any slot) against their brackets the same two ways, and with
``--host-trace``, the host ms of the slot's module calls per step, looks against brackets the same two ways. Then,
per run, how each kind of trial splits the attention forward between ``qkv.fwd`` and ``proj.fwd``.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable
from pathlib import Path

from real_steps_bar import load_or_say, options_changed  # the study's own (this folder is on sys.path)
from trial_precedent import WORK_MS, traces, with_forward_sum


def _run_name(r: dict) -> str:
    """The run as ``call/gG seed S (variant)``: the folder its JSON was read from, its seed and variant."""
    where = "/".join(Path(r["file"]).parent.parts[-2:]) + " " if "file" in r else ""
    return f"{where}seed {r.get('seed')} ({options_changed(r)})"


def _mean_se(v: list[float]) -> str:
    return f"{statistics.fmean(v):+.3f} +- {statistics.stdev(v) / math.sqrt(len(v)):.3f} (n={len(v)})"


def level(row: list) -> float:
    """A trial's level in its slot: its median ms less the delay put in."""
    return row[2] - row[3]


def host(row: list) -> float:
    """The host ms per step of the slot's module calls (``--host-trace``: the rows' 10th field)."""
    return row[9]


def look_less_brackets(
    rows: list[list], phase: str = "recheck", value: Callable[[list], float] = level
) -> tuple[list[float], list[float]]:
    """Trace rows of one slot in the order run (``miss_trace``'s): per trial of ``phase`` (``recheck``: a look;
    ``halving``: a racing trial, where no delay is put in any slot), (its ``value`` less that of the nearest bracket
    of the same length after it, less that of the nearest one before it)."""
    mine = [len(x[5]) for x in rows if x[0] == phase]
    rows = [
        x
        for x in rows
        if mine
        and len(x[5]) == mine[0]
        and (x[0] == "bracket" or x[0] == phase and (phase == "recheck" or not any(x[4])))
    ]
    got = [value(x) for x in rows]
    brackets = [i for i, x in enumerate(rows) if x[0] == "bracket"]
    after, before = [], []
    for i, x in enumerate(rows):
        if x[0] == phase:
            if nxt := [j for j in brackets if j > i]:
                after.append(got[i] - got[nxt[0]])
            if prev := [j for j in brackets if j < i]:
                before.append(got[i] - got[prev[-1]])
    return after, before


def final_less_reference(run: dict, rows: list[list]) -> float | None:
    """The final decision's candidate blocks less its reference blocks in one slot (mean ms), or None."""
    blocks = run.get("confirm_blocks") or []
    confirm = [x for x in rows if x[0] == "confirm"]
    if not blocks or len(confirm) != len(blocks):
        return None
    names = dict.fromkeys(b[0] for b in blocks)
    if "reference" not in names or len(names) != 2:
        return None
    cand = next(n for n in names if n != "reference")
    mine = [x[2] - x[3] for x, b in zip(confirm, blocks) if b[0] == cand]
    ref = [x[2] - x[3] for x, b in zip(confirm, blocks) if b[0] == "reference"]
    return statistics.fmean(mine) - statistics.fmean(ref)


def _both(label: str, pair: tuple[list[float], list[float]]) -> str:
    """The text ``; label: next ..., before ...`` where each side has two differences or more, else nothing."""
    after, before = pair
    return f"; {label}: next {_mean_se(after)}, before {_mean_se(before)}" if min(len(after), len(before)) > 1 else ""


def lines(runs: list[dict]) -> list[str]:
    """One line per run and forward slot with two looks or more on each side (the folder a run's JSON is in first)."""
    out = []
    for r in runs:
        for slot, rows in with_forward_sum(traces(r)).items():
            after, before = look_less_brackets(rows)
            if not slot.endswith("fwd") or len(after) < 2 or len(before) < 2:
                continue
            final = final_less_reference(r, rows)
            tail = f"; final decision {final:+.3f} ms" if final is not None else ""
            tail += _both("the racing's trials", look_less_brackets(rows, "halving"))
            timed = all(len(x) > 9 for x in rows if x[0] in ("recheck", "bracket"))  # --host-trace's rows
            tail += _both("on the host", look_less_brackets(rows, value=host)) if timed and "+" not in slot else ""
            out.append(
                f"{_run_name(r)} {slot}: looks less the bracket "
                f"next {_mean_se(after)}, before {_mean_se(before)} ms{tail}"
            )
    return out


SPLIT_KINDS = (
    "looks after the judging",
    "looks after a look",
    "brackets",
    "racing's trials",
    "final decision's blocks",
)


def split_kind(row: list, look_steps: int, work_ms: float = WORK_MS) -> str | None:
    """Which of :data:`SPLIT_KINDS` a trace row is: a look after a host gap of ``work_ms`` or more (the search's
    judging) or after another look, a bracket of the looks' length, a racing trial with no delay put in any slot, a
    block of the final decision; None for any other."""
    if row[0] == "recheck" and len(row) > 7:
        return SPLIT_KINDS[0] if row[7] >= work_ms else SPLIT_KINDS[1]
    if row[0] == "bracket" and len(row[5]) == look_steps:
        return SPLIT_KINDS[2]
    if row[0] == "halving" and not any(row[4]):
        return SPLIT_KINDS[3]
    return SPLIT_KINDS[4] if row[0] == "confirm" else None


def split_lines(runs: list[dict]) -> list[str]:
    """Per run tracing both ``qkv.fwd`` and ``proj.fwd``, trial for trial: how each kind of trial
    (:func:`split_kind`) splits the attention forward, ``qkv.fwd`` less ``proj.fwd`` (ms, mean over its trials)."""
    out = []
    for r in runs:
        t = traces(r)
        if "qkv.fwd" not in t or "proj.fwd" not in t or len(t["qkv.fwd"]) != len(t["proj.fwd"]):
            continue
        looks = [len(q[5]) for q in t["qkv.fwd"] if q[0] == "recheck"]
        by: dict[str, list[float]] = {}
        for q, p in zip(t["qkv.fwd"], t["proj.fwd"]):
            if kind := split_kind(q, looks[0] if looks else 0):
                by.setdefault(kind, []).append(q[2] - p[2])
        got = [f"{k} {statistics.fmean(by[k]):+.2f} (n={len(by[k])})" for k in SPLIT_KINDS if k in by]
        out.append(f"{_run_name(r)} qkv.fwd less proj.fwd, ms: " + "; ".join(got))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("paths", nargs="+", help="search_on_real_steps.json files or folders holding them")
    a = p.parse_args(argv)
    runs = load_or_say(a.paths)
    print("\n".join(lines(runs) + split_lines(runs)))


if __name__ == "__main__":
    main()
