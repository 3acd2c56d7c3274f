"""Placeholder: plots and reports are written in a parallel branch and replace this module.

It exists only so that ``torchinstruments plot`` and ``report`` fail with a clear message.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

    from torchinstruments_analysis.read import Run


def plot(run_or_runs: Run | list[Run], out_dir: Path) -> list[Path]:
    """Not available in this build: raises ``NotImplementedError``."""
    raise NotImplementedError("torchinstruments_analysis.plots is not part of this build yet")


def report(run: Run, out_dir: Path) -> Path:
    """Not available in this build: raises ``NotImplementedError``."""
    raise NotImplementedError("torchinstruments_analysis.plots is not part of this build yet")
