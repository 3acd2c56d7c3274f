"""A run folder opened for analysis: the long table, the records and the layer order.

Minimal reader (placeholder for the analysis API's own ``read.py``): a compacted run
(``history.parquet``), a running or crashed one (``history.parts/``), or a folder of
``rank-NNN/`` runs, read with Polars lazy scans.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import os

    import polars as pl


@dataclass(frozen=True, slots=True)
class Run:
    """One run, all its ranks.

    Attributes:
        path: The run folder.
        history: The long table, one row per scalar, every rank.
        samples: One row per record (``kind`` ``forward`` or ``step``), every rank.
        layers: Layer names in forward execution order.
        complete: Whether every rank finalized its run (``result.json`` says ``complete``).
    """

    path: Path
    history: pl.LazyFrame
    samples: pl.LazyFrame
    layers: list[str]
    complete: bool


def open_run(path: str | os.PathLike[str]) -> Run:
    """Open a run folder (compacted, still being written, or one folder per rank).

    Raises:
        FileNotFoundError: ``path`` holds no run.
    """
    import polars as pl

    root = Path(path)
    folders = _rank_folders(root)
    history = pl.concat([_scan(f, "history") for f in folders], how="diagonal_relaxed")
    samples = pl.concat([_scan(f, "samples") for f in folders], how="diagonal_relaxed")
    results = [_result(f) for f in folders]
    complete = all(r is not None and r.get("status") == "complete" for r in results)
    return Run(root, history, samples, _layers(results[0], history), complete)


def _rank_folders(root: Path) -> list[Path]:
    if _holds_run(root):
        return [root]
    ranks = sorted(p for p in root.glob("rank-[0-9][0-9][0-9]*") if _holds_run(p))
    if not ranks:
        raise FileNotFoundError(f"{str(root)!r} holds no run (no history.parquet or history.parts)")
    return ranks


def _holds_run(folder: Path) -> bool:
    return (folder / "history.parquet").is_file() or any(
        (folder / "history.parts").glob("history-*.parquet")
    )


def _scan(folder: Path, table: str) -> pl.LazyFrame:
    import polars as pl

    whole = folder / f"{table}.parquet"
    if whole.is_file():
        return pl.scan_parquet(whole)
    parts = sorted((folder / "history.parts").glob(f"{table}-*.parquet"))
    # chunks are renamed into place whole; reading the list now keeps a growing run consistent
    return pl.scan_parquet(parts) if parts else pl.LazyFrame()


def _result(folder: Path) -> dict[str, Any] | None:
    try:
        loaded: dict[str, Any] = json.loads((folder / "result.json").read_text())
    except (OSError, ValueError):
        return None
    return loaded


def _layers(result: dict[str, Any] | None, history: pl.LazyFrame) -> list[str]:
    if result is not None:
        return [layer["name"] for layer in result.get("layers", [])]
    import polars as pl

    # without a catalog, the order rows were written in: a sample's rows follow the forward
    first = history.select("sample_id", "layer").with_row_index().group_by("layer").min()
    return first.sort("sample_id", "index").collect().get_column("layer").cast(pl.String).to_list()
