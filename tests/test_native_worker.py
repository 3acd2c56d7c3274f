"""The kernels' reduction queue (``_kernels.c``) and the worker that hands it a sample's tensors.

The queue's thread runs ``profile`` without the GIL; ``NativeWorker`` keeps the buffers of its
jobs alive, bounds their bytes, keeps spares and reads the values back in order; ``Measurer``
sends a small sample's tensors there. Checked: the queue's values are ``profile``'s bit for bit
(its own subsample draws included), jobs run in order and a closed queue runs them in the
caller, a waiter runs the jobs the thread has not started and they count in order all the same
(concurrent submitters and waiters included), a closing record waits once for its last job,
copies queued in pieces, the thread lingers for a next job before it sleeps (a job then needs
no wake), a child made by ``fork`` never touches the parent's queue, the worker's byte budget
and spares, and a measurement by the queue equals one in the hooks, odd tensors included.
"""

from __future__ import annotations

import collections
import gc
import math
import multiprocessing
import os
import threading
import time
import weakref
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from helpers import floats
from torchinstruments_core import AlwaysSampler, _background, inject_observer
from torchinstruments_core import _native_worker as _native_worker_module
from torchinstruments_core._measure import Measurer
from torchinstruments_core._native_worker import NativeWorker, ProfileJob
from torchinstruments_core.reducers import HistogramReducer, _native, default_reducers
from torchinstruments_core.reducers._fused import _call
from torchinstruments_core.testing import RecordingSink

pytestmark = pytest.mark.skipif(not _native.QUEUE, reason="the kernels have no queue here")


