"""Run GPU benchmark cases (``benchmarks/cases.yaml``) and write their evidence in one folder:

    python benchmarks/suite.py --cases megatron_tp2,main_job_tp2 --megatron-lm ~/Megatron-LM \\
        --out benchmarks/results/$(date +%F)_h200x2

Per case: ``<case>.log`` (stdout and stderr), the case's own outputs in ``<case>/``; for the folder: ``README.md``
(device, date, commit, the exact command of every case, its exit code, wall time and the log lines its
``report`` patterns select) and ``summary.json``. Cases run one after another, each under its own timeout; with
``--per-gpu`` the one-GPU cases run side by side first, one per GPU (a lease of N GPUs runs N one-GPU studies in the
time of one; the host's CPU cores are shared: a 2-GPU lease had 4), then the others one after another.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from queue import Queue

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def load_cases(path: Path = HERE / "cases.yaml") -> dict[str, dict]:
    cases = yaml.safe_load(path.read_text())
    for name, c in cases.items():
        missing = {"about", "gpus", "timeout_s", "command", "report"} - set(c)
        if missing:
            raise ValueError(f"{path}: case {name}: missing {', '.join(sorted(missing))}")
    return cases


def command_of(case: dict, out: Path, megatron_lm: str | None, gpus: int) -> str:
    if case.get("needs") == "megatron_lm" and not megatron_lm:
        raise ValueError("this case needs --megatron-lm DIR (a Megatron-LM checkout at tag core_v0.19.0)")
    return case["command"].format(out=out, megatron_lm=megatron_lm or "", gpus=gpus)


def selected_lines(log: str, patterns: list[str]) -> list[str]:
    rx = [re.compile(p) for p in patterns]
    return [line.rstrip() for line in log.splitlines() if any(r.search(line) for r in rx)]


def device() -> tuple[str, int]:
    try:
        names = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return "no GPU", 0
    return f"{len(names)} x {names[0].split(':', 1)[1].split('(')[0].strip()}" if names else "no GPU", len(names)


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def run_case(name: str, case: dict, out: Path, megatron_lm: str | None, gpus: int, env: dict | None = None) -> dict:
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    cmd = command_of(case, folder, megatron_lm, gpus)
    print(f"[suite] {name}: {cmd}", flush=True)
    t0 = time.time()
    try:
        p = subprocess.run(
            cmd, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=case["timeout_s"], env=env
        )
        rc, log = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, log = 124, (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    wall = time.time() - t0
    log = "\n".join(line for line in log.splitlines() if not line.startswith("!!! [UB"))  # TE's per-buffer lines
    (out / f"{name}.log").write_text(log + "\n")
    lines = selected_lines(log, case["report"])
    print(f"[suite] {name}: rc={rc} in {wall:.0f} s", flush=True)
    return {
        "case": name,
        "about": " ".join(case["about"].split()),
        "command": cmd,
        "rc": rc,
        "wall_s": round(wall, 1),
        "lines": lines,
    }


def one_gpu_env(gpu: int) -> dict[str, str]:
    """The environment of a one-GPU case pinned to ``gpu``: that device alone, and its own torchrun master port
    (side by side, two single-node torchruns both took 29500 on 2 x H100)."""
    return {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu), "PET_MASTER_PORT": str(29600 + 10 * gpu)}


def run_side_by_side(names: list[str], cases: dict, out: Path, megatron_lm: str | None, gpus: int) -> list[dict]:
    """``names`` (one-GPU cases) at once, each on a GPU of its own, as many at a time as there are GPUs."""
    free: Queue[int] = Queue()
    for g in range(gpus):
        free.put(g)

    def one(name: str) -> dict:
        g = free.get()
        try:
            return {**run_case(name, cases[name], out, megatron_lm, 1, one_gpu_env(g)), "gpu": g}
        finally:
            free.put(g)

    with ThreadPoolExecutor(max_workers=gpus) as pool:
        return list(pool.map(one, names))


def readme(results: list[dict], dev: str, argv: list[str]) -> str:
    head = [
        f"# GPU results: {dev}, {datetime.date.today().isoformat()}",
        "",
        f"- commit: `{git('rev-parse', 'HEAD')}`"
        + (" (with uncommitted changes)" if git("status", "--porcelain") else ""),
        f"- device: {dev}",
        f"- suite command: `python {' '.join(shlex.quote(a) for a in argv)}`",
        "",
        "| case | exit code | wall s |",
        "|---|---|---|",
    ]
    head += [f"| {r['case']} | {r['rc']} | {r['wall_s']} |" for r in results]
    side = [f"{r['case']} (GPU {r['gpu']})" for r in results if "gpu" in r]
    head += ["", f"Side by side, one per GPU: {', '.join(side)}"] if side else []
    body = []
    for r in results:
        body += ["", f"## {r['case']}", "", r["about"], "", f"`{r['command']}`", "", "```", *r["lines"][-40:], "```"]
    return "\n".join(head + body) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    cases = load_cases()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", required=True, help=f"comma list of: {', '.join(cases)}")
    p.add_argument("--megatron-lm", default=os.environ.get("MEGATRON_LM"), help="a Megatron-LM checkout (core_v0.19.0)")
    p.add_argument("--out", required=True, help="results folder, e.g. benchmarks/results/<date>_<device>")
    p.add_argument("--per-gpu", action="store_true", help="one-GPU cases side by side, one per GPU, first")
    a = p.parse_args(argv[1:])
    names = [n for n in a.cases.split(",") if n]
    unknown = [n for n in names if n not in cases]
    if unknown:
        p.error(f"unknown case(s) {', '.join(unknown)}; valid: {', '.join(cases)}")
    dev, gpus = device()
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = []
    side = [n for n in names if cases[n]["gpus"] == 1] if a.per_gpu and gpus > 1 else []
    if side:
        results += run_side_by_side(side, cases, out, a.megatron_lm, gpus)
        (out / "README.md").write_text(readme(results, dev, argv))
    for n in (n for n in names if n not in side):
        if cases[n]["gpus"] > gpus:
            results.append(
                {
                    "case": n,
                    "about": cases[n]["about"],
                    "command": "-",
                    "rc": "not run",
                    "wall_s": 0,
                    "lines": [f"needs {cases[n]['gpus']} GPUs, this node has {gpus}"],
                }
            )
            continue
        results.append(run_case(n, cases[n], out, a.megatron_lm, gpus))
        (out / "README.md").write_text(readme(results, dev, argv))  # after each case: a killed run keeps the rest
    (out / "summary.json").write_text(json.dumps(results, indent=1) + "\n")
    print(readme(results, dev, argv))
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
