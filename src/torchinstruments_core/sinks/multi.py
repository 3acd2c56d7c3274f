"""``MultiSink``: hand every sample to several sinks (the run directory, the trainer's loggers)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from torchinstruments_core._records import RunInfo, SampleRecord
    from torchinstruments_core.sinks.base import Sink


class MultiSink:
    """Calls each sink in turn; one failing sink does not starve the others.

    After every sink had its turn, the first error is raised again (the observer's
    ``error_policy`` then decides), with the sink it came from in the message.
    """

    def __init__(self, sinks: Sequence[Sink]) -> None:
        self.sinks = tuple(sinks)

    def open(self, run: RunInfo) -> None:
        """Open every sink."""
        self._each(lambda sink: sink.open(run))

    def write(self, sample: SampleRecord) -> None:
        """Give the sample to every sink."""
        self._each(lambda sink: sink.write(sample))

    def close(self) -> None:
        """Close every sink."""
        self._each(lambda sink: sink.close())

    def _each(self, action: Callable[[Sink], None]) -> None:
        first: Exception | None = None
        for sink in self.sinks:
            try:
                action(sink)
            except Exception as error:
                first = first or type(error)(f"{type(sink).__name__}: {error}")
        if first is not None:
            raise first

    def __repr__(self) -> str:
        return f"MultiSink({', '.join(repr(s) for s in self.sinks)})"
