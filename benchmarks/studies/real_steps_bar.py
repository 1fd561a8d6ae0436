"""Issue 46's real-step bar over many ``search_on_real_steps.py`` results, per dtype and variant of the search.

    python benchmarks/studies/real_steps_bar.py DIR_OR_JSON [...]

Reads every ``search_on_real_steps.json`` under the paths given (one search per run; the same seed in two files
counts as one seed searched twice) and prints, per dtype (bf16 / FP8, from the Megatron arguments) and variant: the
seeds and searches, the gains taken in full, the worst realized share and its seed, the false winners among the equal
worlds, the equal worlds that accepted a choice (each one a chance for the final decision to err), the seconds per
search, and whether the bar holds: at least ``--seeds`` seeds, the worst seed at least ``--worst`` of its gain, no false
winner, the median search within the budget. Then, for each seed that left a gain and kept its trials
(``miss_trace``), what each look at the slots of that gain measured against the delay taken out. Where the results
carry ``slot_visibility`` (since the thirty-second session), it also prints each dtype's gains scored on what the slots
show of a delay (:func:`realized_as_shown`), and where a delay left was measured at its size (``miss_shown``, since the
thirty-fourth session) what it showed; and per slot, the fresh looks at each leader the world gave no faster option,
in standard errors of one look (:func:`look_lines`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from collections import Counter
from pathlib import Path

from search_on_real_steps import MISS_CHECKS, parse_variant  # the study's own (this folder is on sys.path)

from megatron_tp_overlap.engine.options import TuneOptions
from megatron_tp_overlap.engine.search import SearchOptions


def load(paths: list[str]) -> list[dict]:
    """Every run of every ``search_on_real_steps.json`` under ``paths``, each with its dtype."""
    files = [
        f for p in map(Path, paths) for f in ([p] if p.is_file() else sorted(p.rglob("search_on_real_steps.json")))
    ]
    runs = []
    for f in files:
        try:
            d = json.loads(f.read_text())
        except json.JSONDecodeError as e:  # a log beside the folders, given by a glob
            raise ValueError(f"{f}: not a search_on_real_steps.json ({e.msg})") from None
        dtype = "FP8" if "--fp8-format" in d.get("megatron_args", []) else "bf16"
        vis = d.get("slot_visibility")
        slots = list(d.get("slots", {}))  # the order of a miss_trace row's every-slot delays (slot_coupling.py)
        runs += [{**r, "dtype": dtype, "file": str(f), "slot_visibility": vis, "slots": slots} for r in d["runs"]]
    return runs


def load_or_say(paths: list[str]) -> list[dict]:
    """:func:`load`, or [] after one line on stderr: a file that is not a result, or no result under ``paths``."""
    try:
        runs = load(paths)
    except ValueError as e:
        print(e, file=sys.stderr)
        return []
    if not runs:
        print(f"no search_on_real_steps.json under {' '.join(paths)}", file=sys.stderr)
    return runs


def shown_share(run: dict, slot: str) -> float | None:
    """The share of its put-in gain that ``slot`` shows, [0, 1]: where the chosen config left a delay and it was
    measured at its size after the search (``miss_shown``, since the thirty-fourth session), the upper end of that
    measurement (mean + 2 standard errors) over the delay left; else ``slot_visibility``'s share of a delay of 1% of
    the step in the slot's own measurement; None with neither."""
    b, c = run["slot_gain_ms"][slot]
    if (m := (run.get("miss_shown") or {}).get(slot)) and b - c > 0:
        return min(1.0, max(0.0, (m["in_slot_ms"] + 2 * m["in_slot_se_ms"]) / (b - c)))
    vis = run.get("slot_visibility") or {}
    return min(1.0, max(0.0, vis[slot]["in_slot"])) if slot in vis else None


def realized_as_shown(run: dict) -> float | None:
    """A search's realized share scored on what the slots show: each slot's put-in gain (``slot_gain_ms``: the
    best config's, the chosen one's) weighted by the share it shows (:func:`shown_share`). None without both, or
    where the slots show no gain at all."""
    gains = run.get("slot_gain_ms")
    if not gains or not (run.get("slot_visibility") or run.get("miss_shown")):
        return None
    w = {s: x for s in gains if (x := shown_share(run, s)) is not None}
    best = sum(w[s] * gains[s][0] for s in w)
    return sum(w[s] * gains[s][1] for s in w) / best if best > 0 else None