def _queued(queue: object, values: torch.Tensor, seed: int | None, bins: int) -> _native.Queued:
    call = _call(values.numel(), 8192 if seed is not None else 0, bins)
    return _native.submit_profile(queue, values, seed, call.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("numel", [1, 640, 20_000])
@pytest.mark.parametrize("bins", [0, 37])
def test_a_queued_profile_is_profile_bit_for_bit(dtype: torch.dtype, numel: int, bins: int) -> None:
    """The queue's thread gives what ``profile`` gives in the caller.

    The positions are drawn there from the seed (``draw_positions``'s), or are the tensor's
    first entries without one.
    """
    values = torch.randn(numel, dtype=dtype, generator=torch.Generator().manual_seed(numel))
    queue = _native.new_queue()
    for seed in (None, 12345) if numel > 8192 else (None,):
        queued = _queued(queue, values, seed, bins)
        assert queued.ticket is not None
        _native.queue_wait(queue, queued.ticket, run=False)  # the thread's run, not the caller's
        call = _call(numel, 8192 if seed is not None else 0, bins)
        index = None if seed is None else _native.draw_positions(seed, numel, call.size)
        expected = _native.profile(values, index, call.shape)
        got = queued.profiled()
        # one entry has no spread: its moments take the second pass, on both sides
        assert got.status == expected.status == _native.STATUS_OK
        assert got.values.tolist() == expected.values.tolist()
        assert got.summary() == expected.summary()
        here = _queued(None, values, seed, bins)  # no queue: the same job, in the caller
        assert here.ticket is None
        assert here.profiled().values.tolist() == expected.values.tolist()
    _native.queue_close(queue)


def test_a_nonfinite_entry_gives_the_queue_s_status_and_the_sums_alone() -> None:
    """A NaN stops the job after the sums, as it stops ``profile``: the status says so."""
    values = torch.randn(1000)
    values[17] = math.nan
    queue = _native.new_queue()
    queued = _queued(queue, values, None, 16)
    assert queued.ticket is not None
    _native.queue_wait(queue, queued.ticket, run=False)
    assert queued.profiled().status == _native.STATUS_NONFINITE
    assert math.isnan(queued.profiled().numbers[0])


def test_jobs_run_in_the_order_submitted_and_a_closed_queue_runs_them_in_the_caller() -> None:
    """Tickets count the jobs; once job N has run, so have those before it.

    After ``queue_close`` a job runs before ``queue_submit`` returns, and is counted as run.
    """
    queue = _native.new_queue()
    values = [torch.randn(50_000, generator=torch.Generator().manual_seed(n)) for n in range(20)]
    queued = [_queued(queue, v, 7, 0) for v in values]
    assert [q.ticket for q in queued] == list(range(1, 21))
    _native.queue_wait(queue, 20)
    assert _native.queue_finished(queue) == 20
    assert all(q.profiled().status == _native.STATUS_OK for q in queued)
    _native.queue_close(queue)
    late = _queued(queue, values[0], 7, 0)
    assert late.ticket == 21
    assert _native.queue_finished(queue) == 21  # ran in the caller
    assert late.profiled().values.tolist() == queued[0].profiled().values.tolist()
    _native.queue_wait(queue, 10**9)  # a ticket past the last waits for the last only


def _expected(values: torch.Tensor, seed: int | None, bins: int) -> list[float]:
    """``profile``'s values of ``values`` in the caller, as ``_queued`` asks the queue."""
    call = _call(values.numel(), 8192 if seed is not None else 0, bins)
    index = None if seed is None else _native.draw_positions(seed, values.numel(), call.size)
    result: list[float] = _native.profile(values, index, call.shape).values.tolist()
    return result


def test_a_waiter_runs_the_jobs_the_thread_has_not_started() -> None:
    """``queue_wait`` runs queued jobs up to its ticket itself, with the same values.

    The first job (16 M entries, a histogram: tens of milliseconds) keeps the queue's thread
    busy while the waiter arrives, so the small jobs behind it are the waiter's to run
    (``queue_helped``); every job's values are ``profile``'s bit for bit, and all are counted.
    """
    big = torch.randn(16_000_000, generator=torch.Generator().manual_seed(1))
    small = [torch.randn(30_000, generator=torch.Generator().manual_seed(n)) for n in range(30)]
    for _ in range(3):  # a host that stalls the waiter for the big job's whole time: again
        queue = _native.new_queue()
        jobs = [_queued(queue, big, 99, 64)]
        jobs += [_queued(queue, values, n, 16) for n, values in enumerate(small)]
        last = jobs[-1].ticket
        assert last == 31
        _native.queue_wait(queue, last)
        helped = _native.queue_helped(queue)
        assert _native.queue_finished(queue) == 31
        assert jobs[0].profiled().values.tolist() == _expected(big, 99, 64)
        for n, (job, values) in enumerate(zip(jobs[1:], small, strict=True)):
            assert job.profiled().status == _native.STATUS_OK
            assert job.profiled().values.tolist() == _expected(values, n, 16)
        _native.queue_close(queue)
        if helped:
            break
    assert 1 <= helped <= 31


def test_a_waiter_told_not_to_run_jobs_only_waits() -> None:
    """``queue_wait(..., run=False)``: the queue's thread runs every job, the caller none."""
    big = torch.randn(4_000_000, generator=torch.Generator().manual_seed(1))
    small = [torch.randn(30_000, generator=torch.Generator().manual_seed(n)) for n in range(10)]
    queue = _native.new_queue()
    jobs = [_queued(queue, big, 9, 64)]
    jobs += [_queued(queue, values, n, 16) for n, values in enumerate(small)]
    _native.queue_wait(queue, 11, run=False)
    assert _native.queue_finished(queue) == 11
    assert _native.queue_helped(queue) == 0
    for n, (job, values) in enumerate(zip(jobs[1:], small, strict=True)):
        assert job.profiled().values.tolist() == _expected(values, n, 16)
    _native.queue_close(queue)


def test_jobs_a_waiter_ran_are_counted_once_every_job_before_them_has_run() -> None:
    """``queue_finished`` counts in the order submitted, whoever ran the jobs.

    A waiter for job 5 that runs jobs 2 to 5 itself (``queue_helped``) while the thread still
    runs job 1 (16 M entries and a histogram) leaves the count at 0 until job 1 has run, and it
    then says 5, never a number between; the waiter returns only then.
    """
    big = torch.randn(16_000_000, generator=torch.Generator().manual_seed(2))
    small = [torch.randn(1000, generator=torch.Generator().manual_seed(n)) for n in range(4)]
    helped = 0
    for _ in range(3):  # a waiter that started after job 1 ran has nothing to show: again
        queue = _native.new_queue()
        first = _queued(queue, big, 5, 64)
        behind = [_queued(queue, v, None, 0) for v in small]
        assert [j.ticket for j in behind] == [2, 3, 4, 5]
        waiter = threading.Thread(target=_native.queue_wait, args=(queue, 5))
        waiter.start()
        seen = [_native.queue_finished(queue)]
        while waiter.is_alive():
            seen.append(_native.queue_finished(queue))
        waiter.join()
        seen.append(_native.queue_finished(queue))
        helped = _native.queue_helped(queue)
        assert seen == sorted(seen)
        assert seen[-1] == 5
        assert first.profiled().values.tolist() == _expected(big, 5, 64)
        for job, values in zip(behind, small, strict=True):
            assert job.profiled().values.tolist() == _expected(values, None, 0)
        _native.queue_close(queue)
        if helped == 4:
            assert set(seen) <= {0, 5}
            break
    assert helped == 4


def test_threads_that_submit_and_wait_at_once_get_every_job_s_values() -> None:
    """Four threads submitting to one queue and waiting, each for its own jobs, concurrently.

    Waiters run jobs of other threads too (those before their own); every job is run once,
    with ``profile``'s values, and the count reaches every ticket.
    """
    queue = _native.new_queue()
    tensors = [torch.randn(20_000, generator=torch.Generator().manual_seed(n)) for n in range(8)]
    expected = [_expected(t, 3, 8) for t in tensors]
    failures: list[str] = []

    def work(offset: int) -> None:
        for round_ in range(25):
            mine = [(i, _queued(queue, tensors[i], 3, 8)) for i in range(offset, 8, 4)]
            tickets = [job.ticket for _, job in mine]
            assert all(t is not None for t in tickets)
            _native.queue_wait(queue, max(t for t in tickets if t is not None))
            for i, job in mine:
                if job.profiled().values.tolist() != expected[i]:
                    failures.append(f"thread {offset}, round {round_}, tensor {i}")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert _native.queue_finished(queue) == 4 * 25 * 2
    _native.queue_close(queue)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="no /proc (not Linux)")
def test_the_queue_s_thread_has_a_name_of_its_own() -> None:
    """``top -H``, ``ps -L`` and ``/proc`` show the queue's thread as ``ti-kernel-queue``.

    Not as the process's name, so that its processor time is told apart from the model's.
    """

    def names() -> list[str]:
        found = []
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/comm") as comm:
                    found.append(comm.read().strip())
            except FileNotFoundError:  # a thread that ended meanwhile
                continue
        return found

    before = names().count("ti-kernel-queue")
    queue = _native.new_queue()
    queued = _queued(queue, torch.randn(1000), None, 0)  # the first job starts the thread
    assert queued.ticket is not None
    # the thread runs it (named by then): a caller that ran it could return before it started
    _native.queue_wait(queue, queued.ticket, run=False)
    assert names().count("ti-kernel-queue") == before + 1
    _native.queue_close(queue)
    assert names().count("ti-kernel-queue") == before


