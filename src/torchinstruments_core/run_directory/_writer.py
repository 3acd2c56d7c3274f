"""The background writer: samples in through a bounded queue, immutable Parquet chunks out.

The training thread only puts a finished sample on the queue; it waits on disk only when the
queue is full. The writer thread turns the samples into frames of rows ``BATCH_ROWS`` rows at a
time (Python work, so short holds of the GIL, a millisecond or so each) and writes a chunk,
concatenated by Polars, when ``chunk_rows`` rows are buffered or ``flush_seconds`` have passed,
each chunk written to a temporary file and renamed, so a reader (or a run killed mid-write) only
ever sees complete chunks. Once a batch's frame is built its samples' row objects are let go:
only the frame waits for the chunk. Hundreds of thousands of rows alive until a chunk is written
(every step sampled, 30 seconds of them) would make Python's garbage collector run full
collections, a few hundred milliseconds each with torch's own objects, every hundred samples or
so. A frame a sample cost about 0.1 ms of the writer's time beyond its rows, as much as the 132
rows of an MNIST-sized MLP's sample took: with every step sampled the writer shares the cores
with training.

Failures, and what they cost (every sample is either written or counted in ``Losses``):

- A chunk that cannot be written (a full disk) is kept and retried with the next chunk, once per
  ``flush_seconds``; while writes keep failing the buffer holds at most ``chunk_rows`` rows (or
  one sample), the oldest samples dropped first, so memory stays bounded. When space returns the
  kept samples are written and the run goes on.
- A writer thread that dies (any ``BaseException``, such as a Polars panic) is detected: the
  training thread never waits on it again, and every sample it buffered, had queued, or is given
  from then on is counted as lost.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torchinstruments_core.run_directory._atomic import atomic_write_parquet
from torchinstruments_core.run_directory._tables import (
    history_frame,
    history_frames,
    sample_history,
    samples_frame,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

    import polars as pl

    from torchinstruments_core._records import SampleRecord
    from torchinstruments_core.run_directory._layout import RunLayout

_STOP = object()
_POLL_SECONDS = 0.5  # how often a training thread blocked on a full queue checks the writer
INTERRUPTED = "interrupted (KeyboardInterrupt) before it was handed to the writer"
"""The reason a sample lost to an interrupt in a writer's ``put`` is counted under."""


class CountedQueue(queue.Queue[object]):
    """A queue that counts the items ever put on it (``puts``, under the queue's own lock).

    A ``put`` interrupted while it waited for room (a Ctrl-C) tells from it whether its item
    got on the queue: one thread puts, so the count moved exactly when it did.
    """

    def __init__(self, maxsize: int = 0) -> None:
        super().__init__(maxsize)
        self.puts = 0

    def _put(self, item: object) -> None:
        super()._put(item)
        self.puts += 1


BATCH_ROWS = 4096
"""Rows of samples made into one frame (``_tables.history_frames``); a larger sample is its own."""


@dataclass(slots=True)
class Losses:
    """Samples and rows that never reached ``history.parts``, and the distinct reasons."""

    samples: int = 0
    rows: int = 0
    reasons: list[str] = field(default_factory=list)

    def add(self, rows: Iterable[int], reason: str) -> None:
        """Count samples as lost for ``reason``, given the number of rows of each."""
        for count in rows:
            self.samples += 1
            self.rows += count
        self.note(reason)

    def note(self, reason: str) -> None:
        """Record a reason once (a failure that lost no sample, such as a TensorBoard write)."""
        if reason not in self.reasons:
            self.reasons.append(reason)

    def __bool__(self) -> bool:
        return bool(self.samples or self.rows or self.reasons)

    def as_json(self) -> dict[str, Any]:
        """The ``lost`` entry of ``result.json``."""
        return {"samples": self.samples, "rows": self.rows, "reasons": list(self.reasons)}

    def describe(self) -> str:
        """One sentence: how much was lost and why."""
        return f"{self.samples} samples ({self.rows} rows) were lost: " + "; ".join(self.reasons)


