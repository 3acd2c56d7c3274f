"""The background writer: samples in through a bounded queue, immutable Parquet chunks out.

The training thread only puts a finished sample on the queue; it waits on disk only when the
queue is full. The writer thread turns samples into rows, writes a chunk when ``chunk_rows`` rows
are buffered or ``flush_seconds`` have passed, each chunk written to a temporary file and renamed,
so a reader (or a run killed mid-write) only ever sees complete chunks.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torchinstruments_core.run_directory._layout import RunLayout, temporary_sibling
from torchinstruments_core.run_directory._tables import history_frame, samples_frame

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from pathlib import Path

    import polars as pl

    from torchinstruments_core._records import SampleRecord

_STOP = object()


@dataclass(slots=True)
class WriterReport:
    """What the writer did: chunks and samples written, and what it lost."""

    chunks: int = 0
    samples_written: int = 0
    rows_written: int = 0
    lost: list[str] = field(default_factory=list)


class ChunkWriter:
    """A daemon thread writing chunks of a run's history.

    Args:
        layout: The run's paths.
        chunk_rows: Rows buffered before a chunk is written.
        flush_seconds: A non-empty buffer is written at least this often, bounding what a crash
            can lose.
        queue_size: Samples waiting for the writer before ``put`` blocks.
        on_sample: Called on the writer thread with each sample, in order (aggregates for
            result.json, TensorBoard histograms); a failure is reported like a failed chunk.
    """

    def __init__(
        self,
        layout: RunLayout,
        *,
        chunk_rows: int,
        flush_seconds: float,
        queue_size: int,
        on_sample: Sequence[Callable[[SampleRecord], None]] = (),
    ) -> None:
        self._layout = layout
        self._chunk_rows = chunk_rows
        self._flush_seconds = flush_seconds
        self._queue: queue.Queue[object] = queue.Queue(maxsize=queue_size)
        self._on_sample = tuple(on_sample)
        self._report = WriterReport()
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._run, name="torchinstruments-writer", daemon=True
        )

    def start(self) -> None:
        """Start the writer thread."""
        self._thread.start()

    def put(self, sample: SampleRecord) -> None:
        """Queue a sample; raise (once) the error of a chunk the writer failed to write."""
        self._raise_pending()
        self._queue.put(sample)

    def finish(self) -> WriterReport:
        """Write what is buffered, stop the thread and report."""
        self._queue.put(_STOP)
        self._thread.join()
        return self._report

    def _raise_pending(self) -> None:
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def _run(self) -> None:
        buffer: list[SampleRecord] = []
        rows = 0
        deadline = time.monotonic() + self._flush_seconds
        while True:
            try:
                item = self._queue.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                item = None
            if item is _STOP:
                self._write(buffer)
                return
            if item is not None:
                sample: SampleRecord = item  # type: ignore[assignment]
                buffer.append(sample)
                rows += len(sample.rows)
                self._observe(sample)
            if buffer and (rows >= self._chunk_rows or time.monotonic() >= deadline):
                self._write(buffer)
                buffer, rows = [], 0
            if time.monotonic() >= deadline:
                deadline = time.monotonic() + self._flush_seconds

    def _observe(self, sample: SampleRecord) -> None:
        for consumer in self._on_sample:
            try:
                consumer(sample)
            except Exception as error:
                self._fail(f"the {_name(consumer)} of sample {sample.sample_id}", error)

    def _write(self, samples: list[SampleRecord]) -> None:
        if not samples:
            return
        number = self._report.chunks
        try:
            _write_parquet(samples_frame(samples), self._layout.part("samples", number))
            _write_parquet(history_frame(samples), self._layout.part("history", number))
        except Exception as error:
            first, last = samples[0].sample_id, samples[-1].sample_id
            self._fail(f"samples {first} to {last}", error)
            return
        self._report.chunks += 1
        self._report.samples_written += len(samples)
        self._report.rows_written += sum(len(s.rows) for s in samples)

    def _fail(self, what: str, error: Exception) -> None:
        message = f"{what} were not written to {self._layout.root}: {type(error).__name__}: {error}"
        self._report.lost.append(message)
        with self._lock:
            self._error = OSError(message)


def _name(consumer: Callable[[SampleRecord], None]) -> str:
    return getattr(consumer, "describes", None) or type(consumer).__name__


def _write_parquet(frame: pl.DataFrame, path: Path) -> None:
    temporary = temporary_sibling(path)
    frame.write_parquet(temporary)
    os.replace(temporary, path)