def _runs_within(queue: object, ticket: int | None, seconds: float = 10.0) -> bool:
    """Whether job ``ticket`` runs within ``seconds`` (a lost wake would leave it queued)."""
    assert ticket is not None
    deadline = time.monotonic() + seconds
    while _native.queue_finished(queue) < ticket:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def test_a_lingering_thread_takes_the_next_job_without_being_woken() -> None:
    """After a job the thread looks for the next one for ``linger_ns``: no submit wakes it.

    Closing the queue while its thread lingers stops it at once, not at the linger's end.
    """
    queue = _native.new_queue(60 * 10**9)  # a minute: it lingers through the whole test
    values = torch.randn(1000)
    queued = _queued(queue, values, None, 0)  # held until it has run: the job writes into it
    assert _runs_within(queue, queued.ticket)  # starts the thread
    for _ in range(5):
        time.sleep(0.005)  # a hundred times the thread's naps: it has finished and lingers
        queued = _queued(queue, values, None, 0)
        assert _runs_within(queue, queued.ticket)
    assert _native.queue_wakes(queue) == 0
    started = time.monotonic()
    _native.queue_close(queue)
    assert time.monotonic() - started < 5


def _until_asleep(queue: object, seconds: float = 10.0) -> None:
    """Waits until a job wakes ``queue``'s thread, which is then asleep (past its linger).

    A thread starved of its processor may still linger at the first try: the job it took
    without a wake is run, and the next one tried after a longer pause.
    """
    deadline = time.monotonic() + seconds
    before = _native.queue_wakes(queue)
    pause = 0.05  # a hundred times the default linger
    values = torch.randn(1000)
    while _native.queue_wakes(queue) == before:
        assert time.monotonic() < deadline, "the thread was never found asleep"
        time.sleep(pause)
        pause *= 2
        queued = _queued(queue, values, None, 0)  # held until it has run: the job writes into it
        assert _runs_within(queue, queued.ticket)
    assert _native.queue_wakes(queue) == before + 1  # the one job woke it, once


def test_a_thread_that_no_longer_lingers_is_woken_by_the_next_job() -> None:
    """Past its linger (0.5 ms by default) the thread sleeps, and the next job wakes it once."""
    queue = _native.new_queue()
    queued = _queued(queue, torch.randn(1000), None, 0)
    assert _runs_within(queue, queued.ticket)  # starts the thread
    for _ in range(3):
        _until_asleep(queue)
    _native.queue_close(queue)


def test_a_thread_that_never_lingers_is_woken_by_every_job() -> None:
    """Without a linger (``linger_ns=0``) every job that finds the thread asleep wakes it.

    It sleeps as soon as it has nothing: each job after a pause wakes it exactly once, and jobs
    queued while the woken thread runs the first of them wake nothing more.
    """
    queue = _native.new_queue(0)
    values = torch.randn(1000)
    queued = _queued(queue, values, None, 0)
    assert _runs_within(queue, queued.ticket)  # starts the thread
    for wakes in range(1, 4):
        time.sleep(0.05)  # the thread has run the job and sleeps on its condition
        queued = _queued(queue, values, None, 0)
        assert _runs_within(queue, queued.ticket)
        assert _native.queue_wakes(queue) == wakes
    time.sleep(0.05)
    big = torch.randn(4_000_000, dtype=torch.float64)  # runs for milliseconds
    burst = [_queued(queue, big, None, 37), _queued(queue, values, None, 0)]
    burst.append(_queued(queue, values, None, 0))
    busy = _native.queue_finished(queue) < (burst[0].ticket or 0)
    assert _runs_within(queue, burst[-1].ticket)
    if busy:  # the thread was never asleep after the first of them: one wake in all
        assert _native.queue_wakes(queue) == 4
    else:  # this thread was held up past the big job: each may have found it asleep
        assert 4 <= _native.queue_wakes(queue) <= 6
    _native.queue_close(queue)


@pytest.mark.parametrize("linger_ns", [-1, 60 * 10**9 + 1])
def test_a_linger_outside_zero_to_a_minute_is_refused(linger_ns: int) -> None:
    """A negative linger, or one past a minute, raises before any queue is made.

    The worker checks it in its constructor, not at its first job, which runs in a hook.
    """
    with pytest.raises(ValueError, match="linger_ns must be between 0 and"):
        _native.new_queue(linger_ns)
    with pytest.raises(ValueError, match="linger_ns must be between 0 and"):
        NativeWorker(linger_ns=linger_ns)
    assert _native.LINGER_MAX_NS == 60 * 10**9
    assert (
        _native.queue_wakes(_native.new_queue(_native.LINGER_MAX_NS)) == 0
    )  # the longest is taken


