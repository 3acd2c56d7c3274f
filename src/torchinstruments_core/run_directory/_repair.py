"""``repair``: complete a run that crashed, was killed, or could not be finalized.

One line, from a shell::

    python -m torchinstruments_core.run_directory repair PATH

It does what finalizing would have done, in the same order (see ``_state``): compacts the chunks
of ``history.parts/``, rebuilds the aggregates of ``result.json`` from the rows on disk, writes
``index.md`` and ``result.json`` with status ``recovered``, removes ``history.parts/`` and every
orphan temporary. A run whose finalizing had committed already (``result.json`` finished) only
loses its leftovers and keeps its status. A folder that a live process is writing is refused.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchinstruments_core._records import LayerInfo, RunInfo
from torchinstruments_core.run_directory._aggregate import ROW_COLUMNS, RunAggregates
from torchinstruments_core.run_directory._claim import lock_folder, unlock_folder
from torchinstruments_core.run_directory._finalize import (
    commit,
    compact_tables,
    remove_leftovers,
    remove_parts,
)
from torchinstruments_core.run_directory._layout import RunLayout
from torchinstruments_core.run_directory._state import RunState, RunStatus, inspect_run

if TYPE_CHECKING:
    import os
    from collections.abc import Iterator

    import polars as pl

_BATCH_ROWS = 1_000_000
_UNFINALIZED = (
    "the run ended without being finalized (a crash, a kill, or an exit that skipped it): the "
    "samples not yet written to a chunk are lost and could not be counted"
)


def repair(path: str | os.PathLike[str]) -> list[RunState]:
    """Complete the run in ``path``, or each ``rank-NNN`` run under it.

    Returns:
        The state of each run afterwards.

    Raises:
        OSError: A live process is writing the run, or ``path`` holds no run data.
    """
    folder = Path(path)
    ranks = sorted(p for p in folder.glob("rank-[0-9][0-9][0-9]*") if p.is_dir())
    targets = ranks if ranks and not (folder / "result.json").exists() else [folder]
    return [_repair_run(target) for target in targets]


def _repair_run(folder: Path) -> RunState:
    state = inspect_run(folder)
    if state.live:
        raise OSError(f"{folder} is being written by a live process; repair it once that ends")
    lock = lock_folder(folder)  # two repairs at once: the second is refused
    try:
        if state.finished:
            remove_leftovers(state.leftovers)
            remove_parts(RunLayout(folder))
        else:
            remove_leftovers([p for p in state.leftovers if p.name.endswith(".tmp")])
            _recover(RunLayout(folder))
    finally:
        unlock_folder(lock)
    return inspect_run(folder)


def _recover(layout: RunLayout) -> None:
    previous = _read_result(layout.result)
    if layout.parts.is_dir():
        compact_tables(layout)
    elif not layout.history.is_file():
        raise OSError(f"{layout.root} holds no run data (no history.parts, no history.parquet)")
    run = _run_info(previous, layout)
    aggregates = fold_tables(layout)
    commit(layout, run, aggregates, status=RunStatus.RECOVERED, lost=_lost(previous))
    remove_parts(layout)


def _read_result(path: Path) -> dict[str, Any]:
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return document if isinstance(document, dict) else {}


def _lost(previous: dict[str, Any]) -> dict[str, Any]:
    recorded = previous.get("lost")
    lost: dict[str, Any] = recorded if isinstance(recorded, dict) else {}
    reasons = [str(r) for r in lost.get("reasons", [])]
    if previous.get("status") == RunStatus.NEEDS_REPAIR:  # the sink counted every loss
        return {"samples": lost.get("samples"), "rows": lost.get("rows"), "reasons": reasons}
    return {"samples": None, "rows": None, "reasons": [*reasons, _UNFINALIZED]}


def _run_info(previous: dict[str, Any], layout: RunLayout) -> RunInfo:
    import polars as pl

    first = pl.scan_parquet(layout.history).select("run_id", "rank").head(1).collect()
    row = first.row(0, named=True) if first.height else {"run_id": "unknown", "rank": 0}
    per_rank = re.fullmatch(r"rank-\d+", layout.root.name) is not None
    return RunInfo(
        run_id=str(previous.get("run_id", row["run_id"])),
        rank=int(previous.get("rank", row["rank"])),
        world_size=int(previous.get("world_size", 1)),
        rank_policy=str(previous.get("rank_policy", "all" if per_rank else "rank0")),
        model_class=str(previous.get("model_class", "unknown")),
        sampling_policy=str(previous.get("sampling_policy", "unknown")),
        layers=_layers(previous, layout),
        metrics=tuple(previous.get("metrics", ())),
    )


def _layers(previous: dict[str, Any], layout: RunLayout) -> tuple[LayerInfo, ...]:
    import polars as pl

    if "layers" in previous:
        return tuple(
            LayerInfo(layer["name"], layer["type"], layer["parameters"], layer["histogram"])
            for layer in previous["layers"]
        )
    names = pl.scan_parquet(layout.history).select(pl.col("layer").unique(maintain_order=True))
    return tuple(LayerInfo(name, "unknown", 0, False) for name in names.collect()["layer"])


def fold_tables(layout: RunLayout) -> RunAggregates:
    """The aggregates of result.json, from the compacted tables on disk, in sample order."""
    aggregates = RunAggregates()
    for batch in _batches(layout.samples, ("forward_only", "collection_duration_ms")):
        for forward_only, duration in batch.iter_rows():
            aggregates.add_sample(forward_only=bool(forward_only), duration_ms=float(duration))
    for batch in _batches(layout.history, ROW_COLUMNS):
        aggregates.add_table(batch)
    return aggregates


def _batches(path: Path, columns: tuple[str, ...]) -> Iterator[pl.DataFrame]:
    import polars as pl

    scan = pl.scan_parquet(path).select(columns)
    offset = 0
    while True:
        batch = scan.slice(offset, _BATCH_ROWS).collect()
        if batch.height == 0:
            return
        yield batch
        offset += batch.height
