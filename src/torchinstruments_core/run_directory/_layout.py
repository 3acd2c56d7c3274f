"""Where a run's files go, the rule that a new run never mixes into an old one, atomic writes.

Rule: a run directory holds exactly one run. ``output_dir`` is refused (``RunDirectoryExistsError``)
when it already holds one: a ``result.json``, a ``history.parquet``, a ``history.parts`` folder or
a ``rank-NNN`` folder. Under ``rank_policy="all"`` each rank writes ``output_dir/rank-NNN/`` and a
rank refuses a folder that exists already.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torchinstruments_core._exceptions import RunDirectoryExistsError

if TYPE_CHECKING:
    from pathlib import Path

_RUN_MARKERS = ("result.json", "history.parquet", "history.parts", "samples.parquet")


@dataclass(frozen=True, slots=True)
class RunLayout:
    """The paths of one run (one rank's run under ``rank_policy="all"``)."""

    root: Path

    @property
    def parts(self) -> Path:
        """Folder of the immutable history chunks written during the run."""
        return self.root / "history.parts"

    @property
    def history(self) -> Path:
        """The compacted long table."""
        return self.root / "history.parquet"

    @property
    def samples(self) -> Path:
        """One row per sample: step, timestamp, forward_only, collection_duration_ms."""
        return self.root / "samples.parquet"

    @property
    def result(self) -> Path:
        """Aggregates per layer, call, signal, tensor and metric."""
        return self.root / "result.json"

    @property
    def index(self) -> Path:
        """The human- and LLM-readable guide to the run."""
        return self.root / "index.md"

    @property
    def tensorboard(self) -> Path:
        """TensorBoard event files of the focus layers."""
        return self.root / "tensorboard"

    def part(self, table: str, number: int) -> Path:
        """Path of chunk ``number`` of ``table`` (``history`` or ``samples``)."""
        return self.parts / f"{table}-{number:06d}.parquet"


def existing_run(folder: Path) -> Path | None:
    """The first file or folder showing that ``folder`` already holds a run, if any."""
    if not folder.is_dir():
        return None
    for marker in _RUN_MARKERS:
        if (folder / marker).exists():
            return folder / marker
    return next(iter(sorted(folder.glob("rank-[0-9][0-9][0-9]*"))), None)


def next_free_folder(folder: Path) -> Path:
    """``folder`` if it holds no run, else the first ``<folder>-resumed-<k>`` that holds none."""
    candidate, k = folder, 1
    while existing_run(candidate) is not None:
        candidate = folder.with_name(f"{folder.name}-resumed-{k}")
        k += 1
    return candidate


def refuse_existing(folder: Path) -> None:
    """Raise ``RunDirectoryExistsError`` when ``folder`` already holds a run."""
    found = existing_run(folder)
    if found is not None:
        raise RunDirectoryExistsError(
            f"output_dir {str(folder)!r} already holds a run ({found.name} exists); a new run "
            "never overwrites or mixes into an old one: pass a new output_dir or move the old run"
        )


def layout_for(output_dir: Path, *, rank: int, per_rank: bool) -> RunLayout:
    """Create and return this process's run folder, refusing one that holds a run."""
    root = output_dir / f"rank-{rank:03d}" if per_rank else output_dir
    refuse_existing(root)
    if per_rank and root.exists():
        raise RunDirectoryExistsError(
            f"{str(root)!r} exists already; two processes have rank {rank}"
        )
    root.mkdir(parents=True, exist_ok=True)
    layout = RunLayout(root)
    layout.parts.mkdir()
    return layout


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` so that readers see the old file or the new one, never a partial file."""
    with tempfile.NamedTemporaryFile(
        "w", encoding="utf-8", dir=path.parent, prefix=f".{path.name}.", suffix=".tmp", delete=False
    ) as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(handle.name, path)


def temporary_sibling(path: Path) -> Path:
    """A hidden temporary path next to ``path`` (same filesystem, so a rename is atomic)."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")
