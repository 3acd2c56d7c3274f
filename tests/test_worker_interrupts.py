"""The CPU reduction worker and the delivery of a sample when a Ctrl-C lands in their waits.

A notebook user who interrupts a cell and runs it again keeps training in the same process: a
``KeyboardInterrupt`` raised inside a hook must leave nothing that hangs or loses data later.
Checked: an interrupt after a hand-over reserved its room and before its job was queued gives
the room back (left reserved, a later hand-over waited for it for good); one inside the start
of the worker thread leaves one worker thread, known to the worker; and one while a closing
sample waits for the worker still delivers that sample, at the next drain.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn

from torchinstruments_core import AlwaysSampler, inject_observer
from torchinstruments_core._background import ReductionWorker
from torchinstruments_core.testing import RecordingSink


@pytest.fixture
def one_thread() -> Any:
    """One torch thread: the other core is free, so the reductions go to the worker."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _worker(observer: Any) -> ReductionWorker:
    worker = observer._config.measurer._worker
    assert isinstance(worker, ReductionWorker)
    return worker


def _within(seconds: float, step: Any) -> bool:
    """Run ``step`` on a thread; whether it returned within ``seconds``."""
    runner = threading.Thread(target=step, daemon=True)
    runner.start()
    runner.join(seconds)
    return not runner.is_alive()


@pytest.mark.usefixtures("one_thread")
def test_an_interrupt_before_a_job_is_queued_gives_its_room_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Ctrl-C as a hand-over asks whether the worker runs, its room reserved, its job made.

    The activations are 16 MiB, so the budget is one of them: room left reserved by a job
    never queued made the next hand-over wait for it for good. The room goes back; the next
    sampled steps run and are delivered whole.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 4096), nn.GELU(), nn.Linear(4096, 8))
    sink = RecordingSink()
    observer = inject_observer(
        model, sampler=AlwaysSampler(), sink=sink, background_reductions=True
    )
    x = torch.randn(1024, 256)
    model(x).pow(2).mean().backward()  # the worker's thread runs
    worker = _worker(observer)
    running, calls = ReductionWorker._running, [0]

    def interrupted(self: ReductionWorker) -> bool:
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt  # Python runs the handler as this call starts
        return running(self)

    monkeypatch.setattr(ReductionWorker, "_running", interrupted)
    with pytest.raises(KeyboardInterrupt):
        model(x).pow(2).mean().backward()
    monkeypatch.setattr(ReductionWorker, "_running", running)
    worker.wait()
    assert worker._held == 0
    assert _within(60, lambda: model(x).pow(2).mean().backward()), "a hand-over waited for good"
    observer.remove()
    whole = [s for s in sink.samples if all(r.value is not None for r in s.rows)]
    assert len(whole) >= 2  # the first step's sample and the one after the interrupt


def test_an_interrupt_while_the_worker_thread_starts_leaves_one_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Ctrl-C inside ``Thread.start`` (which waits for the thread to run) on the first job.

    The thread runs, and the worker knows it: the next job goes to it rather than to a second
    thread, the room of the interrupted job is back, and every later job runs.
    """
    worker = ReductionWorker()
    before = set(threading.enumerate())  # other tests' workers may not have ended yet
    start = threading.Thread.start

    def interrupted(self: threading.Thread) -> None:
        start(self)
        if self.name == "torchinstruments-reductions":
            raise KeyboardInterrupt

    monkeypatch.setattr(threading.Thread, "start", interrupted)
    ran: list[int] = []

    def make(number: int) -> Any:
        return lambda: (lambda: ran.append(number), None)

    with pytest.raises(KeyboardInterrupt):
        worker.submit(1000, make(0))
    monkeypatch.setattr(threading.Thread, "start", start)
    assert worker._held == 0
    tickets = [worker.submit(1000, make(n)) for n in (1, 2)]
    worker.wait()
    assert tickets == [1, 2]
    assert ran == [1, 2]
    started = set(threading.enumerate()) - before
    threads = [t for t in started if t.name == "torchinstruments-reductions"]
    assert threads == [worker._thread]
    worker.close()


@pytest.mark.usefixtures("one_thread")
def test_an_interrupt_while_a_sample_waits_for_the_worker_still_delivers_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Ctrl-C while the end of a sampled backward waits for the worker's jobs.

    The sample was closed already (no hook adds to it), so it was never delivered nor counted.
    It is delivered at the next drain, in its turn, with its values.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 8))
    sink = RecordingSink()
    observer = inject_observer(
        model, sampler=AlwaysSampler(), sink=sink, background_reductions=True
    )
    wait, armed = ReductionWorker.wait, [False]

    def interrupted(self: ReductionWorker, ticket: int | None = None) -> None:
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt  # as the training thread waits for the worker
        wait(self, ticket)

    monkeypatch.setattr(ReductionWorker, "wait", interrupted)
    x = torch.randn(256, 64)
    caught = 0
    for step in range(4):
        armed[0] = step == 1
        try:
            model(x).pow(2).mean().backward()
        except KeyboardInterrupt:
            caught += 1
    monkeypatch.setattr(ReductionWorker, "wait", wait)
    observer.remove()
    assert caught == 1
    assert [s.sample_id for s in sink.samples] == [0, 1, 2, 3]
    assert all(r.value is not None for s in sink.samples for r in s.rows if r.metric == "mean")


@pytest.mark.usefixtures("one_thread")
def test_a_deferred_sample_that_cannot_be_settled_is_dropped_not_left_first_in_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sample whose settle was interrupted, then fails when the next drain settles it again.

    That drain (at the next forward's start) raises the failure once, that forward not run,
    and drops the sample; left first in line it would have raised at every later drain and
    held back every later sample, which are delivered.
    """
    from torchinstruments_core import _sample

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 8))
    sink = RecordingSink()
    observer = inject_observer(
        model, sampler=AlwaysSampler(), sink=sink, background_reductions=True
    )
    settle, calls = _sample.Sample.settle, {"count": 0}

    def failing(self: _sample.Sample) -> Exception | None:
        if self.sample_id == 1:
            calls["count"] += 1
            if calls["count"] == 1:
                raise KeyboardInterrupt  # as the end of the backward waits for the worker
            raise RuntimeError("cannot be settled")
        return settle(self)

    monkeypatch.setattr(_sample.Sample, "settle", failing)
    x = torch.randn(256, 64)
    raised = []
    for step in range(5):
        try:
            model(x).pow(2).mean().backward()
        except (KeyboardInterrupt, RuntimeError) as error:
            raised.append((step, type(error).__name__))
    observer.remove()
    assert raised == [(1, "KeyboardInterrupt"), (2, "RuntimeError")]
    assert calls["count"] == 2
    assert [s.sample_id for s in sink.samples] == [0, 2, 3]  # steps 0, 3 and 4