def miss_shown_lines(runs: list[dict]) -> list[str]:
    """Per seed and slot where a delay was left and measured at its size (``miss_shown``): what it shows on steps,
    then in racing trials (each after a switch), in the frozen heap and against the reference's other delays."""
    out = []
    for r in runs:
        for s, m in (r.get("miss_shown") or {}).items():
            b, c = r["slot_gain_ms"][s]
            trials = [(name, t) for k, name in list(MISS_CHECKS.items())[1:] if (t := (r.get(k) or {}).get(s))]
            out.append(
                f"seed {r['seed']} ({r['dtype']}) {s}: {b - c:.3f} ms left; shows {m['in_slot_ms']:+.3f} +- "
                f"{m['in_slot_se_ms']:.3f} ms in the slot, {m['on_step_ms']:+.3f} +- {m['on_step_se_ms']:.3f} "
                "on the step"
                + "".join(f"; {name} {t['in_slot_ms']:+.3f} +- {t['in_slot_se_ms']:.3f}" for name, t in trials)
            )
    return out


def shown_lines(runs: list[dict]) -> list[str]:
    """Per dtype with ``slot_visibility``: the gains scored on what the slots show (:func:`realized_as_shown`), and
    the slots that show under 80% of a delay."""
    out = []
    for dtype in sorted({r["dtype"] for r in runs}):
        shown = [(x, r) for r in runs if r["dtype"] == dtype and (x := realized_as_shown(r)) is not None]
        if not shown:
            continue
        x, low = min(shown, key=lambda t: t[0])
        files = {r["file"]: r["slot_visibility"] for _, r in shown}
        weak = sorted(
            {f"{s} {v['in_slot']:.2f}" for vis in files.values() if vis for s, v in vis.items() if v["in_slot"] < 0.8}
        )
        out.append(
            f"{dtype}, scored on what the slots show: {sum(v >= 0.999 for v, _ in shown)} of {len(shown)} in full, "
            f"worst {100 * x:.1f}% ({low['seed']}); slots showing under 80% of a delay: {', '.join(weak) or 'none'}"
        )
    return out


def options_changed(run: dict) -> str:
    """The run's variant without the settings it gives their default values ("defaults" when none is left): a
    ``--variants rebase_runners_up=0`` search is the defaults' search, and pools with them. A setting of an option
    since removed (``even_brackets``, forty-fifth session) stays as written: that search was not the defaults'."""
    default, fields = SearchOptions(), {f.name for f in dataclasses.fields(SearchOptions)}
    parts = [kv for kv in (run.get("variant") or "").split(",") if kv and kv != "defaults"]  # as earlier trees wrote
    gone = lambda k: k not in fields  # noqa: E731
    keys = [kv for kv in parts if gone(k := kv.partition("=")[0]) or parse_variant(kv)[k] != getattr(default, k)]
    return ",".join(keys) or "defaults"


def budget_of(variant: str, default_s: float) -> float:
    """The budget (s) a variant's searches ran under: its ``max_seconds=`` (``--variants``), else ``default_s``."""
    fields = dict(kv.split("=", 1) for kv in variant.split(",") if "=" in kv)
    return float(fields.get("max_seconds", default_s))


