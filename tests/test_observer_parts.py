"""The observer's parts, each on its own: plan, rank gate, scale reader, failures, delivery."""

from __future__ import annotations

import ast
import math
import pathlib
import threading
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from torchinstruments_core import (
    ConfigurationError,
    EveryNForwardsSampler,
    ObservationError,
    ObservationWarning,
)
from torchinstruments_core._config import ErrorPolicy, RankPolicy
from torchinstruments_core._delivery import DeliveryQueue
from torchinstruments_core._failures import FailureReport
from torchinstruments_core._plan import StepPlan
from torchinstruments_core._rank_gate import RankGate
from torchinstruments_core._scale import GradientScaleReader
from torchinstruments_core._sink_session import SinkSession

CORE = pathlib.Path(__file__).parent.parent / "src" / "torchinstruments_core"


def test_plan_follows_the_sampler_until_an_adapter_announces_a_step() -> None:
    """Before ``begin`` the sampler decides; after it the step does; after ``end`` nothing is."""
    plan = StepPlan(EveryNForwardsSampler(2))
    assert [plan.samples(i) for i in range(4)] == [True, False, True, False]
    assert plan.policy == repr(EveryNForwardsSampler(2))
    plan.begin(7, sample=True)
    assert (plan.step, plan.sampling, plan.samples(1)) == (7, True, True)
    assert plan.end() == 7
    assert (plan.step, plan.sampling, plan.samples(0)) == (None, False, False)
    assert plan.end() is None
    assert plan.policy == "step-driven by the trainer adapter"


def test_rank_gate_reads_the_rank_only_when_first_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gate is open until asked; then rank 1 of 2 is shut out under rank0, kept under all."""
    monkeypatch.setenv("RANK", "0")
    rank0, every = RankGate(RankPolicy.RANK0), RankGate(RankPolicy.ALL)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert rank0.enabled
    assert not rank0.admits()
    assert every.admits()
    assert (every.resolve().rank, every.resolve().world_size) == (1, 2)
    every.close_for_good()
    assert not every.admits()
    assert every.resolve().rank == 1


def test_rank_gate_closed_before_reading_never_reads_the_rank() -> None:
    """A forked child's gate, closed unread, reports rank -1 of 0 instead of reading the rank."""
    gate = RankGate(RankPolicy.ALL)
    gate.close_for_good()
    assert (gate.resolve().rank, gate.resolve().world_size, gate.admits()) == (-1, 0, False)


def test_failures_warn_once_per_cause_and_raise_under_raise() -> None:
    """Two failures of one cause warn once, another cause warns again; "raise" raises."""
    report = FailureReport(ErrorPolicy.WARN)
    failures: list[tuple[str, Exception, str]] = [
        ("a", ValueError("x"), "cause-1"),
        ("b", ValueError("y"), "cause-1"),
    ]
    failures.append(("c", KeyError("z"), "cause-2"))

    def fail_all() -> None:
        for what, error, key in failures:
            report.failed(what, error, key, "lost")

    with pytest.warns(ObservationWarning) as caught:
        fail_all()
    assert [str(w.message).split(":")[1].strip() for w in caught] == ["a", "c"]
    with pytest.raises(ObservationError, match="torchinstruments: d: ValueError: w") as raised:
        FailureReport(ErrorPolicy.RAISE).failed("d", ValueError("w"), "cause-1", "lost")
    assert isinstance(raised.value.__cause__, ValueError)


def test_scale_reader_rejects_bad_scales_and_survives_a_failing_function() -> None:
    """A bad number raises at once; a function that fails reads as no scale, with a warning."""
    reader = GradientScaleReader(FailureReport(ErrorPolicy.WARN))
    assert reader.read() is None
    with pytest.raises(ConfigurationError):
        reader.set(float("inf"))
    with pytest.raises(ConfigurationError):
        reader.set(torch.ones(2))
    reader.set(lambda: 4.0)
    assert reader.read() == 4.0
    reader.set(lambda: -1.0)
    with pytest.warns(ObservationWarning, match="gradient scale could not be read"):
        assert reader.read() is None


@dataclass
class _Transfer:
    landed: bool = True

    def ready(self) -> bool:
        return self.landed


@dataclass
class _Sample:
    sample_id: int
    transfer: _Transfer = field(default_factory=_Transfer)
    duration_s: float = 0.0

    def settle(self) -> Exception | None:
        return None  # nothing on a reduction worker

    def start_transfer(self) -> _Transfer:
        return self.transfer

    def build(self, transfer: _Transfer, *, run_id: str, rank: int) -> Any:
        return self


