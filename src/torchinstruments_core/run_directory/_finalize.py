"""Finalizing a run directory, in the order that ``_state`` documents (shared with ``repair``).

1. compact the chunks into ``history.parquet`` and ``samples.parquet`` (streamed, bounded memory,
   each through an unpredictable temporary, then renamed);
2. write ``index.md``, then ``result.json`` with its finished status (the commit);
3. remove ``history.parts/``.

A process killed anywhere in this sequence leaves a folder that ``inspect_run`` reads correctly
and ``repair`` completes.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any

from torchinstruments_core.run_directory._atomic import atomic_sink_parquet, atomic_write_parquet
from torchinstruments_core.run_directory._index import write_index
from torchinstruments_core.run_directory._result import write_result
from torchinstruments_core.run_directory._tables import history_schema, samples_schema

if TYPE_CHECKING:
    from pathlib import Path

    from torchinstruments_core._records import RunInfo
    from torchinstruments_core.run_directory._aggregate import RunAggregates
    from torchinstruments_core.run_directory._layout import RunLayout


def compact(parts: Path, table: str, target: Path, schema: Any) -> None:
    """Stream every chunk of ``table`` into ``target`` (bounded memory), atomically."""
    import polars as pl

    chunks = sorted(parts.glob(f"{table}-*.parquet")) if parts.is_dir() else []
    if chunks:
        atomic_sink_parquet(pl.scan_parquet(chunks, schema=schema), target)
    else:
        atomic_write_parquet(pl.DataFrame(schema=schema), target)


def compact_tables(layout: RunLayout) -> None:
    """Step 1: ``history.parquet`` and ``samples.parquet`` from the chunks."""
    compact(layout.parts, "history", layout.history, history_schema())
    compact(layout.parts, "samples", layout.samples, samples_schema())


def commit(
    layout: RunLayout,
    run: RunInfo,
    aggregates: RunAggregates | None,
    *,
    status: str,
    lost: dict[str, Any],
) -> None:
    """Step 2: ``index.md``, then ``result.json``, whose finished status commits the run."""
    write_index(layout.index, run, status=status, aggregates=aggregates, lost=lost)
    write_result(layout.result, run, aggregates, status=status, lost=lost)


def remove_parts(layout: RunLayout) -> None:
    """Step 3: remove ``history.parts/``, chunk by chunk (a kill halfway is harmless)."""
    if not layout.parts.is_dir():
        return
    for chunk in sorted(layout.parts.iterdir()):
        with contextlib.suppress(FileNotFoundError):
            chunk.unlink()
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(layout.parts)


def remove_leftovers(paths: tuple[Path, ...] | list[Path]) -> None:
    """Remove orphan temporaries and leftover chunks named by ``inspect_run``."""
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