@dataclass(slots=True)
class _Held:
    """A sample waiting for its chunk: its rows as a frame, or as rows if that failed."""

    record: SampleRecord
    """The record; without its rows once ``history`` holds them."""
    rows: int
    """How many rows the sample has."""
    history: pl.DataFrame | None
    """The rows as the long table (``history_frames``); ``None`` until its batch is built, or if
    it could not be."""


def _built_alone(sample: SampleRecord) -> pl.DataFrame | None:
    """The frame of ``sample`` alone; ``None`` if it cannot be built."""
    try:
        return sample_history(sample)
    except Exception:
        return None


def _row_counts(samples: Iterable[SampleRecord]) -> list[int]:
    return [len(sample.rows) for sample in samples]


@dataclass(slots=True)
class WriterReport:
    """What the writer did: chunks, samples and rows written, and what was lost."""

    chunks: int = 0
    samples_written: int = 0
    rows_written: int = 0
    losses: Losses = field(default_factory=Losses)
    died: bool = False


class PendingError:
    """An error a writer's own thread met (a full disk), raised once at the caller's next call.

    A base for ``ChunkWriter`` and ``_writer_process.ProcessWriter``: each sets ``_error``
    under ``_lock`` and calls ``_raise_pending`` where the training thread hands it a sample.
    """

    _lock: threading.Lock
    _error: Exception | None

    def _raise_pending(self) -> None:
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error


