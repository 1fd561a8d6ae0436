"""Where a rank's way out of a finished training run goes. Runs the script as ``-m megatron_tp_overlap.run`` does
and prints, per rank, when the script returned (with the process groups and threads still alive then), when the
interpreter's thread shutdown began and ended, and when the last atexit handler ran; a rank still on its way out
5 s after its thread shutdown began dumps every thread's Python stack (faulthandler).

    torchrun --nproc-per-node=2 benchmarks/exit_trace.py [--iteration-log PATH] pretrain_gpt.py <Megatron args>

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


def threads() -> str:
    return "threads " + ", ".join(f"{t.name}{'' if t.daemon else '(non-daemon)'}" for t in threading.enumerate())


def main() -> None:
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


if __name__ == "__main__":
    main()