def test_the_queue_checks_what_it_is_handed() -> None:
    """Not a queue, a plan that does not fit, a seed with an index: errors, nothing queued."""
    assert _native.KERNELS is not None
    kernels = _native.KERNELS
    queue = _native.new_queue()
    values = torch.randn(10)
    call = _call(10, 0, 7)
    assert call.plan is not None
    numbers = np.empty(5 + call.plan.ranks.size + 4 + 1)
    out = np.empty(_native.MOMENTS + 3 + 11 + 8, dtype=np.float32)  # 7 bins: 11 packed, 8 edges
    arguments = (values.data_ptr(), 10, 0, 0, 10, call.plan.ranks, call.plan.table, 7)
    with pytest.raises(ValueError, match="PyCapsule"):
        kernels.queue_finished(object())
    with pytest.raises(TypeError, match="at most 1 argument"):
        kernels.queue_new(0, 0)
    with pytest.raises(ValueError, match="numbers"):  # no room for the status
        kernels.queue_submit(queue, None, *arguments, numbers[1:], out)
    with pytest.raises(ValueError, match="a seed and an index"):
        kernels.queue_submit(
            queue, 3, *arguments[:3], values.data_ptr(), *arguments[4:], numbers, out
        )
    assert kernels.queue_finished(queue) == 0
    assert kernels.queue_submit(queue, None, *arguments, numbers, out) == 1


def _touch_in_child(queue: object, results: Any) -> None:
    try:
        _native.queue_finished(queue)
        results.put("touched")
    except RuntimeError as error:
        results.put(str(error))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_made_by_fork_never_touches_the_parent_s_queue() -> None:
    """The queue's lock may have been held by its thread at the fork: the child raises instead."""
    queue = _native.new_queue()
    queued = _queued(queue, torch.randn(100), None, 0)  # held until it has run
    _native.queue_wait(queue, queued.ticket or 0)
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(target=_touch_in_child, args=(queue, results))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    assert "another process" in results.get(timeout=5)


def _job(values: torch.Tensor, seen: list[int], buffer: torch.Tensor | None = None) -> ProfileJob:
    call = _call(values.numel(), 0, 0)
    return ProfileJob(values, None, call, lambda p: seen.append(p.status), buffer)


def test_the_worker_holds_at_most_its_budget_and_reads_jobs_back_in_order() -> None:
    """With no floor the budget is the largest job: a hand-over reads back the job before it.

    What is read back, and when, follows the tickets.
    """
    worker = NativeWorker(floor=0)
    seen: list[int] = []
    held = []
    tickets = []
    for _n in range(5):
        tickets.append(worker.submit(4 * 100_000, lambda: _job(torch.randn(100_000), seen)))
        held.append(worker._held)
    assert held == [4 * 100_000] * 5
    assert len(seen) == 4  # each earlier job read back when the next one came
    assert tickets == [1, 2, 3, 4, 5]
    assert not worker.done(6)
    worker.wait()
    assert worker.done(5)
    assert seen == [_native.STATUS_OK] * 5
    assert worker._held == 0
    worker.close()


def test_finished_copies_stay_as_spares_within_the_floor_and_close_frees_them() -> None:
    """A job's buffer is handed out again for a copy of its size and dtype once read back.

    The spares never pass the floor; ``close`` frees them, and later jobs run in the caller.
    """
    worker = NativeWorker(floor=3 * 4000)
    seen: list[int] = []
    buffers = [worker.buffer(1000, torch.float32) for _ in range(4)]
    for buffer in buffers:
        buffer.normal_()
        worker.submit(4000, lambda b=buffer: _job(b, seen, b))  # type: ignore[misc]
    worker.wait()
    assert worker._spares.bytes == 3 * 4000  # the fourth did not fit the floor
    assert worker.buffer(1000, torch.float64).dtype == torch.float64  # not a float32 spare
    again = worker.buffer(1000, torch.float32)
    assert any(again is buffer for buffer in buffers)
    worker.close()
    assert worker._spares.bytes == 0
    assert worker.submit(4000, lambda: _job(torch.randn(1000), seen)) is None
    assert seen == [_native.STATUS_OK] * 5


def test_a_worker_let_go_with_jobs_queued_closes_its_queue_first() -> None:
    """Dropped while its jobs run, the worker's queue runs them before their buffers go."""
    worker = NativeWorker()
    seen: list[int] = []
    for _n in range(10):
        worker.submit(4 * 200_000, lambda: _job(torch.randn(200_000), seen))
    queue = worker._queue
    assert queue is not None
    gone = weakref.ref(worker)
    del worker
    gc.collect()
    assert gone() is None
    assert _native.queue_finished(queue) == 10  # closed, every job run, without a wait here
    closed: list[int] = []
    _native_worker_module._close_queue(lambda: closed.append(1), -1)  # another process's
    assert closed == []  # left alone


def test_a_queue_let_go_after_the_kernels_are_switched_off_still_closes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker collected once ``KERNELS`` is ``None`` closes its queue all the same.

    A test of the path without the kernels switches them off; the finalizer closes the queue
    with the kernels that made it instead of failing.
    """
    worker = NativeWorker()
    seen: list[int] = []
    for _n in range(4):
        worker.submit(4 * 200_000, lambda: _job(torch.randn(200_000), seen))
    queue = worker._queue
    monkeypatch.setattr(_native, "KERNELS", None)
    del worker
    gc.collect()
    monkeypatch.undo()
    assert _native.queue_finished(queue) == 4


def _queue_measurer(**options: Any) -> Measurer:
    """A measurer that hands every CPU tensor to the kernels' queue (a small sample's path)."""
    measurer = Measurer(default_reducers(), HistogramReducer(bins=37), background=True, **options)
    assert measurer._native is not None
    measurer.new_sample()
    measurer._small = True
    return measurer


def _hooks_measurer() -> Measurer:
    measurer = Measurer(default_reducers(), HistogramReducer(bins=37), background=False)
    measurer.new_sample()
    return measurer


def _odd_tensors() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(9)
    big = torch.randn(64, 1024, generator=generator)
    nan = torch.randn(5000, generator=generator)
    nan[::7] = math.nan
    return [
        torch.randn(1, generator=generator),
        torch.randn(64, 256, generator=generator),
        big.t(),  # strided: copied flat
        big[:, ::3],
        big.to(torch.bfloat16),  # a narrower dtype: copied into float32
        torch.randn(30_000, dtype=torch.float64, generator=generator),
        torch.full((5000,), 3.0),
        torch.randn(20_000, generator=generator) * 1e-3 + 40.0,  # the moments' second pass
        torch.full((10,), 1e30),  # squares that need scaling: the reducers run
        nan,  # non-finite entries: the reducers run, on the job's copy
        torch.tensor([1.0, math.inf, -2.0]),
    ]


def _count_jobs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The entries of every job started on a queue from now on (``ProfileJob.start``)."""
    started: list[int] = []
    start = ProfileJob.start

    def counted(job: ProfileJob, queue: object | None) -> int | None:
        ticket = start(job, queue)
        started.append(job._call.numel)
        return ticket

    monkeypatch.setattr(ProfileJob, "start", counted)
    return started


