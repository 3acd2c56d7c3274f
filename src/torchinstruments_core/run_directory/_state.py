"""Reading a run folder in any state: which files hold the data, and whether it needs repair.

Finalizing a run goes in an order that a reader can always interpret:

1. ``history.parts/`` chunks are compacted into ``history.parquet`` and ``samples.parquet``
   (each through a temporary, then renamed);
2. ``index.md`` is written, then ``result.json`` with a finished status: this is the commit;
3. ``history.parts/`` is removed.

So ``result.json`` with a finished status (``complete``, ``complete_with_losses``, ``recovered``)
means ``history.parquet`` is authoritative, whatever is left of ``history.parts/``. Any other
status (``running``, ``needs_repair``) or no ``result.json`` means the chunks in
``history.parts/`` are authoritative: the run is being written (its folder is locked by a live
process), or it crashed or was killed, possibly in the middle of finalizing, and
``repair`` completes it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from torchinstruments_core.run_directory._atomic import is_temporary
from torchinstruments_core.run_directory._claim import folder_in_use
from torchinstruments_core.run_directory._layout import RunLayout

if TYPE_CHECKING:
    from pathlib import Path


class RunStatus(StrEnum):
    """The ``status`` of ``result.json``."""

    RUNNING = "running"
    """Being written, or the process died before finalizing (see ``RunState.live``)."""
    COMPLETE = "complete"
    """Finalized; every sample taken is in ``history.parquet``."""
    COMPLETE_WITH_LOSSES = "complete_with_losses"
    """Finalized; ``lost`` in ``result.json`` counts the samples and rows not written, and why."""
    NEEDS_REPAIR = "needs_repair"
    """Finalizing failed (a full disk): the chunks are intact; ``repair`` completes the run."""
    RECOVERED = "recovered"
    """Finalized by ``repair`` after a crash, a kill or a failed finalization."""


FINISHED = frozenset({RunStatus.COMPLETE, RunStatus.COMPLETE_WITH_LOSSES, RunStatus.RECOVERED})


@dataclass(frozen=True, slots=True)
class RunState:
    """What a run folder holds, read without changing it.

    Attributes:
        folder: The run folder (one rank's under ``rank_policy="all"``).
        status: ``result.json``'s status, or ``None`` without a readable ``result.json``.
        live: A live process holds the folder: the run is being written.
        history: The files holding the long table: ``history.parquet`` for a finished run, else
            the chunks in ``history.parts/``; pass them to ``polars.scan_parquet``.
        samples: The same for the per-sample table.
        leftovers: What an interrupted finalization or a killed writer left behind: orphan
            temporaries, and the chunks of a run that is finished already.
    """

    folder: Path
    status: str | None
    live: bool
    history: tuple[Path, ...]
    samples: tuple[Path, ...]
    leftovers: tuple[Path, ...]

    @property
    def finished(self) -> bool:
        """``result.json`` has a finished status: ``history.parquet`` is authoritative."""
        return self.status in FINISHED

    @property
    def needs_repair(self) -> bool:
        """No live process writes it, and it is unfinished or holds leftovers."""
        return not self.live and (not self.finished or bool(self.leftovers))


def inspect_run(folder: Path) -> RunState:
    """The state of the run in ``folder`` (one run, not a folder of ``rank-NNN`` runs)."""
    layout = RunLayout(folder)
    status = read_status(layout.result)
    finished = status in FINISHED
    chunks = {table: _chunks(layout, table) for table in ("history", "samples")}
    leftovers = _temporaries(layout)
    if finished:
        leftovers += sorted(layout.parts.iterdir()) if layout.parts.is_dir() else []
    return RunState(
        folder=folder,
        status=status,
        live=folder_in_use(folder),
        history=_authoritative(finished, layout.history, chunks["history"]),
        samples=_authoritative(finished, layout.samples, chunks["samples"]),
        leftovers=tuple(leftovers),
    )


def read_status(result: Path) -> str | None:
    """The status written in ``result.json``, or ``None`` when it is missing or unreadable."""
    try:
        status = json.loads(result.read_text(encoding="utf-8")).get("status")
    except (OSError, ValueError, AttributeError):
        return None
    return status if isinstance(status, str) else None


def _authoritative(finished: bool, compacted: Path, chunks: list[Path]) -> tuple[Path, ...]:
    if finished or not chunks:
        return (compacted,) if compacted.is_file() else ()
    return tuple(chunks)


def _chunks(layout: RunLayout, table: str) -> list[Path]:
    if not layout.parts.is_dir():
        return []
    return sorted(p for p in layout.parts.glob(f"{table}-*.parquet") if p.is_file())


def _temporaries(layout: RunLayout) -> list[Path]:
    found: list[Path] = []
    for folder in (layout.root, layout.parts):
        if folder.is_dir():
            found += sorted(p for p in folder.iterdir() if is_temporary(p.name))
    return found
