"""Write files so that a reader never sees a half-written one and nothing the user had is lost.

Shared on a cluster: a rewritten file keeps the mode it had, a new one gets the umask's (``mkstemp`` alone makes every
file 0600, unreadable by the job of another account). Preemption: SIGTERM / SIGINT / SIGHUP arriving during a write
(:func:`signals_deferred`) are delivered once the write is done or undone, so a killed job leaves whole files only."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

DEFERRED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Inside the block, :data:`DEFERRED` signals wait: each is recorded, then raised again once the block is done,
    to the handler that was there (a scheduler's SIGTERM lands after the files, not halfway through one). A handler,
    not a signal mask: the kernel hands a process's signal to any thread that does not block it (a watcher thread
    would take it), while a Python handler always runs in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _: came.append(signum)) for s in DEFERRED}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        for s in dict.fromkeys(came):
            signal.raise_signal(s)


def _umask() -> int:
    """The process's umask, read where Linux shows it (setting it to read it would race other threads' files)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/self/status") as f:
            return int(next(ln for ln in f if ln.startswith("Umask:")).split()[1], 8)
    m = os.umask(0o022)
    os.umask(m)
    return m


def _mode_for(path: Path) -> int:
    """The mode ``path`` has, or the one a new file gets from the umask."""
    try:
        return path.stat().st_mode & 0o7777
    except OSError:
        return 0o666 & ~_umask()


def atomic_write_text(path: str | Path, text: str, backup: bool = False) -> Path | None:
    """Write ``text`` to ``path`` through a temp file in the same directory and ``os.replace``.

    With ``backup=True`` an existing, different file is first copied to ``<path>.bak`` (itself
    written atomically). Returns the backup path, if one was made.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    bak = None
    with signals_deferred():
        mode = _mode_for(path)
        if backup and path.exists() and path.read_text() != text:
            bak = path.with_name(path.name + ".bak")
            _replace_with(bak, lambda tmp: shutil.copy2(path, tmp), mode)
        _replace_with(path, lambda tmp: _write(tmp, text), mode)
    return bak


def _write(tmp: str, text: str) -> None:
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _replace_with(path: Path, fill: Callable[[str], object], mode: int) -> None:
    """``fill(tmp)`` a temporary file beside ``path``, give it ``mode``, move it over ``path``; on any failure (a full
    disk: ENOSPC) the temporary file is removed and ``path`` is as it was."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        fill(tmp)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def unwritable(folder: str | Path) -> str | None:
    """Why files cannot be created in ``folder`` (made if missing), or None. Checked before GPU work, by trying:
    ``os.access`` says yes to root even where nothing can be created (``/proc/nope``, a read-only mount). The probe
    creates the first missing folder (then removes it) or a temporary file in the folder (then removes it); ranks
    probing one place at once can undo each other's folder, so a failure is tried again before it counts."""
    why = None
    for _ in range(3):
        why = _probe(Path(folder).expanduser().absolute())
        if why is None:
            return None
    return why


def _probe(target: Path) -> str | None:
    probe, missing = target, None
    while not probe.exists() and probe != probe.parent:
        probe, missing = probe.parent, probe
    if not probe.is_dir():
        return f"{probe} is not a folder"
    try:
        if missing is not None:
            try:
                os.mkdir(missing)
            except FileExistsError:  # created meanwhile (another rank probing): it can be
                return None
            with contextlib.suppress(OSError):
                os.rmdir(missing)
        else:
            fd, tmp = tempfile.mkstemp(dir=probe, prefix=".megatron_tp_overlap.probe.")
            os.close(fd)
            os.unlink(tmp)
    except OSError as e:
        return f"cannot create {missing if missing is not None else f'files in {probe}'} ({e.strerror or e})"
    return None
