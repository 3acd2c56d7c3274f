"""The run directory's writer in a process of its own, so that it never holds the training GIL.

The writer's own work is about a millisecond a sample: the sample's history frame, its
TensorBoard event and the aggregates of result.json. Run on a thread of the training process it
cost a small CNN's sampled step 2-3 ms (2 cores, one torch thread). The writer held the GIL
while the optimizer's per-parameter Python waited for it, and the OS could deschedule it in
favour of the reduction worker while it held it. Here the training thread pickles each record
(about 0.1 ms for a small model's sample) and writes it to a pipe itself, without waiting, when
nothing is queued before it and the pipe has room; otherwise it queues it, and a sender thread
writes the bytes, releasing the GIL while it writes (``ProcessWriter._write_now`` says why
both). The writer process runs the same ``ChunkWriter``, ``TensorBoardHistograms`` and
``RunAggregates`` the thread ran. At the end it sends back its report and the aggregates, and
the sink finalizes the run as before, in the training process.

The writer process imports no torch (nor the engine; ``_writer_launch`` starts it).
It runs at a niceness 10 above the training process's, so that where the cores are busy the
OS runs the training thread and the reduction worker first, and on Linux as a ``SCHED_BATCH``
process, which the sample that wakes it never has preempt the training thread. It ignores
SIGINT and SIGTERM: a Ctrl-C or a scheduler's SIGTERM meant for the job lets the training
process close the run, and the writer exits when its pipe closes.

The messages and their framing are in ``_writer_pipe``, the writer process's side in
``_writer_child``.

Failures (nothing may hang, nothing may be lost silently):

- The process cannot start or cannot set up (no interpreter at ``sys.executable``, an import
  failing): the samples go to a ``ChunkWriter`` thread of the training process instead. Nothing
  is lost: no sample is sent before the process says it is ready.
- The process dies (killed, out of memory). Its pipe's end tells at once. Every sample it had
  not written to a chunk is counted as lost, and so is every later one, as with a dead writer
  thread. The aggregates of result.json are rebuilt from the chunks on disk, as ``repair`` does.
- The training process dies: the writer reads the end of its pipe, writes what it holds as a
  last chunk and exits, leaving the run to ``repair``.
- A KeyboardInterrupt cuts a sample's write short (``_write_now``): the pipe is closed after
  it, as if the training process had died, and the samples from that one on count as lost. One
  that comes before a sample is written or queued (``put``, waiting for room on the queue)
  counts that sample as lost, and the run goes on.
- The process dies as the run closes, after ``finish`` queued its stop: the stop stays on the
  queue for the sender, which ``finish`` waits for (``_drain``).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import pickle
import queue
import subprocess
import threading
import weakref
from typing import TYPE_CHECKING, Any, BinaryIO, cast

from torchinstruments_core.run_directory._writer import (
    INTERRUPTED,
    ChunkWriter,
    CountedQueue,
    Losses,
    PendingError,
    WriterReport,
    cause,
    enqueue,
)
from torchinstruments_core.run_directory._writer_launch import exit_status, launch
from torchinstruments_core.run_directory._writer_pipe import (
    WriterSettings,
    encode,
    message,
    receive,
    sample_message,
    write_all,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from torchinstruments_core._records import SampleRecord
    from torchinstruments_core.run_directory._aggregate import RunAggregates

logger = logging.getLogger(__name__)

_STOP = object()
_CARRY = object()
"""Wakes the sender for the rest of a message the training thread began (``_write_now``)."""
_READY_SECONDS = 120.0
"""How long the process may take to start (import Polars and numpy) before the thread writes."""
_EXIT_SECONDS = 30.0
"""How long a process that sent its report may take to exit before it is killed."""


class _Parcel:
    """A sample for the writer process, and whether ``_write_now`` sent it (for an interrupt)."""

    __slots__ = ("payload", "sample", "sent")

    def __init__(self, sample: SampleRecord, payload: bytes | None) -> None:
        self.sample, self.payload = sample, payload
        self.sent = False  # all of it written, or the rest left to the sender (``_write_now``)


class ProcessWriter(PendingError):
    """Hands samples to a writer process; the same calls as ``ChunkWriter``.

    Args:
        settings: The run's writer, as the process should open it.
        in_process: Makes (and starts) the writer thread of the training process, for when the
            process cannot start; its aggregates and TensorBoard file are the sink's own.

    Attributes:
        aggregates: After ``finish``, the aggregates the process folded in; ``None`` when the
            thread wrote the run (the sink's own aggregates hold them) or the process died.
        died: After ``finish``, whether the process died before it was done.
    """

    def __init__(self, settings: WriterSettings, *, in_process: Callable[[], ChunkWriter]) -> None:
        self._settings = settings
        self._in_process = in_process
        self._queue = CountedQueue(maxsize=settings.queue_size)
        self._lock = threading.Lock()
        self._unwritten: collections.deque[int] = collections.deque()  # rows of each sample
        self._extra = Losses()  # samples given to a writer already dead
        self._error: Exception | None = None
        self._ready = threading.Event()
        self._usable = False  # the process said it is ready
        self._dead = False
        self._done: tuple[WriterReport, RunAggregates] | None = None
        self._chunks = 0  # the chunks, samples and rows the process said are on disk
        self._written_samples = 0
        self._written_rows = 0
        self._failure = ""
        self._thread_writer: ChunkWriter | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._to_writer: int | None = None
        self._from_writer: BinaryIO | None = None
        # whoever writes to the pipe holds it; the sender also while the pipe is full. An RLock
        # for its ``_is_owned``: ``_write_now`` must release it whatever interrupts it
        self._pipe_lock = threading.RLock()
        self._count_lock = threading.Lock()  # never held while anything waits
        self._queued = 0  # items on the queue, or taken off it and not yet written
        self._carry: memoryview | None = None  # what the pipe did not take of a direct write
        self._cut = False  # a direct write was interrupted: the pipe's end counts the rest
        self._sender = threading.Thread(
            target=self._send_loop, name="torchinstruments-writer-pipe", daemon=True
        )
        self._reader = threading.Thread(
            target=self._read_loop, name="torchinstruments-writer-replies", daemon=True
        )
        self.aggregates: RunAggregates | None = None
        self.died = False

    @property
    def pid(self) -> int | None:
        """The writer process's id (``None`` when none was started)."""
        return None if self._process is None else self._process.pid

    @property
    def in_process(self) -> bool:
        """Whether a thread of the training process writes the run (the process failed)."""
        return self._thread_writer is not None

    def start(self) -> None:
        """Start the writer process (without waiting for it) and the threads that talk to it."""
        try:
            self._spawn()
        except Exception as error:  # no process, whatever the reason: a thread writes
            self._failure = cause(error)
            self._ready.set()
        else:
            self._reader.start()
        self._sender.start()

    def _spawn(self) -> None:
        self._process, self._to_writer, self._from_writer = launch()
        _open_writers.add(self)

    # -- the training thread --------------------------------------------------------------------

    def put(self, sample: SampleRecord) -> None:
        """Queue a sample; then raise (once) the error of a failure the writer reported.

        Never waits on a dead writer: the sample is counted as lost instead. An interrupt
        before the sample is written or queued (a Ctrl-C while the queue has no room) counts
        it as lost, and propagates. Called by one thread at a time (the sink's).
        """
        payload = None if self._ready.is_set() and not self._usable else encode(sample)
        rows = len(sample.rows)
        with self._lock:
            dead = self._dead
            if dead:
                self._extra.add([rows], self._death_reason())
            elif self._thread_writer is None:  # lost if the process dies before its chunk
                self._unwritten.append(rows)
        if not dead:
            parcel, puts = _Parcel(sample, payload), self._queue.puts
            try:
                if payload is None or not self._write_now(parcel):
                    self._enqueue(parcel)  # False if it died meanwhile: counted as above
            except BaseException:
                self._interrupted(parcel, rows, queued=self._queue.puts != puts)
                raise
        self._raise_pending()

    def _interrupted(self, parcel: _Parcel, rows: int, *, queued: bool) -> None:
        """``put`` was interrupted: count its sample as lost if it is not on its way.

        One written, or ``queued`` (the queue's count of items put moved: one thread puts),
        goes on, or is counted lost with the process; one whose write was cut short is counted
        with the pipe's end (``_cut_short``). Only one that never reached the pipe or the
        queue is counted here, its rows taken back out of those the process owes.
        """
        if parcel.sent or queued or self._cut:
            return
        with self._lock:
            if self._thread_writer is None and self._unwritten:
                self._unwritten.pop()  # this sample's: the last one put
            self._extra.add([rows], INTERRUPTED)

    def _write_now(self, parcel: _Parcel) -> bool:
        """Write a sample's message to the pipe from this thread, if that needs no waiting.

        The sender thread takes each queued sample with the GIL, which it must win from the
        training thread at the model's next operation: on an MNIST-sized MLP (2.3 ms steps) that
        hand-over cost a sampled step about 0.04-0.05x and the step after it up to 0.03x
        (``benchmarks/RESULTS.md``).
        Here the message is written at once when nothing is queued or half written before it
        (so the messages keep their order) and no other thread writes: a write that would wait
        (the pipe full) is not made, and the sample is queued instead. What the pipe does not
        take of the message is left for the sender (``_carry``), which writes it before
        anything else.

        Returns:
            Whether the message is on its way (all of it written, or the rest left to the
            sender; ``parcel.sent`` says so too); ``False``: nothing was written, queue it.
        """
        payload = parcel.payload
        assert payload is not None, "a parcel written directly was encoded"
        if not self._usable or self._dead or not self._ready.is_set():
            return False
        try:
            if not self._pipe_lock.acquire(blocking=False):  # the sender is writing
                return False
            pipe = self._to_writer  # closed only under the lock (``_close_pipe``)
            if pipe is None:
                return False
            with self._count_lock:
                if self._queued or self._carry is not None:
                    return False
            data = sample_message(payload)
            began = False  # whether bytes of this message may be in the pipe
            try:
                try:
                    os.set_blocking(pipe, False)
                    began = True
                    written = os.write(pipe, data)
                except OSError:  # full (BlockingIOError), or the process died: nothing written
                    began = False
                    return False
                finally:
                    os.set_blocking(pipe, True)
                if written < len(data):
                    self._carry = memoryview(data)[written:]
                    with self._count_lock:
                        self._queued += 1
                    try:
                        self._queue.put_nowait(_CARRY)
                    except queue.Full:  # the sender writes the rest before the next item it takes
                        with self._count_lock:
                            self._queued -= 1
                began = False
                parcel.sent = True
                return True
            except BaseException:
                # interrupted (a KeyboardInterrupt raised as the write returned) before the rest
                # was left to the sender: the message may be cut short, and nothing written
                # after it could be read. The process gets the end of its pipe instead.
                if began:
                    self._cut_short()
                raise
        finally:
            # owned also when an interrupt came as ``acquire`` returned, before anything else
            if self._pipe_lock._is_owned():  # type: ignore[attr-defined]
                self._pipe_lock.release()

    def _cut_short(self) -> None:
        """Close the pipe (lock held) after a message that may be cut short.

        The writer process reads the end of its pipe, writes what it holds and exits; the
        samples it had not written, and every later one, are counted as lost.
        """
        self._failure = self._failure or "a sample's write to it was interrupted"
        self._cut = True
        pipe, self._to_writer = self._to_writer, None
        if pipe is not None:
            try:  # noqa: SIM105 (no call of suppress's between them for an interrupt to stop at)
                os.close(pipe)
            except OSError:
                pass

    def finish(self) -> WriterReport:
        """Write what is buffered, stop the process and report (also when it died)."""
        if not self._enqueue(_STOP):  # dead: a sender waiting for a sample must still stop
            self._drain()
            with contextlib.suppress(queue.Full):
                self._queue.put_nowait(_STOP)
        self._sender.join()
        if self._reader.ident is not None:
            self._reader.join()  # ends at the report, or at the end of the pipe
        if self._process is not None:
            try:
                self._process.wait(timeout=_EXIT_SECONDS)
            except subprocess.TimeoutExpired:  # it said all it had to say, or is not ours now
                self._process.kill()
                self._process.wait()
        writer = self._thread_writer
        report = writer.finish() if writer is not None else self._report()
        with self._lock:
            _merge(report, self._extra)
        return report

    def _report(self) -> WriterReport:
        with self._lock:
            if self._done is not None:
                report, self.aggregates = self._done
                return report
            self.died = True
            report = WriterReport(
                chunks=self._chunks,
                samples_written=self._written_samples,
                rows_written=self._written_rows,
                died=True,
            )
            report.losses.add(list(self._unwritten), self._death_reason())
            self._unwritten.clear()
            return report

    def _enqueue(self, item: object) -> bool:
        """Put ``item`` on the queue unless the process is dead; whether it was queued.

        Counted (``_queued``) until the sender has written it; an item not queued after all
        (the process died, or an interrupt came while the queue had no room) is not.
        """
        with self._count_lock:  # counted first: no direct write may overtake it
            self._queued += 1
        queued, puts = False, self._queue.puts
        try:
            queued = enqueue(self._queue, item, lambda: not self._dead)
        finally:
            if not queued and self._queue.puts == puts:  # not on the queue after all
                with self._count_lock:
                    self._queued -= 1
        return queued

    def _death_reason(self) -> str:
        reason = self._failure or "it exited"
        return f"the writer process of {self._settings.layout.root} had stopped ({reason})"

    def _drain(self) -> None:
        """Empty the queue: its samples are in ``_unwritten``, lost with the process.

        The stop ``finish`` queued, if it is there, goes back on: the sender must still take it
        (``finish`` waits for it to end), where the process died after ``finish`` queued it and
        before the sender woke.
        """
        stop = False
        while True:
            try:
                stop = self._queue.get_nowait() is _STOP or stop
            except queue.Empty:
                break
        if stop:
            with contextlib.suppress(queue.Full):  # emptied just now: there is room
                self._queue.put_nowait(_STOP)

    # -- the sender thread ----------------------------------------------------------------------

    def _send_loop(self) -> None:
        pipe = self._to_writer
        watchdog = threading.Timer(_READY_SECONDS, self._not_ready)
        watchdog.daemon = True
        watchdog.start()  # also while the catalog is written: a large one fills the pipe
        try:
            if pipe is not None:
                write_all(pipe, message(("open", self._settings)))  # read once its imports are done
            self._ready.wait()
        except OSError as error:  # it exited before it read a word (or was killed, not ready)
            self._ready.wait(timeout=_READY_SECONDS)  # the reader says why
            self._decide(usable=False, failure=cause(error))
        finally:
            watchdog.cancel()
        if not self._usable:
            self._close_pipe()
            self._write_in_process()
            return
        assert pipe is not None
        try:
            while True:
                item = self._queue.get()
                with self._pipe_lock:
                    pipe = self._to_writer  # ``_cut_short`` may have closed it
                    if pipe is None:
                        raise BrokenPipeError("the pipe to the writer process was closed")
                    carry, self._carry = self._carry, None
                    if carry is not None:  # the rest of a message begun by ``_write_now``
                        write_all(pipe, carry)
                    if item is _STOP:
                        write_all(pipe, message(("finish",)))
                        break
                    if item is not _CARRY:
                        parcel = cast("_Parcel", item)
                        data = encode(parcel.sample) if parcel.payload is None else parcel.payload
                        write_all(pipe, sample_message(data))
                        del parcel, data
                del carry, item
                with self._count_lock:
                    self._queued -= 1
        except OSError as error:  # the process died
            self._reader.join(timeout=_EXIT_SECONDS)  # which says how (its exit status)
            self._failure = self._failure or cause(error)
            self._mark_dead()
        finally:
            self._close_pipe()

    def _close_pipe(self) -> None:
        with self._pipe_lock:  # never under a write of ``_write_now``'s
            pipe, self._to_writer = self._to_writer, None
        if pipe is not None:
            with contextlib.suppress(OSError):
                os.close(pipe)

    def _write_in_process(self) -> None:
        """The process is not there: hand every sample to a writer thread of this process."""
        logger.warning(
            "torchinstruments: the writer process of %s could not start (%s); writing from a "
            "thread of the training process instead",
            self._settings.layout.root,
            self._failure,
        )
        try:
            writer = self._in_process()
        except BaseException as error:  # no writer at all: never let a put wait for one
            self._failure = f"{self._failure}; nor could a writer thread ({cause(error)})"
            self._mark_dead()  # the queued samples are in ``_unwritten``: counted as lost
            return
        with self._lock:
            self._thread_writer = writer
            self._unwritten.clear()  # the thread writer counts them from here on
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            try:
                writer.put(cast("_Parcel", item).sample)
            except OSError as error:
                with self._lock:
                    self._error = error

    # -- the reader thread ----------------------------------------------------------------------

    def _read_loop(self) -> None:
        stream = self._from_writer
        assert stream is not None
        try:
            while self._done is None and (reply := receive(stream)) is not None:
                self._take(reply)
        except (OSError, pickle.UnpicklingError, EOFError, ValueError, AttributeError) as error:
            self._failure = self._failure or cause(error)
        finally:
            with contextlib.suppress(OSError):
                stream.close()
            if not self._ready.is_set():  # it never got ready: the thread writes instead
                self._decide(usable=False, failure=exit_status(self._process))
            elif self._usable and self._done is None:
                self._failure = self._failure or exit_status(self._process)
                self._mark_dead()

    def _take(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "ready":
            self._decide(usable=True)
        elif kind == "failed":
            self._failure = message[1]
        elif kind == "written":
            with self._lock:
                self._chunks += 1
                for _ in range(message[1]):
                    self._written_rows += self._unwritten.popleft()
                self._written_samples += message[1]
        elif kind == "error":
            with self._lock:
                self._error = OSError(message[1])
        elif kind == "done":
            self._done = (message[1], message[2])

    def _decide(self, *, usable: bool, failure: str = "") -> bool:
        """Settle, once, whether the process writes the run; whether this call settled it."""
        with self._lock:
            if self._ready.is_set():
                return False
            self._usable = usable
            self._failure = self._failure or failure
            self._ready.set()
            return True

    def _not_ready(self) -> None:
        """The watchdog: a process not ready in ``_READY_SECONDS`` is killed, a thread writes."""
        settled = self._decide(usable=False, failure=f"not ready after {_READY_SECONDS:.0f} s")
        if settled and self._process is not None:
            with contextlib.suppress(OSError):
                self._process.kill()

    def _mark_dead(self) -> None:
        with self._lock:
            if self._dead or self._done is not None:
                return
            self._dead = True
            self._error = OSError(
                f"{self._death_reason()}; the samples it had not written and every later sample "
                "are counted as lost (see result.json)"
            )
        self._drain()  # unblocks a training thread waiting for room


_open_writers: weakref.WeakSet[ProcessWriter] = weakref.WeakSet()


def _forget_pipes_after_fork() -> None:
    """In a forked child (a ``DataLoader`` worker), close its copy of the pipe to the writer.

    So the writer sees the pipe's end when the training process dies, whatever lives on.
    """
    for writer in list(_open_writers):
        pipe, writer._to_writer = writer._to_writer, None  # no sender thread survived the fork
        if pipe is not None:
            with contextlib.suppress(OSError):
                os.close(pipe)


os.register_at_fork(after_in_child=_forget_pipes_after_fork)


def _merge(report: WriterReport, extra: Losses) -> None:
    report.losses.samples += extra.samples
    report.losses.rows += extra.rows
    for reason in extra.reasons:
        report.losses.note(reason)
