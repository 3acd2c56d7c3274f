"""The sink's lifecycle as the observer sees it: opened once, written, closed.

The sink is opened lazily, when the first sample starts (or at removal, so that a run without
samples still has its files), and closed at removal. Every call into the sink is guarded: a sink
that fails never breaks training under ``error_policy="warn"`` (see ``_failures``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchinstruments_core._failures import SINK_CONSEQUENCE
from torchinstruments_core._locks import lock

if TYPE_CHECKING:
    from collections.abc import Callable

    from torchinstruments_core._failures import FailureReport
    from torchinstruments_core._records import RunInfo, SampleRecord
    from torchinstruments_core.sinks import Sink


class SinkSession:
    """Opens, writes to and closes one sink, reporting each failure instead of raising it.

    Args:
        sink: The user's (or the run directory's) sink.
        failures: Where a failing call is reported.
        describe: Builds the ``RunInfo`` the sink is opened with, when it is opened.
    """

    __slots__ = ("_describe", "_failures", "_lock", "_opened", "_sink")

    def __init__(
        self, sink: Sink, failures: FailureReport, describe: Callable[[], RunInfo]
    ) -> None:
        self._sink = sink
        self._failures = failures
        self._describe = describe
        self._opened = False
        self._lock = lock()  # two threads may start their first samples at once

    def open(self) -> None:
        """Open the sink, the first time only."""
        with self._lock:
            if self._opened:
                return
            self._opened = True
        self._guard("open the run", self._sink.open, self._describe())

    def write(self, record: SampleRecord) -> None:
        """Hand one finished sample to the sink."""
        self._guard(f"write sample {record.sample_id}", self._sink.write, record)

    def close(self) -> None:
        """Close the sink (opening it first if no sample ever did), finalizing its files."""
        self.open()
        self._guard("close", self._sink.close)

    def _guard(self, action: str, function: Callable[..., None], *args: Any) -> None:
        try:
            function(*args)
        except Exception as error:
            what = f"the sink {type(self._sink).__name__} could not {action}"
            key = f"sink:{action.split()[0]}"
            self._failures.failed(what, error, key, SINK_CONSEQUENCE)