def test_a_measurement_by_the_queue_is_the_hooks_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Values, histograms and reasons equal those reduced in the hooks, tensor by tensor.

    The odd ones the kernels do not finish included: the reducers run on what the job read.
    """
    queued, hooks = _queue_measurer(), _hooks_measurer()
    submitted = _count_jobs(monkeypatch)
    tensors = _odd_tensors()
    one = [queued.measure(t, with_histogram=True) for t in tensors]
    other = [hooks.measure(t, with_histogram=True) for t in tensors]
    assert len(submitted) == len(tensors)
    for tensor, a, b in zip(tensors, one, other, strict=True):
        assert a.settle() is None
        assert (a.reason, b.reason) == (None, None), tensor
        assert [r.metrics for r in a.results] == [r.metrics for r in b.results]
        got = [floats(r.values) for r in a.results]
        expected = [floats(r.values) for r in b.results]
        assert str(got) == str(expected)  # NaN where NaN: the same values, compared as text
        assert floats(a.histogram) == floats(b.histogram)
        assert str(a.histogram_edges) == str(b.histogram_edges)
        assert (a.histogram_bins, a.histogram_float64) == (b.histogram_bins, b.histogram_float64)
        assert a.n_finite is not None
        assert b.n_finite is not None
        assert float(a.n_finite) == float(b.n_finite)
    queued.close()


def test_a_job_out_of_memory_is_reduced_by_the_reducers_with_the_hooks_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A job whose thread could not allocate its tables (``STATUS_NO_MEMORY``) loses nothing.

    Its numbers are not read: the reducers run on the copy the job read (the sources change
    after their hooks here), with the sample's subsample positions, and give the values,
    histogram and reasons the hooks give. Here every job reports the status, as the queue's
    thread writes it when ``malloc`` fails. Unlike the odd tensors of the test above, two of
    these are subsampled, so the fallback's positions must be the ones the job would have drawn.
    """
    reported: list[int] = []

    def out_of_memory(queued: _native.Queued) -> _native.Profiled:
        reported.append(queued.source.numel())
        numbers = np.full_like(queued.numbers[:-1], np.nan)  # whatever the job left: unread
        return _native.Profiled(_native.STATUS_NO_MEMORY, numbers, np.full_like(queued.values, 7))

    monkeypatch.setattr(_native.Queued, "profiled", out_of_memory)
    monkeypatch.setattr(_native.Queued, "status", _native.STATUS_NO_MEMORY)
    queued, hooks = _queue_measurer(), _hooks_measurer()
    generator = torch.Generator().manual_seed(3)
    tensors = [
        torch.randn(64, 256, generator=generator),  # subsampled quartiles
        torch.randn(640, generator=generator),  # exact ones
        torch.randn(20_000, dtype=torch.float64, generator=generator),  # subsampled
    ]
    one = [queued.measure(t, with_histogram=True) for t in tensors]
    other = [hooks.measure(t, with_histogram=True) for t in tensors]
    for tensor in tensors:  # the model's next ops: only the jobs' copies keep the values
        tensor.fill_(5.0)
    for tensor, a, b in zip(tensors, one, other, strict=True):
        assert a.settle() is None
        assert (a.reason, b.reason, a.errors) == (None, None, []), tensor.shape
    assert reported == [t.numel() for t in tensors]  # every job went to the queue, and failed
    for tensor, a, b in zip(tensors, one, other, strict=True):
        assert [floats(r.values) for r in a.results] == [floats(r.values) for r in b.results]
        assert floats(a.histogram) == floats(b.histogram)
        assert a.n_finite is not None
        assert float(a.n_finite) == tensor.numel()
    queued.close()


def test_a_shared_gradient_is_copied_for_the_queue_and_keeps_its_values() -> None:
    """A tensor the Python worker would read as it is goes to the queue as a copy.

    The queue's thread reads memory by address, so a later ``set_`` or resize of the tensor
    must not free what it reads: the values are those at the hand-over, as in the hooks, even
    when the tensor changes in place or loses its storage before the job is read back.
    """
    measurer, hooks = _queue_measurer(), _hooks_measurer()
    changed: list[str] = []
    touched = torch.randn(4096)
    emptied = torch.randn(4096)
    expected = [hooks.measure(t.clone(), with_histogram=True) for t in (touched, emptied)]
    got = [
        measurer.measure(t, with_histogram=True, shared=True, changed=lambda: changed.append("x"))
        for t in (touched, emptied)
    ]
    assert all(measurement.shared is None for measurement in got)  # copies, nothing to check
    touched.mul_(2.0)
    # its old storage freed: a job that read it in place would read freed memory
    emptied.set_(torch.empty(0).untyped_storage())
    for measurement, reference in zip(got, expected, strict=True):
        assert measurement.settle() is None
        assert measurement.reason is None
        assert [floats(r.values) for r in measurement.results] == [
            floats(r.values) for r in reference.results
        ]
        assert floats(measurement.histogram) == floats(reference.histogram)
    assert changed == []
    measurer.close()


