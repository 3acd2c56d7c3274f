"""The kernels' queue when something goes wrong: no thread, a close beside a waiter, interrupts.

A job whose submitter runs it (no thread could start) is counted in its turn, though another
submitter starts the thread meanwhile; ``queue_close`` returns once a job a waiter took has run;
a copy interrupted between its pieces, a profile interrupted as it is queued, and a job
interrupted before the worker holds it each leave only once what was queued has run (its
buffers are held by nothing else); and a failure among a recorded step's queued copies has the
pre-hook wait for every queued job before the optimizer may change the parameters they read.
Each case keeps the queue's thread busy with a long job first, so that without the waits the
jobs would still be queued when the test looks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from torchinstruments_core import (
    AlwaysSampler,
    ObservationWarning,
    _optimizer_probe,
    inject_observer,
)
from torchinstruments_core._native_worker import CopyJob, NativeWorker, ProfileJob
from torchinstruments_core._step_tensors import queue_copies
from torchinstruments_core.reducers import _native
from torchinstruments_core.reducers._fused import _call
from torchinstruments_core.testing import RecordingSink

pytestmark = pytest.mark.skipif(not _native.QUEUE, reason="the kernels have no queue here")

_BUSY_BYTES = 1 << 27
"""A copy of 128 MiB: tens of milliseconds of the queue's thread."""


def _kernels() -> Any:
    assert _native.KERNELS is not None
    return _native.KERNELS


def _busy(queue: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Queue one long byte copy; its two tensors, to keep until the queue has run it."""
    source = torch.ones(_BUSY_BYTES, dtype=torch.uint8)
    destination = torch.zeros(_BUSY_BYTES, dtype=torch.uint8)
    _kernels().queue_copy(queue, source.data_ptr(), destination.data_ptr(), _BUSY_BYTES)
    return source, destination


_FAILING_START = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* pthread_create fails with EAGAIN (no resources) while TI_FAIL_THREAD_START is "1" */
int pthread_create(pthread_t* thread, const pthread_attr_t* attributes, void* (*start)(void*),
                   void* argument) {
    static int (*real)(pthread_t*, const pthread_attr_t*, void* (*)(void*), void*);
    if (real == NULL) *(void**)&real = dlsym(RTLD_NEXT, "pthread_create");
    const char* fail = getenv("TI_FAIL_THREAD_START");
    if (fail != NULL && strcmp(fail, "1") == 0) return EAGAIN;
    return real(thread, attributes, start, argument);
}
"""

_TWO_SUBMITTERS = r"""
import json, os, threading, time, torch
from torchinstruments_core.reducers import _native
kernels = _native.KERNELS
queue = _native.new_queue()
n = 1 << 27
first_source = torch.ones(n, dtype=torch.uint8)
first_destination = torch.zeros(n, dtype=torch.uint8)
second_source = torch.ones(16, dtype=torch.uint8)
second_destination = torch.zeros(16, dtype=torch.uint8)
seen = {}
entered = threading.Event()

def first():
    os.environ["TI_FAIL_THREAD_START"] = "1"  # this submit finds no thread, and starts none
    entered.set()
    seen["first_ticket"] = kernels.queue_copy(
        queue, first_source.data_ptr(), first_destination.data_ptr(), n)
    seen["ran_in_submitter"] = int(first_destination[-1])  # copied before the call returned

submitter = threading.Thread(target=first)
submitter.start()
entered.wait()
time.sleep(0.005)  # the first job is being copied by its submitter
os.environ["TI_FAIL_THREAD_START"] = "0"
second = kernels.queue_copy(  # this one starts the thread, which runs it at once
    queue, second_source.data_ptr(), second_destination.data_ptr(), 16)
kernels.queue_wait(queue, second, 0)
seen["second_ticket"] = second
seen["first_done_when_second_counted"] = int(first_destination[-1])
submitter.join()
seen["finished_after_both"] = kernels.queue_finished(queue)
third = kernels.queue_copy(queue, second_source.data_ptr(), second_destination.data_ptr(), 16)
kernels.queue_wait(queue, third)
seen["third_ticket"], seen["finished_after_third"] = third, kernels.queue_finished(queue)
kernels.queue_close(queue)
print(json.dumps(seen))
"""


def _failing_start_library(folder: Path) -> Path:
    """A shared library whose ``pthread_create`` fails on request; skip without a compiler."""
    if not sys.platform.startswith("linux"):
        pytest.skip("LD_PRELOAD of a pthread_create that fails: Linux only")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the failing pthread_create")
    source, library = folder / "failing_start.c", folder / "failing_start.so"
    source.write_text(_FAILING_START)
    built = subprocess.run(
        [compiler, "-shared", "-fPIC", "-o", str(library), str(source), "-ldl"],
        capture_output=True,
        text=True,
    )
    if built.returncode != 0:
        pytest.skip(f"the failing pthread_create did not build: {built.stderr[-500:]}")
    return library


def test_a_job_its_submitter_runs_is_counted_in_its_turn(tmp_path: Path) -> None:
    """No thread starts for the first job, which its submitter runs (128 MiB, some ms).

    Meanwhile a second submitter starts the thread, which runs the second job at once; it is
    counted only once the first has run, whichever finished first: ``queue_wait`` for it
    returns with the first job done, and the count is 2 after both, 3 after a third job (the
    kernels counted the first job a second time, one ahead of the jobs from then on).
    """
    library = _failing_start_library(tmp_path)
    environment = {**os.environ, "LD_PRELOAD": str(library), "TI_FAIL_THREAD_START": "0"}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_TWO_SUBMITTERS)],
        capture_output=True,
        text=True,
        env=environment,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["first_ticket"] == 1
    assert seen["ran_in_submitter"] == 1  # no thread took it: the path under test ran
    assert seen["second_ticket"] == 2
    assert seen["first_done_when_second_counted"] == 1
    assert seen["finished_after_both"] == 2
    assert (seen["third_ticket"], seen["finished_after_third"]) == (3, 3)


