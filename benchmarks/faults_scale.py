"""Faults a large job meets while it tunes, each in N CPU processes running the project's real ``engine.lockstep``.

Each rank runs a synthetic tuning (trials of one step with a collective in a TP-like group of ``--tp`` ranks, an
agreement after each) over a c10d TCPStore, hosted by rank 0 or by a process of its own (as torchrun's agent hosts
it). Rank ``N // 2 + 2`` (or rank 0 for ``kill0``) meets the fault at trial 3:

- ``kill``: it ends abruptly (``os._exit``), the store on rank 0; ``kill_agent``: the same, the store outside;
  ``kill0``: rank 0 itself, which hosts the store;
- ``hang``: it sleeps outside any step, alive, never reaching the next agreement (bound: ``--bound-s``);
- ``store``: the store's host process is killed while the ranks tune;
- ``sigterm``: every rank gets SIGTERM while rank 0 keeps rewriting its outputs (YAML, report, cache entry);
- ``enospc``: after tuning, every write of rank 0's outputs fails with ENOSPC (a user's YAML is there already).

Prints (and writes as ``--out/README`` table rows) per fault and size: seconds from the fault to the last exit,
exit codes, the line the ranks printed (and on how many ranks), whether any output file was half-written.

    python benchmarks/faults_scale.py --ranks 8 32 --out benchmarks/results/<date>_cpu/faults
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("kill", "kill_agent", "kill0", "hang", "store", "sigterm", "enospc")
AGENT = ("kill_agent", "hang", "store", "sigterm", "enospc")  # the store outside the ranks
ENDLESS = ("store", "sigterm")  # the ranks tune until the fault comes from outside


@dataclass
class Setup:
    bound_s: float = 3.0
    census_s: float = 2.0
    poll_s: float = 0.05
    local_size: int = 4
    fanout: int = 8
    tp: int = 4
    trials: int = 8


def bad_rank(kind: str, world: int) -> int:
    return 0 if kind == "kill0" else min(world - 1, world // 2 + 2)


def _agent(port: int, world: int) -> None:
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", port, world, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False
    )
    while store:
        time.sleep(1.0)


def _outputs(folder: Path, trial: int) -> None:
    """What rank 0 leaves behind: the YAML, its report, a cache entry (atomic writes, as the integrations do)."""
    from megatron_tp_overlap.atomic import atomic_write_text, signals_deferred
    from megatron_tp_overlap.engine.cache import TunedConfigCache
    from megatron_tp_overlap.ub.presets import PRESETS

    cfg = list(PRESETS.values())[trial % len(PRESETS)]
    with signals_deferred():
        atomic_write_text(folder / "tuned.yaml", f"# trial {trial}\n" + "x: 1\n" * 2000, backup=True)
        atomic_write_text(folder / "tuned.report.json", json.dumps({"trial": trial, "pad": "x" * 20000}))
        TunedConfigCache(folder / "cache").put(_key(), cfg, meta={"trial": trial})


def _key() -> Any:
    from megatron_tp_overlap.engine.cache import TuningKey

    return TuningKey("cpu", "0", 4, 1, 8192, 4096, 14336, 32, 8, 128, True, "bf16", False, False, "0" * 12, "x")


def _enospc(folder: Path) -> None:
    """Rank 0 writes its outputs through the integrations' own writer on a disk that is full."""
    import types

    from megatron_tp_overlap import atomic
    from megatron_tp_overlap.engine.cache import TunedConfigCache
    from megatron_tp_overlap.engine.space import TuningConfig
    from megatron_tp_overlap.integrations.megatron.flags import Recipe
    from megatron_tp_overlap.integrations.megatron.outputs import _write_outputs
    from megatron_tp_overlap.integrations.megatron.tuning import Tuned
    from megatron_tp_overlap.ub.presets import PRESETS

    class Full:  # a file on a full disk: opens, refuses every byte
        def __init__(self, *a: Any, **k: Any) -> None:
            pass

        def __enter__(self) -> Full:
            return self

        def __exit__(self, *a: Any) -> None:
            pass

        def write(self, _: str) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    # the writer's own open() for writing; the temporary file it made is removed on failure
    (folder.parent / "fault.t").write_text(repr(time.time()))
    atomic.open = lambda f, mode="r", *a, **k: Full() if "w" in mode else open(f, mode, *a, **k)
    config = TuningConfig(next(iter(PRESETS.values())), frozenset(), "autotuned")
    tuned = Tuned(config, None, folder / "tuned.yaml", Recipe(str(folder / "tuned.yaml"), [], [], {}))
    tuned.result = types.SimpleNamespace(report={"summary": "x"})
    _write_outputs(tuned, _key(), TunedConfigCache(folder / "cache"), 1.0, print)
    print(f"[tp-overlap-autotune] trains on: yaml_written={tuned.yaml_written}", flush=True)