def _trained(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    background: bool | None,
    inputs: list[torch.Tensor],
    *,
    classes: int | None = None,
) -> RecordingSink:
    """A step sampled for each of ``inputs``, with the optimizer's step signals; the sink.

    The loss is the cross-entropy against ``arange % classes``, or the outputs' mean square.
    """
    sink = RecordingSink()
    with inject_observer(
        model,
        sampler=AlwaysSampler(),
        sink=sink,
        optimizer=optimizer,
        background_reductions=background,
    ) as observer:
        for step, x in enumerate(inputs):
            observer.begin_step(step, sample=True)
            output = model(x)
            if classes is None:
                output.square().mean().backward()
            else:
                targets = torch.arange(len(x)) % classes
                nn.functional.cross_entropy(output, targets).backward()
            optimizer.step()
            optimizer.zero_grad()
            observer.end_step()
    return sink


def test_a_small_model_sampled_on_the_queue_gives_the_rows_of_the_hooks() -> None:
    """A training loop's small samples (the queue from the second on) equal reduced in hooks."""

    def run(background_reductions: bool | None) -> RecordingSink:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(inplace=True), nn.Linear(64, 10))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        generator = torch.Generator().manual_seed(1)
        inputs = [torch.randn(256, 32, generator=generator) for _ in range(4)]
        return _trained(model, optimizer, background_reductions, inputs, classes=10)

    with pytest.MonkeyPatch.context() as patch:
        submitted = _count_jobs(patch)
        queued = run(True)
    assert len(submitted) > 0  # from the second sample on, every tensor: a small model
    hooks = run(False)
    assert [s.rows for s in queued.samples] == [s.rows for s in hooks.samples]
    assert [s.histograms for s in queued.samples] == [s.histograms for s in hooks.samples]


