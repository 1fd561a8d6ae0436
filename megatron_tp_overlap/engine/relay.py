"""A failure posted in the c10d store reaches every rank of a node through one store wait per node and a node-local
file (``engine.lockstep``'s watcher threads read it; no polling of the store)."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

WAIT_S = 3600.0  # the relay's store wait is posted again after this (a timeout logs a c10d warning: keep it rare)
CLOSED = "closed"  # the relay's last message: the tuning is over


def _marker_dir() -> Path:
    shm = Path("/dev/shm")  # node-local memory: the ranks of one node see it, nothing else does
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class Relay:
    """A failure posted in the store reaches every rank of a node through one waiter per node and a local file.

    The file holds the first failure of the latest epoch that had one (``{"epoch", "why"}``) and ``"gone": true``
    once the store's host (rank 0) has ended."""

    def __init__(self, store: Any, prefix: str, path: Path, waiter: bool, closer: bool) -> None:
        self.store, self.prefix, self.path, self.waiter, self.closer = store, prefix, path, waiter, closer
        self.requests = 0  # store requests this rank made (the harness counts them)
        self._stop = threading.Event()
        self._seen: tuple[int, int] | None = None
        self._cached: dict[str, Any] | None = None
        self._thread: threading.Thread | None = None
        if waiter:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            self._thread = threading.Thread(target=self._wait, name="tp-overlap-relay", daemon=True)
            self._thread.start()

    def post(self, epoch: int, why: str) -> int:
        """Announce a failure in ``epoch``; returns its order (1 = the first of this tuning)."""
        return self.post_raw({"epoch": epoch, "why": why})

    def post_raw(self, alarm: dict[str, Any]) -> int:
        n = int(self.store.add(f"{self.prefix}/alarms", 1))
        self.store.set(f"{self.prefix}/alarm/{n}", json.dumps(alarm))
        self.requests += 2
        return n

    def read(self) -> dict[str, Any] | None:
        """What the node's file says (cached until the file changes)."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        if self._seen != (st.st_mtime_ns, st.st_size):
            try:
                self._cached = json.loads(self.path.read_text())
                self._seen = (st.st_mtime_ns, st.st_size)
            except (OSError, ValueError):  # replaced while reading: read it next time
                return self._cached
        return self._cached

    def _write(self, state: dict[str, Any]) -> None:
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.path)  # readers see the old file or the new one, never half of one

    def _wait(self) -> None:
        try:
            store = self.store.clone()  # its own connection: a wait must not hold the training's store client
        except Exception:  # noqa: BLE001 - a store without clone(): wait on the shared one
            store = self.store
        state: dict[str, Any] = {}
        k = 1
        while not self._stop.is_set():
            key = f"{self.prefix}/alarm/{k}"
            try:
                store.wait([key], datetime.timedelta(seconds=WAIT_S))
                msg = store.get(key).decode()
                self.requests += 2
            except Exception as e:  # noqa: BLE001 - a timeout (wait again), or the store's host has ended
                if "timeout" in str(e).lower() or "timed out" in str(e).lower():
                    continue
                if not self._stop.is_set():
                    self._write({**state, "gone": True})
                return
            if msg == CLOSED:
                return
            alarm = json.loads(msg)
            if "epoch" not in alarm:  # a census or a verdict (engine.ending): kept beside the failure
                state = {**state, **alarm}
                self._write(state)
            elif state.get("epoch") != alarm["epoch"]:  # the first failure of an epoch is its cause
                state = {k: v for k, v in state.items() if k in ("census", "verdict")}
                state.update(epoch=alarm["epoch"], why=alarm["why"])
                self._write(state)
            k += 1

    def close(self) -> None:
        self._stop.set()
        if self.closer:  # wakes every node's waiter (they would otherwise wait out WAIT_S)
            with contextlib.suppress(Exception):
                n = int(self.store.add(f"{self.prefix}/alarms", 1))
                self.store.set(f"{self.prefix}/alarm/{n}", CLOSED)
                self.requests += 2
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
