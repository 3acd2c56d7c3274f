"""Opening a run directory for analysis: one run, its ranks, or a run still being written.

A run folder holds ``history.parquet`` once it is finished, and only ``history.parts/`` chunks
while it runs or after a crash. Which files are authoritative follows the core's rule
(``torchinstruments_core.run_directory.inspect_run``), reimplemented here so that reading a run
never imports torch: ``result.json`` with a finished status means ``history.parquet``; any other
status, or none, means the chunks (or ``history.parquet`` when no chunk is left).

Every table is a lazy ``polars.scan_parquet``: a question about a few layers or steps reads
only the columns and row groups it needs.

Example:
    >>> from torchinstruments_analysis.read import FINISHED
    >>> sorted(FINISHED)
    ['complete', 'complete_with_losses', 'recovered']
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import polars as pl

from torchinstruments_analysis._signals import OUTPUT

if TYPE_CHECKING:
    import os

FINISHED = frozenset({"complete", "complete_with_losses", "recovered"})
"""The ``result.json`` statuses after which ``history.parquet`` holds the whole run."""

_RANK_GLOB = "rank-[0-9][0-9][0-9]*"


def history_schema() -> pl.Schema:
    """The columns of ``history.parquet`` (the core's ``history_schema``, without torch)."""
    return pl.Schema(
        {
            "run_id": pl.String(),
            "rank": pl.Int32(),
            "sample_id": pl.Int64(),
            "step": pl.Int64(),
            "timestamp": pl.Datetime("us", "UTC"),
            "layer": pl.String(),
            "call_index": pl.Int32(),
            "signal": pl.String(),
            "tensor_path": pl.String(),
            "metric": pl.String(),
            "value": pl.Float64(),
            "unavailable_reason": pl.String(),
        }
    )


class RunNotFoundError(FileNotFoundError):
    """The folder holds no run: no ``history.parquet``, no chunks, no ``rank-NNN`` folders."""


@dataclass(frozen=True, slots=True)
class RankFolder:
    """What one run folder (one rank's under ``rank_policy="all"``) holds.

    Attributes:
        folder: The folder.
        status: ``result.json``'s status, or ``None`` without a readable one.
        history: The files holding its long table (``history.parquet`` or the chunks).
        samples: The same for ``samples.parquet``.
        result: ``result.json`` as read, or ``None``.
    """

    folder: Path
    status: str | None
    history: tuple[Path, ...]
    samples: tuple[Path, ...]
    result: dict[str, Any] | None

    @property
    def finished(self) -> bool:
        """``result.json`` has a finished status."""
        return self.status in FINISHED


@dataclass(frozen=True, slots=True)
class Run:
    """A run opened for analysis.

    Attributes:
        path: The folder given to ``open_run``.
        history: The long table, lazily (every rank's rows, told apart by ``rank``).
        samples: ``samples.parquet`` (or its chunks) lazily: one row per record; empty when none
            was written yet.
        layers: Layer names in forward execution order: ``result.json``'s catalog of a finished
            run, else the order of first appearance in the history, then the catalog's others.
        status: ``result.json``'s status, the same on every rank; where ranks differ, the first
            unfinished one's (``None`` without ``result.json``).
        complete: Every rank is finished: ``history.parquet`` holds the whole run. ``False``
            while the run is written, and after a crash (the chunks are read then).
        folders: What each rank's folder holds, in rank order.
    """

    path: Path
    history: pl.LazyFrame
    samples: pl.LazyFrame
    layers: tuple[str, ...]
    status: str | None
    complete: bool
    folders: tuple[RankFolder, ...]

    @property
    def result(self) -> dict[str, Any] | None:
        """The first rank's ``result.json``, or ``None``."""
        return self.folders[0].result


def open_run(path: str | os.PathLike[str]) -> Run:
    """Open the run in ``path``: one run folder, or a folder of ``rank-NNN/`` runs.

    Raises:
        RunNotFoundError: ``path`` holds no run.
    """
    root = Path(path)
    folders = tuple(_rank_folder(folder) for folder in _run_folders(root))
    history = _scan(tuple(p for f in folders for p in f.history), history_schema())
    samples = _scan_samples(tuple(p for f in folders for p in f.samples))
    return Run(
        path=root,
        history=history,
        samples=samples,
        layers=_execution_order(folders, history),
        status=_status(folders),
        complete=all(folder.finished for folder in folders),
        folders=folders,
    )


def open_runs(first: str | os.PathLike[str], second: str | os.PathLike[str]) -> tuple[Run, Run]:
    """Open two runs, e.g. to ``diff`` them."""
    return open_run(first), open_run(second)


def _run_folders(root: Path) -> list[Path]:
    if not root.is_dir():
        raise RunNotFoundError(f"{str(root)!r} is not a folder")
    if _holds_run(root):
        return [root]
    ranks = sorted(p for p in root.glob(_RANK_GLOB) if p.is_dir() and _holds_run(p))
    if not ranks:
        raise RunNotFoundError(
            f"{str(root)!r} holds no run: no history.parquet, no history.parts/ chunks and no "
            "rank-NNN/ folder with either"
        )
    return ranks


def _holds_run(folder: Path) -> bool:
    return (folder / "history.parquet").is_file() or (folder / "history.parts").is_dir()


def _rank_folder(folder: Path) -> RankFolder:
    result = _read_result(folder / "result.json")
    status = result.get("status") if result else None
    status = status if isinstance(status, str) else None
    finished = status in FINISHED
    return RankFolder(
        folder=folder,
        status=status,
        history=_authoritative(folder, "history", finished=finished),
        samples=_authoritative(folder, "samples", finished=finished),
        result=result,
    )


def _read_result(path: Path) -> dict[str, Any] | None:
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return document if isinstance(document, dict) else None


def _authoritative(folder: Path, table: str, *, finished: bool) -> tuple[Path, ...]:
    compacted = folder / f"{table}.parquet"
    parts = folder / "history.parts"
    # temporaries start with a dot, so this glob never matches a chunk being written
    chunks = sorted(parts.glob(f"{table}-*.parquet")) if parts.is_dir() else []
    if finished or not chunks:
        return (compacted,) if compacted.is_file() else ()
    return tuple(chunks)


def _scan(paths: tuple[Path, ...], schema: pl.Schema) -> pl.LazyFrame:
    if not paths:
        return pl.LazyFrame(schema=schema)
    return pl.scan_parquet(list(paths))


def _scan_samples(paths: tuple[Path, ...]) -> pl.LazyFrame:
    frames = [pl.scan_parquet(path) for path in paths]
    if not frames:
        return pl.LazyFrame(schema={"rank": pl.Int32(), "sample_id": pl.Int64()})
    # a run written before step records existed has no ``kind`` column: its rows are samples
    return pl.concat(frames, how="diagonal_relaxed")


def _status(folders: tuple[RankFolder, ...]) -> str | None:
    unfinished = [folder.status for folder in folders if not folder.finished]
    return unfinished[0] if unfinished else folders[0].status


def _execution_order(folders: tuple[RankFolder, ...], history: pl.LazyFrame) -> tuple[str, ...]:
    catalog = [
        layer["name"]
        for folder in folders
        for layer in (folder.result or {}).get("layers", [])
        if isinstance(layer, dict) and isinstance(layer.get("name"), str)
    ]
    if folders and all(folder.finished for folder in folders) and catalog:
        return tuple(dict.fromkeys(catalog))
    # While a run is written result.json lists the catalog in model order: the first sample's
    # rows, written as the forward reached each module, give the execution order.
    outputs = history.filter(pl.col("signal") == OUTPUT)
    first = outputs.filter(pl.col("sample_id") == pl.col("sample_id").min())
    seen = first.select(pl.col("layer").unique(maintain_order=True)).collect()
    return tuple(dict.fromkeys([*seen["layer"].to_list(), *catalog]))