class ChunkWriter(PendingError):
    """A daemon thread writing chunks of a run's history.

    Args:
        layout: The run's paths.
        chunk_rows: Rows buffered before a chunk is written.
        flush_seconds: A non-empty buffer is written at least this often, bounding what a crash
            can lose; after a failed write, the interval between retries.
        queue_size: Samples waiting for the writer before ``put`` blocks.
        on_sample: Called on the writer thread with each sample as it arrives (TensorBoard
            histograms); a failure is reported and the sample is still written.
        on_written: Called with each sample and its rows as a frame (``None`` if the frame
            was built only for the chunk: the record then holds its rows) once its chunk is
            on disk, in order (the aggregates of result.json, which so describe exactly the
            rows of the history). The record no longer holds its rows when a frame is given.
        on_chunk: Called with the number of samples of each chunk as soon as it is on disk,
            before ``on_written`` (the writer process tells the training process).
    """

    def __init__(
        self,
        layout: RunLayout,
        *,
        chunk_rows: int,
        flush_seconds: float,
        queue_size: int,
        on_sample: Sequence[Callable[[SampleRecord], None]] = (),
        on_written: Sequence[Callable[[SampleRecord, pl.DataFrame | None], None]] = (),
        on_chunk: Callable[[int], None] | None = None,
    ) -> None:
        self._layout = layout
        self._chunk_rows = chunk_rows
        self._flush_seconds = flush_seconds
        self._queue = CountedQueue(maxsize=queue_size)
        self._on_sample = tuple(on_sample)
        self._on_written = tuple(on_written)
        self._on_chunk = on_chunk
        self._report = WriterReport()
        self._error: Exception | None = None
        self._lock = threading.Lock()
        # the samples' history rows are built a batch at a time (short holds of the GIL)
        self._buffer: list[_Held] = []
        self._rows = 0
        self._unbuilt: list[_Held] = []  # the buffer's samples whose frames are not built yet
        self._unbuilt_rows = 0
        self._retry_at = 0.0
        self._last_failure = ""
        self._thread = threading.Thread(
            target=self._run, name="torchinstruments-writer", daemon=True
        )

    def start(self) -> None:
        """Start the writer thread."""
        self._thread.start()

    def put(self, sample: SampleRecord) -> None:
        """Queue a sample; then raise (once) the error of a failure the writer reported.

        Never waits on a dead writer: the sample is counted as lost instead. An interrupt while
        it waits for room (a Ctrl-C, the writer behind) counts it as lost too, and propagates.
        Called by one thread at a time (the sink's).
        """
        puts = self._queue.puts
        try:
            queued = not self._report.died and self._enqueue(sample)
        except BaseException:
            if self._queue.puts == puts:  # it never got on the queue
                with self._lock:
                    self._report.losses.add([len(sample.rows)], INTERRUPTED)
            raise
        if not queued:
            with self._lock:
                self._report.losses.add([len(sample.rows)], self._death_reason())
        self._raise_pending()

    def finish(self) -> WriterReport:
        """Write what is buffered, stop the thread and report (also when the thread died)."""
        self._enqueue(_STOP)
        self._thread.join()
        leftovers = self._drain()  # queued after the writer died, or never reached by it
        if leftovers:
            with self._lock:
                self._report.losses.add(_row_counts(leftovers), self._death_reason())
        return self._report

    def _enqueue(self, item: object) -> bool:
        """Put ``item`` on the queue unless the writer is dead; whether it was queued."""
        return enqueue(self._queue, item, self._alive)

    def _alive(self) -> bool:
        return not self._report.died and self._thread.is_alive()

    def _death_reason(self) -> str:
        return f"the writer thread of {self._layout.root} had stopped"

    # -- the writer thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as error:  # a Polars panic is a BaseException; nothing may hang
            self._die(error)

    def _loop(self) -> None:
        deadline = time.monotonic() + self._flush_seconds
        while True:
            try:
                item = self._queue.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                item = None
            if item is _STOP:
                self._flush(final=True)
                return
            if item is not None:
                self._take(item)  # type: ignore[arg-type]
                item = None  # once its batch is built, its rows are let go: nothing else holds them
            due = time.monotonic() >= deadline
            if self._buffer and (self._rows >= self._chunk_rows or due):
                self._flush(final=False)
            if due:
                deadline = time.monotonic() + self._flush_seconds

    def _take(self, sample: SampleRecord) -> None:
        # buffered first: if the thread dies below (a Polars panic) the sample is counted lost
        held = _Held(sample, len(sample.rows), None)
        self._buffer.append(held)
        self._rows += held.rows
        self._unbuilt.append(held)
        self._unbuilt_rows += held.rows
        for consumer in self._on_sample:
            try:
                consumer(sample)
            except Exception as error:
                self._consumer_failed(consumer, sample, error)
        if self._unbuilt_rows >= BATCH_ROWS:
            self._build()

    def _build(self) -> None:
        """Build the frames of the samples not yet in one, and let their rows go.

        A batch that cannot be built (a row Polars cannot take) is built sample by sample; a
        sample that cannot be built keeps its rows and fails its chunk's write.
        """
        batch, self._unbuilt, self._unbuilt_rows = self._unbuilt, [], 0
        if not batch:
            return
        try:
            frames: list[pl.DataFrame | None] = [*history_frames([h.record for h in batch])]
        except Exception:
            frames = [_built_alone(held.record) for held in batch]
        for held, frame in zip(batch, frames, strict=True):
            if frame is not None:  # the rows are in the table now: let the objects go
                held.history = frame
                held.record = dataclasses.replace(held.record, rows=())

    def _flush(self, *, final: bool) -> None:
        self._build()
        if not self._buffer or (not final and time.monotonic() < self._retry_at):
            self._trim()
            return
        held = self._buffer
        try:
            self._write_chunk(held)
        except Exception as error:
            self._failed_write(held, error, final=final)
            return
        self._buffer, self._rows = [], 0
        self._retry_at = 0.0
        if self._on_chunk is not None:  # at once: the chunk's samples are on disk
            self._on_chunk(len(held))
        self._written(held)

    def _failed_write(self, held: list[_Held], error: Exception, *, final: bool) -> None:
        self._retry_at = time.monotonic() + self._flush_seconds
        self._last_failure = cause(error)
        first, last = held[0].record.sample_id, held[-1].record.sample_id
        what = f"samples {first} to {last} were not written to {self._layout.root}"
        if final:
            self._lose(held, f"the last chunk could not be written ({self._last_failure})")
            self._buffer, self._rows = [], 0
        else:
            self._trim()
            what += (
                " (kept for a retry; past chunk_rows rows the oldest are dropped; result.json "
                "counts every lost sample)"
            )
        self._fail(f"{what}: {_describe(error)}")

    def _write_chunk(self, held: list[_Held]) -> None:
        number = self._report.chunks
        # samples first: a kill between the two leaves no history row without its sample's row
        targets = (self._layout.part("samples", number), self._layout.part("history", number))
        samples = [entry.record for entry in held]
        built = {e.record.sample_id: e.history for e in held if e.history is not None}
        try:
            atomic_write_parquet(samples_frame(samples, [e.rows for e in held]), targets[0])
            atomic_write_parquet(history_frame(samples, built), targets[1])
        except BaseException:
            for target in targets:  # half a chunk would count its samples twice after a retry
                with contextlib.suppress(OSError):
                    target.unlink(missing_ok=True)
            raise

    def _written(self, held: list[_Held]) -> None:
        self._report.chunks += 1
        self._report.samples_written += len(held)
        self._report.rows_written += sum(entry.rows for entry in held)
        for entry in held:
            for consumer in self._on_written:
                try:
                    consumer(entry.record, entry.history)
                except Exception as error:
                    self._consumer_failed(consumer, entry.record, error)
            # a chunk's samples are folded in one by one (a millisecond or two each): between
            # them the training thread takes the GIL at once instead of after a switch interval
            time.sleep(0)

    def _consumer_failed(
        self, consumer: Callable[..., None], sample: SampleRecord, error: Exception
    ) -> None:
        failure = f"the {_name(consumer)} failed ({cause(error)})"
        self._fail(
            f"{failure} on sample {sample.sample_id} in {self._layout.root}",
            note=f"{failure}; the history rows were still written",
        )

    def _trim(self) -> None:
        """While writes fail, keep at most ``chunk_rows`` rows (or one sample): newest first."""
        dropped: list[_Held] = []
        while len(self._buffer) > 1 and self._rows > self._chunk_rows:
            entry = self._buffer.pop(0)
            self._rows -= entry.rows
            dropped.append(entry)
        if dropped:
            failure = self._last_failure
            self._lose(dropped, f"dropped while chunks could not be written ({failure})")

    def _lose(self, held: Sequence[_Held], reason: str) -> None:
        with self._lock:
            self._report.losses.add([entry.rows for entry in held], reason)

    def _fail(self, message: str, *, note: str | None = None) -> None:
        """Report a failure to the training thread (its next ``put`` raises it)."""
        with self._lock:
            if note is not None:
                self._report.losses.note(note)
            self._error = OSError(message)

    def _die(self, error: BaseException) -> None:
        reason = f"the writer thread died ({cause(error)})"
        with self._lock:
            self._report.died = True
            self._report.losses.add([entry.rows for entry in self._buffer], reason)
            self._buffer, self._rows = [], 0
            self._unbuilt, self._unbuilt_rows = [], 0
            self._error = OSError(
                f"{reason}; the samples it had and every later sample of {self._layout.root} "
                "are counted as lost (see result.json)"
            )
        leftovers = self._drain()
        with self._lock:
            self._report.losses.add(_row_counts(leftovers), reason)

    def _drain(self) -> list[SampleRecord]:
        drained: list[SampleRecord] = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return drained
            if item is not _STOP:
                drained.append(item)  # type: ignore[arg-type]


def enqueue(items: queue.Queue[object], item: object, alive: Callable[[], bool]) -> bool:
    """Put ``item`` on ``items`` while the writer is ``alive()``; whether it was queued.

    Waits only while the queue is full, checking every ``_POLL_SECONDS`` that the writer lives,
    so that a training thread never waits on a dead writer.
    """
    if not alive():
        return False
    try:
        items.put_nowait(item)  # the usual case: room in the queue, no waiting
    except queue.Full:
        while alive():
            try:
                items.put(item, timeout=_POLL_SECONDS)
            except queue.Full:
                continue
            return True
        return False
    return True


def _name(consumer: Callable[[SampleRecord], None]) -> str:
    return getattr(consumer, "describes", None) or type(consumer).__name__


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def cause(error: BaseException) -> str:
    """The cause without the file name, so that one cause is one reason however often it hits."""
    if isinstance(error, OSError) and error.strerror:
        return f"{type(error).__name__}: [Errno {error.errno}] {error.strerror}"
    return _describe(error)
