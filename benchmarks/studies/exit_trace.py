"""Where a rank's way out of a finished training run goes. Runs the script as ``-m megatron_tp_overlap.run`` does
and prints, per rank, when the script returned (with the process groups and threads still alive then), when the
interpreter's thread shutdown began and ended, and when the last atexit handler ran; a rank still on its way out
5 s after its thread shutdown began dumps every thread's Python stack (faulthandler). multiprocessing logs each step
of its own atexit handler (DataLoader workers, queue threads), and the DataLoader iterators still alive when the
script returned are named with what holds them.

    torchrun --nproc-per-node=2 benchmarks/studies/exit_trace.py [--iteration-log PATH] pretrain_gpt.py <Megatron args>

Issue 21: "a finished job exits within a few seconds of its last output" (``megatron_autotune.py --exit-trace``).
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import sys
import threading
import time

RANK = os.environ.get("RANK", "0")


def say(what: str) -> None:
    now = time.time()
    print(
        f"[exit-trace] rank {RANK} {time.strftime('%H:%M:%S', time.localtime(now))}.{int(now * 1e3) % 1000:03d} {what}",
        file=sys.stderr,
        flush=True,
    )


def process_groups() -> str:
    import torch.distributed as dist

    if not dist.is_initialized():
        return "no process group"
    c10d = dist.distributed_c10d
    rows = []
    for pg in list(c10d._world.pg_map):
        try:
            rows.append(f"{dist.get_backend(pg)}{dist.get_process_group_ranks(pg)}")
        except Exception as e:  # noqa: BLE001 - a diagnostic: name what could not be read
            rows.append(f"?({type(e).__name__})")
    return f"{len(rows)} process groups alive: {', '.join(rows)}"


def holders(obj: object, depth: int = 6, width: int = 4) -> list[str]:
    """Chains of what refers to ``obj``, innermost first, at most ``depth`` deep and ``width`` referrers per level
    (type names; a dict by the key that holds the object, a frame by its code, a module by name): who keeps it
    alive."""
    import gc
    import types

    def name(o: object, held: object) -> str:
        if isinstance(o, types.FrameType):
            return f"frame {o.f_code.co_name} ({o.f_code.co_filename.rsplit('/', 2)[-1]}:{o.f_lineno})"
        if isinstance(o, types.FunctionType):
            return f"function {o.__qualname__}"
        if isinstance(o, types.ModuleType):
            return f"module {o.__name__}"
        if isinstance(o, dict):
            return f"dict[{next((k for k, v in o.items() if v is held), '?')!r}]"
        return type(o).__name__

    chains: list[str] = []
    skip = {id(chains)}

    def walk(o: object, chain: list[str], d: int) -> None:
        refs = [
            r
            for r in gc.get_referrers(o)
            if id(r) not in skip and not (isinstance(r, types.FrameType) and r.f_code is walk.__code__)
        ]
        skip.add(id(refs))  # the walk's own lists and frames hold what it visits: never followed
        if d == 0 or not refs or isinstance(o, types.ModuleType):
            chains.append(" <- ".join(chain))
            return
        for k in range(min(width, len(refs))):  # no slice: a new list would hold the referrers too
            skip.add(id(refs[k]))
            walk(refs[k], [*chain, name(refs[k], o)], d - 1)

    walk(obj, [type(obj).__name__], depth)
    return chains[:16]


def data_loader_iterators() -> str:
    import gc

    try:
        from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter
    except ImportError:
        return "no torch"
    live = [o for o in gc.get_objects() if isinstance(o, _MultiProcessingDataLoaderIter)]
    lines = [f"{len(live)} multi-process DataLoader iterators alive"]
    for it in live:
        lines += ["  held by: " + c for c in holders(it)]
    del live
    n = gc.collect()
    left = sum(isinstance(o, _MultiProcessingDataLoaderIter) for o in gc.get_objects())
    return "\n".join([*lines, f"  after gc.collect() ({n} objects): {left} alive"])


def threads() -> str:
    return "threads " + ", ".join(f"{t.name}{'' if t.daemon else '(non-daemon)'}" for t in threading.enumerate())


def main() -> None:
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print("usage: " + __doc__.strip().split("\n\n")[1].strip() + "\n\n" + __doc__.strip().split("\n\n")[0])
        return
    atexit.register(say, "last atexit handler done")  # registered first: runs last
    shutdown = threading._shutdown

    def traced_shutdown() -> None:  # the interpreter calls threading._shutdown() before the atexit handlers
        say("thread shutdown begins; " + threads())
        faulthandler.dump_traceback_later(5, exit=False)
        shutdown()
        say("thread shutdown done")

    threading._shutdown = traced_shutdown
    from megatron_tp_overlap.integrations.megatron.launcher import run_script

    try:
        run_script(sys.argv[1:])
    finally:
        say("script returned; " + process_groups() + "; " + threads())
        import logging
        import multiprocessing.util as mpu

        logging.basicConfig(format=f"[exit-trace] rank {RANK} %(asctime)s multiprocessing: %(message)s")
        mpu.log_to_stderr(mpu.SUBDEBUG)
        for h in mpu.get_logger().handlers:  # with times
            h.setFormatter(logging.Formatter(f"[exit-trace] rank {RANK} %(asctime)s multiprocessing: %(message)s"))
        say(data_loader_iterators())


if __name__ == "__main__":
    main()
