"""Write files so that a reader never sees a half-written one and nothing the user had is lost."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path


def atomic_write_text(path: str | Path, text: str, backup: bool = False) -> Path | None:
    """Write ``text`` to ``path`` through a temp file in the same directory and ``os.replace``.

    With ``backup=True`` an existing, different file is first copied to ``<path>.bak`` (itself
    written atomically). Returns the backup path, if one was made.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    bak = None
    if backup and path.exists() and path.read_text() != text:
        bak = path.with_name(path.name + ".bak")
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.bak.")
        os.close(fd)
        shutil.copy2(path, tmp)
        os.replace(tmp, bak)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return bak


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
