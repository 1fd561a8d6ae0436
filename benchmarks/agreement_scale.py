"""What the tuning's agreements cost as the job grows: N CPU processes, the project's real ``engine.lockstep``.

Each rank runs the agreement points of a real tuning (the trials, switches and steps of a committed 2-GPU tuning
report, replayed with no GPU work between them) and back-to-back agreements, and records: time per agreement,
messages, file descriptors its agreements opened, and store requests (every rank's store goes through a counter).
The previous design (one world-size gloo group, a MAX all-reduce per point plus one per agree_max, every rank
polling the store twice a second) runs beside it as ``flat``, reproduced here. ``--fault between|midstep`` fails
one rank mid-tuning and records what every rank did. ``--model DIR`` fits the measured points and predicts 1,000 /
4,000 / 16,000 ranks (assumptions printed with the table).

    python benchmarks/agreement_scale.py --ranks 4 8 16 32 64 --out benchmarks/results/<date>_cpu/agreement_scale
    python benchmarks/agreement_scale.py --ranks 64 --fault midstep --out ...
    python benchmarks/agreement_scale.py --model benchmarks/results/<date>_cpu/agreement_scale
"""

from __future__ import annotations

import argparse
import datetime
import json
import lzma
import math
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the heaviest tuning committed: 118 trials, 77 switches, 308 steps in 54 s on 2 H200s (Megatron-LM, qwen14b-like)
REPORT = (
    ROOT / "benchmarks/results/2026-11-23_h200x2/tenth/call3/exit_qwen14b/megatron_qwen14b_like_tuned.report.json.xz"
)
BUDGET_S = 60.0


def tuning_points(report: Path = REPORT, step_checks: bool = True) -> list[int]:
    """The agreement points of the tuning in ``report`` as ``Autotuner.evaluate`` makes them, as the number of values
    each agrees on: a switch's barriers (2; 1 without step checks) and its check, then with step checks one after the
    warm-up step and after each timed step but the last, and the trial's own agreement (engine.lockstep
    .STEP_CHECKS_UP_TO: jobs beyond it agree after the switch and at the end of a trial only)."""
    r = json.loads(lzma.open(report).read() if report.suffix == ".xz" else report.read_text())
    trials, switches = r["trials"], r["meta"]["switches"]
    slots = max(len(t.get("slot_ms") or {}) for t in trials)
    every = len(trials) / max(1, switches)  # which trials switched is not recorded: spread them evenly
    out: list[int] = []
    for i, t in enumerate(trials):
        steps = len(t.get("step_samples_ms") or []) or 1
        if int(i / every) != int((i + 1) / every):
            out += [0, 0] if step_checks else [0]
        out += [0] + ([0] + [0] * (steps - 1) if step_checks else []) + [slots * steps + steps + 3]
    return out


class Counting:
    """A c10d store that counts its requests (wraps the job's TCPStore client)."""

    def __new__(cls, inner):  # a subclass of torch's Store, built lazily (torch imports in the rank only)
        import torch.distributed as dist

        class _Counting(dist.Store):
            def __init__(self, inner, counter):
                super().__init__()
                self.inner, self.counter = inner, counter

            def _n(self):
                with self.counter[1]:
                    self.counter[0] += 1

            def set(self, k, v):
                self._n()
                return self.inner.set(k, v)

            def get(self, k):
                self._n()
                return self.inner.get(k)

            def add(self, k, v):
                self._n()
                return self.inner.add(k, v)

            def check(self, ks):
                self._n()
                return self.inner.check(ks)

            def wait(self, ks, *a):
                self._n()
                return self.inner.wait(ks, *a)

            def compare_set(self, k, e, d):
                self._n()
                return self.inner.compare_set(k, e, d)

            def delete_key(self, k):
                self._n()
                return self.inner.delete_key(k)

            def multi_get(self, ks):
                self._n()
                return self.inner.multi_get(ks)

            def multi_set(self, ks, vs):
                self._n()
                return self.inner.multi_set(ks, vs)

            def num_keys(self):
                return self.inner.num_keys()

            def set_timeout(self, t):
                return self.inner.set_timeout(t)

            def clone(self):
                self._n()
                c = _Counting(self.inner.clone(), self.counter)
                self.counter[2].append(c)  # C++ holds the clone; the Python half must outlive it
                return c

        return _Counting(inner, [0, threading.Lock(), []])


