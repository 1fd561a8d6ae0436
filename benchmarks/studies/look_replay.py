"""Is a look's reading its config's or its place in the search? Replay a search's looks with other configs.

    search_on_real_steps.py ... --replay-looks same incumbent     # on the GPU, after each search
    python benchmarks/studies/look_replay.py DIR_OR_JSON [...]     # the table
    python benchmarks/studies/look_replay.py --tsv DIR_OR_JSON ... # or one line per trial

On 2 x H200 every fresh look split the attention forward apart from its brackets (``look_neighbours.py``: host-bound
``qkv.fwd`` and ``proj.fwd`` 0.3-1.2 ms apart, looks only, every config costing the same; results/2026-11-30_h200x2g/),
though the study runs the same code for a look and a bracket and no config puts a delay anywhere. Right after a search
(its heap still frozen, its objects alive), :func:`replay` runs its looks again, call by call: per call of looks (a
``unit``: a look after the search's judging up to the next one), the same trials in the same order, each after as
many milliseconds of the search's kind of host work as the search spent before it (``trial_precedent._python``) and
a switch, once per variant, the variants' order rotating by unit (drift cancels):

- ``same``: each trial's own config, as the search ran it;
- ``incumbent``: each look runs the incumbent (its bracket's config), so every trial runs the same config;
- ``swap``: each look runs the incumbent and each bracket the config of the look before it.

A lead that stays in ``same`` and goes in ``incumbent`` is the configs'; one that stays in ``incumbent`` is the place's
(and in ``swap`` then moves with the place). :func:`summarize` gives per variant the looks less their unit's bracket,
per forward slot (GPU ms, and host ms with ``--host-trace``), mean +- se over units, with the search's own trials of
the same units (``search``) beside them.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from real_steps_bar import load_or_say  # the study's own (this folder is on sys.path)
from trial_precedent import WORK_MS, _python

from megatron_tp_overlap.engine.frames import fresh_stack

VARIANTS = ("same", "incumbent", "swap")
FORWARDS = ("qkv.fwd", "proj.fwd", "fc1.fwd", "fc2.fwd")


def units(trials: list, gaps_ms: list[float]) -> list[list[int]]:
    """The search's calls of looks as lists of trial indices: from its first look to its last (and the bracket right
    after it), a new unit at each trial that followed the search's work (a gap of at least ``WORK_MS``); trials that
    failed are left out."""
    looks = [i for i, t in enumerate(trials) if t.phase == "recheck"]
    if not looks:
        return []
    end = looks[-1] + 1
    end += end < len(trials) and trials[end].phase == "bracket"
    out: list[list[int]] = []
    for i in range(looks[0], end):
        if trials[i].error:
            continue
        if not out or gaps_ms[i] >= WORK_MS:
            out.append([])
        out[-1].append(i)
    return out


def plan(trials: list, unit: list[int], variant: str) -> list[tuple[int, object]]:
    """(trial index, config to run) for ``unit`` in ``variant`` (module docstring). A look's incumbent is the config
    of the first bracket after it in the unit; a unit with no bracket keeps its looks' own configs."""
    brackets = [i for i in unit if trials[i].phase == "bracket"]
    out = []
    for n, i in enumerate(unit):
        t = trials[i]
        after = next((b for b in brackets if b > i), None)
        if variant == "same" or not brackets:
            config = t.config
        elif t.phase == "recheck":
            config = trials[after].config if after is not None else trials[brackets[-1]].config
        else:  # a bracket: in ``swap`` the config of the look right before it
            before = unit[n - 1] if n else None
            swap = variant == "swap" and before is not None and trials[before].phase == "recheck"
            config = trials[before].config if swap else t.config
        out.append((i, config))
    return out


def replay(
    real,
    trials: list,
    gaps_ms: list[float],
    variants: tuple[str, ...],
    warmup: int,
    deadline: float = math.inf,
    work: Callable[[float], None] = _python,
) -> list[dict]:
    """Replay the looks of ``trials`` (a search's, run on ``real``: ``search_on_real_steps.RealSteps``) per unit and
    variant (module docstring) until ``deadline`` (``time.perf_counter()``); ``real``'s per-call lists and switch
    count are left as the search left them. Per trial: its unit, index, phase, variant, per forward slot the median
    ms, and the host ms per step where ``real`` keeps them."""
    kept = {k: len(getattr(real, k)) for k in ("gaps_ms", "switched", "host_ms", "os_stats") if hasattr(real, k)}
    switches, out = real.switches, []
    for k, unit in enumerate(units(trials, gaps_ms)):
        for variant in variants[k % len(variants) :] + variants[: k % len(variants)]:
            if time.perf_counter() > deadline:
                break
            for i, config in plan(trials, unit, variant):
                work(gaps_ms[i])
                real.live = None  # a switch first, as before every trial of the search's looks
                m = fresh_stack(real, config, len(trials[i].step_samples), warmup)  # as the searcher calls it
                host = real.host_ms[-1] if real.host_ms else None
                slot_ms = {s: round(statistics.median(v), 4) for s, v in m.slot_ms.items() if s in FORWARDS and v}
                out.append({"unit": k, "i": i, "phase": trials[i].phase, "variant": variant, "slot_ms": slot_ms})
                out[-1]["host_ms"] = {s: v for s, v in host.items() if s in FORWARDS} if host else None
                out[-1]["os"] = real.os_stats[-1] if getattr(real, "os_stats", None) else None
    for k, n in kept.items():
        del getattr(real, k)[n:]
    real.switches = switches
    return out


