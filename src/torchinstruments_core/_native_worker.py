"""The CPU's native reduction worker: the kernels' queue, whose thread never takes the GIL.

The reduction worker of ``_background`` is a Python thread: between the kernels' calls it runs
the reducers' Python, and the training thread waits for the GIL it holds. On a small model that
wait is much of a sample's cost (LeNet-5: about 5 ms of a 13 ms sample). Where the compiled
kernels have their queue (``_native.QUEUE``) and the reducers are the built-in ones
(``FusedReductions``), a hook of a small sample (``_measure.SMALL_SAMPLE_ENTRIES``) instead
copies the tensor (gradients too), works out what to ask the kernels for, and queues one
``profile`` job; the kernels' thread runs it, with the subsample's positions drawn there from
the sample's seed, while the model computes; after a job it lingers for the next one (0.5 ms)
before it sleeps, so that a sample's later jobs cost their hooks no wake (about 10 us each on a
virtual machine). Reading each job's values back costs the training thread about what the
Python worker's GIL does on larger samples, which keep that worker. A step record's tensors
(``Measurer.measure``'s ``step``) take the queue whatever the size of the samples, copied
unless nothing changes them before their record is delivered (``StepTensor.in_place``).
Each job's values are read back (``ProfileJob.complete``) on a thread that measures or
settles, in the order the jobs were submitted, once the job has run: when the sample closes
and waits for them, back to back, where the interpreter's caches are warm (read back in a
hook, between the model's kernels, a job took several times as long), or at a hand-over that
needs their room. A tensor whose values the kernels do not finish (a
NaN or an infinity, squares that need scaling) goes through the reducers there, in Python, on
the copy the job read. A thread that waits for jobs (``wait``: a sample or a step record
closing) runs those the queue's thread has not started itself, with the GIL released
(``_native.queue_wait``), rather than sit idle beside it: a sample's closing wait waits once,
for its last job (``Sample.settle``).

Memory is bounded as on the Python worker (``_background``): the bytes of jobs handed over and
not yet read back never pass the largest job's or ``BUDGET_FLOOR``, whichever is more; a
hand-over waits for the oldest jobs first. In a child made by ``fork``, and after ``close``,
jobs run in the caller.
"""

from __future__ import annotations

import collections
import os
import threading
import weakref
from typing import TYPE_CHECKING

import torch

from torchinstruments_core import _background
from torchinstruments_core.reducers import _native

if TYPE_CHECKING:
    from collections.abc import Callable

    from torchinstruments_core.reducers._fused import _Call


class ProfileJob:
    """One tensor's ``profile`` on the queue, and what reads its values back.

    Args:
        values: A ``usable``, contiguous tensor that nothing changes until the job has run;
            ``None`` for a job whose copy ``NativeWorker.submit_copy`` makes.
        seed: The seed of the subsample's positions (``cpu_seed``), ``None`` for the first
            ``call.size`` entries.
        call: What to ask the kernels for (``FusedReductions.call``).
        finish: Called with the kernels' output once the job has run, on the thread that
            reads it back; it must not raise, nor keep a view of ``buffer``. ``None`` where
            a subclass reads it back itself (``read_back``).
        buffer: ``values``, where it is a buffer of the worker's (``NativeWorker.buffer``).
    """

    __slots__ = ("_call", "_finish", "_queued", "_seed", "_values", "buffer")

    def __init__(
        self,
        values: torch.Tensor | None,
        seed: int | None,
        call: _Call,
        finish: Callable[[_native.Profiled], None] | None = None,
        buffer: torch.Tensor | None = None,
    ) -> None:
        self._values = values
        self._seed = seed
        self._call = call
        self._finish = finish
        self._queued: _native.Queued | None = None
        self.buffer = buffer
        """The worker's buffer ``values`` is a copy in (``NativeWorker.buffer``), if it is one:
        kept as a spare once the job's values are read back."""

    def start(self, queue: object | None) -> int | None:
        """Submit the job to ``queue`` (``None``: run it here); its ticket, ``None`` if it ran."""
        assert self._values is not None, "a job starts once it has its values"
        self._queued = _native.submit_profile(queue, self._values, self._seed, self._call.shape)
        return self._queued.ticket

    def complete(self) -> None:
        """Read the values back (``read_back``), once the job has run; then let its buffers go."""
        queued, self._queued = self._queued, None
        if queued is not None:
            self.read_back(queued)
        self._values = None

    def read_back(self, queued: _native.Queued) -> None:
        """Hand what the job wrote to ``finish``; a subclass may read ``queued`` itself."""
        assert self._finish is not None, "a job without finish reads its values back itself"
        self._finish(queued.profiled())