def bar(runs: list[dict], seeds: int, worst: float, budget_s: float) -> list[dict]:
    """Per (dtype, variant): the figures of issue 46's bar and whether it holds (``why`` lists what does not);
    ``budget_s``: the default budget, for searches whose variant does not set ``max_seconds``."""
    rows = []
    keyed = [((r["dtype"], options_changed(r)), r) for r in runs]
    for key in sorted({k for k, _ in keyed}):
        mine = [r for k, r in keyed if k == key]
        gains = [r for r in mine if r["kind"] == "gain" and r["realized"] is not None]
        equal = [r for r in mine if r["kind"] == "equal"]
        low = min(gains, key=lambda r: r["realized"], default=None)
        secs = [r["seconds"] for r in mine]
        row = {
            "dtype": key[0],
            "variant": key[1],
            "seeds": len({r["seed"] for r in mine}),
            "searches": len(mine),
            "gains_in_full": sum(r["realized"] >= 0.999 for r in gains),
            "gains": len(gains),
            "worst": low["realized"] if low else None,
            "worst_seed": low["seed"] if low else None,
            "false_winners": sum(r["false_winner"] for r in equal),
            "equal": len(equal),
            "equal_accepted": sum(bool(r.get("choices_accepted")) for r in equal),
            "seconds_median": statistics.median(secs),
            "seconds_max": max(secs),
        }
        why = [f"{row['seeds']} seeds < {seeds}"] if row["seeds"] < seeds else []
        why += [f"worst {100 * row['worst']:.1f}% < {100 * worst:.0f}%"] if low and row["worst"] < worst else []
        n = row["false_winners"]
        why += [f"{n} false winner{'s' * (n > 1)}"] if n else []
        budget = budget_of(key[1], budget_s)
        why += [f"median {row['seconds_median']:.1f} s > {budget:g} s"] if row["seconds_median"] > budget else []
        rows.append({**row, "why": why})
    return rows


def unfounded_lines(runs: list[dict]) -> list[str]:
    """Per dtype and variant, per GEMM: the searches that accepted a choice for it where the world had put no faster
    option in it (``world_fast``), gain and equal worlds alike: each one left for the final decision to catch. On real
    L/M steps at b987351's defaults qkv_fprop had a choice accepted in 24 of 32 searches, a part put in in 5; the
    looks' host time was the frame stack's (results/2026-11-30_h200x2i/)."""
    out = []
    keyed = [((r["dtype"], options_changed(r)), r) for r in runs]
    for key in sorted({k for k, _ in keyed}):
        mine = [r for k, r in keyed if k == key]
        count = Counter(
            g
            for r in mine
            for g in r.get("choices_accepted") or []
            if not any(w.startswith(f"{g}:") for w in r.get("world_fast") or [])
        )
        listed = ", ".join(f"{g} {n} of {len(mine)}" for g, n in sorted(count.items(), key=lambda t: (-t[1], t[0])))
        out.append(f"{key[0]}, {key[1]}: {listed or 'none'}")
    return out


def look_zs(choice: dict, opt: SearchOptions | None = None) -> list[float]:
    """A leader's fresh looks in standard errors of one look: ``per_look_ms[k] / (noise_ms / z * sqrt(looks))``,
    with ``z`` (and ``late_z`` from the fourth look) as the looks' threshold has it. Where a gain worth a switch set
    the threshold, the standard error is overstated and the figures understated. [] without looks."""
    looks, thr, opt = choice.get("per_look_ms") or [], choice.get("noise_ms"), opt or SearchOptions()
    if not looks or not thr or not math.isfinite(thr):
        return []
    z = opt.z + (opt.late_z if len(looks) > 3 else 0.0)
    return [v / (thr / z * math.sqrt(len(looks))) for v in looks]


def look_lines(runs: list[dict], beyond: float = 2.5) -> list[str]:
    """Per dtype, variant and slot: the fresh looks at each leader whose GEMM the world put no faster option in (truly
    no gain), in standard errors of one look (:func:`look_zs`), the first look apart from the later ones: count,
    mean, and how many beyond +- ``beyond`` (0.6% each way if the looks' standard errors were right), and the
    choices accepted there after one look and after more. On real L/M FP8 steps at the defaults (2 x H200,
    results/2026-11-30_h200x2b/ to 2f/) the forwards' first looks read apart, and apart from each other:
    ``proj.fwd`` +1.29 on average, 9 of 26 above +2.5; ``fc1.fwd`` -1.68, 8 of 23 below -2.5; the backwards' not."""
    cells: dict[tuple[str, str, str], list[tuple[list[float], bool]]] = {}  # per leader: its looks, accepted
    for r in runs:
        fast = {w.split(":")[0] for w in r.get("world_fast") or []}
        for gemm, c in (r.get("choices") or {}).items():
            if gemm not in fast and (zs := look_zs(c)):
                cells.setdefault((r["dtype"], options_changed(r), c.get("slot", gemm)), []).append((zs, c["accepted"]))

    def part(zs: list[float]) -> str:
        if not zs:
            return "none"
        up, down = sum(z > beyond for z in zs), sum(z < -beyond for z in zs)
        return f"{len(zs)}, mean {statistics.mean(zs):+.2f}, {up} above +{beyond:g}, {down} below -{beyond:g}"

    out = []
    for (d, v, slot), leaders in sorted(cells.items()):
        first, later = [zs[0] for zs, _ in leaders], [z for zs, _ in leaders for z in zs[1:]]
        once, more = sum(a and len(zs) == 1 for zs, a in leaders), sum(a and len(zs) > 1 for zs, a in leaders)
        out.append(
            f"{d}, {v}, {slot}: first looks {part(first)}; later looks {part(later)}; "
            f"accepted after one look {once}, after more {more}"
        )
    return out


