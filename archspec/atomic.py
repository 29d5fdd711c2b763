"""Atomic file writes: readers see the old file or the whole new one, never a part.

Nothing a user made is lost to a crash or Ctrl-C halfway through a write: the data goes
to a temporary file in the same directory (so `os.replace` is a rename on one file
system), is flushed to disk, and only then replaces the target.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def write_atomic(path: str | os.PathLike[str], write: Callable[[BinaryIO], None]) -> None:
    """Create or replace `path` with what `write(handle)` writes to a binary handle."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp creates the file 0600; give it the mode a plain open() would (0666 less
        # the umask) so results stay readable by the user's other tools and accounts.
        os.fchmod(fd, 0o666 & ~_current_umask())
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """`write_atomic` for UTF-8 text."""
    write_atomic(path, lambda handle: handle.write(text.encode("utf-8")))