def searched(trials: list, gaps_ms: list[float], host_ms: list, os_stats: list | None = None) -> list[dict]:
    """The search's own trials of the replayed units, as :func:`replay`'s records (variant ``search``)."""
    out = []
    for k, unit in enumerate(units(trials, gaps_ms)):
        for i in unit:
            t, host = trials[i], host_ms[i] if i < len(host_ms) else None
            slot_ms = {s: round(v, 4) for s, v in t.slot_ms.items() if s in FORWARDS}
            rec = {"unit": k, "i": i, "phase": t.phase, "variant": "search", "slot_ms": slot_ms}
            rec["host_ms"] = {s: v for s, v in host.items() if s in FORWARDS} if host else None
            out.append(rec | {"os": os_stats[i] if os_stats and i < len(os_stats) else None})
    return out


def _value(ms: dict[str, float], slot: str) -> float | None:
    """A slot's ms, or ``qkv-proj``: the attention forward's split (``qkv.fwd`` less ``proj.fwd``)."""
    if slot == "qkv-proj":
        return ms["qkv.fwd"] - ms["proj.fwd"] if "qkv.fwd" in ms and "proj.fwd" in ms else None
    return ms.get(slot)


def summarize(records: list[dict]) -> dict[str, dict[str, dict[str, list[float]]]]:
    """Per variant, per slot (``gpu:SLOT``, ``host:SLOT``, and ``gpu:qkv-proj``, ``host:qkv-proj``), the looks of
    each unit (their mean) less the unit's bracket: [mean, se, units] over the units that have both."""
    out: dict[str, dict[str, dict[str, list[float]]]] = {}
    for variant in dict.fromkeys(r["variant"] for r in records):
        per: dict[str, list[float]] = {}
        for unit in dict.fromkeys(r["unit"] for r in records if r["variant"] == variant):
            mine = [r for r in records if r["variant"] == variant and r["unit"] == unit]
            looks = [r for r in mine if r["phase"] == "recheck"]
            brackets = [r for r in mine if r["phase"] == "bracket"]
            if not looks or not brackets:
                continue
            for kind in ("gpu", "host"):
                key = "slot_ms" if kind == "gpu" else "host_ms"
                if any(not r[key] for r in looks + brackets[-1:]):
                    continue
                for s in [*FORWARDS, "qkv-proj"]:
                    v = [_value(r[key], s) for r in looks + brackets[-1:]]
                    if None not in v:
                        per.setdefault(f"{kind}:{s}", []).append(statistics.fmean(v[:-1]) - v[-1])
        out[variant] = {
            s: [
                round(statistics.fmean(v), 4),
                round(statistics.stdev(v) / math.sqrt(len(v)), 4) if len(v) > 1 else math.nan,
                len(v),
            ]
            for s, v in per.items()
        }
    return out


def table(summary: dict[str, dict[str, dict[str, list[float]]]]) -> list[str]:
    """Markdown: one row per slot, one column per variant (ms, mean +- se (units))."""
    variants = list(summary)
    slots = list(dict.fromkeys(s for v in summary.values() for s in v))
    lines = ["| looks less their bracket | " + " | ".join(variants) + " |", "|---|" + "---|" * len(variants)]
    for s in slots:
        cells = [
            f"{summary[v][s][0]:+.3f} +- {summary[v][s][1]:.3f} ({summary[v][s][2]})" if s in summary[v] else "-"
            for v in variants
        ]
        lines.append(f"| {s} ms | " + " | ".join(cells) + " |")
    return lines