@dataclass
class _ListSink:
    written: list[int] = field(default_factory=list)
    on_write: Any = None

    def open(self, run: Any) -> None:
        pass

    def write(self, record: Any) -> None:
        if self.on_write is not None:
            self.on_write()  # before taking the record, as a sink that flushes first would
        self.written.append(record.sample_id)

    def close(self) -> None:
        pass


def _queue(sink: _ListSink) -> DeliveryQueue:
    session = SinkSession(sink, FailureReport(ErrorPolicy.RAISE), lambda: None)  # type: ignore[arg-type,return-value]
    return DeliveryQueue(threading.RLock(), session, "run", RankGate(RankPolicy.ALL))


def test_delivery_keeps_closing_order_behind_a_transfer_in_flight() -> None:
    """A sample whose values have not landed holds back the later ones, until a waiting drain."""
    sink = _ListSink()
    queue = _queue(sink)
    first = _Sample(0, _Transfer(landed=False))
    queue.push(first)  # type: ignore[arg-type]
    queue.push(_Sample(1))  # type: ignore[arg-type]
    queue.drain(wait=False)
    assert sink.written == []
    first.transfer.landed = True
    queue.push(_Sample(2, _Transfer(landed=False)))  # type: ignore[arg-type]
    queue.drain(wait=False)
    assert sink.written == [0, 1]
    queue.drain(wait=True)
    assert sink.written == [0, 1, 2]


def test_delivery_reentered_from_a_sink_write_keeps_the_order() -> None:
    """A sink write that drains again delivers nothing itself: the outer drain keeps the order."""
    sink = _ListSink()
    queue = _queue(sink)
    sink.on_write = lambda: queue.drain(wait=True)
    for sample_id in range(3):
        queue.push(_Sample(sample_id))  # type: ignore[arg-type]
    queue.drain(wait=True)
    assert sink.written == [0, 1, 2]


def test_a_waiting_drain_returns_only_after_another_threads_write_of_the_last_sample() -> None:
    """``drain(wait=True)`` (``flush``) waits for a sample another thread is writing.

    That thread took the last sample off the queue before writing it: the queue looks empty,
    and a drain that returned then would let ``remove`` close the sink during the write.
    """
    sink = _ListSink()
    queue = _queue(sink)
    writing, release = threading.Event(), threading.Event()

    def slow_write() -> None:
        writing.set()
        assert release.wait(timeout=30)

    sink.on_write = slow_write
    queue.push(_Sample(0))  # type: ignore[arg-type]
    other = threading.Thread(target=queue.drain, kwargs={"wait": False})
    returned = threading.Event()

    def flush() -> None:
        queue.drain(wait=True)
        returned.set()

    waiting = threading.Thread(target=flush)
    other.start()
    assert writing.wait(timeout=30)  # the other thread is inside the sink's write
    waiting.start()
    try:
        assert not returned.wait(timeout=0.5)  # held while the write goes on
    finally:  # no thread outlives the test, pass or fail
        release.set()
        other.join(timeout=30)
        waiting.join(timeout=30)
    assert returned.is_set()
    assert sink.written == [0]
    queue.drain(wait=False)  # nothing queued: returns at once
    assert sink.written == [0]


def _imported_modules(path: pathlib.Path) -> set[str]:
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            modules.add(node.module)
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
    return modules


@pytest.mark.parametrize(
    "part",
    [
        "_registry",
        "_lifecycle",
        "_probe",
        "_delivery",
        "_sink_session",
        "_failures",
        "_plan",
        "_scale",
        "_rank_gate",
        "_observer_config",
    ],
)
def test_no_part_imports_the_observer(part: str) -> None:
    """No part of the observer, the registry included, imports it back, even for type checks."""
    assert "torchinstruments_core._observer" not in _imported_modules(CORE / f"{part}.py")


def test_cpu_values_reach_the_host_as_their_float64_values_in_order() -> None:
    """On the CPU each tensor is read as it is: the floats a float64 copy gives, in order."""
    from torchinstruments_core._transfer import HostTransfer

    tensors = [
        torch.tensor([1 / 3, -2.5e-8, float("inf")], dtype=torch.float32),
        torch.tensor(12_345_678_901, dtype=torch.int64).reshape(1),
        torch.tensor([[0.1, float("nan")]], dtype=torch.float64),
        torch.tensor([3.0], dtype=torch.bfloat16),
        torch.tensor([2**53 + 1, 5], dtype=torch.int64),  # a custom reducer's count
        torch.tensor([True, False]),
    ]
    transfer = HostTransfer(tensors)
    assert transfer.ready()
    values = transfer.wait()
    expected = [t.reshape(-1).to(torch.float64).tolist() for t in tensors]
    assert len(values) == len(expected)
    for got, want in zip(values, expected, strict=True):
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert type(a) is float  # as from a float64 copy: never an int or a bool
            assert a == b or (math.isnan(a) and math.isnan(b))
