"""``MultiSink``: hand every sample to several sinks (the run directory, the trainer's loggers)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchinstruments_core._exceptions import raise_collected

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from torchinstruments_core._records import RunInfo, SampleRecord
    from torchinstruments_core.sinks.base import Sink


class MultiSink:
    """Calls each sink in turn; one failing sink does not starve the others.

    After every sink had its turn, the failures are raised (the observer's ``error_policy`` then
    decides): a single failure as the sink's own exception, its type and cause untouched and the
    sink named in a note; several as an ``ExceptionGroup`` of them.
    """

    def __init__(self, sinks: Sequence[Sink]) -> None:
        self.sinks = tuple(sinks)

    def open(self, run: RunInfo) -> None:
        """Open every sink."""
        self._each(lambda sink: sink.open(run), "open")

    def write(self, sample: SampleRecord) -> None:
        """Give the sample to every sink."""
        self._each(lambda sink: sink.write(sample), f"write sample {sample.sample_id}")

    def close(self) -> None:
        """Close every sink."""
        self._each(lambda sink: sink.close(), "close")

    def _each(self, action: Callable[[Sink], None], what: str) -> None:
        errors: list[Exception] = []
        for sink in self.sinks:
            try:
                action(sink)
            except Exception as error:
                error.add_note(f"raised by {type(sink).__name__} during {what}")
                errors.append(error)
        raise_collected(errors, f"{len(errors)} sinks failed to {what}")

    def __repr__(self) -> str:
        return f"MultiSink({', '.join(repr(s) for s in self.sinks)})"