def test_closing_the_queue_waits_for_the_job_a_waiter_is_running() -> None:
    """The thread copies 64 MiB while a waiter takes the next job, 128 MiB, and copies it.

    ``queue_close`` stops the thread once it has nothing left to take, which is before the
    waiter is done: it returns only once the waiter's job has run too (the last byte copied,
    both jobs counted), so that nothing writes a job's buffers after the close. The waiter
    starts once the thread's copy has begun (its first byte written), so that the thread has
    taken the first job and the waiter takes the second.
    """
    kernels = _kernels()
    helped, seen = 0, (0, 0)
    first_bytes = 1 << 26
    a, b = torch.ones(first_bytes, dtype=torch.uint8), torch.zeros(first_bytes, dtype=torch.uint8)
    c = torch.ones(_BUSY_BYTES, dtype=torch.uint8)
    d = torch.zeros(_BUSY_BYTES, dtype=torch.uint8)
    for _ in range(3):  # a waiter stalled until the thread's copy ended has nothing to show
        b.zero_()
        d.zero_()
        queue = _native.new_queue()
        kernels.queue_copy(queue, a.data_ptr(), b.data_ptr(), first_bytes)
        last = kernels.queue_copy(queue, c.data_ptr(), d.data_ptr(), _BUSY_BYTES)
        deadline = time.monotonic() + 10
        while not b[0]:  # the thread is copying the first job
            assert time.monotonic() < deadline
        waiter = threading.Thread(target=_native.queue_wait, args=(queue, last))
        waiter.start()
        while not _native.queue_helped(queue) and waiter.is_alive():
            assert time.monotonic() < deadline
            time.sleep(0.0001)
        helped = _native.queue_helped(queue)
        _native.queue_close(queue)
        seen = (_native.queue_finished(queue), int(d[-1]))
        waiter.join()
        if helped == 1:
            break
    assert helped == 1, "the waiter never took the second job beside the thread"
    assert seen == (2, 1)


class _Interrupting:
    """The kernels, except that the ``after``-th ``queue_copy`` raises ``KeyboardInterrupt``."""

    def __init__(self, kernels: Any, after: int) -> None:
        self._kernels, self._after, self.calls = kernels, after, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kernels, name)

    def queue_copy(self, *args: Any) -> int:
        self.calls += 1
        if self.calls == self._after:
            raise KeyboardInterrupt
        return int(self._kernels.queue_copy(*args))


