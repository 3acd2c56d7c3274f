"""The sink extension point: where finished samples go.

The engine calls ``open`` once, when the process's rank is known and before the first sample,
``write`` for each finished sample, and ``close`` once at removal. ``write`` may be called from an
autograd thread (the end of a CUDA backward); the engine serializes calls, so a sink needs no lock
of its own. A sink that raises is handled by the observer's ``error_policy``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from torchinstruments_core._records import RunInfo, SampleRecord


@runtime_checkable
class Sink(Protocol):
    """Receives the run's description and its finished samples."""

    def open(self, run: RunInfo) -> None:
        """Start the run: identity, rank and the catalog of selected layers."""
        ...

    def write(self, sample: SampleRecord) -> None:
        """Store one finished sample."""
        ...

    def close(self) -> None:
        """Finish the run; called once, after the last ``write``."""
        ...
