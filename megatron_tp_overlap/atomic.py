"""Write files so that a reader never sees a half-written one and nothing the user had is lost."""

from __future__ import annotations

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
    """Why files cannot be created in ``folder`` (made if missing), or None. Checked before GPU work."""
    probe = Path(folder).expanduser().absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is not a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{folder}: the nearest existing folder {probe} is not writable"
    return None
