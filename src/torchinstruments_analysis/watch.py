"""A live terminal view of a run while it is written, naming each finding as it appears.

``watch(path)`` re-reads the run every ``interval`` seconds (``history.parts/`` while it runs,
``history.parquet`` once compacted), applies ``findings.find`` and shows the run's state (records
so far, last step, complete or not) with the table of findings. A finding not seen before is
printed on a line of its own above the view (``new: [rule] message``), so the scrollback keeps
the order in which they appeared.

With rich installed (``uv add "rich>=13"``) the view is a ``rich.live.Live`` display redrawn in
place, without flicker; without it, a status line and the new findings are printed as plain
text. Layer names and messages come from the user's model: they are escaped (never read as rich
markup or terminal escapes).
"""

from __future__ import annotations

import importlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from torchinstruments_analysis._escape import escape_text
from torchinstruments_analysis.findings import Thresholds, find
from torchinstruments_analysis.read import open_run

if TYPE_CHECKING:
    import os

    import polars as pl

_FINDING_KEY = ("rule", "layer", "signal", "metric")


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What one refresh read: the run's state and its findings (``None`` before any chunk)."""

    status: str
    findings: pl.DataFrame | None


def watch(
    run_path: str | os.PathLike[str],
    *,
    interval: float = 2.0,
    iterations: int | None = None,
    thresholds: Thresholds | None = None,
    file: TextIO | None = None,
) -> pl.DataFrame | None:
    """Show a run live until interrupted (Ctrl-C) or after ``iterations`` refreshes.

    Args:
        run_path: The run folder (it may not hold a chunk yet).
        interval: Seconds between refreshes.
        iterations: Stop after this many refreshes; ``None``: until interrupted.
        thresholds: Passed to ``find``.
        file: Where to write (default: the terminal, ``sys.stdout``).

    Returns:
        The findings of the last refresh (``None`` if the run never held a chunk).

    Raises:
        ValueError: ``interval`` is not positive or ``iterations`` is below 1.
    """
    if not interval > 0:
        raise ValueError(f"interval={interval!r} is invalid: expected a number of seconds > 0")
    if iterations is not None and iterations < 1:
        raise ValueError(f"iterations={iterations!r} is invalid: expected None or at least 1")
    view = _RichView(file) if _rich_available() else _PlainView(file or sys.stdout)
    seen: set[tuple[str, ...]] = set()
    snapshot = Snapshot("", None)
    with view:
        count = 0
        try:
            while iterations is None or count < iterations:
                if count:
                    time.sleep(interval)
                snapshot = read_snapshot(Path(run_path), thresholds)
                view.show(snapshot, _new_findings(snapshot, seen))
                count += 1
        except KeyboardInterrupt:
            pass
    return snapshot.findings


def read_snapshot(path: Path, thresholds: Thresholds | None) -> Snapshot:
    """The run's state line and findings now; a run without a chunk yet says so."""
    import polars as pl

    try:
        run = open_run(path)
    except FileNotFoundError:
        return Snapshot(f"{escape_text(str(path))}: waiting for the first chunk", None)
    records = run.samples.select(
        n=pl.len(), step=pl.col("step").max(), last=pl.col("sample_id").max()
    ).collect()
    n, step, last = records.row(0)
    state = "complete" if run.complete else "running"
    where = f"last step {step}" if step is not None else f"last sample {last}"
    status = f"{escape_text(str(path))}: {state}, {n} records, {where}, {len(run.layers)} layers"
    return Snapshot(status, find(run, thresholds=thresholds))


def _new_findings(snapshot: Snapshot, seen: set[tuple[str, ...]]) -> list[dict[str, Any]]:
    if snapshot.findings is None:
        return []
    new = []
    for row in snapshot.findings.iter_rows(named=True):
        key = tuple(str(row[c]) for c in _FINDING_KEY)
        if key not in seen:
            seen.add(key)
            new.append(row)
    return new


def _rich_available() -> bool:
    try:
        importlib.import_module("rich.live")
    except ImportError:
        return False
    return True


class _PlainView:
    """Plain text: a status line per refresh and each new finding on its own line."""

    def __init__(self, file: TextIO) -> None:
        self._file = file

    def __enter__(self) -> _PlainView:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.flush()

    def show(self, snapshot: Snapshot, new: list[dict[str, Any]]) -> None:
        total = "" if snapshot.findings is None else f", {snapshot.findings.height} findings"
        print(f"[{time.strftime('%H:%M:%S')}] {snapshot.status}{total}", file=self._file)
        for row in new:
            print(f"  new: [{row['rule']}] {escape_text(row['message'])}", file=self._file)
        self._file.flush()


class _RichView:
    """A ``rich.live.Live`` display redrawn in place; new findings printed above it."""

    def __init__(self, file: TextIO | None) -> None:
        console = importlib.import_module("rich.console").Console(file=file)
        live = importlib.import_module("rich.live").Live
        self._text = importlib.import_module("rich.text").Text
        self._table = importlib.import_module("rich.table").Table
        self._live = live(console=console, auto_refresh=False, transient=False)

    def __enter__(self) -> _RichView:
        self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._live.__exit__(None, None, None)

    def show(self, snapshot: Snapshot, new: list[dict[str, Any]]) -> None:
        for row in new:
            self._live.console.print(
                self._text(f"new: [{row['rule']}] {escape_text(row['message'])}", style="bold")
            )
        self._live.update(self._render(snapshot), refresh=True)

    def _render(self, snapshot: Snapshot) -> Any:
        if snapshot.findings is None or snapshot.findings.height == 0:
            found = "" if snapshot.findings is None else "\nno findings"
            return self._text(snapshot.status + found)
        table = self._table(title=self._text(snapshot.status), title_justify="left", expand=True)
        for column in ("rule", "layer", "signal", "sample", "value", "threshold"):
            table.add_column(column, no_wrap=column != "layer")
        for row in snapshot.findings.iter_rows(named=True):
            value = "" if row["value"] is None else f"{row['value']:.3g}"
            cells = [row["rule"], escape_text(row["layer"]), row["signal"], str(row["sample_id"])]
            table.add_row(*[self._text(c) for c in [*cells, value, f"{row['threshold']:.3g}"]])
        return table