class Flat:
    """The previous design (engine/lockstep.py before this harness): a gloo group of every rank, one MAX all-reduce
    per check and one more per agree_max, and a watcher polling the store twice a second per rank."""

    def __init__(self, store) -> None:
        import torch.distributed as dist

        self.pg = dist.new_group(backend="gloo")
        self.store, self.stop, self.epoch = store, threading.Event(), 0
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        while not self.stop.wait(0.5):
            self.store.add(f"flat/{self.epoch}/failed", 0)

    def _reduce(self, values):
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.pg)
        return t.tolist()

    def agree_max(self, values):
        self.check()
        return self._reduce(list(values))

    def check(self):
        self._reduce([0.0])
        self.epoch += 1

    def close(self):
        import torch.distributed as dist

        self.stop.set()
        self.thread.join()
        dist.destroy_process_group(self.pg)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rank(rank: int, world: int, port: int, design: str, local: int, fanout: int, back_to_back: int, out: str):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    tcp = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=600))
    store = Counting(tcp)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    from megatron_tp_overlap.engine.lockstep import Lockstep

    dist.barrier()
    fds0, req0, t0 = _fds(), store.counter[0], time.perf_counter()
    ls = Flat(store) if design == "flat" else Lockstep(local_size=local, fanout=fanout, grace_s=120.0)
    setup_s, fds1, req1 = time.perf_counter() - t0, _fds(), store.counter[0]
    points = tuning_points()
    ts = time.perf_counter()
    for n in points:
        ls.agree_max([float(rank)] * n) if n else ls.check()
    tuning_s = time.perf_counter() - ts
    req2 = store.counter[0]
    tb, cb = time.perf_counter(), time.process_time()
    for _ in range(back_to_back):
        ls.agree_max([float(rank)] * 8)
    b2b_ms = (time.perf_counter() - tb) / back_to_back * 1e3
    cpu_ms = (time.process_time() - cb) / back_to_back * 1e3  # this process's CPU, all its threads
    hops = ls.hops if design == "tree" else 2 * 2 * (world - 1)  # flat: a ring all-reduce is 2 (N - 1) steps, twice
    sent = getattr(getattr(ls, "transport", None), "sent", None)
    ls.close()
    Path(out, f"{design}_{world}_r{rank}.json").write_text(
        json.dumps(
            {
                "fds_opened": fds1 - fds0,
                "setup_s": setup_s,
                "setup_requests": req1 - req0,
                "tuning_points": len(points),
                "tuning_s": tuning_s,
                "tuning_requests": req2 - req1,
                "agree_ms_back_to_back": b2b_ms,
                "cpu_ms_per_agreement": cpu_ms,
                "hops": hops,
                "messages_sent": sent,
            }
        )
    )
    dist.destroy_process_group()


