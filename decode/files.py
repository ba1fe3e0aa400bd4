"""The bench's output files (``--json``, ``--plot``, ``--samples-out``): each written whole or not at all, and a
failed write after measuring that keeps the figures (:class:`UnwrittenOutput`). Standard library only."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


class UnwrittenOutput(Exception):
    """A bench measured, but a file it was asked for could not be written: ``result`` holds the figures."""

    def __init__(self, result: dict, message: str) -> None:
        super().__init__(message)
        self.result = result


def _new_file_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_whole(path: str | Path, write: Callable[[Path], object]) -> None:
    """``write(p)`` writes the file's content to ``p``: a temporary file beside ``path``, renamed over ``path``
    when complete, so that ``path`` never holds half a file. Missing directories are created; a device or pipe
    (``/dev/stdout``) is written in place.

    Raises:
        OSError: the file could not be written (nothing is left behind).
    """
    path = Path(path).expanduser()
    if path.exists() and not path.is_file() and not path.is_dir():
        write(path)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix)
    os.close(fd)
    tmp = Path(name)
    try:
        os.chmod(tmp, path.stat().st_mode & 0o7777 if path.is_file() else _new_file_mode())
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def os_reason(e: OSError) -> str:
    """An OSError in a few words ("No space left on device")."""
    return e.strerror or str(e) or type(e).__name__
