"""Placeholder: the ``findings`` rules are written in a parallel branch and replace this module.

It exists only so that ``torchinstruments findings`` and imports of this name fail with a clear
message instead of an ``ImportError`` until then.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import polars as pl

    from torchinstruments_analysis.read import Run


class Thresholds:
    """Placeholder for the findings' thresholds."""


def find(run: Run, *, thresholds: Thresholds | None = None) -> pl.DataFrame:
    """Not available in this build: raises ``NotImplementedError``."""
    raise NotImplementedError("torchinstruments_analysis.findings is not part of this build yet")
