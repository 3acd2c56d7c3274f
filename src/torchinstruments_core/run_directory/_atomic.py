"""Files that appear whole or not at all, through temporaries nobody can predict or redirect.

Every file of a run is written to a temporary beside it, then renamed over its final name, so a
reader (or a run killed mid-write) sees the old file or the new one, never a partial one. The
temporary is created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` under a random name: a link planted
in the run folder is never followed, and the data is written through that descriptor (never by
reopening the name). Its mode is ``0o666`` before the umask, like any file the user creates, so
``result.json`` and ``index.md`` get the same permissions as the Parquet files.

A temporary that a killed process left behind is named ``.<final name>.<16 hex digits>.tmp``;
``is_temporary`` recognizes it (and the names earlier versions used) for ``repair``.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from typing import TYPE_CHECKING, BinaryIO

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    import polars as pl

_FLAGS = (
    os.O_WRONLY
    | os.O_CREAT
    | os.O_EXCL
    | getattr(os, "O_NOFOLLOW", 0)  # O_EXCL alone already refuses an existing link on POSIX
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_BINARY", 0)
)
_TEMPORARY = re.compile(
    r"^\.(history\.parquet|samples\.parquet|result\.json|index\.md|(history|samples)-\d+\.parquet)"
    r"\.[^/]+\.tmp$"
)


def open_temporary(target: Path) -> tuple[BinaryIO, Path]:
    """Create a new, empty temporary beside ``target``; the caller writes it and renames it."""
    while True:
        path = target.with_name(f".{target.name}.{secrets.token_hex(8)}.tmp")
        try:
            descriptor = os.open(path, _FLAGS, 0o666)
        except FileExistsError:  # 64 random bits: only a planted name collides, so draw again
            continue
        return os.fdopen(descriptor, "wb"), path


@contextlib.contextmanager
def replacing(target: Path) -> Iterator[BinaryIO]:
    """Yield a file whose content replaces ``target`` atomically when the block succeeds.

    On any failure (a full disk, a kill signal turned into an exception) the temporary is
    removed, so a failed write neither leaves a file behind nor holds on to disk space.
    """
    handle, temporary = open_temporary(target)
    try:
        with handle:
            yield handle
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` so that readers see the old file or the new one, never a partial file."""
    with replacing(path) as handle:
        handle.write(text.encode("utf-8"))
        handle.flush()
        os.fsync(handle.fileno())


def atomic_write_parquet(frame: pl.DataFrame, path: Path) -> None:
    """Write ``frame`` to ``path`` atomically."""
    with replacing(path) as handle:
        frame.write_parquet(handle)


def atomic_sink_parquet(frame: pl.LazyFrame, path: Path) -> None:
    """Stream ``frame`` into ``path`` atomically, with bounded memory."""
    with replacing(path) as handle:
        frame.sink_parquet(handle)


def is_temporary(name: str) -> bool:
    """Whether ``name`` is a temporary of a run file (an orphan, once its writer has gone)."""
    return _TEMPORARY.match(name) is not None
