"""Who writes a run folder: one sink per folder in a process, one live process per folder.

Two claims keep two writers out of one folder:

- Within a process, ``claim_folder`` at injection: a second observer given a folder that another
  observer of the same process holds is refused before training starts. The claim ends when the
  sink closes (or is garbage-collected).
- Across processes, ``lock_folder`` when the run opens: an exclusive ``flock`` on the run folder,
  held until the run is finalized and released by the kernel if the process dies. It is what
  tells ``repair`` that a run without a finished ``result.json`` is still being written rather
  than crashed. (Across processes the claim cannot be taken at injection: under DDP every rank
  injects, before it knows its rank, into the folder that only rank 0 will write.)
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import TYPE_CHECKING

from torchinstruments_core._exceptions import RunDirectoryExistsError

try:
    import fcntl

    _HAS_FLOCK = True
except ImportError:  # pragma: no cover - Windows has no flock; the in-process claim still holds
    _HAS_FLOCK = False

if TYPE_CHECKING:
    from pathlib import Path

_claims: dict[str, weakref.ref[object]] = {}
_claims_lock = threading.Lock()


def claim_folder(folder: Path, owner: object) -> None:
    """Record that ``owner`` writes ``folder``; raise if another live owner in this process does."""
    key = os.path.realpath(folder)
    with _claims_lock:
        holder = _claims.get(key)
        current = holder() if holder is not None else None
        if current is not None and current is not owner:
            raise RunDirectoryExistsError(
                f"output_dir {str(folder)!r} is already the run folder of {current!r} in this "
                "process; two observers never share a folder: give each its own output_dir"
            )
        _claims[key] = weakref.ref(owner)


def release_folder(folder: Path, owner: object) -> None:
    """End ``owner``'s claim on ``folder`` (nothing if it holds none)."""
    key = os.path.realpath(folder)
    with _claims_lock:
        holder = _claims.get(key)
        if holder is not None and holder() in (owner, None):
            del _claims[key]


def lock_folder(folder: Path) -> int | None:
    """Lock ``folder`` for this process; the descriptor to pass to ``unlock_folder``.

    Returns ``None`` where the file system has no locks (the run goes on unlocked).

    Raises:
        RunDirectoryExistsError: Another live process holds the folder.
    """
    if not _HAS_FLOCK:  # pragma: no cover
        return None
    descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        raise RunDirectoryExistsError(
            f"{str(folder)!r} is being written by another live process"
        ) from None
    except OSError:  # no locks on this file system
        os.close(descriptor)
        return None
    return descriptor


def unlock_folder(descriptor: int | None) -> None:
    """Release a lock taken by ``lock_folder``."""
    if descriptor is None or not _HAS_FLOCK:
        return
    try:
        fcntl.flock(descriptor, fcntl.LOCK_UN)
    finally:
        os.close(descriptor)


def folder_in_use(folder: Path) -> bool:
    """Whether a live process holds ``folder``'s lock (it is writing the run there)."""
    if not _HAS_FLOCK:  # pragma: no cover
        return False
    try:
        descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    else:
        fcntl.flock(descriptor, fcntl.LOCK_UN)
        return False
    finally:
        os.close(descriptor)