def miss_lines(runs: list[dict]) -> list[str]:
    """Per seed that left a gain (its ``miss_trace``), per slot: each trial of a config with less delay put in than the
    incumbent's, as the slot's measured change (ms, against the incumbent's trial nearest in position) beside the
    change put in, with the phase's initial, and their mean and its standard error. A look that reads nothing where
    a delay was taken out shows here."""
    out = []
    for r in runs:
        for slot, rows in (r.get("miss_trace") or {}).items():
            inc = [x for x in rows if x[0] in ("baseline", "bracket")]
            if not inc or r["kind"] != "gain":
                continue
            ref_put = statistics.median(x[3] for x in inc)
            looks, seen, put_in = [], [], []
            for phase, pos, ms, put, *_ in rows:
                if put < ref_put - 1e-9:
                    near = min(inc, key=lambda x: abs(x[1] - pos))
                    looks.append(f"{phase[0]} {ms - near[2]:+.3f}/{put - ref_put:+.3f}")
                    seen.append(ms - near[2])
                    put_in.append(put - ref_put)
            mean = (
                f" (mean {statistics.fmean(seen):+.3f} +- {statistics.stdev(seen) / len(seen) ** 0.5:.3f} of "
                f"{statistics.fmean(put_in):+.3f})"
                if len(seen) > 1
                else ""
            )
            out.append(
                f"seed {r['seed']} ({r['dtype']}, {options_changed(r)}) {slot}: "
                f"{len(looks)} trials with less put in{mean}, measured/put in ms: {', '.join(looks) or 'none'}"
            )
    return out


def table(rows: list[dict]) -> str:
    out = [
        "| dtype | variant | seeds (searches) | gains taken in full | realized, worst (seed) | false winners | "
        "equal worlds with a choice accepted | s per search (median / max) | bar |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        worst = "-" if r["worst"] is None else f"{100 * r['worst']:.1f}% ({r['worst_seed']})"
        out.append(
            f"| {r['dtype']} | {r['variant']} | {r['seeds']} ({r['searches']}) | {r['gains_in_full']} of {r['gains']} | "
            f"{worst} | {r['false_winners']} of {r['equal']} | {r['equal_accepted']} of {r['equal']} | "
            f"{r['seconds_median']:.1f} / {r['seconds_max']:.1f} | {'; '.join(r['why']) or 'met'} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="+", help="result folders or search_on_real_steps.json files")
    p.add_argument("--seeds", type=int, default=20, help="seeds per dtype the bar asks for")
    p.add_argument("--worst", type=float, default=0.8, help="share of its gain the worst seed must realize")
    a = p.parse_args(argv)
    if not (runs := load_or_say(a.paths)):
        return 2
    print(table(bar(runs, a.seeds, a.worst, TuneOptions.seconds)))
    print(
        "\nchoices accepted where the world put no faster option in the GEMM (searches; the final decision's to catch):"
    )
    print("\n".join(unfounded_lines(runs)))
    if lines := look_lines(runs):
        print("\nfresh looks at leaders the world gave no faster option, in standard errors of one look:")
        print("\n".join(lines))
    if lines := shown_lines(runs):
        print("\n" + "\n".join(lines))
    if lines := miss_shown_lines(runs):
        print("\nwhat each delay left shows at its size (chosen minus best config, ABBA pairs, mean +- se):")
        print("\n".join(lines))
    if lines := miss_lines(runs):
        print("\nthe looks at the slots where a gain was left (s screen, h halving, r recheck, ...):")
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
