"""Placeholder: following a live run is written in a parallel branch and replaces this module.

It exists only so that ``torchinstruments watch`` fails with a clear message.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path


def watch(run_path: Path, interval: float) -> None:
    """Not available in this build: raises ``NotImplementedError``."""
    raise NotImplementedError("torchinstruments_analysis.watch is not part of this build yet")
