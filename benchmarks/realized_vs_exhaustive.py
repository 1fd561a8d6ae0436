"""Issue 19's in-run acceptance: the gain a Megatron-LM run measured for its tuned config (the in-run verification,
vs TE's default, ms per iteration) against the gain the layer benchmark's slot-exhaustive search finds for the
same layers on the same machine, scaled to the run's layers and micro-batches.

    python benchmarks/realized_vs_exhaustive.py --layer DIR/overlap_vs_baselines_tp2.json \\
        --run DIR/megatron_qwen14b_like.json=qwen14b_like --run DIR/megatron_llama8b_like.json=llama3_8b

``--run JSON=CASE``: a ``benchmarks/megatron_autotune.py`` result and the ``benchmarks/overlap_vs_baselines.py`` case
with the same dimensions, sequence and micro-batch size (checked). A layer-benchmark step is the forward and backward
of ``layers`` layers on one micro-batch, so per iteration the exhaustive gain is
``(TE default - slot-exhaustive best) x run layers / bench layers x micro-batches per iteration`` (PP=1).
Target: realized >= 80% of it. Prints a table; ``--out`` also writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TARGET = 0.8  # realized share of the slot-exhaustive gain


def expected_gain_ms(case: dict, model: dict) -> float:
    """The slot-exhaustive gain over TE's default of a layer-benchmark ``case``, per iteration of the run ``model``
    (``megatron_autotune.py``'s ``model``); ValueError when they are not the same layers."""
    d = case["dims"]
    problems = []
    if [d["hidden"], d["ffn"], d["heads"], d["kv_heads"]] != list(model["dims"]):
        problems.append(f"dims {[d['hidden'], d['ffn'], d['heads'], d['kv_heads']]} vs the run's {model['dims']}")
    for k, m in (("seq", "seq"), ("mbs", "micro_batch"), ("tp", "tp")):
        if case[k] != model[m]:
            problems.append(f"{k} {case[k]} vs the run's {model[m]}")
    if model["pp"] != 1:
        problems.append(f"the run has PP={model['pp']}: the scaling assumes PP=1")
    if problems:
        raise ValueError(f"case {case['case']} is not the run's layers: " + "; ".join(problems))
    ms = case["step_ms"]
    per_step = ms["TE default"]["median"] - ms["slot-exhaustive best"]["median"]
    return per_step * model["layers"] / case["layers"] * model["micro_batches_per_iter"]


def compare(run: dict, case: dict) -> dict:
    """One row: realized (the verification's gain, 0 when the run went back), expected, their ratio."""
    v = (run.get("tuning") or {}).get("in_run_verification")
    expected = expected_gain_ms(case, run["model"])
    row = {"case": case["case"], "expected_ms": round(expected, 3), "fp8": run["model"]["fp8"]}
    if not v:
        return {**row, "realized_ms": None, "ratio": None, "met": False, "note": "no in-run verification in the run"}
    realized = 0.0 if v["reverted"] else v["gain_ms"]
    ratio = realized / expected if expected > 0 else None
    return {
        **row,
        "realized_ms": round(realized, 3),
        "interval_ms": [v["ci_low_ms"], v["ci_high_ms"]],
        "level": v["level"],
        "kept": v["kept"],
        "iter_ms": v["reference_iter_ms"],
        "ratio": None if ratio is None else round(ratio, 3),
        "met": expected <= 0 or (ratio is not None and ratio >= TARGET),
        "note": "the exhaustive search found no gain over TE's default" if expected <= 0 else "",
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layer", nargs="+", required=True, help="overlap_vs_baselines_tp*.json files")
    p.add_argument("--run", action="append", required=True, help="megatron_<tag>.json=CASE")
    p.add_argument("--out")
    a = p.parse_args(argv)
    cases = {c["case"]: c for f in a.layer for c in json.loads(Path(f).read_text())}
    rows = []
    for spec in a.run:
        path, _, name = spec.rpartition("=")
        if name not in cases:
            p.error(f"--run {spec}: no case {name!r} in {', '.join(a.layer)} (has {', '.join(cases)})")
        rows.append({"run": Path(path).stem, **compare(json.loads(Path(path).read_text()), cases[name])})
    print(
        "| run | layer case | realized ms/iter [interval] | slot-exhaustive ms/iter (scaled) | realized share | "
        f">= {TARGET:.0%} |\n|---|---|---|---|---|---|"
    )
    for r in rows:
        iv = f" [{r['interval_ms'][0]}, {r['interval_ms'][1]}] {r['level']:.0%}" if r.get("interval_ms") else ""
        share = "-" if r["ratio"] is None else f"{100 * r['ratio']:.0f}%"
        print(
            f"| {r['run']} | {r['case']} | {r['realized_ms']}{iv} | {r['expected_ms']} | {share} | "
            f"{'yes' if r['met'] else 'NO'}{' (' + r['note'] + ')' if r['note'] else ''} |"
        )
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
