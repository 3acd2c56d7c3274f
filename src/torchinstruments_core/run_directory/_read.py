"""Reading a run's tables back, whichever version of the suite wrote them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from torchinstruments_core._signals import RecordKind

if TYPE_CHECKING:
    from collections.abc import Sequence

    import polars as pl


def scan_samples(
    source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
) -> pl.LazyFrame:
    """``samples.parquet`` of one or more runs (or ranks) as one lazy frame.

    A run written before step records existed has no ``kind`` column: its rows read as
    ``"forward"`` samples, so a query on ``kind`` works on old and new runs alike. A run written
    before skipped optimizer steps were noted has no ``note`` column: it reads as null.

    Args:
        source: A run folder, a ``samples.parquet`` file, or a list of either.
    """
    import polars as pl

    paths = [source] if isinstance(source, str | os.PathLike) else list(source)
    return pl.concat([_scan_one(Path(path)) for path in paths], how="diagonal_relaxed")


def _scan_one(path: Path) -> pl.LazyFrame:
    import polars as pl

    frame = pl.scan_parquet(path / "samples.parquet" if path.is_dir() else path)
    names = frame.collect_schema().names()
    if "kind" not in names:
        frame = frame.with_columns(kind=pl.lit(RecordKind.FORWARD.value, dtype=pl.String()))
    if "note" not in names:
        frame = frame.with_columns(note=pl.lit(None, dtype=pl.String()))
    return frame