def os_lines(records: list[dict]) -> list[str]:
    """Per variant and kind of trial (``--host-trace``): the thread over the measured steps, per step, ms: wall, user
    and system CPU; context switches per trial (voluntary, involuntary); the trials that ended on another core than
    they began on; the cores seen; in ``qkv.fwd`` and ``proj.fwd`` the thread's CPU ms against its host ms; and where
    kept, minor page faults per step, the thread's and the process's, and the process's system ms."""
    lines = []
    for variant in dict.fromkeys(r["variant"] for r in records):
        for phase in ("recheck", "bracket"):
            mine = [r for r in records if r["variant"] == variant and r["phase"] == phase and r.get("os")]
            if not mine:
                continue
            o = [r["os"] for r in mine]

            def mean(f: Callable[[dict], float], o: list[dict] = o) -> float:
                return statistics.fmean(f(x) for x in o)

            moved = sum(x["cores"][0] != x["cores"][1] for x in o)
            cores = sorted({c for x in o for c in x["cores"]})
            split = [
                f"{s} cpu {mean(lambda x, s=s: x['cpu_ms'].get(s, math.nan)):.2f} of host "
                f"{statistics.fmean(r['host_ms'][s] for r in mine if r['host_ms']):.2f}"
                for s in ("qkv.fwd", "proj.fwd")
                if all(r["host_ms"] and s in r["host_ms"] for r in mine)
            ]
            lines.append(
                f"{variant} {'looks' if phase == 'recheck' else 'brackets'} ({len(o)}): wall {mean(lambda x: x['wall_ms']):.2f}, "
                f"user {mean(lambda x: x['user_ms']):.2f}, sys {mean(lambda x: x['sys_ms']):.2f} ms per step; "
                f"switches {mean(lambda x: x['vcsw']):.1f} / {mean(lambda x: x['ivcsw']):.1f}; moved core {moved}; "
                f"cores {cores}; "
                + "; ".join(split)
                + (
                    f"; faults {mean(lambda x: x['faults']):.0f} per step (process: {mean(lambda x: x['proc_faults']):.0f}, "
                    f"system {mean(lambda x: x['proc_sys_ms']):.2f} ms)"
                    if all("faults" in x for x in o)
                    else ""
                )
                + (
                    "; in "
                    + ", ".join(f"{s} {mean(lambda x, s=s: x['faults_in'].get(s, math.nan)):.0f}" for s in FORWARDS)
                    if all("faults_in" in x for x in o)
                    else ""
                )
            )
    return lines


def phase_faults(run: dict) -> str:
    """Per phase of a search (``--host-trace``: its ``trial_os``; the phase from its first traced slot), the thread's
    minor page faults per step, lowest-highest over the phase's trials, and its system ms per step (median)."""
    os_stats, trace = run.get("trial_os") or [], next(iter((run.get("trace") or {}).values()), [])
    by: dict[str, list[dict]] = {}
    for o, t in zip(os_stats, trace):
        if o and "faults" in o:
            by.setdefault(t[0], []).append(o)
    return "; ".join(
        f"{ph} {min(o['faults'] for o in v):.0f}-{max(o['faults'] for o in v):.0f} "
        f"({statistics.median(o['sys_ms'] for o in v):.2f} ms)"
        for ph, v in by.items()
    )


def bracket_levels(run: dict) -> list[str]:
    """Per traced forward slot, the incumbent's brackets by the call they close (a racing round's or a call of looks'):
    their mean level (the trace's median ms per trial), how many, and the looks' less the racing's. Every bracket runs
    the same config; before ``engine/frames.fresh_stack`` each kind of call ran its trials from its own depth."""
    out = []
    for slot, rows in (run.get("trace") or {}).items():
        by: dict[str, list[float]] = {}
        for before, row in zip(rows, rows[1:]):
            if row[0] == "bracket" and before[0] in ("halving", "recheck"):
                by.setdefault(before[0], []).append(row[2])
        if slot in FORWARDS and all(by.get(k) for k in ("halving", "recheck")):
            h, k = statistics.fmean(by["halving"]), statistics.fmean(by["recheck"])
            out.append(
                f"{slot} brackets closing racing rounds {h:.3f} ms ({len(by['halving'])}), calls of looks {k:.3f} "
                f"({len(by['recheck'])}): {k - h:+.3f}"
            )
    return out


def tsv(records: list[dict], where: str = "") -> list[str]:
    """One line per trial (tab-separated, a header first): where, unit, index, phase, variant; per step the thread's
    minor page faults, then per forward slot its faults, host ms and GPU ms (empty where not kept)."""
    head = ["where", "unit", "i", "phase", "variant", "faults"]
    head += [f"{k}:{s}" for k in ("faults", "host", "gpu") for s in FORWARDS]
    lines = ["\t".join(head)]
    for r in records:
        o, host = r.get("os") or {}, r.get("host_ms") or {}
        cells = [where, r["unit"], r["i"], r["phase"], r["variant"], o.get("faults", "")]
        cells += [(o.get("faults_in") or {}).get(s, "") for s in FORWARDS]
        cells += [host.get(s, "") for s in FORWARDS] + [r["slot_ms"].get(s, "") for s in FORWARDS]
        lines.append("\t".join(map(str, cells)))
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="+", help="search_on_real_steps.json files or folders holding them")
    p.add_argument("--tsv", action="store_true", help="the replayed units' trials, one line each (tsv), no tables")
    a = p.parse_args()
    header = True
    for run in load_or_say(a.paths):
        records = run.get("look_replay")
        if not records:
            continue
        where = "/".join(Path(run["file"]).parent.parts[-2:]) if "file" in run else ""
        if a.tsv:
            print("\n".join(tsv(records, f"{where} {run.get('seed')}")[0 if header else 1 :]))
            header = False
            continue
        print(f"\n{where} seed {run.get('seed')}")
        print("\n".join(table(summarize(records))))
        print("\n".join(os_lines(records)))
        if faults := phase_faults(run):
            print(f"faults per step by phase (system ms per step, median): {faults}")
        print("\n".join(bracket_levels(run)))


if __name__ == "__main__":
    main()
