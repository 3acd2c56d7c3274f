"""The CPU's reduction worker: one thread that reduces sampled tensors while training goes on.

On an accelerator a hook only enqueues its reductions and the device runs them while the host
goes on. On the CPU the hook would have to run them itself, before the model's next operation.
Where torch leaves a core free (``torch.get_num_threads()`` below the cores this process may
use), the hook instead copies the tensor (the model may change it in place once the hook
returns) and hands the copy to this worker, which runs the reducers while the model computes.
A gradient, which autograd only reads, and an output that an earlier forward left unchanged
are handed over as they are (``Measurer.measure``'s ``shared``); they count against the
budget below like copies.

Memory stays bounded: the copies handed over and not yet reduced never hold more bytes than the
largest copy so far (or than the one being handed over, when it is the largest) or
``BUDGET_FLOOR`` (8 MiB), whichever is more, and a hook waits until the worker has reduced
enough to make room. The floor lets a burst of small tensors (a backward that hands over two
gradients in quick succession) queue instead of making the hook wait; a model whose largest
activation passes 8 MiB keeps the bound of one tensor in float32. A finished job's buffer stays
as a spare for the next copy of its size (a copy into mapped pages takes a third to half the
time of one into fresh memory), within the same bound and never past the floor, so that between
samples the worker keeps at most 8 MiB; ``close`` frees them. Jobs run in the order they came;
the subsamples' positions come from a seed each sample gets when it starts
(``Measurer._new_cache``), so the worker gives the values the hooks would.

The worker never takes the observer's lock and a job never raises (``Measurer`` records errors
in the measurement), so waiting for it always ends. It is started on the first job and stopped
by ``close``; in a child made by ``fork`` (which has no worker thread) jobs run in the caller.
"""

from __future__ import annotations

import collections
import functools
import os
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    Job = tuple[Callable[[], None], torch.Tensor | None]


_current_pid = os.getpid()
"""This process's id, kept current in a child made by ``fork``: the hot paths compare it with
the worker's instead of asking the system (``os.getpid`` is a system call) at every tensor."""


def _forked() -> None:
    global _current_pid
    _current_pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


def free_core() -> bool:
    """Whether torch's intra-op threads leave a core of this process's CPUs free."""
    import torch

    return torch.get_num_threads() < _cores()