def _fault_rank(rank: int, world: int, port: int, kind: str, local: int, fanout: int, tp: int, out: str):
    """A synthetic tuning whose step runs a collective in a TP-like group of ``tp`` ranks; rank ``world // 2 + 1``
    fails at trial 5: between two steps (``between``) or inside the step, before its collective (``midstep``)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    err = open(Path(out, f"fault_{kind}_r{rank}.err"), "w")
    os.dup2(err.fileno(), 2)
    tcp = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=600))
    dist.init_process_group("gloo", store=tcp, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    from megatron_tp_overlap.engine.lockstep import Lockstep

    first = rank - rank % tp
    step_pg = dist.ProcessGroupGloo(dist.PrefixStore(f"step{first}/", tcp), rank - first, tp, datetime.timedelta(600))
    ls = Lockstep(local_size=local, fanout=fanout, grace_s=5.0)
    bad = world // 2 + 1
    outcome = []
    for trial in range(10):

        def step(trial=trial):
            if kind == "midstep" and rank == bad and trial == 5:
                raise RuntimeError("injected fault inside a step")
            step_pg.allreduce([torch.ones(1)]).wait()
            if kind == "between" and rank == bad and trial == 5:
                raise RuntimeError("injected fault between steps")

        ok = ls.attempt(step) and ls.attempt(step)
        outcome.append({"trial": trial, "ok": ok, "epoch": ls.epoch, "failure": ls.failure})
        ls.failure = ""
    ls.close()
    Path(out, f"fault_{kind}_r{rank}.json").write_text(json.dumps(outcome))
    dist.destroy_process_group()


def _spawn(target, world: int, args: tuple, timeout_s: float) -> list[int | None]:
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, world, port, *args)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    codes = [p.exitcode for p in procs]
    for p in procs:
        p.kill()
    return codes


def measure(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for design in args.designs:
        for n in args.ranks:
            t0 = time.time()
            codes = _spawn(_rank, n, (design, args.local_size, args.fanout, args.back_to_back, str(out)), 1800)
            files = [out / f"{design}_{n}_r{r}.json" for r in range(n)]
            per = [json.loads(f.read_text()) for f in files if f.exists()]
            for f in files:
                f.unlink(missing_ok=True)
            if len(per) != n:
                print(f"{design} N={n}: {n - len(per)} ranks failed (exit codes {codes})", flush=True)
                continue
            row = {
                "design": design,
                "ranks": n,
                "local_size": args.local_size,
                "fanout": args.fanout,
                "fds_opened_max": max(p["fds_opened"] for p in per),
                "setup_s_max": max(p["setup_s"] for p in per),
                "setup_requests_per_rank_max": max(p["setup_requests"] for p in per),
                "tuning_points": per[0]["tuning_points"],
                "tuning_s_max": max(p["tuning_s"] for p in per),
                "tuning_requests_total": sum(p["tuning_requests"] for p in per),
                "tuning_requests_per_s": sum(p["tuning_requests"] for p in per) / max(p["tuning_s"] for p in per),
                "agree_ms_tuning": max(p["tuning_s"] for p in per) / per[0]["tuning_points"] * 1e3,
                "agree_ms_back_to_back": statistics.median(p["agree_ms_back_to_back"] for p in per),
                "cpu_ms_per_agreement_max": max(p["cpu_ms_per_agreement"] for p in per),
                "cpu_ms_per_agreement_total": sum(p["cpu_ms_per_agreement"] for p in per),
                "hops": max(p["hops"] for p in per),
                "messages_per_agreement": (
                    sum(p["messages_sent"] for p in per) / (per[0]["tuning_points"] + args.back_to_back + 1)
                    if per[0]["messages_sent"] is not None
                    else 2 * (n - 1) * 2  # a ring all-reduce: 2(N-1) steps, one message per rank each; x2 per point
                ),
                "wall_s": round(time.time() - t0, 1),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    (out / "points.json").write_text(json.dumps(rows, indent=1))


def fault(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n = max(args.ranks)
    t0 = time.time()
    codes = _spawn(_fault_rank, n, (args.fault, args.local_size, args.fanout, args.tp, str(out)), 600)
    wall = time.time() - t0
    res = {"kind": args.fault, "ranks": n, "failed_rank": n // 2 + 1, "exit_codes": sorted(set(map(str, codes)))}
    if args.fault == "between":
        runs = [json.loads((out / f"fault_between_r{r}.json").read_text()) for r in range(n)]
        res["same_everywhere"] = all(r == runs[0] for r in runs)
        res["failed_trials"] = [t for t in runs[0] if not t["ok"]]
    else:
        lines = [
            [ln for ln in (out / f"fault_midstep_r{r}.err").read_text().splitlines() if "ending the job" in ln]
            for r in range(n)
        ]
        res["ranks_with_one_end_line"] = sum(len(ls) == 1 for ls in lines)
        res["distinct_causes"] = sorted(
            {ls[0].split("tuning failed on ")[1].split(", and the ranks")[0] for ls in lines if ls}
        )
        res["json_written"] = len(list(out.glob("fault_midstep_r*.json")))
    res["wall_s"] = round(wall, 1)
    for f in list(out.glob("fault_*_r*.*")):
        f.unlink()
    (out / f"fault_{args.fault}.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


# --- the model ---------------------------------------------------------------------------------------------------


def depth(n: int, local: int, fanout: int) -> int:
    from megatron_tp_overlap.engine.agreement import place

    return place(0, n, local, fanout).depth


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    mx, my = statistics.mean(xs), statistics.mean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(1e-12, sum((x - mx) ** 2 for x in xs))
    return my - b * mx, b


def model(args: argparse.Namespace) -> None:
    """Measured table, the fits, and a prediction for 1,000 / 4,000 / 16,000 ranks from measured inputs.

    On one machine every rank shares its cores, so an agreement's wall time here is at least the CPU of all ranks
    divided by the cores (O(N) for any design). On a cluster each rank has its own core and the time is the critical
    path: hops x (one hop's software + the network), plus the busiest rank's own CPU. Both come from the points."""
    folder = Path(args.model)
    rows = [r for f in sorted(folder.glob("*/points.json")) for r in json.loads(f.read_text())]
    if (folder / "points.json").exists():
        rows += json.loads((folder / "points.json").read_text())
    lines = [
        "| ranks | design | ranks/node, fan-out | fds opened/rank | store requests/rank at setup | store requests in "
        "the tuning, all ranks (per s) | hops | ms/agreement here (back to back) | ms/agreement here (tuning) | CPU ms/agreement, "
        "busiest rank | CPU ms/agreement, all ranks | messages/agreement |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["design"], r["local_size"], r["ranks"])):
        lines.append(
            f"| {r['ranks']} | {r['design']} | {r['local_size']}, {r['fanout']} | {r['fds_opened_max']} | "
            f"{r['setup_requests_per_rank_max']} | {r['tuning_requests_total']} ({r['tuning_requests_per_s']:.1f}) | "
            f"{r['hops']} | "
            f"{r['agree_ms_back_to_back']:.2f} | {r['agree_ms_tuning']:.2f} | {r['cpu_ms_per_agreement_max']:.3f} | "
            f"{r['cpu_ms_per_agreement_total']:.2f} | {r['messages_per_agreement']:.0f} |"
        )
    fits = []
    for design, local in sorted({(r["design"], r["local_size"]) for r in rows}):
        rs = sorted((r for r in rows if r["design"] == design and r["local_size"] == local), key=lambda r: r["ranks"])
        if len(rs) < 3:
            continue
        logn = [math.log2(r["ranks"]) for r in rs]
        a_h, b_h = _fit(logn, [r["hops"] for r in rs])
        a_c, b_c = _fit(logn, [r["cpu_ms_per_agreement_max"] for r in rs])
        a_n, b_n = _fit([r["ranks"] for r in rs], [r["cpu_ms_per_agreement_total"] for r in rs])
        fits.append(
            f"- {design}, {local} ranks/node: hops = {a_h:.2f} + {b_h:.2f} log2 N; busiest rank's CPU/agreement = "
            f"{a_c:.3f} + {b_c:.3f} log2 N ms; all ranks' CPU/agreement = {a_n:.3f} + {b_n:.4f} N ms "
            f"(N = {rs[0]['ranks']}-{rs[-1]['ranks']})"
        )
    tree = [
        r for r in rows if r["design"] == "tree" and r["local_size"] == args.local_size and r["fanout"] == args.fanout
    ]
    two = min((r for r in rows if r["design"] == "tree" and r["ranks"] == 2), key=lambda r: r["agree_ms_back_to_back"])
    hop_ms = two["agree_ms_back_to_back"] / two["hops"]  # 2 ranks on 2 cores: no rank waits for a core
    msg_ms = two["cpu_ms_per_agreement_max"] / 2  # CPU of one message, sent or received (each rank: one of each)
    contended = max(r["cpu_ms_per_agreement_max"] for r in tree)  # the busiest rank with 64 ranks on 2 cores
    points = len(tuning_points(step_checks=False))  # beyond STEP_CHECKS_UP_TO, as at 1,000-16,000 ranks
    with_checks = len(tuning_points(step_checks=True))
    local, fanout = args.local_size, args.fanout
    lines += [
        "",
        "Fits over the measured points (least squares):",
        *fits,
        "",
        f"Inputs, measured: one hop's software {hop_ms * 1e3:.0f} us and one message's CPU {msg_ms * 1e3:.0f} us "
        f"(2 ranks, 2 cores, back to back); the busiest rank's CPU per agreement {contended:.3f} ms with "
        f"{max(r['ranks'] for r in tree)} ranks on {os.cpu_count()} cores ({local} ranks/node, fan-out {fanout}; "
        "an upper bound: the ranks wait for the cores there); agreement points of the heaviest tuning recorded on 2 "
        f"H200s (118 trials, 77 switches, 308 steps in 54 s): {with_checks} with checks between steps, {points} "
        "without (beyond engine.lockstep.STEP_CHECKS_UP_TO = 1024 ranks). Assumed: "
        f"{local} ranks per node (HGX), a network hop of 25 or 100 us between leaders (the hops inside a node at the "
        "measured loopback cost), the busiest rank's CPU on the critical path whole (none of it overlapping a hop), "
        "each rank on a core of its own.",
        "",
        "ms/agreement = hops x hop + (hops - 2) x network + busiest rank's messages x one message's CPU "
        "(or its contended CPU, the upper bound).",
        "",
        "| ranks | depth | hops | busiest rank's messages | ms/agreement, 25 us network | ms/agreement, 100 us "
        f"network | % of a 60 s budget, {points} points (100 us) | same with the contended CPU | connections/rank "
        "| store requests/s while tuning |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    from megatron_tp_overlap.engine.agreement import place

    for n in (1000, 4000, 16000):
        d = depth(n, local, fanout)
        busiest = max(
            2 * (len(pl.block) - 1 + len(pl.children) + (pl.parent is not None))
            for pl in (place(q, n, local, fanout) for q in (0, local, n - n % local if n % local else n - local))
        )
        hops = 2 * (1 + d)
        ms = [hops * hop_ms + (hops - 2) * net / 1e3 + busiest * msg_ms for net in (25, 100)]
        upper = hops * hop_ms + (hops - 2) * 0.1 + contended
        lines.append(
            f"| {n} | {d} | {hops} | {busiest} | {ms[0]:.2f} | {ms[1]:.2f} | "
            f"{100 * points * ms[1] / 1e3 / BUDGET_S:.2f} | {100 * points * upper / 1e3 / BUDGET_S:.2f} "
            f"({upper:.2f} ms) | <= {local - 1 + 2 * fanout} | 0 (a failure: 2 + 2 per node) |"
        )
    text = "\n".join(lines)
    (folder / "model.md").write_text(text + "\n")
    print(text)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    p.add_argument("--designs", nargs="+", default=["tree", "flat"], choices=["tree", "flat"])
    p.add_argument("--local-size", type=int, default=8, help="ranks per simulated node")
    p.add_argument("--fanout", type=int, default=8)
    p.add_argument("--back-to-back", type=int, default=200, help="agreements timed back to back")
    p.add_argument("--fault", choices=["between", "midstep"])
    p.add_argument("--tp", type=int, default=4, help="--fault: ranks per TP-like step group")
    p.add_argument("--model", help="fit and predict from this folder's points.json")
    p.add_argument("--out", default="agreement_scale")
    args = p.parse_args(argv)
    if args.model:
        model(args)
    elif args.fault:
        fault(args)
    else:
        measure(args)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