def test_a_closing_record_waits_for_the_queue_once_up_to_its_last_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``Sample.settle`` waits once for its last job, not job by job.

    One wait lets the closing thread run the jobs the queue's thread has not started
    (``queue_wait``); a wait per job would wait for the one that thread runs, each in turn.
    Every sample and step record of an MLP's sampled steps (its step tensors on the queue)
    calls ``queue_wait`` at most once as it settles, for a ticket at least its last job's.
    """
    from torchinstruments_core import _sample

    waits: list[int] = []
    settles: list[tuple[int, int, list[int]]] = []  # (last ticket, waits before, their tickets)
    queue_wait = _native.queue_wait

    def counted(queue: object, ticket: int) -> None:
        waits.append(ticket)
        queue_wait(queue, ticket)

    settle = _sample.Sample.settle

    def watched(self: _sample.Sample) -> Exception | None:
        tickets = [m.ticket for m in self._distinct() if m.ticket is not None and m.worker]
        before = len(waits)
        result = settle(self)
        if tickets:
            settles.append((max(tickets), before, waits[before:]))
        return result

    monkeypatch.setattr(_native, "queue_wait", counted)
    monkeypatch.setattr(_sample.Sample, "settle", watched)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 512), nn.Linear(512, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _trained(model, optimizer, True, [torch.randn(64, 64) for _ in range(4)])
    assert settles  # the step records' tensors went to the queue
    for last, _, tickets in settles:
        assert len(tickets) <= 1
        assert all(ticket >= last for ticket in tickets)


@pytest.mark.parametrize("numel", [1, 262_144, 1_000_003])
def test_a_copy_on_the_queue_is_copied_in_pieces_byte_for_byte(numel: int) -> None:
    """``NativeWorker.copy``: ``COPY_PIECE_BYTES`` pieces, the last one shorter, all copied.

    The ticket is the last piece's; waiting for it lets the tensors go. A closed worker takes
    no copy (``None``): the caller copies.
    """
    worker = NativeWorker()
    source = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    destination = torch.full_like(source, math.nan)
    first = worker.copy(torch.ones(4), torch.zeros(4))  # the queue's first job: a tiny copy
    assert first == 1
    ticket = worker.copy(source, destination)
    pieces = -(-numel * 4 // _native.COPY_PIECE_BYTES)
    assert ticket == 1 + pieces
    worker.wait(ticket)
    assert torch.equal(destination, source)
    assert worker._pending == collections.deque()  # read back: both tensors let go
    worker.close()
    assert worker.copy(source, destination) is None


def test_a_thread_waiting_for_queued_copies_copies_pieces_itself() -> None:
    """Behind a long job on the queue's thread, a waiter for the copy runs its pieces."""
    big = torch.randn(16_000_000, generator=torch.Generator().manual_seed(3))
    source = torch.randn(2_000_000, generator=torch.Generator().manual_seed(4))
    helped = 0
    for _ in range(3):  # a waiter that started after the long job ran has nothing to show
        queue = _native.new_queue()
        _queued(queue, big, 1, 64)
        destination = torch.empty_like(source)
        ticket = _native.queue_copy(queue, source, destination)
        assert ticket == 1 + -(-source.numel() * 4 // _native.COPY_PIECE_BYTES)
        _native.queue_wait(queue, ticket)
        assert torch.equal(destination, source)
        helped = _native.queue_helped(queue)
        _native.queue_close(queue)
        if helped:
            break
    assert helped >= 1


def test_a_queued_copy_of_a_negative_size_is_refused() -> None:
    """The kernels refuse a copy of fewer than zero bytes, before queueing anything."""
    queue = _native.new_queue()
    kernels = _native.KERNELS
    assert kernels is not None
    values = torch.zeros(4)
    with pytest.raises(ValueError, match="negative size"):
        kernels.queue_copy(queue, values.data_ptr(), values.data_ptr(), -1)
    assert _native.queue_finished(queue) == 0
    _native.queue_close(queue)


def test_a_recorded_step_s_large_copies_go_to_the_queue_with_the_same_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Parameters of ``QUEUED_COPY_BYTES`` or more are copied on the queue before the step.

    The step records' rows (parameters, updates with ``update_to_weight``, the optimizer's
    state) equal those of the copies made in the hooks (``background_reductions=False``),
    bit for bit, with AdamW (gradients reduced during its step) and with SGD and Nesterov
    momentum (gradients reduced before it); the 512 x 512 weight (1 MiB) goes to the queue in
    one-MiB pieces, the small parameters not.
    """
    from torchinstruments_core import _step_tensors

    def run(background: bool, nesterov: bool) -> RecordingSink:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 512))
        optimizer = (
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
            if nesterov
            else torch.optim.AdamW(model.parameters(), lr=1e-3)
        )
        return _trained(model, optimizer, background, [torch.randn(32, 64) for _ in range(3)])

    copied: list[int] = []
    queue_copy = _native.queue_copy

    def counted(queue: object, source: torch.Tensor, destination: torch.Tensor) -> int:
        copied.append(source.numel())
        return queue_copy(queue, source, destination)

    assert 512 * 512 * 4 >= _step_tensors.QUEUED_COPY_BYTES > 64 * 512 * 4
    for nesterov in (False, True):
        copied.clear()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(_native, "queue_copy", counted)
            queued = run(True, nesterov)
        assert copied == [512 * 512] * 3  # one parameter, every recorded step
        hooks = run(False, nesterov)
        steps = [s for s in queued.samples if s.kind == "step"]
        assert len(steps) == 3
        assert [s.rows for s in queued.samples] == [s.rows for s in hooks.samples]
        updates = [r for s in steps for r in s.rows if r.signal == "update"]
        assert updates


def test_a_job_that_fails_to_be_made_leaves_nothing_held() -> None:
    """A copy that raises (out of memory) propagates, and the worker holds nothing for it."""
    worker = NativeWorker(floor=0)

    def failing() -> ProfileJob:
        raise MemoryError("no room for the copy")

    with pytest.raises(MemoryError):
        worker.submit(4000, failing)
    assert worker._held == 0
    assert not worker._pending
    seen: list[int] = []
    assert worker.submit(4000, lambda: _job(torch.randn(1000), seen)) == 1
    worker.close()
    assert seen == [_native.STATUS_OK]


def test_submit_copy_queues_a_flat_copy_taken_at_the_hand_over() -> None:
    """``submit_copy`` reads what ``plain`` held when it was handed over, strided or narrower.

    The first job goes through ``submit`` (it makes the queue), the later ones are copied and
    queued in the one call, into the buffers of jobs read back before; every job gives what
    ``profile`` gives for the tensor as it was, though the sources change once handed over.
    """
    worker = NativeWorker()
    generator = torch.Generator().manual_seed(4)
    sources = [
        torch.randn(64, 10, generator=generator),  # contiguous: copied flat
        torch.randn(10, 64, generator=generator).t(),  # strided
        torch.randn(640, generator=generator).to(torch.bfloat16),  # copied into float32
        torch.randn(640, dtype=torch.float64, generator=generator),
    ]
    made_by_submit: list[int] = []
    submit = NativeWorker.submit

    def counted(self: NativeWorker, nbytes: int, make: Any) -> int | None:
        made_by_submit.append(nbytes)
        return submit(self, nbytes, make)

    seen: list[_native.Profiled] = []
    expected: list[_native.Profiled] = []
    buffers = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(NativeWorker, "submit", counted)
        for _round in range(2):
            for source in sources:
                dtype = torch.float64 if source.dtype == torch.float64 else torch.float32
                held = source.to(dtype).reshape(-1).clone()  # its entries in row-major order
                expected.append(_native.profile(held, None, _call(640, 0, 0).shape))
                job = ProfileJob(None, None, _call(640, 0, 0), seen.append)
                assert worker.submit_copy(source, dtype, job) is not None
                buffers.append(job.buffer)
                source.mul_(-3.0)  # the model's next ops: only the copy keeps the values
            worker.wait()
    assert made_by_submit == [4 * 640]  # only the first, which made the queue
    assert worker._held == 0
    assert any(b is a for a in buffers[:4] for b in buffers[4:])  # spares handed out again
    for got, want in zip(seen, expected, strict=True):
        assert got.status == want.status == _native.STATUS_OK
        assert got.values.tolist() == want.values.tolist()
    worker.close()


def test_submit_copy_after_close_or_without_room_runs_through_submit() -> None:
    """After ``close`` the job runs in the caller; a copy past the budget waits for room first."""
    worker = NativeWorker(floor=0)
    seen: list[_native.Profiled] = []
    first = ProfileJob(None, None, _call(1000, 0, 0), seen.append)
    assert worker.submit_copy(torch.randn(1000), torch.float32, first) == 1
    larger = ProfileJob(None, None, _call(4000, 0, 0), seen.append)
    assert worker.submit_copy(torch.randn(4000), torch.float32, larger) == 2
    assert len(seen) == 1  # the first read back to make room: the budget was its 4,000 bytes
    worker.close()
    late = ProfileJob(None, None, _call(1000, 0, 0), seen.append)
    assert worker.submit_copy(torch.randn(1000), torch.float32, late) is None
    assert [p.status for p in seen] == [_native.STATUS_OK] * 3
    assert worker._held == 0


def test_a_copy_that_fails_in_submit_copy_leaves_nothing_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A copy that raises (out of memory) propagates from either path, and nothing is held.

    A measurer's small sample then has the error as its reason, and the next tensor is queued.
    """
    worker = NativeWorker()
    seen: list[_native.Profiled] = []
    copy = _background.flat_copy

    def failing(plain: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
        raise MemoryError("no room for the copy")

    monkeypatch.setattr(_background, "flat_copy", failing)
    for _path in ("submit", "in one call"):
        job = ProfileJob(None, None, _call(1000, 0, 0), seen.append)
        with pytest.raises(MemoryError):
            worker.submit_copy(torch.randn(1000), torch.float32, job)
        assert worker._held == 0
        assert not worker._pending
        monkeypatch.setattr(_background, "flat_copy", copy)
        after = ProfileJob(None, None, _call(10, 0, 0), seen.append)
        assert worker.submit_copy(torch.randn(10), torch.float32, after) is not None
        worker.wait()
        monkeypatch.setattr(_background, "flat_copy", failing)
    worker.close()
    assert [p.status for p in seen] == [_native.STATUS_OK] * 2  # the two that were copied
    measurer = _queue_measurer()
    measurer.measure(torch.randn(100), with_histogram=True).settle()  # makes the queue
    failed = measurer.measure(torch.randn(100), with_histogram=True)
    assert failed.reason is not None
    assert failed.reason.startswith("reducer_error")
    assert isinstance(failed.errors[0], MemoryError)
    monkeypatch.setattr(_background, "flat_copy", copy)
    measured = measurer.measure(torch.randn(100), with_histogram=True)
    assert measured.settle() is None
    assert measured.reason is None
    measurer.close()


def test_a_job_counts_as_done_only_once_its_values_are_read_back() -> None:
    """Another thread sees a job done only after ``finish`` has filled its values in."""
    worker = NativeWorker()
    filled: list[str] = []
    started = threading.Event()

    def slow(profiled: _native.Profiled) -> None:
        started.set()
        time.sleep(0.3)
        filled.append("filled")

    call = _call(1000, 0, 0)
    ticket = worker.submit(4000, lambda: ProfileJob(torch.randn(1000), None, call, slow))
    assert ticket is not None
    reader = threading.Thread(target=worker.wait)
    reader.start()
    assert started.wait(10)
    assert not worker.done(ticket)  # read back under way on the other thread
    worker.wait(ticket)  # waits for that read-back, not only for the job
    assert filled == ["filled"]
    assert worker.done(ticket)
    reader.join()
    worker.close()


def test_a_child_made_by_fork_copies_without_the_lock_and_keeps_no_spares() -> None:
    """In a child the parent's thread may have held the lock: hooks never take it there."""
    worker = NativeWorker()
    seen: list[int] = []
    worker.submit(4000, lambda: _job(torch.randn(1000), seen, worker.buffer(1000, torch.float32)))
    worker.wait()
    assert worker._spares.bytes == 4000
    worker._pid = -1  # as seen from a child made by fork
    taken, release = threading.Event(), threading.Event()

    def parent_thread() -> None:  # inside the lock at the fork
        with worker._lock:
            taken.set()
            release.wait()

    def child() -> None:
        buffer = worker.buffer(1000, torch.float32)
        assert worker.submit(4000, lambda: _job(buffer.normal_(), seen)) is None  # ran here
        worker.close()

    holder = threading.Thread(target=parent_thread, daemon=True)
    holder.start()
    assert taken.wait(5)
    hook = threading.Thread(target=child, daemon=True)
    hook.start()
    hook.join(10)
    alive = hook.is_alive()
    release.set()
    holder.join(5)
    assert not alive, "the child's hook waited for a lock the parent's thread held"
    assert worker._spares.bytes == 0
    assert seen == [_native.STATUS_OK] * 2


def test_a_job_submitted_while_the_queue_closes_runs_after_those_before_it() -> None:
    """A job that finds the queue closing runs in the caller, and only once the others ran.

    Forty jobs of 4 Mi entries keep the thread busy for a while; this thread closes the queue
    (waiting for them) while another, 0.1 s later, submits one more: that one returns only
    once all forty have run, itself the forty-first.
    """
    queue = _native.new_queue()
    values = torch.randn(4 * 2**20)
    queued = [_queued(queue, values, 11, 64) for _ in range(40)]
    late: list[_native.Queued] = []
    seen: list[int] = []

    def submit_late() -> None:
        time.sleep(0.1)  # this thread is in ``queue_close`` by then: the queue is closing
        late.append(_queued(queue, torch.randn(1000), 11, 64))
        seen.append(_native.queue_finished(queue))

    submitter = threading.Thread(target=submit_late)
    submitter.start()
    _native.queue_close(queue)
    submitter.join()
    assert late[0].ticket == 41
    assert seen == [41]  # the forty before it had run when it returned
    assert all(q.profiled().status == _native.STATUS_OK for q in queued)
    assert late[0].profiled().status == _native.STATUS_OK