def _rank(rank: int, world: int, port: int, kind: str, setup: Setup, out: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    folder = Path(out)
    err = open(folder / f"r{rank}.err", "w")
    os.dup2(err.fileno(), 2)
    os.dup2(err.fileno(), 1)
    # a rank forked from a process whose sys.stderr is not fd 2 (pytest's capture) prints where the others do
    sys.stdout, sys.stderr = (os.fdopen(fd, "w", buffering=1, closefd=False) for fd in (1, 2))
    import faulthandler

    faulthandler.register(signal.SIGUSR1, file=err)
    if kind in AGENT:
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # as torchrun's agent tells its workers
    host = rank == 0 and kind not in AGENT
    tcp = dist.TCPStore("127.0.0.1", port, world, host, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=tcp, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    from megatron_tp_overlap.engine.lockstep import Lockstep

    first = rank - rank % setup.tp
    step_pg = dist.ProcessGroupGloo(
        dist.PrefixStore(f"step{first}/", tcp), rank - first, setup.tp, datetime.timedelta(60)
    )
    ls = Lockstep(
        local_size=setup.local_size,
        fanout=setup.fanout,
        grace_s=30.0,
        poll_s=setup.poll_s,
        bound_s=setup.bound_s,
        census_s=setup.census_s,
    )
    (folder / f"started.{rank}").touch()
    bad = bad_rank(kind, world)
    trial = 0
    while trial < setup.trials or kind in ENDLESS:
        if trial == 3 and rank == bad and kind.startswith("kill") or kind == "hang" and trial == 3 and rank == bad:
            (folder / "fault.t").write_text(repr(time.time()))
            if kind == "hang":
                time.sleep(3600)
            os._exit(9)
        ls.attempt(lambda: step_pg.allreduce([torch.ones(1)]).wait())
        if kind == "sigterm" and rank == 0:
            _outputs(folder / "outputs", trial)
        trial += 1
    ls.close()
    if kind == "enospc" and rank == 0:
        _enospc(folder / "outputs")
    dist.destroy_process_group()


@dataclass
class Launch:
    kind: str
    world: int
    out: Path
    procs: list[Any]
    agent: Any = None
    t_fault: float | None = None
    exits: dict[int, float] = field(default_factory=dict)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(kind: str, world: int, out: Path, setup: Setup, ctx: Any) -> Launch:
    out.mkdir(parents=True, exist_ok=True)
    port = _port()
    agent = ctx.Process(target=_agent, args=(port, world)) if kind in AGENT else None
    if agent is not None:
        agent.start()
    if kind in ("sigterm", "enospc"):  # what the user had: a YAML of theirs, readable by every account
        (out / "outputs").mkdir(exist_ok=True)
        (out / "outputs" / "tuned.yaml").write_text("# the user's\nx: 0\n")
        os.chmod(out / "outputs" / "tuned.yaml", 0o644)
    procs = [ctx.Process(target=_rank, args=(r, world, port, kind, setup, str(out))) for r in range(world)]
    for p in procs:
        p.start()
    return Launch(kind, world, out, procs, agent)


def _poll(launch: Launch) -> bool:
    for r, p in enumerate(launch.procs):
        if r not in launch.exits and p.exitcode is not None:
            launch.exits[r] = time.time()
    return len(launch.exits) == launch.world


def finish(launches: list[Launch], timeout_s: float = 120.0) -> list[dict[str, Any]]:
    """Inject the outside faults once every rank tunes, wait for every exit, and read what happened."""
    deadline = time.monotonic() + timeout_s
    pending = list(launches)
    while pending and time.monotonic() < deadline:
        for la in list(pending):
            started = sum((la.out / f"started.{r}").exists() for r in range(la.world)) == la.world
            if la.kind in ENDLESS and la.t_fault is None and started:
                time.sleep(0.3)  # a few trials in
                la.t_fault = time.time()
                if la.kind == "store":
                    la.agent.kill()
                else:
                    for p in la.procs:
                        os.kill(p.pid, signal.SIGTERM)
            if _poll(la):
                pending.remove(la)
        time.sleep(0.01)
    return [_result(la) for la in launches]


def _result(la: Launch) -> dict[str, Any]:
    for p in la.procs:
        p.kill()
    if la.agent is not None:
        la.agent.kill()
    if la.t_fault is None and (la.out / "fault.t").exists():
        la.t_fault = float((la.out / "fault.t").read_text())
    codes = [p.exitcode for p in la.procs]
    lines = {}
    for r in range(la.world):
        f = la.out / f"r{r}.err"
        mine = [ln for ln in (f.read_text().splitlines() if f.exists() else []) if "[tp-overlap-autotune]" in ln]
        mine = [ln for ln in mine if "ending the job" in ln or "WARNING" in ln or "trains on" in ln]
        for ln in mine:
            lines.setdefault(ln, []).append(r)
    ends = [ln for ln in lines if "ending the job" in ln]
    last = max(la.exits.values()) if len(la.exits) == la.world else None
    return {
        "fault": la.kind,
        "ranks": la.world,
        "bad": bad_rank(la.kind, la.world) if la.kind not in ENDLESS else None,
        "exit_codes": codes,
        "seconds_to_last_exit": round(last - la.t_fault, 2) if last and la.t_fault else None,
        "lines": {ln: rs for ln, rs in lines.items()},
        "end_lines_per_rank": [sum(r in rs for ln, rs in lines.items() if ln in ends) for r in range(la.world)],
        "outputs": outputs_state(la.out / "outputs"),
    }


def outputs_state(folder: Path) -> dict[str, Any]:
    """Whether every output file is whole (parses) and none is left half-written (a temporary file)."""
    if not folder.exists():
        return {}
    from megatron_tp_overlap.engine.cache import TunedConfigCache

    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    temps = [f for f in files if Path(f).name.startswith(".") and Path(f).name != ".lock"]
    whole = True
    for f in files:
        if f.endswith(".json") and f not in temps:
            try:
                json.loads((folder / f).read_text())
            except ValueError:
                whole = False
    cached = TunedConfigCache(folder / "cache").get(_key()) is not None if (folder / "cache").exists() else None
    yaml = folder / "tuned.yaml"
    return {
        "temporary_files": temps,
        "json_whole": whole,
        "cache_entry_valid": cached,
        "yaml_mode": oct(yaml.stat().st_mode & 0o777) if yaml.exists() else None,
        "yaml_head": yaml.read_text().splitlines()[0] if yaml.exists() else None,
    }


def row(r: dict[str, Any]) -> str:
    ends = [ln for ln in r["lines"] if "ending the job" in ln]
    shown = ends or list(r["lines"])
    text = " / ".join(f"`{ln.split('] ', 1)[-1]}` ({len(r['lines'][ln])} ranks)" for ln in shown) or "-"
    codes = ", ".join(f"{c} x{r['exit_codes'].count(c)}" for c in sorted(set(r["exit_codes"]), key=str))
    o = r["outputs"]
    files = (
        f"temps {len(o['temporary_files'])}, JSON whole {o['json_whole']}, cache valid {o['cache_entry_valid']}, "
        f"YAML {o['yaml_mode']} `{o['yaml_head']}`"
        if o
        else "-"
    )
    return f"| {r['fault']} | {r['ranks']} | {r['seconds_to_last_exit']} | {codes} | {text} | {files} |"


HEADER = (
    "| fault | ranks | s from the fault to the last exit | exit codes | the line printed (on how many ranks) | "
    "output files |\n|---|---|---|---|---|---|"
)


def main(argv: list[str] | None = None) -> None:
    import multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 32])
    p.add_argument("--faults", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--bound-s", type=float, default=Setup.bound_s, help="the longest wait at an agreement point")
    p.add_argument("--census-s", type=float, default=Setup.census_s)
    p.add_argument("--out", default="faults_scale")
    args = p.parse_args(argv)
    setup = Setup(bound_s=args.bound_s, census_s=args.census_s)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "megatron_tp_overlap.engine.lockstep"])
    rows = []
    print(HEADER, flush=True)
    for n in args.ranks:
        for kind in args.faults:
            out = Path(args.out) / f"{kind}_{n}"
            r = finish([start(kind, n, out, setup, ctx)], timeout_s=300)[0]
            rows.append(r)
            print(row(r), flush=True)
    Path(args.out, "faults.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