def test_a_copy_interrupted_between_its_pieces_leaves_once_the_queued_pieces_ran(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Ctrl-C between the pieces of ``queue_copy``: the pieces queued run before it leaves.

    Nobody holds the two tensors for them once the exception is out (``NativeWorker`` tracks a
    copy only once ``queue_copy`` returns). Behind a long job, two of four pieces are queued,
    then the interrupt: when it reaches the test every job has run, those two pieces copied
    and the rest of the destination untouched.
    """
    kernels = _kernels()
    queue = _native.new_queue()
    held = _busy(queue)
    piece = _native.COPY_PIECE_BYTES // 4  # float32 entries a piece
    source = torch.randn(4 * piece, generator=torch.Generator().manual_seed(5))
    destination = torch.zeros_like(source)
    interrupting = _Interrupting(kernels, after=3)
    monkeypatch.setattr(_native, "KERNELS", interrupting)
    with pytest.raises(KeyboardInterrupt):
        _native.queue_copy(queue, source, destination)
    monkeypatch.setattr(_native, "KERNELS", kernels)
    assert interrupting.calls == 3
    assert _native.queue_finished(queue) == 3  # the long job and both pieces
    assert torch.equal(destination[: 2 * piece], source[: 2 * piece])
    assert not destination[2 * piece :].any()
    _native.queue_close(queue)
    del held


def test_a_worker_s_copy_interrupted_before_it_holds_the_tensors_leaves_once_it_ran(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An interrupt after the copy is queued, before ``NativeWorker`` tracks it: it runs first.

    The worker holds a copy's two tensors through its ``CopyJob`` once tracked; before that,
    an exception leaving ``copy`` would leave the queued piece reading and writing tensors
    nobody holds. Behind a long job, the interrupt reaches the test with the copy made.
    """
    worker = NativeWorker()
    assert worker.copy(torch.ones(4), torch.zeros(4)) == 1  # makes the queue
    queue = worker._queue
    held = _busy(queue)
    source = torch.randn(_native.COPY_PIECE_BYTES // 4, generator=torch.Generator().manual_seed(6))
    destination = torch.zeros_like(source)
    track = NativeWorker._track

    def interrupted(self: NativeWorker, ticket: int | None, nbytes: int, job: Any) -> int | None:
        if isinstance(job, CopyJob):
            raise KeyboardInterrupt
        return track(self, ticket, nbytes, job)

    monkeypatch.setattr(NativeWorker, "_track", interrupted)
    with pytest.raises(KeyboardInterrupt):
        worker.copy(source, destination)
    monkeypatch.setattr(NativeWorker, "_track", track)
    assert _native.queue_finished(queue) == 3  # the first copy, the long job, this piece
    assert torch.equal(destination, source)
    worker.close()
    del held


def _drain_in_child(queue: object, results: Any) -> None:
    _native.drain(queue)  # the parent's queue: the kernels refuse it here, nothing to wait for
    results.put("returned")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_draining_a_queue_of_the_parent_in_a_child_made_by_fork_returns() -> None:
    """``drain`` (an exception's wait for every job) of another process's queue waits for none.

    A child made by ``fork`` that fails to queue (the kernels refuse the parent's queue there)
    must not fail again waiting for it.
    """
    import multiprocessing

    queue = _native.new_queue()
    held = _busy(queue)
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(target=_drain_in_child, args=(queue, results))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    assert results.get(timeout=5) == "returned"
    _native.queue_close(queue)
    del held


class _InterruptedSubmit:
    """The kernels, except that ``queue_submit`` raises ``KeyboardInterrupt`` once it queued."""

    def __init__(self, kernels: Any) -> None:
        self._kernels, self.tickets = kernels, list[int]()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kernels, name)

    def queue_submit(self, *args: Any) -> int:
        self.tickets.append(self._kernels.queue_submit(*args))
        raise KeyboardInterrupt


def test_a_profile_interrupted_once_queued_leaves_once_the_job_ran(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An interrupt as ``queue_submit`` returns: ``submit_profile`` waits for the job first.

    The ``Queued`` it would have returned is what holds the buffers the job writes, and the
    interrupt comes before the ticket is known; behind a long job, it reaches the test with
    both jobs run.
    """
    kernels = _kernels()
    queue = _native.new_queue()
    held = _busy(queue)
    values = torch.randn(100_000, generator=torch.Generator().manual_seed(7))
    interrupted = _InterruptedSubmit(kernels)
    monkeypatch.setattr(_native, "KERNELS", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _native.submit_profile(queue, values, None, _call(values.numel(), 0, 16).shape)
    monkeypatch.setattr(_native, "KERNELS", kernels)
    assert interrupted.tickets == [2]
    assert _native.queue_finished(queue) == 2
    _native.queue_close(queue)
    del held


@pytest.mark.parametrize("path", ["submit", "submit_ready", "submit_copy"])
def test_a_worker_s_job_interrupted_before_it_is_tracked_leaves_once_it_ran(
    monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """An interrupt between queueing a job and tracking it: the worker waits for the job.

    Only the worker holds a queued job (and with it the buffers the job reads and writes) once
    it tracks it. Each way a job is queued, behind a long job: when the interrupt reaches the
    test the job has run, and it holds none of the budget.
    """
    worker = NativeWorker()
    assert worker.copy(torch.ones(4), torch.zeros(4)) == 1  # makes the queue
    worker.wait(1)
    queue = worker._queue
    held = _busy(queue)
    values = torch.randn(100_000, generator=torch.Generator().manual_seed(8))
    seen: list[int] = []
    job = ProfileJob(None, None, _call(values.numel(), 0, 0), lambda p: seen.append(p.status))
    track = NativeWorker._track

    def interrupted(self: NativeWorker, ticket: int | None, nbytes: int, job: Any) -> int | None:
        if isinstance(job, ProfileJob):
            raise KeyboardInterrupt
        return track(self, ticket, nbytes, job)

    monkeypatch.setattr(NativeWorker, "_track", interrupted)
    if path != "submit_copy":
        job._values = values  # the job reads ``values`` where it is; submit_copy copies them
    submits = {
        "submit": lambda: worker.submit(values.numel() * 4, lambda: job),
        "submit_ready": lambda: worker.submit_ready(job),
        "submit_copy": lambda: worker.submit_copy(values, torch.float32, job),
    }
    with pytest.raises(KeyboardInterrupt):
        submits[path]()
    monkeypatch.setattr(NativeWorker, "_track", track)
    assert _native.queue_finished(queue) == 3  # the first copy, the long job, this one
    assert worker._held == 0
    assert not worker._pending
    worker.close()
    del held


def test_a_failure_among_a_step_s_queued_copies_waits_for_every_queued_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pre-hook's copies fail after some are queued: the hook returns once all have run.

    The failure is reported (``ObservationWarning``) and training goes on, so the optimizer
    then changes the parameters those queued copies read. AdamW has its gradients reduced
    during its step, so the pre-hook waits for nothing else; behind a long job, the 1 MiB
    weight's copy is queued, then the failure: when the hook returns, every job has run.
    """
    real = queue_copies
    seen: list[tuple[int, int]] = []  # (the last copy's ticket, jobs run when the hook returned)
    state: dict[str, Any] = {}

    def failing(*args: Any) -> tuple[dict[int, torch.Tensor], int | None]:
        worker = args[-1].__self__._native  # ``copy_on_queue`` is the measurer's ``copy``
        if worker is None or worker._queue is None:  # the queue is made by a sample's first job
            return real(*args)
        state["queue"], state["held"] = worker._queue, _busy(worker._queue)
        _, ticket = real(*args)
        assert ticket is not None
        state["ticket"] = ticket
        raise RuntimeError("no memory for the next copy")

    before = _optimizer_probe.OptimizerProbe._before

    def watched(self: Any, *args: Any) -> None:
        before(self, *args)
        if "ticket" in state:
            queue, ticket = state["queue"], state.pop("ticket")
            seen.append((ticket, _native.queue_finished(queue)))
            _native.queue_wait(queue, ticket)  # the long job has run: its tensors may go
            state.pop("held")

    monkeypatch.setattr(_optimizer_probe, "queue_copies", failing)
    monkeypatch.setattr(_optimizer_probe.OptimizerProbe, "_before", watched)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a free core: the CPU reductions, and the copies, go to the queue
    try:
        with pytest.warns(ObservationWarning, match="measuring before an optimizer step"):
            _sampled_steps(3)
    finally:
        torch.set_num_threads(threads)
    assert len(seen) >= 2  # the first step's samples may have made the queue only then
    for ticket, finished in seen:
        assert finished >= ticket


def _sampled_steps(steps: int) -> None:
    """An MLP with a 512 x 512 weight (1 MiB: copied on the queue), AdamW, every step sampled."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 512))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sink = RecordingSink()
    with inject_observer(
        model, sampler=AlwaysSampler(), sink=sink, optimizer=optimizer
    ) as observer:
        for step in range(steps):
            observer.begin_step(step, sample=True)
            model(torch.randn(32, 64)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            observer.end_step()
