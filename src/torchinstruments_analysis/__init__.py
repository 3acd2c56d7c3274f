"""Reading run directories: summaries, the first non-finite layer, diffs, ranks.

Every function returns a polars DataFrame, for a notebook or the ``torchinstruments`` command::

    from torchinstruments_analysis import first_nonfinite, open_run, summary
    run = open_run("stats")
    summary(run, layers="blocks.*")

Nothing here imports torch. The names are loaded on first use, so that the command line starts
without importing polars for ``--help``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchinstruments_analysis._compare import diff, ranks
    from torchinstruments_analysis._nonfinite import first_nonfinite
    from torchinstruments_analysis._summary import summary
    from torchinstruments_analysis.read import Run, RunNotFoundError, open_run, open_runs

__all__ = [
    "Run",
    "RunNotFoundError",
    "diff",
    "first_nonfinite",
    "open_run",
    "open_runs",
    "ranks",
    "summary",
]

_HOMES = {
    "Run": "read",
    "RunNotFoundError": "read",
    "diff": "_compare",
    "first_nonfinite": "_nonfinite",
    "open_run": "read",
    "open_runs": "read",
    "ranks": "_compare",
    "summary": "_summary",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
