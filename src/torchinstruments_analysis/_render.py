"""Printing frames: a rich table when rich is installed, plain columns otherwise, or JSON.

Every string cell is escaped (``escape_name``), so a layer name can neither break a table's
columns nor send escape sequences to the terminal; rich gets ``Text`` cells, never markup.
JSON is strict: a value that is not finite is written as null.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import math
import sys
from typing import TYPE_CHECKING, Any, TextIO

from torchinstruments_analysis._escape import escape_name

if TYPE_CHECKING:
    import polars as pl


def rich_available() -> bool:
    """Whether rich can be imported (the ``analysis`` extra)."""
    return importlib.util.find_spec("rich") is not None


def cell(value: object) -> str:
    """One value as table text: 4 significant digits, ``-`` for null, names escaped."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    return escape_name(str(value))


def table(frame: pl.DataFrame, *, title: str, plain: bool, out: TextIO | None = None) -> None:
    """Print ``frame`` as a table under ``title``."""
    out = out or sys.stdout
    rows = [[cell(value) for value in row] for row in frame.iter_rows()]
    if plain or not rich_available():
        _plain(frame.columns, rows, title, out)
    else:
        _rich(frame.columns, rows, title, out)


def _plain(columns: list[str], rows: list[list[str]], title: str, out: TextIO) -> None:
    widths = [max([len(c), *(len(r[i]) for r in rows)]) for i, c in enumerate(columns)]
    print(escape_name(title), file=out)
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)), file=out)
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip(), file=out)


def _rich(columns: list[str], rows: list[list[str]], title: str, out: TextIO) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    shown = Table(title=Text(escape_name(title)), title_justify="left")
    for column in columns:
        shown.add_column(Text(column), overflow="fold")
    for row in rows:
        shown.add_row(*(Text(value) for value in row))
    # rich wraps to 80 columns when the output is not a terminal: give a file the whole width
    needed = sum(max([len(c), *(len(r[i]) for r in rows)]) + 3 for i, c in enumerate(columns))
    width = None if out.isatty() else max(needed + 1, len(title))
    Console(file=out, highlight=False, width=width).print(shown)


def as_json(document: dict[str, Any], out: TextIO | None = None) -> None:
    """Print ``document`` as strict JSON (non-finite numbers become null)."""
    print(json.dumps(_strict(document), indent=2, allow_nan=False), file=out or sys.stdout)


def rows_of(frame: pl.DataFrame) -> list[dict[str, Any]]:
    """The frame's rows as JSON-ready dictionaries."""
    return [_strict(row) for row in frame.to_dicts()]


def _strict(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, datetime.datetime | datetime.date):
        return value.isoformat()
    if isinstance(value, dict):
        return {str(key): _strict(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_strict(item) for item in value]
    return value