@functools.cache
def _cores() -> int:
    """The cores this process may run on, read once (an affinity changed later is not seen)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS and Windows have no affinity mask
        return os.cpu_count() or 1


WAKE_BYTES = 2**20
"""Bytes of queued, not yet started jobs that wake an idle worker (1 MiB): waking it costs the
hook about 0.1 ms (the worker takes the GIL from the training thread and gives it back), more
than reducing a small tensor; a sample's small tensors wait for each other instead, and for
``kick`` (the end of a sample's forward) or for anyone who waits for them."""

BUDGET_FLOOR = 8 * 2**20
"""Bytes the copies waiting for the worker may always hold (8 MiB), however small the largest:
on the small workloads of ``benchmarks/`` a budget of one tensor made hooks wait during the
backward's bursts, and a sampled step cost 0.05-0.1x more than with this floor."""


class ReductionWorker:
    """Runs jobs on one daemon thread, in order, holding at most a budget of bytes of input.

    The budget is the largest reservation so far, or ``floor`` bytes if that is more.
    ``submit`` reserves the job's bytes (waiting for room), makes the job on the calling thread
    (that is where the copy is taken) and queues it; ``wait`` returns once every job has run.
    An idle worker is woken once ``wake_bytes`` of jobs are queued, by ``kick``, or by any
    caller that waits (for room or for jobs): while one waits, every new job wakes it too.

    Args:
        floor: The least budget, in bytes (``None``: ``BUDGET_FLOOR``; ``0`` keeps the budget
            at the largest copy).
        wake_bytes: Bytes of queued, not yet started jobs that wake an idle worker
            (``WAKE_BYTES``; ``0`` wakes it for every job).
    """

    def __init__(self, floor: int | None = None, wake_bytes: int = WAKE_BYTES) -> None:
        # taken directly (``with self._lock``) on the hand-over's path: a ``Condition``'s own
        # ``with`` is a Python call around the same lock, and waiting on either condition
        # needs only this lock held
        self._lock = lock = threading.RLock()
        self._condition = threading.Condition(lock)  # callers wait here: room, finished jobs
        self._work = threading.Condition(lock)  # the worker waits here: jobs worth a wake
        self._waiters = 0  # callers blocked until jobs run: every job wakes the worker then
        # each job, the bytes it holds of the budget, its buffer, the bytes it reads (a wake's)
        self._jobs: collections.deque[tuple[Callable[[], None], int, torch.Tensor | None, int]] = (
            collections.deque()
        )
        self._held = 0  # bytes reserved by jobs not yet finished
        self._queued = 0  # bytes of the jobs not yet started
        self._wake_bytes = wake_bytes
        self._floor = BUDGET_FLOOR if floor is None else floor
        self._budget = self._floor  # the largest reservation so far, or the floor if more
        self._spares = Spares()
        self._submitted = 0  # jobs submitted (a job's ticket is the count after it)
        self._finished = 0  # jobs run to their end, in order
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._closed = False

    def buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat buffer of ``numel`` entries for the copy of the job being made (in ``make``).

        A spare of that size and dtype when there is one: its pages are mapped already, and a
        copy into it takes a third to half the time of one into fresh memory, whose pages the
        system maps (and zeroes) as the copy first touches them. Otherwise a new one, after
        freeing the oldest spares until what is held and spare fits the budget again.
        """
        import torch

        if os.getpid() != self._pid:  # a child made by fork: the lock may be held, no spares
            return torch.empty(numel, dtype=dtype)
        with self._condition:
            spare = self._spares.take(numel, dtype)
            if spare is not None:
                return spare
            self._spares.trim(self._budget - self._held)
        return torch.empty(numel, dtype=dtype)

    def submit(self, nbytes: int, make: Callable[[], Job], *, held: bool = True) -> int | None:
        """Reserve ``nbytes``, call ``make()`` here for the job, and queue the job.

        ``held=False``: the job reads memory that lives anyway (a tensor read in place,
        ``Measurer.measure``'s ``in_place``) and reserves none of the budget; its ``nbytes``
        still count toward the bytes that wake the worker.

        ``make`` returns the job and the buffer holding its copy, from ``buffer`` (or ``None``):
        once the job has run, the buffer is kept as a spare for a later copy of its size while
        the spares stay within ``floor`` and, with the bytes held, within the budget. Waits
        while the bytes held plus ``nbytes`` would pass the budget (unless nothing is held).
        ``make`` must not raise for reasons the job could report itself; if it does, the
        reservation is released and the error propagates.

        Returns:
            The job's ticket for ``done`` and ``wait``; ``None`` when it ran here already
            (after ``close``, or in a child made by ``fork``).
        """
        if _current_pid != self._pid or self._closed:  # no worker thread here (fork): run it now
            make()[0]()
            return None
        reserved = nbytes if held else 0
        with self._lock:  # ``_wait_for_jobs`` waits on the condition of this lock
            self._budget = max(self._budget, reserved)
            while self._held and self._held + reserved > self._budget:
                self._wait_for_jobs()  # the jobs holding the room may not have started
            self._held += reserved
        try:
            job, buffer = make()
        except BaseException:
            self._release(reserved)
            raise
        entry = (job, reserved, buffer, nbytes)
        with self._lock:
            try:
                if self._spares.bytes:  # a copy made without ``buffer`` did not trim them
                    self._spares.trim(self._budget - self._held)
                if not self._closed and self._running():
                    # counted, then queued, with no call between them: an interrupt (which
                    # Python raises once a call returns) finds the job queued and counted, or
                    # neither
                    self._submitted += 1
                    self._queued += nbytes
                    self._jobs.append(entry)
                    if self._queued >= self._wake_bytes or self._waiters:
                        self._work.notify()
                    return self._submitted
            except BaseException:
                # an interrupt (a Ctrl-C while the thread starts) before the job was queued:
                # the room it reserved goes back, or a later hand-over would wait for it for
                # good. The lock is held: the worker cannot have taken it meanwhile.
                if not any(queued is entry for queued in self._jobs):
                    self._release(reserved)
                raise
        # closed meanwhile (removal from another thread), or no thread could start: run it here
        try:
            job()
        finally:
            self._release(reserved)
        return None

    def wait(self, ticket: int | None = None) -> None:
        """Block until the job with ``ticket`` has run; without one, every job submitted.

        Returns at once, without the lock, when nothing is left (the inline path asks at every
        tensor).
        """
        goal = self._submitted if ticket is None else ticket
        if self._finished >= goal or _current_pid != self._pid:
            return
        with self._condition:
            goal = self._submitted if ticket is None else ticket
            while self._finished < goal:
                self._wait_for_jobs()  # the worker may sleep on jobs too small to wake it

    def kick(self) -> None:
        """Wake the worker for the jobs queued so far, however small (a sample's forward ended)."""
        if _current_pid != self._pid or not self._jobs:
            return
        with self._lock:
            self._work.notify()

    def _wait_for_jobs(self) -> None:
        """Wake the worker and wait for a job to finish (lock held); jobs wake it meanwhile."""
        self._waiters += 1
        try:
            self._work.notify()
            self._condition.wait()
        finally:
            self._waiters -= 1

    def done(self, ticket: int | None) -> bool:
        """Whether the job with ``ticket`` has run (a job without one ran when submitted)."""
        return ticket is None or self._finished >= ticket or _current_pid != self._pid

    def on_thread(self) -> bool:
        """Whether the caller runs on this worker's thread (inside a job)."""
        return self._thread is not None and threading.current_thread() is self._thread

    def close(self) -> None:
        """Run what is queued, then stop the thread; later jobs run in the caller."""
        if os.getpid() != self._pid:  # a child made by fork: no thread, and the lock may be held
            self._closed = True
            self._spares = Spares()
            return
        with self._condition:
            self._closed = True
            self._spares.clear()
            self._condition.notify_all()
            self._work.notify()
            thread = self._thread
        if thread is not None and os.getpid() == self._pid:
            thread.join()

    def _running(self) -> bool:
        """Start the thread if there is none yet; whether it runs (it may fail to start).

        The thread is known before it starts: an interrupt in ``start`` (which waits for the
        thread to run) must not leave it running unknown, beside a second one started later.
        One an interrupt kept from starting is not started again: the caller reduces instead.
        """
        thread = self._thread
        if thread is None:
            thread = self._thread = threading.Thread(
                target=self._run, name="torchinstruments-reductions", daemon=True
            )
            try:
                thread.start()
            except RuntimeError:  # "can't start new thread": the caller reduces instead
                self._thread = None
                return False
        return thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._condition:
                while not self._jobs and not self._closed:
                    self._work.wait()
                if not self._jobs:
                    return
                job, reserved, buffer, nbytes = self._jobs.popleft()
                self._queued -= nbytes
            try:
                job()
            except BaseException:  # jobs record their own errors; a stray one must not stop us
                pass
            finally:
                del job  # the job holds its copy: freed (or kept spare) before room is given back
                self._release(reserved, finished=1, spare=buffer)
                del buffer

    def _release(
        self, nbytes: int, *, finished: int = 0, spare: torch.Tensor | None = None
    ) -> None:
        with self._lock:
            self._held -= nbytes
            self._finished += finished
            if spare is not None and not self._closed:
                self._spares.keep(spare, min(self._floor, self._budget - self._held))
            self._condition.notify_all()


class Spares:
    """Buffers of finished copies, kept for later copies of their size (oldest first).

    A copy into a spare's mapped pages takes a third to half the time of one into fresh
    memory. The worker that owns them says how many bytes they may hold (its lock held).
    """

    __slots__ = ("_buffers", "bytes")

    def __init__(self) -> None:
        self._buffers: collections.deque[torch.Tensor] = collections.deque()
        self.bytes = 0

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A spare of ``numel`` entries of ``dtype``, no longer kept; ``None`` if none is."""
        for index, spare in enumerate(self._buffers):
            if spare.numel() == numel and spare.dtype == dtype:
                del self._buffers[index]  # by position: ``remove`` would compare tensors
                self.bytes -= _nbytes(spare)
                return spare
        return None

    def keep(self, buffer: torch.Tensor, room: int) -> None:
        """Keep ``buffer`` if the spares stay within ``room`` bytes with it."""
        size = self.bytes + _nbytes(buffer)
        if size <= room:
            self._buffers.append(buffer)
            self.bytes = size

    def trim(self, room: int) -> None:
        """Free the oldest spares until they hold at most ``room`` bytes."""
        while self._buffers and self.bytes > room:
            self.bytes -= _nbytes(self._buffers.popleft())

    def clear(self) -> None:
        """Free every spare."""
        self._buffers.clear()
        self.bytes = 0


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def flat_copy(plain: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """``plain``'s entries copied into the flat ``buffer``, in row-major order; ``buffer``.

    A contiguous tensor is copied flat: a copy between two-dimensional views of the same
    entries takes torch four times as long (19 against 4 us for 16 Ki float32 entries).
    """
    if plain.is_contiguous():
        return buffer.copy_(plain.view(-1))
    buffer.view(plain.shape).copy_(plain)
    return buffer