class CopyJob:
    """A copy on the queue (``NativeWorker.copy``): holds both tensors until it has run.

    Args:
        source: What is copied.
        destination: Where to.
    """

    __slots__ = ("_tensors", "buffer")

    def __init__(self, source: torch.Tensor, destination: torch.Tensor) -> None:
        self._tensors: tuple[torch.Tensor, torch.Tensor] | None = (source, destination)
        self.buffer: torch.Tensor | None = None  # none of the worker's: nothing kept as spare

    def complete(self) -> None:
        """The copy has run: let the tensors go."""
        self._tensors = None


class NativeWorker:
    """Hands ``ProfileJob``s to one queue of the kernels, holding at most a budget of bytes.

    The budget is the largest job's bytes so far, or ``floor`` if that is more. ``submit``
    makes a job once there is room (``make`` copies the tensor) and queues it; ``wait`` reads
    back every job up to a ticket, waiting for the queue's thread where it has not run them.

    Args:
        floor: The least budget, in bytes (``None``: ``BUDGET_FLOOR``).
        linger_ns: How long the queue's thread looks for a next job before it sleeps
            (``_native.new_queue``; ``None``: the kernels' default, 0.5 ms; at most a minute).

    Raises:
        ValueError: ``linger_ns`` is negative or over a minute (checked here, not at the first
            job, which runs in a hook).
    """

    def __init__(self, floor: int | None = None, *, linger_ns: int | None = None) -> None:
        limit = _native.LINGER_MAX_NS  # the kernels' own
        if linger_ns is not None and not 0 <= linger_ns <= limit:
            raise ValueError(f"linger_ns must be between 0 and {limit}, not {linger_ns}")
        self._lock = threading.RLock()
        self._queue: object | None = None  # made at the first job
        self._pending: collections.deque[tuple[int, int, ProfileJob | CopyJob]] = (
            collections.deque()
        )
        self._held = 0  # bytes of the jobs not yet read back
        self._spares = _background.Spares()
        self._floor = _background.BUDGET_FLOOR if floor is None else floor
        self._budget = self._floor
        self._collected = 0  # the ticket of the last job read back
        self._pid = os.getpid()
        self._closed = False
        self._collecting = False  # a read-back under way (a job's reducers never re-enter it)
        self._linger_ns = linger_ns

    def buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat buffer of ``numel`` entries for a job's copy, made in ``submit``'s ``make``.

        A spare of that size and dtype where there is one (see ``_background``), else a new
        one, after freeing the oldest spares until held and spare bytes fit the budget.
        """
        if _background._current_pid != self._pid:  # a child made by fork: the lock may be held
            return torch.empty(numel, dtype=dtype, device="cpu")
        with self._lock:
            return self._take(numel, dtype)

    def _take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``buffer``'s work, the lock held."""
        spare = self._spares.take(numel, dtype)
        if spare is not None:
            return spare
        self._spares.trim(self._budget - self._held)
        return torch.empty(numel, dtype=dtype, device="cpu")

    @staticmethod
    def available() -> bool:
        """Whether the kernels have their queue (not on Windows, nor without the kernels)."""
        return _native.QUEUE

    def submit(self, nbytes: int, make: Callable[[], ProfileJob]) -> int | None:
        """Wait for room for ``nbytes``, call ``make()`` for the job and queue it.

        ``make`` may raise (the copy ran out of memory): nothing is queued then, and the error
        propagates; so does one from queueing.

        Returns:
            The job's ticket for ``done`` and ``wait``; ``None`` when it ran here, values read
            back already (after ``close``, or in a child made by ``fork``).
        """
        if _background._current_pid != self._pid or self._closed:
            job = make()
            job.start(None)
            job.complete()
            return None
        with self._lock:
            self._budget = max(self._budget, nbytes)
            # read back only for room: the rest waits for the sample's close, where the values
            # are read back to back (a read-back in a hook, between the model's kernels, takes
            # several times as long)
            if self._held + nbytes > self._budget:
                self._collect()
            while self._pending and self._held + nbytes > self._budget:
                self._collect(self._pending[0][0])
            self._held += nbytes  # before the copy: ``buffer`` trims the spares to make room
            try:
                job = make()
                queue = self._started()
            except BaseException:
                self._held -= nbytes
                raise
            return self._start(job, queue, nbytes)

    def submit_ready(self, job: ProfileJob) -> int | None:
        """``submit`` of a ``job`` that holds its values already and none of the budget.

        A step record's tensor read where it is (``Measurer.measure``'s ``in_place``): queued
        in this one call where the queue is up, as ``submit_copy`` queues its copy; anything
        else (the first job, after ``close``, a child made by ``fork``) goes through
        ``submit``, with the same result.

        Returns:
            As ``submit``: the job's ticket, or ``None`` when it ran here.
        """
        queue = self._queue
        if queue is not None and _background._current_pid == self._pid:
            with self._lock:
                if not self._closed:
                    return self._start(job, queue, 0)
        return self.submit(0, lambda: job)

    def submit_copy(self, plain: torch.Tensor, dtype: torch.dtype, job: ProfileJob) -> int | None:
        """``submit`` of ``job`` on a flat copy of ``plain`` in ``dtype``, in a buffer of ours.

        A small sample's usual hand-over. Where the queue is up and the copy fits the budget
        it is made and queued in this one call, without ``submit``'s ``make`` and the calls
        around it: this runs in a hook, between the model's kernels, where each Python call
        costs two to three times what it does in a warm loop. Anything else (the first job,
        which makes the queue; no room; after ``close``; a child made by ``fork``) goes through
        ``submit``, with the same result.

        Returns:
            As ``submit``: the job's ticket, or ``None`` when it ran here.
        """
        numel = plain.numel()
        nbytes = numel * dtype.itemsize
        queue = self._queue
        if queue is not None and _background._current_pid == self._pid:
            with self._lock:
                if not self._closed and self._held + nbytes <= max(self._budget, nbytes):
                    self._budget = max(self._budget, nbytes)
                    self._held += nbytes
                    try:
                        buffer = self._take(numel, dtype)
                        job._values = job.buffer = _background.flat_copy(plain, buffer)
                    except BaseException:
                        self._held -= nbytes
                        raise
                    return self._start(job, queue, nbytes)

        def make() -> ProfileJob:
            job._values = job.buffer = _background.flat_copy(plain, self.buffer(numel, dtype))
            return job

        return self.submit(nbytes, make)

    def copy(self, source: torch.Tensor, destination: torch.Tensor) -> int | None:
        """Queue ``destination.copy_(source)`` (``_native.queue_copy``); the ticket to wait for.

        The queue's thread copies while the caller goes on, and a ``wait`` for the ticket has
        the waiting thread copy the pieces no one has started. Both tensors are held until the
        copy has run; nothing of the budget. ``None``: there is no queue to take it (after
        ``close``, in a child made by ``fork``) and the caller copies. An exception on the way
        (an interrupt, no memory for a job) leaves once what was queued of the copy has run.

        Args:
            source: A contiguous CPU tensor of at least one entry, unchanged until the copy has
                run.
            destination: A contiguous CPU tensor of ``source``'s dtype and number of entries,
                whose memory does not overlap ``source``'s.
        """
        if _background._current_pid == self._pid:
            with self._lock:
                if not self._closed:
                    job, queue = CopyJob(source, destination), self._started()
                    try:
                        return self._track(_native.queue_copy(queue, source, destination), 0, job)
                    except BaseException:
                        # an interrupt before the job was tracked: nobody would hold the
                        # tensors its pieces read and write
                        if not self._tracks(job):
                            _native.drain(queue)
                        raise
        return None

    def _started(self) -> object:
        """The queue, made at the first job (lock held)."""
        queue = self._queue
        if queue is None:
            self._queue = queue = _native.new_queue(self._linger_ns)
            # closed (its jobs run) before the jobs' buffers can go, when this goes
            closer = _native.queue_closer(queue)
            weakref.finalize(self, _close_queue, closer, self._pid)
        return queue

    def _start(self, job: ProfileJob, queue: object, nbytes: int) -> int | None:
        """Queue ``job``, which holds ``nbytes`` of the budget, and track it (lock held).

        Once queued, the job reads and writes buffers that only it holds, and only the worker
        holds it once tracked (``_track``): an exception in between (a ``KeyboardInterrupt``,
        perhaps before the job's ticket is known) would let them go while the queue's thread
        uses them. Every queued job is waited for first, and the bytes are given back; a job
        that failed to queue holds none either.
        """
        try:
            return self._track(job.start(queue), nbytes, job)
        except BaseException:
            if not self._tracks(job):
                self._held -= nbytes  # first: a second interrupt may leave the drain
                _native.drain(queue)
            raise

    def _tracks(self, job: ProfileJob | CopyJob) -> bool:
        """Whether ``job`` is among the jobs waiting to be read back (lock held)."""
        return any(held is job for _, _, held in self._pending)

    def _track(self, ticket: int | None, nbytes: int, job: ProfileJob | CopyJob) -> int | None:
        """Hold ``job`` (queued with ``ticket``) until it is read back; ``ticket``, as ``submit``.

        A job the queue ran in the caller (``ticket`` ``None``: it closed meanwhile, from its
        finalizer or another thread) is read back at once and holds nothing.
        """
        if ticket is None:
            self._held -= nbytes
            job.complete()
            return None
        self._pending.append((ticket, nbytes, job))
        return ticket

    def wakes(self) -> int:
        """How many jobs found the queue's thread asleep and woke it (``_native.queue_wakes``)."""
        queue = self._queue
        if queue is None or _background._current_pid != self._pid:
            return 0
        return _native.queue_wakes(queue)

    def wait(self, ticket: int | None = None) -> None:
        """Read back the job with ``ticket`` and those before it; without one, every job."""
        if not self._pending or _background._current_pid != self._pid:
            return
        with self._lock:
            if self._pending:
                self._collect(self._pending[-1][0] if ticket is None else ticket)

    def done(self, ticket: int | None) -> bool:
        """Whether the job with ``ticket`` has been read back (reading back what has run).

        Never waits: while another thread reads jobs back, the answer is ``False``.
        """
        if ticket is None or self._collected >= ticket or _background._current_pid != self._pid:
            return True
        if not self._lock.acquire(blocking=False):
            return False
        try:
            self._collect()
            return self._collected >= ticket
        finally:
            self._lock.release()

    def close(self) -> None:
        """Read back every job and stop the queue's thread; later jobs run in the caller."""
        if _background._current_pid != self._pid:  # a child made by fork: not its queue
            self._closed = True
            self._spares = _background.Spares()  # the parent's: the lock may be held
            return
        with self._lock:
            self._closed = True
            if self._pending:
                self._collect(self._pending[-1][0])
            self._spares.clear()
            if self._queue is not None:
                _native.queue_close(self._queue)

    def _collect(self, goal: int | None = None) -> None:
        """Read back the jobs that have run, waiting first for job ``goal`` (lock held)."""
        if not self._pending or self._queue is None or self._collecting:
            return
        if goal is not None and goal > self._collected:
            _native.queue_wait(self._queue, goal)
        finished = _native.queue_finished(self._queue)
        self._collecting = True
        try:
            while self._pending and self._pending[0][0] <= finished:
                ticket, nbytes, job = self._pending[0]
                # read back before it counts as done: ``done`` and ``wait`` look without the lock
                job.complete()
                self._pending.popleft()
                self._held -= nbytes
                self._collected = ticket
                if job.buffer is not None and not self._closed:
                    self._spares.keep(job.buffer, min(self._floor, self._budget - self._held))
        finally:
            self._collecting = False


def _close_queue(close: Callable[[], None], pid: int) -> None:
    """``close`` a queue (``_native.queue_closer``) in the process that made it.

    A child made by ``fork`` leaves it.
    """
    if _background._current_pid == pid:
        close()
